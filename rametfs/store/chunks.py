"""Chunks: BLAKE3-addressed, zstd-compressed pages of file content in a self-checking envelope.

Pure functions (no I/O), safe to call from worker threads: BLAKE3 and zstd release the GIL.
"""

from __future__ import annotations

import threading

import blake3
import zstandard

from ..errors import IntegrityError
from .format import (CODEC_RAW, CODEC_ZSTD, PAGE_SIZE, pack_envelope, unpack_envelope)

ZSTD_LEVEL = 3
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


def content_id(size: int, chunk_ids: bytes) -> bytes:
    """The 32-byte id of a file's content: BLAKE3 over its size (bytes) and chunk id list."""
    return blake3.blake3(b"content\0" + size.to_bytes(8, "big") + chunk_ids).digest()


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
