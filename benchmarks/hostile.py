"""The parts of the isolation workload (issue 15.3): a bystander probe that runs in one
execution while hostile cases run in another, and the cases themselves.

The probe is a process of its own (``python -c PROBE``), so neither the benchmark's GIL nor
its waits delay it.  Every :data:`PROBE_INTERVAL_S` it times one round of what any agent does
all the time: ``stat`` of a file of the base, create + write 4 KiB + close of a new file,
unlink of it; and prints ``<start> <seconds>`` (``time.monotonic``, the same clock in every
process) per round.  :class:`Probe` gathers the lines in a thread.

Each hostile case is a plain process (``sh -c``, ``python -c``) started in the hostile
execution's directory, or a harness command on it (checkpoint, promote, reset); its
``outcome`` is what the process said (the errno a limit answers with, a count).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .trees import BenchError

PROBE_INTERVAL_S = 0.005
PROBE_BYTES = 4096
MIN_PROBES = 100  # a repeatable case runs again until this many probes started during it
STOP_SECONDS = 30.0

PROBE = r"""
import os, signal, sys, time
root, target, interval, size = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
block = b"p" * size
name = f"{root}/probe-{os.getpid()}"
while not stop:
    start = time.monotonic()
    os.stat(f"{root}/{target}")
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, block)
    os.close(fd)
    os.unlink(name)
    print(f"{start:.6f} {time.monotonic() - start:.6f}", flush=True)
    time.sleep(interval)
"""


class Probe:
    """The bystander: :data:`PROBE` running in ``root`` (a view), ``target`` the file it
    stats (relative to ``root``).  Use as a context manager; :meth:`latencies` gives the
    seconds of the rounds that started in a time window."""

    def __init__(self, root: Path, target: str):
        self.samples: list[tuple[float, float]] = []  # (start, seconds)
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, str(root), target, str(PROBE_INTERVAL_S),
             str(PROBE_BYTES)],
            cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            start, seconds = line.split()
            with self.lock:
                self.samples.append((float(start), float(seconds)))

    def __enter__(self) -> "Probe":
        self.wait_for(time.monotonic(), 1)  # started, and its first round went through
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def count(self, since: float) -> int:
        """Rounds that started at or after ``since``."""
        with self.lock:
            return sum(1 for start, _ in self.samples if start >= since)

    def wait_for(self, since: float, count: int) -> None:
        """Wait until ``count`` rounds started at or after ``since`` are in.  Raises
        BenchError when the probe exits (an operation failed: its traceback) or stalls for
        :data:`STOP_SECONDS`."""
        deadline = time.monotonic() + STOP_SECONDS
        while self.count(since) < count:
            if self.proc.poll() is not None:
                raise BenchError(f"the probe exited {self.proc.returncode}: "
                                 f"{self.proc.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise BenchError(f"no probe round came back in {STOP_SECONDS:.0f} s")
            time.sleep(PROBE_INTERVAL_S)

    def latencies(self, since: float, until: float) -> list[float]:
        """Seconds of each round that started in ``[since, until]``."""
        with self.lock:
            return [seconds for start, seconds in self.samples if since <= start <= until]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(timeout=STOP_SECONDS)
        self.proc.stdout.close()
        self.proc.stderr.close()


def shell(cwd: Path, script: str, *, ok: bool = False) -> str:
    """Run ``sh -c script`` in ``cwd``; return its last line of output (stdout, else
    stderr), as the case's outcome.  ``ok``: raise BenchError unless it exits 0."""
    done = subprocess.run(["sh", "-c", script], cwd=cwd, capture_output=True, text=True)
    if ok and done.returncode != 0:
        raise BenchError(f"{script!r} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    lines = (done.stdout.strip() or done.stderr.strip()).splitlines()
    return lines[-1] if lines else f"exit {done.returncode}"


def python(cwd: Path, code: str, *args: object) -> str:
    """Run ``python -c code args...`` in ``cwd``; its last line of stdout (the script
    prints its outcome).  Raises BenchError when it fails."""
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchError(f"python -c exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


# The hostile processes written in Python; each prints its outcome on its last line.

CREATE_FILES = r"""
import os, sys, time
directory, count = sys.argv[1], int(sys.argv[2])
os.makedirs(directory, exist_ok=True)
block = b"x" * 100
start = time.monotonic()
for i in range(count):
    fd = os.open(f"{directory}/f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, block)
    os.close(fd)
print(f"{count} files in {time.monotonic() - start:.1f} s")
"""

SETXATTRS = r"""
import errno, os, sys
path, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
open(path, "wb").close()
value = os.urandom(size)
done, refused = 0, {}
for i in range(count):
    try:
        os.setxattr(path, f"user.hostile{i}", value)
        done += 1
    except OSError as exc:
        refused[errno.errorcode[exc.errno]] = refused.get(errno.errorcode[exc.errno], 0) + 1
print(f"{done} set, refused: " + ", ".join(f"{n} {name}" for name, n in refused.items()))
"""

WRITE_FLOOD = r"""
import os, sys, time
path, seconds, wrap = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
block = os.urandom(1 << 20)
fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
end = time.monotonic() + seconds
written = 0
while time.monotonic() < end:
    os.pwrite(fd, block, written % wrap)
    written += len(block)
os.close(fd)
print(written)
"""


def write_flood(cwd: Path, writers: int, seconds: float, wrap: int) -> str:
    """``writers`` processes writing 1 MiB blocks to a file each for ``seconds``, each
    file kept below ``wrap`` bytes (the writes go round); returns what they wrote."""
    procs = [subprocess.Popen([sys.executable, "-c", WRITE_FLOOD, f"flood-{i}", str(seconds),
                               str(wrap)], cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(writers)]
    total = 0
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise BenchError(f"a writer exited {proc.returncode}: {err.strip()[-2000:]}")
        total += int(out)
    return f"{writers} writers, {total >> 20} MiB in {seconds:g} s"


def upper_layers(data: Path) -> set[str]:
    """The layer directories under ``<data>/upper`` (numbers; ``precreated`` is not one)."""
    return {e.name for e in os.scandir(data / "upper") if e.name.isdigit()}


def layer_of(data: Path, written: Path) -> str:
    """The layer directory under ``<data>/upper`` holding the upper data file of
    ``written``, a file with data in an execution (the data file is named by its inode
    number).  Raises BenchError when there is none."""
    name = str(os.stat(written).st_ino)
    for layer in upper_layers(data):
        if os.path.exists(data / "upper" / layer / name):
            return layer
    raise BenchError(f"no upper data file for {written}")


def wait_collected(data: Path, layers: set[str], timeout: float = 600.0) -> float:
    """Wait until the daemon's background collection removed the directories of
    ``layers`` (dropped by a reset or release); returns the seconds waited.  Raises
    BenchError after ``timeout``."""
    start = time.monotonic()
    while upper_layers(data) & layers:
        if time.monotonic() - start > timeout:
            raise BenchError(f"layers {sorted(upper_layers(data) & layers)} not collected "
                             f"after {timeout:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - start
