"""``st_blocks`` through the real mount: the blocks of what is stored, not of the size, so
``du`` of a sparse file counts its data and not its holes (docs/conformance.md).

A file written in an execution reports what its upper data file takes on the host (a sparse
ext4 file, as ext4 itself stores the same writes); a snapshot's file reports its pages that
hold data (64 KiB pages: a hole is a page of zeros); a copied-up file both, its base pages that
its writes replaced left out."""

from __future__ import annotations

import os

from conftest import run
from rametfs.store import PAGE_SIZE

KIB, MIB = 1 << 10, 1 << 20


def blocks(path) -> int:
    return os.stat(path).st_blocks


def write_at(path, offset: int, data: bytes, mode: str = "r+b") -> None:
    with open(path, mode) as f:
        f.seek(offset)
        f.write(data)


def test_st_blocks_count_what_is_stored(daemon, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "dense").write_bytes(b"d" * (3 * PAGE_SIZE + 100))
    with open(src / "sparse", "wb") as f:  # 1 MiB + 4 KiB: one page of data at 512 KiB
        f.truncate(MIB + 4 * KIB)
    write_at(src / "sparse", 512 * KIB, b"s" * 4 * KIB)
    with open(src / "empty-hole", "wb") as f:
        f.truncate(MIB)
    snap = daemon.snapshot(src)
    ex = daemon.exec_path(daemon.create(snap))
    ext4 = tmp_path / "ext4"
    ext4.mkdir()

    # New files: the blocks ext4 gives the same writes (the upper data file is one).
    for root in (ex, ext4):
        write_at(root / "new", 1600 * KIB, b"n" * 50 * KIB, "wb")
        with open(root / "grown", "wb") as f:
            f.truncate(8 * MIB)
    assert os.stat(ex / "new").st_size == 1650 * KIB
    assert (blocks(ex / "new"), blocks(ex / "grown")) == \
        (blocks(ext4 / "new"), blocks(ext4 / "grown")) == (52 * KIB // 512, 0)

    # Snapshot files: the pages holding data (the last one up to the size).
    for root in (ex, daemon.snap_path(snap)):
        assert blocks(root / "dense") == (3 * PAGE_SIZE + 100 + 511) // 512
        assert blocks(root / "sparse") == PAGE_SIZE // 512
        assert blocks(root / "empty-hole") == 0
    assert run("du", "-k", "--apparent-size", ex / "sparse").stdout.split()[0] == "1028"
    assert run("du", "-k", ex / "sparse").stdout.split()[0] == "64"

    # Copies-up: the base's data pages still shown, plus what the upper file takes.
    write_at(ex / "sparse", 0, b"w" * 4 * KIB)  # copies up page 0 whole: 64 KiB more
    assert blocks(ex / "sparse") == 2 * PAGE_SIZE // 512
    write_at(ex / "sparse", 512 * KIB, b"x" * PAGE_SIZE)  # replaces the base's data page
    assert blocks(ex / "sparse") == 2 * PAGE_SIZE // 512
    os.truncate(ex / "dense", PAGE_SIZE + 10)  # the base shows its first page and 10 bytes
    assert blocks(ex / "dense") == (PAGE_SIZE + 10 + 511) // 512

    # The same after a restart, before any upper data file is opened again.
    daemon.restart()
    assert [blocks(ex / n) for n in ("new", "grown", "sparse", "dense")] == [
        52 * KIB // 512, 0, 2 * PAGE_SIZE // 512, (PAGE_SIZE + 10 + 511) // 512]
