"""The content store: chunks, contents, trees and snapshots (no FUSE, no trio)."""

from .format import PAGE_SIZE, WHITEOUT
from .fsck import FsckReport, fsck
from .git_import import import_git
from .importer import ImportStats, import_tree
from .store import EMPTY_CONTENT, Snapshot, Store
from .trees import FLAG_HAS_LINKS, Entry

__all__ = ["PAGE_SIZE", "WHITEOUT", "EMPTY_CONTENT", "Entry", "FLAG_HAS_LINKS", "FsckReport", "fsck", "ImportStats",
           "Snapshot", "Store", "import_tree", "import_git"]
