"""The FUSE adapter: pyfuse3 requests in, one call of the mount tree, errno out.

Protocol translation only (after BorgBackup's ``fuse.py``): each handler turns inode numbers,
bytes and a request context into one call of rametfs.control.tree (what the mount looks like
and does) and its answer into pyfuse3's types (:func:`_entry`, the one builder of
``EntryAttributes``); what the kernel was told is rametfs.fuse.kernel.  Errors map to errno in
one place (:func:`_translate`, on every handler, ``forget`` included): a RametError or OSError
becomes ``FUSEError(errno)``; any other exception is a bug, logged with its traceback and
answered with EIO so one bad request cannot take the daemon down.  The adapter reads no
environment and starts no task: the daemon builds the tree, the kernel state and the
channels their background work is fed by, and runs that work in its nursery.

Open-less mode (:class:`Operations`, with the pyfuse3 patch, tools/pyfuse3/README.md): open
and opendir are not implemented (pyfuse3 answers ENOSYS), so the kernel stops sending open,
release, opendir and releasedir, keeps every file's pages and every directory's listing
cached, and the handlers get the inode number where a file handle was; the patch also
passes O_TMPFILE opens on to ``tmpfile``.  Plain mode (:class:`PlainOperations`, without the
patch) runs the same handlers with the inode number as the file handle, and O_TMPFILE fails
EOPNOTSUPP.  Either way there is no per-open state: a file's upper data descriptor is
cached (``FileData.upper_fds``), dirty inode records are stored by the daemon every second
(``daemon._store_dirty_records``) and on fsync, promote and unmount, and an unlinked inode is
deleted when the kernel forgets it.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import secrets
import stat

import pyfuse3
import trio

from ..authority import HARNESS, Caller
from ..control.tree import NAME_MAX, Absence, Entry, MountTree
from ..errors import NotFound, ReadOnly
from ..faults import FAULTS
from .kernel import KernelState

log = logging.getLogger(__name__)

# Entries of one readdir reply made between two checkpoints: a reply holds up to ~1,000 (the
# kernel's buffer, attributes included), 44-69 ms of the trio thread at once on a loaded host.
READDIR_STEP = 128


def _entry(e: Entry, generation: int) -> pyfuse3.EntryAttributes:
    """What the kernel is told of ``e``; ``generation`` goes in every file handle the
    kernel makes of it."""
    a = e.attrs
    out = pyfuse3.EntryAttributes()
    out.st_ino = a.ino
    out.st_mode = a.mode
    out.st_nlink = a.nlink
    out.st_uid = a.uid
    out.st_gid = a.gid
    out.st_rdev = a.rdev
    out.st_size = a.size
    out.st_blksize = 4096
    out.st_blocks = a.blocks
    out.st_atime_ns = a.atime_ns
    out.st_mtime_ns = a.mtime_ns
    out.st_ctime_ns = a.ctime_ns
    out.attr_timeout = e.attr_timeout
    out.entry_timeout = e.entry_timeout
    out.generation = generation
    return out


def _negative(timeout: float) -> pyfuse3.EntryAttributes:
    """A "no such name" the kernel may cache ``timeout`` seconds (inode 0): git looks for a
    .gitignore in every directory.  The kernel replaces it when it creates the name."""
    out = pyfuse3.EntryAttributes()
    out.st_ino = 0
    out.entry_timeout = timeout
    return out


def _dot(ino: int) -> pyfuse3.EntryAttributes:
    """The entry of ``.`` or ``..`` in a listing: its inode number and type, all the kernel
    reads of it (it links neither into its dentry cache, nor counts a lookup for them)."""
    out = pyfuse3.EntryAttributes()
    out.st_ino = ino
    out.st_mode = stat.S_IFDIR
    return out


def _inos(args: tuple) -> list[int]:
    """The inode numbers a request names: its first argument, or ``forget``'s list."""
    first = args[0] if args else None
    if isinstance(first, list):
        return [ino for ino, _ in first]
    return [first] if isinstance(first, int) else []


