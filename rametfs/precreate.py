"""Empty upper data files made ahead of need, so that a new file's first write renames one
into place instead of creating it.

Creating a file costs ext4 16-20 µs on a quiet file system but 150-500 µs for a while after
files were removed (measured on this project's machine; docs/benchmarks.md), and an execution
creates an upper data file at the first write of every new file it holds (untar, git
checkout, pip install), while a request waits.  A rename into place costs about 20 µs either
way.  Like a Lustre OST's precreated objects, the files are made in the background, in a worker
thread, and kept in ``<data>/upper/precreated/``; they are empty and named ``s<counter>``, and
a restart takes over what the last run left there.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
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
MIN_FREE_INODES = 65536  # none are made on a file system with fewer inodes free
_NAME = re.compile(r"s([1-9][0-9]*)", re.ASCII)


class Precreated:
    """A pool of empty files, all 0600, in ``<upper_root>/precreated`` (made 0700 if missing;
    ``upper_root`` is the data directory's ``upper``, so a rename reaches every layer's
    directory).

    :meth:`take` hands one out (its path); :attr:`wanted` is set when the pool runs below
    :data:`REFILL_BELOW`, and whoever drives it calls :meth:`make` in a worker thread and
    :meth:`add` with the result until :meth:`missing` is 0.
    """

    def __init__(self, upper_root: str):
        self.directory = directory = f"{upper_root}/{DIRECTORY}"
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.paths: collections.deque[str] = collections.deque()
        names = []
        with os.scandir(directory) as entries:
            for entry in entries:
                n = self._ours(entry)
                if n is not None:
                    names.append(n)
                else:  # never handed out: it may be anything, linked from anywhere
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        self.paths.extend(self._path(n) for n in sorted(names))
        self._counter = itertools.count(max(names, default=0) + 1)
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
        path = self.paths.popleft() if self.paths else None
        if len(self.paths) < REFILL_BELOW:
            self.wanted.set()
        return path

    def missing(self) -> int:
        """How many files the pool lacks to reach :data:`TARGET`."""
        return max(0, TARGET - len(self.paths))

    def make(self, count: int) -> list[str]:
        """Create up to ``count`` empty files; returns their paths, fewer when creation fails
        (a full disk, no inode left), none when fewer than :data:`MIN_FREE_INODES` inodes
        are free.  Blocking: run it in a worker thread."""
        if os.statvfs(self.directory).f_favail < MIN_FREE_INODES:
            return []  # the inodes are better left to the files themselves
        made = []
        for _ in range(count):
            path = self._path(next(self._counter))
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            except OSError as exc:
                if not self.failing:  # once per streak: a full disk fails every refill
                    log.warning("precreating upper data files stopped: %s", exc)
                self.failing = True
                break
            made.append(path)
        else:
            if self.failing:
                log.info("precreating upper data files again")
            self.failing = False
        return made

    def add(self, paths: list[str]) -> None:
        self.paths.extend(paths)

    def drain(self) -> int:
        """Remove every file of the pool (the file system ran out of inodes or space while
        the pool held some); returns how many went."""
        gone = 0
        while self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.paths.popleft())
                gone += 1
        return gone


async def keep_filled(pool: Precreated) -> None:
    """Refill ``pool`` whenever it runs low, :data:`BATCH` files per worker-thread job; after
    a job that made fewer than asked (a full disk), wait for the next take below the mark."""
    while True:
        await pool.wanted.wait()
        pool.wanted = trio.Event()
        while (count := min(pool.missing(), BATCH)) > 0:
            FAULTS.check("task:precreate")
            made = await trio.to_thread.run_sync(pool.make, count)
            pool.add(made)
            if len(made) < count:
                break
