"""Publish a local snapshot to the remote (docs/remote.md): upload, in pack objects, the
trees, content records and chunks the remote lacks, then list the snapshot in the catalog.

Order is what makes it safe to stop at any point: chunks first, then content records, then
trees children before parents, pack by pack, each pack's catalog rows recorded only after its
PUT succeeded.  So a tree's row in the catalog means everything below it is published: a
publish that finds a tree published skips its whole subtree (a 1% change uploads about 1%),
a publish cut short (crash, outage) leaves only durable packs and resumes where it stopped,
and the snapshot row, written last in a transaction of its own that checks its root tree is
there, is never listed before all it needs.  Two workers publishing the same content may both
upload it; the catalog keeps the first row, so every reader fetches one copy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from . import remote as rm
from .remote import KIND_CHUNK, KIND_CONTENT, KIND_TREE, PackWriter, Remote
from .chunks import Content
from ..errors import RametError
from .store import EMPTY_CONTENT, Snapshot, Store
from .trees import decode_tree


@dataclass
class Published:
    """What a publish did: ``snapshot`` (hex id), whether it was listed ``already``, and the
    ``packs``, ``objects`` (trees, contents, chunks uploaded) and ``bytes`` it uploaded,
    S3 ``requests``, ``seconds``."""

    snapshot: str
    already: bool = False
    packs: int = 0
    trees: int = 0
    contents: int = 0
    chunks: int = 0
    bytes: int = 0
    requests: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def publish(store: Store, remote: Remote, ref: str,
            progress: Callable[[Published], None] | None = None) -> Published:
    """Publish the local snapshot ``ref`` names; ``progress(so_far)`` is called after each
    pack.  Idempotent: a listed snapshot uploads nothing.

    Raises NotFound (ENOENT) for ``ref``, RametError (EIO) when the object store or the
    catalog fails (what was uploaded stays, and the next publish resumes from it),
    IntegrityError when the local store lacks or holds a bad record the snapshot needs.
    """
    started = time.monotonic()
    requests0 = remote.objects.requests
    snap = store.snapshot(ref)
    sid = bytes.fromhex(snap.id)
    done = Published(snap.id)
    if remote.catalog.has_snapshot(sid):
        done.already = True
        return done
    # Registered before the first question of what is published: no remote gc deletes what
    # the answers say is there while this runs (rametfs.store.remote_gc).
    publishing = remote.catalog.begin_publish(sid)
    try:
        _upload(store, remote, snap, done, publishing, progress, started, requests0)
    finally:  # a registration left (the catalog gone) is stale after the gc's grace
        with contextlib.suppress(RametError):
            remote.catalog.end_publish(publishing)
    done.requests = remote.objects.requests - requests0
    done.seconds = time.monotonic() - started
    return done


def _upload(store: Store, remote: Remote, snap: Snapshot, done: Published, publishing: int,
            progress: Callable[[Published], None] | None, started: float,
            requests0: int) -> None:
    """What ``snap`` needs that the remote lacks, uploaded, then the snapshot listed; the
    figures in ``done`` (``started``: monotonic s, ``requests0``: the count then)."""
    sid = bytes.fromhex(snap.id)
    trees, in_path_order = _missing_trees(store, remote, snap.root.ref)
    contents = remote.catalog.missing(KIND_CONTENT, dict.fromkeys(in_path_order))
    with store.read() as txn:
        records = {c: bytes(txn.get(c, db=store.db["contents"]) or _missing("content", c))
                   for c in contents}
    wanted = dict.fromkeys(cid for c, value in records.items()
                           for cid in Content.unpack(c, value).chunk_ids())
    chunk_ids = remote.catalog.missing(KIND_CHUNK, wanted)

    pack = PackWriter()

    def flush() -> None:
        nonlocal pack
        if not pack.rows:
            return
        _, size = remote.upload(pack, publishing)
        done.packs += 1
        done.bytes += size
        for kind, *_ in pack.rows:
            if kind == KIND_TREE:
                done.trees += 1
            elif kind == KIND_CONTENT:
                done.contents += 1
            else:
                done.chunks += 1
        done.requests = remote.objects.requests - requests0
        done.seconds = time.monotonic() - started
        pack = PackWriter()
        if progress is not None:
            progress(done)

    def add(kind: int, oid: bytes, value: bytes) -> None:
        pack.add(kind, oid, value)
        if pack.full:
            flush()

    for cid in chunk_ids:
        with store.read() as txn:
            envelope = txn.get(cid, db=store.db["chunks"])
            add(KIND_CHUNK, cid, bytes(envelope) if envelope is not None
                else _missing("chunk", cid))
    for cid, value in records.items():
        add(KIND_CONTENT, cid, value)
    for tid in trees:  # children before parents
        with store.read() as txn:
            value, totals = txn.get(tid, db=store.db["trees"]), txn.get(
                tid, db=store.db["tree_stats"])
            add(KIND_TREE, tid, rm.tree_object(bytes(value), bytes(totals)))
    flush()
    with store.read() as txn:
        record = bytes(txn.get(sid, db=store.db["snapshots"]))
    done.already = not remote.catalog.add_snapshot(sid, record, snap.label, snap.created_ns,
                                                   snap.root.ref, KIND_TREE, publishing)


def _missing(what: str, oid: bytes):
    from ..errors import IntegrityError
    raise IntegrityError(f"{what} {oid.hex()} is missing from the local store")


def _missing_trees(store: Store, remote: Remote, root: bytes
                   ) -> tuple[list[bytes], list[bytes]]:
    """The ids of every tree below (and with) ``root`` that the catalog lacks, children
    before parents, and the content ids of their files in path order (a directory's files,
    then its subdirectories by name: what a reader of the tree reads one after another,
    which read-ahead then finds side by side); a published tree's subtrees are not read.
    The catalog is asked once per level of the tree (in batches), not once per tree."""
    found: dict[bytes, tuple[list[bytes], list[bytes]]] = {}
    level = [root]
    while level:
        next_level = []
        for tid in remote.catalog.missing(KIND_TREE, level):
            if tid in found:
                continue
            subtrees, contents = [], []
            for e in decode_tree(_tree_value(store, tid)).values():
                if e.is_dir:
                    subtrees.append(e.ref)
                elif e.is_reg and e.ref != EMPTY_CONTENT:
                    contents.append(e.ref)
            found[tid] = (subtrees, contents)
            next_level.extend(t for t in subtrees if t not in found)
        level = list(dict.fromkeys(next_level))
    # Depth first by an explicit stack (trees may be tens of thousands deep): files on the
    # way down, trees on the way up.
    order, contents, seen, stack = [], [], set(), [(root, False)]
    while stack:
        tid, expanded = stack.pop()
        if tid not in found:
            continue
        if expanded:
            order.append(tid)
            continue
        if tid in seen:
            continue
        seen.add(tid)
        contents.extend(found[tid][1])
        stack.append((tid, True))
        stack.extend((t, False) for t in reversed(found[tid][0]) if t not in seen)
    return order, contents


def _tree_value(store: Store, tid: bytes) -> bytes:
    with store.read() as txn:
        value = txn.get(tid, db=store.db["trees"])
    return bytes(value) if value is not None else _missing("tree", tid)
