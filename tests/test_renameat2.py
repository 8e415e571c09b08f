"""renameat2(2) flags through the real mount: RENAME_WHITEOUT leaves a 0/0 character device at
the source, as on ext4 and tmpfs (overlayfs makes its whiteouts so on its upper file system);
every flag the daemon does not implement is EINVAL, whoever asks (the kernel filters most of
them, the model refuses them too)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
from pathlib import Path

import pytest

from conftest import run
from rametfs.errors import RametError
from rametfs.overlay import Overlay
from rametfs.store import Store, import_tree
from test_snapshots import write_tree

RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4
AT_FDCWD = -100
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def renameat2(old: Path, new: Path, flags: int) -> str:
    """``"ok"``, or the errno name renameat2(2) fails with."""
    if libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) == 0:
        return "ok"
    return errno.errorcode[ctypes.get_errno()]


def shape(path: Path) -> tuple:
    st = os.lstat(path)
    return (stat.filemode(st.st_mode), st.st_rdev, st.st_uid, st.st_gid, st.st_nlink)


def steps(root: Path) -> list:
    """Whiteout renames of a file (to a new name and over another), of a directory with
    children into another directory, and the refused flag sets; what each leaves."""
    out = [renameat2(root / "a", root / "b", RENAME_WHITEOUT)]
    out += [shape(root / "a"), (root / "b").read_bytes()]
    out.append(renameat2(root / "c", root / "b", RENAME_WHITEOUT))  # replaces b
    out += [shape(root / "c"), (root / "b").read_bytes()]
    out.append(renameat2(root / "d", root / "sub" / "d", RENAME_WHITEOUT))
    out += [shape(root / "d"), sorted(os.listdir(root / "sub" / "d")),
            os.lstat(root).st_nlink, os.lstat(root / "sub").st_nlink]
    out.append(renameat2(root / "a", root / "x", RENAME_WHITEOUT | RENAME_NOREPLACE))
    out.append(renameat2(root / "x", root / "b", RENAME_WHITEOUT | RENAME_NOREPLACE))
    for flags in (RENAME_WHITEOUT | RENAME_EXCHANGE, RENAME_NOREPLACE | RENAME_EXCHANGE, 8,
                  1 << 31):
        out.append(renameat2(root / "b", root / "sub", flags))
    out.append(sorted(os.listdir(root)))
    return out


def test_rename_whiteout_leaves_a_char_device_as_on_ext4(daemon, tmp_path):
    src = write_tree(tmp_path / "src", {"a": b"A\n", "c": b"C\n", "d/e": b"E\n", "sub/f": b"F"})
    eid = daemon.create(daemon.snapshot(src))
    ex = daemon.exec_path(eid)
    ext4 = tmp_path / "ext4"
    run("cp", "-a", src, ext4)
    whiteout = ("c---------", 0, 0, 0, 1)
    assert steps(ex) == steps(ext4) == [
        "ok", whiteout, b"A\n", "ok", whiteout, b"C\n", "ok", whiteout, ["e"], 3, 3,
        "ok", "EEXIST", "EINVAL", "EINVAL", "EINVAL", "EINVAL", ["a", "b", "c", "d", "sub", "x"]]
    # The whiteouts are inodes of the execution: they survive a restart, and the diff names
    # each as a change of type (a file or a directory, then a device: D then A).
    assert (ex / ".ramet" / "diff").read_text().splitlines() == [
        "D a", "A a", "A b", "D c", "A c", "D d/", "D d/e", "A d", "A sub/d/", "A sub/d/e",
        "A x"]
    daemon.restart()
    assert [shape(ex / n) for n in ("a", "c", "d", "x")] == [whiteout] * 4  # x: a's first
    assert (ex / "b").read_bytes() == b"C\n" and (ex / "sub" / "d" / "e").read_bytes() == b"E\n"


def test_rename_in_a_snapshot_is_erofs_whatever_the_flags(shared_daemon, tmp_path):
    src = write_tree(tmp_path / "src", {"a": b"A\n"})
    snap = shared_daemon.snap_path(shared_daemon.snapshot(src))
    assert [renameat2(snap / "a", snap / "b", f)
            for f in (0, RENAME_WHITEOUT, RENAME_NOREPLACE)] == ["EROFS"] * 3
    assert os.listdir(snap) == ["a"]


@pytest.mark.parametrize("flags", [8, 1 << 31, RENAME_EXCHANGE | RENAME_WHITEOUT,
                                   RENAME_EXCHANGE | RENAME_NOREPLACE])
def test_the_model_refuses_flags_it_does_not_implement(tmp_path, flags, fsck_clean):
    """The kernel filters these before FUSE (the calls above); the model refuses them too, so
    no other caller of it can have one ignored."""
    src = write_tree(tmp_path / "src", {"a": b"A\n", "b": b"B\n"})
    store = Store(tmp_path / "data")
    try:
        overlay = Overlay(store)
        ex = overlay.create_execution(import_tree(store, src), "e")
        with pytest.raises(RametError) as exc:
            overlay.rename(ex.root_ino, b"a", ex.root_ino, b"b", flags)
        assert exc.value.errno == errno.EINVAL
        assert sorted(n for n, _ in overlay.listdir(ex.root_ino)) == [b"a", b"b"]
        fsck_clean(store)
    finally:
        store.close()
