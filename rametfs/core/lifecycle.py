"""Snapshot lifecycle for both modes: forgetting snapshot records (``rm``).

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

from collections.abc import Iterable

from ..errors import Busy
from ..store import Store
from ..store.catalog import Catalog


def remove_snapshots(store: Store, refs: Iterable[str], force: bool,
                     executions: Iterable[tuple[str, str, str, str]]) -> dict:
    """Forget the snapshots ``refs`` (ids, prefixes or names: Store.snapshot) in one
    transaction, all or none; ``executions`` are ``(id, base id, head id, lower id)`` of every
    execution of the caller's mode (fallback mode: the lower is the head).  Returns the reply
    ``{"ok", "removed": [ids], "names": [names deleted]}``.

    Raises NotFound (ENOENT) for a reference that names nothing, Busy (EBUSY) naming every use
    that refuses it (names only without ``force``).
    """
    wanted = {store.snapshot(ref).id: ref for ref in refs}
    executions = list(executions)
    with store.write() as txn:
        names = {n: sid for n, sid in store.names(txn).items() if sid in wanted}
        pools = [(name, rec.base) for name, rec in Catalog(store).pools(txn)
                 if rec.base in wanted]
        uses = []
        for eid, base, head, lower in executions:
            for sid, role in ((base, "base"), (head, "head"), (lower, "lower snapshot")):
                if sid in wanted and (role == "base" or sid != base) and \
                        (role != "lower snapshot" or sid != head):
                    uses.append((sid, f"it is the {role} of execution {eid}", True))
        uses += [(sid, f"it is the base of pool {name}", True) for name, sid in pools]
        uses += [(sid, f"name {name!r} points at it", False) for name, sid in names.items()]
        refused: dict[str, list[str]] = {}
        for sid, why, hard in uses:
            if hard or not force:
                refused.setdefault(sid, []).append(why)
        if refused:
            soft = not any(hard for _, _, hard in uses)
            raise Busy("rm: " + "; ".join(
                f"snapshot {sid[:12]}{'' if wanted[sid] == sid else f' ({wanted[sid]})'}: "
                f"{', '.join(whys)}" for sid, whys in refused.items())
                + (": --force deletes the names" if soft else
                   ": reset the execution onto another snapshot (reset --base or --to), "
                   "release it, or drop the pool, first"))
        for name in names:
            txn.delete(name.encode(), db=store.db["names"])
        for sid in wanted:
            txn.delete(bytes.fromhex(sid), db=store.db["snapshots"])
    return {"ok": True, "removed": sorted(wanted), "names": sorted(names)}

