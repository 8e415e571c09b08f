"""The control protocol: the magic files under ``.ramet/`` and the commands they take.

This module is the whole contract between the daemon and its clients (the Python wrapper,
the CLI, a shell).  It imports only the standard library, so a client can depend on it
without pulling in FUSE, LMDB or trio.

Layout (paths relative to the mountpoint)::

    .ramet/ctl                       root control file (mode 0600: the harness's)
    .ramet/status                    JSON: snapshots, executions, pools, last root reply
    .ramet/error                     text: message of the last failed root command (0400)
    snapshots/<snapshot-id>/         read-only tree (snapshots/ is 0711)
    executions/<execution-id>/       writable copy-on-write view (executions/ is 0711)
    executions/<id>/.ramet/ctl       this execution's control file
    executions/<id>/.ramet/promote   write anything to promote; read: last promoted id
    executions/<id>/.ramet/status    JSON: execution, id, base, head, state, created_ns,
                                     upper_bytes, last reply
    executions/<id>/.ramet/diff      ``A|M|D <path>`` lines, like ``git status --porcelain``
                                     (names quoted as git quotes them: :func:`quote_path`)
    executions/<id>/.ramet/preview   JSON: what a promote would keep, by class (docs/policy.md)
    executions/<id>/.ramet/error     text: message of the last failed command here
    executions/<id>/.ramet/fsmonitor git's fsmonitor hook (protocol 2): run it, or write
                                     ``TOKEN\nPREFIX`` and read ``TOKEN\0PATH\0...`` back

A command is one line written to a ``ctl`` file, split as ``shlex.split`` splits it
(:func:`split_command`), so arguments with spaces are quoted; it is at most
:data:`MAX_COMMAND_BYTES` bytes (E2BIG, checked before anything else) and
:data:`MAX_COMMAND_PARTS` parts (EINVAL).  The ``write()`` returns once the command is done:
the written length on success, else -1 with a precise errno (:data:`EINVAL` malformed,
:data:`ENOENT` unknown id or path, :data:`EBUSY` busy, :data:`ENOSPC` no room, :data:`EIO`
store failure, :data:`EACCES` not allowed: see "Who may do what").  After the write, reading the same open file descriptor from offset 0 gives
the reply as one JSON object followed by a newline: ``{"ok": true, ...}`` or
``{"ok": false, "errno": 22, "error": "..."}``; ``echo CMD > ctl; cat ctl`` in a shell reads
the reply of the last command written to that ``ctl`` file.

Each line parses to a typed Command (:func:`parse`; :func:`format` writes one back, and
``parse(format(c)) == c``): a frozen dataclass per command (:data:`COMMANDS`, e.g.
``Acquire(pool, holder, ttl_ns, pid, host)``), whose counts, durations, names, sizes and
modes are checked there once, however it was made (a line written to a ``ctl``, or the
client building it: fallback mode has no line at all), so both modes refuse a bad command
with the same errno, class and message.  A value that is not one is EINVAL
(:class:`rametfs.errors.ProtocolError`, an InvalidArgument) naming the option and the text
given (``--ttl must be seconds >= 0, not 'soon'``).  Every error the daemon answers is a
rametfs.errors.RametError, which the client raises again from the reply's errno and message.

Root commands and their replies::

    snapshot <abs-path> [--label L] [--message M] [--on-change fail|skip]
                                                   -> {"ok", "snapshot", "stats"}
    create <snapshot-id> [--name N] [--owner UID] [--group GID] [--share MODE]
           [--control full|read|none] [--max-bytes B] [--max-inodes N] [--policy P]
                                                   -> {"ok", "execution", "path"}
    release <execution-id>                         -> {"ok", "execution"}
    runtime <execution-id> bubblewrap|docker --uid U --gid G [--image I]
                                                   -> {"ok", "execution", "runtime"}
    snapshot-git <abs-repo> [--rev REV] [--gitdir yes|no] [--label L] [--message M]
                                                   -> {"ok", "snapshot", "stats"}

``create --policy`` stores a persistence policy with the execution (see ``--policy``
below), which its promotes and previews apply; it survives reset and restart.  ``runtime``
records which sandbox runs the execution's commands (the sandbox adapters send it): a
promote keeps it in the snapshot record with the recipes, and a restore runs them there by
default.  Labels are at most :data:`MAX_LABEL_BYTES` bytes and messages
:data:`MAX_MESSAGE_BYTES` (EINVAL beyond, for every command that takes them).

``snapshot`` fails with EAGAIN, naming the path, when an entry of the source changes while
it is imported (another file, type or content); ``--on-change skip`` leaves such entries out
instead and counts them in the stats as ``skipped``.

Snapshot lifecycle commands (rametfs.core.lifecycle, docs/lifecycle.md)::

    name <name> <snapshot>                         -> {"ok", "name", "snapshot", "previous"}
    unname <name>                                  -> {"ok", "name", "snapshot"}
    resolve <snapshot>                             -> {"ok", "snapshot"}
    rm <snapshot> [--force yes|no]                 -> {"ok", "removed", "names"}
    gc [--dry-run yes|no] [--compact yes|no]       -> {"ok", "gc"}
    forget [--keep-last N] [--keep-within DURATION] [--keep-name PATTERN] [--dry-run yes|no]
                                                   -> {"ok", "dry_run", "kept", "removed",
                                                       "names"}

``snapshot-git`` imports the tree of commit ``REV`` (default ``HEAD``) of a git repository
from its objects, without a checkout; ``--gitdir yes`` takes the repository's ``.git``
directory along (local commits, branches, stash, index).  Its errors: ENOENT no repository
or no such commit, EINVAL not a repository, EOPNOTSUPP git support not installed.

``create`` makes an execution owned by ``--owner`` (default: the daemon's uid) and
``--group`` (default: the daemon's gid), shared by ``--share`` (default 0700) and with
``--control`` (default ``full``) over its own control files; see "Who may do what".
``--max-bytes`` and ``--max-inodes`` bound its upper layer: the disk bytes its written data
takes and its upper inodes (new ones and copies-up); past them a write is short, then EDQUOT,
and a create or copy-up is EDQUOT, like ext4 project quotas (default: no limit; fallback
mode: EOPNOTSUPP).  A value out of range is EINVAL.  The settings are kept in the
execution's record, through resets, pool returns and restarts.

Pool and lease commands (rametfs.core.pools; ``--size``, ``--holder`` and ``--ttl`` are required;
times in seconds, decimals allowed; lease times in the replies are wall-clock ns)::

    pool <snapshot-id> --size N [--name P] [--owner UID] [--group GID] [--share MODE]
         [--max-bytes B] [--max-inodes N]
         [--control full|read|none] [--policy POL] [--keep-last K]
                                              -> {"ok", "pool", "snapshot", "size", "created",
                                                  "executions"}
    acquire <pool> --holder H --ttl S [--pid PID] [--host HOST]
                                              -> {"ok", "execution", "path", "pool",
                                                  "snapshot", "lease"}
    renew <execution-id> --holder H --ttl S   -> {"ok", "execution", "lease"}
    return <execution-id> --holder H [--verify root|deep]
                                              -> {"ok", "execution", "pool", "state",
                                                  "reset_ms", "verification"}
    drop <pool>                               -> {"ok", "pool", "executions"}

``pool`` creates a pool of N warm executions of a snapshot, or reattaches to the pool named
P (growing it to N; EEXIST when it has another base, when an ``--owner``, ``--group``,
``--share`` or ``--control`` given differs from the pool's, or when ``--policy`` names
another policy, or ``--keep-last`` another count).  ``--keep-last K``: after each promote
of a member, the pool's promotes but the K newest and the named ones are forgotten
(rametfs.core.lifecycle.trim_pool; gc frees their data).  Every member gets the pool's settings and policy (those of ``create``;
absent options of a new pool take ``create``'s defaults).  ``acquire`` leases the ready execution
returned last to holder H (a token the client chooses; PID and HOST are recorded for people)
for S seconds: EBUSY when none is ready, ENOENT unknown pool.  It answers at once: the kernel
serialises the writes to one ``ctl`` file, so a command that waited would hold up every other
command there; a client that wants to wait polls.  ``renew`` extends the lease: EBUSY when
another holder has it, EINVAL when it has ended or is not leased (it expired and went back to
the pool).  ``return`` resets the execution, verifies it (``root`` by default) and puts it
back in the pool, or, when verification fails, quarantines it: state ``"quarantined"``, never
handed out again, replaced by a new member; the reply says which.  An expired lease is
returned the same way by the daemon.  ``drop`` releases every execution of the pool and
forgets it.  ``release`` of a pool member takes it out of its pool, which shrinks by one
(EBUSY while a lease on it runs; an ended lease holds nothing).

One command runs on an execution at a time, and the harness comes first: a command written
to the root ``ctl`` on an execution cancels one its own ``ctl`` runs (and waits until it has
stopped), while the execution's own commands are EBUSY as long as a harness command runs on
it.  Within one scope a second command is EBUSY, except that ``reset``, ``release`` and
``return`` (and an expired lease's return) cancel the one running; so does::

    cancel [--execution ID]                   -> {"ok", "cancelled": [execution ids]}

for the command running on execution ID, or on every execution (``rametfs umount`` sends it
first; SIGTERM and SIGINT do the same before the daemon unmounts).  A cancelled command
fails with ECANCELED, its message naming what cancelled it; a capture stops within a page
of work and stores no snapshot.

For the test suite, a daemon served with ``--faults`` also takes
``fault <site> [--execution ID] [--count N]``, which makes the named site raise an
unexpected exception at its next N hits (rametfs.faults lists the sites); elsewhere it is
EINVAL.

Execution commands::

    promote [--label L] [--message M] [--policy TOML]   -> {"ok", "snapshot", "stats"}
                                         (it becomes the head)
    checkpoint [--label L] [--message M] [--policy TOML] -> {"ok", "snapshot", "stats"}
                                         (the head stays)
    reset [--base yes]                  -> {"ok", "snapshot", "reset_ms"} (back to its head,
                                         or to its base, which becomes the head)
    verify [--mode root|deep]           -> {"ok", "execution", "state", "verification"}
    preview [--policy TOML]             -> {"ok", "preview"}             (changes nothing)

An execution's *head* (rametfs.core.heads) is its base until a promote, which makes the new
snapshot the head; ``diff``, ``verify``, ``reset`` and the next promote's parent refer to the
head.  ``reset --to SNAPSHOT`` (root ``ctl`` only: EACCES from the execution's own, as
``--policy``) rebases the execution onto any snapshot in place, which becomes its head; EINVAL
with ``--base yes``.

``verify`` compares the execution with its head (rametfs.verify): ``verification`` is
``{"mode", "equal", "root", "base_root", "verify_ms", "differences"}``, ``differences`` a
list of ``[letter, path]`` like ``diff``.  A ready pool member that is not equal is
quarantined.

The root ``ctl`` takes each of these with the execution's id first, and two more, so the
harness acts on an execution whatever its ``--control``::

    promote <execution-id> [--label L] [--message M] [--policy TOML] [--publish yes]
    checkpoint <execution-id> [--label L] [--message M] [--policy TOML]
    reset <execution-id> [--base yes | --to SNAPSHOT]
    verify <execution-id> [--mode root|deep]
    preview <execution-id> [--policy TOML]
    diff <execution-id>                 -> {"ok", "execution", "diff": [[letter, path], ...]}
    status <execution-id>               -> {"ok", "status": {...}} (the root status's record)

``promote <execution-id> --publish yes`` (root ``ctl`` only: EACCES from the execution's own)
then publishes the new snapshot to the daemon's remote (docs/remote.md), and the reply adds
``"published"`` (``{"snapshot", "already", "packs", "trees", "contents", "chunks", "bytes",
"requests", "seconds"}``); so does the root command ``publish <snapshot>`` ->
``{"ok", "snapshot", "published"}``.  Both are EINVAL when the daemon serves no remote
(``mount --remote --catalog``), EIO when the remote fails (what was uploaded stays; the next
publish resumes).

Their replies are those above, with the store-wide figures an execution's own files leave out
(below).  ``diff`` paths are the names' bytes decoded as UTF-8 with surrogate escapes.

Answers are bounded (:data:`MAX_ANSWER_BYTES` by default; ``rametfs mount
--max-answer-bytes``): a diff (``.ramet/diff``, as its text; ``diff <id>``, as the
``.ramet/diff`` text of the same paths), a preview (``.ramet/preview``, the ``preview``
commands: as the JSON report) or any other reply longer than that fails with EFBIG (``the
diff of execution X is more than N bytes; ...``) and is never made whole in memory;
``.ramet/fsmonitor`` then answers ``TOKEN\0/\0``, "everything may have changed", which git
handles by scanning (githooks(5)).  The ``last`` reply a status shows is the whole reply
when its JSON takes at most :data:`LAST_REPLY_BYTES` bytes, else its scalar fields and
``"omitted"``, the names of the others.  Root
and execution commands on one execution exclude each other (EBUSY) as execution commands do;
``diff`` and ``status`` answer while one runs.

Who may do what (rametfs.authority; docs/security.md).  The root ``ctl`` (0600) is the
harness's: the daemon's uid, or root.  An execution belongs to its owner: its ``share`` bits
are applied like a directory's (the owner's class, the group's for a member of its group,
else the others'): ``x`` to enter ``executions/<id>/`` (EACCES, checked at every lookup of
that name), ``r`` to read its ``.ramet/`` files and be listed in the root status, ``w`` to
write its ``ctl`` and ``promote`` (EACCES from the file modes the kernel checks); the owner
and the harness may do all three.  ``snapshots/`` and ``executions/`` are 0711: only the
harness lists them, anyone may look up a name (a snapshot id is 64 hex digits).
``--control`` is what the execution's own files allow, whoever writes them: ``full`` every
execution command; ``read`` the files read as ever (``fsmonitor`` answers too) and a write to
``ctl`` or ``promote`` is EACCES (at the open, or at the write for root); ``none``: ``.ramet``
does not exist (ENOENT) and cannot be made (EEXIST).  A control file acts on the execution it
was opened in: once that is released, ENOENT, even when another execution has its name.

What an execution's own files show never depends on content outside it: its ``ctl`` replies
and the ``last`` of its ``status`` leave out :data:`STORE_WIDE_STATS` (deduplication against
the whole store, and the capture time that follows it); its ``status`` leaves out the lease,
pool and mount path.  The root status read by a uid other than the harness's lists only the
executions whose ``r`` bit it has (as their ``status`` shows them), the snapshots that are
their base or head (without those figures and without ``source``), no pools, no ``pid``,
``data`` or ``last``.

``--policy`` carries a persistence policy's text itself (the client reads the file), so the
daemon never opens a path a sandbox names, or one of two words, which no policy's text can be
(neither is a TOML document): ``tree``, the execution's own ``ramet.toml``, and ``none``, no
policy.  Without it, promote and preview apply the policy stored with the execution
(``create --policy``, ``pool --policy``), else none; checkpoint applies none.  The tree's
``ramet.toml`` is read only when ``tree`` is given (docs/policy.md).  Only the harness gives
``--policy`` (at the root ``ctl``: ``promote <execution-id> --policy ...``); written to an
execution's own ``ctl`` it is EACCES, so an agent cannot replace the harness's policy.

Snapshot ids are 64 hex digits (BLAKE3); any unique prefix of at least
:data:`MIN_ID_PREFIX` digits is accepted where an id is expected.  Execution ids are
names matching :data:`EXECUTION_NAME_RE`.
"""

