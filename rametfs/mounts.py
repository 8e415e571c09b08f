"""The read-only bind mount of ``snapshots/`` over itself, made by the daemon and taken down
by ``rametfs umount``; and the kernel's mount table.

In open-less mode the kernel sends no open, so the daemon cannot refuse a snapshot file
opened for writing, and a shared writable mmap of it changes the kernel's cached pages.  A
read-only mount makes the VFS refuse such opens itself (EROFS) before FUSE sees them.

The bind is made with the kernel's mount API (open_tree(2) clone, mount_setattr(2),
move_mount(2); Linux 5.12+) so that it is read-only before it is attached: where the mount
root propagates (a shared parent, systemd's default), every copy it propagates is read-only
too.  It keeps the propagation it gets, so that unmounting the mount root also unmounts those
copies (a copy left with a child mount would keep the FUSE connection, and the daemon, alive).
The price: an rbind copy of the mount root in the same peer group shares it, and unmounting
that copy unmounts the bind too (the root status then says "absent").  It needs
CAP_SYS_ADMIN; without it the daemon drops a snapshot file's pages when their write-back
reaches it (docs/conformance.md).  Being a mount under the FUSE mount, it makes a plain
unmount of the mountpoint fail EBUSY until it is gone; a lazy one (what the daemon and
libfuse do) takes both.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from .protocol import SNAPSHOTS_DIR

FSTYPE = "fuse.rametfs"  # the daemon mounts with subtype=rametfs

# Syscall numbers of the mount API: one table for every architecture (asm-generic, 424+).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_OPEN_TREE_CLONE = 1
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):  # struct mount_attr, linux/mount.h
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _checked(ret: int, name: str, path: str | None = None) -> int:
    """``ret`` of a libc call, or OSError from its errno."""
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}", path)
    return ret


def _syscall(name: str, number: int, *args) -> int:
    return _checked(_libc.syscall(ctypes.c_long(number), *args), name)


def snapshots_path(mountpoint: str) -> str:
    return os.path.join(mountpoint, SNAPSHOTS_DIR)


def bind_snapshots_read_only(mountpoint: str) -> str | None:
    """Bind ``<mountpoint>/snapshots`` read-only (and nosuid, nodev, like the FUSE mount)
    over itself; None when done, else why not.  Blocks on FUSE lookups: call it off the
    daemon's event loop."""
    path = os.fsencode(snapshots_path(mountpoint))
    try:
        fd = _syscall("open_tree", _SYS_OPEN_TREE, ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(path),
                      ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC))
        try:
            attr = _MountAttr(attr_set=_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID |
                              _MOUNT_ATTR_NODEV)
            _syscall("mount_setattr", _SYS_MOUNT_SETATTR, ctypes.c_int(fd), ctypes.c_char_p(b""),
                     ctypes.c_uint(_AT_EMPTY_PATH), ctypes.byref(attr),
                     ctypes.c_size_t(ctypes.sizeof(attr)))
            _syscall("move_mount", _SYS_MOVE_MOUNT, ctypes.c_int(fd), ctypes.c_char_p(b""),
                     ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(path),
                     ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH))
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.strerror
    return None


@dataclass(frozen=True)
class Mount:
    """One mount: where, what file system type, its per-mount options, and which directory
    of its file system it shows (``/`` unless it is a bind of a subdirectory)."""

    point: str
    fstype: str
    options: tuple[str, ...]
    root: str


def _unescape(field: bytes) -> str:
    # The kernel escapes space, tab, newline and backslash in octal (\040 ...).
    return os.fsdecode(field.decode("unicode_escape").encode("latin-1"))


def mount_table() -> list[Mount]:
    """The calling process's mounts, in mount order (/proc/self/mountinfo, proc(5)):
    ``id parent dev root point options [optional...] - fstype source super-options``."""
    table = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index(b"-") + 1]
            table.append(Mount(_unescape(fields[4]), fstype.decode(),
                               tuple(fields[5].decode().split(",")), _unescape(fields[3])))
    return table


def mount_at(path: str) -> Mount | None:
    """The topmost mount at ``path`` exactly, or None."""
    found = [m for m in mount_table() if m.point == path]
    return found[-1] if found else None


def snapshots_bound(mountpoint: str) -> bool:
    """Whether the daemon's read-only bind is on ``<mountpoint>/snapshots`` (a rametfs mount
    on a rametfs mount, read-only)."""
    bind, root = mount_at(snapshots_path(mountpoint)), mount_at(mountpoint)
    return bind is not None and root is not None and bind.fstype == root.fstype == FSTYPE \
        and "ro" in bind.options


def unbind_snapshots(mountpoint: str) -> None:
    """Unmount the read-only bind of ``<mountpoint>/snapshots`` (umount(2)); OSError (EBUSY
    while a process works in it).  Checks nothing: see :func:`snapshots_bound`."""
    path = snapshots_path(mountpoint)
    _checked(_libc.umount2(os.fsencode(path), 0), "umount", path)
