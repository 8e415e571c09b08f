"""Pools and leases kept by the daemon, verification and quarantine, restore across sessions.

Harnesses run as real subprocesses (killed with SIGKILL where a test needs a dead holder);
corruption is made behind the daemon's back, in its data directory, while it runs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import pytest

from conftest import run, wait_until
from rametfs import Ramet, RametError, protocol
from rametfs.client import PoolTimeout
from rametfs.errors import Busy
from rametfs.store import Store
from rametfs.store.format import UpperInode, dentry_key, inode_key, page_key, u64
from test_snapshots import write_tree

QUARANTINE_LOG = r"WARNING rametfs\.control\.commands: execution \S+ quarantined"
BIG = bytes(range(256)) * 800  # 200 KiB: four pages, the last one short
SECOND = 1_000_000_000  # ns


@pytest.fixture
def source(tmp_path) -> Path:
    return write_tree(tmp_path / "src", {"README": b"project\n", "src/main.py": b"print(1)\n",
                                         "data/big.bin": BIG})


def harness(ramet: Ramet, script: str) -> subprocess.Popen:
    """A Python harness process running ``script`` with ``ramet`` (a Ramet on the same mount
    or data directory as ``ramet``)."""
    where = (repr(str(ramet.mount)) if ramet.mode == "fuse"
             else f"data={str(ramet.data)!r}, mode='fallback'")
    code = f"from rametfs import Ramet\nramet = Ramet({where})\n" + textwrap.dedent(script)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def killed_holder(ramet: Ramet, base: str, pool: str, ttl: float) -> str:
    """Run a harness that leases an execution of the pool ``pool`` (2 of ``base``), writes
    to its README and is killed with SIGKILL; returns the execution's id."""
    proc = harness(ramet, f"""
        import time
        pool = ramet.execution_pool({base!r}, concurrency=2, name={pool!r}, ttl={ttl})
        with pool.acquire() as ex:
            (ex.path / "README").write_text("half done\\n")
            print(ex.id, flush=True)
            time.sleep(600)
    """)
    try:
        held = proc.stdout.readline().strip()
        lease = member(ramet, held)["lease"]
        assert (lease["pid"], member(ramet, held)["state"]) == (proc.pid, "leased")
        assert (ramet.execution(held).path / "README").read_text() == "half done\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    return held


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"harness exited {proc.returncode}\n{out}\n{err}"
    return out


def member(ramet: Ramet, execution_id: str) -> dict:
    record, = [e for e in ramet.executions() if e["id"] == execution_id]
    return record


def pool_record(ramet: Ramet, name: str) -> dict:
    record, = [p for p in ramet.pools() if p["name"] == name]
    return record


def cli_ls(mnt: Path) -> str:
    return run(sys.executable, "-m", "rametfs", "ls", "-m", mnt).stdout


