"""What differs between two snapshot trees, as the FUSE ``.ramet/diff`` reports it.

Both trees are Merkle trees: a subtree with the same id on both sides is skipped unread.  The
rules are those of ``rametfs.capture.diff``: ``A`` added, ``D`` deleted, ``M`` modified
(a file's content, mode, owner, mtime or xattrs; a directory's mode, owner or xattrs, not its
mtime, which moves with every change inside), a path whose type changed is ``D`` then ``A``,
directories end in ``/``, and each directory's names come in byte order, depth first.
"""

from __future__ import annotations

import stat
from collections.abc import Callable, Iterator

from ..store import Entry

Trees = Callable[[bytes], dict[bytes, Entry]]


def _changed(current: Entry, base: Entry) -> bool:
    same_owner = (current.mode == base.mode and current.uid == base.uid
                  and current.gid == base.gid and current.xattrs == base.xattrs)
    if base.is_dir:
        return not same_owner
    return (not same_owner or current.mtime_ns != base.mtime_ns or current.ref != base.ref
            or current.size != base.size)


def _paths(entry: Entry, path: bytes, tree: Trees) -> Iterator[bytes]:
    yield path + (b"/" if entry.is_dir else b"")
    if entry.is_dir:
        for name, child in tree(entry.ref).items():
            yield from _paths(child, path + b"/" + name, tree)


def diff_trees(base: Entry, current: Entry, tree: Trees) -> list[tuple[str, bytes]]:
    """``[(letter, path)]`` from root entry ``base`` to root entry ``current``; ``tree(id)``
    gives a directory's entries by name (either side)."""
    out: list[tuple[str, bytes]] = []

    def walk(b: Entry, c: Entry, path: bytes) -> None:
        if b.ref == c.ref:
            return
        old, new = tree(b.ref), tree(c.ref)
        for name in sorted(old.keys() | new.keys()):
            be, ce = old.get(name), new.get(name)
            p = path + name
            if ce is None:
                out.extend(("D", x) for x in _paths(be, p, tree))
            elif be is None:
                out.extend(("A", x) for x in _paths(ce, p, tree))
            elif be.is_dir and ce.is_dir:
                if _changed(ce, be):
                    out.append(("M", p + b"/"))
                walk(be, ce, p + b"/")
            elif stat.S_IFMT(be.mode) != stat.S_IFMT(ce.mode):
                out.extend(("D", x) for x in _paths(be, p, tree))
                out.extend(("A", x) for x in _paths(ce, p, tree))
            elif _changed(ce, be):
                out.append(("M", p))

    walk(base, current, b"")
    return out
