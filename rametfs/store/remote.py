"""The remote: pack objects in S3-compatible object storage, found through the PostgreSQL
catalog (:mod:`rametfs.store.remote_catalog`), and the local store's source of what it lacks
(docs/remote.md).

A *pack object* is ``<PREFIX>packs/<name>``: :data:`PACK_MAGIC`, then objects back to back,
each the exact bytes the local store keeps (``kind`` :data:`KIND_CHUNK`: a chunk envelope;
:data:`KIND_CONTENT`: a content record; :data:`KIND_TREE`: msgpack ``[tree value, tree_stats
value]``); ``name`` is the BLAKE3 hex of the pack's bytes.  The catalog says where each object
lies (pack, offset, length), so one ranged GET reads it, and neighbours published together are
read together.  Every object is checked against its id when fetched, as the local store
checks it (``IntegrityError``, EIO): the object store is not trusted with content.

The S3 client is boto3 with the standard AWS chain (``AWS_ENDPOINT_URL``, keys, region,
config files); it retries a failed request :data:`S3_ATTEMPTS` times in all with backoff
(botocore's standard mode), then the read or publish fails with EIO.  No message here holds a
credential: boto3's errors name the operation, the bucket and key, never the keys.
"""

from __future__ import annotations

import errno
import logging
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import blake3
import msgpack

from ..errors import IntegrityError, InvalidArgument, RametError
from . import chunks
from .chunks import Content
from .remote_catalog import Catalog

log = logging.getLogger(__name__)

KIND_CHUNK, KIND_CONTENT, KIND_TREE = 0, 1, 2
KIND_NAMES = {KIND_CHUNK: "chunk", KIND_CONTENT: "content", KIND_TREE: "tree"}
PACK_MAGIC = b"RMP\x01"
PACK_TARGET_BYTES = 16 << 20  # a pack is closed once it holds this much
MERGE_GAP_BYTES = 256 << 10  # objects of one pack this close are read in one GET
MAX_GET_BYTES = 16 << 20  # nor is a GET longer than this
FETCH_BATCH = 512  # chunks or content records fetched and stored per transaction
TREE_READ_AHEAD = 32768  # trees a tree's fetch brings along (breadth first below it)
# Of the pack after a fetched object, what is read along with it (objects of the same kind
# the store lacks): content records are about 100 bytes, chunks up to 64 KiB.
READ_AHEAD_BYTES = {KIND_CONTENT: 256 << 10, KIND_CHUNK: 1 << 20}
GET_THREADS = 8  # ranged GETs in flight per fetch
S3_ATTEMPTS = 4  # the first try and 3 retries (botocore standard mode: exponential backoff)
S3_TIMEOUT_S = 10
_URL = re.compile(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?\Z")


def parse_url(url: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``s3://BUCKET/PREFIX``; the prefix ends with ``/`` unless
    empty.  Raises InvalidArgument (EINVAL) for anything else."""
    m = _URL.match(url)
    if not m:
        raise InvalidArgument(f"remote {url!r}: give s3://BUCKET/PREFIX (a bucket name of 3-63 "
                              "lowercase letters, digits, dots and hyphens)")
    prefix = (m.group(2) or "").strip("/")
    return m.group(1), prefix + "/" if prefix else ""


class ObjectStore:
    """The bucket and prefix of ``url``, through one boto3 client (thread-safe).

    ``requests`` and ``bytes_sent``/``bytes_received`` count what it did, for figures.
    """

    def __init__(self, url: str):
        import boto3
        import botocore.config
        self.bucket, self.prefix = parse_url(url)
        self.url = url
        self.client = boto3.session.Session().client("s3", config=botocore.config.Config(
            retries={"max_attempts": S3_ATTEMPTS, "mode": "standard"},
            connect_timeout=S3_TIMEOUT_S, read_timeout=S3_TIMEOUT_S,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required"))
        self._count = threading.Lock()
        self.requests = self.bytes_sent = self.bytes_received = 0

    def key(self, pack: str) -> str:
        return f"{self.prefix}packs/{pack}"

    def _error(self, what: str, exc: Exception) -> RametError:
        return RametError(errno.EIO, f"s3://{self.bucket}/{what}: {exc}")

    def put(self, pack: str, data: bytes) -> None:
        """Store pack ``pack`` (durable once this returns).  RametError (EIO) on failure."""
        import botocore.exceptions
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.key(pack), Body=data)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._error(self.key(pack), exc) from None
        with self._count:
            self.requests += 1
            self.bytes_sent += len(data)

    def size(self, pack: str) -> int | None:
        """Bytes of pack ``pack``, None when there is none (HEAD).  RametError (EIO) on
        another failure."""
        import botocore.exceptions
        try:
            reply = self.client.head_object(Bucket=self.bucket, Key=self.key(pack))
        except botocore.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self._error(self.key(pack), exc) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise self._error(self.key(pack), exc) from None
        finally:
            with self._count:
                self.requests += 1
        return reply["ContentLength"]

    def get(self, pack: str, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)`` of pack ``pack``.  RametError (EIO) on failure
        or a short reply."""
        import botocore.exceptions
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key(pack),
                                           Range=f"bytes={start}-{start + length - 1}")
            data = reply["Body"].read()
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._error(self.key(pack), exc) from None
        with self._count:
            self.requests += 1
            self.bytes_received += len(data)
        if len(data) != length:
            raise RametError(errno.EIO,
                             f"s3://{self.bucket}/{self.key(pack)}: {len(data)} bytes at "
                             f"{start}, {length} expected")
        return data


    def delete(self, packs: list[str]) -> None:
        """Delete packs ``packs`` (absent ones too), 1,000 a request.  RametError (EIO) on
        failure."""
        import botocore.exceptions
        for at in range(0, len(packs), 1000):
            keys = [{"Key": self.key(p)} for p in packs[at:at + 1000]]
            try:
                reply = self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": keys, "Quiet": True})
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
                raise self._error(f"{self.prefix}packs/", exc) from None
            finally:
                with self._count:
                    self.requests += 1
            if reply.get("Errors"):
                e = reply["Errors"][0]
                raise RametError(errno.EIO, f"s3://{self.bucket}/{e.get('Key')}: delete: "
                                 f"{e.get('Code')} {e.get('Message')}")

    def list_packs(self) -> list[tuple[str, float]]:
        """``(name, last modified: epoch seconds)`` of every pack object, 1,000 a request.
        RametError (EIO) on failure."""
        import botocore.exceptions
        found = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=f"{self.prefix}packs/"):
                with self._count:
                    self.requests += 1
                found += [(o["Key"].rsplit("/", 1)[1], o["LastModified"].timestamp())
                          for o in page.get("Contents", ())]
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._error(f"{self.prefix}packs/", exc) from None
        return found