def test_acquire_renew_ebusy_timeout_and_ls(daemon, source):
    ramet = Ramet(daemon.mnt)
    base = ramet.snapshot(source)
    with ramet.execution_pool(base, concurrency=2, name="agents", ttl=0.6) as pool:
        assert pool.name == "agents"
        assert pool_record(ramet, "agents")["ready"] == 2
        with pool.acquire() as ex:
            lease = member(ramet, ex.id)["lease"]
            assert (lease["holder"], lease["pid"], lease["host"]) == (
                pool.holder, os.getpid(), socket.gethostname())
            assert member(ramet, ex.id)["state"] == "leased"
            # The wrapper renews every ttl/3: the lease outlives several ttls.
            first_expiry = lease["expires_ns"]
            wait_until(lambda: member(ramet, ex.id)["lease"]["expires_ns"] > first_expiry,
                       5, "a renewal")
            time.sleep(1.5)  # 2.5 ttls: an unrenewed lease would be back in the pool by now
            assert member(ramet, ex.id)["state"] == "leased"
            assert pool.renew_error is None
            (ex.path / "scratch").write_text("mine\n")

            listing = cli_ls(daemon.mnt)
            row, = [line for line in listing.splitlines() if line.startswith(ex.id)]
            assert row.split()[5:9] == [f"{os.getuid()}:{os.getgid()}/0700/full", "leased",
                                        "agents", pool.holder]
            assert f"(pid {os.getpid()} on {socket.gethostname()})" in row
            assert row.split()[-2] == "in"
            assert [line.split() for line in listing.splitlines()[-2:]] == [
                ["POOL", "BASE", "SIZE", "READY", "LEASED", "QUARANTINED"],
                ["agents", base[:12], "2", "1", "1", "0"]]

            # Another holder gets EBUSY for renew and return; unknown names get ENOENT.
            for line in (f"renew {ex.id} --holder someone --ttl 5",
                         f"return {ex.id} --holder someone"):
                with pytest.raises(OSError) as caught:
                    daemon.ctl(line)
                assert caught.value.errno == errno.EBUSY
                assert caught.value.reply["error"].startswith(
                    f"execution {ex.id!r} is leased by {pool.holder}")
            with pytest.raises(OSError) as caught:
                daemon.ctl("acquire nosuchpool --holder h --ttl 5")
            assert (caught.value.errno, caught.value.reply["error"]) == (
                errno.ENOENT, "no pool 'nosuchpool'")

            with pool.acquire() as other:
                assert other.id != ex.id
                started = time.monotonic()
                with pytest.raises(PoolTimeout) as caught:
                    with pool.acquire(timeout=0.3):
                        pass
                assert 0.3 <= time.monotonic() - started < 5
                assert caught.value.errno == errno.EBUSY
                assert "no ready execution" in str(caught.value)
        # Returned: reset, verified, ready again, lease gone.
        assert member(ramet, ex.id)["state"] == "ready"
        assert member(ramet, ex.id)["lease"] is None
        assert not (ex.path / "scratch").exists()
    assert "agents" in {p["name"] for p in ramet.pools()}  # a named pool outlives its handle
    with ramet.execution_pool(base, concurrency=1, name="agents") as again:
        assert pool_record(ramet, "agents")["size"] == 2  # reattached, not shrunk
        again.drop()
    assert ramet.pools() == [] and ramet.executions() == []


def test_sigkilled_harness_lease_expires_and_a_new_process_reattaches(daemon, source):
    ramet = Ramet(daemon.mnt)
    base = ramet.snapshot(source)
    held = killed_holder(ramet, base, "rl", ttl=1)
    killed_at = time.monotonic()
    wait_until(lambda: member(ramet, held)["state"] == "ready", 10, "the lease to expire")
    assert time.monotonic() - killed_at < 5
    assert member(ramet, held)["lease"] is None
    assert (daemon.exec_path(held) / "README").read_text() == "project\n"
    members = set(pool_record(ramet, "rl")["executions"])
    assert held in members and len(members) == 2

    out = finish(harness(ramet, f"""
        pool = ramet.execution_pool({base!r}, concurrency=2, name="rl")
        with pool.acquire(timeout=10) as a, pool.acquire(timeout=10) as b:
            print(a.id, b.id, (a.path / "README").read_text() == "project\\n")
    """))
    a, b, clean = out.split()
    assert {a, b} == members and clean == "True"
    assert pool_record(ramet, "rl")["ready"] == 2


def corrupt_a_ready_execution(data: Path, execution_id: str, base: str) -> None:
    """Behind the daemon's back: give the execution's current layer a copied-up README whose
    page 0 lives in an upper data file holding other bytes (records and data on disk)."""
    store = Store(data)
    try:
        with store.read() as txn:
            rec = msgpack.unpackb(txn.get(execution_id.encode(), db=store.db["executions"]))
        entry = store.tree(store.snapshot(base).root.ref)[b"README"]
        ino = 1 << 40  # far above any inode number the daemon gives out
        with store.write() as txn:
            txn.put(dentry_key(rec["layer"], rec["root_ino"], b"README"), u64(ino),
                    db=store.db["dentries"])
            txn.put(inode_key(rec["layer"], ino), UpperInode.from_entry(entry).pack(),
                    db=store.db["inodes"])
            txn.put(page_key(rec["layer"], ino, 0), b"", db=store.db["pages"])
        upper = data / "upper" / str(rec["layer"])
        upper.mkdir(mode=0o700, exist_ok=True)
        (upper / str(ino)).write_bytes(b"PROJECT\n")  # same size, other bytes
    finally:
        store.close()


