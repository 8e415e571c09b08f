"""Episodes per second of the SkyRL-Gym environment, by sandbox: bubblewrap, Docker, Podman.

Run it through ``tools/bench-episodes`` (which prepares .venv first), as root::

    tools/bench-episodes [--episodes N] [--runtimes bubblewrap,docker,podman] [--json FILE]

It serves a daemon of its own (``--allow-other``), snapshots a one-file task, and for each
runtime runs ``N`` episodes (``rametfs.integrations.skyrl``: acquire, verify, one action,
the reward command, release) over a pool of 4 executions, four workers at a time, then 20
single ``true`` commands one after another.  Docker is a private ``dockerd``, Podman rootful
with storage of its own, both on the image ``tools/containers.py`` builds (no registry);
each engine's start and image build are not timed.  Prints one line per runtime: episodes
per second, mean milliseconds per episode of acquire, verify, the two sandboxed commands and
release, and the median of one ``true``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import skyrl_gym

import containers
from demo import rametfs, stop_daemon
from rametfs import Ramet
from rametfs.integrations.skyrl import ENV_ID
from rametfs.sandbox import Bubblewrap, Docker, Runtime

POOL, NOBODY, SINGLE = 4, 65534, 20
ENGINES = {"docker": containers.Dockerd, "podman": containers.Podman}
PROMPT = [{"role": "user", "content": "write 42 to answer.txt"}]


def episode(pool, runtime: Runtime, n: int) -> dict:
    """One episode; its timings (``acquire_s``, ``verify_s``, ``step_s``, ``release_s``)."""
    env = skyrl_gym.make(ENV_ID, extras={"pool": pool, "runtime": runtime, "timeout": 60,
                                         "reward_command": "grep -qx 42 answer.txt"})
    env.init(PROMPT)
    out = env.step(f"cat task.txt; echo {42 if n % 2 else 41} > answer.txt")
    env.close()
    if out["metadata"]["exit_code"] != 0 or out["reward"] != n % 2:
        raise click.ClickException(f"episode {n}: {out}")
    return env.get_metrics()


def measure(ramet: Ramet, base: str, runtime: Runtime, episodes: int) -> dict:
    """Episodes per second and the mean timings, and the median seconds of one ``true``."""
    with ramet.execution_pool(base, concurrency=POOL) as pool:
        start = time.perf_counter()
        with ThreadPoolExecutor(POOL) as threads:
            metrics = list(threads.map(lambda n: episode(pool, runtime, n), range(episodes)))
        elapsed = time.perf_counter() - start
        with pool.acquire() as execution:
            single = [runtime.run(execution, ["true"], timeout=60).seconds
                      for _ in range(SINGLE)]
    means = {key[:-2]: statistics.mean(m[key] for m in metrics) * 1000
             for key in ("acquire_s", "verify_s", "step_s", "release_s")}
    return {"episodes": episodes, "seconds": elapsed, "episodes_per_s": episodes / elapsed,
            "mean_ms": means, "true_median_ms": statistics.median(single) * 1000}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--episodes", type=click.IntRange(1), default=40, show_default=True,
              help="Episodes per runtime.")
@click.option("--runtimes", default="bubblewrap,docker,podman", show_default=True,
              help="Comma-separated: bubblewrap, docker, podman.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the figures to this file.")
def main(episodes: int, runtimes: str, json_file: Path | None) -> None:
    """Episodes per second of the SkyRL-Gym environment under each sandbox."""
    names = [n.strip() for n in runtimes.split(",") if n.strip()]
    unknown = set(names) - {"bubblewrap", *ENGINES}
    if unknown:
        raise click.UsageError(f"unknown runtimes: {', '.join(sorted(unknown))}")
    work = Path(tempfile.mkdtemp(prefix="rametfs-bench-episodes-"))
    (work / "mnt").mkdir()
    (work / "task").mkdir()
    (work / "task" / "task.txt").write_text("write 42 to answer.txt\n")
    for path in (work / "task", work / "task" / "task.txt"):
        os.chown(path, NOBODY, NOBODY)
    figures = {}
    try:
        rametfs("mount", "--data", str(work / "data"), str(work / "mnt"), "--background",
                "--allow-other", "--log", str(work / "daemon.log"))
        ramet = Ramet(work / "mnt")
        base = ramet.snapshot(work / "task")
        for name in names:
            engine = None
            try:
                if name == "bubblewrap":
                    runtime: Runtime = Bubblewrap(NOBODY, NOBODY)
                else:
                    engine = ENGINES[name](work / name)
                    engine.start()
                    containers.build_image(engine.client)
                    runtime = Docker(containers.IMAGE, NOBODY, NOBODY, options=engine.options,
                                     docker=engine.client)
                figures[name] = result = measure(ramet, base, runtime, episodes)
            finally:
                if engine is not None:
                    engine.stop()
            means = ", ".join(f"{k} {v:.1f}" for k, v in result["mean_ms"].items())
            click.echo(f"{name:<10} {result['episodes_per_s']:6.2f} episodes/s "
                       f"({episodes} in {result['seconds']:.1f} s); mean ms: {means}; "
                       f"one 'true': {result['true_median_ms']:.0f} ms (median of {SINGLE})")
    finally:
        stop_daemon(work / "mnt")  # raises CheckFailed if it stays mounted: work is kept
        shutil.rmtree(work)
    if json_file:
        json_file.write_text(json.dumps({"pool": POOL, "runtimes": figures}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
