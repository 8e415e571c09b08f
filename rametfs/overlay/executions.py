"""The views: snapshot views, and the executions' lifecycle (create, reset, release, pristine,
head and runtime records), the freeze that holds an execution's mutations, and the deletion of
dead layers.

*Reset* gives an execution a fresh, empty layer over a snapshot and marks the old one dead:
the old layer's nodes turn stale at once but those whose path the snapshot still has (the
same file, or a directory), which keep their inode numbers, and a background task deletes
the dead layer's records (:meth:`Executions.collect_dead_layer`).  What it plans, it plans in
slices of the trio thread; it swaps the layer in one step, whose work does not grow with the
nodes the execution has or keeps (only with the directories it rebinds); what is left of the
old layer's tables it reads and empties in slices afterwards (:meth:`Executions._dropped_steps`).
"""

from __future__ import annotations

import contextlib
import errno
import stat
import time
from typing import AsyncIterator

import trio

from ..authority import Access, ReadIndex
from ..errors import NotFound, RametError
from ..store import Entry, Snapshot, Store
from ..store.catalog import Catalog
from ..store.format import ExecutionRecord, UpperInode
from ..store.names import SNAPSHOT_ID_RE
from ..treewalk import Steps
from ..ids import ExecutionId
from .nodes import (COLLECT_BATCH, RELEASED, Dropped, Epoch, Execution, InodeTable, Node,
                    SnapshotView, View)
from .slices import in_slices
from .trees import BaseTrees

RESET_STEP = 1024  # known nodes a reset's plan places per step (rametfs.overlay.slices)
DROP_STEP = 1024  # entries of a dropped layer's tables read and emptied per step


