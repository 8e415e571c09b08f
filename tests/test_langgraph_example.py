"""examples/langgraph_thread.py: the snapshot id lives in LangGraph's SQLite checkpoint, and a
new process, after a daemon restart, resumes the workspace from it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import run

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "langgraph_thread.py"


def test_a_new_process_resumes_the_workspace_from_the_checkpoint(daemon, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "notes.txt").write_text("base\n")
    db = tmp_path / "thread.sqlite"

    def example(*args: str) -> dict:
        done = run(sys.executable, EXAMPLE, "--mount", daemon.mnt, "--db", db,
                   "--thread", "t1", *args)
        return json.loads(done.stdout)

    first = example("start", str(src), "first")
    assert first["notes"] == "base\nfirst\n"
    daemon.restart()
    second = example("resume", "second")
    assert second["resumed_from"] == first["snapshot"]
    assert second["notes"] == "base\nfirst\nsecond\n"
    assert second["snapshot"] not in (first["snapshot"], first["resumed_from"])
    assert (daemon.snap_path(second["snapshot"]) / "notes.txt").read_text() == second["notes"]
    assert daemon.status()["executions"] == []  # every node released its workspace
