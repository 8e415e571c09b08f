"""The control protocol, and the client and CLI code that needs no mount.

A "fake mount" here is a plain directory holding ``.ramet/status`` and execution control
files as regular files: enough for everything that only reads them.
"""

from __future__ import annotations

import errno
import itertools
import json
import random
import shlex
import time

import pytest
from click.testing import CliRunner

from rametfs import Execution, Ramet, RametError, protocol
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
