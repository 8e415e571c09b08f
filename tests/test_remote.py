"""Publishing snapshots to a remote (S3: Ceph's RADOS Gateway; catalog: PostgreSQL 15, both
started by tools/services once per run, on 127.0.0.1) and reading them on another worker
(docs/remote.md).

Each test has its own bucket and catalog schema.  The services are skipped, with the reason,
where their Debian packages are missing (tools/services install, or tools/setup as root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from conftest import Daemon, check_log, require_fuse, run

SERVICES = Path(__file__).resolve().parents[1] / "tools" / "services"
START_TIMEOUT_S = 240


@pytest.fixture(scope="session")
def services():
    """The environment of the running services (``AWS_*``, ``RAMET_CATALOG``)."""
    missing = [cmd for cmd in ("ceph-mon", "ceph-osd", "radosgw", "monmaptool")
               if shutil.which(cmd) is None]
    if missing or not os.path.exists("/usr/lib/postgresql/15/bin/initdb"):
        pytest.skip(f"Ceph or PostgreSQL 15 is not installed ({' '.join(missing) or 'initdb'} "
                    "missing): run tools/services install (or tools/setup) as root")
    if os.geteuid() != 0:
        pytest.skip("the Ceph daemons and PostgreSQL's cluster are started as root")
    root = tempfile.mkdtemp(prefix="rametfs-services-")
    try:
        proc = subprocess.run([sys.executable, str(SERVICES), "start", root], text=True,
                              capture_output=True, timeout=START_TIMEOUT_S)
        assert proc.returncode == 0, f"tools/services start failed:\n{proc.stderr}"
        with open(os.path.join(root, "env.json")) as f:
            env = json.load(f)
        yield env
    finally:
        subprocess.run([sys.executable, str(SERVICES), "stop", root], timeout=120)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def remote(services):
    """An environment naming a fresh bucket and catalog schema of the test's own:
    ``RAMET_REMOTE``, ``RAMET_CATALOG`` and the AWS variables."""
    import boto3
    import psycopg
    name = f"t{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=services["AWS_ENDPOINT_URL"],
                      aws_access_key_id=services["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=services["AWS_SECRET_ACCESS_KEY"],
                      region_name=services["AWS_DEFAULT_REGION"])
    s3.create_bucket(Bucket=name)
    with psycopg.connect(services["RAMET_CATALOG"], autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    env = {**services, "RAMET_REMOTE": f"s3://{name}/pfx",
           "RAMET_CATALOG": f"{services['RAMET_CATALOG']} options=-csearch_path={name}"}
    env["s3"] = s3
    yield env
    with psycopg.connect(services["RAMET_CATALOG"], autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {name} CASCADE")


def environ(remote: dict, **changes: str) -> dict[str, str]:
    env = {**os.environ, **{k: v for k, v in remote.items() if isinstance(v, str)}}
    env.update(changes)
    return env


def rametfs(*args: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "rametfs", *args, env=env, check=check)


def make_tree(root: Path) -> None:
    """Files of every kind the store keeps: small and many-page files, an empty one, a sparse
    one, a symlink, a hard link, nested and empty directories, odd modes."""
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    for i in range(120):
        (root / "src" / "pkg" / f"mod{i}.py").write_text(f"value = {i}\n" * (i + 1))
    (root / "big.bin").write_bytes(os.urandom(3 * 65536 + 123))
    (root / "empty").write_bytes(b"")
    with open(root / "sparse", "wb") as f:
        f.truncate(1 << 20)
        f.seek(300000)
        f.write(b"island")
    (root / "link").symlink_to("src/pkg/mod1.py")
    os.link(root / "big.bin", root / "big-hardlink")
    (root / "script.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "script.sh", 0o750)


def tar_of(path: Path) -> bytes:
    """The tar stream of the tree at ``path`` (names sorted): equal streams mean equal names,
    bytes, modes, owners, times, links."""
    return subprocess.run(["tar", "-C", str(path), "--sort=name", "--numeric-owner", "-cf",
                           "-", "."], check=True, capture_output=True, timeout=120).stdout


def test_a_published_snapshot_outlives_its_worker(tmp_path, remote, request):
    """Worker 1 publishes two snapshots (the second a small change of the first), its data
    directory is deleted, and worker 2 (its own data directory and mount, the same remote and
    catalog) lists them, creates an execution of each and reads every byte equal to the
    source (cmp, tar)."""
    require_fuse()
    src = tmp_path / "src"
    make_tree(src)
    one = Daemon(tmp_path / "data1", tmp_path / "mnt1")
    one.start()
    try:
        first = one.snapshot(src, label="base")
        copy = tmp_path / "src-v2"
        shutil.copytree(src, copy, symlinks=True)
        (copy / "src" / "pkg" / "mod7.py").write_text("changed\n")
        (copy / "new.txt").write_text("new\n")
        second = one.snapshot(copy, label="changed")
        env = environ(remote)
        out = json.loads(rametfs("publish", "--data", str(one.data_dir), first, "--json",
                                 env=env).stdout)
        assert out["snapshot"] == first and not out["already"]
        # 120 small files, a big one and the rest: one pack, one PUT, not one per object.
        assert (out["packs"], out["requests"]) == (1, 1)
        # The root, src/, src/pkg/, empty-dir/; the modules, big.bin (twice linked), sparse
        # and script.sh (the empty file has no record); 120 + 4 + 1 chunks (sparse: 1).
        assert (out["trees"], out["contents"], out["chunks"]) == (4, 123, 126)
        again = json.loads(rametfs("publish", "--data", str(one.data_dir), first, "--json",
                                   env=env).stdout)
        assert again["already"] and again["packs"] == 0
        delta = json.loads(rametfs("publish", "--data", str(one.data_dir), second, "--json",
                                   env=env).stdout)
        # Only what changed goes up: the root and src/pkg's trees (src/ too, holding it) and
        # the two new contents and their chunks.
        assert (delta["trees"], delta["contents"], delta["chunks"]) == (3, 2, 2)
    finally:
        one.stop()
    check_log(one.log_text(), [], repr(one))
    shutil.rmtree(one.data_dir)

    listed = json.loads(rametfs("ls", "--remote", "--json", env=environ(remote)).stdout)
    assert listed["remote"] == remote["RAMET_REMOTE"]
    assert [(s["id"], s["label"]) for s in listed["snapshots"]] == [(first, "base"),
                                                                     (second, "changed")]
    two = Daemon(tmp_path / "data2", tmp_path / "mnt2", env=environ(remote))
    two.start()
    try:
        for snap, source in ((first, src), (second, copy)):
            ex = two.create(snap[:11])  # a prefix, of an odd length, found in the catalog
            path = two.exec_path(ex)
            assert tar_of(path) == tar_of(source)
            files = [p for p in source.rglob("*") if p.is_file() and not p.is_symlink()]
            for f in files:
                run("cmp", f, path / f.relative_to(source))
            assert two.exec_status(ex)["base"] == snap
        assert first in os.listdir(two.mnt / "snapshots")
    finally:
        two.stop()
    check_log(two.log_text(), [], repr(two))
    # What worker 2 read is its own now: served again with no remote at all.
    three = Daemon(tmp_path / "data2", tmp_path / "mnt3")
    three.start()
    try:
        assert tar_of(three.exec_path(three.create(first))) == tar_of(src)
    finally:
        three.stop()


def test_credentials_never_show(tmp_path, remote):
    """A catalog password and the S3 secret key appear in no message, log or listing: a
    publish to a catalog that refuses the connection, a worker serving the remote."""
    require_fuse()
    secret = "pw-" + uuid.uuid4().hex
    dead_dsn = f"postgresql://postgres:{secret}@127.0.0.1:1/postgres"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("x\n")
    one = Daemon(tmp_path / "data1", tmp_path / "mnt1")
    one.start()
    try:
        snap = one.snapshot(tmp_path / "src")
        proc = rametfs("publish", "--data", str(one.data_dir), snap,
                       env=environ(remote, RAMET_CATALOG=dead_dsn), check=False)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.startswith(
            "rametfs: publish: catalog user=postgres dbname=postgres host=127.0.0.1 port=1: "
            f"find snapshot {snap}: connection failed: "), proc.stderr
        assert secret not in proc.stderr + proc.stdout
        proc = rametfs("ls", "--remote", env=environ(remote, RAMET_CATALOG=dead_dsn),
                       check=False)
        assert proc.returncode == 1 and secret not in proc.stderr + proc.stdout
        rametfs("publish", "--data", str(one.data_dir), snap, env=environ(remote))
        # The catalog belongs to the remote it first served: another is refused (EINVAL).
        proc = rametfs("publish", "--data", str(one.data_dir), snap, check=False,
                       env=environ(remote, RAMET_REMOTE="s3://another-bucket/pfx"))
        assert proc.returncode == 4
        assert proc.stderr.endswith(f"belongs to the remote {remote['RAMET_REMOTE']}, not "
                                    "s3://another-bucket/pfx\n"), proc.stderr
    finally:
        one.stop()
    # The server trusts every local connection: the password is carried, never checked.
    two = Daemon(tmp_path / "data2", tmp_path / "mnt2", env=environ(
        remote, RAMET_CATALOG=f"{remote['RAMET_CATALOG']} password={secret}"))
    two.start()
    try:
        ex = two.create(snap)
        assert (two.exec_path(ex) / "f").read_text() == "x\n"
        shown = json.dumps(two.status()) + json.dumps(two.exec_status(ex))
        with open(f"/proc/{two.pid}/cmdline", "rb") as f:
            shown += f.read().decode(errors="replace")  # ps shows it to every user
    finally:
        two.stop()
    assert "catalog user=postgres dbname=postgres host=127.0.0.1 port=" in two.log_text()
    for text in (shown, two.log_text()):
        assert remote["AWS_SECRET_ACCESS_KEY"] not in text
        assert secret not in text


def closed_port() -> int:
    """A port of 127.0.0.1 nothing listens on (the OS's pick, closed again)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.allow_log(r"WARNING rametfs.store.remote: fetching 1 tree\(s\) from s3://")
def test_without_the_object_store_reads_fail_eio_and_nothing_local_is_harmed(tmp_path, remote):
    """A worker whose object store does not answer: a publish fails (EIO, naming the
    object), and lists nothing; a published snapshot's execution is made (the catalog
    answers) but a read of what is not local fails EIO after bounded retries, with the cause
    in the daemon log, while its own snapshots serve as before; with the object store back,
    the same execution reads."""
    require_fuse()
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "a").write_text("a\n")
    (src / "d" / "b").write_text("b\n")
    dead = environ(remote, AWS_ENDPOINT_URL=f"http://127.0.0.1:{closed_port()}")
    one = Daemon(tmp_path / "data1", tmp_path / "mnt1")
    one.start()
    try:
        snap = one.snapshot(src)
        proc = rametfs("publish", "--data", str(one.data_dir), snap, env=dead, check=False)
        bucket = remote["RAMET_REMOTE"][5:].split("/")[0]
        assert proc.returncode == 1
        assert proc.stderr.startswith(f"rametfs: publish: s3://{bucket}/pfx/packs/"), proc.stderr
        assert "Could not connect to the endpoint URL" in proc.stderr
        assert json.loads(rametfs("ls", "--remote", "--json", env=dead).stdout)[
            "snapshots"] == []
        rametfs("publish", "--data", str(one.data_dir), snap, env=environ(remote))
    finally:
        one.stop()
    local = tmp_path / "local"
    local.mkdir()
    (local / "mine").write_text("mine\n")
    two = Daemon(tmp_path / "data2", tmp_path / "mnt2", env=dead)
    two.start()
    try:
        own = two.create(two.snapshot(local))
        ex = two.create(snap)
        for argv in (("cat", two.exec_path(ex) / "a"), ("ls", two.exec_path(ex))):
            proc = run(*argv, check=False)
            assert proc.returncode != 0 and "Input/output error" in proc.stderr, proc
        assert (two.exec_path(own) / "mine").read_text() == "mine\n"
    finally:
        two.stop()
    assert "Could not connect to the endpoint URL" in two.log_text()
    two.env = environ(remote)
    two.start()
    try:
        assert (two.exec_path(ex) / "a").read_text() == "a\n"
        assert (two.exec_path(ex) / "d" / "b").read_text() == "b\n"
    finally:
        two.stop()


