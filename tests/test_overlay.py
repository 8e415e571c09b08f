"""Model tests of the overlay without a kernel: copy-up, page maps, whiteouts, persistence."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import stat

import lmdb
import pytest
import trio
import trio.testing

from rametfs.capture import Capture, diff
from rametfs.errors import NoSpace, NotFound, ReadOnly, RametError
from rametfs.overlay import Overlay, assemble, close_all, drop_upper_files
from rametfs import precreate
from rametfs.precreate import TARGET, Precreated
from rametfs.store import PAGE_SIZE, Store, fsck, import_tree
from rametfs.verify import verify


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "small").write_bytes(b"0123456789" * 2)
    (root / "big").write_bytes(bytes(range(256)) * (3 * PAGE_SIZE // 256) + b"tail")
    (root / "dir" / "a").write_bytes(b"a")
    (root / "dir" / "sub" / "b").write_bytes(b"b")
    os.link(root / "small", root / "dir" / "small-link")
    return root


@pytest.fixture
def model(tmp_path, src, fsck_clean):
    """A store, its overlay and an execution of ``src``; fsck at the end finds the layers as
    the test left them stored, and after a flush of what it left dirty, sound."""
    store = Store(tmp_path / "data")
    snap = import_tree(store, src)
    overlay = Overlay(store)
    ex = overlay.create_execution(snap, "e")
    yield store, overlay, ex
    fsck_clean(store)
    overlay.flush_all()
    fsck_clean(store)
    store.close()


def path_node(overlay, ex, path):
    node = overlay.node(ex.root_ino)
    for part in path.split("/"):
        node = overlay.lookup(node.ino, part.encode())
    return node


def read_all(overlay, node):
    cid = node.base_content
    fd = os.open(overlay.store.hydrate(cid), os.O_RDONLY) if cid and node.entry.size else None
    try:
        return overlay.read(node, 0, node.size + 10, fd)
    finally:
        if fd is not None:
            os.close(fd)


def test_assemble_merges_base_upper_and_zeros():
    base = bytes([1]) * (2 * PAGE_SIZE)
    upper = {PAGE_SIZE: b"\x02" * 10}

    def read_upper(o, n):
        return upper.get(o, b"")[:n]

    out = assemble(0, 2 * PAGE_SIZE, {1}, 2 * PAGE_SIZE, lambda o, n: base[o:o + n], read_upper)
    assert out == base[:PAGE_SIZE] + b"\x02" * 10 + bytes(PAGE_SIZE - 10)
    # past base_limit every byte comes from the upper data (zeros where it is short)
    out = assemble(0, 100, set(), 30, lambda o, n: base[o:o + n], lambda o, n: b"")
    assert out == base[:30] + bytes(70)


def test_write_copies_up_one_page(model, src):
    store, overlay, ex = model
    node = path_node(overlay, ex, "big")
    ino = node.ino
    overlay.write(node, PAGE_SIZE + 5, b"XYZ")
    assert node.ino == ino
    assert overlay._pages(node) == {1}
    upper = os.stat(overlay._upper_path(ex, ino))
    assert upper.st_blocks * 512 <= 2 * PAGE_SIZE
    expected = bytearray((src / "big").read_bytes())
    expected[PAGE_SIZE + 5:PAGE_SIZE + 8] = b"XYZ"
    assert read_all(overlay, node) == bytes(expected)


def test_a_created_file_holds_no_page_sets(model):
    # Each set is 216 bytes of the daemon's heap per node (issue 15.5): a file with no base
    # byte visible never gets a page map; the pending pages get a set with their first page
    # and give it up once stored.  Base pages still copy up into a page map of their own.
    store, overlay, ex = model
    node = overlay.create(ex.root_ino, b"new", 0o644, 0, 0)
    assert overlay.write(node, 0, b"x" * 100) == 100
    overlay.flush_view(ex)
    assert node.pages is None and not isinstance(node.new_pages, set)
    assert not hasattr(node.upper, "__dict__")
    assert read_all(overlay, node) == b"x" * 100
    big = path_node(overlay, ex, "big")
    overlay.write(big, 5, b"Y")
    assert big.pages == {0} and big.new_pages == {0}
    overlay.flush_view(ex)
    assert big.pages == {0} and not isinstance(big.new_pages, set)
    overlay.truncate(big, 0)  # the page map goes with the base bytes, not left to a reload
    assert big.pages == set()
    with store.read() as txn:
        assert list(store.layers.pages(txn, ex.layer, big.ino)) == []


def test_short_write_leaves_the_pages_past_it_to_the_base(model, src, monkeypatch):
    # A full disk: the upper file takes PAGE_SIZE + 100 bytes of a two-page write.
    store, overlay, ex = model
    node = path_node(overlay, ex, "big")
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: real_pwrite(
        fd, data[:PAGE_SIZE + 100] if len(data) > PAGE_SIZE else data, off))
    written = overlay.write(node, 0, b"N" * (2 * PAGE_SIZE))
    monkeypatch.undo()

    assert written == PAGE_SIZE  # the second page is not whole: not claimed
    assert overlay._pages(node) == {0}
    base = (src / "big").read_bytes()
    assert read_all(overlay, node) == b"N" * PAGE_SIZE + base[PAGE_SIZE:]


def test_truncate_then_grow_reads_zeros(model):
    store, overlay, ex = model
    node = path_node(overlay, ex, "small")
    overlay.truncate(node, 4)
    overlay.truncate(node, 12)
    assert read_all(overlay, node) == b"0123" + bytes(8)


def test_hard_link_group_has_one_upper_inode(model):
    store, overlay, ex = model
    a = path_node(overlay, ex, "small")
    b = path_node(overlay, ex, "dir/small-link")
    assert a.ino == b.ino and overlay.attrs(a).nlink == 2
    overlay.write(a, 0, b"ZZ")
    assert read_all(overlay, path_node(overlay, ex, "dir/small-link"))[:4] == b"ZZ23"


def test_rename_base_directory_and_recreate(model):
    store, overlay, ex = model
    d = path_node(overlay, ex, "dir")
    overlay.rename(ex.root_ino, b"dir", ex.root_ino, b"moved", 0)
    assert path_node(overlay, ex, "moved").ino == d.ino
    assert path_node(overlay, ex, "moved/sub/b").entry.ref
    with pytest.raises(NotFound):
        overlay.lookup(ex.root_ino, b"dir")
    overlay.mkdir(ex.root_ino, b"dir", 0o755, 0, 0)
    assert overlay.listdir(path_node(overlay, ex, "dir").ino) == []


def test_state_survives_a_new_overlay(model, tmp_path):
    store, overlay, ex = model
    overlay.write(path_node(overlay, ex, "small"), 0, b"AB")
    overlay.unlink(path_node(overlay, ex, "dir").ino, b"a")
    new = overlay.create(ex.root_ino, b"new", 0o644, 0, 0)
    overlay.write(new, 0, b"fresh")
    overlay.flush_all()
    reopened = Overlay(store)
    ex2 = reopened.execution("e")
    assert read_all(reopened, path_node(reopened, ex2, "small")) == b"AB" + b"23456789" + \
        b"0123456789"
    assert read_all(reopened, path_node(reopened, ex2, "new")) == b"fresh"
    assert [n for n, _ in reopened.listdir(path_node(reopened, ex2, "dir").ino)] == \
        [b"small-link", b"sub"]
    assert [(k, p) for k, p in diff(reopened, ex2)] == [
        ("D", b"dir/a"), ("M", b"dir/small-link"), ("A", b"new"), ("M", b"small")]


def test_namespace_changes_store_every_record_they_touch(model):
    # No flush_all: each operation stores its dentries and the records it changed at once,
    # so a new overlay (as after a crash) sees names and link counts that agree.
    store, overlay, ex = model
    overlay.mkdir(ex.root_ino, b"new", 0o755, 0, 0)
    dir_ino, new_ino = path_node(overlay, ex, "dir").ino, path_node(overlay, ex, "new").ino
    overlay.rename(dir_ino, b"sub", new_ino, b"moved", 0)
    overlay.unlink(dir_ino, b"small-link")
    overlay.rename(ex.root_ino, b"small", dir_ino, b"a", 0)  # replaces dir/a
    x = overlay.create(new_ino, b"x", 0o644, 0, 0)
    overlay.write(x, 0, b"x")
    overlay.rename(new_ino, b"x", dir_ino, b"a", 2)  # RENAME_EXCHANGE
    reopened = Overlay(store)
    ex2 = reopened.execution("e")

    def nlink(path):
        return reopened.attrs(path_node(reopened, ex2, path) if path else
                              reopened.node(ex2.root_ino)).nlink

    def names(path):
        return [n for n, _ in reopened.listdir(path_node(reopened, ex2, path).ino)]
    assert (names("new"), names("dir")) == ([b"moved", b"x"], [b"a"])
    assert b"small" not in [n for n, _ in reopened.listdir(ex2.root_ino)]
    assert (nlink(""), nlink("dir"), nlink("new"), nlink("new/moved"), nlink("new/x")) == \
        (4, 2, 3, 2, 1)
    assert read_all(reopened, path_node(reopened, ex2, "new/x")) == b"0123456789" * 2
    assert read_all(reopened, path_node(reopened, ex2, "dir/a")) == b"x"


def test_the_reclaim_of_a_base_hard_link_group_leaves_no_record(model):
    store, overlay, ex = model
    small, dir_ = path_node(overlay, ex, "small"), path_node(overlay, ex, "dir")
    overlay.write(small, 0, b"S")
    overlay.unlink(ex.root_ino, b"small")
    overlay.unlink(dir_.ino, b"small-link")
    overlay.flush_view(ex)
    with store.read() as txn:
        assert store.layers.link(txn, ex.layer, small.upper.base.link) == small.ino
    overlay.forgotten([small])
    items = overlay.take_reclaim()
    drop_upper_files(items, None)
    overlay.reclaimed(items)
    with store.read() as txn:  # the group's record went with its inode (fsck: none dangles)
        assert store.layers.link(txn, ex.layer, small.upper.base.link) is None
        assert store.layers.inode(txn, ex.layer, small.ino) is None


def test_forgotten_unlinked_inode_loses_records_and_data(model):
    store, overlay, ex = model
    big, small = path_node(overlay, ex, "big"), path_node(overlay, ex, "small")
    overlay.write(big, PAGE_SIZE, b"Q")
    overlay.write(small, 0, b"S")
    overlay.save(big, small)
    overlay.unlink(ex.root_ino, b"big")
    data = overlay._upper_path(ex, big.ino)

    def stored():
        with store.read() as txn:
            layers = store.layers
            return [layers.inode(txn, ex.layer, big.ino) is not None,
                    list(layers.pages(txn, ex.layer, big.ino)) == [1],
                    layers.inode(txn, ex.layer, small.ino) is not None,
                    list(layers.pages(txn, ex.layer, small.ino)) == [0]]
    assert stored() == [True, True, True, True]
    overlay.forgotten([big, small])  # small still has its name
    assert (big.ino in overlay.nodes, small.ino in overlay.nodes) == (False, True)
    items = overlay.take_reclaim()
    assert [(item.layer, item.ino) for item in items] == [(ex.layer, big.ino)]
    assert overlay.take_reclaim() == []
    drop_upper_files(items, None)
    assert not os.path.exists(data) and os.path.exists(overlay._upper_path(ex, small.ino))
    assert stored() == [True, True, True, True]  # marked orphan until reclaimed
    with store.read() as txn:
        assert store.layers.orphans(txn) == [(ex.layer, big.ino)]
    overlay.reclaimed(items)
    assert stored() == [False, False, True, True]
    with store.read() as txn:
        assert store.layers.orphans(txn) == []


def test_an_inode_unlinked_while_open_goes_at_the_next_start(model):
    store, overlay, ex = model
    node = path_node(overlay, ex, "big")
    overlay.write(node, 0, b"A" * (2 * PAGE_SIZE))
    overlay.save(node)
    data = overlay._upper_path(ex, node.ino)
    overlay.unlink(ex.root_ino, b"big")  # a process still holds it: no forget before the stop

    def stored():
        with store.read() as txn:
            layers = store.layers
            return [layers.inode(txn, ex.layer, node.ino) is not None,
                    (ex.layer, node.ino) in layers.orphans(txn),
                    0 in layers.pages(txn, ex.layer, node.ino)]
    assert stored() == [True, True, True] and os.path.exists(data)
    restarted = Overlay(store)  # as deep verify makes one of a live store: the file stays
    assert stored() == [True, True, True] and os.path.exists(data)
    restarted.remove_orphans()  # the daemon's next start
    assert stored() == [False, False, False] and not os.path.exists(data)


def test_truncate_to_zero_starts_a_new_data_file_and_hands_over_the_old_one(model):
    store, overlay, ex = model
    node = path_node(overlay, ex, "big")
    overlay.write(node, 0, b"A" * (3 * PAGE_SIZE))
    data = overlay._upper_path(ex, node.ino)
    old_inode = os.stat(data).st_ino
    overlay.setattr(node, size=0)
    fds = overlay.take_unlinked_fds()
    assert [(os.fstat(fd).st_ino, os.fstat(fd).st_nlink) for fd in fds] == [(old_inode, 0)]
    close_all(fds)
    assert not os.path.exists(data) and read_all(overlay, node) == b""
    overlay.write(node, 5, b"new")
    assert read_all(overlay, node) == b"\0" * 5 + b"new"
    assert os.path.getsize(data) == 8 and overlay.take_unlinked_fds() == []


def test_reset_drops_the_layer(model):
    store, overlay, ex = model
    overlay.create(ex.root_ino, b"x", 0o644, 0, 0)
    trio.run(overlay.reset, ex, ex.head)
    assert [n for n, _ in overlay.listdir(ex.root_ino)] == [b"big", b"dir", b"small"]
    assert diff(overlay, ex) == []
    while (batch := overlay.collect_dead_layer()) is not None:
        overlay.forget_dead_layer(batch[0])
    with store.read() as txn:
        assert store.layers.layers_holding(txn) == {ex.layer}


def test_reset_places_only_the_known_nodes(model, tmp_path):
    """A reset looks at the nodes the kernel knows, not at the trees: onto a snapshot of 200
    more directories it decodes the trees on the known paths alone, keeps the known node
    whose path and entry the snapshot has, and rebinds the directory whose entry differs."""
    store, overlay, ex = model
    target = tmp_path / "target"
    for i in range(200):
        (target / f"many{i}" / "deep").mkdir(parents=True)
    shutil.copytree(tmp_path / "src" / "dir", target / "dir")  # the times kept
    (target / "dir" / "new").write_bytes(b"new")
    snap = import_tree(store, target)
    b, d = path_node(overlay, ex, "dir/sub/b"), path_node(overlay, ex, "dir")
    decoded = set(overlay.base_trees.trees)
    trio.run(overlay.reset, ex, snap)
    decoded_by_reset = set(overlay.base_trees.trees) - decoded
    new_dir = overlay.tree(snap.root.ref)[b"dir"]
    assert decoded_by_reset == {snap.root.ref, new_dir.ref}  # dir/sub's tree is the same
    assert path_node(overlay, ex, "dir/sub/b") is b and overlay.is_live(b)
    assert path_node(overlay, ex, "dir") is d and (d.entry, d.upper) == (new_dir, None)
    assert [n for n, _ in overlay.listdir(d.ino)] == [b"a", b"new", b"small-link", b"sub"]
    assert len(overlay.listdir(ex.root_ino)) == 201


def test_a_reader_in_the_execution_sees_the_old_tree_or_the_new_never_a_mix(model, tmp_path,
                                                                            monkeypatch):
    """Every step of a reset yields to other tasks here (its plan, the move of the kept nodes
    into their epoch, the reading of the dropped tables): a reader of the execution that
    looks between any two steps sees the whole old tree (every node live, the old listing
    and head) or the whole new one (the kept nodes live, the others stale, the rebound
    directory's new names), and the reset names what the kernel must forget."""
    from rametfs.overlay import executions, slices
    monkeypatch.setattr(slices, "SLICE_S", 0)
    monkeypatch.setattr(slices, "YIELD_MAX_S", 0.001)
    monkeypatch.setattr(executions, "RESET_STEP", 1)
    monkeypatch.setattr(executions, "DROP_STEP", 1)
    store, overlay, ex = model
    target = tmp_path / "target"
    shutil.copytree(tmp_path / "src", target, symlinks=True)
    (target / "dir" / "new").write_bytes(b"new")  # dir is rebound: its names change
    (target / "small").write_bytes(b"changed")  # small's entry differs: dropped
    to = import_tree(store, target)
    kept = [path_node(overlay, ex, p) for p in ("big", "dir", "dir/a", "dir/sub", "dir/sub/b")]
    link = path_node(overlay, ex, "dir/small-link")  # a hard link: never kept
    assert path_node(overlay, ex, "small") is link  # one node for both names
    created = [overlay.create(ex.root_ino, f"n{i}".encode(), 0o644, 0, 0) for i in range(5)]
    dropped = [link] + created
    d = kept[1]
    old_head = ex.head.id

    def seen():
        return (ex.head.id, [overlay.is_live(n) for n in kept],
                [overlay.is_live(n) for n in dropped],
                [name for name, _ in overlay.listdir(d.ino)] if overlay.is_live(d) else None)

    before = seen()
    assert before == (old_head, [True] * 5, [True] * 6,
                      [b"a", b"small-link", b"sub"])
    observed = []
    stale = []

    async def reset_beside_a_reader():
        done = trio.Event()

        async def reader():
            while not done.is_set():
                observed.append(seen())
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.sleep(0)
            stale.append(await overlay.reset(ex, to))
            done.set()

    trio.run(reset_beside_a_reader)
    after = (to.id, [True] * 5, [False] * 6, [b"a", b"new", b"small-link", b"sub"])
    assert seen() == after
    assert before in observed and after in observed and len(observed) > 20
    assert [state for state in observed if state not in (before, after)] == []
    assert [path_node(overlay, ex, p) for p in ("big", "dir", "dir/a", "dir/sub",
                                                "dir/sub/b")] == kept
    entries, inodes = stale[0]
    root = ex.root_ino
    assert sorted(entries) == sorted([(root, b"small"), (d.ino, b"small-link")]
                                     + [(root, f"n{i}".encode()) for i in range(5)])
    assert sorted(inodes) == sorted([root, d.ino] + [n.ino for n in dropped])
    assert sorted(overlay.stale_inos[-1]) == sorted([root] + [n.ino for n in dropped])


def test_resets_in_slices_side_by_side_keep_nothing_the_other_dropped(model, monkeypatch):
    """A reset's plan yields to other tasks (every step here): a reset that swaps the layer
    meanwhile makes the other plan again, so a node the first dropped is never kept; a
    release meanwhile makes it NotFound."""
    from rametfs.overlay import executions, slices
    monkeypatch.setattr(slices, "SLICE_S", 0)
    monkeypatch.setattr(executions, "RESET_STEP", 1)
    store, overlay, ex = model
    written = path_node(overlay, ex, "dir/a")
    overlay.write(written, 0, b"changed")
    kept = path_node(overlay, ex, "dir/sub/b")
    results = []

    async def both():
        async def one():
            results.append(await overlay.reset(ex, ex.head))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)

    trio.run(both)
    assert len(results) == 2 and not overlay.is_live(written) and overlay.is_live(kept)
    assert read_all(overlay, path_node(overlay, ex, "dir/a")) == b"a"
    assert path_node(overlay, ex, "dir/a") is not written

    async def reset_and_release():
        async def reset():
            with pytest.raises(NotFound):
                await overlay.reset(ex, ex.head)
            results.append("refused")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reset)
            await trio.sleep(0)
            await overlay.release(ex)

    trio.run(reset_and_release)
    assert results[-1] == "refused" and not overlay.is_live(kept)


