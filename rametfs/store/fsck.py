"""Reachability in a store, and the check built on it.

:class:`Walk` is the one walk of what a snapshot reaches (trees, contents, chunks): ``fsck``
checks each object it meets, ``gc`` (rametfs.store.gc) keeps what it meets.

Reads only (LMDB read transactions), so it can run beside a live daemon.  Each tree, content
and chunk is visited once however many roots share it; every file entry's size is compared
with its content's.  The executions' layers are checked in one read transaction
(:func:`check_layers`), so the check sees one committed state: a daemon stores every
namespace change in one transaction, and a record's page map with the record.
"""

from __future__ import annotations

import stat
from collections import Counter
from dataclasses import dataclass, field

import lmdb

from ..errors import IntegrityError
from .catalog import Catalog
from .format import PAGE_SIZE, WHITEOUT, UpperInode
from .layers import merged_children
from .store import EMPTY_CONTENT, Store
from .trees import Entry


@dataclass
class FsckReport:
    """Counts of what was checked, and one readable line per problem found."""

    snapshots: int = 0
    trees: int = 0
    contents: int = 0
    chunks: int = 0
    executions: int = 0
    upper_inodes: int = 0  # records of the executions' layers checked
    orphans: list[tuple[int, int]] = field(default_factory=list)  # (layer, ino), unlinked open
    dead_layers: list[int] = field(default_factory=list)  # left by reset or release, to delete
    problems: list[str] = field(default_factory=list)


class Walk:
    """What root entries reach, each object visited once: ``trees`` and ``chunks`` (ids met),
    ``sizes`` (content id -> bytes, None when unreadable); ``problems`` one line per missing
    or damaged object, named by the first root label and path that reached it.

    ``verify``: read every chunk and check its BLAKE3 id (fsck); without it only records are
    read (gc's mark).  Iterative, no depth limit.
    """

    def __init__(self, store: Store, verify: bool):
        self.store = store
        self.verify = verify
        self.trees: set[bytes] = set()
        self.sizes: dict[bytes, int | None] = {EMPTY_CONTENT: 0}
        self.chunks: set[bytes] = set()
        self.problems: list[str] = []

    def content(self, label: str, path: str, cid: bytes) -> int | None:
        """Visit content ``cid`` (and its chunks); its size, None when unreadable."""
        if cid in self.sizes:
            return self.sizes[cid]
        self.sizes[cid] = None
        try:
            content = self.store.content(cid)
            for chunk in content.chunk_ids():
                if chunk not in self.chunks:
                    self.chunks.add(chunk)
                    if self.verify:
                        self.store.chunk(chunk)
        except IntegrityError as exc:
            self.problems.append(f"{label} {path}: {exc}")
            return None
        self.sizes[cid] = content.size
        return content.size

    def tree(self, label: str, root: Entry, path: str = "") -> None:
        """Visit the directory entry ``root`` and everything below it."""
        stack: list[tuple[str, Entry]] = [(path, root)]
        while stack:
            path, entry = stack.pop()
            if entry.ref in self.trees:
                continue
            self.trees.add(entry.ref)
            try:
                entries = self.store.tree(entry.ref)
            except IntegrityError as exc:
                self.problems.append(f"{label} {path or '/'}: {exc}")
                continue
            subdirs = []
            for name, child in entries.items():
                child_path = f"{path}/{name.decode(errors='replace')}"
                if child.is_dir:
                    subdirs.append((child_path, child))
                elif child.is_reg:
                    size = self.content(label, child_path, child.ref)
                    if size is not None and size != child.size:
                        self.problems.append(f"{label} {child_path}: content has "
                                             f"{size} bytes, entry says {child.size}")
            stack.extend(reversed(subdirs))  # name order, depth first

    def entry(self, label: str, entry: Entry, path: str = "") -> None:
        """Visit what one entry references: a directory's tree, a file's content."""
        if entry.is_dir:
            self.tree(label, entry, path)
        elif entry.is_reg:
            self.content(label, path, entry.ref)


def fsck(store: Store) -> FsckReport:
    """Verify every snapshot in ``store`` (trees, contents, and each chunk's BLAKE3 id), then
    every execution's layer (:func:`check_layers`).

    A tree shared by snapshots is checked once, its problems named by the first snapshot and
    path that reach it; a content is read once, but its size is compared with every entry
    that names it.
    """
    walk = Walk(store, verify=True)
    snapshots = store.snapshots()
    for snap in snapshots:
        walk.tree(snap.id[:12], snap.root)
    report = FsckReport(len(snapshots), len(walk.trees), len(walk.sizes) - 1,
                        len(walk.chunks), problems=walk.problems)
    check_layers(store, report)
    return report


