"""A SkyRL-Gym environment whose every episode works in a clean execution.

SkyRL-Gym (PyPI ``skyrl-gym``) environments are text in, text out: ``init(prompt)`` starts an
episode, ``step(action)`` returns ``{"observations", "reward", "done", "metadata"}``,
``close()`` ends it (``skyrl_gym.core.Env``, ``skyrl_gym.envs.base_text_env.BaseTextEnv``).
Here:

- ``init`` acquires an execution from the pool (they are all of the pool's base snapshot) and
  verifies it equals the base (``Execution.verify()``: empty), else raises RametError (EIO);
- ``step`` runs the action as a shell command (``sh -c ACTION``) in the sandbox on that
  execution, at ``/workspace``; the observation is its stdout then its stderr, as one user
  message.  The episode is done after ``max_turns`` steps; then, if a ``reward_command`` is
  set, it runs in the sandbox too and the reward is 1.0 when it exits 0, else 0.0;
- ``close`` releases the execution: the pool resets it to the base and hands it out again.

Everything comes through ``extras`` (SkyRL passes a dataset row's extras to the constructor)::

    env = skyrl_gym.make("rametfs-shell", extras={
        "pool": ramet.execution_pool(base, concurrency=4),   # required
        "runtime": Bubblewrap(),        # default: Bubblewrap()
        "max_turns": 1, "timeout": 60,  # per step, seconds
        "reward_command": "python3 -m pytest -q", "acquire_timeout": None})

:attr:`RametShellEnv.timings` holds the episode's seconds spent in acquire, verify, steps and
release (the reset); ``get_metrics()`` returns them with the turn count.
"""

from __future__ import annotations

import contextlib
import errno
import time
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from rametfs.client import Execution, RametError
from rametfs.sandbox import Bubblewrap

ENV_ID = "rametfs-shell"


class RametShellEnv(BaseTextEnv):
    """Shell episodes on clean executions; see the module docstring for ``extras``.

    One instance may run several episodes in turn: ``init`` starts each afresh."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.pool = extras["pool"]
        self.runtime = extras.get("runtime") or Bubblewrap()
        self.max_turns = int(extras.get("max_turns", 1))
        self.timeout = extras.get("timeout", 60)
        self.reward_command = extras.get("reward_command")
        self.acquire_timeout = extras.get("acquire_timeout")
        self.execution: Execution | None = None
        self.timings: dict[str, float] = {}
        self._held = contextlib.ExitStack()

    def init(self, prompt):
        """Acquire and verify a clean execution; return ``prompt`` and ``{"execution": id}``.

        Raises PoolTimeout (EBUSY) when none is free within ``acquire_timeout``, RametError
        (EIO) when the one acquired differs from the base (it is released, not used)."""
        self.turns = 0
        start = time.perf_counter()
        self.execution = self._held.enter_context(self.pool.acquire(self.acquire_timeout))
        acquired = time.perf_counter()
        left = self.execution.verify()
        self.timings = {"acquire_s": acquired - start, "verify_s": time.perf_counter() - acquired,
                        "step_s": 0.0, "release_s": 0.0}
        if left:
            self.close()
            raise RametError(errno.EIO, f"execution handed out dirty: {left[:5]}")
        return prompt, {"execution": self.execution.id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Run ``action`` with ``sh -c`` in the sandbox; metadata: ``exit_code``,
        ``timed_out``, ``seconds``, and ``reward_exit_code`` when the reward command ran."""
        start = time.perf_counter()
        self.turns += 1
        result = self.runtime.run(self.execution, ["sh", "-c", action], timeout=self.timeout)
        done = self.turns >= self.max_turns
        metadata = {"exit_code": result.exit_code, "timed_out": result.timed_out,
                    "seconds": result.seconds}
        reward = 0.0
        if done and self.reward_command:
            check = self.runtime.run(self.execution, ["sh", "-c", self.reward_command],
                                     timeout=self.timeout)
            metadata["reward_exit_code"] = check.exit_code
            reward = 1.0 if check.ok else 0.0
        self.timings["step_s"] += time.perf_counter() - start
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": result.stdout + result.stderr}],
            reward=reward, done=done, metadata=metadata, postprocessed_action=None)

    def close(self) -> None:
        """Hand the execution back (the pool resets it); a second call does nothing."""
        if self.execution is None:
            return
        start = time.perf_counter()
        self.execution = None
        self._held.close()
        self.timings["release_s"] = time.perf_counter() - start

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns, **self.timings}


if ENV_ID not in skyrl_gym.registry:
    skyrl_gym.register(id=ENV_ID, entry_point=RametShellEnv)
