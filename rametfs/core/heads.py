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

from .. import protocol
from ..errors import InvalidArgument

RESET = "reset"


def reset_target(args: dict[str, str], base: str, head: str) -> str:
    """The snapshot a ``reset`` command with ``args`` takes an execution whose base and head
    are the snapshot ids ``base`` and ``head`` to: the one given with ``--to`` (an id or a
    prefix, which the caller's store resolves: ENOENT unknown), the base for ``--base yes``,
    else the head.

    Raises InvalidArgument (EINVAL) for ``--base`` other than yes or no, or with ``--to``.
    """
    to_base = protocol.yes_no(RESET, "base", args.get("base"))
    to = args.get("to")
    if to is not None and to_base:
        raise InvalidArgument("reset: --to SNAPSHOT and --base yes name two snapshots; "
                              "give one")
    return to if to is not None else base if to_base else head
