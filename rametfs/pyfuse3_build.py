"""Build pyfuse3 with this project's open-less patch into a Python environment.

``rametfs build-pyfuse3`` runs it for the Python rametfs runs on; ``tools/setup`` runs this
file by path (``.venv/bin/python rametfs/pyfuse3_build.py``) before rametfs is installed, so
that pip keeps the patched build.  It imports only the standard library.

The steps, one line each as they start: download the pyfuse3 :data:`VERSION` source
distribution (``pip download --no-binary :all:``, from the package index pip is set up
with), unpack it, apply ``pyfuse3-open-less.patch`` (``git apply``; what it changes:
tools/pyfuse3/README.md) and remove the shipped ``__init__.c`` so that Cython regenerates
it, ``pip install`` the result into the target Python, and check that the installed pyfuse3
has the whole patch (``FileInfo.cache_readdir``, ``Operations.fallocate``,
``Operations.lseek``, ``Operations.tmpfile``, ``handles_killpriv_v2``,
``Operations.enable_async_dio``, ``Operations.dont_mask`` and the session loop's
``_Resumed``: a build of an older patch lacks the later ones).  The build needs a C
compiler, the target Python's headers and libfuse3's (Debian: ``gcc python3-dev
libfuse3-dev pkg-config``); pip fetches Cython and setuptools for it.  About a minute on 2
cores.

A standard ``pip install rametfs`` cannot do this itself: pip builds each distribution from
its own source with its own build backend, so rametfs's build has no say in how pyfuse3 is
built, and nothing fetched may be shipped in rametfs (no copy of pyfuse3's source).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

VERSION = "3.5.0"  # the pyfuse3 release the patch applies to
PATCH = Path(__file__).with_name("pyfuse3-open-less.patch")
OUTPUT_LINES = 20  # of a failed step's output shown
HAS_PATCH = ("import pyfuse3, sys; "
             "sys.exit(0 if hasattr(pyfuse3.FileInfo(), 'cache_readdir') and "
             "hasattr(pyfuse3.Operations, 'fallocate') and "
             "hasattr(pyfuse3.Operations, 'lseek') and "
             "hasattr(pyfuse3.Operations, 'tmpfile') and "
             "hasattr(pyfuse3, 'handles_killpriv_v2') and "
             "hasattr(pyfuse3.Operations, 'enable_async_dio') and "
             "hasattr(pyfuse3.Operations, 'dont_mask') and "
             "hasattr(pyfuse3, '_Resumed') else 1)")


class BuildError(Exception):
    """A step failed; the message says which, why, and the end of its output."""


def has_patch(python: str = sys.executable) -> bool:
    """Whether the pyfuse3 that ``python`` imports is a patched one."""
    return subprocess.run([python, "-c", HAS_PATCH], capture_output=True).returncode == 0


def missing_tools(python: str = sys.executable) -> list[str]:
    """What the build lacks on this host, as Debian package names: a C compiler, git,
    libfuse3's headers (found by pkg-config), the target Python's headers."""
    missing = [pkg for pkg, cmd in (("gcc", "cc"), ("git", "git"), ("pkg-config", "pkg-config"))
               if shutil.which(cmd) is None]
    if shutil.which("pkg-config") and subprocess.run(["pkg-config", "--exists", "fuse3"]
                                                     ).returncode != 0:
        missing.append("libfuse3-dev")
    include = subprocess.run([python, "-c", "import sysconfig; "
                              "print(sysconfig.get_paths()['include'])"],
                             capture_output=True, text=True).stdout.strip()
    if not include or not os.path.exists(os.path.join(include, "Python.h")):
        missing.append("python3-dev")
    return missing


def _run(step: str, argv: list[str], cwd: str | None = None,
         env: dict[str, str] | None = None) -> None:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          errors="replace")
    if done.returncode != 0:
        lines = [line for line in (done.stdout + done.stderr).splitlines()
                 if not line.startswith("WARNING: Location")]  # pip's noise about indexes
        raise BuildError(f"{step} failed ({' '.join(argv[:4])} ... exited "
                         f"{done.returncode}):\n" + "\n".join(lines[-OUTPUT_LINES:]))


def build(python: str = sys.executable, say: Callable[[str], None] = print) -> float:
    """Build the patched pyfuse3 and install it into ``python``'s environment, replacing
    the pyfuse3 there; ``say`` gets one line per step.  Returns the seconds taken.  Raises
    BuildError when a tool is missing or a step fails."""
    started = time.monotonic()
    missing = missing_tools(python)
    if missing:
        raise BuildError(f"the build needs {', '.join(missing)} (Debian: apt-get install "
                         f"{' '.join(missing)})")
    with tempfile.TemporaryDirectory(prefix="rametfs-pyfuse3-") as tmp:
        say(f"downloading the {VERSION} source")
        _run("download", [python, "-m", "pip", "download", "-q", "--no-deps",
                          "--no-binary", ":all:", "-d", tmp, f"pyfuse3=={VERSION}"])
        say("unpacking it and applying the open-less patch")
        with tarfile.open(os.path.join(tmp, f"pyfuse3-{VERSION}.tar.gz")) as tar:
            tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter")
                                   else {}))
        src = os.path.join(tmp, f"pyfuse3-{VERSION}")
        # Not inside any repository the temporary directory may be in: git apply then
        # patches the working directory, as patch(1) does.
        _run("patch", ["git", "apply", str(PATCH)], cwd=src,
             env={**os.environ, "GIT_CEILING_DIRECTORIES": tmp})
        os.unlink(os.path.join(src, "src", "pyfuse3", "__init__.c"))  # Cython makes it anew
        say("building and installing it (about a minute)")
        _run("build", [python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                       src])
    if not has_patch(python):
        raise BuildError(f"the pyfuse3 {python} imports has no open-less patch after the "
                         "install (another pyfuse3 earlier on its path?)")
    return time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    """``python pyfuse3_build.py [--python PYTHON] [--prefix TEXT]``: build into PYTHON's
    environment (default: this one); exit 1 on failure, with the reason on stderr."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable,
                        help="the Python to install into (default: this one)")
    parser.add_argument("--prefix", default="pyfuse3: ", help="what each line starts with")
    args = parser.parse_args(argv)
    try:
        seconds = build(args.python, lambda line: print(args.prefix + line, file=sys.stderr,
                                                        flush=True))
    except BuildError as exc:
        print(f"{args.prefix}{exc}", file=sys.stderr)
        return 1
    print(f"{args.prefix}installed with the open-less patch in {seconds:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