class PackWriter:
    """Objects for one pack: :meth:`add` them, then :meth:`finish`."""

    def __init__(self):
        self.data = bytearray(PACK_MAGIC)
        self.rows: list[tuple[int, bytes, int, int]] = []  # (kind, id, offset, length)

    def add(self, kind: int, oid: bytes, value: bytes) -> None:
        self.rows.append((kind, oid, len(self.data), len(value)))
        self.data += value

    @property
    def full(self) -> bool:
        return len(self.data) >= PACK_TARGET_BYTES

    def finish(self) -> tuple[str, bytes]:
        """``(name, bytes)`` of the pack."""
        data = bytes(self.data)
        return blake3.blake3(data).hexdigest(), data


def tree_object(value: bytes, totals: bytes) -> bytes:
    """The pack object of a tree: its stored value and its ``tree_stats`` value."""
    return msgpack.packb([value, totals], use_bin_type=True)


def check_object(kind: int, oid: bytes, data: bytes) -> bytes | tuple[bytes, bytes]:
    """``data`` fetched as ``kind`` ``oid``, checked against the id: the chunk envelope, the
    content record, or a tree's ``(value, totals)``.  IntegrityError (EIO) when it does not
    match."""
    if kind == KIND_CHUNK:
        chunks.decode_chunk(oid, data)
        return data
    if kind == KIND_CONTENT:
        if Content.unpack(oid, data).id != oid:
            raise IntegrityError(f"remote content {oid.hex()} does not match its id")
        return data
    try:
        value, totals = msgpack.unpackb(data)
        ok = isinstance(value, bytes) and isinstance(totals, bytes)
    except (ValueError, TypeError, msgpack.UnpackException):
        ok = False
    if not ok or chunks.chunk_id(value) != oid:
        raise IntegrityError(f"remote tree {oid.hex()} does not match its id")
    return value, totals