def _translate(fn):
    """Guard a handler: RametError and OSError become ``FUSEError(errno)``; any other
    exception is a bug, logged with its traceback, answered EIO, and the executions whose
    inodes the request named are marked failed, so nothing else stops.  ``forget`` has no
    reply, and pyfuse3's session loop awaits it unguarded: no exception may leave it, so
    there every error is only logged."""
    name = fn.__name__
    replies = name != "forget"

    @functools.wraps(fn)
    async def wrapper(self, *args):
        try:
            if FAULTS.armed:
                named = self.tree.culprits(_inos(args))
                FAULTS.check(f"handler:{name}", *named)
                await FAULTS.hold(f"hold:{name}", *named)
            return await fn(self, *args)
        except (pyfuse3.FUSEError, OSError) as exc:  # a RametError is an OSError
            if not replies:
                log.warning("forget: %s", exc)
                return None
            if isinstance(exc, pyfuse3.FUSEError):
                raise
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception as exc:
            culprits = self.tree.culprits(_inos(args))
            log.exception("internal error in %s (execution %s)", name,
                          ", ".join(ex.id for ex in culprits) or "none")
            self.tree.fail(culprits, f"internal error in {name}: {exc!r}")
            if replies:
                raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


def _caller(ctx) -> Caller:
    return HARNESS if ctx is None else Caller(ctx.uid, ctx.gid, ctx.pid)


