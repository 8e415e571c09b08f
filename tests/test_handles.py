"""File handles through the real mount (docs/conformance.md, "File handles"):
name_to_handle_at(2) and open_by_handle_at(2) of files and directories the kernel has dropped
from its caches (``drop_caches``, as fstests's open_by_handle tests do), answered by lookups of
``.`` and ``..`` by inode number (FUSE export support)."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest

from test_fallocate import fresh

MAX_HANDLE_SZ = 128
_libc = ctypes.CDLL(None, use_errno=True)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="open_by_handle_at needs "
                                                          "CAP_DAC_READ_SEARCH")


class FileHandle(ctypes.Structure):  # struct file_handle, fcntl.h
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int),
                ("f_handle", ctypes.c_ubyte * MAX_HANDLE_SZ)]


def name_to_handle(path) -> FileHandle:
    handle, mount_id = FileHandle(handle_bytes=MAX_HANDLE_SZ), ctypes.c_int()
    if _libc.name_to_handle_at(-100, os.fsencode(path), ctypes.byref(handle),  # AT_FDCWD
                               ctypes.byref(mount_id), 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(path))
    return handle


def open_by_handle(mount_fd: int, handle: FileHandle, flags: int = os.O_RDONLY) -> int:
    fd = _libc.open_by_handle_at(mount_fd, ctypes.byref(handle), flags)
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return fd


def drop_caches() -> None:
    """Make the kernel drop unused dentries and inodes, so it forgets ours (FUSE forget)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")


def test_handles_of_forgotten_inodes_open_until_unlinked_or_restarted(daemon, tmp_path):
    snap = daemon.snapshot(fresh(tmp_path, "src", {"base": b"from the snapshot\n"}))
    ex = daemon.exec_path(daemon.create(snap))
    (ex / "d" / "sub").mkdir(parents=True)
    (ex / "d" / "sub" / "new").write_bytes(b"made here\n")
    (ex / "gone").write_bytes(b"x")
    paths = {"base": ex / "base", "new": ex / "d" / "sub" / "new", "sub": ex / "d" / "sub",
             "gone": ex / "gone", "snap": daemon.snap_path(snap) / "base"}
    handles = {name: name_to_handle(p) for name, p in paths.items()}
    inos = {name: os.stat(p).st_ino for name, p in paths.items()}
    os.unlink(ex / "gone")
    mount_fd = os.open(daemon.mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        drop_caches()
        for name, want in (("base", b"from the snapshot\n"), ("new", b"made here\n"),
                           ("snap", b"from the snapshot\n")):
            fd = open_by_handle(mount_fd, handles[name])
            try:
                assert (os.read(fd, 100), os.fstat(fd).st_ino) == (want, inos[name]), name
            finally:
                os.close(fd)
        fd = open_by_handle(mount_fd, handles["sub"], os.O_RDONLY | os.O_DIRECTORY)
        try:  # a directory: reconnected to the tree through ".." lookups
            assert (os.listdir(fd), os.fstat(fd).st_ino) == (["new"], inos["sub"])
            assert os.readlink(f"/proc/self/fd/{fd}") == str(paths["sub"])
        finally:
            os.close(fd)
        with pytest.raises(OSError) as exc:
            open_by_handle(mount_fd, handles["gone"])
        assert exc.value.errno == errno.ESTALE
    finally:
        os.close(mount_fd)
    daemon.restart()  # a handle from an earlier run is stale, even of a kept inode number
    mount_fd = os.open(daemon.mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert os.stat(paths["new"]).st_ino == inos["new"]
        drop_caches()
        with pytest.raises(OSError) as exc:
            open_by_handle(mount_fd, handles["new"])
        assert exc.value.errno == errno.ESTALE
        fd = open_by_handle(mount_fd, name_to_handle(paths["new"]))
        os.close(fd)
    finally:
        os.close(mount_fd)
