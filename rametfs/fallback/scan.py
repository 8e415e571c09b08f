"""Read an execution's tree as snapshot entries, hashing only what its manifest cannot vouch for.

One walk ``lstat``s every path (there is no FUSE to tell what changed).  A regular file whose
inode, ctime, mtime, mode and size match its manifest record keeps the recorded content id
and xattrs, unread; any other file is read and hashed into chunks (BLAKE3, one page each,
like the importer), on every core, and for a promote its new chunks are stored.  So a scan
costs O(tree) ``lstat`` calls and O(changed) reading and hashing.

A file is read as it is while the scan runs: with writers active the result is not a point
in time.  A record is marked untrusted (hashed again next time) when its file changed while
it was hashed or when its ctime is within :data:`RACY_NS` of the scan, because a later write
in the same timestamp tick would leave size, mtime and ctime as they were (git's "racy clean"
problem).

Blocking: call from a worker thread.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..errors import RametError
from ..longpath import cached, short
from ..store import PAGE_SIZE, Entry, Store
from ..store.chunks import Content, page_id
from ..store.entries import directory_entry, link_id
from ..store.importer import read_xattrs
from ..store.writer import ChunkWriter
from ..store.trees import tree_id
from ..treewalk import postorder, preorder
from .manifest import UNTRUSTED, Record

RACY_NS = 2_000_000_000  # covers coarse timestamps: a jiffy on Linux, 1 s on HFS+, 2 s on FAT


def join(rel: bytes, name: bytes) -> bytes:
    """The relative path of ``name`` inside the directory ``rel`` (``b""``: the root)."""
    return rel + b"/" + name if rel else name


@dataclass
class ScanStats:
    """Counts of one scan: paths ``lstat``ed, files read and hashed, files whose content
    differs from their record, chunks stored (and their bytes, compressed)."""

    scanned: int = 0
    hashed_files: int = 0
    changed_files: int = 0
    new_chunks: int = 0
    new_chunk_bytes: int = 0


@dataclass
class Scan:
    """The tree as read: its root entry, each directory's entries by tree id, and the
    manifest records that describe it (by relative path)."""

    root: Entry
    trees: dict[bytes, list[Entry]]
    records: dict[bytes, Record]
    stats: ScanStats

    def tree(self, store: Store, tid: bytes) -> dict[bytes, Entry]:
        """Entries of tree ``tid`` by name: read here, else from ``store``."""
        entries = self.trees.get(tid)
        return {e.name: e for e in entries} if entries is not None else store.tree(tid)


@dataclass
class _Node:
    st: os.stat_result
    record: Record | None  # the record of this inode, vouching for it or not
    trusted: bool
    xattrs: tuple = ()
    ref: bytes = b""        # content id (file), target (symlink)
    size: int = 0           # bytes (file), rdev (device)
    stable: bool = True     # False: the file changed while it was hashed
    children: dict[bytes, "_Node"] | None = None  # a directory's (an lstat result until visited)


@dataclass
class _Scanner:
    store: Store
    root: bytes
    old: dict[bytes, Record]
    store_contents: bool
    hash_all: bool
    skip: frozenset[bytes] = frozenset()
    stats: ScanStats = field(default_factory=ScanStats)

    def __post_init__(self) -> None:
        self.by_ino = {r.ino: r for r in self.old.values()}
        self.started_ns = time.time_ns()
        self.jobs: dict[int, list[tuple[bytes, _Node]]] = {}  # ino -> its names to hash
        self.groups: dict[int, list[bytes]] = {}  # ino -> its names, for nlink > 1
        self.links: dict[int, tuple[int, int]] = {}  # ino -> (link id, nlink in the tree)
        self.trees: dict[bytes, list[Entry]] = {}
        self.records: dict[bytes, Record] = {}
        self.as_root = os.geteuid() == 0
        self.lock = threading.Lock()
        self.writer = ChunkWriter(self.store) if self.store_contents else None

    def path(self, rel: bytes) -> bytes:
        """The absolute path of ``rel``: maybe longer than PATH_MAX (rametfs.longpath)."""
        return self.root + b"/" + rel if rel else self.root

    # -- the walk ------------------------------------------------------------------------

    def walk(self, st: os.stat_result) -> _Node:
        """The tree from the root (``st`` its lstat), depth first in name order."""
        top = self.visit(b"", st)
        for _ in preorder([(b"", top)], self.below):
            pass
        return top

    def visit(self, rel: bytes, st: os.stat_result) -> _Node:
        """One path's node; a directory's children are listed by :meth:`below`."""
        path = self.path(rel)
        record = self.by_ino.get(st.st_ino)
        trusted = record is not None and not self.hash_all and record.vouches_for(st)
        node = _Node(st, record, trusted)
        self.stats.scanned += 1
        with short(path) as p:
            node.xattrs = record.entry.xattrs if trusted else read_xattrs(p)
            if stat.S_ISDIR(st.st_mode):
                with os.scandir(p) as it:
                    node.children = dict(sorted(
                        (e.name, e.stat(follow_symlinks=False)) for e in it
                        if join(rel, e.name) not in self.skip))
                return node
            if stat.S_ISLNK(st.st_mode):
                node.ref = os.readlink(p)
        if st.st_nlink > 1:
            self.groups.setdefault(st.st_ino, []).append(rel)
        if stat.S_ISREG(st.st_mode):
            if trusted:
                node.ref, node.size = record.entry.ref, record.entry.size
            else:
                self.jobs.setdefault(st.st_ino, []).append((path, node))
        elif not stat.S_ISLNK(st.st_mode):
            node.size = st.st_rdev
        return node

    def below(self, item: tuple[bytes, _Node]) -> Iterator[tuple[bytes, _Node]] | None:
        """Visit the children of a directory's node (listed, as lstat results, by
        :meth:`visit`), replacing each by its node; yields them for the walk."""
        rel, node = item
        if node.children is None:
            return None
        return self._visit_children(rel, node.children)

    def _visit_children(self, rel: bytes, children: dict) -> Iterator[tuple[bytes, _Node]]:
        for name, st in children.items():
            child = children[name] = self.visit(join(rel, name), st)
            yield join(rel, name), child

    # -- hashing -------------------------------------------------------------------------

    def hash(self, names: list[tuple[bytes, _Node]]) -> None:
        """Read, hash (and store) one inode's content; fill in every node naming it."""
        path, node = names[0]
        cid, size, stable = self._content(path, node.st)
        changed = node.record is None or node.record.entry.ref != cid
        with self.lock:
            self.stats.hashed_files += 1
            self.stats.changed_files += changed
        for _, n in names:
            n.ref, n.size, n.stable = cid, size, stable

    def _content(self, path: bytes, st: os.stat_result) -> tuple[bytes, int, bool]:
        # O_NONBLOCK: a fifo put in the file's place meanwhile must not block the open.
        with short(path) as p:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        ids: list[bytes] = []
        size = 0
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                raise RametError(errno.EBUSY,
                                 f"{os.fsdecode(path)} changed while it was scanned: stop "
                                 "what writes in the execution, then try again")
            while page := _read_page(fd):
                ids.append(self.writer.add(page) if self.writer else page_id(page))
                size += len(page)
                if len(page) < PAGE_SIZE:
                    break
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if self.writer:
            cid = self.writer.put_content(size, ids)
        else:
            cid = Content.from_pages(size, ids).id
        stable = _same(st, before) and _same(before, after) and after.st_size == size
        return cid, size, stable

    # -- entries and records -------------------------------------------------------------

    def number_links(self) -> None:
        """Give each hard-linked inode a link id: its record's, else one from its first path
        (as the importer does, so an unchanged tree keeps its tree ids)."""
        used: set[int] = set()
        for ino, names in self.groups.items():
            if len(names) < 2:
                continue  # its other names are outside the tree
            record = self.by_ino.get(ino)
            link = record.entry.link if record is not None else 0
            if not link or link in used:
                link = link_id(b"/" + names[0])
            used.add(link)
            self.links[ino] = (link, len(names))

    def build(self, top: _Node) -> Entry:
        """The root entry of the tree walked (``top`` its node), bottom-up: each directory's
        tree in :attr:`trees`, each path's record in :attr:`records` (children first)."""
        def children(item: tuple[bytes, bytes, _Node]) -> list | None:
            rel, _, node = item
            if node.children is None:
                return None
            return [(join(rel, n), n, c) for n, c in node.children.items()]

        def combine(item: tuple[bytes, bytes, _Node], entries: list[Entry] | None) -> Entry:
            return self._entry(*item, entries)

        return postorder((b"", b"", top), children, combine)

    def _entry(self, rel: bytes, name: bytes, node: _Node, entries: list[Entry] | None
               ) -> Entry:
        st = node.st
        uid, gid = self._owner(rel, node)
        if entries is not None:
            tid = tree_id(entries)
            self.trees[tid] = entries
            entry = directory_entry(entries, tid, st.st_mode, uid, gid, st.st_mtime_ns,
                                    node.xattrs, name)
        else:
            link, nlink = self.links.get(st.st_ino, (0, 1))
            entry = Entry(name, st.st_mode, uid, gid, st.st_mtime_ns, node.size, node.ref,
                          node.xattrs, link, nlink)
        self.records[rel] = Record(entry, st.st_ino, self._ctime(node))
        return entry

    def _owner(self, rel: bytes, node: _Node) -> tuple[int, int]:
        # Without root nothing can be chowned: a path keeps the owner its record (by inode,
        # else by path) gave it, so a scan does not see every file as changed.
        if self.as_root:
            return node.st.st_uid, node.st.st_gid
        record = node.record or self.old.get(rel)
        if record is None:
            return node.st.st_uid, node.st.st_gid
        return record.entry.uid, record.entry.gid

    def _ctime(self, node: _Node) -> int:
        if node.trusted:
            return node.record.ctime_ns
        if not node.stable or node.st.st_ctime_ns > self.started_ns - RACY_NS:
            return UNTRUSTED
        return node.st.st_ctime_ns