class Operations(pyfuse3.Operations):
    """pyfuse3 handlers over a MountTree, in open-less mode (no open or opendir)."""

    supports_dot_lookup = True  # file handles: the kernel finds an inode it forgot by "."
    enable_writeback_cache = False
    # POSIX ACLs (FUSE_POSIX_ACL): the kernel enforces the access ACL it reads from the
    # xattrs; the tree keeps the mode and the ACLs consistent and inherits default ACLs,
    # applying the umask itself (FUSE_DONT_MASK, with the patch) where none applies.  Who
    # does what: rametfs.core.acl.
    enable_acl = True
    dont_mask = True
    # With the patch, open-less (FUSE_HANDLE_KILLPRIV_V2): the kernel sends no GETATTR before
    # each chown and no security.capability GETXATTR before each write of a file that has
    # none, and leaves clearing set-user-ID and set-group-ID bits to the tree.
    handle_killpriv_v2 = True
    # With the patch, no FUSE_ASYNC_DIO: the kernel completes an asynchronous direct write
    # (io_submit, io_uring) as a synchronous one, so it drops the cached pages of the range
    # after the write; its asynchronous completion does not, and a buffered read that raced
    # the write would leave the old bytes cached (docs/conformance.md, generic/451).
    enable_async_dio = False

    def __init__(self, tree: MountTree, kernel: KernelState):
        super().__init__()
        self.tree = tree
        self.kernel = kernel
        # In every entry, so in every file handle the kernel makes: a handle from an earlier
        # run is stale (an inode number lookups gave out may be given again after a crash).
        self.generation = secrets.randbits(32)

    def _entry(self, e: Entry) -> pyfuse3.EntryAttributes:
        return _entry(e, self.generation)

    # -- namespace -----------------------------------------------------------------------

    @_translate
    async def lookup(self, parent_inode, name, ctx=None):
        try:
            entry = await self.tree.lookup(parent_inode, name, _caller(ctx))
        except NotFound:
            absence = self.tree.absence(parent_inode)
            if absence is Absence.UNCACHED:
                raise
            scope = self.tree.scope(parent_inode) if absence is Absence.UNTIL_RESET else None
            return _negative(self.kernel.negative_entry(parent_inode, name, scope))
        self.kernel.looked_up(entry)
        return self._entry(entry)

    @_translate
    async def getattr(self, inode, ctx=None):
        return self._entry(self.tree.getattr(inode))

    @_translate
    async def setattr(self, inode, attr, fields, fh, ctx):
        changes = {}
        if fields.update_mode:
            changes["mode"] = attr.st_mode
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        if fields.update_size:
            changes["size"] = attr.st_size
        if fields.update_atime:
            changes["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            changes["mtime_ns"] = attr.st_mtime_ns
        # A setattr that changes nothing is the kernel's own kill of set-ID bits: a chown(2)
        # to -1, -1, or a write by a caller without CAP_FSETID (file_remove_privs).
        kill = getattr(fields, "kill_suidgid", False) or not changes
        return self._entry(await self.tree.setattr(inode, changes, _caller(ctx) if kill else None))

    @_translate
    async def readlink(self, inode, ctx):
        return self.tree.readlink(inode)

    @_translate
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._entry(await self.tree.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid,
                                                 ctx.umask))

    @_translate
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._entry(await self.tree.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid,
                                                 ctx.umask))

    @_translate
    async def symlink(self, parent_inode, name, target, ctx):
        return self._entry(await self.tree.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @_translate
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return self._entry(await self.tree.link(inode, new_parent_inode, new_name))

    @_translate
    async def unlink(self, parent_inode, name, ctx):
        await self.tree.unlink(parent_inode, name)

    @_translate
    async def rmdir(self, parent_inode, name, ctx):
        await self.tree.rmdir(parent_inode, name)

    @_translate
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self.tree.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags,
                               owner=(ctx.uid, ctx.gid))

    @_translate
    async def forget(self, inode_list):
        self.tree.forget([ino for ino, _ in inode_list], self.kernel.forgotten(inode_list))

    # -- directories ---------------------------------------------------------------------

    @_translate
    async def readdir(self, fh, start_id, token):
        # fh is the directory's inode.  The listing (names and inode numbers; attributes are
        # made per reply) is made when a read starts at 0 and kept for the calls that page
        # through it, so offsets stay valid between them.
        listing = self.kernel.listing(fh, start_id)
        if listing is None:
            listing = self.kernel.keep_listing(fh, await self.tree.listing(fh))
        for i in range(start_id, len(listing)):
            name, ino = listing[i]
            entry = self.tree.entry_in(fh, ino) if i >= 2 else None
            if not pyfuse3.readdir_reply(token, name, _dot(ino) if entry is None
                                         else self._entry(entry), i + 1):
                break
            if entry is not None:
                self.kernel.looked_up(entry)
            if (i - start_id) % READDIR_STEP == READDIR_STEP - 1:
                await trio.sleep(0)

    @_translate
    async def fsyncdir(self, fh, datasync):
        await self.tree.fsyncdir()

    # -- files ---------------------------------------------------------------------------

    @_translate
    async def create(self, parent_inode, name, mode, flags, ctx):
        entry = await self.tree.create(parent_inode, name, mode, ctx.uid, ctx.gid, ctx.umask)
        return pyfuse3.FileInfo(fh=entry.attrs.ino, keep_cache=True), self._entry(entry)

    @_translate
    async def tmpfile(self, parent_inode, mode, flags, ctx):
        # With the patch only (FUSE_TMPFILE through its custom I/O); stock pyfuse3 never
        # calls it, libfuse answers ENOSYS and O_TMPFILE fails EOPNOTSUPP.
        entry = await self.tree.tmpfile(parent_inode, mode, ctx.uid, ctx.gid,
                                        linkable=not flags & os.O_EXCL, umask=ctx.umask)
        return pyfuse3.FileInfo(fh=entry.attrs.ino, keep_cache=True), self._entry(entry)

    @_translate
    async def read(self, fh, off, size):
        return await self.tree.read(fh, off, size)

    @_translate
    async def write(self, fh, off, buf, kill_suidgid=False):
        try:
            return await self.tree.write(fh, off, buf, kill_suidgid)
        except ReadOnly:  # a snapshot file's: its pages the kernel changed must go
            self.kernel.refused_write_back(fh)
            raise

    @_translate
    async def fsync(self, fh, datasync):
        await self.tree.fsync(fh)

    @_translate
    async def fallocate(self, fh, mode, off, length):
        await self.tree.fallocate(fh, mode, off, length)

    @_translate
    async def lseek(self, fh, off, whence):
        return self.tree.seek(fh, off, whence)

    @_translate
    async def statfs(self, ctx):
        s = self.tree.statfs()
        out = pyfuse3.StatvfsData()
        out.f_bsize, out.f_frsize = s.f_bsize, s.f_frsize
        out.f_blocks, out.f_bfree, out.f_bavail = s.f_blocks, s.f_bfree, s.f_bavail
        out.f_files, out.f_ffree, out.f_favail = s.f_files, s.f_ffree, s.f_favail
        out.f_namemax = NAME_MAX
        return out

    # -- xattrs --------------------------------------------------------------------------

    @_translate
    async def getxattr(self, inode, name, ctx):
        return self.tree.getxattr(inode, name)

    @_translate
    async def listxattr(self, inode, ctx):
        return self.tree.listxattr(inode)

    @_translate
    async def setxattr(self, inode, name, value, ctx):
        await self.tree.setxattr(inode, name, value, _caller(ctx))

    @_translate
    async def removexattr(self, inode, name, ctx):
        await self.tree.removexattr(inode, name)


class PlainOperations(Operations):
    """The same handlers for a pyfuse3 without the open-less patch (or with it turned off):
    the handle of an open file or directory is its inode number, and no ``tmpfile`` (the
    patch's default, so that O_TMPFILE fails EOPNOTSUPP as with stock pyfuse3)."""

    tmpfile = getattr(pyfuse3.Operations, "tmpfile", None)

    @_translate
    async def opendir(self, inode, ctx):
        self.tree.opendir(inode)
        return inode

    @_translate
    async def open(self, inode, flags, ctx):
        direct = await self.tree.open(inode, flags)
        return pyfuse3.FileInfo(fh=inode, direct_io=direct, keep_cache=True)
