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
from ..store.trees import subtree_paths
from ..treewalk import preorder

Trees = Callable[[bytes], dict[bytes, Entry]]


def _changed(current: Entry, base: Entry) -> bool:
    same_owner = (current.mode == base.mode and current.uid == base.uid
                  and current.gid == base.gid and current.xattrs == base.xattrs)
    if base.is_dir:
        return not same_owner
    return (not same_owner or current.mtime_ns != base.mtime_ns or current.ref != base.ref
            or current.size != base.size)


def diff_trees(base: Entry, current: Entry, tree: Trees) -> list[tuple[str, bytes]]:
    """``[(letter, path)]`` from root entry ``base`` to root entry ``current``; ``tree(id)``
    gives a directory's entries by name (either side)."""
    out: list[tuple[str, bytes]] = []

    def pairs(item: tuple[Entry, Entry, bytes]) -> Iterator[tuple[Entry, Entry, bytes]]:
        """Compare one pair of directories; yields the pairs below to compare in turn (the
        walk does so before this one goes on)."""
        b, c, path = item
        if b.ref == c.ref:
            return
        old, new = tree(b.ref), tree(c.ref)
        for name in sorted(old.keys() | new.keys()):
            be, ce = old.get(name), new.get(name)
            p = path + name
            if ce is None:
                out.extend(("D", x) for x in subtree_paths(be, p, tree))
            elif be is None:
                out.extend(("A", x) for x in subtree_paths(ce, p, tree))
            elif be.is_dir and ce.is_dir:
                if _changed(ce, be):
                    out.append(("M", p + b"/"))
                yield be, ce, p + b"/"
            elif stat.S_IFMT(be.mode) != stat.S_IFMT(ce.mode):
                out.extend(("D", x) for x in subtree_paths(be, p, tree))
                out.extend(("A", x) for x in subtree_paths(ce, p, tree))
            elif _changed(ce, be):
                out.append(("M", p))

    for _ in preorder([(base, current, b"")], pairs):
        pass
    return out
