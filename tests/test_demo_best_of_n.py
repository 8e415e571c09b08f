"""tools/demo-best-of-n: four sandboxed attempts, the exact table, the winner restored.

Runs the demo's program (tools/setup has run: this is the suite's interpreter) in a work
directory of the test's own, so the test can check that nothing is left mounted there; under
bubblewrap, and in Docker containers of the dockerd the demo starts there itself.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from conftest import containers, require_bwrap, require_container_engine, require_fuse, run

ROOT = Path(__file__).resolve().parent.parent
ID = re.compile(r"[0-9a-f]{64}")


@pytest.mark.parametrize("runtime", ["bubblewrap", "docker"])
def test_best_of_n_promotes_the_right_fix_and_restores_it(tmp_path, runtime):
    require_fuse()
    if runtime == "bubblewrap":
        require_bwrap()
    else:
        require_container_engine(runtime)
    work, out = tmp_path / "work", tmp_path / "outcome.json"
    done = run(sys.executable, ROOT / "tools" / "demo_best_of_n.py", "--workdir", work,
               "--json", out, "--runtime", runtime)
    outcome = json.loads(out.read_text())
    assert outcome["runtime"] == runtime
    rows = outcome["rows"]
    assert [(r["attempt"], r["passed"]) for r in rows] == [
        ("right-fix", "5/5"), ("wrong-fix", "4/5"), ("breaks-mean", "3/5"), ("timeout", None)]
    winner = rows[0]["snapshot"]
    assert ID.fullmatch(winner) and [r["snapshot"] for r in rows[1:]] == [None] * 3
    # killed at its 2 s timeout; a container's creation and removal count too
    assert 2.0 <= rows[3]["seconds"] < (5 if runtime == "bubblewrap" else 15)
    assert outcome["ok"] and outcome["restored"] == {"files": outcome["restored"]["files"],
                                                     "identical": True, "tests": "5/5"}
    assert outcome["restored"]["files"] > 10  # stats.py, test_stats.py and .git
    lines = done.stdout.splitlines()
    table = lines[lines.index("ATTEMPT      TESTS PASSED SECONDS  SNAPSHOT"):][:5]
    seconds = r" +\d+\.\d\d  "
    assert [re.sub(seconds, " | ", line) for line in table] == [
        "ATTEMPT      TESTS PASSED SECONDS  SNAPSHOT",
        "right-fix    5/5 | " + winner[:12] + " (promoted)",
        "wrong-fix    4/5 | - (reset)",
        "breaks-mean  3/5 | - (reset)",
        "timeout      timed out | - (reset)"]
    assert not os.path.ismount(work / "mnt")
    if runtime == "docker":  # the demo's dockerd is gone, and everything it mounted
        engine = containers.Dockerd(work / "docker")
        assert engine.pid is None and not os.path.exists(engine.exec_root)
        assert engine.mounts() == [] and not (work / "docker" / "data").exists()