from __future__ import annotations

import datetime
import decimal
import errno as _errno
import json
import re
import secrets
import shlex  # format_command quotes; split_command splits as shlex.split does
from dataclasses import Field, dataclass, field, fields
from typing import Any, Callable, ClassVar

from rametfs.errors import ProtocolError

CONTROL_DIR = ".ramet"
CTL = "ctl"
STATUS = "status"
ERROR = "error"
PROMOTE = "promote"
DIFF = "diff"
PREVIEW = "preview"
FSMONITOR = "fsmonitor"
SNAPSHOTS_DIR = "snapshots"
EXECUTIONS_DIR = "executions"

ROOT_CONTROL_FILES = (CTL, STATUS, ERROR)
EXECUTION_CONTROL_FILES = (CTL, PROMOTE, STATUS, DIFF, ERROR, PREVIEW, FSMONITOR)

MIN_ID_PREFIX = 8
EXECUTION_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_COMMAND_BYTES = 64 * 1024
MAX_ANSWER_BYTES = 64 * 1024 * 1024  # default of one control file answer or reply (EFBIG)
LAST_REPLY_BYTES = 16 * 1024  # of the JSON of the ``last`` reply a status shows whole
MAX_ECHO_CHARS = 200  # of a command or word a message, the log or ``.ramet/error`` shows
MAX_ERROR_CHARS = 2000  # of an error message kept for ``.ramet/error`` and the log
MAX_COMMAND_PARTS = 4096  # words, spaces, quoted strings and escapes of one command (EINVAL)
MAX_LABEL_BYTES = 256  # of a --label (UTF-8)
MAX_MESSAGE_BYTES = 16 * 1024  # of a --message (UTF-8): room for a --policy in the same command

