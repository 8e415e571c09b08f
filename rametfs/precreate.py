"""Empty upper data files made ahead of need, so that a new file's first write renames one
into place instead of creating it.

Creating a file costs ext4 16-20 µs on a quiet file system but 150-500 µs for a while after
files were removed (measured on this project's machine; docs/benchmarks.md; the figures below
were measured by hand there too), and an execution
creates an upper data file at the first write of every new file it holds (untar, git
checkout, pip install), while a request waits.  A rename into place costs about 20 µs either
way.  Like a Lustre OST's precreated objects, the files are made in the background, in a worker
thread, and kept in ``<data>/upper/precreated/``; they are empty and named ``s<counter>``, and
a restart takes over what the last run left there.

The upper data files that go (an unlinked inode the kernel forgot, a layer dropped by reset or
release) are taken back rather than unlinked (:meth:`Precreated.take_back`): renamed into the
pool's directory at once (about 8 µs of CPU, where an unlink costs 12 µs and waits 60 µs more
on ext4), and truncated to 0 later (:meth:`Precreated.empty`), when new files need them or
:data:`HOLD_S` after the last came, which costs less than the creation it replaces (24 µs of
CPU against 7-80 µs).  A file is emptied and handed out only when the kernel proves that no
one holds it open (:func:`held_elsewhere`), so no descriptor left of the file's last owner can
read or write what its next owner puts there.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import logging
import math
import os
import re
import stat

import trio

from .faults import FAULTS

log = logging.getLogger(__name__)

DIRECTORY = "precreated"  # in the data directory's upper/, beside the layers' directories
TARGET = 512  # files kept ready
REFILL_BELOW = 384  # a refill starts when fewer are left
BATCH = 64  # files made per worker-thread job
MIN_FREE_INODES = 65536  # none are made (or taken back) on a file system with fewer free
TAKE_BACK_LIMIT = 16384  # files the pool holds at most with those taken back (an int each)
HELD_MAX_BYTES = 64 << 20  # disk the taken-back files not yet emptied may keep allocated
MIN_FREE_BYTES = 1 << 30  # none are taken back on a file system with less free
HOLD_S = 0.5  # they are emptied this long after the last came, if no creation needed them
_NAME = re.compile(r"s([1-9][0-9]*)", re.ASCII)


class Precreated:
    """A pool of empty files, all 0600, in ``<upper_root>/precreated`` (made 0700 if missing;
    ``upper_root`` is the data directory's ``upper``, so a rename reaches every layer's
    directory).

    :meth:`take` hands one out (its path); :attr:`wanted` is set when the pool runs below
    :data:`REFILL_BELOW`, and whoever drives it calls :meth:`make` in a worker thread and
    :meth:`add` with the result until :meth:`missing` is 0.  Files that go come in through
    :meth:`take_back` (a worker thread) and :meth:`hold`, wait in :attr:`held` with their
    bytes, and join the pool through :meth:`take_held`, :meth:`empty` (a worker thread) and
    :meth:`add`: :func:`keep_filled` does that before it makes any.
    """

    def __init__(self, upper_root: str):
        self.directory = directory = f"{upper_root}/{DIRECTORY}"
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.ready: collections.deque[int] = collections.deque()  # counters, oldest first
        names = []
        with os.scandir(directory) as entries:
            for entry in entries:
                n = self._ours(entry)
                if n is not None:
                    names.append(n)
                else:  # never handed out: it may be anything, linked from anywhere
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        self.ready.extend(sorted(names))
        # make and take_back draw from it in worker threads at once: one next() is atomic
        self._counter = itertools.count(max(names, default=0) + 1)
        # taken back, not yet emptied: (counter, bytes allocated), oldest first
        self.held: collections.deque[tuple[int, int]] = collections.deque()
        self.held_bytes = 0
        self.hold_until = 0.0  # trio time at which what is held is emptied anyway
        self.wanted = trio.Event()
        self.failing = False  # the last creation failed
        if self.missing():
            self.wanted.set()

    def _path(self, n: int) -> str:
        return f"{self.directory}/s{n}"

    @staticmethod
    def _ours(entry: os.DirEntry) -> int | None:
        """The counter of a file this pool made and never handed out (empty, 0600, one
        link, the daemon's own, named ``s<n>``), else None."""
        match = _NAME.fullmatch(entry.name)
        if match is None:
            return None
        st = entry.stat(follow_symlinks=False)
        if (st.st_mode, st.st_size, st.st_nlink, st.st_uid) != \
                (stat.S_IFREG | 0o600, 0, 1, os.geteuid()):
            return None
        return int(match[1])

    def take(self) -> str | None:
        """The path of an empty file to rename into place, or None when none is ready."""
        path = self._path(self.ready.popleft()) if self.ready else None
        if len(self.ready) < REFILL_BELOW:
            self.wanted.set()
        return path

    def missing(self) -> int:
        """How many files the pool lacks to reach :data:`TARGET`."""
        return max(0, TARGET - len(self.ready))

    def room(self) -> tuple[int, int]:
        """How many files, and of how many bytes, :meth:`take_back` may take now."""
        return (max(0, TAKE_BACK_LIMIT - len(self.ready) - len(self.held)),
                max(0, HELD_MAX_BYTES - self.held_bytes))

    def make(self, count: int) -> list[int]:
        """Create up to ``count`` empty files; returns their counters, fewer when creation
        fails (a full disk, no inode left), none when fewer than :data:`MIN_FREE_INODES`
        inodes are free.  Blocking: run it in a worker thread."""
        if os.statvfs(self.directory).f_favail < MIN_FREE_INODES:
            return []  # the inodes are better left to the files themselves
        made = []
        for _ in range(count):
            n = next(self._counter)
            try:
                os.close(os.open(self._path(n), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except OSError as exc:
                if not self.failing:  # once per streak: a full disk fails every refill
                    log.warning("precreating upper data files stopped: %s", exc)
                self.failing = True
                break
            made.append(n)
        else:
            if self.failing:
                log.info("precreating upper data files again")
            self.failing = False
        return made

    def take_back_directory(self, directory: str, room: tuple[int, int]
                            ) -> list[tuple[int, int]]:
        """:meth:`take_back` of every file in ``directory`` (a dropped layer's); what else
        it holds stays for the caller to remove.  Blocking."""
        try:
            with os.scandir(directory) as entries:
                files = [(e.path, e.stat(follow_symlinks=False).st_blocks * 512)
                         for e in entries if e.is_file(follow_symlinks=False)]
        except FileNotFoundError:
            return []  # nothing was written in that layer
        return self.take_back(files, room)

    def take_back(self, files: list[tuple[str, int]], room: tuple[int, int]
                  ) -> list[tuple[int, int]]:
        """Rename into the pool's directory the upper data files that go, ``(path, bytes
        allocated)`` each (the daemon's own, their descriptors closed), while ``room``
        (:meth:`room`, read on the thread that holds) lasts; unlink the others.  Returns
        ``(counter, bytes)`` of those renamed, for :meth:`hold`.  Blocking.

        From the rename on no one can open a file by name: :meth:`empty` then proves that
        no one holds it open before it truncates it.  A crash before that leaves a file that
        is not empty in the pool, which the next start unlinks (``_ours``)."""
        files_left, bytes_left = room
        if files_left:
            fs = os.statvfs(self.directory)
            if fs.f_favail < MIN_FREE_INODES or fs.f_bavail * fs.f_frsize < MIN_FREE_BYTES:
                files_left = 0  # inodes and blocks go back to the file system at once
        taken: list[tuple[int, int]] = []
        for path, nbytes in files:
            if len(taken) == files_left or nbytes > bytes_left:
                unlink_if_there(path)
                continue
            n = next(self._counter)
            try:
                os.rename(path, self._path(n))
            except FileNotFoundError:
                continue  # never written, or its layer already removed
            except OSError:  # ENOSPC for the pool's directory, say: unlink the rest
                files_left = len(taken)
                unlink_if_there(path)
                continue
            taken.append((n, nbytes))
            bytes_left -= nbytes
        return taken

    def hold(self, taken: list[tuple[int, int]]) -> None:
        """Keep what :meth:`take_back` took until a creation needs it or :data:`HOLD_S`
        passed without more (on the trio thread)."""
        if taken:
            self.held.extend(taken)
            self.held_bytes += sum(nbytes for _, nbytes in taken)
            self.hold_until = trio.current_time() + HOLD_S
            self.wanted.set()  # keep_filled waits until the new hold_until

    def take_held(self, count: int) -> list[int]:
        """Up to ``count`` held files, oldest first, for :meth:`empty`."""
        out = []
        while self.held and len(out) < count:
            n, nbytes = self.held.popleft()
            self.held_bytes -= nbytes
            out.append(n)
        return out

    def empty(self, counters: list[int]) -> list[int]:
        """Truncate to 0 the held files ``counters`` that are the daemon's own upper data
        files (regular, 0600, one link) and that no one else holds open; unlink the others
        (whoever holds one keeps an unlinked file no one else reaches).  Returns the
        counters emptied, for :meth:`add`.  Blocking."""
        emptied = []
        for n in counters:
            path = self._path(n)
            try:
                ok = self._emptied(path)
            except OSError:
                ok = False
            if ok:
                emptied.append(n)
            else:
                unlink_if_there(path)
        return emptied

    @staticmethod
    def _emptied(path: str) -> bool:
        """Truncate the held file ``path`` to 0 if :meth:`empty` may; whether it did."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if (st.st_mode, st.st_nlink, st.st_uid) != \
                    (stat.S_IFREG | 0o600, 1, os.geteuid()) or held_elsewhere(fd):
                return False
            os.ftruncate(fd, 0)
            return True
        finally:
            os.close(fd)

    def add(self, counters: list[int]) -> None:
        self.ready.extend(counters)

    def drain(self) -> int:
        """Remove :data:`TARGET` files of the pool, held ones first (they keep blocks), or
        all it has when fewer (the file system ran out of inodes or space while the pool held
        some; a bounded step of the caller's, though the pool may hold
        :data:`TAKE_BACK_LIMIT` files and :data:`HELD_MAX_BYTES`); returns how many went."""
        gone = 0
        for n in self.take_held(TARGET):
            gone += unlink_if_there(self._path(n))
        for _ in range(min(TARGET - gone, len(self.ready))):
            gone += unlink_if_there(self._path(self.ready.popleft()))
        return gone


def unlink_if_there(path: str) -> bool:
    """Unlink ``path``; whether it was there (FileNotFoundError is no error)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def held_elsewhere(fd: int) -> bool:
    """Whether any open file of the whole system but ``fd``'s own (``fd`` open read-write)
    refers to ``fd``'s inode: another descriptor of any process, a mapping, a file the kernel
    holds.  The kernel grants a write lease only when the inode's counts of files open for
    writing and for reading are the asker's own (fcntl(2), F_SETLEASE; Linux fs/locks.c,
    ``check_conflicting_open``), so the lease is taken and given up at once.  Files open
    ``O_PATH`` are not counted: the daemon opens no upper data file so.  Where leases fail
    (``fs.leases-enable`` 0, a file system without them, EACCES) the answer is True: held,
    never reused."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError:  # EAGAIN: open elsewhere
        return True
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return False


async def keep_filled(pool: Precreated) -> None:
    """Refill ``pool`` whenever it runs low, :data:`BATCH` files per worker-thread job,
    emptying held files before it makes any, and empty every held file once
    ``pool.hold_until`` passed; after a job that made fewer than asked (a full disk), wait for
    the next take below the mark."""
    while True:
        with trio.move_on_at(pool.hold_until if pool.held else math.inf):
            await pool.wanted.wait()
        pool.wanted = trio.Event()
        while pool.held and (pool.missing() or trio.current_time() >= pool.hold_until):
            FAULTS.check("task:precreate")
            pool.add(await trio.to_thread.run_sync(pool.empty, pool.take_held(BATCH)))
        while (count := min(pool.missing(), BATCH)) > 0:
            FAULTS.check("task:precreate")
            made = await trio.to_thread.run_sync(pool.make, count)
            pool.add(made)
            if len(made) < count:
                break
