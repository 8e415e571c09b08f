"""Best-of-N: four scripted attempts at one bug, in parallel, each in a sandbox of its own.

Run it through ``tools/demo-best-of-n`` (which prepares .venv and bubblewrap first)::

    tools/demo-best-of-n [--runtime bubblewrap|docker|podman] [--json FILE] [--workdir DIR]

The sandbox is bubblewrap by default; with ``--runtime docker`` each attempt runs in a
container of a private ``dockerd`` the demo starts in its work directory, with ``podman``
in a rootful Podman container, both of the image ``tools/containers.py`` builds from the
installed Debian packages (no registry); the engine is stopped at the end.

1. build a small git repository: ``stats.py`` whose ``median`` is wrong for an even number
   of values, and five unittest tests of which that one fails; own it by uid 65534;
2. serve a fresh daemon (``--allow-other``: the sandboxes run as uid 65534), snapshot the
   repository, and take four executions of it from an execution pool;
3. run the four attempts at once, each as a script in its own sandbox (no network, the host
   read-only, the rest of the mount hidden), then the tests in the same sandbox:
   ``right-fix`` (5/5), ``wrong-fix`` (4/5: still wrong for even counts), ``breaks-mean``
   (3/5: fixes median, breaks both mean tests) and ``timeout`` (writes to a file until
   killed: once the sandbox returns, the file no longer grows);
4. promote the attempt that passes every test, reset the other three and verify them equal
   to the base; print the table (attempt, tests passed, seconds, snapshot id);
5. restart the daemon, create a fresh execution of the promoted snapshot, check that its
   files are byte for byte the winner's, and run the tests in it again.

Exit status 0 when every outcome is the expected one, 1 otherwise.  The daemon is stopped and
the work directory deleted (one given with ``--workdir`` is kept) whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import click

import containers
from demo import (GIT, CheckFailed, expect, mounted, rametfs, run, stop_daemon,
                  work_directory)
from rametfs import Execution, Ramet
from rametfs.sandbox import Bubblewrap, Docker, Runtime

UID = 65534  # the sandboxes' uid, and the owner of the repository
ATTEMPT_TIMEOUT_S = 2.0
TESTS_TIMEOUT_S = 60.0
TESTS = ["python3", "-m", "unittest", "-v"]
ENV = {"PYTHONDONTWRITEBYTECODE": "1"}
ENGINES = {"docker": containers.Dockerd, "podman": containers.Podman}

STATS = '''\
"""Small statistics helpers."""


def mean(values):
    """The arithmetic mean of a non-empty list of numbers."""
    return sum(values) / len(values)


def median(values):
    """The middle value of a non-empty list; the mean of the two middle ones if even."""
    if not values:
        raise ValueError("median of an empty list")
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
'''

TEST_STATS = '''\
import unittest

from stats import mean, median


class StatsTest(unittest.TestCase):
    def test_mean_of_ints(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)

    def test_mean_of_floats(self):
        self.assertEqual(mean([0.5, 1.5]), 1.0)

    def test_median_odd(self):
        self.assertEqual(median([3, 1, 2]), 2)

    def test_median_even(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_median_empty(self):
        with self.assertRaises(ValueError):
            median([])


if __name__ == "__main__":
    unittest.main()
'''

BUGGY = "    return ordered[len(ordered) // 2]\n"
FIXED = ("    middle = len(ordered) // 2\n"
         "    if len(ordered) % 2:\n"
         "        return ordered[middle]\n"
         "    return (ordered[middle - 1] + ordered[middle]) / 2\n")


PATCH = """\
def patch(old, new, path="stats.py"):
    with open(path) as f:
        text = f.read()
    assert old in text, f"{old!r} is not in {path}"
    with open(path, "w") as f:
        f.write(text.replace(old, new))
