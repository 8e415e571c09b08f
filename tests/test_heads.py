"""An execution's base and head (rametfs.core.heads), as git's branch and commits: promote
moves the head, reset returns to it, ``reset --base`` goes back to the base, ``reset --to``
rebases onto any snapshot in place.  Through the real mount (and the fallback directories),
with real programs writing; expected trees come from the sources on the host file system.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import cli_where, run
from rametfs import Ramet, RametError
from rametfs.cli import main
from test_client import NO_SNAPSHOT
from test_control import control
from test_snapshots import tree_signature, write_tree


@pytest.fixture
def source(tmp_path) -> Path:
    return write_tree(tmp_path / "src", {"README": b"project\n", "src/main.py": b"print(1)\n",
                                         "src/util.py": b"def f():\n    return 1\n",
                                         "data/big.bin": os.urandom(300_000)})


@pytest.fixture
def other(tmp_path) -> Path:
    """A tree that shares nothing with ``source``."""
    return write_tree(tmp_path / "other", {"notes/todo.txt": b"nothing in common\n",
                                           "run.sh": b"#!/bin/sh\necho other\n"})


def sh(cwd: Path, script: str) -> None:
    run("sh", "-c", script, cwd=cwd)


def snapshot_record(ramet: Ramet, sid: str) -> dict:
    record, = [s for s in ramet.snapshots() if s["id"] == sid]
    return record


def test_reset_returns_to_the_last_promote_base_and_to_rebase(ramet, source, other):
    base = ramet.snapshot(source, label="base")
    unrelated = ramet.snapshot(other, label="unrelated")
    ex = ramet.create(base)
    sh(ex.path, "echo 'print(2)' >> src/main.py && rm src/util.py && mkdir docs && "
                "echo hi > docs/a.md && dd if=/dev/zero of=data/big.bin bs=1 count=7 seek=70000 "
                "conv=notrunc status=none")
    promoted = ramet_promote = ex.promote(label="attempt")
    promoted_tree = tree_signature(ex.path)
    assert (ex.diff(), ex.status()["head"], ex.status()["base"]) == ([], promoted, base)

    sh(ex.path, "echo later > later.txt && echo more >> README && rm -r docs")
    assert ex.diff() == [("M", "README"), ("D", "docs/"), ("D", "docs/a.md"),
                         ("A", "later.txt")]
    assert ex.reset() == promoted  # git: commit, then reset --hard
    assert tree_signature(ex.path) == promoted_tree
    assert (ex.diff(), ex.verify(deep=True)) == ([], [])

    assert ex.reset(base=True) == base
    assert tree_signature(ex.path) == tree_signature(source)
    assert (ex.diff(), ex.verify(), ex.status()["head"]) == ([], [], base)

    assert ex.reset(to=unrelated[:12]) == unrelated  # a prefix, as rametfs ls shows it
    assert tree_signature(ex.path) == tree_signature(other)
    assert (ex.diff(), ex.verify(deep=True)) == ([], [])
    status = ex.status()
    assert (status["base"], status["head"]) == (base, unrelated)
    sh(ex.path, "echo x >> run.sh")
    assert ex.diff() == [("M", "run.sh")]
    next_one = ex.promote()
    assert snapshot_record(ramet, next_one)["parents"] == [unrelated]
    assert snapshot_record(ramet, ramet_promote)["parents"] == [base]

    assert ex.reset(to=promoted) == promoted  # forks from any saved state, in place
    assert tree_signature(ex.path) == promoted_tree
    ramet.release(ex)


def test_checkpoint_keeps_the_head(ramet, source):
    base = ramet.snapshot(source)
    ex = ramet.create(base)
    sh(ex.path, "echo one > one.txt")
    checkpoint = ex.checkpoint(label="side")
    assert (ex.status()["head"], ex.diff()) == (base, [("A", "one.txt")])
    assert ex.reset() == base and tree_signature(ex.path) == tree_signature(source)
    assert snapshot_record(ramet, checkpoint)["parents"] == [base]
    ramet.release(ex)


def test_a_bad_reset_changes_nothing(ramet, source, other):
    base = ramet.snapshot(source)
    unrelated = ramet.snapshot(other)
    ex = ramet.create(base)
    sh(ex.path, "echo work > work.txt")
    for call, err in [(lambda: ex.reset(to=NO_SNAPSHOT), errno.ENOENT),
                      (lambda: ex.reset(to=unrelated, base=True), errno.EINVAL)]:
        with pytest.raises(RametError) as caught:
            call()
        assert caught.value.errno == err, caught.value
    assert (ex.diff(), ex.status()["head"]) == ([("A", "work.txt")], base)
    ramet.release(ex)


def test_a_pool_return_goes_back_to_the_pools_snapshot(ramet, source, other):
    base = ramet.snapshot(source)
    unrelated = ramet.snapshot(other)
    with ramet.execution_pool(base, concurrency=1) as pool:
        with pool.acquire() as ex:
            sh(ex.path, "echo a > a.txt")
            ex.promote()
            ex.reset(to=unrelated)
            first = ex.id
        with pool.acquire() as ex:
            assert ex.id == first
            assert tree_signature(ex.path) == tree_signature(source)
            status = ex.status()
            assert (status["base"], status["head"], ex.diff()) == (base, base, [])


def test_the_cli_resets_to_head_base_or_snapshot(ramet, source, other):
    base = ramet.snapshot(source)
    unrelated = ramet.snapshot(other)
    ex = ramet.create(base)
    sh(ex.path, "echo a > a.txt")
    promoted = ex.promote()
    sh(ex.path, "echo b > b.txt")

    def cli(*args: str):
        return CliRunner(env={"RAMET_MODE": None}).invoke(
            main, [args[0], *cli_where(ramet), *args[1:]])

    result = cli("reset", ex.id)
    assert (result.exit_code, result.stdout) == (0, promoted + "\n")
    assert not (ex.path / "b.txt").exists() and (ex.path / "a.txt").exists()
    assert cli("reset", ex.id, "--to", unrelated[:10]).stdout == unrelated + "\n"
    assert tree_signature(ex.path) == tree_signature(other)
    assert cli("reset", ex.id, "--base").stdout == base + "\n"
    assert tree_signature(ex.path) == tree_signature(source)
    both = cli("reset", ex.id, "--base", "--to", unrelated)
    assert (both.exit_code, "give one" in both.stderr) == (2, True)
    missing = cli("reset", ex.id, "--to", NO_SNAPSHOT)
    assert (missing.exit_code, f"no snapshot {NO_SNAPSHOT!r}" in missing.stderr) == (3, True)
    ramet.release(ex)


# ----- FUSE mode: the control files, the kernel's caches, restarts ---------------------------

def test_an_execution_may_reset_to_its_head_or_base_but_not_rebase(shared_daemon, source,
                                                                  other):
    """``reset --to`` from the execution's own ctl is EACCES (which snapshot it stands on is
    the harness's); reset and ``reset --base yes`` are its own."""
    d = shared_daemon
    base, unrelated = d.snapshot(source), d.snapshot(other)
    eid = d.create(base)
    path = d.exec_path(eid)
    sh(path, "echo a > a.txt && echo promote > .ramet/ctl && echo b > b.txt")
    promoted = d.exec_status(eid)["head"]
    assert promoted != base

    refused = run("bash", "-c", f"echo 'reset --to {unrelated}' > .ramet/ctl", cwd=path,
                  check=False)  # bash shows the errno's text (dash's echo says I/O error)
    assert refused.returncode != 0 and "Permission denied" in refused.stderr
    assert control(path, "error").read_text().startswith(
        f"reset --to {unrelated}: reset --to: which snapshot an execution stands on is the "
        "harness's")
    assert (control(path, "diff").read_text(), d.exec_status(eid)["head"]) == (
        "A b.txt\n", promoted)

    sh(path, "echo reset > .ramet/ctl")
    assert sorted(os.listdir(path)) == ["README", "a.txt", "data", "src"]
    sh(path, "echo 'reset --base yes' > .ramet/ctl")
    assert tree_signature(path) == tree_signature(source)
    reply = d.ctl(f"reset {eid} --to {unrelated[:8]}")  # the harness may
    assert (reply["ok"], reply["snapshot"]) == (True, unrelated)
    assert tree_signature(path) == tree_signature(other)
    assert d.exec_status(eid)["head"] == unrelated
    d.ctl(f"release {eid}")


