"""Long walks on the trio thread, in slices: a walk written as steps
(rametfs.treewalk.Steps) lets every other task run after each :data:`SLICE_S` of it, and
waits until none can (at most :data:`YIELD_MAX_S`) before its next slice."""

from __future__ import annotations

import time
from typing import TypeVar

import trio
import trio.testing

from ..treewalk import Steps

R = TypeVar("R")
SLICE_S = 0.002  # seconds a walk runs on the trio thread before it lets other tasks run
YIELD_MAX_S = 0.010  # seconds a walk waits for the other tasks before its next slice


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
