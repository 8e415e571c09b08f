"""``python -m benchmarks.remote``: publishing to the remote and reading on another worker
(docs/remote.md, docs/benchmarks.md "Publishing and any worker").

Starts its own Ceph RADOS Gateway and PostgreSQL (tools/services) under the scratch
directory, then:

* worker 1 imports the library tree (``--size full``: with site-packages, about 50,000 files;
  ``small``: without, about 7,700; ``smoke``: 300 synthetic files) as a git repository and
  publishes it: time, pack objects, S3 requests, bytes, objects;
* changes 1% of its files in an execution, promotes and publishes that: the same figures;
* worker 2 (its own data directory, the same remote) creates an execution of the first
  snapshot: ``create``'s latency, the first byte of a file deep in the tree, ``find`` and
  a read of every file (``cat``), on a never-seen snapshot, then the read again; worker 3
  (fresh) runs ``git status`` on it;
* the same ``find``, read and ``git status`` on worker 1, from a fresh execution (its
  hydration cache holds nothing of the tree: the import and the 1% change hydrated
  nothing);
* the requests of each operation, counted in this process on a remote of its own (another
  prefix and catalog schema) through the store's own calls: the publish of both snapshots,
  then on a fresh store the lookup of the first (what ``create`` does), its first tree
  lookup (``Store.tree`` of the root: the fetch that brings the trees below), the first read
  of one file (``Store.hydrate``), the read of every file, and ``rm --remote`` of the first
  snapshot then ``gc --remote``: S3 requests by operation (PutObject, GetObject,
  HeadObject, DeleteObjects, ListObjectsV2) and catalog calls (one query or transaction
  each).

Prints one JSON document (and writes it to ``--out``/remote.json).  Needs root (the Ceph
daemons, PostgreSQL's cluster) and /dev/fuse.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from .trees import SIZES, change_files, make_git_repo

ROOT = Path(__file__).resolve().parents[1]


def rametfs(*args: str, env: dict) -> str:
    done = subprocess.run([sys.executable, "-m", "rametfs", *args], env=env, text=True,
                          capture_output=True)
    if done.returncode:
        raise click.ClickException(f"rametfs {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def timed(fn) -> tuple[float, object]:
    t = time.monotonic()
    out = fn()
    return time.monotonic() - t, out


def sh(cmd: str, cwd: Path) -> None:
    subprocess.run(["sh", "-c", cmd], cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def read_all(path: Path) -> float:
    """Seconds to read every regular file below ``path`` (cat to /dev/null)."""
    return timed(lambda: sh("find . -type f -print0 | xargs -0 cat > /dev/null", path))[0]


class Counted:
    """A remote whose S3 requests (by operation) and catalog calls are counted."""

    OPERATIONS = ("put_object", "get_object", "head_object", "delete_objects",
                  "list_objects_v2")

    def __init__(self, remote):
        self.remote = remote
        self.counts: dict[str, int] = dict.fromkeys(self.OPERATIONS + ("catalog",), 0)
        client = remote.objects.client
        for name in self.OPERATIONS:
            setattr(client, name, self._counting(name, getattr(client, name)))
        remote.catalog._call = self._counting("catalog", remote.catalog._call)

    def _counting(self, name: str, fn):
        def call(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)
        return call

    def of(self, fn) -> dict:
        """What ``fn()`` asked: the counts that are not 0, and its seconds."""
        before = dict(self.counts)
        t, _ = timed(fn)
        return {**{k: v - before[k] for k, v in self.counts.items() if v != before[k]},
                "seconds": round(t, 2)}


def count_requests(env: dict, scratch: Path, snap: str, snap2: str) -> dict:
    """The requests of publish, create, first lookup, first read, read all and gc
    (module docstring), on the remote s3://bench/count with the catalog schema ``count``."""
    import psycopg
    from rametfs.store import Store
    from rametfs.store.publish import publish
    from rametfs.store.remote import Remote
    from rametfs.store.remote_gc import collect
    with psycopg.connect(env["RAMET_CATALOG"], autocommit=True) as conn:
        conn.execute("CREATE SCHEMA count")
    dsn = f"{env['RAMET_CATALOG']} options=-csearch_path=count"
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_DEFAULT_REGION"):
        os.environ[key] = env[key]
    remote = Remote("s3://bench/count", dsn)
    counted = Counted(remote)
    figures: dict = {}
    try:
        source = Store.open_read_only(scratch / "data-one")
        try:
            figures["publish"] = counted.of(lambda: publish(source, remote, snap))
            figures["publish_1pct"] = counted.of(lambda: publish(source, remote, snap2))
        finally:
            source.close()
        store = Store(scratch / "data-count")
        store.remote = remote
        try:
            figures["create"] = counted.of(lambda: store.snapshot(snap))
            root = store.snapshot(snap).root.ref
            figures["first_lookup"] = counted.of(lambda: store.tree(root))
            files = []  # content ids, breadth first
            level = [root]
            while level:
                below = []
                for tid in level:
                    entries = store.tree(tid)
                    files += [e.ref for e in entries.values() if e.is_reg and e.size]
                    below += [e.ref for e in entries.values() if e.is_dir]
                level = below
            files = list(dict.fromkeys(files))
            figures["first_read"] = counted.of(lambda: store.hydrate(files[len(files) // 2]))
            figures["read_all"] = counted.of(lambda: [store.hydrate(c) for c in files])
            figures["files"] = len(files)
        finally:
            store.close()
        figures["rm"] = counted.of(lambda: remote.catalog.remove_snapshots(
            [bytes.fromhex(snap)], force=True))
        figures["gc"] = counted.of(lambda: collect(remote, grace_s=3600, wait_s=60))
    finally:
        remote.close()
    return figures


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--size", type=click.Choice(list(SIZES)), default="small", show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              default=Path("bench-results"), show_default=True)
def main(size: str, out: Path) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="rametfs-bench-remote-"))
    os.chmod(scratch, 0o711)
    services = scratch / "services"
    figures: dict = {"size": size}
    mounts: list[Path] = []
    try:
        t, started = timed(lambda: subprocess.run(
            [sys.executable, str(ROOT / "tools" / "services"), "start", str(services)],
            capture_output=True, text=True))
        if started.returncode:
            raise click.ClickException(f"tools/services start: {started.stderr}")
        figures["services_start_s"] = round(t, 2)
        env = {**os.environ, **json.loads((services / "env.json").read_text())}
        import boto3
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"],
                     aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                     region_name=env["AWS_DEFAULT_REGION"]).create_bucket(Bucket="bench")
        env["RAMET_REMOTE"] = "s3://bench/lib"

        tree = make_git_repo(SIZES[size].main_tree(scratch / "tree"))
        figures["tree"] = {"files": len(tree.files), "bytes": tree.bytes}
        local = {k: v for k, v in env.items() if k not in ("RAMET_REMOTE", "RAMET_CATALOG")}

        def mount(name: str, with_remote: bool) -> Path:
            mnt = scratch / f"mnt-{name}"
            rametfs("mount", "--data", str(scratch / f"data-{name}"), str(mnt), "--background",
                    env=env if with_remote else local)
            mounts.append(mnt)
            return mnt

        m1 = mount("one", False)
        where1 = {**local, "RAMET_MOUNT": str(m1)}
        t, snap = timed(lambda: rametfs("snapshot", str(tree.path), env=where1).strip())
        figures["import_s"] = round(t, 1)
        t, pub = timed(lambda: json.loads(rametfs("publish", "--data", str(scratch / "data-one"),
                                                  snap, "--json", env=env)))
        figures["publish"] = {**pub, "wall_s": round(t, 1)}

        ex = rametfs("create", snap, env=where1).strip()
        changed = tree.sample(max(1, len(tree.files) // 100), seed=1)
        change_files(m1 / "executions" / ex, changed, "remote")
        snap2 = rametfs("promote", ex, env=where1).strip().split()[0]
        t, pub2 = timed(lambda: json.loads(rametfs("publish", "--data",
                                                   str(scratch / "data-one"), snap2, "--json",
                                                   env=env)))
        figures["publish_1pct"] = {**pub2, "wall_s": round(t, 1), "files_changed": len(changed)}

        m2 = mount("two", True)
        where2 = {**env, "RAMET_MOUNT": str(m2)}
        t, ex2 = timed(lambda: rametfs("create", snap, env=where2).strip())
        w2 = m2 / "executions" / ex2
        deep = max(tree.files, key=lambda f: (f.count("/"), f))
        first = {"create_s": round(t, 3)}
        first["first_byte_s"] = round(timed(lambda: sh(f"head -c1 '{deep}' > /dev/null",
                                                       w2))[0], 3)
        first["find_s"] = round(timed(lambda: sh("find . > /dev/null", w2))[0], 2)
        first["read_all_s"] = round(read_all(w2), 1)
        first["read_all_again_s"] = round(read_all(w2), 1)  # hydrated, page cache warm
        # git status on a third worker: it rehashes every file whose index entry's inode,
        # device or ctime differ (all of them, on a new mount), so it reads the tree too.
        m3 = mount("three", True)
        ex3 = rametfs("create", snap, env={**env, "RAMET_MOUNT": str(m3)}).strip()
        first["git_status_s"] = round(timed(lambda: sh(
            "git status --porcelain > /dev/null", m3 / "executions" / ex3))[0], 1)
        figures["worker2_never_seen"] = first

        ex1 = rametfs("create", snap, env=where1).strip()
        w1 = m1 / "executions" / ex1
        figures["worker1_cold"] = {
            "find_s": round(timed(lambda: sh("find . > /dev/null", w1))[0], 2),
            "read_all_s": round(read_all(w1), 1),
            "git_status_s": round(timed(lambda: sh("git status --porcelain > /dev/null",
                                                   w1))[0], 1)}
        figures["requests"] = count_requests(env, scratch, snap, snap2)
    finally:
        for mnt in mounts:
            subprocess.run([sys.executable, "-m", "rametfs", "umount", str(mnt)],
                           capture_output=True)
        subprocess.run([sys.executable, str(ROOT / "tools" / "services"), "stop",
                        str(services)], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(figures, indent=2, sort_keys=True)
    (out / "remote.json").write_text(text + "\n")
    click.echo(text)


if __name__ == "__main__":
    main()
