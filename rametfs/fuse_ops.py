"""The FUSE adapter: pyfuse3 requests in, overlay and control calls, errno out.

Protocol translation only (after BorgBackup's ``fuse.py``): every handler is a few lines over
rametfs.overlay / rametfs.control.  Errors map to errno in one place (:func:`_errors`): a
RametError or OSError becomes ``FUSEError(errno)``; any other exception is a bug, logged with
its traceback and answered with EIO so one bad request cannot take the daemon down.

Fixed inode numbers: 1 the mount root, 2 ``snapshots/``, 3 ``executions/``, 4 ``.ramet/``.
Each execution's ``.ramet/`` directory gets a number on first lookup; control files get one per
content (:class:`ControlSlot`); ``snapshots/<ref>`` (a unique id prefix of 8 hex digits or
more, or a snapshot name without ``/``) is a symlink to the full id, one inode per snapshot.
Snapshot inodes are cached by the kernel for :data:`CACHE_TIMEOUT` (immutable).  So are
execution inodes: every change to them passes through this kernel mount, which keeps its
caches coherent, except reset and release, which invalidate what the kernel may hold.

Open-less mode (:data:`OPEN_LESS`, with the pyfuse3 patch, tools/pyfuse3/README.md): open and
opendir answer ENOSYS, so the kernel stops sending open, release, opendir and releasedir,
keeps every file's pages and every directory's listing cached, and the handlers get the inode
number where a file handle was.  Without the patch the same handlers run with the inode number
as the file handle.  Either way there is no per-open state: a file's upper data descriptor is
cached (``FileData.upper_fds``), dirty inode records are stored by the daemon every second
(``daemon._store_dirty_records``) and on fsync, promote and unmount, and an unlinked inode is deleted when the kernel forgets it.

Who may do what (rametfs.authority; docs/architecture.md, "Authority"): ``snapshots/`` and
``executions/`` are 0711, so only the harness lists them; ``executions/<id>`` is answered at
entry timeout 0 (in lookups and listings), so every path walk through that name comes here
with its caller, who needs the execution's ``x`` bit (EACCES); an execution's ``.ramet/``
and its files carry its owner's uid and group and the modes its share bits and ``--control``
give, so the kernel refuses other uids itself (``--control read``: the daemon refuses writes
too, for root); ``--control none`` has no ``.ramet``.

Control files are looked up at entry timeout 0, and every content a control file shows is an
inode of its own whose bytes never change, so the page cache cannot mix two of them; ``ctl``,
``promote`` and ``fsmonitor`` get a new inode at every lookup, whose content becomes the reply
to what is written to it (a new mtime tells the kernel to drop the cached page).  Without the
patch they are opened with direct I/O.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import re
import stat
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pyfuse3
import trio

from . import protocol
from .authority import DAEMON_GID, DAEMON_UID, HARNESS, R, W, X, Caller
from .control import FSMONITOR_HOOK, Control
from .errors import NotFound, RametError, ReadOnly
from .faults import FAULTS
from .overlay import (COLLECT_BATCH, Attrs, Execution, Node, Overlay, close_all, in_slices,
                      unlink_upper_files)
from .store import Snapshot
from .store.names import HEX_REF, SNAPSHOT_ID_RE

log = logging.getLogger(__name__)

ROOT, SNAPSHOTS, EXECUTIONS, CONTROL = 1, 2, 3, 4
CACHE_TIMEOUT = 86400.0  # seconds
TOP = {b"snapshots": SNAPSHOTS, b"executions": EXECUTIONS}
CONTROL_NAME = protocol.CONTROL_DIR.encode()
# pyfuse3 has our patch, and RAMETFS_OPEN_LESS=0 does not turn its use off (for comparison).
OPEN_LESS = hasattr(pyfuse3.FileInfo(), "cache_readdir") and \
    os.environ.get("RAMETFS_OPEN_LESS", "1") != "0"
LISTINGS = 64  # directory listings kept between the readdir calls that page through them
LISTING_ENTRIES = 1 << 20  # entries of those listings (about 100 bytes each)
NEGATIVE_ROOT_NAMES = 4096  # missing names cached per execution root (Execution.negative_root)
GENERATIONS = 64  # inodes kept per control file and caller: older ones read as ESTALE
# Bytes of content a caller's control file inodes keep, all files together, in answer limits
# (Control.max_answer_bytes): past them its oldest go (ESTALE).
GENERATION_ANSWERS = 2
# Entries of one readdir reply made between two checkpoints: a reply holds up to ~1,000 (the
# kernel's buffer, attributes included), 44-69 ms of the trio thread at once on a loaded host.
READDIR_STEP = 128
RECLAIM_DELAY_S = 0.05  # forgotten unlinked inodes gathered into one batch (Operations._reclaim)
# The root .ramet/ files: ctl and error are the harness's; status is the harness's whole, and
# as much as the caller may see for another uid (Control.root_status).
ROOT_MODES = {protocol.CTL: 0o600, protocol.STATUS: 0o444, protocol.ERROR: 0o400}
HARNESS_STATUS_MODE = stat.S_IFREG | 0o400
WRITTEN = (protocol.CTL, protocol.PROMOTE, protocol.FSMONITOR)  # control files written to
# A name in snapshots/ shorter than an id: a prefix, answered by a symlink to the full id.
SNAPSHOT_PREFIX_RE = re.compile(rf"[0-9a-f]{{{protocol.MIN_ID_PREFIX},63}}")


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
    lookups: int = 0  # of a generation: the kernel's lookup count, down to 0 by forgets
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


def _dot_entry(ino: int) -> pyfuse3.EntryAttributes:
    """The entry of ``.`` or ``..`` in a listing: its inode number and type, all the kernel
    reads of it (it links neither into its dentry cache, nor counts a lookup for them)."""
    e = pyfuse3.EntryAttributes()
    e.st_ino = ino
    e.st_mode = stat.S_IFDIR
    return e


def caller_key(caller: Caller) -> int:
    """Whose generations a lookup by ``caller`` makes and may drop: the harness's (uid 0 and
    the daemon's, as one) or its uid's."""
    return DAEMON_UID if caller.harness else caller.uid


def _errors(fn):
    """Guard a handler: RametError and OSError become ``FUSEError(errno)``; any other
    exception is a bug, logged with its traceback, answered EIO, and the executions whose
    inodes the request named are marked failed (``Overlay.fail``), so nothing else stops.
    ``forget`` has no reply, and pyfuse3's session loop awaits it unguarded: no exception
    may leave it, so there every error is only logged."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self, *args):
        try:
            if FAULTS.armed:
                FAULTS.check(f"handler:{name}", *self._culprits(args))
            return await fn(self, *args)
        except (pyfuse3.FUSEError, RametError, OSError) as exc:
            if name == "forget":
                log.warning("forget: %s", exc)
                return None
            if isinstance(exc, pyfuse3.FUSEError):
                raise
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception as exc:
            culprits = self._culprits(args)
            log.exception("internal error in %s (execution %s)", name,
                          ", ".join(ex.id for ex in culprits) or "none")
            for ex in culprits:
                self.overlay.fail(ex, f"internal error in {name}: {exc!r}")
            if name != "forget":
                raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


