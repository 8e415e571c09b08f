"""fallocate(2) and lseek(2) ``SEEK_DATA``/``SEEK_HOLE`` through the real mount
(docs/conformance.md, "fallocate and SEEK_DATA/SEEK_HOLE"; they need the pyfuse3 patch).

Each step runs on an execution and on a directory of the host (ext4) with the same programs
(fallocate(1), xfs_io, ``os.posix_fallocate``), and the sizes, ``st_blocks``, bytes and data
maps must be equal, where the 64 KiB page rule of snapshot content does not make them differ;
there the exact values are asserted."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
from pathlib import Path

import pyfuse3
import pytest

from conftest import Daemon, run
from rametfs.store import PAGE_SIZE

KIB, MIB = 1 << 10, 1 << 20

pytestmark = pytest.mark.skipif(not hasattr(pyfuse3.Operations, "fallocate"),
                                reason="fallocate and lseek need the patched pyfuse3 "
                                       "(tools/pyfuse3/README.md)")


def state(path: Path) -> tuple[int, int, str]:
    """``(st_size, st_blocks, sha256 of the bytes)``."""
    st = os.stat(path)
    return st.st_size, st.st_blocks, hashlib.sha256(path.read_bytes()).hexdigest()


def data_map(path: Path) -> list[tuple[int, int]]:
    """The ``(start, end)`` data extents ``SEEK_DATA``/``SEEK_HOLE`` report, from 0."""
    out, fd = [], os.open(path, os.O_RDONLY)
    try:
        pos = 0
        while True:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                assert exc.errno == errno.ENXIO
                return out
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, pos))
    finally:
        os.close(fd)


def xfs_io(path: Path, *commands: str, check: bool = True):
    argv = ["xfs_io", "-f"]
    for c in commands:
        argv += ["-c", c]
    return run(*argv, path, check=check)


def fresh(tmp_path: Path, name: str, files: dict[str, bytes]) -> Path:
    root = tmp_path / name
    root.mkdir()
    for n, data in files.items():
        (root / n).write_bytes(data)
    return root


BASE = {"base": b"b" * (4 * PAGE_SIZE), "other": b"o" * (3 * PAGE_SIZE + 4 * KIB)}


def test_each_mode_gives_ext4s_size_blocks_and_bytes(daemon, tmp_path):
    """Mode 0, KEEP_SIZE, PUNCH_HOLE|KEEP_SIZE and ZERO_RANGE (with and without KEEP_SIZE) on
    a new file and on a snapshot file (dense, so its pages count as ext4's blocks do): after
    each step the size, st_blocks and bytes equal ext4's, also after a daemon restart."""
    snap = daemon.snapshot(fresh(tmp_path, "src", BASE))
    ex = daemon.exec_path(daemon.create(snap))
    ext4 = fresh(tmp_path, "ext4", BASE)

    def steps(root: Path) -> list[tuple[int, int, str]]:
        seen = []
        f = root / "f"
        fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            os.posix_fallocate(fd, 0, MIB)
            seen.append(state(f))
            run("fallocate", "-n", "-o", str(MIB), "-l", str(MIB), f)  # KEEP_SIZE past the end
            seen.append(state(f))
            os.pwrite(fd, b"a" * 8 * KIB, 0)
            os.pwrite(fd, b"c" * 10, 5000)
            os.fsync(fd)  # ext4 allocates delayed blocks at write-back: make it happen now
            run("fallocate", "-p", "-o", "4096", "-l", "8192", f)  # PUNCH_HOLE|KEEP_SIZE
            seen.append(state(f))
            run("fallocate", "-z", "-o", str(2 * MIB), "-l", "4096", f)  # ZERO_RANGE, grows
            seen.append(state(f))
        finally:
            os.close(fd)
        xfs_io(f, "pwrite -q -S 0x61 100k 20k", "fsync", "fzero -k 96k 16k", "fpunch 2052k 4k",
               "falloc -k 3m 64k")
        seen.append(state(f))
        b = root / "base"  # from the snapshot: 4 pages of "b"
        run("fallocate", "-p", "-o", "1000", "-l", "70000", b)  # parts of pages 0 and 1
        seen.append(state(b))
        xfs_io(b, "fzero 128k 64k")  # page 2 whole
        seen.append(state(b))
        xfs_io(b, "falloc 0 256k", "falloc -k 256k 64k")  # over the base, then past the end
        seen.append(state(b))
        xfs_io(root / "other", "falloc 64k 1m", "fpunch 0 64k")  # grows, then page 0 whole
        seen.append(state(root / "other"))
        return seen

    got, want = steps(ex), steps(ext4)
    assert got == want
    assert [s[:2] for s in got] == [
        (MIB, 2048), (MIB, 4096), (MIB, 4080), (2 * MIB + 4 * KIB, 4088),
        (2 * MIB + 4 * KIB, 4224), (4 * PAGE_SIZE, 384), (4 * PAGE_SIZE, 384),
        (4 * PAGE_SIZE, 648), (MIB + 64 * KIB, 2048)]
    data = (ex / "f").read_bytes()
    assert data[:4096] == b"a" * 4096 and data[4096:12288] == bytes(8192)
    assert data[100 * KIB:120 * KIB] == bytes(12 * KIB) + b"a" * 8 * KIB
    b = (ex / "base").read_bytes()
    assert b == b"b" * 1000 + bytes(70000) + b"b" * (2 * PAGE_SIZE - 71000) + \
        bytes(PAGE_SIZE) + b"b" * PAGE_SIZE
    assert (daemon.snap_path(snap) / "base").read_bytes() == BASE["base"]  # unchanged
    daemon.restart()
    assert [state(ex / n) for n in ("f", "base", "other")] == [got[4], got[7], got[8]]


def test_punch_on_a_sparse_snapshot_file_and_promote(daemon, tmp_path):
    """A punched base page is masked (a page of the page map, a hole of the upper data
    file); one that is a hole of the base is masked whatever part the punch covers.  Promote
    stores the punched pages as holes: the new snapshot's bytes, st_blocks and data map."""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse", "wb") as f:  # pages 0-3 data, 4-7 a hole, 8 data (short)
        f.write(os.urandom(4 * PAGE_SIZE))
        f.seek(8 * PAGE_SIZE)
        f.write(b"z" * 1000)
    before = (src / "sparse").read_bytes()
    snap = daemon.snapshot(src)
    eid = daemon.create(snap)
    p = daemon.exec_path(eid) / "sparse"
    assert (os.stat(p).st_blocks, data_map(p)) == (
        (4 * PAGE_SIZE + 1024) // 512, [(0, 4 * PAGE_SIZE), (8 * PAGE_SIZE, 8 * PAGE_SIZE + 1000)])
    run("fallocate", "-p", "-o", str(PAGE_SIZE), "-l", str(2 * PAGE_SIZE), p)  # pages 1, 2
    run("fallocate", "-p", "-o", str(5 * PAGE_SIZE + 10), "-l", "100", p)  # inside the hole
    want = before[:PAGE_SIZE] + bytes(2 * PAGE_SIZE) + before[3 * PAGE_SIZE:]
    assert p.read_bytes() == want
    expect_map = [(0, PAGE_SIZE), (3 * PAGE_SIZE, 4 * PAGE_SIZE),
                  (8 * PAGE_SIZE, 8 * PAGE_SIZE + 1000)]
    assert (os.stat(p).st_blocks, data_map(p)) == ((2 * PAGE_SIZE + 1024) // 512, expect_map)
    promoted = daemon.exec_ctl(eid, "promote")["snapshot"]
    q = daemon.snap_path(promoted) / "sparse"
    assert (q.read_bytes(), os.stat(q).st_blocks, data_map(q)) == (
        want, (2 * PAGE_SIZE + 1024) // 512, expect_map)
    assert (daemon.snap_path(snap) / "sparse").read_bytes() == before


def test_seek_data_and_hole_match_ext4(daemon, tmp_path):
    """SEEK_DATA/SEEK_HOLE of new files equal ext4's (xfs_io ``seek``, Python's lseek, and
    cp, which copies holes as holes); a snapshot file's are at 64 KiB pages; ENXIO at and
    past the end."""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "s", "wb") as f:  # 1 MiB + 4 KiB, 4 KiB of data at 512 KiB
        f.truncate(MIB + 4 * KIB)
        f.seek(512 * KIB + 100)
        f.write(b"s" * 4 * KIB)
    snap = daemon.snapshot(src)
    ex = daemon.exec_path(daemon.create(snap))
    ext4 = tmp_path / "ext4"
    ext4.mkdir()
    for root in (ex, ext4):
        xfs_io(root / "n", "pwrite -q 0 4k", "pwrite -q 1m 8k", "truncate 3m", "falloc -k 3m 1m")
    assert data_map(ex / "n") == data_map(ext4 / "n") == [(0, 4 * KIB), (MIB, MIB + 8 * KIB)]
    assert xfs_io(ex / "n", "seek -a -r 0").stdout == xfs_io(ext4 / "n", "seek -a -r 0").stdout
    assert xfs_io(ex / "n", "seek -d 5k").stdout == "Whence\tResult\nDATA\t1048576\n"
    s = ex / "s"
    assert data_map(s) == data_map(daemon.snap_path(snap) / "s") == [(512 * KIB, 576 * KIB)]
    fd = os.open(s, os.O_RDONLY)
    try:
        assert os.lseek(fd, 0, os.SEEK_HOLE) == 0
        assert os.lseek(fd, 600 * KIB, os.SEEK_HOLE) == 600 * KIB
        assert os.lseek(fd, 520 * KIB, os.SEEK_HOLE) == 576 * KIB
        for off, whence in ((576 * KIB, os.SEEK_DATA), (MIB + 4 * KIB, os.SEEK_DATA),
                            (MIB + 4 * KIB, os.SEEK_HOLE), (5 * MIB, os.SEEK_HOLE)):
            with pytest.raises(OSError) as exc:
                os.lseek(fd, off, whence)
            assert exc.value.errno == errno.ENXIO, (off, whence)
    finally:
        os.close(fd)
    # Written past the base: the base pages, then the upper data file's extents.
    with open(s, "r+b") as f:
        f.seek(900 * KIB)
        f.write(b"w" * 10)  # copies up page 14 whole: zeros and 10 bytes
    assert data_map(s) == [(512 * KIB, 576 * KIB), (896 * KIB, 960 * KIB)]
    run("cp", s, ext4 / "copy")  # coreutils copies holes by SEEK_HOLE
    assert (ext4 / "copy").read_bytes() == s.read_bytes()
    assert os.stat(ext4 / "copy").st_blocks < 256  # two pages of data, not 1 MiB


def test_refusals_and_limits(own_daemon, tmp_path):
    """Modes other than the four are EOPNOTSUPP (collapse, insert: the kernel lets them
    through to no file system of FUSE), a snapshot file is EROFS, a range past
    ``--max-file-size`` is EFBIG whatever the mode, and an allocation past ``--max-bytes``
    is EDQUOT with nothing allocated, as ext4 quotas do."""
    d = own_daemon("--max-file-size", str(4 * MIB))
    src = fresh(tmp_path, "src", BASE)
    snap = d.snapshot(src)
    eid = d.ctl(f"create {snap} --max-bytes {MIB}")["execution"]
    ex = d.exec_path(eid)
    (ex / "f").write_bytes(b"x" * 100)
    for flag in ("-c", "-i"):
        proc = run("fallocate", flag, "-o", "0", "-l", str(PAGE_SIZE), ex / "f", check=False)
        assert (proc.returncode, proc.stderr) == (
            1, "fallocate: fallocate failed: Operation not supported\n")
    proc = run("fallocate", "-l", "4096", d.snap_path(snap) / "base", check=False)
    assert proc.returncode == 1 and "Read-only file system" in proc.stderr
    for args in (("-o", str(4 * MIB - 10), "-l", "11"), ("-n", "-l", str(5 * MIB))):
        proc = run("fallocate", *args, ex / "f", check=False)
        assert (proc.returncode, proc.stderr) == (1, "fallocate: fallocate failed: File too "
                                                     "large\n"), args
    proc = run("fallocate", "-l", str(2 * MIB), ex / "g", check=False)
    assert (proc.returncode, proc.stderr) == (1, "fallocate: fallocate failed: Disk quota "
                                                 "exceeded\n")
    assert os.stat(ex / "g")[6:7] == (0,) and os.stat(ex / "g").st_blocks == 0
    run("fallocate", "-l", str(MIB // 2), ex / "g")
    assert (os.stat(ex / "g").st_size, os.stat(ex / "g").st_blocks) == (MIB // 2, 1024)
    run("fallocate", "-l", str(MIB // 2), ex / "g")  # allocated already: nothing more
    assert os.stat(ex / "g").st_blocks == 1024
    proc = run("fallocate", "-o", str(MIB // 2), "-l", str(MIB // 2), ex / "g", check=False)
    assert "Disk quota exceeded" in proc.stderr  # the records took some of the 1 MiB
    proc = run("fallocate", "-z", "-l", str(2 * MIB), ex / "f", check=False)
    assert "Disk quota exceeded" in proc.stderr
    assert (ex / "f").read_bytes() == b"x" * 100  # nothing zeroed before the refusal


def test_pages_the_kernel_holds_show_the_zeros(daemon, tmp_path):
    """A punch or a zero range drops the kernel's cached pages of the range (read, written
    or mapped before), so reads and a shared mapping see the zeros at once."""
    snap = daemon.snapshot(fresh(tmp_path, "src", BASE))
    ex = daemon.exec_path(daemon.create(snap))
    assert (ex / "base").read_bytes() == BASE["base"]  # cached now
    xfs_io(ex / "base", "fzero -k 1000 5000")
    assert (ex / "base").read_bytes()[:7000] == b"b" * 1000 + bytes(5000) + b"b" * 1000
    (ex / "new").write_bytes(b"q" * 20000)
    with open(ex / "new", "r+b") as f, mmap.mmap(f.fileno(), 20000) as m:
        assert m[:10] == b"q" * 10
        xfs_io(ex / "new", "fpunch 0 4096", "fzero 10000 100")
        assert (m[:4097], m[9999:10101]) == (bytes(4096) + b"q", b"q" + bytes(100) + b"q")
    assert (ex / "new").read_bytes() == bytes(4096) + b"q" * 5904 + bytes(100) + b"q" * 9900


def test_plain_mode_answers_them_too(own_daemon, tmp_path):
    """With open and release answered (RAMETFS_OPEN_LESS=0) the handle is the inode number:
    the same punch, zero range and data map."""
    d = own_daemon(env={"RAMETFS_OPEN_LESS": "0"})
    assert d.status()["open_less"] is False
    snap = d.snapshot(fresh(tmp_path, "src", BASE))
    ex = d.exec_path(d.create(snap))
    xfs_io(ex / "base", "fpunch 64k 64k", "fzero -k 192k 64k", "falloc -k 256k 64k")
    assert state(ex / "base")[:2] == (4 * PAGE_SIZE, 2 * PAGE_SIZE // 512 + 256)
    assert (ex / "base").read_bytes() == b"b" * PAGE_SIZE + bytes(PAGE_SIZE) + \
        b"b" * PAGE_SIZE + bytes(PAGE_SIZE)
    assert data_map(ex / "base") == [(0, PAGE_SIZE), (2 * PAGE_SIZE, 3 * PAGE_SIZE)]


@pytest.fixture
def own_daemon(tmp_path):
    """``own_daemon(*serve_args, env=None)``: a daemon of this test's own, stopped at the
    end."""
    made: list[Daemon] = []

    def start(*serve_args: str, env: dict[str, str] | None = None) -> Daemon:
        d = Daemon(tmp_path / "data", tmp_path / "mnt", serve_args, env)
        made.append(d)
        d.start()
        return d

    yield start
    for d in made:
        d.stop()
