"""rametfs: immutable snapshots and copy-on-write executions over FUSE.

``import rametfs`` loads only the client wrapper (standard library), never the daemon.
"""

from rametfs.client import Execution, ExecutionPool, Ramet, RametError
from rametfs.version import __version__

__all__ = ["Execution", "ExecutionPool", "Ramet", "RametError", "__version__"]
