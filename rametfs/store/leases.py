"""The records of execution pools and their members (``pools`` and ``leases`` databases).

Shared by the daemon (rametfs.pools) and fallback mode (rametfs.fallback.pools); the layout is
in rametfs.store.format.  Times are wall-clock ns (``time.time_ns``), so a lease end means the
same to every process and across restarts.
"""

from __future__ import annotations

import errno
import os
from dataclasses import asdict, dataclass, field

import msgpack

from ..errors import RametError
from ..protocol import quote_path

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
    record: owner, group, share, control; empty in a record from before them), and the
    persistence policy its members are created with (the record of a
    rametfs.policy.Setting, or None)."""

    base: str
    size: int
    created_ns: int
    access: dict = field(default_factory=dict)
    policy: dict | None = None

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

    def to_json(self) -> dict:
        """The pool fields of an execution's status."""
        return {"pool": self.pool, "state": self.state,
                "lease": self.lease.to_json() if self.lease else None,
                "quarantine_reason": self.reason or None}


NOT_POOLED = {"pool": None, "state": READY, "lease": None, "quarantine_reason": None}


def pool_json(name: str, pool: PoolRecord, members: list[Member]) -> dict:
    """``{"name", "base", "size", "created_ns", "executions", "ready", "leased",
    "quarantined"}``; the last three count ``members`` in each state."""
    counts = {READY: 0, LEASED: 0, QUARANTINED: 0}
    for m in members:
        counts[m.state] += 1
    return {"name": name, "base": pool.base, "size": pool.size, "created_ns": pool.created_ns,
            "executions": [m.execution for m in members], **counts}


def check_policy(name: str, pool: PoolRecord, policy: dict | None) -> None:
    """Raise RametError (EEXIST) when ``policy`` (a policy record given to reattach to
    ``pool``, named ``name``; None: not given) is not the pool's."""
    if policy is not None and policy != pool.policy:
        raise RametError(f"pool {name!r} exists with another persistence policy",
                         errno.EEXIST)


def quarantine_reason(verification: dict) -> str:
    """Why a verification (``{"mode", "differences": [[letter, path], ...], ...}``)
    quarantines an execution, naming at most five differences (quoted as ``.ramet/diff``
    quotes them)."""
    differences = verification["differences"]
    shown = ", ".join(f"{letter} {quote_path(os.fsencode(path))}"
                      for letter, path in differences[:5])
    more = f" and {len(differences) - 5} more" if len(differences) > 5 else ""
    return f"{verification['mode']} verification: differs from its base ({shown}{more})"
