"""A write flood in one execution beside writes in another (issue 15.3): both complete with
exactly the bytes written, in the order written, and what each fsync'd survives a crash of
the daemon.  No time is judged here (docs/benchmarks.md, "Isolation", has the figures)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

from test_snapshots import write_tree

MIB = 1 << 20

# Writes ``blocks`` blocks of ``size`` bytes, block i at offset (i % wrap) * size (the later
# write of an offset is the one that stays), fsyncs, prints the sha256 of what the file must
# then hold.  Each block's bytes come from the seed and its number.
WRITER = r"""
import hashlib, os, sys
path, blocks, size, wrap, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5]
final = {}
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
for i in range(blocks):
    block = hashlib.sha256(f"{seed} {i}".encode()).digest() * (size // 32)
    assert os.pwrite(fd, block, (i % wrap) * size) == size
    final[i % wrap] = block
os.fsync(fd)
os.close(fd)
print(hashlib.sha256(b"".join(final[k] for k in sorted(final))).hexdigest())
"""


def _writer(path, blocks: int, size: int, wrap: int, seed: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(blocks), str(size),
                             str(wrap), seed], stdout=subprocess.PIPE, text=True)


def _sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def test_a_flood_and_a_bystander_both_write_every_byte_and_fsyncd_data_survives_a_crash(
        daemon, tmp_path):
    """Execution A: 6 writers of 1 MiB blocks, 48 blocks each going round 16 MiB (the flood
    of the benchmark, smaller); execution B meanwhile: 2 writers of 4 KiB blocks (the
    bystander's size), 600 each going round 256 blocks.  Every file then reads back as its
    writer's sha256 says, and again after the daemon is killed and started: each writer
    fsync'd its file."""
    snap = daemon.snapshot(write_tree(tmp_path / "src", {"base.txt": b"base\n"}))
    flood, bystander = daemon.create(snap), daemon.create(snap)
    a, b = daemon.exec_path(flood), daemon.exec_path(bystander)
    writers = {a / f"flood-{i}": _writer(a / f"flood-{i}", 48, MIB, 16, f"a{i}")
               for i in range(6)}
    writers |= {b / f"small-{i}": _writer(b / f"small-{i}", 600, 4096, 256, f"b{i}")
                for i in range(2)}
    expected = {}
    for path, proc in writers.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
        expected[path] = out.strip()
    assert {p: p.stat().st_size for p in expected} == {
        p: 16 * MIB if p.name.startswith("flood") else 256 * 4096 for p in expected}
    assert {p: _sha256(p) for p in expected} == expected

    daemon.kill()
    daemon.start()
    assert {p: _sha256(p) for p in expected} == expected
    assert (b / "base.txt").read_bytes() == b"base\n"
