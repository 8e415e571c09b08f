"""Paths of any length on a real file system: the kernel's PATH_MAX bounds one call, not a tree.

A system call refuses a path of PATH_MAX (4,096 on Linux) bytes or more with ENAMETOOLONG,
but a process inside an execution builds a tree as deep as it likes with relative ``mkdir``
and ``chdir``, so the fallback mode's walks (which name paths from the execution's root) and
the input digests of rametfs.policy meet paths longer than that.  ``with short(path) as p``
gives a name for the same file that any call takes: ``path`` itself when it is short enough
(no cost; shorter than :data:`SHORT`, so that ``p + b"/" + name`` is too, as the entries of
``os.scandir(p)`` are), else ``/proc/self/fd/<fd>/<last name>`` with ``fd`` its directory, opened in hops
of less than PATH_MAX bytes (open(2) documents these links to a descriptor's file).  The last
name is resolved as the call resolves it (``follow_symlinks=False`` does not follow it);
names before it are followed as in the path itself.

Linux: where ``/proc/self/fd`` is missing a long path is passed on as it is, and the call
fails with ENAMETOOLONG.
"""

from __future__ import annotations

import errno
import os

PATH_MAX = 4096  # bytes with the final NUL: Linux's limits.h
NAME_MAX = 255
SHORT = PATH_MAX - NAME_MAX - 1  # a name joined to a shorter path stays short (scandir's)
_PROC_FD = os.path.isdir("/proc/self/fd")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class short:
    """``with short(path) as p``: ``p`` names ``path`` (bytes) in fewer than PATH_MAX bytes
    while the block runs (see the module docstring).  Raises OSError when a directory on
    the way cannot be opened (ENOENT, ENOTDIR, EACCES ...)."""

    __slots__ = ("path", "fd")

    def __init__(self, path: bytes):
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> bytes:
        if len(self.path) < SHORT or not _PROC_FD:
            return self.path
        parent, _, name = self.path.rpartition(b"/")
        self.fd = open_dir(parent)
        return b"/proc/self/fd/%d/%s" % (self.fd, name)

    def __exit__(self, *exc_info: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


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
