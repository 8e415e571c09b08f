"""Depth-first walks over trees as loops over an explicit stack, never recursion.

A tree inside an execution is as deep as its owner makes it (relative ``mkdir`` has no limit),
so a walk that recursed would stop at Python's recursion limit (about 1,000 frames): every
walk over snapshot trees, overlay nodes or real directories uses these two.  The stack holds
one iterator (or one partial result list) per level of the current path, so memory grows with
the tree, not with anything else, and the order is exactly that of the recursive walk.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def preorder(top: Iterable[T], children: Callable[[T], Iterable[T] | None]) -> Iterator[T]:
    """Every item of ``top`` and below it, each before its children (a recursive walk's
    order).  ``children(item)`` gives the items below ``item`` or None for a leaf; it is
    called when the walk resumes after yielding ``item``, so the consumer may act on an item
    before its children are listed, and ``children`` may be a generator that does work as it
    goes (what it does between two children happens in the recursive walk's order)."""
    stack = [iter(top)]
    while stack:
        for item in stack[-1]:
            yield item
            below = children(item)
            if below is not None:
                stack.append(iter(below))
            break
        else:
            stack.pop()


Steps = Generator[None, None, R]  # a walk that yields once per step and returns its result


def run_steps(steps: Steps[R]) -> R:
    """Run a walk written as steps (a generator that yields between steps and returns its
    result) to its end, at once; the daemon runs them in slices instead
    (``rametfs.overlay.in_slices``)."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def postorder(root: T, children: Callable[[T], Iterable[T] | None],
              combine: Callable[[T, list[R] | None], R]) -> R:
    """Fold the tree at ``root`` bottom-up: ``combine(item, results)`` for each item after
    its children, ``results`` their values in order (None for a leaf, whose ``children`` is
    None).  Returns ``root``'s value; combines run in a recursive fold's order."""
    return run_steps(postorder_steps(root, children, lambda item, results:
                                     done(combine(item, results))))


def mapped_steps(fn: Callable[[T], R], items: Iterable[T]) -> Steps[list[R]]:
    """``[fn(item) for item in items]`` as steps, one per item."""
    out = []
    for item in items:
        out.append(fn(item))
        yield
    return out


def done(value: R) -> Steps[R]:
    """A walk of no step returning ``value``: a value at hand where steps are asked for."""
    return value
    yield  # makes this a generator


def postorder_steps(root: T, children: Callable[[T], Iterable[T] | None],
                    combine: Callable[[T, list[R] | None], Steps[R]]) -> Steps[R]:
    """:func:`postorder` as steps: ``combine`` is itself a walk of steps (a generator
    returning the item's value), and the fold yields after each item as well, so a tree of
    any shape is folded in steps bounded by one item's own work."""
    below = children(root)
    if below is None:
        return (yield from combine(root, None))
    stack: list[tuple[T, Iterator[T], list[R]]] = [(root, iter(below), [])]
    while True:
        item, it, done = stack[-1]
        for child in it:
            grand = children(child)
            if grand is None:
                done.append((yield from combine(child, None)))
                yield
            else:
                stack.append((child, iter(grand), []))
                break
        else:
            stack.pop()
            value = yield from combine(item, done)
            if not stack:
                return value
            stack[-1][2].append(value)
            yield


def nested_steps(top: T, visit: Callable[[T], Iterator[T | None]]) -> Steps[None]:
    """A depth-first walk as steps: ``visit(item)`` is a generator that yields None after
    each step of its own work, or an item to visit (wholly, depth first) before it goes on;
    this yields once per step of any visit."""
    stack = [visit(top)]
    while stack:
        try:
            item = next(stack[-1])
        except StopIteration:
            stack.pop()
            continue
        if item is None:
            yield
        else:
            stack.append(visit(item))
