"""Reclaim of unlinked inodes: an inode whose last name went stays (marked in ``orphans``)
while processes hold it; once the kernel forgets it, its upper data file, record and page map
are deleted in batches off the event loop, and at the next start what a stop or a crash left
of such inodes goes (like ext4's orphan list)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

from ..precreate import Precreated, unlink_if_there
from ..store import Store
from .data import FileData
from .nodes import Execution, InodeTable, Node
from .upper import Upper


@dataclass(frozen=True)
class Reclaim:
    """A forgotten unlinked inode to delete: its ``layer`` and ``ino``, the ``path`` of its
    upper data file (which may not exist: nothing written; None: its layer goes whole), the
    cached descriptor of that file, if any, and the bytes the file has allocated."""

    layer: int
    ino: int
    path: str | None
    fd: int | None
    allocated: int = 0


def drop_upper_files(items: list[Reclaim], pool: Precreated | None,
                     room: tuple[int, int] = (0, 0)) -> list[tuple[int, int]]:
    """Close the cached descriptors of ``items``, then take their upper data files back into
    ``pool`` while ``room`` lasts and unlink the others (``Precreated.take_back``; all of
    them without a pool); returns what was taken back, for ``pool.hold``.  Blocking, and an
    unlink frees the file's blocks (ext4: about 200 ms per GiB; a file creation or removal
    costs this disk 0.02-0.5 ms): call it off the event loop."""
    files = []
    for item in items:
        if item.fd is not None:
            os.close(item.fd)  # first: the pool hands out no file open anywhere
        if item.path is not None:
            files.append((item.path, item.allocated))
    if pool is not None:
        return pool.take_back(files, room)
    for path, _ in files:
        unlink_if_there(path)  # not there: never written, or its layer removed
    return []


class Reclaimer:
    """The forgotten unlinked inodes of ``table`` in the ``executions`` (by id) of ``store``,
    whose records ``upper`` keeps and whose data files ``data`` does."""

    def __init__(self, store: Store, table: InodeTable, upper: Upper, data: FileData,
                 executions: dict[str, Execution]):
        self.store = store
        self.table = table
        self.upper = upper
        self.data = data
        self.executions = executions
        # Forgotten unlinked inodes, whose data files, records and page maps whoever drives
        # the overlay deletes off the event loop, in batches (take_reclaim, reclaimed).
        self.reclaim: list[Reclaim] = []

    def forgotten(self, nodes: Iterable[Node]) -> None:
        """The kernel dropped ``nodes`` (FUSE forget): no process has them open any more, so
        the unlinked ones join :attr:`reclaim`, to go whole: upper data file, record, page map
        (:func:`drop_upper_files` off the event loop, then :meth:`reclaimed`).  Their orphan
        marks stay until then, so a stop or crash in between leaves nothing behind."""
        upper_fds = self.data.upper_fds
        for node in nodes:
            unnamed = node.upper is not None and node.upper.nlink == 0
            if unnamed:
                node.view.linkable.discard(node.ino)  # no process holds it to link it
            if unnamed and self.table.is_live(node):
                self.upper.stored([node])
                self.reclaim.append(Reclaim(node.view.layer, node.ino,
                                            self.data.upper_path(node.view, node.ino),
                                            upper_fds.take(node), node.allocated))
                # its blocks and record are as good as gone: the batch frees them soon
                node.view.upper_bytes -= node.allocated + node.record_bytes
                node.view.upper_inodes -= 1
                node.allocated = node.record_bytes = 0
                self.table.drop_unlinked(node)
            else:
                upper_fds.close(node)

    def executions_of(self, items: list[Reclaim]) -> list[Execution]:
        """The live executions whose layers ``items`` belong to."""
        layers = {item.layer for item in items}
        return [ex for ex in self.executions.values() if ex.layer in layers]

    def take_reclaim(self) -> list[Reclaim]:
        """The forgotten inodes left to reclaim, oldest first; the list is emptied."""
        items, self.reclaim = self.reclaim, []
        return items

    def reclaimed(self, items: list[Reclaim]) -> None:
        """Delete the records, page maps and orphan marks of ``items`` (their upper data files
        are gone: :func:`drop_upper_files`), in one transaction."""
        with self.store.write() as txn:
            for item in items:
                self.store.layers.delete_inode(txn, item.layer, item.ino)

    def remove_orphans(self) -> None:
        """At the daemon's start no process holds an inode of the last run: delete what is
        left of the ones whose last name went while they were open (the kernel never forgot
        them, or their reclaim had not run: the daemon stopped or crashed first), records and
        upper data.  Only then: a second Overlay of a live store (deep verify) must leave open
        files alone."""
        live = {ex.layer: ex for ex in self.executions.values()}
        with self.store.read() as txn:
            orphans = self.store.layers.orphans(txn)
        items = []
        for layer, ino in orphans:
            ex = live.get(layer)  # a dead layer goes whole (collect_dead_layer)
            path = self.data.upper_path(ex, ino) if ex is not None else None
            items.append(Reclaim(layer, ino, path, None))
        drop_upper_files(items, None)
        self.reclaimed(items)
