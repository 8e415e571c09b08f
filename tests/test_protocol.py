"""The control protocol, and the client and CLI code that needs no mount.

A "fake mount" here is a plain directory holding ``.ramet/status`` and execution control
files as regular files: enough for everything that only reads them.
"""

from __future__ import annotations

import errno
import itertools
import json
import pickle
import random
import shlex
import time

import pytest
from click.testing import CliRunner

import rametfs
from rametfs import Execution, Ramet, RametError, errors, protocol
from rametfs.cli import EXIT_CODES, exit_code, human_age, human_bytes, main
from rametfs.client import NotMountedError, PoolTimeout
from rametfs.protocol import EXECUTION_COMMANDS, ROOT_COMMANDS, ProtocolError

ID_A = "a" * 64
ID_B = "ab" + "b" * 62
ID_C = "c" * 64
DAY_NS = 86400 * 10**9


# ----- parse_command / format_command --------------------------------------------------------

@pytest.mark.parametrize(("name", "positional", "options", "line", "args"), [
    ("snapshot", ("/src/my project",), {"label": "it's", "message": None},
     "snapshot '/src/my project' --label 'it'\"'\"'s'\n",
     {"path": "/src/my project", "label": "it's"}),
    ("create", (ID_A[:8],), {"name": "run-1"},
     "create aaaaaaaa --name run-1\n", {"snapshot": ID_A[:8], "name": "run-1"}),
    ("create", (ID_A[:8], "--name", "run 1"), {},
     "create aaaaaaaa --name 'run 1'\n", {"snapshot": ID_A[:8], "name": "run 1"}),
    ("release", ("run-1",), {}, "release run-1\n", {"execution": "run-1"}),
    ("promote", (), {"label": "--not-an-option", "message": "two\nlines $HOME \\ ; |"},
     "promote --label --not-an-option --message 'two\nlines $HOME \\ ; |'\n",
     {"label": "--not-an-option", "message": "two\nlines $HOME \\ ; |"}),
    ("checkpoint", (), {"label": "", "message": "é ✓"},
     "checkpoint --label '' --message 'é ✓'\n", {"label": "", "message": "é ✓"}),
    ("reset", (), {}, "reset\n", {}),
])
def test_format_then_parse_round_trips(name, positional, options, line, args):
    table = EXECUTION_COMMANDS if name in EXECUTION_COMMANDS else ROOT_COMMANDS
    assert protocol.format_command(name, *positional, **options) == line
    assert protocol.parse_command(line, table) == (name, args)


@pytest.mark.parametrize(("line", "table", "message"), [
    ("", ROOT_COMMANDS, "empty command"),
    ("  \n", EXECUTION_COMMANDS, "empty command"),
    ("frobnicate x", ROOT_COMMANDS,
     "unknown command 'frobnicate'; expected one of acquire, cancel, checkpoint, create, diff, "
     "drop, fault, forget, gc, name, pool, preview, promote, publish, release, renew, reset, "
     "resolve, return, "
     "rm, runtime, snapshot, snapshot-git, status, unname, verify"),
    ("promote", ROOT_COMMANDS, "promote: expected <execution>, got 0 argument(s)"),
    ("status", EXECUTION_COMMANDS,
     "unknown command 'status'; expected one of checkpoint, preview, promote, reset, verify"),
    ("create", ROOT_COMMANDS, "create: expected <snapshot>, got 0 argument(s)"),
    ("create a b", ROOT_COMMANDS, "create: expected <snapshot>, got 2 argument(s)"),
    ("reset now", EXECUTION_COMMANDS, "reset: expected no arguments, got 1 argument(s)"),
    ("create abcdefgh --label x", ROOT_COMMANDS, "create: unknown option '--label'"),
    ("promote --label", EXECUTION_COMMANDS, "promote: option '--label' needs a value"),
    ("promote --label a --label b", EXECUTION_COMMANDS,
     "promote: option '--label' given twice"),
    ("snapshot '/src", ROOT_COMMANDS,
     "cannot split command \"snapshot '/src\": No closing quotation"),
])
def test_parse_command_rejects_with_einval(line, table, message):
    with pytest.raises(ProtocolError) as caught:
        protocol.parse_command(line, table)
    assert (caught.value.errno, str(caught.value)) == (errno.EINVAL, message)


