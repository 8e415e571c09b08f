"""The workloads, in the order of issue 4, each timed on every system it applies to.

A workload is a function ``(Bench, System) -> list[Result]`` registered with
:func:`workload`, which names the systems it runs on.  Times are wall-clock seconds
(``time.perf_counter``) of what a harness would wait for; warm runs follow
:data:`WARMUP` untimed runs; cold runs follow ``echo 3 > /proc/sys/vm/drop_caches`` in a fresh view (for rametfs a fresh
execution; the daemon's hydration cache on disk stays, as it would in production).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from rametfs import Execution

from . import agent_inputs, hostile
from .agent_inputs import AgentInputs, default_cache
from .fuse_trace import FuseTrace
from .report import trio_thread_profile
from .systems import Native, Rametfs, System, Unsupported, View, disk_usage
from .trees import (BIG_FILE, MIB, BenchError, Size, Tree, big_tree, change_files, git,
                    make_git_repo, run, synthetic_tree, tarball)

LIFECYCLE = ("cp-a", "git-worktree", "overlayfs", "fuse-overlayfs", "rametfs",
             "fallback-copy", "fallback-reflink")
IO = ("native", "overlayfs", "fuse-overlayfs", "rametfs")
CHANGED_VIEW = IO + ("native-changed", "rametfs-changed")  # also with a few files changed
READS = CHANGED_VIEW + ("rametfs-snapshot",)  # also on the read-only snapshot itself
CHANGED_FILES = 10  # files changed before each reset and promote
STORAGE_VIEWS = 16  # views of the storage workload, each changing STORAGE_SHARE of the files
STORAGE_SHARE = 0.01
RSS_EXECUTIONS = (1, 100, 1000)
RANDOM_WRITES = 1000  # 4 KiB writes of the randwrite workload
REQUEST_FILES = 1000  # files untarred and removed by the requests workload
REQUEST_MIB = 64  # MiB written by it
PAGE = 4096
GIT_MAX_SCALE = 100_000  # larger scaling trees are not made git repositories (too slow)
# The gc workload (issue 18): promotes of a tree of GC_FILES files, each changing GC_SHARE of
# them, then forget --keep-last GC_KEEP and gc; the figure is the full size.
GC_PROMOTES = {"smoke": 20, "small": 200, "full": 1000}
GC_FILES = {"smoke": 1000, "small": 10_000, "full": 50_000}
GC_SHARE = 0.01
GC_KEEP = 10
PROFILE_RUNS = 3
# The agent workloads (issue 21): the big file's bytes, the files of the tree untarred into
# 1, 2 and 4 views at once.
AGENT_BIG = {"smoke": 8 * MIB, "small": 1 << 30, "full": 1 << 30}
PARALLEL_FILES = {"smoke": 200, "small": 2500, "full": 2500}
PARALLEL_VIEWS = (1, 2, 4)
TRACED = ("fuse-overlayfs", "rametfs")  # FUSE systems: their requests are traced
PROFILE_RATE = 250  # py-spy samples per second


@dataclass
class Result:
    """One measured figure: ``samples`` in ``unit`` (``s``, ``B``), on a tree of ``files``
    files for the scaling workloads; ``extra`` holds derived figures (``MB/s``, ratios)."""

    workload: str
    system: str
    samples: list[float]
    unit: str = "s"
    files: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


@dataclass
class Bench:
    """What the workloads share: the size, the repeat count, the trees (built on first use
    under ``scratch``) and the optional profiler output directory."""

    size: Size
    repeat: int
    scratch: Path
    system_ids: frozenset[str]
    scales: tuple[int, ...]
    profile_dir: Path | None = None
    many_files: int | None = None  # files of the isolation and rss-cycles workloads
    gc_promotes: int | None = None  # the gc workload's, instead of GC_PROMOTES[size]
    cache: Path = field(default_factory=default_cache)  # downloads of the agent workloads
    load: bool = False  # the agent workloads run beside one CPU-bound process per core
    isolation_cases: frozenset[str] | None = None  # the isolation cases to run (None: all)
    skips: list[dict] = field(default_factory=list)  # {workload, system, reason}
    _synthetic: dict[int, Tree] = field(default_factory=dict)

    @cached_property
    def tree(self) -> Tree:
        """The main tree, a git repository with one commit."""
        return make_git_repo(self.size.main_tree(self.scratch / "tree"))

    @cached_property
    def big(self) -> Tree:
        """A tree holding one big incompressible file."""
        return big_tree(self.scratch / "big", self.size.big_bytes)

    @cached_property
    def tar(self) -> Path:
        """A tar of the main tree without ``.git``."""
        return tarball(self.tree, self.scratch / "tree.tar")

    @cached_property
    def agent(self) -> AgentInputs:
        """The agent workloads' tree and inputs (:mod:`benchmarks.agent_inputs`), the
        downloads cached under ``cache``."""
        return agent_inputs.prepare(self.scratch / "agent", self.cache)

    @cached_property
    def agent_big(self) -> Tree:
        """A tree of one AGENT_BIG[size] incompressible file (the big tree if it is that
        big)."""
        size = AGENT_BIG[self.size.name]
        if self.size.big_bytes == size:
            return self.big
        return big_tree(self.scratch / "big-agent", size)

    def skip(self, workload: str, system: str, reason: str) -> None:
        """Note that ``workload`` did not run on ``system``, and why (in the report)."""
        self.skips.append({"workload": workload, "system": system, "reason": reason})
        print(f"skipped {workload} on {system}: {reason}", file=sys.stderr, flush=True)

    @cached_property
    def can_drop_caches(self) -> bool:
        return os.access("/proc/sys/vm/drop_caches", os.W_OK)

    def drop_caches(self) -> None:
        """Write back dirty pages, then drop the page cache, dentries and inodes.
        Raises Unsupported when not permitted (not root)."""
        if not self.can_drop_caches:
            raise Unsupported
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")

    def synthetic(self, files: int) -> Tree:
        """A synthetic tree of ``files`` small files, shared by every system; a git repository
        when git-worktree runs and it is not too large."""
        if files not in self._synthetic:
            tree = synthetic_tree(self.scratch / f"synthetic-{files}", files)
            if "git-worktree" in self.system_ids and files <= GIT_MAX_SCALE:
                tree = make_git_repo(tree)
            self._synthetic[files] = tree
        return self._synthetic[files]

    def profile(self, system: System, name: str, action: Callable[[], object]) -> None:
        """With a profile directory and rametfs: run ``action`` PROFILE_RUNS more times (after
        the timed runs, so the samples stay unperturbed) under ``py-spy record`` attached to
        the daemon; its collapsed stacks go to ``<profile_dir>/<name>.txt``."""
        if self.profile_dir is None or not isinstance(system, Rametfs):
            return
        with self.spying(system, name):
            for _ in range(PROFILE_RUNS):
                action()

    @contextlib.contextmanager
    def spying(self, system: System, name: str, threads: bool = False) -> Iterator[None]:
        """With a profile directory and rametfs: ``py-spy record`` (non-blocking, so the
        daemon is not paused) attached to the daemon during the block, its collapsed stacks
        in ``<profile_dir>/<name>.txt``; ``threads``: each stack under its thread's name
        (``MainThread`` is the trio thread).  Otherwise nothing."""
        if self.profile_dir is None or not isinstance(system, Rametfs):
            yield
            return
        py_spy = Path(sys.executable).with_name("py-spy")
        out = self.profile_dir / f"{name}.txt"
        # cwd outside the mount: py-spy started with its cwd on the mount it samples hangs.
        proc = subprocess.Popen(
            [str(py_spy if py_spy.exists() else "py-spy"), "record", "--nonblocking",
             "--format", "raw", "--rate", str(PROFILE_RATE), *["--threads"] * threads,
             "-o", str(out), "-p", str(system.pid)],
            cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.0)  # py-spy attaches and starts sampling
            yield
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)


WORKLOADS: dict[str, tuple[tuple[str, ...], Callable[[Bench, System], list[Result]]]] = {}


def workload(*systems: str):
    """Register the decorated function as workload ``name`` (its name, ``_`` -> ``-``,
    trailing ``_`` dropped) for ``systems``."""
    def register(fn):
        WORKLOADS[fn.__name__.rstrip("_").replace("_", "-")] = (systems, fn)
        return fn
    return register


def timed(fn: Callable[..., object], *args, **kwargs) -> float:
    """Seconds ``fn(*args, **kwargs)`` took."""
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


# ----- the I/O each workload does --------------------------------------------------------

@contextlib.contextmanager
def inside(path: Path) -> Iterator[None]:
    """Work in ``path``: the workloads use paths relative to it, as an agent does whose
    sandbox root or working directory is the view (path resolution starts inside it)."""
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def walk_lstat(root: Path) -> int:
    """``os.walk`` the tree and ``lstat`` every entry; return the entry count."""
    count = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lstat(os.path.join(dirpath, name))
            count += 1
    return count


def read_files(root: Path, files: tuple[str, ...]) -> int:
    """Read each of ``files`` under ``root`` to its end, 1 MiB at a time; return bytes read."""
    buf = bytearray(MIB)
    total = 0
    for rel in files:
        with open(root / rel, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def write_file(path: Path, size: int, block: bytes) -> None:
    """Write ``size`` bytes to a new file at ``path`` with ``block`` repeated, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(block)
        left = size
        while left:
            left -= os.write(fd, view[:min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)


def random_writes(path: Path, size: int, seed: int) -> tuple[float, float]:
    """Open ``path`` read-write and write RANDOM_WRITES random 4 KiB pages at page-aligned
    offsets below ``size``, then fsync.  Returns (seconds to the first write's return,
    counting the open; seconds for all of it)."""
    rng = random.Random(seed)
    block = os.urandom(PAGE)
    offsets = [rng.randrange(size // PAGE) * PAGE for _ in range(RANDOM_WRITES)]
    start = time.perf_counter()
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, block, offsets[0])
        first = time.perf_counter() - start
        for off in offsets[1:]:
            os.pwrite(fd, block, off)
        os.fsync(fd)
    finally:
        os.close(fd)
    return first, time.perf_counter() - start


# ----- lifecycle -------------------------------------------------------------------------

@workload(*LIFECYCLE)
def fork(b: Bench, s: System) -> list[Result]:
    """fork: get a new writable isolated view of the tree; discard: drop it again."""
    s.prepare(b.tree)
    forks, discards = [], []
    for _ in range(b.repeat):
        start = time.perf_counter()
        view = s.fork(b.tree)
        forks.append(time.perf_counter() - start)
        discards.append(timed(s.discard, view))
    return [Result("fork", s.id, forks), Result("discard", s.id, discards)]


@contextlib.contextmanager
def _forked(s: System, tree: Tree) -> Iterator[View]:
    s.prepare(tree)
    view = s.fork(tree)
    try:
        yield view
    finally:
        s.discard(view)


def _after_changes(b: Bench, s: System, tree: Tree, name: str, op: Callable[[View], None],
                   files: int | None = None) -> Result:
    """Result ``name``: seconds of ``op(view)`` after each of ``repeat`` rounds of
    CHANGED_FILES changes; ``extra``: what the system reports doing in the last round
    (:meth:`System.counters`)."""
    changed = tree.sample(CHANGED_FILES, seed=len(tree.files))
    samples = []
    with _forked(s, tree) as view:
        for i in range(b.repeat):
            change_files(view.path, changed, f"round {i}")
            samples.append(timed(op, view))
        counters = s.counters(view)
    return Result(name, s.id, samples, files=files, extra=counters)


@workload(*LIFECYCLE)
def reset(b: Bench, s: System) -> list[Result]:
    """reset: back to the tree's state after CHANGED_FILES files changed."""
    return [_after_changes(b, s, b.tree, "reset", s.reset)]


@workload(*LIFECYCLE)
def promote(b: Bench, s: System) -> list[Result]:
    """promote: keep the view (CHANGED_FILES files changed) as a new immutable base."""
    return [_after_changes(b, s, b.tree, "promote", s.promote)]


@workload("cp-a", "overlayfs", "fuse-overlayfs", "rametfs")
def promote_big(b: Bench, s: System) -> list[Result]:
    """promote-big: promote a view whose big file was rewritten whole."""
    samples = []
    block = os.urandom(MIB)
    with _forked(s, b.big) as view:
        for _ in range(b.repeat):
            write_file(view.path / BIG_FILE, b.big.bytes, block)
            samples.append(timed(s.promote, view))
    return [Result("promote-big", s.id, samples, extra={"changed_bytes": b.big.bytes})]


# ----- metadata and reads ----------------------------------------------------------------

# Untimed runs before the warm ones, on every system alike.  Two, not one: after FUSE fetches
# a directory's listing it marks the directory's atime stale, so the next lstat of it sends a
# GETATTR (one per directory in the second pass, none from the third).
WARMUP = 2

def _git_status(path: Path, *config: str) -> None:
    git(*config, "status", "--porcelain", cwd=path)


@workload(*CHANGED_VIEW)
def git_status(b: Bench, s: System) -> list[Result]:
    """git-status: warm ``git status --porcelain`` (one run refreshes the index, then
    :data:`WARMUP` more);
    git-status-untracked-cache: the same with ``core.untrackedCache=true``, which skips
    reading directories whose mtime did not change; git-status-fsmonitor (rametfs): that and
    ``core.fsmonitor`` set to the execution's ``.ramet/fsmonitor`` hook, so git lstat()s only
    what the daemon says changed."""
    results = []
    with s.view(b.tree) as path:
        untracked = ("-c", "core.untrackedCache=true")
        variants = [("git-status", ()), ("git-status-untracked-cache", untracked)]
        if (path / ".ramet" / "fsmonitor").exists():
            variants.append(("git-status-fsmonitor", untracked + (
                "-c", f"core.fsmonitor={path / '.ramet' / 'fsmonitor'}")))
        for name, config in variants:
            for _ in range(1 + WARMUP):
                _git_status(path, *config)
            results.append(Result(name, s.id, [timed(_git_status, path, *config)
                                               for _ in range(b.repeat)]))
            b.profile(s, name, lambda: _git_status(path, *config))
    return results


def _warm_and_cold(b: Bench, s: System, name: str, tree: Tree,
                   action: Callable[[], object]) -> list[Result]:
    """``name``-cold: ``action()`` inside a fresh view of ``tree`` after dropping the caches,
    each time; ``name``-warm: again and again in one view, after :data:`WARMUP` untimed
    runs."""
    results = []
    if b.can_drop_caches:
        cold = []
        for _ in range(b.repeat):
            with s.view(tree) as path, inside(path):
                b.drop_caches()
                cold.append(timed(action))
        results.append(Result(f"{name}-cold", s.id, cold))
    with s.view(tree) as path, inside(path):
        for _ in range(WARMUP):
            action()
        warm = [timed(action) for _ in range(b.repeat)]
        b.profile(s, f"{name}-warm", action)
    results.append(Result(f"{name}-warm", s.id, warm))
    return results


@workload(*READS)
def find(b: Bench, s: System) -> list[Result]:
    """find: ``find .`` inside the view (names only), cold then warm."""
    return _warm_and_cold(b, s, "find", b.tree, lambda: run("find", "."))


@workload(*READS)
def walk(b: Bench, s: System) -> list[Result]:
    """walk: ``os.walk`` + ``os.lstat`` of every entry, cold then warm; walk-warm-abspath:
    warm, every path absolute (resolved from the file system root, not inside the view)."""
    results = _warm_and_cold(b, s, "walk", b.tree, lambda: walk_lstat(Path(".")))
    with s.view(b.tree) as path:
        for _ in range(WARMUP):
            walk_lstat(path)
        results.append(Result("walk-warm-abspath", s.id,
                              [timed(walk_lstat, path) for _ in range(b.repeat)]))
    return results


def _read_tree(b: Bench, s: System, name: str, tree) -> list[Result]:
    results = _warm_and_cold(b, s, name, tree, lambda: read_files(Path("."), tree.files))
    for r in results:
        r.extra["MB/s"] = tree.bytes / r.median / 1e6
    return results


def tar_to_pipe() -> None:
    """``tar -cf - --exclude=./.git .`` into ``cat > /dev/null``: GNU tar reads no file
    data when its archive is /dev/null itself.  Raises BenchError if either fails."""
    tar = subprocess.Popen(["tar", "-cf", "-", "--exclude=./.git", "."], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    cat = subprocess.run(["cat"], stdin=tar.stdout, stdout=subprocess.DEVNULL)
    tar.stdout.close()
    err = tar.stderr.read()
    if tar.wait() != 0 or cat.returncode != 0:
        raise BenchError(f"tar exited {tar.returncode}, cat {cat.returncode}: {err[-2000:]!r}")


@workload(*READS)
def read_all(b: Bench, s: System) -> list[Result]:
    """read: read every file of the tree (not ``.git``) from Python, cold then warm;
    read-tar-warm: the same files archived by ``tar -c`` (C, one pass), warm."""
    results = _read_tree(b, s, "read", b.tree)
    with s.view(b.tree) as path, inside(path):
        for _ in range(WARMUP):
            tar_to_pipe()
        results.append(Result("read-tar-warm", s.id, [timed(tar_to_pipe)
                                                      for _ in range(b.repeat)]))
    return results


@workload(*READS)
def seqread(b: Bench, s: System) -> list[Result]:
    """seqread: read the big file sequentially, cold then warm."""
    return _read_tree(b, s, "seqread", b.big)


# ----- writes ----------------------------------------------------------------------------

@workload(*IO)
def seqwrite(b: Bench, s: System) -> list[Result]:
    """seqwrite: write a new file as big as the big file, 1 MiB writes, then fsync."""
    block = os.urandom(MIB)
    samples = []
    with s.view(b.big) as path, inside(path):
        for _ in range(b.repeat):
            samples.append(timed(write_file, Path("written.bin"), b.big.bytes, block))
            os.unlink("written.bin")
    return [Result("seqwrite", s.id, samples,
                   extra={"MB/s": b.big.bytes / statistics.median(samples) / 1e6})]


@workload(*IO)
def randwrite(b: Bench, s: System) -> list[Result]:
    """randwrite: RANDOM_WRITES 4 KiB writes at random offsets into the big file from the
    base (a fresh view each time) and fsync; -first: open + the first write.  rametfs:
    -first-unhydrated: the same into a big file no view has opened yet (its first open
    hydrates the content into the daemon's cache)."""
    firsts, totals = [], []
    for i in range(b.repeat):
        with s.view(b.big) as path, inside(path):
            first, total = random_writes(Path(BIG_FILE), b.big.bytes, seed=i)
        firsts.append(first)
        totals.append(total)
    results = [Result("randwrite-first", s.id, firsts),
               Result(f"randwrite-{RANDOM_WRITES}", s.id, totals)]
    if isinstance(s, Rametfs):
        unhydrated = big_tree(b.scratch / "big-unhydrated", b.big.bytes)
        with s.view(unhydrated) as path, inside(path):
            first, _ = random_writes(Path(BIG_FILE), unhydrated.bytes, seed=0)
        results.append(Result("randwrite-first-unhydrated", s.id, [first]))
    return results


@workload(*IO)
def untar(b: Bench, s: System) -> list[Result]:
    """untar: ``tar -xf`` the tree (no ``.git``) into a view; rm-rf: ``rm -rf`` it again."""
    tar = b.tar

    def untar_and_remove(path: Path) -> tuple[float, float]:
        (path / "untarred").mkdir()
        return (timed(run, "tar", "-xf", tar, "-C", "untarred", cwd=path),
                timed(run, "rm", "-rf", "untarred", cwd=path))

    untars, removes = [], []
    for i in range(b.repeat):
        with s.view(b.tree) as path:
            untar_seconds, rm_seconds = untar_and_remove(path)
            untars.append(untar_seconds)
            removes.append(rm_seconds)
            if i == b.repeat - 1:
                b.profile(s, "untar+rm-rf", lambda: untar_and_remove(path))
    return [Result("untar", s.id, untars), Result("rm-rf", s.id, removes)]


@workload("native", "fuse-overlayfs", "rametfs")
def requests(b: Bench, s: System) -> list[Result]:
    """requests-untar, requests-rm-rf: seconds per file of ``tar -xf`` of REQUEST_FILES small
    files into a view and of ``rm -rf`` of them; requests-write: seconds per MiB of writing
    REQUEST_MIB MiB, 1 MiB at a time, and the fsync.  On a FUSE system ``extra`` then holds,
    from one more traced run (:mod:`benchmarks.fuse_trace`), the requests the kernel sent per
    file (per MiB) by opcode, their ``total``, ``waited_us``: the µs per file (per MiB) the
    process waited for replies, and ``<opcode>_us``: the median µs of each opcode's requests.
    That is what bounds untar, rm -rf and seqwrite."""
    tree = b.synthetic(REQUEST_FILES)
    tar = b.scratch / f"synthetic-{REQUEST_FILES}.tar"
    if not tar.exists():
        tarball(tree, tar)
    block = os.urandom(MIB)
    steps = {
        "untar": (REQUEST_FILES, lambda path: run("tar", "-xf", tar, "-C", path / "untarred")),
        "rm-rf": (REQUEST_FILES, lambda path: run("rm", "-rf", path / "untarred")),
        "write": (REQUEST_MIB, lambda path: write_file(path / "written.bin", REQUEST_MIB * MIB,
                                                      block)),
    }

    def once(path: Path, each: Callable[[str, int, Callable[[], object]], None]) -> None:
        (path / "untarred").mkdir()
        for name, (units, step) in steps.items():
            each(name, units, lambda: step(path))
        os.unlink(path / "written.bin")

    samples: dict[str, list[float]] = {name: [] for name in steps}
    extra: dict[str, dict] = {name: {} for name in steps}
    with s.view(tree) as path:
        for _ in range(b.repeat):
            once(path, lambda name, units, action:
                 samples[name].append(timed(action) / units))
        if not isinstance(s, Native):
            with FuseTrace(path) as trace:
                def traced(name: str, units: int, action: Callable[[], object]) -> None:
                    sent = trace.run(action)
                    extra[name] = {**sent.per(units), "waited_us": sent.waited_us(units),
                                   **sent.median_us()}
                once(path, traced)
    return [Result(f"requests-{name}", s.id, samples[name], extra=extra[name])
            for name in steps]


# ----- rametfs figures with references ---------------------------------------------------

@workload("cp-a", "rametfs")
def import_(b: Bench, s: System) -> list[Result]:
    """import: snapshot the tree (rametfs) or copy it (cp -a, the reference), files/s and
    MB/s; import-big: the big incompressible file; reimport: the unchanged tree again."""
    results = []
    for name, tree in (("import", b.tree), ("import-big", b.big)):
        if isinstance(s, Rametfs):
            s.prepare(tree)
            seconds = s.import_seconds[tree.name]
        else:
            dest = s.scratch / f"{name}-copy"
            seconds = timed(run, "cp", "-a", tree.path, dest)
            shutil.rmtree(dest)
        results.append(Result(name, s.id, [seconds], extra={
            "MB/s": tree.bytes / seconds / 1e6, "files/s": len(tree.files) / seconds}))
    if isinstance(s, Rametfs):
        samples = [timed(s.ramet.snapshot, b.tree.path) for _ in range(b.repeat)]
        results.append(Result("reimport", s.id, samples, extra={
            "share_of_import": statistics.median(samples) / s.import_seconds[b.tree.name]}))
    return results


@workload("overlayfs", "fuse-overlayfs", "rametfs")
def storage(b: Bench, s: System) -> list[Result]:
    """stored: disk bytes added by STORAGE_VIEWS views that each change STORAGE_SHARE of the
    files; ratio = (base + added) / (base + changed files' bytes), base = what the system
    stores for the tree.  rametfs also after promoting every view."""
    tree = b.tree
    s.prepare(tree)
    base = s.base_bytes(tree)
    before = disk_usage(s.stored_paths(tree, []))
    # rametfs: opening a file to change it hydrates its content into the shared cache.
    cache = s.data / "cache" if isinstance(s, Rametfs) else None
    cached_before = disk_usage([cache]) if cache else 0
    views: list[View] = []
    changed = 0
    extra: dict = {}
    try:
        for i in range(STORAGE_VIEWS):
            views.append(s.fork(tree))
            files = tree.sample(max(1, round(len(tree.files) * STORAGE_SHARE)), seed=1000 + i)
            changed += change_files(views[-1].path, files, f"view {i}")
        added = disk_usage(s.stored_paths(tree, views)) - before
        if cache:
            extra["hydration_cache_bytes"] = disk_usage([cache]) - cached_before
            for view in views:
                s.promote(view)
            extra["added_after_promote_bytes"] = disk_usage(s.stored_paths(tree, views)) - before
    finally:
        for view in views:
            s.discard(view)
    extra.update(base_bytes=base, changed_bytes=changed,
                 ratio=(base + added) / (base + changed))
    if cache:
        extra["ratio_without_cache"] = (
            (base + added - extra["hydration_cache_bytes"]) / (base + changed))
    return [Result(f"stored-{STORAGE_VIEWS}x1%", s.id, [added], unit="B", extra=extra)]


@workload("rametfs")
def roundtrip(b: Bench, s: System) -> list[Result]:
    """roundtrip: seconds of one FUSE request that the daemon answers from memory:
    ``fstat`` of an open ``.ramet/status`` (attribute timeout 0, so each is a GETATTR);
    the floor under every request of the other workloads."""
    calls = 2000
    samples = []
    with s.view(b.tree) as path:
        fd = os.open(path / ".ramet" / "status", os.O_RDONLY)
        try:
            for _ in range(b.repeat):
                samples.append(timed(lambda: [os.fstat(fd) for _ in range(calls)]) / calls)
        finally:
            os.close(fd)
    return [Result("roundtrip", s.id, samples)]


LEASE_CYCLES = 200  # acquire+release cycles per sample of the lease workload
LEASE_POOL = 4


@workload("rametfs")
def lease(b: Bench, s: System) -> list[Result]:
    """lease: seconds of one acquire + release of a daemon-kept pool of LEASE_POOL
    executions (the release resets and verifies at the root), one thread, nothing written;
    lease-write: the same with one file written in between; lease-deep: written, with deep
    verification.  ``extra["per_second"]``: cycles per second."""
    assert isinstance(s, Rametfs)
    s.prepare(b.tree)
    base = s.snapshots[b.tree.name]
    results = []
    for name, verify, write in (("lease", "root", False), ("lease-write", "root", True),
                                ("lease-deep", "deep", True)):
        with s.ramet.execution_pool(base, concurrency=LEASE_POOL, verify=verify) as pool:
            def cycles() -> None:
                for i in range(LEASE_CYCLES):
                    with pool.acquire() as ex:
                        if write:
                            (ex.path / "lease-bench.txt").write_text(str(i))

            cycles()  # warm: every execution acquired once
            samples = [timed(cycles) / LEASE_CYCLES for _ in range(b.repeat)]
        results.append(Result(name, s.id, samples,
                              extra={"per_second": 1 / statistics.median(samples)}))
    return results


@workload("rametfs")
def rss(b: Bench, s: System) -> list[Result]:
    """rss: the daemon's resident memory with 1, 100 and 1000 executions (a fresh daemon);
    then after a walk of one of them; release: seconds to release them all."""
    assert isinstance(s, Rametfs)
    s.prepare(b.tree)
    s.restart()
    results, views = [], []
    try:
        def measure(name: str) -> Result:
            memory = s.memory()
            return Result(name, s.id, [memory["rss"]], unit="B",
                          extra={"anon_bytes": memory["anon"], "file_bytes": memory["file"]})

        for count in RSS_EXECUTIONS:
            while len(views) < count:
                views.append(s.fork(b.tree))
            results.append(measure(f"rss-{count}"))
        walk_lstat(views[0].path)
        results.append(measure(f"rss-{len(views)}+walk"))
    finally:
        start = time.perf_counter()
        for view in views:
            s.discard(view)
        if len(views) == RSS_EXECUTIONS[-1]:
            results.append(Result(f"release-{len(views)}", s.id,
                                  [time.perf_counter() - start]))
    return results


@workload(*LIFECYCLE)
def scaling(b: Bench, s: System) -> list[Result]:
    """scale-fork, scale-reset, scale-promote: on synthetic trees of each scaling size."""
    results = []
    for files in b.scales:
        tree = b.synthetic(files)
        try:
            s.prepare(tree)
            forks = []
            for _ in range(b.repeat):
                start = time.perf_counter()
                view = s.fork(tree)
                forks.append(time.perf_counter() - start)
                s.discard(view)
        except Unsupported:
            continue
        results.append(Result("scale-fork", s.id, forks, files=files))
        results.append(_after_changes(b, s, tree, "scale-reset", s.reset, files))
        results.append(_after_changes(b, s, tree, "scale-promote", s.promote, files))
    return results


# ----- isolation and memory (issue 15) ---------------------------------------------------

ISOLATION_FILES = {"smoke": 1000, "small": 20_000, "full": 200_000}  # --many-files
FLOOD_SECONDS = {"smoke": 1.0, "small": 5.0, "full": 10.0}
FLOOD_WRITERS = 8
FLOOD_WRAP = 256 * MIB  # each writer's file stays below this (its writes go round)
XATTRS = 1233  # setxattr calls of the xattr case
XATTR_BYTES = 64 << 10
EXT4_MAX_FILE = 16 << 40  # rametfs's default --max-file-size is this less one page
REPEAT_BUDGET_S = 30.0  # a repeatable case stops repeating after this, probes or not
STALL_GOAL_S = 0.050
# The isolation cases in the order they run (``create`` is create-N); each of NEEDS_FILES
# works on the files ``create`` makes, so ``create`` runs unmeasured when only they are chosen.
ISOLATION_CASES = ("policy-2g", "touch-2600", "setxattr", "truncate-16t", "write-flood",
                   "create", "ls-ramet", "cat-diff", "cat-status", "checkpoint", "promote",
                   "ls-f", "rm-rf", "reset")
NEEDS_FILES = frozenset({"ls-ramet", "cat-diff", "checkpoint", "promote", "ls-f", "rm-rf"})


def _hostile_case(b: Bench, s: Rametfs, probe: hostile.Probe, name: str,
                  action: Callable[[], str], repeat: bool = True) -> Result:
    """Result ``isolation-<name>``: the seconds of each probe round that started while
    ``action()`` (the hostile case) ran.  A ``repeat`` case runs again until
    :data:`hostile.MIN_PROBES` rounds started or :data:`REPEAT_BUDGET_S` passed; a case
    shorter than one round gets the round after it.  ``extra``: ``worst_ms``, ``p99_ms``,
    ``probes``, ``case_s`` (the first run's seconds), ``runs`` and ``outcome`` (what the
    case's process said).  With ``--profile``: py-spy during it, ``isolation-<name>.txt``,
    and where the trio thread spent its time, ``isolation-<name>.json``."""
    with b.spying(s, f"isolation-{name}", threads=True):
        start = time.monotonic()
        outcome = action()
        seconds = time.monotonic() - start
        runs = 1
        while (repeat and probe.count(start) < hostile.MIN_PROBES
               and time.monotonic() - start < REPEAT_BUDGET_S):
            action()
            runs += 1
        probe.wait_for(start, 1)
        until = time.monotonic()
    if b.profile_dir is not None:
        summary = trio_thread_profile(b.profile_dir / f"isolation-{name}.txt", PROFILE_RATE)
        (b.profile_dir / f"isolation-{name}.json").write_text(json.dumps(summary, indent=1))
    latencies = sorted(probe.latencies(start, until))
    p99 = latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)]
    return Result(f"isolation-{name}", s.id, latencies, extra={
        "worst_ms": latencies[-1] * 1e3, "p99_ms": p99 * 1e3, "probes": len(latencies),
        "case_s": seconds, "runs": runs, "outcome": outcome})


def _reset_collected(s: Rametfs, ex: Execution, written: str) -> tuple[float, float]:
    """Reset ``ex`` and wait until the daemon collected the dropped layer (its upper
    directory, found from ``written``, a file with data in ``ex``, gone); returns (seconds
    of the reset command, seconds of the collection)."""
    layer = hostile.layer_of(s.data, ex.path / written)
    reset_s = timed(ex.reset)
    return reset_s, hostile.wait_collected(s.data, {layer})


@workload("rametfs")
def isolation(b: Bench, s: System) -> list[Result]:
    """isolation-<case>: while execution A runs each hostile case, a bystander probe in
    execution B (:mod:`benchmarks.hostile`) times stat + create + write 4 KiB + close +
    unlink, every 5 ms; the samples are those rounds' seconds (issue 15.3: the worst of at
    least 100 under 50 ms).  ``--many-files`` (default by size: ISOLATION_FILES) files
    make the big cases; ``--isolation-cases`` chooses among ISOLATION_CASES."""
    assert isinstance(s, Rametfs)
    tree = b.synthetic(100)
    s.prepare(tree)
    files = b.many_files or ISOLATION_FILES[b.size.name]
    hostile_ex = s.ramet.create(s.snapshots[tree.name], policy="tree")
    bystander = s.ramet.create(s.snapshots[tree.name])
    a = hostile_ex.path
    results: list[Result] = []
    xattr_files = itertools.count()
    chosen = frozenset(ISOLATION_CASES) if b.isolation_cases is None else b.isolation_cases

    def sparse_checkpoint() -> str:
        too_big = hostile.shell(a, f"truncate -s {EXT4_MAX_FILE} sparse")
        hostile.shell(a, f"truncate -s {EXT4_MAX_FILE - PAGE} sparse", ok=True)
        seconds = timed(hostile_ex.checkpoint)
        return f"16 TiB: {too_big}; 16 TiB - 4 KiB: ok; checkpoint {seconds:.3f} s"

    def captured(capture: Callable[[], str]) -> Callable[[], str]:
        def run() -> str:
            seconds = timed(capture)
            stats = hostile_ex.status()["last"]["stats"]
            return f"{stats.get('changed_files')} changed files in {seconds:.2f} s"
        return run

    def reset() -> str:
        reset_s, collected_s = _reset_collected(s, hostile_ex, "many/f0")
        return f"reset {reset_s * 1e3:.0f} ms, collected {collected_s:.2f} s later"

    def create() -> str:
        return hostile.python(a, hostile.CREATE_FILES, "many", files)

    try:
        with hostile.Probe(bystander.path, tree.files[0]) as probe:
            def case(name: str, action: Callable[[], str], repeat: bool = True,
                     key: str | None = None) -> None:
                if (key or name) in chosen:
                    results.append(_hostile_case(b, s, probe, name, action, repeat))

            case("policy-2g", lambda: hostile.shell(
                a, "truncate -s 2G ramet.toml && cat .ramet/preview"))
            case("touch-2600", lambda: hostile.shell(
                a, "touch -d 2600-01-01T00:00:00Z f && t=$(stat -c %Y f) && "
                   "echo \"mtime $t, $(date -u -d @$t +%FT%TZ)\""))
            case("setxattr", lambda: hostile.python(
                a, hostile.SETXATTRS, f"xattrs-{next(xattr_files)}", XATTRS, XATTR_BYTES))
            case("truncate-16t", sparse_checkpoint)
            case("write-flood", lambda: hostile.write_flood(
                a, FLOOD_WRITERS, FLOOD_SECONDS[b.size.name], FLOOD_WRAP), repeat=False)
            if "write-flood" in chosen:
                _reset_collected(s, hostile_ex, "flood-0")
            made = "create" in chosen or bool(chosen & NEEDS_FILES)  # the N files exist
            if "create" in chosen:
                case(f"create-{files}", create, repeat=False, key="create")
            elif made:
                create()
            case("ls-ramet", lambda: hostile.shell(a, "ls .ramet | tr '\\n' ' '"))
            case("cat-diff", lambda: hostile.shell(a, "cat .ramet/diff | wc -l"))
            case("cat-status", lambda: hostile.shell(a, "cat .ramet/status | wc -c"))
            case("checkpoint", captured(hostile_ex.checkpoint), repeat=False)
            case("promote", captured(hostile_ex.promote), repeat=False)
            case("ls-f", lambda: hostile.shell(a, "ls -f many | wc -l"), repeat=False)
            case("rm-rf", lambda: hostile.shell(a, "rm -rf many && echo removed"),
                 repeat=False)
            if "reset" in chosen:
                if not made or "rm-rf" in chosen:
                    create()
                case("reset", reset, repeat=False)
    finally:
        for ex in (hostile_ex, bystander):
            s.ramet.release(ex)
    return results


RSS_CYCLES = {"smoke": (3, 500), "small": (10, 20_000), "full": (10, 100_000)}  # (cycles, files)
EXECUTION_CYCLES = {"smoke": 50, "small": 500, "full": 1000}
SETTLE_S = 0.5  # after the collection, for the daemon to give the memory back


@workload("rametfs")
def rss_cycles(b: Bench, s: System) -> list[Result]:
    """rss-cycle<i>-created, -reset: the daemon's memory (a fresh daemon) after each of
    RSS_CYCLES cycles of creating files (one write of 100 bytes each, in one directory)
    in one execution, then a reset, waited on until the dropped layer is collected (its
    upper directory gone); rss-cycles-released: after creating them once more and
    releasing the execution; rss-after-<n>-executions: after n executions were each
    created, used (a status read, a file written) and released.  Issue 15.5: memory
    returns to its baseline.  ``--many-files`` overrides the files per cycle."""
    assert isinstance(s, Rametfs)
    tree = b.synthetic(100)
    s.prepare(tree)
    s.restart()
    cycles, files = RSS_CYCLES[b.size.name]
    files = b.many_files or files
    results = []

    def measure(name: str, **extra: float) -> None:
        time.sleep(SETTLE_S)
        memory = s.memory()
        results.append(Result(name, s.id, [memory["rss"]], unit="B", extra={
            "anon_bytes": memory["anon"], "file_bytes": memory["file"], **extra}))

    ex = s.ramet.create(s.snapshots[tree.name])
    os.stat(ex.path)
    measure("rss-cycles-start")
    try:
        for i in range(1, cycles + 1):
            create_s = timed(hostile.python, ex.path, hostile.CREATE_FILES, "many", files)
            measure(f"rss-cycle{i}-created", files=files, create_s=create_s)
            reset_s, collect_s = _reset_collected(s, ex, "many/f0")
            measure(f"rss-cycle{i}-reset", reset_s=reset_s, collect_s=collect_s)
        hostile.python(ex.path, hostile.CREATE_FILES, "many", files)
        layers = {hostile.layer_of(s.data, ex.path / "many/f0")}
    finally:
        s.ramet.release(ex)
    hostile.wait_collected(s.data, layers)
    measure("rss-cycles-released", files=files)

    count = EXECUTION_CYCLES[b.size.name]
    layers = set()
    for _ in range(count):
        ex = s.ramet.create(s.snapshots[tree.name])
        (ex.path / ".ramet" / "status").read_bytes()
        (ex.path / "written.txt").write_bytes(b"x")
        layers.add(hostile.layer_of(s.data, ex.path / "written.txt"))
        s.ramet.release(ex)
    hostile.wait_collected(s.data, layers)
    measure(f"rss-after-{count}-executions")
    return results


@workload("rametfs")
def gc(b: Bench, s: System) -> list[Result]:
    """gc-promote: seconds of each of GC_PROMOTES[size] (``--gc-promotes``) promotes of a
    synthetic tree of GC_FILES[size] files, each in a fresh execution of the last promote
    with GC_SHARE of the files changed (one line appended); then gc-forget: ``forget
    --keep-last GC_KEEP``;
    gc: the gc after it, ``bytes`` the LMDB values it deleted (what the store reuses);
    gc-compact: the offline ``rametfs gc --compact`` (daemon stopped), ``after_bytes`` the
    metadata file it leaves.  One sample each: the workload destroys what it measures."""
    assert isinstance(s, Rametfs)
    tree = b.synthetic(GC_FILES[b.size.name])
    s.prepare(tree)
    head = s.snapshots[tree.name]
    changed = max(1, round(len(tree.files) * GC_SHARE))
    promotes = []
    for i in range(b.gc_promotes or GC_PROMOTES[b.size.name]):
        execution = s.ramet.create(head)
        change_files(execution.path, tree.sample(changed, seed=i), f"promote {i}")
        start = time.perf_counter()
        head = execution.promote()
        promotes.append(time.perf_counter() - start)
        s.ramet.release(execution)
    meta = s.data / "meta" / "data.mdb"
    used_before = disk_usage([s.data])
    start = time.perf_counter()
    forgot = s.ramet.forget(keep_last=GC_KEEP)
    forget_s = time.perf_counter() - start
    start = time.perf_counter()
    report = s.ramet.gc()
    gc_s = time.perf_counter() - start
    file_bytes, used_after = meta.stat().st_size, disk_usage([s.data])
    s.stop()  # compaction is offline
    try:
        start = time.perf_counter()
        run(sys.executable, "-m", "rametfs", "gc", "--compact", "--mode", "fallback",
            "--data", s.data)
        compact_s = time.perf_counter() - start
    finally:
        s.start()
    counts = {"promotes": len(promotes), "files": len(tree.files), "changed_files": changed}
    return [
        Result("gc-promote", s.id, promotes, files=len(tree.files), extra=counts),
        Result("gc-forget", s.id, [forget_s], extra={"removed": len(forgot["removed"]),
                                                     "kept": len(forgot["kept"])}),
        Result("gc", s.id, [gc_s], extra={
            "bytes": report["bytes"], "chunks": report["chunks"],
            "contents": report["contents"], "trees": report["trees"],
            "cache_bytes": report["cache_bytes"], "kept_contents": report["kept_contents"],
            "data_dir_bytes_before": used_before,
            "data_dir_bytes_after": used_after}),
        Result("gc-compact", s.id, [compact_s], extra={
            "before_bytes": file_bytes, "after_bytes": meta.stat().st_size}),
    ]


# ----- what coding agents run (issue 21) -------------------------------------------------

@contextlib.contextmanager
def cpu_load(active: bool) -> Iterator[None]:
    """With ``active``: one ``python -c 'while 1: pass'`` per core during the block, each
    ended by its pid afterwards.  Otherwise nothing."""
    burners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"])
               for _ in range(os.cpu_count() or 1)] if active else []
    try:
        yield
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()