def test_a_publish_cut_short_lists_nothing_and_resumes(tmp_path, remote):
    """A publish killed after its first pack: the catalog lists no snapshot; the next publish
    uploads only what the first did not, then lists it, and a worker reads it whole."""
    require_fuse()
    import psycopg
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):  # 40 MiB that does not compress: 3 packs of 16 MiB at most
        (src / f"f{i}").write_bytes(os.urandom(10 << 20))
    one = Daemon(tmp_path / "data1", tmp_path / "mnt1")
    one.start()
    try:
        snap = one.snapshot(src)
        env = environ(remote)
        proc = subprocess.Popen([sys.executable, "-m", "rametfs", "publish", "--data",
                                 str(one.data_dir), snap], env=env, stderr=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, text=True)
        try:
            line = proc.stderr.readline()
            assert line.startswith(f"rametfs: publish {snap[:12]}: 1 packs, "), line
        finally:
            proc.kill()
            proc.wait()
            proc.stderr.close()
        assert json.loads(rametfs("ls", "--remote", "--json", env=env).stdout)[
            "snapshots"] == []
        with psycopg.connect(remote["RAMET_CATALOG"]) as conn:
            (already,), = conn.execute("SELECT count(*) FROM rametfs_objects").fetchall()
        assert already > 0
        done = json.loads(rametfs("publish", "--data", str(one.data_dir), snap, "--json",
                                  env=env).stdout)
        # 4 files of 160 chunks each, their 4 content records and the root tree.
        assert done["trees"] + done["contents"] + done["chunks"] == 645 - already
        assert not done["already"]
    finally:
        one.stop()
    shutil.rmtree(one.data_dir)
    two = Daemon(tmp_path / "data2", tmp_path / "mnt2", env=environ(remote))
    two.start()
    try:
        ex = two.create(snap)
        for i in range(4):
            run("cmp", src / f"f{i}", two.exec_path(ex) / f"f{i}")
    finally:
        two.stop()