"""

# attempt name -> its script: Python run in /workspace after PATCH, as an agent's edits would be
ATTEMPTS = {
    "right-fix": f"patch({BUGGY!r}, {FIXED!r})",
    "wrong-fix": f"patch({BUGGY!r}, '    return ordered[(len(ordered) - 1) // 2]\\n')",
    "breaks-mean": f"patch({BUGGY!r}, {FIXED!r})\n"
                   "patch('sum(values) / len(values)', 'sum(values) / (len(values) + 1)')",
    "timeout": "import time\nwhile True:\n    open('scratch.log', 'a').write('x')\n"
               "    time.sleep(0.01)",
}
# what the demo must find: attempt -> tests passed (None: timed out)
EXPECTED = {"right-fix": "5/5", "wrong-fix": "4/5", "breaks-mean": "3/5", "timeout": None}


@dataclass
class Row:
    """One attempt's line of the table: ``passed`` is ``"5/5"``-like, None when the attempt
    timed out; ``seconds`` covers the attempt and its tests; ``snapshot`` is the promoted id."""

    attempt: str
    passed: str | None
    seconds: float
    snapshot: str | None = None


def build_repository(src: Path) -> None:
    """The repository with the bug: one commit, every file owned by :data:`UID`."""
    src.mkdir()
    (src / "stats.py").write_text(STATS)
    (src / "test_stats.py").write_text(TEST_STATS)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "stats with a bug"]):
        run([*GIT, *args], cwd=src)
    for top, dirs, files in os.walk(src):
        for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
            os.lchown(name, UID, UID)


def run_tests(sandbox: Runtime, execution: Execution) -> tuple[str, float]:
    """Run the tests in ``sandbox`` on ``execution``: ``("passed/ran", seconds)``."""
    tests = sandbox.run(execution, TESTS, timeout=TESTS_TIMEOUT_S)
    return tests_passed(tests.stderr), tests.seconds


def tests_passed(stderr: str) -> str:
    """``"passed/ran"`` from the output of ``python3 -m unittest -v``."""
    ran = re.search(r"^Ran (\d+) tests? in ", stderr, re.M)
    expect(ran, f"no 'Ran N tests' line in the test output: {stderr[-300:]!r}")
    passed = len(re.findall(r" \.\.\. ok$", stderr, re.M))
    return f"{passed}/{ran.group(1)}"


def attempt(sandbox: Runtime, execution: Execution, name: str) -> Row:
    """Run attempt ``name``'s script in ``sandbox`` on ``execution``, then the tests."""
    tried = sandbox.run(execution, ["python3", "-c", PATCH + ATTEMPTS[name]],
                        timeout=ATTEMPT_TIMEOUT_S)
    if tried.timed_out:
        return Row(name, None, tried.seconds)
    expect(tried.exit_code == 0, f"attempt {name} exited {tried.exit_code}: {tried.stderr}")
    passed, seconds = run_tests(sandbox, execution)
    return Row(name, passed, tried.seconds + seconds)


