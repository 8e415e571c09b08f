"""Kernel caching in both FUSE adapter modes: open-less (the pyfuse3 patch of tools/pyfuse3/,
the kernel keeps pages and listings and sends no open/opendir) and plain open (forced with
RAMETFS_OPEN_LESS=0).  Each mode must show nothing stale: control files after commands,
listings after reset, promote and writes from another process, pages after reset.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyfuse3
import pytest

from conftest import Daemon, check_log, ctl_command, require_fuse, run, wait_until
from rametfs.mounts import mount_at
from rametfs.precreate import REFILL_BELOW

PATCHED = hasattr(pyfuse3.FileInfo(), "cache_readdir")


@pytest.fixture(scope="module", params=["open-less", "open"])
def mode_daemon(request, tmp_path_factory):
    require_fuse()
    if request.param == "open-less" and not PATCHED:
        pytest.skip("pyfuse3 lacks the open-less patch (tools/pyfuse3/): plain mode only")
    base = tmp_path_factory.mktemp(request.param)
    env = {"RAMETFS_OPEN_LESS": "1" if request.param == "open-less" else "0"}
    d = Daemon(base / "data", base / "mnt", env=env, serve_args=("--faults",))  # hold:write
    d.start()
    yield request.param, d
    try:
        d.stop()
    finally:
        check_log(d.log_text(), [], repr(d))


@pytest.fixture
def execution(mode_daemon, tmp_path):
    mode, d = mode_daemon
    src = tmp_path / "src"
    (src / "dir").mkdir(parents=True)
    (src / "dir" / "a.txt").write_bytes(b"alpha\n")
    (src / "big.bin").write_bytes(bytes(range(256)) * 1024)  # 256 KiB, 4 pages
    snap = d.snapshot(src)
    eid = ctl_command(d.mnt / ".ramet" / "ctl", f"create {snap}")["execution"]
    yield mode, d, snap, d.mnt / "executions" / eid
    ctl_command(d.mnt / ".ramet" / "ctl", f"release {eid}")


def test_status_says_which_mode(mode_daemon):
    mode, d = mode_daemon
    assert d.status()["open_less"] is (mode == "open-less")


def _fuse_device_flags(pid: int) -> int:
    """The open flags of process ``pid``'s one ``/dev/fuse`` descriptor (/proc/PID/fdinfo)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "/dev/fuse":
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    return int(dict(line.split(":", 1) for line in f)["flags"], 8)
    raise AssertionError(f"process {pid} has no /dev/fuse descriptor")


def test_requests_are_read_without_blocking_and_concurrent_clients_get_their_bytes(execution):
    """The pyfuse3 patch makes the FUSE device non-blocking: a worker reads the next request
    as soon as it answered one, without a pass through trio's scheduler, and a read that
    finds the queue empty (another worker took the request) goes back to waiting instead of
    blocking the daemon.  8 threads create, write, stat, read and remove files at once, with
    pauses that empty the queue, and each gets exactly its own bytes back."""
    _, d, _, ex = execution
    if not PATCHED:
        pytest.skip("stock pyfuse3 reads a blocking device")
    assert _fuse_device_flags(d.pid) & os.O_NONBLOCK
    before = sorted(os.listdir(ex))
    failures = []

    def client(k: int) -> None:
        try:
            for i in range(200):
                path, data = ex / f"c{k}-{i}", f"{k}:{i}\n".encode() * (i + 1)
                path.write_bytes(data)
                assert (os.stat(path).st_size, path.read_bytes()) == (len(data), data)
                os.unlink(path)
                if i % 50 == 49:
                    time.sleep(0.05)
        except BaseException as exc:
            failures.append((k, exc))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert failures == []
    assert sorted(os.listdir(ex)) == before
    assert d.is_alive()


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid``, all its threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_reader_stops_polling_when_requests_stop(execution):
    """The patched reader polls the empty queue for up to 50 µs before it sleeps, a window
    that grows while requests come one right after another's answer (a lone process's
    creates and unlinks) and shrinks to nothing when they stop: the idle daemon then takes no CPU beyond
    its once-a-second flush (a reader that never slept would take 3 s of it here)."""
    _, d, _, ex = execution
    if not PATCHED:
        pytest.skip("stock pyfuse3 sleeps whenever the queue is empty")
    for i in range(500):  # requests back to back: the window opens to its widest
        (ex / f"p{i}").write_bytes(b"p")
        os.unlink(ex / f"p{i}")
    time.sleep(0.5)
    before = _cpu_seconds(d.pid)
    time.sleep(3)
    assert _cpu_seconds(d.pid) - before < 0.15
    assert (ex / "dir" / "a.txt").read_bytes() == b"alpha\n"