EINVAL = _errno.EINVAL
ENOENT = _errno.ENOENT
EBUSY = _errno.EBUSY
ENOSPC = _errno.ENOSPC
EIO = _errno.EIO
EACCES = _errno.EACCES

CONTROL_FULL, CONTROL_READ, CONTROL_NONE = "full", "read", "none"
CONTROLS = (CONTROL_FULL, CONTROL_READ, CONTROL_NONE)  # values of --control
# of create and pool
ACCESS_OPTIONS = frozenset({"owner", "group", "share", "control", "max-bytes", "max-inodes"})
# Stats of a snapshot that depend on what else the store holds: left out of what an
# execution's own files show, and of the root status a uid other than the harness reads.
STORE_WIDE_STATS = ("new_chunks", "new_chunk_bytes", "cached_files", "capture_ms")

# name -> (positional argument names, allowed options)
ROOT_COMMANDS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "snapshot": (("path",), frozenset({"label", "message", "on-change"})),
    "create": (("snapshot",), frozenset({"name", "policy"}) | ACCESS_OPTIONS),
    "release": (("execution",), frozenset()),
    "runtime": (("execution", "name"), frozenset({"uid", "gid", "image"})),
    "pool": (("snapshot",), frozenset({"size", "name", "policy", "keep-last"})
             | ACCESS_OPTIONS),
    "acquire": (("pool",), frozenset({"holder", "ttl", "pid", "host"})),
    "renew": (("execution",), frozenset({"holder", "ttl"})),
    "return": (("execution",), frozenset({"holder", "verify"})),
    "drop": (("pool",), frozenset()),
    "snapshot-git": (("repo",), frozenset({"rev", "gitdir", "label", "message"})),
    "fault": (("site",), frozenset({"execution", "count"})),
    "cancel": ((), frozenset({"execution"})),
    "name": (("name", "snapshot"), frozenset()),
    "unname": (("name",), frozenset()),
    "resolve": (("snapshot",), frozenset()),
    "rm": (("snapshot",), frozenset({"force"})),
    "gc": ((), frozenset({"dry-run", "compact"})),
    "forget": ((), frozenset({"keep-last", "keep-within", "keep-name", "dry-run"})),
    "publish": (("snapshot",), frozenset()),
}
YES, NO = "yes", "no"  # values of a yes/no option such as ``--gitdir``
ON_CHANGE = ("fail", "skip")  # values of snapshot's ``--on-change`` (the first the default)
EXECUTION_COMMANDS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "promote": ((), frozenset({"label", "message", "policy", "publish"})),
    "checkpoint": ((), frozenset({"label", "message", "policy"})),
    "reset": ((), frozenset({"to", "base"})),
    "verify": ((), frozenset({"mode"})),
    "preview": ((), frozenset({"policy"})),
}
# The root ctl's commands on one execution: the execution's own, its id first, and diff and
# status, which the execution reads from files.
ROOT_EXECUTION_COMMANDS = frozenset(EXECUTION_COMMANDS) | {"diff", "status"}
ROOT_COMMANDS.update({name: (("execution",), options)
                      for name, (_, options) in EXECUTION_COMMANDS.items()})
