"""The rametfs benchmark suite: rametfs against native ext4, kernel overlayfs, fuse-overlayfs,
``cp -a`` and ``git worktree add`` on the same tree, in one run (issue 4, docs/benchmarks.md).

Run it through ``tools/bench`` (which prepares .venv and the reference tools first)::

    tools/bench --size smoke|small|full [--repeat N] [--out DIR] [--only WORKLOAD,...]

Modules: :mod:`~benchmarks.trees` builds the source trees, :mod:`~benchmarks.systems` gives
each system's fork/reset/promote/discard and writable views, :mod:`~benchmarks.workloads`
times the workloads, :mod:`~benchmarks.runner` runs them and cleans up,
:mod:`~benchmarks.report` prints the table, writes the JSON and draws the charts.
"""