def test_control_files_from_a_shell_are_fresh_after_each_command(execution):
    _, d, snap, ex = execution
    ramet = ex / ".ramet"
    assert (ramet / "diff").read_bytes() == b""
    (ex / "new.txt").write_text("new\n")
    assert (ramet / "diff").read_bytes() == b"A new.txt\n"
    assert os.stat(ramet / "diff").st_size == len(b"A new.txt\n")

    out = run("sh", "-c", "echo promote > .ramet/ctl && cat .ramet/ctl", cwd=ex).stdout
    first = ctl_reply(out)
    assert first["ok"] is True and len(first["snapshot"]) == 64
    assert (ramet / "promote").read_text() == first["snapshot"] + "\n"
    (ex / "dir" / "a.txt").unlink()
    assert (ramet / "diff").read_bytes() == b"D dir/a.txt\n"  # against the head: the promote

    (ex / "new.txt").write_text("changed\n")
    assert (ramet / "diff").read_bytes() == b"D dir/a.txt\nM new.txt\n"
    out = run("sh", "-c", "echo promote > .ramet/ctl && cat .ramet/ctl", cwd=ex).stdout
    second = ctl_reply(out)
    assert second["snapshot"] != first["snapshot"]
    assert (ramet / "promote").read_text() == second["snapshot"] + "\n"

    bad = subprocess.run(["bash", "-c", "echo frobnicate > .ramet/ctl"], cwd=ex,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "Invalid argument" in bad.stderr
    assert (ramet / "error").read_text().startswith("frobnicate: unknown command")
    assert ctl_reply((ramet / "ctl").read_text())["errno"] == errno.EINVAL


def ctl_reply(text: str) -> dict:
    return json.loads(text)


def test_snapshot_listing_shows_a_promote_at_once(execution):
    _, d, snap, ex = execution
    before = set(os.listdir(d.mnt / "snapshots"))
    assert snap in before
    (ex / "dir" / "b.txt").write_text("beta\n")
    new = ctl_command(ex / ".ramet" / "ctl", "promote")["snapshot"]
    assert set(os.listdir(d.mnt / "snapshots")) == before | {new}
    assert (d.mnt / "snapshots" / new / "dir" / "b.txt").read_text() == "beta\n"


def test_writes_from_another_process_are_seen_at_once(execution):
    _, d, snap, ex = execution
    target = ex / "dir"
    assert sorted(os.listdir(target)) == ["a.txt"]
    assert (target / "a.txt").read_bytes() == b"alpha\n"

    other = ("import os, sys; d = sys.argv[1]; open(d + '/a.txt', 'ab').write(b'more\\n'); "
             "open(d + '/c.txt', 'w').write('c'); os.rename(d + '/c.txt', d + '/d.txt')")
    run(sys.executable, "-c", other, str(target))
    assert sorted(os.listdir(target)) == ["a.txt", "d.txt"]
    assert (target / "a.txt").read_bytes() == b"alpha\nmore\n"
    run(sys.executable, "-c", "import os, sys; os.unlink(sys.argv[1])", str(target / "d.txt"))
    assert sorted(os.listdir(target)) == ["a.txt"]


def test_reset_leaves_nothing_stale_in_held_directories_and_files(execution):
    """A held directory the reset changed but kept lists the snapshot's names at once (no
    stale listing), and a held file the reset changed is stale (its data went)."""
    _, d, snap, ex = execution
    (ex / "dir" / "added.txt").write_text("added\n")
    with open(ex / "big.bin", "r+b") as f:
        f.seek(70000)
        f.write(b"CHANGED")
    held_dir = os.open(ex / "dir", os.O_RDONLY | os.O_DIRECTORY)
    held_file = os.open(ex / "big.bin", os.O_RDONLY)
    try:
        assert sorted(os.listdir(held_dir)) == ["a.txt", "added.txt"]
        assert os.pread(held_file, 7, 70000) == b"CHANGED"

        ctl_command(ex / ".ramet" / "ctl", "reset")

        assert sorted(os.listdir(held_dir)) == ["a.txt"]
        assert os.fstat(held_dir).st_ino == os.stat(ex / "dir").st_ino
        with pytest.raises(OSError) as caught:
            os.pread(held_file, 7, 70000)
        assert caught.value.errno == errno.ESTALE
    finally:
        os.close(held_dir)
        os.close(held_file)
    assert sorted(os.listdir(ex / "dir")) == ["a.txt"]
    assert (ex / "big.bin").read_bytes() == bytes(range(256)) * 1024


def test_truncate_on_open_and_erofs(execution):
    _, d, snap, ex = execution
    with open(ex / "dir" / "a.txt", "w") as f:  # O_TRUNC
        assert os.fstat(f.fileno()).st_size == 0
        f.write("x")
    assert (ex / "dir" / "a.txt").read_bytes() == b"x"
    snap_file = d.mnt / "snapshots" / snap / "dir" / "a.txt"
    with pytest.raises(OSError) as caught:
        open(snap_file, "w")
    assert caught.value.errno == errno.EROFS
    assert snap_file.read_bytes() == b"alpha\n"


def _map_and_store(path: Path, data: bytes) -> OSError | None:
    """Open ``path`` read-write, store ``data`` at offset 0 through a shared mapping and
    msync it; the error the msync gave (None if it gave none)."""
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            m[:len(data)] = data
            try:
                m.flush()
            except OSError as exc:
                return exc
            return None
    finally:
        os.close(fd)


def _hammer(path: Path, rng: random.Random, seconds: float) -> None:
    """Store into random pages of ``path`` through a shared mapping for ``seconds``, with an
    msync after about a third of the stores; the close writes back the rest (FUSE flush)."""
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            pages = len(m) // mmap.PAGESIZE
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                page = rng.randrange(pages) * mmap.PAGESIZE
                m[page:page + 4] = b"EVIL"
                if rng.random() < 0.3:
                    with contextlib.suppress(OSError):  # EROFS
                        m.flush()
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="the read-only bind needs CAP_SYS_ADMIN")
def test_snapshots_are_a_read_only_mount_that_refuses_write_opens(execution):
    _, d, snap, _ = execution
    assert d.status()["snapshots_bind"] == "read-only"
    assert {"ro", "nosuid", "nodev"} <= set(mount_at(str(d.mnt / "snapshots")).options)
    snap_file = d.mnt / "snapshots" / snap / "big.bin"
    for flags in (os.O_RDWR, os.O_WRONLY, os.O_WRONLY | os.O_APPEND):
        with pytest.raises(OSError) as caught:
            os.open(snap_file, flags)
        assert caught.value.errno == errno.EROFS


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need CAP_SYS_ADMIN")
def test_a_shared_writable_mmap_of_a_snapshot_file_is_dropped_at_write_back(execution, tmp_path):
    """Through a bind of the mount root that leaves out the read-only bind of snapshots/ (a
    plain ``mount --bind``), open-less mode cannot refuse the open: the mapping's stores
    reach the page cache, their write-back fails EROFS, and the daemon drops those pages."""
    mode, d, snap, _ = execution
    original = bytes(range(256)) * 1024
    plain = tmp_path / "plain"
    plain.mkdir()
    run("mount", "--bind", d.mnt, plain)
    try:
        snap_file = plain / "snapshots" / snap / "big.bin"
        if mode == "open":
            with pytest.raises(OSError) as caught:
                os.open(snap_file, os.O_RDWR)
            assert caught.value.errno == errno.EROFS
        else:
            failure = _map_and_store(snap_file, b"CHANGED")
            assert failure is not None and failure.errno == errno.EROFS
            wait_until(lambda: (d.mnt / "snapshots" / snap / "big.bin").read_bytes() == original,
                       5, "the snapshot file's pages to be dropped")
            # Write-backs that come while the pages are being dropped: dropped again after.
            rng = random.Random(7)
            for _ in range(10):
                _hammer(snap_file, rng, 0.3)
                wait_until(lambda: (d.mnt / "snapshots" / snap / "big.bin").read_bytes()
                           == original, 5, "every changed page to be dropped")
        assert snap_file.read_bytes() == original
    finally:
        run("umount", plain)
    assert (d.mnt / "snapshots" / snap / "big.bin").read_bytes() == original


