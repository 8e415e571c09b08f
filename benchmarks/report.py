"""The report: ratios to native ext4, the goals of issue 4, the table, the JSON, the charts.

Charts need matplotlib (tools/bench installs it); without it they are skipped with a note.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .systems import SYSTEMS

MS = 1e-3
MB = 1e6
SYSTEM_ORDER = list(SYSTEMS)
COLORS = {"native": "#4c4c4c", "cp-a": "#8c564b", "git-worktree": "#e377c2",
          "overlayfs": "#1f77b4", "fuse-overlayfs": "#ff7f0e", "rametfs": "#2ca02c",
          "rametfs-changed": "#98df8a", "rametfs-snapshot": "#17becf", "native-changed": "#a0a0a0",
          "rametfs-procs": "#006d2c", "fallback-copy": "#9467bd", "fallback-reflink": "#bcbd22"}


# The reference of a system that is not compared to plain native ext4.
REFERENCE = {"rametfs-changed": "native-changed", "native-changed": "native-changed"}


def add_ratios(report: dict) -> None:
    """Give each result measured in seconds its ``ratio`` to the median of its reference
    (native ext4, or :data:`REFERENCE`) on the same workload (None where it has none)."""
    medians = {(r["system"], r["workload"], r["files"]): r["median"] for r in report["results"]}
    for r in report["results"]:
        reference = REFERENCE.get(r["system"], "native")
        base = medians.get((reference, r["workload"], r["files"]))
        r["ratio"] = r["median"] / base if r["unit"] == "s" and base else None


def _find(report: dict, workload: str, system: str = "rametfs", files: int | None = None
          ) -> dict | None:
    return next((r for r in report["results"] if r["workload"] == workload
                 and r["system"] == system and r["files"] == files), None)


@dataclass(frozen=True)
class Goal:
    """A goal of issue 4: ``measure(report)`` gives (value, note) or None when not measured;
    the goal is met when ``value <= limit`` (``value >= limit`` when ``at_least``)."""

    text: str
    unit: str  # how value reads: "ms", "x native", "MB/s", "x import", "x", "MB"
    limit: float
    measure: Callable[[dict], tuple[float, str] | None]
    at_least: bool = False


def _median(workload: str, scale: float = 1.0, system: str = "rametfs"):
    def measure(report: dict):
        r = _find(report, workload, system)
        return (r["median"] / scale, "") if r else None
    return measure


def _ratio(workload: str):
    def measure(report: dict):
        r = _find(report, workload)
        return (r["ratio"], "") if r and r["ratio"] else None
    return measure


def _extra(workload: str, key: str, scale: float = 1.0):
    def measure(report: dict):
        r = _find(report, workload)
        return (r["extra"][key] / scale, "") if r and key in r["extra"] else None
    return measure


def _worst_at_every_size(workload: str):
    """The largest rametfs median of ``workload`` on the main tree and every scaling tree."""
    def measure(report: dict):
        found = [(r["median"], r["files"] or report["tree"]["files"])
                 for r in report["results"] if r["system"] == "rametfs"
                 and r["workload"] in (workload, f"scale-{workload}")]
        if not found:
            return None
        worst, files = max(found)
        return worst / MS, f"worst at {files} files"
    return measure


def _promote_at_100k(report: dict):
    found = sorted((r["files"], r["median"]) for r in report["results"]
                   if r["system"] == "rametfs" and r["workload"] == "scale-promote"
                   and r["files"] <= 100_000)
    if not found:
        return None
    files, median = found[-1]
    return median / MS, f"at {files} files" + ("" if files == 100_000 else " (largest measured)")


def _first_write(report: dict):
    """Open + first write into a never-opened big file when measured (rametfs hydrates the
    content at the first open), else into one that earlier workloads read."""
    r = _find(report, "randwrite-first-unhydrated")
    if r:
        return r["median"] / MS, "never-opened file"
    r = _find(report, "randwrite-first")
    return (r["median"] / MS, "content already hydrated") if r else None


def _fsmonitor(report: dict):
    """rametfs's git status with its fsmonitor hook against native's plain git status."""
    r, native = _find(report, "git-status-fsmonitor"), _find(report, "git-status", "native")
    return (r["median"] / native["median"], "") if r and native else None


def _isolation_worst(report: dict):
    """The worst bystander round over every hostile case (isolation-*), the case it came
    under, and how many cases missed 50 ms."""
    found = [(r["extra"]["worst_ms"], r["workload"].removeprefix("isolation-"))
             for r in report["results"]
             if r["system"] == "rametfs" and r["workload"].startswith("isolation-")]
    if not found:
        return None
    worst, case = max(found)
    missed = sum(1 for ms, _ in found if ms >= 50)
    return worst, f"under {case}; {missed} of {len(found)} cases at 50 ms or more"


def _heap_growth(report: dict):
    """How much the daemon's heap (RssAnon) after the later resets of rss-cycles exceeds
    the heap after the first: 0 when memory returns to the same baseline every cycle."""
    resets = sorted((int(m[1]), r["extra"]["anon_bytes"]) for r in report["results"]
                    if r["system"] == "rametfs"
                    and (m := re.fullmatch(r"rss-cycle(\d+)-reset", r["workload"])))
    if len(resets) < 2:
        return None
    first = resets[0][1]
    return (max(anon for _, anon in resets) - first) / MB, (
        f"after reset 1: {first / MB:.0f} MB, after reset {resets[-1][0]}: "
        f"{resets[-1][1] / MB:.0f} MB")


GOALS = [
    Goal("fork < 5 ms at every tree size", "ms", 5, _worst_at_every_size("fork")),
    Goal("reset < 5 ms at every tree size", "ms", 5, _worst_at_every_size("reset")),
    Goal("promote of 10 changed files < 50 ms at 100k files", "ms", 50, _promote_at_100k),
    Goal("warm git status <= 3x native", "x native", 3, _ratio("git-status")),
    Goal("warm git status <= 1x native with core.fsmonitor answered by rametfs", "x native",
         1, _fsmonitor),
    Goal("warm find <= 3x native", "x native", 3, _ratio("find-warm")),
    Goal("warm os.walk+lstat <= 2x native", "x native", 2, _ratio("walk-warm")),
    Goal("untar <= 1.5x native", "x native", 1.5, _ratio("untar")),
    Goal("rm -rf <= 2x native", "x native", 2, _ratio("rm-rf")),
    Goal("warm sequential read of the big file <= 1.1x native", "x native", 1.1,
         _ratio("seqread-warm")),
    Goal("cold sequential read of the big file <= 1.25x native", "x native", 1.25,
         _ratio("seqread-cold")),
    Goal("sequential write with fsync <= 1.5x native", "x native", 1.5, _ratio("seqwrite")),
    Goal("first 4 KiB write into the big snapshot file < 5 ms", "ms", 5, _first_write),
    Goal("snapshot import >= 100 MB/s on incompressible data", "MB/s", 100,
         _extra("import-big", "MB/s"), at_least=True),
    Goal("re-import of an unchanged tree near-free (<= 0.1x the first import)", "x import",
         0.1, _extra("reimport", "share_of_import")),
    Goal("16 executions changing 1% each store <= 1.1x (base + changed bytes)", "x", 1.1,
         _extra("stored-16x1%", "ratio")),
    Goal("daemon RSS < 200 MB with 1000 executions", "MB", 200, _median("rss-1000", MB)),
    Goal("a bystander's stat + create + write + unlink < 50 ms under every hostile case "
         "(issue 15)", "ms", 50, _isolation_worst),
    Goal("daemon heap back to the same baseline after every create + reset cycle: growth "
         "over the first cycle's < 5 MB (issue 15)", "MB", 5, _heap_growth),
]


def goals(report: dict) -> list[dict]:
    """Each goal with its measured ``value`` (None: not measured or not built) and ``met``."""
    out = []
    for g in GOALS:
        found = g.measure(report)
        value, note = found if found else (None, "not measured")
        met = None if value is None else (value >= g.limit if g.at_least else value <= g.limit)
        out.append({"goal": g.text, "value": value, "unit": g.unit, "limit": g.limit,
                    "met": met, "note": note})
    return out


# ----- text ------------------------------------------------------------------------------

def human(value: float, unit: str) -> str:
    """``0.0123, "s"`` -> ``"12.3 ms"``; bytes in MiB; other units as they are."""
    if unit == "s":
        if value < 1:
            return f"{value / MS:.3g} ms"
        return f"{value:.3g} s"
    if unit == "B":
        return f"{value / (1 << 20):.1f} MiB"
    return f"{value:.3g} {unit}"


def table(report: dict) -> str:
    """The results as an aligned text table: workload, system, median, ratio to native,
    derived figures."""
    rows = [("WORKLOAD", "SYSTEM", "MEDIAN", "x NATIVE", "NOTES")]
    for r in report["results"]:
        name = r["workload"] + (f"@{r['files']}" if r["files"] else "")
        notes = ", ".join(f"{k}={_fmt_extra(k, v)}" for k, v in r["extra"].items())
        rows.append((name, r["system"], human(r["median"], r["unit"]),
                     f"{r['ratio']:.2f}" if r["ratio"] else "-", notes))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4]
             for row in rows]
    lines.append("")
    lines.append("GOALS (issues 4 and 15)")
    for g in report["goals"]:
        mark = {True: "met", False: "NOT MET", None: "-"}[g["met"]]
        value = "-" if g["value"] is None else f"{g['value']:.3g} {g['unit']}"
        lines.append(f"  [{mark:7}] {g['goal']}: {value}" + (f" ({g['note']})" if g["note"]
                                                              else ""))
    if report["skipped"]:
        lines.append("")
        lines += [f"skipped {sid}: {why}" for sid, why in report["skipped"].items()]
    lines += [f"skipped {k['workload']} on {k['system']}: {k['reason']}"
              for k in report.get("skipped_workloads", ())]
    lines += [f"ERROR {e['workload']} on {e['system']}: {e['error']}" for e in report["errors"]]
    return "\n".join(line.rstrip() for line in lines)


def markdown(report: dict) -> str:
    """The results as Markdown tables (for docs/benchmarks.md): one row per workload, one
    column per system, each cell the median and, in seconds, its ratio to native; then the
    goals."""
    systems = report["systems"]
    workloads: list[str] = []
    cells: dict[tuple[str, str], str] = {}
    for r in report["results"]:
        name = r["workload"] + (f" @{r['files']:,}" if r["files"] else "")
        if name not in workloads:
            workloads.append(name)
        cell = human(r["median"], r["unit"])
        if r["ratio"] and r["system"] != "native":
            cell += f" ({r['ratio']:.2f}x)"
        cells[name, r["system"]] = cell
    used = [s for s in systems if any((w, s) in cells for w in workloads)]
    lines = ["| workload | " + " | ".join(used) + " |", "|---" * (len(used) + 1) + "|"]
    lines += ["| " + w + " | " + " | ".join(cells.get((w, s), "") for s in used) + " |"
              for w in workloads]
    lines += ["", "| goal | measured | met |", "|---|---|---|"]
    for g in report["goals"]:
        value = "-" if g["value"] is None else f"{g['value']:.3g} {g['unit']}"
        note = f" ({g['note']})" if g["note"] else ""
        met = {True: "yes", False: "**no**", None: "-"}[g["met"]]
        lines.append(f"| {g['goal']} | {value}{note} | {met} |")
    return "\n".join(lines) + "\n"


def _fmt_extra(key: str, value: float | str) -> str:
    if isinstance(value, str):  # what a hostile case's process said
        return repr(value)
    if key.endswith("_bytes"):
        return f"{value / (1 << 20):.1f}MiB" if value >= 1 << 20 else f"{value:.0f}B"
    if isinstance(value, int):  # a count: files hashed, paths scanned
        return str(value)
    return f"{value:.3g}"


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")


# ----- charts ----------------------------------------------------------------------------

RATIO_WORKLOADS = ["git-status", "git-status-untracked-cache", "find-warm", "find-cold",
                   "walk-warm", "walk-cold", "walk-warm-abspath",
                   "read-warm", "read-cold", "read-tar-warm", "seqread-warm", "seqread-cold",
                   "seqwrite", "randwrite-first", "randwrite-1000", "untar", "rm-rf"]
LIFECYCLE_WORKLOADS = ["fork", "reset", "promote", "discard", "promote-big"]


def charts(report: dict, out: Path) -> list[Path]:
    """Draw ratios.png, lifecycle.png and scaling.png into ``out``; return the files written
    ([] when matplotlib is missing)."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    title = (f"{report['tree']['name']} tree, {report['tree']['files']} files, "
             f"{report['machine']['nproc']} cores; median of {report['repeat']}")

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        written.append(out / name)

    def grouped(ax, workloads: list[str], systems: list[str], value: Callable[[dict], float],
                log: bool) -> None:
        width = 0.8 / max(1, len(systems))
        for i, sid in enumerate(systems):
            xs, ys = [], []
            for j, w in enumerate(workloads):
                r = _find(report, w, sid)
                if r is not None and value(r):
                    xs.append(j + i * width)
                    ys.append(value(r))
            ax.bar(xs, ys, width, label=sid, color=COLORS[sid])
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(workloads))])
        ax.set_xticklabels(workloads, rotation=30, ha="right")
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize="small")

    present = {r["workload"] for r in report["results"]}
    workloads = [w for w in RATIO_WORKLOADS if w in present]
    systems = [s for s in ("overlayfs", "fuse-overlayfs", "rametfs") if s in report["systems"]]
    if workloads and systems:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        grouped(ax, workloads, systems, lambda r: r["ratio"], log=True)
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set_ylabel("time / native ext4 (log)")
        ax.set_title(f"I/O workloads as a ratio to native ext4 — {title}", fontsize="medium")
        save(fig, "ratios.png")

    workloads = [w for w in LIFECYCLE_WORKLOADS if w in present]
    systems = [s for s in SYSTEM_ORDER if s != "native" and s in report["systems"]]
    if workloads:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        grouped(ax, workloads, systems, lambda r: r["median"], log=True)
        ax.axhline(5 * MS, color="grey", linestyle="--", linewidth=0.8)
        ax.set_ylabel("seconds (log); dashed: 5 ms")
        ax.set_title(f"Fork, reset, promote, discard — {title}", fontsize="medium")
        save(fig, "lifecycle.png")

    scaled = [r for r in report["results"] if r["workload"].startswith("scale-")]
    if scaled:
        fig, axes = plt.subplots(1, 3, figsize=(12, 4), sharey=True)
        for ax, (op, goal) in zip(axes, (("fork", 5), ("reset", 5), ("promote", 50))):
            for sid in SYSTEM_ORDER:
                points = sorted((r["files"], r["median"]) for r in scaled
                                if r["system"] == sid and r["workload"] == f"scale-{op}")
                if points:
                    ax.plot(*zip(*points), marker="o", label=sid, color=COLORS[sid])
            ax.axhline(goal * MS, color="grey", linestyle="--", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("files in the tree")
            ax.set_title(f"{op} (dashed: {goal} ms goal)", fontsize="medium")
        axes[0].set_ylabel("seconds")
        axes[0].legend(fontsize="small")
        fig.suptitle(f"Scaling with tree size, synthetic small files; "
                     f"{report['machine']['nproc']} cores", fontsize="medium")
        save(fig, "scaling.png")
    return written


# ----- profiles --------------------------------------------------------------------------

def profile_summary(path: Path, top: int = 12) -> dict:
    """Summarise ``py-spy record --format raw`` output (collapsed stacks, ``frame;...;frame
    count`` a line): the share of samples whose innermost frame is each function (``self``)
    and the share that pass through each rametfs or pyfuse3 function (``total``), largest
    first, line numbers dropped."""
    self_counts: dict[str, int] = {}
    total_counts: dict[str, int] = {}
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        n = int(count)
        samples += n
        self_counts[frames[-1]] = self_counts.get(frames[-1], 0) + n
        for f in set(frames):
            if "rametfs/" in f or "pyfuse3" in f:
                total_counts[f] = total_counts.get(f, 0) + n

    def ranked(counts: dict[str, int]) -> list[list]:
        return [[f, round(c / samples, 3)] for f, c in
                sorted(counts.items(), key=lambda kv: -kv[1])[:top]]

    return {"samples": samples, "self": ranked(self_counts), "total": ranked(total_counts)}


def trio_thread_profile(path: Path, rate: float, top: int = 15) -> dict:
    """Where the daemon's trio thread spent its time, from ``py-spy record --threads
    --format raw`` output sampled at ``rate`` per second (idle samples, the loop waiting in
    epoll, are not recorded): ``busy_s``, the seconds it was running; ``self``: the
    innermost frames (with their lines) and their seconds; ``rametfs``: the seconds spent
    in each rametfs function run by the event loop (its own and its callees' time; the
    frames under trio's run loop, the daemon's start-up, left out), largest first.  Any
    work there delays every request of every execution, since the trio thread serves them
    all one at a time."""
    self_counts: dict[str, int] = {}
    total_counts: dict[str, int] = {}
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or not frames[0].endswith(": MainThread"):
            continue
        n = int(count)
        samples += n
        self_counts[frames[-1]] = self_counts.get(frames[-1], 0) + n
        loop = max((i for i, f in enumerate(frames) if "trio/_core/_run.py" in f), default=0)
        for f in {re.sub(r":\d+\)$", ")", f) for f in frames[loop + 1:] if "rametfs/" in f}:
            total_counts[f] = total_counts.get(f, 0) + n

    def ranked(counts: dict[str, int]) -> list[list]:
        return [[f, round(c / rate, 3)] for f, c in
                sorted(counts.items(), key=lambda kv: -kv[1])[:top]]

    return {"busy_s": round(samples / rate, 3), "self": ranked(self_counts),
            "rametfs": ranked(total_counts)}
