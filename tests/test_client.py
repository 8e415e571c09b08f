"""The Python wrapper (rametfs.client) and the CLI over it: one suite, run in both modes.

Each test takes the ``ramet`` fixture (conftest): a ``Ramet`` on the shared FUSE daemon, or
``Ramet(data=DIR, mode="fallback")`` forced on a data directory of the test's own.  The same
calls must give the same results: expected trees come from the source on the host file system
(:func:`tree_signature`), expected diffs are those of the FUSE control file (``KNOWN_DIFF``).
The shared daemon also holds other tests' snapshots and executions, so counts are taken
against what was there before.

What only one mode has stays with that mode: tests/test_protocol.py (no mount: ENOTCONN),
tests/test_control.py (the control files from a shell), tests/test_fallback.py (copy methods,
the manifest and its costs, locks, the fallback CLI's mode line).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import cli_where, wait_until
from rametfs import Ramet, RametError, client, errors
from rametfs.cli import main
from rametfs.client import PoolTimeout
from test_control import KNOWN_DIFF, make_known_changes
from test_snapshots import SNAPSHOT_ID, TIMES_NS, rich_source, tree_signature, write_tree  # noqa: F401

NO_SNAPSHOT = "0" * 64


@pytest.fixture
def source(tmp_path) -> Path:
    return write_tree(tmp_path / "src", {"README": b"project\n", "src/main.py": b"print(1)\n"})


@pytest.fixture
def special_source(rich_source) -> Path:
    """The rich tree of test_snapshots plus a fifo and (as root) a character device."""
    os.mkfifo(rich_source / "fifo", 0o640)
    if os.geteuid() == 0:
        os.mknod(rich_source / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    for name in ("fifo", "null"):
        if os.path.lexists(rich_source / name):
            os.utime(rich_source / name, ns=TIMES_NS, follow_symlinks=False)
    os.utime(rich_source, ns=TIMES_NS)
    return rich_source


def execution_ids(ramet: Ramet) -> set[str]:
    return {e["id"] for e in ramet.executions()}


def executions_dir(ramet: Ramet) -> Path:
    """Where the executions' directories are: on the mount, or under the data directory."""
    if ramet.mode == "fuse":
        return ramet.mount / "executions"
    return ramet.data / "fallback" / "executions"


def snapshot_tree(ramet: Ramet, snapshot: str) -> dict[str, str]:
    """The :func:`tree_signature` of ``snapshot``, read from a fresh execution of it."""
    ex = ramet.create(snapshot)
    try:
        return tree_signature(ex.path)
    finally:
        ramet.release(ex)


def test_pool_acquire_promote_reset_release(ramet, special_source):
    before = execution_ids(ramet)
    base = ramet.snapshot(special_source, label="clean")
    assert SNAPSHOT_ID.fullmatch(base)
    record, = [s for s in ramet.snapshots() if s["id"] == base]
    assert (record["label"], record["parents"], record["source"], record["files"]) == (
        "clean", [], str(special_source), 8)

    with ramet.execution_pool(base, concurrency=2) as pool:
        new = [e for e in ramet.executions() if e["id"] not in before]
        assert sorted((e["base"], e["head"]) for e in new) == [(base, base)] * 2
        with pool.acquire() as ex:
            assert ex.id in {e["id"] for e in new}
            assert ex.path == executions_dir(ramet) / ex.id
            assert tree_signature(ex.path) == tree_signature(special_source)
            (ex.path / "result.txt").write_text("attempt 1\n")
            os.unlink(ex.path / "empty")
            os.rename(ex.path / "dir" / "owned.txt", ex.path / "moved.txt")
            with open(ex.path / "hl1", "ab") as f:  # dir/hl2 is the same inode
                f.write(b"more\n")
            changes = [("M", "dir/hl2"), ("D", "dir/owned.txt"), ("D", "empty"), ("M", "hl1"),
                       ("A", "moved.txt"), ("A", "result.txt")]
            assert ex.diff() == changes
            saved = ex.promote(label="attempt 1")
            promoted_tree = tree_signature(ex.path)
            assert ex.diff() == []  # against the head: the promote
            status = ex.status()
            assert (status["base"], status["head"], status["last"]["snapshot"]) == (
                base, saved, saved)
        first_id = ex.id
        with pool.acquire() as ex:
            assert ex.id == first_id  # the pool hands back the execution just returned
            assert tree_signature(ex.path) == tree_signature(special_source)
            assert (ex.diff(), ex.verify(), ex.verify(deep=True)) == ([], [], [])
    assert execution_ids(ramet) == before
    assert not {e["id"] for e in new} & set(os.listdir(executions_dir(ramet)))

    record, = [s for s in ramet.snapshots() if s["id"] == saved]
    assert (record["label"], record["parents"], record["source"], record["files"]) == (
        "attempt 1", [base], f"execution:{first_id}", 8)
    with ramet.execution_pool(saved, concurrency=1) as pool, pool.acquire() as ex:
        assert tree_signature(ex.path) == promoted_tree
    assert execution_ids(ramet) == before


