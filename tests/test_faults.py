"""Faults: malformed commands, unknown ids, bad sources, a daemon killed in the middle of a
promote, and a data directory that runs out of space."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Daemon, check_log, lazy_unmount, pid_alive, run, wait_until
from rametfs import protocol
from rametfs.mounts import mount_at, snapshots_bound
from rametfs.store import Store
from rametfs.store.format import from_u64
from test_snapshots import tree_signature, write_tree

MIB = 1 << 20
KILL_PROMOTE_MIB = 200  # fresh random data the killed promote must store
BATCH_BYTES = 32 * MIB  # capture commits chunks in batches of about this size


def control(path: Path, name: str) -> Path:
    return path / protocol.CONTROL_DIR / name


@pytest.fixture
def source(tmp_path) -> Path:
    return write_tree(tmp_path / "src", {"a.txt": b"alpha\n", "d/b.bin": os.urandom(100_000)})


def snapshot_ids(daemon: Daemon) -> list[str]:
    return [s["id"] for s in daemon.status()["snapshots"]]


def assert_fails(fn, err: int) -> OSError:
    with pytest.raises(OSError) as caught:
        fn()
    assert caught.value.errno == err, caught.value
    return caught.value


# ----- malformed commands and unknown ids ----------------------------------------------------

@pytest.mark.parametrize("line", ["", "   ", "frobnicate", "snapshot '/tmp", "snapshot /a /b",
                                  "create", "create a b", "release", "release a b",
                                  "create 00000000 --bogus 1", "snapshot /tmp --label",
                                  "snapshot /tmp --label a --label b", "promote", "reset"])
def test_malformed_root_command_is_einval(shared_daemon, line):
    before = shared_daemon.status()
    exc = assert_fails(lambda: shared_daemon.ctl(line), errno.EINVAL)

    assert (exc.reply["ok"], exc.reply["errno"]) == (False, errno.EINVAL)
    message = control(shared_daemon.mnt, "error").read_text()
    assert message == f"{line.strip()}: {exc.reply['error']}\n"
    after = shared_daemon.status()
    assert (after["snapshots"], after["executions"]) == (before["snapshots"], before["executions"])
    assert after["last"] == exc.reply


@pytest.mark.parametrize("command, err, message", [
    (b"\xff\xfe\n", errno.EINVAL, "a command is UTF-8 text"),
    (b"create " + b"x" * protocol.MAX_COMMAND_BYTES, errno.E2BIG,
     f"a command is at most {protocol.MAX_COMMAND_BYTES} bytes")])
def test_undecodable_or_oversized_command_replaces_the_last_reply(shared_daemon, source, command,
                                                                   err, message):
    with pytest.raises(OSError):
        shared_daemon.ctl("frobnicate")  # an earlier failure whose words must not stay
    for ctl in (control(shared_daemon.mnt, protocol.CTL),
                control(shared_daemon.exec_path(shared_daemon.create(shared_daemon.snapshot(
                    source))), protocol.CTL)):
        fd = os.open(ctl, os.O_RDWR)
        try:
            assert_fails(lambda: os.write(fd, command), err)
            reply = json.loads(os.pread(fd, 1 << 16, 0))
        finally:
            os.close(fd)
        assert reply == {"ok": False, "errno": err, "error": message}
        assert control(ctl.parent.parent, protocol.ERROR).read_text().endswith(
            f": {message}\n")


def test_bad_execution_name_is_einval(shared_daemon, source):
    snap = shared_daemon.snapshot(source)
    for name in ["bad name", "-leading-dash", "a/b", "x" * 65]:
        assert_fails(lambda: shared_daemon.ctl(protocol.format_command("create", snap, name=name)),
                     errno.EINVAL)
    assert not [e for e in shared_daemon.status()["executions"] if e["base"] == snap]


def test_create_with_a_name_in_use_is_eexist(shared_daemon, source):
    snap = shared_daemon.snapshot(source)
    name = f"taken-{snap[:12]}"
    shared_daemon.ctl(f"create {snap} --name {name}")
    try:
        (shared_daemon.exec_path(name) / "mine").write_bytes(b"kept")
        assert_fails(lambda: shared_daemon.ctl(f"create {snap} --name {name}"), errno.EEXIST)
        assert (shared_daemon.exec_path(name) / "mine").read_bytes() == b"kept"
    finally:
        shared_daemon.ctl(f"release {name}")


@pytest.mark.parametrize("ref", ["0" * 64, "00000000", "0000000", "zzzzzzzz", "not-an-id"])
def test_create_of_an_unknown_snapshot_is_enoent(shared_daemon, ref):
    exc = assert_fails(lambda: shared_daemon.ctl(f"create {ref}"), errno.ENOENT)
    assert exc.reply["errno"] == errno.ENOENT
    assert ref in control(shared_daemon.mnt, "error").read_text()


def test_unknown_names_under_the_mount_are_enoent(shared_daemon):
    mnt = shared_daemon.mnt
    for path in [mnt / "snapshots" / ("0" * 64), mnt / "snapshots" / "not-hex",
                 mnt / "executions" / "no-such-execution", mnt / "nothing",
                 mnt / ".ramet" / "promote"]:
        assert_fails(lambda: os.stat(path), errno.ENOENT)
    assert_fails(lambda: shared_daemon.ctl("release no-such-execution"), errno.ENOENT)


def test_commands_on_a_released_execution_are_enoent(shared_daemon, source):
    eid = shared_daemon.create(shared_daemon.snapshot(source))
    ctl = control(shared_daemon.exec_path(eid), "ctl")
    fd = os.open(ctl, os.O_RDWR)
    try:
        shared_daemon.ctl(f"release {eid}")
        assert_fails(lambda: os.write(fd, b"promote\n"), errno.ENOENT)
    finally:
        os.close(fd)
    assert_fails(lambda: shared_daemon.exec_ctl(eid, "promote"), errno.ENOENT)


def test_shell_write_to_a_snapshot_is_erofs(shared_daemon, source):
    snap = shared_daemon.snap_path(shared_daemon.snapshot(source))
    proc = run("bash", "-c", "echo x > a.txt", cwd=snap, check=False)

    assert proc.returncode == 1
    assert "Read-only file system" in proc.stderr
    assert (snap / "a.txt").read_bytes() == b"alpha\n"


# ----- bad sources ---------------------------------------------------------------------------

def test_snapshot_of_a_missing_source_is_enoent(shared_daemon, tmp_path):
    before = snapshot_ids(shared_daemon)
    missing = tmp_path / "missing"
    assert_fails(lambda: shared_daemon.ctl(f"snapshot {missing}"), errno.ENOENT)

    assert str(missing) in control(shared_daemon.mnt, "error").read_text()
    assert snapshot_ids(shared_daemon) == before


@pytest.mark.parametrize("kind", ["dir", "file", "symlink"])
def test_snapshot_of_a_source_holding_ramet_is_einval(shared_daemon, source, kind):
    reserved = source / protocol.CONTROL_DIR
    if kind == "dir":
        reserved.mkdir()
    elif kind == "file":
        reserved.write_bytes(b"")
    else:
        reserved.symlink_to("/nowhere")
    before = snapshot_ids(shared_daemon)
    assert_fails(lambda: shared_daemon.ctl(f"snapshot {source}"), errno.EINVAL)

    assert ".ramet" in control(shared_daemon.mnt, "error").read_text()
    assert snapshot_ids(shared_daemon) == before


@pytest.mark.parametrize("path", ["relative/path", ".", "a.txt"])
def test_snapshot_of_a_relative_source_is_einval(shared_daemon, source, path):
    before = snapshot_ids(shared_daemon)
    assert_fails(lambda: shared_daemon.ctl(f"snapshot {path}"), errno.EINVAL)
    assert "not absolute" in control(shared_daemon.mnt, "error").read_text()
    assert snapshot_ids(shared_daemon) == before


def test_snapshot_of_a_regular_file_is_einval(shared_daemon, source):
    assert_fails(lambda: shared_daemon.ctl(f"snapshot {source / 'a.txt'}"), errno.EINVAL)


def test_cli_reports_errors_with_exit_codes(shared_daemon, tmp_path):
    proc = run(sys.executable, "-m", "rametfs", "snapshot", "-m", shared_daemon.mnt,
               tmp_path / "missing", check=False)
    assert (proc.returncode, proc.stdout) == (3, "")
    assert proc.stderr.startswith("rametfs: ") and str(tmp_path / "missing") in proc.stderr
    proc = run(sys.executable, "-m", "rametfs", "create", "-m", shared_daemon.mnt, "0" * 64,
               check=False)
    assert (proc.returncode, proc.stdout) == (3, "")


def test_a_second_daemon_on_a_data_dir_in_use_refuses_with_ebusy(daemon, tmp_path):
    (tmp_path / "mnt2").mkdir()
    proc = run(sys.executable, "-m", "rametfs", "serve", "--data", daemon.data_dir,
               tmp_path / "mnt2", "--background", "--log", tmp_path / "second.log", check=False)

    assert proc.returncode == 5  # EBUSY
    assert f"in use by the rametfs daemon pid {daemon.pid}, serving {daemon.mnt}" in proc.stderr
    assert not os.path.ismount(tmp_path / "mnt2")
    assert daemon.status()["pid"] == daemon.pid


def test_serve_onto_a_mountpoint_another_daemon_serves_is_ebusy(daemon, tmp_path):
    proc = run(sys.executable, "-m", "rametfs", "serve", "--data", tmp_path / "data2",
               daemon.mnt, "--background", check=False)

    assert proc.returncode == 5  # EBUSY, not a success read off the other daemon's mount
    assert f"{daemon.mnt} is already a mountpoint" in proc.stderr
    assert daemon.status()["pid"] == daemon.pid


@pytest.mark.skipif(os.geteuid() != 0, reason="the read-only bind needs CAP_SYS_ADMIN")
@pytest.mark.parametrize("where", ["executions", "snapshots"])
def test_umount_of_a_busy_mount_is_ebusy_and_keeps_snapshots_read_only(daemon, source, where):
    snap = daemon.snapshot(source)
    busy = daemon.exec_path(daemon.create(snap)) if where == "executions" \
        else daemon.snap_path(snap)
    holder = subprocess.Popen(["sleep", "60"], cwd=busy)
    try:
        proc = run(sys.executable, "-m", "rametfs", "umount", daemon.mnt, check=False)
        assert proc.returncode == 5, proc.stderr  # EBUSY
        assert "busy" in proc.stderr
        assert snapshots_bound(str(daemon.mnt))
        with pytest.raises(OSError) as caught:
            os.open(daemon.snap_path(snap) / "a.txt", os.O_RDWR)
        assert caught.value.errno == errno.EROFS
        assert daemon.status()["pid"] == daemon.pid
    finally:
        holder.kill()
        holder.wait()
    daemon.stop()
    assert not snapshots_bound(str(daemon.mnt))


def _umount(path) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "rametfs", "umount", path, check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts need CAP_SYS_ADMIN")
def test_umount_leaves_a_mount_that_is_not_rametfs_alone(tmp_path):
    inner = tmp_path / "backup" / "snapshots"
    inner.mkdir(parents=True)
    run("mount", "-t", "tmpfs", "rametfs-test", inner)
    try:
        (inner / "important.txt").write_text("precious\n")
        for target in (tmp_path / "backup", inner):
            proc = _umount(target)
            assert proc.returncode == 7, proc.stderr  # ENOTCONN: no rametfs there
        assert (inner / "important.txt").read_text() == "precious\n"
    finally:
        run("umount", inner)


@pytest.mark.skipif(os.geteuid() != 0, reason="the read-only bind needs CAP_SYS_ADMIN")
def test_umount_refuses_the_snapshots_bind_and_the_status_follows_it(daemon):
    proc = _umount(daemon.mnt / "snapshots")
    assert proc.returncode == 4, proc.stderr  # EINVAL
    assert f"rametfs mount at {daemon.mnt}, and goes with it" in proc.stderr
    assert snapshots_bound(str(daemon.mnt)) and daemon.status()["snapshots_bind"] == "read-only"
    run("umount", daemon.mnt / "snapshots")  # by hand: the status says so
    assert daemon.status()["snapshots_bind"] == "absent"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts need CAP_SYS_ADMIN")
def test_umount_refuses_binds_of_parts_of_the_mount(daemon, source, tmp_path):
    snap = daemon.snapshot(source)
    ex = daemon.exec_path(daemon.create(snap))
    (ex / "sub").mkdir()
    assert _umount(ex).returncode == 7  # not a mountpoint
    other = tmp_path / "other"
    other.mkdir()
    for part in (ex, ex / "sub", daemon.mnt / "executions", daemon.mnt / "snapshots",
                 daemon.snap_path(snap)):
        run("mount", "--bind", part, other)
        try:
            proc = _umount(other)
            root = "/" + str(part.relative_to(daemon.mnt))
            assert proc.returncode == 4, proc.stderr  # EINVAL
            assert f"is a bind of {root} of a rametfs mount" in proc.stderr
            assert os.path.ismount(other)
        finally:
            run("umount", other)
    assert daemon.status()["pid"] == daemon.pid


@pytest.mark.kernel
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts need CAP_SYS_ADMIN")
def test_under_a_shared_parent_every_copy_of_the_bind_is_read_only_and_goes_with_it(
        tmp_path, source):
    """systemd makes / shared, so a mount namespace made earlier (a service, a container
    with rslave) gets a copy of each new mount: the bind's copy must be read-only, and the
    unmount must take the copies along, or they keep the daemon alive."""
    shared, slave = tmp_path / "shared", tmp_path / "slave"
    shared.mkdir()
    slave.mkdir()
    run("mount", "-t", "tmpfs", "rametfs-test", shared)
    run("mount", "--make-shared", shared)
    run("mount", "--rbind", shared, slave)
    run("mount", "--make-rslave", slave)
    d = Daemon(tmp_path / "data", shared / "mnt")
    try:
        d.start()
        snap = d.snapshot(source)
        copy = slave / "mnt" / "snapshots"
        assert "ro" in mount_at(str(copy)).options
        with pytest.raises(OSError) as caught:
            os.open(copy / snap / "a.txt", os.O_RDWR)
        assert caught.value.errno == errno.EROFS
        other = shared / "other"
        other.mkdir()
        run("mount", "--rbind", d.mnt, other)
        proc = _umount(other)  # a copy of the mount root: not the daemon's to end
        assert proc.returncode == 4 and f"umount -R {other}" in proc.stderr, proc.stderr
        run("umount", "-R", other)
        d.stop()  # waits for the daemon to exit: no copy kept the connection
        assert not os.path.exists(copy) and not os.path.ismount(slave / "mnt")
    finally:
        d.stop()
        run("umount", "-R", "-l", slave)
        run("umount", "-R", "-l", shared)


@pytest.mark.kernel
def test_serve_and_umount_through_a_symlink_to_the_mountpoint(tmp_path):
    mnt, link = tmp_path / "mnt", tmp_path / "link"
    mnt.mkdir()
    link.symlink_to(mnt)
    rametfs = (sys.executable, "-m", "rametfs")
    try:
        run(*rametfs, "serve", "--data", tmp_path / "data", link, "--background")
        assert json.loads((mnt / ".ramet" / "status").read_text())["mount"] == str(mnt)
        run(*rametfs, "umount", link)
        assert not os.path.ismount(mnt)
    finally:
        lazy_unmount(mnt)


@pytest.mark.kernel
@pytest.mark.skipif(os.geteuid() != 0, reason="the read-only bind needs CAP_SYS_ADMIN")
def test_umount_of_a_dead_busy_mount_says_busy_and_lazy_clears_it(tmp_path, source):
    d = Daemon(tmp_path / "data", tmp_path / "mnt")
    d.start()
    snap = d.snapshot(source)
    holder = subprocess.Popen(["sleep", "60"], cwd=d.snap_path(snap))
    pid, d.pid = d.pid, None
    try:
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), 10, f"daemon {pid} to die")
        proc = _umount(d.mnt)
        assert proc.returncode == 5 and "--lazy" in proc.stderr, proc.stderr  # EBUSY
        proc = run(sys.executable, "-m", "rametfs", "umount", "--lazy", d.mnt, check=False)
        assert proc.returncode == 0, proc.stderr
        assert not os.path.ismount(d.mnt)
    finally:
        holder.kill()
        holder.wait()
        lazy_unmount(d.mnt)


def test_a_file_removed_while_open_is_gone_after_a_crash_and_restart(daemon, source):
    eid = daemon.create(daemon.snapshot(source))
    path = daemon.exec_path(eid)
    (path / "big.bin").write_bytes(os.urandom(1 << 20))
    with open(path / "keep.bin", "wb") as f:
        f.write(b"k" * 4096)
        f.flush()
        os.fsync(f.fileno())  # a crash keeps what was fsync'd
    with open(path / "big.bin", "rb") as held:
        holder = subprocess.Popen(["sleep", "60"], stdin=held)
    try:
        os.unlink(path / "big.bin")
        daemon.kill()  # before the kernel could forget the inode
    finally:
        holder.kill()
        holder.wait()
    daemon.start()
    assert sorted(p.stat().st_size for p in layer_files(daemon)) == [4096]
    assert (path / "keep.bin").read_bytes() == b"k" * 4096
    assert not (path / "big.bin").exists()


def layer_files(daemon: Daemon) -> list[Path]:
    """The upper data files of every layer (``<data>/upper/<layer>/<ino>``; not the empty
    files of ``upper/precreated/``)."""
    return [p for p in (daemon.data_dir / "upper").glob("*/*")
            if p.parent.name != "precreated" and p.is_file()]


def removed_tree(daemon: Daemon, source: Path, files: int) -> set[int]:
    """An execution with ``files`` files written in ``many/`` then removed by ``rm -rf``;
    returns the removed inode numbers."""
    path = daemon.exec_path(daemon.create(daemon.snapshot(source)))
    (path / "many").mkdir()
    for i in range(files):
        (path / "many" / f"f{i}").write_bytes(b"%d" % i * 50)
    inos = {(path / "many" / f"f{i}").stat().st_ino for i in range(files)}
    run("rm", "-rf", path / "many")
    return inos


def stored_inodes(daemon: Daemon) -> tuple[set[int], int]:
    """With the daemon stopped: the inode numbers of every stored upper record, and how many
    orphan marks there are."""
    store = Store(daemon.data_dir)
    try:
        with store.read() as txn:
            keys = txn.cursor(db=store.db["inodes"]).iternext(values=False)
            return {from_u64(key[8:]) for key in keys}, sum(1 for _ in txn.cursor(db=store.db["orphans"]))
    finally:
        store.close()


def test_rm_rf_deletes_every_upper_file_and_record(daemon, source):
    inos = removed_tree(daemon, source, 300)
    wait_until(lambda: layer_files(daemon) == [], 10, "the removed files' upper data deleted")
    daemon.stop()
    records, orphans = stored_inodes(daemon)
    assert (records & inos, orphans) == (set(), 0)


def test_rm_rf_then_a_crash_leaves_nothing_after_the_restart(daemon, source):
    inos = removed_tree(daemon, source, 300)
    daemon.kill()  # the kernel's forgets and the daemon's batched deletes are still to come
    daemon.start()
    daemon.stop()
    assert layer_files(daemon) == []
    records, orphans = stored_inodes(daemon)
    assert (records & inos, orphans) == (set(), 0)


@pytest.mark.kernel
def test_serve_background_ignores_a_rametfs_package_in_the_working_directory(tmp_path):
    cwd = tmp_path / "cwd"
    write_tree(cwd, {"rametfs/__init__.py": b"", "rametfs/__main__.py":
                     f"open({str(tmp_path / 'MARKER')!r}, 'w').close()\n".encode()})
    rametfs = Path(sys.executable).with_name("rametfs")  # the console script, as users run it
    d = Daemon(tmp_path / "data", tmp_path / "mnt")
    d.mnt.mkdir()
    try:
        run(rametfs, "serve", "--data", d.data_dir, d.mnt, "--background", cwd=cwd)
        d.pid = d.status()["pid"]
        assert not (tmp_path / "MARKER").exists()
    finally:
        d.stop()


# ----- crash in the middle of a promote ------------------------------------------------------

def two_snapshots(daemon: Daemon, source, text: bytes) -> tuple[str, dict]:
    """Snapshot ``source``, promote an execution of it with ``a.txt`` set to ``text``;
    ``(execution id, {snapshot id: tree signature})`` of both snapshots, the first first."""
    first = daemon.snapshot(source)
    eid = daemon.create(first)
    (daemon.exec_path(eid) / "a.txt").write_bytes(text)
    second = daemon.exec_ctl(eid, "promote")["snapshot"]
    return eid, {first: tree_signature(daemon.snap_path(first)),
                 second: tree_signature(daemon.snap_path(second))}


def test_sigkill_during_a_large_promote_keeps_every_snapshot(daemon, source):
    eid, expected = two_snapshots(daemon, source, b"promoted once\n")
    first, second = expected
    ex = daemon.exec_path(eid)
    assert expected[first] == tree_signature(source)
    digest = hashlib.sha256()
    with open(ex / "large.bin", "wb") as f:
        for _ in range(KILL_PROMOTE_MIB):
            block = os.urandom(MIB)
            digest.update(block)
            f.write(block)
    old_list = snapshot_ids(daemon)
    lmdb_file = daemon.data_dir / "meta" / "data.mdb"
    size_before = lmdb_file.stat().st_size

    outcome = []

    def promote() -> None:
        try:
            outcome.append(daemon.exec_ctl(eid, "promote"))
        except OSError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=promote)
    thread.start()
    try:
        # Kill once the promote has stored part of its chunks (or has finished).
        wait_until(lambda: outcome or lmdb_file.stat().st_size >= size_before + BATCH_BYTES,
                   120, "the promote to store its first batch of chunks")
        daemon.kill()
    finally:
        thread.join(60)
    assert not thread.is_alive()

    daemon.start()
    new_list = snapshot_ids(daemon)
    if isinstance(outcome[0], dict):  # the promote finished before the kill
        assert new_list == old_list + [outcome[0]["snapshot"]]
    else:  # the old list, or the old list and one complete snapshot
        assert outcome[0].errno in (errno.ENOTCONN, errno.ECONNABORTED), outcome[0]
        assert new_list[:len(old_list)] == old_list
        assert len(new_list) - len(old_list) in (0, 1)
    for sid, signature in expected.items():
        assert tree_signature(daemon.snap_path(sid)) == signature
    for sid in new_list[len(old_list):]:  # a promote that made it is whole
        sha = hashlib.sha256()
        with open(daemon.snap_path(sid) / "large.bin", "rb") as f:
            while block := f.read(MIB):
                sha.update(block)
        assert sha.hexdigest() == digest.hexdigest()
        assert (daemon.snap_path(sid) / "a.txt").read_bytes() == b"promoted once\n"
    # The daemon still works after the crash.
    again = daemon.create(second)
    assert (daemon.exec_path(again) / "a.txt").read_bytes() == b"promoted once\n"


# ----- a full disk ---------------------------------------------------------------------------

@contextlib.contextmanager
def daemon_on_tmpfs(tmp_path: Path, options: str, request) -> Iterator[Daemon]:
    """A started daemon whose data directory is a tmpfs mounted with ``options`` (a small
    disk); afterwards it is stopped, the tmpfs unmounted and the log checked (lines the
    test's ``allow_log`` marks allow)."""
    data = tmp_path / "data"
    data.mkdir()
    run("mount", "-t", "tmpfs", "-o", options, "tmpfs", data)
    d = Daemon(data, tmp_path / "mnt")
    try:
        d.start()
        yield d
    finally:
        try:
            if d.pid is not None:
                d.stop()
        finally:
            run("umount", data)
            check_log(d.log_text(), [m for mark in request.node.iter_markers("allow_log")
                                     for m in mark.args], repr(d))


@pytest.mark.kernel
def test_a_file_system_with_few_inodes_gets_no_precreated_files(tmp_path, source, request):
    with daemon_on_tmpfs(tmp_path, "size=64m,nr_inodes=600", request) as d:
        ex = d.exec_path(d.create(d.snapshot(source)))
        (ex / "first").write_bytes(b"first")
        spares = d.data_dir / "upper" / "precreated"
        assert os.listdir(spares) == []
        written = 0
        with pytest.raises(OSError) as caught:
            for i in range(1000):
                (ex / f"f{i}").write_bytes(b"%d" % i)
                written += 1
        assert caught.value.errno == errno.ENOSPC
        assert written > 500  # the inodes went to the files, none to precreated ones
        assert os.listdir(spares) == []
        assert [(ex / f"f{i}").read_bytes() for i in (0, written - 1)] == \
            [b"0", b"%d" % (written - 1)]


@pytest.mark.kernel
def test_full_disk_write_fails_with_enospc_and_snapshots_survive(tmp_path, source, request):
    with daemon_on_tmpfs(tmp_path, "size=64m", request) as d:
        eid, expected = two_snapshots(d, source, b"before the disk filled\n")
        ex = d.exec_path(eid)

        written = 0
        fd = os.open(ex / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            with pytest.raises(OSError) as caught:
                for _ in range(128):  # 128 MiB: twice the file system
                    written += os.write(fd, os.urandom(MIB))
        finally:
            os.close(fd)
        assert caught.value.errno == errno.ENOSPC
        assert 0 < written < 64 * MIB
        assert os.stat(ex / "filler").st_size == written  # a short last write counts as short
        with pytest.raises(OSError) as caught:  # its chunks do not fit either
            d.exec_ctl(eid, "promote")
        assert caught.value.errno == errno.ENOSPC
        assert caught.value.reply["errno"] == errno.ENOSPC
        assert "no space left" in caught.value.reply["error"]
        assert "no space left" in control(ex, protocol.ERROR).read_text()
        assert snapshot_ids(d) == list(expected)

        os.unlink(ex / "filler")
        d.exec_ctl(eid, "reset")
        for sid, signature in expected.items():
            assert tree_signature(d.snap_path(sid)) == signature
        # The filler's data goes in the background (the reclaim of the forgotten inode, the
        # collection of the dropped layer): its space comes back then, not at the reset.
        wait_until(lambda: (st := os.statvfs(d.data_dir)).f_bavail * st.f_frsize > 32 * MIB, 30,
                   "the filler's space to come back")
        (ex / "after").write_bytes(b"room again")
        third = d.exec_ctl(eid, "promote")["snapshot"]
        d.restart()
        for sid, signature in expected.items():
            assert tree_signature(d.snap_path(sid)) == signature
        assert (d.snap_path(third) / "after").read_bytes() == b"room again"