def all_passed(row: Row) -> bool:
    if row.passed is None:
        return False
    passed, ran = row.passed.split("/")
    return passed == ran


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file (its bytes) and symlink (its target) under ``root``, by relative path."""
    found = {}
    for top, _, files in os.walk(root):
        for name in files:
            path = os.path.join(top, name)
            rel = os.path.relpath(path, root)
            found[rel] = os.fsencode(os.readlink(path)) if os.path.islink(path) \
                else Path(path).read_bytes()
    return found


def table(rows: list[Row]) -> str:
    """The rows, aligned: attempt, tests passed, seconds, snapshot id (12 digits) or reset."""
    lines = [f"{'ATTEMPT':<12} {'TESTS PASSED':<12} {'SECONDS':>7}  SNAPSHOT"]
    lines += [f"{r.attempt:<12} {r.passed or 'timed out':<12} {r.seconds:7.2f}  "
              f"{r.snapshot[:12] + ' (promoted)' if r.snapshot else '- (reset)'}" for r in rows]
    return "\n".join(lines)


def serve(data: Path, mnt: Path) -> Ramet:
    """Start a daemon (``--allow-other``, for the sandboxes' uid) and return a Ramet on it."""
    rametfs("mount", "--data", str(data), str(mnt), "--background", "--allow-other",
            "--log", str(data.with_name("daemon.log")))
    return Ramet(mnt)


def best_of_n(work: Path, sandbox: Runtime) -> dict:
    """Steps 1-5 in ``work``, the attempts in ``sandbox``; returns the outcome (JSON-ready:
    ``rows`` and ``restored``).  Raises CheckFailed at the first outcome that is not the
    expected one."""
    src, data, mnt = work / "src", work / "data", work / "mnt"
    build_repository(src)
    mnt.mkdir()
    ramet = serve(data, mnt)
    base = ramet.snapshot(src, label="stats with a bug")
    with ramet.execution_pool(base, concurrency=len(ATTEMPTS)) as pool, \
            contextlib.ExitStack() as held:
        executions = {name: held.enter_context(pool.acquire(timeout=10)) for name in ATTEMPTS}
        before, _ = run_tests(sandbox, executions["right-fix"])
        expect(before == "4/5", f"tests passed before any attempt: {before}, expected 4/5")
        click.echo(f"base snapshot {base[:12]} of {src}: tests {before} before any attempt")
        start = time.perf_counter()
        with ThreadPoolExecutor(len(ATTEMPTS)) as threads:
            futures = {name: threads.submit(attempt, sandbox, ex, name)
                       for name, ex in executions.items()}
            rows = [futures[name].result() for name in ATTEMPTS]
        click.echo(f"{len(rows)} attempts in parallel: {time.perf_counter() - start:.2f} s")
        found = {row.attempt: row.passed for row in rows}
        expect(found == EXPECTED, f"tests passed {found}, expected {EXPECTED}")
        log = executions["timeout"].path / "scratch.log"
        size = log.stat().st_size
        time.sleep(0.1)  # a writer that outlived its sandbox would grow the log meanwhile
        expect(size and log.stat().st_size == size, "the timed-out attempt is still writing")
        click.echo(f"timeout: killed at {ATTEMPT_TIMEOUT_S:g} s; its scratch.log stays at "
                   f"{size} bytes: no writer left")
        winner = next(row for row in rows if all_passed(row))
        chosen = executions[winner.attempt]
        winner.snapshot = chosen.promote(label=f"best of {len(rows)}: {winner.attempt}")
        kept = tree_bytes(chosen.path)
        for name, execution in executions.items():
            if name != winner.attempt:
                execution.reset()
                left = execution.verify()
                expect(not left, f"{name} differs from the base after reset: {left[:3]}")
        click.echo(f"promoted {winner.attempt}; reset and verified the other "
                   f"{len(rows) - 1}\n\n{table(rows)}\n")
    stop_daemon(mnt)
    ramet = serve(data, mnt)
    fresh = ramet.create(winner.snapshot)
    try:
        restored = tree_bytes(fresh.path)
        expect(restored == kept, "the fresh execution's files differ from the winner's: "
               f"{sorted(set(restored.items()) ^ set(kept.items()))[:3]}")
        passed, _ = run_tests(sandbox, fresh)
        expect(passed == "5/5", f"tests in the restored execution: {passed}")
    finally:
        ramet.release(fresh)
    click.echo(f"after a daemon restart, a fresh execution of {winner.snapshot[:12]}: "
               f"{len(restored)} files byte-identical to the winner's, tests {passed}")
    return {"rows": [asdict(row) for row in rows],
            "restored": {"files": len(restored), "identical": True, "tests": passed}}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workdir", metavar="DIR", type=click.Path(file_okay=False, path_type=Path),
              help="Work in DIR (new or empty; kept) instead of a temporary directory.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the outcome to this file, as JSON.")
@click.option("--runtime", type=click.Choice(["bubblewrap", *ENGINES]), default="bubblewrap",
              show_default=True, help="The sandbox: docker starts a dockerd of its own in the "
              "work directory, podman runs rootful with storage there (Debian packages "
              "docker.io, podman; tools/setup test installs them).")
def main(workdir: Path | None, json_file: Path | None, runtime: str) -> None:
    """Four scripted attempts at one bug in parallel sandboxes; promote the one that passes
    the tests, reset the others, restart the daemon and restore the winner."""
    work = work_directory(workdir, "rametfs-best-of-n-")
    outcome: dict = {"ok": False}
    engine = None
    try:
        if runtime == "bubblewrap":
            sandbox: Runtime = Bubblewrap(UID, UID, env=ENV)
        else:
            engine = ENGINES[runtime](work / runtime)
            engine.start()
            containers.build_image(engine.client)
            sandbox = Docker(containers.IMAGE, UID, UID, env=ENV, options=engine.options,
                             docker=engine.client)
            click.echo(f"{runtime}: engine of its own in {work / runtime}, image "
                       f"{containers.IMAGE} built from Debian packages")
        outcome = {"ok": True, "runtime": runtime, **best_of_n(work, sandbox)}
    except (CheckFailed, containers.EngineError) as exc:
        click.echo(f"FAIL: {exc}", err=True)
    finally:
        stop_daemon(work / "mnt")
        if engine is not None:
            engine.stop()
        if json_file:
            json_file.write_text(json.dumps(outcome, indent=2) + "\n")
        if mounted(work / "mnt"):
            click.echo(f"{work / 'mnt'} is still mounted: {work} left in place", err=True)
        elif workdir is None:
            shutil.rmtree(work)
    sys.exit(0 if outcome["ok"] else 1)


if __name__ == "__main__":
    main()