ROOT_COMMANDS.update({"diff": (("execution",), frozenset()),
                      "status": (("execution",), frozenset())})
# options a command cannot do without (either table)
REQUIRED_OPTIONS: dict[str, frozenset[str]] = {
    "pool": frozenset({"size"}),
    "acquire": frozenset({"holder", "ttl"}),
    "renew": frozenset({"holder", "ttl"}),
    "return": frozenset({"holder"}),
    "runtime": frozenset({"uid", "gid"}),
}
POLICY_TREE, POLICY_NONE = "tree", "none"  # the words --policy takes besides a policy's text
VERIFY_MODES = ("root", "deep")
RUNTIMES = ("bubblewrap", "docker")  # sandboxes a ``runtime`` command records
IMAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}")  # a Docker image reference
POOL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,47}")  # member ids add 9 characters
MAX_POOL_SIZE = 4096


def parse_command(line: str, table: dict[str, tuple[tuple[str, ...], frozenset[str]]]
                  ) -> tuple[str, dict[str, str]]:
    """Split one command line into ``(name, arguments)``.

    ``arguments`` maps each positional name and each given ``--option`` to its string value.
    Raises :class:`ProtocolError` (EINVAL) for an unknown command, a missing or extra
    argument, an unknown, repeated or missing required option (:data:`REQUIRED_OPTIONS`), or
    unbalanced quotes.
    """
    words = split_command(line)
    if not words:
        raise ProtocolError("empty command")
    name, rest = words[0], words[1:]
    if name not in table:
        raise ProtocolError(f"unknown command {shown(name, quoted=True)}; "
                            f"expected one of {', '.join(sorted(table))}")
    positional, options = table[name]
    args: dict[str, str] = {}
    values: list[str] = []
    i = 0
    while i < len(rest):
        word = rest[i]
        if word.startswith("--"):
            option = word[2:]
            if option not in options:
                raise ProtocolError(f"{name}: unknown option {shown(word, quoted=True)}")
            if option in args:
                raise ProtocolError(f"{name}: option {word!r} given twice")
            if i + 1 >= len(rest):
                raise ProtocolError(f"{name}: option {word!r} needs a value")
            args[option] = rest[i + 1]
            i += 2
        else:
            values.append(word)
            i += 1
    if len(values) != len(positional):
        want = " ".join(f"<{p}>" for p in positional) or "no arguments"
        raise ProtocolError(f"{name}: expected {want}, got {len(values)} argument(s)")
    missing = sorted(REQUIRED_OPTIONS.get(name, frozenset()) - args.keys())
    if missing:
        raise ProtocolError(f"{name}: missing {', '.join('--' + m for m in missing)}")
    check_text(name, args.get("label"), args.get("message"))
    args.update(zip(positional, values))
    return name, args


# One part of a command line as shlex.split (POSIX mode, no comments) reads it: a run of
# plain characters, a backslash and the character it escapes, a single-quoted or a
# double-quoted string, whitespace between words; anything else is an opening quote or a
# backslash with nothing after it.
_PART = re.compile(r"""([^ \t\r\n'"\\]+)|\\(.)|'([^']*)'|"((?:[^"\\]|\\.)*)"|([ \t\r\n]+)|(.)""",
                   re.S)
_OPEN_ESCAPE = re.compile(r'"(?:[^"\\]|\\.)*\\', re.S)  # a double quote ending in "\"


def split_command(line: str) -> list[str]:
    """The words of ``line``, exactly as ``shlex.split(line)`` gives them, in C for the most
    part and in at most :data:`MAX_COMMAND_PARTS` steps: shlex reads a character at a time
    in Python (a quoted 64 KiB word took it 69 ms of the daemon's one thread here, this
    0.02 ms; 4,096 parts take both about 1 ms).  Raises ProtocolError (EINVAL) for an
    unclosed quote or a trailing backslash (with shlex's words for them), or for more
    parts."""
    words: list[str] = []
    word: list[str] | None = None  # the parts of the word being read, None between words
    for count, m in enumerate(_PART.finditer(line), 1):
        if count > MAX_COMMAND_PARTS:
            raise ProtocolError(f"a command has at most {MAX_COMMAND_PARTS} parts (words, "
                                f"spaces between them, quoted strings, escapes)")
        plain, escaped, single, double, space, bad = m.groups()
        if space is not None:
            if word is not None:
                words.append("".join(word))
                word = None
        elif bad is not None:
            why = ("No escaped character" if bad == "\\" or _OPEN_ESCAPE.fullmatch(
                line, m.start()) else "No closing quotation")
            raise ProtocolError(f"cannot split command {shown(line.strip(), quoted=True)}: "
                                f"{why}")
        else:
            if word is None:
                word = []
            if double:  # only \" and \\ are escapes there, and every \ starts a pair
                double = "\\".join(p.replace('\\"', '"') for p in double.split("\\\\"))
            word.append(plain or escaped or single or double or "")
    if word is not None:
        words.append("".join(word))
    return words