def _write_in_place(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)


def test_read_only_control_files_refuse_writes_with_eacces(execution):
    """Root passes the mode bits: open-less, the write (or the truncate of O_TRUNC) refuses;
    with opens, the open does."""
    _, d, _, ex = execution
    for path in (d.mnt / ".ramet" / "status", ex / ".ramet" / "status", ex / ".ramet" / "diff",
                 ex / ".ramet" / "error"):
        for write in (_write_in_place, lambda p: p.write_text("x")):
            with pytest.raises(OSError) as caught:
                write(path)
            assert caught.value.errno == errno.EACCES, (path, write)
    assert (ex / ".ramet" / "diff").read_bytes() == b""
    assert json.loads((ex / ".ramet" / "status").read_text())["id"] == ex.name


def test_unlinked_open_file_lives_until_closed_then_its_data_goes(execution):
    _, d, snap, ex = execution
    fd = os.open(ex / "scratch.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        ino = os.fstat(fd).st_ino
        os.write(fd, b"s" * 100000)
        os.unlink(ex / "scratch.bin")
        assert not (ex / "scratch.bin").exists()
        os.write(fd, b"tail")
        assert os.pread(fd, 4, 100000) == b"tail"
        assert os.fstat(fd).st_nlink == 0
        assert [os.path.getsize(p) for p in upper_data(d, ino)] == [100004]
    finally:
        os.close(fd)
    wait_until(lambda: upper_data(d, ino) == [], 10, "the unlinked file's upper data deleted")


def test_new_files_get_precreated_upper_data_files_and_the_pool_refills(execution):
    _, d, _, ex = execution
    spares = d.data_dir / "upper" / "precreated"
    wait_until(lambda: len(list(spares.iterdir())) >= REFILL_BELOW, 30, "the precreated pool filled")
    spare_inos = {p.stat().st_ino for p in spares.iterdir()}
    for i in range(200):
        (ex / f"new{i}").write_bytes(b"n%d" % i)
    inos = {upper_data(d, (ex / f"new{i}").stat().st_ino)[0].stat().st_ino for i in range(200)}
    assert len(inos) == 200 and inos <= spare_inos
    # 200 taken leave fewer than REFILL_BELOW: the daemon makes more
    wait_until(lambda: len(list(spares.iterdir())) >= REFILL_BELOW, 30,
               "the precreated pool refilled")
    # files taken back from earlier tests' removals are emptied within HOLD_S
    wait_until(lambda: set(_pool(spares).values()) == {0}, 10, "every pooled file empty")
    assert [(ex / f"new{i}").read_bytes() for i in (0, 199)] == [b"n0", b"n199"]


def _pool(spares: Path) -> dict[int, int]:
    """The precreated pool's files now: inode number -> size (files moving in or out as it is
    read are left out)."""
    pool = {}
    for p in spares.iterdir():
        with contextlib.suppress(FileNotFoundError):
            st = p.stat()
            pool[st.st_ino] = st.st_size
    return pool


def test_removed_and_reset_files_go_back_to_the_pool_but_never_one_held_open(execution):
    """The upper data files of removed files, and of a layer a reset dropped, go back to the
    precreated pool emptied and later files reuse them; one that someone still holds open
    (here the test, with the daemon's own file) is unlinked instead, so what is written
    through that descriptor reaches no later file."""
    _, d, _, ex = execution
    spares = d.data_dir / "upper" / "precreated"
    for i in range(40):
        (ex / f"gone{i}").write_bytes(b"secret %d" % i)
    uppers = [upper_data(d, (ex / f"gone{i}").stat().st_ino)[0] for i in range(40)]
    held = os.open(uppers[0], os.O_RDWR)
    held_ino = os.fstat(held).st_ino
    taken = {p.stat().st_ino for p in uppers[1:]}
    try:
        for i in range(40):
            (ex / f"gone{i}").unlink()
        def emptied(inos):
            pool = _pool(spares)
            return {pool.get(ino) for ino in inos} == {0}  # in the pool, and empty
        wait_until(lambda: emptied(taken), 10, "the removed files taken back, emptied")
        wait_until(lambda: os.fstat(held).st_nlink == 0, 10, "the held file unlinked")
        assert held_ino not in _pool(spares)
        os.pwrite(held, b"LEAK", 0)

        (ex / "kept").write_bytes(b"until the reset")
        kept = upper_data(d, (ex / "kept").stat().st_ino)[0].stat().st_ino
        ctl_command(ex / ".ramet" / "ctl", "reset")
        wait_until(lambda: emptied({kept}), 10, "the reset layer's file taken back, emptied")

        count = len(_pool(spares)) + 10  # the pool hands out oldest first: all of it
        for i in range(count):
            (ex / f"new{i}").write_bytes(b"n%d" % i)
        new = {upper_data(d, (ex / f"new{i}").stat().st_ino)[0].stat().st_ino
               for i in range(count)}
        assert taken | {kept} <= new and held_ino not in new
        assert [(ex / f"new{i}").read_bytes() for i in range(count)] == \
            [b"n%d" % i for i in range(count)]
        assert os.pread(held, 4, 0) == b"LEAK"
    finally:
        os.close(held)


def upper_data(d: Daemon, ino: int) -> list:
    """The upper data file of inode ``ino`` (``<data>/upper/<layer>/<ino>``), if any."""
    return list((d.data_dir / "upper").glob(f"*/{ino}"))


def test_names_found_missing_come_back_after_reset(execution):
    _, d, snap, ex = execution
    for path in (ex / "big.bin", ex / "dir" / "a.txt"):
        path.unlink()
        for _ in range(2):  # the second answer may come from the kernel's negative dentry
            assert not path.exists()
    assert not (ex / "never").exists()
    run(sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write('made')",
        str(ex / "never"))
    assert (ex / "never").read_text() == "made"  # created by another process: seen

    ctl_command(ex / ".ramet" / "ctl", "reset")
    assert (ex / "big.bin").read_bytes() == bytes(range(256)) * 1024
    assert (ex / "dir" / "a.txt").read_bytes() == b"alpha\n"
    assert not (ex / "never").exists()
    assert not (d.mnt / "snapshots" / snap / "never").exists()


# Kernel AIO (io_setup, io_submit, io_getevents, io_destroy) by system call number: Python
# has no binding, and libaio is no dependency.
AIO_SYSCALLS = {"x86_64": (206, 209, 208, 207), "aarch64": (0, 2, 4, 1)}
IOCB_CMD_PWRITE = 1


class _Iocb(ctypes.Structure):  # struct iocb (linux/aio_abi.h), little-endian
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32),
                ("rw_flags", ctypes.c_int32), ("opcode", ctypes.c_uint16),
                ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64),
                ("offset", ctypes.c_int64), ("reserved2", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _IoEvent(ctypes.Structure):  # struct io_event
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


def _aio_direct_write(path: Path, buf: mmap.mmap) -> int:
    """Write the page-aligned ``buf`` at offset 0 of ``path`` through an ``O_DIRECT``
    descriptor with one kernel AIO request, and wait for its completion; its result (the
    bytes written, or a negative errno)."""
    setup, submit, getevents, destroy = AIO_SYSCALLS[os.uname().machine]
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    ctx = ctypes.c_ulong(0)
    try:
        if libc.syscall(setup, 1, ctypes.byref(ctx)) != 0:
            raise OSError(ctypes.get_errno(), "io_setup")
        iocb = _Iocb(opcode=IOCB_CMD_PWRITE, fildes=fd, nbytes=len(buf),
                     buf=ctypes.addressof(ctypes.c_char.from_buffer(buf)))
        iocbs = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(iocb))
        if libc.syscall(submit, ctx, 1, iocbs) != 1:
            raise OSError(ctypes.get_errno(), "io_submit")
        event = _IoEvent()
        while libc.syscall(getevents, ctx, 1, 1, ctypes.byref(event), None) != 1:
            if ctypes.get_errno() != errno.EINTR:
                raise OSError(ctypes.get_errno(), "io_getevents")
        return event.res
    finally:
        if ctx.value:
            libc.syscall(destroy, ctx)
        os.close(fd)


