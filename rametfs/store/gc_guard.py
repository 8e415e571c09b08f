"""The guard between a store's writers and its garbage collector (rametfs.store.gc has the
design): epochs, pins and sweep batches.  No store imports: ``Store`` holds one."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from ..errors import Busy

Progress = Callable[[str, int, int], None]  # (phase, done, total; 0: unknown)


class GcGuard:
    """Writers and the gc of one store (``Store.gc_guard``), in one process.  Thread-safe.

    The protocol (module docstring): a writer pins an id (:meth:`pin`) before it looks it
    up or writes it; a sweep batch checks the pins inside its write transaction, so a writer
    inside a write transaction of its own (``put_tree``, ``put_content``) is serialised with
    it by LMDB, and a writer outside one waits in :meth:`pin` for an open batch to commit, so
    its lookup sees what the batch deleted.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._epoch = 0
        self._writers: dict[int, int] = {}  # writer token -> epoch it began in
        self._next = 0
        self._batch_open = False
        self.pins: set[bytes] | None = None  # while a gc runs: ids writers touched

    @property
    def running(self) -> bool:
        """Whether a gc runs (writers pin; the stat and blob caches are not trusted)."""
        return self.pins is not None

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around a writer (an import, a promote): a gc waits for it if it began first."""
        with self._cond:
            token, self._next = self._next, self._next + 1
            self._writers[token] = self._epoch
        try:
            yield
        finally:
            with self._cond:
                del self._writers[token]
                self._cond.notify_all()

    def pin(self, oid: bytes) -> None:
        """A writer is about to look up or write ``oid``: a running gc keeps it.  Outside a
        write transaction this may wait for one sweep batch to commit (milliseconds).  No
        lock when no gc runs: a writer that began before a gc is waited for by it."""
        if self.pins is None:
            return
        with self._cond:
            if self.pins is None:
                return
            self.pins.add(bytes(oid))
            while self._batch_open:
                self._cond.wait()

    @contextlib.contextmanager
    def collecting(self, progress: Progress | None = None) -> Iterator[set[bytes]]:
        """A gc's span: raises the epoch, waits for the writers that began before; yields
        the pins.  Busy (EBUSY) when a gc runs already."""
        with self._cond:
            if self.pins is not None:
                raise Busy("gc: a gc is running already")
            self._epoch += 1
            self.pins = pins = set()
            epoch = self._epoch
        try:
            with self._cond:
                while earlier := sum(e < epoch for e in self._writers.values()):
                    if progress:
                        progress("waiting for writers begun before gc", earlier, 0)
                    self._cond.wait(1.0)
            yield pins
        finally:
            with self._cond:
                self.pins = None

    def batch(self, open_: bool) -> None:
        """A sweep batch opens (inside its write transaction) or has committed."""
        with self._cond:
            self._batch_open = open_
            if not open_:
                self._cond.notify_all()
