"""A LangGraph thread whose workspace is a rametfs snapshot id in the checkpointed state.

The graph has one deterministic node, ``work`` (no model): it opens a workspace from the
snapshot id in the state (a fresh execution of it), appends the state's ``task`` to
``notes.txt``, promotes, releases the execution, and puts the new snapshot id in the state.
The state is checkpointed in SQLite (``langgraph-checkpoint-sqlite``), so a later process,
even after a daemon restart, resumes the thread, and with it the workspace, from that id::

    python examples/langgraph_thread.py --db thread.sqlite --thread t1 start SRC "first"
    python examples/langgraph_thread.py --db thread.sqlite --thread t1 resume "second"

``start`` snapshots SRC and runs the node once; ``resume`` reads the snapshot id from the
thread's checkpoint and runs it again.  Each prints one JSON line: ``{"resumed_from",
"snapshot", "notes"}`` (``notes``: the promoted ``notes.txt``).  The mount is ``--mount`` or
``$RAMET_MOUNT``.  Needs ``pip install 'rametfs[harness]'``.
"""

from __future__ import annotations

import argparse
import json
from typing import TypedDict

from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph

from rametfs import Ramet


class Thread(TypedDict):
    snapshot: str  # the workspace: a snapshot id, all the state a new process needs
    task: str  # the line the next run appends


def build(ramet: Ramet, checkpointer: SqliteSaver):
    def work(state: Thread) -> dict:
        execution = ramet.create(state["snapshot"])  # the workspace, as the thread left it
        try:
            with open(execution.path / "notes.txt", "a") as notes:
                notes.write(state["task"] + "\n")
            return {"snapshot": execution.promote(label=f"thread: {state['task']}")}
        finally:
            ramet.release(execution)

    graph = StateGraph(Thread)
    graph.add_node("work", work)
    graph.add_edge(START, "work")
    graph.add_edge("work", END)
    return graph.compile(checkpointer=checkpointer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mount", help="the rametfs mount (default: $RAMET_MOUNT)")
    parser.add_argument("--db", required=True, help="the SQLite checkpoint database")
    parser.add_argument("--thread", required=True, help="the LangGraph thread id")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="snapshot SOURCE and run the first task")
    start.add_argument("source")
    start.add_argument("task")
    resume = commands.add_parser("resume", help="resume the thread's workspace, run a task")
    resume.add_argument("task")
    args = parser.parse_args()

    ramet = Ramet(args.mount)
    config = {"configurable": {"thread_id": args.thread}}
    with SqliteSaver.from_conn_string(args.db) as checkpointer:
        graph = build(ramet, checkpointer)
        if args.command == "start":
            resumed_from = ramet.snapshot(args.source, label="thread base")
            state = graph.invoke({"snapshot": resumed_from, "task": args.task}, config)
        else:
            resumed_from = graph.get_state(config).values["snapshot"]
            state = graph.invoke({"task": args.task}, config)
    notes = (ramet.mount / "snapshots" / state["snapshot"] / "notes.txt").read_text()
    print(json.dumps({"resumed_from": resumed_from, "snapshot": state["snapshot"],
                      "notes": notes}))


if __name__ == "__main__":
    main()
