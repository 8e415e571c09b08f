"""The end-to-end demo: rametfs on real input, the Python standard library.

Run it through ``tools/demo`` (which prepares .venv first)::

    tools/demo [--workdir DIR] [--source DIR] [--promote A|B|C|D] [--sequential] [--json FILE]

1. mount a fresh daemon (``rametfs mount --background``) in a new work directory;
2. snapshot the standard library (tens of thousands of files) and check the file count and
   bytes that the root status reports against a walk of the source;
3. create four executions of it and run in each, at once (or with ``--sequential`` one after
   another): A ``git init/add/commit`` of everything, B ``compileall`` of two packages,
   C delete and rename directories, D append to, shrink and grow files; check each result
   and each ``.ramet/diff`` against exactly what the job did;
4. copy one execution with ``cp -a``, promote it, reset the other three (diffs empty);
5. stop and restart the daemon;
6. ``diff -r`` the promoted snapshot against the copy and the base snapshot against the
   source, and check the promoted changes in a fresh execution of it;
7. stop the daemon and print every step with its time and OK/FAIL.

Exit status: 0 when every step is OK, 1 when one failed, 130 on Ctrl-C.  The daemon is
stopped and its mount removed whatever happens; a temporary work directory is deleted, one
given with ``--workdir`` is kept (it must be empty or new).

On a terminal, a step that runs over a second shows its progress on stderr (tqdm): a bar
where the work is counted (the snapshot: bytes the daemon has read of the source, from
/proc/PID/io; ``git add``: the files it added; ``cp -a``: the entries copied), else what
it has done so far or the seconds it has run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import click
from tqdm import tqdm

from rametfs import Execution, Ramet, RametError
from rametfs.cli import human_bytes

GIT = ["git", "-c", "user.name=rametfs demo", "-c", "user.email=demo@rametfs.invalid",
       "-c", "gc.auto=0", "-c", "init.defaultBranch=main"]
COMPILED = ("json", "email")  # the packages job B compiles
PYC = f".{sys.implementation.cache_tag}.pyc"
CHECKED_HASH = 0b11  # pyc header flags for --invalidation-mode checked-hash (PEP 552)
REMOVED = "tomllib"
RENAMED = (("xml", "xml_renamed"), ("email/mime", "email/mime2"))
APPENDED = b"# appended by the rametfs demo\n"
SHRUNK_TO = 10  # bytes left of antigravity.py
GROWN_TO = (1 << 20) + 1  # bytes keyword.py grows to: many pages past its end, unaligned
SAMPLE_LINES = 3  # diff lines shown per execution
OUTPUT_LINES = 5  # lines of a failed program's output shown
MAX_NOTES = 20  # source entries diff -r cannot compare, listed

Diff = set[tuple[str, str]]  # {("A" | "M" | "D", path)}, as Execution.diff() gives them


class CheckFailed(Exception):
    """A check of the demo failed: its step is FAIL, and the demo carries on."""


def expect(condition: object, message: str) -> None:
    """Raise CheckFailed(message) unless ``condition`` holds."""
    if not condition:
        raise CheckFailed(message)


@contextlib.contextmanager
def os_errors_fail() -> Iterator[None]:
    """Turn an OSError in the block (the tree misbehaved) into CheckFailed."""
    try:
        yield
    except OSError as exc:
        raise CheckFailed(f"{type(exc).__name__}: {exc}") from exc


# ----- the report --------------------------------------------------------------------------

PROGRESS_DELAY_S = 1.0  # a step's progress shows once it has run this long
TICK_S = 0.5  # how often a shown progress line is redrawn
UNCOUNTED = "{desc}: {elapsed}"  # a step's progress line until it counts something


@dataclass
class Step:
    """One timed step: ``seconds`` of wall time; ``notes`` are printed under it, not tabled;
    ``bar`` its progress line (tqdm; silent off a terminal): a step that counts its work
    sets ``bar.total`` and calls ``bar.update(n)``, or sets ``poll`` to a function giving
    the count so far."""

    name: str
    seconds: float = 0.0
    ok: bool = True
    detail: str = ""
    notes: list[str] = field(default_factory=list)
    bar: tqdm | None = field(default=None, repr=False)
    poll: Callable[[], int] | None = field(default=None, repr=False)


@contextlib.contextmanager
def progress(step: Step, unit: str) -> Iterator[None]:
    """Show ``step``'s progress on stderr while the block runs (from its first second on,
    and only on a terminal), redrawn every TICK_S so that the seconds run on."""
    step.bar = tqdm(desc=step.name, unit=unit, unit_scale=unit == "B", leave=False,
                    delay=PROGRESS_DELAY_S, disable=None, dynamic_ncols=True,
                    bar_format=UNCOUNTED)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(TICK_S):
            if step.poll is not None:
                step.bar.n = min(step.poll(), step.bar.total or math.inf)
            if step.bar.total or step.bar.n:
                step.bar.bar_format = None  # tqdm's own: a bar, or a count and a rate
            step.bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    if not step.bar.disable:
        ticker.start()
    try:
        yield
    finally:
        done.set()
        if ticker.is_alive():
            ticker.join()
        step.bar.close()


class Report:
    """The steps run so far, in the order they ended; steps may run in several threads."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self._lock = threading.Lock()

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)

    @contextlib.contextmanager
    def step(self, name: str, unit: str = "it") -> Iterator[Step]:
        """Time the block as step ``name``, its progress shown (:func:`progress`, counted
        in ``unit``).  A CheckFailed in it makes the step FAIL and is swallowed; any other
        exception makes it FAIL and propagates."""
        record = Step(name)
        start = time.perf_counter()
        try:
            with progress(record, unit):
                yield record
        except BaseException as exc:
            record.ok = False
            if isinstance(exc, CheckFailed):
                message = str(exc)
            else:
                message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            record.detail = f"{record.detail}; {message}" if record.detail else message
            if not isinstance(exc, CheckFailed):
                raise
        finally:
            record.seconds = time.perf_counter() - start
            with self._lock:
                self.steps.append(record)
                lines = [f"{'OK' if record.ok else 'FAIL':<4} {record.seconds:9.3f} s  "
                         f"{name}" + (f": {record.detail}" if record.detail else "")]
                lines += [f"{'':17}{note}" for note in record.notes]
                tqdm.write("\n".join(lines), file=sys.stdout)  # above the progress lines

    def table(self) -> str:
        """Aligned columns: step, seconds (3 decimals), OK/FAIL, first line of the detail."""
        width = max(len(s.name) for s in self.steps)
        rows = [f"{'STEP':<{width}}  {'SECONDS':>9}  RESULT  DETAIL"]
        rows += [f"{s.name:<{width}}  {s.seconds:9.3f}  {'OK' if s.ok else 'FAIL':<6}  "
                 f"{s.detail.splitlines()[0] if s.detail else ''}".rstrip() for s in self.steps]
        return "\n".join(rows)

    def to_json(self) -> dict:
        return {"ok": self.ok, "steps": [
            {"name": s.name, "seconds": round(s.seconds, 3), "ok": s.ok, "detail": s.detail}
            for s in self.steps]}


