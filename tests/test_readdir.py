"""Directory listings through the real mount: ``.`` and ``..`` in every directory (executions,
snapshots, the top directories, ``.ramet/``), with the inode numbers ``stat`` gives and offsets
that stay valid from one call to the next (fstests generic/471 and 736 count them), while the
programs that walk trees (find, tar, cp -r, git, os.walk) and the daemon's own diff and
fsmonitor see exactly the names they saw before."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import stat
from pathlib import Path

from conftest import run
from test_fsmonitor import GIT, hook
from test_snapshots import write_tree

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class Dirent(ctypes.Structure):  # glibc's struct dirent on 64-bit Linux
    _fields_ = [("d_ino", ctypes.c_uint64), ("d_off", ctypes.c_int64),
                ("d_reclen", ctypes.c_ushort), ("d_type", ctypes.c_ubyte),
                ("d_name", ctypes.c_char * 256)]


libc.opendir.restype = ctypes.c_void_p
libc.opendir.argtypes = [ctypes.c_char_p]
libc.readdir.restype = ctypes.POINTER(Dirent)
libc.readdir.argtypes = [ctypes.c_void_p]
libc.closedir.argtypes = [ctypes.c_void_p]
libc.telldir.restype = ctypes.c_long
libc.telldir.argtypes = [ctypes.c_void_p]
libc.seekdir.argtypes = [ctypes.c_void_p, ctypes.c_long]


def dirents(path: Path, start: int | None = None) -> list[tuple[bytes, int, int, int]]:
    """readdir(3) of ``path`` from its start, or from the offset ``start`` (seekdir):
    ``(name, d_ino, d_off, d_type)`` in the order the file system gives them."""
    d = libc.opendir(os.fsencode(path))
    assert d, os.strerror(ctypes.get_errno())
    try:
        if start is not None:
            libc.seekdir(d, start)
        out = []
        while ent := libc.readdir(d):
            e = ent.contents
            out.append((e.d_name, e.d_ino, e.d_off, e.d_type))
        return out
    finally:
        libc.closedir(d)


def dots(path: Path) -> tuple[int, int]:
    """The inode numbers readdir gives ``.`` and ``..`` of ``path``; they come first."""
    (n1, i1, _, t1), (n2, i2, _, t2), *_ = dirents(path)
    assert (n1, n2, t1, t2) == (b".", b"..", 4, 4)  # DT_DIR
    return i1, i2


def ino(path: Path) -> int:
    return os.lstat(path).st_ino


def test_every_directory_lists_dot_and_dotdot_with_their_inode_numbers(shared_daemon,
                                                                       tmp_path):
    src = write_tree(tmp_path / "src", {"a/b/f": b"f\n", "top": b"t\n", "moved/x": b"x\n"})
    snap = shared_daemon.snapshot(src)
    eid = shared_daemon.create(snap)
    mnt, ex, sv = shared_daemon.mnt, shared_daemon.exec_path(eid), shared_daemon.snap_path(snap)
    (ex / "new").mkdir()
    (ex / "new" / "deeper").mkdir()
    os.rename(ex / "moved", ex / "a" / "b" / "moved")  # its .. follows it

    assert dots(mnt) == (1, 1)  # the mount root's .. is itself, as ext4's root's
    for top in ("snapshots", "executions", ".ramet"):
        assert dots(mnt / top) == (ino(mnt / top), 1)
    assert dots(ex) == (ino(ex), ino(mnt / "executions"))
    assert dots(sv) == (ino(sv), ino(mnt / "snapshots"))
    assert dots(ex / ".ramet") == (ino(ex / ".ramet"), ino(ex))
    for d in (ex, sv):
        assert dots(d / "a") == (ino(d / "a"), ino(d))
        assert dots(d / "a" / "b") == (ino(d / "a" / "b"), ino(d / "a"))
    assert dots(ex / "new" / "deeper") == (ino(ex / "new" / "deeper"), ino(ex / "new"))
    assert dots(ex / "a" / "b" / "moved") == (ino(ex / "a" / "b" / "moved"),
                                              ino(ex / "a" / "b"))
    assert dots(sv / "moved") == (ino(sv / "moved"), ino(sv))

    assert run("ls", "-a", ex).stdout.split() == [".", "..", "a", "new", "top"]
    assert run("ls", "-a", ex / "new" / "deeper").stdout.split() == [".", ".."]
    assert run("ls", "-a", sv / "a").stdout.split() == [".", "..", "b"]
    # A whited-out and a made name are listed like any other, after the two.
    (ex / "top").unlink()
    (ex / "made").write_bytes(b"m\n")
    assert [e[0] for e in dirents(ex)] == [b".", b"..", b"a", b"made", b"new"]
    shared_daemon.ctl(f"release {eid}")


def test_offsets_stay_valid_across_calls_in_a_large_directory(shared_daemon, tmp_path):
    """5000 entries (4000 from the snapshot, 1000 made) take several readdir replies: 5002
    entries come back, each offset is the next entry's position, and a listing resumed at
    any offset (seekdir) gives the same entries as the whole listing from there."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "big").mkdir()
    for i in range(4000):
        (src / "big" / f"s{i:04d}").write_bytes(b"")
    ex = shared_daemon.exec_path(shared_daemon.create(shared_daemon.snapshot(src)))
    big = ex / "big"
    for i in range(1000):
        (big / f"m{i:04d}").write_bytes(b"")

    whole = dirents(big)
    assert len(whole) == 5002
    assert [e[0] for e in whole[:2]] == [b".", b".."]
    assert sorted(e[0] for e in whole[2:]) == sorted(os.fsencode(n) for n in os.listdir(big))
    assert len({e[1] for e in whole[2:]}) == 5000  # one inode number each
    assert dirents(big) == whole  # a second pass: the same names, inodes and offsets
    for k in (0, 1, 2, 700, 2501, 4999):
        assert dirents(big, start=whole[k][2]) == whole[k + 1:]
    assert dirents(big, start=whole[-1][2]) == []


