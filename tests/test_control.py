"""The control files through the kernel mount: hidden ``.ramet``, commands, replies, promote,
diff, reset, release, and a promote that stays consistent while a writer keeps writing."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from pathlib import Path

import pytest

from conftest import ctl_command, read_reply, run, wait_until
from rametfs import protocol
from test_snapshots import SNAPSHOT_ID, tree_signature, write_tree



@pytest.fixture
def source(tmp_path) -> Path:
    src = write_tree(tmp_path / "src", {
        "a.txt": b"alpha\n",
        "c.txt": b"gamma\n",
        "dir/b.txt": b"beta\n",
        "dir/keep.txt": b"keep\n",
        "old/x": b"x\n",
        "big.bin": os.urandom(200_000),
    })
    os.symlink("a.txt", src / "link")
    return src


@pytest.fixture
def snap(shared_daemon, source) -> str:
    return shared_daemon.snapshot(source)


@pytest.fixture
def new_execution(shared_daemon):
    """``new_execution(snapshot) -> (id, path)``; releases what is left at teardown."""
    made = []

    def new(snapshot: str) -> tuple[str, Path]:
        eid = shared_daemon.create(snapshot)
        made.append(eid)
        return eid, shared_daemon.exec_path(eid)

    yield new
    live = {e["id"] for e in shared_daemon.status()["executions"]}
    for eid in made:
        if eid in live:
            shared_daemon.ctl(f"release {eid}")


@pytest.fixture
def ex(new_execution, snap) -> tuple[str, Path]:
    return new_execution(snap)


def control(path: Path, name: str) -> Path:
    return path / protocol.CONTROL_DIR / name


def make_known_changes(root: Path) -> None:
    """Changes whose diff is :data:`KNOWN_DIFF`."""
    with open(root / "a.txt", "ab") as f:
        f.write(b"more\n")
    (root / "new.txt").write_bytes(b"new\n")
    os.unlink(root / "dir" / "b.txt")
    os.chmod(root / "c.txt", 0o600)
    os.mkdir(root / "newdir")
    (root / "newdir" / "f").write_bytes(b"f\n")
    os.rename(root / "old", root / "renamed")
    os.truncate(root / "big.bin", 10)


KNOWN_DIFF = ["M a.txt", "M big.bin", "M c.txt", "D dir/b.txt", "A new.txt",
              "A newdir/", "A newdir/f", "D old/", "D old/x", "A renamed/", "A renamed/x"]


# ----- .ramet is found, never listed ---------------------------------------------------------

def test_ramet_is_not_listed_but_found_by_lookup(shared_daemon, ex, source):
    eid, path = ex
    mnt = shared_daemon.mnt

    assert sorted(os.listdir(mnt)) == ["executions", "snapshots"]
    assert sorted(os.listdir(path)) == sorted(os.listdir(source))
    assert stat.S_ISDIR(os.stat(mnt / ".ramet").st_mode)
    assert stat.S_ISDIR(os.stat(path / ".ramet").st_mode)
    assert sorted(os.listdir(mnt / ".ramet")) == sorted(protocol.ROOT_CONTROL_FILES)
    assert sorted(os.listdir(path / ".ramet")) == sorted(protocol.EXECUTION_CONTROL_FILES)
    assert stat.S_IMODE(os.stat(control(mnt, "ctl")).st_mode) == 0o600
    found = run("find", path).stdout.splitlines()
    assert sorted(found) == sorted([str(path)] + [str(path / p) for p in tree_signature(source)
                                                  if p != "."])
    assert not os.path.lexists(path / "dir" / ".ramet")  # only at an execution's root


# ----- commands and replies ------------------------------------------------------------------

def test_echo_promote_then_cat_status_from_bash(shared_daemon, ex, snap):
    eid, path = ex
    (path / "new.txt").write_bytes(b"n\n")
    proc = run("bash", "-c", "echo promote > .ramet/ctl && cat .ramet/status", cwd=path)

    status = json.loads(proc.stdout)
    promoted = status["last"]["snapshot"]
    assert SNAPSHOT_ID.fullmatch(promoted)
    assert (status["execution"], status["base"], status["head"], status["last"]["ok"]) == (
        eid, snap, promoted, True)
    record, = [s for s in shared_daemon.status()["snapshots"] if s["id"] == promoted]
    assert record["parents"] == [snap]


def test_reply_is_read_back_from_the_same_fd(shared_daemon, ex, snap):
    eid, path = ex
    fd = os.open(control(path, "ctl"), os.O_RDWR)
    try:
        assert os.write(fd, b"promote --label 'with space'\n") == 29
        reply = read_reply(fd)
    finally:
        os.close(fd)

    assert reply["ok"] is True
    assert SNAPSHOT_ID.fullmatch(reply["snapshot"])
    record, = [s for s in shared_daemon.status()["snapshots"] if s["id"] == reply["snapshot"]]
    assert (record["label"], record["parents"]) == ("with space", [snap])
    assert shared_daemon.exec_status(eid)["last"] == reply


def test_the_promote_file(shared_daemon, ex):
    eid, path = ex
    assert control(path, "promote").read_text() == ""
    (path / "f").write_bytes(b"f")

    run("bash", "-c", "echo anything > .ramet/promote", cwd=path)
    first = control(path, "promote").read_text()
    assert SNAPSHOT_ID.fullmatch(first.rstrip("\n")) and first.endswith("\n")
    assert shared_daemon.exec_status(eid)["head"] == first.strip()
    assert (shared_daemon.snap_path(first.strip()) / "f").read_bytes() == b"f"

    (path / "g").write_bytes(b"g")
    with open(control(path, "promote"), "w") as f:
        f.write("x")
    second = control(path, "promote").read_text().strip()
    assert second != first.strip()
    record, = [s for s in shared_daemon.status()["snapshots"] if s["id"] == second]
    assert record["parents"] == [first.strip()]


def test_diff_lists_exact_changes_and_is_empty_after_reset(shared_daemon, ex):
    eid, path = ex
    assert control(path, "diff").read_text() == ""
    make_known_changes(path)

    assert control(path, "diff").read_text().splitlines() == KNOWN_DIFF
    shared_daemon.exec_ctl(eid, "reset")
    assert control(path, "diff").read_text() == ""


def test_diff_of_hard_links_from_the_base_is_empty_until_one_changes(shared_daemon, tmp_path):
    src = tmp_path / "linked"
    src.mkdir()
    (src / "f").write_bytes(b"shared\n")
    os.link(src / "f", src / "g")
    path = shared_daemon.exec_path(shared_daemon.create(shared_daemon.snapshot(src)))
    (path / "g").read_bytes()  # looked up under both names
    assert control(path, "diff").read_text() == ""
    with open(path / "g", "ab") as f:
        f.write(b"more\n")
    assert control(path, "diff").read_text().splitlines() == ["M f", "M g"]


def test_reset_returns_every_file_to_its_base(shared_daemon, ex, snap, source):
    eid, path = ex
    make_known_changes(path)
    os.setxattr(path / "dir" / "keep.txt", "user.k", b"v")
    os.symlink("nowhere", path / "dir" / "sym")
    os.link(path / "c.txt", path / "c-link")

    reply = shared_daemon.exec_ctl(eid, "reset")
    assert (reply["ok"], reply["snapshot"]) == (True, snap)
    assert tree_signature(path) == tree_signature(source)
    status = shared_daemon.exec_status(eid)
    assert (status["base"], status["head"], status["upper_bytes"]) == (snap, snap, 0)
    (path / "after-reset").write_bytes(b"still writable")
    assert (path / "after-reset").read_bytes() == b"still writable"


def test_reset_after_promote_returns_to_the_promoted_snapshot(shared_daemon, ex, snap,
                                                              source):
    """git's commit then ``reset --hard``: the promote is the head; ``--base yes`` goes back
    to the snapshot the execution was created from (before the change: the base)."""
    eid, path = ex
    make_known_changes(path)
    promoted = shared_daemon.exec_ctl(eid, "promote")["snapshot"]
    promoted_tree = tree_signature(path)
    assert control(path, "diff").read_text() == ""
    (path / "later").write_bytes(b"later")
    assert control(path, "diff").read_text() == "A later\n"

    assert shared_daemon.exec_ctl(eid, "reset")["snapshot"] == promoted
    assert tree_signature(path) == promoted_tree
    assert control(path, "diff").read_text() == ""
    assert shared_daemon.exec_ctl(eid, "reset --base yes")["snapshot"] == snap
    assert tree_signature(path) == tree_signature(source)
    status = shared_daemon.exec_status(eid)
    assert (status["base"], status["head"]) == (snap, snap)


def test_commands_act_on_their_own_execution_only(shared_daemon, new_execution, snap, source):
    one_id, one = new_execution(snap)
    two_id, two = new_execution(snap)
    (one / "mine").write_bytes(b"1")
    (two / "yours").write_bytes(b"2")

    shared_daemon.exec_ctl(one_id, "reset")
    promoted = shared_daemon.exec_ctl(two_id, "promote")["snapshot"]
    assert not os.path.lexists(one / "mine")
    assert (two / "yours").read_bytes() == b"2"
    assert shared_daemon.exec_status(one_id)["head"] == snap
    assert shared_daemon.exec_status(two_id)["head"] == promoted


@pytest.mark.parametrize("line", ["bogus", "promote extra", "reset --label x", "'unbalanced",
                                  "promote --label", "snapshot /tmp"])
def test_malformed_execution_command_is_einval_and_changes_nothing(shared_daemon, ex, line):
    eid, path = ex
    (path / "work").write_bytes(b"in progress")
    before = (tree_signature(path), shared_daemon.exec_status(eid)["head"],
              [s["id"] for s in shared_daemon.status()["snapshots"]])

    with pytest.raises(OSError) as caught:
        shared_daemon.exec_ctl(eid, line)
    assert caught.value.errno == errno.EINVAL
    assert (caught.value.reply["ok"], caught.value.reply["errno"]) == (False, errno.EINVAL)
    message = control(path, "error").read_text()
    assert message.startswith(f"{line}: ") and message.endswith("\n")
    assert caught.value.reply["error"] in message
    assert (tree_signature(path), shared_daemon.exec_status(eid)["head"],
            [s["id"] for s in shared_daemon.status()["snapshots"]]) == before
    assert shared_daemon.exec_status(eid)["last"] == caught.value.reply


def test_malformed_command_from_bash_fails_and_leaves_a_message(ex):
    eid, path = ex
    proc = run("bash", "-c", "echo frobnicate > .ramet/ctl", cwd=path, check=False)

    assert proc.returncode == 1
    assert "Invalid argument" in proc.stderr
    assert control(path, "error").read_text() == (
        "frobnicate: unknown command 'frobnicate'; expected one of checkpoint, preview, promote, "
        "reset, verify\n")


def test_create_of_an_unknown_snapshot_is_enoent(shared_daemon):
    before = shared_daemon.status()["executions"]
    with pytest.raises(OSError) as caught:
        shared_daemon.ctl("create " + "0" * 64)

    assert caught.value.errno == errno.ENOENT
    assert caught.value.reply["errno"] == errno.ENOENT
    assert "0" * 64 in control(shared_daemon.mnt, "error").read_text()
    assert shared_daemon.status()["executions"] == before


def test_release_of_an_unknown_execution_is_enoent(shared_daemon):
    with pytest.raises(OSError) as caught:
        shared_daemon.ctl("release no-such-execution")

    assert caught.value.errno == errno.ENOENT
    assert "no-such-execution" in control(shared_daemon.mnt, "error").read_text()


def test_release_removes_the_execution(shared_daemon, snap):
    eid = shared_daemon.create(snap)
    path = shared_daemon.exec_path(eid)
    (path / "f").write_bytes(b"f")

    assert shared_daemon.ctl(f"release {eid}") == {"ok": True, "execution": eid}
    assert not os.path.lexists(path)
    assert eid not in os.listdir(shared_daemon.mnt / "executions")
    assert eid not in [e["id"] for e in shared_daemon.status()["executions"]]
    with pytest.raises(OSError) as caught:
        shared_daemon.ctl(f"release {eid}")
    assert caught.value.errno == errno.ENOENT


def test_the_control_directory_of_a_released_execution_goes_with_it(shared_daemon, snap):
    """A released execution's ``.ramet/`` is forgotten with it (the daemon used to keep one
    per execution ever used): a handle on it is stale, as one on any of its directories."""
    eid = shared_daemon.create(snap)
    fd = os.open(shared_daemon.exec_path(eid) / ".ramet", os.O_RDONLY | os.O_DIRECTORY)
    try:
        shared_daemon.ctl(f"release {eid}")
        with pytest.raises(OSError) as caught:  # listed there and then: nothing cached
            os.listdir(fd)
        assert caught.value.errno == errno.ESTALE
    finally:
        os.close(fd)


def test_a_name_released_then_created_again_is_a_fresh_execution(shared_daemon, snap, source):
    name = f"again-{snap[:12]}"
    shared_daemon.ctl(f"create {snap} --name {name}")
    path = shared_daemon.exec_path(name)
    (path / "first-life").write_bytes(b"1")
    fd = os.open(path / "dir", os.O_RDONLY | os.O_DIRECTORY)
    try:
        shared_daemon.ctl(f"release {name}")
        shared_daemon.ctl(f"create {snap} --name {name}")
        assert not os.path.lexists(path / "first-life")
        assert tree_signature(path) == tree_signature(source)
        with pytest.raises(OSError) as caught:  # a handle on the released view is stale
            os.listdir(fd)
        assert caught.value.errno == errno.ESTALE
    finally:
        os.close(fd)
        shared_daemon.ctl(f"release {name}")


# ----- promote -------------------------------------------------------------------------------

def test_promoted_snapshot_holds_exactly_the_execution(shared_daemon, ex, new_execution,
                                                       tmp_path):
    eid, path = ex
    make_known_changes(path)
    os.setxattr(path / "new.txt", "user.tag", b"t")
    os.link(path / "new.txt", path / "dir" / "new-link")
    with open(path / "big.bin", "r+b") as f:
        f.seek(150_000)
        f.write(os.urandom(70_000))
    run("cp", "-a", path, tmp_path / "copy")
    expected = tree_signature(path)

    promoted = shared_daemon.exec_ctl(eid, "promote")["snapshot"]
    _, fresh = new_execution(promoted)
    run("diff", "-r", "--no-dereference", tmp_path / "copy", fresh)
    run("diff", "-r", "--no-dereference", tmp_path / "copy", shared_daemon.snap_path(promoted))
    assert tree_signature(path) == expected
    assert tree_signature(fresh) == expected
    assert tree_signature(shared_daemon.snap_path(promoted)) == expected


# A promote is consistent at a FUSE request boundary.  The kernel may split one write(2) that
# crosses a page boundary into several requests (docs/concurrency.md), so the records here
# never cross one: 512 bytes (8 to a page) and 4096 bytes (a whole page each).
@pytest.mark.parametrize("size", [512, 4096])
def test_promote_is_consistent_while_a_writer_appends(shared_daemon, ex, size):
    """The promoted file is always a whole number of the writer's records, in order."""
    eid, path = ex
    stop = threading.Event()
    written = []
    errors = []

    def writer() -> None:
        try:
            fd = os.open(path / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                while not stop.is_set():
                    n = len(written)
                    assert os.write(fd, log_record(n, size)) == size
                    written.append(n)
            finally:
                os.close(fd)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    snapshots = []
    try:
        for _ in range(5):
            count = len(written)
            wait_until(lambda: len(written) >= count + 20 or errors, 30, "20 more records")
            snapshots.append(shared_daemon.exec_ctl(eid, "promote")["snapshot"])
    finally:
        stop.set()
        thread.join()
    assert errors == []

    sizes = []
    for sid in snapshots:
        data = (shared_daemon.snap_path(sid) / "log").read_bytes()
        length = len(data)
        assert length % size == 0, f"{length} bytes: a torn record"
        assert data == b"".join(log_record(n, size) for n in range(length // size))
        sizes.append(length)
    assert sizes == sorted(sizes) and sizes[0] > 0
    assert (path / "log").read_bytes() == b"".join(log_record(n, size) for n in written)


def log_record(n: int, size: int) -> bytes:
    """Record ``n`` of the appending writer: exactly ``size`` bytes."""
    return f"{n:0{size - 1}d}\n".encode()


def test_ctl_with_options_and_quotes(shared_daemon, ex):
    eid, path = ex
    reply = ctl_command(control(path, "ctl"),
                        "checkpoint --label \"it's\" --message 'two\nlines'")
    record, = [s for s in shared_daemon.status()["snapshots"] if s["id"] == reply["snapshot"]]
    assert (record["label"], record["message"]) == ("it's", "two\nlines")
    assert shared_daemon.exec_status(eid)["head"] == shared_daemon.exec_status(eid)["base"]


# ----- what a reset and a release give back ---------------------------------------------------

FILES = 2000


def test_a_reset_or_release_gives_back_every_node_and_kept_listing(daemon, source):
    # A listed directory's names stay kept between readdir calls (fuse.kernel.LISTINGS); those
    # of a dropped layer went only when 64 other listings pushed them out; the table of nodes
    # (a dict) kept its peak's size.
    snap = daemon.snapshot(source)
    first = daemon.create(snap)
    before = daemon.status()["memory"]
    for release in (False, True):
        eid = daemon.create(snap) if release else first
        path = daemon.exec_path(eid)
        (path / "many").mkdir()
        for i in range(FILES):
            (path / "many" / f"f{i}").write_bytes(b"x" * 100)
        assert len(os.listdir(path / "many")) == FILES
        grown = daemon.status()["memory"]
        assert grown["nodes"] >= before["nodes"] + FILES + 1
        assert grown["node_table_bytes"] > before["node_table_bytes"]
        assert grown["listing_entries"] >= before["listing_entries"] + FILES
        daemon.ctl(f"release {eid}") if release else daemon.exec_ctl(eid, "reset")
        wait_until(lambda: daemon.status()["memory"]["stale_nodes"] == 0, 30,
                   "the dropped nodes freed")
        after = daemon.status()["memory"]
        held = ("nodes", "node_table_bytes", "listings", "listing_entries")
        assert {k: after[k] for k in held} == {k: before[k] for k in held}, release
    assert before["heap_bytes"] > 0


def test_files_made_and_removed_for_ever_keep_no_node(daemon, source):
    # Each created, closed and removed file (a tmpfile too) kept its node until the next
    # reset, about 1 KB: an agent doing it in a loop grew the daemon without bound.
    eid = daemon.create(daemon.snapshot(source))
    path = daemon.exec_path(eid)
    (path / "first").write_bytes(b"x")  # the root's copy-up: one upper inode from now on
    (path / "first").unlink()
    wait_until(lambda: daemon.exec_status(eid)["upper_inodes"] == 1, 30, "the first reclaimed")
    before = daemon.status()["memory"]["nodes"]
    for i in range(FILES):
        (path / f"f{i}").write_bytes(b"x")
        (path / f"f{i}").unlink()
        os.close(os.open(path, os.O_TMPFILE | os.O_RDWR, 0o600))
    wait_until(lambda: daemon.status()["memory"]["nodes"] == before, 30,
               "the forgotten unlinked nodes freed")
    assert daemon.exec_status(eid)["upper_inodes"] == 1
