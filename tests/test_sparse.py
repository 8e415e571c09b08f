"""Sparse files and the hydration cache (docs/security.md, "Sparse files and the hydration
cache"; docs/format.md): holes are holes, file sizes and the cache are bounded.

Through the real mount: a file may not grow past ``--max-file-size`` (EFBIG); a 16 TiB sparse
file with a few MiB written imports, promotes, checkpoints, diffs and verifies in the time of
what it stores and reads back byte-exact; the hydration cache writes only the pages holding
data, stays under ``--cache-max-bytes`` by removing contents no reader holds, and removes the
temporary files of dead hydrations at start.  Without a mount: the content record's two forms,
their ids, and a format 1 store.

The tests whose bug made a command run for ever run it in a thread with a deadline; past it
the daemon is killed (its pid), which ends the blocked write, and the test fails.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import blake3
import msgpack
import pytest

from conftest import Daemon, check_log, run
from rametfs import Ramet, protocol
from rametfs.errors import IntegrityError
from rametfs.overlay.data import MAX_FILE_SIZE, OPEN_FILES
from rametfs.store import EMPTY_CONTENT, PAGE_SIZE, Store, fsck
from rametfs.store.chunks import chunk_id, content_id, encode_chunk
from rametfs.store.importer import put_directory
from rametfs.store.trees import Entry
from rametfs.store.writer import ChunkWriter

MIB = 1 << 20
TIB = 1 << 40
DEADLINE_S = 120  # far above what these take (a few seconds), far below the bug's "for ever"


def pages_touched(off: int, n: int) -> int:
    return (off + n - 1) // PAGE_SIZE - off // PAGE_SIZE + 1


def cache_files(d: Daemon) -> dict[str, os.stat_result]:
    """The hydrated files in ``d``'s cache by name (temporary ones left out)."""
    top = d.data_dir / "cache"
    return {p.name: p.stat() for p in top.iterdir() if not p.name.startswith(".")}


def disk_bytes(st: os.stat_result) -> int:
    return st.st_blocks * 512


def within(d: Daemon, what: str, fn, deadline_s: float = DEADLINE_S):
    """``fn()`` in a thread; past ``deadline_s`` kill the daemon (ending what blocks on the
    mount) and fail naming ``what``.  Returns ``(result, seconds)``; re-raises its error."""
    out: dict = {}

    def target():
        try:
            out["result"] = fn()
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    started = time.monotonic()
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(deadline_s)
    if t.is_alive():
        d.kill()
        t.join(30)
        pytest.fail(f"{what} still running after {deadline_s} s: daemon killed")
    if "error" in out:
        raise out["error"]
    return out["result"], time.monotonic() - started


@pytest.fixture
def own_daemon(tmp_path, request):
    """``own_daemon(*serve_args)``: a daemon of this test's own, stopped and its log
    checked at the end."""
    made: list[Daemon] = []

    def start(*serve_args: str) -> Daemon:
        d = Daemon(tmp_path / f"data{len(made)}", tmp_path / f"mnt{len(made)}", serve_args)
        made.append(d)
        d.start()
        return d

    yield start
    allowed = [r for m in request.node.iter_markers("allow_log") for r in m.args]
    for d in made:
        try:
            d.stop()
        finally:
            check_log(d.log_text(), allowed, repr(d))


def empty_execution(d: Daemon, tmp_path: Path) -> tuple[str, Path]:
    src = tmp_path / "empty-src"
    src.mkdir(exist_ok=True)
    eid = d.create(d.snapshot(src))
    return eid, d.exec_path(eid)


# -- the largest file size -----------------------------------------------------------------

