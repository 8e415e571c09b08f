"""The records of executions, of execution pools and of their members, and typed access to
them inside a transaction (the ``executions``, ``pools`` and ``leases`` databases; layout in
rametfs.store.format, which holds :class:`ExecutionRecord`'s codec).

What the records mean and how they change is rametfs.core.pools, for both modes.  Times are
wall-clock ns (``time.time_ns``), so a lease end means the same to every process and across
restarts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import lmdb
import msgpack

from .format import ExecutionRecord

READY, LEASED, QUARANTINED = "ready", "leased", "quarantined"


@dataclass
class Lease:
    """Who holds a member: ``holder`` (the client's token), its ``pid`` and ``host``, and
    when the lease ends and began (``expires_ns``, ``acquired_ns``: wall-clock ns)."""

    holder: str
    pid: int
    host: str
    expires_ns: int
    acquired_ns: int

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class PoolRecord:
    """A pool: its base snapshot id (hex), how many executions it keeps for hand-out, when it
    was made (ns), the access settings its members get (``rametfs.authority.Access`` as a
    record: owner, group, share, control, limits; empty in a record from before them), and
    the persistence policy its members are created with (the record of a
    rametfs.core.policy.Setting, or None); ``keep_last`` how many of its members' promotes are
    kept after each promote (rametfs.core.lifecycle.trim_pool; 0: all)."""

    base: str
    size: int
    created_ns: int
    access: dict = field(default_factory=dict)
    policy: dict | None = None
    keep_last: int = 0

    def pack(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def unpack(cls, value: bytes) -> PoolRecord:
        return cls(**msgpack.unpackb(value))


@dataclass
class Member:
    """One execution of a pool; ``reason`` says why verification quarantined it;
    ``returned_ns`` when it last became ready (ready members go out last-returned first)."""

    execution: str
    pool: str
    state: str = READY
    lease: Lease | None = None
    reason: str = ""
    returned_ns: int = 0

    def pack(self) -> bytes:
        return msgpack.packb({"pool": self.pool, "state": self.state, "reason": self.reason,
                              "lease": self.lease.to_json() if self.lease else None,
                              "returned_ns": self.returned_ns})

    @classmethod
    def unpack(cls, execution: str, value: bytes) -> Member:
        rec = msgpack.unpackb(value)
        lease = Lease(**rec["lease"]) if rec["lease"] else None
        return cls(execution, rec["pool"], rec["state"], lease, rec["reason"],
                   rec["returned_ns"])


class Catalog:
    """Get, put, delete and scan execution, pool and member records of ``store`` (a
    rametfs.store.Store) inside a transaction the caller holds (``store.read()`` or
    ``store.write()``)."""

    def __init__(self, store):
        self.executions_db = store.db["executions"]
        self.pools_db = store.db["pools"]
        self.leases_db = store.db["leases"]

    def executions(self, txn: lmdb.Transaction) -> Iterator[tuple[str, ExecutionRecord]]:
        """Every execution's record, by id."""
        for key, value in txn.cursor(db=self.executions_db):
            yield key.decode(), ExecutionRecord.unpack(value)

    def put_execution(self, txn: lmdb.Transaction, eid: str, rec: ExecutionRecord) -> None:
        txn.put(eid.encode(), rec.pack(), db=self.executions_db)

    def delete_execution(self, txn: lmdb.Transaction, eid: str) -> None:
        txn.delete(eid.encode(), db=self.executions_db)

    def pool(self, txn: lmdb.Transaction, name: str) -> PoolRecord | None:
        raw = txn.get(name.encode(), db=self.pools_db)
        return None if raw is None else PoolRecord.unpack(raw)

    def put_pool(self, txn: lmdb.Transaction, name: str, pool: PoolRecord) -> None:
        txn.put(name.encode(), pool.pack(), db=self.pools_db)

    def delete_pool(self, txn: lmdb.Transaction, name: str) -> None:
        txn.delete(name.encode(), db=self.pools_db)

    def pools(self, txn: lmdb.Transaction) -> Iterator[tuple[str, PoolRecord]]:
        """Every pool, by name."""
        for key, value in txn.cursor(db=self.pools_db):
            yield key.decode(), PoolRecord.unpack(value)

    def member(self, txn: lmdb.Transaction, execution: str) -> Member | None:
        raw = txn.get(execution.encode(), db=self.leases_db)
        return None if raw is None else Member.unpack(execution, raw)

    def put_member(self, txn: lmdb.Transaction, member: Member) -> None:
        txn.put(member.execution.encode(), member.pack(), db=self.leases_db)

    def delete_member(self, txn: lmdb.Transaction, execution: str) -> None:
        txn.delete(execution.encode(), db=self.leases_db)

    def members(self, txn: lmdb.Transaction, pool: str | None = None) -> Iterator[Member]:
        """Every member, or those of ``pool``, by execution id.  A member's id is
        ``<pool>-<8 hex>`` (rametfs.protocol.member_name), so a pool's members are read from
        the keys starting with ``<pool>-`` alone (and those of pools named ``<pool>-...``,
        left out by their record's pool)."""
        prefix = b"" if pool is None else f"{pool}-".encode()
        cursor = txn.cursor(db=self.leases_db)
        if not cursor.set_range(prefix):
            return
        for key, value in cursor:
            if not key.startswith(prefix):
                return
            member = Member.unpack(key.decode(), value)
            if pool is None or member.pool == pool:
                yield member