def test_a_rebase_drops_what_the_kernel_cached(shared_daemon, source, other):
    """Pages and listings read before ``reset --to`` are not served after it."""
    d = shared_daemon
    base, unrelated = d.snapshot(source), d.snapshot(other)
    eid = d.create(base)
    path = d.exec_path(eid)
    assert run("cat", "README", cwd=path).stdout == "project\n"
    assert run("ls", "src", cwd=path).stdout == "main.py\nutil.py\n"
    d.ctl(f"reset {eid} --to {unrelated}")
    assert run("ls", cwd=path).stdout == "notes\nrun.sh\n"
    assert run("cat", "README", cwd=path, check=False).returncode != 0
    assert run("cat", "notes/todo.txt", cwd=path).stdout == "nothing in common\n"
    d.ctl(f"reset {eid} --to {base}")
    assert run("cat", "README", cwd=path).stdout == "project\n"
    d.ctl(f"release {eid}")


def test_the_head_and_the_layer_survive_a_restart(daemon, source, other):
    d = daemon
    base, unrelated = d.snapshot(source), d.snapshot(other)
    eid = d.create(base)
    path = d.exec_path(eid)
    sh(path, "echo 'print(3)' > src/main.py && echo new > new.txt")
    promoted = d.exec_ctl(eid, "promote")["snapshot"]
    promoted_tree = tree_signature(path)
    sh(path, "echo later > later.txt")

    d.restart()
    assert d.exec_status(eid)["head"] == promoted
    assert control(path, "diff").read_text() == "A later.txt\n"  # no M: the promote's ids
    assert d.ctl(f"verify {eid}")["verification"]["differences"] == [["A", "later.txt"]]
    assert d.exec_ctl(eid, "reset")["snapshot"] == promoted
    assert tree_signature(path) == promoted_tree

    d.ctl(f"reset {eid} --to {unrelated}")
    d.restart()
    assert tree_signature(path) == tree_signature(other)
    status = d.exec_status(eid)
    assert (status["base"], status["head"]) == (base, unrelated)
    assert (control(path, "diff").read_text(),
            d.ctl(f"verify {eid} --mode deep")["verification"]["differences"]) == ("", [])
    assert d.exec_ctl(eid, "reset --base yes")["snapshot"] == base
    assert tree_signature(path) == tree_signature(source)