def test_truncate_to_the_largest_off_t_is_efbig_and_checkpoint_finishes(own_daemon, tmp_path):
    """Issue 15.2: ``truncate -s 9223372036854775807 f`` then ``checkpoint`` ran for ever
    (the writer in D state, the daemon growing).  Now the truncate is EFBIG, the size stays,
    and truncating to the largest size allowed (ext4's) is fine and checkpoints at once."""
    d = own_daemon()
    eid, root = empty_execution(d, tmp_path)
    (root / "f").write_bytes(b"data")
    proc = run("truncate", "-s", str(2**63 - 1), root / "f", check=False)
    assert proc.returncode == 1 and "File too large" in proc.stderr, proc
    with pytest.raises(OSError) as exc:
        os.truncate(root / "f", MAX_FILE_SIZE + 1)
    assert exc.value.errno == errno.EFBIG
    assert (root / "f").stat().st_size == 4
    run("truncate", "-s", str(MAX_FILE_SIZE), root / "f")
    assert (root / "f").stat().st_size == MAX_FILE_SIZE
    reply, seconds = within(d, "checkpoint of a 16 TiB file",
                            lambda: d.ctl(f"checkpoint {eid}"))
    assert seconds < 30, seconds
    assert (reply["stats"]["new_chunks"], reply["stats"]["bytes"]) == (1, MAX_FILE_SIZE)
    with open(d.snap_path(reply["snapshot"]) / "f", "rb") as f:
        assert f.read(8) == b"data\0\0\0\0"
        assert os.pread(f.fileno(), 8, MAX_FILE_SIZE - 8) == bytes(8)


