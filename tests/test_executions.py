"""Executions through the kernel mount: full read-write POSIX over a snapshot, copy-on-write.

Where behaviour is not obvious, the same operations run on a plain copy of the source on the
host file system (ext4) and the two results must be equal.
"""

from __future__ import annotations

import errno
import importlib.util
import mmap
import os
import sqlite3
import stat
import sys
import threading
from pathlib import Path

import pytest

from conftest import Daemon, run
from rametfs import protocol
from test_snapshots import PAGE, tree_signature, write_tree

BASE_TXT = b"0123456789abcdefghij"  # 20 bytes
MIB = 1 << 20
BIG = os.urandom(MIB)  # one 1 MiB base file, shared by the tests that need it


@pytest.fixture
def source(tmp_path) -> Path:
    """A small source tree: files at two depths, a 1 MiB file, hard links, a symlink, xattrs,
    a Python package."""
    src = write_tree(tmp_path / "src", {
        "base.txt": BASE_TXT,
        "big.bin": BIG,
        "dir/a.txt": b"a\n",
        "dir/sub/b.txt": b"b\n",
        "dir/sub/deeper/c.txt": b"c\n",
        "other/keep.txt": b"keep\n",
        "hl1": b"hard\n",
        "pkg/__init__.py": b"",
        "pkg/mod.py": b"VALUE = 6 * 7\n",
    })
    os.link(src / "hl1", src / "other" / "hl2")
    os.symlink("base.txt", src / "link")
    os.setxattr(src / "base.txt", "user.origin", b"base")
    return src


