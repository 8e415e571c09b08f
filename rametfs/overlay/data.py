"""File data: page maps, reads merged from base and upper bytes, copy-on-write writes,
truncation, fsync, and the upper data files themselves (``<data>/upper/<layer>/<ino>``: their
descriptors, their placement from precreated files, their unlink on a truncation to 0).

A file's upper record carries ``base_limit``, the number of leading bytes still served from
the base content; its page map lists the pages below that limit that now live in the upper
data file.  A write copies up only the pages it touches (:func:`assemble` merges a read).
"""

from __future__ import annotations

import errno
import functools
import heapq
import os
import shutil
import stat
import time
from collections import OrderedDict
from typing import Callable, Hashable, Iterator

import trio

from ..errors import NoSpace, RametError, fs_error
from ..precreate import Precreated, unlink_if_there
from ..store import PAGE_SIZE, Store
from ..store.chunks import page_count
from ..store.extents import (FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE,
                              allocated_bytes, data_extents, fallocate)
from ..store.format import UpperInode
from .lookup import Lookup
from .nodes import NO_PAGES, Attrs, Execution, Node
from .upper import Upper

OPEN_FILES = 256  # upper data files, and as many hydrated base files, kept open
CONTENTS_KEPT = 1 << 16  # contents whose stored bytes are kept (FileData.content_bytes)
MAX_FILE_SIZE = (2**32 - 1) * 4096  # bytes: ext4's limit with 4 KiB blocks (16 TiB - 4 KiB)


class OpenFiles:
    """At most ``limit`` open file descriptors by key; the least recently used is closed
    to make room.  The kernel no longer tells the daemon when a file is closed (open-less
    FUSE), so descriptors live here, not with the files' users."""

    def __init__(self, limit: int = OPEN_FILES,
                 closed: Callable[[Hashable], None] | None = None):
        self.limit = limit
        self.fds: OrderedDict[Hashable, int] = OrderedDict()
        self.closed = closed  # called with the key after its descriptor is closed here

    def get(self, key: Hashable) -> int | None:
        fd = self.fds.get(key)
        if fd is not None:
            self.fds.move_to_end(key)
        return fd

    def put(self, key: Hashable, fd: int) -> int:
        self.fds[key] = fd
        if len(self.fds) > self.limit:
            old, old_fd = self.fds.popitem(last=False)
            os.close(old_fd)
            if self.closed is not None:
                self.closed(old)
        return fd

    def close(self, key: Hashable) -> None:
        fd = self.take(key)
        if fd is not None:
            os.close(fd)
            if self.closed is not None:
                self.closed(key)

    def take(self, key: Hashable) -> int | None:
        """Remove ``key``'s descriptor from the cache, open, and hand it to the caller."""
        return self.fds.pop(key, None)


def close_all(fds: list[int]) -> None:
    """Close ``fds``.  Blocking: closing the last descriptor of an unlinked file frees its
    blocks (ext4: about 200 ms per GiB), so call it off the event loop."""
    for fd in fds:
        os.close(fd)


def assemble(off: int, end: int, pages: set[int], base_limit: int,
             read_base: Callable[[int, int], bytes], read_upper: Callable[[int, int], bytes]
             ) -> bytes:
    """Bytes ``[off, end)`` of a copied-up file, merged from base content and upper data.

    A page in ``pages`` comes from the upper data; otherwise its bytes below ``base_limit``
    come from the base and the rest from the upper data.  Both readers take ``(offset,
    length)`` in bytes and may return short (sparse/EOF): the gap reads as zeros.  Adjacent
    pieces from one source are read with one call.
    """
    pieces: list[tuple[bool, int, int]] = []  # (from_upper, start, end)
    pos = off
    while pos < end:
        page = pos // PAGE_SIZE
        page_end = min(end, (page + 1) * PAGE_SIZE)
        if page in pages or pos >= base_limit:
            piece = (True, pos, page_end)
        elif page_end <= base_limit:
            piece = (False, pos, page_end)
        else:
            piece = (False, pos, base_limit)
        if pieces and pieces[-1][0] == piece[0] and pieces[-1][2] == piece[1]:
            pieces[-1] = (piece[0], pieces[-1][1], piece[2])
        else:
            pieces.append(piece)
        pos = piece[2]
    out = bytearray()
    for from_upper, start, stop in pieces:
        data = (read_upper if from_upper else read_base)(start, stop - start)
        out += data
        if len(data) < stop - start:
            out += bytes(stop - start - len(data))
    return bytes(out)