def _read_page(fd: int) -> bytes:
    """Up to one page from ``fd``; short only at the end of the file."""
    data = os.read(fd, PAGE_SIZE)
    while data and len(data) < PAGE_SIZE:
        more = os.read(fd, PAGE_SIZE - len(data))
        if not more:
            break
        data += more
    return data


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == \
        (b.st_ino, b.st_size, b.st_mtime_ns, b.st_ctime_ns)


def scan(store: Store, root: bytes, records: dict[bytes, Record], *,
         store_contents: bool = False, hash_all: bool = False,
         skip: frozenset[bytes] = frozenset()) -> Scan:
    """Read the tree at ``root`` (absolute path) into entries and records.

    ``records`` is the execution's manifest; files it vouches for are not read unless
    ``hash_all``.  With ``store_contents`` the chunks and contents of the files read are
    stored (a promote); trees are returned, not stored.  The relative paths in ``skip`` are
    left out, unread (a policy's ephemeral and rebuildable paths).  Raises OSError when a
    path vanishes or cannot be read, NoSpace (ENOSPC) when the store is full.
    """
    s = _Scanner(store, root, records, store_contents, hash_all, skip)
    with cached():
        top = s.walk(os.lstat(root))
    if s.jobs:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            list(pool.map(s.hash, s.jobs.values()))
    s.number_links()
    root_entry = s.build(top)
    if s.writer:
        s.stats.new_chunks, s.stats.new_chunk_bytes = s.writer.new_chunks, s.writer.new_bytes
    return Scan(root_entry, s.trees, s.records, s.stats)
