"""Reachability in a store, and the check built on it.

:class:`Walk` is the one walk of what a snapshot reaches (trees, contents, chunks): ``fsck``
checks each object it meets, ``gc`` (rametfs.store.gc) keeps what it meets.

Reads only (LMDB read transactions), so it can run beside a live daemon.  Each tree, content
and chunk is visited once however many roots share it; every file entry's size is compared
with its content's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import IntegrityError
from .store import EMPTY_CONTENT, Store
from .trees import Entry


@dataclass
class FsckReport:
    """Counts of what was checked, and one readable line per problem found."""

    snapshots: int = 0
    trees: int = 0
    contents: int = 0
    chunks: int = 0
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
    """Verify every snapshot in ``store``: trees, contents, and each chunk's BLAKE3 id.

    A tree shared by snapshots is checked once, its problems named by the first snapshot and
    path that reach it; a content is read once, but its size is compared with every entry
    that names it.
    """
    walk = Walk(store, verify=True)
    snapshots = store.snapshots()
    for snap in snapshots:
        walk.tree(snap.id[:12], snap.root)
    return FsckReport(len(snapshots), len(walk.trees), len(walk.sizes) - 1, len(walk.chunks),
                      walk.problems)
