"""Execution pools and leases: the one state machine of both modes.

A *pool* is a named set of executions of one snapshot, kept warm for hand-out.  Each member
execution is in one state:

* ``ready``: equal to its base (verified after its last reset), waiting in the pool;
* ``leased``: handed out to one *holder* until its lease ends (``expires_ns``, wall-clock ns,
  so it means the same to every process and across a daemon restart); the holder renews it.
  A lease that has ended holds nothing: its execution is returned to the pool (reset,
  verified) by the daemon's lease task, or in fallback mode taken over by the next
  ``acquire`` that finds no ready member;
* ``quarantined``: it failed verification; never handed out again, kept for inspection until
  released.  The pool makes a new member in its place, so it keeps ``size`` serving.

Ready members are handed out last-returned first.  ``acquire`` never waits: a command holds
the descriptor it was written to, and the kernel serialises writes to one inode, so a waiting
command would hold up whatever else is written there; the wrapper polls instead.

Every method of :class:`Pools` is synchronous and one LMDB transaction of its store, and keeps
nothing in memory between calls, so the processes sharing a data directory see one state and
never hand out one execution twice; the time is an argument (``now_ns``, wall-clock ns),
never read here.  What happens outside the store is the driver's, told by what a method
returns: :class:`NewMember` an execution to create, then :meth:`Pools.add_member`;
:attr:`Acquired.taken_over` an execution to reset and verify before it is handed out; after
``held``, the driver resets and verifies the execution and reports with :meth:`Pools.returned`.
The drivers are rametfs.control.commands (the daemon: trio, cancels a command running on the
execution) and rametfs.fallback.pools (in-process, synchronous).  Records: rametfs.store.catalog.

Where the daemon's and fallback mode's earlier copies of these rules disagreed, this one
keeps: an ended lease holds nothing, so release (:meth:`Pools.forget`) of its member is allowed
in both modes (the daemon refused any leased member until its lease task had returned it; in
fallback mode, with no lease task, such a member could otherwise only be dropped with its
pool) and ``renew`` refuses it in both (the daemon's in-memory postponement of a busy one let
its holder renew it); "not leased" is InvalidArgument with its hint in both; a verification
reply carries tree ids in both (rametfs.core.status.verification_json); and only unreadable
or corrupt data is a failed verification (:func:`verification_failed`), in both.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass

from .. import protocol
from ..authority import Access
from ..errors import Busy, IntegrityError, InvalidArgument, NotFound, RametError
from ..store import Store
from ..store.catalog import LEASED, QUARANTINED, READY, Catalog, Lease, Member, PoolRecord
from ..ids import ExecutionId, PoolName

__all__ = ["LEASED", "QUARANTINED", "READY", "Acquired", "NewMember",
           "Opened", "Pools", "Settled", "return_reply", "verification_failed"]

NOT_POOLED = {"pool": None, "state": READY, "lease": None, "quarantine_reason": None}


def verification_failed(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a verification, quarantines the execution
    (rametfs.core.status.failure_reason): stored bytes corrupt (IntegrityError) or unreadable
    (an OSError of the file system).  Any other RametError (cancelled, busy, no space) is no
    verdict on the execution: the return fails and the member stays as it was."""
    return isinstance(exc, IntegrityError) or \
        isinstance(exc, OSError) and not isinstance(exc, RametError)


@dataclass(frozen=True)
class NewMember:
    """A member for the driver to make: execution ``execution`` of snapshot ``base`` (hex id)
    with ``access`` and the persistence policy record ``policy``; then
    :meth:`Pools.add_member`."""

    pool: str
    execution: str
    base: str
    access: Access
    policy: dict | None


@dataclass(frozen=True)
class Opened:
    """A pool opened: its name, base, size (after growing) and whether it was made now;
    ``new`` the members the driver makes (on failure, a pool ``created`` is dropped)."""

    pool: str
    base: str
    size: int
    created: bool
    new: tuple[NewMember, ...]


