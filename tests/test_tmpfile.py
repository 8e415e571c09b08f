"""``open(2)`` with ``O_TMPFILE`` in executions (docs/conformance.md, "O_TMPFILE"; it needs the
pyfuse3 patch, whose custom I/O passes the kernel's FUSE_TMPFILE on to ``Operations.tmpfile``).

A tmpfile is a regular file of no name (link count 0) until ``linkat(2)`` names it, through
``/proc/self/fd/N`` (``AT_SYMLINK_FOLLOW``) or ``AT_EMPTY_PATH``; one opened with ``O_EXCL``
never can be (tests/test_posix.py checks those rules against ext4, in the model and through
the mount).  Here the steps run on an execution and on a directory of the host (ext4) with the
same calls and programs (python, cat, git, sh), and the results must be equal; then what only
rametfs has is checked: the promote, the record a tmpfile never linked must not leave (fsck),
the execution's limits, the places that refuse it, and plain mode, where it stays EOPNOTSUPP.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
from pathlib import Path

import pyfuse3
import pytest

from conftest import Daemon, check_log, require_fuse, run, wait_until
from posix_drivers import errno_of
from rametfs.overlay import Overlay, drop_upper_files
from rametfs.precreate import DIRECTORY
from rametfs.store import Store, fsck, import_tree
from test_fsmonitor import hook as fsmonitor
from test_snapshots import write_tree

MIB = 1 << 20
AT_FDCWD, AT_EMPTY_PATH = -100, 0x1000
TMPFILE = os.O_TMPFILE | os.O_RDWR
_libc = ctypes.CDLL(None, use_errno=True)

pytestmark = pytest.mark.skipif(not hasattr(pyfuse3.Operations, "tmpfile"),
                                reason="O_TMPFILE needs the patched pyfuse3 "
                                       "(tools/pyfuse3/README.md)")


def link_proc(fd: int, path: Path) -> None:
    """Name this process's open file ``fd`` ``path`` as open(2) shows, with ln(1):
    ``ln -L /proc/PID/fd/N path`` is ``linkat(..., AT_SYMLINK_FOLLOW)``."""
    run("ln", "-L", f"/proc/{os.getpid()}/fd/{fd}", path)


def link_empty_path(fd: int, path: Path) -> None:
    """``linkat(fd, "", AT_FDCWD, path, AT_EMPTY_PATH)``."""
    if _libc.linkat(fd, b"", AT_FDCWD, os.fsencode(path), AT_EMPTY_PATH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))


def record(d: Daemon, eid: str) -> dict:
    """The harness's status record of execution ``eid``."""
    [rec] = [e for e in d.status()["executions"] if e["id"] == eid]
    return rec


def upper_files(d: Daemon) -> set[str]:
    """The upper data files of every layer, as ``layer/ino`` (the precreated pool left out)."""
    root = d.data_dir / "upper"
    return {f"{layer.name}/{f.name}" for layer in root.iterdir() if layer.name != DIRECTORY
            for f in layer.iterdir()}


def check_store(d: Daemon) -> None:
    """Stop ``d``, check that fsck finds no problem and no orphan left, start it again."""
    d.stop()
    store = Store(d.data_dir)
    try:
        report = fsck(store)
        assert (report.problems, report.orphans) == ([], [])
    finally:
        store.close()
    d.start()


def keep_execution(d: Daemon, tmp_path: Path) -> tuple[str, Path]:
    """A new execution of a snapshot holding the one file ``keep``: its id and its path."""
    eid = d.create(d.snapshot(write_tree(tmp_path / "src", {"keep": b"k"})))
    return eid, d.exec_path(eid)


@pytest.fixture
def execution(shared_daemon, tmp_path):
    """``new(files) -> Path``: an execution of a snapshot of ``files`` on the shared daemon,
    released after the test."""
    made = []

    def new(files: dict[str, bytes]) -> Path:
        eid = shared_daemon.create(shared_daemon.snapshot(write_tree(tmp_path / "src", files)))
        made.append(eid)
        return shared_daemon.exec_path(eid)

    yield new
    for eid in made:
        shared_daemon.ctl(f"release {eid}")


