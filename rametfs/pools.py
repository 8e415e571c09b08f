"""Execution pools and leases, kept by the daemon so they outlive the harness that made them.

A *pool* is a named set of executions of one snapshot, kept warm for hand-out.  Each member
execution is in one state:

* ``ready``: equal to its base (verified after its last reset), waiting in the pool;
* ``leased``: handed out to one *holder* until its lease expires (``expires_ns``, wall-clock
  ns, so it means the same to every process and across a daemon restart); the holder renews
  it, and the daemon's lease task resets an expired one and returns it to the pool;
* ``quarantined``: it failed verification; never handed out again, kept for inspection
  until released.  The pool makes a new member in its place, so it keeps ``size`` warm.

Ready members are handed out last-returned first.  This module keeps the records and the
in-memory state on the trio thread (every method is synchronous); resetting and verifying is
the caller's job (rametfs.control).  ``acquire`` never waits: a command holds the descriptor
it was written to, and the kernel serialises writes to one inode, so a waiting command would
hold up whatever else is written there; the wrapper polls instead.  Records live in
the ``pools`` and ``leases`` databases (rametfs.store.format, rametfs.store.leases).
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass, field

import trio

from . import protocol
from .authority import Access
from .errors import Busy, InvalidArgument, NotFound, RametError
from .overlay import Overlay
from .store import Snapshot
from .store.leases import (LEASED, NOT_POOLED, QUARANTINED, READY, Lease, Member, PoolRecord,
                           check_policy, pool_json)

__all__ = ["LEASED", "QUARANTINED", "READY", "Lease", "Member", "Pool", "Pools"]


@dataclass
class Pool:
    """A pool: ``members`` in creation order, ``ready`` the hand-out stack (last returned on
    top); ``access`` the settings every member is created with."""

    name: str
    base: Snapshot
    size: int
    created_ns: int
    access: Access
    policy: dict | None = None  # the persistence policy its members are created with
    members: list[str] = field(default_factory=list)
    ready: list[str] = field(default_factory=list)

    def record(self) -> PoolRecord:
        return PoolRecord(self.base.id, self.size, self.created_ns, self.access.to_record(),
                          self.policy)


class Pools:
    """Every pool of one overlay, loaded from the store at start.

    Members whose execution no longer exists are forgotten on load.  ``leases_changed`` is
    set when a lease is taken or renewed, so the lease task recomputes its next deadline.
    """

    def __init__(self, overlay: Overlay):
        self.overlay = overlay
        self.store = overlay.store
        self.pools: dict[str, Pool] = {}
        self.members: dict[str, Member] = {}
        self.leases_changed = trio.Event()
        gone = []
        with self.store.read() as txn:
            for key, value in txn.cursor(db=self.store.db["pools"]):
                rec, name = PoolRecord.unpack(value), key.decode()
                self.pools[name] = Pool(name, self.store.snapshot(rec.base), rec.size,
                                        rec.created_ns, Access.from_record(rec.access),
                                        rec.policy)
            for key, value in txn.cursor(db=self.store.db["leases"]):
                member = Member.unpack(key.decode(), value)
                pool = self.pools.get(member.pool)
                if pool is None or member.execution not in overlay.executions:
                    gone.append(key)
                    continue
                self.members[member.execution] = member
                pool.members.append(member.execution)
        for pool in self.pools.values():
            ready = [self.members[eid] for eid in pool.members
                     if self.members[eid].state == READY]
            pool.ready = [m.execution for m in sorted(ready, key=lambda m: m.returned_ns)]
        if gone:
            with self.store.write() as txn:
                for key in gone:
                    txn.delete(key, db=self.store.db["leases"])

    # -- pools ---------------------------------------------------------------------------

    def pool(self, name: str) -> Pool:
        """The pool ``name``; NotFound (ENOENT) when there is none."""
        pool = self.pools.get(name)
        if pool is None:
            raise NotFound(f"no pool {name!r}")
        return pool

    def open(self, name: str | None, snap: Snapshot, size: int,
             options: dict[str, str], policy: dict | None = None) -> tuple[Pool, bool]:
        """Create pool ``name`` (generated when None) of ``size`` executions of ``snap``, or
        reattach to the pool of that name, growing it to ``size`` members.  ``options`` are
        the access options given (``Access.given``): a new pool's members get them over the
        defaults; a pool reattached to must have them.  Members are created with ``policy``
        (a policy record).

        Returns ``(pool, created)``.  Raises ProtocolError (EINVAL) for a bad name or size
        (``protocol.check_pool``), InvalidArgument (EINVAL) for a bad option, RametError
        (EEXIST) when the pool exists with another base or other access settings, or
        ``policy`` is given and is not the pool's.
        """
        name = protocol.check_pool(name, size)
        pool = self.pools.get(name)
        created = pool is None
        if pool is None:
            pool = Pool(name, snap, size, time.time_ns(), Access().given(options), policy)
        elif pool.base.id != snap.id:
            raise RametError(f"pool {name!r} exists with base {pool.base.id}, not {snap.id}",
                             errno.EEXIST)
        elif pool.access.given(options) != pool.access:
            raise RametError(f"pool {name!r} exists with {pool.access.describe()}, not "
                             f"{pool.access.given(options).describe()}", errno.EEXIST)
        else:
            check_policy(name, pool.record(), policy)
        pool.size = max(pool.size, size)
        with self.store.write() as txn:
            txn.put(name.encode(), pool.record().pack(), db=self.store.db["pools"])
        self.pools[name] = pool
        while self._serving(pool) < pool.size:
            self._add_member(pool)
        return pool, created

    def _serving(self, pool: Pool) -> int:
        return sum(1 for eid in pool.members if self.members[eid].state != QUARANTINED)

    def _add_member(self, pool: Pool) -> Member:
        """A new ready execution in ``pool``: one execution record and one member record."""
        eid = protocol.member_name(pool.name)
        self.overlay.create_execution(pool.base, eid, pool.access, pool.policy)
        member = Member(eid, pool.name, returned_ns=time.time_ns())
        self._save(member)
        self.members[eid] = member
        pool.members.append(eid)
        pool.ready.append(eid)
        return member

    def drop(self, name: str) -> list[str]:
        """Forget pool ``name`` and its members; returns their execution ids, for the caller
        to release."""
        pool = self.pool(name)
        with self.store.write() as txn:
            txn.delete(name.encode(), db=self.store.db["pools"])
            for eid in pool.members:
                txn.delete(eid.encode(), db=self.store.db["leases"])
        for eid in pool.members:
            del self.members[eid]
        del self.pools[name]
        return list(pool.members)

    # -- leases --------------------------------------------------------------------------

    def acquire(self, name: str, holder: str, pid: int, host: str, ttl_ns: int) -> Member:
        """Lease the last returned ready member of pool ``name`` to ``holder`` for
        ``ttl_ns``.  Raises NotFound (ENOENT) unknown pool, Busy (EBUSY) none ready."""
        pool = self.pool(name)
        if not pool.ready:
            counts = self._counts(pool)
            raise Busy(f"pool {name!r}: no ready execution ({counts[LEASED]} leased, "
                       f"{counts[QUARANTINED]} quarantined)")
        member = self.members[pool.ready.pop()]
        now = time.time_ns()
        member.state, member.lease = LEASED, Lease(holder, pid, host, now + ttl_ns, now)
        self._save(member)
        self.leases_changed.set()
        return member

    def held(self, eid: str, holder: str) -> Member:
        """The member ``eid`` leased by ``holder``.  Raises NotFound (ENOENT) when ``eid`` is
        no pool member, Busy (EBUSY) when another holder has it, InvalidArgument (EINVAL)
        when it is not leased (its lease expired and it went back to the pool)."""
        member = self.members.get(eid)
        if member is None:
            raise NotFound(f"execution {eid!r} is not in a pool")
        if member.state != LEASED:
            raise InvalidArgument(f"execution {eid!r} is not leased (state {member.state}; "
                                  "an expired lease returns it to its pool)")
        if member.lease.holder != holder:
            raise Busy(f"execution {eid!r} is leased by {member.lease.holder} "
                       f"(pid {member.lease.pid} on {member.lease.host})")
        return member

    def renew(self, eid: str, holder: str, ttl_ns: int) -> Member:
        """Extend ``holder``'s lease on ``eid`` to ``ttl_ns`` from now.  Errors: those of
        :meth:`held`, and InvalidArgument (EINVAL) when the lease has ended (the lease task
        is returning the execution)."""
        member = self.held(eid, holder)
        now = time.time_ns()
        if member.lease.expires_ns <= now:
            raise InvalidArgument(f"the lease on execution {eid!r} has ended")
        member.lease.expires_ns = now + ttl_ns
        self._save(member)
        self.leases_changed.set()
        return member

    def postpone(self, member: Member, delay_ns: int) -> None:
        """Push an expired lease back (in memory) while its execution runs a command."""
        member.lease.expires_ns = time.time_ns() + delay_ns

    def expired(self, now_ns: int) -> list[Member]:
        """Leased members whose lease ended at or before ``now_ns``."""
        return [m for m in self.members.values()
                if m.state == LEASED and m.lease.expires_ns <= now_ns]

    def next_expiry(self) -> int | None:
        """The earliest lease end (wall-clock ns), or None when nothing is leased."""
        return min((m.lease.expires_ns for m in self.members.values() if m.state == LEASED),
                   default=None)

    def returned(self, member: Member, reason: str) -> None:
        """``member`` was reset and verified: back to the pool when ``reason`` is empty,
        else quarantined (and replaced by a new member).  Nothing when it left its pool
        meanwhile (the pool was dropped)."""
        if self.members.get(member.execution) is not member:
            return
        if reason:
            self.quarantine(member, reason)
            return
        pool = self.pools[member.pool]
        member.state, member.lease, member.returned_ns = READY, None, time.time_ns()
        self._save(member)
        pool.ready.append(member.execution)

    def quarantine(self, member: Member, reason: str) -> None:
        """Never hand ``member`` out again; make a new member so the pool keeps its size."""
        pool = self.pools[member.pool]
        member.state, member.lease, member.reason = QUARANTINED, None, reason
        self._save(member)
        if member.execution in pool.ready:
            pool.ready.remove(member.execution)
        if self._serving(pool) < pool.size:
            self._add_member(pool)

    def forget(self, eid: str) -> None:
        """Execution ``eid`` is being released: it leaves its pool, which shrinks by one.
        Raises Busy (EBUSY) when it is leased."""
        member = self.members.get(eid)
        if member is None:
            return
        if member.state == LEASED:
            raise Busy(f"execution {eid!r} is leased by {member.lease.holder}; "
                       "release it with return, or drop its pool")
        pool = self.pools[member.pool]
        with self.store.write() as txn:
            txn.delete(eid.encode(), db=self.store.db["leases"])
            if member.state != QUARANTINED:
                pool.size -= 1
                txn.put(pool.name.encode(), pool.record().pack(), db=self.store.db["pools"])
        pool.members.remove(eid)
        if eid in pool.ready:
            pool.ready.remove(eid)
        del self.members[eid]

    def _save(self, member: Member) -> None:
        with self.store.write() as txn:
            txn.put(member.execution.encode(), member.pack(), db=self.store.db["leases"])

    # -- status --------------------------------------------------------------------------

    def _json(self, pool: Pool) -> dict:
        return {**pool_json(pool.name, pool.record(), [self.members[eid] for eid in pool.members]),
                **pool.access.to_json()}

    def _counts(self, pool: Pool) -> dict[str, int]:
        return {state: self._json(pool)[state] for state in (READY, LEASED, QUARANTINED)}

    def to_json(self) -> list[dict]:
        """Every pool (rametfs.store.leases.pool_json), by name."""
        return [self._json(p) for p in sorted(self.pools.values(), key=lambda p: p.name)]

    def member_json(self, eid: str) -> dict:
        """The pool fields of execution ``eid``'s status: ``{"pool", "state", "lease",
        "quarantine_reason"}`` (pool and lease None outside a pool)."""
        m = self.members.get(eid)
        return dict(NOT_POOLED) if m is None else m.to_json()
