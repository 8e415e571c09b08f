"""The decoded base trees of every view: immutable, so kept (at most :data:`TREE_ENTRIES`
entries in all, the least recently used trees going first) and decoded once."""

from __future__ import annotations

from collections import OrderedDict

import trio

from ..store import Entry, Store
from ..treewalk import Steps, run_steps

TREE_ENTRIES = 1 << 20  # entries of the decoded base trees kept in memory (~300 bytes each)
BIG_TREE_BYTES = 1 << 20  # a stored tree this large is decoded in a worker thread (prefetch)


class BaseTrees:
    """Base trees of ``store`` by id, decoded."""

    def __init__(self, store: Store):
        self.store = store
        self.trees: OrderedDict[bytes, dict[bytes, Entry]] = OrderedDict()  # least used first
        self.tree_entries = 0  # of the trees kept

    def tree(self, tid: bytes) -> dict[bytes, Entry]:
        """Entries of base tree ``tid``."""
        return run_steps(self.tree_steps(tid))

    def tree_steps(self, tid: bytes) -> Steps[dict[bytes, Entry]]:
        """:meth:`tree` as steps: one not kept is decoded a batch of names a step
        (``Store.tree_steps``)."""
        entries = self.trees.get(tid)
        if entries is None:
            return self._keep(tid, (yield from self.store.tree_steps(tid)))
        self.trees.move_to_end(tid)
        return entries

    def _keep(self, tid: bytes, entries: dict[bytes, Entry]) -> dict[bytes, Entry]:
        if tid in self.trees:  # decoded meanwhile by another walk
            return self.trees[tid]
        self.trees[tid] = entries
        self.tree_entries += len(entries)
        while self.tree_entries > TREE_ENTRIES and len(self.trees) > 1:
            self.tree_entries -= len(self.trees.popitem(last=False)[1])
        return entries

    async def prefetch(self, tid: bytes, threads: trio.CapacityLimiter) -> None:
        """Make sure base tree ``tid`` is decoded before a lookup or listing needs it: one
        stored in :data:`BIG_TREE_BYTES` or more is decoded in a worker thread (of
        ``threads``, the asking view's), so a directory of 500,000 names delays other
        requests by nothing (3.8 s on the trio thread before)."""
        if tid in self.trees or self.store.tree_bytes(tid) < BIG_TREE_BYTES:
            return
        entries = await trio.to_thread.run_sync(self.store.tree, tid, limiter=threads)
        if tid not in self.trees:
            self._keep(tid, entries)
