"""Snapshots through the kernel mount: what an import keeps, and that a snapshot never changes.

Every expected value comes from the source tree on the host file system (ext4 under pytest's
basetemp), read with the same calls.  :func:`tree_signature` is the comparison the other
mounted test files use too.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import run

PAGE = 64 * 1024
BIG_SIZE = 3 * PAGE + 1234  # several whole pages and a tail
SNAPSHOT_ID = re.compile(r"[0-9a-f]{64}")
TIMES_NS = (1_600_000_000_123_456_789, 1_500_000_000_987_654_321)  # (atime, mtime)


def tree_signature(root: str | os.PathLike, *, times: bool = True) -> dict[str, str]:
    """Everything rametfs must keep of the tree at ``root``: relative path -> one short line.

    A line holds the type, permission bits, uid:gid, link count, ``user.*`` xattrs, with
    ``times`` the mtime in ns, then the size and content hash (files) or the target
    (symlinks), and for a file with hard links in the tree the paths sharing its inode.
    Lines stay short so that a failed comparison shows every differing field.  Symlinks are
    never followed; ``.ramet`` is invisible (readdir never lists it).
    """
    root = Path(root)
    out: dict[str, str] = {}
    inodes: dict[str, int] = {}

    def visit(path: Path, rel: str) -> None:
        st = os.lstat(path)
        kind = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "link"}.get(
            stat.S_IFMT(st.st_mode), oct(stat.S_IFMT(st.st_mode)))
        xattrs = {n: os.getxattr(path, n, follow_symlinks=False)
                  for n in sorted(os.listxattr(path, follow_symlinks=False))
                  if n.startswith("user.")}
        line = (f"{kind} {stat.S_IMODE(st.st_mode):04o} {st.st_uid}:{st.st_gid} "
                f"nlink={st.st_nlink}")
        if xattrs:
            line += f" xattrs={xattrs}"
        if times:
            line += f" mtime={st.st_mtime_ns}"
        if stat.S_ISREG(st.st_mode):
            line += f" {st.st_size}B sha256={hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
            inodes[rel] = st.st_ino
        elif stat.S_ISLNK(st.st_mode):
            line += f" -> {os.readlink(path)}"
        out[rel] = line
        if stat.S_ISDIR(st.st_mode):
            for name in sorted(os.listdir(path)):
                visit(path / name, f"{rel}/{name}" if rel != "." else name)

    visit(root, ".")
    by_inode: dict[int, list[str]] = {}
    for rel, ino in inodes.items():
        by_inode.setdefault(ino, []).append(rel)
    for rel, ino in inodes.items():
        if len(by_inode[ino]) > 1:
            out[rel] += f" links={','.join(sorted(by_inode[ino]))}"
    return out


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    """Create ``root`` holding ``files`` (relative path -> bytes), parents as needed."""
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


@pytest.fixture
def rich_source(tmp_path) -> Path:
    """A source tree with one of everything an import must keep, made as root."""
    src = write_tree(tmp_path / "src", {
        "empty": b"",
        "small.txt": b"hello\n",
        "big.bin": os.urandom(BIG_SIZE),
        "pages.bin": os.urandom(2 * PAGE),  # ends exactly on a page boundary
        "dir/sub/deep.txt": b"deep\n",
        "dir/owned.txt": b"owned\n",
        "hl1": b"linked content\n",
    })
    os.link(src / "hl1", src / "dir" / "hl2")
    os.symlink("/etc/passwd", src / "passwd_link")
    os.symlink("/etc", src / "etc_link")
    os.symlink("small.txt", src / "rel_link")
    os.symlink("does/not/exist", src / "dangling")
    os.chmod(src / "small.txt", 0o640)
    os.chmod(src / "big.bin", 0o751)
    os.chmod(src / "dir" / "sub", 0o700)
    os.chown(src / "dir" / "owned.txt", 1234, 5678)
    os.chown(src / "dir" / "sub", 4321, 8765)
    os.chown(src / "rel_link", 2345, 6789, follow_symlinks=False)
    os.setxattr(src / "small.txt", "user.color", b"blue")
    os.setxattr(src / "small.txt", "user.empty", b"")
    os.setxattr(src / "dir", "user.kind", b"directory")
    # Times last, deepest first: creating entries changes their directory's mtime.
    for path in sorted(src.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        os.utime(path, ns=TIMES_NS, follow_symlinks=False)
    os.utime(src, ns=TIMES_NS)
    return src


def test_import_keeps_every_entry_and_attribute(shared_daemon, rich_source):
    reply = shared_daemon.ctl(f"snapshot {rich_source}")
    snap = shared_daemon.snap_path(reply["snapshot"])

    assert tree_signature(snap) == tree_signature(rich_source)
    stats = reply["stats"]
    assert (stats["files"], stats["dirs"], stats["symlinks"]) == (8, 3, 4)


def test_import_keeps_exact_values(shared_daemon, rich_source):
    snap = shared_daemon.snap_path(shared_daemon.snapshot(rich_source))

    big = (rich_source / "big.bin").read_bytes()
    assert (snap / "big.bin").read_bytes() == big
    with open(snap / "big.bin", "rb") as f:  # reads that straddle page boundaries
        assert os.pread(f.fileno(), 100, PAGE - 50) == big[PAGE - 50:PAGE + 50]
        assert os.pread(f.fileno(), 5000, 3 * PAGE - 10) == big[3 * PAGE - 10:]
        assert os.pread(f.fileno(), 10, BIG_SIZE) == b""
    assert (snap / "empty").read_bytes() == b""
    assert os.stat(snap / "empty").st_size == 0
    small = os.stat(snap / "small.txt")
    assert (stat.S_IMODE(small.st_mode), small.st_mtime_ns) == (0o640, TIMES_NS[1])
    assert os.getxattr(snap / "small.txt", "user.color") == b"blue"
    assert os.getxattr(snap / "small.txt", "user.empty") == b""
    assert sorted(os.listxattr(snap / "small.txt")) == ["user.color", "user.empty"]
    assert os.getxattr(snap / "dir", "user.kind") == b"directory"
    owned = os.stat(snap / "dir" / "owned.txt")
    assert (owned.st_uid, owned.st_gid) == (1234, 5678)
    sub = os.stat(snap / "dir" / "sub")
    assert (stat.S_IMODE(sub.st_mode), sub.st_uid, sub.st_gid) == (0o700, 4321, 8765)
    link = os.lstat(snap / "rel_link")
    assert (link.st_uid, link.st_gid, link.st_mtime_ns) == (2345, 6789, TIMES_NS[1])


def test_import_keeps_hard_links(shared_daemon, rich_source):
    snap = shared_daemon.snap_path(shared_daemon.snapshot(rich_source))

    one, two = os.stat(snap / "hl1"), os.stat(snap / "dir" / "hl2")
    assert one.st_ino == two.st_ino
    assert (one.st_nlink, two.st_nlink) == (2, 2)
    assert (snap / "dir" / "hl2").read_bytes() == b"linked content\n"
    assert os.stat(snap / "small.txt").st_ino != one.st_ino


def test_symlinks_are_stored_never_followed(shared_daemon, rich_source):
    reply = shared_daemon.ctl(f"snapshot {rich_source}")
    snap = shared_daemon.snap_path(reply["snapshot"])

    for name, target in [("passwd_link", "/etc/passwd"), ("etc_link", "/etc"),
                         ("rel_link", "small.txt"), ("dangling", "does/not/exist")]:
        assert stat.S_ISLNK(os.lstat(snap / name).st_mode), name
        assert os.readlink(snap / name) == target
    walked = sorted(os.path.relpath(os.path.join(d, n), snap)
                    for d, dirs, files in os.walk(snap) for n in dirs + files)
    assert walked == sorted(p for p in tree_signature(rich_source) if p != ".")
    # Nothing from /etc was read: the byte count is the tree's own regular files.
    assert reply["stats"]["bytes"] == sum(os.lstat(p).st_size for p in rich_source.rglob("*")
                                          if p.is_file() and not p.is_symlink())


def test_reimport_of_unchanged_tree_stores_no_new_chunks(shared_daemon, tmp_path):
    src = write_tree(tmp_path / "src", {"a.bin": os.urandom(PAGE + 10),
                                        "d/b.bin": os.urandom(5000), "d/c.txt": os.urandom(2)})
    first = shared_daemon.ctl(f"snapshot {src}")["stats"]
    second = shared_daemon.ctl(f"snapshot {src}")["stats"]
    run("cp", "-a", src, tmp_path / "copy")  # same bytes at other paths, inodes and ctimes
    third = shared_daemon.ctl(f"snapshot {tmp_path / 'copy'}")["stats"]

    assert first["new_chunk_bytes"] > 0
    assert first["new_chunks"] == 4
    for stats in (second, third):
        assert (stats["new_chunks"], stats["new_chunk_bytes"]) == (0, 0)
        assert (stats["files"], stats["bytes"]) == (3, PAGE + 10 + 5000 + 2)
    # The second import read no file (stat cache); the copy's files were all read again.
    assert (first["cached_files"], second["cached_files"], third["cached_files"]) == (0, 3, 0)


def test_reimport_reads_a_file_rewritten_in_place_with_its_mtime_put_back(shared_daemon,
                                                                          tmp_path):
    src = write_tree(tmp_path / "src", {"a.txt": b"one\n", "b.txt": b"two\n"})
    shared_daemon.ctl(f"snapshot {src}")
    before = os.stat(src / "a.txt")
    (src / "a.txt").write_bytes(b"ONE\n")  # same size; only ctime tells
    os.utime(src / "a.txt", ns=(before.st_atime_ns, before.st_mtime_ns))
    reply = shared_daemon.ctl(f"snapshot {src}")

    assert reply["stats"]["cached_files"] == 1
    assert (shared_daemon.snap_path(reply["snapshot"]) / "a.txt").read_bytes() == b"ONE\n"


def test_cli_snapshot_prints_the_id_alone(shared_daemon, tmp_path):
    src = write_tree(tmp_path / "src", {"f.txt": b"cli\n"})
    proc = run(sys.executable, "-m", "rametfs", "snapshot", "-m", shared_daemon.mnt, src,
               "--label", "from the cli")

    assert SNAPSHOT_ID.fullmatch(proc.stdout.rstrip("\n"))
    assert proc.stdout.endswith("\n") and proc.stdout.count("\n") == 1
    sid = proc.stdout.strip()
    record, = [s for s in shared_daemon.status()["snapshots"] if s["id"] == sid]
    assert (record["label"], record["source"], record["parents"]) == ("from the cli", str(src), [])
    assert sid in os.listdir(shared_daemon.mnt / "snapshots")
    assert (shared_daemon.snap_path(sid) / "f.txt").read_bytes() == b"cli\n"


def _open_and_write(path: Path, flags: int) -> None:
    # With open-less FUSE the kernel does not ask the daemon about an open: the write (or
    # the truncate of O_TRUNC) is what fails.
    fd = os.open(path, flags)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)


def _erofs_operations(snap: Path) -> dict[str, Callable[[], object]]:
    """Every kind of write, each on an existing entry of ``snap`` or a new name in it."""
    f, d = snap / "small.txt", snap / "dir"
    return {
        "open O_WRONLY": lambda: _open_and_write(f, os.O_WRONLY),
        "open O_RDWR": lambda: _open_and_write(f, os.O_RDWR),
        "open O_APPEND": lambda: _open_and_write(f, os.O_WRONLY | os.O_APPEND),
        "open O_TRUNC": lambda: _open_and_write(f, os.O_WRONLY | os.O_TRUNC),
        "create": lambda: os.open(snap / "new", os.O_WRONLY | os.O_CREAT, 0o644),
        "mkdir": lambda: os.mkdir(snap / "newdir"),
        "mkdir in snapshots/": lambda: os.mkdir(snap.parent / ("0" * 64)),
        "unlink": lambda: os.unlink(f),
        "rmdir": lambda: os.rmdir(d / "sub"),
        "rename": lambda: os.rename(f, snap / "renamed"),
        "rename dir": lambda: os.rename(d, snap / "renamed_dir"),
        "symlink": lambda: os.symlink("x", snap / "newlink"),
        "link": lambda: os.link(f, snap / "newhard"),
        "mknod fifo": lambda: os.mkfifo(snap / "fifo"),
        "chmod": lambda: os.chmod(f, 0o600),
        "chown": lambda: os.chown(f, 1, 1),
        "utime": lambda: os.utime(f, ns=(1, 1)),
        "truncate": lambda: os.truncate(f, 0),
        "setxattr": lambda: os.setxattr(f, "user.new", b"v"),
        "removexattr": lambda: os.removexattr(f, "user.color"),
    }


@pytest.mark.parametrize("operation", list(_erofs_operations(Path("/"))))
def test_every_write_to_a_snapshot_fails_with_erofs(shared_daemon, rich_source, operation):
    snap = shared_daemon.snap_path(shared_daemon.snapshot(rich_source))
    before = tree_signature(snap)

    with pytest.raises(OSError) as caught:
        _erofs_operations(snap)[operation]()
    assert caught.value.errno == errno.EROFS, caught.value
    assert tree_signature(snap) == before
