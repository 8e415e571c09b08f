"""The mount's tree: what each inode number is and does, FUSE-free (rametfs.fuse.adapter
translates requests into calls of :class:`MountTree`).

Fixed inode numbers: 1 the mount root, 2 ``snapshots/``, 3 ``executions/``, 4 ``.ramet/``.
Each execution's ``.ramet/`` directory gets a number on first lookup; control files get one per
content (:class:`ControlSlot`); ``snapshots/<ref>`` (a unique id prefix of 8 hex digits or
more, or a snapshot name without ``/``) is a symlink to the full id, one inode per snapshot.
These synthetic nodes (:class:`Virtual`) share the overlay's inode counter; every other inode
number is an overlay node.  Snapshot inodes are cached by the kernel for
:data:`CACHE_TIMEOUT` (immutable).  So are execution inodes: every change to them passes
through this kernel mount, which keeps its caches coherent, except reset and release, which
invalidate what the kernel may hold (``Control.invalidate``).

Every route that changes an execution waits first while a promote captures it (the freeze,
``Overlay.wait_thawed``); writes to control files are commands (rametfs.control.commands).

File handles (export support): a lookup of ``.`` or ``..`` names the inode itself or its
parent, which the kernel asks for when it opens a handle of an inode it has forgotten; every
entry carries a generation drawn at the start, so handles of an earlier run are stale.

Who may do what (rametfs.authority; docs/architecture.md, "Authority"): ``snapshots/`` and
``executions/`` are 0711, so only the harness lists them; ``executions/<id>`` is answered at
entry timeout 0 (in lookups and listings) unless every caller may enter it, so every path
walk through that name comes here with its caller, who needs the execution's ``x`` bit
(EACCES); an execution's ``.ramet/``
and its files carry its owner's uid and group and the modes its share bits and ``--control``
give, so the kernel refuses other uids itself (``--control read``: the daemon refuses writes
too, for root); ``--control none`` has no ``.ramet``.

Control files are looked up at entry timeout 0, and every content a control file shows is an
inode of its own whose bytes never change, so the page cache cannot mix two of them; ``ctl``,
``promote`` and ``fsmonitor`` get a new inode at every lookup, whose content becomes the reply
to what is written to it (a new mtime tells the kernel to drop the cached page).  In plain
mode they are opened with direct I/O.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import re
import stat
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import trio

from .. import protocol
from ..authority import DAEMON_GID, DAEMON_UID, HARNESS, R, W, X, Caller
from ..core import acl
from ..errors import NotFound, RametError, ReadOnly, fs_error
from ..overlay import Attrs, Execution, Node, Overlay, close_all, in_slices, take_turn
from ..store import Snapshot
from ..store.names import HEX_REF, SNAPSHOT_ID_RE
from .commands import FSMONITOR_HOOK, Control

ROOT, SNAPSHOTS, EXECUTIONS, CONTROL = 1, 2, 3, 4
CACHE_TIMEOUT = 86400.0  # seconds
TOP = {b"snapshots": SNAPSHOTS, b"executions": EXECUTIONS}
CONTROL_NAME = protocol.CONTROL_DIR.encode()
GENERATIONS = 64  # inodes kept per control file and caller: older ones read as ESTALE
# Bytes of content a caller's control file inodes keep, all files together, in answer limits
# (Control.max_answer_bytes): past them its oldest go (ESTALE).
GENERATION_ANSWERS = 2
# The root .ramet/ files: ctl and error are the harness's; status is the harness's whole, and
# as much as the caller may see for another uid (Control.root_status).
ROOT_MODES = {protocol.CTL: 0o600, protocol.STATUS: 0o444, protocol.ERROR: 0o400}
HARNESS_STATUS_MODE = stat.S_IFREG | 0o400
WRITTEN = (protocol.CTL, protocol.PROMOTE, protocol.FSMONITOR)  # control files written to
# A name in snapshots/ shorter than an id: a prefix, answered by a symlink to the full id.
SNAPSHOT_PREFIX_RE = re.compile(rf"[0-9a-f]{{{protocol.MIN_ID_PREFIX},63}}")
NAME_MAX = 255


@dataclass(frozen=True, slots=True)
class Entry:
    """What the kernel is told of an inode: its attributes, how long it may keep them
    (``attr_timeout``) and the name that led to it (``entry_timeout``), in seconds; a
    control file generation's lookups are counted (``generation``: its forget drops it)."""

    attrs: Attrs
    attr_timeout: float
    entry_timeout: float
    generation: bool = False


class Absence(enum.Enum):
    """Whether the kernel may cache a missing name of a directory (a negative entry)."""

    UNCACHED = 0  # snapshots/, executions/, .ramet/: they gain names the kernel does not see
    CACHED = 1  # a directory of a view: every change comes through the mount
    UNTIL_RESET = 2  # an execution's directory: a reset that changes its names makes the
    # kernel forget them


@dataclass
class ControlSlot:
    """One control file name in a ``.ramet/`` directory; each of its contents is an inode
    (a generation), kept per caller (:func:`caller_key`), newest last in ``gens``; a caller
    who may not read it finds ``stub``, one empty inode made once."""

    mode: int
    kind: str  # a name of protocol.ROOT_CONTROL_FILES or EXECUTION_CONTROL_FILES
    execution: Execution | None  # None: the root scope
    uid: int = DAEMON_UID  # of its inodes: an execution's owner and group
    gid: int = DAEMON_GID
    gens: dict[int, list[int]] = field(default_factory=dict)  # caller key -> inode numbers
    stub: Virtual | None = None
    reply: bytes = b""  # a ctl file: the reply of the last command written to it


