"""Fallback mode: executions as real directories, for hosts without FUSE.

Each execution is a directory materialised from a snapshot (files cloned from the shared
hydration cache with clonefile(2), a FICLONE reflink, or copied); promote, reset and diff
scan it against its manifest, hashing only the files that may have changed.  Snapshots live
in the same store as in FUSE mode.  docs/fallback.md has the design, format and costs.

Modules: ``clone`` (copy methods), ``manifest`` (the per-execution record file), ``scan``
(the tree as snapshot entries), ``sync`` (make a directory equal to a snapshot),
``executions`` (the commands), ``pools`` (pools and leases), ``service`` (each protocol
Command run by its type); the diff is rametfs.core.diff's, over the scan's entries.
"""

from .clone import CLONEFILE, COPY, REFLINK
from .executions import Fallback

__all__ = ["CLONEFILE", "COPY", "REFLINK", "Fallback"]
