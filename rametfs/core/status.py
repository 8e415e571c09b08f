"""The status both modes serve (docs/protocol.md, "Status files"): the harness's root status
and each execution's record, with the same keys in both modes, built here from the values
each mode has.  A value a mode does not have is None: fallback mode tracks no upper bytes
or inodes, charges no capture, runs no FUSE adapter and binds no ``snapshots/``; FUSE mode
copies no files (``copy_method``).  The pool fields are rametfs.core.pools'
(``Pools.member_json``, ``Pools.to_json``); a verification's record and the reason it
quarantines an execution are here (``verification_json``, ``quarantine_reason``,
``failure_reason``).

Drivers: rametfs.control (the daemon's ``.ramet/status`` and ``status`` command) and
rametfs.fallback.executions (``Fallback.status``, ``Fallback.execution_status``).
"""

from __future__ import annotations

import os

from .. import protocol
from ..authority import Access
from ..treewalk import Steps, mapped_steps, run_steps
from ..version import __version__
from . import policy

FUSE, FALLBACK = "fuse", "fallback"  # the modes, as ``"mode"`` names them
# what an execution is doing, besides its pool state (ready, leased, quarantined)
PROMOTING, FAILED = "promoting", "failed"
MAX_REASON_PATHS = 5  # differences a quarantine reason names


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


# -- verifications and quarantine reasons, as both modes report them ------------------------

def verification_json(mode: str, root: str, base_root: str,
                      differences: list[tuple[str, bytes]], verify_ms: float) -> dict:
    """A verification as replies carry it: ``{"mode", "equal", "root", "base_root",
    "verify_ms", "differences": [[letter, path], ...]}``; ``root`` the tree id (hex) the
    execution holds, ``base_root`` its base's, ``differences`` as ``diff`` gives them (paths
    decoded as os.fsdecode does), ``verify_ms`` milliseconds."""
    return run_steps(verification_json_steps(mode, root, base_root, differences, verify_ms))


def verification_json_steps(mode: str, root: str, base_root: str,
                            differences: list[tuple[str, bytes]], verify_ms: float
                            ) -> Steps[dict]:
    """:func:`verification_json` as steps (rametfs.treewalk.run_steps), one per difference."""
    decoded = yield from mapped_steps(lambda d: [d[0], os.fsdecode(d[1])], differences)
    return {"mode": mode, "equal": not differences, "root": root, "base_root": base_root,
            "verify_ms": verify_ms, "differences": decoded}


def quarantine_reason(verification: dict) -> str:
    """Why ``verification`` (:func:`verification_json`) quarantines an execution, naming at
    most :data:`MAX_REASON_PATHS` differences (quoted as ``.ramet/diff`` quotes them); empty
    when it found the execution equal to its base."""
    differences = verification["differences"]
    if not differences:
        return ""
    shown = ", ".join(f"{letter} {protocol.quote_path(os.fsencode(path))}"
                      for letter, path in differences[:MAX_REASON_PATHS])
    more = (f" and {len(differences) - MAX_REASON_PATHS} more"
            if len(differences) > MAX_REASON_PATHS else "")
    return f"{verification['mode']} verification: differs from its base ({shown}{more})"


def failure_reason(mode: str, exc: Exception) -> str:
    """Why a verification in ``mode`` that raised ``exc`` (rametfs.core.pools
    .verification_failed: e.g. an upper data file gone unreadable) quarantines the
    execution."""
    return f"{mode} verification failed: {exc}"