def test_promote_publish_from_the_harness(tmp_path, remote):
    """``rametfs promote --publish`` (the wrapper's ``promote(publish=True)``) on a daemon
    served with the remote publishes the new snapshot, which another worker then reads; the
    root command ``publish`` is idempotent; an execution may not publish (EACCES), and a
    daemon with no remote says so (EINVAL)."""
    require_fuse()
    from rametfs import Ramet
    from rametfs.client import RametError
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("base\n")
    env = environ(remote)
    one = Daemon(tmp_path / "data1", tmp_path / "mnt1", env=env)
    one.start()
    try:
        ex = one.create(one.snapshot(tmp_path / "src"))
        (one.exec_path(ex) / "f").write_text("promoted\n")
        snap = rametfs("promote", "--publish", ex, "-m", str(one.mnt), env=env).stdout.strip()
        again = one.ctl(f"publish {snap}")
        assert again["snapshot"] == snap and again["published"]["already"]
        with pytest.raises(OSError) as refused:
            from conftest import ctl_command
            ctl_command(one.exec_path(ex) / ".ramet" / "ctl", "promote --publish yes")
        assert refused.value.errno == 13
        assert refused.value.reply["error"].startswith("promote --publish: what goes to the "
                                                       "remote is the harness's")
        (one.exec_path(ex) / "f").write_text("by the wrapper\n")
        with Ramet(one.mnt) as ramet:
            second = ramet.execution(ex).promote(publish=True)
            assert ramet.publish(second)["already"]
    finally:
        one.stop()
    listed = json.loads(rametfs("ls", "--remote", "--json", env=env).stdout)
    assert [s["id"] for s in listed["snapshots"]] == [snap, second]
    plain = Daemon(tmp_path / "data3", tmp_path / "mnt3")
    plain.start()
    try:
        with Ramet(plain.mnt) as ramet, pytest.raises(RametError) as no_remote:
            ramet.publish(ramet.snapshot(tmp_path / "src"))
        assert no_remote.value.errno == 22
        assert "this daemon serves no remote" in str(no_remote.value)
    finally:
        plain.stop()
    two = Daemon(tmp_path / "data2", tmp_path / "mnt2", env=env)
    two.start()
    try:
        assert (two.exec_path(two.create(snap)) / "f").read_text() == "promoted\n"
        assert (two.exec_path(two.create(second)) / "f").read_text() == "by the wrapper\n"
    finally:
        two.stop()


