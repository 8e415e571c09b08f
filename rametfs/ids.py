"""The ids that cross module boundaries, as distinct types for the type checker.

Each is a ``typing.NewType`` over the plain value it is at run time (no cost, no wrapper):
``Ino(5)`` is the int 5.  Standard library only, so the client, the protocol and the store
all import it.

``Ino``          inode number of the mount (one counter for every view), int
``Layer``        an execution's upper layer number (a fresh one after every reset), int
``ContentId``    a file content's BLAKE3 id, 32 bytes
``TreeId``       a directory tree's BLAKE3 id, 32 bytes
``ChunkId``      a chunk's BLAKE3 id, 32 bytes
``SnapshotId``   a snapshot's id, 64 lowercase hex digits (a BLAKE3 id), str
``ExecutionId``  an execution's name (protocol.EXECUTION_NAME_RE), str
``PoolName``     an execution pool's name (protocol.POOL_NAME_RE), str
"""

from __future__ import annotations

from typing import NewType

Ino = NewType("Ino", int)
Layer = NewType("Layer", int)
ContentId = NewType("ContentId", bytes)
TreeId = NewType("TreeId", bytes)
ChunkId = NewType("ChunkId", bytes)
SnapshotId = NewType("SnapshotId", str)
ExecutionId = NewType("ExecutionId", str)
PoolName = NewType("PoolName", str)

__all__ = ["ChunkId", "ContentId", "ExecutionId", "Ino", "Layer", "PoolName", "SnapshotId",
           "TreeId"]