def _loaded(b: Bench, name: str) -> str:
    return f"{name}-loaded" if b.load else name


# pip with no configuration of this machine's (an index, extra find-links): only the wheels.
_PIP_ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")},
            "PIP_CONFIG_FILE": os.devnull}


def _checkout_and_back(repo: Path) -> None:
    git("checkout", "-q", agent_inputs.OLD_REVISION, cwd=repo)
    git("checkout", "-q", "main", cwd=repo)


def _venv_and_pip_install(path: Path, wheels: Path) -> None:
    run(sys.executable, "-m", "venv", "venv", cwd=path)
    run("venv/bin/python", "-m", "pip", "install", "-q", "--no-index", "--no-cache-dir",
        "--disable-pip-version-check", "--find-links", wheels,
        *(w.split("==")[0] for w in agent_inputs.WHEELS), cwd=path, env=_PIP_ENV,
        inherit_env=False)


def _import(path: Path) -> None:
    run("venv/bin/python", "-c", f"import {', '.join(agent_inputs.IMPORTS)}", cwd=path)


def _npm_ci(path: Path, npm_cache: Path) -> None:
    run("npm", "ci", "--offline", "--cache", npm_cache, "--ignore-scripts", "--no-audit",
        "--no-fund", "--loglevel=error", "--logs-max=0", cwd=path / "web")


