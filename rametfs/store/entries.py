"""A directory's entry from its children, and hard-link group ids: the one rule for every tree
builder (the importer, a promote's capture, fallback's scan), so that equal trees get equal
ids whichever built them (docs/format.md, ``trees``)."""

from __future__ import annotations

from collections.abc import Sequence

import blake3

from .trees import FLAG_HAS_LINKS, Entry


def directory_entry(entries: Sequence[Entry], tid: bytes, mode: int, uid: int, gid: int,
                    mtime_ns: int, xattrs: tuple[tuple[bytes, bytes], ...] = (),
                    name: bytes = b"") -> Entry:
    """The entry named ``name`` of a directory whose children are ``entries`` and whose tree
    id is ``tid`` (``Store.put_tree`` stored it, or ``trees.tree_id`` computed it): ``mode``
    the full st_mode, ``mtime_ns`` in ns, ``xattrs`` sorted ``(name, value)`` pairs; its link
    count is 2 + its subdirectories and its flags :data:`FLAG_HAS_LINKS` when a hard-linked
    file lies anywhere below it."""
    has_links = any(e.link or e.flags & FLAG_HAS_LINKS for e in entries)
    return Entry(name, mode, uid, gid, mtime_ns, 0, tid, xattrs, 0,
                 2 + sum(1 for e in entries if e.is_dir), FLAG_HAS_LINKS if has_links else 0)


def link_id(seed: bytes) -> int:
    """The hard-link group id seeded by ``seed``: the first 8 bytes of its BLAKE3 digest,
    big-endian, shifted right once: the 63-bit id of docs/format.md.  An import and a scan seed a
    group with its first path in the walk's order (depth first, names in byte order) from the
    tree's top, ``b"/dir/name"``, so the same tree gets the same ids from both; a capture
    seeds a new group with ``b"<execution>/<layer>/<inode>"``, unique in the store."""
    return int.from_bytes(blake3.blake3(seed).digest()[:8], "big") >> 1
