"""``python -m benchmarks.s3_clients``: boto3 against obstore on many small ranged GETs of one
pack object (docs/remote.md, Choices), on the Ceph RADOS Gateway tools/services starts.

One 16 MiB object; then, for each client, ``--gets`` ranged GETs of ``--bytes`` each at
random offsets: one at a time (the latency of a request), and 8 at a time (the remote's
``GET_THREADS``: boto3 on a thread pool, obstore on the same pool, since its sync calls
release the GIL).  obstore's ``get_ranges`` (many ranges of one object in one call: it merges
near ones, as rametfs.store.remote does itself) is timed too.  Each figure is the best of
``--repeat`` runs, in GETs a second.  Needs root (the services) and obstore installed
(``pip install obstore``: not a dependency of rametfs).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
OBJECT_BYTES = 16 << 20
THREADS = 8


def best(repeat: int, fn) -> float:
    """The fastest of ``repeat`` runs of ``fn``, in seconds."""
    times = []
    for _ in range(repeat):
        t = time.monotonic()
        fn()
        times.append(time.monotonic() - t)
    return min(times)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--gets", default=2000, show_default=True, help="Ranged GETs per run.")
@click.option("--bytes", "size", default=4096, show_default=True, help="Bytes per GET.")
@click.option("--repeat", default=3, show_default=True)
def main(gets: int, size: int, repeat: int) -> None:
    import boto3
    import botocore.config
    import obstore
    from obstore.store import S3Store
    scratch = Path(tempfile.mkdtemp(prefix="rametfs-bench-s3-"))
    os.chmod(scratch, 0o711)  # PostgreSQL runs as postgres under it
    services = scratch / "services"
    try:
        started = subprocess.run([sys.executable, str(ROOT / "tools" / "services"), "start",
                                  str(services)], capture_output=True, text=True)
        if started.returncode:
            raise click.ClickException(f"tools/services start: {started.stderr}")
        env = json.loads((services / "env.json").read_text())
        s3 = boto3.session.Session().client(
            "s3", endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
            config=botocore.config.Config(max_pool_connections=THREADS,
                                          request_checksum_calculation="when_required",
                                          response_checksum_validation="when_required"))
        s3.create_bucket(Bucket="bench")
        s3.put_object(Bucket="bench", Key="pack", Body=os.urandom(OBJECT_BYTES))
        store = S3Store("bench", endpoint=env["AWS_ENDPOINT_URL"],
                        access_key_id=env["AWS_ACCESS_KEY_ID"],
                        secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                        region=env["AWS_DEFAULT_REGION"], client_options={"allow_http": True})
        rng = random.Random(1)
        starts = [rng.randrange(0, OBJECT_BYTES - size) for _ in range(gets)]

        def boto_get(start: int) -> None:
            body = s3.get_object(Bucket="bench", Key="pack",
                                 Range=f"bytes={start}-{start + size - 1}")["Body"].read()
            assert len(body) == size

        def obstore_get(start: int) -> None:
            assert len(obstore.get_range(store, "pack", start=start, length=size)) == size

        def obstore_ranges() -> None:
            got = obstore.get_ranges(store, "pack", starts=starts,
                                     ends=[s + size for s in starts])
            assert all(len(b) == size for b in got)

        figures = {"gets": gets, "bytes": size, "repeat": repeat}
        with ThreadPoolExecutor(THREADS) as pool:
            for name, get in (("boto3", boto_get), ("obstore", obstore_get)):
                one = best(repeat, lambda get=get: [get(s) for s in starts])
                many = best(repeat, lambda get=get: list(pool.map(get, starts)))
                figures[name] = {"one_at_a_time_per_s": round(gets / one),
                                 f"{THREADS}_at_a_time_per_s": round(gets / many)}
        figures["obstore"]["get_ranges_per_s"] = round(gets / best(repeat, obstore_ranges))
    finally:
        subprocess.run([sys.executable, str(ROOT / "tools" / "services"), "stop",
                        str(services)], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    click.echo(json.dumps(figures, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
