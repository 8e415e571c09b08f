"""Who may do what (docs/security.md, "Authority"): the harness's choice of an execution's
control (``--control full|read|none``), owners and share modes, what an execution's files show.

Through the real mount: sandboxes are bubblewrap (uid 65534) on a daemon served with
``--allow-other``; other local users are processes of other uids (``subprocess`` ``user=``)
whose working directory is the mountpoint (pytest's temporary directories are 0700: the
process changes directory as root, then drops to its uid).  Every probe reports the errno
name or what it read, so each case asserts the exact outcome.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import stat
import statistics
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks.fuse_trace import FuseTrace
from benchmarks.systems import Unsupported
from conftest import ctl_command, require_bwrap
from rametfs import Ramet, RametError, protocol
from rametfs.authority import Access, Caller, R, ReadIndex
from rametfs.cli import main
from rametfs.sandbox import Bubblewrap
from test_snapshots import write_tree

NOBODY = 65534  # the sandbox's uid
OWNER, OTHER, MEMBER = 61001, 61002, 61003  # local users with no passwd entry
GROUP = 61500
SECRET = b"DB_PASS=pw4821\n"

# Run as another uid (or in a sandbox): each operation's result, or its errno's name.
PROBE = r"""
import errno, json, os, sys
out = {}
for name, op, path, arg in json.loads(sys.argv[1]):
    try:
        if op == "read":
            with open(path, "rb") as f:
                out[name] = f.read().decode(errors="replace")
        elif op == "command":  # one command written to a ctl file, then its reply read back
            fd = os.open(path, os.O_RDWR)
            try:
                os.write(fd, arg.encode())
                out[name] = os.pread(fd, 1 << 20, 0).decode()
            finally:
                os.close(fd)
        elif op == "truncate-write":  # as the shell's `echo x > path`
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, arg.encode())
                out[name] = "ok"
            finally:
                os.close(fd)
        elif op == "list":
            out[name] = sorted(os.listdir(path))
        elif op == "stat":
            os.stat(path)
            out[name] = "ok"
        elif op == "mkdir":
            os.mkdir(path)
            out[name] = "ok"
    except OSError as exc:
        out[name] = errno.errorcode[exc.errno]
print(json.dumps(out))
"""


def probe_argv(ops: list[tuple[str, str, str, str]]) -> list[str]:
    return ["/usr/bin/python3", "-c", PROBE, json.dumps(ops)]


def as_uid(mnt: Path, ops, uid: int, gid: int | None = None, groups: tuple[int, ...] = ()
           ) -> dict:
    """Run :data:`PROBE` as ``uid``:``gid`` (and supplementary ``groups``), working directory
    the mountpoint; paths in ``ops`` are relative to it."""
    proc = subprocess.run(probe_argv(ops), cwd=mnt, user=uid, group=uid if gid is None else gid,
                          extra_groups=list(groups), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def in_sandbox(execution, ops, **options) -> dict:
    """Run :data:`PROBE` in a bubblewrap sandbox (uid 65534) on ``execution``."""
    result = Bubblewrap(**options).run(execution, probe_argv(ops), timeout=60)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def control(path: Path, name: str) -> Path:
    return path / protocol.CONTROL_DIR / name


@pytest.fixture(scope="module")
def mnt(allow_other_daemon) -> Path:
    return allow_other_daemon.mnt


@pytest.fixture(scope="module")
def harness(mnt) -> Ramet:
    return Ramet(mnt)


@pytest.fixture(scope="module")
def base(harness, tmp_path_factory) -> str:
    """A tree owned by the sandbox's uid: README, pkg/mod.py."""
    src = write_tree(tmp_path_factory.mktemp("src") / "src",
                     {"README": b"base\n", "pkg/mod.py": b"X = 1\n"})
    for path in (src, src / "README", src / "pkg", src / "pkg" / "mod.py"):
        os.chown(path, NOBODY, NOBODY)
    return harness.snapshot(src)


@pytest.fixture
def made(harness):
    """``made(snapshot, **settings) -> Execution``; released at teardown."""
    executions = []

    def make(snapshot: str, **settings):
        executions.append(harness.create(snapshot, **settings))
        return executions[-1]

    yield make
    for ex in executions:
        harness.release(ex)


def snapshot_ids(ramet: Ramet) -> set[str]:
    return {s["id"] for s in ramet.snapshots()}


