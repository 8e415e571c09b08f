"""An execution's base and head, and where a reset takes it: the one rule of both modes.

An execution has two snapshots (git's words in brackets)::

    base ── promote ──> P1 ── promote ──> P2 = head ── writes ──> the tree (work tree)
                          └─ checkpoint ─> C (a snapshot; the head stays at P1)

* its **base**: the snapshot it was created from, fixed for its life (a pool's members: the
  pool's snapshot);
* its **head**: the base at create; a promote makes the new snapshot the head (commit); a
  checkpoint leaves it (a snapshot on the side); ``reset --to S`` makes S the head (``git
  reset --hard S``), ``reset --base`` the base.

``diff``, ``verify`` and ``promote``'s parent all refer to the head; ``reset`` puts the tree
back to it, in O(1) in FUSE mode whatever the target (a fresh upper layer over it).  A pool's
``return`` resets a member to its base, the pool's snapshot, so a pool stays clean.
"""

from __future__ import annotations


def reset_target(to: str | None, to_base: bool, base: str, head: str) -> str:
    """The snapshot a ``reset`` (rametfs.protocol.Reset: ``to``, ``to_base``, never both)
    takes an execution whose base and head are the snapshot ids ``base`` and ``head`` to:
    ``to`` (an id or a prefix, which the caller's store resolves: ENOENT unknown), the base
    for ``--base yes``, else the head."""
    return to if to is not None else base if to_base else head
