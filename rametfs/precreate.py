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

import trio

log = logging.getLogger(__name__)

DIRECTORY = "precreated"  # in the data directory's upper/, beside the layers' directories
TARGET = 512  # files kept ready
REFILL_BELOW = 384  # a refill starts when fewer are left
BATCH = 64  # files made per worker-thread job


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
                if entry.is_file(follow_symlinks=False) and entry.stat().st_size == 0 \
                        and entry.name[:1] == "s" and entry.name[1:].isdigit():
                    names.append(int(entry.name[1:]))
                else:  # not one of ours: never handed out
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
        (a full disk, no inode left).  Blocking: run it in a worker thread."""
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


async def keep_filled(pool: Precreated) -> None:
    """Refill ``pool`` whenever it runs low, :data:`BATCH` files per worker-thread job; after
    a job that made fewer than asked (a full disk), wait for the next take below the mark."""
    while True:
        await pool.wanted.wait()
        pool.wanted = trio.Event()
        while (count := min(pool.missing(), BATCH)) > 0:
            made = await trio.to_thread.run_sync(pool.make, count)
            pool.add(made)
            if len(made) < count:
                break
