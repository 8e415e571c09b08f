"""The hydration cache: base contents decompressed into ``<data>/cache/<content id>``.

A cached file holds the content's bytes with its holes left as holes (only the pages that hold
data are written: a 50 GB sparse file with 100 MB of data takes 100 MB), mode 0400, and
appears whole (written under a temporary name ``.<content id>.<pid>.<ns>``, then renamed).

With a limit (``max_bytes``, the daemon's ``--cache-max-bytes``), the bytes the cached files
take on disk (``st_blocks``) are kept under it by removing the least recently used contents
that nobody *holds*.  The daemon holds a content while it keeps a descriptor of it open
(``Hydrator.base_fds``, at most ``OPEN_FILES``): such a content is never removed, so its
readers never break and it is never hydrated twice; the cache can exceed its limit by what
the held contents take, until the daemon closes their descriptors.  Other readers open a
cached file by path: one that has it open keeps reading it (Linux frees an unlinked file at
its last close); when it is gone, copy-up reads the page from the chunks and deep
verification has nothing to check, and a fallback copy from a file the daemon removes at
that moment fails (ENOENT; fallback mode itself never removes cached files).

Recency is this process's order of use; at start (:meth:`HydrationCache.scan`), the files'
access times.  Only this process's removals are counted: a file another process hydrated is
counted once this one uses it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

CACHE_SHARE = 4  # by default the cache may take 1/CACHE_SHARE of its file system's size


def default_max_bytes(directory: str | os.PathLike) -> int:
    """The default limit: a quarter of the size of the file system holding ``directory``."""
    st = os.statvfs(directory)
    return st.f_blocks * st.f_frsize // CACHE_SHARE


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class HydrationCache:
    """The files of ``directory`` by content id; ``max_bytes`` None: no limit.

    Thread-safe: one lock guards the index and is never held while a file is written or
    removed, so the trio thread may call :meth:`get` and :meth:`release`.
    """

    def __init__(self, directory: Path, max_bytes: int | None = None):
        self.dir = str(directory)
        self.max_bytes = max_bytes
        self.bytes = 0  # on disk, of the files indexed
        self._files: OrderedDict[bytes, int] = OrderedDict()  # cid -> bytes, oldest use first
        self._holds: dict[bytes, int] = {}  # cid -> descriptors the daemon holds open
        self._lock = threading.Lock()

    def path(self, cid: bytes) -> str:
        """Where the hydrated copy of ``cid`` lives (it may not exist)."""
        return f"{self.dir}/{cid.hex()}"

    def temp_path(self, cid: bytes) -> str:
        """A fresh temporary name for hydrating ``cid`` in this process."""
        return f"{self.dir}/.{cid.hex()}.{os.getpid()}.{time.monotonic_ns()}"

    def scan(self) -> int:
        """Index the cached files (oldest access first) and remove the temporary files whose
        process is gone (or is this one: a pid of an earlier boot); returns the number
        removed.  Blocking: a stat per file."""
        found, removed = [], 0
        with os.scandir(self.dir) as it:
            for e in it:
                name = e.name
                try:
                    if name.startswith("."):
                        parts = name.split(".")  # "", content id, pid, ns
                        pid = int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else 0
                        if pid > 0 and (pid == os.getpid() or not _pid_alive(pid)):
                            os.unlink(e.path)
                            removed += 1
                    elif len(name) == 64:
                        st = e.stat(follow_symlinks=False)
                        found.append((max(st.st_atime_ns, st.st_mtime_ns),
                                      bytes.fromhex(name), st.st_blocks * 512))
                except (FileNotFoundError, ValueError):
                    continue  # gone meanwhile, or not one of ours
        found.sort()
        with self._lock:
            for _, cid, size in found:
                if cid not in self._files:
                    self._files[cid] = size
                    self.bytes += size
        return removed

    def get(self, cid: bytes, hold: bool) -> int | bool:
        """Whether ``cid`` is cached (indexing a file another process made); with ``hold``
        an open descriptor of it (or False), held until :meth:`release`."""
        path = self.path(cid)
        with self._lock:
            if cid not in self._files:
                try:
                    self._index(cid)
                except FileNotFoundError:
                    return False
            self._files.move_to_end(cid)
            if not hold:
                return True
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:  # removed behind our back
                self.bytes -= self._files.pop(cid)
                return False
            self._holds[cid] = self._holds.get(cid, 0) + 1
            return fd

    def added(self, cid: bytes, hold: bool) -> int | bool:
        """Index ``cid`` just hydrated, as :meth:`get`; then remove unheld contents, least
        recently used first, while the cache is over its limit.  Blocking (unlink)."""
        with self._lock:
            if cid in self._files:  # hydrated twice at once: the last rename won
                self.bytes -= self._files.pop(cid)
            self._index(cid)
        got = self.get(cid, hold)
        self.make_room(0, keep=cid)
        return got

    def _index(self, cid: bytes) -> None:
        size = os.stat(self.path(cid)).st_blocks * 512
        self._files[cid] = size
        self.bytes += size

    def release(self, cid: bytes) -> None:
        """The daemon closed a descriptor :meth:`get` gave it."""
        with self._lock:
            left = self._holds.pop(cid) - 1
            if left:
                self._holds[cid] = left

    def discard(self, cid: bytes, dry_run: bool = False) -> int | None:
        """Remove the cached file of ``cid``, a content gc deleted, unless it is held; the
        bytes it took on disk, None when there is none or it is held (or, ``dry_run``, what
        removing it would free).  Blocking (unlink)."""
        with self._lock:
            if cid in self._holds:
                return None
            try:
                size = os.stat(self.path(cid)).st_blocks * 512
            except FileNotFoundError:
                return None
            if not dry_run and cid in self._files:
                self.bytes -= self._files.pop(cid)
        if not dry_run:
            try:
                os.unlink(self.path(cid))
            except FileNotFoundError:
                return None
        return size

    def make_room(self, nbytes: int, keep: bytes | None = None) -> int:
        """Remove unheld contents but ``keep``, least recently used first, until ``nbytes``
        more fit under the limit (with no limit, nothing); returns the bytes freed.  Blocking."""
        if self.max_bytes is None:
            return 0
        return self._remove(self.max_bytes - nbytes, keep)

    def remove_unheld(self) -> int:
        """Remove every content nobody holds (the disk is full; with no limit, nothing);
        returns the bytes freed.  Blocking."""
        return 0 if self.max_bytes is None else self._remove(0, None)

    def _remove(self, target: int, keep: bytes | None) -> int:
        victims = []
        with self._lock:
            over = self.bytes - target
            for cid, size in self._files.items():
                if over <= 0:
                    break
                if cid != keep and cid not in self._holds:
                    victims.append((cid, size))
                    over -= size
            for cid, size in victims:
                del self._files[cid]
                self.bytes -= size
        for cid, _ in victims:  # outside the lock: freeing blocks takes time
            try:
                os.unlink(self.path(cid))
            except FileNotFoundError:
                pass
        return sum(size for _, size in victims)
