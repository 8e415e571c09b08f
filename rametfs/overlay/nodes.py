"""The views of the overlay, their nodes, and the one inode table that holds the nodes.

A *view* is a tree mounted under the root: a snapshot (read-only) or an execution
(:class:`Execution`, copy-on-write).  A :class:`Node` is one inode of a view: a base entry, an
upper record (rametfs.store.format.UpperInode), or both.  It belongs to the layer its view had
when it was made, through an :class:`Epoch`, and is *stale* (ESTALE) once a reset or release
drops that layer.
:class:`InodeTable` gives inode numbers out from one counter for the whole mount and keeps the
live nodes by number; the nodes of dropped layers are freed later, in batches.
"""

from __future__ import annotations

import contextlib
import errno
import stat
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import trio

from ..authority import Access
from ..errors import fs_error
from ..store import Entry, Snapshot, Store
from ..store.format import ExecutionRecord, UpperInode
from ..ids import Ino

FIRST_DYNAMIC_INO = 1000  # inode numbers below are the mount's fixed virtual nodes
RELEASED = -1  # the layer of a released execution: every node of it is stale
# Nodes freed, or keys of a dead layer deleted, per step of the background collection: 10,000
# held the trio thread 30-60 ms a step after a reset of 50,000 files (loaded 2-core host).
COLLECT_BATCH = 1000
# Requests of one execution that may wait for its freeze to end: an eighth of the daemon's
# request tasks (rametfs.daemon.MAX_REQUEST_TASKS, 4,096).
MAX_WAITING = 512
THREADS_PER_VIEW = 4  # worker threads one execution's (or snapshot's) requests may hold


