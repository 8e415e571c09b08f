"""Promote, checkpoint and diff: an execution's state against its base, in O(changed).

Only copied-up inodes are visited: a directory never copied up is its base subtree, reused by
id (a Merkle tree), so a promote reads and hashes only what changed.  A capture is consistent
at one point in time: the execution's mutations wait while it runs (``Overlay.freeze``), and
it runs, so the plan taken on the trio thread and the pages hashed in worker threads agree.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial

import blake3
import trio

from .core import diff as core_diff
from .core import policy
from .errors import Cancelled, NotFound, RametError
from .faults import FAULTS
from .overlay import Execution, Node, Overlay, assemble, in_slices, walk_names
from .store import EMPTY_CONTENT, FLAG_HAS_LINKS, PAGE_SIZE, Entry, Snapshot, Store
from .store.chunks import ContentBuilder, page_count
from .store.entries import directory_entry_steps, link_id
from .store.extents import data_extents, pages_of
from .store.format import UpperInode
from .store.trees import encode_tree_steps
from .store.writer import ChunkWriter
from .treewalk import Steps, nested_steps, postorder_steps, run_steps


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


@dataclass
class _BaseDirPlan:
    """An unchanged base directory some of whose paths a policy leaves out."""

    entry: Entry
    children: list = field(default_factory=list)  # (name, Entry | _BaseDirPlan)


class _Reader:
    """Reads a file's bytes from its base chunks and its upper pages (blocking)."""

    def __init__(self, store: Store, job: _FileJob):
        self.job = job
        self.store = store
        self.base = store.content(job.base.ref if job.base is not None else EMPTY_CONTENT)
        try:
            self.fd = os.open(job.upper_path, os.O_RDONLY) if job.upper_path else None
        except FileNotFoundError:
            self.fd = None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)

    def _read_base(self, o: int, n: int) -> bytes:
        page = o // PAGE_SIZE
        chunk = self.base.chunk(page)
        data = self.store.chunk(chunk) if chunk is not None else b""  # a hole: zeros
        return data[o - page * PAGE_SIZE: o - page * PAGE_SIZE + n]

    def _read_upper(self, o: int, n: int) -> bytes:
        return os.pread(self.fd, n, o) if self.fd is not None else b""

    def page(self, page: int) -> bytes:
        job = self.job
        start = page * PAGE_SIZE
        return assemble(start, min(start + PAGE_SIZE, job.size), job.pages, job.base_limit,
                        self._read_base, self._read_upper)

    def base_chunk(self, page: int) -> bytes | None:
        """The base chunk id of ``page`` when its bytes are untouched, else None."""
        job = self.job
        start = page * PAGE_SIZE
        stop = min(start + PAGE_SIZE, job.size)
        if page not in job.pages and stop <= job.base_limit and \
                stop == min(start + PAGE_SIZE, self.base.size):
            return self.base.chunk(page)
        return None

    def stored_pages(self) -> list[int]:
        """The pages that may hold a byte other than zero, ascending: those of the page
        map, the base's pages holding data below ``base_limit``, and the upper data file's
        data extents from ``base_limit`` on (SEEK_DATA).  Every other page is a hole, so
        this costs what is stored, not the file's size."""
        job = self.job
        npages = page_count(job.size)
        pages = {p for p in job.pages if p < npages}
        below = min(job.base_limit, job.size)
        pages.update(p for p, _ in self.base.pages(page_count(below)))
        if self.fd is not None and below < job.size:
            pages.update(pages_of(data_extents(self.fd, below, job.size)))
        return sorted(pages)