# ----- programs and trees ------------------------------------------------------------------

def run(argv: list[str], cwd: Path | None = None) -> str:
    """Run a program; return its stdout.  Raises CheckFailed when it exits non-zero."""
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, errors="replace")
    code = done.returncode
    if code:
        ended = f"exited {code}" if code > 0 else f"was killed by {signal.Signals(-code).name}"
        output = "\n".join((done.stdout + done.stderr).splitlines()[:OUTPUT_LINES])
        raise CheckFailed(f"{shlex.join(argv)} {ended}" + (f": {output}" if output else ""))
    return done.stdout


def run_counting(argv: list[str], bar: tqdm, cwd: Path | None = None) -> None:
    """Run a program that prints a line per thing it did (``git add --verbose``, ``cp -v``),
    counting the lines on ``bar``.  Raises CheckFailed when it exits non-zero."""
    with subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, errors="replace") as proc:
        errors: list[str] = []
        reader = threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)
        reader.start()
        for _ in proc.stdout:
            bar.update()
        reader.join()
        code = proc.wait()
    if code:
        ended = f"exited {code}" if code > 0 else f"was killed by {signal.Signals(-code).name}"
        output = "".join(errors[:OUTPUT_LINES]).rstrip()
        raise CheckFailed(f"{shlex.join(argv)} {ended}" + (f": {output}" if output else ""))


