"""Chunks: BLAKE3-addressed, zstd-compressed pages of file content in a self-checking envelope,
and contents: a file's size and the chunks of its pages that hold data.

Pure functions (no I/O), safe to call from worker threads: BLAKE3 and zstd release the GIL.
"""

from __future__ import annotations

import bisect
import functools
import struct
import threading
from collections.abc import Iterable, Iterator

import blake3
import msgpack
import zstandard

from ..errors import IntegrityError
from .format import (CODEC_RAW, CODEC_ZSTD, ID_BYTES, PAGE_SIZE, pack_envelope,
                     unpack_envelope)

ZSTD_LEVEL = 3
ZERO_PAGE = bytes(PAGE_SIZE)
_RUN = struct.Struct(">QQ")
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    # zstandard contexts are not thread-safe: one per thread.
    c = getattr(_local, "compressor", None)
    if c is None:
        c = _local.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = zstandard.ZstdDecompressor()
    return d


def chunk_id(raw: bytes) -> bytes:
    """The 32-byte BLAKE3 id of ``raw`` chunk bytes."""
    return blake3.blake3(raw).digest()


def is_zero(raw: bytes | bytearray) -> bool:
    """Whether ``raw`` (at most one page) holds only zero bytes: one memcmp(3), not a loop."""
    return raw == (ZERO_PAGE if len(raw) == PAGE_SIZE else ZERO_PAGE[:len(raw)])


def page_id(raw: bytes) -> bytes | None:
    """The chunk id of page bytes ``raw``, or None when they are all zeros (a hole)."""
    return None if is_zero(raw) else chunk_id(raw)


@functools.lru_cache(maxsize=64)
def zero_chunk_id(length: int) -> bytes:
    """The id of a chunk of ``length`` zero bytes: what a format 1 record holds for a page
    of zeros, which is a hole in this format."""
    return chunk_id(ZERO_PAGE[:length])


def encode_chunk(raw: bytes) -> bytes:
    """Envelope for ``raw`` (at most one page): zstd when that is smaller, else raw."""
    assert len(raw) <= PAGE_SIZE
    packed = _compressor().compress(raw)
    if len(packed) < len(raw):
        return pack_envelope(CODEC_ZSTD, len(raw), packed)
    return pack_envelope(CODEC_RAW, len(raw), raw)


def decode_chunk(cid: bytes, envelope: bytes) -> bytes:
    """The raw bytes of a chunk, checked against its id.

    Raises IntegrityError (EIO) when the envelope is malformed or the bytes do not hash to ``cid``.
    """
    try:
        codec, raw_length, payload = unpack_envelope(envelope)
        if codec == CODEC_ZSTD:
            raw = _decompressor().decompress(payload, max_output_size=raw_length)
        else:
            raw = bytes(payload)
    except (ValueError, zstandard.ZstdError) as exc:
        raise IntegrityError(f"chunk {cid.hex()}: {exc}") from None
    if len(raw) != raw_length or chunk_id(raw) != cid:
        raise IntegrityError(f"chunk {cid.hex()}: content does not match its BLAKE3 id")
    return raw