class Executions:
    """Creates executions of snapshots on one daemon; releases what is left at teardown."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.ids: list[str] = []

    def new(self, snapshot: str) -> Path:
        eid = self.daemon.create(snapshot)
        self.ids.append(eid)
        return self.daemon.exec_path(eid)

    def release_all(self) -> None:
        live = {e["id"] for e in self.daemon.status()["executions"]}
        for eid in self.ids:
            if eid in live:
                self.daemon.ctl(f"release {eid}")


@pytest.fixture
def executions(shared_daemon):
    made = Executions(shared_daemon)
    yield made
    made.release_all()


@pytest.fixture
def snap(shared_daemon, source) -> str:
    return shared_daemon.snapshot(source)


@pytest.fixture
def ex(executions, snap) -> Path:
    """A fresh execution of ``snap``."""
    return executions.new(snap)


def ext4_copy(source: Path, dest: Path) -> Path:
    run("cp", "-a", source, dest)
    return dest


# ----- create --------------------------------------------------------------------------------

def test_create_replies_and_the_execution_appears(shared_daemon, executions, snap, source):
    reply = shared_daemon.ctl(f"create {snap}")
    executions.ids.append(reply["execution"])
    eid = reply["execution"]
    path = shared_daemon.exec_path(eid)

    assert reply["ok"] is True
    assert protocol.EXECUTION_NAME_RE.fullmatch(eid)
    assert (reply["snapshot"], reply["path"]) == (snap, str(path))
    assert eid in os.listdir(shared_daemon.mnt / "executions")
    assert stat.S_ISDIR(os.stat(path).st_mode)
    status = shared_daemon.exec_status(eid)
    assert (status["execution"], status["base"], status["head"], status["state"],
            status["upper_bytes"], status["last"]) == (eid, snap, snap, "ready", 0, None)
    assert tree_signature(path) == tree_signature(source)


def test_create_with_a_name_and_by_prefix(shared_daemon, executions, snap):
    reply = shared_daemon.ctl(f"create {snap[:protocol.MIN_ID_PREFIX]} --name run-1.a_b")
    executions.ids.append(reply["execution"])

    assert (reply["execution"], reply["snapshot"]) == ("run-1.a_b", snap)
    assert (shared_daemon.exec_path("run-1.a_b") / "base.txt").read_bytes() == BASE_TXT


# ----- file contents -------------------------------------------------------------------------

def test_create_write_and_read_a_new_file(ex):
    fd = os.open(ex / "dir" / "new.txt", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        assert os.write(fd, b"hello ") == 6
        assert os.pwrite(fd, b"world", 6) == 5
        assert os.pread(fd, 100, 0) == b"hello world"
        st = os.fstat(fd)
        assert (st.st_size, stat.S_IMODE(st.st_mode), st.st_nlink) == (11, 0o640, 1)
    finally:
        os.close(fd)
    assert (ex / "dir" / "new.txt").read_bytes() == b"hello world"
    with pytest.raises(FileExistsError):
        os.open(ex / "dir" / "new.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def test_append_to_a_base_file(ex):
    fd = os.open(ex / "base.txt", os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"+one")
        os.lseek(fd, 0, os.SEEK_SET)  # O_APPEND writes at the end wherever the offset is
        os.write(fd, b"+two")
    finally:
        os.close(fd)
    assert (ex / "base.txt").read_bytes() == BASE_TXT + b"+one+two"
    run("bash", "-c", "printf '+three' >> base.txt", cwd=ex)
    assert (ex / "base.txt").read_bytes() == BASE_TXT + b"+one+two+three"


def test_shell_redirection_truncates_a_base_file(ex, snap, shared_daemon):
    run("bash", "-c", "printf BB > base.txt", cwd=ex)

    assert (ex / "base.txt").read_bytes() == b"BB"
    assert os.stat(ex / "base.txt").st_size == 2
    assert (shared_daemon.snap_path(snap) / "base.txt").read_bytes() == BASE_TXT


def test_open_with_o_trunc(ex):
    fd = os.open(ex / "big.bin", os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
        os.write(fd, b"xyz")
    finally:
        os.close(fd)
    assert (ex / "big.bin").read_bytes() == b"xyz"


def test_truncate_grow_and_shrink_a_base_file(ex):
    os.truncate(ex / "base.txt", 30)
    assert (ex / "base.txt").read_bytes() == BASE_TXT + bytes(10)
    os.truncate(ex / "base.txt", 5)
    assert (ex / "base.txt").read_bytes() == BASE_TXT[:5]
    os.truncate(ex / "base.txt", 8)  # the cut bytes must not come back
    assert (ex / "base.txt").read_bytes() == BASE_TXT[:5] + bytes(3)


def test_truncate_across_pages_of_a_large_base_file(ex):
    cut = PAGE + 1000
    with open(ex / "big.bin", "r+b") as f:
        f.truncate(cut)
        f.truncate(3 * PAGE + 7)
        f.seek(0)
        assert f.read() == BIG[:cut] + bytes(3 * PAGE + 7 - cut)
    os.truncate(ex / "big.bin", 10)
    os.truncate(ex / "big.bin", 2 * PAGE)
    assert (ex / "big.bin").read_bytes() == BIG[:10] + bytes(2 * PAGE - 10)


def test_small_write_into_a_large_base_file_copies_up_little(shared_daemon, ex):
    off = MIB // 2 + 100
    patch = os.urandom(4096)
    fd = os.open(ex / "big.bin", os.O_WRONLY)
    try:
        assert os.pwrite(fd, patch, off) == 4096
        os.fsync(fd)
    finally:
        os.close(fd)

    assert (ex / "big.bin").read_bytes() == BIG[:off] + patch + BIG[off + 4096:]
    assert os.stat(ex / "big.bin").st_size == MIB
    assert shared_daemon.exec_status(ex.name)["upper_bytes"] < 256 * 1024


# ----- names ---------------------------------------------------------------------------------

def test_rename_a_base_file(ex):
    ino = os.stat(ex / "base.txt").st_ino
    os.rename(ex / "base.txt", ex / "dir" / "moved.txt")

    assert not os.path.lexists(ex / "base.txt")
    assert (ex / "dir" / "moved.txt").read_bytes() == BASE_TXT
    assert os.stat(ex / "dir" / "moved.txt").st_ino == ino
    assert os.getxattr(ex / "dir" / "moved.txt", "user.origin") == b"base"
    os.rename(ex / "dir" / "a.txt", ex / "dir" / "moved.txt")  # replaces the target
    assert (ex / "dir" / "moved.txt").read_bytes() == b"a\n"
    assert sorted(os.listdir(ex / "dir")) == ["moved.txt", "sub"]


def test_rename_a_base_directory_with_children(ex):
    ino = os.stat(ex / "dir").st_ino
    os.rename(ex / "dir", ex / "other" / "renamed")  # a real rename: no EXDEV

    new = ex / "other" / "renamed"
    assert not os.path.lexists(ex / "dir")
    assert os.stat(new).st_ino == ino
    assert (new / "a.txt").read_bytes() == b"a\n"
    assert (new / "sub" / "b.txt").read_bytes() == b"b\n"
    assert (new / "sub" / "deeper" / "c.txt").read_bytes() == b"c\n"
    assert sorted(os.listdir(ex / "other")) == ["hl2", "keep.txt", "renamed"]
    os.mkdir(ex / "dir")
    assert os.listdir(ex / "dir") == []
    (ex / "dir" / "a.txt").write_bytes(b"new a\n")
    assert (new / "a.txt").read_bytes() == b"a\n"
    run("mv", new / "sub", ex / "dir" / "sub2")
    assert (ex / "dir" / "sub2" / "deeper" / "c.txt").read_bytes() == b"c\n"
    assert sorted(os.listdir(new)) == ["a.txt"]


def test_rename_errors_match_ext4(ex, source, tmp_path):
    ext4 = ext4_copy(source, tmp_path / "ext4")

    def attempts(root: Path) -> list:
        (root / "empty").mkdir()
        out = []
        for old, new in [("dir", "other"), ("dir", "base.txt"), ("base.txt", "dir"),
                         ("dir", "dir/sub/inside"), ("missing", "x"), ("dir", "empty")]:
            try:
                os.rename(root / old, root / new)
                out.append((old, new, "ok"))
            except OSError as exc:
                out.append((old, new, errno.errorcode[exc.errno]))
        return out

    assert attempts(ex) == attempts(ext4) == [
        ("dir", "other", "ENOTEMPTY"), ("dir", "base.txt", "ENOTDIR"),
        ("base.txt", "dir", "EISDIR"), ("dir", "dir/sub/inside", "EINVAL"),
        ("missing", "x", "ENOENT"), ("dir", "empty", "ok")]
    assert tree_signature(ex, times=False) == tree_signature(ext4, times=False)


def test_rename_and_link_across_executions_and_snapshots_give_exdev(shared_daemon, executions,
                                                                    snap, source):
    a, b = executions.new(snap), executions.new(snap)
    (a / "new.txt").write_bytes(b"only in a\n")
    crossings = [(a / "new.txt", b / "new.txt"), (a / "dir", b / "dir2"),
                 (a / "base.txt", b / "base-copy.txt"),
                 (shared_daemon.snap_path(snap) / "hl1", a / "x")]
    for op, src, dst in [(os.rename, a / "base.txt", b / "base.txt")] + \
            [(op, src, dst) for op in (os.rename, os.link) for src, dst in crossings
             if not (op is os.link and src.is_dir())]:
        with pytest.raises(OSError) as caught:
            op(src, dst)
        assert caught.value.errno == errno.EXDEV, (op, src, dst)
    run("mv", a / "new.txt", b / "moved.txt")  # mv copies, then unlinks, on EXDEV
    (b / "moved.txt").write_bytes(b"changed in b\n")

    assert not (a / "new.txt").exists()
    assert sorted(p.name for p in b.iterdir() if p.name.endswith(".txt")) == \
        ["base.txt", "moved.txt"]
    unchanged = tree_signature(source)
    del unchanged["."]  # a's root mtime moved with new.txt
    assert {k: v for k, v in tree_signature(a).items() if k != "."} == unchanged
    assert (b / "moved.txt").read_bytes() == b"changed in b\n"


def test_unlink_of_an_open_base_file_keeps_it_readable(ex):
    fd = os.open(ex / "base.txt", os.O_RDONLY)
    try:
        os.unlink(ex / "base.txt")
        assert not os.path.lexists(ex / "base.txt")
        assert os.pread(fd, 100, 0) == BASE_TXT
        assert os.fstat(fd).st_nlink == 0
    finally:
        os.close(fd)
    assert sorted(os.listdir(ex)) == ["big.bin", "dir", "hl1", "link", "other", "pkg"]


def test_unlink_of_an_open_base_file_keeps_it_writable(ex):
    fd = os.open(ex / "dir" / "a.txt", os.O_RDWR)  # not copied up before the unlink
    try:
        os.unlink(ex / "dir" / "a.txt")
        assert os.pwrite(fd, b"after unlink", 2) == 12
        assert os.pread(fd, 100, 0) == b"a\nafter unlink"
        assert os.fstat(fd).st_nlink == 0
    finally:
        os.close(fd)
    assert sorted(os.listdir(ex / "dir")) == ["sub"]


def test_unlink_of_an_open_new_file_keeps_it_writable(ex):
    fd = os.open(ex / "new", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x")
        os.unlink(ex / "new")
        assert os.fstat(fd).st_nlink == 0
        os.pwrite(fd, b"yz", 1)
        assert os.pread(fd, 100, 0) == b"xyz"
    finally:
        os.close(fd)
    assert not os.path.lexists(ex / "new")


def test_mkdir_and_rmdir(ex):
    os.mkdir(ex / "fresh", 0o750)
    st = os.stat(ex / "fresh")
    assert (stat.S_IMODE(st.st_mode), st.st_nlink) == (0o750, 2)
    with pytest.raises(FileExistsError):
        os.mkdir(ex / "dir")
    with pytest.raises(OSError) as caught:
        os.rmdir(ex / "dir")
    assert caught.value.errno == errno.ENOTEMPTY
    with pytest.raises(NotADirectoryError):
        os.rmdir(ex / "base.txt")
    os.rmdir(ex / "fresh")
    for rel in ["dir/sub/deeper/c.txt", "dir/sub/b.txt", "dir/a.txt"]:
        os.unlink(ex / rel)
    os.rmdir(ex / "dir" / "sub" / "deeper")
    os.rmdir(ex / "dir" / "sub")
    os.rmdir(ex / "dir")  # a base directory whose children are all deleted
    assert not os.path.lexists(ex / "dir")
    assert sorted(os.listdir(ex)) == ["base.txt", "big.bin", "hl1", "link", "other", "pkg"]


def test_directory_link_counts_match_ext4(ex, source, tmp_path):
    ext4 = ext4_copy(source, tmp_path / "ext4")

    def counts(root: Path) -> list[int]:
        out = [os.stat(root).st_nlink, os.stat(root / "dir").st_nlink]
        os.mkdir(root / "dir" / "x")
        out.append(os.stat(root / "dir").st_nlink)
        os.rename(root / "dir" / "sub", root / "sub")
        out += [os.stat(root / "dir").st_nlink, os.stat(root).st_nlink]
        return out

    assert counts(ex) == counts(ext4) == [5, 3, 4, 3, 6]


def test_symlink(ex):
    os.symlink("dir/a.txt", ex / "alink")
    os.symlink("/etc/passwd", ex / "abs")

    assert os.readlink(ex / "alink") == "dir/a.txt"
    assert (ex / "alink").read_bytes() == b"a\n"
    assert stat.S_ISLNK(os.lstat(ex / "abs").st_mode)
    assert os.readlink(ex / "abs") == "/etc/passwd"
    assert os.readlink(ex / "link") == "base.txt"
    os.unlink(ex / "link")
    assert not os.path.lexists(ex / "link")
    assert (ex / "base.txt").read_bytes() == BASE_TXT


def test_hard_link_of_a_base_file(ex):
    os.link(ex / "base.txt", ex / "dir" / "again")
    one, two = os.stat(ex / "base.txt"), os.stat(ex / "dir" / "again")
    assert one.st_ino == two.st_ino
    assert (one.st_nlink, two.st_nlink) == (2, 2)

    with open(ex / "dir" / "again", "r+b") as f:
        f.write(b"XY")
    assert (ex / "base.txt").read_bytes() == b"XY" + BASE_TXT[2:]
    os.unlink(ex / "base.txt")
    assert os.stat(ex / "dir" / "again").st_nlink == 1
    assert (ex / "dir" / "again").read_bytes() == b"XY" + BASE_TXT[2:]


def test_base_hard_links_survive_copy_up(ex):
    ino = os.stat(ex / "hl1").st_ino
    assert os.stat(ex / "other" / "hl2").st_ino == ino

    with open(ex / "other" / "hl2", "ab") as f:
        f.write(b"more\n")
    assert (ex / "hl1").read_bytes() == b"hard\nmore\n"
    os.chmod(ex / "hl1", 0o600)
    for path in (ex / "hl1", ex / "other" / "hl2"):
        st = os.stat(path)
        assert (st.st_ino, st.st_nlink, stat.S_IMODE(st.st_mode)) == (ino, 2, 0o600)


def test_inode_numbers_stay_stable_across_copy_up(ex):
    before = {rel: os.stat(ex / rel).st_ino for rel in ["base.txt", "dir", "dir/sub/b.txt"]}
    with open(ex / "base.txt", "ab") as f:
        f.write(b"!")
    (ex / "dir" / "new").write_bytes(b"n")
    os.chmod(ex / "dir" / "sub" / "b.txt", 0o600)

    assert {rel: os.stat(ex / rel).st_ino for rel in before} == before


# ----- attributes ----------------------------------------------------------------------------

def test_chmod_chown_and_utimens(ex):
    f = ex / "dir" / "a.txt"
    os.chown(f, 1234, 5678)
    os.chmod(f, 0o4751)  # after chown, which clears set-user-ID
    times = (1_111_111_111_123_456_789, 1_222_222_222_987_654_321)
    os.utime(f, ns=times)
    os.chown(ex / "link", 42, 43, follow_symlinks=False)
    os.chmod(ex / "dir" / "sub", 0o711)

    st = os.stat(f)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o4751, 1234, 5678)
    assert (st.st_atime_ns, st.st_mtime_ns) == times
    assert (os.lstat(ex / "link").st_uid, os.lstat(ex / "link").st_gid) == (42, 43)
    assert os.stat(ex / "base.txt").st_uid == 0  # the link's target is untouched
    assert stat.S_IMODE(os.stat(ex / "dir" / "sub").st_mode) == 0o711


def test_write_updates_mtime_and_ctime(ex):
    st0 = os.stat(ex / "base.txt")
    with open(ex / "base.txt", "ab") as f:
        f.write(b"x")
    st1 = os.stat(ex / "base.txt")
    assert st1.st_mtime_ns > st0.st_mtime_ns
    assert st1.st_ctime_ns >= st1.st_mtime_ns


def test_xattrs_set_get_list_remove(ex):
    f = ex / "dir" / "a.txt"
    os.setxattr(f, "user.one", b"1")
    os.setxattr(f, "user.two", b"\x00binary\xff")
    os.setxattr(f, "user.one", b"uno")

    assert os.getxattr(f, "user.one") == b"uno"
    assert os.getxattr(f, "user.two") == b"\x00binary\xff"
    assert sorted(os.listxattr(f)) == ["user.one", "user.two"]
    os.removexattr(f, "user.one")
    assert os.listxattr(f) == ["user.two"]
    with pytest.raises(OSError) as caught:
        os.getxattr(f, "user.one")
    assert caught.value.errno == errno.ENODATA
    with pytest.raises(OSError) as caught:
        os.removexattr(f, "user.one")
    assert caught.value.errno == errno.ENODATA
    assert os.getxattr(ex / "base.txt", "user.origin") == b"base"
    os.removexattr(ex / "base.txt", "user.origin")
    assert os.listxattr(ex / "base.txt") == []
    os.setxattr(ex / "dir", "user.d", b"dir value")
    assert os.getxattr(ex / "dir", "user.d") == b"dir value"


def test_fsync_and_statfs(shared_daemon, ex):
    fd = os.open(ex / "synced", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"durable")
        os.fsync(fd)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    dfd = os.open(ex, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    assert (ex / "synced").read_bytes() == b"durable"

    vfs, host = os.statvfs(ex), os.statvfs(shared_daemon.data_dir)
    assert (vfs.f_bsize, vfs.f_frsize, vfs.f_blocks, vfs.f_files, vfs.f_namemax) == (
        host.f_bsize, host.f_frsize, host.f_blocks, host.f_files, 255)
    assert 0 < vfs.f_bavail <= vfs.f_bfree <= vfs.f_blocks


# ----- isolation -----------------------------------------------------------------------------

def test_two_executions_do_not_see_each_other(shared_daemon, executions, snap, source):
    one, two = executions.new(snap), executions.new(snap)
    (one / "base.txt").write_bytes(b"one")
    (one / "only-one").write_bytes(b"1")
    os.unlink(one / "dir" / "a.txt")
    os.rename(one / "other", one / "other2")
    os.chmod(one / "hl1", 0o700)

    assert tree_signature(two) == tree_signature(source)
    (two / "two-only").write_bytes(b"2")
    assert not os.path.lexists(one / "two-only")
    assert (one / "base.txt").read_bytes() == b"one"
    assert tree_signature(shared_daemon.snap_path(snap)) == tree_signature(source)


# ----- real programs -------------------------------------------------------------------------

def test_cp_a_inside_an_execution(ex, source):
    (ex / "copy").mkdir()
    run("cp", "-a", ex / "dir", ex / "hl1", ex / "other", ex / "copy")

    run("diff", "-r", ex / "dir", ex / "copy" / "dir")
    assert tree_signature(ex / "copy" / "dir") == tree_signature(source / "dir")
    assert os.stat(ex / "copy" / "hl1").st_ino == os.stat(ex / "copy" / "other" / "hl2").st_ino
    assert tree_signature(ex / "copy" / "other") == tree_signature(source / "other")


def test_tar_round_trip_inside_an_execution(ex, source, tmp_path):
    run("tar", "--format=posix", "-C", ex, "-cf", tmp_path / "out.tar", ".")  # ns mtimes
    run("tar", "--format=posix", "-C", source, "-cf", tmp_path / "src.tar", ".")
    listing = sorted(run("tar", "-tf", tmp_path / "out.tar").stdout.split())
    assert listing == sorted(run("tar", "-tf", tmp_path / "src.tar").stdout.split())
    assert "./.ramet/" not in listing
    (ex / "untarred").mkdir()
    run("tar", "-C", ex / "untarred", "-xpf", tmp_path / "out.tar", "./dir", "./hl1", "./other")
    run("diff", "-r", ex / "dir", ex / "untarred" / "dir")
    run("diff", "-r", ex / "other", ex / "untarred" / "other")
    untarred = ex / "untarred"
    assert os.stat(untarred / "hl1").st_ino == os.stat(untarred / "other" / "hl2").st_ino
    assert tree_signature(ex / "untarred" / "dir") == tree_signature(source / "dir")


def test_git_inside_an_execution(ex, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    repo = ex / "dir"
    run("git", "init", "-q", cwd=repo, env=env)
    run("git", "add", "-A", cwd=repo, env=env)
    run("git", "commit", "-q", "-m", "first", cwd=repo, env=env)
    (repo / "a.txt").write_bytes(b"changed\n")
    run("git", "commit", "-q", "-am", "second", cwd=repo, env=env)
    assert run("git", "status", "--porcelain", cwd=repo, env=env).stdout == ""
    assert run("git", "log", "--format=%s", cwd=repo, env=env).stdout == "second\nfirst\n"
    assert run("git", "ls-files", cwd=repo, env=env).stdout.split() == [
        "a.txt", "sub/b.txt", "sub/deeper/c.txt"]
    assert run("git", "show", "HEAD~1:a.txt", cwd=repo, env=env).stdout == "a\n"
    run("git", "fsck", "--strict", cwd=repo, env=env)


def test_compileall_inside_an_execution(ex, source, tmp_path):
    ext4 = ext4_copy(source, tmp_path / "ext4")
    env = {k: v for k, v in os.environ.items()
           if k not in ("SOURCE_DATE_EPOCH", "PYTHONDONTWRITEBYTECODE")}
    for root in (ex, ext4):
        run(sys.executable, "-m", "compileall", "-q", "pkg", cwd=root, env=env)

    pyc = Path(importlib.util.cache_from_source("pkg/mod.py"))
    assert (ex / pyc).read_bytes() == (ext4 / pyc).read_bytes()
    assert sorted(os.listdir(ex / "pkg" / "__pycache__")) == sorted(
        os.listdir(ext4 / "pkg" / "__pycache__"))
    out = run(sys.executable, "-c", "import pkg.mod; print(pkg.mod.VALUE, pkg.mod.__cached__)",
              cwd=ex, env=env).stdout
    assert out == f"42 {ex / pyc}\n"


def test_mmap_writes_to_a_base_file(ex):
    with open(ex / "big.bin", "r+b") as f:
        with mmap.mmap(f.fileno(), 0) as m:
            m[PAGE - 2:PAGE + 2] = b"MMAP"
            m[-1:] = b"!"
            m.flush()
    assert (ex / "big.bin").read_bytes() == BIG[:PAGE - 2] + b"MMAP" + BIG[PAGE + 2:-1] + b"!"


def test_sqlite_database_inside_an_execution(ex):
    db = sqlite3.connect(ex / "data.db")
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE t (n INTEGER PRIMARY KEY, v TEXT)")
        with db:
            db.executemany("INSERT INTO t VALUES (?, ?)", [(n, f"v{n}" * 50) for n in range(2000)])
        with db:
            db.execute("DELETE FROM t WHERE n % 3 = 0")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        db.close()
    db = sqlite3.connect(ex / "data.db")
    try:
        assert db.execute("SELECT count(*), sum(n) FROM t").fetchone() == (
            1333, sum(n for n in range(2000) if n % 3))
    finally:
        db.close()


def test_rm_rf_of_a_large_base_directory(shared_daemon, executions, tmp_path):
    names = [f"file-{n:04d}-{'x' * 40}" for n in range(600)]  # several readdir buffers
    src = write_tree(tmp_path / "many", {f"d/{n}": n.encode() for n in names})
    path = executions.new(shared_daemon.snapshot(src))

    assert sorted(os.listdir(path / "d")) == names
    assert run("find", path / "d", "-type", "f").stdout.count("\n") == 600
    run("rm", "-rf", path / "d")
    assert os.listdir(path) == []


def test_posix_sequence_matches_ext4(ex, source, tmp_path):
    ext4 = ext4_copy(source, tmp_path / "ext4")

    def sequence(root: Path) -> None:
        (root / "dir" / "sub" / "new.txt").write_bytes(b"new")
        os.rename(root / "dir" / "sub", root / "sub")
        os.link(root / "sub" / "new.txt", root / "new-link")
        os.unlink(root / "other" / "keep.txt")
        os.symlink("../base.txt", root / "other" / "up")
        with open(root / "base.txt", "r+b") as f:
            f.seek(30)
            f.write(b"hole")
        os.truncate(root / "hl1", 2)
        os.chmod(root / "pkg", 0o700)
        os.setxattr(root / "sub", "user.x", b"y")
        os.removexattr(root / "base.txt", "user.origin")
        os.rename(root / "dir" / "a.txt", root / "pkg" / "a.txt")
        os.mkdir(root / "dir" / "sub")

    sequence(ex)
    sequence(ext4)
    assert tree_signature(ex, times=False) == tree_signature(ext4, times=False)


def test_concurrent_writers_in_one_execution(ex):
    def writer(i: int) -> None:
        with open(ex / f"w{i}", "wb") as f:
            for n in range(200):
                f.write(f"{i}:{n:04d}\n".encode())
                f.flush()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert (ex / f"w{i}").read_bytes() == b"".join(
            f"{i}:{n:04d}\n".encode() for n in range(200))


def test_base_content_hydrates_lazily_and_once(daemon, tmp_path):
    """Only what is read is decompressed, once, into the cache every view shares."""
    src = write_tree(tmp_path / "src", {"read.txt": b"read me\n", "unread.txt": b"never\n",
                                        "also-unread.bin": os.urandom(3 * PAGE)})
    snap = daemon.snapshot(src)
    views = [daemon.exec_path(daemon.create(snap)) for _ in range(3)]
    views.append(daemon.snap_path(snap))
    cache = daemon.data_dir / "cache"
    assert os.listdir(cache) == []
    assert [(v / "read.txt").read_bytes() for v in views] == [b"read me\n"] * 4
    assert len(os.listdir(cache)) == 1
    assert (cache / os.listdir(cache)[0]).read_bytes() == b"read me\n"