# ----- 1. control capabilities are the harness's choice ---------------------------------------

WRITES = [("ctl promote", "command", "/workspace/.ramet/ctl", "promote\n"),
          ("checkpoint", "command", "/workspace/.ramet/ctl", "checkpoint\n"),
          ("reset", "command", "/workspace/.ramet/ctl", "reset\n"),
          ("echo-promote", "truncate-write", "/workspace/.ramet/ctl", "promote\n"),
          ("promote-file", "truncate-write", "/workspace/.ramet/promote", "x\n")]
READS = [(name, "read", f"/workspace/.ramet/{name}", "")  # names apart from WRITES's
         for name in ("status", "diff", "preview", "error", "promote", "ctl")]


def test_control_read_keeps_the_files_readable_and_refuses_every_write(harness, base, made):
    require_bwrap()
    ex = made(base, owner=NOBODY, control="read")
    (ex.path / "made").write_text("by the harness\n")
    before = snapshot_ids(harness)
    seen = in_sandbox(ex, WRITES + READS)
    assert {name: seen[name] for name, *_ in WRITES} == dict.fromkeys(
        (name for name, *_ in WRITES), "EACCES")
    status = json.loads(seen["status"])
    assert (status["base"], status["head"], status["state"]) == (base, base, "ready")
    assert json.loads(seen["preview"])["totals"]["durable"]["files"] == 3
    assert {name: seen[name] for name in ("diff", "error", "promote", "ctl")} == {
        "diff": "A made\n", "error": "", "promote": "", "ctl": ""}
    assert snapshot_ids(harness) == before and ex.status()["head"] == base
    assert (ex.path / "made").read_text() == "by the harness\n"  # no reset happened
    # The kernel refuses the sandbox from the modes; root (which passes them) gets EACCES
    # from the daemon, at the O_TRUNC of `echo cmd > ctl` and at the write.
    ctl = control(ex.path, protocol.CTL)
    assert (stat.filemode(os.stat(ctl).st_mode), os.stat(ctl).st_uid) == ("-r--------", NOBODY)
    with pytest.raises(OSError) as caught:
        ctl_command(ctl, "promote")
    assert caught.value.errno == errno.EACCES
    for name in (protocol.CTL, protocol.PROMOTE):
        with pytest.raises(OSError) as caught:
            os.open(control(ex.path, name), os.O_WRONLY | os.O_TRUNC)
        assert caught.value.errno == errno.EACCES
    assert snapshot_ids(harness) == before


def test_control_full_lets_its_owner_promote_itself(harness, base, made):
    require_bwrap()
    ex = made(base, owner=NOBODY)
    seen = in_sandbox(ex, [("promote", "command", "/workspace/.ramet/ctl", "promote\n"),
                           ("promoted", "read", "/workspace/.ramet/promote", "")])
    reply = json.loads(seen["promote"])
    assert reply["ok"] and seen["promoted"] == reply["snapshot"] + "\n"
    assert ex.status()["head"] == reply["snapshot"]


def test_control_none_hides_ramet(harness, base, made):
    require_bwrap()
    ex = made(base, owner=NOBODY, control="none")
    seen = in_sandbox(ex, [("stat", "stat", "/workspace/.ramet", ""),
                           ("status", "read", "/workspace/.ramet/status", ""),
                           ("promote", "command", "/workspace/.ramet/ctl", "promote\n"),
                           ("mkdir", "mkdir", "/workspace/.ramet", ""),
                           ("list", "list", "/workspace", "")])
    assert seen == {"stat": "ENOENT", "status": "ENOENT", "promote": "ENOENT",
                    "mkdir": "EEXIST", "list": ["README", "pkg"]}
    with pytest.raises(FileNotFoundError):
        os.stat(control(ex.path, ""))  # for the harness too: it uses the root ctl