def test_snapshot_view_is_read_only(model):
    store, overlay, ex = model
    view = overlay.snapshot_view(ex.base.id)
    node = overlay.lookup(view.root_ino, b"small")
    with pytest.raises(ReadOnly):
        overlay.write(node, 0, b"x")
    with pytest.raises(ReadOnly):
        overlay.mkdir(view.root_ino, b"d", 0o755, 0, 0)


def test_errors_carry_errnos(model):
    store, overlay, ex = model
    with pytest.raises(RametError) as e:
        overlay.create(ex.root_ino, b"n" * 256, 0o644, 0, 0)
    assert e.value.errno == 36  # ENAMETOOLONG
    with pytest.raises(RametError) as e:
        overlay.rmdir(ex.root_ino, b"dir")
    assert e.value.errno == 39  # ENOTEMPTY
    with pytest.raises(RametError) as e:
        overlay.create(ex.root_ino, b".ramet", 0o644, 0, 0)
    assert e.value.errno == 17  # EEXIST


def test_capture_reuses_unchanged_subtrees(model):
    store, overlay, ex = model
    overlay.write(path_node(overlay, ex, "small"), 0, b"Q")
    cap = Capture(overlay, ex)
    plan = cap.plan()
    trio.run(cap.hash)
    snap = trio.run(cap.commit, plan, [ex.head.id], "l", "m", 0)
    new_root = store.tree(snap.root.ref)
    old_root = store.tree(ex.base.root.ref)
    # dir holds the other name of small (a hard link), so it changes; its sub does not
    assert store.tree(new_root[b"dir"].ref)[b"sub"].ref == \
        store.tree(old_root[b"dir"].ref)[b"sub"].ref
    assert store.tree(new_root[b"dir"].ref)[b"small-link"].ref == new_root[b"small"].ref
    assert new_root[b"big"] == old_root[b"big"]
    assert new_root[b"small"].ref != old_root[b"small"].ref
    assert (len(cap.jobs), cap.writer.new_chunks) == (1, 1)
    assert {k: snap.stats[k] for k in ("files", "bytes", "dirs", "symlinks")} == {
        "files": 5, "bytes": 20 + 3 * PAGE_SIZE + 4 + 1 + 1 + 20, "dirs": 3, "symlinks": 0}
    assert stat.S_ISREG(new_root[b"small"].mode)