# ----- as on ext4 ---------------------------------------------------------------------------

def _open_masked(path: Path, flags: int, mode: int) -> int:
    """open(2) under umask 027, which the kernel applies to a tmpfile as to a create."""
    mask = os.umask(0o027)
    try:
        return os.open(path, flags, mode)
    finally:
        os.umask(mask)


def _write_link_read(d: Path) -> list:
    out = []
    fd = _open_masked(d, TMPFILE, 0o666)
    try:
        st = os.fstat(fd)
        out.append((stat.S_ISREG(st.st_mode), stat.S_IMODE(st.st_mode), st.st_nlink,
                    st.st_size, st.st_uid, st.st_gid))
        os.write(fd, b"written before it had a name\n")
        out.append(sorted(os.listdir(d)))  # no hidden entry
        link_proc(fd, d / "via-proc")
        os.write(fd, b"and after\n")
        out.append((os.fstat(fd).st_nlink, os.stat(d / "via-proc").st_ino == os.fstat(fd).st_ino))
    finally:
        os.close(fd)
    sub_fd = _open_masked(d / "sub", os.O_TMPFILE | os.O_WRONLY, 0o755)
    try:  # sub is set-group-ID, of group 1234: the file gets its group
        st = os.fstat(sub_fd)
        out.append((stat.S_IMODE(st.st_mode), st.st_nlink, st.st_uid, st.st_gid))
        os.pwrite(sub_fd, b"#!/bin/sh\necho made by a tmpfile\n", 0)
        link_empty_path(sub_fd, d / "sub" / "run.sh")
        os.fsync(sub_fd)
    finally:
        os.close(sub_fd)
    out.append(run("cat", d / "via-proc").stdout)
    out.append(run(d / "sub" / "run.sh").stdout)
    st = os.stat(d / "sub" / "run.sh")
    out.append((stat.S_IMODE(st.st_mode), st.st_nlink, st.st_size, st.st_gid))
    run("git", "init", "-q", cwd=d)
    run("git", "add", "via-proc", "sub/run.sh", cwd=d)
    out.append(run("git", "ls-files", "-s", cwd=d).stdout)
    out.append(sorted(os.listdir(d)))
    return out


def test_a_tmpfile_written_then_linked_reads_as_on_ext4_and_is_promoted(shared_daemon,
                                                                         tmp_path):
    src = write_tree(tmp_path / "src", {"keep": b"k\n", "sub/old": b"o\n"})
    os.chown(src / "sub", 0, 1234)
    os.chmod(src / "sub", 0o2775)
    eid = shared_daemon.create(shared_daemon.snapshot(src))
    ex = shared_daemon.exec_path(eid)
    try:
        ext4 = tmp_path / "ext4"
        run("cp", "-a", src, ext4)
        got = _write_link_read(ex)
        assert got == _write_link_read(ext4)
        assert got[0] == (True, 0o640, 0, 0, 0, 0)
        assert got[3] == (0o750, 0, 0, 1234)
        assert got[4:7] == ["written before it had a name\nand after\n", "made by a tmpfile\n",
                            (0o750, 1, 33, 1234)]
        assert got[-1] == [".git", "keep", "sub", "via-proc"]
        promoted = shared_daemon.exec_ctl(eid, "promote")["snapshot"]
        snap = shared_daemon.snap_path(promoted)
        assert (snap / "via-proc").read_bytes() == b"written before it had a name\nand after\n"
        assert sorted(os.listdir(snap / "sub")) == ["old", "run.sh"]
        assert stat.S_IMODE(os.stat(snap / "sub" / "run.sh").st_mode) == 0o750
        assert run("git", "ls-files", "-s", cwd=ex).stdout == got[7]
        # The execution goes on from its promote; a new execution of the snapshot has both.
        again = shared_daemon.create(promoted)
        try:
            assert (shared_daemon.exec_path(again) / "sub" / "run.sh").read_bytes() == \
                b"#!/bin/sh\necho made by a tmpfile\n"
        finally:
            shared_daemon.ctl(f"release {again}")
    finally:
        shared_daemon.ctl(f"release {eid}")


