"""Execution pools and leases in fallback mode: the pool commands of rametfs.protocol run in
this process over the rules of rametfs.core.pools, whose records are in the data directory's
LMDB, shared by every process using it.

This driver does the mechanics, on the values of the protocol's commands (rametfs.protocol
checks them): it makes, resets, verifies and releases executions (rametfs.fallback.executions).
No daemon watches the leases: ``acquire`` takes over the execution of an ended lease when no
member is ready, resetting and verifying it first (quarantined: it looks again).  Replies are
those of the daemon's commands.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import protocol
from ..core import policy as _policy
from ..core import pools as core
from ..core import status
from ..errors import NotFound

if TYPE_CHECKING:
    from .executions import Fallback


class Pools:
    """The pools of one fallback data directory (``engine``); ``clock`` gives the time
    (wall-clock ns: lease ends mean the same to every process)."""

    def __init__(self, engine: Fallback, clock: Callable[[], int] = time.time_ns):
        self.engine = engine
        self.rules = core.Pools(engine.store)
        self.clock = clock

    # -- commands ------------------------------------------------------------------------

    def open(self, command: protocol.Pool) -> dict:
        """Create pool ``command.name`` of ``command.size`` executions of its snapshot, whose
        members are created with its persistence policy (a ``--policy`` value) and access
        settings, and whose promotes are trimmed to the ``keep_last`` newest, or reattach to
        it (growing it to the size).  Errors: ENOENT snapshot, EINVAL policy, EEXIST other
        base, settings, policy or keep_last (rametfs.core.pools.Pools.open)."""
        snap = self.engine.store.snapshot(command.snapshot)
        opened = self.rules.open(command.name, snap.id, command.size, command.access,
                                 _policy.stored(command.policy, _policy.POOL), self.clock(),
                                 command.keep_last)
        try:
            self._make(opened.new)
        except BaseException:
            if opened.created:  # half made: no one could use it
                self.drop(opened.pool)
            raise
        return self.rules.opened_reply(opened)

    def acquire(self, pool: str, holder: str, ttl_ns: int, pid: int = 0, host: str = ""
                ) -> dict:
        """Lease a ready execution of ``pool`` (the last returned), else one whose lease
        ended (reset and verified first), for ``ttl_ns``.  Errors: ENOENT unknown pool,
        EBUSY none free."""
        while True:
            acquired = self.rules.acquire(pool, holder, pid, host, ttl_ns, self.clock(),
                                          take_expired=True)
            eid = acquired.member.execution
            if acquired.taken_over:
                _, _, reason = self._reset_and_verify(eid, "root")
                if reason:
                    self._make(self.rules.returned(eid, holder, reason, self.clock()).new)
                    continue
            return self.rules.acquired_reply(acquired, str(self.engine.path(eid)))

    def renew(self, execution: str, holder: str, ttl_ns: int) -> dict:
        """Extend ``holder``'s lease on ``execution`` to ``ttl_ns`` from now.  Errors: ENOENT
        not in a pool, EBUSY another holder, EINVAL not leased or the lease ended."""
        return self.rules.renew(execution, holder, ttl_ns, self.clock())

    def return_(self, execution: str, holder: str, mode: str = "root") -> dict:
        """Reset ``execution``, verify it in ``mode`` (``root``: the manifest; ``deep``:
        every file hashed) and put it back in its pool, or quarantine it.  Errors as
        :meth:`renew`."""
        self.rules.held(execution, holder)
        reset_ms, verification, reason = self._reset_and_verify(execution, mode)
        settled = self.rules.returned(execution, holder, reason, self.clock())
        self._make(settled.new)
        return core.return_reply(settled, reset_ms, verification)

    def drop(self, pool: str) -> dict:
        """Release every execution of ``pool`` and forget it.  Errors: ENOENT."""
        reply = self.rules.drop(pool)
        for eid in reply["executions"]:
            with contextlib.suppress(NotFound):  # released meanwhile
                self.engine.release(eid)
        return reply

    # -- what the engine asks ------------------------------------------------------------

    def forget(self, execution: str) -> None:
        """``execution`` is being released: it leaves its pool (Busy, EBUSY, while a lease
        on it runs)."""
        self.rules.forget(execution, self.clock())

    def verified(self, execution: str, verification: dict) -> None:
        """An explicit verification (rametfs.core.status.verification_json): a ready member
        that differs from its base is quarantined and replaced."""
        settled = self.rules.verified(execution, status.quarantine_reason(verification))
        if settled is not None:
            self._make(settled.new)

    def member_json(self, execution: str) -> dict:
        return self.rules.member_json(execution)

    def to_json(self) -> list[dict]:
        return self.rules.to_json()

    # -- mechanics -----------------------------------------------------------------------

    def _reset_and_verify(self, eid: str, mode: str) -> tuple[float, dict | None, str]:
        """Reset execution ``eid`` to its base (the pool's snapshot) and verify it in
        ``mode``: ``(reset_ms, verification, quarantine reason)``, the reason empty when it
        equals its base."""
        reset_ms = self.engine.reset(eid, base=True)["reset_ms"]  # the pool's snapshot
        try:
            verification = self.engine.verification(eid, mode)
        except OSError as exc:
            if not core.verification_failed(exc):
                raise
            return reset_ms, None, status.failure_reason(mode, exc)
        return reset_ms, verification, status.quarantine_reason(verification)

    def _make(self, new: tuple[core.NewMember, ...]) -> None:
        """Create the executions of ``new`` members and record them; one its pool no longer
        wants (dropped, or filled by another process meanwhile) is released again."""
        for member in new:
            self.engine.create(member.base, member.execution, stored_policy=member.policy,
                               access=member.access.options())
            if not self.rules.add_member(member, self.clock()):
                self.engine.release(member.execution)
