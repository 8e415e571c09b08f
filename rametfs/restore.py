"""Rebuild a restored execution's rebuildable paths from the recipes its snapshot recorded.

For each recipe, in the order the policy listed them (docs/policy.md): check its inputs
against the recorded BLAKE3 hashes, run its command, run its readiness check; the first
failure stops the restore.  Commands run through a *runtime adapter*, a callable
``run(execution, argv, timeout)`` that runs ``argv`` (a list of str) with the execution's
directory as working directory and returns an object with ``returncode`` (and, if it has
them, ``stdout``/``stderr``), like :class:`subprocess.CompletedProcess`, or raises
:class:`subprocess.TimeoutExpired` after ``timeout`` seconds.  The default,
:func:`run_subprocess`, is a plain subprocess; a sandbox adapter (bubblewrap, docker) runs
the same argv inside its sandbox.

Used by :meth:`rametfs.client.Ramet.restore`; needs only the standard library, BLAKE3 and
rametfs.policy, so a harness process does not load the daemon's modules.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from .policy import path_digest

OUTPUT_TAIL_BYTES = 2000


@dataclass(frozen=True)
class Step:
    """One step of a restore: ``recipe`` name, ``step`` (``"inputs"``, ``"command"`` or
    ``"check"``), ``ok``, ``seconds`` it took, ``detail`` (what happened, with the tail of
    the output of a failed command), and on failure the ``errno`` it raises with (EIO:
    input changed or command failed; ETIMEDOUT)."""

    recipe: str
    step: str
    ok: bool
    seconds: float
    detail: str
    errno: int = 0

    def __str__(self) -> str:
        return (f"{self.recipe}: {self.step} {'ok' if self.ok else 'FAILED'} "
                f"({self.seconds:.2f} s): {self.detail}")


Runtime = Callable[[object, list, float], object]


def run_subprocess(execution, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """The default runtime adapter: ``argv`` as a subprocess in ``execution.path``, no stdin,
    output captured; raises subprocess.TimeoutExpired after ``timeout`` seconds."""
    return subprocess.run(argv, cwd=execution.path, stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=timeout)


def rebuild(execution, recipes: list[dict], run: Runtime,
            on_step: Callable[[Step], None] | None = None) -> list[Step]:
    """Run ``recipes`` (snapshot records, docs/format.md) in ``execution`` (anything with a
    ``path``); return every step taken, the last one failed if one did."""
    steps: list[Step] = []

    def record(step: Step) -> bool:
        steps.append(step)
        if on_step is not None:
            on_step(step)
        return step.ok

    for recipe in recipes:
        if not record(_check_inputs(execution, recipe)):
            break
        if not record(_run(execution, recipe, "command", recipe["command"], run)):
            break
        if recipe.get("check") and not record(_run(execution, recipe, "check",
                                                   recipe["check"], run)):
            break
    return steps


def _check_inputs(execution, recipe: dict) -> Step:
    started = time.monotonic()
    bad = []
    for item in recipe["inputs"]:
        actual = path_digest(os.path.join(execution.path, item["path"]))
        if actual is None:
            bad.append(f"{item['path']} is missing")
        elif actual != item["blake3"]:
            bad.append(f"{item['path']} changed (BLAKE3 {actual[:16]}..., recorded "
                       f"{item['blake3'][:16]}...)")
    seconds = time.monotonic() - started
    if bad:
        return Step(recipe["name"], "inputs", False, seconds, "; ".join(bad), errno.EIO)
    return Step(recipe["name"], "inputs", True, seconds,
                f"{len(recipe['inputs'])} input(s) match their recorded hashes")


def _run(execution, recipe: dict, step: str, argv: list[str], run: Runtime) -> Step:
    started = time.monotonic()
    try:
        done = run(execution, list(argv), recipe["timeout"])
    except subprocess.TimeoutExpired:
        return Step(recipe["name"], step, False, time.monotonic() - started,
                    f"{_show(argv)} timed out after {recipe['timeout']} s", errno.ETIMEDOUT)
    except OSError as exc:
        return Step(recipe["name"], step, False, time.monotonic() - started,
                    f"{_show(argv)} did not start: {exc}", exc.errno or errno.EIO)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        return Step(recipe["name"], step, False, seconds,
                    f"{_show(argv)} exited {done.returncode}{_tail(done)}", errno.EIO)
    return Step(recipe["name"], step, True, seconds, f"{_show(argv)} exited 0")


def _show(argv: list[str]) -> str:
    return argv[2] if argv[:2] == ["sh", "-c"] and len(argv) == 3 else " ".join(argv)


def _tail(done) -> str:
    out = b""
    for stream in (getattr(done, "stdout", None), getattr(done, "stderr", None)):
        if stream:
            out += stream.encode() if isinstance(stream, str) else stream
    text = out[-OUTPUT_TAIL_BYTES:].decode(errors="replace").strip()
    return f"; output ends with:\n{text}" if text else ""
