"""Fallback mode (no FUSE): executions as real directories, through the wrapper and the CLI.

Fallback mode is forced (``mode="fallback"``) although this host has /dev/fuse, so the same
host also runs the FUSE daemon for the cross-mode tests.  Expected trees come from the source
on the host file system, read by :func:`tree_signature` as the mounted tests do; expected diffs
are the ones the FUSE tests expect (``KNOWN_DIFF``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import run
from rametfs import Ramet, RametError, client
from rametfs.cli import main
from test_control import KNOWN_DIFF, make_known_changes
from test_snapshots import TIMES_NS, rich_source, tree_signature, write_tree  # noqa: F401

XFS_IMAGE_SIZE = "300M"
BIG = 32 << 20  # bytes: three copies of it would not fit in the xfs image beside the store


@pytest.fixture
def source(rich_source) -> Path:
    """The rich tree of test_snapshots plus a fifo and (as root) a character device."""
    os.mkfifo(rich_source / "fifo", 0o640)
    if os.geteuid() == 0:
        os.mknod(rich_source / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    for name in ("fifo", "null"):
        if os.path.lexists(rich_source / name):
            os.utime(rich_source / name, ns=TIMES_NS, follow_symlinks=False)
    os.utime(rich_source, ns=TIMES_NS)
    return rich_source


@pytest.fixture
def ramet(tmp_path):
    with Ramet(data=tmp_path / "data", mode="fallback") as r:
        yield r


def last_stats(ex) -> dict:
    return ex.status()["last"]["stats"]


def fs_type(path: Path) -> str:
    """The file system type name of ``path`` as ``stat -f`` gives it (``ext2/ext3``, ``xfs``)."""
    return run("stat", "-f", "-c", "%T", path).stdout.strip()


def copy_method_for(path: Path) -> str:
    """The copy method expected for a data directory under ``path`` (xfs made by xfsprogs
    >= 5.1 and btrfs have reflinks)."""
    return "reflink" if fs_type(path) in ("xfs", "btrfs") else "copy"


# ----- the wrapper ------------------------------------------------------------------------------

def test_pool_acquire_promote_reset_release(ramet, tmp_path, source):
    assert (ramet.mode, ramet.mount, ramet.data) == ("fallback", None, tmp_path / "data")
    status = ramet.status()
    assert (status["mode"], status["copy_method"]) == ("fallback", copy_method_for(tmp_path))
    base = ramet.snapshot(source, label="clean")
    assert [(s["id"], s["label"]) for s in ramet.snapshots()] == [(base, "clean")]

    with ramet.execution_pool(base, concurrency=2) as pool:
        assert {(e["base"], e["head"]) for e in ramet.executions()} == {(base, base)}
        with pool.acquire() as ex:
            assert ex.path == tmp_path / "data" / "fallback" / "executions" / ex.id
            assert not os.path.ismount(ex.path)
            assert tree_signature(ex.path) == tree_signature(source)
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
            assert ex.diff() == changes  # still against the base
            status = ex.status()
            assert (status["base"], status["head"], status["mode"]) == (base, saved, "fallback")
        first_id = ex.id
        with pool.acquire() as ex:
            assert ex.id == first_id  # the pool hands back the execution just returned
            assert tree_signature(ex.path) == tree_signature(source)
            assert (ex.diff(), ex.verify(), ex.verify(deep=True)) == ([], [], [])
    assert ramet.executions() == []
    assert os.listdir(tmp_path / "data" / "fallback" / "executions") == []

    record, = [s for s in ramet.snapshots() if s["id"] == saved]
    assert (record["label"], record["parents"], record["source"]) == (
        "attempt 1", [base], f"execution:{first_id}")
    with ramet.execution_pool(saved, concurrency=1) as pool:
        with pool.acquire() as ex:
            assert tree_signature(ex.path) == promoted_tree


def test_diff_is_the_fuse_diff(ramet, tmp_path):
    # The FUSE suite expects KNOWN_DIFF for the same changes (test_control).
    src = write_tree(tmp_path / "src", {"a.txt": b"alpha\n", "c.txt": b"gamma\n",
                                        "dir/b.txt": b"beta\n", "dir/keep.txt": b"keep\n",
                                        "old/x": b"x\n", "big.bin": os.urandom(200_000)})
    os.symlink("a.txt", src / "link")
    ex = ramet.create(ramet.snapshot(src))
    assert ex.diff() == []
    make_known_changes(ex.path)
    assert [f"{letter} {path}" for letter, path in ex.diff()] == KNOWN_DIFF
    ex.reset()
    assert ex.diff() == []


def test_reset_puts_back_only_what_differs(ramet, tmp_path, source):
    method = copy_method_for(tmp_path)
    ex = ramet.create(ramet.snapshot(source))
    p = ex.path
    os.chmod(p / "small.txt", 0o600)
    os.setxattr(p / "dir", "user.kind", b"changed")
    os.chown(p / "big.bin", 42, 42)
    os.truncate(p / "big.bin", 3)
    os.link(p / "pages.bin", p / "pages-link")  # pages.bin must be a lone inode again
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

    ex.reset()
    assert tree_signature(p) == tree_signature(source)
    assert (ex.verify(), ex.verify(deep=True)) == ([], [])
    # Written again: small.txt, big.bin, pages.bin, the hl1 + dir/hl2 inode and
    # dir/sub/deep.txt from the cache; the empty file; the rest was kept.
    assert last_stats(ex)["methods"] == {method: 5, "empty": 1}
    ex.reset()
    assert {k: last_stats(ex)[k] for k in ("removed", "written", "methods")} == {
        "removed": 0, "written": 0, "methods": {}}


def test_promote_and_reset_cost_o_changed(ramet, tmp_path):
    method = copy_method_for(tmp_path)
    files = {f"d{i % 10}/f{i:03}.txt": f"file {i}\n".encode() for i in range(500)}
    src = write_tree(tmp_path / "src", files)
    base = ramet.snapshot(src)
    ex = ramet.create(base)
    changed = ["d3/f003.txt", "d0/f250.txt", "d9/f499.txt"]
    for rel in changed:
        with open(ex.path / rel, "ab") as f:
            f.write(b"changed\n")

    promoted = ex.promote()
    stats = last_stats(ex)
    assert (stats["scanned"], stats["hashed_files"], stats["changed_files"],
            stats["new_chunks"]) == (511, 3, 3, 3)  # 500 files, 10 directories, the root
    record, = [s for s in ramet.snapshots() if s["id"] == promoted]
    assert (record["hashed_files"], record["files"], record["dirs"]) == (3, 500, 11)

    ex.reset()
    stats = last_stats(ex)  # written: the 3 files, and their directories' mtimes
    assert {k: stats[k] for k in ("kept", "removed", "written", "methods")} == {
        "kept": 497, "removed": 3, "written": 6, "methods": {method: 3}}
    assert tree_signature(ex.path) == tree_signature(src)
    with ramet.execution_pool(promoted, concurrency=1) as pool, pool.acquire() as again:
        for rel in changed:
            assert (again.path / rel).read_bytes() == files[rel] + b"changed\n"


def test_verify_trusts_the_manifest_and_deep_reads_the_bytes(ramet, tmp_path):
    src = write_tree(tmp_path / "src", {"a.txt": b"alpha\n", "b.txt": b"beta\n"})
    ex = ramet.create(ramet.snapshot(src))
    f = ex.path / "a.txt"
    st = os.stat(f)
    f.write_bytes(b"alpha\n")  # the same bytes, and the times put back: only ctime moved
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ex.verify() == [("M", "a.txt")]  # the manifest cannot vouch for it
    assert (ex.verify(deep=True), ex.diff()) == ([], [])
    f.write_bytes(b"ALPHA\n")  # other bytes of the same size, the times put back
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ex.verify(deep=True) == ex.diff() == [("M", "a.txt")]
    ex.reset()
    assert (ex.verify(), ex.verify(deep=True)) == ([], [])
    assert f.read_bytes() == b"alpha\n"


def test_errors_carry_their_errno(ramet, tmp_path, monkeypatch):
    src = write_tree(tmp_path / "src", {"a": b"a\n"})
    base = ramet.snapshot(src)
    ex = ramet.create(base, name="one")
    (ex.path / ".ramet").mkdir()
    monkeypatch.delenv("RAMET_DATA", raising=False)
    cases = [
        (lambda: ramet.create("0" * 64), errno.ENOENT),
        (lambda: ramet.create(base, name="one"), errno.EEXIST),
        (lambda: ramet.create(base, name="../up"), errno.EINVAL),
        (lambda: ramet.snapshot(tmp_path / "missing"), errno.ENOENT),
        (lambda: ramet.release("nope"), errno.ENOENT),
        (lambda: ramet.execution("nope").promote(), errno.ENOENT),
        (lambda: ramet.execution("../data").status(), errno.ENOENT),
        (lambda: ex.promote(), errno.EINVAL),  # .ramet is reserved
        (lambda: Ramet(mode="fallback"), errno.EINVAL),
        (lambda: Ramet(data=tmp_path / "d", mode="nfs"), errno.EINVAL),
    ]
    for call, err in cases:
        with pytest.raises(RametError) as caught:
            call()
        assert caught.value.errno == err, caught.value
    locks = tmp_path / "data" / "fallback" / "locks"
    assert os.listdir(locks) == ["one"]  # failed calls leave no lock files behind
    with open(locks / "one", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process or thread running a command
        with pytest.raises(RametError) as caught:
            ex.reset()
    assert (caught.value.errno, str(caught.value)) == (
        errno.EBUSY, "execution 'one' is running another command")
    assert ex.reset() == base and not (ex.path / ".ramet").exists()


def test_any_execution_name_and_a_removed_root(ramet, tmp_path):
    src = write_tree(tmp_path / "src", {"a": b"a\n"})
    base = ramet.snapshot(src)
    names = ["run.1", "x.lock", "y.tmp-1"]  # dots are allowed, whatever follows them
    for name in names:
        ramet.create(base, name=name)
    assert sorted(e["id"] for e in ramet.executions()) == names
    ex = ramet.execution("run.1")
    shutil.rmtree(ex.path)  # a sandbox may remove everything, its root included
    assert ex.reset() == base
    assert tree_signature(ex.path) == tree_signature(src)
    for name in names:
        ramet.release(name)
    assert ramet.executions() == []


def test_auto_mode_picks_fallback_without_dev_fuse(tmp_path, monkeypatch):
    monkeypatch.delenv("RAMET_MOUNT", raising=False)
    monkeypatch.setattr(client, "FUSE_DEVICE", str(tmp_path / "no-fuse"))
    with Ramet(data=tmp_path / "data", mode="auto") as ramet:
        assert ramet.mode == "fallback"
    (tmp_path / "fuse").touch()
    monkeypatch.setattr(client, "FUSE_DEVICE", str(tmp_path / "fuse"))
    with pytest.raises(RametError) as caught:
        Ramet(data=tmp_path / "data", mode="auto")  # FUSE: a mountpoint is needed
    assert caught.value.errno == errno.EINVAL


# ----- snapshots shared by both modes -----------------------------------------------------------

def test_snapshots_cross_between_fuse_and_fallback(daemon, tmp_path):
    src = write_tree(tmp_path / "src", {"README": b"project\n", "src/main.py": b"print(1)\n"})
    fuse = Ramet(daemon.mnt)
    ex = fuse.create(fuse.snapshot(src))
    (ex.path / "src" / "main.py").write_text("print(2)\n")
    (ex.path / "notes.txt").write_text("from fuse\n")
    from_fuse = ex.promote(label="fuse")
    fuse_tree = tree_signature(ex.path)
    fuse.release(ex)
    daemon.stop()

    with Ramet(data=daemon.data_dir, mode="fallback") as local:
        ex = local.create(from_fuse)
        assert tree_signature(ex.path) == fuse_tree
        os.unlink(ex.path / "README")
        (ex.path / "src" / "util.py").write_text("pass\n")
        from_fallback = ex.promote(label="fallback")
        local_tree = tree_signature(ex.path)
        local.release(ex)

    daemon.start()
    fuse = Ramet(daemon.mnt)
    record, = [s for s in fuse.snapshots() if s["id"] == from_fallback]
    assert (record["label"], record["parents"]) == ("fallback", [from_fuse])
    ex = fuse.create(from_fallback)
    assert tree_signature(ex.path) == local_tree
    assert ex.diff() == []
    fuse.release(ex)


# ----- copy methods -----------------------------------------------------------------------------

@contextlib.contextmanager
def loop_mounted_xfs(tmp_path: Path):
    """An xfs file system in a loop-mounted image, unmounted (lazily if busy) at exit."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop device needs root")
    mkfs = shutil.which("mkfs.xfs")
    if mkfs is None:
        pytest.skip("mkfs.xfs is absent (Debian package xfsprogs, which tools/setup installs)")
    image, mnt = tmp_path / "xfs.img", tmp_path / "xfs"
    mnt.mkdir()
    run("truncate", "-s", XFS_IMAGE_SIZE, image)
    run(mkfs, "-q", image)
    mounted = run("mount", "-o", "loop", image, mnt, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount an xfs image here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        if run("umount", mnt, check=False).returncode != 0:
            run("umount", "-l", mnt, check=False)


def used_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_reflink_on_xfs(tmp_path):
    with loop_mounted_xfs(tmp_path) as mnt:
        src = write_tree(mnt / "src", {"big.bin": os.urandom(BIG), "small.txt": b"small\n"})
        with Ramet(data=mnt / "data", mode="fallback") as ramet:
            assert ramet.status()["copy_method"] == "reflink"
            base = ramet.snapshot(src)
            first = ramet.create(base)  # hydrates big.bin into the shared cache
            before = used_bytes(mnt)
            more = [ramet.create(base) for _ in range(3)]
            assert used_bytes(mnt) - before < 4 << 20  # 3 copies would take 96 MiB
            for ex in [first, *more]:
                assert tree_signature(ex.path) == tree_signature(src)
            with open(more[0].path / "big.bin", "r+b") as f:
                f.write(b"changed")
            more[0].reset()
            assert tree_signature(more[0].path) == tree_signature(src)
            assert last_stats(more[0])["methods"] == {"reflink": 1}
    assert not os.path.ismount(mnt), "the xfs image did not unmount cleanly"


@pytest.mark.parametrize("fs", ["ext2/ext3", "tmpfs"])
def test_plain_copy_on_ext4_and_tmpfs(tmp_path, fs):
    top = tmp_path if fs == "ext2/ext3" else Path("/dev/shm")
    found = fs_type(top) if top.is_dir() else "absent"
    if found != fs:
        pytest.skip(f"no {fs} file system here: {top} is {found}")
    data = top / f"rametfs-test-{os.getpid()}" if fs == "tmpfs" else top / "data"
    try:
        with Ramet(data=data, mode="fallback") as ramet:
            assert ramet.status()["copy_method"] == "copy"
            src = write_tree(tmp_path / "src", {"f": b"plain copy\n"})
            ex = ramet.create(ramet.snapshot(src))
            assert tree_signature(ex.path) == tree_signature(src)
            (ex.path / "f").write_bytes(b"changed\n")
            ex.reset()
            assert last_stats(ex)["methods"] == {"copy": 1}
    finally:
        if fs == "tmpfs":
            shutil.rmtree(data, ignore_errors=True)


@pytest.mark.skipif(sys.platform != "darwin",
                    reason="clonefile(2) exists only on macOS (APFS); on Linux the reflink "
                           "test covers cloning")
def test_clonefile_on_macos(ramet, tmp_path):
    assert ramet.status()["copy_method"] == "clonefile"
    src = write_tree(tmp_path / "src", {"f": b"cloned\n"})
    ex = ramet.create(ramet.snapshot(src))
    assert tree_signature(ex.path) == tree_signature(src)


# ----- the CLI ----------------------------------------------------------------------------------

def test_cli_in_fallback_mode(tmp_path):
    data = tmp_path / "data"
    src = write_tree(tmp_path / "src", {"a.txt": b"alpha\n"})

    def cli(*args, env=None):
        env = {"RAMET_MOUNT": None, "RAMET_MODE": "fallback", "RAMET_DATA": str(data),
               **(env or {})}
        return CliRunner(env=env).invoke(main, list(args))

    base = cli("snapshot", str(src)).stdout.strip()
    assert cli("create", base, "--name", "run-1").stdout == "run-1\n"
    (data / "fallback" / "executions" / "run-1" / "new.txt").write_text("new\n")
    assert cli("diff", "run-1").stdout == "A new.txt\n"
    promoted = cli("promote", "run-1").stdout.strip()
    listing = cli("ls").stdout.splitlines()
    method = copy_method_for(tmp_path)
    assert listing[0] == f"mode: fallback  copy method: {method}  data: {data}"
    assert listing[-1].split()[:4] == ["run-1", base[:12], promoted[:12], "-"]
    status = json.loads(cli("status").stdout)
    assert (status["mode"], status["copy_method"], status["mount"]) == ("fallback", method, None)
    assert json.loads(cli("status", "run-1").stdout)["head"] == promoted
    assert cli("reset", "run-1").exit_code == 0
    assert cli("diff", "run-1").stdout == ""
    assert cli("release", "run-1").exit_code == 0
    result = cli("status", "run-1")
    assert (result.exit_code, result.stderr) == (3, f"rametfs: no execution 'run-1' in {data}\n")
    # The options work as well as the environment, and a missing --data is a usage error.
    assert cli("ls", "--mode", "fallback", "--data", str(data),
               env={"RAMET_MODE": None, "RAMET_DATA": None}).exit_code == 0
    assert cli("ls", env={"RAMET_DATA": None}).exit_code == 2