def test_replies_encode_as_one_json_line():
    assert protocol.encode_reply({"snapshot": ID_A[:8], "ok": True}) == \
        b'{"ok": true, "snapshot": "aaaaaaaa"}\n'
    assert protocol.decode_reply(b'{"errno": 2, "error": "no such", "ok": false}\n') == \
        {"ok": False, "errno": 2, "error": "no such"}
    assert protocol.decode_reply(b"") == {}


# ----- client ---------------------------------------------------------------------------------

@pytest.fixture
def fake_mount(tmp_path):
    """A directory that looks like a mount to readers: root status, one execution's files."""
    now = time.time_ns()
    snapshots = [
        {"id": ID_A, "label": "clean", "message": "first import", "parents": [],
         "created_ns": now - 10 * DAY_NS - 3600 * 10**9, "tree": "d" * 64,
         "source": "/src", "files": 3, "bytes": 1536},
        {"id": ID_B, "label": None, "message": None, "parents": [ID_A],
         "created_ns": now - 3 * DAY_NS - 3600 * 10**9, "tree": "d" * 64,
         "source": None, "files": 4, "bytes": 10 << 20},
        {"id": ID_C, "label": "fix", "message": "try 2", "parents": [ID_B],
         "created_ns": now - 2 * DAY_NS - 3600 * 10**9, "tree": "e" * 64,
         "source": None, "files": 4, "bytes": 512},
    ]
    executions = [{"id": "run-1", "base": ID_A, "head": ID_C,
                   "created_ns": now - DAY_NS - 60 * 10**9, "upper_bytes": 2048,
                   "state": "ready", "owner": 1000, "group": 100, "share": "0750",
                   "control": "read"}]
    root = {"mode": "fuse", "pid": 1, "data": "/data", "mount": str(tmp_path), "version": "0.1.0",
            "open_less": True, "snapshots": snapshots, "executions": executions,
            "last": None}
    (tmp_path / ".ramet").mkdir()
    (tmp_path / ".ramet" / "status").write_text(json.dumps(root))
    control = tmp_path / "executions" / "run-1" / ".ramet"
    control.mkdir(parents=True)
    (control / "diff").write_text('A "dir/new file"\nD gone\nM src/main.py\n')
    (control / "status").write_text(json.dumps({"execution": "run-1", "base": ID_A}))
    return tmp_path


def test_ramet_needs_a_live_mount(tmp_path, monkeypatch):
    monkeypatch.delenv("RAMET_MOUNT", raising=False)
    with pytest.raises(RametError) as caught:
        Ramet()
    assert (caught.value.errno, str(caught.value)) == (
        errno.EINVAL, "no mountpoint given and $RAMET_MOUNT is not set")
    monkeypatch.setenv("RAMET_MOUNT", str(tmp_path))
    with pytest.raises(NotMountedError) as caught:
        Ramet()
    assert (caught.value.errno, str(caught.value)) == (
        errno.ENOTCONN, f"no rametfs mounted at {tmp_path}")


def test_ramet_reads_status_and_execution_files(fake_mount):
    ramet = Ramet(fake_mount)
    assert [s["id"] for s in ramet.snapshots()] == [ID_A, ID_B, ID_C]
    assert [e["id"] for e in ramet.executions()] == ["run-1"]
    execution = ramet.execution("run-1")
    assert execution == Execution(ramet, "run-1")
    assert execution.path == fake_mount / "executions" / "run-1"
    assert execution.diff() == [("A", "dir/new file"), ("D", "gone"), ("M", "src/main.py")]
    assert execution.status() == {"execution": "run-1", "base": ID_A}


