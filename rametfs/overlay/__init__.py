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
import itertools
import os
import re
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Iterator

import trio

from ..authority import ReadIndex, Access
from ..errors import InvalidArgument, NoSpace, NotFound, RametError, ReadOnly, fs_error
from ..precreate import Precreated
from ..protocol import CONTROL_DIR
from ..store import EMPTY_CONTENT, FLAG_HAS_LINKS, PAGE_SIZE, WHITEOUT, Snapshot, Store
from ..store.format import (ExecutionRecord, UpperInode, clamp_time_ns, dentry_key, from_u64,
                           inode_key, link_key, page_key, page_of_key, prefixed, u64)
from ..treewalk import Steps, run_steps
from .changes import ChangeClock
from .data import MAX_FILE_SIZE, FileData, OpenFiles, assemble, close_all
from .hydrate import Hydrator
from .lookup import RESERVED, Lookup, check_name, walk_names
from .nodes import (COLLECT_BATCH, NO_PAGES, RELEASED, Attrs, Execution, InodeTable, Node,
                    SnapshotView, View)
from .reclaim import Reclaimer, unlink_upper_files
from .slices import in_slices
from .trees import BaseTrees
from .upper import Upper, dentry_bytes

XATTR_BYTES = 64 * 1024  # names and values of one inode's extended attributes
ANCESTOR_STEP = 1024  # parents a directory move's check looks at per step (about 1 ms)
SNAPSHOT_ID_RE = re.compile(r"[0-9a-f]{64}")
def _check_not_reserved(ex: Execution, parent: Node, name: bytes) -> None:
    """EEXIST for the name the control directory has at an execution's root: a file there
    would hide ``.ramet`` (and land in a snapshot, where it hides it from every execution
    of it)."""
    if parent.ino == ex.root_ino and name == RESERVED:
        raise RametError(f"{CONTROL_DIR} is reserved for rametfs control files", errno.EEXIST)


