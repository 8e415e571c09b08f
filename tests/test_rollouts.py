"""RL rollouts: 200 SkyRL-Gym episodes over a pool of 4 executions, each episode clean; and
8 with the Docker runtime, in containers of the session's dockerd.

Each episode acquires an execution, verifies it equals the base, runs one shell action in a
sandbox and a reward command, and hands the execution back (reset by the pool).
Every first observation shows the base tree alone, so no episode saw another's files.  The
episode rate and the seconds spent in acquire, verify and release (reset) are printed (run
with ``-s``); docs/integrations.md records them.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import skyrl_gym

from conftest import containers, require_bwrap
from rametfs import Ramet
from rametfs.integrations.skyrl import ENV_ID, RametShellEnv
from rametfs.sandbox import Docker

EPISODES, CONTAINER_EPISODES, POOL, NOBODY = 200, 8, 4, 65534
PROMPT = [{"role": "user", "content": "write 42 to answer.txt"}]


def episode(pool, n: int, runtime=None) -> tuple[str, float, dict, str]:
    env = skyrl_gym.make(ENV_ID, extras={"pool": pool, "reward_command": "grep -qx 42 answer.txt",
                                         "timeout": 30, "runtime": runtime})
    assert isinstance(env, RametShellEnv)
    prompt, info = env.init(PROMPT)
    assert prompt == PROMPT
    out = env.step(f"ls; cat answer.txt 2>/dev/null || echo no answer; "
                   f"echo {42 if n % 2 else 41} > answer.txt; echo {n}")
    assert out["done"] and out["metadata"]["exit_code"] == 0
    env.close()
    env.close()  # a second close does nothing
    return out["observations"][0]["content"], out["reward"], env.get_metrics(), info["execution"]


def test_200_episodes_over_a_pool_of_4_each_starts_clean(allow_other_daemon, tmp_path):
    require_bwrap()
    rollouts(Ramet(allow_other_daemon.mnt), tmp_path, EPISODES, None)


@pytest.mark.parametrize("container_engine", ["docker"], indirect=True)
def test_episodes_in_docker_containers_each_start_clean(allow_other_daemon, tmp_path,
                                                        container_engine):
    runtime = Docker(containers.IMAGE, NOBODY, NOBODY, docker=container_engine.client)
    rollouts(Ramet(allow_other_daemon.mnt), tmp_path, CONTAINER_EPISODES, runtime)
    assert container_engine.containers() == []  # each removed once it exited (--rm)


def rollouts(ramet: Ramet, tmp_path, episodes: int, runtime) -> None:
    """``episodes`` episodes over a pool of :data:`POOL`, four at a time, in ``runtime``
    (None: the environment's default, bubblewrap); checks every one started clean."""
    src = tmp_path / "task"
    src.mkdir()
    (src / "task.txt").write_text("write 42 to answer.txt\n")
    for path in (src, src / "task.txt"):
        os.chown(path, NOBODY, NOBODY)
    base = ramet.snapshot(src)
    with ramet.execution_pool(base, concurrency=POOL) as pool:
        start = time.perf_counter()
        with ThreadPoolExecutor(POOL) as threads:
            results = list(threads.map(lambda n: episode(pool, n, runtime), range(episodes)))
        elapsed = time.perf_counter() - start
        observations = [r[0] for r in results]
        assert observations == [f"task.txt\nno answer\n{n}\n"
                                for n in range(episodes)]
        assert sum(r[1] for r in results) == episodes // 2
        assert [r[1] for r in results[:4]] == [0.0, 1.0, 0.0, 1.0]
        assert len({r[3] for r in results}) == POOL
        pooled = {e["id"] for e in ramet.executions() if e["base"] == base}
        assert pooled == {r[3] for r in results}
        assert all(ramet.execution(e).verify() == [] for e in pooled)
    metrics = [r[2] for r in results]
    assert all(m["turns"] == 1 for m in metrics)
    means = {key: statistics.mean(m[key] for m in metrics) * 1000
             for key in ("acquire_s", "verify_s", "step_s", "release_s")}
    print(f"\n{episodes} episodes over a pool of {POOL} in {elapsed:.2f} s: "
          f"{episodes / elapsed:.1f} episodes/s; mean ms per episode: "
          + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in means.items()))
