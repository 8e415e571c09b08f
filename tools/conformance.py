"""Run two public suites against rametfs executions and the reference file systems.

* fstests (``FSTESTS_DIR``: a checkout built with ``make``), a group of tests (default
  ``generic/quick``) on TEST_DIR only (no scratch device), against
  - ``rametfs``: FSTYP=fuse, FUSE_SUBTYP=.rametfs; TEST_DEV a name, and the source
    directory in ``-o source=``, mounted by the ``mount.fuse.rametfs`` helper
    (tools/conformance_mount.py) as an execution of its snapshot, ``dev,suid`` as the kernel file systems are (``--allow-devices --allow-suid``;
    ``RAMETFS_MOUNT_OPTIONS=nodev,nosuid`` for the daemon's defaults);
  - ``overlay``: kernel overlayfs (``check -overlay``) over ext4 on a loop device;
  - ``fuse-overlayfs``: FSTYP=fuse through a ``mount.fuse.fuse-overlayfs`` helper whose
    layers are directories on the host file system.
* unionmount-testsuite (``UNIONMOUNT_DIR``), ``./run --ov --fuse=<subtype>`` against rametfs
  and fuse-overlayfs, and ``./run --ov`` (kernel overlayfs); ``--ov=0`` too (each test again
  after a remount), whose mount cycles are daemon restarts for rametfs.  A rametfs mount
  cycle is otherwise a new mount of the same execution, the daemon serving on.

Nothing is fetched: the suites are the checkouts named.  fstests runs in a mount namespace of
its own holding only the host's mounts it needs, as fstests finds TEST_DEV by its source and
aborts when another mount has it (every fuse-overlayfs mount is named fuse-overlayfs).  The mount helpers go in /sbin for the
run and are removed after (one already there that is not this run's stops the run).  fstests
finds its TEST_DEV by source (findmnt) and compares the type ``df -T`` shows with FSTYP: the
run gives it a ``df`` that shows every ``fuse.<subtype>`` as ``fuse``, libfuse's type for a
mount without a subtype (its own run instructions, README.fuse, use one).

Results go to ``--out`` (default ``conformance-results/`` here): each run's log, fstests's
results directory, and ``summary.json``, counts and failing tests per run, which
docs/conformance.md reports.  Root only; takes minutes to an hour per run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE_ENV = "RAMETFS_CONFORMANCE_STATE"  # tools/conformance_mount.py's state directory
HELPER_DIR = Path("/sbin")
SYSTEMS = ("rametfs", "overlay", "fuse-overlayfs")
LOOP_IMAGE_BYTES = 4 << 30  # the ext4 image kernel overlayfs runs over (sparse)

DF_SHIM = """#!/bin/sh
# fstests compares df's type with FSTYP=fuse: show fuse.<subtype> as fuse.
exec df "$@" | sed -E 's/^([^ ]+ +)fuse\\.[^ ]+/\\1fuse/'
"""
RAMETFS_HELPER = """#!/bin/sh
# Installed by rametfs tools/conformance for one run; removed after it.
RAMETFS_CONFORMANCE_STATE={state} exec {python} {repo}/tools/conformance_mount.py "$@"
"""
# fuse-overlayfs for fstests (no layers given: they go under BASE/<source name>/), and as
# libfuse's mount.fuse would run it for unionmount-testsuite (the layers in the options).
FUSE_OVERLAYFS_HELPER = """#!/bin/sh
# Installed by rametfs tools/conformance for one run; removed after it.
case "$4" in *lowerdir=*) exec fuse-overlayfs -o "$4" "$2";; esac
base={base}/"$(basename "$1")"
mkdir -p "$base/lower" "$base/upper" "$base/work"
exec fuse-overlayfs -o lowerdir="$base/lower",upperdir="$base/upper",workdir="$base/work" "$2"
"""


def say(text: str) -> None:
    print(f"tools/conformance: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def helpers(scripts: dict[str, str]):
    """Install ``scripts`` (name -> text) in /sbin for the block, then remove them."""
    made = []
    try:
        for name, text in scripts.items():
            path = HELPER_DIR / name
            if path.exists():
                sys.exit(f"tools/conformance: {path} exists and is not this run's: "
                         f"remove it first")
            path.write_text(text)
            path.chmod(0o755)
            made.append(path)
        yield
    finally:
        for path in made:
            path.unlink(missing_ok=True)


def fstests_results(log: str) -> dict:
    """Counts and names from fstests's summary lines: ``Ran:`` (every test tried, those not
    run included), ``Not run:``, ``Failures:``."""
    def names(label: str) -> list[str]:
        found = re.findall(rf"^{label}:(.*)$", log, re.M)
        return sorted(set(" ".join(found).split()))
    tried, failed, not_run = names("Ran"), names("Failures"), names("Not run")
    return {"ran": len(tried) - len(not_run), "passed": len(tried) - len(not_run) - len(failed),
            "failed": len(failed), "not_run": len(not_run), "failures": failed,
            "not_run_tests": not_run}


def run_logged(argv: list[str], log: Path, cwd: Path, env: dict) -> tuple[int, str]:
    """Run ``argv`` with its output to ``log``; its exit status and the log's text."""
    say(f"{' '.join(map(str, argv))} (in {cwd}), log {log}")
    start = time.monotonic()
    with open(log, "w", buffering=1) as out:  # line by line: a long run can be followed
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        for line in proc.stdout:
            out.write(line)
        proc.wait()
    say(f"done in {time.monotonic() - start:.0f} s (exit {proc.returncode})")
    return proc.returncode, log.read_text(errors="replace")