def check_layers(store: Store, report: FsckReport) -> None:
    """Check the layers of ``store``'s executions into ``report``, in one read transaction.

    For each execution: its snapshots (base, head, lower) are stored; in its layer every
    dentry lies in a directory with a record and names an inode with a record; a directory
    is named once and has ``2 + subdirectories`` links (its base tree's, less whiteouts, plus
    its dentries); an inode outside a base hard-link group has as many links as dentries name
    it, one of a group at least as many and the group's ``links`` record; a page-map entry
    belongs to a regular file's record and lies below its size; a record with no link left
    is marked orphan, and each orphan mark names such a record.  The orphans and the dead
    layers are listed in ``report``; records of a layer that no execution has and that is not
    dead are a problem.  Each problem names the execution, the layer and the inode.
    """
    layers = store.layers
    with store.read() as txn:
        executions = list(Catalog(store).executions(txn))
        report.executions += len(executions)
        report.dead_layers = layers.dead(txn)
        report.orphans = layers.orphans(txn)
        live = {}
        for eid, rec in executions:
            live[rec.layer] = eid
            for what in ("base", "head", "lower"):
                sid = getattr(rec, what)
                if store.snapshot_by_raw_id(bytes.fromhex(sid)) is None:
                    report.problems.append(f"execution {eid}: its {what} snapshot {sid[:12]} "
                                           f"is not stored")
            _check_layer(store, txn, f"execution {eid} layer {rec.layer}", rec.layer,
                         report)
        for layer, ino in report.orphans:
            if layer in live and layers.inode(txn, layer, ino) is None:
                report.problems.append(f"execution {live[layer]} layer {layer} inode {ino}: "
                                       f"marked orphan, but it has no record")
        dead = set(report.dead_layers)
        for layer in sorted(layers.layers_holding(txn) - live.keys() - dead):
            report.problems.append(f"layer {layer}: records of a layer no execution has and "
                                   f"that is not dead")


def _check_layer(store: Store, txn: lmdb.Transaction, label: str, layer: int,
                 report: FsckReport) -> None:
    layers = store.layers
    records: dict[int, UpperInode] = {ino: upper for ino, upper, _ in layers.inodes(txn, layer)}
    report.upper_inodes += len(records)
    problems = report.problems
    names: Counter[int] = Counter()  # dentries naming each inode
    upper_children: dict[int, dict[bytes, int]] = {}
    for parent, name, ino in layers.all_dentries(txn, layer):
        upper_children.setdefault(parent, {})[name] = ino
        shown = name.decode(errors="replace")
        directory = records.get(parent)
        if directory is None or not stat.S_ISDIR(directory.mode):
            problems.append(f"{label} inode {parent}: holds dentry {shown!r}, but has "
                            f"{'no record' if directory is None else 'no directory record'}")
        if ino == WHITEOUT:
            continue
        names[ino] += 1
        if ino not in records:
            problems.append(f"{label} inode {parent}: dentry {shown!r} names inode {ino}, "
                            f"which has no record")
    groups = dict(layers.links(txn, layer))
    for link, ino in groups.items():
        if ino not in records:
            problems.append(f"{label} inode {ino}: hard-link group {link:x} names it, but it "
                            f"has no record")
    orphans = {ino for orphan_layer, ino in report.orphans if orphan_layer == layer}
    for ino, upper in records.items():
        where = f"{label} inode {ino}"
        if upper.nlink == 0 and ino not in orphans:
            problems.append(f"{where}: no link left, but not marked orphan")
        if stat.S_ISDIR(upper.mode) and upper.nlink == 0:  # removed, its inode still held
            if names[ino]:
                problems.append(f"{where}: a removed directory named by {names[ino]} dentries")
        elif stat.S_ISDIR(upper.mode):
            if names[ino] > 1:
                problems.append(f"{where}: a directory named by {names[ino]} dentries")
            want = 2 + _subdirectories(store, records, upper, upper_children.get(ino, {}))
            if upper.nlink != want:
                problems.append(f"{where}: directory has nlink {upper.nlink}, but 2 + "
                                f"subdirectories make {want}")
        elif upper.base is not None and upper.base.link:
            if groups.get(upper.base.link) != ino:
                problems.append(f"{where}: of base hard-link group {upper.base.link:x}, "
                                f"which does not name it")
            if upper.nlink < names[ino]:
                problems.append(f"{where}: nlink {upper.nlink}, but {names[ino]} dentries "
                                f"name it")
        elif upper.nlink != names[ino]:
            problems.append(f"{where}: nlink {upper.nlink}, but {names[ino]} dentries name it")
    for ino, page in layers.all_pages(txn, layer):
        upper = records.get(ino)
        if upper is None or not stat.S_ISREG(upper.mode):
            problems.append(f"{label} inode {ino}: page {page} in its page map, but it has "
                            f"{'no record' if upper is None else 'no regular file record'}")
        elif page * PAGE_SIZE >= upper.size:
            problems.append(f"{label} inode {ino}: page {page} in its page map, past its "
                            f"size of {upper.size} bytes")


def _subdirectories(store: Store, records: dict[int, UpperInode], upper: UpperInode,
                    dentries: dict[bytes, int]) -> int:
    """The subdirectories of the directory of record ``upper`` whose ``dentries`` are given:
    its base tree's names merged with them (a name of a dentry counts as its record says)."""
    try:
        base = store.tree(upper.tree) if upper.tree is not None else {}
    except IntegrityError:  # the tree's damage is a problem of the snapshot walk
        base = {}
    count = 0
    for _, item in merged_children(base, dentries):
        if isinstance(item, Entry):
            count += item.is_dir
        elif item is not None and item in records:
            count += stat.S_ISDIR(records[item].mode)
    return count
