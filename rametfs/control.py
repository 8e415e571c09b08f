"""The control commands behind the ``.ramet/`` files, and what those files read.

A dispatch table per scope (root, execution) maps each command of rametfs.protocol to a
coroutine.  Every command returns a JSON-ready reply dict; a failure raises RametError and its
message is kept for ``.ramet/error``.  Kernel cache invalidation is handed to the adapter
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
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from . import mounts, policy, protocol
from .authority import HARNESS, Access, Caller, R
from .capture import CancelToken, capture, diff_in_slices, preview
from .core import pools
from .errors import Busy, Cancelled, InvalidArgument, NotFound, RametError
from .faults import FAULTS
from .overlay import Execution, Overlay
from .store import import_git, import_tree
from .store.catalog import Lease
from .verify import ROOT, verify

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

Invalidate = Callable[[list[tuple[int, bytes]]], Awaitable[None]]
ENDS_COMMANDS = ("reset", "release", "return")  # cancel a command running on the execution
CAPTURES = ("promote", "checkpoint")  # a running one shows the state "promoting"


@dataclass
class Running:
    """A command running on an execution, and what cancels it: its cancel scope (for the
    trio side) and token (for its worker threads); ``done`` is set once it has stopped."""

    command: str
    harness: bool  # run from the root scope (else from the execution's own ctl)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    token: CancelToken = field(default_factory=CancelToken)
    done: trio.Event = field(default_factory=trio.Event)


MAX_ECHO_CHARS = 200  # of a command written, shown in .ramet/error
MAX_ERROR_CHARS = 2000  # of an error message kept for .ramet/error


def shown(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` safe to show: each character that is not printable (control and format
    characters, U+FFFD of undecodable bytes) as its Python escape, cut at ``limit``
    characters."""
    def one(c: str) -> str:
        return c if c.isprintable() and c != "\ufffd" else \
            c.encode("unicode_escape").decode("ascii")

    out = "".join(map(one, text[:limit]))
    return out + (f"... ({len(text)} characters)" if len(text) > limit else "")


def _parse(text: str, table: dict) -> tuple[str, dict[str, str]]:
    """:func:`protocol.parse_command` of ``text`` for ``table`` (the root's or an
    execution's), whose error, for a command of the other scope, says where it belongs."""
    try:
        return protocol.parse_command(text, table)
    except protocol.ProtocolError as exc:
        words = text.split()
        name = words[0] if words else ""
        if table is protocol.EXECUTION_COMMANDS and name in (protocol.DIFF, protocol.STATUS):
            raise InvalidArgument(f"{name}: read this execution's .ramet/{name} "
                                  "instead") from None
        if table is protocol.EXECUTION_COMMANDS and name in protocol.ROOT_COMMANDS:
            raise InvalidArgument(
                f"{name}: a command of the root .ramet/ctl, at the top of the mount (the "
                f"harness's), not of an execution's; this one takes "
                f"{', '.join(sorted(protocol.EXECUTION_COMMANDS))}") from None
        if table is protocol.ROOT_COMMANDS and name in protocol.ROOT_EXECUTION_COMMANDS \
                and (len(words) == 1 or words[1].startswith("--")):
            raise InvalidArgument(f"{exc}: on the root ctl, {name} names its execution first "
                                  f"({name} <execution-id> ...); an execution's own "
                                  f".ramet/ctl takes {name} alone") from None
        raise


