"""The FUSE adapter without a kernel (after borg's testsuite/fuse_test.py): its handlers over a
fake mount tree that answers and fails as each test chooses (errno mapping, readdir offsets,
negative entries, forget, refused write-backs), and over the real mount tree of an in-process
overlay (the replies of control file writes)."""

from __future__ import annotations

import errno
import json
import logging
import math
import stat
from types import SimpleNamespace

import pyfuse3
import pytest
import trio

from rametfs.authority import Caller
from rametfs.control.commands import Control
from rametfs.control.tree import (CACHE_TIMEOUT, CONTROL, EXECUTIONS, ROOT, SNAPSHOTS, Absence,
                                  Entry, MountTree)
from rametfs.errors import NotFound, RametError, ReadOnly, fs_error
from rametfs.fuse.adapter import Operations, PlainOperations
from rametfs.fuse.kernel import NEGATIVE_NAMES, KernelState
from rametfs.overlay import Attrs, Overlay
from rametfs.store import Store, import_tree

CTX = SimpleNamespace(uid=1000, gid=1000, pid=4242, umask=0o022)  # a RequestContext's


def entry(ino: int, mode: int = stat.S_IFREG | 0o644, generation: bool = False) -> Entry:
    return Entry(Attrs(ino, mode, 1, 1000, 1000, 0, 10 * ino, 1, 2, 3), 7.0, 5.0, generation)


class FakeTree:
    """A mount tree whose answers the test sets: ``raises`` maps a method's name to what it
    raises, ``listings`` a directory to its entries; ``calls`` and ``failed`` record what
    the adapter asked."""

    def __init__(self):
        self.raises: dict[str, BaseException] = {}
        self.listings: dict[int, list[tuple[bytes, int]]] = {}
        self.absences: dict[int, Absence] = {}
        self.scopes: dict[int, str] = {}
        self.generations: set[int] = set()
        self.calls: list[tuple] = []
        self.failed: list[tuple[list[str], str]] = []

    def _call(self, name: str, *args) -> None:
        self.calls.append((name, *args))
        if name in self.raises:
            raise self.raises[name]

    def culprits(self, inos: list[int]) -> list[SimpleNamespace]:
        return [SimpleNamespace(id=f"ex-{ino}") for ino in inos]

    def fail(self, executions: list[SimpleNamespace], reason: str) -> None:
        self.failed.append(([ex.id for ex in executions], reason))

    def getattr(self, ino: int) -> Entry:
        self._call("getattr", ino)
        return entry(ino, generation=ino in self.generations)

    def entry_in(self, parent: int, ino: int) -> Entry:
        return self.getattr(ino)

    async def lookup(self, parent: int, name: bytes, caller: Caller) -> Entry:
        self._call("lookup", parent, name, caller)
        return entry(100, generation=True)

    def absence(self, parent: int) -> Absence:
        return self.absences[parent]

    def scope(self, parent: int) -> str:
        return self.scopes.get(parent, "e")

    async def listing(self, ino: int) -> list[tuple[bytes, int]]:
        self._call("listing", ino)
        return list(self.listings[ino])

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                    umask: int) -> Entry:
        self._call("mkdir", parent, name, mode, uid, gid, umask)
        return entry(200, stat.S_IFDIR | mode)

    async def write(self, ino: int, off: int, buf: bytes, kill_suidgid: bool = False) -> int:
        self._call("write", ino, off, buf)
        return len(buf)

    def forget(self, inos: list[int], generations: list[int]) -> None:
        self._call("forget", inos, generations)


@pytest.fixture
def fake():
    tree = FakeTree()
    send, recv = trio.open_memory_channel[int](math.inf)
    kernel = KernelState(send)
    return Operations(tree, kernel), tree, kernel, recv


@pytest.fixture
def told(monkeypatch):
    """What the kernel is told to forget: KernelState.invalidate's calls of the kernel, the
    missing names as dentries after the others."""
    calls: list[tuple[list[tuple[int, bytes]], list[int]]] = []

    def told(entries, inodes, negative=()):
        missing = [(ino, name) for ino, names in negative for name in names]
        calls.append((entries + missing, list(inodes)))

    monkeypatch.setattr(KernelState, "_invalidate_now", staticmethod(told))
    return calls