def test_unknown_execution_is_enoent(fake_mount):
    with pytest.raises(RametError) as caught:
        Ramet(fake_mount).execution("nope").reset()
    assert (caught.value.errno, str(caught.value)) == (
        errno.ENOENT, f"no execution 'nope' at {fake_mount}")


def test_pool_timeout_is_a_timeout_and_a_ramet_error():
    error = PoolTimeout(errno.EBUSY, "busy")
    assert isinstance(error, TimeoutError) and isinstance(error, RametError)
    assert (error.errno, error.strerror, str(error)) == (errno.EBUSY, "busy", "busy")


# ----- typed commands: parse / format ------------------------------------------------------

ROUND_TRIPS = [
    (protocol.ROOT, "snapshot /a --label x --on-change skip\n",
     protocol.Snapshot("/a", "x", "", "skip")),
    (protocol.ROOT, "snapshot-git /r --rev v1 --gitdir yes\n",
     protocol.SnapshotGit("/r", "v1", True)),
    (protocol.ROOT, "create aaaaaaaa --name e --policy none --owner 1 --group 2 --share 0750 "
     "--control read --max-bytes 10 --max-inodes 5\n",
     protocol.Create("aaaaaaaa", "e", "none", protocol.Access(1, 2, 0o750, "read", 10, 5))),
    (protocol.ROOT, "create aaaaaaaa\n", protocol.Create("aaaaaaaa")),
    (protocol.ROOT, "release e\n", protocol.Release("e")),
    (protocol.ROOT, "runtime e docker --uid 1000 --gid 100 --image python:3.11\n",
     protocol.Runtime("e", "docker", 1000, 100, "python:3.11")),
    (protocol.ROOT, "pool aaaaaaaa --size 2 --name p --keep-last 3 --control none\n",
     protocol.Pool("aaaaaaaa", 2, "p", None, 3, protocol.Access(control="none"))),
    (protocol.ROOT, "acquire p --holder h --ttl 0.25 --pid 7 --host box\n",
     protocol.Acquire("p", "h", 250_000_000, 7, "box")),
    (protocol.ROOT, "renew e --holder h --ttl 30.000000001\n",
     protocol.Renew("e", "h", 30_000_000_001)),
    (protocol.ROOT, "return e --holder h --verify deep\n", protocol.Return("e", "h", "deep")),
    (protocol.ROOT, "drop p\n", protocol.Drop("p")),
    (protocol.ROOT, "fault capture.hash --execution e --count 0\n",
     protocol.Fault("capture.hash", "e", 0)),
    (protocol.ROOT, "cancel\n", protocol.Cancel()),
    (protocol.ROOT, "cancel --execution e\n", protocol.Cancel("e")),
    (protocol.ROOT, "name main aaaaaaaa\n", protocol.Name("main", "aaaaaaaa")),
    (protocol.ROOT, "unname main\n", protocol.Unname("main")),
    (protocol.ROOT, "resolve main\n", protocol.Resolve("main")),
    (protocol.ROOT, "rm main --force yes\n", protocol.Rm("main", True)),
    (protocol.ROOT, "gc --dry-run yes\n", protocol.Gc(True)),
    (protocol.ROOT, "forget --keep-last 2 --keep-within 1y2m --keep-name 'rel/*' --dry-run yes\n",
     protocol.Forget(2, protocol.Duration(years=1, months=2), "rel/*", True)),
    (protocol.ROOT, "publish main\n", protocol.Publish("main")),
    (protocol.ROOT, "diff e\n", protocol.Diff("e")),
    (protocol.ROOT, "status e\n", protocol.Status("e")),
    (protocol.ROOT, "promote e --label l --message 'm n' --policy tree --publish yes\n",
     protocol.Promote("e", "l", "m n", "tree", True)),
    (protocol.ROOT, "checkpoint e\n", protocol.Checkpoint("e")),
    (protocol.ROOT, "reset e --to aaaaaaaa\n", protocol.Reset("e", "aaaaaaaa")),
    (protocol.ROOT, "verify e --mode deep\n", protocol.Verify("e", "deep")),
    (protocol.ROOT, "preview e --policy none\n", protocol.Preview("e", "none")),
    (protocol.EXECUTION, "promote --label x\n", protocol.Promote(label="x")),
    (protocol.EXECUTION, "reset --base yes\n", protocol.Reset(base=True)),
    (protocol.EXECUTION, "verify\n", protocol.Verify()),
    (protocol.EXECUTION, "preview\n", protocol.Preview()),
]


