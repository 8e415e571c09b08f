"""Pools and leases on the CLI (``rametfs pool``, ``acquire``, ``renew``, ``return``,
``drop``) through the wrapper, in both modes: a shell script drives a pool as a harness
written in sh would, and ``rametfs ls`` shows the lease holders."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import cli_where, run
from rametfs.cli import main
from test_client import NO_SNAPSHOT
from test_snapshots import tree_signature, write_tree

RAMETFS = Path(sys.executable).with_name("rametfs")


@pytest.fixture
def source(tmp_path) -> Path:
    return write_tree(tmp_path / "src", {"README": b"project\n", "src/main.py": b"print(1)\n"})


def cli(ramet, *args: str, holder: str | None = None):
    """``rametfs ARGS[0] <where> ARGS[1:]`` in this process (click's runner)."""
    env = {"RAMET_MODE": None, "RAMET_HOLDER": holder}
    return CliRunner(env=env).invoke(main, [args[0], *cli_where(ramet), *args[1:]])


def member(ramet, execution: str) -> dict:
    record, = [e for e in ramet.executions() if e["id"] == execution]
    return record


def test_a_shell_script_drives_a_pool(ramet, source, tmp_path):
    snap = ramet.snapshot(source)
    where = " ".join(cli_where(ramet))
    script = f"""set -e
        export RAMET_HOLDER=ci-worker-1
        pool=$({RAMETFS} pool {where} {snap[:12]} --size 2 --name shpool)
        ex=$({RAMETFS} acquire {where} "$pool" --ttl 60)
        echo "$pool $ex $$"
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAMET_")}
    pool, execution, shell_pid = run("bash", "-c", script, env=env).stdout.split()
    assert pool == "shpool"
    record = member(ramet, execution)
    assert (record["pool"], record["state"], record["base"]) == ("shpool", "leased", snap)
    lease = record["lease"]
    assert (lease["holder"], lease["pid"], lease["host"]) == (
        "ci-worker-1", int(shell_pid), socket.gethostname())

    listing = cli(ramet, "ls").stdout
    line, = [row for row in listing.splitlines() if row.startswith(execution)]
    assert f"leased  shpool  ci-worker-1 (pid {shell_pid} on {socket.gethostname()})  in " in line

    path = ramet.execution(execution).path
    run("sh", "-c", "echo attempt > result.txt && rm README", cwd=path)
    result = cli(ramet, "renew", execution, "--ttl", "120", holder="ci-worker-1")
    assert (result.exit_code, result.stdout) == (0, "")
    assert member(ramet, execution)["lease"]["expires_ns"] > lease["expires_ns"]
    for args, holder in [(("renew", execution), "someone-else"),
                         (("return", execution), "someone-else")]:
        refused = cli(ramet, *args, holder=holder)
        assert (refused.exit_code, "ci-worker-1" in refused.stderr or "another holder"
                in refused.stderr) == (5, True), refused.stderr

    returned = cli(ramet, "return", execution, "--deep", holder="ci-worker-1")
    assert (returned.exit_code, returned.stdout) == (0, "ready\n")
    assert tree_signature(path) == tree_signature(source)
    assert (member(ramet, execution)["state"], member(ramet, execution)["lease"]) == (
        "ready", None)

    first = cli(ramet, "acquire", "shpool", holder="h1")
    second = cli(ramet, "acquire", "shpool", holder="h2")
    assert (first.exit_code, first.stdout, second.exit_code) == (0, execution + "\n", 0)
    none_left = cli(ramet, "acquire", "shpool", holder="h3")
    assert (none_left.exit_code, "rametfs: " in none_left.stderr) == (5, True)

    dropped = cli(ramet, "drop", "shpool")
    assert dropped.exit_code == 0
    assert sorted(dropped.stdout.split()) == sorted([execution, second.stdout.strip()])
    assert not {execution, second.stdout.strip()} & {e["id"] for e in ramet.executions()}
    gone = cli(ramet, "acquire", "shpool", holder="h1")
    assert gone.exit_code == 3


def test_pool_options_and_errors(ramet, source, tmp_path):
    snap = ramet.snapshot(source)
    other = ramet.snapshot(write_tree(tmp_path / "other", {"x": b"x\n"}))
    made = cli(ramet, "pool", snap, "--size", "1", "--name", "opts", "--share", "0750",
               "--control", "read")
    assert (made.exit_code, made.stdout) == (0, "opts\n")
    record, = [e for e in ramet.executions() if e.get("pool") == "opts"]
    assert (record["share"], record["control"]) == ("0750", "read")
    again = cli(ramet, "pool", snap, "--size", "2", "--name", "opts")  # reattach, grow
    assert again.exit_code == 0
    assert len([e for e in ramet.executions() if e.get("pool") == "opts"]) == 2
    for args, code in [(("pool", other, "--size", "1", "--name", "opts"), 8),  # another base
                       (("pool", NO_SNAPSHOT, "--size", "1"), 3),
                       (("pool", snap, "--size", "0"), 2),
                       (("pool", snap), 2),  # --size is required
                       (("pool", snap, "--size", "1", "--name", "bad name"), 4),
                       (("drop", "no-such-pool"), 3),
                       (("acquire", "opts"), 2)]:  # no --holder
        result = cli(ramet, *args)
        assert result.exit_code == code, (args, result.output)
    ended = cli(ramet, "acquire", "opts", "--ttl", "0", holder="brief")
    assert ended.exit_code == 0
    late = cli(ramet, "renew", ended.stdout.strip(), holder="brief")
    assert (late.exit_code, "rametfs: " in late.stderr) == (4, True)
    assert cli(ramet, "drop", "opts").exit_code == 0
