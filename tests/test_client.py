"""The Python wrapper (rametfs.client) against a real mount."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from conftest import wait_until
from rametfs import Ramet, RametError
from rametfs.client import NotMountedError, PoolTimeout
from test_snapshots import SNAPSHOT_ID, tree_signature, write_tree


@pytest.fixture
def source(tmp_path) -> Path:
    return write_tree(tmp_path / "src", {"README": b"project\n", "src/main.py": b"print(1)\n"})


def test_snapshot_pool_acquire_promote_reset_release(daemon, source):
    ramet = Ramet(daemon.mnt)
    base = ramet.snapshot(source=source, label="clean")
    assert SNAPSHOT_ID.fullmatch(base)
    assert [(s["id"], s["label"]) for s in ramet.snapshots()] == [(base, "clean")]

    with ramet.execution_pool(base, concurrency=2) as pool:
        executions = ramet.executions()
        assert len(executions) == 2
        assert {(e["base"], e["head"]) for e in executions} == {(base, base)}
        with pool.acquire() as ex:
            assert isinstance(ex.path, Path)
            assert ex.path == daemon.mnt / "executions" / ex.id
            assert ex.id in {e["id"] for e in executions}
            (ex.path / "result.txt").write_text("attempt 1\n")
            saved = ex.promote(label="attempt 1")
            assert ex.diff() == [("A", "result.txt")]
            assert ex.status()["head"] == saved
        first_id = ex.id
        with pool.acquire() as ex:
            assert ex.id == first_id  # the pool hands back the execution just returned
            assert not (ex.path / "result.txt").exists()
            assert tree_signature(ex.path) == tree_signature(source)
            assert ex.diff() == []
    assert ramet.executions() == []
    assert os.listdir(daemon.mnt / "executions") == []

    record, = [s for s in ramet.snapshots() if s["id"] == saved]
    assert (record["label"], record["parents"]) == ("attempt 1", [base])
    with ramet.execution_pool(saved, concurrency=1) as pool:
        with pool.acquire() as ex:
            assert (ex.path / "result.txt").read_text() == "attempt 1\n"
            assert (ex.path / "README").read_text() == "project\n"
    assert ramet.executions() == []


def test_every_execution_leaves_the_pool_clean(shared_daemon, source):
    ramet = Ramet(shared_daemon.mnt)
    base = ramet.snapshot(source)
    with ramet.execution_pool(base, concurrency=2) as pool:
        ids = set()
        for i in range(4):
            with pool.acquire() as ex:
                assert not (ex.path / "mine").exists()
                (ex.path / "mine").write_text(str(i))
                os.unlink(ex.path / "README")
                ids.add(ex.id)
        live = {e["id"] for e in ramet.executions()}
    assert not ids & {e["id"] for e in ramet.executions()}
    assert ids <= live


def test_acquire_from_two_threads_gives_two_executions(shared_daemon, source):
    ramet = Ramet(shared_daemon.mnt)
    base = ramet.snapshot(source)
    held, release, errors = [], threading.Event(), []

    def worker(n: int) -> None:
        try:
            with pool.acquire(timeout=30) as ex:
                (ex.path / "who").write_text(str(n))
                held.append(ex)
                release.wait(30)
                assert (ex.path / "who").read_text() == str(n)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with ramet.execution_pool(base, concurrency=2) as pool:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: len(held) == 2 or errors, 30, "both executions acquired")
            with pytest.raises(PoolTimeout) as caught:
                with pool.acquire(timeout=0.05):
                    pass
            assert caught.value.errno == errno.EBUSY
        finally:
            release.set()
            for t in threads:
                t.join()
        assert errors == []
        assert len({ex.id for ex in held}) == 2


def test_checkpoint_and_reset_through_the_wrapper(shared_daemon, source):
    ramet = Ramet(shared_daemon.mnt)
    base = ramet.snapshot(source)
    ex = ramet.create(base, name=None)
    try:
        (ex.path / "README").write_text("changed\n")
        checkpoint = ex.checkpoint(message="keep this")
        assert ex.status()["head"] == base
        assert ex.reset() == base
        assert (ex.path / "README").read_text() == "project\n"
        assert (shared_daemon.snap_path(checkpoint) / "README").read_text() == "changed\n"
    finally:
        ramet.release(ex)


def test_unknown_snapshot_raises_enoent(shared_daemon):
    ramet = Ramet(shared_daemon.mnt)
    before = ramet.executions()
    for call in (lambda: ramet.create("0" * 64), lambda: ramet.execution_pool("0" * 64, 2)):
        with pytest.raises(RametError) as caught:
            call()
        assert caught.value.errno == errno.ENOENT
        assert "0" * 64 in str(caught.value)
    assert ramet.executions() == before


def test_other_errors_carry_their_errno(shared_daemon, tmp_path):
    ramet = Ramet(shared_daemon.mnt)
    cases = [
        (lambda: ramet.snapshot(tmp_path / "missing"), errno.ENOENT),
        (lambda: ramet.release("no-such-execution"), errno.ENOENT),
        (lambda: ramet.execution("no-such-execution").promote(), errno.ENOENT),
        (lambda: ramet.execution("no-such-execution").status(), errno.ENOENT),
        (lambda: Ramet(tmp_path), errno.ENOTCONN),
    ]
    for call, err in cases:
        with pytest.raises(RametError) as caught:
            call()
        assert caught.value.errno == err, caught.value
    with pytest.raises(NotMountedError):
        Ramet(tmp_path)
