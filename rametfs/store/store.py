"""The local store: one LMDB environment for metadata and chunks, plus the hydration cache.

``Store`` owns the data directory (mode 0700)::

    <data>/meta/          LMDB environment (rametfs.store.format lists its databases)
    <data>/cache/<cid>    hydrated (decompressed) base content, sparse, shared by every
                          view, bounded (rametfs.store.cache)
    <data>/upper/<layer>/ upper data files of an execution layer, one sparse file per inode

Read methods open their own read transaction and may be called from any thread.  Write
transactions (``write()``) are short and never span an ``await`` (docs/concurrency.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterator

import lmdb
import msgpack

from ..errors import IntegrityError, InvalidArgument, NoSpace, NotFound, RametError
from . import chunks
from .cache import HydrationCache
from .chunks import Content
from .gc_guard import GcGuard
from .layers import Layers
from .format import (DATABASES, FORMAT_VERSION, PAGE_SIZE, READABLE_VERSIONS, from_u64, u64)
from ..treewalk import Steps, run_steps
from ..ids import ChunkId, ContentId, SnapshotId, TreeId
from .names import HEX_REF, MIN_ID_PREFIX, check_name
from .remote import KIND_CHUNK, KIND_CONTENT, KIND_TREE
from .trees import TREE_STEP, Entry, decode_tree_steps, encode_tree

MAP_SIZE = 1 << 40  # bytes of address space; LMDB files grow only as data is written
# Bytes of the metadata file kept allocated past LMDB's last page, so that small metadata
# transactions (the unlink that frees room, a reset) still commit on a full disk: LMDB writes
# new pages past its last one, and a write that finds no room fails the whole commit (EIO).
METADATA_RESERVE = 4 << 20
EMPTY_CONTENT = chunks.content_id(0, b"")
REMOTE_TREE_BYTES = 1 << 62  # what Store.tree_bytes says a tree to fetch from the remote costs
_EMPTY = Content(0, b"", ())


@dataclass(frozen=True)
class Snapshot:
    """A snapshot record; ``id`` is 64 hex digits, times in ns, stats a plain dict;
    ``recipes`` the rebuild recipes a promote with a policy stored (rametfs.core.policy), and
    ``runtime`` the sandbox recorded for the execution promoted (None: none)."""

    id: SnapshotId
    root: Entry
    parents: tuple[SnapshotId, ...]
    created_ns: int
    label: str
    message: str
    source: str
    stats: dict
    recipes: tuple[dict, ...] = ()
    runtime: dict | None = None

    def to_json(self) -> dict:
        return {"id": self.id, "label": self.label, "message": self.message,
                "parents": list(self.parents), "created_ns": self.created_ns,
                "tree": self.root.ref.hex(), "source": self.source, **self.stats, "recipes": list(self.recipes),
                "runtime": self.runtime}


class Store:
    """Chunks, contents, trees and snapshots under one data directory, and its hydration
    cache (``cache``: at most ``cache_max_bytes`` on disk, None: no limit; with a limit the
    cache is scanned at once, which removes the temporary files of dead hydrations).

    Raises RametError (EIO) when the directory holds a store of a format version this
    rametfs does not read.
    """

    read_only = False  # opened by open_read_only
    # A rametfs.store.remote.Remote: what a read finds missing here (a published snapshot's
    # record, a tree, a content record, a chunk) is fetched from it and kept (docs/remote.md).
    remote = None

    def __init__(self, data_dir: str | os.PathLike, cache_max_bytes: int | None = None):
        self.root = Path(data_dir).absolute()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        for sub in ("meta", "cache", "upper"):
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
        # sync=False: commits reach the OS page cache (safe against a daemon crash); fsync and
        # promote call sync() for durability against power loss.  The kernel's read-ahead
        # stays on: chunks are LMDB values read whole, and without it (MDB_NORDAHEAD, which
        # advises MADV_RANDOM) every 4 KiB of a cold chunk was a disk read of its own: 1 GiB
        # hydrated in 25 s against 1.5 s (docs/benchmarks.md, "Agent workloads").
        self.env = lmdb.open(str(self.root / "meta"), map_size=MAP_SIZE, max_dbs=len(DATABASES),
                             sync=False, metasync=False, max_readers=1024)
        self.db = {name: self.env.open_db(name.encode()) for name in DATABASES}
        self.layers = Layers(self.db)
        self._meta_file = self.root / "meta" / "data.mdb"
        self._reserved_to = 0  # bytes of the metadata file allocated, as last seen
        self._psize = self.env.stat()["psize"]  # bytes per LMDB page
        with self.write() as txn:
            version = txn.get(b"format", db=self.db["meta"])
            if version is not None and from_u64(version) not in READABLE_VERSIONS:
                raise RametError(errno.EIO, f"{self.root}: store format {from_u64(version)}, "
                                 f"this rametfs reads {READABLE_VERSIONS}")
            if version is None or from_u64(version) != FORMAT_VERSION:
                # A format 1 store is a format 2 store without sparse contents: marked
                # 2, so that no older rametfs reads the sparse records written from now on.
                txn.put(b"format", u64(FORMAT_VERSION), db=self.db["meta"])
        self.page_size = PAGE_SIZE
        self.gc_guard = GcGuard()
        self.cache = HydrationCache(self.root / "cache", cache_max_bytes)
        if cache_max_bytes is not None:
            self.cache.scan()

    @classmethod
    def open_read_only(cls, data_dir: str | os.PathLike) -> Store:
        """The store in ``data_dir`` for reading only (``rametfs fsck``, beside a live daemon
        or none): nothing in the directory is made or changed, LMDB is opened read-only,
        no write method may be called and :meth:`close` syncs nothing.

        Raises RametError: ENOENT when ``data_dir`` does not exist or holds no store (no
        ``meta/data.mdb``), EINVAL when it is not a directory, EIO when its format is one
        this rametfs does not read or its metadata does not open.
        """
        root = Path(data_dir).absolute()
        if not root.exists():
            raise RametError(errno.ENOENT, f"{root} does not exist")
        if not root.is_dir():
            raise RametError(errno.EINVAL, f"{root} is not a directory")
        if not (root / "meta" / "data.mdb").is_file():
            raise RametError(errno.ENOENT,
                             f"{root} holds no rametfs store (no meta/data.mdb): give the "
                             "--data directory a daemon was served with")
        store = cls.__new__(cls)
        store.root, store.page_size, store.read_only = root, PAGE_SIZE, True
        store.gc_guard = GcGuard()
        try:
            store.env = lmdb.open(str(root / "meta"), readonly=True, max_dbs=len(DATABASES),
                                  max_readers=1024)
            store.db = {}
            for name in DATABASES:
                try:
                    store.db[name] = store.env.open_db(name.encode(), create=False)
                except lmdb.NotFoundError:  # a database newer than the store (names)
                    if name != "names":
                        raise
        except lmdb.Error as exc:
            raise RametError(errno.EIO,
                             f"{root}/meta: not a rametfs store's metadata: {exc}") from None
        store.layers = Layers(store.db)
        with store.read() as txn:
            version = txn.get(b"format", db=store.db["meta"])
        if version is None or from_u64(version) not in READABLE_VERSIONS:
            store.close()
            raise RametError(errno.EIO, f"{root}: store format "
                             f"{'unknown' if version is None else from_u64(version)}, this "
                             f"rametfs reads {READABLE_VERSIONS}")
        store.cache = HydrationCache(root / "cache")
        return store

    def _reserve_metadata(self) -> None:
        """Keep :data:`METADATA_RESERVE` bytes allocated past LMDB's last committed page
        (posix_fallocate(3)); on a full disk the reserve left is kept as it is.  Call it
        holding a write transaction."""
        used = (self.env.info()["last_pgno"] + 1) * self._psize
        if used + METADATA_RESERVE // 2 <= self._reserved_to:
            return
        fd = os.open(self._meta_file, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, used + METADATA_RESERVE)
            self._reserved_to = used + METADATA_RESERVE
        except OSError:  # no room, or no fallocate here: the reserve is a best effort
            self._reserved_to = os.fstat(fd).st_size
        finally:
            os.close(fd)

    def _disk_full(self) -> bool:
        """Whether the data directory's file system has less than 1 MiB available (to
        unprivileged users: ext4 can fail a write with blocks still free in its reserve)."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize < 1 << 20

    def close(self) -> None:
        if not self.read_only:
            self.env.sync(True)
        self.env.close()

    def sync(self) -> None:
        """Flush LMDB to disk (fsync)."""
        self.env.sync(True)

    @contextmanager
    def write(self) -> Iterator[lmdb.Transaction]:
        """A write transaction; ENOSPC from LMDB becomes NoSpace and nothing is committed."""
        try:
            with self.env.begin(write=True) as txn:
                yield txn
                # Before the commit, under LMDB's writer lock: no page is written meanwhile
                # (glibc's posix_fallocate, where the file system has no fallocate, writes).
                self._reserve_metadata()
        except lmdb.MapFullError:
            raise NoSpace("metadata store is full") from None
        except lmdb.Error as exc:
            # A commit whose page writes find no room fails as EIO (a short write).
            if "No space left" in str(exc) or self._disk_full():
                raise NoSpace(f"no space left for metadata: {exc}") from None
            raise

    def read(self) -> lmdb.Transaction:
        return self.env.begin()

    # -- chunks and contents -------------------------------------------------------------

    def has_chunk(self, cid: ChunkId) -> bool:
        with self.env.begin(db=self.db["chunks"]) as txn:
            return txn.get(cid) is not None

    def chunk(self, cid: ChunkId) -> bytes:
        """Raw bytes of chunk ``cid``; IntegrityError (EIO) when missing or corrupt."""
        with self.env.begin(db=self.db["chunks"], buffers=True) as txn:
            envelope = txn.get(cid)
            if envelope is not None:
                return chunks.decode_chunk(cid, envelope)
        if self._fetched(KIND_CHUNK, [cid]):
            return self.chunk(cid)
        raise IntegrityError(f"chunk {cid.hex()} is missing")

    def content(self, cid: ContentId) -> Content:
        """The content record ``cid``; IntegrityError (EIO) when missing or malformed."""
        if cid == EMPTY_CONTENT:
            return _EMPTY
        with self.env.begin(db=self.db["contents"]) as txn:
            value = txn.get(cid)
        if value is None:
            if self._fetched(KIND_CONTENT, [cid]):
                return self.content(cid)
            raise IntegrityError(f"content {cid.hex()} is missing")
        return Content.unpack(cid, value)

    def _fetched(self, kind: int, ids: list[bytes]) -> bool:
        """Fetch ``ids`` of ``kind`` from the remote, if one is attached and has them; whether
        the first is stored now.  Blocking; RametError (EIO) when the remote fails."""
        if self.remote is None:
            return False
        self.remote.fill(self, kind, ids)
        db = {KIND_CHUNK: "chunks", KIND_CONTENT: "contents", KIND_TREE: "trees"}[kind]
        with self.env.begin(db=self.db[db]) as txn:
            return txn.get(ids[0]) is not None

    def put_content(self, txn: lmdb.Transaction, content: Content) -> ContentId:
        """Record ``content`` (its chunks already stored) in ``txn``; returns its id."""
        cid = content.id
        if cid != EMPTY_CONTENT:
            self.gc_guard.pin(cid)
            txn.put(cid, content.pack(), db=self.db["contents"], overwrite=False)
        return cid

    def hydrate(self, cid: ContentId) -> str:
        """Path of the decompressed content ``cid`` in the shared cache
        (:mod:`rametfs.store.cache`), building it if absent.  Blocking (reads every chunk
        holding data): call it from a worker thread.  Raises IntegrityError (EIO), NoSpace
        (ENOSPC), RametError (EFBIG: larger than the cache's file system holds)."""
        self._hydrated(cid, hold=False)
        return self.cache.path(cid)

    def open_hydrated(self, cid: ContentId) -> int:
        """A descriptor (O_RDONLY) of the hydrated content ``cid``, hydrating it first if
        absent; the cache never removes the content while it is held: call
        ``cache.release(cid)`` after closing it.  Blocking; raises as :meth:`hydrate`."""
        return self._hydrated(cid, hold=True)

    def _hydrated(self, cid: bytes, hold: bool) -> int | bool:
        got = self.cache.get(cid, hold)
        if got is not False:
            return got
        content = self.content(cid)
        if self.remote is not None:  # every chunk it lacks in a few GETs, not one per page
            self.remote.fill(self, KIND_CHUNK, [c for _, c in content.pages()])
        self.cache.make_room(content.stored_pages * self.page_size)
        try:
            self._write_cache_file(cid, content)
        except NoSpace:
            if not self.cache.remove_unheld():
                raise
            self._write_cache_file(cid, content)
        return self.cache.added(cid, hold)

    def _write_cache_file(self, cid: bytes, content: Content) -> None:
        """Write ``content`` to its cache file: its size set, then only its pages holding
        data (holes stay holes), under a temporary name renamed into place."""
        tmp = self.cache.temp_path(cid)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, content.size)
                for page, chunk in content.pages():
                    raw = self.chunk(chunk)
                    start = page * self.page_size
                    if len(raw) != min(self.page_size, content.size - start):
                        raise IntegrityError(f"content {cid.hex()}: page {page} holds "
                                             f"{len(raw)} bytes")
                    if os.pwrite(fd, raw, start) < len(raw):
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fchmod(fd, 0o400)
            finally:
                os.close(fd)
            os.replace(tmp, self.cache.path(cid))
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if exc.errno == errno.ENOSPC:
                raise NoSpace(f"no space left to hydrate content {cid.hex()}") from None
            if exc.errno == errno.EFBIG:
                raise RametError(errno.EFBIG,
                                 f"content {cid.hex()} of {content.size} bytes is larger than "
                                 "the cache's file system holds") from None
            raise
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def cache_path(self, cid: bytes) -> str:
        """Where the hydrated copy of content ``cid`` lives (it may not exist yet)."""
        return self.cache.path(cid)

    def read_page(self, cid: ContentId, page: int) -> bytes:
        """Raw bytes of page ``page`` of content ``cid``: zeros for a hole, b"" past the end.
        Blocking."""
        try:
            with open(self.cache.path(cid), "rb") as f:
                return os.pread(f.fileno(), self.page_size, page * self.page_size)
        except FileNotFoundError:
            pass
        content = self.content(cid)
        start = page * self.page_size
        if start >= content.size:
            return b""
        chunk = content.chunk(page)
        if chunk is None:
            return bytes(min(self.page_size, content.size - start))
        return self.chunk(chunk)

    # -- trees ---------------------------------------------------------------------------

    def tree(self, tid: TreeId) -> dict[bytes, Entry]:
        """Entries of tree ``tid`` by name; IntegrityError (EIO) when missing."""
        return run_steps(self.tree_steps(tid))

    def tree_steps(self, tid: TreeId) -> Steps[dict[bytes, Entry]]:
        """:meth:`tree` as steps (``trees.decode_tree_steps``); no transaction is held
        across a step."""
        with self.env.begin(db=self.db["trees"]) as txn:
            value = txn.get(tid)
        if value is None:
            if not self._fetched(KIND_TREE, [tid]):
                raise IntegrityError(f"tree {tid.hex()} is missing")
            with self.env.begin(db=self.db["trees"]) as txn:
                value = txn.get(tid)
        return (yield from decode_tree_steps(value))

    def tree_bytes(self, tid: bytes) -> int:
        """Bytes of tree ``tid``'s stored value (what decoding it costs); 0 when missing, but
        :data:`REMOTE_TREE_BYTES` with a remote: fetching it costs round trips, which a
        caller that weighs this cost (``Overlay.prefetch``) makes in a worker thread."""
        with self.env.begin(db=self.db["trees"], buffers=True) as txn:
            value = txn.get(tid)
            if value is None:
                return 0 if self.remote is None else REMOTE_TREE_BYTES
            return len(value)

    def put_tree(self, txn: lmdb.Transaction, entries: list[Entry]) -> TreeId:
        """Store a tree (its subtrees already stored, in ``txn`` or before) and its totals."""
        tid, value = encode_tree(entries)
        self.put_encoded_tree(txn, tid, value, lambda: run_steps(
            self.totals_steps(entries, partial(self.stored_totals, txn))))
        return tid

    def put_encoded_tree(self, txn: lmdb.Transaction, tid: bytes, value: bytes,
                         totals: Callable[[], list[int]]) -> bool:
        """Store tree ``tid`` encoded as ``value`` (``trees.encode_tree``) unless it is
        stored, with its totals (``totals()``, only then); True when it was not stored.
        A running gc keeps it (``gc_guard.pin``, inside ``txn``: rametfs.store.gc)."""
        self.gc_guard.pin(tid)
        if not txn.put(tid, value, db=self.db["trees"], overwrite=False):
            return False
        txn.put(tid, msgpack.packb(totals()), db=self.db["tree_stats"])
        return True

    @staticmethod
    def totals_steps(entries: list[Entry], below: Callable[[bytes], list[int]]
                     ) -> Steps[list[int]]:
        """What ``tree_stats`` holds for a tree of ``entries``: ``[files, bytes, directories,
        symlinks]`` below it, a subdirectory's own from ``below(its tree id)``; as steps
        (rametfs.treewalk.run_steps), one per ``trees.TREE_STEP`` entries."""
        files = size = dirs = symlinks = 0
        for at in range(0, len(entries), TREE_STEP):
            for e in entries[at:at + TREE_STEP]:
                if e.is_dir:
                    sub = below(e.ref)
                    files, size = files + sub[0], size + sub[1]
                    dirs, symlinks = dirs + sub[2] + 1, symlinks + sub[3]
                elif e.is_reg:
                    files, size = files + 1, size + e.size
                elif e.is_symlink:
                    symlinks += 1
            yield
        return [files, size, dirs, symlinks]

    def stored_totals(self, txn: lmdb.Transaction, tid: bytes) -> list[int]:
        """``tree_stats`` of stored tree ``tid``: ``[files, bytes, directories, symlinks]``
        below it (:meth:`totals_steps`)."""
        return msgpack.unpackb(txn.get(tid, db=self.db["tree_stats"]))

    def tree_totals(self, txn: lmdb.Transaction, tid: bytes) -> dict:
        """Names of files (each hard link counts), their bytes, directories (the top one
        included) and symlinks of the tree ``tid``, from ``tree_stats``."""
        files, size, dirs, symlinks = self.stored_totals(txn, tid)
        return {"files": files, "bytes": size, "dirs": dirs + 1, "symlinks": symlinks}

    # -- snapshots -----------------------------------------------------------------------

    def put_snapshot(self, txn: lmdb.Transaction, root: Entry, parents: list[str], label: str,
                     message: str, source: str, stats: dict,
                     recipes: list[dict] | None = None,
                     runtime: dict | None = None) -> Snapshot:
        """Record a snapshot whose trees are stored (in ``txn`` or before); returns it.

        ``root`` is the entry of the top directory (its ``ref`` the root tree id);
        ``recipes`` (docs/format.md) are stored only when there are some, and with them
        ``runtime``, the sandbox to run them in.
        """
        record = {"root": root.pack(), "parents": parents, "created_ns": time.time_ns(),
                  "label": label, "message": message, "source": source, "stats": stats}
        if recipes:
            record["recipes"] = recipes
            if runtime:
                record["runtime"] = runtime
        value = msgpack.packb(record, use_bin_type=True)
        sid = chunks.chunk_id(value)
        txn.put(sid, value, db=self.db["snapshots"])
        return self._snapshot(sid, value)

    @staticmethod
    def _snapshot(sid: bytes, value: bytes) -> Snapshot:
        r = msgpack.unpackb(value)
        return Snapshot(sid.hex(), Entry.unpack(r["root"]), tuple(r["parents"]), r["created_ns"], r["label"],
                        r["message"], r["source"], r["stats"], tuple(r.get("recipes", ())),
                        r.get("runtime"))

    def snapshot(self, ref: str) -> Snapshot:
        """The snapshot ``ref`` names: its id, a unique id prefix (>= 8 hex digits) or a
        snapshot name (:mod:`rametfs.store.names`).  The one resolver of snapshot
        references: every command that takes a snapshot comes here, here
        (:meth:`local_snapshot`) and then, when :meth:`asks_remote`, in the catalog
        (:meth:`published_snapshot`: blocking, a worker thread's call).

        Raises NotFound (ENOENT) when none or several match; RametError (EIO) when the remote
        is asked and fails.
        """
        try:
            return self.local_snapshot(ref)
        except NotFound:
            if not self.asks_remote(ref):
                raise
        return self.published_snapshot(ref)

    def asks_remote(self, ref: str) -> bool:
        """Whether :meth:`snapshot` asks the remote's catalog for ``ref`` when it is found
        nowhere here: an id, an id prefix or a valid name, with a remote attached."""
        if self.remote is None:
            return False
        try:
            check_name(ref)
        except InvalidArgument:
            return HEX_REF.fullmatch(ref) is not None
        return True

    def published_snapshot(self, ref: str) -> Snapshot:
        """The published snapshot whose id or id prefix is ``ref``, or that the catalog's
        name ``ref`` points at, looked up in the remote's catalog (:meth:`asks_remote` must
        be true); its record is checked and kept here, so the snapshot is local from then
        on (a name is not: it is asked again, since another worker may move it).
        Blocking (a query, retried while the catalog is unreachable).  Raises NotFound
        (ENOENT) when none or several match, RametError (EIO) when the catalog fails,
        IntegrityError (EIO) when the record does not match its id."""
        found = self.remote.snapshot(ref)
        if len(found) != 1:
            raise NotFound(f"no snapshot {ref!r} here nor published" if not found
                           else f"snapshot prefix {ref!r} is ambiguous")
        sid, value = found[0]
        if chunks.chunk_id(value) != sid:
            raise IntegrityError(f"published snapshot {sid.hex()} does not match its id")
        with self.write() as txn:
            txn.put(sid, value, db=self.db["snapshots"], overwrite=False)
        return self._snapshot(sid, value)

    def local_snapshot(self, ref: str) -> Snapshot:
        """:meth:`snapshot` of what this store holds only (never the remote: what ``rm`` and
        ``forget`` act on, and what the trio thread may look up).  NotFound (ENOENT) when
        none or several match."""
        if not HEX_REF.fullmatch(ref):
            return self._named(ref)
        prefix = bytes.fromhex(ref[: len(ref) // 2 * 2])
        found = []
        with self.env.begin(db=self.db["snapshots"]) as txn:
            cur = txn.cursor()
            if cur.set_range(prefix):
                for key, value in cur:
                    if not key.startswith(prefix) or len(found) > 1:
                        break
                    if key.hex().startswith(ref.lower()):
                        found.append((key, value))
        if len(found) != 1:
            raise NotFound(f"no snapshot {ref!r}" if not found
                           else f"snapshot prefix {ref!r} is ambiguous")
        return self._snapshot(*found[0])

    def _named(self, ref: str) -> Snapshot:
        with self.env.begin() as txn:
            sid = txn.get(ref.encode(errors="surrogateescape"), db=self.db["names"]) \
                if "names" in self.db else None
            value = None if sid is None else txn.get(sid, db=self.db["snapshots"])
        if value is None:
            if all(c in "0123456789abcdefABCDEF" for c in ref):
                raise NotFound(f"no snapshot {ref!r}: give at least {MIN_ID_PREFIX} hex digits")
            raise NotFound(f"no snapshot {ref!r}: no such snapshot name, and not an id prefix")
        return self._snapshot(sid, value)

    # -- names (rametfs.store.names) -------------------------------------------------------

    def set_name(self, name: str, ref: str) -> tuple[Snapshot, str | None]:
        """Point snapshot name ``name`` at the snapshot ``ref`` names (created, or moved);
        returns the snapshot and the id (hex) the name pointed at before (None: new).
        Raises InvalidArgument (EINVAL) for a bad name, NotFound (ENOENT) for ``ref``."""
        check_name(name)
        snap = self.snapshot(ref)
        with self.write() as txn:
            old = txn.get(name.encode(), db=self.db["names"])
            txn.put(name.encode(), bytes.fromhex(snap.id), db=self.db["names"])
        return snap, None if old is None else old.hex()

    def delete_name(self, name: str) -> str:
        """Delete snapshot name ``name``; returns the id (hex) it pointed at.  Raises
        NotFound (ENOENT) when there is no such name."""
        with self.write() as txn:
            old = txn.get(name.encode(errors="surrogateescape"), db=self.db["names"])
            if old is None:
                raise NotFound(f"no snapshot name {name!r}")
            txn.delete(name.encode(errors="surrogateescape"), db=self.db["names"])
        return old.hex()

    def delete_records(self, txn: lmdb.Transaction, snapshots: Iterable[str],
                       names: Iterable[str]) -> None:
        """Delete the snapshot records ``snapshots`` (ids, hex) and the snapshot ``names`` in
        ``txn`` (rametfs.core.lifecycle decides which)."""
        for name in names:
            txn.delete(name.encode(), db=self.db["names"])
        for sid in snapshots:
            txn.delete(bytes.fromhex(sid), db=self.db["snapshots"])

    def snapshot_count(self) -> int:
        """How many snapshot records the store holds (O(1): LMDB's count)."""
        with self.read() as txn:
            return txn.stat(self.db["snapshots"])["entries"]

    def names(self, txn: lmdb.Transaction | None = None) -> dict[str, str]:
        """Every snapshot name and the id (hex) it points at, by name."""
        if "names" not in self.db:
            return {}
        with contextlib.ExitStack() as stack:
            if txn is None:
                txn = stack.enter_context(self.env.begin())
            return {k.decode(): v.hex() for k, v in txn.cursor(db=self.db["names"])}

    def snapshots_json(self) -> list[dict]:
        """Every snapshot's record (:meth:`Snapshot.to_json`) with ``names``, the names
        pointing at it (sorted), oldest first: what a root status lists."""
        by_id: dict[str, list[str]] = {}
        for name, sid in self.names().items():
            by_id.setdefault(sid, []).append(name)
        return [{**s.to_json(), "names": by_id.get(s.id, [])} for s in self.snapshots()]

    def snapshot_by_raw_id(self, sid: bytes) -> Snapshot | None:
        with self.env.begin(db=self.db["snapshots"]) as txn:
            value = txn.get(sid)
        return None if value is None else self._snapshot(sid, value)

    def snapshots(self, txn: lmdb.Transaction | None = None) -> list[Snapshot]:
        """Every snapshot (read in ``txn``, else a transaction of its own), oldest first."""
        with contextlib.ExitStack() as stack:
            if txn is None:
                txn = stack.enter_context(self.env.begin())
            items = [self._snapshot(k, v) for k, v in txn.cursor(db=self.db["snapshots"])]
        return sorted(items, key=lambda s: s.created_ns)
