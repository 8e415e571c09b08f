"""Unit tests of rametfs.store.layers: the typed access to execution layers' records."""

from __future__ import annotations

import pytest

from rametfs.store import WHITEOUT, Entry, fsck
from rametfs.store.format import UpperInode
from rametfs.store.layers import Layers, dentry_bytes, merged_children


def entry(name: bytes, mode: int = 0o100644) -> Entry:
    return Entry(name, mode, 0, 0, 0, 0, b"")


def test_merged_children_takes_the_layer_over_the_base_in_name_order():
    base = {b"a": entry(b"a"), b"b": entry(b"b"), b"d": entry(b"d", 0o40755)}
    upper = {b"b": WHITEOUT, b"c": 7, b"d": 8}
    assert list(merged_children(base, upper)) == [
        (b"a", base[b"a"]), (b"b", None), (b"c", 7), (b"d", 8)]
    assert list(merged_children(base, {})) == list(base.items())
    assert list(merged_children({}, {b"x": 3})) == [(b"x", 3)]


@pytest.mark.corrupts_store  # records of layers that no execution has
def test_records_of_a_layer_round_trip_in_one_transaction(store):
    layers: Layers = store.layers
    upper = UpperInode(0o100644, 1, 2, 3, 4, 5, size=200_000)
    with store.write() as txn:
        stored = layers.put_inode(txn, 3, 1001, upper)
        for name, ino in ((b"b", 1001), (b"a", WHITEOUT), (b"c", 1002)):
            layers.put_dentry(txn, 3, 1000, name, ino)
        layers.put_dentry(txn, 4, 1000, b"other layer", 5)
        layers.put_link(txn, 3, 77, 1001)
        for page in (2, 0):
            layers.put_page(txn, 3, 1001, page)
        layers.put_orphan(txn, 3, 1002)
    with store.read() as txn:
        assert layers.inode(txn, 3, 1001) == (upper, stored)
        assert layers.inode(txn, 4, 1001) is None
        assert list(layers.dentries(txn, 3, 1000)) == [(b"a", 0), (b"b", 1001), (b"c", 1002)]
        assert list(layers.dentries(txn, 3, 1000, after=b"a")) == [(b"b", 1001), (b"c", 1002)]
        assert layers.dentry(txn, 3, 1000, b"a") == WHITEOUT
        assert layers.dentry(txn, 3, 1000, b"z") is None
        assert layers.whiteouts_only(txn, 3, 1000) is None
        assert layers.dentry_sizes(txn, 3) == sum(map(dentry_bytes, (b"a", b"b", b"c")))
        assert (layers.link(txn, 3, 77), layers.has_links(txn, 3), layers.has_links(txn, 4)) \
            == (1001, True, False)
        assert list(layers.pages(txn, 3, 1001)) == [0, 2]
        assert layers.orphans(txn) == [(3, 1002)]
        assert layers.layers_holding(txn) == {3, 4}
    with store.write() as txn:
        layers.delete_inode(txn, 3, 1001)
        layers.delete_inode(txn, 3, 1002)
        layers.delete_dentry(txn, 3, 1000, b"b")
        layers.delete_dentry(txn, 3, 1000, b"c")
    with store.read() as txn:
        assert (layers.inode(txn, 3, 1001), list(layers.pages(txn, 3, 1001)),
                layers.orphans(txn)) == (None, [], [])
        assert layers.whiteouts_only(txn, 3, 1000) == 1
    assert fsck(store).problems == [
        "layer 3: records of a layer no execution has and that is not dead",
        "layer 4: records of a layer no execution has and that is not dead"]


def test_a_dead_layer_is_deleted_in_batches_then_forgotten(store):
    layers = store.layers
    with store.write() as txn:
        for ino in range(10):
            layers.put_inode(txn, 5, ino, UpperInode(0o100644, 0, 0, 0, 0, 0))
            layers.put_page(txn, 5, ino, 0)
        layers.put_inode(txn, 6, 1, UpperInode(0o100644, 0, 0, 0, 0, 0))  # a live layer
        layers.mark_dead(txn, 5)
        assert layers.dead(txn) == [5]
    batches = []
    while True:
        with store.write() as txn:
            batch = layers.delete_dead_batch(txn, 8)
        batches.append(batch)
        if not batch[1]:
            break
    assert batches == [(5, True), (5, True), (5, False)]  # 20 records, 8 a batch
    with store.write() as txn:
        assert layers.layers_holding(txn) == {6}
        layers.forget_dead(txn, 5)
        assert layers.delete_dead_batch(txn, 8) is None
        layers.delete_inode(txn, 6, 1)  # the fixture's fsck: no layer without an execution
