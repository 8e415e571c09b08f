"""Attribute changes: chmod, chown, utimens and truncate through setattr, and extended
attributes (set and remove)."""

from __future__ import annotations

import errno
import stat
import time

from ..errors import fs_error
from ..store.format import clamp_time_ns
from .data import FileData
from .nodes import Attrs, Node
from .upper import Upper

# Names and values of one inode's extended attributes: room for a value as long as the kernel
# allows (XATTR_SIZE_MAX, 64 KiB; fstests generic/020 sets one on FUSE) beside others.
XATTR_BYTES = 128 * 1024


class Attributes:
    """Attribute changes of nodes, their records kept by ``upper`` and a truncate's bytes by
    ``data``."""

    def __init__(self, upper: Upper, data: FileData):
        self.upper = upper
        self.data = data

    def setattr(self, node: Node, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, size: int | None = None, atime_ns: int | None = None,
                mtime_ns: int | None = None) -> Attrs:
        """chmod/chown/truncate/utimens; ctime is set to now; times outside what a record
        holds are clamped as ext4 clamps them (``clamp_time_ns``).  Without a truncate the record
        is stored with the next flush (every second, fsync, promote), as a write's is: tar
        sets mode, owner and times on every file it makes."""
        self.upper.writable(node)
        if size is not None:
            self.data.check_size(node, size)
        u = self.upper.copy_up(node)
        if mode is not None:
            u.mode = stat.S_IFMT(u.mode) | (mode & 0o7777)
        if uid is not None:
            u.uid = uid
        if gid is not None:
            u.gid = gid
        if size is not None:
            if node.is_dir:
                raise fs_error(errno.EISDIR)
            self.data.truncate(node, size)
        if atime_ns is not None:
            u.atime_ns = clamp_time_ns(atime_ns)
        if mtime_ns is not None:
            u.mtime_ns = clamp_time_ns(mtime_ns)
        u.ctime_ns = time.time_ns()
        if size is not None:  # now: its page-map entries are already gone
            self.upper.save(node)
        else:
            self.upper.mark_dirty(node)
        return self.data.attrs(node)

    def setxattr(self, node: Node, name: bytes, value: bytes) -> None:
        """Set an xattr; POSIX ACLs are refused (EOPNOTSUPP) since they would not change the
        mode bits as they do on ext4, and tools then fall back to chmod.  ENOSPC when the
        inode's names and values would pass :data:`XATTR_BYTES` (ext4 answers ENOSPC when
        they pass its one block), so storing the record stays cheap."""
        self.upper.writable(node)
        if name.startswith(b"system.posix_acl_"):
            raise fs_error(errno.EOPNOTSUPP, "POSIX ACLs are not supported")
        xattrs = self.upper.copy_up(node).xattrs
        self.upper.check_room(node.view, len(name) + len(value))
        total = sum(len(k) + len(v) for k, v in xattrs.items() if k != name)
        if total + len(name) + len(value) > XATTR_BYTES:
            raise fs_error(errno.ENOSPC, f"the extended attributes of an inode hold at most "
                                         f"{XATTR_BYTES} bytes of names and values")
        xattrs[name] = value
        self.upper.touch(node, mtime=False)
        self.upper.save(node)

    def removexattr(self, node: Node, name: bytes) -> None:
        self.upper.writable(node)
        u = self.upper.copy_up(node)
        if name not in u.xattrs:
            raise fs_error(errno.ENODATA)
        del u.xattrs[name]
        self.upper.touch(node, mtime=False)
        self.upper.save(node)