TEMPORARY_FILE = ("import os, sys, tempfile\n"
                  "f = tempfile.TemporaryFile(dir=sys.argv[1])\n"
                  "f.write(b'scratch ' * 1000); f.seek(0)\n"
                  "print(len(f.read()), os.fstat(f.fileno()).st_nlink,"
                  " sorted(os.listdir(sys.argv[1])))\n")


def temporary_file(directory: Path, trace: Path) -> tuple[str, list[str]]:
    """Run Python's tempfile.TemporaryFile in ``directory`` under strace: its output, and
    of each openat(2) that makes a file there, ``"tmpfile"`` (O_TMPFILE) or ``"named"``
    (O_CREAT), or the errno of its failure."""
    out = run("strace", "-f", "-qq", "-e", "trace=openat", "-o", trace, sys.executable, "-c",
              TEMPORARY_FILE, directory).stdout
    calls = []
    for line in trace.read_text().splitlines():
        if f'"{directory}' in line and ("O_TMPFILE" in line or "O_CREAT" in line):
            result = line.rsplit(" = ", 1)[1]
            calls.append(result.split()[1] if result.startswith("-1") else
                         "tmpfile" if "O_TMPFILE" in line else "named")
    return out, calls


def test_tempfile_temporary_file_opens_a_tmpfile(execution, tmp_path):
    """tempfile.TemporaryFile opens O_TMPFILE first (falling back to a named file it unlinks
    at once where that fails): here the first open is the file."""
    ex = execution({"keep": b"k\n"})
    assert temporary_file(ex, tmp_path / "trace") == ("8000 0 ['keep']\n", ["tmpfile"])


# ----- what only rametfs has ------------------------------------------------------------------

def test_git_fsmonitor_sees_a_tmpfile_at_its_link_only(execution):
    """git's fsmonitor hook (``.ramet/fsmonitor``) lists changed paths: a tmpfile written
    has none until a link gives it one."""
    ex = execution({"d/keep": b"k\n"})
    token, _ = fsmonitor(ex, "")
    fd = os.open(ex / "d", TMPFILE, 0o600)
    try:
        os.write(fd, b"unnamed\n")
        token, paths = fsmonitor(ex, token)
        assert paths == []
        link_empty_path(fd, ex / "d" / "named")
        os.write(fd, b"named\n")
    finally:
        os.close(fd)
    assert fsmonitor(ex, token)[1] == ["d/named"]


def test_refused_in_snapshots_and_control_directories(shared_daemon, execution, tmp_path):
    ex = execution({"keep": b"k\n"})
    mnt = shared_daemon.mnt
    snap = shared_daemon.snap_path(shared_daemon.snapshot(write_tree(tmp_path / "snap",
                                                                     {"d/f": b"f"})))
    where = {"snapshot": snap, "snapshot's d": snap / "d", "snapshots/": mnt / "snapshots",
             "execution .ramet": ex / ".ramet", "root .ramet": mnt / ".ramet",
             "executions/": mnt / "executions", "root": mnt}
    got = {name: errno_of(os.open, path, TMPFILE, 0o600) for name, path in where.items()}
    assert got == {"snapshot": "EROFS", "snapshot's d": "EROFS", "snapshots/": "EROFS",
                   "execution .ramet": "EPERM", "root .ramet": "EPERM", "executions/": "EPERM",
                   "root": "EPERM"}
    # A create there is refused the same way.
    assert {name: errno_of(os.open, path / "new", os.O_CREAT | os.O_RDWR, 0o600)
            for name, path in where.items()} == got
    assert os.listdir(ex) == ["keep"]