def _agent_round(inputs: AgentInputs, path: Path) -> dict[str, float]:
    """One round of the agent workload in the view at ``path``: seconds of each step."""
    seconds = {}
    if inputs.changed_files:
        git("status", "--porcelain", cwd=path / "repo")  # untimed: refreshes the index
        seconds["git-checkout"] = timed(_checkout_and_back, path / "repo")
    if inputs.wheels:
        seconds["pip-install"] = timed(_venv_and_pip_install, path, inputs.wheels)
        for _ in range(WARMUP):
            _import(path)
        seconds["import-warm"] = timed(_import, path)
    if inputs.npm_cache:
        seconds["npm-ci"] = timed(_npm_ci, path, inputs.npm_cache)
    made = [rel for rel in ("venv", "web/node_modules") if (path / rel).exists()]
    if made:
        seconds["rm-rf"] = timed(run, "rm", "-rf", *made, cwd=path)
    return seconds


def _entries(path: Path) -> int:
    """Directories, files and symlinks under ``path`` (``path`` itself not counted)."""
    return sum(len(dirs) + len(files) for _, dirs, files in os.walk(path))


@workload(*IO)
def agent(b: Bench, s: System) -> list[Result]:
    """In a fresh view of the agent tree (:mod:`benchmarks.agent_inputs`) each round:
    agent-git-checkout: ``git checkout`` from the newest Django release to the oldest and back
    (after an untimed ``git status``); agent-pip-install: ``python -m venv`` and an offline
    ``pip install`` of the cached wheels; agent-import-warm: ``import`` of IMPORTS from that
    venv after WARMUP untimed runs; agent-npm-ci: ``npm ci --offline`` from the cached npm
    cache; agent-rm-rf: ``rm -rf`` of the venv and node_modules.  A step whose input could not
    be made is skipped, with the reason in the report.  On fuse-overlayfs and rametfs one
    more round traces the requests of the checkout (per changed file and checkout) and of
    npm ci (per entry of node_modules).  ``--load``: beside a CPU-bound process per core;
    the names end in ``-loaded``."""
    inputs = b.agent
    for step, needs in (("git-checkout", "repo"), ("pip-install", "wheels"),
                        ("import-warm", "wheels"), ("npm-ci", "npm")):
        if needs in inputs.missing:
            b.skip(_loaded(b, f"agent-{step}"), s.id, inputs.missing[needs])
    samples: dict[str, list[float]] = defaultdict(list)
    extra: dict[str, dict] = defaultdict(dict)
    with cpu_load(b.load):
        for _ in range(b.repeat):
            with s.view(inputs.tree) as path:
                for step, seconds in _agent_round(inputs, path).items():
                    samples[step].append(seconds)
        def traced(path: Path, trace: FuseTrace) -> None:
            if inputs.changed_files:
                git("status", "--porcelain", cwd=path / "repo")
                sent = trace.run(lambda: _checkout_and_back(path / "repo"))
                extra["git-checkout"] = _per(sent, 2 * inputs.changed_files)
            if inputs.npm_cache:
                sent = trace.run(lambda: _npm_ci(path, inputs.npm_cache))
                extra["npm-ci"] = _per(sent, _entries(path / "web" / "node_modules"))

        _trace_in_view(b, s, inputs.tree, _loaded(b, "agent"), traced)
    if inputs.changed_files:
        extra["git-checkout"]["changed_files"] = inputs.changed_files
    return [Result(_loaded(b, f"agent-{step}"), s.id, values, extra=extra[step])
            for step, values in samples.items()]