def test_every_execution_leaves_the_pool_clean(ramet, source):
    base = ramet.snapshot(source)
    with ramet.execution_pool(base, concurrency=2) as pool:
        ids = set()
        for i in range(4):
            with pool.acquire() as ex:
                assert sorted(os.listdir(ex.path)) == ["README", "src"]
                (ex.path / "mine").write_text(str(i))
                os.unlink(ex.path / "README")
                ids.add(ex.id)
        assert len(ids) == 1 and ids <= execution_ids(ramet)  # the last one given back
    assert not ids & execution_ids(ramet)


def test_acquire_from_two_threads_gives_two_executions(ramet, source):
    base = ramet.snapshot(source)
    held, release, errors = [], threading.Event(), []

    def worker(n: int) -> None:
        try:
            with pool.acquire(timeout=30) as ex:
                (ex.path / "who").write_text(str(n))
                held.append(ex)
                release.wait(30)
                assert (ex.path / "who").read_text() == str(n)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with ramet.execution_pool(base, concurrency=2) as pool:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: len(held) == 2 or errors, 30, "both executions acquired")
            with pytest.raises(PoolTimeout) as caught:
                with pool.acquire(timeout=0.05):
                    pass
            assert (caught.value.errno, str(caught.value)) == (
                errno.EBUSY, f"no free execution after 0.05 s: pool {pool.name!r}: no ready "
                             f"execution (2 leased, 0 quarantined)")
        finally:
            release.set()
            for t in threads:
                t.join()
        assert errors == []
        assert len({ex.id for ex in held}) == 2
        with pool.acquire(timeout=0) as ex:  # given back, reset
            assert not (ex.path / "who").exists()


def test_checkpoint_keeps_the_base_and_reset_returns_to_it(ramet, source):
    base = ramet.snapshot(source)
    ex = ramet.create(base)
    try:
        (ex.path / "README").write_text("changed\n")
        changed = tree_signature(ex.path)
        checkpoint = ex.checkpoint(label="cp", message="keep this")
        assert (ex.status()["base"], ex.status()["head"]) == (base, base)
        assert ex.diff() == [("M", "README")]
        assert ex.reset() == base
        assert ex.status()["last"]["snapshot"] == base
        assert (ex.path / "README").read_text() == "project\n"
        assert (ex.diff(), ex.verify(), ex.verify(deep=True)) == ([], [], [])
        record, = [s for s in ramet.snapshots() if s["id"] == checkpoint]
        assert (record["label"], record["message"], record["parents"]) == (
            "cp", "keep this", [base])
        assert snapshot_tree(ramet, checkpoint) == changed
    finally:
        ramet.release(ex)


def test_diff_lines_are_the_fuse_diff(ramet, tmp_path):
    src = write_tree(tmp_path / "src", {"a.txt": b"alpha\n", "c.txt": b"gamma\n",
                                        "dir/b.txt": b"beta\n", "dir/keep.txt": b"keep\n",
                                        "old/x": b"x\n", "big.bin": os.urandom(200_000)})
    os.symlink("a.txt", src / "link")
    ex = ramet.create(ramet.snapshot(src))
    assert ex.diff() == []
    make_known_changes(ex.path)
    assert [f"{letter} {path}" for letter, path in ex.diff()] == KNOWN_DIFF
    ex.reset()
    assert (ex.diff(), ex.verify(), ex.verify(deep=True)) == ([], [], [])
    assert tree_signature(ex.path) == tree_signature(src)
    ramet.release(ex)


