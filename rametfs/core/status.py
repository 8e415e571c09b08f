"""The status both modes serve (docs/protocol.md, "Status files"): the harness's root status
and each execution's record, with the same keys in both modes, built here from the values
each mode has.  A value a mode does not have is None: fallback mode tracks no upper bytes
or inodes, charges no capture, runs no FUSE adapter and binds no ``snapshots/``; FUSE mode
copies no files (``copy_method``).  The pool fields are rametfs.core.pools'
(``Pools.member_json``, ``Pools.to_json``), the quarantine reasons too
(``quarantine_reason``, ``failure_reason``).

Drivers: rametfs.control (the daemon's ``.ramet/status`` and ``status`` command) and
rametfs.fallback.executions (``Fallback.status``, ``Fallback.execution_status``).
"""

from __future__ import annotations

from ..authority import Access
from ..version import __version__
from . import policy

FUSE, FALLBACK = "fuse", "fallback"  # the modes, as ``"mode"`` names them
# what an execution is doing, besides its pool state (ready, leased, quarantined)
PROMOTING, FAILED = "promoting", "failed"


def state(pool_state: str, failed: bool = False, promoting: bool = False) -> str:
    """An execution's ``state``: ``failed`` (marked failed: FUSE mode), else ``promoting``
    (a promote or checkpoint runs on it: FUSE mode), else its pool state."""
    return FAILED if failed else PROMOTING if promoting else pool_state


def execution_view(eid: str, base: str, head: str, state: str, created_ns: int,
                   access: Access, last: dict | None, *, upper_bytes: int | None = None,
                   upper_inodes: int | None = None, captured_bytes: int | None = None
                   ) -> dict:
    """What an execution's own status shows: ``{"execution", "id", "base", "head",
    "state", "created_ns", "upper_bytes", "upper_inodes", "captured_bytes", "max_bytes",
    "max_inodes", "last"}``; base and head are snapshot ids, ``upper_*`` what its layer
    holds (bytes, inodes), ``captured_bytes`` what its own promotes stored against
    ``max_bytes`` (bytes), ``last`` its last reply as it may see it."""
    return {"execution": eid, "id": eid, "base": base, "head": head, "state": state,
            "created_ns": created_ns, "upper_bytes": upper_bytes,
            "upper_inodes": upper_inodes, "captured_bytes": captured_bytes,
            "max_bytes": access.max_bytes, "max_inodes": access.max_inodes, "last": last}


def execution_record(view: dict, pool_fields: dict, access: Access, *, mode: str,
                     path: str, policy_record: dict | None, runtime: dict | None,
                     last: dict | None, failure: str | None = None, waiting: int = 0,
                     copy_method: str | None = None) -> dict:
    """An execution's record in the harness's root status (and the ``status`` command's
    reply): ``pool_fields`` (``Pools.member_json``: ``pool``, ``lease``,
    ``quarantine_reason``), its ``view`` (:func:`execution_view`), then ``"failure"`` (why
    it was marked failed), ``"waiting"`` (its requests waiting on its freeze), ``"policy"``
    (where its stored policy came from: rametfs.core.policy.shown), ``"runtime"``,
    ``"last"`` (its whole last reply), ``"path"``, ``"mode"``, ``"copy_method"`` and its
    access settings (``Access.to_json``)."""
    return {**pool_fields, **view, "failure": failure, "waiting": waiting,
            "policy": policy.shown(policy_record), "runtime": runtime, "last": last,
            "path": path, "mode": mode, "copy_method": copy_method, **access.to_json()}


def root_status(*, mode: str, pid: int, data: str, mount: str | None, snapshots: object,
                executions: list[dict], pools: list[dict], last: dict | None,
                copy_method: str | None = None, open_less: bool | None = None,
                snapshots_bind: str | None = None, gc: dict | None = None,
                memory: dict | None = None) -> dict:
    """The harness's root status: ``{"mode", "pid", "data", "mount", "version",
    "copy_method", "open_less", "snapshots_bind", "snapshots", "executions", "pools",
    "last", "gc", "memory"}``, ``version`` rametfs.__version__; ``snapshots`` as given (the
    daemon passes JSON text made already)."""
    return {"mode": mode, "pid": pid, "data": data, "mount": mount, "version": __version__,
            "copy_method": copy_method, "open_less": open_less,
            "snapshots_bind": snapshots_bind, "snapshots": snapshots,
            "executions": executions, "pools": pools, "last": last, "gc": gc,
            "memory": memory}