def test_writes_and_sizes_stop_at_max_file_size(own_daemon, tmp_path):
    """``--max-file-size``: a write at or past it is EFBIG, one across it is short (ext4's
    rule); a truncate or a setattr past it is EFBIG and changes nothing (the mode given with
    it neither); shrinking a file is always allowed."""
    limit = MIB + 100
    d = own_daemon("--max-file-size", str(limit))
    _, root = empty_execution(d, tmp_path)
    f = root / "f"
    fd = os.open(f, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert os.pwrite(fd, b"x" * 300, limit - 200) == 200
        assert os.fstat(fd).st_size == limit
        for off in (limit, limit + 1, 2**62):
            with pytest.raises(OSError) as exc:
                os.pwrite(fd, b"y", off)
            assert exc.value.errno == errno.EFBIG
        with pytest.raises(OSError) as exc:
            os.ftruncate(fd, limit + 1)
        assert exc.value.errno == errno.EFBIG
        os.ftruncate(fd, 10)
        os.ftruncate(fd, limit)
    finally:
        os.close(fd)
    assert f.stat().st_size == limit
    assert f.read_bytes() == bytes(limit)  # what the short write put there went with the shrink
    proc = run("truncate", "-s", str(limit + 1), f, check=False)
    assert proc.returncode == 1 and "File too large" in proc.stderr
    # dd writes in 64 KiB blocks and stops at the limit with "File too large"
    proc = run("dd", "if=/dev/zero", f"of={f}", "bs=64K", "count=32", "conv=notrunc",
               check=False)
    assert proc.returncode == 1 and "File too large" in proc.stderr, proc
    assert f.stat().st_size == limit


# -- 16 TiB sparse files: promote, read back, import, copy-up, verify ------------------------

REGIONS = [(0, MIB), (5 * TIB + 12345, MIB), (8 * TIB, MIB), (MAX_FILE_SIZE - MIB, MIB)]
STORED_PAGES = sum(pages_touched(off, n) for off, n in REGIONS)  # 16 + 17 + 16 + 17


def write_regions(path: Path, size: int) -> list[bytes]:
    """Make ``path`` a sparse file of ``size`` bytes holding random :data:`REGIONS`."""
    datas = [os.urandom(n) for _, n in REGIONS]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        for (off, _), data in zip(REGIONS, datas):
            assert os.pwrite(fd, data, off) == len(data)
    finally:
        os.close(fd)
    return datas


def check_regions(path: Path, datas: list[bytes]) -> None:
    """``path`` reads :data:`REGIONS` back, zeros around each and at both ends of the holes."""
    with open(path, "rb") as f:
        fd = f.fileno()
        assert os.fstat(fd).st_size == MAX_FILE_SIZE
        for (off, n), data in zip(REGIONS, datas):
            assert os.pread(fd, n, off) == data, off
            if off:
                assert os.pread(fd, 3 * PAGE_SIZE, off - 3 * PAGE_SIZE) == bytes(3 * PAGE_SIZE)
            if off + n < MAX_FILE_SIZE:
                assert os.pread(fd, 3 * PAGE_SIZE, off + n) == bytes(3 * PAGE_SIZE)
        assert os.pread(fd, 2 * PAGE_SIZE, 3 * TIB) == bytes(2 * PAGE_SIZE)
        assert os.pread(fd, 10, MAX_FILE_SIZE - 5) == datas[-1][-5:]


def the_cache_file(d: Daemon, size: int) -> os.stat_result:
    found = [st for st in cache_files(d).values() if st.st_size == size]
    assert len(found) == 1, cache_files(d)
    return found[0]


def test_16_tib_sparse_file_promotes_in_the_time_of_its_data_and_reads_back(own_daemon,
                                                                            tmp_path):
    """A 16 TiB file with 4 MiB written promotes in seconds and stores its 66 written pages
    only; its snapshot reads back byte-exact through the mount (zeros in the holes), and
    hydrating it takes what it stores on disk, not 16 TiB."""
    d = own_daemon()
    eid, root = empty_execution(d, tmp_path)
    datas = write_regions(root / "f", MAX_FILE_SIZE)
    reply, seconds = within(d, "promote of a 16 TiB sparse file",
                            lambda: d.ctl(f"promote {eid}"))
    assert seconds < 30, seconds
    stats = reply["stats"]
    assert (stats["changed_files"], stats["new_chunks"], stats["bytes"]) == (
        1, STORED_PAGES, MAX_FILE_SIZE)
    diff = (root / protocol.CONTROL_DIR / protocol.DIFF).read_text()
    assert diff == "", diff  # against the head, the promote: by its content id, unread
    check_regions(d.snap_path(reply["snapshot"]) / "f", datas)
    assert disk_bytes(the_cache_file(d, MAX_FILE_SIZE)) <= (STORED_PAGES + 1) * PAGE_SIZE


def test_16_tib_sparse_source_imports_copies_up_and_verifies_in_the_time_of_its_data(
        own_daemon, tmp_path):
    """The importer reads only a source's data extents (SEEK_DATA); an execution of it
    copies up a page of a hole as zeros; checkpoint, diff, verify and deep verify (which
    rechecks the sparse hydrated copy) take seconds."""
    d = own_daemon()
    src = tmp_path / "src"
    src.mkdir()
    datas = write_regions(src / "f", MAX_FILE_SIZE)
    reply, seconds = within(d, "import of a 16 TiB sparse source",
                            lambda: d.ctl(protocol.format_command("snapshot", str(src))))
    assert seconds < 30, seconds
    assert reply["stats"]["new_chunks"] == STORED_PAGES
    sid = reply["snapshot"]
    check_regions(d.snap_path(sid) / "f", datas)
    eid = d.create(sid)
    f = d.exec_path(eid) / "f"
    hole = 3 * TIB + 100
    fd = os.open(f, os.O_RDWR)
    try:
        assert os.pwrite(fd, b"0123456789", hole) == 10
        page = hole - hole % PAGE_SIZE
        assert os.pread(fd, PAGE_SIZE, page) == bytes(100) + b"0123456789" + bytes(
            PAGE_SIZE - 110)
    finally:
        os.close(fd)
    ctl = d.exec_path(eid) / protocol.CONTROL_DIR
    assert (ctl / protocol.DIFF).read_text() == "M f\n"
    reply, seconds = within(d, "checkpoint", lambda: d.ctl(f"checkpoint {eid}"))
    assert seconds < 30 and reply["stats"]["new_chunks"] == 1, (seconds, reply)
    reply, seconds = within(d, "verify", lambda: d.exec_ctl(eid, "verify"))
    assert seconds < 30 and reply["verification"]["differences"] == [["M", "f"]], reply
    d.exec_ctl(eid, "reset")
    reply, seconds = within(d, "deep verify", lambda: d.exec_ctl(eid, "verify --mode deep"))
    assert seconds < 30 and reply["verification"]["equal"], reply
    check_regions(f, datas)


def test_deep_verify_sees_bytes_in_a_hole_of_a_hydrated_copy(own_daemon, tmp_path):
    """Deep verification checks the holes of a sparse hydrated copy too: a byte written
    into one (behind the daemon's back) is a difference."""
    d = own_daemon()
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "f", "wb") as f:
        f.truncate(64 * MIB)
        f.seek(32 * MIB)
        f.write(os.urandom(PAGE_SIZE))
    eid = d.create(d.snapshot(src))
    assert (d.exec_path(eid) / "f").read_bytes()[32 * MIB:32 * MIB + 1] != b""
    assert d.exec_ctl(eid, "verify --mode deep")["verification"]["equal"]
    (name, st), = cache_files(d).items()
    assert disk_bytes(st) == PAGE_SIZE
    with open(d.data_dir / "cache" / name, "r+b") as f:  # mode 0400, but this is root
        f.seek(MIB)
        f.write(b"!")
    reply = d.exec_ctl(eid, "verify --mode deep")["verification"]
    assert reply["differences"] == [["M", "f"]], reply