async def test_an_entry_is_built_from_the_trees_attributes_and_timeouts(fake):
    ops, tree, kernel, _ = fake
    e = await ops.getattr(9)
    assert (e.st_ino, e.st_mode, e.st_nlink, e.st_uid, e.st_gid, e.st_rdev, e.st_size) == \
        (9, stat.S_IFREG | 0o644, 1, 1000, 1000, 0, 90)
    assert (e.st_blocks, e.st_blksize, e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns) == \
        (1, 4096, 1, 2, 3)
    assert (e.attr_timeout, e.entry_timeout) == (7.0, 5.0)
    m = await ops.mkdir(1, b"d", 0o750, CTX)
    assert (m.st_ino, m.st_mode) == (200, stat.S_IFDIR | 0o750)
    assert tree.calls[-1] == ("mkdir", 1, b"d", 0o750, 1000, 1000, 0o022)  # the tree masks


@pytest.mark.parametrize("exc, err", [
    (NotFound("no execution 'x'"), errno.ENOENT),
    (ReadOnly("snapshots are read-only"), errno.EROFS),
    (fs_error(errno.EACCES), errno.EACCES),
    (fs_error(errno.ESTALE, "inode 9 is stale"), errno.ESTALE),
    (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC),
    (OSError("no errno"), errno.EIO),
    (RametError("a store error"), errno.EIO),
    (pyfuse3.FUSEError(errno.EXDEV), errno.EXDEV),
], ids=lambda v: v.__class__.__name__ if isinstance(v, BaseException) else errno.errorcode[v])
async def test_a_domain_error_answers_its_errno_and_fails_nothing(fake, caplog, exc, err):
    ops, tree, _, _ = fake
    tree.raises["getattr"] = exc
    with pytest.raises(pyfuse3.FUSEError) as raised:
        await ops.getattr(9)
    assert raised.value.errno == err
    assert tree.failed == []
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_an_unexpected_exception_answers_eio_logged_and_fails_its_execution(fake, caplog):
    ops, tree, _, _ = fake
    tree.raises["mkdir"] = ValueError("boom")
    with pytest.raises(pyfuse3.FUSEError) as raised:
        await ops.mkdir(7, b"d", 0o755, CTX)
    assert raised.value.errno == errno.EIO
    [record] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.getMessage() == "internal error in mkdir (execution ex-7)"
    assert record.levelno == logging.ERROR and record.exc_info[0] is ValueError
    assert tree.failed == [(["ex-7"], "internal error in mkdir: ValueError('boom')")]


async def test_forget_never_raises(fake, caplog):
    ops, tree, _, _ = fake
    tree.raises["forget"] = KeyError(3)
    assert await ops.forget([(3, 1), (4, 2)]) is None
    [record] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.getMessage() == "internal error in forget (execution ex-3, ex-4)"
    assert record.exc_info[0] is KeyError
    assert tree.failed == [(["ex-3", "ex-4"], "internal error in forget: KeyError(3)")]
    caplog.clear()
    for exc in (NotFound("gone"), OSError(errno.EIO, "I/O error"),
                pyfuse3.FUSEError(errno.ENOENT)):
        tree.raises["forget"] = exc
        assert await ops.forget([(3, 1)]) is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 3
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["forget"] * 3
    assert len(tree.failed) == 1  # domain errors fail nothing


async def test_a_generation_goes_at_the_forget_of_its_last_lookup(fake):
    ops, tree, kernel, _ = fake
    await ops.lookup(CONTROL, b"ctl", CTX)
    await ops.lookup(CONTROL, b"ctl", None)
    assert [c[3] for c in tree.calls if c[0] == "lookup"] == [Caller(1000, 1000, 4242),
                                                             Caller(0, 0, 0)]
    assert kernel.lookups == {100: 2}
    await ops.forget([(100, 1), (7, 1)])
    assert tree.calls[-1] == ("forget", [100, 7], [])
    await ops.forget([(100, 1)])
    assert tree.calls[-1] == ("forget", [100], [100])
    assert kernel.lookups == {}