def page_count(size: int) -> int:
    """Pages of a file of ``size`` bytes (the last one may be short)."""
    return -(-size // PAGE_SIZE)


def content_id(size: int, chunk_ids: bytes, runs: tuple[tuple[int, int], ...] | None = None
               ) -> bytes:
    """The 32-byte id of a file's content (docs/format.md).

    Dense (``runs`` None: every page holds data, chunk i is page i): BLAKE3 of ``b"content\\0"``,
    the size (u64) and the chunk ids, the format 1 definition.  Sparse (``runs``: the
    ``(first page, pages)`` runs of pages holding data, ascending and maximal, their chunk
    ids in page order): BLAKE3 of ``b"content\\1"``, the size, the number of runs (u64), the
    runs (two u64 each) and the chunk ids.  O(pages holding data), never O(size).
    """
    head = size.to_bytes(8, "big")
    if runs is None:
        return blake3.blake3(b"content\0" + head + chunk_ids).digest()
    h = blake3.blake3(b"content\1" + head + len(runs).to_bytes(8, "big"))
    h.update(_pack_runs(runs))
    h.update(chunk_ids)
    return h.digest()


def _pack_runs(runs: tuple[tuple[int, int], ...]) -> bytes:
    return b"".join(_RUN.pack(*r) for r in runs)


class Content:
    """A file's content: ``size`` bytes, of which the pages in ``runs`` (``(first page,
    pages)``, ascending, maximal) hold data, chunk ids ``ids`` (32 B each, concatenated, in
    page order); every other page is a hole and reads as zeros.

    Canonical: a page is a hole exactly when its bytes are all zeros, so equal bytes make an
    equal content (and id) whoever wrote them.  A format 1 record (every page a chunk, zero
    pages too) reads as the same pages; :meth:`chunk` and :meth:`pages` report its zero
    chunks as holes.
    """

    __slots__ = ("size", "ids", "runs", "_starts", "_offsets")

    def __init__(self, size: int, ids: bytes, runs: tuple[tuple[int, int], ...]):
        self.size = size
        self.ids = ids
        self.runs = runs
        self._starts = [start for start, _ in runs]
        offsets, total = [], 0
        for _, count in runs:
            offsets.append(total)
            total += count
        self._offsets = offsets

    @property
    def dense(self) -> bool:
        """Whether every page holds a chunk (the format 1 record form)."""
        pages = page_count(self.size)
        return not pages or self.runs == ((0, pages),)

    @property
    def id(self) -> bytes:
        return content_id(self.size, self.ids, None if self.dense else self.runs)

    @property
    def stored_pages(self) -> int:
        """Pages with a chunk (those of a format 1 record's zero chunks included)."""
        return len(self.ids) // ID_BYTES

    def _is_zero_chunk(self, page: int, cid: bytes) -> bool:
        # Only a format 1 record holds such chunks: a page of zeros, or a short last page.
        if cid == _ZERO_PAGE_ID:
            return True
        tail = self.size - page * PAGE_SIZE
        return tail < PAGE_SIZE and cid == zero_chunk_id(tail)

    def _in_runs(self, page: int) -> bool:
        i = bisect.bisect_right(self._starts, page) - 1
        return i >= 0 and page < self._starts[i] + self.runs[i][1]

    def data_bytes(self, limit: int, excluded: Iterable[int] = ()) -> int:
        """Bytes of the pages that hold data below byte ``limit`` (at most the size), the
        last one counted up to ``limit``, the pages ``excluded`` left out: what the file's
        first ``limit`` bytes keep in the store (a format 1 record's zero chunks count)."""
        limit, excluded = min(limit, self.size), set(excluded)
        stop = page_count(limit)
        total = sum(max(0, min(start + count, stop) - start) * PAGE_SIZE
                    for start, count in self.runs)
        for page in {stop - 1, *excluded} if stop else ():
            if page < stop and self._in_runs(page):
                short = page * PAGE_SIZE + PAGE_SIZE - limit if page == stop - 1 else 0
                total -= PAGE_SIZE if page in excluded else short
        return total

    def chunk(self, page: int) -> bytes | None:
        """The chunk id of ``page``, or None for a hole (or a page past the end)."""
        i = bisect.bisect_right(self._starts, page) - 1
        if i < 0:
            return None
        start, count = self.runs[i]
        if page >= start + count:
            return None
        at = (self._offsets[i] + page - start) * ID_BYTES
        cid = self.ids[at:at + ID_BYTES]
        return None if self._is_zero_chunk(page, cid) else cid

    def pages(self, stop: int | None = None, first: int = 0) -> Iterator[tuple[int, bytes]]:
        """``(page, chunk id)`` of every page holding data from page ``first`` on and below
        page ``stop`` (all when None), ascending."""
        ids = self.ids
        skip = max(0, bisect.bisect_right(self._starts, first) - 1)  # runs wholly before it
        for (start, count), offset in zip(self.runs[skip:], self._offsets[skip:]):
            end = start + count if stop is None else min(start + count, stop)
            for page in range(max(start, first), end):
                at = (offset + page - start) * ID_BYTES
                cid = ids[at:at + ID_BYTES]
                if not self._is_zero_chunk(page, cid):
                    yield page, cid
            if stop is not None and start + count >= stop:
                return

    def chunk_ids(self) -> Iterator[bytes]:
        """Every chunk id the record holds, in page order (zero chunks of format 1 too)."""
        return (self.ids[i:i + ID_BYTES] for i in range(0, len(self.ids), ID_BYTES))

    def pack(self) -> bytes:
        """The ``contents`` record: ``[size, ids]`` (dense) or ``[size, ids, runs]``."""
        if self.dense:
            return msgpack.packb([self.size, self.ids])
        return msgpack.packb([self.size, self.ids, _pack_runs(self.runs)])

    @classmethod
    def unpack(cls, cid: bytes, value: bytes) -> "Content":
        """The content record ``value`` of id ``cid``; IntegrityError (EIO) if malformed."""
        try:
            record = msgpack.unpackb(value)
            size, ids = record[0], record[1]
            if not (isinstance(size, int) and isinstance(ids, bytes) and len(record) in (2, 3)
                    and 0 <= size < 1 << 63 and len(ids) % ID_BYTES == 0):
                raise ValueError("not [size, ids] or [size, ids, runs]")
            stored = len(ids) // ID_BYTES
            if len(record) == 2:
                if stored != page_count(size):
                    raise ValueError(f"{stored} chunk ids for {size} bytes")
                return cls(size, ids, ((0, stored),) if stored else ())
            raw = record[2]
            if not isinstance(raw, bytes) or len(raw) % _RUN.size:
                raise ValueError("runs are not pairs of u64")
            runs = tuple(_RUN.iter_unpack(raw))
            end = -1
            for start, count in runs:
                if count < 1 or start <= end:
                    raise ValueError("runs are not ascending, apart and non-empty")
                end = start + count
            if end > page_count(size) or sum(c for _, c in runs) != stored:
                raise ValueError("runs do not match the size or the chunk ids")
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            raise IntegrityError(f"content {cid.hex()}: malformed record ({exc})") from None
        return cls(size, ids, runs)

    @classmethod
    def from_pages(cls, size: int, ids: Iterable[bytes | None]) -> "Content":
        """The content of ``size`` bytes whose page i has chunk ``ids[i]`` (None: a hole)."""
        builder = ContentBuilder()
        for page, cid in enumerate(ids):
            builder.add(page, cid)
        return builder.content(size)


_ZERO_PAGE_ID = chunk_id(ZERO_PAGE)


class ContentBuilder:
    """Collects the pages of a content in ascending order: :meth:`add`, then
    :meth:`content`."""

    def __init__(self):
        self._ids = bytearray()
        self._runs: list[list[int]] = []

    def add(self, page: int, cid: bytes | None) -> None:
        """Page ``page`` (above every page added so far) has chunk ``cid``; None: a hole."""
        if cid is None:
            return
        runs = self._runs
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1][1] += 1
        else:
            runs.append([page, 1])
        self._ids += cid

    def content(self, size: int) -> Content:
        return Content(size, bytes(self._ids), tuple((s, c) for s, c in self._runs))

