"""The daemon's memory allocator (rametfs.allocator, issue 15.5): jemalloc where it is
installed, in a detached daemon and in one serving in the foreground, and a reset's memory
given back to the system once the dropped layer is collected."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import Daemon, require_fuse, wait_until
from rametfs import allocator
from rametfs.cli import main
from rametfs.errors import exit_code

needs_jemalloc = pytest.mark.skipif(
    allocator.library() is None, reason="libjemalloc2 is not installed (tools/setup installs it)")

BURST_FILES = 20_000
KEPT_SHARE = 0.3  # of the first burst's heap, the most two collected resets may keep
CREATE = """\
import os, sys
d = sys.argv[1]
os.makedirs(d, exist_ok=True)
for i in range(int(sys.argv[2])):
    with open(os.path.join(d, f"f{i}"), "wb") as f:
        f.write(b"x" * 100)
"""


@pytest.fixture
def source(tmp_path) -> Path:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(b"alpha\n")
    return tmp_path / "src"


def loaded(pid: int, library: str) -> bool:
    """Whether process ``pid`` has a shared library whose file name starts ``library``."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return any(Path(line.split()[-1]).name.startswith(library)
               for line in maps.splitlines() if "/" in line)


@needs_jemalloc
@pytest.mark.kernel
def test_a_collected_reset_gives_the_burst_of_heap_back(daemon, source):
    # Under pymalloc the few objects that outlived a burst of requests kept its arenas: after
    # two cycles of 20,000 files created and reset, the heap held 81% of the first burst's.
    eid = daemon.create(daemon.snapshot(source))
    path = daemon.exec_path(eid)
    memory = daemon.status()["memory"]
    assert memory["allocator"] == "jemalloc"
    assert loaded(daemon.pid, "libjemalloc")
    start = memory["heap_bytes"]
    for cycle in range(2):
        subprocess.run([sys.executable, "-c", CREATE, str(path / "many"), str(BURST_FILES)],
                       check=True)
        if cycle == 0:
            burst = daemon.status()["memory"]["heap_bytes"] - start
        daemon.exec_ctl(eid, "reset")
        wait_until(lambda: daemon.status()["memory"]["stale_nodes"] == 0, 60,
                   "the dropped nodes freed")
        time.sleep(0.1)
    assert burst > BURST_FILES * 500  # what the nodes took, about 1 KiB a file

    def kept() -> int:
        return daemon.status()["memory"]["heap_bytes"] - start
    wait_until(lambda: kept() < KEPT_SHARE * burst, 30,
               f"the heap back within {KEPT_SHARE:.0%} of a {burst} B burst (now {kept()} B)")


@needs_jemalloc
@pytest.mark.kernel
def test_pymalloc_by_choice_and_jemalloc_in_the_foreground(tmp_path):
    """``--allocator pymalloc`` keeps Python's own; a daemon serving in the foreground starts
    its interpreter again, same pid, with jemalloc, and ends with the unmount."""
    require_fuse()
    d = Daemon(tmp_path / "data", tmp_path / "mnt", serve_args=("--allocator", "pymalloc"))
    d.start()
    try:
        assert d.status()["memory"]["allocator"] == "pymalloc"
        assert not loaded(d.pid, "libjemalloc")
    finally:
        d.stop()
    log, out = tmp_path / "foreground.log", tmp_path / "foreground.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "rametfs", "mount", "--data",
                                 str(tmp_path / "data"), str(d.mnt), "--log", str(log)],
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: os.path.ismount(d.mnt) or proc.poll() is not None, 30,
                   "the foreground daemon mounted")
        assert proc.poll() is None, out.read_text()
        status = d.status()
        assert (status["pid"], status["memory"]["allocator"]) == (proc.pid, "jemalloc")
        assert loaded(proc.pid, "libjemalloc")
    finally:
        subprocess.run([sys.executable, "-m", "rametfs", "umount", str(d.mnt)], check=False)
        try:
            assert proc.wait(timeout=30) == 0, out.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if os.path.ismount(d.mnt):
                subprocess.run(["fusermount3", "-u", "-z", str(d.mnt)], check=False)
    assert "mode) on jemalloc;" in log.read_text()


def test_jemalloc_asked_for_and_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(allocator, "library", lambda: None)
    result = CliRunner().invoke(main, ["mount", "--data", str(tmp_path / "data"),
                                       str(tmp_path / "mnt"), "--background",
                                       "--allocator", "jemalloc"])
    assert result.exit_code == exit_code(errno.ENOENT), result.output
    assert result.output == ("rametfs: --allocator jemalloc: libjemalloc.so.2 is not installed "
                             "(Debian: apt-get install libjemalloc2)\n")
    assert not os.path.ismount(tmp_path / "mnt")


@needs_jemalloc
def test_the_daemon_environment_is_taken_back_out(monkeypatch):
    """What :func:`allocator.daemon_environment` adds, :func:`allocator.settle` removes, and
    the caller's own preload stays."""
    env = allocator.daemon_environment({"LD_PRELOAD": "libmine.so", "HOME": "/root"}, "auto")
    assert env == {"LD_PRELOAD": f"{allocator.library()} libmine.so", "HOME": "/root",
                   "PYTHONMALLOC": "malloc", allocator.MARK_ENV: "jemalloc"}
    for name in ("LD_PRELOAD", "PYTHONMALLOC", allocator.MARK_ENV):
        monkeypatch.setenv(name, env[name])
    assert allocator.settle() == "pymalloc"  # this interpreter started without it
    assert {name: os.environ.get(name) for name in ("LD_PRELOAD", "PYTHONMALLOC",
                                                    allocator.MARK_ENV)} == {
        "LD_PRELOAD": "libmine.so", "PYTHONMALLOC": None, allocator.MARK_ENV: None}
    assert allocator.daemon_environment({}, "pymalloc") == {allocator.MARK_ENV: "pymalloc"}