def stop_daemons(work: Path) -> None:
    """End the daemons the rametfs mount helper started (each in its namespace)."""
    subprocess.run([sys.executable, REPO / "tools" / "conformance_mount.py", "--stop"],
                   env={**os.environ, STATE_ENV: str(work / "state")},
                   check=True)


def fstests(system: str, tests: list[str], work: Path, out: Path) -> dict:
    src = Path(os.environ["FSTESTS_DIR"]).resolve()
    base = work / f"fstests-{system}"
    base.mkdir()
    test_dir = base / "test"
    test_dir.mkdir()
    shim = work / "df"
    config = {"TEST_DIR": test_dir, "DF_PROG": f"{shim} -T -P"}
    loop = None
    if system == "rametfs":
        source = base / "source"
        source.mkdir(mode=0o755)
        # TEST_DEV is a name, not a path: umount(8) takes an existing path for a mountpoint.
        options = ",".join(filter(None, [f"source={source}",
                                         os.environ.get("RAMETFS_MOUNT_OPTIONS")]))
        config |= {"FSTYP": "fuse", "FUSE_SUBTYP": ".rametfs", "TEST_DEV": f"rametfs-{work.name}",
                   "TEST_FS_MOUNT_OPTS": f"-o {options}"}
    elif system == "fuse-overlayfs":
        config |= {"FSTYP": "fuse", "FUSE_SUBTYP": ".fuse-overlayfs",
                   "TEST_DEV": "fuse-overlayfs"}
    else:  # kernel overlayfs over ext4 on a loop device (check -overlay)
        image = base / "ext4.img"
        with open(image, "wb") as f:
            f.truncate(LOOP_IMAGE_BYTES)
        subprocess.run(["mkfs.ext4", "-q", "-F", image], check=True)
        loop = subprocess.run(["losetup", "--find", "--show", image], check=True,
                              capture_output=True, text=True).stdout.strip()
        config |= {"FSTYP": "ext4", "TEST_DEV": loop}
    (base / "local.config").write_text(
        "".join(f'export {k}="{v}"\n' for k, v in config.items()))
    results = out / f"fstests-{system}"
    env = {**os.environ, "HOST_OPTIONS": str(base / "local.config"),
           "RESULT_BASE": str(results)}
    argv = [sys.executable, REPO / "tools" / "conformance_mount.py", "--isolated", "./check"] \
        + ["-overlay"] * (system == "overlay") + tests
    env[STATE_ENV] = str(work / "state")
    try:
        _, log = run_logged(argv, out / f"fstests-{system}.log", src, env)
    finally:
        for mnt in (test_dir / "ovl-mnt", test_dir):
            subprocess.run(["umount", "-l", mnt], capture_output=True)
        if system == "rametfs":
            stop_daemons(work)
        if loop is not None:
            subprocess.run(["umount", "-l", loop], capture_output=True)
            subprocess.run(["losetup", "-d", loop], capture_output=True)
    return fstests_results(log)


