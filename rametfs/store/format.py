"""Every stored record: the LMDB databases, their key and value layouts, and the chunk envelope.

Format version :data:`FORMAT_VERSION` (stored under ``meta[b"format"]``); a store of a version
in :data:`READABLE_VERSIONS` is read, any other is refused.  Version 2 added the sparse content
record; a version 1 store (every content dense) is read as it is and marked version 2 when
opened, nothing rewritten.  docs/format.md describes the same layout for readers of the data
directory.

Integers in keys are unsigned big-endian so LMDB's byte order is numeric order.  Values are
msgpack (``use_bin_type``) lists or maps; names and symlink targets are raw bytes, never decoded.

Databases (one LMDB environment, ``<data>/meta``):

``meta``       ``b"format"`` -> u32 version; ``b"next_ino"`` -> u64, above every stored inode number;
               ``b"next_layer"`` -> u64, the number the next upper layer gets.
``chunks``     chunk id (32 B BLAKE3 of the raw bytes) -> chunk envelope (below).
``contents``   content id (32 B) -> msgpack ``[size_bytes, chunk_ids]`` (dense: ``chunk_ids`` 32 B
               each, concatenated; chunk i holds bytes ``[i*page_size, (i+1)*page_size)``), or
               ``[size_bytes, chunk_ids, runs]`` (sparse: ``runs`` the pages holding data,
               ``(first page, pages)`` as two u64 each, ascending and maximal; their chunk ids
               in page order; every other page is a hole, read as zeros).  A page of zeros is
               always a hole, and a content without holes is dense, so equal bytes make one
               record.  The content id: :func:`rametfs.store.chunks.content_id`.
``trees``      tree id (32 B BLAKE3 of the value) -> msgpack list of entries sorted by name,
               each ``[name, mode, uid, gid, mtime_ns, size, ref, xattrs, link, nlink, flags]``
               (:class:`rametfs.store.trees.Entry`).  ``ref`` is the content id (regular file),
               the target (symlink), the subtree id (directory) or ``b""``; ``rdev`` of a device
               node is ``size``.  ``link`` is 0, or a 63-bit id shared by the hard links of one
               inode within the snapshot; ``flags`` bit 0 marks a directory holding hard links
               somewhere below.
``tree_stats`` tree id -> msgpack ``[files, bytes, directories, symlinks]`` counted below it,
               written with the tree (subtrees' totals are summed, so it costs O(entries)).
``snapshots``  snapshot id (32 B BLAKE3 of the value) -> msgpack map ``{root, parents, created_ns,
               label, message, source, stats[, recipes]}``.  Written last, in the same
               transaction as anything it needs: a snapshot is listed only when it is whole.
               ``recipes`` (only when some): the rebuild recipes of a promote under a
               persistence policy, a list of maps ``{name, outputs, inputs: [{path,
               blake3}], command, check, timeout}`` (docs/format.md, docs/policy.md).
``sources``    absolute source path -> msgpack ``[dev, ino, size, mtime_ns, ctime_ns, content id]``,
               the stat cache that makes re-importing an unchanged file free (mtime and
               ctime clamped as a record's, :func:`clamp_time_ns`).  A path longer than
               :data:`MAX_KEY_BYTES` is keyed ``b"path-blake3:"`` + its 32-byte BLAKE3
               hash instead (:func:`source_key`).
               Also ``b"git-blob:"`` + raw git blob id -> msgpack ``[size_bytes, content id]``,
               the blob cache that makes re-importing an unchanged git blob free
               (:mod:`rametfs.store.git_import`); such a key never starts with ``/``.
``executions`` execution id (utf-8) -> msgpack map ``{base, head, lower, layer, root_ino,
               created_ns, owner, group, share, control, max_bytes, max_inodes[, policy]
               [, runtime]}`` (:class:`ExecutionRecord`).
``inodes``     layer (u64) + ino (u64) -> msgpack map, an execution's upper inode record
               (:class:`UpperInode`).
``dentries``   layer (u64) + parent ino (u64) + name -> child ino (u64); ino 0 is a whiteout.
``links``      layer (u64) + link id (u64) -> ino (u64): the upper inode of a base hard-link group.
``pages``      layer (u64) + ino (u64) + page (u64) -> ``b""``: that page of the file lives in the
               upper data file ``<data>/upper/<layer>/<ino>``, not in the base chunks.
``dead``       layer (u64) -> ``b""``: layers left by reset or release, deleted in the background.
``orphans``    layer (u64) + ino (u64) -> ``b""``: an upper inode whose last name is gone while
               processes may still hold it; deleted with its record when the kernel forgets
               it, or at the next start (like ext4's orphan list).
``pools``      pool name (utf-8) -> msgpack map ``{base, size, created_ns, access, policy}``: an
               execution pool (:mod:`rametfs.store.catalog`, :mod:`rametfs.core.pools`);
               ``base`` the snapshot id as hex, ``size`` the number of executions kept for
               hand-out, ``access`` and ``policy`` what every member is created with.
``leases``     execution id (utf-8, ``<pool>-<8 hex>``: a pool's members are the keys starting
               with its name and ``-``) -> msgpack map ``{pool, state, lease, reason,
               returned_ns}``: a pool member.  ``state`` is ``"ready"``, ``"leased"`` or
               ``"quarantined"``; ``lease`` nil or ``{holder, pid, host, expires_ns,
               acquired_ns}`` (wall-clock ns); ``reason`` why verification quarantined it;
               ``returned_ns`` when it last became ready (the last returned goes out first).  Written in the transaction that
               changes the member, so pools and leases survive a restart.
``names``      snapshot name (utf-8, :func:`rametfs.store.names.check_name`) -> snapshot id
               (32 B): a movable name, like a git branch (docs/lifecycle.md).

Chunk envelope (after BorgBackup's ``repoobj``): ``b"RMC"``, u8 version (1), u8 codec
(0 raw, 1 zstd), u32 raw length, then the payload.  The chunk id is the BLAKE3 hash of the raw
bytes and is checked on every read (:class:`rametfs.errors.IntegrityError`, EIO).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import blake3
import msgpack

from .trees import Entry

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
PAGE_SIZE = 64 * 1024  # bytes; one chunk holds at most one page
ID_BYTES = 32

DATABASES = ("meta", "chunks", "contents", "trees", "tree_stats", "snapshots", "sources",
             "executions",
             "inodes", "dentries", "links", "pages", "dead", "orphans",
             "pools", "leases", "names")

ENVELOPE_MAGIC = b"RMC"
ENVELOPE_VERSION = 1
CODEC_RAW = 0
CODEC_ZSTD = 1
_ENVELOPE = struct.Struct(">3sBBI")
ENVELOPE_HEADER_BYTES = _ENVELOPE.size

_U64 = struct.Struct(">Q")
_U64x2 = struct.Struct(">QQ")
_U64x3 = struct.Struct(">QQQ")

WHITEOUT = 0

MAX_KEY_BYTES = 511  # LMDB's key size limit (mdb_env_get_maxkeysize, the default build)
SOURCE_HASH_PREFIX = b"path-blake3:"

# Timestamps a record holds: ext4's range with 256-byte inodes (fs/ext4/ext4.h,
# EXT4_TIMESTAMP_MIN and EXT4_EXTRA_TIMESTAMP_MAX: 1901-12-13T20:45:52Z to
# 2446-05-10T22:38:55Z), which fits a msgpack integer in ns.
TIME_MIN_S = -(1 << 31)
TIME_MAX_S = (1 << 34) - 1 - (1 << 31)
NS_PER_S = 1_000_000_000


def clamp_time_ns(ns: int) -> int:
    """``ns`` (ns since the epoch) clamped to what a record holds, the way the kernel clamps a
    timestamp to an ext4 inode's range (fs/inode.c, ``timestamp_truncate``): the seconds
    to [:data:`TIME_MIN_S`, :data:`TIME_MAX_S`], and the nanoseconds to 0 at either bound."""
    sec, nsec = divmod(ns, NS_PER_S)
    if TIME_MIN_S < sec < TIME_MAX_S:
        return ns
    return min(max(sec, TIME_MIN_S), TIME_MAX_S) * NS_PER_S


def u64(value: int) -> bytes:
    """Encode an unsigned 64-bit integer as 8 big-endian bytes."""
    return _U64.pack(value)


def from_u64(data: bytes) -> int:
    """Decode 8 big-endian bytes."""
    return _U64.unpack(data)[0]


LAYER_PREFIX_BYTES = 8  # every key of a layer's records starts with its layer (u64)
DENTRY_NAME_OFFSET = 16  # a ``dentries`` key's name follows layer + parent ino


def layer_prefix(layer: int) -> bytes:
    """The prefix of every key of ``layer`` in ``inodes``, ``dentries``, ``links``, ``pages``
    and ``orphans``, and its key in ``dead``."""
    return _U64.pack(layer)


def layer_of_key(key: bytes) -> int:
    """The layer a key of ``inodes``, ``dentries``, ``links``, ``pages``, ``orphans`` or
    ``dead`` belongs to."""
    return _U64.unpack_from(key)[0]


def split_pair_key(key: bytes) -> tuple[int, int]:
    """``(layer, ino)`` of an ``inodes`` or ``orphans`` key, ``(layer, link id)`` of a
    ``links`` key, ``(layer, parent ino)`` of a ``dentries`` key."""
    return _U64x2.unpack_from(key)


def inode_key(layer: int, ino: int) -> bytes:
    """Key of ``inodes``: layer + ino (16 bytes)."""
    return _U64x2.pack(layer, ino)


def dentry_key(layer: int, parent: int, name: bytes) -> bytes:
    """Key of ``dentries``: layer + parent ino + name."""
    return _U64x2.pack(layer, parent) + name


def link_key(layer: int, link: int) -> bytes:
    """Key of ``links``: layer + link id (16 bytes)."""
    return _U64x2.pack(layer, link)


def prefixed(cur, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
    """The ``(key, value)`` pairs of LMDB cursor ``cur`` whose keys start with ``prefix``,
    from key ``start`` (default: the first such key) on."""
    if cur.set_range(prefix if start is None else start):
        yield from itertools.takewhile(lambda kv: kv[0].startswith(prefix), cur.iternext())


def source_key(path: bytes) -> bytes:
    """Key of ``sources`` for the absolute source path ``path``: the path itself when it fits
    an LMDB key (:data:`MAX_KEY_BYTES`), else :data:`SOURCE_HASH_PREFIX` + its 32-byte
    BLAKE3 hash (44 bytes; never starts with ``/``, so it meets no path)."""
    if len(path) <= MAX_KEY_BYTES:
        return path
    return SOURCE_HASH_PREFIX + blake3.blake3(path).digest()


def page_key(layer: int, ino: int, page: int) -> bytes:
    """Key of ``pages``: layer + ino + page number (24 bytes)."""
    return _U64x3.pack(layer, ino, page)


def page_of_key(key: bytes) -> int:
    """The page number in a ``pages`` key."""
    return _U64x3.unpack(key)[2]


def split_page_key(key: bytes) -> tuple[int, int, int]:
    """``(layer, ino, page)`` of a ``pages`` key."""
    return _U64x3.unpack(key)


def pack_envelope(codec: int, raw_length: int, payload: bytes) -> bytes:
    """Build a chunk envelope around ``payload`` (``raw_length`` in bytes, before compression)."""
    return _ENVELOPE.pack(ENVELOPE_MAGIC, ENVELOPE_VERSION, codec, raw_length) + payload


def unpack_envelope(data: bytes) -> tuple[int, int, memoryview]:
    """Split an envelope into ``(codec, raw_length, payload)``; ValueError if malformed."""
    if len(data) < ENVELOPE_HEADER_BYTES:
        raise ValueError("chunk envelope too short")
    magic, version, codec, raw_length = _ENVELOPE.unpack_from(data)
    if magic != ENVELOPE_MAGIC or version != ENVELOPE_VERSION or codec not in (CODEC_RAW, CODEC_ZSTD):
        raise ValueError(f"bad chunk envelope header {bytes(data[:ENVELOPE_HEADER_BYTES])!r}")
    return codec, raw_length, memoryview(data)[ENVELOPE_HEADER_BYTES:]


@dataclass(slots=True)
class UpperInode:
    """An inode record in an execution's upper layer (``inodes`` database).

    Times in ns; ``size`` in bytes; ``base`` the origin base entry (None for a new inode);
    ``base_limit`` the number of leading bytes of the base content still visible (bytes);
    ``tree`` the base subtree id of a directory that came from the base (None: opaque);
    ``content`` the content id a capture found the file's bytes to hold, until its bytes
    change (None: not known), so a diff against the head that capture made needs no hash.
    """

    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    size: int = 0
    nlink: int = 1
    rdev: int = 0
    target: bytes = b""
    xattrs: dict = field(default_factory=dict)
    base: Entry | None = None
    base_limit: int = 0
    tree: bytes | None = None
    content: bytes | None = None

    def pack(self) -> bytes:
        d = {name: getattr(self, name) for name in self.__slots__}
        d["base"] = self.base.pack() if self.base else None
        d["xattrs"] = sorted(self.xattrs.items())
        if d["content"] is None:  # absent unless a capture set it: records stay as small
            del d["content"]
        return msgpack.packb(d, use_bin_type=True)

    @classmethod
    def unpack(cls, value: bytes) -> UpperInode:
        d = msgpack.unpackb(value)
        d["base"] = Entry.unpack(d["base"]) if d["base"] else None
        d["xattrs"] = {k: v for k, v in d["xattrs"]}
        return cls(**d)

    @classmethod
    def from_entry(cls, e: Entry) -> UpperInode:
        return cls(mode=e.mode, uid=e.uid, gid=e.gid, atime_ns=e.mtime_ns, mtime_ns=e.mtime_ns,
                   ctime_ns=e.mtime_ns, size=e.size if e.is_reg else 0, nlink=e.nlink,
                   rdev=0 if (e.is_reg or e.is_dir or e.is_symlink) else e.size,
                   target=e.ref if e.is_symlink else b"", xattrs=dict(e.xattrs), base=e,
                   base_limit=e.size if e.is_reg else 0, tree=e.ref if e.is_dir else None)


@dataclass(slots=True)
class ExecutionRecord:
    """An execution (``executions`` database): the ids of its base, head and lower snapshots,
    its current layer, its root's inode number, when it was made (ns), its access settings
    (``rametfs.authority.Access.to_record``, stored in the same map), and the records of its
    persistence policy and of the sandbox running it (None: none, left out of the map)."""

    base: str
    head: str
    lower: str
    layer: int
    root_ino: int
    created_ns: int
    access: dict
    policy: dict | None = None
    runtime: dict | None = None

    def pack(self) -> bytes:
        rec = {"base": self.base, "head": self.head, "lower": self.lower, "layer": self.layer,
               "root_ino": self.root_ino, "created_ns": self.created_ns, **self.access}
        rec.update((key, value) for key, value in (("policy", self.policy),
                                                   ("runtime", self.runtime)) if value)
        return msgpack.packb(rec)

    @classmethod
    def unpack(cls, value: bytes) -> ExecutionRecord:
        rec = msgpack.unpackb(value)
        fixed = {name: rec.pop(name) for name in ("base", "head", "layer", "root_ino",
                                                  "created_ns")}
        # A record from before "lower" was kept: its layer lies over its base.
        lower = rec.pop("lower", fixed["base"])
        policy, runtime = rec.pop("policy", None), rec.pop("runtime", None)
        return cls(**fixed, lower=lower, access=rec, policy=policy, runtime=runtime)
