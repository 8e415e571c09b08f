"""Snapshot lifecycle for both modes: forgetting snapshot records (``rm``, and ``forget``
by a retention policy: rametfs.core.retention).

What a snapshot is used by, and so what ``rm`` refuses (EBUSY) or, with ``force``, undoes:

* a **name** pointing at it: ``force`` deletes the name (a git branch deleted with its last
  commit: ``git branch -D``);
* an **execution's base**, **head** or **lower** snapshot, or a **pool's base**: refused even
  with ``force``, as git refuses to delete a branch checked out in a worktree: the
  execution's tree is compared with its head and reset returns to it or to its base
  (rametfs.core.heads), and its layer lies over its lower snapshot until its next reset.
  Reset the execution onto another snapshot, release it, or drop the pool, first.

A snapshot that is only the parent of another is forgotten like any other (restic's
``forget``): its child keeps the parent's id in ``parents`` and ``log`` stops there.  Forgetting
deletes only the snapshot record; its trees, contents and chunks stay until ``gc``
(rametfs.store.gc), as restic's data stays until ``prune``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import Busy
from ..store import Snapshot, Store
from ..store.catalog import Catalog
from . import retention


@dataclass(frozen=True)
class Use:
    """A use of a snapshot that keeps it, even from ``rm --force``: it is the ``role``
    (``"base"``, ``"head"``, ``"lower snapshot"``) of the execution or pool ``owner``
    (``kind``)."""

    snapshot: str
    role: str
    kind: str
    owner: str

    def __str__(self) -> str:
        return f"{self.role} of {self.kind} {self.owner}"


Executions = Iterable[tuple[str, str, str, str]]  # (id, base id, head id, lower id)


def uses(store: Store, txn, executions: Executions) -> list[Use]:
    """Every use of a snapshot by an execution or a pool, read in ``txn``: the bases of the
    ``executions`` (``(id, base id, head id, lower id)``; fallback mode's lower is its head),
    the pools' bases, then the heads that are not their execution's base and the lower
    snapshots that are neither."""
    executions = list(executions)
    found = [Use(base, "base", "execution", eid) for eid, base, _, _ in executions]
    found += [Use(rec.base, "base", "pool", name) for name, rec in Catalog(store).pools(txn)]
    found += [Use(head, "head", "execution", eid) for eid, base, head, _ in executions
              if head != base]
    return found + [Use(lower, "lower snapshot", "execution", eid)
                    for eid, base, head, lower in executions if lower not in (base, head)]


def remove_snapshots(store: Store, refs: Iterable[str], force: bool,
                     executions: Executions) -> dict:
    """Forget the snapshots ``refs`` (ids, prefixes or names: Store.snapshot) in one
    transaction, all or none; ``executions`` as :func:`uses` takes them, every execution of
    the caller's mode.  Returns the reply ``{"ok", "removed": [ids], "names": [names
    deleted]}``.

    Raises NotFound (ENOENT) for a reference that names nothing, Busy (EBUSY) naming every use
    that refuses it (names only without ``force``).
    """
    wanted = {store.snapshot(ref).id: ref for ref in refs}
    with store.write() as txn:
        names = {n: sid for n, sid in store.names(txn).items() if sid in wanted}
        used = [u for u in uses(store, txn, executions) if u.snapshot in wanted]
        why = [(u.snapshot, f"it is the {u}") for u in used]
        if not force:
            why += [(sid, f"name {name!r} points at it") for name, sid in names.items()]
        refused: dict[str, list[str]] = {}
        for sid, text in why:
            refused.setdefault(sid, []).append(text)
        if refused:
            raise Busy("rm: " + "; ".join(
                f"snapshot {sid[:12]}{'' if wanted[sid] == sid else f' ({wanted[sid]})'}: "
                f"{', '.join(whys)}" for sid, whys in refused.items())
                + (": reset the execution onto another snapshot (reset --base or --to), "
                   "release it, or drop the pool, first" if used else
                   ": --force deletes the names"))
        store.delete_records(txn, wanted, names)
    return {"ok": True, "removed": sorted(wanted), "names": sorted(names)}


def forget_snapshots(store: Store, policy: retention.Policy, dry_run: bool,
                     executions: Executions,
                     among: Callable[[Snapshot], bool] | None = None) -> dict:
    """Forget every snapshot (``among``: every one it is true of) that ``policy`` does not
    keep (rametfs.core.retention), with the names pointing at them, in one write
    transaction; every snapshot an execution of ``executions`` (as :func:`uses` takes them)
    or a pool uses is kept.  ``dry_run``: nothing changes.  Returns the reply ``{"ok",
    "dry_run", "kept": [{"snapshot", "reasons"}], "removed": [ids], "names": [names
    deleted]}``, kept and removed newest first."""
    with store.write() as txn:
        considered = [s for s in store.snapshots(txn) if among is None or among(s)]
        used: dict[str, list[str]] = {}
        for use in uses(store, txn, executions):
            used.setdefault(use.snapshot, []).append(str(use))
        all_names = store.names(txn)
        decided = retention.plan([(s.id, s.created_ns) for s in considered], all_names, used,
                                 policy)
        gone = set(decided.forget)
        names = sorted(n for n, sid in all_names.items() if sid in gone)
        if not dry_run:
            store.delete_records(txn, gone, names)
    return {"ok": True, "dry_run": dry_run,
            "kept": [{"snapshot": sid, "reasons": why} for sid, why in decided.keep.items()],
            "removed": decided.forget, "names": names}


def trim_pool(store: Store, execution: str,
              executions: Executions) -> dict | None:
    """After a promote of ``execution``: when it is a member of a pool with ``keep_last``
    N (``pool --keep-last``), forget the pool's promotes but the N newest and the named ones
    (a name is the harness's choice to keep one), as :func:`forget_snapshots` does with
    ``executions``; its reply, or None (not a member, or no ``keep_last``).  The pool's
    promotes are the snapshots whose source is a member's id: ``execution:<pool>-<8 hex>``
    (rametfs.protocol.member_name), members gone included."""
    with store.read() as txn:
        catalog = Catalog(store)
        member = catalog.member(txn, execution)
        pool = None if member is None else catalog.pool(txn, member.pool)
    if pool is None or not pool.keep_last:
        return None
    source = re.compile(rf"execution:{re.escape(member.pool)}-[0-9a-f]{{8}}")
    return forget_snapshots(store, retention.Policy(keep_last=pool.keep_last, keep_name="*"),
                            False, executions, lambda s: source.fullmatch(s.source) is not None)
