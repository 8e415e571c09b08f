"""What outlives the daemon: snapshots, executions with their changes, promoted snapshots."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Daemon, ctl_command, wait_until
from test_snapshots import tree_signature, write_tree


@pytest.fixture
def source(tmp_path) -> Path:
    src = write_tree(tmp_path / "src", {
        "keep.txt": b"keep\n",
        "gone.txt": b"to delete\n",
        "old-name.txt": b"renamed\n",
        "cut.bin": os.urandom(150_000),
        "dir/child.txt": b"child\n",
        "dir/sub/deep.txt": b"deep\n",
        "linked": b"linked\n",
    })
    os.link(src / "linked", src / "dir" / "linked-too")
    os.symlink("keep.txt", src / "link")
    os.setxattr(src / "keep.txt", "user.a", b"1")
    return src


def change(root: Path) -> None:
    """New files, deletions, renames, a truncation, hard links, attributes."""
    (root / "new.txt").write_bytes(b"brand new\n")
    os.mkdir(root / "newdir")
    (root / "newdir" / "inner").write_bytes(b"inner\n")
    os.mkdir(root / "empty-dir")
    os.unlink(root / "gone.txt")
    os.rename(root / "old-name.txt", root / "dir" / "new-name.txt")
    os.rename(root / "dir" / "sub", root / "moved-sub")
    os.truncate(root / "cut.bin", 70_000)
    os.link(root / "new.txt", root / "newdir" / "new-link")
    os.link(root / "keep.txt", root / "keep-link")
    with open(root / "dir" / "linked-too", "ab") as f:
        f.write(b"through the second name\n")
    os.symlink("dir/child.txt", root / "child-link")
    os.chmod(root / "dir" / "child.txt", 0o600)
    os.setxattr(root / "new.txt", "user.b", b"2")
    with open(root / "cut.bin", "r+b") as f:
        f.seek(100_000)
        f.write(b"past the cut")


def test_everything_survives_a_restart(daemon, source):
    snap = daemon.snapshot(source)
    eid = daemon.create(snap)
    ex = daemon.exec_path(eid)
    change(ex)
    promoted_from = daemon.create(snap)
    change(daemon.exec_path(promoted_from))
    promoted = daemon.exec_ctl(promoted_from, "promote --label kept")["snapshot"]
    untouched = daemon.create(snap)

    before = {
        "snap": tree_signature(daemon.snap_path(snap)),
        "ex": tree_signature(ex),
        "promoted": tree_signature(daemon.snap_path(promoted)),
        "diff": (ex / ".ramet" / "diff").read_text(),
        "inos": [os.stat(ex / p).st_ino for p in ("new.txt", "newdir/new-link", "keep.txt",
                                                    "keep-link", "dir/new-name.txt")],
    }
    status = daemon.status()
    daemon.restart()

    after = daemon.status()
    assert after["snapshots"] == status["snapshots"]
    assert sorted((e["id"], e["base"], e["head"]) for e in after["executions"]) == sorted(
        (e["id"], e["base"], e["head"]) for e in status["executions"])
    assert sorted(os.listdir(daemon.mnt / "executions")) == sorted(
        [eid, promoted_from, untouched])
    assert tree_signature(daemon.snap_path(snap)) == before["snap"]
    assert tree_signature(ex) == before["ex"]
    assert tree_signature(daemon.snap_path(promoted)) == before["promoted"]
    assert tree_signature(daemon.exec_path(untouched)) == tree_signature(source)
    assert (ex / ".ramet" / "diff").read_text() == before["diff"]
    # Copied-up inodes keep their numbers across a restart.
    assert [os.stat(ex / p).st_ino for p in ("new.txt", "newdir/new-link", "keep.txt",
                                              "keep-link", "dir/new-name.txt")] == before["inos"]
    assert before["snap"] == tree_signature(source)


def test_exact_state_of_an_execution_after_restart(daemon, source):
    eid = daemon.create(daemon.snapshot(source))
    ex = daemon.exec_path(eid)
    cut = (source / "cut.bin").read_bytes()
    change(ex)
    daemon.restart()

    assert sorted(os.listdir(ex)) == ["child-link", "cut.bin", "dir", "empty-dir", "keep-link",
                                      "keep.txt", "link", "linked", "moved-sub", "new.txt",
                                      "newdir"]
    assert not os.path.lexists(ex / "gone.txt")
    assert not os.path.lexists(ex / "old-name.txt")
    assert (ex / "dir" / "new-name.txt").read_bytes() == b"renamed\n"
    assert (ex / "moved-sub" / "deep.txt").read_bytes() == b"deep\n"
    assert sorted(os.listdir(ex / "dir")) == ["child.txt", "linked-too", "new-name.txt"]
    assert os.listdir(ex / "empty-dir") == []
    assert (ex / "cut.bin").read_bytes() == (cut[:70_000] + bytes(30_000) + b"past the cut")
    assert (ex / "linked").read_bytes() == b"linked\nthrough the second name\n"
    for one, two in [("new.txt", "newdir/new-link"), ("keep.txt", "keep-link"),
                     ("linked", "dir/linked-too")]:
        a, b = os.stat(ex / one), os.stat(ex / two)
        assert (a.st_ino, a.st_nlink) == (b.st_ino, 2), (one, two)
    assert os.readlink(ex / "child-link") == "dir/child.txt"
    assert stat.S_IMODE(os.stat(ex / "dir" / "child.txt").st_mode) == 0o600
    assert os.getxattr(ex / "new.txt", "user.b") == b"2"
    assert os.getxattr(ex / "keep-link", "user.a") == b"1"

    # The execution carries on: it takes writes and promotes after the restart.
    (ex / "after").write_bytes(b"after restart")
    promoted = daemon.exec_ctl(eid, "promote")["snapshot"]
    assert (daemon.snap_path(promoted) / "after").read_bytes() == b"after restart"
    assert (daemon.snap_path(promoted) / "cut.bin").read_bytes() == (ex / "cut.bin").read_bytes()


def test_promoted_snapshot_is_byte_identical_after_restart(daemon, source, tmp_path):
    eid = daemon.create(daemon.snapshot(source))
    ex = daemon.exec_path(eid)
    change(ex)
    (ex / "big.bin").write_bytes(os.urandom(300_000))
    promoted = daemon.exec_ctl(eid, "promote")["snapshot"]
    copy = tmp_path / "copy"
    copy.mkdir()
    for rel, sig in tree_signature(daemon.snap_path(promoted)).items():
        if sig.startswith("file "):
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            (copy / rel).write_bytes((daemon.snap_path(promoted) / rel).read_bytes())
    daemon.restart()

    for rel, sig in tree_signature(daemon.snap_path(promoted)).items():
        if sig.startswith("file "):
            assert (daemon.snap_path(promoted) / rel).read_bytes() == (copy / rel).read_bytes()


def test_reset_and_release_survive_a_restart(daemon, source):
    snap = daemon.snapshot(source)
    kept, dropped = daemon.create(snap), daemon.create(snap)
    change(daemon.exec_path(kept))
    daemon.exec_ctl(kept, "reset")
    change(daemon.exec_path(dropped))
    daemon.ctl(f"release {dropped}")
    daemon.restart()

    assert [e["id"] for e in daemon.status()["executions"]] == [kept]
    assert tree_signature(daemon.exec_path(kept)) == tree_signature(source)
    assert (daemon.exec_path(kept) / ".ramet" / "diff").read_text() == ""
    assert not os.path.lexists(daemon.exec_path(dropped))


@pytest.mark.kernel
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_foreground_serve_stops_cleanly_on_a_signal(tmp_path, source, sig):
    """`rametfs serve` in the foreground: a signal unmounts cleanly and exits 0, and what the
    execution held (not fsync'd) is there after the next start."""
    mnt, data = tmp_path / "mnt", tmp_path / "data"
    mnt.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "rametfs", "serve", "--data", str(data),
                             str(mnt), "--log", str(tmp_path / "serve.log")])
    try:
        wait_until(lambda: os.path.exists(mnt / ".ramet" / "status") or proc.poll() is not None,
                   30, "the mount")
        snap = ctl_command(mnt / ".ramet" / "ctl", f"snapshot {source}")["snapshot"]
        eid = ctl_command(mnt / ".ramet" / "ctl", f"create {snap} --name e")["execution"]
        (mnt / "executions" / eid / "new.txt").write_bytes(b"kept\n")
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        assert not os.path.ismount(mnt)
    finally:
        if proc.poll() is None:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
            proc.kill()
            proc.wait()
    again = Daemon(data, mnt)
    again.start()
    try:
        assert (again.exec_path(eid) / "new.txt").read_bytes() == b"kept\n"
        assert tree_signature(again.snap_path(snap)) == tree_signature(source)
    finally:
        again.stop()