def test_diff_of_exchanged_directories_compares_what_is_below_them(ramet, tmp_path):
    # a/ and b/ swap places (renameat2 RENAME_EXCHANGE): each keeps its mode, owner and
    # mtime, so the diff names only the files that now differ below them, in both modes.
    src = write_tree(tmp_path / "src", {"a/f": b"same\n", "a/s/x": b"x\n",
                                        "b/f": b"same\n", "b/s/y": b"y\n"})
    for path in ("a/f", "a/s", "a", "b/f", "b/s", "b"):
        os.utime(src / path, ns=TIMES_NS)
    ex = ramet.create(ramet.snapshot(src))
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE (linux/fs.h)
        assert libc.renameat2(at_cwd, os.fsencode(ex.path / "a"), at_cwd,
                              os.fsencode(ex.path / "b"), exchange) == 0, \
            os.strerror(ctypes.get_errno())
        assert ex.diff() == [("D", "a/s/x"), ("A", "a/s/y"), ("A", "b/s/x"), ("D", "b/s/y")]
    finally:
        ramet.release(ex)


def test_reset_puts_back_every_kind_of_change(ramet, special_source):
    base = ramet.snapshot(special_source)
    ex = ramet.create(base)
    p = ex.path
    os.chmod(p / "small.txt", 0o600)
    os.setxattr(p / "dir", "user.kind", b"changed")
    os.chown(p / "big.bin", 42, 42)
    os.truncate(p / "big.bin", 3)
    os.link(p / "pages.bin", p / "pages-link")
    shutil.rmtree(p / "dir" / "sub")
    (p / "dir" / "sub").write_text("now a file")
    os.unlink(p / "rel_link")
    os.symlink("elsewhere", p / "rel_link")
    os.unlink(p / "empty")
    os.mkdir(p / "empty")
    (p / "empty" / "x").write_text("x")
    os.unlink(p / "dir" / "hl2")
    shutil.copy2(p / "hl1", p / "dir" / "hl2")  # same bytes, but no longer hl1's inode
    os.unlink(p / "fifo")
    os.symlink("fifo", p / "fifo")

    assert ex.reset() == base
    assert tree_signature(p) == tree_signature(special_source)
    assert (ex.diff(), ex.verify(), ex.verify(deep=True)) == ([], [], [])
    if ramet.mode == "fallback":
        # Written again: small.txt, big.bin, pages.bin, the hl1 + dir/hl2 inode and
        # dir/sub/deep.txt from the cache; the empty file; the rest was kept.
        method = ramet.status()["copy_method"]
        assert ex.status()["last"]["stats"]["methods"] == {method: 5, "empty": 1}
    ramet.release(ex)


def test_named_executions_and_release(ramet, source):
    base = ramet.snapshot(source)
    before = execution_ids(ramet)
    names = ["wrapper.run.1", "wrapper.x.lock", "wrapper.y.tmp-1"]  # dots, whatever follows
    executions = [ramet.create(base, name=name) for name in names]
    assert [ex.id for ex in executions] == names
    assert execution_ids(ramet) - before == set(names)
    with pytest.raises(RametError) as caught:
        ramet.create(base, name=names[0])
    assert caught.value.errno == errno.EEXIST
    ex = ramet.execution(names[1])  # a handle by id
    assert (ex.status()["base"], tree_signature(ex.path)) == (base, tree_signature(source))
    for name in names:
        ramet.release(name)
    assert execution_ids(ramet) == before
    assert not set(names) & set(os.listdir(executions_dir(ramet)))


def test_preview_without_a_policy_keeps_everything(ramet, source):
    ex = ramet.create(ramet.snapshot(source))
    (ex.path / "notes.txt").write_text("12345")
    report = ex.preview()
    assert [(p["path"], p["class"], p["bytes"]) for p in report["paths"]] == [
        ("README", "durable", 8), ("notes.txt", "durable", 5), ("src/main.py", "durable", 9)]
    assert (report["ok"], report["policy"], report["problems"], report["recipes"]) == (
        True, None, [], [])
    assert report["totals"]["durable"] == {"paths": 3, "files": 3, "bytes": 22}
    assert ex.diff() == [("A", "notes.txt")]  # a preview changes nothing
    ramet.release(ex)