@pytest.mark.allow_log(QUARANTINE_LOG)
def test_corrupted_executions_are_quarantined_and_never_acquired(daemon, source):
    ramet = Ramet(daemon.mnt)
    base = ramet.snapshot(source)
    pool = ramet.execution_pool(base, concurrency=2, name="checked")
    with pool.acquire() as ex:
        (ex.path / "README").write_text("changed\n")
        assert ex.verify() == [("M", "README")]  # a leased execution may differ: reported only
    assert member(ramet, ex.id)["state"] == "ready"
    upper_victim = ex.id

    # 1. Upper data and records of a ready execution changed on disk: found, quarantined.
    corrupt_a_ready_execution(daemon.data_dir, upper_victim, base)
    assert ramet.execution(upper_victim).verify() == []  # what the daemon serves is intact
    assert member(ramet, upper_victim)["state"] == "ready"
    assert ramet.execution(upper_victim).verify(deep=True) == [("M", "README")]
    record = member(ramet, upper_victim)
    assert record["state"] == "quarantined"
    assert record["quarantine_reason"] == (
        "deep verification: differs from its base (M README)")

    # 2. The hydrated base content it serves changed on disk: only deep verification sees it.
    with pool.acquire() as ex:
        assert (ex.path / "data" / "big.bin").read_bytes() == BIG  # hydrates the cache
    cache_victim = ex.id
    cached = [p for p in (daemon.data_dir / "cache").iterdir() if p.stat().st_size == len(BIG)]
    assert len(cached) == 1
    os.chmod(cached[0], 0o600)
    with open(cached[0], "r+b") as f:
        f.seek(3 * 65536 + 5)
        f.write(b"X")
    assert ramet.execution(cache_victim).verify() == []
    assert member(ramet, cache_victim)["state"] == "ready"
    assert ramet.execution(cache_victim).verify(deep=True) == [("M", "data/big.bin")]
    assert member(ramet, cache_victim)["state"] == "quarantined"

    # The pool made new members in their place; acquire never hands the quarantined out,
    # before or after a restart.
    quarantined = {upper_victim, cache_victim}
    record = pool_record(ramet, "checked")
    assert (record["size"], record["ready"], record["quarantined"]) == (2, 2, 2)
    daemon.restart()
    assert {e["id"] for e in ramet.executions() if e["state"] == "quarantined"} == quarantined
    # A restarted daemon serves the layer as stored: root verification sees it now.
    done = run(sys.executable, "-m", "rametfs", "verify", upper_victim, "-m", daemon.mnt,
               check=False)
    assert (done.returncode, done.stdout) == (1, "M README\n")
    pool = ramet.execution_pool(base, concurrency=2, name="checked")
    for _ in range(3):
        with pool.acquire(timeout=5) as a, pool.acquire(timeout=5) as b:
            assert not {a.id, b.id} & quarantined
    with pytest.raises(PoolTimeout):
        with pool.acquire(timeout=5) as a, pool.acquire(timeout=5) as b, \
                pool.acquire(timeout=0.1):
            pass
    listing = cli_ls(daemon.mnt)
    assert {line.split()[0] for line in listing.splitlines()
            if " quarantined " in line} == quarantined
    pool.drop()
    assert ramet.executions() == []


