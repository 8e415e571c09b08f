"""The daemon's allocator: glibc's malloc (``PYTHONMALLOC=malloc``), whose free pages the
daemon hands back after dropping the nodes of a reset or release (rametfs.daemon
TRIM_NODES; the figures are the rss-cycles benchmark's, docs/benchmarks.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import require_fuse, wait_until


def environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode() for k, v in pairs}


def test_a_background_daemon_runs_on_glibc_malloc(daemon):
    assert environment(daemon.pid)["PYTHONMALLOC"] == "malloc"


@pytest.mark.parametrize("given", [None, "pymalloc"])
def test_a_foreground_daemon_starts_again_on_glibc_malloc_unless_told(tmp_path, given):
    """``rametfs mount`` (or serve) in the foreground sets it and runs itself again (the same process,
    so a supervisor's pid stays right); an allocator the caller chose is kept."""
    require_fuse()
    mnt, data = tmp_path / "mnt", tmp_path / "data"
    mnt.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"}
    if given:
        env["PYTHONMALLOC"] = given
    proc = subprocess.Popen([sys.executable, "-m", "rametfs", "serve", "--data", str(data),
                             str(mnt), "--log", str(tmp_path / "serve.log")], env=env)
    try:
        wait_until(lambda: os.path.exists(mnt / ".ramet" / "status") or proc.poll() is not None,
                   30, "the mount")
        assert proc.poll() is None
        assert environment(proc.pid)["PYTHONMALLOC"] == (given or "malloc")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
            proc.kill()
            proc.wait()
