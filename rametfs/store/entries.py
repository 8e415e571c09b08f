"""A directory's entry from its children, and hard-link group ids: the one rule for every tree
builder (the importer, a promote's capture, fallback's scan), so that equal trees get equal
ids whichever built them (docs/format.md, ``trees``)."""

from __future__ import annotations

from collections.abc import Sequence

import blake3

from ..treewalk import Steps, run_steps
from .trees import FLAG_HAS_LINKS, TREE_STEP, Entry


def directory_entry(entries: Sequence[Entry], tid: bytes, mode: int, uid: int, gid: int,
                    mtime_ns: int, xattrs: tuple[tuple[bytes, bytes], ...] = (),
                    name: bytes = b"") -> Entry:
    """The entry named ``name`` of a directory whose children are ``entries`` and whose tree
    id is ``tid`` (``Store.put_tree`` stored it, or ``trees.tree_id`` computed it): ``mode``
    the full st_mode, ``mtime_ns`` in ns, ``xattrs`` sorted ``(name, value)`` pairs; its link
    count is 2 + its subdirectories and its flags :data:`FLAG_HAS_LINKS` when a hard-linked
    file lies anywhere below it."""
    return run_steps(directory_entry_steps(entries, tid, mode, uid, gid, mtime_ns, xattrs,
                                           name))


def directory_entry_steps(entries: Sequence[Entry], tid: bytes, mode: int, uid: int,
                          gid: int, mtime_ns: int, xattrs: tuple[tuple[bytes, bytes], ...] = (),
                          name: bytes = b"") -> Steps[Entry]:
    """:func:`directory_entry` as steps (rametfs.treewalk.run_steps), one per
    ``trees.TREE_STEP`` entries."""
    has_links, subdirs = False, 0
    for at in range(0, len(entries), TREE_STEP):
        batch = entries[at:at + TREE_STEP]
        has_links = has_links or any(e.link or e.flags & FLAG_HAS_LINKS for e in batch)
        subdirs += sum(1 for e in batch if e.is_dir)
        yield
    return Entry(name, mode, uid, gid, mtime_ns, 0, tid, xattrs, 0, 2 + subdirs,
                 FLAG_HAS_LINKS if has_links else 0)


def link_id(seed: bytes) -> int:
    """The hard-link group id seeded by ``seed``: the first 8 bytes of its BLAKE3 digest,
    big-endian, shifted right once: the 63-bit id of docs/format.md.  An import and a scan seed a
    group with its first path in the walk's order (depth first, names in byte order) from the
    tree's top, ``b"/dir/name"``, so the same tree gets the same ids from both; a capture
    seeds a new group with ``b"<execution>/<layer>/<inode>"``, unique in the store."""
    return int.from_bytes(blake3.blake3(seed).digest()[:8], "big") >> 1