def test_every_command_has_a_round_trip_here():
    assert {type(c) for _, _, c in ROUND_TRIPS} == set(protocol.COMMANDS.values())


@pytest.mark.parametrize(("scope", "line", "command"), ROUND_TRIPS,
                         ids=[line.strip() for _, line, _ in ROUND_TRIPS])
def test_parse_and_format_round_trip(scope, line, command):
    assert protocol.parse(line, scope) == command
    assert protocol.format(command) == line


def test_parse_of_format_round_trips_random_values():
    rng = random.Random(7)
    for _ in range(500):
        command = protocol.Acquire(
            "p" + "".join(rng.choice("ab-c ' \"\n$é") for _ in range(rng.randrange(8))),
            rng.choice(["h", "", "a b", "--ttl"]), rng.randrange(10**18), rng.randrange(2**31),
            rng.choice(["", "box", "a'b"]))
        assert protocol.parse(protocol.format(command)) == command
    for ns in (0, 1, 999_999_999, 10**9, 123_456_789_012):
        assert protocol.parse(protocol.format(protocol.Renew("e", "h", ns))).ttl_ns == ns


@pytest.mark.parametrize(("scope", "line", "message"), [
    (protocol.ROOT, "acquire p --holder h --ttl -1", "--ttl must be seconds >= 0, not '-1'"),
    (protocol.ROOT, "acquire p --holder h --ttl soon", "--ttl must be seconds >= 0, not 'soon'"),
    (protocol.ROOT, "acquire p --holder h --ttl nan", "--ttl must be seconds >= 0, not 'nan'"),
    (protocol.ROOT, "renew e --holder h --ttl 1e9", "--ttl must be seconds >= 0, not '1e9'"),
    (protocol.ROOT, "acquire p --holder h --ttl 1 --pid -2",
     "--pid must be a whole number >= 0, not '-2'"),
    (protocol.ROOT, "acquire p --ttl 1", "acquire: missing --holder"),
    (protocol.ROOT, "pool s --size 0", "--size must be a whole number >= 1, not '0'"),
    (protocol.ROOT, "pool s --size many", "--size must be a whole number >= 1, not 'many'"),
    (protocol.ROOT, "pool s --size 4097", "pool size must be 1 to 4096, not 4097"),
    (protocol.ROOT, "pool s --size 1 --name -p",
     "pool name '-p' must match [A-Za-z0-9][A-Za-z0-9._-]{0,47}"),
    (protocol.ROOT, "pool s --size 1 --keep-last 0",
     "--keep-last must be a whole number >= 1, not '0'"),
    (protocol.ROOT, "create s --name ''",
     "create: execution name '' must match [A-Za-z0-9][A-Za-z0-9._-]{0,63}"),
    (protocol.ROOT, "create s --share 0644", "--share must be octal permission bits that give "
     "the owner rwx (0700 to 0777), not '0644'"),
    (protocol.ROOT, "create s --share rwx", "--share must be octal permission bits that give "
     "the owner rwx (0700 to 0777), not 'rwx'"),
    (protocol.ROOT, "create s --owner -1", "--owner must be a numeric id below 4294967295, "
     "not '-1'"),
    (protocol.ROOT, "create s --group 4294967295", "--group must be a numeric id below "
     "4294967295, not '4294967295'"),
    (protocol.ROOT, "create s --control write",
     "--control must be one of full, read, none, not 'write'"),
    (protocol.ROOT, "create s --max-bytes 0",
     "--max-bytes must be a whole number from 1 to 2**63 - 1, not '0'"),
    (protocol.ROOT, "create s --max-inodes 9223372036854775808",
     "--max-inodes must be a whole number from 1 to 2**63 - 1, not '9223372036854775808'"),
    (protocol.ROOT, "snapshot /a --on-change ignore",
     "--on-change must be one of fail, skip, not 'ignore'"),
    (protocol.ROOT, "snapshot /a --label " + "x" * 257,
     "snapshot: --label is at most 256 bytes, not 257"),
    (protocol.ROOT, "snapshot-git /r --gitdir maybe",
     "snapshot-git: option --gitdir takes yes or no, not 'maybe'"),
    (protocol.ROOT, "rm s --force 1", "rm: option --force takes yes or no, not '1'"),
    (protocol.ROOT, "gc --compact no --dry-run Yes",
     "gc: option --dry-run takes yes or no, not 'Yes'"),
    (protocol.ROOT, "forget --keep-within 2h30m", "bad duration '2h30m': give whole numbers of "
     "y (years), m (months), d (days) and h (hours), in that order, each at most 1000 and not "
     "all zero, as restic does: 7d, 36h, 1y2m (m is months, so 2h30m is not a duration)"),
    (protocol.ROOT, "return e --holder h --verify shallow",
     "verification mode must be one of root, deep, not 'shallow'"),
    (protocol.ROOT, "verify e --mode quick",
     "verification mode must be one of root, deep, not 'quick'"),
    (protocol.ROOT, "fault site --count -1", "--count must be a whole number >= 0, not '-1'"),
    (protocol.ROOT, "runtime e firecracker --uid 1 --gid 1",
     "runtime: the sandbox is one of bubblewrap, docker, not 'firecracker'"),
    (protocol.ROOT, "runtime e bubblewrap --uid 0 --gid 5",
     "runtime: bubblewrap never runs as root: --uid 0"),
    (protocol.ROOT, "runtime e docker --uid 1 --gid 4294967295",
     "runtime: --gid must be below 4294967295, not 4294967295"),
    (protocol.ROOT, "runtime e docker --uid 1 --gid 1",
     "runtime: --image is needed for docker, and only for docker"),
    (protocol.ROOT, "runtime e docker --uid 1 --gid 1 --image 'a b'",
     "runtime: image 'a b' must match [A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}"),
    (protocol.ROOT, "reset e --to s --base yes",
     "reset: --to SNAPSHOT and --base yes name two snapshots; give one"),
    (protocol.ROOT, "promote --label x", "promote: expected <execution>, got 0 argument(s): on "
     "the root ctl, promote names its execution first (promote <execution-id> ...); an "
     "execution's own .ramet/ctl takes promote alone"),
    (protocol.EXECUTION, "diff", "diff: read this execution's .ramet/diff instead"),
    (protocol.EXECUTION, "create s", "create: a command of the root .ramet/ctl, at the top of "
     "the mount (the harness's), not of an execution's; this one takes checkpoint, preview, "
     "promote, reset, verify"),
    (protocol.EXECUTION, "promote --publish maybe",
     "promote: option --publish takes yes or no, not 'maybe'"),
])
def test_parse_refuses_each_bad_value_with_einval_naming_it(scope, line, message):
    with pytest.raises(ProtocolError) as caught:
        protocol.parse(line, scope)
    assert (type(caught.value), caught.value.errno, str(caught.value)) == (
        errors.InvalidArgument, errno.EINVAL, message)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: protocol.Acquire("p", "h", -10**9), "--ttl must be seconds >= 0, not '-1'"),
    (lambda: protocol.Renew("e", "h", 10**18), "--ttl must be seconds >= 0, not '1000000000'"),
    (lambda: protocol.Acquire("p", "h", 1, pid=-1), "--pid must be a whole number >= 0, "
     "not '-1'"),
    (lambda: protocol.Pool("s", 0), "--size must be a whole number >= 1, not '0'"),
    (lambda: protocol.Access(share=0o1777), "--share must be octal permission bits that give "
     "the owner rwx (0700 to 0777), not '1777'"),
    (lambda: protocol.Create("s", "a/b"),
     "create: execution name 'a/b' must match [A-Za-z0-9][A-Za-z0-9._-]{0,63}"),
    (lambda: protocol.Rm("s", "yes"), "rm: option --force takes yes or no, not \"'yes'\""),
    (lambda: protocol.Verify("e", "fast"),
     "verification mode must be one of root, deep, not 'fast'"),
    (lambda: protocol.Promote("e", label="é" * 129),
     "promote: --label is at most 256 bytes, not 258"),
    (lambda: protocol.Duration(), protocol._bad_duration("")),
])
def test_a_command_built_with_a_bad_value_is_refused_as_parse_refuses_it(build, message):
    with pytest.raises(ProtocolError) as caught:
        build()
    assert (caught.value.errno, str(caught.value)) == (errno.EINVAL, message)