@dataclass(frozen=True, slots=True)
class Attrs:
    """What stat(2) shows; times in ns, size in bytes, blocks in 512-byte units."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    stored: int | None = None  # bytes a regular file's data takes where kept (None: its size)

    @property
    def blocks(self) -> int:
        return ((self.size if self.stored is None else self.stored) + 511) // 512


class Epoch:
    """The layer number (``layer``) of the nodes that hold this epoch: a node is live while
    it is its view's.  A view's new nodes take the view's epoch (:attr:`View.epoch`); a
    reset moves the nodes it keeps into an epoch of its own while it plans, its layer still
    the old one, then gives that epoch the new layer in the step that swaps the view's:
    every kept node moves, and every other one turns stale, in that one step, however many
    they are (rametfs.overlay.executions)."""

    __slots__ = ("layer",)

    def __init__(self, layer: int):
        self.layer = layer


class View:
    """A tree mounted under the root: a snapshot (read-only) or an execution."""

    read_only = True
    layer = 0  # snapshot views have one layer, which never changes

    def __init__(self, root_ino: int):
        self.root_ino = root_ino
        self.epoch = Epoch(self.layer)  # new nodes' (:class:`Epoch`)
        # Worker threads its requests may hold at once (fsync, hydration): 200 threads of
        # one execution fsyncing took every thread of trio's pool from the others.
        self.threads = trio.CapacityLimiter(THREADS_PER_VIEW)
        self.inos: set[int] = {root_ino}
        self.dcache: dict[tuple[int, bytes], int] = {}  # (parent ino, name) -> ino
        self.link_inos: dict[int, int] = {}  # base hard-link group -> ino
        self.dirty: set[Node] = set()  # nodes whose upper record is not stored yet


class SnapshotView(View):
    """``/snapshots/<id>``: the immutable tree of one snapshot."""

    def __init__(self, snap: Snapshot, root_ino: int):
        super().__init__(root_ino)
        self.snap = snap


class Execution(View):
    """``/executions/<id>``: a writable copy-on-write view of a snapshot.

    ``base`` is the snapshot it was created from; ``head`` the one its next promote descends
    from and its diff, verify and reset compare with (rametfs.core.heads); ``lower`` the one
    its current upper layer lies over (the head at its last reset: a promote moves the head,
    not the layer); ``layer`` numbers the current upper layer; while ``freezes`` counts captures or walks of it, its mutations wait;
    ``access`` who may use it and what its control files do (rametfs.authority), fixed at
    create; ``failure`` says why an internal error stopped it, until its next reset;
    ``policy`` is the persistence policy the harness stored with it (the record of a
    rametfs.core.policy.Setting, or None); ``runtime`` the sandbox recorded as running it
    (``{"name", "uid", "gid"[, "image"]}``, or None).
    """

    read_only = False

    def __init__(self, eid: str, base: Snapshot, head: Snapshot, lower: Snapshot, layer: int,
                 root_ino: int, created_ns: int, access: Access):
        self.layer = layer  # before View's epoch is made
        super().__init__(root_ino)
        self.id = eid
        self.base = base
        self.head = head
        self.lower = lower
        self.created_ns = created_ns
        self.access = access
        self.freezes = 0  # captures and walks that hold its mutations (freeze)
        self.waiting = 0  # requests waiting for them to end (wait_thawed)
        self.thawed = trio.Event()  # set while freezes is 0
        self.thawed.set()
        self.write_turn = trio.Lock()  # held by its write taking its turn (slices.take_turn)
        # Why an internal error marked this execution failed (Upper.fail); None: it is not.
        self.failure: str | None = None
        # What the layer uses: bytes its upper data files take on disk, and upper inode
        # records (copied up or new); counted at start (Upper.count_usage), then kept.
        self.upper_bytes = 0
        self.upper_inodes = 1  # the root's record
        self.captured_bytes = 0  # stored by captures it asked for since its reset (charge)
        # What changed in this layer since the daemon started, for git's fsmonitor hook:
        # an inode number or a (parent inode, name) dentry -> the change clock when it last
        # changed (clock: its own count of changes, so a token tells nothing of the others').
        self.changes: dict[int | tuple[int, bytes], int] = {}
        self.clock = 0
        self.changes_floor = 0  # tokens from before this clock no longer say what changed
        self.policy: dict | None = None
        self.runtime: dict | None = None
        # Files opened with O_TMPFILE but not O_EXCL and not linked yet: a link may name one
        # (Names.link).  Each goes when the kernel forgets it (Reclaimer.forgotten).
        self.linkable: set[int] = set()

    def record(self) -> ExecutionRecord:
        return ExecutionRecord(self.base.id, self.head.id, self.lower.id, self.layer,
                               self.root_ino, self.created_ns, self.access.to_record(),
                               self.policy, self.runtime)

    @contextlib.contextmanager
    def freeze(self) -> Iterator[None]:
        """Hold the mutations of this execution while the block runs, awaits included: a
        capture or a walk (diff, preview) sees one point in time.  Every mutating request
        waits in :meth:`wait_thawed` first; blocks may nest."""
        if not self.freezes:
            self.thawed = trio.Event()
        self.freezes += 1
        try:
            yield
        finally:
            self.freezes -= 1
            if not self.freezes:
                self.thawed.set()

    async def wait_thawed(self) -> None:
        """Wait while this execution is frozen (:meth:`freeze`).  EAGAIN when
        :data:`MAX_WAITING` of its requests wait already: each holds one of the daemon's
        request tasks, which one execution must not take all of."""
        if not self.freezes:
            return
        if self.waiting >= MAX_WAITING:
            raise fs_error(errno.EAGAIN, f"execution {self.id} has {self.waiting} requests "
                                         f"waiting for its promote")
        self.waiting += 1
        try:
            while self.freezes:
                await self.thawed.wait()
        finally:
            self.waiting -= 1


NO_PAGES: frozenset[int] = frozenset()  # the empty page set of the nodes that have none


class Node:
    """An inode of a view: a base entry (``entry``), an upper record (``upper``), or both."""

    __slots__ = ("ino", "view", "epoch", "entry", "upper", "parent", "name", "pages",
                 "new_pages", "dirty", "allocated", "record_bytes", "pending_bytes")

    def __init__(self, ino: int, view: View, entry: Entry | None, upper: UpperInode | None,
                 parent: int, name: bytes):
        self.ino = ino
        self.view = view
        self.epoch = view.epoch  # the node is stale once its view's layer is not its epoch's
        self.entry = entry
        self.upper = upper
        self.parent = parent
        self.name = name
        self.pages: set[int] | None = None  # page map, loaded on first use
        # pages not yet written to the page map; a set of its own once it has one (a set
        # is 216 bytes, and most nodes never get a page)
        self.new_pages: set[int] | frozenset[int] = NO_PAGES
        self.dirty = False  # upper record changed since it was last stored (view.dirty)
        self.allocated = 0  # bytes its upper data file takes on disk, as last seen
        self.record_bytes = 0  # bytes its upper record took when last stored
        self.pending_bytes = 0  # ... in the transaction being committed (Upper.put_records)

    @property
    def mode(self) -> int:
        return self.upper.mode if self.upper else self.entry.mode

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def size(self) -> int:
        if self.upper:
            return self.upper.size
        return self.entry.size if self.entry.is_reg else 0

    @property
    def tree(self) -> bytes | None:
        """The base subtree id merged into this directory's listing (None: none or opaque)."""
        if self.upper:
            return self.upper.tree
        return self.entry.ref if self.entry.is_dir else None

    @property
    def base_content(self) -> bytes | None:
        """The base content id this file's unchanged pages come from."""
        e = self.upper.base if self.upper else self.entry
        return e.ref if e is not None and e.is_reg else None


class Dropped(NamedTuple):
    """The tables of a dropped layer's view (:meth:`InodeTable.drop_layer`), as they were."""

    inos: set[int]
    dcache: dict[tuple[int, bytes], int]
    link_inos: dict[int, int]
    dirty: set[Node]
    changes: dict[int | tuple[int, bytes], int]


