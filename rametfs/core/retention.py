"""The retention rule of ``forget``: which snapshots a policy keeps, and why (both modes).

The model is restic's ``forget`` (restic-forget(1), "Removing snapshots according to a
policy" in restic's manual), on the rules that fit a workspace store:

* ``keep_last`` N: the N newest snapshots (by ``created_ns``, newest first; restic's
  ``--keep-last``);
* ``keep_within`` DURATION: every snapshot younger than DURATION counted back from the
  **newest snapshot's** time, not from the clock (restic's rule since 0.10: a store nobody
  promoted to for a month does not lose everything at once); kept when its time is after
  that cutoff, as restic keeps ``Time.After(cutoff)``;
* ``keep_name`` PATTERN: every snapshot that a name matching the glob PATTERN points at
  (restic's ``--keep-tag``; ``fnmatch.fnmatchcase``: ``*`` also matches ``/``).

A snapshot any rule keeps is kept (the rules add up, as restic's do), and so is every
snapshot in use (``uses``: an execution's base or head, a pool's base), which ``rm`` refuses
too.  An empty policy is EINVAL, as restic refuses to forget "everything" by accident.

The rule is pure: it reads no clock and no store.  rametfs.core.lifecycle.forget_snapshots
applies it inside one write transaction.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .. import protocol
from ..errors import InvalidArgument
from ..protocol import Duration  # the calendar duration of --keep-within

__all__ = ["Duration", "Plan", "Policy", "plan", "policy_of"]

@dataclass(frozen=True)
class Policy:
    """What ``forget`` keeps: the module's rules; None leaves a rule out."""

    keep_last: int | None = None
    keep_within: Duration | None = None
    keep_name: str | None = None

    def __post_init__(self) -> None:
        if self.keep_last is None and self.keep_within is None and self.keep_name is None:
            raise InvalidArgument("forget: give at least one of --keep-last, --keep-within, "
                                  "--keep-name (forgetting everything is rm's job)")
        if self.keep_last is not None and self.keep_last < 1:
            raise InvalidArgument(f"forget: --keep-last must be at least 1, not "
                                  f"{self.keep_last}")


def policy_of(command: protocol.Forget) -> Policy:
    """The policy of a ``forget`` command (its values checked by rametfs.protocol);
    InvalidArgument (EINVAL) for none at all."""
    return Policy(command.keep_last, command.keep_within, command.keep_name)


@dataclass(frozen=True)
class Plan:
    """What a policy does to a list of snapshots: ``keep`` maps each kept id to its reasons
    (``"last 3"``, ``"within 7d"``, ``"name main"``, ``"base of execution e1"``, ...), in the
    order of the rules; ``forget`` the other ids; both newest first."""

    keep: dict[str, list[str]]
    forget: list[str]


def plan(snapshots: Iterable[tuple[str, int]], names: Mapping[str, str],
         uses: Mapping[str, list[str]], policy: Policy) -> Plan:
    """Apply ``policy`` to ``snapshots``, ``(id, created_ns)`` pairs in any order (ties of
    time are broken by id, so the plan is the same every time); ``names`` maps each snapshot
    name to the id it points at, ``uses`` each id in use to why (always kept).  Pure: no
    clock, no store."""
    ordered = sorted(snapshots, key=lambda s: (s[1], s[0]), reverse=True)
    cutoff = (policy.keep_within.before(ordered[0][1])
              if ordered and policy.keep_within is not None else None)
    named: dict[str, list[str]] = {}
    if policy.keep_name is not None:
        for name, sid in sorted(names.items()):
            if fnmatch.fnmatchcase(name, policy.keep_name):
                named.setdefault(sid, []).append(f"name {name}")
    keep: dict[str, list[str]] = {}
    forget: list[str] = []
    for rank, (sid, created_ns) in enumerate(ordered):
        why = []
        if policy.keep_last is not None and rank < policy.keep_last:
            why.append(f"last {policy.keep_last}")
        if cutoff is not None and created_ns > cutoff:
            why.append(f"within {policy.keep_within}")
        why += named.get(sid, []) + list(uses.get(sid, ()))
        if why:
            keep[sid] = why
        else:
            forget.append(sid)
    return Plan(keep, forget)
