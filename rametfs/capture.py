"""Promote, checkpoint and diff: an execution's state against its base, in O(changed).

Only copied-up inodes are visited: a directory never copied up is its base subtree, reused by
id (a Merkle tree), so a promote reads and hashes only what changed.  A capture is consistent
at one point in time: the caller holds the execution's mutations (``Execution.frozen``) while
it runs, so the plan taken on the trio thread and the pages hashed in worker threads agree.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field

import blake3
import trio

from . import overlay as ov
from .overlay import Execution, Node, Overlay, assemble
from .store import EMPTY_CONTENT, FLAG_HAS_LINKS, PAGE_SIZE, Entry, Snapshot, Store
from .store.writer import ChunkWriter
from .store.format import link_key


@dataclass
class _FileJob:
    """A file whose content must be rebuilt from base chunks and upper pages."""

    size: int
    pages: frozenset[int]
    base_limit: int
    base: Entry | None
    upper_path: str
    content: bytes = b""


@dataclass
class _DirPlan:
    node: Node
    children: list = field(default_factory=list)  # (name, Entry | _DirPlan | (Node, _FileJob))


def _hash_file(store: Store, writer: ChunkWriter, job: _FileJob) -> None:
    """Chunk, hash and store the content of one changed file (blocking; a worker thread)."""
    base_ids: list[bytes] = []
    base_size = 0
    if job.base is not None and job.base.ref != EMPTY_CONTENT:
        base_size, base_ids = store.content(job.base.ref)
    try:
        fd = os.open(job.upper_path, os.O_RDONLY)
    except FileNotFoundError:
        fd = None

    def read_base(o: int, n: int) -> bytes:
        page = o // PAGE_SIZE
        data = store.chunk(base_ids[page]) if page < len(base_ids) else b""
        return data[o - page * PAGE_SIZE: o - page * PAGE_SIZE + n]

    def read_upper(o: int, n: int) -> bytes:
        return os.pread(fd, n, o) if fd is not None else b""

    ids: list[bytes] = []
    try:
        for page in range(-(-job.size // PAGE_SIZE)):
            start = page * PAGE_SIZE
            stop = min(start + PAGE_SIZE, job.size)
            if (page not in job.pages and stop <= job.base_limit and page < len(base_ids)
                    and stop == min(start + PAGE_SIZE, base_size)):
                ids.append(base_ids[page])
            else:
                ids.append(writer.add(assemble(start, stop, job.pages, job.base_limit,
                                               read_base, read_upper)))
    finally:
        if fd is not None:
            os.close(fd)
    job.content = writer.put_content(job.size, ids)


def _has_upper_links(overlay: Overlay, ex: Execution) -> bool:
    prefix = link_key(ex.layer, 0)[:8]
    with overlay.store.read() as txn:
        cur = txn.cursor(db=overlay.store.db["links"])
        return cur.set_range(prefix) and cur.key().startswith(prefix)


def _link_of(ex: Execution, node: Node) -> int:
    u = node.upper
    if u.nlink < 2:
        return 0
    if u.base is not None and u.base.link:
        return u.base.link
    seed = f"{ex.id}/{ex.layer}/{node.ino}".encode()
    return int.from_bytes(blake3.blake3(seed).digest()[:8], "big") >> 1


class Capture:
    """One promote or checkpoint of ``ex``: ``plan()`` (sync), ``hash()`` (threads), ``commit()``."""

    def __init__(self, overlay: Overlay, ex: Execution):
        self.overlay = overlay
        self.ex = ex
        self.jobs: dict[int, _FileJob] = {}  # ino -> job: hard links share one
        self.writer = ChunkWriter(overlay.store)
        self.descend_links = False

    def plan(self) -> _DirPlan:
        """Walk the copied-up part of the execution; must run without an await in between."""
        self.overlay.flush_view(self.ex)
        self.descend_links = _has_upper_links(self.overlay, self.ex)
        return self._plan_dir(self.overlay.node(self.ex.root_ino))

    def _plan_dir(self, node: Node) -> Entry | _DirPlan:
        if node.upper is None and not (self.descend_links and node.entry.flags & FLAG_HAS_LINKS):
            return node.entry
        plan = _DirPlan(node)
        for name, child in self.overlay.listdir(node.ino):
            if child.is_dir:
                plan.children.append((name, self._plan_dir(child)))
            elif child.upper is None:
                plan.children.append((name, child.entry))
            elif stat.S_ISREG(child.upper.mode) and not self.overlay.base_only(child):
                job = self.jobs.get(child.ino)
                if job is None:
                    job = self.jobs[child.ino] = _FileJob(
                        child.upper.size, frozenset(self.overlay._pages(child)),
                        child.upper.base_limit, child.upper.base,
                        self.overlay._upper_path(self.ex, child.ino))
                plan.children.append((name, (child, job)))
            else:
                plan.children.append((name, (child, None)))
        return plan

    async def hash(self) -> None:
        """Hash and store the changed files on every core."""
        limiter = trio.CapacityLimiter(os.cpu_count() or 2)
        async with trio.open_nursery() as nursery:
            for job in self.jobs.values():
                nursery.start_soon(lambda j=job: trio.to_thread.run_sync(
                    _hash_file, self.overlay.store, self.writer, j, limiter=limiter))

    def _entry(self, txn, name: bytes, item) -> Entry:
        if isinstance(item, Entry):
            return item.renamed(name)
        if isinstance(item, _DirPlan):
            entries = [self._entry(txn, n, c) for n, c in item.children]
            tid = self.overlay.store.put_tree(txn, entries)
            u = item.node.upper or ov.UpperInode.from_entry(item.node.entry)
            has_links = any(e.link or e.flags & FLAG_HAS_LINKS for e in entries)
            return Entry(name, u.mode, u.uid, u.gid, u.mtime_ns, 0, tid,
                         tuple(sorted(u.xattrs.items())), 0,
                         2 + sum(1 for e in entries if e.is_dir),
                         FLAG_HAS_LINKS if has_links else 0)
        node, job = item
        u = node.upper
        if job is not None:
            ref, size = job.content, u.size
        elif stat.S_ISREG(u.mode):
            ref, size = (u.base.ref if u.base else EMPTY_CONTENT), u.size
        elif stat.S_ISLNK(u.mode):
            ref, size = u.target, 0
        else:
            ref, size = b"", u.rdev
        link = _link_of(self.ex, node)
        return Entry(name, u.mode, u.uid, u.gid, u.mtime_ns, size, ref,
                     tuple(sorted(u.xattrs.items())), link, u.nlink if link else 1)

    def commit(self, plan: Entry | _DirPlan, parents: list[str], label: str, message: str,
               started_ns: int) -> Snapshot:
        """Store the trees and the snapshot record in one transaction."""
        store = self.overlay.store
        stats = {"changed_files": len(self.jobs), "new_chunks": self.writer.new_chunks,
                 "new_chunk_bytes": self.writer.new_bytes}
        with store.write() as txn:
            root = self._entry(txn, b"", plan)
            stats.update(store.tree_totals(txn, root.ref))
            stats["capture_ms"] = round((time.monotonic_ns() - started_ns) / 1e6, 3)
            return store.put_snapshot(txn, root, parents, label, message,
                                      f"execution:{self.ex.id}", stats)


async def capture(overlay: Overlay, ex: Execution, label: str, message: str) -> Snapshot:
    """Turn the current state of ``ex`` into a new snapshot whose parent is ``ex.head``.

    Mutations of ``ex`` wait while this runs (a consistent point in time).  Raises NoSpace
    (ENOSPC) or IntegrityError (EIO); nothing is listed unless the whole snapshot is stored.
    """
    started = time.monotonic_ns()
    ex.frozen = trio.Event()
    try:
        cap = Capture(overlay, ex)
        plan = cap.plan()
        await cap.hash()
        snap = cap.commit(plan, [ex.head], label, message, started)
        await trio.to_thread.run_sync(overlay.store.sync)
        return snap
    finally:
        frozen, ex.frozen = ex.frozen, None
        frozen.set()


def diff(overlay: Overlay, ex: Execution) -> list[tuple[str, bytes]]:
    """What changed against the base: ``[(letter, path)]`` with ``A`` added, ``M`` modified,
    ``D`` deleted, paths relative to the execution root (directories end in ``/``), sorted.
    """
    out: list[tuple[str, bytes]] = []
    descend_links = _has_upper_links(overlay, ex)

    def base_paths(entry: Entry, path: bytes):
        yield path + (b"/" if entry.is_dir else b"")
        if entry.is_dir:
            for name, child in overlay.tree(entry.ref).items():
                yield from base_paths(child, path + b"/" + name)

    def node_paths(node: Node, path: bytes):
        yield path + (b"/" if node.is_dir else b"")
        if node.is_dir:
            for name, child in overlay.listdir(node.ino):
                yield from node_paths(child, path + b"/" + name)

    def changed(node: Node, b: Entry) -> bool:
        u = node.upper
        if u is None:
            return node.entry != b
        same_owner = (u.mode == b.mode and u.uid == b.uid and u.gid == b.gid
                      and tuple(sorted(u.xattrs.items())) == b.xattrs)
        if b.is_dir:  # its mtime moves with every change inside: not a change of its own
            return not same_owner
        same_attrs = same_owner and u.mtime_ns == b.mtime_ns
        if b.is_symlink:
            return not same_attrs or u.target != b.ref
        if b.is_reg:
            return (not same_attrs or u.base is None or u.base.ref != b.ref
                    or not overlay.base_only(node))
        return not same_attrs or u.rdev != b.size

    def walk(node: Node, base: Entry, path: bytes) -> None:
        if node.upper is None and not (descend_links and base.flags & FLAG_HAS_LINKS):
            return
        base_entries = overlay.tree(base.ref)
        current = dict(overlay.listdir(node.ino))
        for name in sorted(set(base_entries) | set(current)):
            b, c = base_entries.get(name), current.get(name)
            p = path + name
            if c is None:
                out.extend(("D", x) for x in base_paths(b, p))
            elif b is None:
                out.extend(("A", x) for x in node_paths(c, p))
            elif c.is_dir and b.is_dir:
                if changed(c, b):
                    out.append(("M", p + b"/"))
                walk(c, b, p + b"/")
            elif c.is_dir != b.is_dir or stat.S_IFMT(c.mode) != stat.S_IFMT(b.mode):
                out.extend(("D", x) for x in base_paths(b, p))
                out.extend(("A", x) for x in node_paths(c, p))
            elif changed(c, b):
                out.append(("M", p))

    walk(overlay.node(ex.root_ino), ex.base.root, b"")
    return out


async def root_entry(overlay: Overlay, ex: Execution) -> Entry:
    """The root entry a promote of ``ex`` would make now (its ``ref`` the root tree id),
    recording no tree and no snapshot; changed files are re-chunked and their chunks stored,
    as a promote stores them.  Mutations of ``ex`` wait while this runs."""
    ex.frozen = trio.Event()
    try:
        cap = Capture(overlay, ex)
        plan = cap.plan()
        await cap.hash()
        txn = overlay.store.env.begin(write=True)
        try:
            return cap._entry(txn, b"", plan)
        finally:
            txn.abort()  # the trees were only needed for their ids
    finally:
        frozen, ex.frozen = ex.frozen, None
        frozen.set()