def test_kills_during_publish_never_list_a_snapshot_with_missing_objects(tmp_path, remote,
                                                                          monkeypatch):
    """Publishes of three snapshots killed 20 times at moments spread over their run: after
    each kill, ``fsck --remote``'s check finds every listed snapshot whole; then each
    publish completes, and fsck counts all three."""
    require_fuse()
    import random
    import time
    from rametfs.store.remote import Remote
    from rametfs.store.remote_fsck import check
    for key, value in environ(remote).items():
        monkeypatch.setenv(key, value)
    src = tmp_path / "src"
    (src / "small").mkdir(parents=True)
    for i in range(300):
        (src / "small" / f"f{i}").write_text(f"{i}\n" * i)
    one = Daemon(tmp_path / "data1", tmp_path / "mnt1")
    one.start()
    snaps = []
    try:
        for n in range(3):  # each adds 12 MiB that does not compress
            (src / f"big{n}").write_bytes(os.urandom(12 << 20))
            snaps.append(one.snapshot(src))
        where = Remote(remote["RAMET_REMOTE"], remote["RAMET_CATALOG"])
        rng = random.Random(19)
        try:
            for kill in range(20):
                snap = snaps[kill % 3]
                proc = subprocess.Popen([sys.executable, "-m", "rametfs", "publish", "--data",
                                         str(one.data_dir), snap], env=environ(remote),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(rng.uniform(0.5, 3.0))
                proc.kill()
                proc.wait()
                report = check(where)
                assert report.problems == [], (kill, report)
            for snap in snaps:
                rametfs("publish", "--data", str(one.data_dir), snap, env=environ(remote))
            report = check(where)
            assert (report.snapshots, report.problems) == (3, [])
            assert report.contents == 300 - 1 + 3  # f0 is empty
        finally:
            where.close()
    finally:
        one.stop()
    proc = rametfs("fsck", env=environ(remote))
    # The three roots and small/ (shared); 299 small chunks and 3 x 192 of 64 KiB.
    assert proc.stderr.startswith("3 published snapshots, 4 trees, 302 contents, 875 chunks, "
                                  ), proc.stderr


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts connections and never answers (a catalog host
    that hangs: libpq waits out its connect_timeout); ``accepted`` counts connections."""

    def __init__(self):
        import socket
        import threading
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.held: list = []
        self.first = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.held.append(conn)
            self.accepted += 1
            self.first.set()

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_catalog_lookups_never_hold_the_daemon(tmp_path):
    """A daemon whose catalog hangs (each call waits out 3 connection timeouts of 2 s): many
    lookups of unknown hex names under ``snapshots/`` and a ``create`` of one, all at once,
    run in worker threads, so a bystander execution's stat/create/write/read rounds are all
    served while the first lookup still waits; then every lookup fails EIO, and the create
    EIO naming the catalog."""
    require_fuse()
    pytest.importorskip("psycopg")
    pytest.importorskip("boto3")
    import errno
    import threading
    from conftest import ctl_command
    silent = SilentServer()
    env = {"RAMET_REMOTE": "s3://bucket/pfx", "RAMET_CATALOG":
           f"host=127.0.0.1 port={silent.port} user=ramet dbname=ramet",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed_port()}", "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("base\n")
    d = Daemon(tmp_path / "data", tmp_path / "mnt", env=env)
    d.start()
    try:
        ex = d.create(d.snapshot(tmp_path / "src"))  # a full id found here: no catalog call
        path = d.exec_path(ex)
        lookups = 80
        names = [uuid.uuid4().hex[:8 + i % 40] for i in range(lookups)]
        errnos: dict[str, int] = {}
        create: dict = {}

        def look(name: str) -> None:
            try:
                os.stat(d.mnt / "snapshots" / name)
                errnos[name] = 0
            except OSError as exc:
                errnos[name] = exc.errno

        unknown = uuid.uuid4().hex[:16]

        def create_unknown() -> None:
            try:
                ctl_command(d.mnt / ".ramet" / "ctl", f"create {unknown}")
            except OSError as exc:
                create.update(errno=exc.errno, reply=exc.reply)

        threads = [threading.Thread(target=look, args=(n,)) for n in names]
        threads.append(threading.Thread(target=create_unknown))
        for t in threads:
            t.start()
        assert silent.first.wait(60), "no lookup reached the catalog"
        for i in range(20):  # the bystander, while lookups wait for the catalog
            f = path / f"round{i}"
            f.write_text(f"round {i}\n")
            assert f.read_text() == f"round {i}\n"
            assert os.stat(f).st_size == len(f"round {i}\n")
            assert (path / "f").read_text() == "base\n"
        pending = sum(t.is_alive() for t in threads)
        for t in threads:
            t.join(120)
        # Each lookup waits out 3 connection timeouts of 2 s (then the others fail at once),
        # so the bystander's rounds were served while lookups waited.
        assert pending == lookups + 1, pending
        # The kernel sends the lookups of one directory one at a time (no parallel dirops),
        # so none finds CATALOG_WAITING others waiting (that bound: the test below).
        assert list(errnos.values()) == [errno.EIO] * lookups
        assert create["errno"] == errno.EIO
        assert create["reply"]["error"] == (
            f"catalog user=ramet dbname=ramet host=127.0.0.1 port={silent.port}: find snapshot "
            f"{unknown}: connection timeout expired"), create
        # The catalog answered nothing: a lookup now is as prompt an EIO (it is not retried
        # for a while), and a name found here is served at once.
        with pytest.raises(OSError) as again:
            os.stat(d.mnt / "snapshots" / uuid.uuid4().hex[:12])
        assert again.value.errno == errno.EIO
        assert (path / "round19").read_text() == "round 19\n"
    finally:
        d.stop()
        silent.close()
    check_log(d.log_text(), [], repr(d))


def test_lookups_waiting_for_the_catalog_are_bounded(tmp_path, monkeypatch):
    """Lookups of ``snapshots/`` entries that wait for a catalog that hangs: at most
    CATALOG_WAITING wait (each then fails EIO), the others fail at once, EAGAIN."""
    pytest.importorskip("psycopg")
    pytest.importorskip("boto3")
    import errno
    import trio
    from rametfs.errors import RametError
    from rametfs.overlay.resolve import CATALOG_WAITING, Resolver
    from rametfs.store import Store
    from rametfs.store.remote import Remote
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    silent = SilentServer()
    store = Store(tmp_path / "data")
    store.remote = Remote("s3://bucket/pfx", f"host=127.0.0.1 port={silent.port} user=r")
    resolver = Resolver(store)
    failed: list[int] = []

    async def look(ref: str) -> None:
        try:
            await resolver.entry(ref)
        except RametError as exc:
            failed.append(exc.errno)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(CATALOG_WAITING + 16):
                nursery.start_soon(look, uuid.uuid4().hex[:16])

    try:
        trio.run(main)
    finally:
        store.remote.close()
        store.close()
        silent.close()
    assert sorted(failed) == [errno.EIO] * CATALOG_WAITING + [errno.EAGAIN] * 16


def catalog_rows(remote: dict) -> dict[str, int]:
    """Rows of the test's catalog: objects by kind name, packs, snapshots, names."""
    import psycopg
    with psycopg.connect(remote["RAMET_CATALOG"]) as conn:
        kinds = dict(conn.execute("SELECT kind, count(*) FROM rametfs_objects GROUP BY kind"))
        counts = {t: conn.execute(f"SELECT count(*) FROM rametfs_{t}").fetchone()[0]
                  for t in ("packs", "snapshots", "names", "publishes")}
    return {**{n: kinds.get(k, 0) for k, n in ((0, "chunks"), (1, "contents"), (2, "trees"))},
            **counts}


def bucket_packs(remote: dict) -> set[str]:
    bucket = remote["RAMET_REMOTE"][5:].split("/")[0]
    listed = remote["s3"].list_objects_v2(Bucket=bucket, Prefix="pfx/packs/")
    return {o["Key"].rsplit("/", 1)[1] for o in listed.get("Contents", ())}


def test_names_rm_and_forget_on_the_remote(tmp_path, remote):
    """``name --remote`` names a published snapshot for every worker (a worker's own name
    of the same spelling comes first there; a moved name is seen at once); ``rm --remote``
    refuses a named snapshot without --force; ``forget --remote`` keeps what its rules keep;
    ``gc --remote`` then deletes what only the delisted snapshots reached, and what stays
    is whole (fsck --remote) and read equal to its source by another worker."""
    require_fuse()
    env = environ(remote)
    src = tmp_path / "src"
    make_tree(src)
    one = Daemon(tmp_path / "data1", tmp_path / "mnt1")
    one.start()
    try:
        snaps = []
        for n in range(3):
            (src / "version").write_text(f"{n}\n")
            (src / f"only{n}.bin").write_bytes(os.urandom(200000))
            snaps.append(one.snapshot(src, label=f"v{n}"))
            rametfs("publish", "--data", str(one.data_dir), snaps[-1], env=env)
            (src / f"only{n}.bin").unlink()
        one.ctl(f"name base {snaps[0]}")  # worker 1's own name
    finally:
        one.stop()
    assert rametfs("name", "--remote", "base", snaps[0][:10], env=env).stdout == \
        f"base -> {snaps[0]}\n"
    bad = rametfs("name", "--remote", "0123abcd99", snaps[0], env=env, check=False)
    assert bad.returncode == 4 and "ambiguous with a snapshot id prefix" in bad.stderr
    two = Daemon(tmp_path / "data2", tmp_path / "mnt2", env=env)
    two.start()
    try:
        ex = two.create("base")
        assert (two.exec_path(ex) / "version").read_text() == "0\n"
        assert os.readlink(two.mnt / "snapshots" / "base") == snaps[0]
        assert rametfs("name", "--remote", "base", snaps[1], env=env).stdout == \
            f"base -> {snaps[1]} (was {snaps[0]})\n"
        assert (two.exec_path(two.create("base")) / "version").read_text() == "1\n"
        assert os.readlink(two.mnt / "snapshots" / "base") == snaps[1]
        two.ctl(f"name base {snaps[2]}")  # its own name comes first
        assert (two.exec_path(two.create("base")) / "version").read_text() == "2\n"
    finally:
        two.stop()
    listed = json.loads(rametfs("ls", "--remote", "--json", env=env).stdout)["snapshots"]
    assert [s["names"] for s in listed] == [[], ["base"], []]
    refused = rametfs("rm", "--remote", "base", env=env, check=False)
    assert refused.returncode == 5, refused
    assert refused.stderr == (f"rametfs: rm --remote: snapshot {snaps[1][:12]}: name 'base' "
                              "points at it: --force deletes the names\n")
    assert rametfs("rm", "--remote", snaps[0], env=env).stdout == f"delisted {snaps[0]}\n"
    assert rametfs("rm", "--remote", snaps[0], env=env, check=False).returncode == 3
    planned = json.loads(rametfs("forget", "--remote", "--keep-last", "1", "--json",
                                 env=env).stdout)
    assert (planned["removed"], planned["names"]) == ([snaps[1]], ["base"])
    assert [k["snapshot"] for k in planned["kept"]] == [snaps[2]]
    assert catalog_rows(remote)["snapshots"] == 1 and catalog_rows(remote)["names"] == 0
    before, packs = catalog_rows(remote), bucket_packs(remote)
    report = json.loads(rametfs("gc", "--remote", "--json", env=env).stdout)
    # What only the delisted two reached went: each one's root tree, its version file (a
    # record and a chunk) and its 200,000 bytes (a record and 4 chunks); so did the pack of
    # the second, holding nothing else (the first's holds what the third still reaches).
    assert report["deleted"] == {"chunk": 2 * 5, "content": 2 * 2, "tree": 2}, report
    after = catalog_rows(remote)
    assert after["chunks"] == before["chunks"] - 10
    assert report["packs"] == 1 and len(bucket_packs(remote)) == len(packs) - 1
    assert after["packs"] == before["packs"] - 1
    proc = rametfs("fsck", env=env)
    assert proc.stderr.startswith("1 published snapshots, "), proc.stderr
    again = json.loads(rametfs("gc", "--remote", "--json", env=env).stdout)
    assert again["deleted"] == {"chunk": 0, "content": 0, "tree": 0} and again["packs"] == 0
    three = Daemon(tmp_path / "data3", tmp_path / "mnt3", env=env)
    three.start()
    try:
        path = three.exec_path(three.create(snaps[2]))
        assert (path / "version").read_text() == "2\n"
        assert (path / "only2.bin").stat().st_size == 200000
        assert tar_of(path / "src") == tar_of(src / "src")
        proc = run("cat", path / "only1.bin", check=False)
        assert proc.returncode == 1 and "No such file" in proc.stderr
    finally:
        three.stop()


def test_remote_gc_is_safe_against_publishes_at_the_same_time(tmp_path, remote, monkeypatch):
    """Interleavings of a remote gc and publishes relying on objects only a delisted snapshot
    reaches: (1) a publish that has asked what is published: the gc waits for it, then keeps
    what it listed; (2) one not seen within the gc's grace period: the gc takes it for dead
    and deletes, and the publish then fails and lists nothing, and runs again whole; (3) a
    publish that runs whole between the gc's mark and its sweep: the gc marks it too.  After
    each, fsck --remote finds every listed snapshot whole, and a worker reads them all."""
    require_fuse()
    import threading
    from rametfs.errors import Busy, RametError
    from rametfs.store import Store
    from rametfs.store import publish as publishing
    from rametfs.store.remote import Remote
    from rametfs.store.remote_fsck import check
    from rametfs.store.remote_gc import collect
    for key, value in environ(remote).items():
        monkeypatch.setenv(key, value)
    src = tmp_path / "src"
    make_tree(src)
    one = Daemon(tmp_path / "data1", tmp_path / "mnt1")
    one.start()
    try:
        snaps = []
        for n in range(4):  # each the base and a file of its own
            (src / "own").write_text(f"{n}\n")
            snaps.append(one.snapshot(src, label=f"v{n}"))
    finally:
        one.stop()
    store = Store.open_read_only(one.data_dir)
    where = Remote(remote["RAMET_REMOTE"], remote["RAMET_CATALOG"])
    walked, resume = threading.Event(), threading.Event()
    real_missing_trees = publishing._missing_trees

    def paused_missing_trees(*args):  # the publish has asked what is published
        found = real_missing_trees(*args)
        walked.set()
        assert resume.wait(120)
        return found

    def publish_paused(sid: str, outcome: dict) -> threading.Thread:
        walked.clear()
        resume.clear()

        def run() -> None:
            other = Remote(remote["RAMET_REMOTE"], remote["RAMET_CATALOG"])
            try:
                outcome["done"] = publishing.publish(store, other, sid)
            except RametError as exc:
                outcome["error"] = exc
            finally:
                other.close()
        thread = threading.Thread(target=run)
        thread.start()
        assert walked.wait(120)
        return thread

    def whole(count: int) -> None:
        report = check(where)
        assert (report.snapshots, report.problems) == (count, []), report

    try:
        publishing.publish(store, where, snaps[0])
        rametfs("rm", "--remote", snaps[0], env=environ(remote))  # its base: unreached now
        monkeypatch.setattr(publishing, "_missing_trees", paused_missing_trees)

        # (1) The publish of v1 found the base's trees published, and skips them.
        outcome: dict = {}
        thread = publish_paused(snaps[1], outcome)
        rows = catalog_rows(remote)
        with pytest.raises(Busy):
            collect(where, grace_s=3600, wait_s=2)
        assert catalog_rows(remote) == rows  # nothing deleted
        gc_report: dict = {}
        gc = threading.Thread(target=lambda: gc_report.update(
            collect(where, grace_s=3600, wait_s=120).to_json()))
        gc.start()
        resume.set()
        thread.join(120)
        gc.join(120)
        assert "error" not in outcome and not outcome["done"].already
        # v0's own file went (its record and chunk; its root tree); v1 kept the rest.
        assert gc_report["deleted"] == {"chunk": 1, "content": 1, "tree": 1}, gc_report
        assert gc_report["snapshots"] == 1
        whole(1)

        # (2) The publish of v2 is not seen for longer than the grace period (0 s here).
        rametfs("rm", "--remote", snaps[1], env=environ(remote))
        outcome = {}
        thread = publish_paused(snaps[2], outcome)
        report = collect(where, grace_s=0, wait_s=0)
        assert report.stale_publishes == 1
        # All of v1: it relied on the base, which went too (its own file: a record and a
        # chunk, then the base's 123 records, 126 chunks and 4 trees).
        assert report.deleted == {"chunk": 1 + 126, "content": 1 + 123, "tree": 4}, report
        resume.set()
        thread.join(120)
        assert "done" not in outcome
        assert str(outcome["error"]).startswith("a remote gc took this publish for dead")
        assert catalog_rows(remote)["snapshots"] == 0
        whole(0)
        monkeypatch.setattr(publishing, "_missing_trees", real_missing_trees)
        again = publishing.publish(store, where, snaps[2])
        assert (again.trees, again.contents, again.chunks) == (4, 124, 127)
        whole(1)

        # (3) v3 is published whole between the gc's mark and its sweep.
        real_publishes = where.catalog.publishes
        calls = []

        def publish_first(grace_s: float) -> int:
            if not calls:
                other = Remote(remote["RAMET_REMOTE"], remote["RAMET_CATALOG"])
                try:
                    publishing.publish(store, other, snaps[3])
                finally:
                    other.close()
            calls.append(grace_s)
            return real_publishes(grace_s)
        monkeypatch.setattr(where.catalog, "publishes", publish_first)
        rametfs("rm", "--remote", snaps[2], env=environ(remote))
        report = collect(where, grace_s=3600, wait_s=60)
        assert (report.rounds, report.snapshots) == (2, 1)
        assert report.deleted == {"chunk": 1, "content": 1, "tree": 1}, report
        whole(1)
    finally:
        resume.set()
        where.close()
        store.close()
    two = Daemon(tmp_path / "data2", tmp_path / "mnt2", env=environ(remote))
    two.start()
    try:
        path = two.exec_path(two.create(snaps[3]))
        assert (path / "own").read_text() == "3\n"
        assert tar_of(path / "src") == tar_of(src / "src")
        for f in ("big.bin", "big-hardlink", "sparse", "empty", "script.sh"):
            run("cmp", src / f, path / f)
    finally:
        two.stop()