def test_a_tmpfile_never_linked_goes_when_closed_and_leaves_no_record(daemon, tmp_path):
    eid, ex = keep_execution(daemon, tmp_path)
    before, files = record(daemon, eid), upper_files(daemon)
    fd = os.open(ex, TMPFILE, 0o600)
    try:
        data = os.urandom(MIB)
        os.write(fd, data)
        while_open = record(daemon, eid)
        assert while_open["upper_inodes"] == before["upper_inodes"] + 1
        assert while_open["upper_bytes"] >= before["upper_bytes"] + MIB
        assert os.pread(fd, 2 * MIB, 0) == data
        assert os.listdir(ex) == ["keep"]
    finally:
        os.close(fd)
    # Counted back when the kernel forgets it; its data file goes in the reclaim's batch.
    wait_until(lambda: upper_files(daemon) == files, 10, "the forgotten tmpfile reclaimed")
    after = record(daemon, eid)
    assert (after["upper_inodes"], after["upper_bytes"]) == (before["upper_inodes"],
                                                             before["upper_bytes"])
    check_store(daemon)


def test_a_tmpfile_open_at_a_crash_is_gone_after_the_restart(daemon, tmp_path):
    eid, ex = keep_execution(daemon, tmp_path)
    before, files = record(daemon, eid), upper_files(daemon)
    fd = os.open(ex, TMPFILE, 0o600)
    try:
        os.write(fd, b"lost with the crash" * 1000)
        assert len(upper_files(daemon) - files) == 1
        daemon.kill()
    finally:
        with contextlib.suppress(OSError):  # the connection is gone
            os.close(fd)
    daemon.start()
    assert upper_files(daemon) == files
    assert record(daemon, eid)["upper_inodes"] == before["upper_inodes"]
    assert os.listdir(ex) == ["keep"]
    check_store(daemon)


def test_an_open_tmpfile_across_a_promote_and_a_reset(daemon, tmp_path):
    """A promote leaves an unnamed tmpfile out and open; a reset drops it (ESTALE)."""
    eid, ex = keep_execution(daemon, tmp_path)
    fd = os.open(ex, TMPFILE, 0o600)
    try:
        os.write(fd, b"before the promote\n")
        promoted = daemon.exec_ctl(eid, "promote")["snapshot"]
        assert os.listdir(daemon.snap_path(promoted)) == ["keep"]
        os.write(fd, b"after it\n")
        link_empty_path(fd, ex / "named")
    finally:
        os.close(fd)
    assert (ex / "named").read_bytes() == b"before the promote\nafter it\n"
    fd = os.open(ex, TMPFILE, 0o600)
    try:
        os.write(fd, b"dropped\n")
        daemon.exec_ctl(eid, "reset")
        assert errno_of(os.write, fd, b"more") == "ESTALE"
    finally:
        os.close(fd)
    assert os.listdir(ex) == ["keep"]
    check_store(daemon)


def test_a_hostile_agent_is_held_by_max_inodes_and_max_bytes(daemon, tmp_path):
    """100,000 tmpfiles held open: the execution's inode limit stops them at its count, and
    once they are closed the inodes come back; a tmpfile's bytes count against --max-bytes."""
    snap = daemon.snapshot(write_tree(tmp_path / "src", {"keep": b"k"}))
    eid = daemon.ctl(f"create {snap} --max-inodes 64 --max-bytes {MIB}")["execution"]
    ex = daemon.exec_path(eid)
    assert record(daemon, eid)["upper_inodes"] == 1  # the root's record
    fds = []
    try:
        with pytest.raises(OSError) as caught:
            for _ in range(100_000):
                fds.append(os.open(ex, TMPFILE, 0o600))
        assert caught.value.errno == errno.EDQUOT
        assert len(fds) == 63
        assert record(daemon, eid)["upper_inodes"] == 64
        assert errno_of(os.open, ex / "named", os.O_CREAT | os.O_RDWR, 0o600) == "EDQUOT"
        written = 0
        with pytest.raises(OSError) as caught:
            for _ in range(3):
                written += os.write(fds[0], os.urandom(MIB))
        assert caught.value.errno == errno.EDQUOT
        assert MIB // 2 < written <= MIB
    finally:
        for fd in fds:
            os.close(fd)
    wait_until(lambda: record(daemon, eid)["upper_inodes"] == 1, 10,
               "the forgotten tmpfiles reclaimed")
    fd = os.open(ex, TMPFILE, 0o600)
    try:
        os.write(fd, b"room again\n")
        link_proc(fd, ex / "kept")
    finally:
        os.close(fd)
    assert (ex / "kept").read_bytes() == b"room again\n"
    check_store(daemon)


