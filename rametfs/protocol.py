"""The control protocol: the magic files under ``.ramet/`` and the commands they take.

This module is the whole contract between the daemon and its clients (the Python wrapper,
the CLI, a shell).  It imports only the standard library, so a client can depend on it
without pulling in FUSE, LMDB or trio.

Layout (paths relative to the mountpoint)::

    .ramet/ctl                       root control file (mode 0600)
    .ramet/status                    JSON: snapshots, executions, pools, last root reply
    .ramet/error                     text: message of the last failed root command
    snapshots/<snapshot-id>/         read-only tree
    executions/<execution-id>/       writable copy-on-write view
    executions/<id>/.ramet/ctl       this execution's control file
    executions/<id>/.ramet/promote   write anything to promote; read: last promoted id
    executions/<id>/.ramet/status    JSON: id, base, head, state, last reply
    executions/<id>/.ramet/diff      ``A|M|D <path>`` lines, like ``git status --porcelain``
    executions/<id>/.ramet/preview   JSON: what a promote would keep, by class (docs/policy.md)
    executions/<id>/.ramet/error     text: message of the last failed command here
    executions/<id>/.ramet/fsmonitor git's fsmonitor hook (protocol 2): run it, or write
                                     ``TOKEN\nPREFIX`` and read ``TOKEN\0PATH\0...`` back

A command is one line written to a ``ctl`` file, split like a POSIX shell does (``shlex``), so
arguments with spaces are quoted.  The ``write()`` returns once the command is done: the
written length on success, else -1 with a precise errno (:data:`EINVAL` malformed,
:data:`ENOENT` unknown id or path, :data:`EBUSY` busy, :data:`ENOSPC` no room, :data:`EIO`
store failure).  After the write, reading the same open file descriptor from offset 0 gives
the reply as one JSON object followed by a newline: ``{"ok": true, ...}`` or
``{"ok": false, "errno": 22, "error": "..."}``; ``echo CMD > ctl; cat ctl`` in a shell reads
the reply of the last command written to that ``ctl`` file.

Root commands and their replies::

    snapshot <abs-path> [--label L] [--message M] [--on-change fail|skip]
                                                   -> {"ok", "snapshot", "stats"}
    create <snapshot-id> [--name N]                -> {"ok", "execution", "path"}
    release <execution-id>                         -> {"ok", "execution"}
    snapshot-git <abs-repo> [--rev REV] [--gitdir yes|no] [--label L] [--message M]
                                                   -> {"ok", "snapshot", "stats"}

``snapshot`` fails with EAGAIN, naming the path, when an entry of the source changes while
it is imported (another file, type or content); ``--on-change skip`` leaves such entries out
instead and counts them in the stats as ``skipped``.

``snapshot-git`` imports the tree of commit ``REV`` (default ``HEAD``) of a git repository
from its objects, without a checkout; ``--gitdir yes`` takes the repository's ``.git``
directory along (local commits, branches, stash, index).  Its errors: ENOENT no repository
or no such commit, EINVAL not a repository, EOPNOTSUPP git support not installed.

Pool and lease commands (rametfs.pools; ``--size``, ``--holder`` and ``--ttl`` are required;
times in seconds, decimals allowed; lease times in the replies are wall-clock ns)::

    pool <snapshot-id> --size N [--name P]    -> {"ok", "pool", "snapshot", "size", "created",
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
P (growing it to N; EEXIST when it has another base).  ``acquire`` leases the ready execution
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
(EBUSY while leased).

Execution commands::

    promote [--label L] [--message M] [--policy TOML]   -> {"ok", "snapshot", "stats"}
                                         (execution continues on it)
    checkpoint [--label L] [--message M] [--policy TOML] -> {"ok", "snapshot", "stats"}
                                         (base stays; not a new head)
    reset                               -> {"ok", "snapshot"}            (back to its base)
    verify [--mode root|deep]           -> {"ok", "execution", "state", "verification"}
    preview [--policy TOML]             -> {"ok", "preview"}             (changes nothing)

``verify`` compares the execution with its base (rametfs.verify): ``verification`` is
``{"mode", "equal", "root", "base_root", "verify_ms", "differences"}``, ``differences`` a
list of ``[letter, path]`` like ``diff``.  A ready pool member that is not equal is
quarantined.

``--policy`` carries a persistence policy's text itself (the client reads the file), so the
daemon never opens a path a sandbox names.  Without it, promote and preview apply the
execution's own ``ramet.toml`` if there is one; checkpoint applies none (docs/policy.md).

Snapshot ids are 64 hex digits (BLAKE3); any unique prefix of at least
:data:`MIN_ID_PREFIX` digits is accepted where an id is expected.  Execution ids are
names matching :data:`EXECUTION_NAME_RE`.
"""

from __future__ import annotations

import errno as _errno
import json
import math
import re
import secrets
import shlex

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

EINVAL = _errno.EINVAL
ENOENT = _errno.ENOENT
EBUSY = _errno.EBUSY
ENOSPC = _errno.ENOSPC
EIO = _errno.EIO

