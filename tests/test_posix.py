"""POSIX conformance cases run at two levels: against the model (no kernel) and through the
mount, each result equal to ext4's (tests/posix_drivers.py; rclone's vfstest does the same over its
VFS and its mount).  The cases here are the conformance cases (tests/test_conformance.py,
issue 3) whose steps are plain system calls; those that run real programs (bash, ln, rm,
find, sqlite3) or restart the daemon stay there, through the mount only.
"""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

import pyfuse3
import pytest

from conftest import run
from posix_drivers import ModelTree, OsTree, errno_of, signature
from rametfs.overlay import Overlay
from rametfs.store import Store, import_tree
from test_snapshots import write_tree


@pytest.fixture(params=["model", "fuse"])
def trees(request, tmp_path, fsck_clean):
    """``new(source) -> (tree, ext4)``: an execution of a snapshot of ``source`` through the
    model or the mount, and an ext4 copy of ``source`` (``cp -a``) to compare with; the
    model's store passes fsck at the end."""
    closing = []

    def new(source: Path):
        ext4 = OsTree(tmp_path / "ext4")
        run("cp", "-a", source, ext4.root)
        if request.param == "model":
            store = Store(tmp_path / "data")
            closing.append(store)
            overlay = Overlay(store)
            ex = overlay.create_execution(import_tree(store, source), "e")
            return ModelTree(overlay, ex), ext4
        d = request.getfixturevalue("shared_daemon")
        eid = d.create(d.snapshot(source))
        closing.append((d, eid))
        return OsTree(d.exec_path(eid)), ext4

    yield new
    for item in closing:
        if isinstance(item, Store):
            fsck_clean(item)
            item.close()
        else:
            d, eid = item
            d.ctl(f"release {eid}")


# ----- case 1: rename of a snapshot directory with children ---------------------------------------

def test_case1_rename_of_a_snapshot_directory_with_children(trees, tmp_path):
    src = write_tree(tmp_path / "src", {
        "proj/src/main.py": b"main\n", "proj/src/pkg/mod.py": b"mod\n",
        "proj/src/pkg/data/x.bin": bytes(range(256)), "proj/src/gone/old": b"old\n",
        "proj/README": b"readme\n"})
    t, ext4 = trees(src)

    def steps(t) -> list:
        out = []
        t.rename("proj/src", "proj/lib")
        out.append(t.listdir("proj"))
        out.append(t.read("proj/lib/pkg/data/x.bin"))
        t.mkdir("proj/src")
        out.append(t.listdir("proj/src"))
        t.write("proj/src/main.py", b"new main\n")
        out.append(t.read("proj/lib/main.py"))
        t.rename("proj/lib/pkg", "pkg")  # out of the moved tree
        out.append(t.listdir("proj/lib"))
        t.unlink("proj/src/main.py")
        t.rename("proj/lib", "proj/src")  # back over the empty new one
        out.append(t.listdir("proj/src"))
        t.mkdir("proj/lib")
        out.append(t.listdir("proj/lib"))
        out.append(t.listdir("pkg"))
        return out

    assert steps(t) == steps(ext4) == [
        [b"README", b"lib"], bytes(range(256)), [], b"main\n", [b"gone", b"main.py"],
        [b"gone", b"main.py"], [], [b"data", b"mod.py"]]
    assert signature(t) == signature(ext4)


# ----- case 7: writes through a descriptor opened before a rename -----------------------------------