@pytest.mark.parametrize("choice", ["read", "none"])
def test_the_harness_acts_through_the_root_ctl_whatever_the_control(harness, base, made,
                                                                   choice):
    ex = made(base, control=choice)
    (ex.path / "new").write_text("n\n")
    assert ex.diff() == [("A", "new")]
    assert ex.preview()["totals"]["durable"]["files"] == 3
    checkpoint = ex.checkpoint(label="c")
    promoted = ex.promote(label="p")
    status = ex.status()
    assert (status["head"], status["control"], status["last"]["snapshot"]) == (
        promoted, choice, promoted)
    assert checkpoint in snapshot_ids(harness)
    assert ex.verify() == [] and ex.diff() == []  # against the head: the promote
    assert ex.reset(base=True) == base and ex.diff() == [] and ex.verify() == []
    assert not (ex.path / "new").exists()

    def cli(*args):
        return CliRunner(env={"RAMET_MODE": None}).invoke(main, [args[0], "-m", str(harness.mount),
                                                                 *args[1:]])
    (ex.path / "cli").write_text("c\n")
    assert cli("diff", ex.id).stdout == "A cli\n"
    by_cli = cli("promote", ex.id).stdout.strip()
    assert json.loads(cli("status", ex.id).stdout)["head"] == by_cli
    assert cli("reset", ex.id).exit_code == 0 and ex.diff() == []


def test_root_commands_on_one_execution(allow_other_daemon, base, made):
    d = allow_other_daemon
    ex = made(base, control="none")
    (ex.path / "new").write_text("n\n")
    (ex.path / os.fsdecode(b"\xff")).write_bytes(b"not UTF-8\n")
    assert d.ctl(f"diff {ex.id}") == {"ok": True, "execution": ex.id,
                                      "diff": [["A", "new"], ["A", os.fsdecode(b"\xff")]]}
    status = d.ctl(f"status {ex.id}")["status"]
    assert (status["id"], status["owner"], status["share"], status["control"], status["path"]) == (
        ex.id, os.getuid(), "0700", "none", str(ex.path))
    checkpoint = d.ctl(f"checkpoint {ex.id} --label 'by root'")
    assert {"new_chunks", "new_chunk_bytes", "capture_ms"} <= set(checkpoint["stats"])
    assert d.ctl(f"preview {ex.id}")["preview"]["totals"]["durable"]["files"] == 4
    verify = d.ctl(f"verify {ex.id} --mode deep")
    assert verify["verification"]["differences"] == [["A", "new"], ["A", os.fsdecode(b"\xff")]]
    promoted = d.ctl(f"promote {ex.id} --message m")["snapshot"]
    assert d.ctl(f"status {ex.id}")["status"]["head"] == promoted
    reset = d.ctl(f"reset {ex.id}")
    assert (reset["ok"], reset["snapshot"], d.ctl(f"diff {ex.id}")["diff"]) == (True, promoted,
                                                                                 [])
    for line, err, message in [
            ("promote no-such-execution", errno.ENOENT, "no execution 'no-such-execution'"),
            ("status no-such-execution", errno.ENOENT, "no execution 'no-such-execution'"),
            ("reset", errno.EINVAL, "reset: expected <execution>, got 0 argument(s): on the "
             "root ctl, reset names its execution first (reset <execution-id> ...); an "
             "execution's own .ramet/ctl takes reset alone"),
            (f"diff {ex.id} --mode deep", errno.EINVAL, "diff: unknown option '--mode'")]:
        with pytest.raises(OSError) as caught:
            d.ctl(line)
        assert (caught.value.errno, caught.value.reply["error"]) == (err, message)


def test_a_ctl_held_open_acts_on_no_later_execution_of_its_name(harness, base):
    ex = harness.create(base, name="reused-name", owner=NOBODY)
    fd = os.open(control(ex.path, protocol.CTL), os.O_RDWR)
    try:
        harness.release(ex)
        again = harness.create(base, name="reused-name", control="none")
        before = snapshot_ids(harness)
        with pytest.raises(OSError) as caught:
            os.write(fd, b"promote\n")
        assert caught.value.errno == errno.ENOENT
    finally:
        os.close(fd)
    assert (again.status()["head"], snapshot_ids(harness)) == (base, before)
    harness.release(again)


