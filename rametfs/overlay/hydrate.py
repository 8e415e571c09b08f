"""Base content for reads: each content decompressed once into the shared hydration cache
(rametfs.store.cache) by one worker thread however many readers ask at once, and its
descriptor kept open (the cache keeps a content while its descriptor is held here)."""

from __future__ import annotations

import os

import trio

from ..store import EMPTY_CONTENT, Store
from .data import OpenFiles
from .nodes import Node


class Hydrator:
    """Hydrated base contents of ``store``, by content id."""

    def __init__(self, store: Store):
        self.store = store
        self.hydrating: dict[bytes, trio.Event] = {}  # content id -> set once it is there
        self.base_fds = OpenFiles(closed=store.cache.release)

    async def _hydrate(self, cid: bytes, threads: trio.CapacityLimiter) -> int:
        """A held descriptor of base content ``cid`` decompressed in the shared cache; one
        thread (of ``threads``, the asking view's) builds it however many readers ask at
        once (a keyed in-flight event), and none is needed when it is already there."""
        while cid in self.hydrating:
            await self.hydrating[cid].wait()
        fd = self.store.cache.get(cid, hold=True)
        if fd is not False:
            return fd
        event = self.hydrating[cid] = trio.Event()
        try:
            return await trio.to_thread.run_sync(self.store.open_hydrated, cid, limiter=threads)
        finally:
            del self.hydrating[cid]
            event.set()

    async def base_fd(self, node: Node) -> int | None:
        """An open descriptor of ``node``'s hydrated base content (hydrating it first), or
        None when no byte of it can come from the base."""
        cid = node.base_content
        if cid is None or cid == EMPTY_CONTENT or \
                (node.upper is not None and node.upper.base_limit == 0):
            return None
        fd = self.base_fds.get(cid)
        if fd is None:
            fd = await self._hydrate(cid, node.view.threads)
            other = self.base_fds.get(cid)  # another request may have opened it meanwhile
            if other is not None:
                os.close(fd)
                self.store.cache.release(cid)
                return other
            self.base_fds.put(cid, fd)
        return fd
