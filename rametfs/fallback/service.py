"""Fallback mode's command runner: each rametfs.protocol Command, by its type, run in this
process on a data directory's Fallback (rametfs.fallback.executions), as the daemon's
rametfs.control runs it on a mount; what the client's fallback backend calls.

The Command's values are checked already (rametfs.protocol), so nothing here parses text.
Errors are rametfs.errors classes; an OSError of the file system the commands work on is
raised as a RametError naming the file (:func:`file_errors`), the only conversion.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator

from .. import protocol
from ..core import retention
from ..errors import InvalidArgument, RametError
from ..store.gc_guard import Progress
from .executions import Fallback

# What fallback mode answers a command it does not have (no daemon: no remote, no faults);
# any other it does not have (cancel, diff, status: the client's) is EINVAL too.
NOT_HERE = {protocol.Publish: "publish: fallback mode has no remote (use rametfs publish "
                              "--data DIR)",
            protocol.Fault: "fault: fault injection needs a daemon (rametfs serve --faults)"}

_P = protocol
_RUNNERS: dict[type, Callable[[Fallback, protocol.Command], dict]] = {
    _P.Snapshot: lambda f, c: f.snapshot(c.path, c.label, c.message, c.on_change),
    _P.SnapshotGit: lambda f, c: f.snapshot_git(c.repo, c.rev, c.gitdir, c.label, c.message),
    _P.Create: lambda f, c: f.create(c.snapshot, c.name, c.policy, access=c.access),
    _P.Release: lambda f, c: f.release(c.execution),
    _P.Runtime: lambda f, c: f.runtime(c.execution, c.record()),
    _P.Name: lambda f, c: f.name(c.name, c.snapshot),
    _P.Unname: lambda f, c: f.unname(c.name),
    _P.Resolve: lambda f, c: f.resolve(c.snapshot),
    _P.Rm: lambda f, c: f.rm(c.snapshot, c.force),
    _P.Forget: lambda f, c: f.forget(retention.policy_of(c), c.dry_run),
    _P.Pool: lambda f, c: f.pools.open(c),
    _P.Acquire: lambda f, c: f.pools.acquire(c.pool, c.holder, c.ttl_ns, c.pid, c.host),
    _P.Renew: lambda f, c: f.pools.renew(c.execution, c.holder, c.ttl_ns),
    _P.Return: lambda f, c: f.pools.return_(c.execution, c.holder, c.verify),
    _P.Drop: lambda f, c: f.pools.drop(c.pool),
    _P.Promote: lambda f, c: _no_publish(c) or f.promote(c.execution, c.label, c.message,
                                                         c.policy),
    _P.Checkpoint: lambda f, c: f.checkpoint(c.execution, c.label, c.message, c.policy),
    _P.Reset: lambda f, c: f.reset(c.execution, c.to, c.base),
    _P.Preview: lambda f, c: {"ok": True, "preview": f.preview(c.execution, c.policy)},
    _P.Verify: lambda f, c: _verify(f, c),
}


def run(engine: Fallback, command: protocol.Command, progress: Progress | None = None
        ) -> dict:
    """Run ``command`` on ``engine``; its reply, as the daemon's.  ``progress`` is a gc's
    (rametfs.store.gc).  Raises the command's RametError; EINVAL for one fallback mode does
    not have (:data:`NOT_HERE`) or an execution command without its execution."""
    with file_errors():
        if isinstance(command, protocol.Gc):
            return engine.gc(command.dry_run, command.compact, progress)
        runner = _RUNNERS.get(type(command))
        if runner is None:
            raise InvalidArgument(NOT_HERE.get(type(command))
                                  or f"{command.NAME}: not a command of fallback mode")
        if isinstance(command, protocol.ExecutionCommand) and command.execution is None:
            raise InvalidArgument(f"{command.NAME}: fallback mode needs the execution's id")
        return runner(engine, command)


def _no_publish(command: protocol.Promote) -> None:
    if command.publish:
        raise InvalidArgument("promote: fallback mode has no remote to publish to "
                              "(docs/remote.md)")


def _verify(engine: Fallback, command: protocol.Verify) -> dict:
    """Verify the execution; a ready pool member that differs is quarantined
    (rametfs.fallback.pools), as the daemon's ``verify`` does."""
    verification = engine.verification(command.execution, command.mode)
    engine.pools.verified(command.execution, verification)
    return {"ok": True, "execution": command.execution,
            "state": engine.pools.member_json(command.execution)["state"],
            "verification": verification}


@contextlib.contextmanager
def file_errors() -> Iterator[None]:
    """An OSError of the file system fallback mode works on as a RametError naming the file
    (the commands' own errors are RametErrors already)."""
    try:
        yield
    except RametError:
        raise
    except OSError as exc:
        where = f"{os.fsdecode(exc.filename)}: " if exc.filename else ""
        raise RametError(exc.errno or errno.EIO, f"{where}{exc.strerror or exc}") from None