@contextlib.contextmanager
def _fusectl(tmp_path: Path):
    """The kernel's FUSE control file system (fusectl: a directory per connection), mounted
    on a directory of ``tmp_path`` for the block."""
    top = tmp_path / "fusectl"
    top.mkdir()
    run("mount", "-t", "fusectl", "fusectl", top)
    try:
        yield top
    finally:
        run("umount", top)


@pytest.mark.skipif(os.uname().machine not in AIO_SYSCALLS, reason="AIO syscall numbers known "
                    f"for {', '.join(AIO_SYSCALLS)} only")
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting fusectl needs CAP_SYS_ADMIN")
def test_a_buffered_read_racing_an_aio_direct_write_leaves_no_stale_page(execution, tmp_path):
    """fstests generic/451, made deterministic: an AIO write through an ``O_DIRECT``
    descriptor is held in the daemon (``fault hold:write``) while the file is read through
    the page cache, which gets the old bytes; once the write is let go, a read gives the new
    ones.  The daemon turns off FUSE_ASYNC_DIO, so the kernel completes the write as a
    synchronous one and drops the range's cached pages after it; its asynchronous completion
    would leave the old ones (docs/conformance.md, "Results")."""
    _, d, _, ex = execution
    if not hasattr(pyfuse3.Operations, "enable_async_dio"):
        pytest.skip("stock pyfuse3 cannot turn off FUSE_ASYNC_DIO")
    size = 256 << 10
    target = ex / "aio.bin"
    target.write_bytes(b"\x55" * size)
    new = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT wants
    new.write(b"\xaa" * size)
    dev = os.stat(ex).st_dev
    written = []
    with _fusectl(tmp_path) as fusectl:
        waiting = fusectl / str(os.major(dev) << 20 | os.minor(dev)) / "waiting"
        assert waiting.read_text() == "0\n"
        d.ctl(f"fault hold:write --execution {ex.name}")
        writer = threading.Thread(target=lambda: written.append(_aio_direct_write(target, new)))
        writer.start()
        try:
            wait_until(lambda: waiting.read_text() != "0\n", 60, "the direct write held")
            during = _pread(target, size)
        finally:
            d.ctl("fault hold:write --count 0")
            writer.join(60)
    assert during == b"\x55" * size  # the write was not applied yet
    assert written == [size]
    assert _pread(target, size) == new[:]


def _pread(path: Path, size: int) -> bytes:
    """``size`` bytes at offset 0 of ``path`` through the page cache, with nothing else: a
    stat after a read would make the kernel ask for the attributes (the read invalidated its
    atime), and a changed mtime drops the cached pages (FUSE_AUTO_INVAL_DATA), stale or not."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)
