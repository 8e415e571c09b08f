"""Attribute changes: chmod, chown, utimens and truncate through setattr, and extended
attributes (set and remove), POSIX ACLs with the mode they imply (rametfs.core.acl)."""

from __future__ import annotations

import errno
import stat
import time

from ..core import acl
from ..errors import fs_error
from ..store.format import clamp_time_ns
from .data import FileData
from .lookup import Lookup
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
        sets mode, owner and times on every file it makes.  A chmod of a node with an access
        ACL sets its owner, mask and other entries too (``acl.chmod``)."""
        self.upper.writable(node)
        if size is not None:
            self.data.check_size(node, size)
        u = self.upper.copy_up(node)
        if mode is not None:
            u.mode = stat.S_IFMT(u.mode) | (mode & 0o7777)
            if acl.ACCESS in u.xattrs:
                u.xattrs[acl.ACCESS] = acl.encode(acl.chmod(acl.decode(u.xattrs[acl.ACCESS]),
                                                            u.mode))
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

    def setxattr(self, node: Node, name: bytes, value: bytes, keep_sgid: bool = True) -> None:
        """Set an xattr.  ENOSPC when the inode's names and values would pass
        :data:`XATTR_BYTES` (ext4 answers ENOSPC when they pass its one block), so storing the
        record stays cheap.

        A POSIX ACL (:data:`acl.NAMES`) is checked (``acl.decode``: EINVAL, E2BIG) and stored
        as the kernel writes it; a default ACL only on a directory (EACCES, as the kernel
        refuses it); an access ACL sets the mode's permission bits, and is not stored where
        they say all of it (``acl.equivalent_mode``), and with ``keep_sgid`` False (the
        setter is neither root nor in the file's group) the set-group-ID bit goes, as
        ``posix_acl_update_mode`` does on ext4.  Other ``system.posix_acl_*`` names are
        EOPNOTSUPP."""
        self.upper.writable(node)
        mode = None
        if name in acl.NAMES:
            entries = acl.decode(value)
            value = acl.encode(entries)
            if name == acl.DEFAULT and not node.is_dir:
                raise fs_error(errno.EACCES, "only a directory has a default ACL")
            if name == acl.ACCESS:
                mode, whole = acl.equivalent_mode(entries, node.mode)
                if not keep_sgid:
                    mode &= ~stat.S_ISGID
                if whole:
                    value = None
        elif name.startswith(b"system.posix_acl_"):
            raise fs_error(errno.EOPNOTSUPP, f"no such POSIX ACL: {name!r}")
        u = self.upper.copy_up(node)
        xattrs = u.xattrs
        if value is not None:
            self.upper.check_room(node.view, len(name) + len(value))
            total = sum(len(k) + len(v) for k, v in xattrs.items() if k != name)
            if total + len(name) + len(value) > XATTR_BYTES:
                raise fs_error(errno.ENOSPC, f"the extended attributes of an inode hold at "
                                             f"most {XATTR_BYTES} bytes of names and values")
            xattrs[name] = value
        else:
            xattrs.pop(name, None)
        if mode is not None:
            u.mode = mode
        self.upper.touch(node, mtime=False)
        self.upper.save(node)

    def removexattr(self, node: Node, name: bytes) -> None:
        """Remove an xattr; ENODATA if ``node`` has none of that name, but for a POSIX ACL,
        whose removal leaves the mode as it is and succeeds without one, as on ext4."""
        self.upper.writable(node)
        if name not in Lookup.xattrs(node):
            if name in acl.NAMES:
                return
            raise fs_error(errno.ENODATA)
        u = self.upper.copy_up(node)
        del u.xattrs[name]
        self.upper.touch(node, mtime=False)
        self.upper.save(node)
