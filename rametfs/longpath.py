"""Paths of any length on a real file system: the kernel's PATH_MAX bounds one call, not a tree.

A system call refuses a path of PATH_MAX (4,096 on Linux) bytes or more with ENAMETOOLONG,
but a process inside an execution builds a tree as deep as it likes with relative ``mkdir``
and ``chdir``, so the fallback mode's walks (which name paths from the execution's root) and
the input digests of rametfs.core.policy meet longer paths.  ``with short(path) as p`` gives a
name for the same file that any call takes: ``path`` itself when it is short enough (no cost;
shorter than :data:`SHORT`, so that ``p + b"/" + name``, an entry of ``os.scandir(p)``, is
too), else ``/proc/self/fd/<fd>/<last name>`` with ``fd`` its directory, opened in hops of
less than PATH_MAX bytes (proc(5): these links name a descriptor's file).  The last name is
resolved as the call resolves it (``follow_symlinks=False`` does not follow it); names before
it are followed as in the path itself.

Opening a deep directory costs a lookup per level (about 0.1 µs each), so a walk naming every
path from the root costs O(depth²).  Within ``with cached():`` a thread's ``short`` keeps the
directories it opened (the last :data:`CACHE`), opens a directory from its parent's
descriptor (one name), and takes a path of :data:`CACHED_FROM` bytes or more (some hundred
levels, where the kernel's lookups cost more than the link's) by descriptor too.  A cached
descriptor stays on the directory it opened, so the block must not rename or remove what it
walks: ``rametfs.fallback.sync`` caches after its removals, and its ``remove_tree`` lets go
of each directory (:func:`forget`) before removing it.

Linux: where ``/proc/self/fd`` is missing a long path is passed on as it is, and the call
fails with ENAMETOOLONG.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator

PATH_MAX = 4096  # bytes with the final NUL: Linux's limits.h
NAME_MAX = 255
SHORT = PATH_MAX - NAME_MAX - 1  # a name joined to a shorter path stays short (scandir's)
CACHE = 256  # directory descriptors a thread keeps within cached()
WINDOW = 128  # levels opened one by one on a miss (fewer than CACHE)
CACHED_FROM = 1024  # bytes: within cached(), a path this long goes by its directory's fd
_PROC_FD = os.path.isdir("/proc/self/fd")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class _Cache(threading.local):
    dirs: OrderedDict | None = None  # path -> descriptor, least recently used first
    active = 0  # short() blocks open in this thread: an evicted descriptor waits for 0
    evicted: list

    def __init__(self):
        self.evicted = []


_cache = _Cache()


@contextlib.contextmanager
def cached() -> Iterator[None]:
    """Let this thread's ``short`` keep directories open until the block ends (see the
    module docstring); nested blocks share the outermost one's."""
    if _cache.dirs is not None:
        yield
        return
    _cache.dirs = OrderedDict()
    try:
        yield
    finally:
        dirs, _cache.dirs = _cache.dirs, None
        for fd in [*dirs.values(), *_cache.evicted]:
            os.close(fd)
        _cache.evicted.clear()


def forget(path: bytes) -> None:
    """Close the descriptor this thread's cache holds for directory ``path``, if any (before
    removing the directory: closing the last descriptor of a removed directory is what frees
    it, and costs as much as the rmdir)."""
    fd = _cache.dirs.pop(path, None) if _cache.dirs is not None else None
    if fd is not None:
        if _cache.active:
            _cache.evicted.append(fd)
        else:
            os.close(fd)


def _cached_dir(dirs: OrderedDict, path: bytes) -> int:
    """The cached descriptor of directory ``path``.  On a miss, the directories from the
    nearest cached one above (at most :data:`WINDOW` levels up, else the one ``WINDOW``
    levels up is opened whole) down to ``path`` are opened one name at a time and cached, so
    a walk going back up a deep chain finds the next ones cached too."""
    fd = dirs.get(path)
    if fd is not None:
        dirs.move_to_end(path)
        return fd
    todo, up, base = [path], path, None
    for _ in range(WINDOW):
        up = up.rpartition(b"/")[0]
        if not up:
            break
        base = dirs.get(up)
        if base is not None:
            dirs.move_to_end(up)
            break
        todo.append(up)
    if base is None:
        top = todo.pop()
        base = _cache_put(dirs, top, open_dir(top))
    for p in reversed(todo):
        base = _cache_put(dirs, p, os.open(p.rpartition(b"/")[2], _DIR_FLAGS, dir_fd=base))
    return base


def _cache_put(dirs: OrderedDict, path: bytes, fd: int) -> int:
    dirs[path] = fd
    if len(dirs) > CACHE:  # a block still using it may be open: closed once none is
        _cache.evicted.append(dirs.popitem(last=False)[1])
    return fd


class short:
    """``with short(path) as p``: ``p`` names ``path`` (bytes) in fewer than PATH_MAX bytes
    while the block runs (see the module docstring).  Raises OSError when a directory on
    the way cannot be opened (ENOENT, ENOTDIR, EACCES ...)."""

    __slots__ = ("path", "fd", "counted")

    def __init__(self, path: bytes):
        self.path = path
        self.fd: int | None = None  # ours to close
        self.counted = False

    def __enter__(self) -> bytes:
        if len(self.path) < (SHORT if _cache.dirs is None else CACHED_FROM) or not _PROC_FD:
            return self.path
        parent, _, name = self.path.rpartition(b"/")
        if _cache.dirs is None:
            self.fd = fd = open_dir(parent)
        else:
            fd = _cached_dir(_cache.dirs, parent)
            _cache.active += 1
            self.counted = True
        return b"/proc/self/fd/%d/%s" % (fd, name)

    def __exit__(self, *exc_info: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.counted:
            self.counted = False
            _cache.active -= 1
            if not _cache.active:
                for fd in _cache.evicted:
                    os.close(fd)
                _cache.evicted.clear()


def open_dir(path: bytes) -> int:
    """A new descriptor (O_CLOEXEC) of the directory ``path`` of any length, opened in hops
    of less than PATH_MAX bytes.  Raises OSError as open(2); ENAMETOOLONG for a name longer
    than a hop."""
    fd = None  # the first hop is relative to the working directory, or absolute
    rest = path
    while True:
        if len(rest) < PATH_MAX:
            hop, rest = rest, b""
        else:
            cut = rest.rfind(b"/", 1, PATH_MAX - 1)
            if cut < 0:
                raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG),
                              os.fsdecode(path[:256]) + "...")
            hop, rest = rest[:cut], rest[cut + 1:]
        try:
            new = os.open(hop, _DIR_FLAGS, dir_fd=fd)
        finally:
            if fd is not None:
                os.close(fd)
        fd = new
        if not rest:
            return fd