def test_settings_are_kept_through_reset_and_restart(daemon):
    src = write_tree(daemon.data_dir.parent / "src", {"f": b"f\n"})
    ramet = Ramet(daemon.mnt)
    snap = ramet.snapshot(src)
    shared = ramet.create(snap, name="shared", owner=OWNER, group=GROUP, share=0o750,
                          control="read")
    hidden = ramet.create(snap, name="hidden", control="none")
    settings = {"owner": OWNER, "group": GROUP, "share": "0750", "control": "read"}

    def check():
        status = shared.status()
        assert {key: status[key] for key in settings} == settings
        ctl = os.stat(control(shared.path, protocol.CTL))
        assert (stat.filemode(ctl.st_mode), ctl.st_uid, ctl.st_gid) == (
            "-r--r-----", OWNER, GROUP)
        directory = os.stat(control(shared.path, ""))
        assert (stat.filemode(directory.st_mode), directory.st_uid) == ("dr-xr-x---", OWNER)
        assert hidden.status()["control"] == "none"
        assert not os.path.lexists(control(hidden.path, ""))

    check()
    (shared.path / "f").write_text("changed\n")
    assert shared.reset() == snap and hidden.reset() == snap
    check()
    daemon.restart()
    check()


@pytest.mark.parametrize("mode", ["fuse", "fallback"])
def test_pool_members_get_the_pools_settings(request, tmp_path, mode):
    if mode == "fuse":
        ramet = Ramet(request.getfixturevalue("shared_daemon").mnt)
    else:
        ramet = Ramet(data=tmp_path / "data", mode="fallback")
    base = ramet.snapshot(write_tree(tmp_path / "src", {"f": b"f\n"}))
    name = f"authority-{mode}-{os.getpid()}"
    settings = {"owner": NOBODY, "group": NOBODY, "share": "0750", "control": "read"}
    with ramet.execution_pool(base, 2, name=name, owner=NOBODY, group=NOBODY, share=0o750,
                              control="read") as pool:
        pooled, = [p for p in ramet.pools() if p["name"] == name]
        assert {key: pooled[key] for key in settings} == settings
        for _ in range(2):  # a returned member is reset: its settings stay
            with pool.acquire() as ex:
                status = ex.status()
                assert {key: status[key] for key in settings} == settings
                if mode == "fuse":
                    assert stat.filemode(os.stat(control(ex.path, "ctl")).st_mode) == "-r--r-----"
        with pytest.raises(RametError) as caught:
            ramet.execution_pool(base, 2, name=name, control="full")
        assert caught.value.errno == errno.EEXIST and "control read" in str(caught.value)
        again = ramet.execution_pool(base, 2, name=name, owner=NOBODY)  # the same: fine
        assert again.name == name
        again.close()
        pool.drop()
    ramet.close()


@pytest.mark.parametrize("settings, message", [
    ({"control": "write"}, "--control must be one of full, read, none, not 'write'"),
    ({"share": 0o644}, "--share must be octal permission bits that give the owner rwx "
                       "(0700 to 0777), not '0644'"),
    ({"share": 0o1777}, "--share must be octal permission bits that give the owner rwx "
                        "(0700 to 0777), not '1777'"),
    ({"owner": -1}, "--owner must be a numeric id below 4294967295, not '-1'"),
    ({"group": 2**32 - 1}, "--group must be a numeric id below 4294967295, not '4294967295'"),
])
def test_bad_settings_are_einval_and_make_nothing(ramet, tmp_path, settings, message):
    base = ramet.snapshot(write_tree(tmp_path / "src", {"f": b"f\n"}))
    before = {e["id"] for e in ramet.executions()}
    for call in (lambda: ramet.create(base, **settings),
                 lambda: ramet.execution_pool(base, 1, **settings)):
        with pytest.raises(RametError) as caught:
            call()
        assert (caught.value.errno, str(caught.value)) == (errno.EINVAL, message)
    assert {e["id"] for e in ramet.executions()} == before


def test_cli_create_takes_the_settings(shared_daemon, tmp_path):
    base = shared_daemon.snapshot(write_tree(tmp_path / "src", {"f": b"f\n"}))

    def cli(*args):
        return CliRunner(env={"RAMET_MODE": None}).invoke(
            main, ["create", "-m", str(shared_daemon.mnt), base, *args])
    made = cli("--name", "cli-settings", "--owner", str(OWNER), "--share", "0711",
               "--control", "none")
    assert (made.exit_code, made.stdout) == (0, "cli-settings\n")
    record = shared_daemon.ctl("status cli-settings")["status"]
    assert (record["owner"], record["share"], record["control"]) == (OWNER, "0711", "none")
    shared_daemon.ctl("release cli-settings")
    assert cli("--control", "all").exit_code == 2
    assert cli("--share", "rwx").exit_code == 2
    refused = cli("--share", "0644")
    assert (refused.exit_code, refused.stderr) == (
        4, "rametfs: --share must be octal permission bits that give the owner rwx (0700 to "
           "0777), not '0644'\n")


