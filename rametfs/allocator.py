"""The daemon's memory allocator: jemalloc where it is installed, so that the memory of a
reset or released execution goes back to the system (issue 15.5).

CPython's own allocator, pymalloc, hands a 1 MiB arena back only once every object in it is
gone, and the few objects a burst of requests leaves alive keep the arenas the burst filled:
after 10 cycles of 20,000 files created and reset, the heap stayed 6.9 MiB over the first
reset's (docs/benchmarks.md, "Daemon memory across reset cycles").  jemalloc (Debian's
libjemalloc2) keeps small objects in page-sized slabs of one size each and returns the pages
of freed slabs when asked (the ``arena.<i>.purge`` control, jemalloc(3), "MALLCTL
NAMESPACE"); the same cycles then stay within 2.0 MiB, for the same daemon CPU on an untar,
a cold read and an rm -rf, and 0-6% more wall time on a git checkout (docs/benchmarks.md,
"On jemalloc").

The allocator is fixed when the daemon's interpreter starts: :func:`daemon_environment`
preloads the library (``LD_PRELOAD``, ld.so(8)) and sends every Python object to the C
allocator (``PYTHONMALLOC=malloc``, Python's "Command line and environment"); the daemon
calls :func:`settle` first thing, and :func:`give_back` once a collection has freed many
nodes.  Without the library the daemon keeps pymalloc and gives back what glibc's
``malloc_trim(3)`` can.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Mapping

from .errors import RametError

JEMALLOC, PYMALLOC = "jemalloc", "pymalloc"
CHOICES = ("auto", JEMALLOC, PYMALLOC)  # ``rametfs mount --allocator``
MARK_ENV = "RAMETFS_ALLOCATOR"  # the allocator a daemon's environment was made for
PRELOAD_ENV = "LD_PRELOAD"
ALL_ARENAS = 4096  # MALLCTL_ARENAS_ALL: arena.<i> for every arena at once

_process = ctypes.CDLL(None)
_mallctl = getattr(_process, "mallctl", None)  # jemalloc's, when preloaded
_malloc_trim = getattr(_process, "malloc_trim", None)  # glibc's


def library() -> str | None:
    """jemalloc's shared library name (``libjemalloc.so.2``), None when not installed."""
    return ctypes.util.find_library("jemalloc")


def daemon_environment(environ: Mapping[str, str], choice: str) -> dict[str, str]:
    """The environment a daemon's interpreter starts in for ``choice`` (one of
    :data:`CHOICES`; ``auto``: jemalloc when installed, else pymalloc).

    Raises RametError ENOENT when ``choice`` is jemalloc and it is not installed.
    """
    lib = library() if choice != PYMALLOC else None
    if lib is None:
        if choice == JEMALLOC:
            raise RametError(errno.ENOENT, "--allocator jemalloc: libjemalloc.so.2 is not "
                             "installed (Debian: apt-get install libjemalloc2)")
        return {**environ, MARK_ENV: PYMALLOC}
    preload = " ".join(filter(None, (lib, environ.get(PRELOAD_ENV))))
    return {**environ, PRELOAD_ENV: preload, "PYTHONMALLOC": "malloc", MARK_ENV: JEMALLOC}


def settle() -> str:
    """The allocator this process runs on: :data:`JEMALLOC` when jemalloc is loaded and
    serves Python's objects too, else :data:`PYMALLOC`.  Takes out of ``os.environ`` what
    :func:`daemon_environment` added, so that no program the daemon starts inherits it."""
    objects_from_malloc = os.environ.get("PYTHONMALLOC") == "malloc"
    if os.environ.pop(MARK_ENV, None) == JEMALLOC:
        os.environ.pop("PYTHONMALLOC", None)
        theirs = os.environ.pop(PRELOAD_ENV, "").split(" ", 1)[1:]
        if theirs:
            os.environ[PRELOAD_ENV] = theirs[0]
    return JEMALLOC if _mallctl is not None and objects_from_malloc else PYMALLOC


def give_back() -> None:
    """Return the free pages of the heap to the system: jemalloc's purge of every arena's
    unused dirty pages, else glibc's ``malloc_trim(0)``; a no-op elsewhere.  Blocking (the
    trim holds glibc's arena lock for tens of ms after 100,000 nodes): run it in a worker
    thread."""
    if _mallctl is not None:
        name = f"arena.{ALL_ARENAS}.purge".encode()
        _mallctl(name, None, None, None, ctypes.c_size_t(0))
    elif _malloc_trim is not None:
        _malloc_trim(0)