def shown(text: str, limit: int = MAX_ECHO_CHARS, quoted: bool = False) -> str:
    """``text`` (what a client sent, bytes decoded with U+FFFD for what is not UTF-8) safe to
    show in a message, the log or ``.ramet/error``: its first ``limit`` characters, each that
    is not printable (control and format characters, U+FFFD) as its Python escape
    (``quoted``: as ``repr`` of that part shows it), then ``... (N characters)`` when it is
    longer: one line of at most about ``10 * limit`` characters, whatever was sent."""
    def one(c: str) -> str:
        return c if c.isprintable() and c != "\ufffd" else \
            c.encode("unicode_escape").decode("ascii")

    head = repr(text[:limit]) if quoted else "".join(map(one, text[:limit]))
    return head + (f"... ({len(text)} characters)" if len(text) > limit else "")


def check_text(command: str, label: str | None, message: str | None) -> None:
    """Raise ProtocolError (EINVAL) for a label over :data:`MAX_LABEL_BYTES` or a message
    over :data:`MAX_MESSAGE_BYTES` (UTF-8); None is not given."""
    for option, value, limit in (("label", label, MAX_LABEL_BYTES),
                                 ("message", message, MAX_MESSAGE_BYTES)):
        size = 0 if value is None else len(value.encode(errors="surrogatepass"))
        if size > limit:
            raise ProtocolError(f"{command}: --{option} is at most {limit} bytes, not {size}")


def format_command(name: str, /, *positional: str, **options: str | None) -> str:
    """Build one command line (with a trailing newline), quoting every word; an option's
    ``_`` becomes ``-`` (``on_change=`` gives ``--on-change``)."""
    words = [name, *positional]
    for key, value in options.items():
        if value is not None:
            words += [f"--{key.replace('_', '-')}", value]
    return " ".join(shlex.quote(w) for w in words) + "\n"


def encode_reply(reply: dict) -> bytes:
    """Serialise a reply: compact JSON, one line."""
    return (json.dumps(reply, sort_keys=True) + "\n").encode()


def decode_reply(data: bytes) -> dict:
    """Parse a reply read back from a ``ctl`` file descriptor."""
    return json.loads(data.decode() or "{}")


def new_pool_name() -> str:
    """A name for a pool made without one: ``pool-<8 hex>``."""
    return f"pool-{secrets.token_hex(4)}"


def member_name(pool: str) -> str:
    """A new execution id for a member of pool ``pool``: ``<pool>-<8 hex>``."""
    return f"{pool}-{secrets.token_hex(4)}"


# -- typed commands ---------------------------------------------------------------------------
#
# parse(line, scope) -> Command and format(Command) -> line: every command is a frozen
# dataclass whose fields are typed values (ints, ns, bools), checked once, here: parse turns
# the option strings into values, naming the text when it is not one; the dataclass checks
# the values however it was made (parse, or the client building it), with the same message.
# The runners (the daemon's rametfs.control, fallback mode's rametfs.fallback.service)
# dispatch on the Command's type and take its fields as they are.

ROOT, EXECUTION = "root", "execution"  # scopes: the root ctl, an execution's own ctl
MAX_ID = 2**32 - 1  # (uid_t) -1 means "no change" to chown(2): never an owner
MAX_LIMIT = 2**63  # of --max-bytes and --max-inodes (exclusive)
MAX_SECONDS = 10**9  # of --ttl (exclusive)
NS = 10**9

# A duration: whole numbers, each with a unit, units in this order, each at most once
# (restic's units; ``m`` is months, as in restic: ``2h30m`` is EINVAL, not 30 months).
_DURATION = re.compile(r"(?:(\d+)y)?(?:(\d+)m)?(?:(\d+)d)?(?:(\d+)h)?")
# Of each unit: 1,000 years before any time since 1970 is still a year datetime holds (>= 1).
MAX_DURATION_PART = 1000