@dataclass(frozen=True)
class Acquired:
    """A lease taken on ``member`` (its ``lease`` set) of a pool of snapshot ``base``;
    ``taken_over``: it was the execution of an ended lease, which the driver resets and
    verifies before handing it out."""

    member: Member
    base: str
    taken_over: bool


@dataclass(frozen=True)
class Settled:
    """Where a member returned or verified ended: ``state`` ``ready`` or ``quarantined``;
    ``new`` the members to make in place of one quarantined."""

    execution: str
    pool: str
    state: str
    new: tuple[NewMember, ...] = ()


class Pools:
    """The pools and leases in ``store``'s ``pools`` and ``leases`` databases."""

    def __init__(self, store: Store):
        self.store = store
        self.catalog = Catalog(store)

    # -- pools ---------------------------------------------------------------------------

    def open(self, name: PoolName | None, base: str, size: int, options: protocol.Access,
             policy: dict | None, now_ns: int, keep_last: int | None = None) -> Opened:
        """Create pool ``name`` (generated when None) of ``size`` executions of snapshot
        ``base`` (hex id), or reattach to the pool of that name, growing it to ``size``.
        ``options`` are the access options given (``Access.given``): a new pool's members get
        them over the defaults; a pool reattached to must have them.  Members are created
        with ``policy`` (a policy record; None: not given).  ``keep_last`` N: after each
        promote of a member, only the pool's N newest promotes are kept
        (rametfs.core.lifecycle.trim_pool; None: not given, a new pool keeps all).

        The name, size and options are a ``pool`` command's (rametfs.protocol.Pool checks
        them).  Raises RametError (EEXIST) when the pool exists with another base or other
        access settings, or ``policy`` or ``keep_last`` is given and is not the pool's.
        """
        name = name or protocol.new_pool_name()
        with self.store.write() as txn:
            pool = self.catalog.pool(txn, name)
            created = pool is None
            if pool is None:
                pool = PoolRecord(base, size, now_ns, Access().given(options).to_record(),
                                  policy, keep_last or 0)
            else:
                _check_reattach(name, pool, base, options, policy)
                if keep_last is not None and keep_last != pool.keep_last:
                    raise RametError(errno.EEXIST,
                                     f"pool {name!r} exists with --keep-last "
                                     f"{pool.keep_last or 'unset'}, not {keep_last}")
                pool.size = max(pool.size, size)
            self.catalog.put_pool(txn, name, pool)
            new = self._missing(txn, name, pool)
        return Opened(name, pool.base, pool.size, created, new)

    def opened_reply(self, opened: Opened) -> dict:
        """The ``pool`` command's reply: ``{"ok", "pool", "snapshot", "size", "created",
        "executions"}`` (member ids in id order)."""
        with self.store.read() as txn:
            members = [m.execution for m in self.catalog.members(txn, opened.pool)]
        return {"ok": True, "pool": opened.pool, "snapshot": opened.base, "size": opened.size,
                "created": opened.created, "executions": members}

    def add_member(self, new: NewMember, now_ns: int) -> bool:
        """Record the execution the driver made for ``new`` as a ready member.  False when
        its pool no longer wants it (dropped, made again with other settings, or already
        serving its size: another process filled it meanwhile): the driver releases it."""
        with self.store.write() as txn:
            pool = self.catalog.pool(txn, new.pool)
            if pool is None or _spec(pool) != (new.base, new.access, new.policy) \
                    or _serving(self.catalog.members(txn, new.pool)) >= pool.size:
                return False
            self.catalog.put_member(txn, Member(new.execution, new.pool, returned_ns=now_ns))
        return True

    def drop(self, name: PoolName) -> dict:
        """Forget pool ``name`` and its members; the ``drop`` command's reply, ``{"ok",
        "pool", "executions"}``, names the members' executions, which the driver releases.
        Raises NotFound (ENOENT) when there is no such pool."""
        with self.store.write() as txn:
            self._pool(txn, name)
            members = [m.execution for m in self.catalog.members(txn, name)]
            self.catalog.delete_pool(txn, name)
            for eid in members:
                self.catalog.delete_member(txn, eid)
        return {"ok": True, "pool": name, "executions": members}

    def prune(self, exists: Callable[[str], bool]) -> list[str]:
        """Forget the members whose pool is gone or whose execution does not exist
        (``exists(execution id)`` False); their ids.  The daemon's, at start."""
        with self.store.write() as txn:
            pools = {name for name, _ in self.catalog.pools(txn)}
            gone = [m.execution for m in self.catalog.members(txn)
                    if m.pool not in pools or not exists(m.execution)]
            for eid in gone:
                self.catalog.delete_member(txn, eid)
        return gone

    # -- leases --------------------------------------------------------------------------

    def acquire(self, name: PoolName, holder: str, pid: int, host: str, ttl_ns: int, now_ns: int,
                *, take_expired: bool = False) -> Acquired:
        """Lease the last returned ready member of pool ``name`` to ``holder`` (``pid`` on
        ``host``) from ``now_ns`` for ``ttl_ns``; with none ready and ``take_expired``, the
        member whose lease ended first (:attr:`Acquired.taken_over`).  Raises NotFound
        (ENOENT) unknown pool, Busy (EBUSY) none free."""
        with self.store.write() as txn:
            pool = self._pool(txn, name)
            members = list(self.catalog.members(txn, name))
            ready = [m for m in members if m.state == READY]
            ended = [m for m in members if m.state == LEASED and m.lease.expires_ns <= now_ns]
            if ready:
                member = max(ready, key=lambda m: m.returned_ns)
            elif ended and take_expired:
                member = min(ended, key=lambda m: m.lease.expires_ns)
            else:
                counts = _counts(members)
                raise Busy(f"pool {name!r}: no ready execution ({counts[LEASED]} leased, "
                           f"{counts[QUARANTINED]} quarantined)")
            taken_over = member.state == LEASED
            member.state, member.lease = LEASED, Lease(holder, pid, host, now_ns + ttl_ns,
                                                       now_ns)
            self.catalog.put_member(txn, member)
        return Acquired(member, pool.base, taken_over)

    @staticmethod
    def acquired_reply(acquired: Acquired, path: str) -> dict:
        """The ``acquire`` command's reply: ``{"ok", "execution", "pool", "snapshot", "path",
        "lease"}``; ``path`` where the execution is."""
        member = acquired.member
        return {"ok": True, "execution": member.execution, "pool": member.pool,
                "snapshot": acquired.base, "path": path, "lease": member.lease.to_json()}

    def held(self, eid: ExecutionId, holder: str) -> Member:
        """The member ``eid`` leased by ``holder``.  Raises NotFound (ENOENT) when ``eid`` is
        no pool member, InvalidArgument (EINVAL) when it is not leased, Busy (EBUSY) when
        another holder has it."""
        with self.store.read() as txn:
            return self._held(txn, eid, holder)

    def lease(self, eid: str) -> Lease | None:
        """The lease on member ``eid``; None when there is none (or no such member)."""
        with self.store.read() as txn:
            member = self.catalog.member(txn, eid)
        return None if member is None else member.lease

    def renew(self, eid: ExecutionId, holder: str, ttl_ns: int, now_ns: int) -> dict:
        """Extend ``holder``'s lease on ``eid`` to ``ttl_ns`` from ``now_ns``; the ``renew``
        command's reply, ``{"ok", "execution", "lease"}``.  Errors: those of :meth:`held`,
        and InvalidArgument (EINVAL) when the lease has ended (an ended lease holds nothing:
        it is being returned, or may be taken over)."""
        with self.store.write() as txn:
            member = self._held(txn, eid, holder)
            if member.lease.expires_ns <= now_ns:
                raise InvalidArgument(f"the lease on execution {eid!r} has ended")
            member.lease.expires_ns = now_ns + ttl_ns
            self.catalog.put_member(txn, member)
        return {"ok": True, "execution": eid, "lease": member.lease.to_json()}

    def returned(self, eid: ExecutionId, holder: str, reason: str, now_ns: int) -> Settled:
        """``holder``'s member ``eid`` was reset and verified: back to the pool, ready, when
        ``reason`` is empty, else quarantined with ``reason`` (rametfs.core.status
        .quarantine_reason, .failure_reason) and :attr:`Settled.new` its replacement.
        Errors: those of :meth:`held` (released, returned or taken over meanwhile: nothing
        changes)."""
        with self.store.write() as txn:
            member = self._held(txn, eid, holder)
            if reason:
                return self._quarantine(txn, member, reason)
            member.state, member.lease, member.returned_ns = READY, None, now_ns
            self.catalog.put_member(txn, member)
        return Settled(eid, member.pool, READY)

    def verified(self, eid: str, reason: str) -> Settled | None:
        """A verification of execution ``eid`` found it different from its base (``reason``;
        empty: equal): a ready member is quarantined, and the result names its replacement.
        None when nothing changes: equal, not in a pool, or not ready (a leased member may
        legitimately differ)."""
        if not reason:
            return None
        with self.store.write() as txn:
            member = self.catalog.member(txn, eid)
            if member is None or member.state != READY:
                return None
            return self._quarantine(txn, member, reason)

    def forget(self, eid: ExecutionId, now_ns: int) -> None:
        """Execution ``eid`` is being released: it leaves its pool, which shrinks by one
        (unless it was quarantined).  Raises Busy (EBUSY) while a lease on it runs
        (a lease that has ended at ``now_ns`` holds nothing)."""
        with self.store.write() as txn:
            member = self.catalog.member(txn, eid)
            if member is None:
                return
            if member.state == LEASED and member.lease.expires_ns > now_ns:
                raise Busy(f"execution {eid!r} is leased by {member.lease.holder}; "
                           "release it with return, or drop its pool")
            self.catalog.delete_member(txn, eid)
            pool = self.catalog.pool(txn, member.pool)
            if pool is not None and member.state != QUARANTINED:
                pool.size -= 1
                self.catalog.put_pool(txn, member.pool, pool)

    def expired(self, now_ns: int) -> list[Member]:
        """Leased members whose lease ended at or before ``now_ns``, the earliest first."""
        with self.store.read() as txn:
            ended = [m for m in self.catalog.members(txn)
                     if m.state == LEASED and m.lease.expires_ns <= now_ns]
        return sorted(ended, key=lambda m: m.lease.expires_ns)

    def next_expiry(self, after_ns: int | None = None) -> int | None:
        """The earliest end (wall-clock ns) of a lease, of those running at ``after_ns``
        when given; None when there is none."""
        with self.store.read() as txn:
            return min((m.lease.expires_ns for m in self.catalog.members(txn)
                        if m.state == LEASED
                        and (after_ns is None or m.lease.expires_ns > after_ns)),
                       default=None)

    # -- status --------------------------------------------------------------------------

    def to_json(self) -> list[dict]:
        """Every pool, by name: ``{"name", "base", "size", "created_ns", "keep_last"
        (None: all kept), "executions",
        "ready", "leased", "quarantined", "owner", "group", "share", "control", "max_bytes",
        "max_inodes"}``; ``ready``, ``leased`` and ``quarantined`` count the ``executions``
        (member ids) in each state, the rest are the members' access settings
        (``Access.to_json``)."""
        with self.store.read() as txn:
            members: dict[str, list[Member]] = {}
            for m in self.catalog.members(txn):
                members.setdefault(m.pool, []).append(m)
            return [{"name": name, "base": pool.base, "size": pool.size,
                     "created_ns": pool.created_ns, "keep_last": pool.keep_last or None,
                     "executions": [m.execution for m in members.get(name, [])],
                     **_counts(members.get(name, [])),
                     **Access.from_record(pool.access).to_json()}
                    for name, pool in self.catalog.pools(txn)]

    def member_json(self, eid: str) -> dict:
        """The pool fields of execution ``eid``'s status: ``{"pool", "state", "lease",
        "quarantine_reason"}`` (``lease`` as :meth:`Lease.to_json` or None; pool and lease
        None, state ``ready``, outside a pool)."""
        with self.store.read() as txn:
            m = self.catalog.member(txn, eid)
        if m is None:
            return dict(NOT_POOLED)
        return {"pool": m.pool, "state": m.state,
                "lease": m.lease.to_json() if m.lease else None,
                "quarantine_reason": m.reason or None}

    # -- inside a transaction ------------------------------------------------------------

    def _pool(self, txn, name: str) -> PoolRecord:
        pool = self.catalog.pool(txn, name)
        if pool is None:
            raise NotFound(f"no pool {name!r}")
        return pool

    def _held(self, txn, eid: str, holder: str) -> Member:
        member = self.catalog.member(txn, eid)
        if member is None:
            raise NotFound(f"execution {eid!r} is not in a pool")
        if member.state != LEASED:
            raise InvalidArgument(f"execution {eid!r} is not leased (state {member.state}; "
                                  "an expired lease returns it to its pool)")
        if member.lease.holder != holder:
            raise Busy(f"execution {eid!r} is leased by {member.lease.holder} "
                       f"(pid {member.lease.pid} on {member.lease.host})")
        return member

    def _quarantine(self, txn, member: Member, reason: str) -> Settled:
        """Never hand ``member`` out again; its replacement for the driver to make."""
        member.state, member.lease, member.reason = QUARANTINED, None, reason
        self.catalog.put_member(txn, member)
        pool = self.catalog.pool(txn, member.pool)
        new = () if pool is None else self._missing(txn, member.pool, pool)
        return Settled(member.execution, member.pool, QUARANTINED, new)

    def _missing(self, txn, name: str, pool: PoolRecord) -> tuple[NewMember, ...]:
        """New members for ``pool`` (named ``name``) to serve its size again."""
        base, access, policy = _spec(pool)
        missing = pool.size - _serving(self.catalog.members(txn, name))
        return tuple(NewMember(name, protocol.member_name(name), base, access, policy)
                     for _ in range(missing))


