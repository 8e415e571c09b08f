"""Count and time the FUSE requests an action sends, from the kernel's own tracepoints.

Recent kernels have ``fuse:fuse_request_send`` and ``fuse:fuse_request_end`` (fs/fuse/fuse_trace.h):
one event when the kernel queues a request for the daemon (its opcode), one when the reply
arrives.  :class:`FuseTrace` records them in a tracefs instance of its own (the global trace
buffer is left alone), for one FUSE connection only, and pairs them by the request's unique id:
the count of each opcode and the time from queueing to reply (µs), which is what the calling
process waits for.  Root only; tracefs is mounted at /sys/kernel/tracing if it is not, and
unmounted again.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .systems import Unsupported
from .trees import BenchError

TRACEFS = Path("/sys/kernel/tracing")
EVENTS = ("fuse_request_send", "fuse_request_end")
BUFFER_KB = 65536  # per CPU: about 700,000 events, far more than a workload sends
_EVENT = re.compile(r" (\d+\.\d+): fuse_request_(send|end): connection \d+ req (\d+)"
                    r"(?: opcode \d+ \(FUSE_(\w+)\))?")


@dataclass
class Requests:
    """What one traced action sent: ``counts[opcode]`` requests (``GETATTR``, ``WRITE``...)
    and ``latency_us[opcode]``, each request's time from queueing to reply (µs); requests
    the daemon never answers (FORGET) have no latency."""

    counts: Counter
    latency_us: dict[str, list[float]]

    def per(self, units: int) -> dict[str, float]:
        """Requests of each opcode per unit (file, MiB), most frequent first, and their sum as
        ``total``."""
        out = {op: n / units for op, n in self.counts.most_common()}
        out["total"] = sum(self.counts.values()) / units
        return out

    def median_us(self) -> dict[str, float]:
        """The median latency of each answered opcode (µs), keyed ``<opcode>_us``."""
        return {f"{op}_us": statistics.median(v) for op, v in self.latency_us.items()}

    def waited_us(self, units: int) -> float:
        """The time from queueing to reply summed over every request, per unit (µs): what
        the calling process waited for the daemon when it sends one request at a time."""
        return sum(sum(v) for v in self.latency_us.values()) / units


def parse(text: str) -> Requests:
    """Pair the send and end events of a tracefs ``trace`` file by request id."""
    counts: Counter = Counter()
    sent: dict[str, tuple[float, str]] = {}
    latency: dict[str, list[float]] = defaultdict(list)
    for m in _EVENT.finditer(text):
        at, kind, unique, opcode = float(m[1]), m[2], m[3], m[4]
        if kind == "send":
            counts[opcode] += 1
            sent[unique] = (at, opcode)
        elif unique in sent:
            start, opcode = sent.pop(unique)
            latency[opcode].append((at - start) * 1e6)
    return Requests(counts, dict(latency))


class FuseTrace:
    """A tracefs instance recording the FUSE requests of the mount at ``mountpoint``.

    Raises :class:`Unsupported` without root or without the tracepoints (older kernels);
    :meth:`run` raises BenchError when the buffer overflowed (events lost)."""

    def __init__(self, mountpoint: Path, name: str | None = None):
        self.mountpoint = mountpoint
        # One instance per process: benchmarks run at the same time must not share one.
        self.name = name or f"rametfs-bench-{os.getpid()}"
        self.mounted_tracefs = False
        self.instance: Path | None = None

    def __enter__(self) -> FuseTrace:
        if os.geteuid() != 0:
            raise Unsupported("tracing FUSE requests needs root")
        if not (TRACEFS / "events").is_dir():
            done = subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise Unsupported(f"tracefs: {done.stderr.strip()}")
            self.mounted_tracefs = True
        try:
            if not (TRACEFS / "events" / "fuse" / EVENTS[0]).is_dir():
                raise Unsupported("this kernel has no fuse request tracepoints")
            self.instance = TRACEFS / "instances" / self.name
            self.instance.mkdir()
            (self.instance / "buffer_size_kb").write_text(str(BUFFER_KB))
            dev = os.stat(self.mountpoint).st_dev
            connection = os.major(dev) << 20 | os.minor(dev)  # the kernel's dev_t
            for event in EVENTS:
                path = self.instance / "events" / "fuse" / event
                (path / "filter").write_text(f"connection == {connection}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def run(self, action: Callable[[], object]) -> Requests:
        """Trace the requests sent while ``action()`` runs."""
        assert self.instance is not None
        (self.instance / "trace").write_text("")
        for event in EVENTS:
            (self.instance / "events" / "fuse" / event / "enable").write_text("1")
        try:
            action()
        finally:
            for event in EVENTS:
                (self.instance / "events" / "fuse" / event / "enable").write_text("0")
        text = (self.instance / "trace").read_text()
        written = re.search(r"entries-in-buffer/entries-written: (\d+)/(\d+)", text)
        if written is None or written[1] != written[2]:
            raise BenchError(f"the trace buffer lost events ({written and written[0]})")
        return parse(text)

    def __exit__(self, *exc) -> None:
        if self.instance is not None and self.instance.exists():
            self.instance.rmdir()
        if self.mounted_tracefs:
            subprocess.run(["umount", str(TRACEFS)], check=False)
