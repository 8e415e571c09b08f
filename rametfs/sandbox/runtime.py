"""The runtime interface every sandbox adapter implements, the process-group runner, and
:class:`Host`, the runtime that is no sandbox.

A runtime runs one command in one execution, with the execution at ``/workspace`` as its
working directory (:class:`Host`: the execution's own path), and returns a :class:`Result`.
On timeout the runtime kills everything the command started and waits until it is gone
before :meth:`Runtime.run` returns, so no writer survives into a promote or a reset that the
caller does next.  The sandbox adapters also record on the execution which sandbox runs it
(:meth:`rametfs.client.Execution.record_runtime`), so that a restore of a snapshot promoted
from it runs the snapshot's recipes there too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from rametfs.client import Execution, Ramet, RametError

WORKSPACE = "/workspace"  # where the execution appears inside every sandbox
NOBODY = 65534  # the default uid and gid of a sandboxed command


@dataclass(frozen=True)
class Result:
    """What one sandboxed command did.

    ``exit_code``: the sandbox's exit status as ``subprocess`` reports it; both adapters
    report a command killed by signal N as 128 + N (137 after a timeout's SIGKILL).  ``stdout`` and ``stderr``: the
    output, decoded as UTF-8 with undecodable bytes replaced.  ``timed_out``: the command ran
    past its timeout and was killed.  ``seconds``: wall time from start to the end of the
    last process.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        """The command exited 0 within its timeout."""
        return self.exit_code == 0 and not self.timed_out


class Runtime(Protocol):
    """A sandbox: ``run(execution, argv, timeout)`` runs ``argv`` inside it."""

    def run(self, execution: Execution, argv: Sequence[str],
            timeout: float | None = None) -> Result:
        """Run ``argv`` in ``execution`` (at ``/workspace``) for at most ``timeout`` seconds
        (None: no limit).  Raises :class:`rametfs.RametError` when the sandbox cannot be set
        up for this execution (not when the command fails: that is the result's exit code)."""


class Host:
    """No sandbox: ``argv`` runs as this process's user, in the execution's directory
    (``execution.path``), with this process's environment.  Only for commands the caller
    trusts: :meth:`rametfs.client.Ramet.restore` uses it only when asked
    (``runtime="host"``).  On timeout the command's process group is killed."""

    def run(self, execution: Execution, argv: Sequence[str],
            timeout: float | None = None) -> Result:
        """Run ``argv`` for at most ``timeout`` seconds (None: no limit); raises OSError
        when it cannot start (no such program)."""
        return run_group(argv, timeout, _kill_leader_group, cwd=execution.path)


def _kill_leader_group(process: subprocess.Popen) -> None:
    """SIGKILL the process group ``process`` leads (not yet reaped: its group id is its)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def run_group(argv: Sequence[str], timeout: float | None,
              stop: Callable[[subprocess.Popen], None], pass_fds: Sequence[int] = (),
              cwd: str | os.PathLike | None = None) -> Result:
    """Run ``argv`` as the leader of a new process group, stdin from /dev/null, in ``cwd``
    (None: this process's working directory).

    When ``timeout`` (seconds) passes, or this thread is interrupted, ``stop(process)`` is
    called to kill the sandbox and must return once its processes are gone (the adapter
    knows how: a PID namespace, a container); then the leftovers of the process group are
    killed too, the output read to its end and the group leader reaped.  The descriptors in
    ``pass_fds`` are handed to the process and closed here once it started.
    """
    start = time.perf_counter()
    try:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, start_new_session=True,
                                   pass_fds=tuple(pass_fds), cwd=cwd)
    finally:
        for fd in pass_fds:
            os.close(fd)
    timed_out = False
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException as exc:
        timed_out = isinstance(exc, subprocess.TimeoutExpired)
        stop(process)
        _kill_group(process)
        stdout, stderr = process.communicate()
        if not timed_out:
            raise
    return Result(process.returncode, stdout.decode(errors="replace"),
                  stderr.decode(errors="replace"), timed_out, time.perf_counter() - start)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process group that ``process`` leads, waiting for the leader's exit first
    without reaping it, so that the group id cannot have been reused by then."""
    try:
        os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # already reaped: its group id may belong to another by now
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group left with its leader
        pass


def require_allow_other(ramet: Ramet, uid: int) -> None:
    """Raise RametError (EACCES) when ``ramet`` is a FUSE mount served without
    ``allow_other`` and ``uid`` is not root: the kernel would keep that uid out of it."""
    if ramet.mount is None or uid == 0:
        return
    target = os.fspath(ramet.mount).translate({ord(c): f"\\{ord(c):03o}" for c in " \t\n\\"})
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == target and "allow_other" in fields[-1].split(","):
                return
    raise RametError(errno.EACCES, f"{ramet.mount} is not served with --allow-other: a "
                     f"sandbox running as uid {uid} could not enter its executions")