def test_bubblewrap_hides_only_host_paths():
    for path in ("/workspace/.ramet", "/workspace", "/workspace/../workspace/x", "relative"):
        with pytest.raises(ValueError) as caught:
            Bubblewrap(hide=[path])
        assert "control='none'" in str(caught.value)
    assert Bubblewrap(hide=["/srv/", "/workspaces"]).hide == ["/srv", "/workspaces"]


def test_a_mount_inside_an_execution_goes_when_another_uid_is_refused(harness, base, made):
    """Why ``hide`` refuses /workspace paths: a tmpfs over part of the workspace is detached
    by the kernel when another uid's lookup of the execution is refused (the kernel then
    drops its cached dentry of the execution and every mount below it, in every mount
    namespace), as a reset or a release does."""
    require_bwrap()
    ex = made(base, owner=NOBODY)
    argv = Bubblewrap().command(ex, ["sh", "-c", "ls -A pkg; echo; read go; ls -A pkg"])
    at = argv.index("/workspace", argv.index("--bind"))
    argv[at + 1:at + 1] = ["--tmpfs", "/workspace/pkg"]
    sandbox = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert sandbox.stdout.readline() == "\n"  # the tmpfs hides pkg/mod.py
        refused = as_uid(harness.mount, [("stat", "stat", f"executions/{ex.id}/README", "")],
                         OTHER)
        out, err = sandbox.communicate("go\n", timeout=60)
    finally:
        sandbox.kill()
        sandbox.wait()
    assert (refused, out, err) == ({"stat": "EACCES"}, "mod.py\n", "")


# ----- 2. executions belong to whoever made them ----------------------------------------------

def test_another_uid_is_refused_even_where_the_harness_cached_everything(harness, base, made):
    ex = made(base)
    (ex.path / "secret").write_bytes(SECRET)
    path = f"executions/{ex.id}"
    # The harness walks, lists and reads: the kernel caches dentries (readdirplus too).
    assert ex.id in os.listdir(harness.mount / "executions")
    assert (ex.path / "secret").read_bytes() == SECRET and ex.status()["id"] == ex.id
    for name in protocol.EXECUTION_CONTROL_FILES:
        os.stat(control(ex.path, name))
    seen = as_uid(harness.mount, [
        ("read", "read", f"{path}/secret", ""),
        ("stat", "stat", f"{path}/README", ""),
        ("list", "list", path, ""),
        ("reset", "command", f"{path}/.ramet/ctl", "reset\n"),
        ("promote", "truncate-write", f"{path}/.ramet/promote", "x\n"),
        ("status", "read", f"{path}/.ramet/status", ""),
        ("executions", "list", "executions", ""),
        ("snapshots", "list", "snapshots", ""),
        ("root-ctl", "command", ".ramet/ctl", f"release {ex.id}\n"),
        ("root-error", "read", ".ramet/error", ""),
    ], OTHER)
    assert seen == {"read": "EACCES", "stat": "EACCES", "list": "EACCES", "reset": "EACCES",
                    "promote": "EACCES", "status": "EACCES", "executions": "EACCES",
                    "snapshots": "EACCES", "root-ctl": "EACCES", "root-error": "EACCES"}
    assert ex.diff() == [("A", "secret")]  # nothing changed
    # and the harness still walks where the refused lookups were
    assert (ex.path / "secret").read_bytes() == SECRET