class Operations(pyfuse3.Operations):
    """pyfuse3 handlers over one Overlay."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, overlay: Overlay, mountpoint: str, *, faults: bool = False,
                 max_answer_bytes: int = protocol.MAX_ANSWER_BYTES):
        super().__init__()
        self.overlay = overlay
        self.control = Control(overlay, mountpoint, self._invalidate, open_less=OPEN_LESS,
                               faults=faults, max_answer_bytes=max_answer_bytes)
        self.control.snapshots_dir_ino = SNAPSHOTS
        self.control.adapter_memory = lambda: {"listings": len(self.listings),
                                               "listing_entries": self.listing_entries}
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
        self.listings: OrderedDict[int, list] = OrderedDict()  # ino -> readdir entries
        self.listing_entries = 0  # entries of every kept listing
        # snapshot inode whose pages are being dropped -> a WRITE came since the drop began
        self.refused_pages: dict[int, bool] = {}
        self._reclaiming = False  # a _reclaim task runs

    def _add_virtual(self, v: Virtual) -> None:
        self.virtual[v.ino] = v

    def _culprits(self, args: tuple) -> list[Execution]:
        """The executions a request's arguments name: the one of its first inode (a node or
        a control file), or for ``forget`` those of every inode of its list."""
        first = args[0] if args else None
        inos = [ino for ino, _ in first] if isinstance(first, list) else [first]
        found: dict[str, Execution] = {}
        for ino in inos:
            if not isinstance(ino, int):
                continue
            v = self.virtual.get(ino)
            node = self.overlay.nodes.get(ino) if v is None else None
            ex = v.execution if v is not None else node.view if node is not None else None
            if isinstance(ex, Execution) and ex.id in self.overlay.executions:
                found[ex.id] = ex
        return list(found.values())

    async def _invalidate(self, entries: list[tuple[int, bytes]],
                          inodes: Sequence[int] = ()) -> None:
        # The kernel calls block until related requests finish: run them in a thread while
        # the loop goes on serving, and reply to the command only when they are done.
        # The kept listings of the inodes named go now: those of a dropped layer would stay
        # until 64 others pushed them out (a reset kept a 20,000-name listing, 2 MB).
        named = [ino for ino, name in entries if not name] + list(self.listings.keys() & inodes)
        for ino in named:
            if (listing := self.listings.pop(ino, None)) is not None:
                self.listing_entries -= len(listing)
        await trio.to_thread.run_sync(self._invalidate_now, entries, inodes)

    @staticmethod
    def _invalidate_now(entries: list[tuple[int, bytes]], inodes: Sequence[int]) -> None:
        for ino, name in itertools.chain(entries, zip(inodes, itertools.repeat(b""))):
            try:
                if name:  # parent 0 is an execution root's entry in executions/
                    pyfuse3.invalidate_entry(ino or EXECUTIONS, name)
                else:
                    pyfuse3.invalidate_inode(ino)
            except OSError:
                pass  # the kernel does not know it

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
        # Directories are cached like the rest (a command tells the kernel when the listing
        # of snapshots/ or executions/ changes); control files are looked up every time.
        is_dir = v.kind == "dir"
        a = Attrs(v.ino, v.mode, 2 if is_dir else 1, v.uid, v.gid, 0, len(v.content), 0,
                  v.mtime_ns, v.mtime_ns)
        return self._entry(a, CACHE_TIMEOUT if is_dir else 0)

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

    def _forget_generation(self, v: Virtual, count: int) -> None:
        """The kernel forgot ``count`` lookups of control file inode ``v``: a generation
        goes at 0 (else a lookup was answered since the kernel let it go); a stub stays."""
        v.lookups -= count
        if v.lookups <= 0 and v.caller is not None:
            self._drop_generation(v)

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

    def _node_attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        return self._entry(self.overlay.attrs(node), CACHE_TIMEOUT)

    def _attrs(self, ino: int) -> pyfuse3.EntryAttributes:
        v = self.virtual.get(ino)
        if v is not None:
            return self._virtual_attrs(v)
        return self._node_attrs(self.overlay.node(ino))

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

    async def _hold(self, node: Node) -> None:
        """Wait while a promote captures this node's execution (a consistent point)."""
        await self.overlay.wait_thawed(node)

    # -- namespace -----------------------------------------------------------------------

    @_errors
    async def lookup(self, parent_inode, name, ctx=None):
        caller = HARNESS if ctx is None else Caller(ctx.uid, ctx.gid, ctx.pid)
        try:
            v = self.virtual.get(parent_inode)
            if v is not None and name in v.files:  # a control file: its content made now
                ino = (await self._control_file(v.files[name], caller)).ino
            elif parent_inode == SNAPSHOTS:
                ino = await self._snapshot_entry(name)
            else:
                await self.overlay.prefetch(parent_inode)
                ino = self._lookup_ino(parent_inode, name, caller)
        except NotFound:
            if parent_inode in self.virtual:
                raise  # snapshots/ and executions/ gain entries the kernel does not see
            return self._negative_entry(parent_inode, name)
        self._looked_up(ino)
        return self._entry_in(parent_inode, ino)

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

    def _entry_in(self, parent_inode: int, ino: int) -> pyfuse3.EntryAttributes:
        """The entry of ``ino`` in directory ``parent_inode``, for a lookup or a listing:
        one in ``executions/`` is never cached (entry timeout 0), so every path walk through
        it asks again, as its caller."""
        entry = self._attrs(ino)
        if parent_inode == EXECUTIONS:
            entry.entry_timeout = 0
        return entry

    def _negative_entry(self, parent_inode: int, name: bytes) -> pyfuse3.EntryAttributes:
        """A cached "no such name" (inode 0): git looks for a .gitignore in every directory.
        The kernel replaces it when it creates the name; a reset must drop the ones in an
        execution's root (``Execution.negative_root``)."""
        view = self.overlay.node(parent_inode).view
        timeout = CACHE_TIMEOUT
        if isinstance(view, Execution) and parent_inode == view.root_ino:
            if len(view.negative_root) < NEGATIVE_ROOT_NAMES:
                view.negative_root.add(name)
            else:  # not cached: the set (and the reset that tells the kernel) stay bounded
                timeout = 0
        e = pyfuse3.EntryAttributes()
        e.st_ino = 0
        e.entry_timeout = timeout
        return e

    def _looked_up(self, ino: int) -> None:
        v = self.virtual.get(ino)
        if v is not None and v.slot is not None:
            v.lookups += 1

    def _lookup_ino(self, parent: int, name: bytes, caller: Caller) -> int:
        v = self.virtual.get(parent)
        if v is not None:
            if parent == EXECUTIONS:
                ex = self.overlay.execution(name.decode("utf-8", "replace"))
                if not ex.access.allows(caller, X):
                    raise pyfuse3.FUSEError(errno.EACCES)
                return ex.root_ino
            if name not in v.children:
                raise pyfuse3.FUSEError(errno.ENOENT)
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

    @_errors
    async def getattr(self, inode, ctx=None):
        return self._attrs(inode)

    @_errors
    async def setattr(self, inode, attr, fields, fh, ctx):
        v = self.virtual.get(inode)
        if v is not None:
            if v.kind in (protocol.CTL, protocol.PROMOTE) and fields.update_size \
                    and self._writable(v):
                return self._virtual_attrs(v)  # the O_TRUNC of `echo cmd > ctl`
            # A size is a write (like sysfs, EACCES); modes, owners and times are EPERM.
            if fields.update_size:
                self._refused(v)
            raise pyfuse3.FUSEError(errno.EACCES if fields.update_size else errno.EPERM)
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
        await self._close_unlinked()
        return self._node_attrs(node)

    @_errors
    async def readlink(self, inode, ctx):
        v = self.virtual.get(inode)
        if v is not None:
            if v.kind != "symlink":
                raise pyfuse3.FUSEError(errno.EINVAL)
            return v.content
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
        await self.overlay.rename_in_slices(parent_inode_old, name_old, parent_inode_new,
                                            name_new, flags, owner=(ctx.uid, ctx.gid))

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

    async def _listing(self, ino: int) -> list[tuple[bytes, int]]:
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

    def _keep_listing(self, ino: int, listing: list) -> None:
        """Keep ``listing`` for the readdir calls to come; the oldest kept go while more than
        :data:`LISTINGS` listings or :data:`LISTING_ENTRIES` entries are kept."""
        old = self.listings.pop(ino, None)
        self.listing_entries += len(listing) - (len(old) if old is not None else 0)
        while self.listings and (len(self.listings) >= LISTINGS
                                 or self.listing_entries > LISTING_ENTRIES):
            self.listing_entries -= len(self.listings.popitem(last=False)[1])
        self.listings[ino] = listing

    @_errors
    async def readdir(self, fh, start_id, token):
        # fh is the directory's inode.  The listing (names and inode numbers; attributes are
        # made per reply) is made when a read starts at 0 and kept for the calls that page
        # through it, so offsets stay valid between them.
        listing = self.listings.get(fh)
        if listing is None or start_id == 0:
            listing = await self._listing(fh)
            self._keep_listing(fh, listing)
        self.listings.move_to_end(fh)
        for i in range(start_id, len(listing)):
            name, ino = listing[i]
            entry = _dot_entry(ino) if i < 2 else self._entry_in(fh, ino)
            if not pyfuse3.readdir_reply(token, name, entry, i + 1):
                break
            self._looked_up(ino)
            if (i - start_id) % READDIR_STEP == READDIR_STEP - 1:
                await trio.sleep(0)

    # -- files ---------------------------------------------------------------------------

    if not OPEN_LESS:  # plain pyfuse3: the handle of an open file or directory is its inode
        @_errors
        async def opendir(self, inode, ctx):
            self._attrs(inode)  # ESTALE or ENOENT now rather than at readdir
            return inode

        @_errors
        async def open(self, inode, flags, ctx):
            v = self.virtual.get(inode)
            if v is not None:
                if v.kind == "dir":
                    raise pyfuse3.FUSEError(errno.EISDIR)
                if flags & (os.O_WRONLY | os.O_RDWR) and not self._writable(v):
                    self._refused(v)
                    raise pyfuse3.FUSEError(errno.EACCES)
                return pyfuse3.FileInfo(fh=inode, direct_io=True)
            node = self.overlay.node(inode)
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC) and node.view.read_only:
                raise ReadOnly("snapshots are read-only")
            if flags & os.O_TRUNC:  # libfuse asks for atomic O_TRUNC: it comes here
                await self._hold(node)
                self.overlay.setattr(node, size=0)
                await self._close_unlinked()
            return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    @_errors
    async def create(self, parent_inode, name, mode, flags, ctx):
        await self._parent(parent_inode)
        node = self.overlay.create(parent_inode, name, mode, ctx.uid, ctx.gid)
        return pyfuse3.FileInfo(fh=node.ino, keep_cache=True), self._node_attrs(node)

    @_errors
    async def read(self, fh, off, size):
        v = self.virtual.get(fh)
        if v is not None:
            return v.content[off:off + size]
        node = self.overlay.node(fh)
        base_fd = await self.overlay.base_fd(node)
        return self.overlay.read(self.overlay.node(fh), off, size, base_fd)

    @_errors
    async def write(self, fh, off, buf):
        v = self.virtual.get(fh)
        if v is not None:
            return await self._control_write(v, buf)
        node = self.overlay.node(fh)
        if node.view.read_only:
            # Open-less, the kernel cannot refuse a shared writable mmap of a snapshot file
            # where snapshots/ is not a read-only mount; this WRITE is its write-back.  Drop
            # the changed pages once it is answered, again if another comes meanwhile.
            if fh in self.refused_pages:
                self.refused_pages[fh] = True
            else:
                self.refused_pages[fh] = False
                trio.lowlevel.spawn_system_task(self._drop_refused_pages, fh)
        await self._hold(node)
        return self.overlay.write(node, off, buf)

    async def _drop_refused_pages(self, ino: int) -> None:
        try:
            while True:
                FAULTS.check("task:refused-pages")
                await self._invalidate([(ino, b"")])
                if not self.refused_pages[ino]:
                    break
                self.refused_pages[ino] = False
        except Exception:  # a system task: an exception here would end the daemon
            log.exception("dropping the refused pages of snapshot inode %d failed", ino)
        finally:
            del self.refused_pages[ino]

    @_errors
    async def fsync(self, fh, datasync):
        if fh in self.virtual:
            return
        node = self.overlay.node(fh)
        if node.upper is not None:
            await self.overlay.sync_data(node)
            if self.overlay.is_live(node) and node.upper.nlink > 0:
                self.overlay.save(node)
            await self.overlay.sync_store()

    @_errors
    async def fsyncdir(self, fh, datasync):
        await in_slices(self.overlay.flush_all_steps())
        await self.overlay.sync_store()

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

    @_errors
    async def forget(self, inode_list):
        # Nodes stay while the daemon runs, so inode numbers stay stable; an unlinked one
        # goes now that no process can reach it.
        nodes = [self.overlay.nodes[ino] for ino, _ in inode_list if ino in self.overlay.nodes]
        for ino, count in inode_list:
            v = self.virtual.get(ino)
            if v is not None and v.slot is not None:  # a control file's inode
                self._forget_generation(v, count)
        self.overlay.forgotten(nodes)
        if self.overlay.reclaim and not self._reclaiming:
            self._reclaiming = True
            trio.lowlevel.spawn_system_task(self._reclaim)

    async def _reclaim(self) -> None:
        """Delete forgotten unlinked inodes: their upper data files in a worker thread, then
        their records in transactions of ``COLLECT_BATCH`` inodes (50,000 in one held the
        trio thread 50 ms), in batches: what the kernel forgets in the
        :data:`RECLAIM_DELAY_S` after the first, then what it forgets while a batch goes.  An
        ``rm -rf`` then waits for neither, and the loop hands a thread a job per batch, not per
        file.  A failed or cancelled batch stays marked orphan and goes at the next start
        (Overlay.remove_orphans)."""
        try:
            await trio.sleep(RECLAIM_DELAY_S)
            while items := self.overlay.take_reclaim():
                try:
                    FAULTS.check("task:reclaim")
                    await trio.to_thread.run_sync(unlink_upper_files, items)
                    for start in range(0, len(items), COLLECT_BATCH):  # a bounded step each
                        self.overlay.reclaimed(items[start:start + COLLECT_BATCH])
                        await trio.sleep(0)
                except (RametError, OSError) as exc:  # the next start deletes them
                    log.warning("reclaiming %d forgotten inodes failed: %s", len(items), exc)
                except Exception as exc:  # a system task: an exception here would end the daemon
                    log.exception("reclaiming %d forgotten inodes failed", len(items))
                    for ex in self.overlay.executions_of(items):
                        self.overlay.fail(ex, f"internal error reclaiming its inodes: {exc!r}")
        finally:
            self._reclaiming = False

    async def _close_unlinked(self) -> None:
        """Close the descriptors of unlinked upper files (freeing their blocks) in a thread."""
        fds = self.overlay.take_unlinked_fds()
        if fds:
            await trio.to_thread.run_sync(close_all, fds)

    # -- control files -------------------------------------------------------------------

    async def _control_content(self, v: ControlSlot | Virtual, caller: Caller = HARNESS
                               ) -> bytes:
        """What a control file other than ``ctl`` shows ``caller`` now; a diff or preview
        is made in slices of the trio thread (rametfs.control)."""
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
            raise pyfuse3.FUSEError(errno.EACCES)
        if v.kind == protocol.FSMONITOR:
            if len(buf) > protocol.MAX_COMMAND_BYTES:
                raise pyfuse3.FUSEError(errno.E2BIG)
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
        await self._invalidate([(SNAPSHOTS, b""), (EXECUTIONS, b"")])
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
            raise pyfuse3.FUSEError(reply["errno"])
        return len(buf)

    def _show(self, v: Virtual, content: bytes) -> None:
        """Generation ``v`` shows ``content`` from now on (the answer to what was written to
        it), counted as its own; unless it was dropped meanwhile (then ESTALE)."""
        v.changed(content)
        if self.virtual.get(v.ino) is v:
            self._count(v, len(content))