def test_tree_walkers_see_no_dot_entries(shared_daemon, tmp_path):
    """find, tar, cp -r, os.walk, git (with and without the fsmonitor hook) and the
    execution's diff list exactly what they list on ext4 of the same tree."""
    src = write_tree(tmp_path / "src", {"d/e/f": b"f\n", "g": b"g\n", "d/h": b"h\n"})
    run(*GIT, "init", "-q", cwd=src)
    run(*GIT, "add", "-A", cwd=src)
    run(*GIT, "commit", "-qm", "init", cwd=src)
    eid = shared_daemon.create(shared_daemon.snapshot(src))
    ex = shared_daemon.exec_path(eid)
    ext4 = tmp_path / "ext4"
    run("cp", "-a", src, ext4)
    for root in (ex, ext4):
        (root / "d" / "new").mkdir()
        (root / "d" / "new" / "n").write_bytes(b"n\n")
        (root / "g").unlink()

    def walk(root: Path) -> dict:
        return {
            "find": sorted(run("find", ".", cwd=root).stdout.splitlines()),
            "tar": sorted(run("sh", "-c", "tar -cf - --exclude=./.git . | tar -tf -",
                              cwd=root).stdout.splitlines()),
            "os.walk": sorted((os.path.relpath(d, root), sorted(ds), sorted(fs))
                              for d, ds, fs in os.walk(root)),
            "git": run(*GIT, "status", "--porcelain", "--untracked-files=all",
                       cwd=root).stdout,
        }

    got, want = walk(ex), walk(ext4)
    assert got == want
    assert "./." not in got["find"] and "./.." not in got["find"]
    assert got["tar"] == ["./", "./d/", "./d/e/", "./d/e/f", "./d/h", "./d/new/",
                          "./d/new/n"]
    run("cp", "-r", ex / "d", tmp_path / "copy")
    copy = tmp_path / "copy"
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*")) == [
        "e", "e/f", "h", "new", "new/n"]
    monitor = ("-c", "core.untrackedCache=true", "-c", "core.fsmonitor=.ramet/fsmonitor")
    assert run(*GIT, *monitor, "status", "--porcelain", "--untracked-files=all",
               cwd=ex).stdout == got["git"] == " D g\n?? d/new/n\n"
    _, paths = hook(ex, "")
    assert paths == ["/"]
    assert (ex / ".ramet" / "diff").read_text().splitlines() == [
        "M .git/index", "A d/new/", "A d/new/n", "D g"]  # git status refreshed its index
    shared_daemon.ctl(f"release {eid}")