def test_status_in_either_mode(ramet, source):
    base = ramet.snapshot(source)
    ex = ramet.create(base)
    saved = ex.promote(label="status")
    status = ramet.status()
    assert status["mode"] == ramet.mode
    assert {"pid", "data", "mount", "version", "snapshots", "executions", "last"} <= set(status)
    assert status["mount"] == (str(ramet.mount) if ramet.mode == "fuse" else None)
    record, = [e for e in status["executions"] if e["id"] == ex.id]
    assert (record["base"], record["head"], record["state"]) == (base, saved, "ready")
    assert {base, saved} <= {s["id"] for s in status["snapshots"]}
    mine = ex.status()
    assert {"execution", "base", "head", "state", "created_ns", "upper_bytes", "last"} <= set(
        mine)
    assert (mine["execution"], mine["base"], mine["head"], mine["created_ns"]) == (
        ex.id, base, saved, record["created_ns"])
    stats = mine["last"]["stats"]
    assert (mine["last"]["snapshot"], stats["files"], stats["bytes"], stats["dirs"]) == (
        saved, 2, 17, 2)
    ramet.release(ex)


def test_errors_carry_their_errno(ramet, source, tmp_path):
    base = ramet.snapshot(source)
    ex = ramet.create(base)
    (tmp_path / "file").write_text("not a directory\n")
    reserved = write_tree(tmp_path / "reserved", {".ramet/ctl": b""})
    before = (execution_ids(ramet), len(ramet.snapshots()))
    unknown = ramet.execution("no-such-execution")
    cases = [
        (lambda: ramet.create(NO_SNAPSHOT), errno.ENOENT, NO_SNAPSHOT),
        (lambda: ramet.execution_pool(NO_SNAPSHOT, 2), errno.ENOENT, NO_SNAPSHOT),
        (lambda: ramet.create(base, name="../up"), errno.EINVAL, "../up"),
        (lambda: ramet.snapshot(tmp_path / "missing"), errno.ENOENT, "missing"),
        (lambda: ramet.snapshot(tmp_path / "file"), errno.EINVAL, "file"),
        (lambda: ramet.snapshot(reserved), errno.EINVAL, ".ramet"),
        (lambda: ramet.release("no-such-execution"), errno.ENOENT, "no-such-execution"),
        (unknown.promote, errno.ENOENT, "no-such-execution"),
        (unknown.checkpoint, errno.ENOENT, "no-such-execution"),
        (unknown.reset, errno.ENOENT, "no-such-execution"),
        (unknown.diff, errno.ENOENT, "no-such-execution"),
        (unknown.preview, errno.ENOENT, "no-such-execution"),
        (unknown.status, errno.ENOENT, "no-such-execution"),
        (lambda: ramet.execution("..").status(), errno.ENOENT, "'..'"),
        (lambda: ramet.execution("..").reset(), errno.ENOENT, "'..'"),
        (lambda: ex.promote(policy=tmp_path / "no-policy.toml"), errno.ENOENT,
         "no-policy.toml"),
        (lambda: Ramet(ramet.mount, data=ramet.data, mode="nfs"), errno.EINVAL, "'nfs'"),
    ]
    for call, err, named in cases:
        with pytest.raises(RametError) as caught:
            call()
        assert (caught.value.errno, named in str(caught.value)) == (err, True), caught.value
    assert (execution_ids(ramet), len(ramet.snapshots())) == before  # nothing made
    assert ex.reset() == base  # and the execution still works
    ramet.release(ex)


