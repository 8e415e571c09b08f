"""Typed access to the execution layers' records: upper inode records, dentries (names and
whiteouts), hard-link groups, page maps, orphan marks, dead layers, and the counters of inode
and layer numbers (the ``inodes``, ``dentries``, ``links``, ``pages``, ``orphans``, ``dead``
and ``meta`` databases; key layouts and codecs in rametfs.store.format).

Every method works inside a transaction the caller holds (``store.read()`` or
``store.write()``, whose ENOSPC handling every write then has), so that one request stays one
transaction however many records it touches.  Layers and inode numbers are u64; a dentry's
value is the child's inode number, :data:`WHITEOUT` (0) for a removed base name.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Mapping

import lmdb

from .format import (DENTRY_NAME_OFFSET, WHITEOUT, UpperInode, dentry_key, from_u64, inode_key,
                     layer_of_key, layer_prefix, link_key, page_key, page_of_key, prefixed,
                     split_page_key, split_pair_key, u64)
from .trees import Entry

_VALUE_BYTES = 8  # a dentry's value: an inode number (u64)


def dentry_bytes(name: bytes) -> int:
    """What a stored dentry named ``name`` takes, as an execution's usage counts it: its key
    and its value (bytes)."""
    return DENTRY_NAME_OFFSET + len(name) + _VALUE_BYTES


def merged_children(base: Mapping[bytes, Entry], upper: Mapping[bytes, int]
                    ) -> Iterator[tuple[bytes, Entry | int]]:
    """A directory's names in byte order, each once: ``(name, ino)`` for a name of the layer's
    dentries ``upper`` (ino :data:`WHITEOUT`: a removed base name), else ``(name, entry)`` of
    its base tree ``base``; a whiteout is yielded as ``(name, None)``, so that a caller
    working in steps counts it too.  Both mappings iterate in name order (a tree's and the
    dentries' key order): merged, never sorted (sorting 500,000 names is one long step)."""
    if not upper:  # a directory never copied up, or with no dentry
        yield from base.items()
        return
    last = None
    for name in heapq.merge(base, upper):
        if name == last:
            continue
        last = name
        item = upper.get(name)
        if item is None:
            yield name, base[name]
        else:
            yield name, None if item == WHITEOUT else item


class Layers:
    """The layer records of a store's databases ``db`` (``Store.db``); ``Store.layers``."""

    def __init__(self, db: Mapping[str, object]):
        self._meta = db["meta"]
        self._inodes = db["inodes"]
        self._dentries = db["dentries"]
        self._links = db["links"]
        self._pages = db["pages"]
        self._orphans = db["orphans"]
        self._dead = db["dead"]

    # -- counters ----------------------------------------------------------------------

    def next_ino(self, txn: lmdb.Transaction) -> int:
        """The stored inode counter: above every stored inode number (0: none stored)."""
        raw = txn.get(b"next_ino", db=self._meta)
        return from_u64(raw) if raw else 0

    def put_next_ino(self, txn: lmdb.Transaction, value: int) -> None:
        txn.put(b"next_ino", u64(value), db=self._meta)

    def next_layer(self, txn: lmdb.Transaction) -> int:
        """The number the next upper layer gets (1 in a new store)."""
        raw = txn.get(b"next_layer", db=self._meta)
        return from_u64(raw) if raw else 1

    def put_next_layer(self, txn: lmdb.Transaction, value: int) -> None:
        txn.put(b"next_layer", u64(value), db=self._meta)

    # -- upper inode records -----------------------------------------------------------

    def inode(self, txn: lmdb.Transaction, layer: int, ino: int
              ) -> tuple[UpperInode, int] | None:
        """The upper record of ``ino`` in ``layer`` and the bytes it takes stored; None when
        there is none."""
        value = txn.get(inode_key(layer, ino), db=self._inodes)
        return None if value is None else (UpperInode.unpack(value), len(value))

    def put_inode(self, txn: lmdb.Transaction, layer: int, ino: int, upper: UpperInode) -> int:
        """Store ``upper`` as the record of ``ino`` in ``layer``; the bytes it takes."""
        packed = upper.pack()
        txn.put(inode_key(layer, ino), packed, db=self._inodes)
        return len(packed)

    def inodes(self, txn: lmdb.Transaction, layer: int) -> Iterator[tuple[int, UpperInode, int]]:
        """Every upper record of ``layer``: ``(ino, record, bytes stored)``, by inode number."""
        for key, value in prefixed(txn.cursor(db=self._inodes), layer_prefix(layer)):
            yield split_pair_key(key)[1], UpperInode.unpack(value), len(value)

    def all_inodes(self, txn: lmdb.Transaction) -> Iterator[tuple[int, UpperInode]]:
        """Every upper record of every layer: ``(layer, record)``."""
        for key, value in txn.cursor(db=self._inodes):
            yield layer_of_key(key), UpperInode.unpack(value)

    def record_sizes(self, txn: lmdb.Transaction, layer: int) -> list[int]:
        """The bytes each upper record of ``layer`` takes stored (none decoded)."""
        return [len(value) for _, value in
                prefixed(txn.cursor(db=self._inodes), layer_prefix(layer))]

    def delete_inode(self, txn: lmdb.Transaction, layer: int, ino: int) -> None:
        """Delete the upper record, the orphan mark and the page map of ``ino`` in ``layer``,
        and the ``links`` record of its base hard-link group when it names it (the inode of
        a group goes once no name of the group is left)."""
        key = inode_key(layer, ino)
        value = txn.pop(key, db=self._inodes)
        base = UpperInode.unpack(value).base if value is not None else None
        if base is not None and base.link and self.link(txn, layer, base.link) == ino:
            txn.delete(link_key(layer, base.link), db=self._links)
        txn.delete(key, db=self._orphans)
        cur = txn.cursor(db=self._pages)
        if cur.set_range(key):
            while cur.key().startswith(key) and cur.delete():
                pass

    # -- dentries ----------------------------------------------------------------------

    def dentry(self, txn: lmdb.Transaction, layer: int, parent: int, name: bytes) -> int | None:
        """The inode ``name`` in directory ``parent`` of ``layer`` names (:data:`WHITEOUT`:
        a removed base name); None when the layer has no dentry of that name."""
        raw = txn.get(dentry_key(layer, parent, name), db=self._dentries)
        return None if raw is None else from_u64(raw)

    def put_dentry(self, txn: lmdb.Transaction, layer: int, parent: int, name: bytes,
                   ino: int) -> None:
        """Name ``ino`` (:data:`WHITEOUT`: a whiteout) ``name`` in ``parent`` of ``layer``."""
        txn.put(dentry_key(layer, parent, name), u64(ino), db=self._dentries)

    def delete_dentry(self, txn: lmdb.Transaction, layer: int, parent: int, name: bytes
                      ) -> None:
        txn.delete(dentry_key(layer, parent, name), db=self._dentries)

    def dentries(self, txn: lmdb.Transaction, layer: int, parent: int,
                 after: bytes | None = None) -> Iterator[tuple[bytes, int]]:
        """The dentries of directory ``parent`` in ``layer``, ``(name, ino)`` in name order
        (:data:`WHITEOUT` for a whiteout), from the first name after ``after`` (None: all)."""
        prefix = dentry_key(layer, parent, b"")
        start = None if after is None else prefix + after + b"\0"
        for key, value in prefixed(txn.cursor(db=self._dentries), prefix, start):
            yield key[DENTRY_NAME_OFFSET:], from_u64(value)

    def whiteouts_only(self, txn: lmdb.Transaction, layer: int, parent: int) -> int | None:
        """How many whiteouts directory ``parent`` of ``layer`` holds when its dentries are
        whiteouts only; None as soon as one names an inode (nothing decoded)."""
        whiteout = u64(WHITEOUT)
        count = 0
        for _, value in prefixed(txn.cursor(db=self._dentries), dentry_key(layer, parent, b"")):
            if value != whiteout:
                return None
            count += 1
        return count

    def all_dentries(self, txn: lmdb.Transaction, layer: int
                     ) -> Iterator[tuple[int, bytes, int]]:
        """Every dentry of ``layer``: ``(parent, name, ino)``, by parent then name."""
        for key, value in prefixed(txn.cursor(db=self._dentries), layer_prefix(layer)):
            yield split_pair_key(key)[1], key[DENTRY_NAME_OFFSET:], from_u64(value)

    def dentry_sizes(self, txn: lmdb.Transaction, layer: int) -> int:
        """The bytes the dentries of ``layer`` take (:func:`dentry_bytes` of each)."""
        return sum(len(key) + _VALUE_BYTES
                   for key in _keys(txn.cursor(db=self._dentries), layer_prefix(layer)))

    def has_dentries(self, txn: lmdb.Transaction, layer: int) -> bool:
        """Whether ``layer`` holds any dentry (a name or a whiteout)."""
        return _any(txn.cursor(db=self._dentries), layer_prefix(layer))

    # -- hard-link groups --------------------------------------------------------------

    def link(self, txn: lmdb.Transaction, layer: int, link: int) -> int | None:
        """The upper inode of base hard-link group ``link`` in ``layer``; None: none yet."""
        raw = txn.get(link_key(layer, link), db=self._links)
        return None if raw is None else from_u64(raw)

    def put_link(self, txn: lmdb.Transaction, layer: int, link: int, ino: int) -> None:
        txn.put(link_key(layer, link), u64(ino), db=self._links)

    def links(self, txn: lmdb.Transaction, layer: int) -> Iterator[tuple[int, int]]:
        """Every hard-link group of ``layer``: ``(link id, ino)``."""
        for key, value in prefixed(txn.cursor(db=self._links), layer_prefix(layer)):
            yield split_pair_key(key)[1], from_u64(value)

    def has_links(self, txn: lmdb.Transaction, layer: int) -> bool:
        """Whether a base hard-link group was copied up in ``layer``."""
        return _any(txn.cursor(db=self._links), layer_prefix(layer))

    # -- page maps ---------------------------------------------------------------------

    def pages(self, txn: lmdb.Transaction, layer: int, ino: int) -> Iterator[int]:
        """The page map of ``ino`` in ``layer``: its pages in the upper data file, ascending."""
        for key in _keys(txn.cursor(db=self._pages), inode_key(layer, ino)):
            yield page_of_key(key)

    def all_pages(self, txn: lmdb.Transaction, layer: int) -> Iterator[tuple[int, int]]:
        """Every page-map entry of ``layer``: ``(ino, page)``, ascending."""
        for key in _keys(txn.cursor(db=self._pages), layer_prefix(layer)):
            yield split_page_key(key)[1:]

    def put_page(self, txn: lmdb.Transaction, layer: int, ino: int, page: int) -> None:
        txn.put(page_key(layer, ino, page), b"", db=self._pages)

    def delete_page(self, txn: lmdb.Transaction, layer: int, ino: int, page: int) -> None:
        txn.delete(page_key(layer, ino, page), db=self._pages)

    # -- orphans -----------------------------------------------------------------------

    def put_orphan(self, txn: lmdb.Transaction, layer: int, ino: int) -> None:
        """Mark ``ino`` of ``layer`` an orphan: no name left, processes may still hold it."""
        txn.put(inode_key(layer, ino), b"", db=self._orphans)

    def delete_orphan(self, txn: lmdb.Transaction, layer: int, ino: int) -> None:
        """The orphan ``ino`` of ``layer`` got a name (a tmpfile linked): its mark goes."""
        txn.delete(inode_key(layer, ino), db=self._orphans)

    def orphans(self, txn: lmdb.Transaction) -> list[tuple[int, int]]:
        """Every orphan mark: ``(layer, ino)``, ascending."""
        return [split_pair_key(key)
                for key in txn.cursor(db=self._orphans).iternext(values=False)]

    # -- dead layers -------------------------------------------------------------------

    def mark_dead(self, txn: lmdb.Transaction, layer: int) -> None:
        """``layer`` was left by a reset or release: its records go in the background."""
        txn.put(layer_prefix(layer), b"", db=self._dead)

    def dead(self, txn: lmdb.Transaction) -> list[int]:
        """The dead layers, ascending."""
        return [layer_of_key(key) for key in txn.cursor(db=self._dead).iternext(values=False)]

    def delete_dead_batch(self, txn: lmdb.Transaction, budget: int) -> tuple[int, bool] | None:
        """Delete at most ``budget`` records (inodes, dentries, links, pages, orphan marks) of
        the first dead layer.  Returns ``(layer, records_left)``, None when no layer is dead;
        the layer stays marked dead until :meth:`forget_dead`."""
        cur = txn.cursor(db=self._dead)
        if not cur.first():
            return None
        layer_key = cur.key()
        for db in (self._inodes, self._dentries, self._links, self._pages, self._orphans):
            c = txn.cursor(db=db)
            if c.set_range(layer_key):
                while budget and c.key().startswith(layer_key) and c.delete():
                    budget -= 1
        return layer_of_key(layer_key), budget == 0

    def forget_dead(self, txn: lmdb.Transaction, layer: int) -> None:
        """``layer``'s records and upper data are gone: it is dead no more."""
        txn.delete(layer_prefix(layer), db=self._dead)

    def layers_holding(self, txn: lmdb.Transaction) -> set[int]:
        """Every layer some record (inode, dentry, link, page, orphan mark) belongs to."""
        found: set[int] = set()
        for db in (self._inodes, self._dentries, self._links, self._pages, self._orphans):
            cur = txn.cursor(db=db)
            ok = cur.first()
            while ok:  # one seek per layer, not one step per record
                layer = layer_of_key(cur.key())
                found.add(layer)
                ok = cur.set_range(layer_prefix(layer + 1)) if layer + 1 < 1 << 64 else False
        return found


def _keys(cur, prefix: bytes) -> Iterator[bytes]:
    if cur.set_range(prefix):
        yield from itertools.takewhile(lambda key: key.startswith(prefix),
                                       cur.iternext(values=False))


def _any(cur, prefix: bytes) -> bool:
    return cur.set_range(prefix) and cur.key().startswith(prefix)
