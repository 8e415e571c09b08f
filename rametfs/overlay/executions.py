"""The views: snapshot views, and the executions' lifecycle (create, reset, release, pristine,
head and runtime records), the freeze that holds an execution's mutations, and the deletion of
dead layers.

*Reset* gives an execution a fresh, empty layer over a snapshot and marks the old one dead:
the old layer's nodes turn stale at once, the nodes the reset leaves as they were are kept,
and a background task deletes the dead layer's records (:meth:`Executions.collect_dead_layer`).
"""

from __future__ import annotations

import errno
import time

import trio

from ..authority import Access, ReadIndex
from ..errors import NotFound, RametError
from ..store import FLAG_HAS_LINKS, Snapshot, Store
from ..store.catalog import Catalog
from ..store.format import ExecutionRecord, UpperInode
from ..store.names import SNAPSHOT_ID_RE
from ..types import ExecutionId
from .nodes import COLLECT_BATCH, RELEASED, Execution, InodeTable, Node, SnapshotView, View
from .trees import BaseTrees



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

    def _new_layer(self, txn, ex: Execution) -> None:
        """Give ``ex`` a fresh, empty upper layer over ``ex.lower``, and store its record."""
        ex.layer = self.next_layer
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
            self._new_layer(txn, ex)
            self.table.persist_counters(txn)
        self.executions[eid] = ex
        self.readers.add(eid, ex.access)
        return ex

    def execution(self, eid: ExecutionId) -> Execution:
        try:
            return self.executions[eid]
        except KeyError:
            raise NotFound(f"no execution {eid!r}") from None

    def reset(self, ex: Execution, to: Snapshot) -> tuple[list[tuple[int, bytes]], list[int]]:
        """Drop the upper layer of ``ex`` and give it a fresh one over snapshot ``to``, which
        becomes its head (rametfs.core.heads): O(1) visible whatever ``to`` is; the old layer
        is deleted later.

        Returns the ``(parent ino, name)`` dentries and the inode numbers the kernel may
        cache, for the adapter to invalidate.  The root keeps
        its dentry and inode number, so a bind mount of the execution stays valid, and so do
        the directories and files of the root that are the same in ``to``, with everything
        below them (:meth:`_unchanged`): a shell working in one of them carries on.
        """
        kept = self._unchanged(ex, to)
        stale = self._stale_entries(ex, keep_root_entry=True, kept=kept)
        old = ex.layer
        ex.failure = None
        ex.upper_bytes, ex.upper_inodes, ex.captured_bytes = 0, 1, 0
        self.table.drop_layer(ex, kept)
        ex.head = ex.lower = to
        with self.store.write() as txn:
            self.layers.mark_dead(txn, old)
            self._new_layer(txn, ex)
        for ino in kept:
            self.table.nodes[ino].layer = ex.layer
        self.dead_layers.set()
        return stale

    def _unchanged(self, ex: Execution, to: Snapshot) -> set[int]:
        """The inodes of ``ex`` the kernel knows that a reset onto ``to`` leaves as they are:
        each name of the root the kernel looked up whose node was never copied up, whose
        base entry is ``to``'s entry of that name (so a directory's whole subtree is the
        same: a change below it would have copied it up), and with no hard link in it, and
        every known node below such a directory.  O(known inodes)."""
        root = ex.root_ino
        new = self.trees.tree(to.root.ref)
        tops: dict[int, bool] = {}  # kept candidates among the root's names
        for (parent, name), ino in ex.dcache.items():
            node = self.table.nodes.get(ino)
            if parent == root and node is not None and node.upper is None and \
                    not node.entry.link and not node.entry.flags & FLAG_HAS_LINKS:
                tops[ino] = new.get(name) == node.entry
        top_of: dict[int, int | None] = {root: None}

        def top(ino: int) -> int | None:
            """The root's child ``ino`` lies below (None: none known)."""
            chain = []
            while ino not in top_of:
                node = self.table.nodes.get(ino)
                if node is None or node.parent == root:
                    top_of[ino] = None if node is None else ino
                    break
                chain.append(ino)
                ino = node.parent
            for below in chain:
                top_of[below] = top_of[ino]
            return top_of[ino]

        below = {ino: top(ino) for ino in ex.inos if ino != root}
        for ino, t in below.items():
            node = self.table.nodes.get(ino)
            if t in tops and (node is None or node.upper is not None or node.entry.link):
                tops[t] = False  # not the base's after all (cannot happen without links)
        return {ino for ino, t in below.items() if tops.get(t)}

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

    def release(self, ex: Execution) -> tuple[list[tuple[int, bytes]], list[int]]:
        """Delete execution ``ex`` and its upper layer (files still open turn stale).

        Returns what the kernel may cache, as ``reset`` does; the root's dentry has parent 0.
        """
        stale = self._stale_entries(ex, keep_root_entry=False)
        self.table.drop_layer(ex)
        with self.store.write() as txn:
            self.layers.mark_dead(txn, ex.layer)
            self.catalog.delete_execution(txn, ex.id)
        del self.executions[ex.id]
        self.readers.remove(ex.id)
        ex.layer = RELEASED
        self.dead_layers.set()
        return stale

    @staticmethod
    def _stale_entries(view: View, keep_root_entry: bool, kept: set[int] = frozenset()
                       ) -> tuple[list[tuple[int, bytes]], list[int]]:
        # Invalidating a directory's dentry drops everything cached below it that nothing
        # holds; the inodes a process still holds (its cwd, an open file) keep their cached
        # pages and listings until told, so every inode of the layer is told too, but those
        # ``kept`` (a reset's unchanged ones: _unchanged) and the names of the root
        # that lead to them.  The inodes are a flat list of numbers: a (ino, b"") pair each
        # made 50,000 tracked tuples, and the young gc collections that traversed them held
        # the trio thread 50 ms more during a reset.  The root's cached missing names are
        # the adapter's to add (rametfs.fuse.kernel): the model does not know them.
        root = view.root_ino
        entries = [key for key, ino in view.dcache.items() if key[0] == root and ino not in kept]
        if not keep_root_entry:
            entries += [key for key in view.dcache if key[0] == 0]
        return entries, list(view.inos - kept) if kept else list(view.inos)

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
        left, the caller removes the layer's upper data (``store.remove_upper_dir``, in a
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

