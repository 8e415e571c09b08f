"""Domain errors: one hierarchy of ``OSError`` subclasses, from the store to the client.

Every error carries the errno the FUSE adapter answers, the control file replies and the CLI
maps to an exit code.  Built as ``RametError(errno, message)``, like ``OSError``, which gives
the class of that errno, as ``OSError(ENOENT, ...)`` gives a FileNotFoundError
(``RametError(errno.ENOENT, m)`` is a :class:`NotFound`); a class takes the message alone
too (``NotFound("no execution 'x'")``).  ``str()`` is the
message alone, ``exc.errno`` the errno, ``exc.exit_code`` the CLI's exit code
(:data:`EXIT_CODES`).  Standard library only: the client raises these same classes
(``rametfs.RametError``), whether a daemon answered through a ``ctl`` file or fallback mode
ran the command in-process, so nothing translates one error into another.

Raised by the store, the overlay, the protocol and the commands; caught in one place per
boundary (``fuse.adapter`` turns them into ``FUSEError(e.errno)``, ``control.commands`` into
a JSON reply, the CLI into its message and exit code).
"""

from __future__ import annotations

import errno
from typing import ClassVar

# The CLI's exit code per errno (1 for any other; 2 is click's usage error).
EXIT_CODES = {
    errno.ENOENT: 3,
    errno.EINVAL: 4,
    errno.EBUSY: 5,
    errno.ENOSPC: 6,
    errno.ENOTCONN: 7,
    errno.EEXIST: 8,
    errno.EACCES: 9,
}


def exit_code(err: int | None) -> int:
    """The process exit code for a failed operation's errno (:data:`EXIT_CODES`, else 1)."""
    return EXIT_CODES.get(err or 0, 1)


class RametError(OSError):
    """Base class: ``RametError(errno, message)`` (an instance of the class of that errno,
    when it has one: :data:`CLASSES`), or ``Class(message)`` with the class's :attr:`code`
    (EIO for the base).  ``errno`` and ``strerror`` as an OSError's."""

    code: ClassVar[int] = errno.EIO  # the errno of one built from a message alone

    def __new__(cls, *args: object, **kwargs: object) -> RametError:
        if cls is RametError and len(args) == 2:
            cls = CLASSES.get(args[0], cls)  # type: ignore[arg-type]
        return super().__new__(cls)  # the arguments are __init__'s, a subclass's own too

    def __init__(self, *args: object) -> None:
        if len(args) == 1:
            args = (self.code, args[0])
        err, message = args
        super().__init__(err, message)
        self.args, self.errno, self.strerror = args, err, message  # (OSError.__new__ got none)

    def __str__(self) -> str:
        return self.strerror if self.strerror is not None else super().__str__()

    @property
    def exit_code(self) -> int:
        """The CLI's exit code of this error (:func:`exit_code` of its errno)."""
        return exit_code(self.errno)


class InvalidArgument(RametError):
    """Malformed input (EINVAL; exit code 4)."""

    code = errno.EINVAL


class NotFound(RametError):
    """Unknown snapshot, execution, path or name (ENOENT; exit code 3)."""

    code = errno.ENOENT


class Busy(RametError):
    """The object is in use (EBUSY; exit code 5)."""

    code = errno.EBUSY


class NoSpace(RametError):
    """The data directory's file system is full (ENOSPC; exit code 6)."""

    code = errno.ENOSPC


class Exists(RametError):
    """The name is taken (EEXIST; exit code 8)."""

    code = errno.EEXIST


class Denied(RametError):
    """Not allowed for this caller (EACCES; exit code 9)."""

    code = errno.EACCES


class IntegrityError(RametError):
    """Stored bytes do not match their BLAKE3 id, or a record does not parse (EIO)."""

    code = errno.EIO


class Cancelled(RametError):
    """A command cancelled before it was done: by a reset or release of its execution, or
    the daemon stopping (ECANCELED)."""

    code = errno.ECANCELED


class ReadOnly(RametError):
    """A write to an immutable snapshot (EROFS)."""

    code = errno.EROFS


# A command line that does not parse or validate (rametfs.protocol): EINVAL, the same class
# whether the daemon refused it (the client builds its error from the reply's errno) or
# fallback mode did in-process.
ProtocolError = InvalidArgument

# The class of each errno that has one: what ``RametError(errno, message)`` builds.
CLASSES: dict[int, type[RametError]] = {cls.code: cls for cls in (
    InvalidArgument, NotFound, Busy, NoSpace, Exists, Denied, Cancelled, ReadOnly)}


def fs_error(err: int, message: str = "") -> RametError:
    """A ``RametError`` for a plain POSIX errno (ENOTEMPTY, EEXIST, EACCES, ...)."""
    return RametError(err, message or errno.errorcode.get(err, str(err)))