def test_a_walk_by_name_through_an_execution_asks_the_daemon_and_one_inside_does_not(
        harness, base, made):
    """What the per-walk check costs (run with ``-s``; docs/architecture.md records it): each
    ``stat`` of ``<mnt>/executions/<id>/pkg/mod.py`` revalidates ``<id>`` (one LOOKUP), which
    makes the kernel forget the root's ACL and read it again (a GETXATTR: the harness is not
    the tree's owner, rametfs/core/acl.py); one from a working directory inside the
    execution (as in a sandbox) sends nothing; the same walk through ``snapshots/<id>/``,
    whose entries the kernel keeps, is the cached figure."""
    ex = made(base)
    paths = {"by name": ex.path / "pkg" / "mod.py", "inside": Path("pkg/mod.py"),
             "snapshot": harness.mount / "snapshots" / base / "pkg" / "mod.py"}
    cwd = os.getcwd()
    os.chdir(ex.path)
    try:
        for path in paths.values():
            os.stat(path)
        try:
            with FuseTrace(harness.mount, name="rametfs-authority") as trace:
                sent = {name: trace.run(lambda path=path: [os.stat(path) for _ in range(200)])
                        for name, path in paths.items()}
        except Unsupported as exc:
            pytest.skip(str(exc))
        medians = {}
        for name, path in paths.items():
            rounds = []
            for _ in range(30):
                started = time.perf_counter_ns()
                for _ in range(200):
                    os.stat(path)
                rounds.append((time.perf_counter_ns() - started) / 200 / 1000)
            medians[name] = statistics.median(rounds)
    finally:
        os.chdir(cwd)
    assert {name: dict(r.counts) for name, r in sent.items()} == {
        "by name": {"LOOKUP": 200, "GETXATTR": 200}, "inside": {}, "snapshot": {}}
    answered = sent["by name"].median_us()
    print("\nstat median us: " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items())
          + f"; LOOKUP median {answered['LOOKUP_us']:.1f} us, GETXATTR "
            f"{answered['GETXATTR_us']:.1f} us")


def walk_requests(mnt: Path, path: Path, walks: int = 200) -> dict[str, int]:
    """The FUSE requests that ``walks`` stats of ``path`` send, after one that is not counted."""
    os.stat(path)
    try:
        with FuseTrace(mnt, name="rametfs-authority") as trace:
            sent = trace.run(lambda: [os.stat(path) for _ in range(walks)])
    except Unsupported as exc:
        pytest.skip(str(exc))
    return dict(sent.counts)


def test_a_walk_by_name_is_cached_where_every_caller_may_enter(harness, base, made):
    """``<id>`` is given with a day's entry timeout where the group and others have ``x``
    (0711): walks by name send nothing; where the others have it and the group not (0701, a
    group member is refused), or only the owner (0700), each walk asks as its caller."""
    walks = {share: walk_requests(harness.mount, made(base, share=share).path / "pkg" / "mod.py")
             for share in (0o711, 0o701, 0o700)}
    uncached = {"LOOKUP": 200, "GETXATTR": 200}  # the root's ACL read again after each
    assert walks == {0o711: {}, 0o701: uncached, 0o700: uncached}


def test_a_walk_by_name_is_cached_where_only_the_harness_reaches_the_mount(daemon, tmp_path):
    """Mounted without ``allow_other`` the kernel lets no uid but the mounter's in, so the
    entry of a private execution is cached too: walks by name send nothing."""
    ramet = Ramet(daemon.mnt)
    ex = ramet.create(ramet.snapshot(write_tree(tmp_path / "src", {"pkg/mod.py": b"X = 1\n"})))
    assert [e["share"] for e in ramet.executions()] == ["0700"]
    assert walk_requests(daemon.mnt, ex.path / "pkg" / "mod.py") == {}


def test_the_owner_uses_its_execution_and_sees_only_its_own(harness, base, made):
    mine, theirs = made(base, owner=OWNER), made(base, owner=OTHER)
    path = f"executions/{mine.id}"
    seen = as_uid(harness.mount, [
        ("read", "read", f"{path}/README", ""),
        ("checkpoint", "command", f"{path}/.ramet/ctl", "checkpoint\n"),
        ("status", "read", f"{path}/.ramet/status", ""),
        ("theirs", "stat", f"executions/{theirs.id}/README", ""),
        ("root", "read", ".ramet/status", ""),
    ], OWNER)
    assert seen["read"] == "base\n" and seen["theirs"] == "EACCES"
    checkpoint = json.loads(seen["checkpoint"])
    assert json.loads(seen["status"])["last"] == checkpoint
    root = json.loads(seen["root"])
    assert [e["id"] for e in root["executions"]] == [mine.id]
    assert {s["id"] for s in root["snapshots"]} == {base}