async def test_readdir_pages_through_one_listing_at_its_offsets(fake, monkeypatch):
    ops, tree, kernel, _ = fake
    tree.listings[9] = [(b".", 9), (b"..", 1)] + [(b"n%d" % i, 100 + i) for i in range(5)]
    tree.generations = {102}
    replied: list[tuple[bytes, int, int, int]] = []
    room = [0]

    def reply(token, name, attrs, next_id):
        if room[0] == 0:
            return False  # the kernel's buffer is full: this entry is not in the reply
        room[0] -= 1
        replied.append((name, attrs.st_ino, attrs.st_mode, next_id))
        return True

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)
    room[0] = 3
    await ops.readdir(9, 0, None)
    assert replied == [(b".", 9, stat.S_IFDIR, 1), (b"..", 1, stat.S_IFDIR, 2),
                       (b"n0", 100, stat.S_IFREG | 0o644, 3)]
    tree.listings[9].insert(2, (b"a-new-name", 300))  # the kept listing's offsets stay valid
    room[0], replied[:] = 3, []
    await ops.readdir(9, 3, None)
    assert [(name, ino, next_id) for name, ino, _, next_id in replied] == \
        [(b"n1", 101, 4), (b"n2", 102, 5), (b"n3", 103, 6)]
    room[0], replied[:] = 10, []
    await ops.readdir(9, 6, None)
    assert [(name, next_id) for name, _, _, next_id in replied] == [(b"n4", 7)]
    room[0], replied[:] = 10, []
    await ops.readdir(9, 7, None)  # past the end: nothing
    assert replied == []
    assert [c for c in tree.calls if c[0] == "listing"] == [("listing", 9)]
    assert kernel.lookups == {102: 1}  # only what was replied is counted
    room[0], replied[:] = 10, []
    await ops.readdir(9, 0, None)  # a read from 0 starts over, with the new name
    assert [name for name, *_ in replied][:4] == [b".", b"..", b"a-new-name", b"n0"]
    assert [c for c in tree.calls if c[0] == "listing"] == [("listing", 9)] * 2
    assert kernel.memory() == {"listings": 1, "listing_entries": 8}


async def test_a_missing_name_is_a_negative_entry_where_its_directory_allows(fake):
    ops, tree, kernel, _ = fake
    tree.raises["lookup"] = NotFound("no such name")
    tree.absences = {5: Absence.UNTIL_RESET, 6: Absence.CACHED, SNAPSHOTS: Absence.UNCACHED}
    for parent in (5, 6):
        e = await ops.lookup(parent, b".gitignore", CTX)
        assert (e.st_ino, e.entry_timeout) == (0, CACHE_TIMEOUT)
    assert kernel.negative == {5: {b".gitignore"}}
    with pytest.raises(pyfuse3.FUSEError) as raised:
        await ops.lookup(SNAPSHOTS, b"0123abcd", CTX)  # snapshots/ gains names unseen
    assert raised.value.errno == errno.ENOENT
    tree.raises["lookup"] = fs_error(errno.EACCES)  # only a missing name is cached
    with pytest.raises(pyfuse3.FUSEError) as raised:
        await ops.lookup(5, b"x", CTX)
    assert raised.value.errno == errno.EACCES


async def test_an_executions_missing_names_are_bounded_and_dropped_at_its_reset(
        fake, told):
    """NEGATIVE_NAMES an execution, in all its directories: past them a missing name is not
    cached, in that execution only; a reset naming a directory forgets its names."""
    ops, tree, kernel, _ = fake
    tree.raises["lookup"] = NotFound("no such name")
    tree.absences = {5: Absence.UNTIL_RESET, 6: Absence.UNTIL_RESET, 7: Absence.UNTIL_RESET}
    tree.scopes = {7: "other"}
    kernel.negative_entry(6, b"in-a-subdirectory", "e")
    for i in range(NEGATIVE_NAMES - 1):
        kernel.negative_entry(5, b"m%d" % i, "e")
    e = await ops.lookup(5, b"one-more", CTX)
    assert (e.st_ino, e.entry_timeout) == (0, 0)  # not cached: the set stays bounded
    e = await ops.lookup(7, b"another-execution", CTX)
    assert (e.st_ino, e.entry_timeout) == (0, CACHE_TIMEOUT)  # its own budget
    assert len(kernel.negative[5]) == NEGATIVE_NAMES - 1 and b"one-more" not in kernel.negative[5]
    kernel.keep_listing(5, [(b".", 5), (b"..", EXECUTIONS)])
    # A reset names the root and a rebound directory among the inodes: the kernel forgets
    # their missing names too; another execution's stay.
    await kernel.invalidate([(5, b"kept-name")], [5, 6, 11])
    [(entries, inodes)] = told
    assert entries[0] == (5, b"kept-name")
    assert sorted(entries[1:]) == sorted([(5, b"m%d" % i) for i in range(NEGATIVE_NAMES - 1)]
                                         + [(6, b"in-a-subdirectory")])
    assert inodes == [5, 6, 11]
    assert (kernel.negative, kernel.negative_counts) == ({7: {b"another-execution"}},
                                                         {"other": 1})
    assert kernel.memory() == {"listings": 0, "listing_entries": 0}
    e = await ops.lookup(5, b"one-more", CTX)
    assert (e.st_ino, e.entry_timeout) == (0, CACHE_TIMEOUT)


