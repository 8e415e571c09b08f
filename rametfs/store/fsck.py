"""Check a store: every snapshot's trees, contents and chunks are present and hash right.

Reads only (LMDB read transactions), so it can run beside a live daemon.  Each tree, content
and chunk is checked once however many snapshots share it; every file entry's size is
compared with its content's.
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


def fsck(store: Store) -> FsckReport:
    """Verify every snapshot in ``store``: trees, contents, and each chunk's BLAKE3 id.

    The walk is iterative (no depth limit).  A tree shared by snapshots is checked once,
    its problems named by the first snapshot and path that reach it; a content is read
    once, but its size is compared with every entry that names it.
    """
    report = FsckReport()
    seen_trees: set[bytes] = set()
    sizes: dict[bytes, int | None] = {EMPTY_CONTENT: 0}  # content id -> bytes (None: damaged)
    seen_chunks: set[bytes] = set()

    def content_size(sid: str, path: str, cid: bytes) -> int | None:
        if cid in sizes:
            return sizes[cid]
        report.contents += 1
        sizes[cid] = None
        try:
            content = store.content(cid)
            size = content.size
            for chunk in content.chunk_ids():
                if chunk not in seen_chunks:
                    seen_chunks.add(chunk)
                    report.chunks += 1
                    store.chunk(chunk)
        except IntegrityError as exc:
            report.problems.append(f"{sid[:12]} {path}: {exc}")
            return None
        sizes[cid] = size
        return size

    for snap in store.snapshots():
        report.snapshots += 1
        stack: list[tuple[str, Entry]] = [("", snap.root)]
        while stack:
            path, entry = stack.pop()
            if entry.ref in seen_trees:
                continue
            seen_trees.add(entry.ref)
            report.trees += 1
            try:
                entries = store.tree(entry.ref)
            except IntegrityError as exc:
                report.problems.append(f"{snap.id[:12]} {path or '/'}: {exc}")
                continue
            subdirs = []
            for name, child in entries.items():
                child_path = f"{path}/{name.decode(errors='replace')}"
                if child.is_dir:
                    subdirs.append((child_path, child))
                elif child.is_reg:
                    size = content_size(snap.id, child_path, child.ref)
                    if size is not None and size != child.size:
                        report.problems.append(f"{snap.id[:12]} {child_path}: content has "
                                               f"{size} bytes, entry says {child.size}")
            stack.extend(reversed(subdirs))  # name order, depth first
    return report