def _trace_in_view(b: Bench, s: System, tree: Tree, name: str,
                   action: Callable[[Path, FuseTrace], object]) -> None:
    """On :data:`TRACED` systems: ``action(path, trace)`` with a fresh view of ``tree`` at
    ``path`` and a FuseTrace of it; where tracing is unsupported, a skip of ``name
    requests`` is noted instead."""
    if s.id not in TRACED:
        return
    with s.view(tree) as path:
        try:
            with FuseTrace(path) as trace:
                action(path, trace)
        except Unsupported as exc:
            b.skip(f"{name} requests", s.id, str(exc))


def _per(sent, units: int) -> dict:
    """Requests per unit by opcode, their total, and the µs waited per unit."""
    return {"units": units, **sent.per(units), "waited_us": sent.waited_us(units)}


@workload(*IO)
def agent_big(b: Bench, s: System) -> list[Result]:
    """agent-write-1g: write a new AGENT_BIG file (1 GiB at small and full) in 1 MiB writes
    and fsync, in a fresh view each time; agent-read-1g-cold, -warm: read a base file of
    that size sequentially, 1 MiB reads (cold: a fresh view after dropping the caches).
    ``--load``: beside a CPU-bound process per core."""
    tree = b.agent_big
    block = os.urandom(MIB)
    samples = []
    with cpu_load(b.load):
        for _ in range(b.repeat):
            with s.view(tree) as path, inside(path):
                samples.append(timed(write_file, Path("written.bin"), tree.bytes, block))
                os.unlink("written.bin")
        results = [Result(_loaded(b, "agent-write-1g"), s.id, samples)]
        results += _warm_and_cold(b, s, _loaded(b, "agent-read-1g"), tree,
                                  lambda: read_files(Path("."), tree.files))
    for r in results:
        r.extra["MB/s"] = tree.bytes / r.median / 1e6
    return results


