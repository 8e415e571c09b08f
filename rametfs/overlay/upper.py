"""Copy-up, and the upper inode records of each execution's layer: the gate every change
passes (:meth:`Upper.writable`), what a layer may use (``--max-bytes``, ``--max-inodes``) and
uses, and storing the records (at once, or the dirty ones with the next flush).

An inode is *copied up* the first time it or its directory listing changes: its upper record
is written with its origin base entry and its inode number, and the dentry that names it in
its parent, whose own copy-up comes first.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from typing import Iterable

from ..errors import RametError, ReadOnly, fs_error
from ..store import Store
from ..store.format import UpperInode
from ..store.layers import dentry_bytes
from ..treewalk import Steps, run_steps
from .changes import changed
from .nodes import NO_PAGES, Execution, InodeTable, Node, View

FLUSH_BATCH = 1000  # dirty records a flush stores in one transaction, one step of the trio thread


class Upper:
    """The upper records of the nodes of ``table`` in ``store``, for the ``executions`` (by
    id) whose upper data files lie under ``upper_root``."""

    def __init__(self, store: Store, table: InodeTable, executions: dict[str, Execution],
                 upper_root: str):
        self.store = store
        self.table = table
        self.executions = executions
        self.upper_root = upper_root

    def writable(self, node: Node) -> Execution:
        """``node``'s execution, which every change to the node passes through (and is
        recorded by); EROFS for a snapshot, EIO for an execution marked failed."""
        view = node.view
        if view.read_only:
            raise ReadOnly("snapshots are read-only")
        self.check_not_failed(view)
        changed(view, node.ino)
        return view  # type: ignore[return-value]

    @staticmethod
    def check_not_failed(ex: Execution) -> None:
        """Raise RametError (EIO) when an internal error marked ``ex`` failed (:meth:`fail`):
        it takes no change and no capture until its reset."""
        if ex.failure is not None:
            raise RametError(errno.EIO, f"execution {ex.id} failed: an internal error hit it (the "
                             f"harness's status says which); reset it to go on")

    @staticmethod
    def fail(ex: Execution, reason: str) -> None:
        """Mark ``ex`` failed: an unexpected exception hit a request or background work of
        it, so its state in memory may not be what is stored.  Reads go on; changes and
        captures get EIO until a reset (which drops the layer and the mark).  The first
        reason is kept."""
        if ex.failure is None:
            ex.failure = reason

    def copy_up(self, node: Node) -> UpperInode:
        """Materialise ``node`` (and its parent directories) in its execution's upper layer.

        Writes the upper records and the dentries that name them, in one transaction; inode
        numbers stay.
        """
        ex = self.writable(node)
        if node.upper is not None:
            return node.upper
        chain, n = [], node  # it and its ancestors not copied up yet, deepest first
        while n.upper is None:  # a loop, not recursion: a tree may be any depth
            chain.append(n)
            n = self.table.node(n.parent)
            self.writable(n)  # each directory on the way is recorded as changed too
        self.check_inode_quota(ex, len(chain))
        # No room check: a copy-up comes before every removal too (a base name's whiteout),
        # and what copies-up store is bounded by the base.
        uppers = [(n, UpperInode.from_entry(n.entry)) for n in reversed(chain)]
        added = 0
        layers = self.store.layers
        with self.store.write() as txn:  # one transaction: all of them or (ENOSPC) none
            for n, upper in uppers:
                n.pending_bytes = layers.put_inode(txn, ex.layer, n.ino, upper)
                layers.put_dentry(txn, ex.layer, n.parent, n.name, n.ino)
                added += n.pending_bytes + dentry_bytes(n.name)
                if n.entry.link:
                    layers.put_link(txn, ex.layer, n.entry.link, n.ino)
            self.table.persist_counters(txn)
        for n, upper in uppers:
            n.upper, n.record_bytes = upper, n.pending_bytes
        ex.upper_inodes += len(uppers)
        ex.upper_bytes += added
        return node.upper

    @staticmethod
    def check_inode_quota(ex: Execution, new: int = 1) -> None:
        """EDQUOT when ``new`` more upper inode records would pass ``ex``'s limit (a copy-up
        takes one, as it takes an upper inode in kernel overlayfs)."""
        limit = ex.access.max_inodes
        if limit is not None and ex.upper_inodes + new > limit:
            raise fs_error(errno.EDQUOT, f"execution {ex.id} has used its {limit} inodes "
                                         f"(--max-inodes)")

    @staticmethod
    def room(ex: Execution, wanted: int) -> int:
        """How many of ``wanted`` bytes ``ex`` may still allocate (all, without a limit);
        EDQUOT when none."""
        limit = ex.access.max_bytes
        if limit is None:
            return wanted
        room = limit - ex.upper_bytes - ex.captured_bytes
        if room <= 0 < wanted:
            raise fs_error(errno.EDQUOT, f"execution {ex.id} has used its {limit} bytes "
                                         f"(--max-bytes)")
        return min(wanted, room)

    def charge(self, ex: Execution, stored: int) -> None:
        """Count ``stored`` bytes a capture ``ex`` asked for itself puts in the store against
        its ``--max-bytes`` until its next reset (:attr:`Execution.captured_bytes`); EDQUOT
        when they do not fit, and then nothing is counted.  So an agent's checkpoints cannot
        fill the store, while the harness's captures are never refused.  ``stored`` must not
        depend on what else the store holds (ChunkWriter.added_bytes, not new_bytes): the
        agent reads the count and sees the EDQUOT."""
        if self.room(ex, stored) < stored:
            raise fs_error(errno.EDQUOT, f"execution {ex.id}: the capture stores {stored} "
                                         f"bytes, more than is left of its "
                                         f"{ex.access.max_bytes} (--max-bytes)")
        ex.captured_bytes += stored

    def check_room(self, ex: Execution, wanted: int) -> None:
        """EDQUOT unless ``ex`` may still store all of ``wanted`` bytes (metadata: records,
        names, extended attributes)."""
        if self.room(ex, wanted) < wanted:
            raise fs_error(errno.EDQUOT, f"execution {ex.id} has used its "
                                         f"{ex.access.max_bytes} bytes (--max-bytes)")

    def save(self, *nodes: Node) -> None:
        """Store the upper records and new page-map entries of ``nodes`` now, in one
        transaction."""
        with self.store.write() as txn:
            self.put_records(txn, nodes)
        self.stored(nodes)

    def put_records(self, txn, nodes: Iterable[Node]) -> None:
        """Put the upper records and new page-map entries of ``nodes`` (those that have an
        upper record) and the counters in ``txn``; call :meth:`stored` once it commits."""
        layers = self.store.layers
        for node in nodes:
            if node.upper is not None:
                layer = node.view.layer
                node.pending_bytes = layers.put_inode(txn, layer, node.ino, node.upper)
                if node.upper.nlink == 0:  # no name left; processes may still hold it
                    layers.put_orphan(txn, layer, node.ino)
                for page in node.new_pages:
                    layers.put_page(txn, layer, node.ino, page)
        self.table.persist_counters(txn)

    @staticmethod
    def stored(nodes: Iterable[Node]) -> None:
        """The transaction :meth:`put_records` filled committed: the nodes are clean and
        their records' bytes count into their executions' usage."""
        for node in nodes:
            if node.upper is not None:
                node.new_pages = NO_PAGES
                node.dirty = False
                node.view.dirty.discard(node)
                node.view.upper_bytes += node.pending_bytes - node.record_bytes
                node.record_bytes = node.pending_bytes

    @staticmethod
    def mark_dirty(node: Node) -> None:
        """``node``'s record changed: stored with the next flush (:meth:`flush_view`)."""
        node.dirty = True
        node.view.dirty.add(node)

    def flush_view(self, view: View) -> None:
        """Store every dirty upper record of ``view`` now (:meth:`flush_steps` at once)."""
        run_steps(self.flush_steps(view))

    def flush_steps(self, view: View) -> Steps[None]:
        """Store every dirty upper record of ``view`` (before a capture, a fsync, shutdown,
        and every second), :data:`FLUSH_BATCH` records a transaction and a step: 50,000
        records in one took the trio thread 250 ms.  A record made dirty meanwhile stays
        dirty for the next flush; one of an inode dropped or unlinked meanwhile is not
        stored.  A store error (NoSpace: ENOSPC) leaves the records not yet stored dirty."""
        dirty = list(view.dirty)
        for start in range(0, len(dirty), FLUSH_BATCH):
            if start:
                yield
            batch = []
            for node in dirty[start:start + FLUSH_BATCH]:
                if not node.dirty:
                    continue  # stored meanwhile (a fsync)
                if self.table.is_live(node) and node.upper.nlink > 0:
                    batch.append(node)
                else:
                    node.dirty = False
                    view.dirty.discard(node)
            if batch:
                self.save(*batch)

    def flush_all(self) -> None:
        run_steps(self.flush_all_steps())

    def flush_all_steps(self) -> Steps[None]:
        """:meth:`flush_steps` of every execution."""
        for ex in list(self.executions.values()):
            yield from self.flush_steps(ex)

    @staticmethod
    def touch(node: Node, mtime: bool = True) -> None:
        """Set ``node``'s ctime (and mtime) to now, in memory."""
        now = time.time_ns()
        u = node.upper
        u.ctime_ns = now
        if mtime:
            u.mtime_ns = now

    def count_usage(self) -> None:
        """Count what each execution's layer uses (:attr:`Execution.upper_bytes`: the blocks
        of its upper data files, and the bytes of its records and dentries but for the
        pristine root record's; :attr:`Execution.upper_inodes`: its records): a scan of its
        upper data files, records and dentries, O(upper inodes and names).  The daemon calls
        it once at its start, after ``remove_orphans``; from then on every change keeps the
        counts."""
        for ex in self.executions.values():
            ex.upper_bytes = -len(UpperInode.from_entry(ex.lower.root).pack())
            with contextlib.suppress(FileNotFoundError), \
                    os.scandir(f"{self.upper_root}/{ex.layer}") as it:
                for e in it:
                    ex.upper_bytes += e.stat().st_blocks * 512
            with self.store.read() as txn:
                records = self.store.layers.record_sizes(txn, ex.layer)
                ex.upper_inodes = len(records)
                ex.upper_bytes += sum(records) + self.store.layers.dentry_sizes(txn, ex.layer)