class Executions:
    """The snapshot views and executions of ``store``, their nodes in ``table``; the
    executions stored are loaded at once."""

    def __init__(self, store: Store, table: InodeTable, trees: BaseTrees):
        self.store = store
        self.table = table
        self.trees = trees
        self.snapshot_views: dict[str, SnapshotView] = {}
        self.executions: dict[str, Execution] = {}
        self.readers = ReadIndex()  # who may read which execution (its r bit)
        self.dead_layers = trio.Event()  # set when a layer or nodes wait for deletion
        self.resetting: dict[str, trio.Lock] = {}  # execution id -> its resets take turns
        self.layers = store.layers
        self.catalog = Catalog(store)
        with store.read() as txn:
            self.next_layer = self.layers.next_layer(txn)
            for eid, rec in self.catalog.executions(txn):
                self._load_execution(eid, rec)

    def snapshot_view(self, sid: str) -> SnapshotView:
        """The view of snapshot ``sid``, its full id as the store spells it (64 lower-case hex
        digits: another spelling of the same id would make another view); NotFound (ENOENT)
        if there is none."""
        view = self.snapshot_views.get(sid)
        if view is None:
            if not SNAPSHOT_ID_RE.fullmatch(sid):
                raise NotFound(f"no snapshot {sid!r}")
            snap = self.store.snapshot_by_raw_id(bytes.fromhex(sid))
            if snap is None:
                raise NotFound(f"no snapshot {sid!r}")
            view = SnapshotView(snap, self.table.alloc_ino())
            self.snapshot_views[sid] = view
            self.table.add(Node(view.root_ino, view, snap.root, None, 0, sid.encode()))
        return view

    def _load_execution(self, eid: str, rec: ExecutionRecord) -> Execution:
        snapshot = self.store.snapshot
        ex = Execution(eid, snapshot(rec.base), snapshot(rec.head), snapshot(rec.lower),
                       rec.layer, rec.root_ino, rec.created_ns, Access.from_record(rec.access))
        ex.policy, ex.runtime = rec.policy, rec.runtime
        with self.store.read() as txn:
            stored = self.layers.inode(txn, ex.layer, ex.root_ino)
        upper, record_bytes = stored or (UpperInode.from_entry(ex.lower.root), 0)
        self.executions[eid] = ex
        self.readers.add(eid, ex.access)
        root = self.table.add(Node(ex.root_ino, ex, ex.lower.root, upper, 0, eid.encode()))
        root.record_bytes = record_bytes
        return ex

    def _new_layer(self, txn, ex: Execution, epoch: Epoch) -> None:
        """Give ``ex`` a fresh, empty upper layer over ``ex.lower``, its nodes' epoch
        ``epoch`` (rametfs.overlay.nodes.Epoch), and store its record."""
        ex.layer = self.next_layer
        epoch.layer, ex.epoch = ex.layer, epoch
        self.next_layer += 1
        self.layers.put_next_layer(txn, self.next_layer)
        root = UpperInode.from_entry(ex.lower.root)
        record_bytes = self.layers.put_inode(txn, ex.layer, ex.root_ino, root)
        self.catalog.put_execution(txn, ex.id, ex.record())
        node = self.table.add(Node(ex.root_ino, ex, ex.lower.root, root, 0, ex.id.encode()))
        node.record_bytes = record_bytes  # the root's record is not counted in upper_bytes

    def create_execution(self, snap: Snapshot, eid: ExecutionId, access: Access = Access(),
                         policy: dict | None = None) -> Execution:
        """A new execution of ``snap`` named ``eid`` with ``access``: one record, O(1) in the
        tree size; ``policy`` is stored with it (``Execution.policy``).

        Raises RametError(EEXIST) when ``eid`` is taken.
        """
        if eid in self.executions:
            raise RametError(errno.EEXIST, f"execution {eid!r} already exists")
        ex = Execution(eid, snap, snap, snap, 0, self.table.alloc_ino(), time.time_ns(), access)
        ex.policy = policy
        with self.store.write() as txn:
            self._new_layer(txn, ex, ex.epoch)
            self.table.persist_counters(txn)
        self.executions[eid] = ex
        self.readers.add(eid, ex.access)
        return ex

    def execution(self, eid: ExecutionId) -> Execution:
        try:
            return self.executions[eid]
        except KeyError:
            raise NotFound(f"no execution {eid!r}") from None

    async def reset(self, ex: Execution, to: Snapshot
                    ) -> tuple[list[tuple[int, bytes]], list[int]]:
        """Drop the upper layer of ``ex`` and give it a fresh one over snapshot ``to``, which
        becomes its head (rametfs.core.heads): O(known nodes of ``ex``) whatever ``to`` is,
        in slices of the trio thread (``in_slices``) but for the swap of the layer, one step
        of O(rebound directories); ``ex`` frozen until the swap, and its resets one at a
        time; the old layer is deleted later.  NotFound (ENOENT) when ``ex`` is released
        meanwhile.

        The known nodes that lie at the same path in ``to`` keep their node and inode number
        (:meth:`_kept_steps`): a shell working in an unchanged directory carries on, and so
        does one in a changed directory that ``to`` still has, which shows ``to``'s names.
        Until the swap every node is the old layer's, after it the kept ones are the new
        layer's (their :class:`Epoch` moves with the layer number), so no request of ``ex``
        sees a mix of the two trees.  Returns the ``(parent ino, name)`` dentries and the
        inode numbers the kernel may cache that changed, for the adapter to invalidate.  The
        root keeps its dentry and inode number, so a bind mount of the execution stays valid.
        """
        async with self._one_reset(ex):
            with ex.freeze():
                kept, rebound = await in_slices(self._kept_steps(ex, to))
                self._check_not_released(ex)
                epoch, inos, dcache = await in_slices(self._keep_steps(ex, kept))
                self._check_not_released(ex)
                dropped = self._swap(ex, to, epoch, inos, dcache, rebound)
        with trio.CancelScope(shield=True):  # the kernel must be told, and the nodes freed
            return await in_slices(self._dropped_steps(ex, dropped, True, kept, rebound))

    @contextlib.asynccontextmanager
    async def _one_reset(self, ex: Execution) -> AsyncIterator[None]:
        """Run the block while no other reset of ``ex`` runs: a reset's kept nodes sit in its
        epoch from its plan to its swap, and another's plan would move them to its own."""
        lock = self.resetting.get(ex.id)
        if lock is None:
            lock = self.resetting[ex.id] = trio.Lock()
        try:
            async with lock:
                yield
        finally:  # a release hands the lock to the next reset waiting, if any
            if not lock.locked() and self.resetting.get(ex.id) is lock:
                del self.resetting[ex.id]

    def _check_not_released(self, ex: Execution) -> None:
        if self.executions.get(ex.id) is not ex:
            raise NotFound(f"execution {ex.id!r} was released")

    def _keep_steps(self, ex: Execution, kept: set[int]
                    ) -> Steps[tuple[Epoch, set[int], dict[tuple[int, bytes], int]]]:
        """Move the nodes ``kept`` into an epoch of their own, whose layer is still ``ex``'s
        (they stay live), and gather them and their dentries for the new layer: ``(epoch,
        inos, dcache)``; a step per :data:`RESET_STEP` nodes."""
        epoch = Epoch(ex.layer)
        nodes, dcache = self.table.nodes, ex.dcache
        inos: set[int] = set()
        dentries: dict[tuple[int, bytes], int] = {}
        for i, ino in enumerate(kept, 1):
            if i % RESET_STEP == 0:
                yield
            node = nodes[ino]
            node.epoch = epoch
            inos.add(ino)
            key = (node.parent, node.name)
            if dcache.get(key) == ino:
                dentries[key] = ino
        return epoch, inos, dentries

    def _swap(self, ex: Execution, to: Snapshot, epoch: Epoch, inos: set[int],
              dcache: dict[tuple[int, bytes], int], rebound: dict[int, Entry]) -> Dropped:
        """The one step of a reset that changes what ``ex`` shows: the new layer over
        ``to``, the kept nodes (``inos``, their dentries ``dcache``, already in ``epoch``)
        in it, the ``rebound`` directories bound to their entries in ``to``.  O(rebound);
        returns the old layer's tables (``InodeTable.drop_layer``)."""
        old = ex.layer
        ex.failure = None
        ex.upper_bytes, ex.upper_inodes, ex.captured_bytes = 0, 1, 0
        dropped = self.table.drop_layer(ex, inos, dcache)
        ex.head = ex.lower = to
        with self.store.write() as txn:
            self.layers.mark_dead(txn, old)
            self._new_layer(txn, ex, epoch)
        nodes = self.table.nodes
        for ino, entry in rebound.items():  # the old layer's record is not theirs now
            node = nodes[ino]
            node.entry, node.upper, node.dirty, node.record_bytes = entry, None, False, 0
        return dropped

    def _kept_steps(self, ex: Execution, to: Snapshot) -> Steps[tuple[set[int], dict[int, Entry]]]:
        """The known nodes of ``ex`` (``ex.inos``: those the kernel may hold) that a reset
        onto ``to`` keeps, and the directories among them it rebinds, each to its entry in
        ``to``: ``(kept inos, {ino: entry})``, the root left out.

        A node is kept when its parent is kept and ``to``'s directory there has its name:
        a directory (still named where its parent knows it: one removed or moved away is
        not) of a directory, rebound when it was copied up or its entry differs (its names
        change); a file, symlink or device only when it was never copied up (a removal or
        a move copies it up) and its entry is the same, and is no hard link (its group's
        other names would get other inodes).  Only known nodes are looked at, each once: a
        step per :data:`RESET_STEP` of them, or per batch of names of a base tree decoded
        (``BaseTrees.tree_steps``)."""
        nodes = self.table.nodes
        names = yield from self.trees.tree_steps(to.root.ref)
        # a directory placed -> the names of its tree in ``to`` (None: not kept)
        listings: dict[int, dict[bytes, Entry] | None] = {ex.root_ino: names}
        trees = {to.root.ref: names}  # ``to``'s trees looked in, by id
        kept: set[int] = set()
        rebound: dict[int, Entry] = {}
        for i, ino in enumerate(list(ex.inos), 1):  # lookups may add nodes meanwhile
            if i % RESET_STEP == 0:
                yield
            node = nodes.get(ino)
            if node is None:
                continue
            upper = node.upper
            if stat.S_ISDIR(upper.mode if upper is not None else node.entry.mode):
                if ino not in listings:
                    yield from self._place_steps(ex, node, listings, trees, rebound)
                if listings[ino] is not None:
                    kept.add(ino)
            elif upper is None and not node.entry.link:
                names = listings.get(node.parent, False)
                if names is False:
                    parent = nodes.get(node.parent)
                    if parent is None:
                        continue
                    yield from self._place_steps(ex, parent, listings, trees, rebound)
                    names = listings[parent.ino]
                if names is not None:
                    entry = names.get(node.name)
                    if entry is node.entry or entry == node.entry:  # one tree decoded: one object
                        kept.add(ino)
        kept.discard(ex.root_ino)
        return kept, rebound

    def _place_steps(self, ex: Execution, node: Node,
                     listings: dict[int, dict[bytes, Entry] | None],
                     trees: dict[bytes, dict[bytes, Entry]], rebound: dict[int, Entry]
                     ) -> Steps[None]:
        """Place directory ``node`` of ``ex`` and its parents not placed yet in ``listings``
        (:meth:`_kept_steps`), the directories rebound into ``rebound``."""
        chain = []  # ``node`` and its parents not placed yet, deepest first
        dcache = ex.dcache
        while node.ino not in listings:
            listings[node.ino] = None  # until placed (a loop of parents ends here)
            if node.view is not ex or node.epoch.layer != ex.layer or \
                    dcache.get((node.parent, node.name)) != node.ino:
                break
            chain.append(node)
            parent = self.table.nodes.get(node.parent)
            if parent is None:
                break
            node = parent
        names = listings[node.ino]
        for d in reversed(chain):
            entry = names.get(d.name) if names is not None else None
            if entry is None or not entry.is_dir:
                names = None
            else:
                if d.upper is not None or not (d.entry is entry or d.entry == entry):
                    rebound[d.ino] = entry
                names = trees.get(entry.ref)
                if names is None:
                    names = trees[entry.ref] = yield from self.trees.tree_steps(entry.ref)
            listings[d.ino] = names

    def pristine(self, ex: Execution) -> bool:
        """Whether ``ex``'s layer is as a reset leaves it: no change recorded since, no
        dentry stored in it (one from before a daemon restart), its root record its lower
        snapshot's."""
        if ex.changes:
            return False
        with self.store.read() as txn:
            if self.layers.has_dentries(txn, ex.layer):
                return False
        root = self.table.nodes[ex.root_ino].upper
        return root is not None and root.pack() == UpperInode.from_entry(ex.lower.root).pack()

    async def release(self, ex: Execution) -> tuple[list[tuple[int, bytes]], list[int]]:
        """Delete execution ``ex`` and its upper layer (files still open turn stale): one
        step, O(1); what the kernel may cache of it is found in slices afterwards.

        Returns what the kernel may cache, as ``reset`` does; the root's dentry has parent 0.
        """
        dropped = self.table.drop_layer(ex)
        with self.store.write() as txn:
            self.layers.mark_dead(txn, ex.layer)
            self.catalog.delete_execution(txn, ex.id)
        del self.executions[ex.id]
        self.readers.remove(ex.id)
        ex.layer = RELEASED
        with trio.CancelScope(shield=True):
            return await in_slices(self._dropped_steps(ex, dropped, False))

    def _dropped_steps(self, view: View, dropped: Dropped, keep_root_entry: bool,
                       kept: set[int] = frozenset(), rebound: dict[int, Entry] | None = None
                       ) -> Steps[tuple[list[tuple[int, bytes]], list[int]]]:
        """What the kernel may cache of a layer ``view`` dropped (``dropped``, its tables),
        as ``(dentries, inode numbers)``, the tables emptied meanwhile and its stale nodes
        given to the collector (``InodeTable.stale_inos``); a step per :data:`DROP_STEP`
        entries.  (Emptied entry by entry: freeing a table of 100,000 entries at once held
        the trio thread for milliseconds.)

        Invalidating a directory's dentry drops everything cached below it that nothing
        holds; the inodes a process still holds (its cwd, an open file) keep their cached
        pages and listings until told, so every inode of the layer that is not ``kept`` is
        told too, and so are the root and the kept directories whose names change
        (attributes and listings): the ``rebound`` ones, and those with a name whose node
        goes (a hard link).  Of the kept directories (and the root), the names whose node
        goes are invalidated; the missing names the kernel was told of the directories told
        (the root, the rebound ones) are the adapter's to add (rametfs.fuse.kernel): the
        model does not know them.  The inodes are a flat list of numbers: a (ino, b"") pair
        each made 50,000 tracked tuples, and the young gc collections that traversed them
        held the trio thread 50 ms more during a reset."""
        root = view.root_ino
        entries: list[tuple[int, bytes]] = []
        changed = set(rebound or ())  # kept directories whose names change
        dcache = dropped.dcache
        while dcache:
            for _ in range(min(DROP_STEP, len(dcache))):
                key, ino = dcache.popitem()
                parent = key[0]
                if ino in kept:
                    continue
                if parent in kept:
                    changed.add(parent)
                    entries.append(key)
                elif parent == root or parent == 0 and not keep_root_entry:
                    entries.append(key)
            yield
        stale: list[int] = []
        inos = dropped.inos
        while inos:
            for _ in range(min(DROP_STEP, len(inos))):
                ino = inos.pop()
                if ino not in kept:
                    stale.append(ino)
            yield
        for table in dropped.link_inos, dropped.changes, dropped.dirty:
            pop = table.popitem if isinstance(table, dict) else table.pop
            while table:
                for _ in range(min(DROP_STEP, len(table))):
                    pop()
                yield
        self.table.stale_inos.append(stale[:])  # the collector takes them from its own list
        self.dead_layers.set()
        return entries, stale + list(changed)

    def set_head(self, ex: Execution, snap: Snapshot) -> None:
        """Make ``snap`` the head of ``ex`` (a promote of it); its layer stays."""
        ex.head = snap
        self._save_record(ex)

    def set_runtime(self, ex: Execution, runtime: dict) -> None:
        """Record the sandbox that runs ``ex`` (``Execution.runtime``)."""
        ex.runtime = runtime
        self._save_record(ex)

    def _save_record(self, ex: Execution) -> None:
        with self.store.write() as txn:
            self.catalog.put_execution(txn, ex.id, ex.record())

    def collect_dead_layer(self) -> tuple[int, bool] | None:
        """Delete a bounded batch of one dead layer's records.

        Returns ``(layer, records_left)``, or None when no layer is dead.  Once no record is
        left, the caller removes the layer's upper data (``FileData.remove_layer_files``, in a
        thread) and then calls ``forget_dead_layer``, so a crash in between repeats it.
        """
        with self.store.write() as txn:
            return self.layers.delete_dead_batch(txn, COLLECT_BATCH)

    def forget_dead_layer(self, layer: int) -> None:
        with self.store.write() as txn:
            self.layers.forget_dead(txn, layer)

    async def wait_thawed(self, node: Node) -> None:
        """Wait while ``node``'s execution is frozen (``Execution.wait_thawed``); ESTALE when
        a reset or release dropped the node's layer meanwhile (the change would land in the
        new one)."""
        ex = node.view
        if isinstance(ex, Execution) and ex.freezes:
            await ex.wait_thawed()
            self.table.check_live(node)