class InodeTable:
    """The nodes of every view by inode number, and the counter that numbers them
    (``meta[b"next_ino"]``: stored by the next transaction that stores a record,
    :meth:`persist_counters`), so a copied-up inode keeps its number across restarts.

    ``freed`` is called with each node of a dropped layer as :meth:`drop_stale_nodes` frees
    it (its upper data descriptor goes with it)."""

    def __init__(self, store: Store, freed: Callable[[Node], None]):
        self.store = store
        self.freed = freed
        self.nodes: dict[int, Node] = {}
        with store.read() as txn:
            self.next_ino = max(FIRST_DYNAMIC_INO, store.layers.next_ino(txn))
        self.stored_next_ino = self.next_ino
        self.stale_inos: list[list[int]] = []  # nodes of dropped layers, freed in batches
        self.nodes_dropped = 0  # freed from :attr:`nodes` since its table was last remade

    def alloc_ino(self) -> Ino:
        ino = Ino(self.next_ino)
        self.next_ino += 1
        return ino

    def persist_counters(self, txn) -> None:
        if self.next_ino > self.stored_next_ino:
            self.store.layers.put_next_ino(txn, self.next_ino)
            self.stored_next_ino = self.next_ino

    def is_live(self, node: Node) -> bool:
        """False once ``node``'s layer was dropped by a reset or release of its execution."""
        return node.epoch.layer == node.view.layer and self.nodes.get(node.ino) is node

    def check_live(self, node: Node) -> None:
        """ESTALE when ``node`` is not live (:meth:`is_live`)."""
        if not self.is_live(node):
            raise fs_error(errno.ESTALE, f"inode {node.ino} is stale")

    def node(self, ino: Ino) -> Node:
        """The node for ``ino``; ESTALE when it belongs to a dropped layer or view."""
        node = self.nodes.get(ino)
        if node is None or node.epoch.layer != node.view.layer:
            raise fs_error(errno.ESTALE, f"inode {ino} is stale")
        return node

    def add(self, node: Node) -> Node:
        self.nodes[node.ino] = node
        node.view.inos.add(node.ino)
        node.view.dcache[(node.parent, node.name)] = node.ino
        return node

    @staticmethod
    def drop_layer(view: View, inos: set[int] | None = None,
                   dcache: dict[tuple[int, bytes], int] | None = None) -> Dropped:
        """Give ``view`` the nodes ``inos`` and their dentries ``dcache`` (those a reset keeps,
        in the new layer's epoch; None: none) and empty tables for the rest, in O(1): the
        nodes of the old layer turn stale with the layer number, and its tables are returned
        whole, for the caller to read what the kernel must forget and empty in slices
        (rametfs.overlay.executions), then to give its stale nodes to :attr:`stale_inos`."""
        dropped = Dropped(view.inos, view.dcache, view.link_inos, view.dirty,
                          view.changes if isinstance(view, Execution) else {})
        view.inos = set() if inos is None else inos
        view.dcache = {} if dcache is None else dcache
        view.link_inos, view.dirty = {}, set()
        if isinstance(view, Execution):
            view.changes = {}
        return dropped

    def drop_stale_nodes(self, budget: int = COLLECT_BATCH) -> int:
        """Free up to ``budget`` nodes of dropped layers; returns how many were freed (call
        again while :attr:`stale_inos` is not empty)."""
        freed = 0
        while self.stale_inos and budget:
            inos = self.stale_inos[-1]
            while inos and budget:
                ino = inos.pop()
                budget -= 1
                node = self.nodes.get(ino)
                if node is not None and not self.is_live(node):
                    del self.nodes[ino]
                    self.freed(node)
                    freed += 1
            if not inos:
                self.stale_inos.pop()
        self.nodes_dropped += freed
        if not self.stale_inos:
            self._shrink()
        return freed

    def drop_unlinked(self, node: Node) -> None:
        """Free ``node``, unlinked and forgotten by the kernel: nothing can name it again (a
        file handle of it is ESTALE), so an execution that creates and removes files for
        ever keeps no node of each (they took 1 KB each until its next reset)."""
        del self.nodes[node.ino]
        node.view.inos.discard(node.ino)
        node.view.dirty.discard(node)
        self.nodes_dropped += 1
        if not self.stale_inos:
            self._shrink()

    def _shrink(self) -> None:
        if self.nodes_dropped > len(self.nodes):
            # A dict never shrinks its table as entries go: remade at the size of what is
            # left (O(left), less than what was freed), not the peak's (a table of 100,000
            # nodes is 5 MiB).  Inserted one by one: dict(self.nodes) may copy the table.
            self.nodes = {ino: node for ino, node in self.nodes.items()}
            self.nodes_dropped = 0