@pytest.mark.corrupts_store
def test_fsck_finds_a_corrupt_chunk(model):
    store, overlay, ex = model
    assert fsck(store).problems == []
    ids = list(store.content(store.tree(ex.base.root.ref)[b"small"].ref).chunk_ids())
    with store.write() as txn:
        envelope = bytearray(txn.get(ids[0], db=store.db["chunks"]))
        envelope[-1] ^= 0xFF
        txn.put(ids[0], bytes(envelope), db=store.db["chunks"])
    report = fsck(store)
    assert len(report.problems) == 1
    assert "/small" in report.problems[0] and ids[0].hex() in report.problems[0]


@pytest.mark.corrupts_store
def test_fsck_names_damaged_layer_records(model):
    store, overlay, ex = model
    big = path_node(overlay, ex, "big")
    overlay.write(big, PAGE_SIZE, b"Q")
    overlay.mkdir(ex.root_ino, b"new", 0o755, 0, 0)
    overlay.unlink(ex.root_ino, b"small")  # still named dir/small-link: no orphan
    overlay.flush_view(ex)
    report = fsck(store)
    root, layer = ex.root_ino, ex.layer
    assert (report.problems, report.executions, report.orphans, report.dead_layers) == \
        ([], 1, [], [])
    # Each damage made through the store's own accessors, in one transaction.
    layers = store.layers
    with store.write() as txn:
        upper, _ = layers.inode(txn, layer, big.ino)
        upper.size = PAGE_SIZE  # its page 1 now lies past the size
        upper.nlink = 3
        layers.put_inode(txn, layer, big.ino, upper)
        layers.put_dentry(txn, layer, root, b"ghost", 999_999)
        new = overlay.lookup(root, b"new")
        layers.delete_inode(txn, layer, new.ino)
        root_record, _ = layers.inode(txn, layer, root)
        root_record.nlink += 1
        layers.put_inode(txn, layer, root, root_record)
        layers.put_orphan(txn, layer, 777)
        layers.put_page(txn, layer + 5, 1, 0)  # a layer nobody has
        layers.mark_dead(txn, layer + 9)
    report = fsck(store)
    where = f"execution e layer {layer}"
    assert sorted(report.problems) == sorted([
        f"{where} inode {root}: dentry 'ghost' names inode 999999, which has no record",
        f"{where} inode {root}: dentry 'new' names inode {new.ino}, which has no record",
        f"{where} inode {root}: directory has nlink 5, but 2 + subdirectories make 3",
        f"{where} inode {big.ino}: nlink 3, but 1 dentries name it",
        f"{where} inode {big.ino}: page 1 in its page map, past its size of {PAGE_SIZE} bytes",
        f"execution e layer {layer} inode 777: marked orphan, but it has no record",
        f"layer {layer + 5}: records of a layer no execution has and that is not dead",
    ])
    assert (report.orphans, report.dead_layers) == ([(layer, 777)], [layer + 9])