@pytest.mark.kernel
def test_plain_mode_answers_eopnotsupp_and_programs_fall_back(tmp_path):
    """Without the patch (or with it turned off) libfuse answers FUSE_TMPFILE ENOSYS itself,
    and the kernel fails every O_TMPFILE open EOPNOTSUPP from then on; the daemon serves on,
    and tempfile.TemporaryFile falls back to a named file it unlinks."""
    require_fuse()
    d = Daemon(tmp_path / "data", tmp_path / "mnt", env={"RAMETFS_OPEN_LESS": "0"})
    d.start()
    try:
        eid = d.create(d.snapshot(write_tree(tmp_path / "src", {"keep": b"k"})))
        ex = d.exec_path(eid)
        unsupported = errno.errorcode[errno.EOPNOTSUPP]  # ENOTSUP, the same number
        assert [errno_of(os.open, ex, TMPFILE, 0o600) for _ in range(2)] == [unsupported] * 2
        assert temporary_file(ex, tmp_path / "trace") == ("8000 0 ['keep']\n",
                                                          ["EOPNOTSUPP", "named"])
        (ex / "named").write_bytes(b"n")
        assert sorted(os.listdir(ex)) == ["keep", "named"]
        wait_until(lambda: record(d, eid)["upper_inodes"] == 2, 10,  # the root's and named's
                   "the unlinked temporary file reclaimed")
        check_store(d)
    finally:
        d.stop()
        check_log(d.log_text(), [], repr(d))


# ----- the model's rules, which the kernel applies first ---------------------------------------

def test_the_model_links_only_a_linkable_tmpfile_once(store, tmp_path):
    overlay = Overlay(store)
    ex = overlay.create_execution(import_tree(store, write_tree(tmp_path / "src",
                                                                {"d/f": b"f"})), "e")
    d = overlay.lookup(ex.root_ino, b"d")
    excl = overlay.tmpfile(d.ino, 0o600, 0, 0, linkable=False)
    with pytest.raises(OSError) as caught:
        overlay.link(excl.ino, d.ino, b"excl")
    assert caught.value.errno == errno.ENOENT
    tmp = overlay.tmpfile(d.ino, 0o640, 1000, 1000, linkable=True)
    a = overlay.attrs(tmp)
    assert (stat.S_ISREG(a.mode), stat.S_IMODE(a.mode), a.nlink, a.uid, a.gid) == (
        True, 0o640, 0, 1000, 1000)
    overlay.write(tmp, 0, b"data")
    with store.read() as txn:
        assert sorted(store.layers.orphans(txn)) == sorted([(ex.layer, excl.ino),
                                                            (ex.layer, tmp.ino)])
    overlay.link(tmp.ino, d.ino, b"named")
    assert overlay.lookup(d.ino, b"named") is tmp and overlay.attrs(tmp).nlink == 1
    with store.read() as txn:
        assert store.layers.orphans(txn) == [(ex.layer, excl.ino)]
    overlay.unlink(d.ino, b"named")
    with pytest.raises(OSError) as caught:
        overlay.link(tmp.ino, d.ino, b"again")
    assert caught.value.errno == errno.ENOENT
    overlay.forgotten([excl, tmp])
    items = overlay.take_reclaim()
    assert [item.ino for item in items] == [excl.ino, tmp.ino]
    assert os.path.exists(items[1].path)  # written: its upper data file
    drop_upper_files(items, None)
    overlay.reclaimed(items)
    assert ex.linkable == set() and ex.upper_inodes == 2  # the root's and d's records
    with store.read() as txn:
        assert store.layers.orphans(txn) == []
