"""Check a store: every snapshot's trees, contents and chunks are present and hash right.

Reads only (LMDB read transactions), so it can run beside a live daemon.  Each tree, content
and chunk is checked once however many snapshots share it.
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
    """Verify every snapshot in ``store``: trees, contents, and each chunk's BLAKE3 id."""
    report = FsckReport()
    seen_trees: set[bytes] = set()
    seen_contents: set[bytes] = set()
    seen_chunks: set[bytes] = set()

    def check_file(sid: str, path: str, entry: Entry) -> None:
        if entry.ref in seen_contents or entry.ref == EMPTY_CONTENT:
            return
        seen_contents.add(entry.ref)
        report.contents += 1
        try:
            content = store.content(entry.ref)
            if content.size != entry.size:
                report.problems.append(f"{sid[:12]} {path}: content has {content.size} bytes, "
                                       f"entry says {entry.size}")
            for cid in content.chunk_ids():
                if cid not in seen_chunks:
                    seen_chunks.add(cid)
                    report.chunks += 1
                    store.chunk(cid)
        except IntegrityError as exc:
            report.problems.append(f"{sid[:12]} {path}: {exc}")

    def check_tree(sid: str, path: str, entry: Entry) -> None:
        if entry.ref in seen_trees:
            return
        seen_trees.add(entry.ref)
        report.trees += 1
        try:
            entries = store.tree(entry.ref)
        except IntegrityError as exc:
            report.problems.append(f"{sid[:12]} {path or '/'}: {exc}")
            return
        for name, child in entries.items():
            child_path = f"{path}/{name.decode(errors='replace')}"
            if child.is_dir:
                check_tree(sid, child_path, child)
            elif child.is_reg:
                check_file(sid, child_path, child)

    for snap in store.snapshots():
        report.snapshots += 1
        check_tree(snap.id, "", snap.root)
    return report
