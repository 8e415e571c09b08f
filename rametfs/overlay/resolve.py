"""Snapshot references resolved without holding the trio thread: what the store holds at once,
a published snapshot's catalog lookup (``Store.published_snapshot``) in a worker thread.

The lookups are bounded twice, so that a flood of unknown names (``snapshots/`` is 0711: any
uid of an ``--allow-other`` mount may look names up in it) costs neither threads nor the
requests of anyone else: at most :data:`CATALOG_THREADS` of them run at a time, and at most
:data:`CATALOG_WAITING` lookups of ``snapshots/`` entries wait or run; one more fails at once,
EAGAIN.  The control commands (``create``, ``reset``, ``name``, ...) have threads of their own
and wait their turn: a flood of lookups does not refuse the harness's ``create``.
"""

from __future__ import annotations

import errno

import trio

from ..errors import NotFound, RametError
from ..store import Snapshot, Store

CATALOG_THREADS = 2  # catalog lookups running at once, for each of commands and entries
CATALOG_WAITING = 64  # lookups of snapshots/ entries waiting or running; more: EAGAIN


class Resolver:
    """Snapshot references of ``store``, resolved as ``Store.snapshot`` does."""

    def __init__(self, store: Store):
        self.store = store
        self._commands = trio.CapacityLimiter(CATALOG_THREADS)
        self._entries = trio.CapacityLimiter(CATALOG_THREADS)
        self._entries_waiting = 0

    def _local(self, ref: str) -> Snapshot | None:
        """The snapshot ``ref`` names here; None when the catalog is to be asked."""
        try:
            return self.store.local_snapshot(ref)
        except NotFound:
            if not self.store.asks_remote(ref):
                raise
            return None

    async def snapshot(self, ref: str) -> Snapshot:
        """The snapshot ``ref`` names, for a control command.  Raises as
        ``Store.snapshot``."""
        snap = self._local(ref)
        if snap is not None:
            return snap
        snap = await trio.to_thread.run_sync(self.store.published_snapshot, ref,
                                             limiter=self._commands)
        return self.store.local_snapshot(snap.id)  # an rm meanwhile: NotFound

    async def entry(self, ref: str) -> Snapshot:
        """The snapshot ``ref`` names, for a lookup of ``snapshots/<ref>``.  Raises as
        ``Store.snapshot``, and RametError (EAGAIN) when :data:`CATALOG_WAITING` lookups
        of entries wait for the catalog already."""
        snap = self._local(ref)
        if snap is not None:
            return snap
        if self._entries_waiting >= CATALOG_WAITING:
            raise RametError(errno.EAGAIN, f"snapshot {ref!r}: {CATALOG_WAITING} lookups wait "
                             "for the remote's catalog already: try again")
        self._entries_waiting += 1
        try:
            snap = await trio.to_thread.run_sync(self.store.published_snapshot, ref,
                                                 limiter=self._entries)
        finally:
            self._entries_waiting -= 1
        return self.store.local_snapshot(snap.id)  # an rm meanwhile: NotFound
