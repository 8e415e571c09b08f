"""``python -m benchmarks``: run the suite, print the table, write the JSON and the charts."""

from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path

import click

from . import report as rep
from .agent_inputs import default_cache
from .runner import run
from .systems import SYSTEMS
from .trees import SIZES
from .workloads import ISOLATION_CASES, WORKLOADS


def _names(value: str | None) -> list[str] | None:
    return [n.strip() for n in value.split(",") if n.strip()] if value else None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--size", type=click.Choice(list(SIZES)), default="small", show_default=True,
              help="smoke: a few hundred synthetic files; small: the library directory "
                   "without site-packages, 256 MiB big file; full: all of it, 1 GiB.")
@click.option("--repeat", type=click.IntRange(1), default=3, show_default=True,
              help="Timed runs per figure; the table shows medians.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              default=Path("bench-results"), show_default=True,
              help="Directory for results.json and the PNG charts.")
@click.option("--only", help=f"Comma-separated workloads (default all): {', '.join(WORKLOADS)}.")
@click.option("--systems", help=f"Comma-separated systems (default all available): "
                                f"{', '.join(SYSTEMS)}.")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path),
              default=Path(tempfile.gettempdir()), show_default=True,
              help="Where the scratch directory goes: the disk being measured.")
@click.option("--scale-1m", is_flag=True, help="Add a 1,000,000-file tree to the scaling.")
@click.option("--gc-promotes", type=click.IntRange(1),
              help="Promotes of the gc workload (default: 20, 200, 1,000 by size).")
@click.option("--profile", "profile_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Profile the rametfs daemon with py-spy during extra runs of git-status, "
                   "find-warm, walk-warm, read-warm, seqread-warm, and during each "
                   "isolation case; collapsed stacks go here.")
@click.option("--many-files", type=click.IntRange(1), metavar="N",
              help="Files of the isolation and rss-cycles workloads (default by size: "
                   "isolation 1,000 / 20,000 / 200,000, rss-cycles 500 / 20,000 / 100,000).")
@click.option("--isolation-cases", metavar="C,...",
              help=f"Comma-separated cases of the isolation workload (default all): "
                   f"{', '.join(ISOLATION_CASES)}.")
@click.option("--cache", type=click.Path(file_okay=False, path_type=Path),
              default=default_cache(), show_default=True,
              help="Where the agent workloads keep what they download (Django sdists, "
                   "wheels, npm's cache) and the repository built from it; kept across runs.")
@click.option("--load", is_flag=True,
              help="Run the agent workloads beside a CPU-bound process per core; their "
                   "names end in -loaded.")
def main(size: str, repeat: int, out: Path, only: str | None, systems: str | None,
         workdir: Path, scale_1m: bool, profile_dir: Path | None,
         many_files: int | None, gc_promotes: int | None, isolation_cases: str | None,
         cache: Path, load: bool) -> None:
    """Benchmark rametfs against native ext4, overlayfs, fuse-overlayfs, cp -a and
    git worktree (issue 4), and against its own fallback mode (issue 7).  Needs root for
    overlayfs, the xfs image of fallback-reflink and the cold runs."""
    # SIGTERM unwinds like an error, so every daemon and mount the run made is taken down.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        report = run(size, repeat, _names(only), _names(systems), workdir.resolve(),
                     scale_1m=scale_1m, profile_dir=profile_dir, many_files=many_files,
                     gc_promotes=gc_promotes, cache=cache.resolve(), load=load,
                     isolation_cases=_names(isolation_cases))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    rep.add_ratios(report)
    report["goals"] = rep.goals(report)
    out.mkdir(parents=True, exist_ok=True)
    report["charts"] = [p.name for p in rep.charts(report, out)]
    rep.write_json(report, out / "results.json")
    (out / "results.md").write_text(rep.markdown(report))
    click.echo(rep.table(report))
    click.echo(f"\nwrote {out / 'results.json'}, results.md"
               + (f" and {', '.join(report['charts'])}" if report["charts"]
                  else " (no charts: matplotlib is not installed)"))
    if report["errors"]:
        sys.exit(1)


main(prog_name="python -m benchmarks")