class Overlay:
    """Every view of one store, and the POSIX operations on their inodes.

    Methods are synchronous and run on the trio thread; each LMDB write transaction is short
    and opened and closed within the call.  Errors are RametError subclasses carrying errnos.
    Blocking work (hydrating base content) is in the ``async`` methods, which use threads.
    """

    def __init__(self, store: Store):
        self.store = store
        self.upper_root = str(store.root / "upper")
        self.upper_fds = OpenFiles()  # by Node
        self.table = InodeTable(store, freed=self.upper_fds.close)
        self.base_trees = BaseTrees(store)
        self.lookups = Lookup(store, self.table, self.base_trees)
        self.clock = ChangeClock(self.table)
        self.snapshot_views: dict[str, SnapshotView] = {}
        self.executions: dict[str, Execution] = {}
        self.readers = ReadIndex()  # who may read which execution (its r bit)
        self.upper = Upper(store, self.table, self.clock, self.executions, self.upper_root)
        self.data = FileData(store, self.upper, self.upper_fds, self.upper_root)
        self.hydrator = Hydrator(store)
        self.reclaimer = Reclaimer(store, self.table, self.upper, self.data, self.executions)
        t, lk, c, u, d, r = (self.table, self.lookups, self.clock, self.upper, self.data,
                             self.reclaimer)
        self._alloc_ino, self._persist_counters, self._add_node = t.alloc_ino, t.persist_counters, t.add
        self.is_live, self.node, self._check_live = t.is_live, t.node, t.check_live
        self._drop_layer_nodes, self.drop_stale_nodes = t.drop_layer, t.drop_stale_nodes
        self.tree, self.tree_steps = self.base_trees.tree, self.base_trees.tree_steps
        self.lookup, self._base_child, self._load_upper = lk.lookup, lk.base_child, lk.load_upper
        self.listdir, self.listdir_steps, self.listdir_in_slices = lk.listdir, lk.listdir_steps, lk.listdir_in_slices
        self.prefetch, self._is_empty_dir = lk.prefetch, lk.is_empty_dir
        self.attrs, self.readlink, self.xattrs = lk.attrs, lk.readlink, lk.xattrs
        self._changed, self.fsmonitor_token = c.changed, c.fsmonitor_token
        self.changed_since_in_slices = c.changed_since_in_slices
        self._writable, self.check_not_failed, self.fail, self.copy_up = u.writable, u.check_not_failed, u.fail, u.copy_up
        self._check_inode_quota, self.charge, self._check_room = u.check_inode_quota, u.charge, u.check_room
        self.save, self._put_records, self._stored, self._mark_dirty = u.save, u.put_records, u.stored, u.mark_dirty
        self.flush_view, self.flush_all, self._touch, self.count_usage = u.flush_view, u.flush_all, u.touch, u.count_usage
        self._upper_path, self.sync_data, self.sync_store = d.upper_path, d.sync_data, d.sync_store
        self._pages, self.base_only, self.read, self.write = d.pages, d.base_only, d.read, d.write
        self._check_size, self.truncate, self.take_unlinked_fds = d.check_size, d.truncate, d.take_unlinked_fds
        self.base_fd = self.hydrator.base_fd
        self.forgotten, self.executions_of, self.take_reclaim = r.forgotten, r.executions_of, r.take_reclaim
        self.reclaimed, self.remove_orphans = r.reclaimed, r.remove_orphans
        with store.read() as txn:
            raw = txn.get(b"next_layer", db=store.db["meta"])
            self.next_layer = from_u64(raw) if raw else 1
            for key, value in txn.cursor(db=store.db["executions"]):
                self._load_execution(key.decode(), ExecutionRecord.unpack(value))
        self.dead_layers = trio.Event()  # set when a layer or nodes wait for deletion

    reclaim = property(lambda self: self.reclaimer.reclaim)
    precreated = property(lambda self: self.data.precreated,
                          lambda self, value: setattr(self.data, "precreated", value))
    max_file_size = property(lambda self: self.data.max_file_size,
                             lambda self, value: setattr(self.data, "max_file_size", value))
    nodes = property(lambda self: self.table.nodes)
    stale_inos = property(lambda self: self.table.stale_inos)
    freeze = staticmethod(Execution.freeze)

    async def wait_thawed(self, node: Node) -> None:
        """Wait while ``node``'s execution is frozen (``Execution.wait_thawed``); ESTALE when
        a reset or release dropped the node's layer meanwhile (the change would land in the
        new one)."""
        ex = node.view
        if isinstance(ex, Execution) and ex.freezes:
            await ex.wait_thawed()
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

    def _load_execution(self, eid: str, rec: ExecutionRecord) -> Execution:
        snapshot = self.store.snapshot
        ex = Execution(eid, snapshot(rec.base), snapshot(rec.head), snapshot(rec.lower),
                       rec.layer, rec.root_ino, rec.created_ns, Access.from_record(rec.access))
        ex.policy, ex.runtime = rec.policy, rec.runtime
        with self.store.read() as txn:
            value = txn.get(inode_key(ex.layer, ex.root_ino), db=self.store.db["inodes"])
        upper = UpperInode.unpack(value) if value else UpperInode.from_entry(ex.lower.root)
        self.executions[eid] = ex
        self.readers.add(eid, ex.access)
        root = self._add_node(Node(ex.root_ino, ex, ex.lower.root, upper, 0, eid.encode()))
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
                added -= dentry_bytes(key) if txn.get(key, db=dentries) is not None else 0
                if child is not None:
                    txn.put(key, u64(child.ino), db=dentries)
                elif parent.tree is not None and name in self.tree(parent.tree):
                    txn.put(key, u64(WHITEOUT), db=dentries)
                else:
                    txn.delete(key, db=dentries)
                    continue
                added += dentry_bytes(key)
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
        pmode = parent.mode
        if pmode & stat.S_ISGID:
            gid = parent.upper.gid if parent.upper else parent.entry.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        now = time.time_ns()
        upper = UpperInode(mode=mode, uid=uid, gid=gid, atime_ns=now, mtime_ns=now,
                           ctime_ns=now, **fields)
        self._check_inode_quota(ex)
        node = Node(self._alloc_ino(), ex, None, upper, parent.ino, name)
        with self._undone_on_failure(parent):
            if stat.S_ISDIR(mode):
                parent.upper.nlink += 1
            self._store_names([(parent, name, node)])
        ex.upper_inodes += 1
        self.nodes[node.ino] = node
        return node

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
                               new_parent_ino: int, new_name: bytes, flags: int) -> None:
        """:meth:`rename`, its check that no directory moves below itself made in slices of
        the trio thread (:func:`in_slices`), the execution frozen from the check to the
        rename: a move between directories 60,000 deep walked their ancestors on the trio
        thread, 72 ms a rename."""
        old_parent, new_parent = self.node(old_parent_ino), self.node(new_parent_ino)
        ex = old_parent.view
        try:
            src = self.lookup(old_parent_ino, old_name)
            dst = self.lookup(new_parent_ino, new_name) if flags & 2 else None
        except NotFound:
            src = dst = None  # rename says which
        moves = [] if src is None or not isinstance(ex, Execution) or \
            new_parent.view is not ex else \
            self._moves_of_directories(src, dst, old_parent, new_parent)  # else rename refuses
        if not moves:
            return self.rename(old_parent_ino, old_name, new_parent_ino, new_name, flags)
        with self.freeze(ex):
            for directory, parent in moves:
                await in_slices(self._not_below_steps(ex, directory, parent))
            self._check_live(src)
            self.rename(old_parent_ino, old_name, new_parent_ino, new_name, flags, checked=True)

    def rename(self, old_parent_ino: int, old_name: bytes, new_parent_ino: int, new_name: bytes,
               flags: int, checked: bool = False) -> None:
        """rename(2) with RENAME_NOREPLACE (1) and RENAME_EXCHANGE (2); directories from the
        base move for real within an execution; EXDEV from another view.  ``checked``: no
        directory moves below itself (:meth:`rename_in_slices` made sure)."""
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
        exchange, noreplace = flags & 2, flags & 1
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
        with self._undone_on_failure(old_parent, new_parent, src, dst):
            if dst is not None:
                self._count_link_down(new_parent, dst)
            if src.is_dir and old_parent.ino != new_parent.ino:
                old_parent.upper.nlink -= 1
                new_parent.upper.nlink += 1
            src.parent, src.name = new_parent.ino, new_name
            self._touch(src, mtime=False)
            self._store_names([(old_parent, old_name, None), (new_parent, new_name, src)],
                              *replaced)

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

