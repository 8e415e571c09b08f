"""The control commands behind the ``.ramet/`` files, and what those files read.

A dispatch table per scope (root, execution) maps each Command type of rametfs.protocol
(parsed and checked there: the handlers take its values as they are) to a coroutine.  Every
command returns a JSON-ready reply dict; a failure raises RametError and its message is kept
for ``.ramet/error``.  Kernel cache invalidation is handed to the adapter
through the ``invalidate`` callback, so this module stays free of FUSE.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import trio

from .. import mounts, protocol
from ..authority import HARNESS, Access, Caller
from ..capture import CancelToken, capture, diff_in_slices, preview
from ..core import heads, lifecycle, policy, pools, retention, status
from ..errors import Busy, Cancelled, Denied, InvalidArgument, NotFound, RametError
from ..faults import FAULTS
from ..fallback import manifest
from ..overlay import Execution, Overlay, in_slices
from ..treewalk import Steps
from ..store import Snapshot, gc, import_git, import_tree
from ..store.catalog import Lease
from ..store.publish import publish
from ..verify import verify
from ..version import __version__

log = logging.getLogger(__name__)

# What reading .ramet/fsmonitor gives: git's fsmonitor hook, answered by the daemon.  Writing
# to the file it opens ("$0", a fresh inode per open) makes that inode's content the answer,
# which cat reads back through /proc/self/fd (the same inode; a path lookup gives a new one).
FSMONITOR_HOOK = b"""#!/bin/sh
# git fsmonitor hook (protocol 2), answered by rametfs from the execution's own change record:
#   git config core.fsmonitor .ramet/fsmonitor; git config core.untrackedCache true
# (from a work tree at the execution root; elsewhere, the hook's path from the work tree)
[ "$1" = 2 ] || { echo "rametfs fsmonitor: only hook protocol version 2" >&2; exit 1; }
root=$(cd "$(dirname "$0")/.." && pwd -P) && top=$(pwd -P) || exit 1
case $top in
    "$root") prefix= ;;
    "$root"/*) prefix=${top#"$root"/} ;;
    *) echo "rametfs fsmonitor: $top is not in the execution $root" >&2; exit 1 ;;
esac
exec 3<>"$0" && printf '%s\n%s' "$2" "$prefix" >&3 && exec cat /proc/self/fd/3
"""

# (dentries as (parent ino, name), or (ino, b"") for an inode; more inode numbers)
Invalidate = Callable[[list[tuple[int, bytes]], Sequence[int]], Awaitable[None]]
ENDS_COMMANDS = ("reset", "release", "return")  # cancel a command running on the execution
CAPTURES = ("promote", "checkpoint")  # a running one shows the state "promoting"
LOG_INTERVAL_S = 1.0  # a scope (an execution, the root) logs one failed command per interval
JSON_STEP = 4096  # pieces of JSON text made per step (json_steps)
PREVIEW_ITEM_BYTES = 96  # a preview path's JSON besides the path itself, at most
ROOT_SCOPE = ""  # the root ctl's scope of the log limits; an execution's is its id


@dataclass
class Running:
    """A command running on an execution, and what cancels it: its cancel scope (for the
    trio side) and token (for its worker threads); ``done`` is set once it has stopped."""

    command: str
    harness: bool  # run from the root scope (else from the execution's own ctl)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    token: CancelToken = field(default_factory=CancelToken)
    done: trio.Event = field(default_factory=trio.Event)


class Control:
    """Runs control commands against an Overlay; ``invalidate`` drops kernel caches of
    ``(parent ino, name)`` dentries and ``(ino, b"")`` inodes, and returns when done;
    ``open_less`` is what the root status reports of the FUSE adapter's mode.  The daemon
    sets ``snapshots_settled`` once it has tried the read-only bind of ``snapshots/``
    (rametfs.mounts), with ``snapshots_bind_failure`` saying why it failed, if it did."""

    def __init__(self, overlay: Overlay, mountpoint: str, invalidate: Invalidate, *,
                 open_less: bool = False, faults: bool = False,
                 max_answer_bytes: int = protocol.MAX_ANSWER_BYTES):
        self.overlay = overlay
        self.faults = faults
        self.max_answer_bytes = max_answer_bytes  # of one answer or reply (EFBIG)
        self.logs = LogLimit(LOG_INTERVAL_S)
        # The harness's status: the snapshots' JSON, made again only when a snapshot is
        # added (they are never changed or removed): (count, ids, text of each).
        self._snapshots: tuple[int, int, list[str], dict[str, str]] = (-1, 0, [], {})
        self._listing_changes = 0  # names set or deleted, snapshots removed
        self.mountpoint = mountpoint
        self.invalidate = invalidate
        self.open_less = open_less
        self.snapshots_settled = False
        self.snapshots_bind_failure: str | None = None
        self.snapshots_dir_ino: int | None = None  # the adapter's snapshots/, to invalidate
        self.adapter_memory: Callable[[], dict] = dict  # the adapter's kept tables, by size
        self.allocator: str | None = None  # the daemon's (rametfs.allocator.settle)
        self.gc_progress: dict | None = None  # a running gc's {phase, done, total}
        self.root_last: dict | None = None
        self.root_error = ""
        self.last: dict[str, dict] = {}
        self.errors: dict[str, str] = {}
        self.promoted: dict[str, str] = {}
        self.running: dict[str, Running] = {}  # execution id -> the command running on it
        self.pools = pools.Pools(overlay.store)
        self.pools.prune(overlay.executions.__contains__)
        # The lease task's: when it wakes next (wall-clock ns; 0 while awake), and what wakes
        # it sooner (:meth:`_lease_set`).
        self.leases_wake_ns = 0
        self.leases_changed = trio.Event()
        P = protocol
        self.root_handlers: dict[type, Callable[[Any], Awaitable[dict]]] = {
            P.Snapshot: self._snapshot, P.Create: self._create, P.Release: self._release,
            P.SnapshotGit: self._snapshot_git, P.Pool: self._pool, P.Acquire: self._acquire,
            P.Renew: self._renew, P.Return: self._return, P.Drop: self._drop,
            P.Fault: self._fault, P.Runtime: self._runtime, P.Cancel: self._cancel,
            P.Name: self._name, P.Unname: self._unname, P.Resolve: self._resolve,
            P.Publish: self._publish, P.Rm: self._rm, P.Gc: self._gc, P.Forget: self._forget,
            P.Diff: self._diff, P.Status: self._status}
        self.execution_handlers: dict[type, Callable[[Execution, Any], Awaitable[dict]]] = {
            P.Promote: self._promote, P.Checkpoint: self._checkpoint, P.Reset: self._reset,
            P.Preview: self._preview, P.Verify: self._verify}

    # -- running commands ----------------------------------------------------------------

    async def run_root(self, command: bytes) -> dict:
        """Run one root command (one write to ``ctl``); returns the reply, raises RametError
        (errno; E2BIG over :data:`protocol.MAX_COMMAND_BYTES`, checked first; EINVAL if not
        UTF-8)."""
        try:
            try:
                cmd = protocol.parse(self._text(command), protocol.ROOT)
                if isinstance(cmd, protocol.ExecutionCommand):
                    # The harness's command on one execution, whatever its --control.
                    reply = await self._on_execution(self.overlay.execution(cmd.execution),
                                                     cmd, harness=True)
                else:
                    reply = await self.root_handlers[type(cmd)](cmd)
            except Exception as exc:
                raise self._as_rametfs(exc, ROOT_SCOPE, command) from None
        except RametError as exc:
            self.root_error = self._failed(ROOT_SCOPE, exc, command)
            self.root_last = kept_reply(self._error_reply(exc))
            raise
        self.root_last = kept_reply(reply)
        return reply

    async def run_execution(self, ex: Execution, command: bytes) -> dict:
        """Run one command written to execution ``ex``'s own ``ctl``; returns the reply as the
        execution sees it (:func:`execution_reply`), raises RametError (as :meth:`run_root`)."""
        try:
            try:
                cmd = protocol.parse(self._text(command), protocol.EXECUTION)
                if getattr(cmd, "policy", None) is not None:
                    raise Denied(f"{cmd.NAME}: the policy is the harness's (create --policy, "
                                 f"or the root ctl); an execution cannot give its own")
                if getattr(cmd, "publish", False):
                    raise Denied("promote --publish: what goes to the remote is the "
                                 "harness's (the root ctl: promote <execution-id> "
                                 "--publish yes)")
                if getattr(cmd, "to", None) is not None:
                    raise Denied("reset --to: which snapshot an execution stands on is "
                                 "the harness's (the root ctl: reset <execution-id> --to "
                                 "SNAPSHOT); an execution resets to its head, or to its "
                                 "base with --base yes")
                reply = await self._on_execution(ex, cmd, harness=False)
            except Exception as exc:
                raise self._as_rametfs(exc, ex.id, command) from None
        except RametError as exc:
            self.errors[ex.id] = self._failed(ex.id, exc, command)
            self.last[ex.id] = kept_reply(self._error_reply(exc))
            raise
        return execution_reply(reply)

    async def _on_execution(self, ex: Execution, cmd: protocol.ExecutionCommand,
                            harness: bool) -> dict:
        """Run execution command ``cmd`` on ``ex``, from the root scope (``harness``) or its
        own, alone on it (:meth:`_alone`); the reply, whole, becomes the execution's
        ``last``.  An unexpected exception (a bug) marks ``ex`` failed (Overlay.fail)."""
        async with self._alone(ex, cmd.NAME, harness):
            try:
                reply = await self.execution_handlers[type(cmd)](ex, cmd)
            except RametError:
                raise
            except Exception as exc:
                self.overlay.fail(ex, f"internal error in {cmd.NAME}: {exc!r}")
                raise
        self.last[ex.id] = kept_reply(reply)
        return reply

    @contextlib.asynccontextmanager
    async def _alone(self, ex: Execution, command: str, harness: bool = True
                     ) -> AsyncIterator[Running]:
        """Run the block as ``command`` on ``ex`` from the root scope (``harness``) or the
        execution's own, the only command running on it.  While another runs, the harness
        comes first: its command cancels one the execution's own ``ctl`` runs, and the
        execution's never cancels the harness's (Busy, EBUSY); within one scope a ``reset``,
        ``release`` or ``return`` cancels the one running, anything else is Busy.  A cancel
        waits until the command has stopped (a capture's worker threads stop within a
        page).  A block that was cancelled raises Cancelled (ECANCELED) naming why."""
        while (other := self.running.get(ex.id)) is not None:
            if other.harness and not harness or \
                    other.harness == harness and command not in ENDS_COMMANDS:
                raise Busy(f"execution {ex.id!r} is running {other.command}")
            await self.cancel(ex.id, f"the {command} of execution {ex.id}"
                                     + ("" if harness == other.harness else " by the harness"))
        run = self.running[ex.id] = Running(command, harness)
        done = False
        try:
            with run.scope:
                yield run
                done = True
        except Cancelled:  # from a worker thread, which saw the token
            pass
        finally:
            del self.running[ex.id]
            run.done.set()
        if not done:
            raise Cancelled(f"{command} cancelled by {run.token.reason}")

    def _token(self, ex: Execution) -> CancelToken:
        """The token that cancels the command running on ``ex`` (its worker threads check
        it)."""
        return self.running[ex.id].token

    async def cancel(self, eid: str, reason: str) -> bool:
        """Cancel the command running on execution ``eid`` (``reason`` says by what) and
        wait until it has stopped; False when none runs."""
        run = self.running.get(eid)
        if run is None:
            return False
        run.token.cancel(reason)
        run.scope.cancel()
        await run.done.wait()
        return True

    async def cancel_all(self, reason: str) -> list[str]:
        """Cancel every running execution command (:meth:`cancel`); their execution ids."""
        cancelled = []
        for eid in list(self.running):
            if await self.cancel(eid, reason):
                cancelled.append(eid)
        return cancelled

    @staticmethod
    def _text(command: bytes) -> str:
        if len(command) > protocol.MAX_COMMAND_BYTES:
            raise RametError(errno.E2BIG,
                             f"a command is at most {protocol.MAX_COMMAND_BYTES} bytes")
        try:
            return command.decode()
        except UnicodeDecodeError:
            raise InvalidArgument("a command is UTF-8 text") from None

    def _as_rametfs(self, exc: Exception, scope: str, command: bytes) -> RametError:
        """``exc`` as the RametError a command fails with: itself when it is one; any
        other exception is a bug, logged with its traceback (at most one per ``scope`` and
        :data:`LOG_INTERVAL_S`, :class:`LogLimit`) and answered EIO."""
        if isinstance(exc, RametError):
            return exc
        if (skipped := self.logs.take("error", scope)) is not None:
            log.error("internal error in command %s%s",
                      protocol.shown(command.decode(errors="replace").strip()),
                      _skipped(skipped), exc_info=exc)
        return RametError(errno.EIO, f"internal error: {protocol.shown(repr(exc))}")

    @staticmethod
    def _error_reply(exc: Exception) -> dict:
        return {"ok": False, "errno": exc.errno, "error": str(exc)}

    def _failed(self, scope: str, exc: Exception, command: bytes | str) -> str:
        """The ``.ramet/error`` text of a failed command of ``scope``: the command as written
        and the error, each printable and cut (:func:`protocol.shown`), so no bytes an agent
        wrote reach a terminal raw and the file and the log line stay one short line; logged
        at INFO at most once per scope and :data:`LOG_INTERVAL_S`, with the number of those
        not logged since."""
        if isinstance(command, bytes):
            command = command.decode(errors="replace")
        message = (f"{protocol.shown(command.strip())}: "
                   f"{protocol.shown(str(exc), protocol.MAX_ERROR_CHARS)}")
        if (skipped := self.logs.take("failed", scope)) is not None:
            log.info("command failed (%s): %s%s",
                     f"execution {scope}" if scope != ROOT_SCOPE else "root ctl", message,
                     _skipped(skipped))
        return message + "\n"

    def refuse_read_only(self, ex: Execution, command: bytes) -> None:
        """Keep, for ``ex``'s ``.ramet/error`` and the ``last`` of its status, why a write
        to its ``ctl`` or ``promote`` that reached the daemon was refused: its control files
        are read-only (``--control read``).  ``command`` is what was written, or what was
        done (the truncation of ``echo cmd > ctl`` comes first).  (A writer the kernel
        refuses by the file's mode at the open never reaches the daemon: only root's
        writes come here.)"""
        exc = Denied("this execution's control files are read-only (--control read); "
                     "the harness acts on it through the root ctl")
        self.errors[ex.id] = self._failed(ex.id, exc, command)
        self.last[ex.id] = kept_reply(self._error_reply(exc))

    # -- root commands -------------------------------------------------------------------

    def _check_source(self, command: str, path: str) -> None:
        """InvalidArgument (EINVAL) for a source path that is relative (with the absolute
        form to give) or in this mount (an execution has promote and checkpoint).  Strings
        only: a stat of this mount from the trio thread would wait for itself."""
        if not os.path.isabs(path):
            raise InvalidArgument(f"{command}: path {path!r} is not absolute: the daemon has "
                                  f"no working directory of yours; give it from /, as in "
                                  f"{command} \"$PWD/{path}\" (the CLI and the wrapper do)")
        norm = os.path.normpath(path)
        if os.path.commonpath([norm, self.mountpoint]) != self.mountpoint:
            return
        parts = os.path.relpath(norm, self.mountpoint).split(os.sep)
        if parts[0] == protocol.EXECUTIONS_DIR and len(parts) > 1:
            raise InvalidArgument(f"{command}: {path} is in execution {parts[1]} of this mount: "
                                  f"promote {parts[1]} (its new head) or checkpoint "
                                  f"{parts[1]} (its base stays) snapshots it, storing only what "
                                  "changed")
        raise InvalidArgument(f"{command}: {path} is in this rametfs mount"
                              + (f", in snapshot {parts[1]}: that is a snapshot already"
                                 if parts[0] == protocol.SNAPSHOTS_DIR and len(parts) > 1
                                 else ""))

    async def _snapshot(self, cmd: protocol.Snapshot) -> dict:
        self._check_source("snapshot", cmd.path)
        snap = await trio.to_thread.run_sync(import_tree, self.overlay.store, cmd.path,
                                             cmd.label, cmd.message, cmd.on_change)
        return {"ok": True, "snapshot": snap.id, "stats": snap.stats}

    async def _snapshot_git(self, cmd: protocol.SnapshotGit) -> dict:
        self._check_source("snapshot-git", cmd.repo)
        snap = await trio.to_thread.run_sync(import_git, self.overlay.store, cmd.repo, cmd.rev,
                                             cmd.gitdir, cmd.label, cmd.message)
        return {"ok": True, "snapshot": snap.id, "stats": snap.stats}

    async def _create(self, cmd: protocol.Create) -> dict:
        snap = await self.overlay.resolve(cmd.snapshot)
        eid = secrets.token_hex(6) if cmd.name is None else cmd.name
        ex = self.overlay.create_execution(snap, eid, Access().given(cmd.access),
                                           policy.stored(cmd.policy, policy.CREATE))
        path = os.path.join(self.mountpoint, protocol.EXECUTIONS_DIR, ex.id)
        return {"ok": True, "execution": ex.id, "snapshot": snap.id, "path": path}

    async def _runtime(self, cmd: protocol.Runtime) -> dict:
        ex = self.overlay.execution(cmd.execution)
        runtime = cmd.record()
        if ex.runtime != runtime:  # the adapters send it before every command they run
            self.overlay.set_runtime(ex, runtime)
        return {"ok": True, "execution": ex.id, "runtime": runtime}

    async def _release(self, cmd: protocol.Release) -> dict:
        ex = self.overlay.execution(cmd.execution)
        async with self._alone(ex, "release"):
            self.pools.forget(ex.id, time.time_ns())
            await self.invalidate(*await self.overlay.release(ex))
        self._forget_replies(ex.id)
        return {"ok": True, "execution": ex.id}

    async def _cancel(self, cmd: protocol.Cancel) -> dict:
        eid = cmd.execution
        if eid is None:
            cancelled = await self.cancel_all("the harness (cancel)")
        else:
            self.overlay.execution(eid)  # ENOENT for an unknown one
            cancelled = [eid] if await self.cancel(eid, "the harness (cancel)") else []
        return {"ok": True, "cancelled": cancelled}

    async def _fault(self, cmd: protocol.Fault) -> dict:
        if not self.faults:
            raise InvalidArgument("fault: fault injection is off (rametfs serve --faults)")
        FAULTS.arm(cmd.site, cmd.execution, cmd.count)
        return {"ok": True, "site": cmd.site, "execution": cmd.execution, "count": cmd.count}

    # -- snapshot lifecycle (rametfs.core.lifecycle, docs/lifecycle.md) --------------------

    async def _name(self, cmd: protocol.Name) -> dict:
        snap = await self.overlay.resolve(cmd.snapshot)
        snap, previous = self.overlay.store.set_name(cmd.name, snap.id)
        self._listing_changes += 1
        return {"ok": True, "name": cmd.name, "snapshot": snap.id, "previous": previous}

    async def _unname(self, cmd: protocol.Unname) -> dict:
        sid = self.overlay.store.delete_name(cmd.name)
        self._listing_changes += 1
        return {"ok": True, "name": cmd.name, "snapshot": sid}

    async def _resolve(self, cmd: protocol.Resolve) -> dict:
        return {"ok": True, "snapshot": (await self.overlay.resolve(cmd.snapshot)).id}

    async def _rm(self, cmd: protocol.Rm) -> dict:
        # On the trio thread, one transaction: no create or promote comes in between.
        reply = lifecycle.remove_snapshots(self.overlay.store, [cmd.snapshot], cmd.force,
                                           self._execution_uses())
        await self._removed(reply["removed"])
        return reply

    async def _forget(self, cmd: protocol.Forget) -> dict:
        policy, dry_run = retention.policy_of(cmd), cmd.dry_run
        # On the trio thread, one transaction, as rm; a plan reads every snapshot record
        # (201 snapshots: 8 ms, the control round trip included: docs/benchmarks.md).
        reply = lifecycle.forget_snapshots(self.overlay.store, policy, dry_run,
                                           self._execution_uses())
        if not dry_run:
            await self._removed(reply["removed"])
        log.info("forget%s: kept %d, removed %d", " (dry run)" if dry_run else "",
                 len(reply["kept"]), len(reply["removed"]))
        return reply

    def _execution_uses(self) -> list[tuple[str, str, str, str]]:
        """``(id, base id, head id, lower id)`` of every execution: what rm and forget keep
        (lifecycle.uses)."""
        return [(ex.id, ex.base.id, ex.head.id, ex.lower.id)
                for ex in self.overlay.executions.values()]

    async def _removed(self, sids: list[str]) -> None:
        """Snapshots ``sids`` were forgotten: drop their views and the kernel's dentries of
        ``snapshots/<id>``, and make the status list again."""
        self._listing_changes += 1
        stale: list[tuple[int, bytes]] = []
        for sid in sids:
            view = self.overlay.snapshot_views.pop(sid, None)
            if view is not None:
                stale += [(view.root_ino, b"")]
            if self.snapshots_dir_ino is not None:
                stale.append((self.snapshots_dir_ino, sid.encode()))
        await self.invalidate(stale, ())

    async def _gc(self, cmd: protocol.Gc) -> dict:
        dry_run = cmd.dry_run
        if cmd.compact:
            raise Busy("gc --compact rewrites the metadata file, which this daemon has open: "
                       "stop it (rametfs umount), then run rametfs gc --compact --data DIR")
        store = self.overlay.store

        def progress(phase: str, done: int, total: int) -> None:  # in gc's worker thread
            self.gc_progress = {"phase": phase, "done": done, "total": total}

        try:
            # A worker thread: marking reads every reached record (rametfs.store.gc).
            report = await trio.to_thread.run_sync(
                gc.collect, store, functools.partial(manifest.gc_roots, store.root),
                dry_run, progress)
        finally:
            self.gc_progress = None
        log.info("gc%s: %s", " (dry run)" if dry_run else "", report.to_json())
        return {"ok": True, "gc": report.to_json()}

    # -- execution commands --------------------------------------------------------------

    async def _promote(self, ex: Execution, cmd: protocol.Promote) -> dict:
        snap = await capture(self.overlay, ex, cmd.label, cmd.message,
                             policy.choose(cmd.policy, ex.policy), self._token(ex),
                             charged=not self.running[ex.id].harness)
        self.overlay.set_head(ex, snap)
        self.promoted[ex.id] = snap.id
        await self._trim_pool(ex)
        reply = {"ok": True, "snapshot": snap.id, "stats": snap.stats}
        if cmd.publish:
            reply["published"] = await self._published(snap.id)
        return reply

    async def _publish(self, cmd: protocol.Publish) -> dict:
        snap = await self.overlay.resolve(cmd.snapshot)
        return {"ok": True, "snapshot": snap.id, "published": await self._published(snap.id)}

    async def _published(self, sid: str) -> dict:
        """Publish snapshot ``sid`` to the daemon's remote, in a worker thread; what it did
        (rametfs.store.publish.Published).  InvalidArgument (EINVAL) without a remote."""
        store = self.overlay.store
        if store.remote is None:
            raise InvalidArgument("this daemon serves no remote: mount it with --remote "
                                  "s3://BUCKET/PREFIX --catalog DSN (docs/remote.md)")
        done = await trio.to_thread.run_sync(publish, store, store.remote, sid)
        log.info("published %s to %s: %d packs, %d bytes, %.1f s%s", sid, store.remote.url,
                 done.packs, done.bytes, done.seconds, " (listed already)" * done.already)
        return done.to_json()

    async def _trim_pool(self, ex: Execution) -> None:
        """After a promote of ``ex``: its pool's ``--keep-last`` (lifecycle.trim_pool).  Not
        in the promote's reply: the other members' snapshots are not ``ex``'s to know."""
        trimmed = lifecycle.trim_pool(self.overlay.store, ex.id, self._execution_uses())
        if trimmed is not None and trimmed["removed"]:
            await self._removed(trimmed["removed"])
            log.info("pool of %s: --keep-last forgot %d promotes", ex.id,
                     len(trimmed["removed"]))

    async def _checkpoint(self, ex: Execution, cmd: protocol.Checkpoint) -> dict:
        snap = await capture(self.overlay, ex, cmd.label, cmd.message,
                             policy.choose(cmd.policy, None), self._token(ex),
                             charged=not self.running[ex.id].harness)
        return {"ok": True, "snapshot": snap.id, "stats": snap.stats}

    async def _reset(self, ex: Execution, cmd: protocol.Reset) -> dict:
        to = await self.overlay.resolve(heads.reset_target(cmd.to, cmd.base, ex.base.id,
                                                           ex.head.id))
        return {"ok": True, "snapshot": to.id, "reset_ms": await self._reset_layer(ex, to)}

    async def _reset_layer(self, ex: Execution, to: Snapshot) -> float:
        """Drop ``ex``'s changes and what the kernel caches of them, giving it a fresh layer
        over ``to``, its head from now on; milliseconds taken."""
        started = time.monotonic_ns()
        await self.invalidate(*await self.overlay.reset(ex, to))
        return round((time.monotonic_ns() - started) / 1e6, 3)

    def _forget_replies(self, eid: str) -> None:
        for table in (self.last, self.errors, self.promoted):
            table.pop(eid, None)
        self.logs.forget(eid)

    async def _preview(self, ex: Execution, cmd: protocol.Preview) -> dict:
        return {"ok": True, "preview": await self._bounded_preview(
            ex, policy.choose(cmd.policy, ex.policy))}

    async def _diff(self, cmd: protocol.Diff) -> dict:
        ex = self.overlay.execution(cmd.execution)
        return {"ok": True, "execution": ex.id, "diff": await self._bounded_diff(
            ex, lambda item: [item[0], os.fsdecode(item[1])])}

    async def _bounded_diff(self, ex: Execution, keep: Callable[[tuple[str, bytes]], object]
                            ) -> list:
        """``ex``'s diff, each item as ``keep`` keeps it; EFBIG as soon as its lines as
        ``.ramet/diff`` shows them take more than :attr:`max_answer_bytes` (so no more than
        that is made)."""
        out = Bounded(self.max_answer_bytes, lambda item: len(_diff_line(item)), keep,
                      f"the diff of execution {ex.id}")
        return await diff_in_slices(self.overlay, ex, out)

    async def _bounded_preview(self, ex: Execution, chosen: policy.Setting | None) -> dict:
        """``ex``'s preview under ``chosen``; EFBIG as soon as the paths it lists would take
        more than :attr:`max_answer_bytes` as JSON (each counted as its text and
        :data:`PREVIEW_ITEM_BYTES`)."""
        paths = Bounded(self.max_answer_bytes,
                        lambda item: len(json.dumps(item[0])) + PREVIEW_ITEM_BYTES,
                        lambda item: item, f"the preview of execution {ex.id}")
        return await preview(self.overlay, ex, chosen, paths)

    async def encoded(self, value: object, what: str, indent: int | None = None,
                      sort_keys: bool = False) -> bytes:
        """``value`` as JSON text and a newline (``json.dumps``' text with the same
        arguments), made in slices of the trio thread (:func:`json_steps`); EFBIG when it
        takes more than :attr:`max_answer_bytes` (``what`` names it in the message)."""
        text = await in_slices(json_steps(value, indent, sort_keys))
        data = (text + "\n").encode()
        if len(data) > self.max_answer_bytes:
            raise too_big(what, self.max_answer_bytes)
        return data

    async def _status(self, cmd: protocol.Status) -> dict:
        ex = self.overlay.execution(cmd.execution)
        return {"ok": True, "status": self.execution_json(ex)}

    # -- pools and leases (the rules: rametfs.core.pools) ----------------------------------

    async def _pool(self, cmd: protocol.Pool) -> dict:
        snap = await self.overlay.resolve(cmd.snapshot)
        opened = self.pools.open(cmd.name, snap.id, cmd.size, cmd.access,
                                 policy.stored(cmd.policy, policy.POOL), time.time_ns(),
                                 cmd.keep_last)
        try:
            await self._make_members(opened.new)
        except RametError:
            if opened.created:  # half made: no one could use it
                await self._drop(protocol.Drop(opened.pool))
            raise
        return self.pools.opened_reply(opened)

    async def _make_members(self, new: tuple[pools.NewMember, ...]) -> None:
        """Create the executions of ``new`` members and record them; one its pool no longer
        wants (dropped meanwhile) is released again."""
        for member in new:
            ex = self.overlay.create_execution(await self.overlay.resolve(member.base),
                                               member.execution, member.access, member.policy)
            if not self.pools.add_member(member, time.time_ns()):
                await self._release(protocol.Release(ex.id))

    async def _acquire(self, cmd: protocol.Acquire) -> dict:
        acquired = self.pools.acquire(cmd.pool, cmd.holder, cmd.pid, cmd.host, cmd.ttl_ns,
                                      time.time_ns())
        self._lease_set(acquired.member.lease.expires_ns)
        ex = self.overlay.execution(acquired.member.execution)
        if not self.overlay.pristine(ex):  # a process of an earlier holder wrote after return
            log.info("pool %s: execution %s changed while ready: reset before its lease",
                     acquired.member.pool, ex.id)
            await self._reset_layer(ex, ex.base)
        return self.pools.acquired_reply(
            acquired, os.path.join(self.mountpoint, protocol.EXECUTIONS_DIR, ex.id))

    async def _renew(self, cmd: protocol.Renew) -> dict:
        reply = self.pools.renew(cmd.execution, cmd.holder, cmd.ttl_ns, time.time_ns())
        self._lease_set(reply["lease"]["expires_ns"])
        return reply

    def _lease_set(self, expires_ns: int) -> None:
        """A lease taken or renewed ends at ``expires_ns``: wake the lease task if that is
        before it would wake.  (A wake reads every member record; renewals, which only move
        an end later, then cost it nothing.)"""
        if expires_ns < self.leases_wake_ns:
            self.leases_changed.set()

    async def _return(self, cmd: protocol.Return) -> dict:
        self.pools.held(cmd.execution, cmd.holder)  # before cancelling anything
        return await self.recycle(cmd.execution, cmd.holder, cmd.verify)

    async def _drop(self, cmd: protocol.Drop) -> dict:
        reply = self.pools.drop(cmd.pool)
        for eid in reply["executions"]:
            with contextlib.suppress(NotFound):  # released meanwhile
                await self._release(protocol.Release(eid))
        return reply

    async def recycle(self, eid: str, holder: str, mode: str,
                      ended: Lease | None = None) -> dict | None:
        """Reset ``holder``'s member ``eid``, verify it in ``mode``, and return it to its pool,
        or quarantine it when verification fails; a command running on it is cancelled
        first.  ``ended``: the lease task's, the ended lease to return, and nothing is done
        (None) when the member no longer has it (returned, released or leased again
        meanwhile).  Errors: those of ``Pools.held``; Cancelled (ECANCELED) when a reset,
        release or return of it cancels this."""
        ex = self.overlay.execution(eid)
        async with self._alone(ex, "return") as run:
            if ended is not None and self.pools.lease(eid) != ended:
                return None
            self.pools.held(eid, holder)
            reset_ms = await self._reset_layer(ex, ex.base)  # the pool's snapshot
            try:
                verification = await verify(self.overlay, ex, mode, run.token)
                result = await in_slices(verification.json_steps())
                reason = status.quarantine_reason(result)
            except OSError as exc:  # e.g. an upper data file unreadable
                if not pools.verification_failed(exc):
                    raise
                result, reason = None, status.failure_reason(mode, exc)
        self._forget_replies(ex.id)
        settled = self.pools.returned(eid, holder, reason, time.time_ns())
        if reason:
            log.warning("execution %s quarantined: %s", ex.id, reason)
        await self._make_members(settled.new)
        return pools.return_reply(settled, reset_ms, result)

    async def _verify(self, ex: Execution, cmd: protocol.Verify) -> dict:
        verification = await verify(self.overlay, ex, cmd.mode, self._token(ex))
        result = await in_slices(verification.json_steps())
        reason = status.quarantine_reason(result)
        settled = self.pools.verified(ex.id, reason)
        if settled is not None:
            log.warning("execution %s quarantined: %s", ex.id, reason)
            await self._make_members(settled.new)
        return {"ok": True, "execution": ex.id,
                "state": self.pools.member_json(ex.id)["state"], "verification": result}

    # -- what the files read -------------------------------------------------------------

    def execution_view(self, ex: Execution) -> dict:
        """What ``ex``'s own ``.ramet/status`` shows: who it is, where it stands, its own
        space, and its last reply as :func:`execution_reply` shows it; nothing of the harness
        (lease holder, pid, host, pool, mount path) or of the rest of the store."""
        running = self.running.get(ex.id)
        state = status.state(self.pools.member_json(ex.id)["state"], ex.failure is not None,
                             running is not None and running.command in CAPTURES)
        return status.execution_view(
            ex.id, ex.base.id, ex.head.id, state, ex.created_ns, ex.access,
            execution_reply(self.last.get(ex.id)), upper_bytes=ex.upper_bytes,
            upper_inodes=ex.upper_inodes, captured_bytes=ex.captured_bytes)

    def execution_json(self, ex: Execution) -> dict:
        """The root scope's record of ``ex``: its view, its pool fields, why it failed, how
        many of its requests wait on its freeze, its stored policy and recorded runtime, its
        whole last reply, its path and its access settings."""
        return status.execution_record(
            self.execution_view(ex), self.pools.member_json(ex.id), ex.access,
            mode=status.FUSE, path=os.path.join(self.mountpoint, protocol.EXECUTIONS_DIR, ex.id),
            policy_record=ex.policy, runtime=ex.runtime, last=self.last.get(ex.id),
            failure=ex.failure, waiting=ex.waiting)

    def memory_json(self) -> dict:
        """What the daemon holds (the harness's root status): ``heap_bytes``, its resident
        anonymous memory (RssAnon; None where /proc lacks it); ``allocator``, what it comes
        from ("jemalloc" or "pymalloc", rametfs.allocator); ``nodes``, the inodes of every
        view, and ``node_table_bytes``, their table's; ``stale_nodes`` of dropped layers not
        freed yet; the adapter's kept ``listings`` and their ``listing_entries``.  Once a
        reset or release is collected the counts are as before it (docs/benchmarks.md,
        "Daemon memory across reset cycles")."""
        heap = None
        with contextlib.suppress(OSError), open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    heap = int(line.split()[1]) * 1024
        return {"heap_bytes": heap, "allocator": self.allocator,
                "nodes": len(self.overlay.nodes),
                "node_table_bytes": sys.getsizeof(self.overlay.nodes),
                "stale_nodes": sum(map(len, self.overlay.stale_inos)), **self.adapter_memory()}

    def root_status(self, caller: Caller = HARNESS) -> bytes:
        """The root ``.ramet/status`` as ``caller`` may read it: whole for the harness; for
        another uid only the executions whose ``r`` bit it has (as their own ``status`` shows
        them, oldest first) and their base and head snapshots, without store-wide figures
        or sources.  Another uid's costs what it shows: its executions are found by the
        index of readers (authority.ReadIndex), its snapshots looked up by id; the harness's
        decodes the snapshots only when one was added (:meth:`_snapshots_json`)."""
        if caller.harness:
            return _json_object(status.root_status(
                mode=status.FUSE, pid=os.getpid(), data=str(self.overlay.store.root),
                mount=self.mountpoint, open_less=self.open_less,
                snapshots_bind=self._snapshots_bind(), snapshots=self._snapshots_json(),
                executions=[self.execution_json(ex) for ex in self.overlay.executions.values()],
                pools=self.pools.to_json(), last=self.root_last, gc=self.gc_progress,
                memory=self.memory_json()))
        visible = sorted((self.overlay.executions[eid]
                          for eid in self.overlay.readers.readable(caller)),
                         key=lambda ex: (ex.created_ns, ex.id))
        seen = {snap.id: snap for ex in visible for snap in (ex.base, ex.head)}
        return _json_object({
            "mode": status.FUSE, "mount": self.mountpoint, "version": __version__,
            "open_less": self.open_less, "snapshots_bind": self._snapshots_bind(),
            "snapshots": [_local_stats(s.to_json(), "source")
                          for s in sorted(seen.values(), key=lambda s: (s.created_ns, s.id))],
            "executions": [self.execution_view(ex) for ex in visible], "pools": []})

    def _snapshots_json(self) -> str:
        """The ``snapshots`` of the harness's status as JSON text (``json.dumps(...,
        indent=1)`` of Store.snapshots_json, oldest first), nested at the status's first
        level.  Made again when the store's count of snapshots changed (a snapshot added) or
        a name or rm changed the list (:attr:`_listing_changes`), each snapshot's text once
        while no name changes."""
        store = self.overlay.store
        count = store.snapshot_count()
        *cached, ids, texts = self._snapshots
        if (count, self._listing_changes) != tuple(cached):
            if cached[1] != self._listing_changes:
                texts = {}  # a name moved: the texts show names
            snaps = store.snapshots_json()
            texts = {s["id"]: texts.get(s["id"]) or _nested(json.dumps(s, indent=1), 2)
                     for s in snaps}
            ids = [s["id"] for s in snaps]
            self._snapshots = (count, self._listing_changes, ids, texts)
        return _RawJSON("[]" if not ids else
                        "[\n  " + ",\n  ".join(texts[i] for i in ids) + "\n ]")

    def _snapshots_bind(self) -> str:
        """"pending", "read-only", "failed: <why>", or "absent" (unmounted since)."""
        if not self.snapshots_settled:
            return "pending"
        if self.snapshots_bind_failure is not None:
            return f"failed: {self.snapshots_bind_failure}"
        return "read-only" if mounts.snapshots_bound(self.mountpoint) else "absent"

    def execution_status(self, ex: Execution) -> bytes:
        return (json.dumps(self.execution_view(ex), indent=1) + "\n").encode()

    async def diff_text(self, ex: Execution) -> bytes:
        """``.ramet/diff``: ``<letter> <path>`` lines, each path quoted as ``git status
        --porcelain`` quotes it (rametfs.protocol.quote_path); made in slices of the trio
        thread.  EFBIG past :attr:`max_answer_bytes`, its message kept in ``.ramet/error``."""
        try:
            return b"".join(await self._bounded_diff(ex, _diff_line))
        except RametError as exc:
            self.errors[ex.id] = self._failed(ex.id, exc, protocol.DIFF)
            raise

    async def preview_text(self, ex: Execution) -> bytes:
        """``.ramet/preview``: the preview under the policy the harness stored with the
        execution (none if it stored none), as JSON; the tree's ``ramet.toml`` only if that
        policy is ``tree``.  A malformed policy fails the lookup (EINVAL), a report past
        :attr:`max_answer_bytes` too (EFBIG), with its message in ``.ramet/error``."""
        try:
            report = await self._bounded_preview(ex, policy.Setting.from_record(ex.policy))
            return await self.encoded(report, f"the preview of execution {ex.id}", indent=1)
        except RametError as exc:
            self.errors[ex.id] = self._failed(ex.id, exc, protocol.PREVIEW)
            raise

    async def fsmonitor_answer(self, ex: Execution, request: bytes) -> bytes:
        """The answer to git's fsmonitor hook, protocol 2 (githooks(5), "fsmonitor-watchman").

        ``request`` is ``TOKEN\nPREFIX``: the token git kept from the last answer, and the
        work tree's path relative to the execution root (empty at the root).  The answer is
        ``NEW_TOKEN\0`` followed by each changed path under the work tree (relative to it, not
        in ``.git/``) and a NUL, or by ``/\0`` when everything may have changed: a token of
        another daemon run or layer, or none, or paths that would take the answer past
        :attr:`max_answer_bytes` (git then scans, which is always right).  Made in slices of
        the trio thread, the execution frozen (Overlay.changed_since_in_slices).
        """
        token, _, prefix = request.decode(errors="surrogateescape").partition("\n")
        new = self.overlay.fsmonitor_token(ex).encode()
        base = os.fsencode(prefix.strip("/"))
        under = base + b"/" if base else b""

        def shown(path: bytes) -> bytes | None:
            if not path.startswith(under):
                return None
            path = path[len(under):]
            return None if path == b".git" or path.startswith(b".git/") else path

        paths = await self.overlay.changed_since_in_slices(
            ex, token, shown, self.max_answer_bytes - len(new) - 1)
        return b"\0".join([new, *(paths if paths is not None else [b"/"])]) + b"\0"

    def promoted_text(self, ex: Execution) -> bytes:
        sid = self.promoted.get(ex.id) or (ex.head.id if ex.head.id != ex.base.id else "")
        return f"{sid}\n".encode() if sid else b""


def kept_reply(reply: dict | None) -> dict | None:
    """``reply`` as ``last`` keeps it: whole when its JSON takes at most
    :data:`protocol.LAST_REPLY_BYTES`, else its scalar fields (long strings as
    :func:`protocol.shown` shows them) and ``"omitted"``, the sorted names of the others;
    only as much of a large reply is looked at as that bound."""
    if reply is None or _json_fits(reply, protocol.LAST_REPLY_BYTES) and len(
            json.dumps(reply)) <= protocol.LAST_REPLY_BYTES:
        return reply
    kept: dict = {"omitted": sorted(k for k, v in reply.items() if isinstance(v, (dict, list)))}
    for key, value in reply.items():
        if isinstance(value, str):
            kept[key] = protocol.shown(value)
        elif not isinstance(value, (dict, list)):
            kept[key] = value
    return kept


def _json_fits(value: object, limit: int) -> bool:
    """False once the strings, keys and punctuation of ``value`` take more than ``limit``
    characters (a lower bound of its JSON's length): looks at no more than that."""
    size, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            size += 2 + 4 * len(v)
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            size += 2 + 2 * len(v)
            todo.extend(v)
        else:
            size += len(v) + 2 if isinstance(v, str) else 1
        if size > limit:
            return False
    return True


def _diff_line(item: tuple[str, bytes]) -> bytes:
    letter, path = item
    return f"{letter} {protocol.quote_path(path)}\n".encode()


def too_big(what: str, limit: int) -> RametError:
    """EFBIG for an answer over ``limit`` bytes, named by ``what``."""
    return RametError(errno.EFBIG,
                      f"{what} is more than {limit} bytes; it is not made (the limit of one "
                      f"answer: rametfs mount --max-answer-bytes)")


class Bounded(list):
    """A list that the walk of one answer fills (``append``, ``extend``), holding each item
    as ``keep`` keeps it, that raises EFBIG (:func:`too_big`, ``what``) as soon as the sizes
    ``size`` gives its items add up to more than ``max_bytes``: no answer is made past its
    limit."""

    def __init__(self, max_bytes: int, size: Callable[[object], int],
                 keep: Callable[[object], object], what: str):
        super().__init__()
        self.left, self.limit, self.size, self.keep, self.what = \
            max_bytes, max_bytes, size, keep, what

    def append(self, item: object) -> None:
        self.left -= self.size(item)
        if self.left < 0:
            raise too_big(self.what, self.limit)
        super().append(self.keep(item))

    def extend(self, items) -> None:
        for item in items:
            self.append(item)


def json_steps(value: object, indent: int | None = None, sort_keys: bool = False
               ) -> Steps[str]:
    """``json.dumps(value, indent=indent, sort_keys=sort_keys)`` as steps: its encoder's
    pieces (``JSONEncoder.iterencode``), joined and a step per :data:`JSON_STEP` of them,
    so a large reply delays other requests by a slice, not by its encoding."""
    done: list[str] = []
    pieces: list[str] = []
    for piece in json.JSONEncoder(indent=indent, sort_keys=sort_keys).iterencode(value):
        pieces.append(piece)
        if len(pieces) == JSON_STEP:
            done.append("".join(pieces))
            pieces.clear()
            yield
    done.append("".join(pieces))
    return "".join(done)


class _RawJSON(str):
    """JSON text already made, which :func:`_json_object` puts in as it is."""


def _nested(text: str, depth: int) -> str:
    """``json.dumps(..., indent=1)`` text as it reads ``depth`` levels down (JSON text has
    no newline but those of its indentation)."""
    return text.replace("\n", "\n" + " " * depth)


def _json_object(fields: dict) -> bytes:
    """``json.dumps(fields, indent=1)`` and a newline, as bytes, each :class:`_RawJSON`
    value put in as it is."""
    items = [f" {json.dumps(key)}: "
             f"{value if isinstance(value, _RawJSON) else _nested(json.dumps(value, indent=1), 1)}"
             for key, value in fields.items()]
    return ("{\n" + ",\n".join(items) + "\n}\n").encode()


class LogLimit:
    """At most one log line per scope, kind and ``interval_s`` (monotonic): :meth:`take`
    answers None to skip one, else the number skipped since the last."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        # scope -> kind -> (when it logged last, lines skipped since)
        self.scopes: dict[str, dict[str, tuple[float, int]]] = {}

    def take(self, kind: str, scope: str) -> int | None:
        now = time.monotonic()
        kinds = self.scopes.setdefault(scope, {})
        logged, skipped = kinds.get(kind, (-self.interval_s, 0))
        if now - logged < self.interval_s:
            kinds[kind] = (logged, skipped + 1)
            return None
        kinds[kind] = (now, 0)
        return skipped

    def forget(self, scope: str) -> None:
        """Forget a released execution's scope."""
        self.scopes.pop(scope, None)


def _skipped(count: int) -> str:
    return f" ({count} more not logged since the last)" if count else ""


def execution_reply(reply: dict | None) -> dict | None:
    """``reply`` as an execution's own files show it: its ``stats`` without the figures that
    depend on the rest of the store (:data:`protocol.STORE_WIDE_STATS`), so no reply reveals
    content the execution cannot read (a deduplicated chunk counts as not new)."""
    if not reply or "stats" not in reply:
        return reply
    return {**reply, "stats": _local_stats(reply["stats"])}


def _local_stats(stats: dict, *drop: str) -> dict:
    """``stats`` without :data:`protocol.STORE_WIDE_STATS` and the keys ``drop``."""
    return {k: v for k, v in stats.items() if k not in protocol.STORE_WIDE_STATS + drop}