def _untar_at_once(tar: Path, dests: list[Path]) -> None:
    """``tar -xf tar -C dest`` into every one of ``dests`` at once; waits for all."""
    procs = [subprocess.Popen(["tar", "-xf", str(tar), "-C", str(d)], stderr=subprocess.PIPE)
             for d in dests]
    failed = [(p.wait(), p.stderr.read()) for p in procs]
    for p in procs:
        p.stderr.close()
    if any(code for code, _ in failed):
        raise BenchError(f"tar -xf into {len(dests)} views at once: {failed}")


@workload(*IO, "rametfs-procs")
def agent_parallel(b: Bench, s: System) -> list[Result]:
    """agent-untar-x<N>: seconds until ``tar -xf`` of a synthetic tree of PARALLEL_FILES
    files ended in each of N fresh views at once (N in PARALLEL_VIEWS; native: N directories;
    rametfs-procs: each view on a daemon of its own);
    ``throughput_vs_one``: the entries per second of all N together as a multiple of one
    alone.  On fuse-overlayfs and rametfs one more untar in one view is traced: requests per
    entry.  ``--load``: beside a CPU-bound process per core."""
    tree = b.synthetic(PARALLEL_FILES[b.size.name])
    tar = b.scratch / f"synthetic-{len(tree.files)}.tar"
    if not tar.exists():
        tarball(tree, tar)
    with tarfile.open(tar) as t:
        entries = sum(1 for m in t if m.name not in (".", "./"))
    results = []
    with cpu_load(b.load):
        for n in PARALLEL_VIEWS:
            samples = []
            for _ in range(b.repeat):
                with contextlib.ExitStack() as stack:
                    dests = [stack.enter_context(s.view(tree)) / f"untarred-{i}"
                             for i in range(n)]
                    for d in dests:
                        d.mkdir()
                    samples.append(timed(_untar_at_once, tar, dests))
                    run("rm", "-rf", *dests)
            results.append(Result(_loaded(b, f"agent-untar-x{n}"), s.id, samples,
                                  extra={"views": n, "entries": entries}))
        def traced(path: Path, trace: FuseTrace) -> None:
            (path / "untarred").mkdir()
            sent = trace.run(lambda: _untar_at_once(tar, [path / "untarred"]))
            results[0].extra.update(_per(sent, entries))

        _trace_in_view(b, s, tree, _loaded(b, "agent-untar-x1"), traced)
    one = results[0].median
    for r in results:
        r.extra["throughput_vs_one"] = r.extra["views"] * one / r.median
    return results
