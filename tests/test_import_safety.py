"""Imports of a tree someone else controls: they see exactly one tree and cannot hang.

The source tree belongs to an unprivileged user (uid 65534) who changes it while root imports
it.  The attacker is a real separate process (forked, then ``setuid(65534)``) that loops
``renameat2(RENAME_EXCHANGE)`` between two of its names, or rewrites one of its files, for as
long as the test imports, through the daemon (the ``ramet`` fixture's FUSE mode: the root
``.ramet/ctl`` of the shared daemon, which runs as root) and in fallback mode (the importer in
this process).  Whatever the timing, no snapshot ever holds a byte of the root-only files the
attacker's symlinks point at, every import ends in bounded time, and each either stores the
tree as it was listed or fails with EAGAIN naming the path that changed (``on_change="skip"``:
leaves that entry out and counts it in the stats).

Also here: a source path of several thousand bytes, a 4,096-deep tree, timestamps outside
what a record holds (a tmpfs source), and fsck's size check and depth.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import cli_where, ctl_command, run
from rametfs import Ramet, RametError
from rametfs.store import Entry, Store, fsck, import_tree
from rametfs.store.format import NS_PER_S, TIME_MAX_S, TIME_MIN_S
from rametfs.store.importer import put_directory

NOBODY = 65534
RENAME_EXCHANGE = 2  # linux/fs.h
# A race test imports until it saw the tree change under an import RACE_HITS times (on a
# loaded machine the attacker may get a core for a fraction of the imports only), at most
# RACE_IMPORTS times.  Today's code leaked within 6 imports (a file) or 29 (a directory).
RACE_HITS = 3
RACE_IMPORTS = 400
IMPORT_TIMEOUT_S = 20  # an import of these small trees takes milliseconds
PUBLIC = b"the attacker's own bytes\n"
PUBLIC_TARGET = "public-target"
SECRET_MARK = b"SECRET-"  # the root-only files' bytes begin with it; nothing else holds it
DEEP = 4096

_libc = ctypes.CDLL(None, use_errno=True)


# ----- the attacker ---------------------------------------------------------------------------

@contextlib.contextmanager
def attacker(directory: Path, attack: Callable[[int, Callable[[], None]], None]
             ) -> Iterator[None]:
    """Run ``attack(dir_fd)`` in a child process as uid and gid 65534 while the block runs.

    ``dir_fd`` is ``directory`` opened by root before the fork (pytest's basetemp is 0700, so
    the attacker reaches its tree only through it; renames are checked against the directory
    itself, which the attacker owns).  ``attack(dir_fd, started)`` loops for ever and calls
    ``started()`` after its first successful step; the block runs from then on, and the child
    is killed (SIGKILL, by its pid) after it.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the attacker: no return from here
        try:
            os.close(ready_r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            attack(fd, lambda: os.write(ready_w, b"!"))
        finally:
            os._exit(1)
    os.close(ready_w)
    try:
        ready, _, _ = select.select([ready_r], [], [], 10)
        assert ready and os.read(ready_r, 1) == b"!", "the attacker could not make one step"
        assert os.stat(directory).st_uid == NOBODY
        yield
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
        os.close(fd)


def exchange(a: str, b: str) -> Callable:
    """An attack: swap the names ``a`` and ``b`` (``renameat2(RENAME_EXCHANGE)``), for ever."""
    def attack(fd: int, started: Callable[[], None]) -> None:
        first = True
        while _libc.renameat2(fd, a.encode(), fd, b.encode(), RENAME_EXCHANGE) == 0:
            if first:
                started()
                first = False
    return attack


def rewrite(name: str) -> Callable:
    """An attack: rewrite file ``name`` for ever, each time 1 to 200,000 bytes of one letter."""
    def attack(fd: int, started: Callable[[], None]) -> None:
        f = os.open(name, os.O_WRONLY, dir_fd=fd)
        for i in range(1 << 62):
            size = 1 + i * 7919 % 200_000
            os.ftruncate(f, 0)
            os.pwrite(f, bytes([97 + i % 26]) * size, 0)
            if i == 0:
                started()
    return attack


def give_to_nobody(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)


@pytest.fixture(params=["fuse", "fallback"])
def own_ramet(request, tmp_path) -> Iterator[Ramet]:
    """A ``Ramet`` on a store of this test's own (so ``rametfs fsck`` checks only what the
    test made): on a daemon of its own (the root ``ctl``), or in fallback mode."""
    if request.param == "fuse":
        yield Ramet(request.getfixturevalue("daemon").mnt)
    else:
        with Ramet(data=tmp_path / "data", mode="fallback") as r:
            yield r


# ----- reading a snapshot back ------------------------------------------------------------------

def read_tree(root: str | os.PathLike) -> dict[bytes, tuple]:
    """Every entry below ``root``, read through directory fds (so paths longer than PATH_MAX
    read too): relative path -> ``("file", bytes, st_size, xattrs)``, ``("link", target)``,
    ``("dir", xattrs)`` or ``("other", file type)``.  Symlinks are never followed."""
    out: dict[bytes, tuple] = {}
    stack = [(b"", os.open(root, os.O_RDONLY | os.O_DIRECTORY))]
    while stack:
        rel, fd = stack.pop()
        try:
            for name in sorted(os.listdir(fd)):
                path = rel + b"/" + os.fsencode(name)
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    out[path] = ("link", os.readlink(name, dir_fd=fd))
                elif stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                    flags = os.O_RDONLY | os.O_NOFOLLOW | (
                        os.O_DIRECTORY if stat.S_ISDIR(st.st_mode) else 0)
                    sub = os.open(name, flags, dir_fd=fd)
                    xattrs = {n: os.getxattr(sub, n) for n in sorted(os.listxattr(sub))}
                    if stat.S_ISDIR(st.st_mode):
                        out[path] = ("dir", xattrs)
                        stack.append((path, sub))
                        continue
                    with open(sub, "rb") as f:
                        out[path] = ("file", f.read(), st.st_size, xattrs)
                else:
                    out[path] = ("other", stat.S_IFMT(st.st_mode))
        finally:
            os.close(fd)
    return out


@contextlib.contextmanager
def snapshot_root(ramet: Ramet, snap: str) -> Iterator[Path]:
    """Where snapshot ``snap`` can be read: ``snapshots/<id>`` of the mount, or in fallback
    mode (no mount) an execution of it, released after."""
    if ramet.mode == "fuse":
        yield ramet.mount / "snapshots" / snap
        return
    ex = ramet.create(snap)
    try:
        yield ex.path
    finally:
        ramet.release(ex)


def read_trees(ramet: Ramet, snaps: list[str]) -> dict[str, dict]:
    """:func:`read_tree` of each snapshot in ``snaps``, by id."""
    trees = {}
    for snap in snaps:
        with snapshot_root(ramet, snap) as root:
            trees[snap] = read_tree(root)
    return trees


def stats_of(ramet: Ramet, snap: str) -> dict:
    return next(s for s in ramet.snapshots() if s["id"] == snap)


def fsck_problems(ramet: Ramet) -> str:
    """``rametfs fsck`` of the store behind ``ramet`` (the real program; it reads beside a
    live daemon): its problem lines, empty when the store is whole."""
    data = ramet.data if ramet.mode == "fallback" else ramet.status()["data"]
    proc = run(sys.executable, "-m", "rametfs", "fsck", "--data", data, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.stdout


def bounded(call: Callable[[], object], unblock: Callable[[], None]) -> object:
    """``call()`` in a thread; its result, or its exception raised here.  When it has not
    returned after :data:`IMPORT_TIMEOUT_S`, ``unblock()`` is called until it does (so a hung
    import does not hang the test run) and the test fails."""
    result: list = []

    def target() -> None:
        try:
            result.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result.append((False, exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(IMPORT_TIMEOUT_S)
    if thread.is_alive():
        while thread.is_alive():
            unblock()
            thread.join(0.1)
        pytest.fail(f"an import did not finish within {IMPORT_TIMEOUT_S} s")
    ok, value = result[0]
    if not ok:
        raise value
    return value


def race(ramet: Ramet, src: Path, on_change: str,
         unblock: Callable[[], None] = lambda: None) -> tuple[list[str], list[RametError]]:
    """Import ``src`` with ``on_change`` until :data:`RACE_HITS` imports saw it change
    (failed, or skipped an entry), at most :data:`RACE_IMPORTS` times; the snapshots made
    and the errors met (see :func:`check_failures`)."""
    options = {} if on_change == "fail" else {"on_change": on_change}  # fail: the default
    snaps, failures = [], []
    hits = 0
    while hits < RACE_HITS and len(snaps) + len(failures) < RACE_IMPORTS:
        try:
            snap = bounded(lambda: ramet.snapshot(src, **options), unblock)
        except RametError as exc:
            failures.append(exc)
            hits += 1
        else:
            snaps.append(snap)
            hits += on_change == "skip" and stats_of(ramet, snap).get("skipped", 0) > 0
    return snaps, failures


def check_failures(failures: list[RametError], src: Path) -> None:
    """Each failed import said EAGAIN and named the path below ``src`` that changed."""
    for exc in failures:
        assert exc.errno == errno.EAGAIN, exc
        assert f"{src}/" in str(exc) and "changed during the import" in str(exc), exc


# ----- a file swapped for a symlink, a directory for a symlink, a FIFO for a file ----------------

@pytest.fixture
def secret(tmp_path) -> None:
    """Root-only files beside the source: ``secret`` (0600) and ``vault/`` (0700) holding
    ``x`` (the same bytes, also as its xattr) and a symlink whose target is those bytes."""
    data = SECRET_MARK + os.urandom(12).hex().encode()
    (tmp_path / "secret").write_bytes(data)
    os.chmod(tmp_path / "secret", 0o600)
    (tmp_path / "vault").mkdir(mode=0o700)
    (tmp_path / "vault" / "x").write_bytes(data)
    os.setxattr(tmp_path / "vault" / "x", "user.k", data)
    os.symlink(data, tmp_path / "vault" / "y")


def check_no_secret(trees: dict[str, dict]) -> None:
    """No snapshot of ``trees`` holds root-only bytes (:data:`SECRET_MARK`) in a file, an
    xattr or a symlink target, not even a part (a file read is cut at its entry's size)."""
    leaked = {snap: tree for snap, tree in trees.items() if SECRET_MARK in repr(tree).encode()}
    assert not leaked, f"{len(leaked)} of {len(trees)} snapshots hold root-only bytes: {leaked}"


@pytest.mark.usefixtures("secret")
@pytest.mark.parametrize("on_change", ["fail", "skip"])
def test_a_file_swapped_for_a_symlink_never_imports_the_target(own_ramet, tmp_path, on_change):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(PUBLIC)
    os.symlink(tmp_path / "secret", src / "l")
    give_to_nobody(src)
    expected = {"file": ("file", PUBLIC, len(PUBLIC), {}),
                "link": ("link", str(tmp_path / "secret"))}
    with attacker(src, exchange("f", "l")):
        snaps, failures = race(own_ramet, src, on_change)
    trees = read_trees(own_ramet, snaps)
    check_no_secret(trees)
    skipped = 0
    for snap, tree in trees.items():
        # Each name is the file or the link, never both the same one.
        assert all(entry in expected.values() for entry in tree.values()), tree
        assert set(tree) <= {b"/f", b"/l"} and len({e[0] for e in tree.values()}) == len(tree)
        assert stats_of(own_ramet, snap)["skipped"] == 2 - len(tree)
        skipped += 2 - len(tree)
    check_raced(own_ramet, src, on_change, failures, skipped, len(snaps))


@pytest.mark.usefixtures("secret")
@pytest.mark.parametrize("on_change", ["fail", "skip"])
def test_a_directory_swapped_for_a_symlink_never_imports_the_root_only_one(
        own_ramet, tmp_path, on_change):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "x").write_bytes(PUBLIC)
    os.setxattr(src / "d" / "x", "user.k", b"public")
    os.symlink(PUBLIC_TARGET, src / "d" / "y")
    os.symlink(tmp_path / "vault", src / "dl")
    give_to_nobody(src)
    with attacker(src, exchange("d", "dl")):
        snaps, failures = race(own_ramet, src, on_change)
    whole = {b"/x": ("file", PUBLIC, len(PUBLIC), {"user.k": b"public"}),
             b"/y": ("link", PUBLIC_TARGET)}
    trees = read_trees(own_ramet, snaps)
    check_no_secret(trees)
    skipped = 0
    for snap, tree in trees.items():
        dirs = [p for p, e in tree.items() if e[0] == "dir"]
        links = [p for p, e in tree.items() if e[0] == "link" and p.count(b"/") == 1]
        assert len(dirs) <= 1 and len(links) <= 1 and set(dirs + links) <= {b"/d", b"/dl"}
        for d in dirs:
            assert {p[len(d):]: e for p, e in tree.items() if p.startswith(d + b"/")} == whole
        for link in links:
            assert tree[link] == ("link", str(tmp_path / "vault"))
        assert stats_of(own_ramet, snap)["skipped"] == 2 - len(dirs) - len(links)
        skipped += 2 - len(dirs) - len(links)
    check_raced(own_ramet, src, on_change, failures, skipped, len(snaps))


def check_raced(ramet, src, on_change: str, failures: list, skipped: int, imports: int) -> None:
    """The attacker did race the imports (some entry changed between the listing and its
    open): they failed (``fail``), named rightly, or left entries out (``skip``); fsck is
    clean."""
    check_failures(failures, src)
    if on_change == "fail":
        assert failures and not skipped, (len(failures), imports)
    else:
        assert not failures and skipped, "no import saw the tree change"
    assert fsck_problems(ramet) == ""


def test_a_fifo_swapped_for_a_file_cannot_hang_the_import(ramet, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(PUBLIC)
    os.mkfifo(src / "p")
    give_to_nobody(src)

    def unblock() -> None:  # an import stuck opening the FIFO: give it a writer, so EOF
        for name in ("f", "p"):
            with contextlib.suppress(OSError):
                os.close(os.open(src / name, os.O_WRONLY | os.O_NONBLOCK))

    with attacker(src, exchange("f", "p")):
        snaps, failures = race(ramet, src, "fail", unblock)
        skips, none = race(ramet, src, "skip", unblock)
    kinds = [("file", PUBLIC, len(PUBLIC), {}), ("other", stat.S_IFIFO)]
    skipped = 0
    for snap, tree in read_trees(ramet, snaps + skips).items():
        # One name is the file, the other the FIFO (either may be skipped).
        assert set(tree) <= {b"/f", b"/p"} and all(kind in kinds for kind in tree.values())
        assert len({repr(kind) for kind in tree.values()}) == len(tree), tree
        assert stats_of(ramet, snap)["skipped"] == 2 - len(tree)
        skipped += 2 - len(tree)
    check_failures(failures + none, src)
    assert failures and not none and skipped


@pytest.mark.parametrize("on_change", ["fail", "skip"])
def test_a_file_rewritten_during_the_import_is_stored_whole_or_not_at_all(
        own_ramet, tmp_path, on_change):
    src = tmp_path / "src"
    src.mkdir()
    (src / "g").write_bytes(b"first")
    give_to_nobody(src)
    with attacker(src, rewrite("g")):
        snaps, failures = race(own_ramet, src, on_change)
    trees = read_trees(own_ramet, snaps)
    for tree in trees.values():
        for kind, data, size, _ in tree.values():
            # One version of the file: its bytes are one letter, as many as the entry says.
            assert kind == "file" and len(data) == size and data == data[:1] * size, tree
    assert fsck_problems(own_ramet) == ""  # every entry's size is its content's
    kept = sum(1 for tree in trees.values() if tree)
    for snap, tree in trees.items():
        assert set(tree) <= {b"/g"} and stats_of(own_ramet, snap)["skipped"] == 1 - len(tree)
    check_failures(failures, src)
    if on_change == "fail":
        assert failures and kept == len(snaps), (len(failures), kept)
    else:
        assert not failures and kept < len(snaps), "no import saw the file change"


def test_cli_and_ctl_take_on_change(ramet, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(PUBLIC)
    proc = run(sys.executable, "-m", "rametfs", "snapshot", *cli_where(ramet),
               "--on-change", "skip", src)
    snap = proc.stdout.strip()
    assert stats_of(ramet, snap)["skipped"] == 0
    with snapshot_root(ramet, snap) as root:
        assert read_tree(root) == {b"/f": ("file", PUBLIC, len(PUBLIC), {})}
    bad = run(sys.executable, "-m", "rametfs", "snapshot", *cli_where(ramet),
              "--on-change", "maybe", src, check=False)
    assert bad.returncode == 2 and "'maybe' is not one of 'fail', 'skip'" in bad.stderr
    with pytest.raises(RametError) as info:
        ramet.snapshot(src, on_change="maybe")
    assert (info.value.errno, str(info.value)) == (
        errno.EINVAL, "--on-change must be one of fail, skip, not 'maybe'")
    if ramet.mode == "fuse":
        ctl = ramet.mount / ".ramet" / "ctl"
        reply = ctl_command(ctl, f"snapshot {src} --on-change skip")
        assert reply["stats"]["skipped"] == 0 and reply["stats"]["cached_files"] == 1
        with pytest.raises(OSError) as info:
            ctl_command(ctl, f"snapshot {src} --on-change maybe")
        assert (info.value.errno, info.value.reply["error"]) == (
            errno.EINVAL, "--on-change must be one of fail, skip, not 'maybe'")


# ----- long paths, deep trees, timestamps -------------------------------------------------------

def make_chain(root: Path, names: list[str], data: bytes) -> None:
    """``root/names[0]/names[1]/.../file`` holding ``data``, made through directory fds (the
    whole path may be longer than PATH_MAX)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in names:
            os.mkdir(name, dir_fd=fd)
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        f = os.open("file", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(f, data)
        os.close(f)
    finally:
        os.close(fd)


def remove_chain(root: Path, names: list[str]) -> None:
    """Remove what :func:`make_chain` made, bottom-up through ``..`` (shutil.rmtree
    recurses, so it cannot remove a 4,096-deep tree)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for name in names:
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    os.unlink("file", dir_fd=fd)
    for name in reversed(names):
        parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = parent
        os.rmdir(name, dir_fd=fd)
    os.close(fd)


@pytest.fixture
def long_names(tmp_path) -> Iterator[tuple[Path, list[str]]]:
    """A source whose one file lies 24 directories of 250-byte names down: its path has
    more than 6,000 bytes (an LMDB key holds 511, PATH_MAX is 4,096)."""
    src = tmp_path / "src"
    src.mkdir()
    names = [f"{i:02d}" + "n" * 248 for i in range(24)]
    make_chain(src, names, PUBLIC)
    yield src, names
    remove_chain(src, names)


def test_a_source_path_of_thousands_of_bytes_imports_and_hits_the_stat_cache(own_ramet,
                                                                             long_names):
    src, names = long_names
    assert len(str(src)) + sum(len(n) + 1 for n in names) > 6000
    first = own_ramet.snapshot(src)
    again = own_ramet.snapshot(src)
    assert stats_of(own_ramet, again)["cached_files"] == 1  # found by its (hashed) key
    stats = stats_of(own_ramet, first)
    assert (stats["files"], stats["dirs"], stats["bytes"]) == (1, 25, len(PUBLIC))
    assert fsck_problems(own_ramet) == ""
    if own_ramet.mode == "fuse":  # (a fallback execution is a copy made by path: ENAMETOOLONG)
        tree = read_tree(own_ramet.mount / "snapshots" / first)
        path = b"".join(b"/" + n.encode() for n in names) + b"/file"
        assert tree[path] == ("file", PUBLIC, len(PUBLIC), {}) and len(tree) == 25


@pytest.fixture
def deep_source(tmp_path) -> Iterator[tuple[Path, list[str]]]:
    """A source :data:`DEEP` directories deep (``d/d/.../d/file``), made and removed
    through directory fds."""
    src = tmp_path / "deep"
    src.mkdir()
    names = ["d"] * DEEP
    make_chain(src, names, PUBLIC)
    yield src, names
    remove_chain(src, names)


def read_chain(root: Path, names: list[str]) -> bytes:
    """The bytes of ``root/names.../file``, opened one directory at a time."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for name in names:
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    try:
        with open(os.open("file", os.O_RDONLY, dir_fd=fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def test_a_tree_4096_directories_deep_imports_mounts_and_reads_back(shared_daemon,
                                                                      deep_source):
    src, names = deep_source
    reply = shared_daemon.ctl(f"snapshot {src}")
    assert reply["stats"]["dirs"] == DEEP + 1 and reply["stats"]["files"] == 1
    assert read_chain(shared_daemon.snap_path(reply["snapshot"]), names) == PUBLIC
    ex = shared_daemon.create(reply["snapshot"])
    try:
        assert read_chain(shared_daemon.exec_path(ex), names) == PUBLIC
    finally:
        shared_daemon.ctl(f"release {ex}")


def test_the_library_imports_and_checks_a_4096_deep_tree(tmp_path, deep_source):
    src, names = deep_source
    store = Store(tmp_path / "store")
    try:
        snap = import_tree(store, src)
        assert snap.stats["dirs"] == DEEP + 1 and snap.stats["skipped"] == 0
        entry = snap.root
        for _ in names:
            entry = store.tree(entry.ref)[b"d"]
        size = store.content(store.tree(entry.ref)[b"file"].ref).size
        assert size == len(PUBLIC)
        report = fsck(store)
        assert report.problems == [] and report.trees == DEEP + 1
    finally:
        store.close()


def test_fsck_walks_a_tree_deeper_than_the_recursion_limit(tmp_path):
    store = Store(tmp_path / "store")
    try:
        with store.write() as txn:
            entry = put_directory(store, txn, [], stat.S_IFDIR | 0o755, 0, 0, 0)
            for _ in range(sys.getrecursionlimit() + 100):
                entry = put_directory(store, txn, [entry.renamed(b"d")], stat.S_IFDIR | 0o755,
                                      0, 0, 0)
            store.put_snapshot(txn, entry, [], "", "", "", {})
        report = fsck(store)
        assert report.problems == [] and report.trees == sys.getrecursionlimit() + 101
    finally:
        store.close()


def test_fsck_reports_a_wrong_size_in_every_snapshot_that_has_one(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(PUBLIC)
    store = Store(tmp_path / "store")
    try:
        good = import_tree(store, src)
        entry = store.tree(good.root.ref)[b"a"]
        with store.write() as txn:
            root = put_directory(store, txn, [Entry(b"b", entry.mode, 0, 0, 0, 99, entry.ref)],
                                 stat.S_IFDIR | 0o755, 0, 0, 0)
            bad = store.put_snapshot(txn, root, [], "", "", "", {})
        assert fsck(store).problems == [
            f"{bad.id[:12]} /b: content has {len(PUBLIC)} bytes, entry says 99"]
    finally:
        store.close()


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Path]:
    """A small tmpfs mounted for the test (tmpfs keeps any 64-bit time), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    point = tmp_path / "tmpfs"
    point.mkdir()
    run("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", point)
    try:
        yield point
    finally:
        run("umount", point)


def test_times_beyond_what_a_record_holds_are_clamped(ramet, tmpfs):
    (tmpfs / "future").write_bytes(PUBLIC)
    (tmpfs / "past").mkdir()
    os.utime(tmpfs / "future", ns=(2**70, 2**70))
    os.utime(tmpfs / "past", ns=(-2**70, -2**70))
    os.utime(tmpfs, ns=(2**70 + 1, 2**70 + 1))
    assert os.stat(tmpfs / "future").st_mtime_ns == 2**70  # the source really holds them
    snap = ramet.snapshot(tmpfs)
    with snapshot_root(ramet, snap) as root:
        assert os.stat(root / "future").st_mtime_ns == TIME_MAX_S * NS_PER_S
        assert os.stat(root / "past").st_mtime_ns == TIME_MIN_S * NS_PER_S
        if ramet.mode == "fuse":  # an execution's top is a real directory in fallback mode
            assert os.stat(root).st_mtime_ns == TIME_MAX_S * NS_PER_S
        assert (root / "future").read_bytes() == PUBLIC
    again = ramet.snapshot(tmpfs)  # the stat cache holds a clamped signature
    assert stats_of(ramet, again)["cached_files"] == 1
