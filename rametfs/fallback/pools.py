"""Execution pools and leases in fallback mode: the daemon's commands (rametfs.protocol) and
records (rametfs.store.leases), kept in the data directory's LMDB by the processes using it.

No daemon watches the leases: ``acquire`` looks at them, and when no member is ready it takes
the execution of an expired lease for its caller after resetting and verifying it.  Every
change of a record is one LMDB write transaction, so processes and threads sharing a data
directory never hand out one execution twice.  As in the daemon, ``acquire`` never waits
(the wrapper polls).  Replies are those of the daemon's commands;
verification is :meth:`Fallback.verify` (manifest, or ``deep``: every file hashed).
"""

from __future__ import annotations

import errno
import os
import time
from typing import TYPE_CHECKING

from .. import policy as _policy
from .. import protocol
from ..authority import Access
from ..errors import Busy, NotFound, RametError
from ..store.leases import (LEASED, NOT_POOLED, QUARANTINED, READY, Lease, Member, PoolRecord,
                            check_policy, pool_json, quarantine_reason)

if TYPE_CHECKING:
    from .executions import Fallback


class Pools:
    """The pools of one fallback data directory (``engine``)."""

    def __init__(self, engine: Fallback):
        self.engine = engine
        self.store = engine.store
        self.pools_db = self.store.db["pools"]
        self.leases_db = self.store.db["leases"]

    # -- commands (arguments as the protocol gives them: strings) --------------------------

    def open(self, snapshot: str, size: str, name: str | None = None,
             policy: str | None = None, **access: str) -> dict:
        """Create pool ``name`` of ``size`` executions of ``snapshot``, whose members are
        created with the persistence policy ``policy`` (a ``--policy`` value), or reattach to
        it (growing it to ``size``); ``access`` the members' settings, as the daemon's
        ``pool`` takes them.  Errors: ENOENT snapshot, EINVAL, EEXIST other base, settings or
        policy."""
        count = protocol.parse_count(size, "--size")
        name = protocol.check_pool(name, count)
        stored = _policy.stored(policy, _policy.POOL)
        snap = self.store.snapshot(snapshot)
        with self.store.write() as txn:
            raw = txn.get(name.encode(), db=self.pools_db)
            created = raw is None
            pool = PoolRecord(snap.id, count, time.time_ns(), Access().given(access).to_record(),
                              stored) if created else PoolRecord.unpack(raw)
            if pool.base != snap.id:
                raise RametError(f"pool {name!r} exists with base {pool.base}, not {snap.id}",
                                 errno.EEXIST)
            settings = Access.from_record(pool.access)
            if settings.given(access) != settings:
                raise RametError(f"pool {name!r} exists with {settings.describe()}, not "
                                 f"{settings.given(access).describe()}", errno.EEXIST)
            check_policy(name, pool, stored)
            pool.size = max(pool.size, count)
            txn.put(name.encode(), pool.pack(), db=self.pools_db)
            missing = pool.size - _serving(self._members(txn, name))
        try:
            for _ in range(missing):
                self._add_member(name, pool)
        except BaseException:
            if created:  # half made: no one could use it
                self.drop(name)
            raise
        with self.store.read() as txn:
            members = [m.execution for m in self._members(txn, name)]
        return {"ok": True, "pool": name, "snapshot": snap.id, "size": pool.size,
                "created": created, "executions": members}

    def acquire(self, pool: str, holder: str, ttl: str, pid: str = "0", host: str = "") -> dict:
        """Lease a ready execution of ``pool`` (the last returned), else one whose lease
        expired (reset and verified first).  Errors: ENOENT unknown pool, EBUSY none free."""
        ttl_ns = protocol.parse_seconds_ns(ttl, "--ttl")
        lease_pid = protocol.parse_count(pid, "--pid", minimum=0)
        while True:
            now = time.time_ns()
            with self.store.write() as txn:
                self._pool(txn, pool)
                members = self._members(txn, pool)
                ready = [m for m in members if m.state == READY]
                expired = [m for m in members if m.state == LEASED and m.lease.expires_ns <= now]
                chosen = (max(ready, key=lambda m: m.returned_ns) if ready
                          else min(expired, key=lambda m: m.lease.expires_ns, default=None))
                if chosen is not None:
                    stale = chosen.state == LEASED
                    chosen.state = LEASED
                    chosen.lease = Lease(holder, lease_pid, host, now + ttl_ns, now)
                    self._put(txn, chosen)
            if chosen is None:
                leased = sum(m.state == LEASED for m in members)
                raise Busy(f"pool {pool!r}: no ready execution ({leased} leased, "
                           f"{len(members) - leased} quarantined)")
            if stale:
                reply = self._reset_and_verify(chosen, protocol.VERIFY_MODES[0])
                if reply["state"] != LEASED:  # quarantined
                    continue
            return {"ok": True, "execution": chosen.execution, "pool": pool,
                    "snapshot": self._pool_record(pool).base,
                    "path": str(self.engine.path(chosen.execution)),
                    "lease": chosen.lease.to_json()}

    def renew(self, execution: str, holder: str, ttl: str) -> dict:
        """Extend ``holder``'s lease on ``execution`` to ``ttl`` seconds from now.  Errors:
        ENOENT not in a pool, EBUSY another holder, EINVAL not leased or the lease ended (an
        acquire may take the execution over)."""
        ttl_ns = protocol.parse_seconds_ns(ttl, "--ttl")
        with self.store.write() as txn:
            member = self._held(txn, execution, holder)
            now = time.time_ns()
            if member.lease.expires_ns <= now:
                raise RametError(f"the lease on execution {execution!r} has ended",
                                 errno.EINVAL)
            member.lease.expires_ns = now + ttl_ns
            self._put(txn, member)
        return {"ok": True, "execution": execution, "lease": member.lease.to_json()}

    def return_(self, execution: str, holder: str, verify: str = "root") -> dict:
        """Reset ``execution``, verify it (``root``: the manifest; ``deep``: every file
        hashed) and put it back in its pool, or quarantine it.  Errors as :meth:`renew`."""
        mode = protocol.parse_verify_mode(verify)
        with self.store.read() as txn:
            member = self._held(txn, execution, holder)
        reply = self._reset_and_verify(member, mode)
        if reply["state"] == LEASED:
            with self.store.write() as txn:
                self._held(txn, execution, holder)  # not taken over while it was being reset
                member.state, member.lease, member.returned_ns = READY, None, time.time_ns()
                self._put(txn, member)
            reply["state"] = READY
        return reply

    def drop(self, pool: str) -> dict:
        """Release every execution of ``pool`` and forget it.  Errors: ENOENT."""
        with self.store.write() as txn:
            self._pool(txn, pool)
            members = [m.execution for m in self._members(txn, pool)]
            txn.delete(pool.encode(), db=self.pools_db)
            for eid in members:
                txn.delete(eid.encode(), db=self.leases_db)
        for eid in members:
            try:
                self.engine.release(eid)
            except NotFound:
                pass
        return {"ok": True, "pool": pool, "executions": members}

    # -- what the engine asks --------------------------------------------------------------

    def forget(self, execution: str) -> None:
        """``execution`` is being released: it leaves its pool, which shrinks by one.  Raises
        Busy (EBUSY) while a lease on it runs."""
        with self.store.write() as txn:
            raw = txn.get(execution.encode(), db=self.leases_db)
            if raw is None:
                return
            member = Member.unpack(execution, raw)
            if member.state == LEASED and member.lease.expires_ns > time.time_ns():
                raise Busy(f"execution {execution!r} is leased by {member.lease.holder}; "
                           "release it with return, or drop its pool")
            txn.delete(execution.encode(), db=self.leases_db)
            if member.state != QUARANTINED:
                pool = self._pool(txn, member.pool)
                pool.size -= 1
                txn.put(member.pool.encode(), pool.pack(), db=self.pools_db)

    def verified(self, execution: str, mode: str, differences: list[tuple[str, bytes]]) -> None:
        """A verification in ``mode`` found ``differences``: a ready member that differs from
        its base is quarantined."""
        if not differences:
            return
        with self.store.read() as txn:
            raw = txn.get(execution.encode(), db=self.leases_db)
        member = None if raw is None else Member.unpack(execution, raw)
        if member is not None and member.state == READY:
            self._quarantine(member, quarantine_reason(
                {"mode": mode, "differences": _as_text(differences)}))

    def member_json(self, execution: str) -> dict:
        """The pool fields of ``execution``'s status (as the daemon's)."""
        with self.store.read() as txn:
            raw = txn.get(execution.encode(), db=self.leases_db)
        return dict(NOT_POOLED) if raw is None else Member.unpack(execution, raw).to_json()

    def to_json(self) -> list[dict]:
        """Every pool (rametfs.store.leases.pool_json), by name."""
        with self.store.read() as txn:
            pools = [(k.decode(), PoolRecord.unpack(v)) for k, v in txn.cursor(db=self.pools_db)]
            return [{**pool_json(name, pool, self._members(txn, name)),
                     **Access.from_record(pool.access).to_json()} for name, pool in pools]

    # -- helpers ---------------------------------------------------------------------------

    def _reset_and_verify(self, member: Member, mode: str) -> dict:
        """Reset and verify ``member``'s execution; quarantine it when it differs.  The
        reply's ``state`` is ``"leased"`` (still) or ``"quarantined"``."""
        reset = self.engine.reset(member.execution)
        started = time.monotonic_ns()
        differences = self.engine.verify(member.execution, deep=mode == "deep")
        verification = {"mode": mode, "equal": not differences, "root": None, "base_root": None,
                        "verify_ms": round((time.monotonic_ns() - started) / 1e6, 3),
                        "differences": _as_text(differences)}
        if differences:
            self._quarantine(member, quarantine_reason(verification))
        return {"ok": True, "execution": member.execution, "pool": member.pool,
                "state": member.state, "reset_ms": reset["reset_ms"],
                "verification": verification}

    def _quarantine(self, member: Member, reason: str) -> None:
        with self.store.write() as txn:
            member.state, member.lease, member.reason = QUARANTINED, None, reason
            self._put(txn, member)
            pool = self._pool(txn, member.pool)
            missing = pool.size - _serving(self._members(txn, member.pool))
        for _ in range(missing):
            self._add_member(member.pool, pool)

    def _add_member(self, name: str, pool: PoolRecord) -> None:
        eid = protocol.member_name(name)
        self.engine.create(pool.base, eid, stored_policy=pool.policy,
                           **Access.from_record(pool.access).options())
        with self.store.write() as txn:
            self._put(txn, Member(eid, name, returned_ns=time.time_ns()))

    def _pool(self, txn, name: str) -> PoolRecord:
        raw = txn.get(name.encode(), db=self.pools_db)
        if raw is None:
            raise NotFound(f"no pool {name!r}")
        return PoolRecord.unpack(raw)

    def _pool_record(self, name: str) -> PoolRecord:
        with self.store.read() as txn:
            return self._pool(txn, name)

    def _members(self, txn, pool: str) -> list[Member]:
        """The members of ``pool`` by execution id (a scan: pools are small)."""
        members = (Member.unpack(k.decode(), v) for k, v in txn.cursor(db=self.leases_db))
        return [m for m in members if m.pool == pool]

    def _held(self, txn, execution: str, holder: str) -> Member:
        raw = txn.get(execution.encode(), db=self.leases_db)
        if raw is None:
            raise NotFound(f"execution {execution!r} is not in a pool")
        member = Member.unpack(execution, raw)
        if member.state != LEASED:
            raise RametError(f"execution {execution!r} is not leased (state {member.state})",
                             errno.EINVAL)
        if member.lease.holder != holder:
            raise Busy(f"execution {execution!r} is leased by {member.lease.holder} "
                       f"(pid {member.lease.pid} on {member.lease.host})")
        return member

    def _put(self, txn, member: Member) -> None:
        txn.put(member.execution.encode(), member.pack(), db=self.leases_db)


def _serving(members: list[Member]) -> int:
    return sum(1 for m in members if m.state != QUARANTINED)


def _as_text(differences: list[tuple[str, bytes]]) -> list[list[str]]:
    return [[letter, os.fsdecode(path)] for letter, path in differences]
