"""The one diff (rametfs.core.diff) over stored trees, without a mount: its rules, the exact
lines, the subtrees it leaves unread and its steps.  Both modes' diffs through the real mount
are tests/test_client.py's (KNOWN_DIFF, exchanged directories) and tests/test_depth.py's."""

from __future__ import annotations

import stat

from rametfs.core.diff import Stored, diff_steps, diff_trees
from rametfs.store import Entry
from rametfs.store.trees import tree_id
from rametfs.treewalk import done

DIR, FILE, LINK = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644, stat.S_IFLNK | 0o777


class Trees(dict):
    """Trees by id, counting which were read."""

    def __init__(self):
        super().__init__()
        self.read: list[bytes] = []

    def __call__(self, tid: bytes) -> dict[bytes, Entry]:
        self.read.append(tid)  # in name order, as a stored tree decodes
        return {e.name: e for e in sorted(self[tid], key=lambda e: e.name)}

    def dir(self, name: bytes, children: list[Entry], mode: int = DIR, mtime: int = 1,
            xattrs=()) -> Entry:
        tid = tree_id(children)
        self[tid] = children
        return Entry(name, mode, 0, 0, mtime, 0, tid, xattrs)


def file(name: bytes, ref: bytes = b"c1", mtime: int = 1, mode: int = FILE, size: int = 5
         ) -> Entry:
    return Entry(name, mode, 0, 0, mtime, size, ref)


def trees() -> tuple[Trees, Entry, Entry, Entry]:
    """``(trees, base, current, keep)``: two roots differing in each way a diff names, and
    the subtree they share."""
    t = Trees()
    keep = t.dir(b"keep", [file(b"k"), t.dir(b"in", [file(b"i")])])
    base = t.dir(b"", [
        file(b"a"), file(b"b"), file(b"c"), file(b"e"), keep,
        t.dir(b"d", [file(b"x"), t.dir(b"sub", [file(b"y")])]),
        t.dir(b"m", [file(b"z")], mtime=1),
        t.dir(b"o", [], mode=DIR),
        file(b"t"),
        Entry(b"l", LINK, 0, 0, 1, 0, b"a"),
        t.dir(b"gone", [t.dir(b"deep", [file(b"f")])]),
    ])
    current = t.dir(b"", [
        file(b"a", ref=b"c2"),                    # other bytes
        file(b"b", mtime=2),                      # mtime
        file(b"c", mode=stat.S_IFREG | 0o600),    # mode
        file(b"e"), keep,                         # unchanged; the same subtree id
        t.dir(b"d", [t.dir(b"sub", [file(b"y")], mtime=2), file(b"new")]),
        t.dir(b"m", [file(b"z", size=6)], mtime=9),  # a directory's mtime is no change
        t.dir(b"o", [], mode=stat.S_IFDIR | 0o700, xattrs=((b"user.k", b"v"),)),
        t.dir(b"t", [file(b"u")]),               # a file became a directory
        Entry(b"l", LINK, 0, 0, 1, 0, b"b"),     # another target
        t.dir(b"added", [t.dir(b"deep", [file(b"f")])]),
    ])
    return t, base, current, keep


# Names in byte order, depth first: d/new before d/x, the pair d/sub/ compared between them.
EXPECTED = [("M", b"a"), ("A", b"added/"), ("A", b"added/deep/"), ("A", b"added/deep/f"),
            ("M", b"b"), ("M", b"c"), ("A", b"d/new"), ("D", b"d/x"), ("D", b"gone/"),
            ("D", b"gone/deep/"), ("D", b"gone/deep/f"), ("M", b"l"), ("M", b"m/z"),
            ("M", b"o/"), ("D", b"t"), ("A", b"t/"), ("A", b"t/u")]


def test_the_rules_and_the_order():
    t, base, current, _ = trees()
    assert diff_trees(base, current, t) == EXPECTED
    assert diff_trees(base, base, t) == []


def test_a_subtree_both_sides_share_is_not_read():
    t, base, current, keep = trees()
    diff_trees(base, current, t)
    assert keep.ref not in t.read
    sub = {e.name: e for e in t[base.ref]}[b"d"]
    same_sub = {e.name: e for e in t[sub.ref]}[b"sub"]
    assert same_sub.ref not in t.read  # d/sub/ differs only in its mtime: same tree id


def test_one_step_per_name_compared_or_listed():
    """A step per name, so a directory of 500,000 names is no 1 s step (issue 15.3): before,
    a step per directory (6 here)."""
    t, base, current, _ = trees()
    def tree(tid):
        return done(t(tid))

    steps = diff_steps(base, tree, current, Stored(tree))
    count = 0
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            out = stop.value
            break
        count += 1
    assert out == EXPECTED
    # 12 names of the root, 3 of d/ (d/sub/ has the same tree id: not walked), 1 of m/ (o/ is
    # empty, keep/ the same id) and the files listed below added/, gone/ and t/ (1 each)
    assert count == 12 + 3 + 1 + 3