class _FullEnv:
    """An LMDB environment whose metadata map is full: every put of a write transaction
    fails as LMDB fails it (MapFullError); reads and everything else as before."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def begin(self, write=False, **kwargs):
        txn = self._env.begin(write=write, **kwargs)
        return _FullTxn(txn) if write else txn


class _FullTxn:
    def __init__(self, txn):
        self._txn = txn

    def __getattr__(self, name):
        return getattr(self._txn, name)

    def put(self, *args, **kwargs):
        raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL: Environment mapsize limit reached")

    def __enter__(self):
        self._txn.__enter__()
        return self

    def __exit__(self, *exc):
        return self._txn.__exit__(*exc)


def test_a_root_verify_on_a_full_metadata_store_answers_or_fails_enospc(model, monkeypatch):
    # Root verification computes the tree ids a promote would store: it once did so in a
    # raw LMDB write transaction, past Store.write, so a full metadata map raised
    # lmdb.MapFullError out of it (a crash of the command) instead of ENOSPC.
    store, overlay, ex = model
    monkeypatch.setattr(store, "env", _FullEnv(store.env))
    unchanged = trio.run(verify, overlay, ex, "root")
    assert (unchanged.differences, unchanged.root) == ([], ex.head.root.ref.hex())
    monkeypatch.undo()
    small = path_node(overlay, ex, "small")
    overlay.write(small, 0, b"S")  # a change whose chunk a verify must store to hash it
    monkeypatch.setattr(store, "env", _FullEnv(store.env))
    with pytest.raises(NoSpace) as exc:
        trio.run(verify, overlay, ex, "root")
    assert exc.value.errno == errno.ENOSPC
    with pytest.raises(NoSpace):
        overlay.flush_view(ex)
    monkeypatch.undo()  # room again: nothing the change made was lost
    assert small in ex.dirty
    overlay.flush_view(ex)
    assert read_all(Overlay(store), path_node(Overlay(store), ex, "small")) == \
        b"S" + b"123456789" + b"0123456789"
    changed = trio.run(verify, overlay, ex, "root")
    assert changed.differences == [("M", b"dir/small-link"), ("M", b"small")]  # hard links


def test_precreated_files_are_made_taken_and_taken_over_after_a_restart(tmp_path):
    upper = str(tmp_path / "upper")
    pool = Precreated(upper)
    assert pool.wanted.is_set() and pool.missing() == TARGET  # an empty pool asks at once
    pool.add(pool.make(3))
    spare_dir = tmp_path / "upper" / "precreated"
    assert sorted(p.name for p in spare_dir.iterdir()) == ["s1", "s2", "s3"]
    assert {(p.stat().st_size, stat.S_IMODE(p.stat().st_mode)) for p in spare_dir.iterdir()} \
        == {(0, 0o600)}
    assert pool.take() == f"{spare_dir}/s1"  # oldest first
    (spare_dir / "stray").write_bytes(b"")  # not one of ours
    (spare_dir / "s9").write_bytes(b"x")  # not empty: never handed out
    restarted = Precreated(upper)
    assert list(restarted.ready) == [1, 2, 3]
    assert restarted.make(1) == [4]  # the counter goes on past the last
    assert sorted(p.name for p in spare_dir.iterdir()) == ["s1", "s2", "s3", "s4"]


def test_a_new_file_gets_a_precreated_upper_data_file(model):
    store, overlay, ex = model
    overlay.precreated = pool = Precreated(overlay.upper_root)
    pool.add(pool.make(1))
    spare_ino = os.stat(f"{pool.directory}/s{pool.ready[0]}").st_ino
    first = overlay.create(ex.root_ino, b"first", 0o644, 0, 0)
    assert overlay.write(first, 0, b"one") == 3
    data = overlay._upper_path(ex, first.ino)
    assert (os.stat(data).st_ino, os.path.getsize(data)) == (spare_ino, 3)
    assert list(pool.ready) == [] and pool.wanted.is_set()
    second = overlay.create(ex.root_ino, b"second", 0o644, 0, 0)  # none left: created
    assert overlay.write(second, 0, b"two") == 3
    assert read_all(overlay, first) == b"one" and read_all(overlay, second) == b"two"
    assert os.listdir(os.path.dirname(pool.directory + "/")) == []


def test_a_namespace_change_whose_transaction_fails_changes_nothing(model, monkeypatch):
    store, overlay, ex = model
    small, dir_ = path_node(overlay, ex, "small"), path_node(overlay, ex, "dir")
    big = path_node(overlay, ex, "big")
    overlay.mkdir(dir_.ino, b"empty", 0o755, 0, 0)
    for node in (small, dir_, big):
        overlay.copy_up(node)
    before = {n.name: (n.upper.nlink, n.upper.ctime_ns, n.parent) for n in (small, dir_, big)}
    root_nlink = overlay.node(ex.root_ino).upper.nlink if overlay.node(ex.root_ino).upper \
        else overlay.node(ex.root_ino).entry.nlink

    @contextlib.contextmanager
    def full_disk():
        raise NoSpace("no space left for metadata")
        yield
    monkeypatch.setattr(store, "write", full_disk)
    for change in (lambda: overlay.unlink(ex.root_ino, b"small"),
                   lambda: overlay.rename(ex.root_ino, b"big", ex.root_ino, b"small", 0),
                   lambda: overlay.rename(ex.root_ino, b"big", ex.root_ino, b"small", 2),
                   lambda: overlay.rename(ex.root_ino, b"big", dir_.ino, b"big", 0),
                   lambda: overlay.link(small.ino, dir_.ino, b"again"),
                   lambda: overlay.mkdir(ex.root_ino, b"new", 0o755, 0, 0),
                   lambda: overlay.rmdir(dir_.ino, b"empty")):
        with pytest.raises(NoSpace):
            change()
    monkeypatch.undo()
    assert {n.name: (n.upper.nlink, n.upper.ctime_ns, n.parent)
            for n in (small, dir_, big)} == before
    assert overlay.node(ex.root_ino).upper.nlink == root_nlink
    assert [n for n, _ in overlay.listdir(ex.root_ino)] == [b"big", b"dir", b"small"]
    overlay.forgotten([small, big])  # still named: nothing to reclaim
    assert overlay.take_reclaim() == []
    assert read_all(overlay, small) == b"0123456789" * 2


def test_the_pool_takes_over_only_its_own_files(tmp_path):
    spare_dir = tmp_path / "upper" / "precreated"
    spare_dir.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.write_bytes(b"")
    os.link(outside, spare_dir / "s1")  # a second link: it could be anything
    for name in ("s2", "s05", "s\u00b2", "x3"):
        (spare_dir / name).write_bytes(b"")
        os.chmod(spare_dir / name, 0o600)
    os.chmod(spare_dir / "s2", 0o644)
    (spare_dir / "s4").write_bytes(b"content")
    (spare_dir / "s6").mkdir()
    os.symlink(outside, spare_dir / "s7")
    (spare_dir / "s8").write_bytes(b"")
    os.chmod(spare_dir / "s8", 0o600)
    pool = Precreated(str(tmp_path / "upper"))
    assert list(pool.ready) == [8]
    assert sorted(p.name for p in spare_dir.iterdir()) == ["s6", "s8"]  # a directory stays
    assert outside.read_bytes() == b"" and outside.stat().st_nlink == 1


def test_the_pool_takes_back_files_and_empties_only_those_no_one_holds(tmp_path):
    """A file that goes is renamed into the pool while there is room (files and bytes),
    unlinked otherwise; it is emptied (same inode) and handed out only when no one holds it
    open (a descriptor, a mapping) and it is the daemon's 0600 file of one link, unlinked
    otherwise."""
    pool = Precreated(str(tmp_path / "upper"))
    layer = tmp_path / "upper" / "7"
    layer.mkdir()
    for name in "12345678":
        (layer / name).write_bytes(b"secret " + name.encode())
        os.chmod(layer / name, 0o600)
    os.chmod(layer / "3", 0o644)
    os.link(layer / "4", tmp_path / "second-link")
    inos = {name: (layer / name).stat().st_ino for name in "12345678"}
    files = [(str(layer / name), 4096) for name in "123456"] + \
        [(str(layer / "missing"), 0), (str(layer / "7"), 1 << 20), (str(layer / "8"), 4096)]
    taken = pool.take_back(files, (6, 7 * 4096))
    assert os.listdir(layer) == []  # "7" found no room for its bytes, "8" none for a file
    assert [n for n, _ in taken] == [1, 2, 3, 4, 5, 6] and {b for _, b in taken} == {4096}
    assert [os.stat(f"{pool.directory}/s{n}").st_ino for n, _ in taken] == \
        [inos[name] for name in "123456"]
    reader = os.open(f"{pool.directory}/s2", os.O_RDONLY)
    with open(f"{pool.directory}/s5", "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        pool.held.extend(taken)  # as hold() does, outside trio
        assert pool.empty(pool.take_held(10)) == [1, 6]
        assert os.fstat(reader).st_nlink == 0 and mapped[:6] == b"secret"
    finally:
        os.close(reader)
        mapped.close()
    assert (tmp_path / "second-link").read_bytes() == b"secret 4"
    pool.add([1, 6])
    spares = [pool.take(), pool.take()]
    assert [(os.stat(p).st_ino, os.path.getsize(p)) for p in spares] == \
        [(inos["1"], 0), (inos["6"], 0)]
    assert sorted(os.listdir(pool.directory)) == ["s1", "s6"]


def test_held_files_wait_for_a_creation_or_the_hold_then_are_emptied(tmp_path):
    async def main():
        pool = Precreated(str(tmp_path / "upper"))
        layer = tmp_path / "upper" / "9"
        layer.mkdir()
        for i in range(3):
            (layer / str(i)).write_bytes(b"x" * 5000)
            os.chmod(layer / str(i), 0o600)
        (layer / "sub").mkdir()  # not a data file: left to the caller
        assert pool.take_back_directory(str(tmp_path / "upper" / "8"), pool.room()) == []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(precreate.keep_filled, pool)
            with trio.fail_after(30):
                while len(pool.ready) < TARGET:  # the pool makes its files
                    await trio.sleep(0.01)
            assert (len(pool.ready), pool.room()) == \
                (TARGET, (precreate.TAKE_BACK_LIMIT - TARGET, precreate.HELD_MAX_BYTES))
            taken = await trio.to_thread.run_sync(pool.take_back_directory, str(layer),
                                                  pool.room())
            pool.hold(taken)
            assert os.listdir(layer) == ["sub"] and pool.held_bytes == 3 * 8192
            await trio.sleep(precreate.HOLD_S / 2)
            assert len(pool.held) == 3  # the pool is full: they wait
            with trio.fail_after(30):
                while len(pool.ready) < TARGET + 3:  # then they are emptied anyway
                    await trio.sleep(0.01)
            assert (len(pool.held), pool.held_bytes, trio.current_time() >= pool.hold_until) \
                == (0, 0, True)
            assert {os.path.getsize(f"{pool.directory}/s{n}") for n, _ in taken} == {0}
            nursery.cancel_scope.cancel()
    trio.run(main)


@pytest.mark.parametrize("few", ["MIN_FREE_INODES", "MIN_FREE_BYTES"])
def test_the_pool_takes_back_nothing_where_inodes_or_blocks_are_few(tmp_path, monkeypatch,
                                                                     few):
    pool = Precreated(str(tmp_path / "upper"))
    (tmp_path / "f").write_bytes(b"y")
    fs = os.statvfs(tmp_path)
    free = fs.f_favail if few == "MIN_FREE_INODES" else fs.f_bavail * fs.f_frsize
    monkeypatch.setattr(precreate, few, free + (1 << 30))
    assert pool.take_back([(str(tmp_path / "f"), 4096)], pool.room()) == []
    assert not (tmp_path / "f").exists() and os.listdir(pool.directory) == []


def test_a_file_is_held_where_leases_are_refused(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDWR)
    try:
        assert not precreate.held_elsewhere(fd)
        other = os.open(path, os.O_RDONLY)
        assert precreate.held_elsewhere(fd)
        os.close(other)

        def refused(*args):
            raise OSError(errno.EINVAL, "leases off")  # fs.leases-enable = 0
        monkeypatch.setattr(precreate.fcntl, "fcntl", refused)
        assert precreate.held_elsewhere(fd)
    finally:
        os.close(fd)


def test_the_pool_makes_nothing_where_inodes_are_few(tmp_path, monkeypatch):
    pool = Precreated(str(tmp_path / "upper"))
    monkeypatch.setattr(precreate, "MIN_FREE_INODES", os.statvfs(tmp_path).f_favail + 1)
    assert pool.make(4) == [] and os.listdir(pool.directory) == []


def test_no_room_for_a_new_upper_file_empties_the_pool_and_tries_again(model, monkeypatch):
    store, overlay, ex = model
    overlay.precreated = pool = Precreated(overlay.upper_root)
    pool.add(pool.make(3))
    rename = os.rename

    def full(src, dst):  # the layer's directory needs a block the pool's inodes took
        monkeypatch.setattr(os, "rename", rename)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "rename", full)
    node = overlay.create(ex.root_ino, b"new", 0o644, 0, 0)
    assert overlay.write(node, 0, b"data") == 4
    assert read_all(overlay, node) == b"data"
    assert list(pool.ready) == [] and os.listdir(pool.directory) == []


async def turns_beside(work, each_turn=lambda: None) -> int:
    """Await ``work()`` beside a task that calls ``each_turn()`` and yields, over and over;
    the turns that task had while ``work`` ran (at most one when it ran in one step)."""
    ran = []

    async def other() -> None:
        while True:
            each_turn()
            ran.append(None)
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        await trio.sleep(0)
        before = len(ran)
        await work()
        between = len(ran) - before
        nursery.cancel_scope.cancel()
    return between


async def test_dirty_records_are_stored_in_batches_with_other_tasks_between(model, monkeypatch):
    """Upper.flush_steps: 5,000 dirty records are stored FLUSH_BATCH a transaction, other
    tasks running between (50,000 in one step took the trio thread 250 ms, stalling every
    execution); a record changed after its batch was stored stays dirty for the next flush,
    one unlinked before its batch leaves the dirty set."""
    from rametfs.overlay import slices, upper
    store, overlay, ex = model
    monkeypatch.setattr(slices, "SLICE_S", 0.0)  # a slice a step, however fast the host
    d = overlay.mkdir(ex.root_ino, b"d", 0o755, 0, 0)
    nodes = [overlay.create(d.ino, b"f%d" % i, 0o644, 0, 0) for i in range(5000)]
    overlay.flush_view(ex)
    for node in nodes:
        overlay.setattr(node, mode=0o600)
    assert ex.dirty == set(nodes)
    changed, unlinked = [], []

    def meddle() -> None:
        stored = [n for n in nodes if not n.dirty]
        if stored and not changed:  # between two batches
            changed.append(stored[0])
            overlay.setattr(stored[0], mode=0o640)  # after its batch: dirty again
            unlinked.append(next(n for n in nodes if n.dirty and n is not stored[0]))
            overlay.unlink(d.ino, unlinked[0].name)  # before its batch

    between = await turns_beside(lambda: slices.in_slices(overlay.flush_steps(ex)), meddle)
    assert between >= 5000 // upper.FLUSH_BATCH - 2  # in one step, at most one turn passed
    [first], [last] = changed, unlinked
    assert ex.dirty == {first}
    with store.read() as txn:
        stored = {n.ino: store.layers.inode(txn, ex.layer, n.ino)[0] for n in nodes}
    assert stat.S_IMODE(stored[first.ino].mode) == 0o600 and first.upper.mode & 0o777 == 0o640
    assert stored[last.ino].nlink == 0  # the unlink stored it as an orphan
    assert [n.ino for n in nodes
            if n is not first and stat.S_IMODE(stored[n.ino].mode) != 0o600] == []
    overlay.flush_view(ex)
    assert ex.dirty == set()


async def test_a_move_between_deep_directories_is_checked_in_slices(model, monkeypatch):
    """Overlay.rename_in_slices: a directory moved between two chains 20,000 deep has the new
    parent's ancestors walked ANCESTOR_STEP at a time, other tasks running between slices (in
    one step, 72 ms a rename at 60,000 deep stalled every execution); moving a directory
    below itself from that deep is EINVAL."""
    store, overlay, ex = model

    def chain(name: bytes, depth: int):
        node = overlay.mkdir(ex.root_ino, name, 0o755, 0, 0)
        for _ in range(depth):
            node = overlay.mkdir(node.ino, b"d", 0o755, 0, 0)
        return node

    from rametfs.overlay import names, slices
    monkeypatch.setattr(slices, "SLICE_S", 0.0)  # a slice a step, however fast the host
    depth = 20_000
    a, b = chain(b"a", depth), chain(b"b", depth)
    moved = overlay.mkdir(a.ino, b"x", 0o755, 0, 0)
    between = await turns_beside(lambda: overlay.rename_in_slices(a.ino, b"x", b.ino, b"x", 0))
    # 19 steps; trio orders the tasks of a batch at random, so a few yields may pass it by
    assert between >= depth // names.ANCESTOR_STEP // 2  # run whole it let none run
    assert overlay.lookup(b.ino, b"x").ino == moved.ino
    with pytest.raises(RametError) as caught:
        await overlay.rename_in_slices(ex.root_ino, b"b", moved.ino, b"b", 0)
    assert caught.value.errno == errno.EINVAL
    assert overlay.lookup(ex.root_ino, b"b").ino != moved.ino  # nothing moved



async def test_writes_take_turns_one_per_idle_point_while_requests_wait():
    """slices.take_turn: with no request waiting a write goes at once, without letting any
    other task run, and so does one under TURN_BYTES whatever waits; while requests wait,
    one execution's writes go one per idle point of the trio thread, in the order they came,
    after every task that could run (a request read meanwhile), and another execution's
    write waits for no write of the first; a write that comes while earlier ones hold their
    turn waits for them even with no request waiting."""
    from rametfs.overlay.slices import TURN_BYTES, take_turn
    log: list[str] = []

    async def other_task() -> None:
        log.append("other")

    a, b = trio.Lock(), trio.Lock()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await take_turn(a, TURN_BYTES, lambda: False)
        log.append("alone")
        await take_turn(a, TURN_BYTES - 1, lambda: True)  # small: as any other request
        log.append("small")
    assert log == ["alone", "small", "other"]

    log.clear()
    came: list[str] = []

    async def write(turn: trio.Lock, name: str, waiting: bool = True) -> None:
        came.append(name)  # the turn is asked for in this same step: the order they queue in
        await take_turn(turn, TURN_BYTES, lambda: waiting)
        log.append(name)

    async def request() -> None:  # a handler that awaits a few times, as a create does
        for _ in range(5):
            await trio.sleep(0)
        log.append("request")

    async def idle_points() -> None:
        while True:
            await trio.testing.wait_all_tasks_blocked()
            log.append("idle")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(idle_points)
        for name in ("a1", "a2", "a3"):
            nursery.start_soon(write, a, name)
        nursery.start_soon(request)
        nursery.start_soon(write, b, "b1")
        while sum(name in log for name in ("a1", "a2", "a3", "b1")) < 4:
            await trio.sleep(0.001)
        nursery.cancel_scope.cancel()
    writes = [name for name in log if name != "idle"]
    a_order = [name for name in came if name.startswith("a")]
    assert writes[0] == "request"
    assert [name for name in writes if name.startswith("a")] == a_order
    assert writes.index("b1") < writes.index(a_order[1])  # b1 went at the first idle point
    last = log.index(a_order[2])
    assert log[:last].count("idle") >= 2  # a3 needed a third idle point

    log.clear()
    async with trio.open_nursery() as nursery:
        async with a:  # an earlier write of the execution holds its turn
            nursery.start_soon(write, a, "a2", False)
            await trio.testing.wait_all_tasks_blocked()  # a2 waits for the turn
            log.append("a1")
    assert log == ["a1", "a2"]
