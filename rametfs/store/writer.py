"""ChunkWriter: store each new chunk once, compressed in the caller's thread, in batches.

Shared by snapshot import, promote and fallback promote.  Thread-safe: several worker
threads may add chunks to one writer; LMDB serialises their batch commits.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from . import chunks
from .chunks import Content, ContentBuilder
from .extents import data_extents, pages_of
from .format import PAGE_SIZE
from .store import Store

BATCH_BYTES = 32 << 20  # envelope bytes per write transaction


class ChunkWriter:
    """Adds chunks to ``store``: a chunk already stored, or already added here, is not
    compressed or written again; a page of zeros is a hole, never a chunk.  ``new_chunks``
    and ``new_bytes`` (stored envelope bytes) count what this writer added.  Call
    ``flush()`` before the chunks are referenced.  ``added_bytes`` counts the page bytes of
    the distinct chunks given to this writer, stored before or not: what a caller may be
    told without learning what else the store holds (new_chunks would say whether another
    execution stored the same page).
    """

    def __init__(self, store: Store):
        self.store = store
        self.new_chunks = 0
        self.new_bytes = 0
        self.added_bytes = 0
        self._seen: set[bytes] = set()
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._lock = threading.Lock()

    def add(self, raw: bytes) -> bytes | None:
        """Store page bytes ``raw`` (at most one page) unless present; returns the 32-byte
        chunk id, or None when ``raw`` is all zeros (a hole: nothing stored).

        Raises NoSpace (ENOSPC) when a batch cannot be committed.
        """
        cid = chunks.page_id(raw)
        if cid is None:
            return None
        self.store.gc_guard.pin(cid)  # before has_chunk (rametfs.store.gc)
        with self._lock:
            if cid in self._seen:
                return cid
            self._seen.add(cid)
            self.added_bytes += len(raw)
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

    def put(self, content: Content) -> bytes:
        """Commit pending chunks, then record ``content``; returns its content id."""
        self.flush()
        with self.store.write() as txn:
            return self.store.put_content(txn, content)

    def put_content(self, size: int, chunk_ids: Iterable[bytes | None]) -> bytes:
        """Record the content of ``size`` bytes whose page i is chunk ``chunk_ids[i]``
        (None: a hole), as :meth:`add` returned them; returns the content id."""
        return self.put(Content.from_pages(size, chunk_ids))

    def put_file(self, fd: int, size: int) -> bytes:
        """Chunk, store and record the first ``size`` bytes of the open regular file ``fd``;
        returns the content id.  Only the file's data extents are read (SEEK_DATA, so a
        source hole costs nothing), and pages of zeros are holes; bytes the file lacks (it
        shrank since ``size`` was taken) read as zeros.  Blocking.  Raises OSError as
        pread(2) does, NoSpace (ENOSPC).
        """
        builder = ContentBuilder()
        for page in pages_of(data_extents(fd, 0, size)):
            start = page * PAGE_SIZE
            want = min(PAGE_SIZE, size - start)
            raw = os.pread(fd, want, start)
            while 0 < len(raw) < want:  # short reads: fill the page
                more = os.pread(fd, want - len(raw), start + len(raw))
                if not more:
                    break
                raw += more
            builder.add(page, self.add(raw.ljust(want, b"\0")))
        return self.put(builder.content(size))
