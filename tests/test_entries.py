"""One builder of directory entries and hard-link ids (rametfs.store.entries) for the importer,
a promote's capture and fallback's scan: the ids each gave before, bit for bit, and equal ids
from the importer and the scan over the same trees.  (Capture against import, through the
mount: tests/test_depth.py.)"""

from __future__ import annotations

import os
import stat

import pytest

from rametfs.fallback import scan
from rametfs.store import FLAG_HAS_LINKS, Entry, import_tree
from rametfs.store.entries import directory_entry, link_id
from rametfs.store.importer import put_directory
from rametfs.store.trees import tree_id
from test_depth import SHAPES, make_shape

DIR, FILE = stat.S_IFDIR | 0o755, stat.S_IFREG | 0o644
MTIME = 1_500_000_000_987_654_321
CONTENT = bytes(range(32))  # a content id's length; a tree stores it unread


def file(name: bytes, **fields) -> Entry:
    return Entry(name, fields.pop("mode", FILE), 1000, 1000, MTIME, 5, CONTENT, **fields)


def build(make_dir) -> dict[str, Entry]:
    """A tree of every shape a directory entry takes, built bottom-up with ``make_dir(entries,
    mode, uid, gid, mtime_ns, xattrs)``; each directory's entry by path."""
    out: dict[str, Entry] = {}

    def put(path: str, entries: list[Entry], mode: int = DIR, xattrs=()) -> Entry:
        out[path] = make_dir(entries, mode, 1000, 1000, MTIME, xattrs)
        return out[path].renamed(path.rpartition("/")[2].encode())

    empty = put("top/empty", [])
    links = put("top/deep/links", [file(b"h1", link=7, nlink=2), file(b"h2", link=7, nlink=2)])
    deep = put("top/deep", [links, file(b"f")])
    plain = put("top/plain", [file(b"a"), Entry(b"l", stat.S_IFLNK | 0o777, 0, 0, MTIME, 0,
                                                b"a"), Entry(b"p", stat.S_IFIFO | 0o640, 0,
                                                             0, MTIME, 0, b"")])
    put("top", [empty, deep, plain, file(b"z")], stat.S_IFDIR | 0o2775,
        ((b"user.a", b"1"), (b"user.b", b"")))
    return out


# Each directory's (tree id, nlink, flags) as put_directory gave them before the builders were
# one function (rametfs 0.1.0, e38cbc6).
BEFORE = {
    "top": ("fccda7cf1a1ae0a49d9975c4e2eb0eb050eab03552ac0cf1cab647acd6434fc1",
            5, FLAG_HAS_LINKS),
    "top/deep": ("b087dd267a88b53182cc452159d2f655c637a147d0c3342d10bc62b7d8577f63",
                 3, FLAG_HAS_LINKS),
    "top/deep/links": ("70fdbc0b2600525882f51f8e0c68af48b41f858f4f00f011d8194a1a24102fba",
                       2, FLAG_HAS_LINKS),
    "top/empty": ("2ba82451e7edbf091af9674a911051229b0452ba7b9276d5159d482a65517d17",
                  2, 0),
    "top/plain": ("ad4a55ebec771147bdb3edd88e2cd63aba797a6de36f419d9057a4e47988fa54",
                  2, 0),
}


def test_directory_entries_keep_their_tree_ids(store):
    with store.write() as txn:
        stored = build(lambda entries, *attrs: put_directory(store, txn, entries, *attrs))
    unstored = build(lambda entries, *attrs: directory_entry(entries, tree_id(entries),
                                                             *attrs))
    assert {path: (e.ref.hex(), e.nlink, e.flags) for path, e in stored.items()} == BEFORE
    assert unstored == stored
    top = stored["top"]
    assert (top.name, top.mode, top.uid, top.gid, top.mtime_ns, top.size, top.xattrs,
            top.link) == (b"", stat.S_IFDIR | 0o2775, 1000, 1000, MTIME, 0,
                          ((b"user.a", b"1"), (b"user.b", b"")), 0)
    assert directory_entry([], tree_id([]), DIR, 0, 0, 0, name=b"n").name == b"n"


def test_link_ids_keep_their_values():
    # An import's and a scan's (a group's first path), a capture's (execution/layer/inode).
    assert [link_id(seed) for seed in (b"/dir/hl2", b"e/3/17")] == [
        6855861319554116712, 6344799644289602708]


LINKED = {"a/one": b"linked", "a/b/c/deep": b"deep", "lone": b"lone", "z": b"z"}


def make_linked(root) -> None:
    """:data:`LINKED` with hard links: a group of three names across directories, a pair in
    one directory, a link only deep down; mtimes set after (make_shape)."""
    make_shape(root, LINKED)
    os.link(root / "a/one", root / "a/two")
    os.link(root / "a/one", root / "z-three")
    os.link(root / "a/b/c/deep", root / "a/b/c/deeper")
    make_shape(root, {})


@pytest.mark.parametrize("shape", [*sorted(SHAPES), "linked"])
def test_import_and_fallback_scan_give_equal_entries(store, tmp_path, shape):
    src = tmp_path / "src"
    src.mkdir()
    make_linked(src) if shape == "linked" else make_shape(src, SHAPES[shape])
    imported = import_tree(store, src).root
    scanned = scan.scan(store, os.fsencode(src), {})
    assert scanned.root == imported
    for tid, entries in scanned.trees.items():
        assert sorted(store.tree(tid).values(), key=lambda e: e.name) == entries
    if shape == "linked":
        top = store.tree(imported.ref)
        a = store.tree(top[b"a"].ref)
        c = store.tree(store.tree(a[b"b"].ref)[b"c"].ref)
        assert (a[b"one"].link, a[b"one"].nlink) == (link_id(b"/a/one"), 3)
        assert a[b"two"].link == top[b"z-three"].link == a[b"one"].link
        assert (top[b"lone"].link, top[b"lone"].nlink) == (0, 1)
        assert (c[b"deep"].link, c[b"deeper"].link) == (link_id(b"/a/b/c/deep"),) * 2
        assert [e.flags for e in (imported, top[b"a"], a[b"b"])] == [FLAG_HAS_LINKS] * 3