def test_leases_survive_a_restart_and_snapshots_restore_byte_for_byte(daemon, source, tmp_path):
    ramet = Ramet(daemon.mnt)
    base = ramet.snapshot(source)
    pool = ramet.execution_pool(base, concurrency=1, name="session", ttl=10)
    with pool.acquire() as ex:
        (ex.path / "result.bin").write_bytes(os.urandom(150_000))
        with open(ex.path / "data" / "big.bin", "r+b") as f:
            f.seek(70_000)
            f.write(b"patched")
        expected = {rel: hashlib.sha256((ex.path / rel).read_bytes()).hexdigest()
                    for rel in ("README", "src/main.py", "data/big.bin", "result.bin")}
        saved = ex.promote(label="keep")
        lease = member(ramet, ex.id)["lease"]
        daemon.restart()  # the lease, its pool and the snapshot are in LMDB
        after = member(ramet, ex.id)
        assert after["state"] == "leased"
        assert (after["lease"]["holder"], after["lease"]["acquired_ns"]) == (
            lease["holder"], lease["acquired_ns"])
        # The renewing thread carries on against the restarted daemon.
        wait_until(lambda: member(ramet, ex.id)["lease"]["expires_ns"] > lease["expires_ns"]
                   and pool.renew_error is None, 10, "a renewal after the restart")
    assert member(ramet, ex.id)["state"] == "ready"
    Path(tmp_path / "ids.json").write_text(json.dumps([saved]))  # what a harness keeps

    daemon.restart()
    out = finish(harness(ramet, f"""
        import hashlib, json
        saved, = json.load(open({str(tmp_path / "ids.json")!r}))
        with ramet.execution_pool(saved, concurrency=1) as pool, pool.acquire() as ex:
            print(json.dumps({{str(p.relative_to(ex.path)): hashlib.sha256(p.read_bytes())
                               .hexdigest() for p in ex.path.rglob("*") if p.is_file()}}))
    """))
    assert json.loads(out) == expected
    pool.drop()


def test_a_lease_ending_while_the_daemon_is_down_is_returned_by_the_next(daemon, source):
    base = daemon.snapshot(source)
    daemon.ctl(f"pool {base} --size 1 --name down")
    reply = daemon.ctl("acquire down --holder gone --ttl 3 --pid 4242 --host elsewhere")
    eid, expires_ns = reply["execution"], reply["lease"]["expires_ns"]
    (daemon.exec_path(eid) / "README").write_text("left behind\n")
    daemon.stop()
    assert time.time_ns() < expires_ns, "the daemon took the whole lease to stop"
    wait_until(lambda: time.time_ns() > expires_ns, 5, "the lease to end")
    daemon.start()
    ramet = Ramet(daemon.mnt)
    wait_until(lambda: member(ramet, eid)["state"] == "ready", 10, "the lease to be returned")
    assert (daemon.exec_path(eid) / "README").read_text() == "project\n"
    assert f"lease of {eid} by gone (pid 4242 on elsewhere) expired" in daemon.log_text()


def test_a_lease_ending_before_the_one_the_lease_task_waits_for_wakes_it(shared_daemon,
                                                                          source):
    base = shared_daemon.snapshot(source)
    shared_daemon.ctl(f"pool {base} --size 2 --name wake")
    long = shared_daemon.ctl("acquire wake --holder a --ttl 3600")["execution"]
    time.sleep(0.2)  # the lease task sleeps until the hour-long lease ends
    short = shared_daemon.ctl("acquire wake --holder b --ttl 0.3")["execution"]
    taken_at = time.monotonic()
    wait_until(lambda: shared_daemon.exec_status(short)["state"] == "ready", 10,
               "the short lease to be returned")
    assert time.monotonic() - taken_at < 3
    assert shared_daemon.exec_status(long)["state"] == "leased"
    shared_daemon.ctl("drop wake")


@pytest.mark.parametrize("restart", [False, True], ids=["running", "restarted"])
def test_writes_into_a_ready_member_are_reset_before_its_next_lease(daemon, source, restart):
    # A process of an earlier holder outlives its lease and goes on writing in the execution.
    base = daemon.snapshot(source)
    daemon.ctl(f"pool {base} --size 1 --name zombie")
    eid = daemon.ctl("acquire zombie --holder a --ttl 30")["execution"]
    daemon.ctl(f"return {eid} --holder a")
    ex = daemon.exec_path(eid)
    (ex / "zombie.txt").write_text("left by a\n")
    (ex / "README").write_text("changed by a\n")
    if restart:  # the pristine check then has no record of changes: it reads the store
        daemon.stop()
        daemon.start()

    assert daemon.ctl("acquire zombie --holder b --ttl 30")["execution"] == eid
    assert sorted(os.listdir(ex)) == sorted(os.listdir(source))
    assert (ex / "README").read_text() == "project\n"
    assert daemon.exec_status(eid)["upper_bytes"] == 0
    assert f"execution {eid} changed while ready: reset before its lease" in daemon.log_text()


