"""Run the selected workloads on every available system, one after another, and clean up.

Everything happens under one scratch directory (``rametfs-bench-*`` in ``--workdir``, on the
disk being measured).  Every system is closed (its mounts undone, the rametfs daemon stopped)
whatever happens, Ctrl-C included; the scratch directory is then deleted, unless something is
still mounted under it, which is reported instead.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from rametfs.mounts import mount_table

from .agent_inputs import default_cache
from .systems import SYSTEMS, System, Unsupported
from .trees import SCALE_1M, SIZES, BenchError
from .workloads import ISOLATION_CASES, WORKLOADS, Bench, Result

JSON_VERSION = 1


def _log(message: str, started: float) -> None:
    print(f"[{time.monotonic() - started:7.1f}s] {message}", file=sys.stderr, flush=True)


def mounts_under(base: Path) -> list[str]:
    """Mountpoints at or under ``base``."""
    return [m.point for m in mount_table()
            if m.point == str(base) or m.point.startswith(f"{base}/")]


def _remove_scratch(scratch: Path) -> None:
    left = mounts_under(scratch)
    if left:
        print(f"benchmarks: still mounted, so {scratch} is kept: {', '.join(left)}",
              file=sys.stderr)
        return
    shutil.rmtree(scratch, ignore_errors=True)


def _version(program: str) -> str | None:
    """The line of ``program --version`` that names it (fuse-overlayfs prints fusermount3's
    first)."""
    try:
        done = subprocess.run([program, "--version"], capture_output=True, text=True,
                              timeout=30)
    except OSError:
        return None
    return next((line.strip() for line in (done.stdout + done.stderr).splitlines()
                 if program in line), None)


def machine(scratch: Path) -> dict:
    """The machine the figures come from: cores, memory, kernel, CPU, the scratch disk."""
    with open("/proc/meminfo") as f:
        mem_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    disk = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "-T", str(scratch)],
                          capture_output=True, text=True).stdout.strip()
    return {"nproc": os.cpu_count(), "mem_bytes": mem_kib * 1024, "kernel": platform.release(),
            "cpu": cpu, "disk": disk, "python": platform.python_version(),
            "git": _version("git"), "fuse-overlayfs": _version("fuse-overlayfs")}


def run(size: str, repeat: int, only: list[str] | None, systems: list[str] | None,
        workdir: Path, scale_1m: bool = False, profile_dir: Path | None = None,
        many_files: int | None = None, gc_promotes: int | None = None,
        cache: Path | None = None, load: bool = False,
        isolation_cases: list[str] | None = None) -> dict:
    """Run the benchmark; return the report (the JSON's content, see docs/benchmarks.md).

    ``only``: workload names (default all, in :data:`WORKLOADS` order); ``systems``: system
    ids (default all); ``many_files``: the files of the isolation and rss-cycles workloads
    (default: by size); ``gc_promotes``: the gc workload's promotes instead of the size's;
    ``cache``: where the agent workloads' downloads are kept (default
    :func:`~benchmarks.agent_inputs.default_cache`); ``load``: the agent workloads run beside
    a CPU-bound process per core; ``isolation_cases``: the isolation workload's cases to run
    (default all, :data:`~benchmarks.workloads.ISOLATION_CASES`).
    An unavailable system is listed under ``skipped``; a workload (or a step of one) that
    cannot run on a system, and why, under ``skipped_workloads``; a workload that
    fails on one system is listed under ``errors`` and the run goes on.  Raises ValueError for
    an unknown workload, system or isolation case name.
    """
    names = only or list(WORKLOADS)
    for name in names:
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    for sid in systems or ():
        if sid not in SYSTEMS:
            raise ValueError(f"unknown system {sid!r}; known: {', '.join(SYSTEMS)}")
    for case in isolation_cases or ():
        if case not in ISOLATION_CASES:
            raise ValueError(f"unknown isolation case {case!r}; known: "
                             f"{', '.join(ISOLATION_CASES)}")
    wanted = [sid for sid in SYSTEMS if systems is None or sid in systems]
    skipped = {sid: reason for sid in wanted if (reason := SYSTEMS[sid].unavailable())}
    started = time.monotonic()
    started_ns = time.time_ns()
    workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="rametfs-bench-", dir=workdir)).resolve()
    results: list[Result] = []
    errors: list[dict] = []
    scales = SIZES[size].scales + ((SCALE_1M,) if scale_1m else ())
    if profile_dir:
        profile_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        stack.callback(_remove_scratch, scratch)
        bench = Bench(SIZES[size], repeat, scratch,
                      frozenset(sid for sid in wanted if sid not in skipped), scales,
                      profile_dir, many_files, gc_promotes,
                      cache=cache or default_cache(), load=load,
                      isolation_cases=frozenset(isolation_cases) if isolation_cases else None)
        live: dict[str, System] = {}
        for sid in wanted:
            if sid in skipped:
                continue
            try:
                live[sid] = SYSTEMS[sid](scratch)
            except (OSError, BenchError) as exc:
                skipped[sid] = f"failed to start: {exc}"
                continue
            stack.callback(live[sid].close)
        _log(f"building the {size} trees in {scratch}", started)
        _log(f"main tree: {len(bench.tree.files)} files, {bench.tree.bytes / 1e6:.0f} MB",
             started)
        for name in names:
            targets, fn = WORKLOADS[name]
            for sid in targets:
                if sid not in live:
                    continue
                _log(f"{name} on {sid}", started)
                try:
                    results += fn(bench, live[sid])
                except Unsupported as exc:
                    if exc.args:  # a missing input, not a system without the operation
                        bench.skip(name, sid, str(exc))
                except (OSError, BenchError, subprocess.SubprocessError) as exc:
                    errors.append({"workload": name, "system": sid, "error": str(exc),
                                   "log": live[sid].diagnose()})
                    _log(f"{name} on {sid} FAILED: {exc}", started)
        meta = {"tree": {"name": bench.tree.name, "files": len(bench.tree.files),
                         "bytes": bench.tree.bytes},
                "big_bytes": bench.size.big_bytes, "scales": list(scales),
                "many_files": many_files, "isolation_cases": isolation_cases,
                "cold": bench.can_drop_caches, "machine": machine(scratch)}
    _log("done", started)
    return {
        "version": JSON_VERSION,
        "command": " ".join(["tools/bench", *sys.argv[1:]]),
        "size": size, "repeat": repeat, "started_ns": started_ns,
        "seconds": round(time.monotonic() - started, 1),
        **meta,
        "systems": [sid for sid in wanted if sid in live],
        "skipped": skipped,
        "skipped_workloads": bench.skips,
        "load": load,
        "workloads": names,
        "results": [asdict(r) | {"median": r.median} for r in results],
        "errors": errors,
    }