def test_case7_writes_through_an_fd_opened_before_a_rename(trees, tmp_path):
    src = write_tree(tmp_path / "src", {"orig": b"orig\n", "target": b"old target\n"})
    t, ext4 = trees(src)

    def steps(t) -> list:
        t.write("tmp", b"a\n")
        t.rename("tmp", "final")
        s = t.lstat("final")
        out = [t.read("final"), t.exists("tmp"), (s.kind, s.nlink, s.size)]
        h = t.open("tmp2", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            h.write(b"1")
            t.rename("tmp2", "final")  # replaces the first final
            h.write(b"2")
            out.append(h.fstat().nlink)
        finally:
            h.close()
        out.append(t.read("final"))
        old = t.open("target", os.O_RDONLY)  # the file the rename replaces
        h = t.open("orig", os.O_WRONLY | os.O_APPEND)  # a snapshot file
        try:
            t.rename("orig", "target")
            h.write(b"after\n")
            out.append([old.fstat().nlink, old.pread(100, 0)])
        finally:
            h.close()
            old.close()
        out.append(t.read("target"))
        out.append(t.listdir())
        return out

    assert steps(t) == steps(ext4) == [
        b"a\n", False, ("f", 1, 2), 1, b"12", [0, b"old target\n"], b"orig\nafter\n",
        [b"final", b"target"]]


# ----- case 11: unlinked open files ---------------------------------------------------------------

def test_case11_unlinked_open_file_then_rmdir(trees, tmp_path):
    src = write_tree(tmp_path / "src", {"d/f": b"from the snapshot\n", "keep": b""})
    t, ext4 = trees(src)

    def steps(t) -> list:
        t.mkdir("n")
        t.write("n/g", b"made here\n")
        out = []
        for rel, parent, data in [("d/f", "d", b"from the snapshot\n"),
                                  ("n/g", "n", b"made here\n")]:
            h = t.open(rel, os.O_RDWR)
            try:
                t.unlink(rel)
                out.append(t.listdir(parent))  # no hidden leftover entry
                out.append(h.fstat().nlink)
                t.rmdir(parent)
                out.append(t.exists(parent))
                out.append(h.pread(100, 0) == data)
                h.pwrite(b"+", len(data))
                out.append(h.pread(100, 0) == data + b"+")
                out.append((h.fstat().nlink, h.fstat().size == len(data) + 1))
            finally:
                h.close()
        out.append(t.listdir())
        t.mkdir("d")
        out.append(t.listdir("d"))
        return out

    assert steps(t) == steps(ext4) == [
        [], 0, False, True, True, (0, True)] * 2 + [[b"keep"], []]


# ----- case 12: names -----------------------------------------------------------------------------

NFC = unicodedata.normalize("NFC", "café").encode()
NFD = unicodedata.normalize("NFD", "café").encode()
LATIN1 = b"latin1-\xe9\xff.txt"  # not UTF-8
LONGEST = b"n" * 251 + b".txt"
LONGEST_MULTIBYTE = "é".encode() * 127 + b"x"


def test_case12_names(trees, tmp_path):
    assert NFC != NFD and len(LONGEST) == len(LONGEST_MULTIBYTE) == 255
    src = tmp_path / "src"
    src.mkdir()
    for name, data in [(NFC, b"nfc"), (NFD, b"nfd"), (LATIN1, b"latin1"), (LONGEST, b"long"),
                       (LONGEST_MULTIBYTE, b"multi")]:
        with open(os.path.join(bytes(src), name), "wb") as f:
            f.write(data)
    t, ext4 = trees(src)
    too_long = b"m" * 256

    def steps(t) -> list:
        out = [t.listdir()]
        out += [t.read(n) for n in (NFC, NFD, LATIN1, LONGEST, LONGEST_MULTIBYTE)]
        new_nfc, new_nfd = b"new-" + NFC, b"new-" + NFD
        for name in (new_nfc, new_nfd, b"new-\x80\xfe", b"d" * 255):
            t.write(name, name)
        t.mkdir(b"D" * 255)
        t.rename(LATIN1, b"renamed-\xc0")
        t.symlink(LATIN1, b"L" * 255)
        out.append([errno_of(t.open, too_long, os.O_WRONLY | os.O_CREAT),
                    errno_of(t.mkdir, too_long),
                    errno_of(t.symlink, b"t", too_long),
                    errno_of(t.link, NFC, too_long),
                    errno_of(t.rename, NFC, too_long),
                    errno_of(t.lstat, too_long),
                    errno_of(t.lstat, b"D" * 255 + b"/" + too_long)])
        out.append(t.listdir())
        out += [t.read(n) for n in (new_nfc, new_nfd, b"renamed-\xc0")]
        out.append(t.readlink(b"L" * 255))
        t.unlink(NFD)
        out.append(t.listdir())
        out.append(t.read(NFC))
        return out

    got = steps(t)
    assert got[0] == sorted([NFC, NFD, LATIN1, LONGEST, LONGEST_MULTIBYTE])
    assert got[1:6] == [b"nfc", b"nfd", b"latin1", b"long", b"multi"]
    # open(O_CREAT), mkdir, symlink, link, rename, stat, lstat below a 255-byte directory
    assert got[6] == ["ENAMETOOLONG"] * 7
    assert got[7] == sorted([NFC, NFD, b"renamed-\xc0", LONGEST, LONGEST_MULTIBYTE,
                             b"new-" + NFC, b"new-" + NFD, b"new-\x80\xfe", b"d" * 255,
                             b"D" * 255, b"L" * 255])
    assert got[8:12] == [b"new-" + NFC, b"new-" + NFD, b"latin1", LATIN1]
    assert NFD not in got[12] and NFC in got[12] and got[13] == b"nfc"
    assert got == steps(ext4)


# ----- O_TMPFILE (issue 22; tests/test_tmpfile.py has the programs and what only rametfs has) -----

def test_tmpfile_linked_once_unless_o_excl(trees, tmp_path):
    src = write_tree(tmp_path / "src", {"d/keep": b"k\n"})
    t, ext4 = trees(src)
    if isinstance(t, OsTree) and not hasattr(pyfuse3.Operations, "tmpfile"):
        pytest.skip("O_TMPFILE through the mount needs the patched pyfuse3 (tools/pyfuse3/)")

    def steps(t) -> list:
        out = []
        h = t.open("d", os.O_TMPFILE | os.O_RDWR, 0o600)
        try:
            out.append(h.fstat()[:4])
            h.write(b"no name yet\n")
            out.append(t.listdir("d"))  # no hidden entry
            t.link_open(h, "d/named")
            h.write(b"named\n")
            out.append((h.fstat().nlink, t.lstat("d/named").ino == h.fstat().ino))
            out.append(t.read("d/named"))
            out.append(errno_of(t.link_open, h, "d/keep"))  # the name is taken
            t.unlink("d/named")
            out.append(errno_of(t.link_open, h, "d/twice"))  # linkable once only
        finally:
            h.close()
        h = t.open("d", os.O_TMPFILE | os.O_RDWR | os.O_EXCL, 0o600)
        try:
            out.append(errno_of(t.link_open, h, "d/excl"))  # never linkable
        finally:
            h.close()
        h = t.open("d/keep", os.O_RDWR)
        try:
            t.unlink("d/keep")
            out.append(errno_of(t.link_open, h, "d/keep-again"))  # an unlinked open file
        finally:
            h.close()
        out.append(t.listdir("d"))
        return out

    assert steps(t) == steps(ext4) == [
        ("f", 0o600, 0, 0), [b"keep"], (1, True), b"no name yet\nnamed\n", "EEXIST", "ENOENT",
        "ENOENT", "ENOENT", []]