async def test_a_refused_write_back_drops_the_pages_once_while_due(fake, told):
    ops, tree, kernel, refused = fake
    tree.raises["write"] = ReadOnly("snapshots are read-only")
    for _ in range(2):
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await ops.write(33, 0, b"x")
        assert raised.value.errno == errno.EROFS
    assert kernel.refused_pages == {33: True}
    assert refused.receive_nowait() == 33
    with pytest.raises(trio.WouldBlock):
        refused.receive_nowait()  # one drop is due, whatever the writes meanwhile
    await kernel.refused.send(33)
    await kernel.refused.aclose()
    await kernel.drop_refused_pages(refused)
    # Dropped, then again for the write that came since the drop began.
    assert told == [([(33, b"")], []), ([(33, b"")], [])]
    assert kernel.refused_pages == {}


def test_plain_mode_has_open_and_opendir_open_less_mode_neither():
    assert Operations.open is pyfuse3.Operations.open
    assert Operations.opendir is pyfuse3.Operations.opendir
    assert PlainOperations.open is not pyfuse3.Operations.open
    assert PlainOperations.opendir is not pyfuse3.Operations.opendir


def test_plain_mode_has_no_tmpfile():
    """So that O_TMPFILE fails EOPNOTSUPP in plain mode, with or without the patch."""
    assert PlainOperations.tmpfile is getattr(pyfuse3.Operations, "tmpfile", None)
    assert Operations.tmpfile is not PlainOperations.tmpfile


@pytest.fixture
async def mounted(tmp_path):
    """The adapter over the real mount tree of an overlay in this process (no kernel): the
    kernel's invalidations are recorded."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"hello")
    store = Store(tmp_path / "data")
    snap = import_tree(store, tmp_path / "src")
    overlay = Overlay(store)
    invalidated: list[tuple[list, list]] = []

    async def invalidate(entries, inodes=()):
        invalidated.append((list(entries), list(inodes)))

    control = Control(overlay, str(tmp_path / "mnt"), invalidate)
    reclaim, _ = trio.open_memory_channel[None](1)
    refused, _ = trio.open_memory_channel[int](math.inf)
    ops = Operations(MountTree(overlay, control, reclaim), KernelState(refused))
    yield ops, snap, invalidated
    store.close()


async def ctl_write(ops: Operations, line: bytes) -> tuple[int, dict]:
    """Look up the root ctl (a new inode), write ``line`` to it: the write's answer (its
    count, or the errno it failed with) and the reply the inode then shows."""
    assert (await ops.lookup(ROOT, b".ramet", None)).st_ino == CONTROL
    ino = (await ops.lookup(CONTROL, b"ctl", None)).st_ino
    try:
        answer = await ops.write(ino, 0, line)
    except pyfuse3.FUSEError as exc:
        answer = -exc.errno
    size = (await ops.getattr(ino, None)).st_size
    return answer, json.loads(await ops.read(ino, 0, size + 1))


async def test_a_control_file_write_answers_its_count_and_shows_its_reply(mounted):
    ops, snap, invalidated = mounted
    line = b"resolve " + snap.id[:12].encode()
    assert await ctl_write(ops, line) == (len(line), {"ok": True, "snapshot": snap.id})
    # A command may change snapshots/ and executions/: the kernel forgets their listings.
    assert invalidated == [([(SNAPSHOTS, b""), (EXECUTIONS, b"")], [])]
    line = b"create " + snap.id.encode() + b" --name e1"
    count, reply = await ctl_write(ops, line)
    assert (count, reply["ok"], reply["execution"]) == (len(line), True, "e1")
    e = await ops.lookup(EXECUTIONS, b"e1", None)
    assert (stat.S_ISDIR(e.st_mode), e.entry_timeout) == (True, 0)


@pytest.mark.parametrize("line, err, message", [
    (b"resolve 00000000", errno.ENOENT, "no snapshot"),
    (b"no-such-command", errno.EINVAL, "unknown command"),
    (b"release", errno.EINVAL, "release"),
])
async def test_a_failed_control_command_answers_its_errno_and_shows_why(
        mounted, line, err, message):
    ops, _, _ = mounted
    answer, reply = await ctl_write(ops, line)
    assert answer == -err
    assert (reply["ok"], reply["errno"]) == (False, err)
    assert message in reply["error"]


async def test_a_control_file_inode_goes_stale_at_the_forget_of_its_last_lookup(mounted):
    ops, _, _ = mounted
    status = (await ops.lookup(CONTROL, b"status", None)).st_ino
    again = (await ops.lookup(CONTROL, b"status", None)).st_ino
    assert again == status  # the same content: the same inode, looked up twice
    await ops.forget([(status, 1)])
    assert (await ops.getattr(status, None)).st_ino == status
    await ops.forget([(status, 1)])
    with pytest.raises(pyfuse3.FUSEError) as raised:
        await ops.getattr(status, None)
    assert raised.value.errno == errno.ESTALE