class Remote:
    """The object store of ``url`` and the catalog at ``dsn``: what publish writes to and
    what a store reads what it lacks from (:meth:`fill`)."""

    def __init__(self, url: str, dsn: str):
        self.url = url
        self.objects = ObjectStore(url)
        self.catalog = Catalog(dsn, url)
        self._pool = ThreadPoolExecutor(GET_THREADS, thread_name_prefix="rametfs-remote")

    def close(self) -> None:
        self._pool.shutdown()
        self.catalog.close()

    # -- publishing ------------------------------------------------------------------------

    def upload(self, pack: PackWriter, publishing: int) -> tuple[str, int]:
        """PUT ``pack``, then record its objects in the catalog for the registered publish
        ``publishing`` (``Catalog.begin_publish``); ``(name, bytes)``."""
        name, data = pack.finish()
        self.objects.put(name, data)
        self.catalog.add_pack(name, len(data), pack.rows, publishing)
        return name, len(data)

    # -- reading ---------------------------------------------------------------------------

    def fetch(self, kind: int, ids: Iterable[bytes], ahead: int = 0,
              lacking: Callable[[list[bytes]], list[bytes]] | None = None
              ) -> dict[bytes, bytes | tuple]:
        """The published objects among ``ids``, checked (:func:`check_object`), by id; ids
        not published are left out.  Ranges of one pack that lie close are read in one GET,
        and the GETs run on :data:`GET_THREADS` threads.  ``ahead``: bytes of each pack
        after the last object asked for whose objects of ``kind`` that ``lacking`` keeps
        (``lacking(ids)``: those the caller lacks) are read along and returned too
        (read-ahead: a publish lays files out in path order, side by side)."""
        where = self.catalog.locate(kind, ids)
        by_pack: dict[str, list[tuple[int, int, bytes]]] = {}
        for oid, (pack, off, length) in where.items():
            by_pack.setdefault(pack, []).append((off, length, oid))
        if ahead:
            for pack, items in by_pack.items():
                end = max(off + length for off, length, _ in items)
                asked = {oid for _, _, oid in items}
                near = {oid: (off, length) for oid, off, length
                        in self.catalog.objects_in(kind, pack, end, end + ahead)
                        if oid not in asked}
                items += [(*near[oid], oid) for oid in (lacking or list)(list(near))]
        reads = []  # (pack, start, length, [(off, length, oid)])
        for pack, items in by_pack.items():
            items.sort()
            group = [items[0]]
            for item in items[1:]:
                start, end = group[0][0], group[-1][0] + group[-1][1]
                if item[0] - end <= MERGE_GAP_BYTES and item[0] + item[1] - start <= MAX_GET_BYTES:
                    group.append(item)
                else:
                    reads.append((pack, group))
                    group = [item]
            reads.append((pack, group))

        def read(job):
            pack, group = job
            start = group[0][0]
            data = self.objects.get(pack, start, group[-1][0] + group[-1][1] - start)
            return [(oid, check_object(kind, oid, data[off - start:off - start + length]))
                    for off, length, oid in group]

        found: dict[bytes, bytes | tuple] = {}
        for part in (self._pool.map(read, reads) if len(reads) > 1 else map(read, reads)):
            found.update(part)
        return found

    def fill(self, store, kind: int, ids: list[bytes]) -> None:
        """Fetch those of ``ids`` that ``store`` lacks as ``kind`` and store them, with
        read-ahead: for trees the trees below them (:meth:`_fill_trees`), for content records
        and chunks what the store lacks of the next :data:`READ_AHEAD_BYTES` of their packs.
        Ids not published stay missing (the store's
        read then fails as it would without a remote).  Raises RametError (EIO) when the
        object store or the catalog fails, IntegrityError when an object does not match;
        either is logged (a warning)."""
        try:
            self._fill(store, kind, list(dict.fromkeys(ids)))
        except RametError as exc:  # what fails a read says so here, for the daemon's log
            log.warning("fetching %d %s(s) from %s failed: %s", len(ids), KIND_NAMES[kind],
                        self.url, exc)
            raise

    def _fill(self, store, kind: int, ids: list[bytes]) -> None:
        if kind == KIND_TREE:
            return self._fill_trees(store, ids)
        for at in range(0, len(ids), FETCH_BATCH):
            got = self.fetch(kind, _lacking(store, kind, ids[at:at + FETCH_BATCH]),
                             READ_AHEAD_BYTES[kind], lambda near: _lacking(store, kind, near))
            if got:
                with store.write() as txn:
                    _put(store, txn, kind, got)

    def _fill_trees(self, store, ids: list[bytes]) -> None:
        """Trees ``ids``, then breadth first the trees below them, :data:`TREE_READ_AHEAD`
        in all at most: one round trip per level (a ``find`` of a never-seen snapshot then
        asks no more), each level stored in one transaction.  Content records wait for a
        read, which brings its neighbours (:data:`READ_AHEAD_BYTES`)."""
        level, budget = _lacking(store, KIND_TREE, ids), TREE_READ_AHEAD
        while level:
            got = self.fetch(KIND_TREE, level)
            budget -= len(got)
            subtrees = [e[6] for value, _ in got.values()
                        for e in msgpack.unpackb(value, use_list=True)
                        if e[1] & 0o170000 == 0o040000]
            with store.write() as txn:
                _put(store, txn, KIND_TREE, got)
            level = _lacking(store, KIND_TREE, subtrees)[:max(budget, 0)]

    def snapshot(self, ref: str) -> list[tuple[bytes, bytes]]:
        """``(id, record)`` of the published snapshots whose id starts with ``ref`` (at most
        two), or that the catalog's name ``ref`` points at."""
        return self.catalog.snapshot(ref)


_DB = {KIND_CHUNK: "chunks", KIND_CONTENT: "contents", KIND_TREE: "trees"}


def _lacking(store, kind: int, ids: list[bytes]) -> list[bytes]:
    with store.read() as txn:
        db = store.db[_DB[kind]]
        return [i for i in dict.fromkeys(ids) if txn.get(i, db=db) is None]


def _put(store, txn, kind: int, objs: dict) -> None:
    for oid, obj in objs.items():
        if kind == KIND_TREE:
            value, totals = obj
            store.put_encoded_tree(txn, oid, value, lambda totals=totals: msgpack.unpackb(totals))
        else:
            txn.put(oid, obj, db=store.db[_DB[kind]], overwrite=False)