def _add_new_page(node: Node, page: int) -> None:
    if node.new_pages is NO_PAGES:
        node.new_pages = set()
    node.new_pages.add(page)


class FileData:
    """The bytes of the files of ``store``'s views: their page maps, their upper data files
    under ``upper_root`` (descriptors cached in ``upper_fds``, by node) and reads and writes
    of them; changes pass ``upper`` (copy-up, usage, records)."""

    def __init__(self, store: Store, upper: Upper, upper_fds: OpenFiles, upper_root: str):
        self.store = store
        self.upper = upper
        self.upper_fds = upper_fds
        self.upper_root = upper_root
        self.max_file_size = MAX_FILE_SIZE  # bytes; a larger size is EFBIG (the daemon's knob)
        # Empty files for new upper data files; the daemon keeps it filled (rametfs.precreate).
        self.precreated: Precreated | None = None
        # Descriptors of upper data files already unlinked: whoever drives the overlay closes
        # them off the event loop (take_unlinked_fds, close_all); that frees their blocks.
        self.unlinked_fds: list[int] = []
        # Group commits of the store (sync_store): calls counted, the last call a finished
        # flush covers, and the flush running (None: none).
        self.sync_calls = self.synced = 0
        self.syncing: trio.Event | None = None
        # content id -> bytes its pages holding data take (st_blocks of unchanged files)
        self.content_bytes = functools.lru_cache(maxsize=CONTENTS_KEPT)(
            lambda cid: (c := store.content(cid)).data_bytes(c.size))

    def attrs(self, node: Node) -> Attrs:
        """What stat(2) shows of ``node`` (:meth:`Lookup.attrs`), a regular file's
        ``st_blocks`` from :meth:`stored_bytes`."""
        return Lookup.attrs(node, self.stored_bytes(node) if stat.S_ISREG(node.mode) else None)

    def stored_bytes(self, node: Node) -> int:
        """Bytes regular file ``node``'s data takes where it is kept, for ``st_blocks``: its
        base pages that hold data and still show (a hole, at page granularity, takes
        none) and what its upper data file takes on disk (a sparse file, as the kernel
        stores it)."""
        u, cid = node.upper, node.base_content
        if u is None:
            return self.content_bytes(cid) if cid else 0
        stored = self.store.content(cid).data_bytes(u.base_limit, self.pages(node)) \
            if cid and u.base_limit else 0
        if u.size:
            if not node.allocated:  # its data file not opened since the start
                try:
                    node.allocated = os.stat(self.upper_path(node.view, node.ino)).st_blocks * 512
                except FileNotFoundError:
                    pass
            stored += node.allocated
        return stored

    # -- upper data files ----------------------------------------------------------------

    def upper_path(self, ex: Execution, ino: int) -> str:
        return f"{self.upper_root}/{ex.layer}/{ino}"  # a string: pathlib costs µs per call

    def remove_layer_files(self, layer: int, room: tuple[int, int]) -> list[tuple[int, int]]:
        """Remove dead ``layer``'s upper data files and their directory, the files taken
        back into the precreated pool first while ``room`` lasts (``Precreated.take_back``);
        returns what was taken back, for ``Precreated.hold``.  Blocking: call it in a
        thread."""
        directory = f"{self.upper_root}/{layer}"
        taken = self.precreated.take_back_directory(directory, room) \
            if self.precreated is not None else []
        shutil.rmtree(directory, ignore_errors=True)
        return taken

    def _upper_fd(self, node: Node) -> int:
        """A descriptor of ``node``'s upper data file, made if missing
        (:meth:`_new_upper_file`)."""
        fd = self.upper_fds.get(node)
        if fd is None:
            path = self.upper_path(node.view, node.ino)
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                fd = self._new_upper_file(path)
            node.allocated = os.fstat(fd).st_blocks * 512  # counted already (count_usage)
            self.upper_fds.put(node, fd)
        return fd

    def _new_upper_file(self, path: str) -> int:
        """Make the upper data file ``path`` and open it: a precreated empty file renamed into
        place (:attr:`precreated`), else a new one.  When the file system has no inode or
        block left for it (ENOSPC) while the pool holds files, they go and it is tried again
        without."""
        spare = self.precreated.take() if self.precreated is not None else None
        try:
            return self._place_upper_file(spare, path)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or self.precreated is None:
                raise
            if spare is not None:
                unlink_if_there(spare)
            if not self.precreated.drain() and spare is None:
                raise
            return self._place_upper_file(None, path)

    @staticmethod
    def _place_upper_file(spare: str | None, path: str) -> int:
        """Rename ``spare`` to ``path`` (if it is still there) or create ``path``, making its
        layer's directory if missing, and open it read-write."""
        while True:
            try:
                if spare is None:
                    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                os.rename(spare, path)
                return os.open(path, os.O_RDWR)
            except FileNotFoundError:
                if spare is not None and not os.path.exists(spare):
                    spare = None  # gone meanwhile: create it instead
                elif os.path.isdir(os.path.dirname(path)):
                    raise
                else:
                    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)

    @staticmethod
    def _allocated(node: Node, fd: int) -> None:
        """Count what ``node``'s upper data file takes on disk now into its execution's
        usage (``os.fstat``: blocks, as quota counts them)."""
        now = os.fstat(fd).st_blocks * 512
        node.view.upper_bytes += now - node.allocated
        node.allocated = now

    def _unlink_upper(self, node: Node) -> None:
        """Unlink ``node``'s upper data file now (a truncation to 0: the next write starts a
        new one at that path), keeping a descriptor of it in :attr:`unlinked_fds`: the unlink
        only drops the name, the blocks are freed when that descriptor is closed.  A crash
        frees them too (the kernel closes it)."""
        fd = self.upper_fds.take(node)
        path = self.upper_path(node.view, node.ino)
        try:
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
            os.unlink(path)
        except FileNotFoundError:
            pass  # never written, or its layer already removed
        if fd is not None:
            self.unlinked_fds.append(fd)
        node.view.upper_bytes -= node.allocated
        node.allocated = 0

    def take_unlinked_fds(self) -> list[int]:
        """The descriptors of unlinked upper files left to close (:func:`close_all`)."""
        fds, self.unlinked_fds = self.unlinked_fds, []
        return fds

    # -- durability ----------------------------------------------------------------------

    async def sync_data(self, node: Node) -> None:
        """fsync(2) ``node``'s upper data file, if it has one, in a worker thread."""
        fd = self.upper_fds.get(node)
        try:  # a descriptor of its own: the cache may close its one while the thread runs
            fd = os.dup(fd) if fd is not None else \
                os.open(self.upper_path(node.view, node.ino), os.O_RDONLY)
        except FileNotFoundError:
            return  # nothing written yet
        try:
            await trio.to_thread.run_sync(os.fsync, fd, limiter=node.view.threads)
        finally:
            os.close(fd)

    async def sync_store(self) -> None:
        """Flush the store to disk (``Store.sync``, in a worker thread) as one group commit:
        a caller that arrives while a flush runs waits for the next one, which serves every
        caller that came meanwhile (600 fsyncs a second made 600 flushes)."""
        self.sync_calls += 1
        mine = self.sync_calls
        while self.synced < mine:
            if self.syncing is not None:
                await self.syncing.wait()
                continue
            self.syncing = trio.Event()
            covers = self.sync_calls
            try:
                await trio.to_thread.run_sync(self.store.sync)
                self.synced = covers
            finally:
                self.syncing.set()
                self.syncing = None

    # -- page maps, reads and writes -----------------------------------------------------

    def pages(self, node: Node) -> set[int] | frozenset[int]:
        """The page map of file ``node``: its pages in its upper data file.  While no byte of
        its base is visible (a new file, or one truncated to 0) no page can join it, and an
        unloaded map stays unloaded (:data:`NO_PAGES`): a created file costs no set."""
        if node.pages is None and (node.upper is None or not node.upper.base_limit):
            return NO_PAGES
        if node.pages is None:
            node.pages = set()
            ex = node.view
            if node.upper is not None and node.upper.base_limit:
                with self.store.read() as txn:
                    node.pages.update(self.store.layers.pages(txn, ex.layer, node.ino))
        return node.pages

    def base_only(self, node: Node) -> bool:
        """True when every byte of file ``node`` still comes from its base content."""
        u = node.upper
        if u is None:
            return True
        return (u.base is not None and u.base.is_reg and u.base_limit == u.base.size == u.size
                and not self.pages(node))

    def read(self, node: Node, off: int, size: int, base_fd: int | None) -> bytes:
        """Up to ``size`` bytes at ``off``; ``base_fd`` is the hydrated base content, open
        (``Hydrator.base_fd``)."""
        end = min(off + size, node.size)
        if off >= end:
            return b""
        u = node.upper
        if u is None or self.base_only(node):
            return os.pread(base_fd, end - off, off)

        def read_base(o: int, n: int) -> bytes:
            return os.pread(base_fd, n, o) if base_fd is not None else b""

        fd = self._upper_fd(node)

        def read_upper(o: int, n: int) -> bytes:
            return os.pread(fd, n, o)

        return assemble(off, end, self.pages(node), u.base_limit, read_base, read_upper)

    def write(self, node: Node, off: int, data: bytes) -> int:
        """Write ``data`` at ``off`` (bytes), copying up only the pages it touches; returns
        the bytes written, fewer when the disk fills up (ENOSPC when none), when they reach
        :attr:`max_file_size` (EFBIG when none fits), as ext4 does, or when they reach the
        execution's byte limit (EDQUOT when none fits)."""
        ex = self.upper.writable(node)
        room = self.max_file_size - off
        if room <= 0 and data:
            raise fs_error(errno.EFBIG, f"write at byte {off}: a file holds at most "
                                        f"{self.max_file_size} bytes")
        if len(data) > room:
            data = data[:room]
        u = self.upper.copy_up(node)
        self._bytes_change(node, u)
        fd = self._upper_fd(node)
        data = data[:self.upper.room(ex, len(data))]  # a short write up to the limit
        end = off + len(data)
        pages = self.pages(node)
        try:
            whole = self._copy_up_pages(node, u, fd, off, end)  # theirs once written
            done = off + os.pwrite(fd, data, off)
        except RametError:  # of the base's read (IntegrityError, NoSpace)
            raise
        except OSError as exc:
            raise RametError(exc.errno, f"upper data write failed: {exc.strerror}") from None
        finally:
            self._allocated(node, fd)
        for page, limit in whole:
            if limit > done:  # a short write: this page and those after stay the base's
                done = min(done, page * PAGE_SIZE)
                break
            pages.add(page)
            _add_new_page(node, page)
        if done <= off and data:
            raise NoSpace("upper data write failed: no space left on device")
        u.size = max(u.size, done)
        u.mtime_ns = u.ctime_ns = time.time_ns()
        self.upper.mark_dirty(node)
        return done - off

    def _copy_up_pages(self, node: Node, u: UpperInode, fd: int, off: int, end: int,
                       holes: bool = False) -> list[tuple[int, int]]:
        """Copy up into ``fd`` the base pages that bytes ``[off, end)`` of ``node`` touch in
        part, adding them to its page map, and return ``(page, end of its base bytes)`` of
        those they cover whole, which are not copied: the caller decides when they join the
        map.  With ``holes``, a base page that is a hole is returned too, covered or not
        (the caller makes it a hole of ``fd``).  Raises OSError (ENOSPC on a short write)."""
        if off >= u.base_limit:
            return []
        pages = self.pages(node)
        content = self.store.content(u.base.ref) if holes else None
        whole = []
        for page in range(off // PAGE_SIZE, (min(end, u.base_limit) - 1) // PAGE_SIZE + 1):
            if page in pages:
                continue
            start = page * PAGE_SIZE
            limit = min(start + PAGE_SIZE, u.base_limit)
            if off <= start and end >= limit or content is not None and \
                    content.chunk(page) is None:
                whole.append((page, limit))
                continue
            raw = self.store.read_page(u.base.ref, page)[: limit - start]
            if os.pwrite(fd, raw, start) < len(raw):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            pages.add(page)
            _add_new_page(node, page)
        return whole

    def fallocate(self, node: Node, mode: int, off: int, length: int) -> None:
        """fallocate(2) of bytes ``[off, off + length)`` of file ``node``.

        Mode 0 allocates them in the upper data file and extends the size to ``off +
        length``; ``FALLOC_FL_KEEP_SIZE`` leaves the size.  Base pages the range leaves
        unchanged keep their bytes in the store: an allocation does not copy them up (a
        later write does, as ever).  ``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE`` makes
        the bytes (up to the size) read as zeros and frees them: the upper data file gets a
        hole there, and a base page the range covers whole (or that is a hole of the base)
        joins the page map uncopied, masked by that hole; one covered in part is copied up
        first.  ``FALLOC_FL_ZERO_RANGE`` (with or without KEEP_SIZE) is a punch and then an
        allocation.  ``st_blocks`` follows (:meth:`stored_bytes`).

        Errors as ext4 gives them: EOPNOTSUPP for any other mode, EINVAL for ``off < 0``
        or ``length <= 0``, EFBIG past :attr:`max_file_size`, EROFS on a snapshot, EDQUOT
        when the bytes it may allocate pass the execution's ``--max-bytes`` (nothing is
        allocated then), ENOSPC when the disk is full.
        """
        ex = self.upper.writable(node)
        punch, zero, keep = (mode & FALLOC_FL_PUNCH_HOLE, mode & FALLOC_FL_ZERO_RANGE,
                             mode & FALLOC_FL_KEEP_SIZE)
        if mode & ~(FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE) or \
                punch and (zero or not keep):
            raise fs_error(errno.EOPNOTSUPP, f"fallocate mode {mode:#x} is not supported "
                                             f"(0, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE, ZERO_RANGE)")
        if off < 0 or length <= 0:
            raise fs_error(errno.EINVAL, f"fallocate of {length} bytes at {off}")
        end = off + length
        if end > self.max_file_size:
            raise fs_error(errno.EFBIG, f"fallocate to byte {end}: a file holds at most "
                                        f"{self.max_file_size} bytes")
        u = self.upper.copy_up(node)
        grows = not keep and end > u.size
        if punch or zero or grows:
            self._bytes_change(node, u)
        fd = self._upper_fd(node)
        # What to allocate, and the room it needs before anything changes: the upper data
        # file's parts of the range (all of it for a zero range, whose punch masks the base).
        ranges = [] if punch else [(off, end)] if zero else self._upper_ranges(node, u, off, end)
        try:
            self.upper.check_room(ex, sum(b - a - allocated_bytes(fd, a, b) for a, b in ranges))
            if punch or zero:
                self._punch(node, u, fd, off, min(end, u.size))
            for a, b in ranges:
                fallocate(fd, keep, a, b - a)
        except RametError:  # the room (EDQUOT, ENOSPC): as it was said
            raise
        except OSError as exc:
            raise RametError(exc.errno, f"fallocate of the upper data failed: {exc.strerror}"
                             ) from None
        finally:
            self._allocated(node, fd)
            self.upper.mark_dirty(node)  # pages a failed punch masked or copied up, too
        now = time.time_ns()
        if grows:
            u.size = end
        if punch or zero or grows:
            u.mtime_ns = now
        u.ctime_ns = now

    def _punch(self, node: Node, u: UpperInode, fd: int, off: int, end: int) -> None:
        """Make bytes ``[off, end)`` of ``node`` read as zeros (:meth:`fallocate`)."""
        if off >= end:
            return
        for page, limit in self._copy_up_pages(node, u, fd, off, end, holes=True):
            start = page * PAGE_SIZE
            fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, start, limit - start)
            self.pages(node).add(page)
            _add_new_page(node, page)
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, end - off)

    def _upper_ranges(self, node: Node, u: UpperInode, off: int, end: int
                      ) -> list[tuple[int, int]]:
        """The byte ranges within ``[off, end)`` of ``node`` its upper data file serves
        (pages of its page map, and from ``base_limit`` on), ascending."""
        pages, ranges, pos = self.pages(node), [], off
        while pos < end:
            page_end = min(end, (pos // PAGE_SIZE + 1) * PAGE_SIZE)
            if pos >= u.base_limit:
                piece, page_end = (pos, end), end
            elif pos // PAGE_SIZE in pages:
                piece = (pos, page_end)
            else:
                pos = min(page_end, u.base_limit)  # the base's bytes
                continue
            if ranges and ranges[-1][1] == piece[0]:
                ranges[-1] = (ranges[-1][0], piece[1])
            else:
                ranges.append(piece)
            pos = page_end
        return ranges

    def seek(self, node: Node, off: int, whence: int) -> int:
        """lseek(2) ``SEEK_DATA`` or ``SEEK_HOLE`` (``whence``) of file ``node`` from byte
        ``off``: the first byte at or after it that may hold data, or that is in a hole (the
        size, if none is).  Base pages are data or holes whole (64 KiB), the upper data file
        as its file system reports it (unwritten extents are holes).  ENXIO when ``off`` is
        at or past the size, or negative, or for SEEK_DATA when only a hole follows."""
        size = node.size
        if off < 0 or off >= size:
            raise fs_error(errno.ENXIO, f"offset {off} is not below the size, {size}")
        pos = off
        for start, stop in self._data_ranges(node, off, size):
            if whence == os.SEEK_DATA:
                return max(start, off)
            if start > pos:
                return pos
            pos = max(pos, stop)
        if whence == os.SEEK_DATA:
            raise fs_error(errno.ENXIO, f"no data after offset {off}")
        return min(pos, size)

    def _data_ranges(self, node: Node, off: int, size: int) -> Iterator[tuple[int, int]]:
        """Byte ranges of ``node`` below ``size`` that end after ``off`` and may hold data,
        ascending by start (they may touch or overlap)."""
        u, cid = node.upper, node.base_content
        base_limit = min(u.base_limit if u is not None else size, size)
        pages = self.pages(node) if u is not None else NO_PAGES
        base: Iterator[tuple[int, int]] = iter(())
        if cid and base_limit > off:
            base = ((p * PAGE_SIZE, min((p + 1) * PAGE_SIZE, base_limit))
                    for p, _ in self.store.content(cid).pages(page_count(base_limit),
                                                              off // PAGE_SIZE)
                    if p not in pages)
        upper: Iterator[tuple[int, int]] = iter(())
        if u is not None and u.size:
            fd = self.upper_fds.get(node)
            if fd is not None or os.path.exists(self.upper_path(node.view, node.ino)):
                upper = self._upper_data(node, u, self._upper_fd(node), off, size)
        return heapq.merge(base, upper)

    def _upper_data(self, node: Node, u: UpperInode, fd: int, off: int, size: int
                    ) -> Iterator[tuple[int, int]]:
        """The data extents of ``node``'s upper data file within ``[off, size)`` that it
        serves (:meth:`_upper_ranges`), ascending."""
        for a, b in data_extents(fd, off, size):
            if a >= u.base_limit:
                yield a, b
                continue
            yield from self._upper_ranges(node, u, a, b)

    def _bytes_change(self, node: Node, u: UpperInode) -> None:
        """``node``'s bytes are about to change: forget the content id a capture found them
        to hold, storing the record at once (a crash must never leave that id vouching for
        other bytes); after the first change since a capture this costs nothing."""
        if u.content is not None:
            u.content = None
            self.upper.save(node)

    def check_size(self, node: Node, size: int) -> None:
        """EFBIG when ``size`` (bytes) grows ``node`` past :attr:`max_file_size`."""
        if size > self.max_file_size and size > node.size:
            raise fs_error(errno.EFBIG, f"size {size}: a file holds at most "
                                        f"{self.max_file_size} bytes")

    def truncate(self, node: Node, size: int) -> None:
        """Set the file size (bytes); bytes past a shrink read as zeros if it grows again.
        Raises EFBIG past :attr:`max_file_size`."""
        self.check_size(node, size)
        u = self.upper.copy_up(node)
        self._bytes_change(node, u)
        ex = node.view
        if size < u.size:
            pages = self.pages(node)  # loaded while the base limit still says it may have any
            if size < u.base_limit:
                u.base_limit = size
            first_gone = -(-size // PAGE_SIZE)
            gone = {p for p in pages if p >= first_gone}
            if gone:
                pages -= gone
                if node.new_pages:  # else NO_PAGES, shared
                    node.new_pages -= gone
                with self.store.write() as txn:
                    for p in gone:
                        self.store.layers.delete_page(txn, ex.layer, node.ino, p)
            if size == 0:  # O_TRUNC: a new data file; the old one's blocks go off the loop
                self._unlink_upper(node)
            elif self.upper_fds.get(node) is not None or \
                    os.path.exists(self.upper_path(ex, node.ino)):
                fd = self._upper_fd(node)
                os.ftruncate(fd, size)
                self._allocated(node, fd)
        u.size = size
        u.mtime_ns = u.ctime_ns = time.time_ns()
        self.upper.mark_dirty(node)
