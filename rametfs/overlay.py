"""The overlay model: read-only snapshot views and copy-on-write executions, FUSE-free.

Vocabulary after the kernel's overlayfs: the *base* (lower) is an immutable snapshot tree; an
execution's *upper* layer holds what it changed.  The upper layer of an execution is
identified by a *layer* number (a fresh one after every reset) and consists of:

* upper inode records (:class:`UpperInode`): an inode is *copied up* (materialised) the first
  time it or its directory listing changes; it keeps the inode number it had, and a record of
  its *origin* base entry;
* dentries per directory: added names, and *whiteouts* (ino 0) for base names removed;
  a directory created anew has no base tree, so it is *opaque*;
* per file, a *page map*: the pages (``PAGE_SIZE`` bytes) that live in the upper data file
  ``<data>/upper/<layer>/<ino>``; the rest of the bytes below ``base_limit`` still come from
  the base content, and bytes at or above ``base_limit`` come from the upper data file (zeros
  where it is sparse).  A write copies up only the pages it touches.

Inode numbers are allocated from one counter for the whole mount; an inode keeps its number
while the daemon runs, and a copied-up inode keeps it across restarts.

Non-standard behaviour (also in docs/architecture.md):

* an inode never copied up gets a new number after a daemon restart;
* after ``reset`` or ``release``, inodes of the old upper layer are stale (ESTALE).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import heapq
import itertools
import os
import re
import secrets
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Iterator, TypeVar

import msgpack
import trio

from .authority import Access, ReadIndex
from .errors import InvalidArgument, NoSpace, NotFound, RametError, ReadOnly, fs_error
from .precreate import Precreated
from .protocol import CONTROL_DIR

RESERVED = CONTROL_DIR.encode()  # the name no entry may have at an execution's root
from .store import EMPTY_CONTENT, FLAG_HAS_LINKS, PAGE_SIZE, WHITEOUT, Entry, Snapshot, Store
from .store.format import (clamp_time_ns, dentry_key, from_u64, inode_key, link_key, page_key,
                           page_of_key, u64)
from .treewalk import Steps, preorder, run_steps

R = TypeVar("R")
NAME_MAX = 255
FIRST_DYNAMIC_INO = 1000
RELEASED = -1  # the layer of a released execution: every node of it is stale  # inode numbers below are the mount's fixed virtual nodes
DIR_SIZE = 4096
TREE_ENTRIES = 1 << 20  # entries of the decoded base trees kept in memory (~300 bytes each)
BIG_TREE_BYTES = 1 << 20  # a stored tree this large is decoded in a worker thread (prefetch)
OPEN_FILES = 256  # upper data files, and as many hydrated base files, kept open
CONTENTS_KEPT = 1 << 16  # contents whose stored bytes are kept (Overlay.content_bytes)
# Names and values of one inode's extended attributes: room for a value as long as the kernel
# allows (XATTR_SIZE_MAX, 64 KiB; fstests generic/020 sets one on FUSE) beside others.
XATTR_BYTES = 128 * 1024
LIST_STEP = 1024  # names a listing makes per step (listdir_steps)
# Nodes freed, or keys of a dead layer deleted, per step of the background collection: 10,000
# held the trio thread 30-60 ms a step after a reset of 50,000 files (loaded 2-core host).
COLLECT_BATCH = 1000
# Requests of one execution that may wait for its freeze to end: an eighth of the daemon's
# request tasks (rametfs.daemon.MAX_REQUEST_TASKS, 4,096).
MAX_WAITING = 512
ANCESTOR_STEP = 1024  # parents a directory move's check looks at per step (about 1 ms)
MAX_CHANGES = 1 << 18  # change-clock entries kept per execution (about 150 bytes each)
THREADS_PER_VIEW = 4  # worker threads one execution's (or snapshot's) requests may hold
SNAPSHOT_ID_RE = re.compile(r"[0-9a-f]{64}")
MAX_FILE_SIZE = (2**32 - 1) * 4096  # bytes: ext4's limit with 4 KiB blocks (16 TiB - 4 KiB)
RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4  # renameat2(2) flags


@dataclass(slots=True)
class UpperInode:
    """An inode record in an execution's upper layer (``inodes`` database).

    Times in ns; ``size`` in bytes; ``base`` the origin base entry (None for a new inode);
    ``base_limit`` the number of leading bytes of the base content still visible (bytes);
    ``tree`` the base subtree id of a directory that came from the base (None: opaque);
    ``content`` the content id a capture found the file's bytes to hold, until its bytes
    change (None: not known), so a diff against the head that capture made needs no hash.
    """

    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    size: int = 0
    nlink: int = 1
    rdev: int = 0
    target: bytes = b""
    xattrs: dict = field(default_factory=dict)
    base: Entry | None = None
    base_limit: int = 0
    tree: bytes | None = None
    content: bytes | None = None

    def pack(self) -> bytes:
        d = {name: getattr(self, name) for name in self.__slots__}
        d["base"] = self.base.pack() if self.base else None
        d["xattrs"] = sorted(self.xattrs.items())
        if d["content"] is None:  # absent unless a capture set it: records stay as small
            del d["content"]
        return msgpack.packb(d, use_bin_type=True)

    @classmethod
    def unpack(cls, value: bytes) -> "UpperInode":
        d = msgpack.unpackb(value)
        d["base"] = Entry.unpack(d["base"]) if d["base"] else None
        d["xattrs"] = {k: v for k, v in d["xattrs"]}
        return cls(**d)

    @classmethod
    def from_entry(cls, e: Entry) -> "UpperInode":
        return cls(mode=e.mode, uid=e.uid, gid=e.gid, atime_ns=e.mtime_ns, mtime_ns=e.mtime_ns,
                   ctime_ns=e.mtime_ns, size=e.size if e.is_reg else 0, nlink=e.nlink,
                   rdev=0 if (e.is_reg or e.is_dir or e.is_symlink) else e.size,
                   target=e.ref if e.is_symlink else b"", xattrs=dict(e.xattrs), base=e,
                   base_limit=e.size if e.is_reg else 0, tree=e.ref if e.is_dir else None)


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


class View:
    """A tree mounted under the root: a snapshot (read-only) or an execution."""

    read_only = True
    layer = 0  # snapshot views have one layer, which never changes

    def __init__(self, root_ino: int):
        self.root_ino = root_ino
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
    rametfs.policy.Setting, or None); ``runtime`` the sandbox recorded as running it
    (``{"name", "uid", "gid"[, "image"]}``, or None).
    """

    read_only = False

    def __init__(self, eid: str, base: Snapshot, head: Snapshot, lower: Snapshot, layer: int,
                 root_ino: int, created_ns: int, access: Access):
        super().__init__(root_ino)
        self.id = eid
        self.base = base
        self.head = head
        self.lower = lower
        self.layer = layer
        self.created_ns = created_ns
        self.access = access
        self.freezes = 0  # captures and walks that hold its mutations (Overlay.freeze)
        self.waiting = 0  # requests waiting for them to end (Overlay.wait_thawed)
        self.thawed = trio.Event()  # set while freezes is 0
        self.thawed.set()
        # Why an internal error marked this execution failed (Overlay.fail); None: it is not.
        self.failure: str | None = None
        # What the layer uses: bytes its upper data files take on disk, and upper inode
        # records (copied up or new); counted at start (Overlay.count_usage), then kept.
        self.upper_bytes = 0
        self.upper_inodes = 1  # the root's record
        self.captured_bytes = 0  # stored by captures it asked for since its reset (charge)
        # What changed in this layer since the daemon started, for git's fsmonitor hook:
        # an inode number or a (parent inode, name) dentry -> the change clock when it last
        # changed (clock: its own count of changes, so a token tells nothing of the others').
        self.changes: dict[int | tuple[int, bytes], int] = {}
        self.clock = 0
        self.changes_floor = 0  # tokens from before this clock no longer say what changed
        # Names the kernel was told do not exist in the root (cached negative dentries),
        # which a reset must make it forget; below the root, dropping the root's names does.
        self.negative_root: set[bytes] = set()
        self.policy: dict | None = None
        self.runtime: dict | None = None

    def record(self) -> bytes:
        rec = {"base": self.base.id, "head": self.head.id, "lower": self.lower.id,
               "layer": self.layer,
               "root_ino": self.root_ino, "created_ns": self.created_ns,
               **self.access.to_record()}
        rec.update((key, value) for key, value in (("policy", self.policy),
                                                   ("runtime", self.runtime)) if value)
        return msgpack.packb(rec)


NO_PAGES: frozenset[int] = frozenset()  # the empty page set of the nodes that have none


def _add_new_page(node: Node, page: int) -> None:
    if node.new_pages is NO_PAGES:
        node.new_pages = set()
    node.new_pages.add(page)


class Node:
    """An inode of a view: a base entry (``entry``), an upper record (``upper``), or both."""

    __slots__ = ("ino", "view", "layer", "entry", "upper", "parent", "name", "pages",
                 "new_pages", "dirty", "allocated", "record_bytes", "pending_bytes")

    def __init__(self, ino: int, view: View, entry: Entry | None, upper: UpperInode | None,
                 parent: int, name: bytes):
        self.ino = ino
        self.view = view
        self.layer = view.layer  # the node is stale once its view moves to another layer
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
        self.pending_bytes = 0  # ... in the transaction being committed (_put_records)

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


def check_name(name: bytes) -> None:
    """Raise ENAMETOOLONG for a name over 255 bytes, EINVAL for one with '/' or NUL."""
    if len(name) > NAME_MAX:
        raise fs_error(errno.ENAMETOOLONG, f"name of {len(name)} bytes, at most {NAME_MAX}")
    if b"/" in name or b"\0" in name or name in (b"", b".", b".."):
        raise InvalidArgument(f"invalid name {name!r}")


def _prefixed(cur, prefix: bytes, start: bytes | None = None
              ) -> Iterator[tuple[bytes, bytes]]:
    """The ``(key, value)`` pairs of LMDB cursor ``cur`` whose keys start with ``prefix``,
    from key ``start`` (default: the first such key) on."""
    if cur.set_range(prefix if start is None else start):
        yield from itertools.takewhile(lambda kv: kv[0].startswith(prefix), cur.iternext())


def _dentry_bytes(key: bytes) -> int:
    """What a stored dentry takes, as an execution's usage counts it: its key and value."""
    return len(key) + 8


def _check_not_reserved(ex: Execution, parent: Node, name: bytes) -> None:
    """EEXIST for the name the control directory has at an execution's root: a file there
    would hide ``.ramet`` (and land in a snapshot, where it hides it from every execution
    of it)."""
    if parent.ino == ex.root_ino and name == RESERVED:
        raise RametError(f"{CONTROL_DIR} is reserved for rametfs control files", errno.EEXIST)