# ----- errors ---------------------------------------------------------------------------------

def test_one_error_hierarchy_built_errno_first_of_the_class_of_its_errno():
    for err, cls, code in [(errno.EINVAL, errors.InvalidArgument, 4),
                           (errno.ENOENT, errors.NotFound, 3), (errno.EBUSY, errors.Busy, 5),
                           (errno.ENOSPC, errors.NoSpace, 6), (errno.EEXIST, errors.Exists, 8),
                           (errno.EACCES, errors.Denied, 9),
                           (errno.ECANCELED, errors.Cancelled, 1),
                           (errno.EROFS, errors.ReadOnly, 1), (errno.EIO, RametError, 1),
                           (errno.EDQUOT, RametError, 1)]:
        built = RametError(err, "why")
        for exc in (built, pickle.loads(pickle.dumps(built))):
            assert (type(exc), exc.errno, exc.strerror, str(exc), exc.exit_code, exc.args) == (
                cls, err, "why", "why", code, (err, "why"))
            assert isinstance(exc, OSError) and isinstance(exc, RametError)
        alone = cls("why")
        assert (type(alone), alone.errno, str(alone)) == (cls, cls.code, "why")
    assert (RametError("why").errno, errors.NotFound("x").exit_code) == (errno.EIO, 3)
    assert rametfs.RametError is RametError is errors.RametError
    assert protocol.ProtocolError is errors.ProtocolError is errors.InvalidArgument
    assert (errors.fs_error(errno.ENOTEMPTY).errno, str(errors.fs_error(errno.ENOTEMPTY))) == (
        errno.ENOTEMPTY, "ENOTEMPTY")