@pytest.mark.parametrize("share, member, other", [
    # for a member of the group, for any other uid: (enter the tree, read its status and be
    # listed in the root status, run a checkpoint)
    (0o700, ("EACCES", "EACCES", "EACCES"), ("EACCES", "EACCES", "EACCES")),
    (0o710, ("ok", "EACCES", "EACCES"), ("EACCES", "EACCES", "EACCES")),
    (0o750, ("ok", "ok", "EACCES"), ("EACCES", "EACCES", "EACCES")),
    (0o770, ("ok", "ok", "ok"), ("EACCES", "EACCES", "EACCES")),
    (0o755, ("ok", "ok", "EACCES"), ("ok", "ok", "EACCES")),
    (0o705, ("EACCES", "EACCES", "EACCES"), ("ok", "ok", "EACCES")),
    (0o777, ("ok", "ok", "ok"), ("ok", "ok", "ok")),
])
def test_the_share_mode_is_applied_like_a_directorys(harness, base, made, share, member,
                                                      other):
    """Each class gets its bits, also after the harness walked the tree by name (a dentry of
    ``<id>`` the kernel caches where the group and others may enter: 0755, 0777)."""
    ex = made(base, owner=OWNER, group=GROUP, share=share)
    path = f"executions/{ex.id}"
    os.stat(ex.path / "README")
    ops = [("enter", "read", f"{path}/README", ""),
           ("status", "read", f"{path}/.ramet/status", ""),
           ("checkpoint", "command", f"{path}/.ramet/ctl", "checkpoint\n"),
           ("root", "read", ".ramet/status", "")]

    def outcome(seen: dict) -> tuple[str, str, str]:
        listed = ex.id in [e["id"] for e in json.loads(seen["root"])["executions"]]
        status = "ok" if seen["status"].startswith("{") else seen["status"]
        assert listed == (status == "ok")
        checkpoint = "ok" if seen["checkpoint"].startswith('{"ok": true') else seen["checkpoint"]
        return "ok" if seen["enter"] == "base\n" else seen["enter"], status, checkpoint

    assert outcome(as_uid(harness.mount, ops, MEMBER, GROUP)) == member
    assert outcome(as_uid(harness.mount, ops, MEMBER, MEMBER, (GROUP,))) == member
    assert outcome(as_uid(harness.mount, ops, OTHER)) == other


def test_root_status_for_another_uid_shows_only_what_it_may_see(harness, base, made):
    mine = made(base, owner=OWNER)
    made(base)  # the harness's own: not shown
    mine.checkpoint()  # the harness's reply, with store-wide figures, is mine's last
    seen = as_uid(harness.mount, [("root", "read", ".ramet/status", "")], OWNER)
    root = json.loads(seen["root"])
    assert set(root) == {"mode", "mount", "version", "open_less", "snapshots_bind",
                         "snapshots", "executions", "pools"}
    record, = root["executions"]
    assert set(record) == {"execution", "id", "base", "head", "state", "created_ns",
                           "upper_bytes", "upper_inodes", "captured_bytes", "max_bytes", "max_inodes",
                           "last"}
    assert not set(record["last"]["stats"]) & set(protocol.STORE_WIDE_STATS)
    snapshot, = root["snapshots"]
    assert snapshot["id"] == base and "source" not in snapshot
    assert not set(snapshot) & set(protocol.STORE_WIDE_STATS)
    full = harness.status()  # the harness's whole status is another inode, 0400
    assert {"pid", "data", "last"} <= set(full) and len(full["executions"]) >= 2


# ----- 5. no side channel between executions --------------------------------------------------