def test_a_waiting_acquire_gets_the_execution_another_thread_returns(shared_daemon, source):
    ramet = Ramet(shared_daemon.mnt)
    with ramet.execution_pool(ramet.snapshot(source), concurrency=1) as pool:
        got = []

        def waiter() -> None:
            with pool.acquire(timeout=30) as ex:
                got.append((ex.id, time.monotonic()))

        with pool.acquire() as first:
            thread = threading.Thread(target=waiter)
            thread.start()
            time.sleep(0.3)  # the waiter asks several times meanwhile
            assert got == []
        returned_at = time.monotonic()
        thread.join(30)
        (taken, taken_at), = got
        assert taken == first.id
        assert taken_at - returned_at < 1  # polled: not stuck behind another command


def test_closing_a_pool_fails_an_acquire_waiting_in_another_thread(shared_daemon, source):
    ramet = Ramet(shared_daemon.mnt)
    pool = ramet.execution_pool(ramet.snapshot(source), concurrency=1)
    failures = []

    def wait_forever() -> None:
        try:
            with pool.acquire():
                pass
        except RametError as exc:
            failures.append((exc.errno, str(exc)))

    with pool.acquire():
        waiter = threading.Thread(target=wait_forever)
        waiter.start()
        pool.close()  # drops the pool: the daemon wakes the waiting acquire
        waiter.join(10)
    assert failures == [(errno.EINVAL, "the execution pool is closed")]
    assert pool.name not in {p["name"] for p in ramet.pools()}


def test_pool_commands_check_their_arguments(shared_daemon, source):
    base = shared_daemon.snapshot(source)
    for line, message in [
            ("pool " + base, "pool: missing --size"),
            (f"pool {base} --size 0", "--size must be a whole number >= 1, not '0'"),
            (f"pool {base} --size 2 --name bad/name", "pool name 'bad/name' must match "
             "[A-Za-z0-9][A-Za-z0-9._-]{0,47}"),
            ("acquire p --holder h", "acquire: missing --ttl"),
            ("acquire p --holder h --ttl soon", "--ttl must be seconds >= 0, not 'soon'")]:
        with pytest.raises(OSError) as caught:
            shared_daemon.ctl(line)
        assert (caught.value.errno, caught.value.reply["error"]) == (errno.EINVAL, message)
    reply = shared_daemon.ctl(f"pool {base} --size 1 --name args")
    assert (reply["pool"], reply["size"], reply["created"]) == ("args", 1, True)
    other = shared_daemon.snapshot(source / "src")
    with pytest.raises(OSError) as caught:
        shared_daemon.ctl(f"pool {other} --size 1 --name args")
    assert caught.value.errno == errno.EEXIST
    eid, = reply["executions"]
    with pytest.raises(OSError) as caught:
        shared_daemon.exec_ctl(eid, "verify --mode shallow")
    assert caught.value.errno == errno.EINVAL
    with pytest.raises(OSError) as caught:
        shared_daemon.ctl(f"renew {eid} --holder h --ttl 1")
    assert caught.value.errno == errno.EINVAL  # not leased
    assert shared_daemon.ctl("acquire args --holder h --ttl 0")["execution"] == eid
    with pytest.raises(OSError) as caught:
        shared_daemon.ctl(f"renew {eid} --holder h --ttl 1")
    assert caught.value.errno == errno.EINVAL  # the lease has ended (or it is back already)
    wait_until(lambda: shared_daemon.exec_status(eid)["state"] == "ready", 10,
               "the ended lease to be returned")
    assert shared_daemon.ctl("drop args") == {"ok": True, "pool": "args", "executions": [eid]}


# ----- fallback mode: the same pools and leases, kept in the data directory's LMDB -----------

