"""The overlay model: read-only snapshot views and copy-on-write executions, FUSE-free.

Vocabulary after the kernel's overlayfs: the *base* (lower) is an immutable snapshot tree; an
execution's *upper* layer holds what it changed.  The upper layer of an execution is
identified by a *layer* number (a fresh one after every reset) and consists of:

* upper inode records (rametfs.store.format.UpperInode): an inode is *copied up*
  (materialised) the first time it or its directory listing changes; it keeps the inode
  number it had, and a record of its *origin* base entry;
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

The model is split by job: each job is one component, in a module of its own, and
:class:`Overlay` wires them and is the one object its callers hold.

``nodes``       views, nodes and the inode table (inode numbers, liveness, freeing dropped layers)
``trees``       decoded base trees, a bounded cache
``lookup``      lookup, the merged listing, attributes, symlink targets, extended attributes
``changes``     the change clock and git's fsmonitor tokens
``upper``       copy-up, what a layer uses and may use, storing upper records
``data``        page maps, reads, copy-on-write writes, truncation, fallocate, SEEK_DATA/HOLE,
                fsync, upper data files
``hydrate``     base content in the shared hydration cache
``names``       namespace changes, one transaction each, undone in memory on failure
``attributes``  setattr and extended attributes, POSIX ACLs (rametfs.core.acl)
``reclaim``     forgotten unlinked inodes and orphans
``executions``  snapshot views, the executions' lifecycle, freezes, dead layers
``resolve``     snapshot references, a published one's catalog lookup in a worker thread
``slices``      long walks in slices of the trio thread
"""

from __future__ import annotations

from ..store import Store
from .attributes import Attributes
from .changes import ChangeClock
from .data import MAX_FILE_SIZE, FileData, OpenFiles, assemble, close_all
from .executions import Executions
from .hydrate import Hydrator
from .lookup import Lookup, walk_names
from .names import Names
from .nodes import COLLECT_BATCH, Attrs, Execution, InodeTable, Node
from .reclaim import Reclaimer, drop_upper_files
from .resolve import Resolver
from .slices import in_slices, take_turn, yield_to_requests
from .trees import BaseTrees
from .upper import Upper

__all__ = ["COLLECT_BATCH", "MAX_FILE_SIZE", "Attrs", "Execution", "Node", "Overlay", "assemble",
           "close_all", "drop_upper_files", "in_slices", "take_turn", "walk_names",
           "yield_to_requests"]


def _state(component: str, name: str) -> property:
    """Attribute ``name`` of component ``component``, read and set through the facade: the
    components rebind some of them, and the daemon sets some."""
    return property(lambda self: getattr(getattr(self, component), name),
                    lambda self, value: setattr(getattr(self, component), name, value))


class Overlay:
    """Every view of one store, and the POSIX operations on their inodes.

    Methods are synchronous and run on the trio thread; each LMDB write transaction is short
    and opened and closed within the call.  Errors are RametError subclasses carrying errnos.
    Blocking work (hydrating base content, fsync) is in the ``async`` methods, which use
    threads.  Each operation is the method of the component whose job it is, bound here
    (no call goes through an extra frame).
    """

    nodes = _state("table", "nodes")
    stale_inos = _state("table", "stale_inos")
    dead_layers = _state("views", "dead_layers")
    reclaim = _state("reclaimer", "reclaim")
    precreated = _state("data", "precreated")
    max_file_size = _state("data", "max_file_size")
    freeze = staticmethod(Execution.freeze)

    def __init__(self, store: Store):
        self.store = store
        self.upper_root = str(store.root / "upper")
        upper_fds = OpenFiles()  # descriptors of upper data files, by node
        self.table = table = InodeTable(store, freed=upper_fds.close)
        self.base_trees = trees = BaseTrees(store)
        self.views = views = Executions(store, table, trees)
        self.lookups = lookups = Lookup(store, table, trees)
        self.clock = clock = ChangeClock(table)
        self.upper = upper = Upper(store, table, views.executions, self.upper_root)
        self.data = data = FileData(store, upper, upper_fds, self.upper_root)
        self.hydrator = Hydrator(store)
        resolver = Resolver(store)
        self.resolve, self.resolve_entry = resolver.snapshot, resolver.entry
        self.names = names = Names(store, table, trees, lookups, upper)
        self.attributes = attributes = Attributes(upper, data)
        self.reclaimer = reclaimer = Reclaimer(store, table, upper, data, views.executions)
        self.executions, self.snapshot_views = views.executions, views.snapshot_views
        self.readers = views.readers

        self.node, self.is_live, self.drop_stale_nodes = table.node, table.is_live, \
            table.drop_stale_nodes
        self._alloc_ino = table.alloc_ino  # the adapter's synthetic nodes share the counter
        self.tree, self.tree_steps = trees.tree, trees.tree_steps
        (self.snapshot_view, self.create_execution, self.execution, self.reset, self.pristine,
         self.release, self.set_head, self.set_runtime, self.wait_thawed,
         self.collect_dead_layer, self.forget_dead_layer) = (
            views.snapshot_view, views.create_execution, views.execution, views.reset,
            views.pristine, views.release, views.set_head, views.set_runtime,
            views.wait_thawed, views.collect_dead_layer, views.forget_dead_layer)
        (self.lookup, self.listdir, self.listdir_steps, self.listdir_in_slices, self.prefetch,
         self.attrs, self.readlink, self.xattrs) = (
            lookups.lookup, lookups.listdir, lookups.listdir_steps, lookups.listdir_in_slices,
            lookups.prefetch, data.attrs, lookups.readlink, lookups.xattrs)
        self.fsmonitor_token = clock.fsmonitor_token
        self.changed_since_in_slices = clock.changed_since_in_slices
        (self.check_not_failed, self.fail, self.copy_up, self.charge, self.save,
         self.flush_view, self.flush_steps, self.flush_all, self.flush_all_steps,
         self.count_usage, self._mark_dirty) = (
            upper.check_not_failed, upper.fail, upper.copy_up, upper.charge, upper.save,
            upper.flush_view, upper.flush_steps, upper.flush_all, upper.flush_all_steps,
            upper.count_usage, upper.mark_dirty)
        (self.read, self.write, self.truncate, self.fallocate, self.seek, self.sync_data,
         self.sync_store, self.base_only, self.take_unlinked_fds, self.remove_layer_files,
         self._pages, self._upper_path) = (
            data.read, data.write, data.truncate, data.fallocate, data.seek, data.sync_data,
            data.sync_store, data.base_only, data.take_unlinked_fds, data.remove_layer_files,
            data.pages, data.upper_path)
        self.base_fd = self.hydrator.base_fd
        (self.mkdir, self.mknod, self.create, self.tmpfile, self.symlink, self.link,
         self.unlink, self.rmdir, self.rename, self.rename_in_slices) = (
            names.mkdir, names.mknod, names.create, names.tmpfile, names.symlink, names.link,
            names.unlink, names.rmdir, names.rename, names.rename_in_slices)
        self.setattr, self.setxattr, self.removexattr = (
            attributes.setattr, attributes.setxattr, attributes.removexattr)
        (self.forgotten, self.executions_of, self.take_reclaim, self.reclaimed,
         self.remove_orphans) = (
            reclaimer.forgotten, reclaimer.executions_of, reclaimer.take_reclaim,
            reclaimer.reclaimed, reclaimer.remove_orphans)
