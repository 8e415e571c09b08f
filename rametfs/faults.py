"""Fault injection, for the test suite: named sites in the daemon raise when armed.

The daemon's guards (every FUSE handler, every background task) must contain any exception a
bug could raise.  The tests prove it by arming a site and making the daemon reach it: a daemon
served with ``--faults`` (a hidden option of ``rametfs serve``) takes the root control command
``fault <site> [--execution ID] [--count N]``.  Sites:

* ``handler:<name>``: the FUSE handler ``<name>`` (``lookup``, ``write``, ``forget`` ...),
  when a request of execution ``ID`` reaches it (any request without ``--execution``);
* ``task:<name>``: the background task ``<name>`` (``flush``, ``reclaim``, ``leases``,
  ``dead-layers``, ``precreate``, ``refused-pages``), at its next round of work, for
  execution ``ID`` where the task works per execution.

* ``hold:capture``: a promote or checkpoint of execution ``ID`` (any, without
  ``--execution``) waits, its execution frozen, after its plan, until the site is disarmed
  (``--count 0``) or the command is cancelled: a capture a test can rely on to be running.
* ``hold:<name>``: the FUSE handler ``<name>`` waits before it starts, when a request of
  execution ``ID`` (any, without ``--execution``) reaches it, until the site is disarmed:
  a request a test can rely on to be in flight, the kernel waiting for its answer.

An armed ``handler:`` or ``task:`` site raises :class:`InjectedFault` (an ``Exception`` that is neither a
``RametError`` nor an ``OSError``: what a bug raises) at its next ``N`` hits (default 1; 0 disarms it).
Unarmed, :meth:`Faults.check` costs one attribute test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio


class InjectedFault(Exception):
    """The exception an armed site raises."""


@dataclass
class _Armed:
    execution: str | None  # None: any
    count: int
    disarmed: trio.Event = field(default_factory=trio.Event)  # what a hold waits for


class Faults:
    """The armed sites of one daemon."""

    def __init__(self) -> None:
        self.armed: dict[str, _Armed] = {}

    def arm(self, site: str, execution: str | None = None, count: int = 1) -> None:
        """Arm ``site`` for its next ``count`` hits (0 disarms it, and ends its holds)."""
        old = self.armed.pop(site, None)
        if old is not None:
            old.disarmed.set()
        if count > 0:
            self.armed[site] = _Armed(execution, count)

    def _armed(self, site: str, executions: tuple) -> _Armed | None:
        """``site``'s arming if it is armed for any execution, or for one of ``executions``
        (ids, or objects with an ``id``)."""
        if not self.armed:
            return None
        armed = self.armed.get(site)
        ids = [getattr(ex, "id", ex) for ex in executions]
        if armed is None or (armed.execution is not None and armed.execution not in ids):
            return None
        return armed

    async def hold(self, site: str, *executions) -> None:
        """Wait while ``site`` is armed for one of ``executions`` (as :meth:`check`)."""
        armed = self._armed(site, executions)
        if armed is not None:
            await armed.disarmed.wait()

    def check(self, site: str, *executions) -> None:
        """Raise InjectedFault if ``site`` is armed for any execution, or for one of
        ``executions`` (ids, or objects with an ``id``)."""
        armed = self._armed(site, executions)
        if armed is None:
            return
        armed.count -= 1
        if armed.count <= 0:
            del self.armed[site]
        raise InjectedFault(f"fault injected at {site}"
                            + (f" for execution {armed.execution}" if armed.execution else ""))


FAULTS = Faults()