class Control:
    """Runs control commands against an Overlay; ``invalidate`` drops kernel caches of
    ``(parent ino, name)`` dentries and ``(ino, b"")`` inodes, and returns when done;
    ``open_less`` is what the root status reports of the FUSE adapter's mode.  The daemon
    sets ``snapshots_settled`` once it has tried the read-only bind of ``snapshots/``
    (rametfs.mounts), with ``snapshots_bind_failure`` saying why it failed, if it did."""

    def __init__(self, overlay: Overlay, mountpoint: str, invalidate: Invalidate, *,
                 open_less: bool = False, faults: bool = False):
        self.overlay = overlay
        self.faults = faults
        self.mountpoint = mountpoint
        self.invalidate = invalidate
        self.open_less = open_less
        self.snapshots_settled = False
        self.snapshots_bind_failure: str | None = None
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
        self.root_handlers: dict[str, Callable[[dict], Awaitable[dict]]] = {
            "snapshot": self._snapshot, "create": self._create, "release": self._release,
            "snapshot-git": self._snapshot_git, "pool": self._pool, "acquire": self._acquire,
            "renew": self._renew, "return": self._return, "drop": self._drop,
            "fault": self._fault, "runtime": self._runtime, "cancel": self._cancel}
        self.execution_handlers: dict[str, Callable[[Execution, dict], Awaitable[dict]]] = {
            "promote": self._promote, "checkpoint": self._checkpoint, "reset": self._reset,
            "preview": self._preview, "verify": self._verify}
        # The harness's commands on one execution, whatever its --control.
        self.root_handlers.update({name: functools.partial(self._root_on_execution, name)
                                   for name in self.execution_handlers})
        self.root_handlers.update({"diff": self._diff, "status": self._status})

    # -- running commands ----------------------------------------------------------------

    async def run_root(self, command: bytes) -> dict:
        """Run one root command (one write to ``ctl``); returns the reply, raises RametError
        (errno; E2BIG over :data:`protocol.MAX_COMMAND_BYTES`, EINVAL if not UTF-8)."""
        text = command.decode(errors="replace")
        try:
            try:
                name, args = _parse(self._text(command), protocol.ROOT_COMMANDS)
                reply = await self.root_handlers[name](args)
            except Exception as exc:
                raise self._as_rametfs(exc, text) from None
        except RametError as exc:
            self.root_error = self._failed(exc, text)
            self.root_last = self._error_reply(exc)
            raise
        self.root_last = reply
        return reply

    async def run_execution(self, ex: Execution, command: bytes) -> dict:
        """Run one command written to execution ``ex``'s own ``ctl``; returns the reply as the
        execution sees it (:func:`execution_reply`), raises RametError (as :meth:`run_root`)."""
        text = command.decode(errors="replace")
        try:
            try:
                name, args = _parse(self._text(command), protocol.EXECUTION_COMMANDS)
                if "policy" in args:
                    raise RametError(f"{name}: the policy is the harness's (create --policy, "
                                     f"or the root ctl); an execution cannot give its own",
                                     errno.EACCES)
                reply = await self._on_execution(ex, name, args, harness=False)
            except Exception as exc:
                raise self._as_rametfs(exc, text) from None
        except RametError as exc:
            self.errors[ex.id] = self._failed(exc, text)
            self.last[ex.id] = self._error_reply(exc)
            raise
        return execution_reply(reply)

    async def _on_execution(self, ex: Execution, name: str, args: dict, harness: bool
                            ) -> dict:
        """Run execution command ``name`` on ``ex``, from the root scope (``harness``) or its
        own, alone on it (:meth:`_alone`); the reply, whole, becomes the execution's
        ``last``.  An unexpected exception (a bug) marks ``ex`` failed (Overlay.fail)."""
        async with self._alone(ex, name, harness):
            try:
                reply = await self.execution_handlers[name](ex, args)
            except (RametError, protocol.ProtocolError):
                raise
            except Exception as exc:
                self.overlay.fail(ex, f"internal error in {name}: {exc!r}")
                raise
        self.last[ex.id] = reply
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

    async def _root_on_execution(self, name: str, args: dict) -> dict:
        """Root ``<name> <execution-id> ...``: the execution command on that execution."""
        ex = self.overlay.execution(args.pop("execution"))
        return await self._on_execution(ex, name, args, harness=True)

    @staticmethod
    def _text(command: bytes) -> str:
        if len(command) > protocol.MAX_COMMAND_BYTES:
            raise RametError(f"a command is at most {protocol.MAX_COMMAND_BYTES} bytes",
                             errno.E2BIG)
        try:
            return command.decode()
        except UnicodeDecodeError:
            raise InvalidArgument("a command is UTF-8 text") from None

    @staticmethod
    def _as_rametfs(exc: Exception, text: str) -> RametError:
        """``exc`` as the RametError a command fails with: a ProtocolError is EINVAL; any
        other exception is a bug, logged with its traceback and answered EIO."""
        if isinstance(exc, RametError):
            return exc
        if isinstance(exc, protocol.ProtocolError):
            return InvalidArgument(str(exc))
        log.error("internal error in command %r", text.strip(), exc_info=exc)
        return RametError(f"internal error: {exc!r}", errno.EIO)

    @staticmethod
    def _error_reply(exc: Exception) -> dict:
        return {"ok": False, "errno": exc.errno, "error": str(exc)}

    @staticmethod
    def _failed(exc: Exception, text: str) -> str:
        """The ``.ramet/error`` text of a failed command: the command as written and the
        error, each printable (:func:`shown`), so no bytes an agent wrote reach a
        terminal raw."""
        message = f"{shown(text.strip())}: {shown(str(exc), MAX_ERROR_CHARS)}"
        log.info("command failed: %s", message)
        return message + "\n"

    def refuse_read_only(self, ex: Execution, command: bytes) -> None:
        """Keep, for ``ex``'s ``.ramet/error`` and the ``last`` of its status, why a write
        to its ``ctl`` or ``promote`` that reached the daemon was refused: its control files
        are read-only (``--control read``).  ``command`` is what was written, or what was
        done (the truncation of ``echo cmd > ctl`` comes first).  (A writer the kernel
        refuses by the file's mode at the open never reaches the daemon: only root's
        writes come here.)"""
        exc = RametError("this execution's control files are read-only (--control read); "
                         "the harness acts on it through the root ctl", errno.EACCES)
        self.errors[ex.id] = self._failed(exc, command.decode(errors="replace"))
        self.last[ex.id] = self._error_reply(exc)

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

    async def _snapshot(self, args: dict) -> dict:
        path = args["path"]
        self._check_source("snapshot", path)
        snap = await trio.to_thread.run_sync(import_tree, self.overlay.store, path,
                                             args.get("label", ""), args.get("message", ""),
                                             args.get("on-change", protocol.ON_CHANGE[0]))
        return {"ok": True, "snapshot": snap.id, "stats": snap.stats}

    async def _snapshot_git(self, args: dict) -> dict:
        repo = args["repo"]
        self._check_source("snapshot-git", repo)
        with_git_dir = protocol.yes_no("snapshot-git", "gitdir", args.get("gitdir"))
        snap = await trio.to_thread.run_sync(
            import_git, self.overlay.store, repo, args.get("rev", "HEAD"), with_git_dir,
            args.get("label", ""), args.get("message", ""))
        return {"ok": True, "snapshot": snap.id, "stats": snap.stats}

    async def _create(self, args: dict) -> dict:
        snap = self.overlay.store.snapshot(args["snapshot"])
        eid = args["name"] if "name" in args else secrets.token_hex(6)  # "": EINVAL below
        if not protocol.EXECUTION_NAME_RE.fullmatch(eid):
            raise InvalidArgument(f"create: execution name {eid!r} must match "
                                  f"{protocol.EXECUTION_NAME_RE.pattern}")
        ex = self.overlay.create_execution(snap, eid, Access().given(args),
                                           policy.stored(args.get("policy"), policy.CREATE))
        path = os.path.join(self.mountpoint, protocol.EXECUTIONS_DIR, ex.id)
        return {"ok": True, "execution": ex.id, "snapshot": snap.id, "path": path}

    async def _runtime(self, args: dict) -> dict:
        ex = self.overlay.execution(args["execution"])
        runtime = protocol.parse_runtime(args)
        if ex.runtime != runtime:  # the adapters send it before every command they run
            self.overlay.set_runtime(ex, runtime)
        return {"ok": True, "execution": ex.id, "runtime": runtime}

    async def _release(self, args: dict) -> dict:
        ex = self.overlay.execution(args["execution"])
        async with self._alone(ex, "release"):
            self.pools.forget(ex.id, time.time_ns())
            await self.invalidate(self.overlay.release(ex))
        self._forget_replies(ex.id)
        return {"ok": True, "execution": ex.id}

    async def _cancel(self, args: dict) -> dict:
        eid = args.get("execution")
        if eid is None:
            cancelled = await self.cancel_all("the harness (cancel)")
        else:
            self.overlay.execution(eid)  # ENOENT for an unknown one
            cancelled = [eid] if await self.cancel(eid, "the harness (cancel)") else []
        return {"ok": True, "cancelled": cancelled}

    async def _fault(self, args: dict) -> dict:
        if not self.faults:
            raise InvalidArgument("fault: fault injection is off (rametfs serve --faults)")
        count = protocol.parse_count(args.get("count", "1"), "--count", minimum=0)
        FAULTS.arm(args["site"], args.get("execution"), count)
        return {"ok": True, "site": args["site"], "execution": args.get("execution"),
                "count": count}

    # -- execution commands --------------------------------------------------------------

    async def _promote(self, ex: Execution, args: dict) -> dict:
        snap = await capture(self.overlay, ex, args.get("label", ""), args.get("message", ""),
                             policy.choose(args.get("policy"), ex.policy), self._token(ex),
                             charged=not self.running[ex.id].harness)
        self.overlay.set_head(ex, snap.id)
        self.promoted[ex.id] = snap.id
        return {"ok": True, "snapshot": snap.id, "stats": snap.stats}

    async def _checkpoint(self, ex: Execution, args: dict) -> dict:
        snap = await capture(self.overlay, ex, args.get("label", ""), args.get("message", ""),
                             policy.choose(args.get("policy"), None), self._token(ex),
                             charged=not self.running[ex.id].harness)
        return {"ok": True, "snapshot": snap.id, "stats": snap.stats}

    async def _reset(self, ex: Execution, args: dict) -> dict:
        return {"ok": True, "snapshot": ex.base.id, "reset_ms": await self._reset_layer(ex)}

    async def _reset_layer(self, ex: Execution) -> float:
        """Drop ``ex``'s changes and what the kernel caches of them; milliseconds taken."""
        started = time.monotonic_ns()
        await self.invalidate(self.overlay.reset(ex))
        return round((time.monotonic_ns() - started) / 1e6, 3)

    def _forget_replies(self, eid: str) -> None:
        for table in (self.last, self.errors, self.promoted):
            table.pop(eid, None)

    async def _preview(self, ex: Execution, args: dict) -> dict:
        return {"ok": True, "preview": await preview(
            self.overlay, ex, policy.choose(args.get("policy"), ex.policy))}

    async def _diff(self, args: dict) -> dict:
        ex = self.overlay.execution(args["execution"])
        return {"ok": True, "execution": ex.id,
                "diff": [[letter, os.fsdecode(path)]
                         for letter, path in await diff_in_slices(self.overlay, ex)]}

    async def _status(self, args: dict) -> dict:
        ex = self.overlay.execution(args["execution"])
        return {"ok": True, "status": self.execution_json(ex)}

    # -- pools and leases (the rules: rametfs.core.pools) ----------------------------------

    async def _pool(self, args: dict) -> dict:
        snap = self.overlay.store.snapshot(args["snapshot"])
        size = protocol.parse_count(args["size"], "--size")
        opened = self.pools.open(args.get("name"), snap.id, size, args,
                                 policy.stored(args.get("policy"), policy.POOL), time.time_ns())
        try:
            await self._make_members(opened.new)
        except RametError:
            if opened.created:  # half made: no one could use it
                await self._drop({"pool": opened.pool})
            raise
        return self.pools.opened_reply(opened)

    async def _make_members(self, new: tuple[pools.NewMember, ...]) -> None:
        """Create the executions of ``new`` members and record them; one its pool no longer
        wants (dropped meanwhile) is released again."""
        for member in new:
            ex = self.overlay.create_execution(self.overlay.store.snapshot(member.base),
                                               member.execution, member.access, member.policy)
            if not self.pools.add_member(member, time.time_ns()):
                await self._release({"execution": ex.id})

    async def _acquire(self, args: dict) -> dict:
        acquired = self.pools.acquire(
            args["pool"], args["holder"],
            protocol.parse_count(args.get("pid", "0"), "--pid", minimum=0),
            args.get("host", ""), protocol.parse_seconds_ns(args["ttl"], "--ttl"),
            time.time_ns())
        self._lease_set(acquired.member.lease.expires_ns)
        ex = self.overlay.execution(acquired.member.execution)
        if not self.overlay.pristine(ex):  # a process of an earlier holder wrote after return
            log.info("pool %s: execution %s changed while ready: reset before its lease",
                     acquired.member.pool, ex.id)
            await self._reset_layer(ex)
        return self.pools.acquired_reply(
            acquired, os.path.join(self.mountpoint, protocol.EXECUTIONS_DIR, ex.id))

    async def _renew(self, args: dict) -> dict:
        reply = self.pools.renew(args["execution"], args["holder"],
                                 protocol.parse_seconds_ns(args["ttl"], "--ttl"), time.time_ns())
        self._lease_set(reply["lease"]["expires_ns"])
        return reply

    def _lease_set(self, expires_ns: int) -> None:
        """A lease taken or renewed ends at ``expires_ns``: wake the lease task if that is
        before it would wake.  (A wake reads every member record; renewals, which only move
        an end later, then cost it nothing.)"""
        if expires_ns < self.leases_wake_ns:
            self.leases_changed.set()

    async def _return(self, args: dict) -> dict:
        mode = protocol.parse_verify_mode(args.get("verify", ROOT))
        self.pools.held(args["execution"], args["holder"])  # before cancelling anything
        return await self.recycle(args["execution"], args["holder"], mode)

    async def _drop(self, args: dict) -> dict:
        reply = self.pools.drop(args["pool"])
        for eid in reply["executions"]:
            with contextlib.suppress(NotFound):  # released meanwhile
                await self._release({"execution": eid})
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
            reset_ms = await self._reset_layer(ex)
            try:
                result = (await verify(self.overlay, ex, mode, run.token)).to_json()
                reason = pools.quarantine_reason(result)
            except pools.VERIFICATION_FAILURES as exc:  # e.g. an upper data file unreadable
                result, reason = None, pools.failure_reason(mode, exc)
        self._forget_replies(ex.id)
        settled = self.pools.returned(eid, holder, reason, time.time_ns())
        if reason:
            log.warning("execution %s quarantined: %s", ex.id, reason)
        await self._make_members(settled.new)
        return pools.return_reply(settled, reset_ms, result)

    async def _verify(self, ex: Execution, args: dict) -> dict:
        mode = protocol.parse_verify_mode(args.get("mode", ROOT))
        result = (await verify(self.overlay, ex, mode, self._token(ex))).to_json()
        reason = pools.quarantine_reason(result)
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
        state = ("failed" if ex.failure is not None else
                 "promoting" if running is not None and running.command in CAPTURES
                 else self.pools.member_json(ex.id)["state"])
        return {"execution": ex.id, "id": ex.id, "base": ex.base.id, "head": ex.head,
                "state": state, "created_ns": ex.created_ns,
                "upper_bytes": ex.upper_bytes, "upper_inodes": ex.upper_inodes,
                "captured_bytes": ex.captured_bytes,
                "max_bytes": ex.access.max_bytes, "max_inodes": ex.access.max_inodes,
                "last": execution_reply(self.last.get(ex.id))}

    def execution_json(self, ex: Execution) -> dict:
        """The root scope's record of ``ex``: its view, its pool fields, why it failed, its
        stored policy and recorded runtime, its whole last reply, its path and its access
        settings."""
        return {**self.pools.member_json(ex.id), **self.execution_view(ex),
                "failure": ex.failure, "policy": policy.shown(ex.policy),
                "runtime": ex.runtime, "last": self.last.get(ex.id),
                "path": os.path.join(self.mountpoint, protocol.EXECUTIONS_DIR, ex.id),
                **ex.access.to_json()}

    def root_status(self, caller: Caller = HARNESS) -> bytes:
        """The root ``.ramet/status`` as ``caller`` may read it: whole for the harness; for
        another uid only the executions whose ``r`` bit it has (as their own ``status`` shows
        them) and their base and head snapshots, without store-wide figures or sources."""
        common = {"mount": self.mountpoint, "version": "0.1.0", "open_less": self.open_less,
                  "snapshots_bind": self._snapshots_bind()}
        if caller.harness:
            status = {"pid": os.getpid(), "data": str(self.overlay.store.root), **common,
                      "snapshots": [s.to_json() for s in self.overlay.store.snapshots()],
                      "executions": [self.execution_json(ex)
                                     for ex in self.overlay.executions.values()],
                      "pools": self.pools.to_json(),
                      "last": self.root_last}
        else:
            visible = [ex for ex in self.overlay.executions.values()
                       if ex.access.allows(caller, R)]
            seen = {ex.base.id for ex in visible} | {ex.head for ex in visible}
            status = {**common,
                      "snapshots": [_local_stats(s.to_json(), "source")
                                    for s in self.overlay.store.snapshots() if s.id in seen],
                      "executions": [self.execution_view(ex) for ex in visible],
                      "pools": []}
        return (json.dumps(status, indent=1) + "\n").encode()

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
        thread."""
        return "".join(f"{letter} {protocol.quote_path(path)}\n"
                       for letter, path in await diff_in_slices(self.overlay, ex)).encode()

    async def preview_text(self, ex: Execution) -> bytes:
        """``.ramet/preview``: the preview under the policy the harness stored with the
        execution (none if it stored none), as JSON; the tree's ``ramet.toml`` only if that
        policy is ``tree``.  A malformed policy fails the open (EINVAL) with its message in
        ``.ramet/error``."""
        try:
            report = await preview(self.overlay, ex, policy.Setting.from_record(ex.policy))
        except RametError as exc:
            self.errors[ex.id] = self._failed(exc, protocol.PREVIEW)
            raise
        return (json.dumps(report, indent=1) + "\n").encode()

    def fsmonitor_answer(self, ex: Execution, request: bytes) -> bytes:
        """The answer to git's fsmonitor hook, protocol 2 (githooks(5), "fsmonitor-watchman").

        ``request`` is ``TOKEN\nPREFIX``: the token git kept from the last answer, and the
        work tree's path relative to the execution root (empty at the root).  The answer is
        ``NEW_TOKEN\0`` followed by each changed path under the work tree (relative to it, not
        in ``.git/``) and a NUL, or by ``/\0`` when everything may have changed (a token of
        another daemon run or layer, or none).
        """
        token, _, prefix = request.decode(errors="surrogateescape").partition("\n")
        out = [self.overlay.fsmonitor_token(ex).encode()]
        paths = self.overlay.changed_since(ex, token)
        if paths is None:
            out.append(b"/")
        else:
            base = os.fsencode(prefix.strip("/"))
            cut = len(base) + 1 if base else 0
            for path in paths:
                if base and not path.startswith(base + b"/"):
                    continue
                path = path[cut:]
                if path != b".git" and not path.startswith(b".git/"):
                    out.append(path)
        return b"\0".join(out) + b"\0"

    def promoted_text(self, ex: Execution) -> bytes:
        sid = self.promoted.get(ex.id) or (ex.head if ex.head != ex.base.id else "")
        return f"{sid}\n".encode() if sid else b""


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
