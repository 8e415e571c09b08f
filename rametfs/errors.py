"""Domain errors: each carries the errno the FUSE adapter answers and the CLI maps to an exit code.

Raised by the store, the overlay and the control commands; caught in exactly one place per
boundary (``fuse.adapter`` turns them into ``FUSEError(e.errno)``, ``control.commands`` into a JSON reply).
"""

from __future__ import annotations

import errno


class RametError(Exception):
    """Base class: ``errno`` (int) and a readable message (``str(exc)``)."""

    errno = errno.EIO

    def __init__(self, message: str, err: int | None = None):
        super().__init__(message)
        if err is not None:
            self.errno = err


class InvalidArgument(RametError):
    """Malformed input (EINVAL)."""

    errno = errno.EINVAL


class NotFound(RametError):
    """Unknown snapshot, execution, path or name (ENOENT)."""

    errno = errno.ENOENT


class Busy(RametError):
    """The object is in use (EBUSY)."""

    errno = errno.EBUSY


class NoSpace(RametError):
    """The data directory's file system is full (ENOSPC)."""

    errno = errno.ENOSPC


class IntegrityError(RametError):
    """Stored bytes do not match their BLAKE3 id, or a record does not parse (EIO)."""

    errno = errno.EIO


class Cancelled(RametError):
    """A command cancelled before it was done: by a reset or release of its execution, or
    the daemon stopping (ECANCELED)."""

    errno = errno.ECANCELED


class ReadOnly(RametError):
    """A write to an immutable snapshot (EROFS)."""

    errno = errno.EROFS


def fs_error(err: int, message: str = "") -> RametError:
    """A ``RametError`` for a plain POSIX errno (ENOTEMPTY, EEXIST, EACCES, ...)."""
    return RametError(message or errno.errorcode.get(err, str(err)), err)
