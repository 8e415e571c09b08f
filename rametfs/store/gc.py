"""Garbage collection: delete every chunk, content and tree nothing kept reaches.

**What is kept** (the roots): every snapshot record; every upper inode record of every
execution layer (its ``base`` entry, and ``tree``, the base subtree a directory merges: an
upper record refers to base contents and trees, never to chunks alone; the upper data files
under ``upper/`` are not in the chunk store); the caller's ``extra`` entries (fallback mode's
manifests, whose records vouch for content ids); and through the snapshots, every execution's
and pool's base (``rm`` never forgets those).  Recipe records live inside snapshot records and
name paths and digests, not stored objects.  Everything a root reaches, by the one walk of
:class:`rametfs.store.fsck.Walk`, is kept; every other chunk, content and tree (with its
``tree_stats``) goes, as do the stat and blob cache entries (``sources``) of the contents that
went, and their hydrated cache files.  That is also what a failed or killed import left.

**Writers running meanwhile** (import, promote, checkpoint, fallback promote; the design of
epoch-based reclamation): a gc first raises the store's epoch (:class:`GcGuard`), and from
then on every writer *pins* each chunk, content and tree id it writes or finds already
stored, before it looks (``ChunkWriter.add``, ``Store.put_content``, ``Store.put_tree``; the
stat and blob caches are not trusted while a gc runs: a file is read again); the gc then waits for the writers that began before the epoch (they
pinned nothing), so that their snapshots are committed when it lists the roots.  The sweep
deletes, in short write transactions, only what is neither marked nor pinned; a writer that
pins an id while a batch is open waits for its commit (:meth:`GcGuard.pin`), so it finds a
deleted id missing and stores it again.  So nothing a running promote or import is about to reference is ever deleted.

**Crash safety**: a sweep deletes only what no root reaches, in transactions; a crash (even
SIGKILL) between two of them leaves a store that fsck finds clean, with less garbage.  A cache
file is removed after its content's deletion commits; one left behind holds the bytes of its
content id, which is all a cache file ever claims.

Marking costs a set of ids in memory (about 100 bytes per chunk, content and tree reached).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import lmdb
import msgpack

from ..errors import IntegrityError, RametError
from .format import DATABASES
from .fsck import Walk
from .gc_guard import Progress
from .store import Store
from .trees import Entry

SWEEP_BATCH = 1000  # keys deleted per write transaction: the daemon's own writes wait at most that


@dataclass
class GcReport:
    """What a gc deleted, or would (``dry_run``): counts and stored bytes (LMDB values) of
    chunks, contents and trees (their ``tree_stats`` included), stat and blob cache entries,
    and hydrated cache files (bytes on disk); ``kept_*`` what the roots reach."""

    dry_run: bool
    chunks: int = 0
    chunk_bytes: int = 0
    contents: int = 0
    content_bytes: int = 0
    trees: int = 0
    tree_bytes: int = 0
    sources: int = 0
    cache_files: int = 0
    cache_bytes: int = 0
    kept_chunks: int = 0
    kept_contents: int = 0
    kept_trees: int = 0
    roots: int = 0

    @property
    def bytes(self) -> int:
        """Stored bytes of the records deleted (what LMDB can reuse)."""
        return self.chunk_bytes + self.content_bytes + self.tree_bytes

    def to_json(self) -> dict:
        return {**asdict(self), "bytes": self.bytes}


def collect(store: Store, extra: Callable[[], Iterable[tuple[str, Entry]]] = tuple,
            dry_run: bool = False, progress: Progress | None = None) -> GcReport:
    """Mark what the roots reach, then delete the rest (module docstring); with ``dry_run``
    only count it.  ``extra`` gives ``(label, entry)`` roots beyond the store's own, read
    after earlier writers finished.  Blocking: run it in a worker thread.

    Raises Busy (EBUSY) when a gc runs already, IntegrityError (EIO) when a root reaches a
    missing or damaged object (rametfs fsck names it; nothing is deleted), NoSpace.
    """
    report = GcReport(dry_run)
    with store.gc_guard.collecting(progress) as pins:
        walk = Walk(store, verify=False)
        roots = _roots(store) + list(extra())
        report.roots = len(roots)
        for i, (label, entry) in enumerate(roots):
            walk.entry(label, entry)
            if progress and i % 64 == 0:
                progress("marking", i, len(roots))
        if walk.problems:
            raise IntegrityError("gc: nothing deleted: the store is damaged (rametfs fsck): "
                                 + "; ".join(walk.problems[:5]))
        kept = {"chunks": walk.chunks, "contents": walk.sizes.keys(), "trees": walk.trees}
        report.kept_chunks, report.kept_trees = len(walk.chunks), len(walk.trees)
        report.kept_contents = len(walk.sizes) - 1
        swept_contents: set[bytes] = set()
        for db_name in ("trees", "contents", "chunks"):  # referrers first
            _sweep(store, db_name, kept[db_name], pins, report, swept_contents, progress)
        _sweep_sources(store, swept_contents, report)
        for cid in swept_contents:
            freed = store.cache.discard(cid, dry_run)
            if freed is not None:
                report.cache_files += 1
                report.cache_bytes += freed
    return report


def _roots(store: Store) -> list[tuple[str, Entry]]:
    """The store's own roots: each snapshot's root entry, each upper inode record's base
    entry and merged base tree (the ``inodes`` layout: docs/format.md)."""
    roots = [(s.id[:12], s.root) for s in store.snapshots()]
    with store.read() as txn:
        for layer, record in store.layers.all_inodes(txn):
            label = f"layer {layer}"
            if record.base:
                roots.append((label, record.base))
            if record.tree:
                roots.append((label, Entry(b"", stat.S_IFDIR, 0, 0, 0, 0, record.tree)))
    return roots


def _sweep(store: Store, db_name: str, kept, pins: set[bytes], report: GcReport,
           swept_contents: set[bytes], progress: Progress | None) -> None:
    """Delete (or count) the records of ``db_name`` neither ``kept`` nor pinned."""
    db, stats_db = store.db[db_name], store.db["tree_stats"]
    with store.read() as txn:
        doomed = [bytes(k) for k in txn.cursor(db=db).iternext(values=False) if k not in kept]
    for start in range(0, len(doomed), SWEEP_BATCH):
        try:
            with (store.read() if report.dry_run else store.write()) as txn:
                store.gc_guard.batch(True)
                for key in doomed[start:start + SWEEP_BATCH]:
                    value = None if key in pins else txn.get(key, db=db)
                    if value is None:
                        continue
                    size = len(value)
                    if db_name == "trees":
                        size += len(txn.get(key, db=stats_db) or b"")
                        report.trees += 1
                        report.tree_bytes += size
                    elif db_name == "contents":
                        report.contents += 1
                        report.content_bytes += size
                        swept_contents.add(key)
                    else:
                        report.chunks += 1
                        report.chunk_bytes += size
                    if not report.dry_run:
                        txn.delete(key, db=db)
                        if db_name == "trees":
                            txn.delete(key, db=stats_db)
        finally:
            store.gc_guard.batch(False)
        if progress:
            progress(f"sweeping {db_name}", min(start + SWEEP_BATCH, len(doomed)),
                     len(doomed))


def _sweep_sources(store: Store, swept_contents: set[bytes], report: GcReport) -> None:
    """Delete the stat and blob cache entries (``sources``) naming a content that went."""
    if not swept_contents:
        return
    db = store.db["sources"]
    with store.read() as txn:
        stale = [bytes(k) for k, v in txn.cursor(db=db)
                 if msgpack.unpackb(v)[-1] in swept_contents]
    report.sources = len(stale)
    if stale and not report.dry_run:
        with store.write() as txn:
            for key in stale:
                txn.delete(key, db=db)


def compact(data_dir: str | os.PathLike) -> tuple[int, int]:
    """Rewrite the LMDB file of the store in ``data_dir`` without its free pages
    (``mdb_env_copy2`` with MDB_CP_COMPACT), then swap it in with rename(2); returns the
    file's bytes before and after.  Offline only: the caller holds the data directory's
    lock (rametfs.mounts.take_data_lock) and no process has the store open, since an open
    environment would go on using the old file.  A crash leaves the old file, or the new
    one, whole (the copy is fsynced before the rename); the copy under ``meta/.compact``
    is removed at the next compaction.  Raises RametError (ENOSPC, EIO) from the copy.
    """
    meta = Path(data_dir) / "meta"
    tmp = meta / ".compact"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    before = os.stat(meta / "data.mdb").st_size
    env = lmdb.open(str(meta), max_dbs=len(DATABASES))
    try:
        env.copy(str(tmp), compact=True)
    except lmdb.Error as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RametError(errno.ENOSPC if "space" in str(exc).lower() else errno.EIO,
                         f"gc --compact: the copy of {meta} failed: {exc}") from None
    finally:
        env.close()
    fd = os.open(tmp / "data.mdb", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp / "data.mdb", meta / "data.mdb")
    fd = os.open(meta, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(tmp, ignore_errors=True)
    return before, os.stat(meta / "data.mdb").st_size
