"""Rebuild a restored execution's rebuildable paths from the recipes its snapshot recorded.

For each recipe, in the order the policy listed them (docs/policy.md): check its inputs
against the recorded BLAKE3 hashes, run its command, run its readiness check; the first
failure stops the restore.  The inputs are checked just before their recipe runs, after the
earlier recipes' commands (which the agent may have written) changed the tree as they
liked, so they are read as rametfs.core.policy.path_digest reads an agent's tree: never through
a symlink, never from a FIFO, at most MAX_INPUT_BYTES each.  Commands run through a
*runtime*, a callable ``run(execution, argv, timeout)`` (the ``run`` of a rametfs.sandbox
runtime) that runs ``argv`` (a list of str) in the execution and returns a
:class:`rametfs.sandbox.Result` (``exit_code``, ``stdout``, ``stderr``, ``timed_out``).
Recipes may come from an agent (its own promote, its own ``ramet.toml`` promoted with
``--policy tree``), so they run in a sandbox unless the caller asks for the host:
:func:`runtime_for` picks the sandbox the snapshot recorded, and refuses when it recorded
none and the caller named none.

Used by :meth:`rametfs.client.Ramet.restore`; needs only the standard library, BLAKE3,
rametfs.core.policy and the harness side's rametfs.sandbox, so a harness process does not load
the daemon's modules.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from .client import RametError
from .core.policy import InputError, path_digest
from .protocol import RUNTIMES, quote_path
from .sandbox import Bubblewrap, Docker, Host, Result

HOST = "host"
OUTPUT_TAIL_BYTES = 2000


@dataclass(frozen=True)
class Step:
    """One step of a restore: ``recipe`` name, ``step`` (``"inputs"``, ``"command"`` or
    ``"check"``), ``ok``, ``seconds`` it took, ``detail`` (what happened, with the tail of
    the output of a failed command), and on failure the ``errno`` it raises with (EIO: an
    input missing or changed, or a command failed; EFBIG: an input too large; ETIMEDOUT)."""

    recipe: str
    step: str
    ok: bool
    seconds: float
    detail: str
    errno: int = 0

    def __str__(self) -> str:
        return (f"{self.recipe}: {self.step} {'ok' if self.ok else 'FAILED'} "
                f"({self.seconds:.2f} s): {self.detail}")


Runtime = Callable[[object, list, float], Result]


def runtime_for(runtime, recorded: dict | None, snapshot: str) -> Runtime:
    """The ``run`` callable for :meth:`rametfs.client.Ramet.restore`'s ``runtime``: None,
    the sandbox ``recorded`` in the snapshot record (``{"name", "uid", "gid"[, "image"]}``,
    docs/format.md); ``"bubblewrap"`` or ``"docker"``, that sandbox (as the recorded uid,
    gid and image when the record names it, else as nobody; docker needs a recorded image);
    ``"host"``, no sandbox (:class:`rametfs.sandbox.Host`); a runtime object (its ``run``);
    or a callable ``run(execution, argv, timeout) -> Result``.

    Raises RametError (EINVAL) when ``runtime`` is None and ``snapshot`` (its id, for the
    message) records no sandbox, for an unknown name, and for docker without an image.
    """
    if runtime is None:
        if recorded is None:
            raise RametError(errno.EINVAL, f"snapshot {snapshot[:12]} records no sandbox to "
                             "run its recipes in (no sandbox adapter ran the execution it was "
                             "promoted from): give a runtime, one of bubblewrap, docker or "
                             "host (host runs them unsandboxed, as this user)")
        runtime = recorded["name"]
    if not isinstance(runtime, str):
        return getattr(runtime, "run", runtime)
    if runtime == HOST:
        return Host().run
    if runtime not in RUNTIMES:
        raise RametError(errno.EINVAL, f"unknown runtime {runtime!r}: expected one of "
                         f"{', '.join((*RUNTIMES, HOST))}")
    same = recorded if recorded is not None and recorded["name"] == runtime else {}
    ids = {key: same[key] for key in ("uid", "gid") if key in same}
    if runtime == "bubblewrap":
        return Bubblewrap(**ids).run
    if "image" not in same:
        raise RametError(errno.EINVAL, f"snapshot {snapshot[:12]} records no docker image to "
                         "run its recipes in: give one (rametfs restore --image, or a "
                         "rametfs.sandbox.Docker runtime)")
    return Docker(same["image"], **ids).run


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
    """Hash each input in ``execution`` (rametfs.core.policy.path_digest: by directory fds from
    its root, never through a symlink, at most MAX_INPUT_BYTES each) and compare it with
    the recorded hash.  The step fails with EIO when one is missing or changed, EFBIG when
    one is too large, an unreadable one's errno; it names every input that failed."""
    started = time.monotonic()
    bad: list[tuple[str, int]] = []
    for item in recipe["inputs"]:
        try:
            actual = path_digest(execution.path, item["path"])
        except InputError as exc:
            bad.append((str(exc), errno.EFBIG if exc.errno == errno.EFBIG else errno.EIO))
            continue
        except OSError as exc:
            bad.append((f"input {_quoted(item['path'])} cannot be read: {exc.strerror}",
                        exc.errno or errno.EIO))
            continue
        if actual != item["blake3"]:
            # ``actual`` hashes only what lies inside the execution, reached without
            # following a symlink (a hard link cannot cross executions; in fallback mode
            # fs.protected_hardlinks refuses one to a file the agent cannot read): bytes of
            # the agent's own tree, so its prefix tells the agent nothing it cannot read.
            bad.append((f"input {_quoted(item['path'])} changed (BLAKE3 {actual[:16]}..., "
                        f"recorded {item['blake3'][:16]}...)", errno.EIO))
    seconds = time.monotonic() - started
    if bad:
        return Step(recipe["name"], "inputs", False, seconds, "; ".join(m for m, _ in bad),
                    bad[0][1])
    return Step(recipe["name"], "inputs", True, seconds,
                f"{len(recipe['inputs'])} input(s) match their recorded hashes")


def _quoted(path: str) -> str:
    return quote_path(os.fsencode(path))


def _run(execution, recipe: dict, step: str, argv: list[str], run: Runtime) -> Step:
    started = time.monotonic()
    try:
        done = run(execution, list(argv), recipe["timeout"])
    except OSError as exc:  # RametError too: the sandbox could not be set up
        return Step(recipe["name"], step, False, time.monotonic() - started,
                    f"{_show(argv)} did not start: {exc}", exc.errno or errno.EIO)
    seconds = time.monotonic() - started
    if done.timed_out:
        return Step(recipe["name"], step, False, seconds,
                    f"{_show(argv)} timed out after {recipe['timeout']} s", errno.ETIMEDOUT)
    if done.exit_code != 0:
        return Step(recipe["name"], step, False, seconds,
                    f"{_show(argv)} exited {done.exit_code}{_tail(done)}", errno.EIO)
    return Step(recipe["name"], step, True, seconds, f"{_show(argv)} exited 0")


def _show(argv: list[str]) -> str:
    return argv[2] if argv[:2] == ["sh", "-c"] and len(argv) == 3 else " ".join(argv)


def _tail(done: Result) -> str:
    out = (done.stdout + done.stderr).encode()
    text = out[-OUTPUT_TAIL_BYTES:].decode(errors="replace").strip()
    return f"; output ends with:\n{text}" if text else ""