# -- zero pages are holes: one content id for the same bytes ---------------------------------

def test_zero_pages_are_holes_whoever_wrote_them(own_daemon, tmp_path):
    """The same bytes give the same content id from a sparse source, a source with its
    zeros written out, and a file written through an execution with its zeros written
    out; only the page holding data is stored."""
    d = own_daemon()
    data = os.urandom(1000)
    size = 3 * MIB + 77
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "dense", "wb") as f:
        f.write(bytes(MIB) + data + bytes(size - MIB - len(data)))
    with open(src / "sparse", "wb") as f:
        f.truncate(size)
        f.seek(MIB)
        f.write(data)
    reply = d.ctl(protocol.format_command("snapshot", str(src)))
    assert reply["stats"]["new_chunks"] == 1
    eid = d.create(reply["snapshot"])
    (d.exec_path(eid) / "written").write_bytes(
        bytes(MIB) + data + bytes(size - MIB - len(data)))
    promoted = d.ctl(f"promote {eid}")
    assert promoted["stats"]["new_chunks"] == 0
    store = Store(d.data_dir)  # a reader beside the daemon (LMDB is multi-process)
    try:
        entries = store.tree(store.snapshot(promoted["snapshot"]).root.ref)
        refs = {name: e.ref for name, e in entries.items()}
        assert refs[b"dense"] == refs[b"sparse"] == refs[b"written"], refs
        content = store.content(refs[b"dense"])
        assert (content.size, content.runs, content.stored_pages) == (size, ((16, 1),), 1)
    finally:
        store.close()
    assert (d.snap_path(promoted["snapshot"]) / "written").read_bytes() == \
        (src / "dense").read_bytes()


def test_fallback_scans_and_promotes_zero_pages_as_holes(tmp_path):
    """Fallback mode gives the same content ids: its diff (ids computed, nothing stored)
    sees a file whose bytes did not change as unchanged, and its promote stores a file of
    written-out zeros as the same sparse content as an import of them."""
    data = bytes(MIB) + os.urandom(100) + bytes(MIB)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(data)
    with Ramet(data=tmp_path / "data", mode="fallback") as r:
        ex = r.create(r.snapshot(src))
        st = (ex.path / "f").stat()
        (ex.path / "f").write_bytes(data)  # its ctime moves: the scan hashes it again
        os.utime(ex.path / "f", ns=(st.st_atime_ns, st.st_mtime_ns))
        (ex.path / "g").write_bytes(data)
        assert ex.diff() == [("A", "g")]
        promoted = ex.promote()
    store = Store(tmp_path / "data")
    try:
        entries = store.tree(store.snapshot(promoted).root.ref)
        assert entries[b"f"].ref == entries[b"g"].ref
        assert store.content(entries[b"g"].ref).runs == ((16, 1),)
    finally:
        store.close()


# -- the hydration cache ---------------------------------------------------------------------

def test_reading_part_of_a_big_sparse_snapshot_file_hydrates_only_its_data(own_daemon,
                                                                          tmp_path):
    """Issue 15.5: reading 100 MB of a 50 GB sparse snapshot file allocated 50 GiB in
    data/cache.  Now the hydrated copy takes what the content stores (here 8 MiB of an
    8 GiB file), and its holes read as zeros."""
    d = own_daemon()
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(8 * MIB)
    with open(src / "big", "wb") as f:
        f.truncate(8 << 30)
        f.seek(3 << 30)
        f.write(data)
    sid = d.snapshot(src)
    with open(d.snap_path(sid) / "big", "rb") as f:
        assert os.pread(f.fileno(), len(data), 3 << 30) == data
        assert os.pread(f.fileno(), MIB, 5 << 30) == bytes(MIB)
    st = the_cache_file(d, 8 << 30)
    assert disk_bytes(st) <= len(data) + PAGE_SIZE, disk_bytes(st)


