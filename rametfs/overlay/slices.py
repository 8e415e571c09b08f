"""Long walks on the trio thread, in slices: a walk written as steps
(rametfs.treewalk.Steps) lets every other task run after each :data:`SLICE_S` of it."""

from __future__ import annotations

import time
from typing import TypeVar

import trio

from ..treewalk import Steps

R = TypeVar("R")
SLICE_S = 0.002  # seconds a walk runs on the trio thread before it lets other tasks run


async def in_slices(steps: Steps[R]) -> R:
    """Run a walk written as steps (rametfs.treewalk.run_steps) on the trio thread, letting
    every other task run after each :data:`SLICE_S` of it: a walk over a large tree delays
    other requests by a slice, not by the walk.  Returns the walk's result."""
    deadline = time.perf_counter() + SLICE_S
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
        if time.perf_counter() >= deadline:
            await trio.sleep(0)
            deadline = time.perf_counter() + SLICE_S
