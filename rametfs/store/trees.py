"""Tree entries and their canonical serialisation (a Merkle tree: equal trees have equal ids)."""

from __future__ import annotations

import stat
from dataclasses import dataclass, replace

import blake3
import msgpack

FLAG_HAS_LINKS = 1  # a directory with a hard-linked file somewhere below it


@dataclass(frozen=True, slots=True)
class Entry:
    """One name in a directory of a snapshot.

    ``mode`` is the full st_mode (type and permission bits); ``mtime_ns`` in ns; ``size`` in
    bytes (regular file; ``rdev`` for a device node; 0 otherwise); ``ref`` is the content id
    (regular file), the link target (symlink) or the subtree id (directory); ``xattrs`` a
    sorted tuple of ``(name, value)`` bytes pairs; ``link`` the hard-link group id (0 when
    the inode has one name); ``nlink`` the link count (directories: 2 + subdirectories).
    """

    name: bytes
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int
    ref: bytes
    xattrs: tuple[tuple[bytes, bytes], ...] = ()
    link: int = 0
    nlink: int = 1
    flags: int = 0

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)

    def pack(self) -> list:
        """The msgpack-ready list form (docs/format.md, ``trees``)."""
        return [self.name, self.mode, self.uid, self.gid, self.mtime_ns, self.size, self.ref,
                [list(x) for x in self.xattrs], self.link, self.nlink, self.flags]

    @classmethod
    def unpack(cls, item: list) -> "Entry":
        name, mode, uid, gid, mtime_ns, size, ref, xattrs, link, nlink, flags = item
        return cls(name, mode, uid, gid, mtime_ns, size, ref,
                   tuple((k, v) for k, v in xattrs), link, nlink, flags)

    def renamed(self, name: bytes) -> "Entry":
        return replace(self, name=name)


def encode_tree(entries: list[Entry]) -> tuple[bytes, bytes]:
    """Serialise entries (sorted by name here) -> ``(tree id, value)``."""
    value = msgpack.packb([e.pack() for e in sorted(entries, key=lambda e: e.name)],
                          use_bin_type=True)
    return blake3.blake3(value).digest(), value


def tree_id(entries: list[Entry]) -> bytes:
    """The id of the tree of ``entries`` (:func:`encode_tree`'s), stored or not: a tree's id
    without a transaction."""
    return encode_tree(entries)[0]


def decode_tree(value: bytes) -> dict[bytes, Entry]:
    """Parse a stored tree into ``{name: Entry}``, in name order."""
    return {item[0]: Entry.unpack(item) for item in msgpack.unpackb(value, raw=True)}
