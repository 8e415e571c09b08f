"""The FUSE adapter: pyfuse3 requests in, overlay and control calls, errno out.

Protocol translation only (after BorgBackup's ``fuse.py``): every handler is a few lines over
rametfs.overlay / rametfs.control.  Errors map to errno in one place (:func:`_errors`): a
RametError or OSError becomes ``FUSEError(errno)``; any other exception is a bug, logged with
its traceback and answered with EIO so one bad request cannot take the daemon down.

Fixed inode numbers: 1 the mount root, 2 ``snapshots/``, 3 ``executions/``, 4 ``.ramet/`` and
5-7 its files.  Each execution's ``.ramet/`` directory and files get numbers on first lookup.
Snapshot inodes are cached by the kernel for :data:`CACHE_TIMEOUT` (immutable).  So are
execution inodes: every change to them passes through this kernel mount, which keeps its
caches coherent, except reset and release, which invalidate what the kernel may hold.
Control files are never cached (timeout 0, direct I/O).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from dataclasses import dataclass, field

import pyfuse3
import trio

from . import protocol
from .control import Control
from .errors import RametError, ReadOnly
from .overlay import Attrs, Execution, Node, Overlay
from .store import EMPTY_CONTENT

log = logging.getLogger(__name__)

ROOT, SNAPSHOTS, EXECUTIONS, CONTROL = 1, 2, 3, 4
CACHE_TIMEOUT = 86400.0  # seconds
TOP = {b"snapshots": SNAPSHOTS, b"executions": EXECUTIONS}
CONTROL_NAME = protocol.CONTROL_DIR.encode()


@dataclass
class Virtual:
    """A node the daemon makes up: the top directories and the control files."""

    ino: int
    mode: int
    kind: str  # "dir" or a control file name (ctl, status, error, promote, diff)
    execution: str | None = None  # None: the root scope
    children: dict[bytes, int] = field(default_factory=dict)


@dataclass
class ControlHandle:
    virtual: Virtual
    data: bytes = b""


@dataclass
class DirHandle:
    node: Node | None  # None for the daemon's own directories
    listing: list[tuple[bytes, pyfuse3.EntryAttributes]]


@dataclass
class FileHandle:
    node: Node
    base_fd: int | None


def _errors(fn):
    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except RametError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("internal error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


class Operations(pyfuse3.Operations):
    """pyfuse3 handlers over one Overlay."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, overlay: Overlay, mountpoint: str):
        super().__init__()
        self.overlay = overlay
        self.control = Control(overlay, mountpoint, self._invalidate)
        self.uid, self.gid = os.getuid(), os.getgid()
        self.virtual: dict[int, Virtual] = {}
        self._add_virtual(Virtual(ROOT, stat.S_IFDIR | 0o755, "dir",
                                  children={**TOP, CONTROL_NAME: CONTROL}))
        self._add_virtual(Virtual(SNAPSHOTS, stat.S_IFDIR | 0o755, "dir"))
        self._add_virtual(Virtual(EXECUTIONS, stat.S_IFDIR | 0o755, "dir"))
        self._add_virtual(Virtual(CONTROL, stat.S_IFDIR | 0o755, "dir"))
        for i, name in enumerate(protocol.ROOT_CONTROL_FILES):
            mode = 0o600 if name == protocol.CTL else 0o444
            self._add_virtual(Virtual(5 + i, stat.S_IFREG | mode, name))
            self.virtual[CONTROL].children[name.encode()] = 5 + i
        self.exec_control: dict[str, int] = {}  # execution id -> its .ramet dir ino
        self.handles: dict[int, object] = {}
        self.next_fh = 1

    def _add_virtual(self, v: Virtual) -> None:
        self.virtual[v.ino] = v

    async def _invalidate(self, entries: list[tuple[int, bytes]]) -> None:
        # The kernel calls block until related requests finish: run them in a thread while
        # the loop goes on serving, and reply to the command only when they are done.
        await trio.to_thread.run_sync(self._invalidate_now, entries)

    @staticmethod
    def _invalidate_now(entries: list[tuple[int, bytes]]) -> None:
        for ino, name in entries:
            try:
                if name:  # parent 0 is an execution root's entry in executions/
                    pyfuse3.invalidate_entry(ino or EXECUTIONS, name)
                else:
                    pyfuse3.invalidate_inode(ino)
            except OSError:
                pass  # the kernel does not know it

    def _fh(self, handle: object) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = handle
        return fh

    # -- attributes ----------------------------------------------------------------------

    def _entry(self, a: Attrs, timeout: float) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.ino
        e.st_mode = a.mode
        e.st_nlink = a.nlink
        e.st_uid = a.uid
        e.st_gid = a.gid
        e.st_rdev = a.rdev
        e.st_size = a.size
        e.st_blksize = 4096
        e.st_blocks = a.blocks
        e.st_atime_ns = a.atime_ns
        e.st_mtime_ns = a.mtime_ns
        e.st_ctime_ns = a.ctime_ns
        e.entry_timeout = e.attr_timeout = timeout
        return e

    def _virtual_attrs(self, v: Virtual) -> pyfuse3.EntryAttributes:
        nlink = 2 if v.kind == "dir" else 1
        a = Attrs(v.ino, v.mode, nlink, self.uid, self.gid, 0, 0, 0, 0, 0)
        return self._entry(a, 0)

    def _node_attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        return self._entry(self.overlay.attrs(node), CACHE_TIMEOUT)

    def _attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        v = self.virtual.get(ino)
        if v is not None:
            return self._virtual_attrs(v)
        return self._node_attrs(self.overlay.node(ino))

    def _exec_control_dir(self, ex: Execution) -> Virtual:
        ino = self.exec_control.get(ex.id)
        if ino is None or ino not in self.virtual:
            d = Virtual(self.overlay._alloc_ino(), stat.S_IFDIR | 0o755, "dir", ex.id)
            self._add_virtual(d)
            for name in protocol.EXECUTION_CONTROL_FILES:
                mode = 0o666 if name in (protocol.CTL, protocol.PROMOTE) else 0o444
                f = Virtual(self.overlay._alloc_ino(), stat.S_IFREG | mode, name, ex.id)
                self._add_virtual(f)
                d.children[name.encode()] = f.ino
            self.exec_control[ex.id] = d.ino
            ino = d.ino
        return self.virtual[ino]

    async def _hold(self, node: Node) -> None:
        """Wait while a promote captures this node's execution (a consistent point)."""
        ex = node.view
        while isinstance(ex, Execution) and ex.frozen is not None:
            await ex.frozen.wait()

    # -- namespace -----------------------------------------------------------------------

    @_errors
    async def lookup(self, parent_inode, name, ctx=None):
        ino = self._lookup_ino(parent_inode, name)
        return self._attrs(ino)

    def _lookup_ino(self, parent: int, name: bytes) -> int:
        v = self.virtual.get(parent)
        if v is not None:
            if parent == SNAPSHOTS:
                return self.overlay.snapshot_view(name.decode("ascii", "replace")).root_ino
            if parent == EXECUTIONS:
                return self.overlay.execution(name.decode("utf-8", "replace")).root_ino
            if name not in v.children:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return v.children[name]
        if name == CONTROL_NAME:
            node = self.overlay.node(parent)
            if isinstance(node.view, Execution) and node.ino == node.view.root_ino:
                return self._exec_control_dir(node.view).ino
        return self.overlay.lookup(parent, name).ino

    @_errors
    async def getattr(self, inode, ctx=None):
        return self._attrs(inode)

    @_errors
    async def setattr(self, inode, attr, fields, fh, ctx):
        v = self.virtual.get(inode)
        if v is not None:
            if v.kind in (protocol.CTL, protocol.PROMOTE) and fields.update_size:
                return self._virtual_attrs(v)  # the O_TRUNC of `echo cmd > ctl`
            raise pyfuse3.FUSEError(errno.EPERM)
        node = self.overlay.node(inode)
        await self._hold(node)
        kw = {}
        if fields.update_mode:
            kw["mode"] = attr.st_mode
        if fields.update_uid:
            kw["uid"] = attr.st_uid
        if fields.update_gid:
            kw["gid"] = attr.st_gid
        if fields.update_size:
            kw["size"] = attr.st_size
        if fields.update_atime:
            kw["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            kw["mtime_ns"] = attr.st_mtime_ns
        self.overlay.setattr(node, **kw)
        return self._node_attrs(node)

    @_errors
    async def readlink(self, inode, ctx):
        return self.overlay.readlink(self.overlay.node(inode))

    async def _parent(self, parent_inode: int) -> Node:
        if parent_inode in self.virtual:
            raise pyfuse3.FUSEError(errno.EPERM if parent_inode != SNAPSHOTS else errno.EROFS)
        node = self.overlay.node(parent_inode)
        await self._hold(node)
        return node

    @_errors
    async def mkdir(self, parent_inode, name, mode, ctx):
        await self._parent(parent_inode)
        return self._node_attrs(self.overlay.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_errors
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        await self._parent(parent_inode)
        return self._node_attrs(self.overlay.mknod(parent_inode, name, mode, rdev, ctx.uid,
                                                   ctx.gid))

    @_errors
    async def symlink(self, parent_inode, name, target, ctx):
        await self._parent(parent_inode)
        return self._node_attrs(self.overlay.symlink(parent_inode, name, target, ctx.uid,
                                                     ctx.gid))

    @_errors
    async def link(self, inode, new_parent_inode, new_name, ctx):
        await self._parent(new_parent_inode)
        return self._node_attrs(self.overlay.link(inode, new_parent_inode, new_name))

    @_errors
    async def unlink(self, parent_inode, name, ctx):
        await self._parent(parent_inode)
        self.overlay.unlink(parent_inode, name)

    @_errors
    async def rmdir(self, parent_inode, name, ctx):
        await self._parent(parent_inode)
        self.overlay.rmdir(parent_inode, name)

    @_errors
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self._parent(parent_inode_old)
        await self._parent(parent_inode_new)
        self.overlay.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    # -- directories ---------------------------------------------------------------------

    @_errors
    async def opendir(self, inode, ctx):
        v = self.virtual.get(inode)
        if v is not None:
            if inode == SNAPSHOTS:
                names = [s.id.encode() for s in self.overlay.store.snapshots()]
                entries = [(n, self.overlay.snapshot_view(n.decode()).root_ino) for n in names]
            elif inode == EXECUTIONS:
                entries = [(eid.encode(), ex.root_ino)
                           for eid, ex in sorted(self.overlay.executions.items())]
            else:  # .ramet is found by lookup, never listed
                entries = sorted((n, i) for n, i in v.children.items() if n != CONTROL_NAME)
            return self._fh(DirHandle(None, [(name, self._attrs(ino)) for name, ino in entries]))
        return self._fh(DirHandle(self.overlay.node(inode), [
            (name, self._node_attrs(node)) for name, node in self.overlay.listdir(inode)]))

    @_errors
    async def readdir(self, fh, start_id, token):
        h = self.handles[fh]
        if h.node is not None and not self.overlay.is_live(h.node):
            raise pyfuse3.FUSEError(errno.ESTALE)  # its execution was reset or released
        listing = h.listing
        for i in range(start_id, len(listing)):
            name, attrs = listing[i]
            if not pyfuse3.readdir_reply(token, name, attrs, i + 1):
                break

    @_errors
    async def releasedir(self, fh):
        del self.handles[fh]

    # -- files ---------------------------------------------------------------------------

    @_errors
    async def open(self, inode, flags, ctx):
        v = self.virtual.get(inode)
        if v is not None:
            if v.kind == "dir":
                raise pyfuse3.FUSEError(errno.EISDIR)
            return pyfuse3.FileInfo(fh=self._fh(ControlHandle(v, self._control_content(v))),
                                    direct_io=True)
        node = self.overlay.node(inode)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC) and node.view.read_only:
            raise ReadOnly("snapshots are read-only")
        if flags & os.O_TRUNC:  # libfuse asks for atomic O_TRUNC: it comes here, not setattr
            await self._hold(node)
            self.overlay.setattr(node, size=0)
        return await self._open_node(node)

    async def _open_node(self, node: Node) -> pyfuse3.FileInfo:
        base_fd = None
        cid = node.base_content
        if cid is not None and cid != EMPTY_CONTENT and \
                not (node.upper is not None and node.upper.base_limit == 0):
            base_fd = os.open(await self.overlay.hydrate(cid), os.O_RDONLY)
        self.overlay.opened(node)
        return pyfuse3.FileInfo(fh=self._fh(FileHandle(node, base_fd)), keep_cache=True)

    @_errors
    async def create(self, parent_inode, name, mode, flags, ctx):
        await self._parent(parent_inode)
        node = self.overlay.create(parent_inode, name, mode, ctx.uid, ctx.gid)
        return await self._open_node(node), self._node_attrs(node)

    def _live(self, h: FileHandle) -> Node:
        if not self.overlay.is_live(h.node):
            raise pyfuse3.FUSEError(errno.ESTALE)  # its execution was reset or released
        return h.node

    @_errors
    async def read(self, fh, off, size):
        h = self.handles[fh]
        if isinstance(h, ControlHandle):
            return h.data[off:off + size]
        return self.overlay.read(self._live(h), off, size, h.base_fd)

    @_errors
    async def write(self, fh, off, buf):
        h = self.handles[fh]
        if isinstance(h, ControlHandle):
            return await self._control_write(h, buf)
        node = self._live(h)
        await self._hold(node)
        return self.overlay.write(self._live(h), off, buf)

    @_errors
    async def flush(self, fh):
        h = self.handles[fh]
        if isinstance(h, FileHandle) and self.overlay.is_live(h.node) \
                and (h.node.dirty or h.node.new_pages) and h.node.upper is not None \
                and h.node.upper.nlink > 0:
            self.overlay.save(h.node)

    @_errors
    async def release(self, fh):
        h = self.handles.pop(fh)
        if isinstance(h, FileHandle):
            if h.base_fd is not None:
                os.close(h.base_fd)
            if self.overlay.is_live(h.node):
                self.overlay.closed(h.node)

    @_errors
    async def fsync(self, fh, datasync):
        h = self.handles[fh]
        if isinstance(h, FileHandle) and h.node.upper is not None:
            self._live(h)
            if h.node.fd is not None:
                await trio.to_thread.run_sync(os.fsync, h.node.fd)
            self.overlay.save(h.node)
            await trio.to_thread.run_sync(self.overlay.store.sync)

    @_errors
    async def fsyncdir(self, fh, datasync):
        self.overlay.flush_all()
        await trio.to_thread.run_sync(self.overlay.store.sync)

    @_errors
    async def statfs(self, ctx):
        s = os.statvfs(self.overlay.store.root)
        out = pyfuse3.StatvfsData()
        out.f_bsize, out.f_frsize = s.f_bsize, s.f_frsize
        out.f_blocks, out.f_bfree, out.f_bavail = s.f_blocks, s.f_bfree, s.f_bavail
        out.f_files, out.f_ffree, out.f_favail = s.f_files, s.f_ffree, s.f_favail
        out.f_namemax = 255
        return out

    # -- xattrs --------------------------------------------------------------------------

    def _xattr_node(self, inode: int) -> Node:
        if inode in self.virtual:
            raise pyfuse3.FUSEError(errno.ENOTSUP)
        return self.overlay.node(inode)

    @_errors
    async def getxattr(self, inode, name, ctx):
        if inode in self.virtual:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        try:
            return self.overlay.xattrs(self.overlay.node(inode))[name]
        except KeyError:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR) from None

    @_errors
    async def listxattr(self, inode, ctx):
        if inode in self.virtual:
            return []
        return list(self.overlay.xattrs(self.overlay.node(inode)))

    @_errors
    async def setxattr(self, inode, name, value, ctx):
        node = self._xattr_node(inode)
        await self._hold(node)
        self.overlay.setxattr(node, name, value)

    @_errors
    async def removexattr(self, inode, name, ctx):
        node = self._xattr_node(inode)
        await self._hold(node)
        self.overlay.removexattr(node, name)

    async def forget(self, inode_list):
        pass  # nodes stay while the daemon runs, so inode numbers stay stable

    # -- control files -------------------------------------------------------------------

    def _control_content(self, v: Virtual) -> bytes:
        c = self.control
        if v.execution is None:
            if v.kind == protocol.STATUS:
                return c.root_status()
            return c.root_error.encode() if v.kind == protocol.ERROR else b""
        ex = self.overlay.execution(v.execution)
        return {protocol.STATUS: c.execution_status,
                protocol.DIFF: c.diff_text,
                protocol.PREVIEW: c.preview_text,
                protocol.PROMOTE: c.promoted_text,
                protocol.ERROR: lambda e: c.errors.get(e.id, "").encode(),
                protocol.CTL: lambda e: b""}[v.kind](ex)

    async def _control_write(self, h: ControlHandle, buf: bytes) -> int:
        v = h.virtual
        if v.kind not in (protocol.CTL, protocol.PROMOTE):
            raise pyfuse3.FUSEError(errno.EBADF)
        if len(buf) > protocol.MAX_COMMAND_BYTES:
            raise pyfuse3.FUSEError(errno.E2BIG)
        try:
            text = buf.decode()
        except UnicodeDecodeError:
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        # One write is one command: a quoted argument may hold a newline.
        line = "promote" if v.kind == protocol.PROMOTE else text
        try:
            if v.execution is None:
                reply = await self.control.run_root(line)
            else:
                reply = await self.control.run_execution(self.overlay.execution(v.execution), line)
        except RametError as exc:
            h.data = protocol.encode_reply({"ok": False, "errno": exc.errno, "error": str(exc)})
            raise
        h.data = protocol.encode_reply(reply)
        return len(buf)