def read_bytes_of(pid: int) -> int:
    """The bytes process ``pid`` has read so far (``rchar`` of /proc/PID/io): the
    snapshot's progress, as the daemon reads each source file once."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def rametfs(*args: str) -> str:
    """Run the rametfs command line."""
    return run([sys.executable, "-m", "rametfs", *args])


def mounted(path: Path) -> bool:
    """Whether ``path`` is a mountpoint, from the mount table: a dead FUSE mount (ENOTCONN)
    is still a mount there, where ``os.path.ismount`` sees nothing."""
    escaped = str(path).translate({ord(c): f"\\{ord(c):03o}" for c in " \t\n\\"})
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == escaped for line in f)


def stop_daemon(mnt: Path) -> str:
    """Unmount ``mnt`` and wait for its daemon; lazily if it is busy.  Returns what was done;
    raises CheckFailed when the mount is still there."""
    if not mounted(mnt):
        return "nothing mounted"
    try:
        rametfs("umount", str(mnt))
        done = "unmounted"
    except CheckFailed:
        rametfs("umount", "--lazy", str(mnt))
        done = "busy: unmounted lazily"
    expect(not mounted(mnt), f"{mnt} is still mounted")
    return done


@dataclass
class Scan:
    """A source tree counted as the importer counts it (``files`` regular files, ``bytes``
    their sizes), and the entries ``diff -r`` cannot compare, as ``"path (why)"``."""

    files: int = 0
    bytes: int = 0
    dirs: int = 1  # the top one
    symlinks: int = 0
    noisy: list[str] = field(default_factory=list)


def scan(path: str | Path, into: Scan | None = None, bar: tqdm | None = None) -> Scan:
    """Walk ``path`` without following symlinks, counting the entries on ``bar``."""
    into = into or Scan()
    try:
        entries = list(os.scandir(path))
    except OSError as exc:
        into.noisy.append(f"{path} (unreadable directory: {exc.strerror})")
        return into
    if bar is not None:
        bar.update(len(entries))
    for entry in entries:
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            into.dirs += 1
            scan(entry.path, into, bar)
        elif stat.S_ISREG(st.st_mode):
            into.files += 1
            into.bytes += st.st_size
            if not os.access(entry.path, os.R_OK):
                into.noisy.append(f"{entry.path} (unreadable file)")
        elif stat.S_ISLNK(st.st_mode):
            into.symlinks += 1
        else:
            into.noisy.append(f"{entry.path} (special file, mode {stat.filemode(st.st_mode)})")
    return into


def tree_paths(root: Path, rel: str) -> Iterator[str]:
    """``rel`` and every path below it in ``root``, spelt as ``.ramet/diff`` spells them
    (relative to ``root``, directories ending in ``/``)."""
    path = root / rel
    if path.is_symlink() or not path.is_dir():
        yield rel
        return
    yield rel + "/"
    for entry in sorted(os.listdir(path)):
        yield from tree_paths(root, f"{rel}/{entry}")


def moved(paths: Iterable[str], old: str, new: str) -> Iterator[str]:
    """``paths`` under ``old`` as they read after ``mv old new``."""
    return (new + p[len(old):] for p in paths)


def diff_trees(a: Path, b: Path) -> None:
    """``diff -r`` two trees (symlinks compared as links); CheckFailed if they differ."""
    run(["diff", "-r", "-q", "--no-dereference", str(a), str(b)])


# ----- the four jobs -----------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """What one execution does: ``run(tree, step, counted)`` changes the tree (``step``'s
    bar may count its work; ``counted`` is the source's scan); ``verify(tree, source)``
    raises CheckFailed unless ``tree`` holds the change; ``diff(tree, source)`` is the
    ``.ramet/diff`` expected after ``run``."""

    key: str
    name: str  # the execution id
    title: str
    run: Callable[[Path, Step, Scan], None]
    verify: Callable[[Path, Path], None]
    diff: Callable[[Path, Path], Diff]


def git_commit(tree: Path, step: Step, counted: Scan) -> None:
    run([*GIT, "init", "-q"], cwd=tree)
    step.bar.total = counted.files + counted.symlinks  # git adds each, not directories
    run_counting([*GIT, "add", "--verbose", "-A"], step.bar, cwd=tree)
    run([*GIT, "commit", "-q", "-m", "base"], cwd=tree)


def git_verify(tree: Path, source: Path) -> None:
    log = run([*GIT, "log", "--format=%s"], cwd=tree)
    expect(log == "base\n", f"git log is not the one commit 'base': {log[:200]!r}")
    status = run([*GIT, "status", "--porcelain"], cwd=tree)
    expect(not status, f"git status is not clean: {status[:200]!r}")


def git_diff(tree: Path, source: Path) -> Diff:
    return {("A", p) for p in tree_paths(tree, ".git")}


def compile_packages(tree: Path, step: Step, counted: Scan) -> None:
    run([sys.executable, "-m", "compileall", "-q", "-f", "--invalidation-mode", "checked-hash",
         *(str(tree / package) for package in COMPILED)])


def compiled_pycs(tree: Path) -> Iterator[Path]:
    """The pyc this Python writes for every module of COMPILED in ``tree``."""
    for package in COMPILED:
        for py in sorted((tree / package).rglob("*.py")):
            yield py.parent / "__pycache__" / (py.stem + PYC)


def compile_verify(tree: Path, source: Path) -> None:
    for pyc in compiled_pycs(tree):
        expect(pyc.exists(), f"{pyc.relative_to(tree)} is missing")
        flags = int.from_bytes(pyc.read_bytes()[4:8], "little")
        expect(flags == CHECKED_HASH, f"{pyc.relative_to(tree)} has flags {flags}, "
               f"not {CHECKED_HASH} (checked hash)")


def compile_diff(tree: Path, source: Path) -> Diff:
    expected = set()
    for pyc in compiled_pycs(source):
        if not pyc.parent.exists():
            expected.add(("A", f"{pyc.parent.relative_to(source)}/"))
        expected.add(("M" if pyc.exists() else "A", str(pyc.relative_to(source))))
    return expected


def reshape(tree: Path, step: Step, counted: Scan) -> None:
    shutil.rmtree(tree / REMOVED)
    for old, new in RENAMED:
        run(["mv", old, new], cwd=tree)


def reshape_verify(tree: Path, source: Path) -> None:
    expect(not (tree / REMOVED).exists(), f"{REMOVED} still exists")
    for old, new in RENAMED:
        expect(not (tree / old).exists(), f"{old} still exists")
        diff_trees(source / old, tree / new)


def reshape_diff(tree: Path, source: Path) -> Diff:
    expected = {("D", p) for p in tree_paths(source, REMOVED)}
    for old, new in RENAMED:
        paths = list(tree_paths(source, old))
        expected |= {("D", p) for p in paths} | {("A", p) for p in moved(paths, old, new)}
    return expected  # no "M" for the parents: a directory's mtime is not a change


def edit_files(tree: Path, step: Step, counted: Scan) -> None:
    with open(tree / "this.py", "ab") as f:
        f.write(APPENDED)
    os.truncate(tree / "antigravity.py", SHRUNK_TO)
    os.truncate(tree / "keyword.py", GROWN_TO)


def edit_verify(tree: Path, source: Path) -> None:
    def check(name: str, want: bytes) -> None:
        got = (tree / name).read_bytes()
        expect(got == want, f"{name}: {len(got)} bytes, not the {len(want)} expected")

    check("this.py", (source / "this.py").read_bytes() + APPENDED)
    check("antigravity.py", (source / "antigravity.py").read_bytes()[:SHRUNK_TO])
    keyword = (source / "keyword.py").read_bytes()
    check("keyword.py", keyword + bytes(GROWN_TO - len(keyword)))


def edit_diff(tree: Path, source: Path) -> Diff:
    return {("M", "antigravity.py"), ("M", "keyword.py"), ("M", "this.py")}


JOBS = {job.key: job for job in (
    Job("A", "A-git", "git init, add -A, commit", git_commit, git_verify, git_diff),
    Job("B", "B-compileall", f"compileall -f {' '.join(COMPILED)} (checked-hash)",
        compile_packages, compile_verify, compile_diff),
    Job("C", "C-reshape", f"rm -r {REMOVED}; "
        + "; ".join(f"mv {old} {new}" for old, new in RENAMED), reshape, reshape_verify,
        reshape_diff),
    Job("D", "D-edit", "append this.py, shrink antigravity.py, grow keyword.py",
        edit_files, edit_verify, edit_diff),
)}


# ----- the phases --------------------------------------------------------------------------

def take_snapshot(report: Report, ramet: Ramet, source: Path) -> tuple[str, Scan]:
    """Step 2: snapshot ``source``; return its id and the scan of the source."""
    with report.step("2 scan the source (files, bytes)", unit=" entries") as step:
        counted = scan(source, bar=step.bar)
        step.detail = (f"{counted.files} files, {counted.dirs} dirs, {counted.symlinks} "
                       f"symlinks, {counted.bytes} bytes; {len(counted.noisy)} entries "
                       "diff -r cannot compare")
        step.notes = counted.noisy[:MAX_NOTES]
        step.notes += [f"... and {len(counted.noisy) - MAX_NOTES} more"] * (
            len(counted.noisy) > MAX_NOTES)
    with report.step("2 snapshot the source", unit="B") as step:
        daemon = ramet.status()["pid"]
        start = read_bytes_of(daemon)
        step.bar.total, step.poll = counted.bytes, lambda: read_bytes_of(daemon) - start
        base = ramet.snapshot(source, label="stdlib", message="the demo's base")
        record = next(s for s in ramet.snapshots() if s["id"] == base)
        step.detail = (f"{base[:12]}: {record['files']} files, {record['bytes']} bytes "
                       f"({human_bytes(record['bytes'])}) in the root status")
        expect((record["files"], record["bytes"]) == (counted.files, counted.bytes),
               f"the source has {counted.files} files, {counted.bytes} bytes")
    return base, counted


def run_job(report: Report, job: Job, tree: Path, source: Path, counted: Scan) -> None:
    with report.step(f"3{job.key} {job.title}", unit=" files") as step, os_errors_fail():
        job.run(tree, step, counted)
    if step.ok:
        with report.step(f"3{job.key} check the result"), os_errors_fail():
            job.verify(tree, source)


def check_diff(report: Report, job: Job, execution: Execution, source: Path) -> None:
    expected = job.diff(execution.path, source)
    with report.step(f"3{job.key} read .ramet/diff") as step:
        lines = execution.diff()
        step.detail = f"{len(lines)} lines"
        step.notes = [" ".join(line) for line in lines[:SAMPLE_LINES]]
        step.notes += ["..."] * (len(lines) > SAMPLE_LINES)
        missing, extra = sorted(expected - set(lines)), sorted(set(lines) - expected)
        expect(not missing and not extra, f"expected {len(expected)}: missing {len(missing)} "
               f"{missing[:SAMPLE_LINES]}, unexpected {len(extra)} {extra[:SAMPLE_LINES]}")


def run_jobs(report: Report, ramet: Ramet, base: str, source: Path, counted: Scan,
             sequential: bool) -> dict[str, Execution]:
    """Step 3: an execution per job, the jobs, their results and diffs."""
    with report.step("3 create 4 executions") as step:
        executions, times = {}, []
        for job in JOBS.values():
            start = time.perf_counter()
            executions[job.key] = ramet.create(base, name=job.name)
            times.append(f"{(time.perf_counter() - start) * 1000:.1f}")
        step.detail = f"{', '.join(executions[k].id for k in JOBS)}: {' / '.join(times)} ms"
    how = "one after another" if sequential else "at once"
    with report.step(f"3 jobs A-D {how}, wall time"):
        with ThreadPoolExecutor(max_workers=1 if sequential else len(JOBS)) as pool:
            list(pool.map(lambda job: run_job(report, job, executions[job.key].path, source,
                                              counted), JOBS.values()))
    for job in JOBS.values():
        check_diff(report, job, executions[job.key], source)
    return executions


def promote_one(report: Report, job: Job, execution: Execution, copy: Path,
                counted: Scan) -> str:
    """Step 4a: copy the execution's tree to ``copy``, then promote it; return the id."""
    with report.step(f"4 cp -a execution {job.key} to a scratch dir", unit=" entries") as step:
        step.bar.total = counted.files + counted.dirs + counted.symlinks  # about: D's edits
        run_counting(["cp", "-a", "-v", str(execution.path), str(copy)], step.bar)
        expect(not (copy / ".ramet").exists(), "the copy has .ramet: readdir listed it")
    with report.step(f"4 promote {job.key}") as step:
        promoted = execution.promote(label=f"demo {job.key}", message=job.title)
        step.detail = promoted[:12]
        head = execution.status()["head"]
        expect(head == promoted, f"execution head is {head[:12]}, not the promoted snapshot")
    return promoted


def reset_others(report: Report, executions: dict[str, Execution], promoted_key: str) -> None:
    """Step 4b: reset every execution but the promoted one; their diffs must be empty."""
    others = [key for key in executions if key != promoted_key]
    for key in others:
        with report.step(f"4 reset {key}"):
            executions[key].reset()
    with report.step(f"4 diffs of {', '.join(others)} empty after reset"):
        for key in others:
            lines = executions[key].diff()
            expect(not lines, f"{key}: {len(lines)} lines, first {lines[:SAMPLE_LINES]}")


def restart(report: Report, data: Path, mnt: Path, snapshots: set[str],
            executions: Iterable[str]) -> Ramet:
    """Step 5: stop and serve again; the snapshots and executions must still be listed."""
    with report.step("5 stop daemon (rametfs umount)"):
        rametfs("umount", str(mnt))
    with report.step("5 start daemon (rametfs mount --background)"):
        rametfs("mount", "--data", str(data), str(mnt), "--background")
    ramet = Ramet(mnt)
    with report.step("5 snapshots and executions survived the restart"):
        status = ramet.status()
        lost = snapshots - {s["id"] for s in status["snapshots"]}
        expect(not lost, f"snapshots missing: {sorted(lost)}")
        listed = sorted(e["id"] for e in status["executions"])
        expect(listed == sorted(executions), f"executions listed: {listed}")
    return ramet


def verify_after_restart(report: Report, ramet: Ramet, job: Job, promoted: str, base: str,
                         source: Path, copy: Path, counted: Scan) -> None:
    """Step 6: the promoted snapshot equals the copy, the base equals the source, and a
    fresh execution of the promoted snapshot holds the job's change."""
    snapshots = ramet.mount / "snapshots"
    with report.step("6 diff -r promoted snapshot, cp -a copy") as step:
        step.detail = f"{promoted[:12]} vs {copy}"
        diff_trees(snapshots / promoted, copy)
    with report.step("6 diff -r base snapshot, source") as step:
        step.detail = f"{base[:12]} vs {source}"
        if counted.noisy:
            step.detail += f" (which has {len(counted.noisy)} entries diff -r cannot compare)"
        diff_trees(snapshots / base, source)
    with report.step("6 create a fresh execution of it") as step:
        fresh = ramet.create(promoted, name="fresh")
        step.detail = fresh.id
    with report.step(f"6 it holds {job.key}'s change, diff empty"), os_errors_fail():
        lines = fresh.diff()
        expect(not lines, f"a fresh execution has {len(lines)} diff lines")
        job.verify(fresh.path, source)


def demo(report: Report, source: Path, work: Path, promoted_key: str,
         sequential: bool) -> None:
    """Steps 1-6, in ``work``: data/ (the store), mnt/ and copy/ (the promoted tree)."""
    data, mnt, copy = work / "data", work / "mnt", work / "copy"
    mnt.mkdir()
    with report.step("1 start daemon (rametfs mount --background)"):
        rametfs("mount", "--data", str(data), str(mnt), "--background")
    ramet = Ramet(mnt)
    base, counted = take_snapshot(report, ramet, source)
    executions = run_jobs(report, ramet, base, source, counted, sequential)
    job = JOBS[promoted_key]
    promoted = promote_one(report, job, executions[promoted_key], copy, counted)
    reset_others(report, executions, promoted_key)
    ramet = restart(report, data, mnt, {base, promoted}, (e.id for e in executions.values()))
    verify_after_restart(report, ramet, job, promoted, base, source, copy, counted)


def clean_up(report: Report, work: Path, keep: bool) -> None:
    """Step 7: stop the daemon; delete ``work`` unless ``keep`` (never while mounted).
    When a step failed, show the end of the daemon's log first."""
    mnt, log = work / "mnt", work / "data" / "daemon.log"
    with report.step("7 stop daemon, no mount left") as step:
        step.detail = stop_daemon(mnt)
    if not report.ok and log.exists():
        click.echo(f"\nlast lines of {log}:", err=True)
        click.echo("\n".join(log.read_text(errors="replace").splitlines()[-20:]), err=True)
    if mounted(mnt):
        click.echo(f"\n{mnt} is still mounted: {work} left in place", err=True)
    elif keep:
        click.echo(f"\nwork directory kept: {work}")
    else:
        shutil.rmtree(work)


def work_directory(workdir: Path | None, prefix: str) -> Path:
    """``workdir`` made if new (click.UsageError unless empty), else a new temporary one."""
    if workdir is None:
        return Path(tempfile.mkdtemp(prefix=prefix))
    workdir.mkdir(parents=True, exist_ok=True)
    if any(workdir.iterdir()):
        raise click.UsageError(f"--workdir {workdir} is not empty")
    return workdir.resolve()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workdir", metavar="DIR", type=click.Path(file_okay=False, path_type=Path),
              help="Work in DIR (empty or new; kept) instead of a temporary directory.")
