"""Fallback mode (no FUSE): what only fallback executions have.

The wrapper and CLI calls both modes share (pool, promote, reset, diff, verify, preview,
errors) run in both modes in test_client.py; here are the copy methods (reflink on a
loop-mounted xfs image, plain copy, clonefile on macOS), the manifest and the O(changed) cost,
locks, ``auto`` mode, the fallback CLI's mode line, and snapshots passed between a FUSE daemon
and fallback mode.  Fallback mode is forced (``mode="fallback"``) although this host has
/dev/fuse, so the same host also runs the FUSE daemon for the cross-mode test.
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
from test_snapshots import tree_signature, write_tree

XFS_IMAGE_SIZE = "300M"
BIG = 32 << 20  # bytes: three copies of it would not fit in the xfs image beside the store


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

def test_executions_are_real_directories(ramet, tmp_path):
    # The flow of the wrapper runs in both modes in test_client; here what only fallback has.
    assert (ramet.mode, ramet.mount, ramet.data) == ("fallback", None, tmp_path / "data")
    method = copy_method_for(tmp_path)
    status = ramet.status()
    assert (status["mode"], status["copy_method"], status["mount"]) == ("fallback", method, None)
    ex = ramet.create(ramet.snapshot(write_tree(tmp_path / "src", {"a": b"a\n"})))
    assert ex.path == tmp_path / "data" / "fallback" / "executions" / ex.id
    assert stat.S_ISDIR(os.lstat(ex.path).st_mode) and not os.path.ismount(ex.path)
    mine = ex.status()
    assert (mine["mode"], mine["copy_method"], mine["path"], mine["upper_bytes"]) == (
        "fallback", method, str(ex.path), None)
    ramet.release(ex)
    assert os.listdir(tmp_path / "data" / "fallback" / "executions") == []


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

    ex.reset(base=True)
    stats = last_stats(ex)  # written: the 3 files, and their directories' mtimes
    assert {k: stats[k] for k in ("kept", "removed", "written", "methods")} == {
        "kept": 497, "removed": 3, "written": 6, "methods": {method: 3}}
    assert tree_signature(ex.path) == tree_signature(src)
    ex.reset()  # nothing differs: nothing is written
    assert {k: last_stats(ex)[k] for k in ("kept", "removed", "written", "methods")} == {
        "kept": 500, "removed": 0, "written": 0, "methods": {}}
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


def test_a_shared_directory_taken_from_the_base_keeps_its_parents_link_flag(ramet, tmp_path):
    # The base's a/vendor/ holds a hard-link pair; the agent breaks the pair (same bytes, mode
    # and mtime: the diff, and so the shared path, is unchanged; in FUSE mode the rewritten
    # file is M).  The promote takes a/vendor/ from the base, hard links and all, so a/ must
    # say a hard link lies below it, as in the base: the promoted tree is the base's.
    src = write_tree(tmp_path / "src", {"a/vendor/x": b"linked\n", "a/other": b"o\n"})
    os.link(src / "a/vendor/x", src / "a/vendor/y")
    base = ramet.snapshot(src)
    ex = ramet.create(base)
    vendor = ex.path / "a" / "vendor"
    st = os.stat(vendor / "y")
    (vendor / "copy").write_bytes((vendor / "y").read_bytes())
    os.replace(vendor / "copy", vendor / "y")
    os.utime(vendor / "y", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(vendor / "x").st_nlink == 1 and ex.diff() == []
    policy = tmp_path / "shared.toml"
    policy.write_text('shared = ["a/vendor/"]\n')
    store = ramet._backend.engine.store
    assert store.snapshot(ex.promote(policy=policy)).root == store.snapshot(base).root


def test_errors_only_fallback_has(ramet, tmp_path, monkeypatch):
    # The errors of both modes are in test_client.
    src = write_tree(tmp_path / "src", {"a": b"a\n"})
    base = ramet.snapshot(src)
    ex = ramet.create(base, name="one")
    (ex.path / ".ramet").mkdir()  # under FUSE the name is the control directory
    monkeypatch.delenv("RAMET_DATA", raising=False)
    cases = [
        (lambda: ramet.create(base, name="one"), errno.EEXIST),
        (lambda: ramet.release("nope"), errno.ENOENT),
        (lambda: ramet.execution("nope").promote(), errno.ENOENT),
        (lambda: ramet.execution("../data").status(), errno.ENOENT),
        (lambda: ex.promote(), errno.EINVAL),  # .ramet is reserved
        (lambda: Ramet(mode="fallback"), errno.EINVAL),
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


def test_a_removed_root_is_made_again(ramet, tmp_path):
    src = write_tree(tmp_path / "src", {"a": b"a\n"})
    base = ramet.snapshot(src)
    ex = ramet.create(base)
    shutil.rmtree(ex.path)  # a sandbox may remove everything, its root included
    assert ex.reset() == base
    assert tree_signature(ex.path) == tree_signature(src)
    ramet.release(ex)
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
    # The commands of both modes are in test_client; here the mode line and the options.
    data = tmp_path / "data"

    def cli(*args, env=None):
        env = {"RAMET_MOUNT": None, "RAMET_MODE": "fallback", "RAMET_DATA": str(data),
               **(env or {})}
        return CliRunner(env=env).invoke(main, list(args))

    base = cli("snapshot", str(write_tree(tmp_path / "src", {"a.txt": b"alpha\n"}))).stdout
    assert cli("create", base.strip(), "--name", "run-1").stdout == "run-1\n"
    listing = cli("ls").stdout.splitlines()
    method = copy_method_for(tmp_path)
    assert listing[0] == f"mode: fallback  copy method: {method}  data: {data}"
    assert listing[-1].split()[:4] == ["run-1", base[:12], base[:12], "-"]
    status = json.loads(cli("status").stdout)
    assert (status["mode"], status["copy_method"], status["mount"]) == ("fallback", method, None)
    # The options work as well as the environment, and a missing --data is a usage error.
    assert cli("ls", "--mode", "fallback", "--data", str(data),
               env={"RAMET_MODE": None, "RAMET_DATA": None}).stdout.splitlines() == listing
    assert cli("ls", env={"RAMET_DATA": None}).exit_code == 2