class OpenFiles:
    """At most ``limit`` open file descriptors by key; the least recently used is closed
    to make room.  The kernel no longer tells the daemon when a file is closed (open-less
    FUSE), so descriptors live here, not with the files' users."""

    def __init__(self, limit: int = OPEN_FILES,
                 closed: Callable[[Hashable], None] | None = None):
        self.limit = limit
        self.fds: OrderedDict[Hashable, int] = OrderedDict()
        self.closed = closed  # called with the key after its descriptor is closed here

    def get(self, key: Hashable) -> int | None:
        fd = self.fds.get(key)
        if fd is not None:
            self.fds.move_to_end(key)
        return fd

    def put(self, key: Hashable, fd: int) -> int:
        self.fds[key] = fd
        if len(self.fds) > self.limit:
            old, old_fd = self.fds.popitem(last=False)
            os.close(old_fd)
            if self.closed is not None:
                self.closed(old)
        return fd

    def close(self, key: Hashable) -> None:
        fd = self.take(key)
        if fd is not None:
            os.close(fd)
            if self.closed is not None:
                self.closed(key)

    def take(self, key: Hashable) -> int | None:
        """Remove ``key``'s descriptor from the cache, open, and hand it to the caller."""
        return self.fds.pop(key, None)


@dataclass(frozen=True)
class Reclaim:
    """A forgotten unlinked inode to delete: its ``key`` (layer + ino), the ``path`` of its
    upper data file (which may not exist: nothing written; None: its layer goes whole) and
    the cached descriptor of that file, if any."""

    key: bytes
    path: str | None
    fd: int | None


def unlink_upper_files(items: list[Reclaim]) -> None:
    """Unlink the upper data files of ``items`` and close their descriptors.  Blocking, and
    the unlink of the last name frees the blocks (ext4: about 200 ms per GiB; a file
    creation or removal costs this disk 0.02-0.5 ms): call it off the event loop."""
    for item in items:
        try:
            if item.path is not None:
                with contextlib.suppress(FileNotFoundError):  # never written, or layer removed
                    os.unlink(item.path)
        finally:
            if item.fd is not None:
                os.close(item.fd)


def close_all(fds: list[int]) -> None:
    """Close ``fds``.  Blocking: closing the last descriptor of an unlinked file frees its
    blocks (ext4: about 200 ms per GiB), so call it off the event loop."""
    for fd in fds:
        os.close(fd)


def assemble(off: int, end: int, pages: set[int], base_limit: int,
             read_base: Callable[[int, int], bytes], read_upper: Callable[[int, int], bytes]
             ) -> bytes:
    """Bytes ``[off, end)`` of a copied-up file, merged from base content and upper data.

    A page in ``pages`` comes from the upper data; otherwise its bytes below ``base_limit``
    come from the base and the rest from the upper data.  Both readers take ``(offset,
    length)`` in bytes and may return short (sparse/EOF): the gap reads as zeros.  Adjacent
    pieces from one source are read with one call.
    """
    pieces: list[tuple[bool, int, int]] = []  # (from_upper, start, end)
    pos = off
    while pos < end:
        page = pos // PAGE_SIZE
        page_end = min(end, (page + 1) * PAGE_SIZE)
        if page in pages or pos >= base_limit:
            piece = (True, pos, page_end)
        elif page_end <= base_limit:
            piece = (False, pos, page_end)
        else:
            piece = (False, pos, base_limit)
        if pieces and pieces[-1][0] == piece[0] and pieces[-1][2] == piece[1]:
            pieces[-1] = (piece[0], pieces[-1][1], piece[2])
        else:
            pieces.append(piece)
        pos = piece[2]
    out = bytearray()
    for from_upper, start, stop in pieces:
        data = (read_upper if from_upper else read_base)(start, stop - start)
        out += data
        if len(data) < stop - start:
            out += bytes(stop - start - len(data))
    return bytes(out)


