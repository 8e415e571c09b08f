"""Long walks on the trio thread, in slices: a walk written as steps
(rametfs.treewalk.Steps) lets every other task run after each :data:`SLICE_S` of it, and
waits until none can (at most :data:`YIELD_MAX_S`) before its next slice.  An execution's
writes take turns the same way while other requests wait (:func:`take_turn`)."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import trio
import trio.testing

from ..treewalk import Steps

R = TypeVar("R")
SLICE_S = 0.002  # seconds a walk runs on the trio thread before it lets other tasks run
YIELD_MAX_S = 0.010  # seconds a walk waits for the other tasks before its next slice
# Writes of at least this many bytes take turns (take_turn); a smaller one costs the trio
# thread about what any other request does (a LOOKUP or CREATE: 0.05-0.3 ms), and waits in
# the kernel's queue as they do, so small-file work (untar, checkout) is left as it was.
TURN_BYTES = 64 << 10


async def yield_to_requests() -> None:
    """Let every other task run, then wait until none can run and no request is waiting
    to be read (trio's idle point), or :data:`YIELD_MAX_S` passed.

    A plain ``trio.sleep(0)`` gives a request one batch of the run loop between slices, so
    a request whose handler awaits k times waits for k slices of every walk under way (a
    bystander's stat + create + write + unlink round took 36 ms beside a ``.ramet/diff``
    of 50,000 names).  Waiting for the idle point serves requests first; the bound keeps
    a walk going at one slice per :data:`YIELD_MAX_S` under a flood of requests.
    ``wait_all_tasks_blocked`` is trio's public hook for that point (trio.testing; it
    does not touch the clock)."""
    with trio.move_on_after(YIELD_MAX_S):
        await trio.testing.wait_all_tasks_blocked()


async def in_slices(steps: Steps[R]) -> R:
    """Run a walk written as steps (rametfs.treewalk.run_steps) on the trio thread, letting
    every other task run after each :data:`SLICE_S` of it (:func:`yield_to_requests`): a
    walk over a large tree delays other requests by at most a slice, not by the walk.
    Returns the walk's result."""
    deadline = time.perf_counter() + SLICE_S
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
        if time.perf_counter() >= deadline:
            await yield_to_requests()
            deadline = time.perf_counter() + SLICE_S


async def take_turn(turn: trio.Lock, size: int, requests_waiting: Callable[[], bool]) -> None:
    """Before a write of ``size`` bytes of an execution whose turn lock is ``turn``: if it is
    at least :data:`TURN_BYTES` and a request waits to be read (``requests_waiting()``, the
    FUSE device polled) or earlier writes of the same execution wait their turn, wait for
    the lock and then for trio's idle point (:func:`yield_to_requests`), so the requests
    waiting are read first and other executions' run first; one such write of the execution
    goes per idle point, in the order they came.  Otherwise return at once, without a
    checkpoint: a lone writer pays one poll(2).

    Without it, eight processes of one execution writing 1 MiB blocks keep eight 1 MiB
    requests queued in the kernel at all times, and every request of another execution
    waits behind them in the kernel's FIFO for eight writes' handling (docs/concurrency.md,
    "Writes take turns")."""
    if size < TURN_BYTES or not turn.locked() and not requests_waiting():
        return
    async with turn:
        await yield_to_requests()