def _spec(pool: PoolRecord) -> tuple[str, Access, dict | None]:
    """What every member of ``pool`` is made from: base snapshot id, access, policy."""
    return pool.base, Access.from_record(pool.access), pool.policy


def _check_reattach(name: str, pool: PoolRecord, base: str, options: protocol.Access,
                    policy: dict | None) -> None:
    """RametError (EEXIST) when pool ``name`` (``pool``) is reattached to with another base
    snapshot, access options other than its own, or a policy (given: not None) not its own."""
    if pool.base != base:
        raise RametError(errno.EEXIST,
                         f"pool {name!r} exists with base {pool.base}, not {base}")
    settings = Access.from_record(pool.access)
    if settings.given(options) != settings:
        raise RametError(errno.EEXIST, f"pool {name!r} exists with {settings.describe()}, not "
                         f"{settings.given(options).describe()}")
    if policy is not None and policy != pool.policy:
        raise RametError(errno.EEXIST,
                         f"pool {name!r} exists with another persistence policy")


def _serving(members) -> int:
    return sum(1 for m in members if m.state != QUARANTINED)


def _counts(members: list[Member]) -> dict[str, int]:
    counts = {READY: 0, LEASED: 0, QUARANTINED: 0}
    for m in members:
        counts[m.state] += 1
    return counts


def return_reply(settled: Settled, reset_ms: float, verification: dict | None) -> dict:
    """The ``return`` command's reply: ``{"ok", "execution", "pool", "state", "reset_ms",
    "verification"}`` (``verification`` None when it failed: rametfs.core.status
    .failure_reason)."""
    return {"ok": True, "execution": settled.execution, "pool": settled.pool,
            "state": settled.state, "reset_ms": reset_ms, "verification": verification}