class CancelToken:
    """Cancels a capture from the trio thread: worker threads :meth:`check` it between
    pages, so they stop within a page of work."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self.reason = ""

    def cancel(self, reason: str) -> None:
        self.reason = reason
        self._set.set()

    def check(self) -> None:
        """Raise Cancelled (ECANCELED) once :meth:`cancel` was called."""
        if self._set.is_set():
            raise Cancelled(f"cancelled by {self.reason}")


NO_CANCEL = CancelToken()  # never cancelled


def _hash_file(store: Store, writer: ChunkWriter, job: _FileJob, cancel: CancelToken) -> None:
    """Chunk, hash and store the content of one changed file (blocking; a worker thread):
    only its stored pages are read, the rest are holes; Cancelled once ``cancel`` is."""
    reader = _Reader(store, job)
    content = ContentBuilder()
    try:
        for page in reader.stored_pages():
            cancel.check()
            content.add(page, reader.base_chunk(page) or writer.add(reader.page(page)))
    finally:
        reader.close()
    job.content = writer.put(content.content(job.size))


HASH_BATCH_FILES = 256  # files of one worker thread's batch in a capture's hashing
HASH_BATCH_BYTES = 8 << 20  # bytes (file sizes) past which a batch ends sooner


def _job_batches(jobs: list[_FileJob]) -> Iterator[list[_FileJob]]:
    """``jobs`` in order, in batches of at most :data:`HASH_BATCH_FILES` files and about
    :data:`HASH_BATCH_BYTES` bytes (a bigger file is a batch of its own)."""
    batch: list[_FileJob] = []
    size = 0
    for job in jobs:
        if batch and (len(batch) == HASH_BATCH_FILES or size + job.size > HASH_BATCH_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(job)
        size += job.size
    if batch:
        yield batch


ZERO_RUN = bytes(1 << 20)  # zeros fed to a digest for holes, not allocated per page
CAPTURE_BYTES = 4096  # what a capture's record and trees are counted as, besides its chunks


def _read_pieces(store: Store, job: _FileJob, cancel: CancelToken = NO_CANCEL
                 ) -> Iterator[bytes | memoryview]:
    """A file's bytes in order: each stored page read, holes as views of :data:`ZERO_RUN`
    (blocking); Cancelled once ``cancel`` is."""
    reader = _Reader(store, job)
    zeros = memoryview(ZERO_RUN)
    try:
        pos = 0
        for page in reader.stored_pages():
            start = page * PAGE_SIZE
            for at in range(pos, start, len(ZERO_RUN)):
                cancel.check()
                yield zeros[:min(len(ZERO_RUN), start - at)]
            cancel.check()
            yield reader.page(page)
            pos = min(start + PAGE_SIZE, job.size)
        for at in range(pos, job.size, len(ZERO_RUN)):
            cancel.check()
            yield zeros[:min(len(ZERO_RUN), job.size - at)]
    finally:
        reader.close()


def _file_digest(store: Store, job: _FileJob, cancel: CancelToken) -> str:
    """BLAKE3 (hex) of a file's bytes (blocking): only stored pages are read, but BLAKE3
    (b3sum's digest, rametfs.core.policy.path_digest) hashes every byte of a hole too."""
    h = blake3.blake3()
    for data in _read_pieces(store, job, cancel):
        h.update(data)
    return h.hexdigest()


def _has_upper_links(overlay: Overlay, ex: Execution) -> bool:
    with overlay.store.read() as txn:
        return overlay.store.layers.has_links(txn, ex.layer)


def _link_of(ex: Execution, node: Node) -> int:
    u = node.upper
    if u.nlink < 2:
        return 0
    if u.base is not None and u.base.link:
        return u.base.link
    return link_id(f"{ex.id}/{ex.layer}/{node.ino}".encode())


class Capture:
    """One promote or checkpoint of ``ex``: ``plan()`` (sync), ``hash()`` and
    ``digest_inputs()`` (threads), ``commit()``.  With a policy (rametfs.core.policy
    .apply_steps), ``plan()`` leaves out ephemeral and rebuildable paths and takes shared
    ones from the base."""

    def __init__(self, overlay: Overlay, ex: Execution, cancel: CancelToken = NO_CANCEL):
        self.overlay = overlay
        self.ex = ex
        self.cancel = cancel
        self.jobs: dict[int, _FileJob] = {}  # ino -> job: hard links share one
        self.writer = ChunkWriter(overlay.store)
        self.descend_links = False
        self.applied = policy.Plan(None)  # what the policy makes of the execution
        self.inputs: dict[str, tuple] = {}  # input path -> what to hash (_input_spec)
        self.digests: dict[str, str] = {}

    def plan(self, chosen: policy.Setting | None = None) -> Entry | _DirPlan:
        """Walk the copied-up part of the execution (:meth:`plan_steps`, at once)."""
        return run_steps(self.plan_steps(chosen))

    def plan_steps(self, chosen: policy.Setting | None = None) -> Steps[Entry | _DirPlan]:
        """Walk the copied-up part of the execution, as steps (one per directory); the
        execution stays frozen (``Overlay.freeze``) from here to the commit.

        The policy is the one the harness ``chosen`` (None: none; see :func:`load_policy`).
        Raises InvalidArgument (EINVAL) for a malformed policy, or one this state breaks (a
        changed shared path, an input missing or not kept), naming every offending path.
        """
        yield from self.overlay.flush_steps(self.ex)
        self.descend_links = _has_upper_links(self.overlay, self.ex)
        pol = load_policy(self.overlay, self.ex, chosen)
        self.applied = yield from policy.apply_steps(
            pol, _ViewTree(self.overlay), self.overlay.node(self.ex.root_ino),
            _PolicySide(self.overlay, self.ex))
        self.applied.check()
        for path in self.applied.inputs:
            self.inputs[path] = _input_spec(self.overlay, self.ex, path, self.applied)
        top = yield from self._dir_plan(self.overlay.node(self.ex.root_ino), "")
        if isinstance(top, _DirPlan):
            yield from nested_steps((top, ""), self._fill)
        return top

    def _dir_plan(self, node: Node, path: str) -> Steps[Entry | _DirPlan | _BaseDirPlan]:
        """The plan of directory ``node``: its base entry where never copied up (filtered
        when a left-out path lies below), else a _DirPlan for :meth:`_fill`."""
        if node.upper is None and not (self.descend_links and node.entry.flags & FLAG_HAS_LINKS):
            if path in self.applied.above:
                return (yield from self._filter_base(node.entry, path))
            return node.entry
        return _DirPlan(node)

    def _fill(self, item: tuple[_DirPlan, str]) -> Iterator[tuple[_DirPlan, str] | None]:
        """List the copied-up directory of ``item`` into its plan (rametfs.treewalk
        .nested_steps): yields None after each step of work (a batch of the listing, one
        name) and the plans of its copied-up subdirectories, for the walk to fill in turn."""
        plan, path = item
        for name, child in (yield from self.overlay.listdir_steps(plan.node.ino)):
            yield
            child_path = _join(path, name)
            cls = self.applied.special.get(child_path)
            if cls == policy.SHARED:
                plan.children.append((name, _base_at(self.overlay, self.ex, child_path)))
            elif cls is not None:
                continue  # ephemeral or rebuildable: left out
            elif child.is_dir:
                sub = yield from self._dir_plan(child, child_path)
                plan.children.append((name, sub))
                if isinstance(sub, _DirPlan):
                    yield sub, child_path
            elif child.upper is None:
                plan.children.append((name, child.entry))
            elif stat.S_ISREG(child.upper.mode) and not self.overlay.base_only(child):
                job = self.jobs.get(child.ino)
                if job is None:
                    job = self.jobs[child.ino] = _node_job(self.overlay, self.ex, child)
                plan.children.append((name, (child, job)))
            else:
                plan.children.append((name, (child, None)))

    def _filter_base(self, entry: Entry, path: str) -> Steps[_BaseDirPlan]:
        """An unchanged base directory without its left-out paths (shared ones are equal
        to the base: a changed one stopped the promote), as steps: one per name."""
        def fill(item: tuple[_BaseDirPlan, str]) -> Iterator[tuple[_BaseDirPlan, str] | None]:
            plan, path = item
            for name, child in (yield from self.overlay.tree_steps(plan.entry.ref)).items():
                yield
                child_path = _join(path, name)
                cls = self.applied.special.get(child_path)
                if cls is not None and cls != policy.SHARED:
                    continue
                if cls is None and child.is_dir and child_path in self.applied.above:
                    sub = _BaseDirPlan(child)
                    plan.children.append((name, sub))
                    yield sub, child_path
                else:
                    plan.children.append((name, child))

        top = _BaseDirPlan(entry)
        yield from nested_steps((top, path), fill)
        return top

    async def digest_inputs(self) -> None:
        """Hash the inputs of the recipes this promote stores (worker threads)."""
        for path, spec in self.inputs.items():
            self.digests[path] = await trio.to_thread.run_sync(
                _spec_digest, self.overlay.store, spec, self.cancel)

    async def hash(self) -> None:
        """Hash and store the changed files on every core: one task per core, each handing
        its worker thread a batch of files at a time (:func:`_job_batches`), so 50,000
        changed files cost the trio thread a few hundred hand-offs, not 50,000 tasks
        spawned in one step (0.6 s of the trio thread for 20,000, every other request
        waiting behind it)."""
        batches = _job_batches(list(self.jobs.values()))

        def hash_batch(jobs: list[_FileJob]) -> None:
            for job in jobs:
                _hash_file(self.overlay.store, self.writer, job, self.cancel)

        async def worker() -> None:
            for jobs in batches:  # shared: each batch goes to the first worker free
                await trio.to_thread.run_sync(hash_batch, jobs)

        try:
            async with trio.open_nursery() as nursery:
                for _ in range(os.cpu_count() or 2):
                    nursery.start_soon(worker)
        except BaseExceptionGroup as group:  # the first failure stops them all: report it
            first = group
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None

    def _entry_steps(self, item, trees: _NewTrees | None) -> Steps[Entry]:
        """The root entry of plan ``item``, subtrees first, bottom-up, as steps (one per
        entry, and per ``trees.TREE_STEP`` entries of a directory's encoding); each new tree
        goes to ``trees``, which stores it, or with None only its id is computed (one
        implementation for a promote and for verify's root mode)."""
        def children(pair: tuple[bytes, object]) -> list | None:
            _, it = pair
            return it.children if isinstance(it, (_DirPlan, _BaseDirPlan)) else None

        return postorder_steps((b"", item), children,
                               lambda pair, entries: self._one_entry(trees, *pair, entries))

    def _one_entry(self, trees: _NewTrees | None, name: bytes, item,
                   entries: list[Entry] | None) -> Steps[Entry]:
        """The entry of one plan item; ``entries`` those of a directory's children."""
        if isinstance(item, Entry):
            return item if item.name == name else item.renamed(name)
        if entries is not None:
            u = (UpperInode.from_entry(item.entry) if isinstance(item, _BaseDirPlan)
                 else item.node.upper or UpperInode.from_entry(item.node.entry))
            tid, value = yield from encode_tree_steps(entries)
            if trees is not None:
                yield from trees.add(tid, value, entries)
            return (yield from directory_entry_steps(
                entries, tid, u.mode, u.uid, u.gid, u.mtime_ns, tuple(sorted(u.xattrs.items())),
                name))
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

    def remember_contents(self) -> None:
        """Record in each hashed file's upper inode the content id its bytes hold (while
        the execution is still frozen), so a diff against this capture hashes nothing
        (``UpperInode.content``; stored with the next flush)."""
        for ino, job in self.jobs.items():
            node = self.overlay.nodes.get(ino)
            if node is not None and self.overlay.is_live(node) and node.upper is not None:
                node.upper.content = job.content
                self.overlay._mark_dirty(node)

    async def commit(self, plan: Entry | _DirPlan, parents: list[str], label: str,
                     message: str, started_ns: int) -> Snapshot:
        """Build and store the new trees in slices of the trio thread (``in_slices``, in
        write transactions of at most :data:`TREE_BATCH_BYTES`: :class:`_NewTrees`), then
        record the snapshot (with its recipes) in one short last transaction: the snapshot
        is listed whole or not at all."""
        store = self.overlay.store
        stats = {"changed_files": len(self.jobs), "new_chunks": self.writer.new_chunks,
                 "new_chunk_bytes": self.writer.new_bytes}
        stats.update(self.applied.stats())
        recipes = self.applied.recipes(self.digests)
        trees = _NewTrees(store, self.cancel)
        root = await in_slices(self._entry_steps(plan, trees))
        trees.flush()
        self.cancel.check()
        with store.write() as txn:
            stats.update(store.tree_totals(txn, root.ref))  # one record: tree_stats'
            stats["capture_ms"] = round((time.monotonic_ns() - started_ns) / 1e6, 3)
            return store.put_snapshot(txn, root, parents, label, message,
                                      f"execution:{self.ex.id}", stats, recipes,
                                      self.ex.runtime)


TREE_BATCH_BYTES = 1 << 20  # of encoded trees one write transaction of a capture stores
TREE_BATCH_TREES = 1024  # trees one write transaction of a capture stores at most


class _NewTrees:
    """The trees a capture makes, stored as they are made in write transactions of at most
    :data:`TREE_BATCH_BYTES` (or :data:`TREE_BATCH_TREES` trees; a larger tree alone), each
    short and on the trio thread (LMDB has one writer: a worker thread holding it would
    stall the daemon's own writes), with other tasks running between them.  A tree is
    content-addressed, so one stored by a capture cancelled before its snapshot record is an
    unreferenced record, as its chunks are (docs/format.md, Atomicity): nothing lists it.
    ``totals`` keeps each new tree's ``tree_stats`` for its parents'."""

    def __init__(self, store: Store, cancel: CancelToken):
        self.store = store
        self.cancel = cancel
        self.totals: dict[bytes, list[int]] = {}
        self.pending: list[tuple[bytes, bytes]] = []
        self.pending_bytes = 0

    def add(self, tid: bytes, value: bytes, entries: list[Entry]) -> Steps[None]:
        """Keep tree ``tid`` (``entries`` encoded as ``value``) for storing, with its totals
        (as steps); stores a batch once one is full."""
        if tid in self.totals:
            return
        self.totals[tid] = yield from self.store.totals_steps(entries, self._below)
        self.pending.append((tid, value))
        self.pending_bytes += len(value)
        if self.pending_bytes >= TREE_BATCH_BYTES or len(self.pending) >= TREE_BATCH_TREES:
            self.flush()

    def _below(self, tid: bytes) -> list[int]:
        got = self.totals.get(tid)
        if got is None:  # a base subtree, stored with its totals
            with self.store.read() as txn:
                got = self.store.stored_totals(txn, tid)
        return got

    def flush(self) -> None:
        """Store the trees kept, in one write transaction (subtrees come first: a fold's
        order); Cancelled (ECANCELED) once the capture is."""
        self.cancel.check()
        with self.store.write() as txn:
            for tid, value in self.pending:
                self.store.put_encoded_tree(txn, tid, value, partial(self.totals.get, tid))
        self.pending, self.pending_bytes = [], 0


async def capture(overlay: Overlay, ex: Execution, label: str, message: str,
                  chosen: policy.Setting | None = None, cancel: CancelToken = NO_CANCEL,
                  charged: bool = False) -> Snapshot:
    """Turn the current state of ``ex`` into a new snapshot whose parent is its head.

    The policy applied is the one the harness ``chosen`` (None: none, everything is kept).
    Mutations of ``ex`` wait while this runs (a consistent point in time).  Raises
    InvalidArgument (EINVAL: the policy, see ``Capture.plan``), NoSpace (ENOSPC),
    IntegrityError (EIO), for an execution marked failed RametError (EIO), or Cancelled
    (ECANCELED) once ``cancel`` is (its worker threads stop within a page); nothing is
    listed unless the whole snapshot is stored.  A ``charged`` capture (one the execution
    asked for itself) counts what it stores against the execution's ``--max-bytes``
    (``Overlay.charge``: EDQUOT past it, before the snapshot is recorded).
    """
    started = time.monotonic_ns()
    overlay.check_not_failed(ex)
    with overlay.freeze(ex), overlay.store.gc_guard.writing():  # a gc waits for it
        cap = Capture(overlay, ex, cancel)
        plan = await in_slices(cap.plan_steps(chosen))
        await FAULTS.hold("hold:capture", ex)
        await cap.hash()
        await cap.digest_inputs()
        if charged:
            overlay.charge(ex, cap.writer.added_bytes + CAPTURE_BYTES)
        snap = await cap.commit(plan, [ex.head.id], label, message, started)
        cap.remember_contents()
        await overlay.sync_store()
        return snap


def diff(overlay: Overlay, ex: Execution) -> list[tuple[str, bytes]]:
    """What changed against the head: ``[(letter, path)]`` (rametfs.core.diff's rules),
    paths relative to the execution root; only copied-up directories are read."""
    return run_steps(diff_steps(overlay, ex))


async def diff_in_slices(overlay: Overlay, ex: Execution, out: list | None = None
                         ) -> list[tuple[str, bytes]]:
    """:func:`diff`, in slices of the trio thread (``Overlay.in_slices``), ``ex`` frozen
    meanwhile so it is one point in time; ``out`` as :func:`diff_steps` takes it."""
    with overlay.freeze(ex):
        return await in_slices(diff_steps(overlay, ex, out))


def diff_steps(overlay: Overlay, ex: Execution, out: list | None = None
               ) -> Steps[list[tuple[str, bytes]]]:
    """:func:`diff` as steps (rametfs.treewalk.run_steps): one per name compared or
    listed (rametfs.core.diff.diff_steps); ``out`` as rametfs.core.diff.diff_steps takes
    it."""
    return core_diff.diff_steps(ex.head.root, overlay.tree_steps, overlay.node(ex.root_ino),
                                _NodeSide(overlay, _has_upper_links(overlay, ex)), out)


class _NodeSide:
    """rametfs.core.diff.TreeSide over an execution's nodes, answered from their metadata
    (``Overlay.base_only``), never hashing: only copied-up directories are walked, and with
    a hard-link group copied up (``descend_links``) those holding a hard link too."""

    def __init__(self, overlay: Overlay, descend_links: bool):
        self.overlay = overlay
        self.descend_links = descend_links

    def children(self, directory: Node) -> Steps[Mapping[bytes, Node]]:
        return dict((yield from self.overlay.listdir_steps(directory.ino)))

    @staticmethod
    def attrs(node: Node) -> core_diff.Attrs:
        u = node.upper
        if u is None:
            return core_diff.entry_attrs(node.entry)
        return u.mode, u.uid, u.gid, tuple(sorted(u.xattrs.items())), u.mtime_ns

    def differs(self, node: Node, base: Entry) -> bool:
        u = node.upper
        if u is None:  # its base entry (maybe another name's of its link group)
            e = node.entry
            if e.is_dir and self.descend_links and e.flags & FLAG_HAS_LINKS:
                return True  # a name of a group copied up elsewhere may lie below
            return core_diff.Stored.differs(e, base)
        if stat.S_ISDIR(u.mode):
            return True
        if stat.S_ISREG(u.mode):
            if u.content is not None:  # what a capture found, the bytes unchanged since
                return u.content != base.ref
            return u.base is None or u.base.ref != base.ref or not self.overlay.base_only(node)
        if stat.S_ISLNK(u.mode):
            return u.target != base.ref
        return u.rdev != base.size


async def root_entry(overlay: Overlay, ex: Execution, cancel: CancelToken = NO_CANCEL
                     ) -> Entry:
    """The root entry a promote of ``ex`` would make now (its ``ref`` the root tree id),
    recording no tree and no snapshot; changed files are re-chunked and their chunks stored,
    as a promote stores them.  Mutations of ``ex`` wait while this runs; Cancelled
    (ECANCELED) once ``cancel`` is."""
    with overlay.freeze(ex):
        cap = Capture(overlay, ex, cancel)
        plan = await in_slices(cap.plan_steps())
        await cap.hash()
        return await in_slices(cap._entry_steps(plan, None))


# -- policies ---------------------------------------------------------------------------------

def _join(path: str, name: bytes) -> str:
    return f"{path}/{os.fsdecode(name)}" if path else os.fsdecode(name)


class _ViewTree:
    """rametfs.core.policy.Tree over an execution: its nodes where copied up, base entries
    below."""

    def __init__(self, overlay: Overlay):
        self.overlay = overlay

    def children(self, item: Node | Entry):
        if isinstance(item, Node):
            if item.upper is not None:
                return [(name, child if child.upper is not None else child.entry)
                        for name, child in self.overlay.listdir(item.ino)]
            item = item.entry
        return self.overlay.tree(item.ref).items()

    @staticmethod
    def kind(item: Node | Entry) -> str:
        return policy.kind_of(item.mode)

    @staticmethod
    def size(item: Node | Entry) -> int:
        return item.size

    def totals(self, item: Node | Entry) -> tuple[int, int]:
        if isinstance(item, Entry) or item.upper is None:
            store = self.overlay.store
            with store.read() as txn:
                t = store.tree_totals(txn, (item if isinstance(item, Entry) else item.entry).ref)
            return t["files"], t["bytes"]
        return policy.subtree_totals(self, item)


def _node_job(overlay: Overlay, ex: Execution, node: Node) -> _FileJob:
    """How to read regular file ``node``: its base content, upper pages and size."""
    u = node.upper
    if u is None:
        return _FileJob(node.entry.size, frozenset(), node.entry.size, node.entry, "")
    return _FileJob(u.size, frozenset(overlay._pages(node)), u.base_limit, u.base,
                    overlay._upper_path(ex, node.ino))


def _lookup_path(overlay: Overlay, ex: Execution, path: str) -> Node | None:
    """The node at relative ``path`` in ``ex``, None when there is none."""
    node = overlay.node(ex.root_ino)
    try:
        for name in path.split("/"):
            node = overlay.lookup(node.ino, os.fsencode(name))
    except NotFound:
        return None
    except RametError as exc:
        if exc.errno == errno.ENOTDIR:
            return None
        raise
    return node


def _base_at(overlay: Overlay, ex: Execution, path: str) -> Entry:
    """The head's entry at ``path`` (a shared path, checked unchanged against it)."""
    entry = ex.head.root
    for name in path.split("/"):
        entry = overlay.tree(entry.ref)[os.fsencode(name)]
    return entry


def load_policy(overlay: Overlay, ex: Execution,
                chosen: policy.Setting | None) -> policy.Policy | None:
    """The policy ``chosen`` (rametfs.core.policy.load_chosen), the tree's ``ramet.toml``
    read from the execution's node.  Raises InvalidArgument (EINVAL) as ``load_chosen``."""
    def tree_file() -> tuple[int, int, Callable[[], bytes]] | None:
        node = _lookup_path(overlay, ex, policy.POLICY_FILE)
        if node is None:
            return None
        return node.mode, node.size, lambda: b"".join(
            _read_pieces(overlay.store, _node_job(overlay, ex, node)))

    return policy.load_chosen(chosen, tree_file)


class _PolicySide:
    """rametfs.core.policy.Side over an execution's nodes."""

    def __init__(self, overlay: Overlay, ex: Execution):
        self.overlay = overlay
        self.ex = ex

    def changes(self, skip: frozenset[str]) -> Steps[list[tuple[str, bytes]]]:
        return diff_steps(self.overlay, self.ex)

    def exists(self, path: str) -> bool | None:
        node = _lookup_path(self.overlay, self.ex, path)
        return None if node is None else node.is_dir


def _input_spec(overlay: Overlay, ex: Execution, path: str, applied: policy.Plan) -> tuple:
    """What to hash for input ``path`` (it exists: checked before): ``("f", job)``,
    ``("l", target)``, ``("o", None)`` or ``("d", [(path below, kind, job | target |
    None)])``.  Raises InputError (EFBIG) when its files hold more than
    rametfs.core.policy.MAX_INPUT_BYTES, as the promote ``applied`` stops (``Plan.stopped``):
    its digest hashes every byte, holes too (b3sum's), so an agent's 16 TiB sparse file
    named as an input would take hours."""
    node = _lookup_path(overlay, ex, path)
    total = 0

    def item(n: Node) -> tuple:
        nonlocal total
        if n.is_dir:
            return ("d", None)
        if stat.S_ISREG(n.mode):
            total += n.size
            if total > policy.MAX_INPUT_BYTES:
                raise applied.stopped(policy.input_too_big(path))
            return ("f", _node_job(overlay, ex, n))
        if stat.S_ISLNK(n.mode):
            return ("l", overlay.readlink(n))
        return ("o", None)

    if not node.is_dir:
        return item(node)
    return ("d", [(rel, *item(n)) for rel, n in walk_names(overlay, node.ino)])


def _spec_digest(store: Store, spec: tuple, cancel: CancelToken) -> str:
    """The digest of one input (rametfs.core.policy.path_digest's definition); blocking."""
    kind, what = spec

    def one(kind: str, what) -> str:
        if kind == "f":
            return _file_digest(store, what, cancel)
        if kind == "l":
            return blake3.blake3(what).hexdigest()
        return "-"

    if kind == "d":
        return policy.tree_digest((rel, k, one(k, w)) for rel, k, w in what)
    return one(kind, what) if kind in ("f", "l") else blake3.blake3(b"").hexdigest()


async def preview(overlay: Overlay, ex: Execution, chosen: policy.Setting | None,
                  paths: list | None = None) -> dict:
    """What a promote of ``ex`` under the policy ``chosen`` would keep
    (rametfs.core.policy.Plan.report); changes nothing.  Runs in slices of the trio thread
    (``Overlay.in_slices``), ``ex`` frozen meanwhile.  ``paths``: the list the classified
    paths are appended to (``policy.classify_steps``).  Raises InvalidArgument (EINVAL) for
    a malformed policy."""
    with overlay.freeze(ex):
        return await in_slices(_preview_steps(overlay, ex, chosen, paths))


def _preview_steps(overlay: Overlay, ex: Execution, chosen: policy.Setting | None,
                   paths: list | None) -> Steps[dict]:
    applied = yield from policy.apply_steps(
        load_policy(overlay, ex, chosen), _ViewTree(overlay), overlay.node(ex.root_ino),
        _PolicySide(overlay, ex), durable=True, paths=paths)
    return applied.report()