class Overlay:
    """Every view of one store, and the POSIX operations on their inodes.

    Methods are synchronous and run on the trio thread; each LMDB write transaction is short
    and opened and closed within the call.  Errors are RametError subclasses carrying errnos.
    Blocking work (hydrating base content) is in the ``async`` methods, which use threads.
    """

    def __init__(self, store: Store):
        self.store = store
        self.nodes: dict[int, Node] = {}
        self.snapshot_views: dict[str, SnapshotView] = {}
        self.executions: dict[str, Execution] = {}
        self.readers = ReadIndex()  # who may read which execution (its r bit)
        self.trees: OrderedDict[bytes, dict[bytes, Entry]] = OrderedDict()  # least used first
        self.tree_entries = 0  # of the trees kept
        # content id -> bytes its pages holding data take (st_blocks of unchanged files)
        self.content_bytes = functools.lru_cache(maxsize=CONTENTS_KEPT)(
            lambda cid: (c := store.content(cid)).data_bytes(c.size))
        with store.read() as txn:
            meta = store.db["meta"]
            raw = txn.get(b"next_ino", db=meta)
            self.next_ino = max(FIRST_DYNAMIC_INO, from_u64(raw) if raw else 0)
            raw = txn.get(b"next_layer", db=meta)
            self.next_layer = from_u64(raw) if raw else 1
            for key, value in txn.cursor(db=store.db["executions"]):
                self._load_execution(key.decode(), msgpack.unpackb(value))
        self.stored_next_ino = self.next_ino
        self.upper_fds = OpenFiles()  # by Node
        # Descriptors of upper data files already unlinked: whoever drives the overlay closes
        # them off the event loop (take_unlinked_fds, close_all); that frees their blocks.
        self.unlinked_fds: list[int] = []
        # Forgotten unlinked inodes, whose data files, records and page maps whoever drives
        # the overlay deletes off the event loop, in batches (take_reclaim, reclaimed).
        self.reclaim: list[Reclaim] = []
        # By content id; the cache keeps a content while its descriptor is open here.
        self.base_fds = OpenFiles(closed=store.cache.release)
        self.max_file_size = MAX_FILE_SIZE  # bytes; a larger size is EFBIG (the daemon's knob)
        self.upper_root = str(store.root / "upper")
        # Empty files for new upper data files; the daemon keeps it filled (rametfs.precreate).
        self.precreated: Precreated | None = None
        self.hydrating: dict[bytes, trio.Event] = {}
        # Group commits of the store (sync_store): calls counted, the last call a finished
        # flush covers, and the flush running (None: none).
        self.sync_calls = self.synced = 0
        self.syncing: trio.Event | None = None
        self.stale_inos: list[set[int]] = []  # nodes of dropped layers, freed in batches
        self.nodes_dropped = 0  # freed from :attr:`nodes` since its table was last remade
        self.boot = secrets.token_hex(4)  # tells change clocks of two daemon runs apart
        self.dead_layers = trio.Event()  # set when a layer or nodes wait for deletion

    def tree(self, tid: bytes) -> dict[bytes, Entry]:
        """Entries of base tree ``tid`` (immutable, so cached: at most :data:`TREE_ENTRIES`
        entries in all, the least recently used trees going first)."""
        return run_steps(self.tree_steps(tid))

    def tree_steps(self, tid: bytes) -> Steps[dict[bytes, Entry]]:
        """:meth:`tree` as steps: one not kept is decoded a batch of names a step
        (``Store.tree_steps``)."""
        entries = self.trees.get(tid)
        if entries is None:
            return self._keep_tree(tid, (yield from self.store.tree_steps(tid)))
        self.trees.move_to_end(tid)
        return entries

    def _keep_tree(self, tid: bytes, entries: dict[bytes, Entry]) -> dict[bytes, Entry]:
        if tid in self.trees:  # decoded meanwhile by another walk
            return self.trees[tid]
        self.trees[tid] = entries
        self.tree_entries += len(entries)
        while self.tree_entries > TREE_ENTRIES and len(self.trees) > 1:
            self.tree_entries -= len(self.trees.popitem(last=False)[1])
        return entries

    async def prefetch(self, ino: int) -> None:
        """Make sure directory ``ino``'s base tree is decoded before a lookup or listing
        needs it: one stored in :data:`BIG_TREE_BYTES` or more is decoded in a worker thread
        (of its view's), so a directory of 500,000 names delays other requests by nothing
        (3.8 s on the trio thread before)."""
        node = self.nodes.get(ino)
        tid = node.tree if node is not None and node.is_dir else None
        if tid is None or tid in self.trees or self.store.tree_bytes(tid) < BIG_TREE_BYTES:
            return
        entries = await trio.to_thread.run_sync(self.store.tree, tid, limiter=node.view.threads)
        if tid not in self.trees:
            self._keep_tree(tid, entries)

    # -- inode numbers and nodes ---------------------------------------------------------

    def _alloc_ino(self) -> int:
        ino = self.next_ino
        self.next_ino += 1
        return ino

    def _persist_counters(self, txn) -> None:
        if self.next_ino > self.stored_next_ino:
            txn.put(b"next_ino", u64(self.next_ino), db=self.store.db["meta"])
            self.stored_next_ino = self.next_ino

    def is_live(self, node: Node) -> bool:
        """False once ``node``'s layer was dropped by a reset or release of its execution."""
        return node.layer == node.view.layer and self.nodes.get(node.ino) is node

    def node(self, ino: int) -> Node:
        """The node for ``ino``; ESTALE when it belongs to a dropped layer or view."""
        node = self.nodes.get(ino)
        if node is None or node.layer != node.view.layer:
            raise fs_error(errno.ESTALE, f"inode {ino} is stale")
        return node

    def _add_node(self, node: Node) -> Node:
        self.nodes[node.ino] = node
        node.view.inos.add(node.ino)
        node.view.dcache[(node.parent, node.name)] = node.ino
        return node

    def _drop_layer_nodes(self, view: View, kept: set[int] = frozenset()) -> None:
        """Forget the nodes of ``view``'s current layer but ``kept`` (a reset's unchanged
        ones, which the caller moves to the new layer): O(1) now for the others, as their
        layer no longer matches; ``drop_stale_nodes`` frees them later, in batches."""
        self.stale_inos.append(view.inos - kept if kept else view.inos)
        dcache = {key: ino for key, ino in view.dcache.items()
                  if ino in kept and (key[0] in kept or key[0] == view.root_ino)}
        view.inos, view.dcache, view.link_inos, view.dirty = set(kept), dcache, {}, set()
        if isinstance(view, Execution):
            view.changes, view.negative_root = {}, set()

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
                    self.upper_fds.close(node)
                    freed += 1
            if not inos:
                self.stale_inos.pop()
        self.nodes_dropped += freed
        if not self.stale_inos and self.nodes_dropped > len(self.nodes):
            # A dict never shrinks its table as entries go: remade at the size of what is
            # left (O(left), less than what was freed), not the peak's (a table of 100,000
            # nodes is 5 MiB).  Inserted one by one: dict(self.nodes) may copy the table.
            self.nodes = {ino: node for ino, node in self.nodes.items()}
            self.nodes_dropped = 0
        return freed

    # -- snapshots -----------------------------------------------------------------------

    # -- consistent points in time ---------------------------------------------------------

    @staticmethod
    @contextlib.contextmanager
    def freeze(ex: Execution) -> Iterator[None]:
        """Hold the mutations of ``ex`` while the block runs, awaits included: a capture or a
        walk (diff, preview) sees one point in time.  Every mutating request waits in
        :meth:`wait_thawed` first; blocks may nest."""
        if not ex.freezes:
            ex.thawed = trio.Event()
        ex.freezes += 1
        try:
            yield
        finally:
            ex.freezes -= 1
            if not ex.freezes:
                ex.thawed.set()

    async def wait_thawed(self, node: Node) -> None:
        """Wait while ``node``'s execution is frozen (:meth:`freeze`).  EAGAIN when
        :data:`MAX_WAITING` of its requests wait already: each holds one of the daemon's
        request tasks, which one execution must not take all of; ESTALE when a reset or
        release dropped the node's layer meanwhile (the change would land in the new one)."""
        ex = node.view
        if not isinstance(ex, Execution) or not ex.freezes:
            return
        if ex.waiting >= MAX_WAITING:
            raise fs_error(errno.EAGAIN, f"execution {ex.id} has {ex.waiting} requests "
                                         f"waiting for its promote")
        ex.waiting += 1
        try:
            while ex.freezes:
                await ex.thawed.wait()
        finally:
            ex.waiting -= 1
        self._check_live(node)

    def snapshot_view(self, sid: str) -> SnapshotView:
        """The view of snapshot ``sid``, its full id as the store spells it (64 lower-case hex
        digits: another spelling of the same id would make another view); NotFound (ENOENT)
        if there is none."""
        view = self.snapshot_views.get(sid)
        if view is None:
            if not SNAPSHOT_ID_RE.fullmatch(sid):
                raise NotFound(f"no snapshot {sid!r}")
            snap = self.store.snapshot_by_raw_id(bytes.fromhex(sid))
            if snap is None:
                raise NotFound(f"no snapshot {sid!r}")
            view = SnapshotView(snap, self._alloc_ino())
            self.snapshot_views[sid] = view
            self._add_node(Node(view.root_ino, view, snap.root, None, 0, sid.encode()))
        return view

    # -- executions ----------------------------------------------------------------------

    def _load_execution(self, eid: str, rec: dict) -> Execution:
        base = self.store.snapshot(rec["base"])
        # A record from before "lower" was kept: its layer lies over its base.
        lower = self.store.snapshot(rec["lower"]) if "lower" in rec else base
        ex = Execution(eid, base, self.store.snapshot(rec["head"]), lower, rec["layer"],
                       rec["root_ino"], rec["created_ns"], Access.from_record(rec))
        ex.policy, ex.runtime = rec.get("policy"), rec.get("runtime")
        with self.store.read() as txn:
            value = txn.get(inode_key(ex.layer, ex.root_ino), db=self.store.db["inodes"])
        upper = UpperInode.unpack(value) if value else UpperInode.from_entry(lower.root)
        self.executions[eid] = ex
        self.readers.add(eid, ex.access)
        root = self._add_node(Node(ex.root_ino, ex, lower.root, upper, 0, eid.encode()))
        root.record_bytes = len(value) if value else 0
        return ex

    def _new_layer(self, txn, ex: Execution) -> None:
        """Give ``ex`` a fresh, empty upper layer over ``ex.lower``, and store its record."""
        ex.layer = self.next_layer
        self.next_layer += 1
        txn.put(b"next_layer", u64(self.next_layer), db=self.store.db["meta"])
        root = UpperInode.from_entry(ex.lower.root)
        packed = root.pack()
        txn.put(inode_key(ex.layer, ex.root_ino), packed, db=self.store.db["inodes"])
        txn.put(ex.id.encode(), ex.record(), db=self.store.db["executions"])
        node = self._add_node(Node(ex.root_ino, ex, ex.lower.root, root, 0, ex.id.encode()))
        node.record_bytes = len(packed)  # the root's record is not counted in upper_bytes

    def create_execution(self, snap: Snapshot, eid: str, access: Access = Access(),
                         policy: dict | None = None) -> Execution:
        """A new execution of ``snap`` named ``eid`` with ``access``: one record, O(1) in the
        tree size; ``policy`` is stored with it (``Execution.policy``).

        Raises RametError(EEXIST) when ``eid`` is taken.
        """
        if eid in self.executions:
            raise RametError(f"execution {eid!r} already exists", errno.EEXIST)
        ex = Execution(eid, snap, snap, snap, 0, self._alloc_ino(), time.time_ns(), access)
        ex.policy = policy
        with self.store.write() as txn:
            self._new_layer(txn, ex)
            self._persist_counters(txn)
        self.executions[eid] = ex
        self.readers.add(eid, ex.access)
        return ex

    def execution(self, eid: str) -> Execution:
        try:
            return self.executions[eid]
        except KeyError:
            raise NotFound(f"no execution {eid!r}") from None

    def reset(self, ex: Execution, to: Snapshot) -> tuple[list[tuple[int, bytes]], list[int]]:
        """Drop the upper layer of ``ex`` and give it a fresh one over snapshot ``to``, which
        becomes its head (rametfs.core.heads): O(1) visible whatever ``to`` is; the old layer
        is deleted later.

        Returns the ``(parent ino, name)`` dentries and the inode numbers the kernel may
        cache, for the adapter to invalidate.  The root keeps
        its dentry and inode number, so a bind mount of the execution stays valid, and so do
        the directories and files of the root that are the same in ``to``, with everything
        below them (:meth:`_unchanged`): a shell working in one of them carries on.
        """
        kept = self._unchanged(ex, to)
        stale = self._stale_entries(ex, keep_root_entry=True, kept=kept)
        old = ex.layer
        ex.failure = None
        ex.upper_bytes, ex.upper_inodes, ex.captured_bytes = 0, 1, 0
        self._drop_layer_nodes(ex, kept)
        ex.head = ex.lower = to
        with self.store.write() as txn:
            txn.put(u64(old), b"", db=self.store.db["dead"])
            self._new_layer(txn, ex)
        for ino in kept:
            self.nodes[ino].layer = ex.layer
        self.dead_layers.set()
        return stale

    def _unchanged(self, ex: Execution, to: Snapshot) -> set[int]:
        """The inodes of ``ex`` the kernel knows that a reset onto ``to`` leaves as they are:
        each name of the root the kernel looked up whose node was never copied up, whose
        base entry is ``to``'s entry of that name (so a directory's whole subtree is the
        same: a change below it would have copied it up), and with no hard link in it, and
        every known node below such a directory.  O(known inodes)."""
        root = ex.root_ino
        new = self.tree(to.root.ref)
        tops: dict[int, bool] = {}  # kept candidates among the root's names
        for (parent, name), ino in ex.dcache.items():
            node = self.nodes.get(ino)
            if parent == root and node is not None and node.upper is None and \
                    not node.entry.link and not node.entry.flags & FLAG_HAS_LINKS:
                tops[ino] = new.get(name) == node.entry
        top_of: dict[int, int | None] = {root: None}

        def top(ino: int) -> int | None:
            """The root's child ``ino`` lies below (None: none known)."""
            chain = []
            while ino not in top_of:
                node = self.nodes.get(ino)
                if node is None or node.parent == root:
                    top_of[ino] = None if node is None else ino
                    break
                chain.append(ino)
                ino = node.parent
            for below in chain:
                top_of[below] = top_of[ino]
            return top_of[ino]

        below = {ino: top(ino) for ino in ex.inos if ino != root}
        for ino, t in below.items():
            node = self.nodes.get(ino)
            if t in tops and (node is None or node.upper is not None or node.entry.link):
                tops[t] = False  # not the base's after all (cannot happen without links)
        return {ino for ino, t in below.items() if tops.get(t)}

    def pristine(self, ex: Execution) -> bool:
        """Whether ``ex``'s layer is as a reset leaves it: no change recorded since, no
        dentry stored in it (one from before a daemon restart), its root record its lower
        snapshot's."""
        if ex.changes:
            return False
        prefix = u64(ex.layer)
        with self.store.read() as txn:
            cur = txn.cursor(db=self.store.db["dentries"])
            if cur.set_range(prefix) and cur.key().startswith(prefix):
                return False
        root = self.nodes[ex.root_ino].upper
        return root is not None and root.pack() == UpperInode.from_entry(ex.lower.root).pack()

    def release(self, ex: Execution) -> tuple[list[tuple[int, bytes]], list[int]]:
        """Delete execution ``ex`` and its upper layer (files still open turn stale).

        Returns what the kernel may cache, as ``reset`` does; the root's dentry has parent 0.
        """
        stale = self._stale_entries(ex, keep_root_entry=False)
        self._drop_layer_nodes(ex)
        with self.store.write() as txn:
            txn.put(u64(ex.layer), b"", db=self.store.db["dead"])
            txn.delete(ex.id.encode(), db=self.store.db["executions"])
        del self.executions[ex.id]
        self.readers.remove(ex.id)
        ex.layer = RELEASED
        self.dead_layers.set()
        return stale

    @staticmethod
    def _stale_entries(view: View, keep_root_entry: bool, kept: set[int] = frozenset()
                       ) -> tuple[list[tuple[int, bytes]], list[int]]:
        # Invalidating a directory's dentry drops everything cached below it that nothing
        # holds; the inodes a process still holds (its cwd, an open file) keep their cached
        # pages and listings until told, so every inode of the layer is told too, but those
        # ``kept`` (a reset's unchanged ones: Overlay._unchanged) and the names of the root
        # that lead to them.  The inodes are a flat list of numbers: a (ino, b"") pair each
        # made 50,000 tracked tuples, and the young gc collections that traversed them held
        # the trio thread 50 ms more during a reset.
        root = view.root_ino
        entries = [key for key, ino in view.dcache.items() if key[0] == root and ino not in kept]
        if isinstance(view, Execution):
            entries += [(root, name) for name in view.negative_root]
        if not keep_root_entry:
            entries += [key for key in view.dcache if key[0] == 0]
        return entries, list(view.inos - kept) if kept else list(view.inos)

    def set_head(self, ex: Execution, snap: Snapshot) -> None:
        """Make ``snap`` the head of ``ex`` (a promote of it); its layer stays."""
        ex.head = snap
        self._save_record(ex)

    def set_runtime(self, ex: Execution, runtime: dict) -> None:
        """Record the sandbox that runs ``ex`` (``Execution.runtime``)."""
        ex.runtime = runtime
        self._save_record(ex)

    def _save_record(self, ex: Execution) -> None:
        with self.store.write() as txn:
            txn.put(ex.id.encode(), ex.record(), db=self.store.db["executions"])

    def collect_dead_layer(self) -> tuple[int, bool] | None:
        """Delete a bounded batch of one dead layer's records.

        Returns ``(layer, records_left)``, or None when no layer is dead.  Once no record is
        left, the caller removes the layer's upper data (``store.remove_upper_dir``, in a
        thread) and then calls ``forget_dead_layer``, so a crash in between repeats it.
        """
        db = self.store.db
        with self.store.write() as txn:
            cur = txn.cursor(db=db["dead"])
            if not cur.first():
                return None
            layer_key = cur.key()
            budget = COLLECT_BATCH
            for name in ("inodes", "dentries", "links", "pages", "orphans"):
                c = txn.cursor(db=db[name])
                if c.set_range(layer_key):
                    while budget and c.key()[:8] == layer_key and c.delete():
                        budget -= 1
            return from_u64(layer_key), budget == 0

    def forget_dead_layer(self, layer: int) -> None:
        with self.store.write() as txn:
            txn.delete(u64(layer), db=self.store.db["dead"])

    # -- lookup and listing --------------------------------------------------------------

    def lookup(self, parent_ino: int, name: bytes) -> Node:
        """The node named ``name`` in directory ``parent_ino``; NotFound (ENOENT) if none,
        ENAMETOOLONG for a name over 255 bytes (the kernel leaves that check to FUSE)."""
        if len(name) > NAME_MAX:
            check_name(name)
        parent = self.node(parent_ino)
        view = parent.view
        ino = view.dcache.get((parent_ino, name))
        if ino is not None and ino in self.nodes:
            return self.nodes[ino]
        if not parent.is_dir:
            raise fs_error(errno.ENOTDIR)
        if isinstance(view, Execution) and parent.upper is not None:
            with self.store.read() as txn:
                raw = txn.get(dentry_key(view.layer, parent_ino, name), db=self.store.db["dentries"])
            if raw is not None:
                ino = from_u64(raw)
                if ino == WHITEOUT:
                    raise NotFound(f"{name!r} was deleted")
                return self._load_upper(view, ino, parent_ino, name)
        tree = parent.tree
        entry = self.tree(tree).get(name) if tree is not None else None
        if entry is None:
            raise NotFound(f"no {name!r}")
        return self._base_child(parent, name, entry)

    def _base_child(self, parent: Node, name: bytes, entry: Entry) -> Node:
        """The node of base entry ``entry`` named ``name`` in ``parent`` (no upper dentry).

        The names of one base hard-link group share one node (and inode number).
        """
        view = parent.view
        if entry.link:
            ino = view.link_inos.get(entry.link)
            if ino is not None and ino in self.nodes:
                view.dcache[(parent.ino, name)] = ino
                return self.nodes[ino]
            if isinstance(view, Execution):
                with self.store.read() as txn:
                    raw = txn.get(link_key(view.layer, entry.link), db=self.store.db["links"])
                if raw is not None:
                    return self._load_upper(view, from_u64(raw), parent.ino, name)
        node = self._add_node(Node(self._alloc_ino(), view, entry, None, parent.ino, name))
        if entry.link:
            view.link_inos[entry.link] = node.ino
        return node

    def _load_upper(self, ex: Execution, ino: int, parent: int, name: bytes) -> Node:
        node = self.nodes.get(ino)
        if node is None:
            with self.store.read() as txn:
                value = txn.get(inode_key(ex.layer, ino), db=self.store.db["inodes"])
            if value is None:
                raise RametError(f"execution {ex.id}: dentry {name!r} names missing inode {ino}",
                                 errno.EIO)
            upper = UpperInode.unpack(value)
            node = Node(ino, ex, upper.base, upper, parent, name)
            node.record_bytes = len(value)
            if upper.base is not None and upper.base.link:
                ex.link_inos[upper.base.link] = ino
        elif node.is_dir:
            node.parent, node.name = parent, name
        self.nodes[ino] = node
        ex.inos.add(ino)
        ex.dcache[(parent, name)] = ino
        return node

    def listdir(self, dir_ino: int) -> list[tuple[bytes, Node]]:
        """The merged listing of a directory (base names minus whiteouts plus upper names),
        sorted by name."""
        return run_steps(self.listdir_steps(dir_ino))

    async def listdir_in_slices(self, dir_ino: int) -> list[tuple[bytes, Node]]:
        """:meth:`listdir` in slices of the trio thread (:func:`in_slices`), its execution
        frozen meanwhile: a directory of a million names delays other requests by a slice."""
        view = self.node(dir_ino).view
        await self.prefetch(dir_ino)
        with self.freeze(view) if isinstance(view, Execution) else contextlib.nullcontext():
            return await in_slices(self.listdir_steps(dir_ino))

    def listdir_steps(self, dir_ino: int) -> Steps[list[tuple[bytes, Node]]]:
        """:meth:`listdir` as steps, one per :data:`LIST_STEP` names; ESTALE when a reset
        or release drops the directory's layer meanwhile."""
        d = self.node(dir_ino)
        if not d.is_dir:
            raise fs_error(errno.ENOTDIR)
        base = (yield from self.tree_steps(d.tree)) if d.tree is not None else {}
        upper: dict[bytes, int] = {}  # upper names in name order (the keys'): ino or WHITEOUT
        view = d.view
        if isinstance(view, Execution) and d.upper is not None:
            prefix = dentry_key(view.layer, dir_ino, b"")
            start = prefix
            while True:  # a read transaction per batch: none is held across a step
                with self.store.read() as txn:
                    cur = txn.cursor(db=self.store.db["dentries"])
                    batch = list(itertools.islice(_prefixed(cur, prefix, start), LIST_STEP))
                for key, value in batch:
                    upper[key[len(prefix):]] = from_u64(value)
                if len(batch) < LIST_STEP:
                    break
                start = batch[-1][0] + b"\0"  # the next key after the last one read
                yield
                self._check_live(d)
        # A base stored before the name was reserved may hold it: never listed.
        hidden = RESERVED if isinstance(view, Execution) and dir_ino == view.root_ino else None
        out = []
        last = None
        # Both are in name order: merged, not sorted (sorting 500,000 names is one long step).
        for i, name in enumerate(heapq.merge(base, upper), 1):
            if i % LIST_STEP == 0:
                yield
                self._check_live(d)
            if name == last:
                continue
            last = name
            item = upper.get(name)
            if item == WHITEOUT or name == hidden:
                continue
            if item is None:
                item = base[name]
            ino = view.dcache.get((dir_ino, name))
            node = self.nodes.get(ino) if ino is not None else None
            if node is None:
                if isinstance(item, int):
                    node = self._load_upper(view, item, dir_ino, name)
                else:
                    node = self._base_child(d, name, item)
            out.append((name, node))
        return out

    def _check_live(self, node: Node) -> None:
        if not self.is_live(node):
            raise fs_error(errno.ESTALE, f"inode {node.ino} is stale")

    # -- attributes ----------------------------------------------------------------------

    def attrs(self, node: Node) -> Attrs:
        u = node.upper
        stored = self._stored_bytes(node) if stat.S_ISREG(node.mode) else None
        if u is not None:
            return Attrs(node.ino, u.mode, u.nlink, u.uid, u.gid, u.rdev,
                         DIR_SIZE if stat.S_ISDIR(u.mode) else
                         (len(u.target) if stat.S_ISLNK(u.mode) else u.size),
                         u.atime_ns, u.mtime_ns, u.ctime_ns, stored)
        e = node.entry
        if e.is_dir:
            size, rdev = DIR_SIZE, 0
        elif e.is_symlink:
            size, rdev = len(e.ref), 0
        elif e.is_reg:
            size, rdev = e.size, 0
        else:
            size, rdev = 0, e.size
        return Attrs(node.ino, e.mode, e.nlink, e.uid, e.gid, rdev, size,
                     e.mtime_ns, e.mtime_ns, e.mtime_ns, stored)

    def _stored_bytes(self, node: Node) -> int:
        """Bytes regular file ``node``'s data takes where it is kept, for ``st_blocks``: its
        base pages that hold data and still show (a hole, at page granularity, takes
        none) and what its upper data file takes on disk (a sparse file, as the kernel
        stores it)."""
        u, cid = node.upper, node.base_content
        if u is None:
            return self.content_bytes(cid) if cid else 0
        stored = self.store.content(cid).data_bytes(u.base_limit, self._pages(node)) \
            if cid and u.base_limit else 0
        if u is not None and u.size:
            if not node.allocated:  # its data file not opened since the start
                try:
                    node.allocated = os.stat(self._upper_path(node.view, node.ino)).st_blocks * 512
                except FileNotFoundError:
                    pass
            stored += node.allocated
        return stored

    def readlink(self, node: Node) -> bytes:
        if not stat.S_ISLNK(node.mode):
            raise InvalidArgument("not a symbolic link")
        return node.upper.target if node.upper else node.entry.ref

    def xattrs(self, node: Node) -> dict[bytes, bytes]:
        return node.upper.xattrs if node.upper else dict(node.entry.xattrs)

    # -- copy-up -------------------------------------------------------------------------

    def _writable(self, node: Node) -> Execution:
        """``node``'s execution, which every change to the node passes through (and is
        recorded by); EROFS for a snapshot, EIO for an execution marked failed."""
        view = node.view
        if view.read_only:
            raise ReadOnly("snapshots are read-only")
        self.check_not_failed(view)
        self._changed(view, node.ino)
        return view  # type: ignore[return-value]

    @staticmethod
    def check_not_failed(ex: Execution) -> None:
        """Raise RametError (EIO) when an internal error marked ``ex`` failed (:meth:`fail`):
        it takes no change and no capture until its reset."""
        if ex.failure is not None:
            raise RametError(f"execution {ex.id} failed: an internal error hit it (the "
                             f"harness's status says which); reset it to go on", errno.EIO)

    @staticmethod
    def fail(ex: Execution, reason: str) -> None:
        """Mark ``ex`` failed: an unexpected exception hit a request or background work of
        it, so its state in memory may not be what is stored.  Reads go on; changes and
        captures get EIO until a reset (which drops the layer and the mark).  The first
        reason is kept."""
        if ex.failure is None:
            ex.failure = reason

    def _changed(self, ex: Execution, key: int | tuple[int, bytes]) -> None:
        ex.clock += 1
        if len(ex.changes) >= MAX_CHANGES and key not in ex.changes:
            # Forget them: a token from before now answers "everything may differ", which
            # git's fsmonitor protocol allows (a full scan), and memory stays bounded.
            ex.changes, ex.changes_floor = {}, ex.clock
        ex.changes[key] = ex.clock

    def fsmonitor_token(self, ex: Execution) -> str:
        """An opaque token for "now" in ``ex``, for :meth:`changed_since_steps`."""
        return f"rametfs:{self.boot}:{ex.layer}:{ex.clock}"

    async def changed_since_in_slices(self, ex: Execution, token: str,
                                      shown: Callable[[bytes], bytes | None],
                                      max_bytes: int) -> list[bytes] | None:
        """:meth:`changed_since_steps` in slices of the trio thread (:func:`in_slices`),
        ``ex`` frozen meanwhile (one point in time, as a diff)."""
        with self.freeze(ex):
            return await in_slices(self.changed_since_steps(ex, token, shown, max_bytes))

    def changed_since_steps(self, ex: Execution, token: str,
                            shown: Callable[[bytes], bytes | None], max_bytes: int
                            ) -> Steps[list[bytes] | None]:
        """The files, symlinks and names changed in ``ex`` after ``token`` was given out,
        each path (relative to the execution root) as ``shown`` gives it (None: left out),
        sorted, each once.  None, "everything may have changed", when the token is not one
        of this daemon run and layer (after a restart or a reset, also one during the walk),
        or when one path, or the paths shown with a byte after each, take more than
        ``max_bytes``: no more than that is made.  Steps: one per :data:`CHANGES_STEP`
        changes looked at and per :data:`CHANGES_STEP` names of one path, then the sort's
        (:func:`sorted_steps`)."""
        prefix = f"rametfs:{self.boot}:{ex.layer}:"
        clock = token[len(prefix):]
        if not token.startswith(prefix) or not (clock.isascii() and clock.isdigit()) \
                or len(clock) > 20:  # int() of 4,300 digits or of "²" raises
            return None
        since = int(clock)
        if since < ex.changes_floor:
            return None
        layer = ex.layer
        paths: set[bytes] = set()
        left = max_bytes
        try:
            for i, (key, clock) in enumerate(ex.changes.items(), 1):  # frozen: it stays
                if i % CHANGES_STEP == 0:
                    yield
                    if ex.layer != layer:
                        return None
                if clock <= since:
                    continue
                name = key[1] if isinstance(key, tuple) else None
                node = self.nodes.get(key[0] if name is not None else key)
                if node is None or not self.is_live(node) or (name is None and node.is_dir):
                    continue
                path = yield from self._path_steps(node, name, max_bytes)
                if ex.layer != layer:
                    return None
                item = shown(path) if path is not None else None
                if item is not None and item not in paths:
                    left -= len(item) + 1
                    if left < 0:
                        return None
                    paths.add(item)
        except _TooLong:
            return None
        return (yield from sorted_steps(paths))

    def _path_steps(self, node: Node, name: bytes | None, max_bytes: int
                    ) -> Steps[bytes | None]:
        """The path of ``node`` (with ``name`` in it, if given) relative to its view's root,
        by its parents; None when a parent is gone (an unlinked directory forgotten);
        :class:`_TooLong` past ``max_bytes``.  One step per :data:`CHANGES_STEP` names."""
        parts = [] if name is None else [name]
        size = 0 if name is None else len(name)
        while node.ino != node.view.root_ino:
            parts.append(node.name)
            size += len(node.name) + 1
            if size > max_bytes:
                raise _TooLong
            node = self.nodes.get(node.parent)
            if node is None or not self.is_live(node):
                return None
            if len(parts) % CHANGES_STEP == 0:
                yield
        return b"/".join(reversed(parts))

    def copy_up(self, node: Node) -> UpperInode:
        """Materialise ``node`` (and its parent directories) in its execution's upper layer.

        Writes the upper records and the dentries that name them, in one transaction; inode
        numbers stay.
        """
        ex = self._writable(node)
        if node.upper is not None:
            return node.upper
        chain, n = [], node  # it and its ancestors not copied up yet, deepest first
        while n.upper is None:  # a loop, not recursion: a tree may be any depth
            chain.append(n)
            n = self.node(n.parent)
            self._writable(n)  # each directory on the way is recorded as changed too
        self._check_inode_quota(ex, len(chain))
        # No room check: a copy-up comes before every removal too (a base name's whiteout),
        # and what copies-up store is bounded by the base.
        uppers = [(n, UpperInode.from_entry(n.entry)) for n in reversed(chain)]
        added = 0
        with self.store.write() as txn:  # one transaction: all of them or (ENOSPC) none
            for n, upper in uppers:
                n.pending_bytes = len(packed := upper.pack())
                txn.put(inode_key(ex.layer, n.ino), packed, db=self.store.db["inodes"])
                key = dentry_key(ex.layer, n.parent, n.name)
                txn.put(key, u64(n.ino), db=self.store.db["dentries"])
                added += n.pending_bytes + _dentry_bytes(key)
                if n.entry.link:
                    txn.put(link_key(ex.layer, n.entry.link), u64(n.ino),
                            db=self.store.db["links"])
            self._persist_counters(txn)
        for n, upper in uppers:
            n.upper, n.record_bytes = upper, n.pending_bytes
        ex.upper_inodes += len(uppers)
        ex.upper_bytes += added
        return node.upper

    @staticmethod
    def _check_inode_quota(ex: Execution, new: int = 1) -> None:
        """EDQUOT when ``new`` more upper inode records would pass ``ex``'s limit (a copy-up
        takes one, as it takes an upper inode in kernel overlayfs)."""
        limit = ex.access.max_inodes
        if limit is not None and ex.upper_inodes + new > limit:
            raise fs_error(errno.EDQUOT, f"execution {ex.id} has used its {limit} inodes "
                                         f"(--max-inodes)")

    def _room(self, ex: Execution, wanted: int) -> int:
        """How many of ``wanted`` bytes ``ex`` may still allocate (all, without a limit);
        EDQUOT when none."""
        limit = ex.access.max_bytes
        if limit is None:
            return wanted
        room = limit - ex.upper_bytes - ex.captured_bytes
        if room <= 0 < wanted:
            raise fs_error(errno.EDQUOT, f"execution {ex.id} has used its {limit} bytes "
                                         f"(--max-bytes)")
        return min(wanted, room)

    def charge(self, ex: Execution, stored: int) -> None:
        """Count ``stored`` bytes a capture ``ex`` asked for itself puts in the store against
        its ``--max-bytes`` until its next reset (:attr:`Execution.captured_bytes`); EDQUOT
        when they do not fit, and then nothing is counted.  So an agent's checkpoints cannot
        fill the store, while the harness's captures are never refused.  ``stored`` must not
        depend on what else the store holds (ChunkWriter.added_bytes, not new_bytes): the
        agent reads the count and sees the EDQUOT."""
        if self._room(ex, stored) < stored:
            raise fs_error(errno.EDQUOT, f"execution {ex.id}: the capture stores {stored} "
                                         f"bytes, more than is left of its "
                                         f"{ex.access.max_bytes} (--max-bytes)")
        ex.captured_bytes += stored

    def _check_room(self, ex: Execution, wanted: int) -> None:
        """EDQUOT unless ``ex`` may still store all of ``wanted`` bytes (metadata: records,
        names, extended attributes)."""
        if self._room(ex, wanted) < wanted:
            raise fs_error(errno.EDQUOT, f"execution {ex.id} has used its "
                                         f"{ex.access.max_bytes} bytes (--max-bytes)")

    @staticmethod
    def _allocated(node: Node, fd: int) -> None:
        """Count what ``node``'s upper data file takes on disk now into its execution's
        usage (``os.fstat``: blocks, as quota counts them)."""
        now = os.fstat(fd).st_blocks * 512
        node.view.upper_bytes += now - node.allocated
        node.allocated = now

    def save(self, *nodes: Node) -> None:
        """Store the upper records and new page-map entries of ``nodes`` now, in one
        transaction."""
        with self.store.write() as txn:
            self._put_records(txn, nodes)
        self._stored(nodes)

    def _put_records(self, txn, nodes: Iterable[Node]) -> None:
        """Put the upper records and new page-map entries of ``nodes`` (those that have an
        upper record) and the counters in ``txn``; call :meth:`_stored` once it commits."""
        for node in nodes:
            if node.upper is not None:
                key = inode_key(node.view.layer, node.ino)
                node.pending_bytes = len(packed := node.upper.pack())
                txn.put(key, packed, db=self.store.db["inodes"])
                if node.upper.nlink == 0:  # no name left; processes may still hold it
                    txn.put(key, b"", db=self.store.db["orphans"])
                for page in node.new_pages:
                    txn.put(page_key(node.view.layer, node.ino, page), b"",
                            db=self.store.db["pages"])
        self._persist_counters(txn)

    @staticmethod
    def _stored(nodes: Iterable[Node]) -> None:
        """The transaction :meth:`_put_records` filled committed: the nodes are clean and
        their records' bytes count into their executions' usage."""
        for node in nodes:
            if node.upper is not None:
                node.new_pages = NO_PAGES
                node.dirty = False
                node.view.dirty.discard(node)
                node.view.upper_bytes += node.pending_bytes - node.record_bytes
                node.record_bytes = node.pending_bytes

    def _mark_dirty(self, node: Node) -> None:
        node.dirty = True
        node.view.dirty.add(node)

    def flush_view(self, view: View) -> None:
        """Store every dirty upper record of ``view`` in one transaction (before a capture, a
        fsync, shutdown, and every second)."""
        dirty = [n for n in view.dirty if self.is_live(n) and n.upper.nlink > 0]
        if dirty:
            self.save(*dirty)
        view.dirty.clear()

    def flush_all(self) -> None:
        for ex in self.executions.values():
            self.flush_view(ex)

    def _touch(self, node: Node, mtime: bool = True) -> None:
        now = time.time_ns()
        u = node.upper
        u.ctime_ns = now
        if mtime:
            u.mtime_ns = now

    # -- dentries ------------------------------------------------------------------------

    def _store_names(self, names: list[tuple[Node, bytes, Node | None]], *also: Node
                     ) -> None:
        """One namespace change, in one transaction: each ``(parent, name, child)`` names
        ``child`` in ``parent`` (None removes the name: a whiteout when the base has it) and
        sets the parent's mtime; the records of the parents, the children and ``also`` are
        stored with the dentries, so a crash keeps all of it or none."""
        nodes: dict[int, Node] = {}
        for parent, name, child in names:  # the parents are in one execution (rename checks)
            ex = self._writable(parent)
            self._changed(ex, (parent.ino, name))
            self.copy_up(parent)
            self._touch(parent)
            nodes[parent.ino] = parent
            if child is not None:
                nodes[child.ino] = child
        nodes.update((n.ino, n) for n in also)
        if all(child is not None for _, _, child in names):  # only adds names: room for them
            self._check_room(ex, 1)
        dentries = self.store.db["dentries"]
        added = 0  # bytes of dentries, whiteouts included
        with self.store.write() as txn:
            for parent, name, child in names:
                key = dentry_key(ex.layer, parent.ino, name)
                added -= _dentry_bytes(key) if txn.get(key, db=dentries) is not None else 0
                if child is not None:
                    txn.put(key, u64(child.ino), db=dentries)
                elif parent.tree is not None and name in self.tree(parent.tree):
                    txn.put(key, u64(WHITEOUT), db=dentries)
                else:
                    txn.delete(key, db=dentries)
                    continue
                added += _dentry_bytes(key)
            self._put_records(txn, nodes.values())
        self._stored(nodes.values())
        ex.upper_bytes += added
        for parent, name, child in names:
            if child is None:
                ex.dcache.pop((parent.ino, name), None)
            else:
                ex.dcache[(parent.ino, name)] = child.ino
                ex.inos.add(child.ino)

    def _new_node(self, parent: Node, name: bytes, mode: int, uid: int, gid: int,
                  **fields) -> Node:
        """A new inode named ``name`` in ``parent``; EEXIST if the name is taken.  A new
        directory (``mode`` S_IFDIR) adds a link to ``parent``."""
        ex = self._writable(parent)
        check_name(name)
        _check_not_reserved(ex, parent, name)
        try:
            self.lookup(parent.ino, name)
        except NotFound:
            pass
        else:
            raise fs_error(errno.EEXIST, f"{name!r} exists")
        node = self._unstored_node(parent, name, mode, uid, gid, **fields)
        with self._undone_on_failure(parent):
            if stat.S_ISDIR(mode):
                parent.upper.nlink += 1
            self._store_names([(parent, name, node)])
        ex.upper_inodes += 1
        self.nodes[node.ino] = node
        return node

    def _unstored_node(self, parent: Node, name: bytes, mode: int, uid: int, gid: int,
                       **fields) -> Node:
        """A new inode for the name ``name`` in ``parent`` (in an execution), its times now,
        the group (and a directory's set-group-ID bit) of a set-group-ID ``parent``; the
        caller stores its name.  EDQUOT past the execution's inode limit."""
        if parent.mode & stat.S_ISGID:
            gid = parent.upper.gid if parent.upper else parent.entry.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        now = time.time_ns()
        upper = UpperInode(mode=mode, uid=uid, gid=gid, atime_ns=now, mtime_ns=now,
                           ctime_ns=now, **fields)
        self._check_inode_quota(parent.view)
        return Node(self._alloc_ino(), parent.view, None, upper, parent.ino, name)

    def mkdir(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int) -> Node:
        return self._new_node(self.node(parent_ino), name, stat.S_IFDIR | (mode & 0o7777),
                              uid, gid, nlink=2)

    def mknod(self, parent_ino: int, name: bytes, mode: int, rdev: int, uid: int, gid: int
              ) -> Node:
        return self._new_node(self.node(parent_ino), name, mode, uid, gid, rdev=rdev)

    def create(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int) -> Node:
        return self._new_node(self.node(parent_ino), name, stat.S_IFREG | (mode & 0o7777),
                              uid, gid)

    def symlink(self, parent_ino: int, name: bytes, target: bytes, uid: int, gid: int) -> Node:
        return self._new_node(self.node(parent_ino), name, stat.S_IFLNK | 0o777, uid, gid,
                              target=target)

    def link(self, ino: int, parent_ino: int, name: bytes) -> Node:
        """link(2); EXDEV from another view (each snapshot and execution is its own tree)."""
        node = self.node(ino)
        parent = self.node(parent_ino)
        if node.view is not parent.view:
            raise fs_error(errno.EXDEV, "a hard link cannot cross snapshots and executions")
        ex = self._writable(parent)
        check_name(name)
        _check_not_reserved(ex, parent, name)
        if node.is_dir:
            raise fs_error(errno.EPERM, "hard links to directories are not allowed")
        try:
            self.lookup(parent_ino, name)
        except NotFound:
            pass
        else:
            raise fs_error(errno.EEXIST, f"{name!r} exists")
        with self._undone_on_failure(parent, node):
            node.upper.nlink += 1
            self._touch(node, mtime=False)
            self._store_names([(parent, name, node)])
        return node

    def _is_empty_dir(self, node: Node) -> bool:
        """Whether directory ``node`` holds no name, without listing it (rmdir of a directory
        of 500,000 names listed them all on the trio thread): any upper name that is not a
        whiteout says no at once; else it is empty when every base name is whited out (a
        whiteout is written only for a base name)."""
        base = len(self.tree(node.tree)) if node.tree is not None else 0
        view = node.view
        if not isinstance(view, Execution) or node.upper is None:
            return base == 0
        prefix = dentry_key(view.layer, node.ino, b"")
        whiteouts = 0
        with self.store.read() as txn:
            for _, value in _prefixed(txn.cursor(db=self.store.db["dentries"]), prefix):
                if from_u64(value) != WHITEOUT:
                    return False
                whiteouts += 1
        return whiteouts == base

    @contextlib.contextmanager
    def _undone_on_failure(self, *nodes: Node | None) -> Iterator[None]:
        """Copy ``nodes`` up, then put their records and names back as they were if the block
        raises.  A namespace change changes them in memory before the transaction that stores
        them; when that fails (a full disk) nothing changed on disk, and a file left named
        with a link count of 0 would be deleted once the kernel forgets it."""
        saved = [(n, copy.copy(self.copy_up(n)), n.parent, n.name)
                 for n in nodes if n is not None]
        try:
            yield
        except BaseException:
            for node, upper, parent, name in saved:
                for field_name in UpperInode.__slots__:
                    setattr(node.upper, field_name, getattr(upper, field_name))
                node.parent, node.name = parent, name
            raise

    def _count_link_down(self, parent: Node, node: Node) -> None:
        """``node`` loses its name in ``parent``: its link count (and a directory's parent's)
        goes down, in memory; the caller stores both with the dentry change.

        The inode is copied up first: one still open keeps its attributes (nlink 0) and
        stays readable and writable until the kernel forgets it (:meth:`forgotten`).
        """
        u = self.copy_up(node)
        if node.is_dir:
            self.copy_up(parent).nlink -= 1
            u.nlink = 0
        else:
            u.nlink -= 1
            self._touch(node, mtime=False)

    def forgotten(self, nodes: Iterable[Node]) -> None:
        """The kernel dropped ``nodes`` (FUSE forget): no process has them open any more, so
        the unlinked ones join :attr:`reclaim`, to go whole: upper data file, record, page map
        (:func:`unlink_upper_files` off the event loop, then :meth:`reclaimed`).  Their orphan
        marks stay until then, so a stop or crash in between leaves nothing behind."""
        for node in nodes:
            if node.upper is not None and node.upper.nlink == 0 and self.is_live(node):
                self._stored([node])
                self.reclaim.append(Reclaim(inode_key(node.view.layer, node.ino),
                                            self._upper_path(node.view, node.ino),
                                            self.upper_fds.take(node)))
                # its blocks and record are as good as gone: the batch frees them soon
                node.view.upper_bytes -= node.allocated + node.record_bytes
                node.view.upper_inodes -= 1
                node.allocated = node.record_bytes = 0
            else:
                self.upper_fds.close(node)

    def executions_of(self, items: list[Reclaim]) -> list[Execution]:
        """The live executions whose layers ``items`` belong to."""
        layers = {from_u64(item.key[:8]) for item in items}
        return [ex for ex in self.executions.values() if ex.layer in layers]

    def take_reclaim(self) -> list[Reclaim]:
        """The forgotten inodes left to reclaim, oldest first; the list is emptied."""
        items, self.reclaim = self.reclaim, []
        return items

    def reclaimed(self, items: list[Reclaim]) -> None:
        """Delete the records, page maps and orphan marks of ``items`` (their upper data files
        are gone: :func:`unlink_upper_files`), in one transaction."""
        with self.store.write() as txn:
            for item in items:
                self._delete_inode(txn, item.key)

    def _delete_inode(self, txn, key: bytes) -> None:
        """Delete the upper record, page map and orphan mark of inode ``key`` (layer + ino)."""
        db = self.store.db
        txn.delete(key, db=db["inodes"])
        txn.delete(key, db=db["orphans"])
        cur = txn.cursor(db=db["pages"])
        if cur.set_range(key):
            while cur.key().startswith(key) and cur.delete():
                pass

    def remove_orphans(self) -> None:
        """At the daemon's start no process holds an inode of the last run: delete what is
        left of the ones whose last name went while they were open (the kernel never forgot
        them, or their reclaim had not run: the daemon stopped or crashed first), records and
        upper data.  Only then: a second Overlay of a live store (deep verify) must leave open
        files alone."""
        live = {ex.layer: ex for ex in self.executions.values()}
        with self.store.read() as txn:
            keys = list(txn.cursor(db=self.store.db["orphans"]).iternext(values=False))
        items = []
        for key in keys:
            ex = live.get(from_u64(key[:8]))  # a dead layer goes whole (collect_dead_layer)
            path = self._upper_path(ex, from_u64(key[8:])) if ex is not None else None
            items.append(Reclaim(key, path, None))
        unlink_upper_files(items)
        self.reclaimed(items)

    def _unlink_upper(self, node: Node) -> None:
        """Unlink ``node``'s upper data file now (a truncation to 0: the next write starts a
        new one at that path), keeping a descriptor of it in :attr:`unlinked_fds`: the unlink
        only drops the name, the blocks are freed when that descriptor is closed.  A crash
        frees them too (the kernel closes it)."""
        fd = self.upper_fds.take(node)
        path = self._upper_path(node.view, node.ino)
        try:
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
            os.unlink(path)
        except FileNotFoundError:
            pass  # never written, or its layer already removed
        if fd is not None:
            self.unlinked_fds.append(fd)
        node.view.upper_bytes -= node.allocated
        node.allocated = 0

    def take_unlinked_fds(self) -> list[int]:
        """The descriptors of unlinked upper files left to close (:func:`close_all`)."""
        fds, self.unlinked_fds = self.unlinked_fds, []
        return fds

    def unlink(self, parent_ino: int, name: bytes) -> None:
        parent = self.node(parent_ino)
        self._writable(parent)
        node = self.lookup(parent_ino, name)
        if node.is_dir:
            raise fs_error(errno.EISDIR)
        with self._undone_on_failure(parent, node):
            self._count_link_down(parent, node)
            self._store_names([(parent, name, None)], node)

    def rmdir(self, parent_ino: int, name: bytes) -> None:
        parent = self.node(parent_ino)
        self._writable(parent)
        node = self.lookup(parent_ino, name)
        if not node.is_dir:
            raise fs_error(errno.ENOTDIR)
        if not self._is_empty_dir(node):
            raise fs_error(errno.ENOTEMPTY)
        with self._undone_on_failure(parent, node):
            self._count_link_down(parent, node)
            self._store_names([(parent, name, None)], node)

    @staticmethod
    def _moves_of_directories(src: Node, dst: Node | None, old_parent: Node,
                              new_parent: Node) -> list[tuple[Node, Node]]:
        """The ``(directory, new parent)`` pairs of a rename (``dst``: the other side of an
        exchange) that must not put a directory below itself: none within one directory."""
        if old_parent.ino == new_parent.ino:
            return []
        return [(d, p) for d, p in ((src, new_parent), (dst, old_parent))
                if d is not None and d.is_dir]

    def _not_below_steps(self, ex: Execution, directory: Node, parent: Node) -> Steps[None]:
        """InvalidArgument (EINVAL) when ``parent`` is ``directory`` or below it, walking
        ``parent``'s ancestors; a step per :data:`ANCESTOR_STEP` of them (a tree may be any
        depth)."""
        p = parent
        for i in itertools.count(1):
            if p.ino == directory.ino:
                raise InvalidArgument("cannot move a directory into itself")
            if p.ino == ex.root_ino:
                return
            if i % ANCESTOR_STEP == 0:
                yield
            p = self.node(p.parent)

    async def rename_in_slices(self, old_parent_ino: int, old_name: bytes,
                               new_parent_ino: int, new_name: bytes, flags: int,
                               owner: tuple[int, int] = (0, 0)) -> None:
        """:meth:`rename`, its check that no directory moves below itself made in slices of
        the trio thread (:func:`in_slices`), the execution frozen from the check to the
        rename: a move between directories 60,000 deep walked their ancestors on the trio
        thread, 72 ms a rename."""
        old_parent, new_parent = self.node(old_parent_ino), self.node(new_parent_ino)
        ex = old_parent.view
        try:
            src = self.lookup(old_parent_ino, old_name)
            dst = self.lookup(new_parent_ino, new_name) if flags & RENAME_EXCHANGE else None
        except NotFound:
            src = dst = None  # rename says which
        moves = [] if src is None or not isinstance(ex, Execution) or \
            new_parent.view is not ex else \
            self._moves_of_directories(src, dst, old_parent, new_parent)  # else rename refuses
        if not moves:
            return self.rename(old_parent_ino, old_name, new_parent_ino, new_name, flags,
                               owner=owner)
        with self.freeze(ex):
            for directory, parent in moves:
                await in_slices(self._not_below_steps(ex, directory, parent))
            self._check_live(src)
            self.rename(old_parent_ino, old_name, new_parent_ino, new_name, flags, checked=True,
                        owner=owner)

    def rename(self, old_parent_ino: int, old_name: bytes, new_parent_ino: int, new_name: bytes,
               flags: int, checked: bool = False, owner: tuple[int, int] = (0, 0)) -> None:
        """renameat2(2) with RENAME_NOREPLACE, RENAME_EXCHANGE and RENAME_WHITEOUT (a 0/0
        character device owned by ``owner``, ``(uid, gid)``, takes the source's name in the
        same transaction, as overlayfs expects of its upper file system); any other flag, or
        RENAME_EXCHANGE with another, is EINVAL.  Directories from the base move for real
        within an execution; EXDEV from another view.  ``checked``: no directory moves below
        itself (:meth:`rename_in_slices` made sure)."""
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE | RENAME_WHITEOUT) or \
                flags & RENAME_EXCHANGE and flags != RENAME_EXCHANGE:
            raise fs_error(errno.EINVAL, f"rename flags {flags:#x} are not supported")
        old_parent, new_parent = self.node(old_parent_ino), self.node(new_parent_ino)
        if old_parent.view is not new_parent.view:
            raise fs_error(errno.EXDEV, "a rename cannot cross snapshots and executions")
        ex = self._writable(old_parent)
        self._writable(new_parent)
        check_name(new_name)
        _check_not_reserved(ex, new_parent, new_name)
        src = self.lookup(old_parent_ino, old_name)
        try:
            dst: Node | None = self.lookup(new_parent_ino, new_name)
        except NotFound:
            dst = None
        exchange, noreplace = flags & RENAME_EXCHANGE, flags & RENAME_NOREPLACE
        if not checked:
            for directory, parent in self._moves_of_directories(src, dst if exchange else None,
                                                                old_parent, new_parent):
                run_steps(self._not_below_steps(ex, directory, parent))
        if exchange:
            if dst is None:
                raise NotFound(f"no {new_name!r}")
            with self._undone_on_failure(old_parent, new_parent, src, dst):
                if src.is_dir != dst.is_dir and old_parent.ino != new_parent.ino:
                    delta = 1 if src.is_dir else -1
                    new_parent.upper.nlink += delta
                    old_parent.upper.nlink -= delta
                src.parent, src.name, dst.parent, dst.name = (new_parent.ino, new_name,
                                                              old_parent.ino, old_name)
                self._touch(src, mtime=False)
                self._touch(dst, mtime=False)
                self._store_names([(old_parent, old_name, dst), (new_parent, new_name, src)])
            return
        if dst is not None:
            if dst.ino == src.ino:
                return
            if noreplace:
                raise fs_error(errno.EEXIST, f"{new_name!r} exists")
            if dst.is_dir and not src.is_dir:
                raise fs_error(errno.EISDIR)
            if src.is_dir and not dst.is_dir:
                raise fs_error(errno.ENOTDIR)
            if dst.is_dir and not self._is_empty_dir(dst):
                raise fs_error(errno.ENOTEMPTY)
        replaced = () if dst is None else (dst,)
        whiteout = self._unstored_node(old_parent, old_name, stat.S_IFCHR, *owner) \
            if flags & RENAME_WHITEOUT else None
        with self._undone_on_failure(old_parent, new_parent, src, dst):
            if dst is not None:
                self._count_link_down(new_parent, dst)
            if src.is_dir and old_parent.ino != new_parent.ino:
                old_parent.upper.nlink -= 1
                new_parent.upper.nlink += 1
            src.parent, src.name = new_parent.ino, new_name
            self._touch(src, mtime=False)
            self._store_names([(old_parent, old_name, whiteout), (new_parent, new_name, src)],
                              *replaced)
        if whiteout is not None:
            ex.upper_inodes += 1
            self.nodes[whiteout.ino] = whiteout

    # -- attributes and xattrs -----------------------------------------------------------

    def setattr(self, node: Node, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, size: int | None = None, atime_ns: int | None = None,
                mtime_ns: int | None = None) -> Attrs:
        """chmod/chown/truncate/utimens; ctime is set to now; times outside what a record
        holds are clamped as ext4 clamps them (``clamp_time_ns``).  Without a truncate the record
        is stored with the next flush (every second, fsync, promote), as a write's is: tar
        sets mode, owner and times on every file it makes."""
        self._writable(node)
        if size is not None:
            self._check_size(node, size)
        u = self.copy_up(node)
        if mode is not None:
            u.mode = stat.S_IFMT(u.mode) | (mode & 0o7777)
        if uid is not None:
            u.uid = uid
        if gid is not None:
            u.gid = gid
        if size is not None:
            if node.is_dir:
                raise fs_error(errno.EISDIR)
            self.truncate(node, size)
        if atime_ns is not None:
            u.atime_ns = clamp_time_ns(atime_ns)
        if mtime_ns is not None:
            u.mtime_ns = clamp_time_ns(mtime_ns)
        u.ctime_ns = time.time_ns()
        if size is not None:  # now: its page-map entries are already gone
            self.save(node)
        else:
            self._mark_dirty(node)
        return self.attrs(node)

    def setxattr(self, node: Node, name: bytes, value: bytes) -> None:
        """Set an xattr; POSIX ACLs are refused (EOPNOTSUPP) since they would not change the
        mode bits as they do on ext4, and tools then fall back to chmod.  ENOSPC when the
        inode's names and values would pass :data:`XATTR_BYTES` (ext4 answers ENOSPC when
        they pass its one block), so storing the record stays cheap."""
        self._writable(node)
        if name.startswith(b"system.posix_acl_"):
            raise fs_error(errno.EOPNOTSUPP, "POSIX ACLs are not supported")
        xattrs = self.copy_up(node).xattrs
        self._check_room(node.view, len(name) + len(value))
        total = sum(len(k) + len(v) for k, v in xattrs.items() if k != name)
        if total + len(name) + len(value) > XATTR_BYTES:
            raise fs_error(errno.ENOSPC, f"the extended attributes of an inode hold at most "
                                         f"{XATTR_BYTES} bytes of names and values")
        xattrs[name] = value
        self._touch(node, mtime=False)
        self.save(node)

    def removexattr(self, node: Node, name: bytes) -> None:
        self._writable(node)
        u = self.copy_up(node)
        if name not in u.xattrs:
            raise fs_error(errno.ENODATA)
        del u.xattrs[name]
        self._touch(node, mtime=False)
        self.save(node)

    # -- file data -----------------------------------------------------------------------

    def _upper_path(self, ex: Execution, ino: int) -> str:
        return f"{self.upper_root}/{ex.layer}/{ino}"  # a string: pathlib costs µs per call

    def _upper_fd(self, node: Node) -> int:
        """A descriptor of ``node``'s upper data file, made if missing
        (:meth:`_new_upper_file`)."""
        fd = self.upper_fds.get(node)
        if fd is None:
            path = self._upper_path(node.view, node.ino)
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                fd = self._new_upper_file(path)
            node.allocated = os.fstat(fd).st_blocks * 512  # counted already (count_usage)
            self.upper_fds.put(node, fd)
        return fd

    def _new_upper_file(self, path: str) -> int:
        """Make the upper data file ``path`` and open it: a precreated empty file renamed into
        place (:attr:`precreated`), else a new one.  When the file system has no inode or
        block left for it (ENOSPC) while the pool holds files, they go and it is tried again
        without."""
        spare = self.precreated.take() if self.precreated is not None else None
        try:
            return self._place_upper_file(spare, path)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or self.precreated is None:
                raise
            if spare is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(spare)
            if not self.precreated.drain() and spare is None:
                raise
            return self._place_upper_file(None, path)

    @staticmethod
    def _place_upper_file(spare: str | None, path: str) -> int:
        """Rename ``spare`` to ``path`` (if it is still there) or create ``path``, making its
        layer's directory if missing, and open it read-write."""
        while True:
            try:
                if spare is None:
                    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                os.rename(spare, path)
                return os.open(path, os.O_RDWR)
            except FileNotFoundError:
                if spare is not None and not os.path.exists(spare):
                    spare = None  # gone meanwhile: create it instead
                elif os.path.isdir(os.path.dirname(path)):
                    raise
                else:
                    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)

    async def sync_data(self, node: Node) -> None:
        """fsync(2) ``node``'s upper data file, if it has one, in a worker thread."""
        fd = self.upper_fds.get(node)
        try:  # a descriptor of its own: the cache may close its one while the thread runs
            fd = os.dup(fd) if fd is not None else \
                os.open(self._upper_path(node.view, node.ino), os.O_RDONLY)
        except FileNotFoundError:
            return  # nothing written yet
        try:
            await trio.to_thread.run_sync(os.fsync, fd, limiter=node.view.threads)
        finally:
            os.close(fd)

    async def sync_store(self) -> None:
        """Flush the store to disk (``Store.sync``, in a worker thread) as one group commit:
        a caller that arrives while a flush runs waits for the next one, which serves every
        caller that came meanwhile (600 fsyncs a second made 600 flushes)."""
        self.sync_calls += 1
        mine = self.sync_calls
        while self.synced < mine:
            if self.syncing is not None:
                await self.syncing.wait()
                continue
            self.syncing = trio.Event()
            covers = self.sync_calls
            try:
                await trio.to_thread.run_sync(self.store.sync)
                self.synced = covers
            finally:
                self.syncing.set()
                self.syncing = None

    def _pages(self, node: Node) -> set[int] | frozenset[int]:
        """The page map of file ``node``: its pages in its upper data file.  While no byte of
        its base is visible (a new file, or one truncated to 0) no page can join it, and an
        unloaded map stays unloaded (:data:`NO_PAGES`): a created file costs no set."""
        if node.pages is None and (node.upper is None or not node.upper.base_limit):
            return NO_PAGES
        if node.pages is None:
            node.pages = set()
            ex = node.view
            if node.upper is not None and node.upper.base_limit:
                prefix = inode_key(ex.layer, node.ino)
                with self.store.read() as txn:
                    cur = txn.cursor(db=self.store.db["pages"])
                    if cur.set_range(prefix):
                        for key in cur.iternext(values=False):
                            if not key.startswith(prefix):
                                break
                            node.pages.add(page_of_key(key))
        return node.pages

    def base_only(self, node: Node) -> bool:
        """True when every byte of file ``node`` still comes from its base content."""
        u = node.upper
        if u is None:
            return True
        return (u.base is not None and u.base.is_reg and u.base_limit == u.base.size == u.size
                and not self._pages(node))

    async def _hydrate(self, cid: bytes, threads: trio.CapacityLimiter) -> int:
        """A held descriptor of base content ``cid`` decompressed in the shared cache
        (rametfs.store.cache); one thread (of ``threads``, the asking view's) builds it
        however many readers ask at once (a keyed in-flight event), and none is needed when
        it is already there."""
        while cid in self.hydrating:
            await self.hydrating[cid].wait()
        fd = self.store.cache.get(cid, hold=True)
        if fd is not False:
            return fd
        event = self.hydrating[cid] = trio.Event()
        try:
            return await trio.to_thread.run_sync(self.store.open_hydrated, cid, limiter=threads)
        finally:
            del self.hydrating[cid]
            event.set()

    async def base_fd(self, node: Node) -> int | None:
        """An open descriptor of ``node``'s hydrated base content (hydrating it first), or
        None when no byte of it can come from the base."""
        cid = node.base_content
        if cid is None or cid == EMPTY_CONTENT or \
                (node.upper is not None and node.upper.base_limit == 0):
            return None
        fd = self.base_fds.get(cid)
        if fd is None:
            fd = await self._hydrate(cid, node.view.threads)
            other = self.base_fds.get(cid)  # another request may have opened it meanwhile
            if other is not None:
                os.close(fd)
                self.store.cache.release(cid)
                return other
            self.base_fds.put(cid, fd)
        return fd

    def read(self, node: Node, off: int, size: int, base_fd: int | None) -> bytes:
        """Up to ``size`` bytes at ``off``; ``base_fd`` is the hydrated base content, open
        (:meth:`base_fd`)."""
        end = min(off + size, node.size)
        if off >= end:
            return b""
        u = node.upper
        if u is None or self.base_only(node):
            return os.pread(base_fd, end - off, off)

        def read_base(o: int, n: int) -> bytes:
            return os.pread(base_fd, n, o) if base_fd is not None else b""

        fd = self._upper_fd(node)

        def read_upper(o: int, n: int) -> bytes:
            return os.pread(fd, n, o)

        return assemble(off, end, self._pages(node), u.base_limit, read_base, read_upper)

    def write(self, node: Node, off: int, data: bytes) -> int:
        """Write ``data`` at ``off`` (bytes), copying up only the pages it touches; returns
        the bytes written, fewer when the disk fills up (ENOSPC when none), when they reach
        :attr:`max_file_size` (EFBIG when none fits), as ext4 does, or when they reach the
        execution's byte limit (EDQUOT when none fits)."""
        ex = self._writable(node)
        room = self.max_file_size - off
        if room <= 0 and data:
            raise fs_error(errno.EFBIG, f"write at byte {off}: a file holds at most "
                                        f"{self.max_file_size} bytes")
        if len(data) > room:
            data = data[:room]
        u = self.copy_up(node)
        self._bytes_change(node, u)
        fd = self._upper_fd(node)
        data = data[:self._room(ex, len(data))]  # a short write up to the limit
        end = off + len(data)
        touched = range(off // PAGE_SIZE, (min(end, u.base_limit) - 1) // PAGE_SIZE + 1) \
            if off < u.base_limit else range(0)  # the pages that may still be the base's
        pages = self._pages(node)
        whole = []  # base pages this write covers whole: not copied, theirs once written
        try:
            for page in touched:
                if page in pages:
                    continue
                start = page * PAGE_SIZE
                limit = min(start + PAGE_SIZE, u.base_limit)
                if off <= start and end >= limit:
                    whole.append((page, limit))
                    continue
                raw = self.store.read_page(u.base.ref, page)[: limit - start]  # copy up
                if os.pwrite(fd, raw, start) < len(raw):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                pages.add(page)
                _add_new_page(node, page)
            done = off + os.pwrite(fd, data, off)
        except OSError as exc:
            raise RametError(f"upper data write failed: {exc.strerror}", exc.errno) from None
        finally:
            self._allocated(node, fd)
        for page, limit in whole:
            if limit > done:  # a short write: this page and those after stay the base's
                done = min(done, page * PAGE_SIZE)
                break
            pages.add(page)
            _add_new_page(node, page)
        if done <= off and data:
            raise NoSpace("upper data write failed: no space left on device")
        u.size = max(u.size, done)
        u.mtime_ns = u.ctime_ns = time.time_ns()
        self._mark_dirty(node)
        return done - off

    def _bytes_change(self, node: Node, u: UpperInode) -> None:
        """``node``'s bytes are about to change: forget the content id a capture found them
        to hold, storing the record at once (a crash must never leave that id vouching for
        other bytes); after the first change since a capture this costs nothing."""
        if u.content is not None:
            u.content = None
            self.save(node)

    def _check_size(self, node: Node, size: int) -> None:
        """EFBIG when ``size`` (bytes) grows ``node`` past :attr:`max_file_size`."""
        if size > self.max_file_size and size > node.size:
            raise fs_error(errno.EFBIG, f"size {size}: a file holds at most "
                                        f"{self.max_file_size} bytes")

    def truncate(self, node: Node, size: int) -> None:
        """Set the file size (bytes); bytes past a shrink read as zeros if it grows again.
        Raises EFBIG past :attr:`max_file_size`."""
        self._check_size(node, size)
        u = self.copy_up(node)
        self._bytes_change(node, u)
        ex = node.view
        if size < u.size:
            pages = self._pages(node)  # loaded while the base limit still says it may have any
            if size < u.base_limit:
                u.base_limit = size
            first_gone = -(-size // PAGE_SIZE)
            gone = {p for p in pages if p >= first_gone}
            if gone:
                pages -= gone
                if node.new_pages:  # else NO_PAGES, shared
                    node.new_pages -= gone
                with self.store.write() as txn:
                    for p in gone:
                        txn.delete(page_key(ex.layer, node.ino, p), db=self.store.db["pages"])
            if size == 0:  # O_TRUNC: a new data file; the old one's blocks go off the loop
                self._unlink_upper(node)
            elif self.upper_fds.get(node) is not None or \
                    os.path.exists(self._upper_path(ex, node.ino)):
                fd = self._upper_fd(node)
                os.ftruncate(fd, size)
                self._allocated(node, fd)
        u.size = size
        u.mtime_ns = u.ctime_ns = time.time_ns()
        self._mark_dirty(node)

    def count_usage(self) -> None:
        """Count what each execution's layer uses (:attr:`Execution.upper_bytes`: the blocks
        of its upper data files, and the bytes of its records and dentries but for the
        pristine root record's; :attr:`Execution.upper_inodes`: its records): a scan of its
        upper data files, records and dentries, O(upper inodes and names).  The daemon calls
        it once at its start, after :meth:`remove_orphans`; from then on every change keeps
        the counts."""
        for ex in self.executions.values():
            ex.upper_bytes = -len(UpperInode.from_entry(ex.lower.root).pack())
            with contextlib.suppress(FileNotFoundError), \
                    os.scandir(f"{self.upper_root}/{ex.layer}") as it:
                for e in it:
                    ex.upper_bytes += e.stat().st_blocks * 512
            prefix = u64(ex.layer)
            with self.store.read() as txn:
                records = [len(value) for _, value in
                           _prefixed(txn.cursor(db=self.store.db["inodes"]), prefix)]
                ex.upper_inodes = len(records)
                ex.upper_bytes += sum(records) + sum(
                    _dentry_bytes(key) for key, _ in
                    _prefixed(txn.cursor(db=self.store.db["dentries"]), prefix))


SLICE_S = 0.002  # seconds a walk runs on the trio thread before it lets other tasks run
CHANGES_STEP = 1024  # changes, names of one path, or paths sorted per step of an fsmonitor walk


class _TooLong(Exception):
    """A path of an fsmonitor walk (Overlay._path_steps) past the walk's byte limit."""


async def in_slices(steps: Steps[R]) -> R:
    """Run a walk written as steps (rametfs.treewalk.run_steps) on the trio thread, letting
    every other task run after each :data:`SLICE_S` of it: a walk over a large tree delays
    other requests by a slice, not by the walk.  Returns the walk's result."""
    deadline = time.perf_counter() + SLICE_S
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
        if time.perf_counter() >= deadline:
            await trio.sleep(0)
            deadline = time.perf_counter() + SLICE_S


def sorted_steps(items: Iterable[bytes]) -> Steps[list[bytes]]:
    """``sorted(items)`` as steps: runs of :data:`CHANGES_STEP` items sorted one per step,
    then merged (heapq.merge), a step per :data:`CHANGES_STEP` items, so that sorting a
    million paths delays other requests by a slice, not by the sort."""
    items = list(items)
    runs = []
    for i in range(0, len(items), CHANGES_STEP):
        runs.append(sorted(items[i:i + CHANGES_STEP]))
        yield
    del items
    out = []
    for i, item in enumerate(heapq.merge(*runs), 1):
        out.append(item)
        if i % CHANGES_STEP == 0:
            yield
    return out


def walk_names(overlay: Overlay, ino: int, prefix: bytes = b"") -> Iterator[tuple[bytes, Node]]:
    """Every path below directory ``ino`` (depth first, sorted), with its node."""
    def below(item: tuple[bytes, Node]) -> list[tuple[bytes, Node]] | None:
        path, node = item
        return [(path + b"/" + name, child) for name, child in overlay.listdir(node.ino)] \
            if node.is_dir else None

    return preorder([(prefix + name, child) for name, child in overlay.listdir(ino)], below)
