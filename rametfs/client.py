"""The Python wrapper for harnesses: snapshots, execution pools, promote and reset.

In FUSE mode (the default) it drives a mounted rametfs through its control files, knowing
only the control protocol (:mod:`rametfs.protocol`) and the standard library, so it works
from any process that can see the mount, without FUSE or the daemon's dependencies::

    ramet = Ramet("/mnt/ramet")                      # or Ramet() to use $RAMET_MOUNT
    base = ramet.snapshot("/src/project", label="clean")
    with ramet.execution_pool(base, concurrency=4) as pool:
        with pool.acquire() as ex:                   # ex.path: <mnt>/executions/<id>
            run_agent(cwd=ex.path)
            saved = ex.promote(label="attempt 1")    # the execution carries on from it
        # leaving acquire() resets the execution and hands it back to the pool
    # leaving the pool releases every execution

In fallback mode (``Ramet(data=DIR, mode="fallback")``, for hosts without FUSE) the same
calls run in this process on the data directory: executions are real directories
(``<data>/fallback/executions/<id>``) made by :mod:`rametfs.fallback`, which is imported only
then.  ``mode="auto"`` picks fallback when ``/dev/fuse`` is missing.

In FUSE mode every call is one synchronous command on a ``ctl`` file (or one read of a status
file); each opens its own file descriptor, so calls from several threads do not interfere.
Failures raise :class:`RametError` with the daemon's (or the file system's) errno and message.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rametfs import protocol

MOUNT_ENV = "RAMET_MOUNT"
_MAX_REPLY = 1 << 20


class RametError(OSError):
    """A failed rametfs operation: ``errno`` and ``strerror`` (the daemon's message).

    Built as ``RametError(errno, message)``; ``str()`` is the message alone.
    """

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class NotMountedError(RametError):
    """No live rametfs at the given mountpoint (errno ENOTCONN)."""

    def __init__(self, mountpoint: str | os.PathLike) -> None:
        super().__init__(errno.ENOTCONN, f"no rametfs mounted at {os.fspath(mountpoint)}")


class PoolTimeout(RametError, TimeoutError):
    """:meth:`ExecutionPool.acquire` found no free execution in time (errno EBUSY)."""


class Ramet:
    """A handle on one mounted rametfs.

    ``mountpoint`` defaults to ``$RAMET_MOUNT``.  Raises :class:`RametError` (EINVAL) when
    neither is given, :class:`NotMountedError` (ENOTCONN) when no rametfs answers there.
    """

    def __init__(self, mountpoint: str | os.PathLike | None = None) -> None:
        if mountpoint is None:
            mountpoint = os.environ.get(MOUNT_ENV)
            if not mountpoint:
                raise RametError(errno.EINVAL, f"no mountpoint given and ${MOUNT_ENV} is not set")
        self.mount = Path(os.path.abspath(mountpoint))
        if not os.path.exists(self._control(protocol.STATUS)):
            raise NotMountedError(self.mount)

    def __repr__(self) -> str:
        return f"Ramet({str(self.mount)!r})"

    def snapshot(self, source: str | os.PathLike, label: str | None = None,
                 message: str | None = None) -> str:
        """Import the directory tree at ``source`` as a new snapshot; return its id (64 hex).

        Errors: ENOENT source missing, EINVAL not a directory or it contains ``.ramet``,
        ENOSPC, EIO.
        """
        path = os.path.abspath(os.fspath(source))
        reply = self._root_command("snapshot", path, label=label, message=message)
        return reply["snapshot"]

    def create(self, snapshot: str, name: str | None = None) -> Execution:
        """Create a writable execution of ``snapshot`` (id or unique prefix).

        Errors: ENOENT unknown snapshot, EINVAL bad name, EEXIST name taken.
        """
        reply = self._root_command("create", snapshot, name=name)
        return Execution(self, reply["execution"])

    def release(self, execution: str | Execution) -> None:
        """Drop an execution and its changes.  Errors: ENOENT unknown execution."""
        execution_id = execution.id if isinstance(execution, Execution) else execution
        self._root_command("release", execution_id)

    def execution(self, execution_id: str) -> Execution:
        """A handle on an existing execution (not checked until first used)."""
        return Execution(self, execution_id)

    def execution_pool(self, snapshot: str, concurrency: int = 4) -> ExecutionPool:
        """Create ``concurrency`` executions of ``snapshot`` to hand out with ``acquire()``."""
        return ExecutionPool(self, snapshot, concurrency)

    def status(self) -> dict:
        """The daemon's status: ``{"pid", "data", "mount", "version", "snapshots",
        "executions", "last"}`` (see the project docs for each record)."""
        return json.loads(_read_text(self._control(protocol.STATUS), self.mount))

    def snapshots(self) -> list[dict]:
        """Every snapshot record: ``{"id", "label", "message", "parents", "created_ns",
        "source", "files", "bytes"}``."""
        return self.status()["snapshots"]

    def executions(self) -> list[dict]:
        """Every execution record: ``{"id", "base", "head", "created_ns", "upper_bytes",
        "state"}``."""
        return self.status()["executions"]

    def _control(self, name: str) -> Path:
        return self.mount / protocol.CONTROL_DIR / name

    def _root_command(self, command: str, *positional: str, **options: str | None) -> dict:
        line = protocol.format_command(command, *positional, **options)
        return _command(self._control(protocol.CTL), line, self.mount)


@dataclass(frozen=True)
class Execution:
    """One execution: a writable copy-on-write view at :attr:`path`.

    Its commands act on this execution only, through ``<path>/.ramet/``; an unknown or
    released execution raises :class:`RametError` (ENOENT).
    """

    ramet: Ramet
    id: str

    @property
    def path(self) -> Path:
        """``<mnt>/executions/<id>``: where the sandbox works."""
        return self.ramet.mount / protocol.EXECUTIONS_DIR / self.id

    def promote(self, label: str | None = None, message: str | None = None) -> str:
        """Save the current tree as a new snapshot and carry on from it; return its id."""
        return self._command("promote", label=label, message=message)["snapshot"]

    def checkpoint(self, label: str | None = None, message: str | None = None) -> str:
        """Save the current tree as a new snapshot without moving the base; return its id."""
        return self._command("checkpoint", label=label, message=message)["snapshot"]

    def reset(self) -> str:
        """Drop every change since the base; return the base snapshot id."""
        return self._command("reset")["snapshot"]

    def diff(self) -> list[tuple[str, str]]:
        """What changed against the base: sorted ``(status, path)`` pairs, status one of
        ``"A"``, ``"M"``, ``"D"``, path relative to :attr:`path`."""
        text = self._read(protocol.DIFF)
        return [tuple(line.split(" ", 1)) for line in text.splitlines() if line]

    def status(self) -> dict:
        """``{"execution", "base", "head", "state", "created_ns", "upper_bytes", "last"}``."""
        return json.loads(self._read(protocol.STATUS))

    def _control(self, name: str) -> Path:
        return self.path / protocol.CONTROL_DIR / name

    def _missing(self) -> str:
        return f"no execution {self.id!r} at {self.ramet.mount}"

    def _read(self, name: str) -> str:
        return _read_text(self._control(name), self.ramet.mount, self._missing())

    def _command(self, command: str, **options: str | None) -> dict:
        line = protocol.format_command(command, **options)
        return _command(self._control(protocol.CTL), line, self.ramet.mount, self._missing())


class ExecutionPool:
    """``concurrency`` executions of one snapshot, handed out one holder at a time.

    Creating the pool creates the executions (releasing those already made if one fails);
    :meth:`close`, or leaving the ``with`` block, releases them all, including any still
    acquired.  :meth:`acquire` may be called from several threads.
    """

    def __init__(self, ramet: Ramet, snapshot: str, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        self.ramet = ramet
        self.base = snapshot
        self._cond = threading.Condition()
        self._all: list[Execution] = []
        self._free: list[Execution] = []
        self._closed = False
        try:
            for _ in range(concurrency):
                self._all.append(ramet.create(snapshot))
        except BaseException:
            with contextlib.suppress(RametError):  # the create error is the one to see
                self.close()
            raise
        self._free = list(self._all)

    def __enter__(self) -> ExecutionPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextlib.contextmanager
    def acquire(self, timeout: float | None = None) -> Iterator[Execution]:
        """Hold a free execution for the ``with`` block; wait up to ``timeout`` seconds
        (``None``: forever) for one.  Leaving the block resets the execution and returns it.

        Raises :class:`PoolTimeout` (EBUSY) when none is free in time, :class:`RametError`
        (EINVAL) when the pool is closed.  If the reset fails, the execution is released and
        leaves the pool, and the reset's error is raised.
        """
        execution = self._take(timeout)
        try:
            yield execution
        finally:
            self._give_back(execution)

    def close(self) -> None:
        """Release every execution; raise the first release error after trying them all."""
        with self._cond:
            self._closed = True
            executions, self._all = self._all, []
            self._cond.notify_all()
        first_error = None
        for execution in executions:
            try:
                self.ramet.release(execution)
            except RametError as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def _take(self, timeout: float | None) -> Execution:
        with self._cond:
            ready = self._cond.wait_for(
                lambda: self._closed or self._free or not self._all, timeout)
            if self._closed:
                raise RametError(errno.EINVAL, "the execution pool is closed")
            if not ready:
                raise PoolTimeout(errno.EBUSY, f"no free execution after {timeout} s: "
                                  f"all {len(self._all)} are acquired")
            if not self._all:
                raise RametError(errno.EIO, "the execution pool has no executions left "
                                 "(their resets failed)")
            return self._free.pop()

    def _give_back(self, execution: Execution) -> None:
        with self._cond:
            if self._closed:
                return
        try:
            execution.reset()
        except RametError:
            with self._cond:
                self._all.remove(execution)
                self._cond.notify_all()
            with contextlib.suppress(RametError):
                self.ramet.release(execution)
            raise
        with self._cond:
            if not self._closed:
                self._free.append(execution)
                self._cond.notify()


def _error(exc: OSError, mount: Path, missing: str | None = None) -> RametError:
    """Turn an OSError on the mount into a RametError with a readable message."""
    if exc.errno == errno.ENOTCONN:
        return NotMountedError(mount)
    if exc.errno == errno.ENOENT and missing:
        return RametError(errno.ENOENT, missing)
    return RametError(exc.errno or errno.EIO, f"{exc.filename}: {exc.strerror}")


def _read_text(path: Path, mount: Path, missing: str | None = None) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise _error(exc, mount, missing) from None


def _command(ctl: Path, line: str, mount: Path, missing: str | None = None) -> dict:
    """Write one command line to ``ctl`` and return its JSON reply, read back from the same
    descriptor.  Raises :class:`RametError` with the reply's errno and message on failure."""
    try:
        fd = os.open(ctl, os.O_RDWR)
    except OSError as exc:
        raise _error(exc, mount, missing) from None
    try:
        data = line.encode()
        try:
            written = os.write(fd, data)
        except OSError as exc:
            failure = exc
        else:
            failure = None if written == len(data) else OSError(
                errno.EIO, f"short write of a command ({written} of {len(data)} bytes)")
        try:
            raw = os.pread(fd, _MAX_REPLY, 0)
        except OSError as exc:
            raise _error(exc, mount) from None
    finally:
        os.close(fd)
    reply = protocol.decode_reply(raw) if raw.strip() else {}
    if failure is None and reply.get("ok"):
        return reply
    code = reply.get("errno") or (failure.errno if failure else None) or errno.EIO
    message = reply.get("error") or (failure.strerror if failure else None) \
        or f"{line.strip()!r}: no reply from the daemon"
    raise RametError(code, message)