def test_cache_over_its_limit_removes_contents_no_reader_holds(own_daemon, tmp_path):
    """With ``--cache-max-bytes`` 1 MiB, reading more files than the daemon keeps open
    leaves exactly the contents it holds (its ``OPEN_FILES`` open descriptors, and the one
    it closed last) in the cache; a file whose copy went hydrates again and reads right,
    and a reader that held a file open across the removal keeps reading it right."""
    d = own_daemon("--cache-max-bytes", str(MIB))
    src = tmp_path / "src"
    src.mkdir()
    count = OPEN_FILES + 40
    datas = [os.urandom(PAGE_SIZE) for _ in range(count)]
    for i, data in enumerate(datas):
        (src / f"{i:04}").write_bytes(data)
    big = os.urandom(4 * MIB)
    (src / "big").write_bytes(big)
    sid = d.snapshot(src)
    top = d.snap_path(sid)
    with open(top / "big", "rb") as held:
        assert held.read(PAGE_SIZE) == big[:PAGE_SIZE]
        for i, data in enumerate(datas):
            assert (top / f"{i:04}").read_bytes() == data
        cached = cache_files(d)
        ids = [content_id(PAGE_SIZE, chunk_id(data)).hex() for data in datas]  # dense
        assert set(cached) == set(ids[-(OPEN_FILES + 1):]), sorted(ids.index(c) for c in cached)
        assert sum(disk_bytes(st) for st in cached.values()) == (OPEN_FILES + 1) * PAGE_SIZE
        os.posix_fadvise(held.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # read it anew
        held.seek(0)
        assert held.read() == big
    assert (top / "0000").read_bytes() == datas[0]


def test_cache_limit_holds_across_a_restart_and_dead_temporary_files_go(own_daemon, tmp_path):
    """A restarted daemon counts what its cache holds (``--cache-max-bytes 0``: every
    content nobody holds goes at the next hydration) and removes the temporary files of
    hydrations whose process is gone, keeping those of live ones."""
    d = own_daemon("--cache-max-bytes", "0")
    src = tmp_path / "src"
    src.mkdir()
    datas = {name: os.urandom(3 * PAGE_SIZE) for name in "abc"}
    for name, data in datas.items():
        (src / name).write_bytes(data)
    top = d.snap_path(d.snapshot(src))
    for name in "ab":
        assert (top / name).read_bytes() == datas[name]
    assert len(cache_files(d)) == 2  # both held open by the daemon
    d.stop()
    dead = run("sh", "-c", "echo $$")  # a pid that has exited
    cid = "ab" * 32
    stale = d.data_dir / "cache" / f".{cid}.{int(dead.stdout)}.{time.monotonic_ns()}"
    live = d.data_dir / "cache" / f".{cid}.{os.getpid()}.{time.monotonic_ns()}"
    for p in (stale, live):
        p.write_bytes(b"partial")
    d.start()
    assert not stale.exists() and live.exists()
    live.unlink()
    assert (top / "c").read_bytes() == datas["c"]
    (name, st), = cache_files(d).items()
    assert disk_bytes(st) == 3 * PAGE_SIZE


# -- the content record ----------------------------------------------------------------------

def test_content_record_forms_and_ids(tmp_path):
    """A content without holes keeps format 1's dense record and id; one with holes has the
    sparse record; both read back; a malformed sparse record is an IntegrityError (EIO)."""
    store = Store(tmp_path / "data")
    try:
        writer = ChunkWriter(store)
        a, b = os.urandom(PAGE_SIZE), os.urandom(5)
        dense = writer.put_content(PAGE_SIZE + 5, [writer.add(a), writer.add(b)])
        assert dense == blake3.blake3(b"content\0" + (PAGE_SIZE + 5).to_bytes(8, "big")
                                      + chunk_id(a) + chunk_id(b)).digest()
        with store.read() as txn:
            assert msgpack.unpackb(txn.get(dense, db=store.db["contents"])) == [
                PAGE_SIZE + 5, chunk_id(a) + chunk_id(b)]
        size = 10 * PAGE_SIZE + 5
        ids = [None] * 11
        ids[3], ids[4], ids[10] = writer.add(a), writer.add(a), writer.add(b)
        sparse = writer.put_content(size, ids)
        runs = (3).to_bytes(8, "big") + (2).to_bytes(8, "big") + \
            (10).to_bytes(8, "big") + (1).to_bytes(8, "big")
        assert sparse == blake3.blake3(
            b"content\1" + size.to_bytes(8, "big") + (2).to_bytes(8, "big") + runs
            + chunk_id(a) * 2 + chunk_id(b)).digest()
        content = store.content(sparse)
        assert list(content.pages()) == [(3, chunk_id(a)), (4, chunk_id(a)), (10, chunk_id(b))]
        assert store.read_page(sparse, 2) == bytes(PAGE_SIZE)
        assert store.read_page(sparse, 4) == a
        assert store.read_page(sparse, 10) == b
        assert store.read_page(sparse, 11) == b""
        assert writer.put_content(0, []) == EMPTY_CONTENT
        assert writer.add(bytes(PAGE_SIZE)) is None and writer.add(bytes(7)) is None
        for bad in ([size, chunk_id(a), runs],  # 3 runs' pages, 1 id
                    [size, chunk_id(a) * 3, runs[16:] + runs[:16]],  # not ascending
                    [PAGE_SIZE, chunk_id(a) * 3, runs]):  # pages past the end
            key = os.urandom(32)
            with store.write() as txn:
                txn.put(key, msgpack.packb(bad), db=store.db["contents"])
            with pytest.raises(IntegrityError, match="malformed"):
                store.content(key)
    finally:
        store.close()


def test_a_format_1_store_with_zero_chunks_reads_hydrates_sparse_and_promotes_canonically(
        own_daemon, tmp_path):
    """A store written by format 1 (a dense record with a chunk for every page, zeros too)
    still reads through the mount; its hydrated copy leaves its zero pages as holes; a
    promote of a change to it stores the canonical sparse content (the id an import of the
    same bytes gets), and fsck passes."""
    data_dir = tmp_path / "data0"
    store = Store(data_dir)
    zero, page = bytes(PAGE_SIZE), os.urandom(PAGE_SIZE)
    size = 40 * PAGE_SIZE + 3
    pages = [zero] * 40 + [bytes(3)]
    pages[20] = page
    with store.write() as txn:
        for raw in (zero, page, bytes(3)):
            txn.put(chunk_id(raw), encode_chunk(raw), db=store.db["chunks"])
        ids = b"".join(chunk_id(p) for p in pages)
        cid = content_id(size, ids)
        txn.put(cid, msgpack.packb([size, ids]), db=store.db["contents"])
        entry = Entry(b"f", 0o100644, 0, 0, 0, size, cid, (), 0, 1)
        root = put_directory(store, txn, [entry], 0o40755, 0, 0, 0)
        sid = store.put_snapshot(txn, root, [], "v1", "", "test",
                                 store.tree_totals(txn, root.ref)).id
        txn.put(b"format", (1).to_bytes(8, "big"), db=store.db["meta"])
    store.close()
    d = own_daemon()
    assert d.data_dir == data_dir
    expected = b"".join(pages)
    assert (d.snap_path(sid) / "f").read_bytes() == expected
    assert disk_bytes(the_cache_file(d, size)) == PAGE_SIZE
    eid = d.create(sid)
    with open(d.exec_path(eid) / "f", "r+b") as f:
        f.seek(size)
        f.write(b"!")
    promoted = d.ctl(f"promote {eid}")["snapshot"]
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(expected + b"!")
    imported = d.snapshot(src)
    check = Store(d.data_dir)
    try:
        with check.read() as txn:
            assert txn.get(b"format", db=check.db["meta"]) == (2).to_bytes(8, "big")
        refs = [check.tree(check.snapshot(s).root.ref)[b"f"].ref for s in (promoted, imported)]
        assert refs[0] == refs[1]
        assert check.content(refs[0]).runs == ((20, 1), (40, 1))
        assert fsck(check).problems == []
    finally:
        check.close()
    assert (d.snap_path(promoted) / "f").read_bytes() == expected + b"!"


def test_import_of_a_file_that_shrank_records_its_size_with_zeros(tmp_path):
    """``ChunkWriter.put_file`` records ``size`` bytes even when the file has fewer by the
    time it is read (it shrank after the stat): the missing bytes are zeros."""
    store = Store(tmp_path / "data")
    try:
        data = os.urandom(PAGE_SIZE + 10)
        (tmp_path / "f").write_bytes(data)
        fd = os.open(tmp_path / "f", os.O_RDONLY)
        try:
            cid = ChunkWriter(store).put_file(fd, 3 * PAGE_SIZE)
        finally:
            os.close(fd)
        assert Path(store.hydrate(cid)).read_bytes() == data + bytes(2 * PAGE_SIZE - 10)
    finally:
        store.close()