@dataclass
class Virtual:
    """A node the daemon makes up: the top and ``.ramet/`` directories, and one generation
    of a control file (``slot``)."""

    ino: int
    mode: int
    kind: str  # "dir", "symlink" (snapshots/<ref>) or a control file kind
    execution: Execution | None = None  # None: the root scope
    children: dict[bytes, int] = field(default_factory=dict)
    files: dict[bytes, ControlSlot] = field(default_factory=dict)  # a .ramet/ directory's
    slot: ControlSlot | None = None
    content: bytes = b""  # what a read returns
    mtime_ns: int = field(default_factory=time.time_ns)  # changes with content or listing
    uid: int = DAEMON_UID
    gid: int = DAEMON_GID
    caller: int | None = None  # of a generation: its caller's key (caller_key); None: a stub
    counted: int = 0  # of a generation: the bytes of its content counted for its caller

    def changed(self, content: bytes | None = None) -> None:
        if content is None or content != self.content:
            self.content = self.content if content is None else content
            self.mtime_ns = time.time_ns()


def caller_key(caller: Caller) -> int:
    """Whose generations a lookup by ``caller`` makes and may drop: the harness's (uid 0 and
    the daemon's, as one) or its uid's."""
    return DAEMON_UID if caller.harness else caller.uid