# A line a harness may write to the root ctl, and the same command through the wrapper.
BAD_COMMANDS = [
    ("acquire p --holder h --ttl -1", lambda r: r.acquire("p", "h", ttl=-1)),
    ("acquire p --holder h --ttl nan", lambda r: r.acquire("p", "h", ttl=float("nan"))),
    ("renew e --holder h --ttl 1000000000.0", lambda r: r.renew("e", "h", ttl=1e9)),
    (f"pool {NO_SNAPSHOT} --size 0", lambda r: r.open_pool(NO_SNAPSHOT, 0)),
    (f"pool {NO_SNAPSHOT} --size 1 --keep-last 0",
     lambda r: r.open_pool(NO_SNAPSHOT, 1, keep_last=0)),
    (f"create {NO_SNAPSHOT} --share 0644", lambda r: r.create(NO_SNAPSHOT, share=0o644)),
    (f"create {NO_SNAPSHOT} --name ../up", lambda r: r.create(NO_SNAPSHOT, name="../up")),
    (f"create {NO_SNAPSHOT} --owner 4294967295",
     lambda r: r.create(NO_SNAPSHOT, owner=2**32 - 1)),
    (f"create {NO_SNAPSHOT} --control write", lambda r: r.create(NO_SNAPSHOT, control="write")),
    ("forget --keep-within 2h30m", lambda r: r.forget(keep_within="2h30m")),
    ("return e --holder h --verify shallow",
     lambda r: r.return_execution("e", "h", verify="shallow")),
    (f"reset e --to {NO_SNAPSHOT} --base yes",
     lambda r: r.execution("e").reset(to=NO_SNAPSHOT, base=True)),
    ("runtime e bubblewrap --uid 0 --gid 0",
     lambda r: r.execution("e").record_runtime("bubblewrap", 0, 0)),
    ("promote e --label " + "x" * 300, lambda r: r.execution("e").promote(label="x" * 300)),
]


def test_a_bad_command_fails_alike_written_to_the_mount_and_in_both_modes(shared_daemon,
                                                                          tmp_path):
    mount = Path(shared_daemon.mnt)
    with Ramet(mount) as fuse, Ramet(data=tmp_path / "data", mode="fallback") as fallback:
        for line, call in BAD_COMMANDS:
            with pytest.raises(RametError) as written:  # the daemon's parse, its reply
                client._command(mount / ".ramet" / "ctl", line + "\n", mount)
            seen = [(type(written.value), written.value.errno, str(written.value))]
            for ramet in (fuse, fallback):
                with pytest.raises(RametError) as caught:
                    call(ramet)
                seen.append((type(caught.value), caught.value.errno, str(caught.value)))
            assert seen[0][:2] == (errors.InvalidArgument, errno.EINVAL), (line, seen)
            assert seen == [seen[0]] * 3, line


def test_cli_in_either_mode(ramet, source):
    where = cli_where(ramet)

    def cli(*args):
        return CliRunner(env={"RAMET_MOUNT": None, "RAMET_MODE": None, "RAMET_DATA": None}
                         ).invoke(main, [args[0], *where, *args[1:]])

    base = cli("snapshot", str(source), "--label", "cli").stdout.strip()
    assert SNAPSHOT_ID.fullmatch(base)
    assert cli("create", base, "--name", "wrapper-cli").stdout == "wrapper-cli\n"
    (executions_dir(ramet) / "wrapper-cli" / "new.txt").write_text("new\n")
    assert cli("diff", "wrapper-cli").stdout == "A new.txt\n"
    promoted = cli("promote", "wrapper-cli").stdout.strip()
    assert json.loads(cli("status", "wrapper-cli").stdout)["head"] == promoted
    assert json.loads(cli("status").stdout)["mode"] == ramet.mode
    row, = [line.split() for line in cli("ls").stdout.splitlines()
            if line.startswith("wrapper-cli ")]
    assert row[:3] == ["wrapper-cli", base[:12], promoted[:12]]
    assert cli("reset", "wrapper-cli").exit_code == 0
    assert cli("diff", "wrapper-cli").stdout == ""
    assert cli("release", "wrapper-cli").exit_code == 0
    result = cli("status", "wrapper-cli")
    where_is = f"at {ramet.mount}" if ramet.mode == "fuse" else f"in {ramet.data}"
    assert (result.exit_code, result.stderr) == (
        3, f"rametfs: no execution 'wrapper-cli' {where_is}\n")
    result = cli("create", NO_SNAPSHOT)
    assert (result.exit_code, result.stdout) == (3, "")