# ----- CLI ------------------------------------------------------------------------------------

def test_exit_code_table():
    assert EXIT_CODES == {errno.ENOENT: 3, errno.EINVAL: 4, errno.EBUSY: 5, errno.ENOSPC: 6,
                          errno.ENOTCONN: 7, errno.EEXIST: 8, errno.EACCES: 9}
    assert [exit_code(e) for e in (errno.EIO, errno.ETIMEDOUT, None)] == [1, 1, 1]


def run(*args, env=None):
    return CliRunner(env={"RAMET_MOUNT": None, **(env or {})}).invoke(main, list(args))


def test_cli_without_mount_exits_7():
    result = run("status", "-m", "/nonexistent")
    assert (result.exit_code, result.stdout, result.stderr) == (
        7, "", "rametfs: no rametfs mounted at /nonexistent\n")
    result = run("ls", env={"RAMET_MOUNT": "/nonexistent"})
    assert (result.exit_code, result.stderr) == (
        7, "rametfs: no rametfs mounted at /nonexistent\n")
    result = run("umount", "/nonexistent")
    assert (result.exit_code, result.stderr) == (
        7, "rametfs: no rametfs mounted at /nonexistent\n")


def test_cli_usage_errors_exit_2():
    assert run("status").exit_code == 2  # no -m and no $RAMET_MOUNT
    assert run("frobnicate").exit_code == 2
    assert run("serve", "/mnt").exit_code == 2  # --data is required