@click.option("--source", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=sysconfig.get_paths()["stdlib"], show_default=True,
              help="The tree to snapshot: a standard library of this Python's version.")
@click.option("--promote", "promoted_key", type=click.Choice(list(JOBS)), default="D",
              show_default=True, help="The execution to promote.")
@click.option("--sequential", is_flag=True, help="Run the jobs one after another.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the steps and their timings to this file, as JSON.")
def main(workdir: Path | None, source: Path, promoted_key: str, sequential: bool,
         json_file: Path | None) -> None:
    """Snapshot the standard library, run four executions on it, promote one, reset the
    others, restart the daemon and verify, timing every step."""
    work = work_directory(workdir, "rametfs-demo-")
    report = Report()
    status = 1
    try:
        demo(report, source.resolve(), work, promoted_key, sequential)
        status = 0
    except KeyboardInterrupt:
        click.echo("\ninterrupted: cleaning up", err=True)
        status = 130
    except RametError as exc:
        click.echo(f"demo aborted: {exc}", err=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip this
        clean_up(report, work, keep=workdir is not None)
        click.echo("\n" + report.table())
        if json_file:
            json_file.write_text(json.dumps({"source": str(source), **report.to_json()},
                                            indent=2) + "\n")
    sys.exit(status or (0 if report.ok else 1))


if __name__ == "__main__":
    main()