@dataclass(frozen=True)
class Duration:
    """A calendar duration as restic's ``--keep-within`` takes it: ``1y2m7d3h`` is one year,
    two months, seven days and three hours (units ``y`` years, ``m`` months, ``d`` days,
    ``h`` hours, in that order, each at most once, at least one)."""

    years: int = 0
    months: int = 0
    days: int = 0
    hours: int = 0

    def __post_init__(self) -> None:
        parts = (self.years, self.months, self.days, self.hours)
        if not any(parts) or min(parts) < 0 or max(parts) > MAX_DURATION_PART:
            raise ProtocolError(_bad_duration(str(self)))

    @classmethod
    def parse(cls, text: str) -> Duration:
        """The duration ``text`` spells; ProtocolError (EINVAL), saying the units, for
        anything else (an empty or zero duration, another unit, units out of order)."""
        match = _DURATION.fullmatch(text)
        if match is None or not any(match.groups()):
            raise ProtocolError(_bad_duration(text))
        parts = [int(p) if p else 0 for p in match.groups()]
        if not any(parts) or max(parts) > MAX_DURATION_PART:
            raise ProtocolError(_bad_duration(text))
        return cls(*parts)

    def __str__(self) -> str:
        return "".join(f"{n}{unit}" for n, unit in zip(
            (self.years, self.months, self.days, self.hours), "ymdh") if n)

    def before(self, ns: int) -> int:
        """The time (ns since the epoch, UTC) this duration before ``ns``: years and months
        by the calendar, a day past a month's end rolling over as Go's ``AddDate`` does
        (restic's arithmetic: Mar 31 less one month is Mar 3, or Mar 2 in a leap year)."""
        seconds, rest = divmod(ns, NS)
        t = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
        month0 = t.year * 12 + (t.month - 1) - self.years * 12 - self.months
        first = t.replace(year=month0 // 12, month=month0 % 12 + 1, day=1)
        moved = first + datetime.timedelta(days=t.day - 1 - self.days, hours=-self.hours)
        return int(moved.timestamp()) * NS + rest


def _bad_duration(text: str) -> str:
    return (f"bad duration {text!r}: give whole numbers of y (years), m (months), d (days) and "
            f"h (hours), in that order, each at most {MAX_DURATION_PART} and not all zero, as "
            "restic does: 7d, 36h, 1y2m (m is months, so 2h30m is not a duration)")


@dataclass(frozen=True)
class _Kind:
    """How one option's text becomes its value: ``convert`` (ValueError, KeyError or
    ArithmeticError for text that is none), ``valid`` (the value's range), ``show`` (the
    value as its text again) and ``message`` (of ``(command, option, text)``, for text or a
    value that is not valid)."""

    convert: Callable[[str], object]
    valid: Callable[[object], bool]
    show: Callable[[object], str]
    message: Callable[[str, str, str], str]


def _digits(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise ValueError(text)
    return int(text)


def _seconds_ns(text: str) -> int:
    value = decimal.Decimal(text)
    if not value.is_finite():
        raise ValueError(text)
    return int(value * NS)


def _show_ns(ns: object) -> str:
    whole, part = divmod(int(ns), NS)  # type: ignore[call-overload]
    return f"{whole}.{part:09d}".rstrip("0").rstrip(".")


def _count(minimum: int) -> _Kind:
    return _Kind(int, lambda v: isinstance(v, int) and v >= minimum, str,
                 lambda c, o, t: f"--{o} must be a whole number >= {minimum}, not {t!r}")


def _choice(values: tuple[str, ...], subject: str | None = None) -> _Kind:
    return _Kind(str, lambda v: v in values, str,
                 lambda c, o, t: f"{subject or '--' + o} must be one of {', '.join(values)}, "
                                 f"not {t!r}")


_TEXT = _Kind(str, lambda v: isinstance(v, str), str, lambda c, o, t: f"--{o}: {t!r}")
_YES_NO = _Kind({YES: True, NO: False}.__getitem__, lambda v: isinstance(v, bool),
                lambda v: {True: YES, False: NO}.get(v, repr(v)),
                lambda c, o, t: f"{c}: option --{o} takes {YES} or {NO}, not {t!r}")
_ID = _Kind(_digits, lambda v: isinstance(v, int) and 0 <= v < MAX_ID, str,
            lambda c, o, t: f"--{o} must be a numeric id below {MAX_ID}, not {t!r}")
_LIMIT = _Kind(_digits, lambda v: isinstance(v, int) and 1 <= v < MAX_LIMIT, str,
               lambda c, o, t: f"--{o} must be a whole number from 1 to 2**63 - 1, not {t!r}")
_SHARE = _Kind(lambda t: int(t, 8), lambda v: isinstance(v, int) and 0o700 <= v <= 0o777,
               lambda v: f"{v:04o}",
               lambda c, o, t: f"--share must be octal permission bits that give the owner "
                               f"rwx (0700 to 0777), not {t!r}")
_SECONDS = _Kind(_seconds_ns, lambda v: isinstance(v, int) and 0 <= v < MAX_SECONDS * NS,
                 _show_ns, lambda c, o, t: f"--{o} must be seconds >= 0, not {t!r}")
_VERIFY = _choice(VERIFY_MODES, "verification mode")
_DURATION_KIND = _Kind(Duration.parse, lambda v: isinstance(v, Duration), str,
                       lambda c, o, t: _bad_duration(t))
# Each option's kind (text when not named here).
KINDS: dict[str, _Kind] = {
    "gitdir": _YES_NO, "force": _YES_NO, "dry-run": _YES_NO, "compact": _YES_NO,
    "publish": _YES_NO, "base": _YES_NO,
    "size": _count(1), "keep-last": _count(1), "pid": _count(0), "count": _count(0),
    "uid": _count(0), "gid": _count(0),
    "owner": _ID, "group": _ID, "share": _SHARE, "control": _choice(CONTROLS),
    "max-bytes": _LIMIT, "max-inodes": _LIMIT, "ttl": _SECONDS, "verify": _VERIFY,
    "mode": _VERIFY, "on-change": _choice(ON_CHANGE), "keep-within": _DURATION_KIND,
}


def _option(name: str) -> Any:
    """A required dataclass field that is option ``--name`` of its command."""
    return field(metadata={"option": name})


class Command:
    """One control command as values: a frozen dataclass per command (``NAME`` its word).
    Its fields, in order: the positional arguments (``POSITIONAL``), then the options
    (each ``--option`` of the field's name with ``-`` for ``_``, or as ``_option`` names
    it).  Building one checks every value (ProtocolError, EINVAL), however it is built."""

    NAME: ClassVar[str]
    POSITIONAL: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None and f.name != "access":  # (Access checks itself)
                kind = KINDS.get(_option_name(f), _TEXT)
                if not kind.valid(value):
                    raise ProtocolError(kind.message(self.NAME, _option_name(f),
                                                     _shown_value(kind, value)))
        if hasattr(self, "label"):
            check_text(self.NAME, getattr(self, "label"), getattr(self, "message"))


def _option_name(f: Field) -> str:
    return f.metadata.get("option", f.name.replace("_", "-"))


def _shown_value(kind: _Kind, value: object) -> str:
    try:
        return kind.show(value)
    except (TypeError, ValueError):
        return repr(value)


class ExecutionCommand(Command):
    """A command on one execution: ``execution`` is its id at the root ``ctl`` (given first),
    None at the execution's own (it acts on the execution it was written to)."""

    POSITIONAL = ("execution",)


@dataclass(frozen=True)
class Access:
    """The ``--owner``, ``--group``, ``--share``, ``--control``, ``--max-bytes`` and
    ``--max-inodes`` of ``create`` and ``pool``: None where not given (rametfs.authority
    applies them over its defaults)."""

    owner: int | None = None
    group: int | None = None
    share: int | None = None
    control: str | None = None
    max_bytes: int | None = None
    max_inodes: int | None = None

    def __post_init__(self) -> None:
        for name in ("owner", "group", "share", "control", "max_bytes", "max_inodes"):
            value, option = getattr(self, name), name.replace("_", "-")
            kind = KINDS[option]
            if value is not None and not kind.valid(value):
                raise ProtocolError(kind.message("", option, _shown_value(kind, value)))

    def options(self) -> dict[str, str]:
        """The options given, as text."""
        return {name.replace("_", "-"): KINDS[name.replace("_", "-")].show(value)
                for name, value in vars(self).items() if value is not None}


@dataclass(frozen=True)
class Snapshot(Command):
    NAME = "snapshot"
    POSITIONAL = ("path",)
    path: str
    label: str = ""
    message: str = ""
    on_change: str = ON_CHANGE[0]


@dataclass(frozen=True)
class SnapshotGit(Command):
    NAME = "snapshot-git"
    POSITIONAL = ("repo",)
    repo: str
    rev: str = "HEAD"
    gitdir: bool = False
    label: str = ""
    message: str = ""


@dataclass(frozen=True)
class Create(Command):
    NAME = "create"
    POSITIONAL = ("snapshot",)
    snapshot: str
    name: str | None = None  # None: the runner makes one
    policy: str | None = None
    access: Access = Access()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name is not None and not EXECUTION_NAME_RE.fullmatch(self.name):
            raise ProtocolError(f"create: execution name {self.name!r} must match "
                                f"{EXECUTION_NAME_RE.pattern}")


@dataclass(frozen=True)
class Release(Command):
    NAME = "release"
    POSITIONAL = ("execution",)
    execution: str


@dataclass(frozen=True)
class Runtime(Command):
    """``runtime``: which sandbox runs the execution's commands.  A uid or gid is below
    2**32 - 1 (and not 0 for bubblewrap, which never runs as root); ``image`` is given for
    docker, and only for docker, and matches :data:`IMAGE_RE`."""

    NAME = "runtime"
    POSITIONAL = ("execution", "name")
    execution: str
    name: str
    uid: int
    gid: int
    image: str | None = None

    def __post_init__(self) -> None:
        if self.name not in RUNTIMES:
            raise ProtocolError(f"runtime: the sandbox is one of {', '.join(RUNTIMES)}, "
                                f"not {self.name!r}")
        super().__post_init__()
        for key in ("uid", "gid"):
            value = getattr(self, key)
            if value >= MAX_ID:
                raise ProtocolError(f"runtime: --{key} must be below {MAX_ID}, not {value}")
            if value == 0 and self.name == "bubblewrap":
                raise ProtocolError(f"runtime: bubblewrap never runs as root: --{key} 0")
        if (self.image is None) != (self.name == "bubblewrap"):
            raise ProtocolError("runtime: --image is needed for docker, and only for docker")
        if self.image is not None and not IMAGE_RE.fullmatch(self.image):
            raise ProtocolError(f"runtime: image {self.image!r} must match {IMAGE_RE.pattern}")

    def record(self) -> dict:
        """The sandbox record: ``{"name", "uid", "gid"}``, with ``"image"`` for docker."""
        return {"name": self.name, "uid": self.uid, "gid": self.gid,
                **({"image": self.image} if self.image is not None else {})}


@dataclass(frozen=True)
class Pool(Command):
    NAME = "pool"
    POSITIONAL = ("snapshot",)
    snapshot: str
    size: int
    name: str | None = None  # None: rametfs.core.pools makes one
    policy: str | None = None
    keep_last: int | None = None
    access: Access = Access()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.size <= MAX_POOL_SIZE:
            raise ProtocolError(f"pool size must be 1 to {MAX_POOL_SIZE}, not {self.size}")
        if self.name is not None and not POOL_NAME_RE.fullmatch(self.name):
            raise ProtocolError(f"pool name {self.name!r} must match {POOL_NAME_RE.pattern}")


@dataclass(frozen=True)
class Acquire(Command):
    NAME = "acquire"
    POSITIONAL = ("pool",)
    pool: str
    holder: str
    ttl_ns: int = _option("ttl")
    pid: int = 0
    host: str = ""


@dataclass(frozen=True)
class Renew(Command):
    NAME = "renew"
    POSITIONAL = ("execution",)
    execution: str
    holder: str
    ttl_ns: int = _option("ttl")


@dataclass(frozen=True)
class Return(Command):
    NAME = "return"
    POSITIONAL = ("execution",)
    execution: str
    holder: str
    verify: str = VERIFY_MODES[0]


@dataclass(frozen=True)
class Drop(Command):
    NAME = "drop"
    POSITIONAL = ("pool",)
    pool: str


@dataclass(frozen=True)
class Fault(Command):
    NAME = "fault"
    POSITIONAL = ("site",)
    site: str
    execution: str | None = None
    count: int = 1


@dataclass(frozen=True)
class Cancel(Command):
    NAME = "cancel"
    execution: str | None = None


@dataclass(frozen=True)
class Name(Command):
    NAME = "name"
    POSITIONAL = ("name", "snapshot")
    name: str
    snapshot: str


@dataclass(frozen=True)
class Unname(Command):
    NAME = "unname"
    POSITIONAL = ("name",)
    name: str


@dataclass(frozen=True)
class Resolve(Command):
    NAME = "resolve"
    POSITIONAL = ("snapshot",)
    snapshot: str


@dataclass(frozen=True)
class Rm(Command):
    NAME = "rm"
    POSITIONAL = ("snapshot",)
    snapshot: str
    force: bool = False


@dataclass(frozen=True)
class Gc(Command):
    NAME = "gc"
    dry_run: bool = False
    compact: bool = False


@dataclass(frozen=True)
class Forget(Command):
    NAME = "forget"
    keep_last: int | None = None
    keep_within: Duration | None = None
    keep_name: str | None = None
    dry_run: bool = False


@dataclass(frozen=True)
class Publish(Command):
    NAME = "publish"
    POSITIONAL = ("snapshot",)
    snapshot: str


@dataclass(frozen=True)
class Diff(Command):
    NAME = "diff"
    POSITIONAL = ("execution",)
    execution: str


@dataclass(frozen=True)
class Status(Command):
    NAME = "status"
    POSITIONAL = ("execution",)
    execution: str


@dataclass(frozen=True)
class Promote(ExecutionCommand):
    NAME = "promote"
    execution: str | None = None
    label: str = ""
    message: str = ""
    policy: str | None = None
    publish: bool = False


@dataclass(frozen=True)
class Checkpoint(ExecutionCommand):
    NAME = "checkpoint"
    execution: str | None = None
    label: str = ""
    message: str = ""
    policy: str | None = None


@dataclass(frozen=True)
class Reset(ExecutionCommand):
    """``reset``: to ``to`` (a snapshot), to the base (``base``), else to the head."""

    NAME = "reset"
    execution: str | None = None
    to: str | None = None
    base: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.to is not None and self.base:
            raise ProtocolError("reset: --to SNAPSHOT and --base yes name two snapshots; "
                                "give one")


@dataclass(frozen=True)
class Verify(ExecutionCommand):
    NAME = "verify"
    execution: str | None = None
    mode: str = VERIFY_MODES[0]


@dataclass(frozen=True)
class Preview(ExecutionCommand):
    NAME = "preview"
    execution: str | None = None
    policy: str | None = None


COMMANDS: dict[str, type[Command]] = {cls.NAME: cls for cls in (
    Snapshot, SnapshotGit, Create, Release, Runtime, Pool, Acquire, Renew, Return, Drop, Fault,
    Cancel, Name, Unname, Resolve, Rm, Gc, Forget, Publish, Diff, Status,
    Promote, Checkpoint, Reset, Verify, Preview)}


def parse(line: str, scope: str = ROOT) -> Command:
    """The Command of one line written to a ``ctl`` of ``scope`` (:data:`ROOT` or
    :data:`EXECUTION`): split (:func:`parse_command`), each option's text made its value
    (:data:`KINDS`) and the whole checked.  Raises ProtocolError (EINVAL) naming what is
    wrong; for a command of the other scope, where it belongs."""
    table = ROOT_COMMANDS if scope == ROOT else EXECUTION_COMMANDS
    try:
        name, args = parse_command(line, table)
    except ProtocolError as exc:
        raise ProtocolError(_elsewhere(line, scope, exc)) from None
    cls = COMMANDS[name]
    values: dict[str, object] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name == "access":
            values["access"] = Access(**{  # type: ignore[arg-type]
                option.replace("-", "_"): _value(name, option, args[option])
                for option in sorted(ACCESS_OPTIONS) if option in args})
        elif f.name in cls.POSITIONAL:
            if f.name in args:
                values[f.name] = args[f.name]
        elif _option_name(f) in args:
            values[f.name] = _value(name, _option_name(f), args[_option_name(f)])
    return cls(**values)


def _value(command: str, option: str, text: str) -> object:
    """The value of option ``--option`` of ``command`` given as ``text``; ProtocolError
    (EINVAL) naming the text when it is none."""
    kind = KINDS.get(option, _TEXT)
    try:
        value = kind.convert(text)
    except (ValueError, KeyError, ArithmeticError):
        raise ProtocolError(kind.message(command, option, text)) from None
    if not kind.valid(value):
        raise ProtocolError(kind.message(command, option, text))
    return value


def seconds_ns(seconds: float, option: str = "ttl") -> int:
    """``seconds`` (a float, as the client takes a ``--ttl``) in ns, checked as that option's
    text would be."""
    return _value("", option, str(seconds))  # type: ignore[return-value]


def _elsewhere(line: str, scope: str, exc: ProtocolError) -> str:
    """``exc``'s message, or for a command of the other scope, where it belongs."""
    words = line.split()
    name = words[0] if words else ""
    if scope == EXECUTION and name in (DIFF, STATUS):
        return f"{name}: read this execution's .ramet/{name} instead"
    if scope == EXECUTION and name in ROOT_COMMANDS and name not in EXECUTION_COMMANDS:
        return (f"{name}: a command of the root .ramet/ctl, at the top of the mount (the "
                f"harness's), not of an execution's; this one takes "
                f"{', '.join(sorted(EXECUTION_COMMANDS))}")
    if scope == ROOT and name in ROOT_EXECUTION_COMMANDS \
            and (len(words) == 1 or words[1].startswith("--")):
        return (f"{exc}: on the root ctl, {name} names its execution first "
                f"({name} <execution-id> ...); an execution's own .ramet/ctl takes {name} "
                "alone")
    return str(exc)


def format(command: Command) -> str:  # noqa: A001 - the protocol's word, as parse
    """The line of ``command`` (with a trailing newline) that :func:`parse` reads back as it:
    an execution command without its ``execution`` is one for the execution's own ``ctl``;
    options at their defaults are left out."""
    positional = [getattr(command, p) for p in command.POSITIONAL
                  if getattr(command, p) is not None]
    options: dict[str, str | None] = {}
    for f in fields(command):  # type: ignore[arg-type]
        value = getattr(command, f.name)
        if f.name == "access":
            options.update(value.options())
        elif f.name not in command.POSITIONAL and value is not None and value != f.default:
            options[_option_name(f)] = KINDS.get(_option_name(f), _TEXT).show(value)
    return format_command(command.NAME, *positional, **options)


# -- quoting names as git does --------------------------------------------------------------

_C_ESCAPES = {7: "a", 8: "b", 9: "t", 10: "n", 11: "v", 12: "f", 13: "r", 34: '"', 92: "\\"}
_QUOTED_BYTE = {b: f"\\{_C_ESCAPES.get(b) or f'{b:03o}'}".encode()
                for b in (*range(0x20), 34, 92, *range(0x7F, 0x100))}
_MUST_QUOTE = re.compile(rb'[\x00-\x1f"\\\x7f-\xff]')
_QUOTE_IF = re.compile(rb'[\x00-\x20"\\\x7f-\xff]')  # those, or a space
_QUOTED = re.compile(r'"((?:[ !#-\[\]-~]|\\[abtnvfr"\\]|\\[0-3][0-7]{2})*)"')
_ESCAPE = re.compile(r"\\(?:([abtnvfr\"\\])|([0-3][0-7]{2}))")
_UNESCAPED = {v: chr(k) for k, v in _C_ESCAPES.items()}


def quote_path(path: bytes) -> str:
    """``path`` as ``git status --porcelain`` prints it (git's ``quote_path``, quote.c, with
    ``core.quotePath=true``): as is, unless it holds a control character, ``"``, ``\\``, a
    byte >= 0x80 or a space; then in double quotes, with ``\\a \\b \\t \\n \\v \\f \\r \\" \\\\``
    and 3-digit octal for the other bytes of those.  ASCII only, so a line holds one name
    and can be parsed back exactly (:func:`unquote_path`)."""
    if _QUOTE_IF.search(path) is None:  # the common case, in C: about 0.3 us a name
        return path.decode("ascii")
    return f'"{_MUST_QUOTE.sub(lambda m: _QUOTED_BYTE[m.group()[0]], path).decode("ascii")}"'


def unquote_path(text: str) -> bytes:
    """The bytes of a name :func:`quote_path` printed.  Raises ProtocolError (EINVAL) for
    text it cannot have printed."""
    found = _QUOTED.fullmatch(text)
    if found is None:
        if not text.isascii() or _QUOTE_IF.search(text.encode()):
            raise ProtocolError(f"not a name as rametfs quotes it: {text!r}")
        return text.encode("ascii")
    return _ESCAPE.sub(lambda m: _UNESCAPED[m.group(1)] if m.group(1) else
                       chr(int(m.group(2), 8)), found.group(1)).encode("latin-1")