def test_cli_errors_map_errno_to_exit_code(fake_mount):
    mount = str(fake_mount)
    result = run("diff", "nope", "-m", mount)
    assert (result.exit_code, result.stderr) == (
        3, f"rametfs: no execution 'nope' at {mount}\n")
    # log resolves its snapshot in the daemon (tests/test_lifecycle.py): no ctl here.


def test_cli_diff_status_log_ls(fake_mount):
    mount = str(fake_mount)
    assert run("diff", "run-1", "-m", mount).stdout == \
        'A "dir/new file"\nD gone\nM src/main.py\n'
    assert json.loads(run("status", "run-1", "-m", mount).stdout) == \
        {"execution": "run-1", "base": ID_A}
    assert run("ls", "-m", mount).stdout == (
        f"mount: {mount}  mode: open-less\n"
        "\n"
        "SNAPSHOT      TREE          NAMES  LABEL  FILES  BYTES  AGE\n"
        "aaaaaaaaaaaa  dddddddddddd  -      clean  3      1.5K   10d\n"
        "abbbbbbbbbbb  dddddddddddd  -             4      10M    3d\n"
        "cccccccccccc  eeeeeeeeeeee  -      fix    4      512B   2d\n"
        "\n"
        "EXECUTION  BASE          HEAD          UPPER  AGE  ACCESS\n"
        "run-1      aaaaaaaaaaaa  cccccccccccc  2.0K   1d   1000:100/0750/read\n")
    listing = json.loads(run("ls", "--json", "-m", mount).stdout)
    assert (sorted(listing), len(listing["snapshots"]), listing["executions"][0]["id"]) == (
        ["executions", "mode", "open_less", "snapshots"], 3, "run-1")


@pytest.mark.parametrize(("n", "text"), [
    (0, "0B"), (1023, "1023B"), (1024, "1.0K"), (1536, "1.5K"), (10 << 10, "10K"),
    (10 << 20, "10M"), (5 << 40, "5.0T"), (3 << 50, "3072T"),
])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


@pytest.mark.parametrize(("seconds", "text"), [
    (-5, "0s"), (0, "0s"), (59, "59s"), (60, "1m"), (3599, "59m"), (3600, "1h"),
    (86399, "23h"), (3 * 86400, "3d"),
])
def test_human_age(seconds, text):
    assert human_age(seconds * 10**9) == text


def test_split_command_splits_as_shlex_split():
    """protocol.split_command gives shlex.split's words, or fails where it fails (with its
    words for why), on every string of these characters up to 6 long and 20,000 random
    ones up to 40."""
    def split(split_fn, text):
        try:
            return split_fn(text)
        except (ValueError, protocol.ProtocolError) as exc:
            return str(exc).rsplit(": ", 1)[-1]

    alphabet = "a \\'\"\n\t"
    rng = random.Random(15)
    texts = ["".join(t) for n in range(7) for t in itertools.product(alphabet, repeat=n)]
    texts += ["".join(rng.choice(alphabet + "b#;é") for _ in range(rng.randrange(41)))
              for _ in range(20_000)]
    for text in texts:
        assert split(protocol.split_command, text) == split(shlex.split, text), repr(text)


def test_split_command_is_bounded_in_parts():
    assert protocol.split_command("a " * 2048) == ["a"] * 2048  # 4,096 parts
    with pytest.raises(protocol.ProtocolError, match="at most 4096 parts"):
        protocol.split_command("a " * 2048 + "b")
    word = "x" * (protocol.MAX_COMMAND_BYTES - 20)
    assert protocol.split_command(f"promote --label '{word}'") == ["promote", "--label", word]
