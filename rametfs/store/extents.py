"""Where a sparse file holds data: lseek(2) ``SEEK_DATA``/``SEEK_HOLE``, in pages.

Linux answers on every file system (one without holes reports the whole file as data, and
ext4, xfs and tmpfs report unwritten extents as holes); where there is no ``SEEK_DATA`` or
lseek refuses it (EINVAL), the whole range counts as data.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator

from .format import PAGE_SIZE


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