# name -> (positional argument names, allowed options)
ROOT_COMMANDS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "snapshot": (("path",), frozenset({"label", "message", "on-change"})),
    "create": (("snapshot",), frozenset({"name"})),
    "release": (("execution",), frozenset()),
    "pool": (("snapshot",), frozenset({"size", "name"})),
    "acquire": (("pool",), frozenset({"holder", "ttl", "pid", "host"})),
    "renew": (("execution",), frozenset({"holder", "ttl"})),
    "return": (("execution",), frozenset({"holder", "verify"})),
    "drop": (("pool",), frozenset()),
    "snapshot-git": (("repo",), frozenset({"rev", "gitdir", "label", "message"})),
}
YES, NO = "yes", "no"  # values of a yes/no option such as ``--gitdir``
ON_CHANGE = ("fail", "skip")  # values of snapshot's ``--on-change`` (the first the default)
EXECUTION_COMMANDS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "promote": ((), frozenset({"label", "message", "policy"})),
    "checkpoint": ((), frozenset({"label", "message", "policy"})),
    "reset": ((), frozenset()),
    "verify": ((), frozenset({"mode"})),
    "preview": ((), frozenset({"policy"})),
}
# options a command cannot do without (either table)
REQUIRED_OPTIONS: dict[str, frozenset[str]] = {
    "pool": frozenset({"size"}),
    "acquire": frozenset({"holder", "ttl"}),
    "renew": frozenset({"holder", "ttl"}),
    "return": frozenset({"holder"}),
}
VERIFY_MODES = ("root", "deep")
POOL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,47}")  # member ids add 9 characters
MAX_POOL_SIZE = 4096


class ProtocolError(ValueError):
    """A command line that does not parse; ``errno`` is always EINVAL."""

    errno = EINVAL


def parse_command(line: str, table: dict[str, tuple[tuple[str, ...], frozenset[str]]]
                  ) -> tuple[str, dict[str, str]]:
    """Split one command line into ``(name, arguments)``.

    ``arguments`` maps each positional name and each given ``--option`` to its string value.
    Raises :class:`ProtocolError` (EINVAL) for an unknown command, a missing or extra
    argument, an unknown, repeated or missing required option (:data:`REQUIRED_OPTIONS`), or
    unbalanced quotes.
    """
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise ProtocolError(f"cannot split command {line.strip()!r}: {exc}") from None
    if not words:
        raise ProtocolError("empty command")
    name, rest = words[0], words[1:]
    if name not in table:
        raise ProtocolError(f"unknown command {name!r}; expected one of {', '.join(sorted(table))}")
    positional, options = table[name]
    args: dict[str, str] = {}
    values: list[str] = []
    i = 0
    while i < len(rest):
        word = rest[i]
        if word.startswith("--"):
            option = word[2:]
            if option not in options:
                raise ProtocolError(f"{name}: unknown option {word!r}")
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
    args.update(zip(positional, values))
    return name, args


def yes_no(command: str, option: str, value: str | None) -> bool:
    """The boolean of a yes/no option (absent: no); ProtocolError (EINVAL) for another word."""
    if value in (None, NO, YES):
        return value == YES
    raise ProtocolError(f"{command}: option --{option} takes {YES} or {NO}, not {value!r}")


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


def parse_count(text: str, what: str, minimum: int = 1) -> int:
    """A whole number >= ``minimum`` given as option ``what``; ProtocolError otherwise."""
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ProtocolError(f"{what} must be a whole number >= {minimum}, not {text!r}")
    return value


def parse_seconds_ns(text: str, what: str) -> int:
    """A duration in seconds (decimals allowed) given as option ``what``, in ns;
    ProtocolError otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1e9:
        raise ProtocolError(f"{what} must be seconds >= 0, not {text!r}")
    return int(value * 1e9)


def parse_verify_mode(mode: str) -> str:
    """``"root"`` or ``"deep"``; ProtocolError otherwise."""
    if mode not in VERIFY_MODES:
        raise ProtocolError(f"verification mode must be one of {', '.join(VERIFY_MODES)}, "
                            f"not {mode!r}")
    return mode


def check_pool(name: str | None, size: int) -> str:
    """The pool name to use (``name``, or a new ``pool-<8 hex>``); ProtocolError for a name
    not matching :data:`POOL_NAME_RE` or a size outside 1..:data:`MAX_POOL_SIZE`."""
    if not 1 <= size <= MAX_POOL_SIZE:
        raise ProtocolError(f"pool size must be 1 to {MAX_POOL_SIZE}, not {size}")
    name = name or f"pool-{secrets.token_hex(4)}"
    if not POOL_NAME_RE.fullmatch(name):
        raise ProtocolError(f"pool name {name!r} must match {POOL_NAME_RE.pattern}")
    return name


def member_name(pool: str) -> str:
    """A new execution id for a member of pool ``pool``: ``<pool>-<8 hex>``."""
    return f"{pool}-{secrets.token_hex(4)}"