def test_fallback_leases_expire_into_the_next_acquire_and_quarantine(tmp_path, source):
    with Ramet(data=tmp_path / "data", mode="fallback") as ramet:
        base = ramet.snapshot(source)
        held = killed_holder(ramet, base, "fb", ttl=30)

        pool = ramet.execution_pool(base, concurrency=2, name="fb")  # reattach
        assert pool_record(ramet, "fb")["leased"] == 1
        with pytest.raises(RametError) as caught:
            ramet._backend.run(protocol.Renew(held, pool.holder, 5 * SECOND))
        assert caught.value.errno == errno.EBUSY
        engine = ramet._backend.engine
        with pool.acquire() as first:
            assert first.id != held  # the ready one goes first
            with pytest.raises(PoolTimeout):  # the dead harness's lease still runs
                with pool.acquire(timeout=0):
                    pass
            # Its lease ends (the clock given to the pools moves past it): the next acquire
            # resets and verifies its execution, and takes it.
            engine.pools.clock = lambda: time.time_ns() + 3600 * SECOND
            with pool.acquire(timeout=0) as second:
                assert second.id == held
                assert (second.path / "README").read_bytes() == b"project\n"
                assert member(ramet, held)["lease"]["holder"] == pool.holder
            assert pool.renew_error is None
        engine.pools.clock = time.time_ns

        # A ready execution changed behind the wrapper's back is quarantined by verify.
        victim = ramet.execution(held)
        with open(victim.path / "data" / "big.bin", "r+b") as f:
            f.write(b"X")
        assert victim.verify(deep=True) == [("M", "data/big.bin")]
        assert member(ramet, held)["state"] == "quarantined"
        record = pool_record(ramet, "fb")
        assert (record["ready"], record["quarantined"]) == (2, 1)
        for _ in range(3):
            with pool.acquire() as a, pool.acquire() as b:
                assert held not in (a.id, b.id)
        pool.drop()
        assert ramet.executions() == [] and ramet.pools() == []


def test_fallback_take_over_of_a_member_failing_verification_quarantines_it(tmp_path, source,
                                                                           monkeypatch):
    with Ramet(data=tmp_path / "data", mode="fallback") as ramet:
        engine = ramet._backend.engine
        base = ramet.snapshot(source)
        reply = ramet._backend.run(protocol.Pool(base, 1, "fb"))
        stale, = reply["executions"]
        ramet._backend.run(protocol.Acquire("fb", "gone", 10 * SECOND))
        engine.pools.clock = lambda: time.time_ns() + 11 * SECOND  # its lease has ended
        verification = engine.verification
        monkeypatch.setattr(engine, "verification", lambda eid, mode: {
            **verification(eid, mode), "equal": False, "differences": [["A", "junk"]]}
            if eid == stale else verification(eid, mode))

        got = ramet._backend.run(protocol.Acquire("fb", "next", 10 * SECOND))
        assert got["execution"] != stale  # the replacement, made when it was quarantined
        record = member(ramet, stale)
        assert (record["state"], record["lease"], record["quarantine_reason"]) == (
            "quarantined", None, "root verification: differs from its base (A junk)")
        record = pool_record(ramet, "fb")
        assert (record["size"], record["ready"], record["leased"], record["quarantined"]) == (
            1, 0, 1, 1)
        ramet._backend.run(protocol.Drop("fb"))


def test_fallback_return_quarantines_on_unreadable_data_but_not_on_a_busy_execution(
        tmp_path, source, monkeypatch):
    with Ramet(data=tmp_path / "data", mode="fallback") as ramet:
        engine = ramet._backend.engine
        base = ramet.snapshot(source)
        ramet._backend.run(protocol.Pool(base, 1, "fb"))
        eid = ramet._backend.run(protocol.Acquire("fb", "h", 60 * SECOND))["execution"]
        verification = engine.verification

        def busy(eid, mode):
            raise Busy(f"execution {eid!r} is running another command")

        monkeypatch.setattr(engine, "verification", busy)
        with pytest.raises(RametError) as caught:  # no verdict on the execution: kept leased
            ramet._backend.run(protocol.Return(eid, "h"))
        assert (caught.value.errno, str(caught.value)) == (
            errno.EBUSY, f"execution {eid!r} is running another command")
        assert member(ramet, eid)["state"] == "leased"

        def unreadable(eid, mode):
            raise PermissionError(errno.EACCES, "Permission denied", "data/big.bin")

        monkeypatch.setattr(engine, "verification", unreadable)
        reply = ramet._backend.run(protocol.Return(eid, "h"))
        assert (reply["state"], reply["verification"]) == ("quarantined", None)
        assert member(ramet, eid)["quarantine_reason"] == (
            "root verification failed: [Errno 13] Permission denied: 'data/big.bin'")
        monkeypatch.setattr(engine, "verification", verification)
        ramet._backend.run(protocol.Drop("fb"))
