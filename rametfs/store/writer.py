"""ChunkWriter: store each new chunk once, compressed in the caller's thread, in batches.

Shared by snapshot import, promote and fallback promote.  Thread-safe: several worker
threads may add chunks to one writer; LMDB serialises their batch commits.
"""

from __future__ import annotations

import threading

from . import chunks
from .store import Store

BATCH_BYTES = 32 << 20  # envelope bytes per write transaction


class ChunkWriter:
    """Adds chunks to ``store``: a chunk already stored, or already added here, is not
    compressed or written again.  ``new_chunks`` and ``new_bytes`` (stored envelope bytes)
    count what this writer added.  Call ``flush()`` before the chunks are referenced.
    """

    def __init__(self, store: Store):
        self.store = store
        self.new_chunks = 0
        self.new_bytes = 0
        self._seen: set[bytes] = set()
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._lock = threading.Lock()

    def add(self, raw: bytes) -> bytes:
        """Store ``raw`` (at most one page) unless present; returns its 32-byte chunk id.

        Raises NoSpace (ENOSPC) when a batch cannot be committed.
        """
        cid = chunks.chunk_id(raw)
        with self._lock:
            if cid in self._seen:
                return cid
            self._seen.add(cid)
        if self.store.has_chunk(cid):
            return cid
        envelope = chunks.encode_chunk(raw)
        with self._lock:
            self._pending.append((cid, envelope))
            self._pending_bytes += len(envelope)
            self.new_chunks += 1
            self.new_bytes += len(envelope)
            full = self._pending_bytes >= BATCH_BYTES
        if full:
            self.flush()
        return cid

    def flush(self) -> None:
        """Commit the chunks added so far."""
        with self._lock:
            batch, self._pending, self._pending_bytes = self._pending, [], 0
        if batch:
            with self.store.write() as txn:
                db = self.store.db["chunks"]
                for cid, envelope in batch:
                    txn.put(cid, envelope, db=db, overwrite=False)

    def put_content(self, size: int, chunk_ids: list[bytes]) -> bytes:
        """Commit pending chunks, then record a file's content; returns the content id."""
        self.flush()
        with self.store.write() as txn:
            return Store.put_content(txn, self.store.db["contents"], size, chunk_ids)