def test_a_checkpoints_reply_does_not_say_what_the_store_already_holds(allow_other_daemon,
                                                                       harness, base, made):
    """The attack of issue 16: guess another execution's secret by checkpointing candidates
    and reading ``new_chunks``.  The execution's replies are equal for a right and a wrong
    guess; the harness's scope still counts; the time each checkpoint takes is printed
    (run with ``-s``; docs/security.md records it)."""
    require_bwrap()
    victim, agent = made(base), made(base, owner=NOBODY)
    (victim.path / "env").write_bytes(SECRET)
    victim.checkpoint()  # the secret's chunk is in the store now
    guesses = [("right", "truncate-write", "/workspace/guess", SECRET.decode()),
               ("right-reply", "command", "/workspace/.ramet/ctl", "checkpoint\n"),
               ("wrong", "truncate-write", "/workspace/guess", "DB_PASS=pw4822\n"),
               ("wrong-reply", "command", "/workspace/.ramet/ctl", "checkpoint\n"),
               ("status", "read", "/workspace/.ramet/status", "")]
    (agent.path / "guess").write_text("")
    os.chown(agent.path / "guess", NOBODY, NOBODY)
    seen = in_sandbox(agent, guesses)
    right, wrong = json.loads(seen["right-reply"]), json.loads(seen["wrong-reply"])
    assert right["stats"] == wrong["stats"] == {"bytes": 26, "changed_files": 1, "dirs": 2,
                                                "files": 3, "symlinks": 0}
    assert json.loads(seen["status"])["last"] == wrong
    assert allow_other_daemon.ctl(f"status {agent.id}")["status"]["last"]["stats"][
        "new_chunks"] == 1  # the harness's scope: the wrong guess was a new chunk
    # Timing: checkpoints of a right guess (its chunk stored) and of wrong ones (each new),
    # interleaved: as the agent times them (wall clock of a write to its ctl), and the
    # capture alone as the daemon times it (capture_ms, which only the harness sees).
    ctl = control(agent.path, protocol.CTL)
    wall: dict[str, list[float]] = {"right": [], "wrong": []}
    capture: dict[str, list[float]] = {"right": [], "wrong": []}
    for i in range(150):
        for kind in ("right", "wrong"):
            for scope in ("agent", "harness"):
                content = SECRET if kind == "right" else f"DB_PASS={scope[0]}{i:05d}\n".encode()
                (agent.path / "guess").write_bytes(content)
                if scope == "harness":
                    stats = allow_other_daemon.ctl(f"checkpoint {agent.id}")["stats"]
                    capture[kind].append(stats["capture_ms"] * 1000)
                    continue
                started = time.perf_counter_ns()
                ctl_command(ctl, "checkpoint")
                wall[kind].append((time.perf_counter_ns() - started) / 1000)

    def summary(samples: list[float]) -> str:
        q = statistics.quantiles(samples, n=4)
        return f"median {statistics.median(samples):.0f} us (quartiles {q[0]:.0f}-{q[2]:.0f})"
    print(f"\nagent's wall clock: right guess {summary(wall['right'])}, wrong "
          f"{summary(wall['wrong'])}; capture: right {summary(capture['right'])}, wrong "
          f"{summary(capture['wrong'])}")


# ----- 7. what the execution sees of the harness -----------------------------------------------

def test_an_executions_status_shows_nothing_of_the_harness(harness, base):
    require_bwrap()
    with harness.execution_pool(base, 1, owner=NOBODY) as pool:
        with pool.acquire() as ex:
            lease = ex.status()["lease"]  # the harness's view: the lease and its holder
            assert (lease["holder"], lease["pid"]) == (pool.holder, os.getpid())
            seen = in_sandbox(ex, [("status", "read", "/workspace/.ramet/status", "")])
    status = json.loads(seen["status"])
    assert status == {"execution": ex.id, "id": ex.id, "base": base, "head": base,
                      "state": "leased", "created_ns": status["created_ns"], "upper_bytes": 0,
                      "upper_inodes": 1, "captured_bytes": 0, "max_bytes": None,
                      "max_inodes": None, "last": None}
    for leak in (pool.holder, pool.host, str(harness.mount), harness.status()["data"]):
        assert leak not in seen["status"]


def test_the_read_index_answers_as_access_allows():
    """authority.ReadIndex gives exactly the executions Access.allows(caller, R) grants, for
    owners, members of the group (primary or supplementary) and others, as executions are
    added and removed."""
    class Member(Caller):  # groups given, not read from /proc
        def __init__(self, uid: int, gid: int, groups: frozenset[int]):
            super().__init__(uid, gid)
            self.__dict__["groups"] = groups

    index, accesses = ReadIndex(), {}
    shares = [0o700, 0o740, 0o704, 0o744, 0o710, 0o750, 0o755, 0o777]
    for i, (owner, group, share) in enumerate(itertools.product((1000, 1001), (50, 51), shares)):
        accesses[f"e{i}"] = Access(owner=owner, group=group, share=share)
        index.add(f"e{i}", accesses[f"e{i}"])
    for gone in ("e3", "e17", "e30"):
        index.remove(gone)
        del accesses[gone]
    callers = [Member(uid, gid, frozenset(groups)) for uid in (1000, 1001, 1002)
               for gid in (50, 51, 99) for groups in ({gid}, {gid, 50}, {gid, 51})]
    for caller in callers:
        assert index.readable(caller) == {e for e, a in accesses.items() if a.allows(caller, R)}
