"""Where a sparse file holds data: lseek(2) ``SEEK_DATA``/``SEEK_HOLE``, in pages; and
fallocate(2), which makes and removes holes.

Linux answers on every file system (one without holes reports the whole file as data, and
ext4, xfs and tmpfs report unwritten extents as holes); where there is no ``SEEK_DATA`` or
lseek refuses it (EINVAL), the whole range counts as data.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from collections.abc import Iterable, Iterator

from .format import PAGE_SIZE

# fallocate(2) modes (linux/falloc.h)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


FS_IOC_FIEMAP = 0xC020660B  # linux/fs.h: _IOWR('f', 11, struct fiemap)
_FIEMAP = struct.Struct("=QQIIII")  # fm_start, fm_length, fm_flags, mapped, count, reserved
_EXTENT = struct.Struct("=QQQ16xI12x")  # fe_logical, fe_physical, fe_length, ..., fe_flags
_FIEMAP_EXTENT_LAST = 0x1
_EXTENTS_ASKED = 256  # extents one ioctl returns at most


def allocated_bytes(fd: int, start: int, stop: int) -> int:
    """Bytes of ``[start, stop)`` of ``fd`` that have blocks, written or not (FIEMAP):
    what a fallocate of that range need not allocate again.  Where the file system has no
    FIEMAP, the bytes of its data extents (SEEK_DATA), which leave allocated holes out."""
    total, pos = 0, start
    while pos < stop:
        request = bytearray(_FIEMAP.pack(pos, stop - pos, 0, 0, _EXTENTS_ASKED, 0)
                            + bytes(_EXTENT.size * _EXTENTS_ASKED))
        try:
            fcntl.ioctl(fd, FS_IOC_FIEMAP, request)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTTY):
                raise
            return sum(b - a for a, b in data_extents(fd, start, stop))
        mapped, before = _FIEMAP.unpack_from(request)[3], pos
        for i in range(mapped):
            logical, _, length, flags = _EXTENT.unpack_from(
                request, _FIEMAP.size + i * _EXTENT.size)
            total += max(0, min(logical + length, stop) - max(logical, pos))
            pos = max(pos, logical + length)
            if flags & _FIEMAP_EXTENT_LAST:
                return total
        if pos == before:  # no extent left in the range
            break
    return total


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) of ``length`` bytes at ``offset`` of ``fd`` (the os module has only
    posix_fallocate, which has no mode and writes zeros where the file system has no
    fallocate).  Raises OSError as fallocate(2) fails (EOPNOTSUPP: not on this file
    system)."""
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def data_extents(fd: int, start: int, stop: int) -> Iterator[tuple[int, int]]:
    """``(offset, end)`` byte ranges of ``fd`` within ``[start, stop)`` that may hold data,
    ascending; every other byte there reads as zeros (or is past the end of the file).
    Moves the file offset.  Raises OSError as lseek(2) does, but for ENXIO (only a hole
    left) and EINVAL (no SEEK_DATA here)."""
    seek_data = getattr(os, "SEEK_DATA", None)
    pos = start
    while pos < stop:
        if seek_data is None:
            yield pos, stop
            return
        try:
            data = os.lseek(fd, pos, seek_data)
            hole = os.lseek(fd, data, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return
            if exc.errno != errno.EINVAL:
                raise
            seek_data = None
            continue
        if data >= stop:
            return
        yield data, min(hole, stop)
        pos = hole


def pages_of(extents: Iterable[tuple[int, int]]) -> Iterator[int]:
    """The pages (:data:`PAGE_SIZE` bytes) that byte ranges ``extents`` (ascending) touch,
    each once, ascending."""
    last = -1
    for offset, end in extents:
        first = max(offset // PAGE_SIZE, last + 1)
        last = max(last, (end - 1) // PAGE_SIZE)
        yield from range(first, last + 1)
