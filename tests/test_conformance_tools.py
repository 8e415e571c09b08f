"""tools/conformance_mount.py: what the commands of the public suites tools/conformance runs
(docs/conformance.md, "fstests and unionmount-testsuite") get from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parent.parent / "tools" / "conformance_mount.py"


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs CAP_SYS_ADMIN")
def test_isolated_commands_get_a_shells_sigpipe_and_sigxfsz(tmp_path):
    """fstests runs under ``--isolated``, and its tests count on the default dispositions:
    generic/591's writer to a pipe whose reader has gone must die of SIGPIPE (not print
    "Broken pipe"), generic/394's write past ``ulimit -f`` of SIGXFSZ.  Python ignores both,
    and an exec keeps an ignored signal ignored."""
    script = ("set -o pipefail; ulimit -c 0; yes | head -c 1 >/dev/null; echo pipe $?; "
              "ulimit -f 1; head -c 4096 /dev/zero >big; echo fsize $?")
    done = subprocess.run([sys.executable, HELPER, "--isolated", "bash", "-c", script],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAMETFS_CONFORMANCE_STATE": str(tmp_path / "s")})
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"pipe {128 + 13}\nfsize {128 + 25}\n"  # SIGPIPE, SIGXFSZ
    assert "Broken pipe" not in done.stderr  # what yes(1) says on EPIPE
    assert "File size limit exceeded" in done.stderr  # bash on its child's SIGXFSZ
    assert "File too large" not in done.stderr  # what head(1) says on EFBIG
