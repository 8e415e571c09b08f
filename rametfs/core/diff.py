"""What changed in a tree against its stored base: the one diff of both modes.

The output is ``[(letter, path)]``: ``A`` added, ``D`` deleted, ``M`` modified (a file's
content, mode, owner, mtime or xattrs; a directory's mode, owner or xattrs, not its mtime,
which moves with every change inside); a path whose file type changed is ``D`` then ``A``;
paths are relative to the top, directories end in ``/``, and each directory's names come in
byte order, depth first (what ``.ramet/diff`` and ``rametfs diff`` show).

The base is a stored tree.  The current tree is a :class:`TreeSide`: the daemon's execution
nodes (``rametfs.capture``, answered from metadata, never hashing) or a fallback scan's
entries (:class:`Stored` over the scan's trees).  A side says where content may differ, and
the walk descends only there: a subtree whose id both sides share is skipped unread (a Merkle
tree), so the overlay side costs O(copied-up directories).
"""

from __future__ import annotations

import heapq
import stat
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, TypeVar

from ..store.trees import Entry
from ..treewalk import Steps, done, nested_steps, run_steps

Change = tuple[str, bytes]  # (letter, path)
Trees = Callable[[bytes], Mapping[bytes, Entry]]  # tree id -> its entries by name, in name order
TreeSteps = Callable[[bytes], Steps[Mapping[bytes, Entry]]]  # the same, as steps
# What a diff compares besides content: st_mode, uid, gid, sorted (name, value) xattr pairs,
# mtime in ns (a directory's is not compared).
Attrs = tuple[int, int, int, tuple[tuple[bytes, bytes], ...], int]
T = TypeVar("T")


class TreeSide(Protocol[T]):
    """The current tree of a diff, over items that are entry-like (``item.mode`` is the
    st_mode)."""

    def children(self, directory: T) -> Steps[Mapping[bytes, T]]:
        """The items of a directory by name, in byte order of the names (a stored tree's
        order), as steps (rametfs.treewalk.run_steps)."""

    def attrs(self, item: T) -> Attrs:
        """The item's mode, owner, xattrs and mtime."""

    def differs(self, item: T, base: Entry) -> bool:
        """Whether what ``item`` holds may differ from what ``base`` (of the same file type)
        holds: a file's bytes, a symlink's target, a device's number, or for a directory
        anything below it.  True where unsure: a directory is then walked, a file marked
        ``M``."""


class Stored:
    """:class:`TreeSide` over stored entries, or a scan's not stored yet: ``tree(id)`` gives
    a tree's entries by name, as steps; content differs where the ids (``ref``) or sizes
    differ."""

    def __init__(self, tree: TreeSteps):
        self.tree = tree

    def children(self, directory: Entry) -> Steps[Mapping[bytes, Entry]]:
        return (yield from self.tree(directory.ref))

    @staticmethod
    def attrs(item: Entry) -> Attrs:
        return entry_attrs(item)

    @staticmethod
    def differs(item: Entry, base: Entry) -> bool:
        return item.ref != base.ref or item.size != base.size


def entry_attrs(e: Entry) -> Attrs:
    """The :data:`Attrs` of an entry."""
    return e.mode, e.uid, e.gid, e.xattrs, e.mtime_ns


def _paths_steps(side: TreeSide[T], item: T, path: bytes, letter: str,
                 out: list[Change]) -> Steps[None]:
    """Append ``(letter, p)`` to ``out`` for ``path`` (the path of ``item``) and every path
    below it, depth first in name order, directories ending in ``/``; as steps, one per
    path."""
    def visit(pair: tuple[T, bytes]) -> Iterator[tuple[T, bytes] | None]:
        it, p = pair
        if not stat.S_ISDIR(it.mode):
            out.append((letter, p))
            return
        out.append((letter, p + b"/"))
        for name, c in (yield from side.children(it)).items():
            if stat.S_ISDIR(c.mode):
                yield c, p + b"/" + name
            else:
                out.append((letter, p + b"/" + name))
                yield

    yield from nested_steps((item, path), visit)


def _names(old: Mapping[bytes, object], new: Mapping[bytes, object]) -> Iterator[bytes]:
    """The names of either sorted mapping, in byte order, each once (a merge: sorting the
    union of 500,000 names took 0.8 s in one step)."""
    last = None
    for name in heapq.merge(old, new):
        if name != last:
            yield name
            last = name


def diff_steps(base: Entry, tree: TreeSteps, current: T, side: TreeSide[T],
               out: list[Change] | None = None) -> Steps[list[Change]]:
    """The changes from the root entry ``base`` (``tree`` gives its trees, as steps) to
    the top item ``current`` of ``side``, as steps (rametfs.treewalk.run_steps): one per
    name compared or listed, so a directory of any size is diffed in bounded steps.
    ``out``: the list the changes are added to and returned (a caller's may bound it: only
    its ``append`` and ``extend`` are called); a new one by default."""
    out = [] if out is None else out
    stored = Stored(tree)

    def pairs(item: tuple[Entry, T, bytes]) -> Iterator[tuple[Entry, T, bytes] | None]:
        """Compare one pair of directories (rametfs.treewalk.nested_steps): yields None
        after each name and the pairs below to compare in turn (the walk does so before this
        one goes on)."""
        b, c, path = item
        if not side.differs(c, b):
            return
        old = yield from tree(b.ref)
        new = yield from side.children(c)
        for name in _names(old, new):
            yield
            be, ce = old.get(name), new.get(name)
            p = path + name
            if ce is None:
                yield from _paths_steps(stored, be, p, "D", out)
            elif be is None:
                yield from _paths_steps(side, ce, p, "A", out)
            elif stat.S_IFMT(be.mode) != stat.S_IFMT(ce.mode):
                yield from _paths_steps(stored, be, p, "D", out)
                yield from _paths_steps(side, ce, p, "A", out)
            elif be.is_dir:
                if side.attrs(ce)[:4] != entry_attrs(be)[:4]:  # not the mtime
                    out.append(("M", p + b"/"))
                yield be, ce, p + b"/"
            elif side.attrs(ce) != entry_attrs(be) or side.differs(ce, be):
                out.append(("M", p))

    yield from nested_steps((base, current, b""), pairs)
    return out


def diff_trees(base: Entry, current: Entry, tree: Trees) -> list[Change]:
    """The changes from root entry ``base`` to root entry ``current``; ``tree(id)`` gives a
    directory's entries by name (either side's)."""
    def steps(tid: bytes) -> Steps[Mapping[bytes, Entry]]:
        return done(tree(tid))

    return run_steps(diff_steps(base, steps, current, Stored(steps)))