class MountTree:
    """The mount's namespace over one Overlay and its Control: inode numbers and bytes in,
    :class:`Entry`, bytes and counts out, RametError (with its errno) on failure.
    ``reclaim``: woken (a ``None`` sent, dropped when one is pending) when forgotten
    unlinked inodes wait to be deleted (the daemon's reclaim worker)."""

    def __init__(self, overlay: Overlay, control: Control,
                 reclaim: trio.MemorySendChannel[None], *, other_uids: bool = True,
                 requests_waiting: Callable[[], bool] = lambda: False):
        self.overlay = overlay
        self.other_uids = other_uids
        self.control = control
        self.reclaim = reclaim
        # Whether a request waits to be read (the daemon polls the FUSE device): an
        # execution's writes then take turns with the others (overlay.take_turn).
        self.requests_waiting = requests_waiting
        control.snapshots_dir_ino = SNAPSHOTS
        # Per caller key: its generations holding content of their own, oldest first, and
        # those bytes (GENERATION_ANSWERS); one answer made at a time per execution (_one_answer).
        self.kept: dict[int, OrderedDict[int, None]] = {}
        self.kept_bytes: dict[int, int] = {}
        self.answering: dict[tuple[str, int], trio.Lock] = {}
        self.virtual: dict[int, Virtual] = {}
        self._add_virtual(Virtual(ROOT, stat.S_IFDIR | 0o755, "dir",
                                  children={**TOP, CONTROL_NAME: CONTROL}))
        # Only the harness lists snapshots/ and executions/ (the kernel caches one listing
        # for every caller); anyone may look a name up, which an execution checks.
        self._add_virtual(Virtual(SNAPSHOTS, stat.S_IFDIR | 0o711, "dir"))
        self._add_virtual(Virtual(EXECUTIONS, stat.S_IFDIR | 0o711, "dir"))
        # Others may look up the root status (by name), not list what the harness has.
        self._add_virtual(Virtual(CONTROL, stat.S_IFDIR | 0o711, "dir", files={
            name.encode(): ControlSlot(stat.S_IFREG | ROOT_MODES[name], name, None)
            for name in protocol.ROOT_CONTROL_FILES}))
        self.exec_control: dict[int, int] = {}  # execution root ino -> its .ramet dir ino
        self.snapshot_links: dict[str, int] = {}  # snapshot id -> its symlink's ino

    def _add_virtual(self, v: Virtual) -> None:
        self.virtual[v.ino] = v

    # -- faults --------------------------------------------------------------------------

    def culprits(self, inos: list[int]) -> list[Execution]:
        """The live executions inodes ``inos`` belong to (nodes or control files)."""
        found: dict[str, Execution] = {}
        for ino in inos:
            v = self.virtual.get(ino)
            node = self.overlay.nodes.get(ino) if v is None else None
            ex = v.execution if v is not None else node.view if node is not None else None
            if isinstance(ex, Execution) and ex.id in self.overlay.executions:
                found[ex.id] = ex
        return list(found.values())

    def fail(self, executions: list[Execution], reason: str) -> None:
        """Mark ``executions`` failed (``Overlay.fail``): a bug met in their requests."""
        for ex in executions:
            self.overlay.fail(ex, reason)

    # -- attributes ----------------------------------------------------------------------

    def getattr(self, ino: int) -> Entry:
        v = self.virtual.get(ino)
        if v is not None:
            return self._virtual_entry(v)
        return self._node_entry(self.overlay.node(ino))

    def _node_entry(self, node: Node) -> Entry:
        return Entry(self.overlay.attrs(node), CACHE_TIMEOUT, CACHE_TIMEOUT)

    def _virtual_entry(self, v: Virtual) -> Entry:
        # Directories are cached like the rest (a command tells the kernel when the listing
        # of snapshots/ or executions/ changes); control files are looked up every time.
        is_dir = v.kind == "dir"
        a = Attrs(v.ino, v.mode, 2 if is_dir else 1, v.uid, v.gid, 0, len(v.content), 0,
                  v.mtime_ns, v.mtime_ns)
        timeout = CACHE_TIMEOUT if is_dir else 0
        return Entry(a, timeout, timeout, generation=v.caller is not None)

    def entry_in(self, parent: int, ino: int) -> Entry:
        """The entry of ``ino`` in directory ``parent``, for a lookup or a listing: one in
        ``executions/`` that not every caller may enter is not cached (entry timeout 0), so
        every path walk through it asks again, as its caller."""
        entry = self.getattr(ino)
        if parent == EXECUTIONS and not self._anyone_enters(ino):
            return Entry(entry.attrs, entry.attr_timeout, 0, entry.generation)
        return entry

    def _anyone_enters(self, root_ino: int) -> bool:
        """Whether every caller that reaches the mount may enter the execution rooted at
        ``root_ino``: its share lets everyone in, or no uid but the harness's reaches the
        mount (``other_uids`` False: mounted without ``allow_other``, the kernel lets only
        the mounter's uid in, ``fuse_allow_current_process`` in fs/fuse/dir.c)."""
        return not self.other_uids or self.overlay.node(root_ino).view.access.anyone_enters

    def statfs(self) -> os.statvfs_result:
        """The data directory's file system's figures (names: :data:`NAME_MAX`)."""
        return os.statvfs(self.overlay.store.root)

    # -- namespace -----------------------------------------------------------------------

    async def lookup(self, parent: int, name: bytes, caller: Caller = HARNESS) -> Entry:
        """The entry of ``name`` in ``parent`` for ``caller``; a control file's content is
        made now.  NotFound where there is none (:meth:`absence`: may the kernel cache it)."""
        v = self.virtual.get(parent)
        if name in (b".", b".."):  # a file handle's inode or its parent (export support)
            ino = self._dot_lookup(parent, name)
        elif v is not None and name in v.files:
            ino = (await self._control_file(v.files[name], caller)).ino
        elif parent == SNAPSHOTS:
            ino = await self._snapshot_entry(name)
        else:
            await self.overlay.prefetch(parent)
            ino = self._lookup_ino(parent, name, caller)
        return self.entry_in(parent, ino)

    async def _snapshot_entry(self, name: bytes) -> int:
        """``snapshots/<name>``: the view of a full id, or the symlink of a unique id prefix
        or a name (:meth:`_snapshot_link`).  One found nowhere here is looked up in the
        remote's catalog, if any, in a worker thread (``Overlay.resolve_entry``: bounded,
        EAGAIN past its bound).  NotFound (ENOENT) when nothing matches."""
        ref = name.decode("ascii", "replace")
        if HEX_REF.fullmatch(ref) and not (SNAPSHOT_ID_RE.fullmatch(ref)
                                           or SNAPSHOT_PREFIX_RE.fullmatch(ref)):
            raise NotFound(f"no snapshot {ref!r}")  # ids are spelt in lower case only
        snap = await self.overlay.resolve_entry(ref)  # NotFound: none, or several
        if snap.id == ref:
            return self.overlay.snapshot_view(ref).root_ino
        return self._snapshot_link(snap)

    def _dot_lookup(self, ino: int, name: bytes) -> int:
        """``.`` or ``..`` of inode ``ino``: the kernel asks when it decodes a file handle
        (open_by_handle_at(2), NFS export) of an inode it no longer holds, and for the
        parent of a directory it reconnects.  Nodes stay while the daemon runs, so any
        inode number it gave is found; one unlinked since, or of a dropped layer (reset,
        release), or of an earlier run that was never copied up, is ESTALE."""
        if ino not in self.virtual:
            node = self.overlay.node(ino)  # ESTALE: unknown, or of a dropped layer
            if node.upper is not None and node.upper.nlink == 0:
                raise fs_error(errno.ESTALE)
        return ino if name == b"." else self._parent_ino(ino)

    def absence(self, parent: int) -> Absence:
        """Whether the kernel may cache that a name of ``parent`` is missing, and until when."""
        if parent in self.virtual:
            return Absence.UNCACHED
        if isinstance(self.overlay.node(parent).view, Execution):
            return Absence.UNTIL_RESET
        return Absence.CACHED

    def scope(self, parent: int) -> str:
        """The id of the execution directory ``parent`` belongs to (its missing names are
        bounded per execution)."""
        return self.overlay.node(parent).view.id

    def _lookup_ino(self, parent: int, name: bytes, caller: Caller) -> int:
        v = self.virtual.get(parent)
        if v is not None:
            if parent == EXECUTIONS:
                ex = self.overlay.execution(name.decode("utf-8", "replace"))
                if not ex.access.allows(caller, X):
                    raise fs_error(errno.EACCES, f"execution {ex.id!r} is not shared with "
                                                 f"uid {caller.uid}")
                return ex.root_ino
            if name not in v.children:
                raise fs_error(errno.ENOENT)
            return v.children[name]
        if name == CONTROL_NAME:
            node = self.overlay.node(parent)
            if isinstance(node.view, Execution) and node.ino == node.view.root_ino:
                if node.view.access.control == protocol.CONTROL_NONE:
                    raise NotFound(f"{protocol.CONTROL_DIR} is hidden (--control none)")
                return self._exec_control_dir(node.view).ino
        return self.overlay.lookup(parent, name).ino

    def _snapshot_link(self, snap: Snapshot) -> int:
        """``snapshots/<ref>`` of a unique id prefix (as ``rametfs ls`` shows ids) or a
        snapshot name, ``snap`` the snapshot it names: a symlink to the full id, never a
        second view of the snapshot (one view per id).  One inode per snapshot, looked up at
        entry timeout 0: a new snapshot can make a prefix ambiguous (then ENOENT, as for no
        match), a name can move."""
        ino = self.snapshot_links.get(snap.id)
        if ino is None:
            ino = self.overlay._alloc_ino()
            self._add_virtual(Virtual(ino, stat.S_IFLNK | 0o777, "symlink",
                                      content=snap.id.encode()))
            self.snapshot_links[snap.id] = ino
        return ino

    def readlink(self, ino: int) -> bytes:
        v = self.virtual.get(ino)
        if v is not None:
            if v.kind != "symlink":
                raise fs_error(errno.EINVAL)
            return v.content
        return self.overlay.readlink(self.overlay.node(ino))

    async def setattr(self, ino: int, changes: dict[str, int],
                      kill_suidgid: Caller | None = None) -> Entry:
        """Set what ``changes`` names (``mode``, ``uid``, ``gid``, ``size``, ``atime_ns``,
        ``mtime_ns``) of ``ino``; a control file takes only the truncation of a command
        written to it.  ``kill_suidgid``: the caller for whom the set-ID bits are also
        cleared (:meth:`_kill_suidgid`)."""
        v = self.virtual.get(ino)
        if v is not None:
            sized = "size" in changes
            if v.kind in (protocol.CTL, protocol.PROMOTE) and sized and self._writable(v):
                return self._virtual_entry(v)  # the O_TRUNC of `echo cmd > ctl`
            # A size is a write (like sysfs, EACCES); modes, owners and times are EPERM.
            if sized:
                self._refused(v)
            raise fs_error(errno.EACCES if sized else errno.EPERM)
        node = self.overlay.node(ino)
        await self.overlay.wait_thawed(node)
        if kill_suidgid is not None:
            changes = {**self._kill_suidgid(node, kill_suidgid), **changes}
        self.overlay.setattr(node, **changes)
        await self._close_unlinked()
        return self._node_entry(node)

    def _kill_suidgid(self, node: Node, caller: Caller | None = None) -> dict[str, int]:
        """The ``mode`` that clears ``node``'s set-user-ID bit, and its set-group-ID bit if
        it has group execute or ``caller`` (when known) is neither root nor in the file's
        group, as the kernel decides on ext4 (a set-group-ID without group execute marks
        mandatory locking); as a setattr keyword, empty if nothing is to clear or ``node`` is
        a directory."""
        mode = node.mode
        if stat.S_ISDIR(mode):
            return {}
        kill = stat.S_ISUID
        if mode & stat.S_IXGRP or caller is not None and caller.uid != 0 \
                and mode & stat.S_ISGID and self.overlay.attrs(node).gid not in caller.groups:
            kill |= stat.S_ISGID
        return {"mode": mode & ~kill} if mode & kill else {}

    async def _parent(self, parent: int) -> Node:
        """Directory ``parent`` of a change, once its execution is not frozen; the
        synthetic directories take none (``snapshots/`` EROFS, the others EPERM)."""
        if parent in self.virtual:
            if parent == SNAPSHOTS:
                raise ReadOnly("snapshots are read-only")
            raise fs_error(errno.EPERM)
        node = self.overlay.node(parent)
        await self.overlay.wait_thawed(node)
        return node

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                    umask: int = 0) -> Entry:
        """A new directory; ``umask`` is the caller's, applied unless ``parent`` has a
        default ACL (as for :meth:`mknod` and :meth:`create`)."""
        await self._parent(parent)
        return self._node_entry(self.overlay.mkdir(parent, name, mode, uid, gid, umask))

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int,
                    umask: int = 0) -> Entry:
        await self._parent(parent)
        return self._node_entry(self.overlay.mknod(parent, name, mode, rdev, uid, gid, umask))

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int
                      ) -> Entry:
        await self._parent(parent)
        return self._node_entry(self.overlay.symlink(parent, name, target, uid, gid))

    async def link(self, ino: int, new_parent: int, new_name: bytes) -> Entry:
        await self._parent(new_parent)
        return self._node_entry(self.overlay.link(ino, new_parent, new_name))

    async def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                     umask: int = 0) -> Entry:
        await self._parent(parent)
        return self._node_entry(self.overlay.create(parent, name, mode, uid, gid, umask))

    async def tmpfile(self, parent: int, mode: int, uid: int, gid: int, linkable: bool,
                      umask: int = 0) -> Entry:
        """open(2) with O_TMPFILE in ``parent`` (``Names.tmpfile``): refused where create is
        (a snapshot EROFS, the synthetic directories EPERM)."""
        await self._parent(parent)
        return self._node_entry(self.overlay.tmpfile(parent, mode, uid, gid, linkable, umask))

    async def unlink(self, parent: int, name: bytes) -> None:
        await self._parent(parent)
        self.overlay.unlink(parent, name)

    async def rmdir(self, parent: int, name: bytes) -> None:
        await self._parent(parent)
        self.overlay.rmdir(parent, name)

    async def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
                     flags: int, owner: tuple[int, int]) -> None:
        await self._parent(old_parent)
        await self._parent(new_parent)
        await self.overlay.rename_in_slices(old_parent, old_name, new_parent, new_name, flags,
                                            owner=owner)

    def forget(self, inos: list[int], generations: list[int]) -> None:
        """The kernel forgot inodes ``inos``, and every lookup of control file generations
        ``generations``: those go (a stub stays), and so does an unlinked node, now that no
        process can reach it (the reclaim worker deletes it).  Other nodes stay while the
        daemon runs, so inode numbers stay stable."""
        for ino in generations:
            v = self.virtual.get(ino)
            if v is not None and v.caller is not None:
                self._drop_generation(v)
        self.overlay.forgotten([self.overlay.nodes[ino] for ino in inos
                                if ino in self.overlay.nodes])
        if self.overlay.reclaim:
            with contextlib.suppress(trio.WouldBlock):  # a wake-up is pending already
                self.reclaim.send_nowait(None)

    # -- directories ---------------------------------------------------------------------

    def _parent_ino(self, ino: int) -> int:
        """The inode number of directory ``ino``'s ``..``: the mount root's is its own (as on
        ext4), a view's root is in ``snapshots/`` or ``executions/``, an execution's
        ``.ramet/`` in the execution's root."""
        v = self.virtual.get(ino)
        if v is not None:
            return v.execution.root_ino if v.execution is not None else ROOT
        node = self.overlay.node(ino)
        if node.ino == node.view.root_ino:
            return EXECUTIONS if isinstance(node.view, Execution) else SNAPSHOTS
        return node.parent

    async def listing(self, ino: int) -> list[tuple[bytes, int]]:
        """Directory ``ino``'s entries, ``(name, inode number)``: ``.`` and ``..`` first, as
        every Linux file system lists them, then the names sorted."""
        return [(b".", ino), (b"..", self._parent_ino(ino))] + await self._names(ino)

    async def _names(self, ino: int) -> list[tuple[bytes, int]]:
        v = self.virtual.get(ino)
        if v is None:
            return [(name, node.ino) for name, node in await self.overlay.listdir_in_slices(ino)]
        if ino == SNAPSHOTS:
            names = [s.id.encode() for s in self.overlay.store.snapshots()]
            entries = [(n, self.overlay.snapshot_view(n.decode()).root_ino) for n in names]
        elif ino == EXECUTIONS:
            entries = [(eid.encode(), ex.root_ino)
                       for eid, ex in sorted(self.overlay.executions.items())]
        else:  # .ramet is found by lookup, never listed
            entries = sorted([(n, i) for n, i in v.children.items() if n != CONTROL_NAME] +
                             [(n, self._listed_control_file(slot).ino)
                              for n, slot in v.files.items()])
        return entries

    def opendir(self, ino: int) -> None:
        """ESTALE or ENOENT now rather than at readdir (plain mode)."""
        self.getattr(ino)

    # -- files ---------------------------------------------------------------------------

    async def open(self, ino: int, flags: int) -> bool:
        """Open ``ino`` with ``flags`` (plain mode); returns whether its reads and writes go
        past the page cache (direct I/O: the control files)."""
        v = self.virtual.get(ino)
        if v is not None:
            if v.kind == "dir":
                raise fs_error(errno.EISDIR)
            if flags & (os.O_WRONLY | os.O_RDWR) and not self._writable(v):
                self._refused(v)
                raise fs_error(errno.EACCES)
            return True
        node = self.overlay.node(ino)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC) and node.view.read_only:
            raise ReadOnly("snapshots are read-only")
        if flags & os.O_TRUNC:  # libfuse asks for atomic O_TRUNC: it comes here
            await self.overlay.wait_thawed(node)
            self.overlay.setattr(node, size=0)
            await self._close_unlinked()
        return False

    async def read(self, ino: int, off: int, size: int) -> bytes:
        v = self.virtual.get(ino)
        if v is not None:
            return v.content[off:off + size]
        node = self.overlay.node(ino)
        base_fd = await self.overlay.base_fd(node)
        return self.overlay.read(node, off, size, base_fd)

    def read_only(self, ino: int) -> bool:
        """Whether ``ino`` is a snapshot's node (its writes are refused, EROFS)."""
        return ino not in self.virtual and self.overlay.node(ino).view.read_only

    async def write(self, ino: int, off: int, buf: bytes, kill_suidgid: bool = False) -> int:
        """Write ``buf`` at ``off``; to a control file, one write is one command.
        ``kill_suidgid``: the writer lacks CAP_FSETID, the set-ID bits go first."""
        v = self.virtual.get(ino)
        if v is not None:
            return await self._control_write(v, buf)
        node = self.overlay.node(ino)
        if isinstance(node.view, Execution):
            await take_turn(node.view.write_turn, len(buf), self.requests_waiting)
            node = self.overlay.node(ino)  # ESTALE if a reset or release dropped it meanwhile
        await self.overlay.wait_thawed(node)
        if kill_suidgid and (kill := self._kill_suidgid(node)):
            # FUSE_WRITE_KILL_SUIDGID.  The kernel's own empty setattr before the write
            # (file_remove_privs) has cleared the bits already and taken the new mode from its
            # reply; this is what the protocol asks for.  (An invalidation of the inode here
            # would wait for this very write: a deadlock.)
            self.overlay.setattr(node, **kill)
        return self.overlay.write(node, off, buf)

    async def fallocate(self, ino: int, mode: int, off: int, length: int) -> None:
        """fallocate(2) of ``length`` bytes at ``off`` (``FileData.fallocate``);
        EOPNOTSUPP on a control file, as sysfs answers."""
        if ino in self.virtual:
            raise fs_error(errno.EOPNOTSUPP)
        node = self.overlay.node(ino)
        await self.overlay.wait_thawed(node)
        self.overlay.fallocate(node, mode, off, length)

    def seek(self, ino: int, off: int, whence: int) -> int:
        """SEEK_DATA or SEEK_HOLE from ``off`` (``FileData.seek``); a control file is data
        to its end.  ENXIO at or past the end."""
        v = self.virtual.get(ino)
        if v is None:
            return self.overlay.seek(self.overlay.node(ino), off, whence)
        if not 0 <= off < len(v.content):
            raise fs_error(errno.ENXIO)
        return off if whence == os.SEEK_DATA else len(v.content)

    async def fsync(self, ino: int) -> None:
        if ino in self.virtual:
            return
        node = self.overlay.node(ino)
        if node.upper is not None:
            await self.overlay.sync_data(node)
            if self.overlay.is_live(node) and node.upper.nlink > 0:
                self.overlay.save(node)
            await self.overlay.sync_store()

    async def fsyncdir(self) -> None:
        await in_slices(self.overlay.flush_all_steps())
        await self.overlay.sync_store()

    async def _close_unlinked(self) -> None:
        """Close the descriptors of unlinked upper files (freeing their blocks) in a thread."""
        fds = self.overlay.take_unlinked_fds()
        if fds:
            await trio.to_thread.run_sync(close_all, fds)

    # -- xattrs --------------------------------------------------------------------------

    def getxattr(self, ino: int, name: bytes) -> bytes:
        if ino in self.virtual:
            raise fs_error(errno.ENODATA)
        try:
            return self.overlay.xattrs(self.overlay.node(ino))[name]
        except KeyError:
            raise fs_error(errno.ENODATA) from None

    def listxattr(self, ino: int) -> list[bytes]:
        if ino in self.virtual:
            return []
        return list(self.overlay.xattrs(self.overlay.node(ino)))

    async def _xattr_node(self, ino: int) -> Node:
        if ino in self.virtual:
            raise fs_error(errno.ENOTSUP)
        node = self.overlay.node(ino)
        await self.overlay.wait_thawed(node)
        return node

    async def setxattr(self, ino: int, name: bytes, value: bytes, caller: Caller = HARNESS
                       ) -> None:
        """Set an xattr; an access ACL set by a ``caller`` neither root nor in the file's
        group clears its set-group-ID bit (``Overlay.setxattr``)."""
        node = await self._xattr_node(ino)
        gid = self.overlay.attrs(node).gid
        keep_sgid = name != acl.ACCESS or caller.uid == 0 or gid == caller.gid \
            or gid in caller.groups
        self.overlay.setxattr(node, name, value, keep_sgid)

    async def removexattr(self, ino: int, name: bytes) -> None:
        self.overlay.removexattr(await self._xattr_node(ino), name)

    # -- control files -------------------------------------------------------------------

    async def _control_file(self, slot: ControlSlot, caller: Caller = HARNESS) -> Virtual:
        """The inode to hand out for ``slot`` to ``caller`` now: its stub (nothing made) if
        the caller may neither read it nor write commands to it; else the caller's newest if
        its content and mode are still current, or a new one; always a new one where the
        caller may write commands.  The root status the harness reads is 0400, so another uid
        can never read it, even through a dentry it shares."""
        if not (self._may_read(slot, caller) or self._takes_commands(slot, caller)):
            return self._stub(slot)
        if slot.kind == protocol.CTL:
            return self._generation(slot, slot.reply, caller, counted=0)  # the slot's bytes
        return self._generation(slot, await self._control_content(slot, caller), caller)

    def _may_read(self, slot: ControlSlot, caller: Caller) -> bool:
        """Whether ``caller`` may read ``slot``: the root ``ctl`` and ``error`` are the
        harness's, the root status anyone's; an execution's files need its ``r`` bit."""
        if slot.execution is None:
            return caller.harness or slot.kind == protocol.STATUS
        return self._execution_of(slot).access.allows(caller, R)

    def _takes_commands(self, slot: ControlSlot, caller: Caller) -> bool:
        """Whether a lookup of ``slot`` by ``caller`` is for a command of its own (a new
        inode each time): the root ``ctl`` for the harness; an execution's ``ctl`` and
        ``promote`` where its ``w`` bit and ``control full`` allow writes; ``fsmonitor``
        for a reader."""
        if slot.kind not in WRITTEN:
            return False
        if slot.execution is None:
            return caller.harness
        access = self._execution_of(slot).access
        if slot.kind == protocol.FSMONITOR:
            return access.allows(caller, R)
        return access.control == protocol.CONTROL_FULL and access.allows(caller, W)

    def _stub(self, slot: ControlSlot) -> Virtual:
        """The one empty inode of ``slot`` for callers who may not read it: looking it up
        makes nothing and drops nothing."""
        if slot.stub is None:
            slot.stub = Virtual(self.overlay._alloc_ino(), slot.mode, slot.kind,
                                slot.execution, slot=slot, uid=slot.uid, gid=slot.gid)
            self._add_virtual(slot.stub)
        return slot.stub

    def _listed_control_file(self, slot: ControlSlot) -> Virtual:
        """The inode a listing of ``.ramet/`` shows for ``slot`` (one listing for every
        caller, who may read the files of an execution's ``.ramet/`` it may list): the
        harness's newest, or one made with what is cheap to show; a diff or preview is made
        only when the file is looked up (to be read), never for a listing."""
        gens = slot.gens.get(caller_key(HARNESS))
        if gens:
            return self.virtual[gens[-1]]
        if slot.kind == protocol.CTL:
            return self._generation(slot, slot.reply, HARNESS, counted=0)
        content = b"" if slot.kind in (protocol.DIFF, protocol.PREVIEW) else \
            self._cheap_content(slot)
        return self._generation(slot, content, HARNESS)

    def _generation(self, slot: ControlSlot, content: bytes, caller: Caller,
                    counted: int | None = None) -> Virtual:
        """The inode showing ``content`` of ``slot`` to ``caller``: the newest of the
        caller's, or a new one (:meth:`_takes_commands`: always), kept in the caller's
        generations (:data:`GENERATIONS` per file, :meth:`_count` its bytes)."""
        mode = slot.mode
        if slot.execution is None and slot.kind == protocol.STATUS and caller.harness:
            mode = HARNESS_STATUS_MODE
        key = caller_key(caller)
        gens = slot.gens.setdefault(key, [])
        if gens and not self._takes_commands(slot, caller):
            newest = self.virtual[gens[-1]]
            if newest.content == content and newest.mode == mode:
                return newest
        v = Virtual(self.overlay._alloc_ino(), mode, slot.kind, slot.execution,
                    slot=slot, content=content, uid=slot.uid, gid=slot.gid, caller=key)
        self._add_virtual(v)
        gens.append(v.ino)
        if len(gens) > GENERATIONS:
            self._drop_generation(self.virtual[gens[0]])
        self._count(v, len(content) if counted is None else counted)
        return v

    def _count(self, v: Virtual, nbytes: int) -> None:
        """Count ``nbytes`` of content for generation ``v`` (what it holds of its own), then
        drop its caller's oldest generations while they hold more than
        :data:`GENERATION_ANSWERS` answer limits (never ``v``)."""
        self._uncount(v)
        key, v.counted = v.caller, nbytes
        if nbytes:
            self.kept.setdefault(key, OrderedDict())[v.ino] = None
            self.kept_bytes[key] = self.kept_bytes.get(key, 0) + nbytes
        budget = GENERATION_ANSWERS * self.control.max_answer_bytes
        while self.kept_bytes.get(key, 0) > budget and len(self.kept[key]) > 1:
            self._drop_generation(self.virtual[next(i for i in self.kept[key] if i != v.ino)])

    def _uncount(self, v: Virtual) -> None:
        """Take generation ``v``'s counted bytes off its caller's."""
        if v.counted:
            key = v.caller
            del self.kept[key][v.ino]
            self.kept_bytes[key] -= v.counted
            if not self.kept[key]:
                del self.kept[key], self.kept_bytes[key]
            v.counted = 0

    def _drop_generation(self, v: Virtual) -> None:
        """Forget generation ``v``: an inode the kernel still holds then reads as ESTALE."""
        del self.virtual[v.ino]
        gens = v.slot.gens[v.caller]
        gens.remove(v.ino)
        if not gens:
            del v.slot.gens[v.caller]
        self._uncount(v)

    @contextlib.asynccontextmanager
    async def _one_answer(self, key: tuple[str, int]) -> AsyncIterator[None]:
        """Make the block's answer (a diff, preview or fsmonitor answer) alone among those of
        ``key``, (execution id, caller key): one caller's concurrent lookups in one
        execution hold one answer in memory at a time, not one each.  By execution too:
        executions of one uid (a sandbox's) must not wait for each other's answers (an
        agent's 3 s diffs held another's fsmonitor answers 11 s)."""
        lock = self.answering.setdefault(key, trio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting:
                self.answering.pop(key, None)

    def _exec_control_dir(self, ex: Execution) -> Virtual:
        """``ex``'s ``.ramet/``, owned by its owner and group with the modes its access gives
        (``Access.mode``), so the kernel refuses what its share mode does not grant."""
        ino = self.exec_control.get(ex.root_ino)  # a new execution of a released name: a new one
        if ino is None or ino not in self.virtual:
            a = ex.access
            d = Virtual(self.overlay._alloc_ino(), a.mode("dir"), "dir", ex, files={
                name.encode(): ControlSlot(a.mode(name), name, ex, a.owner, a.group)
                for name in protocol.EXECUTION_CONTROL_FILES}, uid=a.owner, gid=a.group)
            self._add_virtual(d)
            self.exec_control[ex.root_ino] = d.ino
            ino = d.ino
        return self.virtual[ino]

    def _drop_released_control_dirs(self) -> None:
        """Forget the ``.ramet/`` directories of released executions, which would otherwise
        pile up, one per execution ever used (the kernel's inodes of them are stale since,
        as the rest of the execution's; their files' generations go at their forgets).  A
        release that ran beside a create is caught by the next release."""
        for root_ino, ino in list(self.exec_control.items()):
            d = self.virtual.get(ino)
            if d is None or self.overlay.executions.get(d.execution.id) is not d.execution:
                del self.exec_control[root_ino]
                self.virtual.pop(ino, None)

    def _execution_of(self, v: ControlSlot | Virtual) -> Execution:
        """The execution of control file ``v``; NotFound (ENOENT) once released, even when
        an execution was made since under its name (that is another one)."""
        ex = v.execution
        if self.overlay.executions.get(ex.id) is not ex:
            raise NotFound(f"execution {ex.id!r} was released")
        return ex

    def _writable(self, v: Virtual) -> bool:
        """Whether control file ``v`` takes writes: ``ctl``, ``promote`` and ``fsmonitor``
        (a query), but an execution's ``ctl`` and ``promote`` only under ``--control full``."""
        if v.kind not in WRITTEN or v.caller is None:  # a stub is for those who may not
            return False
        if v.execution is None or v.kind == protocol.FSMONITOR:
            return True
        return self._execution_of(v).access.control == protocol.CONTROL_FULL

    def _refused(self, v: Virtual, command: bytes | None = None) -> None:
        """A write to an execution's ``ctl`` or ``promote`` (``command``, the bytes written
        to ``ctl``, None for an open, a truncation or ``promote``) that ``--control read``
        refuses: say why in its ``.ramet/error`` (Control.refuse_read_only)."""
        if v.execution is not None and v.kind in (protocol.CTL, protocol.PROMOTE) \
                and v.caller is not None:  # not a stub: its caller may not act at all
            what = f"a write to {protocol.CONTROL_DIR}/{v.kind}".encode()
            self.control.refuse_read_only(self._execution_of(v), command or what)

    async def _control_content(self, v: ControlSlot | Virtual, caller: Caller = HARNESS
                               ) -> bytes:
        """What a control file other than ``ctl`` shows ``caller`` now; a diff or preview
        is made in slices of the trio thread (rametfs.control.commands)."""
        if v.execution is not None and v.kind in (protocol.DIFF, protocol.PREVIEW):
            ex = self._execution_of(v)
            async with self._one_answer((ex.id, caller_key(caller))):
                if v.kind == protocol.DIFF:
                    return await self.control.diff_text(ex)
                return await self.control.preview_text(ex)
        return self._cheap_content(v, caller)

    def _cheap_content(self, v: ControlSlot | Virtual, caller: Caller = HARNESS) -> bytes:
        """What a control file other than ``ctl``, ``diff`` and ``preview`` shows ``caller``
        now: O(1) in the execution's size."""
        c = self.control
        if v.execution is None:
            if v.kind == protocol.STATUS:
                return c.root_status(caller)
            return c.root_error.encode()
        ex = self._execution_of(v)
        return {protocol.STATUS: c.execution_status,
                protocol.PROMOTE: c.promoted_text,
                protocol.FSMONITOR: lambda e: FSMONITOR_HOOK,
                protocol.ERROR: lambda e: c.errors.get(e.id, "").encode()}[v.kind](ex)

    async def _control_write(self, v: Virtual, buf: bytes) -> int:
        # A read-only control file opened for writing (open-less), or one --control read
        # keeps from writes (root passes the file modes).
        if not self._writable(v):
            self._refused(v, buf if v.kind == protocol.CTL else None)
            raise fs_error(errno.EACCES)
        if v.kind == protocol.FSMONITOR:
            if len(buf) > protocol.MAX_COMMAND_BYTES:
                raise fs_error(errno.E2BIG)
            ex = self._execution_of(v)
            async with self._one_answer((ex.id, v.caller)):
                answer = await self.control.fsmonitor_answer(ex, buf)
            self._show(v, answer)
            return len(buf)
        # One write is one command: a quoted argument may hold a newline.
        line = b"promote" if v.kind == protocol.PROMOTE else buf
        executions = len(self.overlay.executions)
        try:
            if v.execution is None:
                reply = await self.control.run_root(line)
            else:
                reply = await self.control.run_execution(self._execution_of(v), line)
        except RametError as exc:
            reply = {"ok": False, "errno": exc.errno, "error": str(exc)}
        if len(self.overlay.executions) < executions:  # a release (or a pool's drop)
            self._drop_released_control_dirs()
        for listing in (SNAPSHOTS, EXECUTIONS):  # a command may add or remove entries
            self.virtual[listing].changed()
        await self.control.invalidate([(SNAPSHOTS, b""), (EXECUTIONS, b"")], ())
        if v.kind == protocol.CTL:
            try:
                encoded = await self.control.encoded(reply, "the reply", sort_keys=True)
            except RametError as exc:  # EFBIG: what the command did stays done
                reply = {"ok": False, "errno": exc.errno, "error": str(exc)}
                encoded = protocol.encode_reply(reply)
            v.slot.reply = encoded
            self._show(v, encoded)
        else:
            v.changed(await self._control_content(v))
        if not reply["ok"]:
            raise fs_error(reply["errno"], reply["error"])
        return len(buf)

    def _show(self, v: Virtual, content: bytes) -> None:
        """Generation ``v`` shows ``content`` from now on (the answer to what was written to
        it), counted as its own; unless it was dropped meanwhile (then ESTALE)."""
        v.changed(content)
        if self.virtual.get(v.ino) is v:
            self._count(v, len(content))