def unionmount_results(status: int, log: str) -> dict:
    """Counts from unionmount-testsuite's output: it names each test as it starts
    (``*** ./run --ov ... <test>``) and stops at the first failure, exiting non-zero."""
    tests = re.findall(r"^\*\*\* (\./run .+)$", log, re.M)
    failed = status != 0 and bool(tests)
    last = log.rstrip().splitlines()[-1] if log.strip() else ""
    return {"ran": len(tests), "passed": len(tests) - failed, "failed": int(failed),
            "failures": [f"{tests[-1].split()[-1]}: {last}"] if failed else []}


def unionmount(system: str, recycle: bool, work: Path, out: Path) -> dict:
    src = Path(os.environ["UNIONMOUNT_DIR"]).resolve()
    name = f"unionmount-{system}{'-ov0' if recycle else ''}"
    base = work / name
    mnt = base / "mnt"
    mnt.mkdir(parents=True)
    env = {**os.environ, "UNIONMOUNT_BASEDIR": str(base), "UNIONMOUNT_MNTPOINT": str(mnt),
           "PYTHONDONTWRITEBYTECODE": "1",  # --ov=0: every mount of rametfs restarts it
           "RAMETFS_CONFORMANCE_CYCLE": "restart" if recycle else "rebind"}
    argv = ["./run", "--ov=0" if recycle else "--ov"]
    argv += [] if system == "overlay" else [f"--fuse={system}"]
    try:
        status, log = run_logged(argv, out / f"{name}.log", src, env)
    finally:  # the suite leaves a last union mounted "for further playing"
        subprocess.run(["umount", "-l", mnt], capture_output=True)
        if system == "rametfs":
            stop_daemons(work)
    return unionmount_results(status, log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=("fstests", "unionmount", "both"), default="both")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated, of {', '.join(SYSTEMS)} (default: all)")
    parser.add_argument("--tests", default="-g generic/quick",
                        help="fstests's selection (default: -g generic/quick)")
    parser.add_argument("--out", type=Path, default=REPO / "conformance-results")
    args = parser.parse_args()
    systems = args.systems.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    if os.geteuid() != 0:
        sys.exit("tools/conformance: run it as root (the suites mount file systems)")
    suites = ("fstests", "unionmount") if args.suite == "both" else (args.suite,)
    for suite, var, marker in (("fstests", "FSTESTS_DIR", "ltp/fsstress"),
                               ("unionmount", "UNIONMOUNT_DIR", "run")):
        if suite in suites and not (Path(os.environ.get(var, "/nonexistent")) / marker).exists():
            sys.exit(f"tools/conformance: set {var} to a checkout of {suite}"
                     + (" built with make" if suite == "fstests" else ""))
    if "fuse-overlayfs" in systems and shutil.which("fuse-overlayfs") is None:
        say("fuse-overlayfs is not installed: its runs are left out")
        systems.remove("fuse-overlayfs")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rametfs-conformance-", dir="/tmp"))
    work.chmod(0o755)  # fstests runs some steps as other users
    (work / "df").write_text(DF_SHIM)
    (work / "df").chmod(0o755)
    scripts = {"mount.fuse.rametfs": RAMETFS_HELPER.format(
                   state=work / "state", python=sys.executable, repo=REPO)} \
        if "rametfs" in systems else {}
    if "fuse-overlayfs" in systems:
        scripts["mount.fuse.fuse-overlayfs"] = FUSE_OVERLAYFS_HELPER.format(base=work / "fo")
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    try:
        with helpers(scripts):
            for system in systems:
                if "fstests" in suites:
                    summary[f"fstests {system}"] = fstests(system, args.tests.split(), work,
                                                           args.out)
                if "unionmount" in suites:
                    for recycle in (False, True):
                        key = f"unionmount {system}{' --ov=0' if recycle else ''}"
                        summary[key] = unionmount(system, recycle, work, args.out)
                summary_path.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for key, counts in sorted(summary.items()):
        print(f"{key}: {counts['passed']} passed, {counts['failed']} failed"
              + (f", {counts['not_run']} not run" if "not_run" in counts else ""))


if __name__ == "__main__":
    main()