def test_a_write_after_a_promote_shows_in_the_diff_even_after_a_crash(daemon, source):
    """The content id a promote recorded in a file's inode stops vouching at its next write,
    stored at once: a same-size overwrite, then SIGKILL before the second's flush, still
    diffs as ``M`` (with the id kept, it would read as unchanged)."""
    d = daemon
    eid = d.create(d.snapshot(source))
    path = d.exec_path(eid)
    sh(path, "echo 'print(4)' > src/main.py")
    d.exec_ctl(eid, "promote")
    run("sync", "src/main.py", cwd=path)  # its fsync stores the record with the promote's id
    assert control(path, "diff").read_text() == ""
    sh(path, "printf 'print(5)' | dd of=src/main.py conv=notrunc status=none")
    assert control(path, "diff").read_text() == "M src/main.py\n"
    d.kill()
    d.start()
    assert (path / "src/main.py").read_bytes() == b"print(5)\n"
    assert control(path, "diff").read_text() == "M src/main.py\n"


def test_rm_refuses_the_snapshot_a_layer_lies_over(shared_daemon, source, other):
    """After ``reset --to S`` and a promote, the head is the promote but the layer still lies
    over S: rm of S is EBUSY, even with --force, until a reset moves the layer."""
    d = shared_daemon
    base, unrelated = d.snapshot(source), d.snapshot(other)
    eid = d.create(base)
    d.ctl(f"reset {eid} --to {unrelated}")
    sh(d.exec_path(eid), "echo x > x.txt")
    promoted = d.exec_ctl(eid, "promote")["snapshot"]
    with pytest.raises(OSError) as caught:
        d.ctl(f"rm {unrelated} --force yes")
    assert caught.value.errno == errno.EBUSY
    assert f"it is the lower snapshot of execution {eid}" in caught.value.reply["error"]
    d.exec_ctl(eid, "reset")  # now over the promote
    assert d.ctl(f"rm {unrelated}")["removed"] == [unrelated]
    assert tree_signature(d.exec_path(eid))["x.txt"].startswith("file")
    assert d.exec_status(eid)["head"] == promoted
    d.ctl(f"release {eid}")


def test_a_shell_in_an_unchanged_directory_carries_on_across_a_reset(shared_daemon, tmp_path):
    """Issue 18.5: what a reset (or a rebase) leaves as it was keeps its inode in the
    kernel, so a shell working in ``lib/sub``, and a file it holds open there, carry on
    after ``echo reset > .ramet/ctl`` while the changed ``src/`` is stale.  (Before: ``ls:
    cannot open directory '.': Stale file handle``.)"""
    d = shared_daemon
    src = write_tree(tmp_path / "src", {"lib/sub/f.txt": b"lib\n", "lib/g.txt": b"g\n",
                                        "src/main.py": b"m\n"})
    other = write_tree(tmp_path / "other", {"docs/x": b"x\n"})
    shutil.copytree(src / "lib", other / "lib")  # the same entries: copytree keeps the times
    base, unrelated = d.snapshot(src), d.snapshot(other)
    eid = d.create(base)
    path = d.exec_path(eid)
    script = f"""set -e
        cd src && echo changed > main.py && cd ..
        cd lib/sub
        ls; stat -c %i f.txt; exec 3< f.txt
        echo reset > ../../.ramet/ctl
        echo after-reset; ls; stat -c %i f.txt; cat f.txt; cat <&3; cat ../../src/main.py
        exec 3< f.txt
        echo 'reset {eid} --to {unrelated}' > {d.mnt}/.ramet/ctl
        echo after-rebase; ls ..; stat -c %i f.txt; cat <&3; ls ../..
    """
    out = run("bash", "-c", script, cwd=path).stdout.split("\n")
    ino = out[1]
    assert out == ["f.txt", ino, "after-reset", "f.txt", ino, "lib", "lib", "m",
                   "after-rebase", "g.txt", "sub", ino, "lib", "docs", "lib", ""]
    changed = run("bash", "-c", f"cd docs && echo reset > ../.ramet/ctl && echo 'reset {eid} "
                                f"--to {base}' > {d.mnt}/.ramet/ctl && ls", cwd=path,
                  check=False)  # docs is not in the base: its inode goes stale
    assert changed.returncode != 0 and "Stale file handle" in changed.stderr, changed
    assert tree_signature(path) == tree_signature(src)
    d.ctl(f"release {eid}")
