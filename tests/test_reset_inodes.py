"""Processes inside an execution across a reset, a rebase (``reset --to``) and a pool
member's return and acquire (issue 18.5): what the new head still has at the same path
keeps its inode, so a process working in it carries on (its cwd lists the new names, a file
it holds open reads the same bytes); what the reset deletes or changes is stale for those
holding it, and shows the new head at once to a new path walk (no stale kernel cache).

Through the real mount with real processes: a Python process kept running in a directory of
the execution (:class:`Probe`), holding its cwd and open files across the reset, and shells.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run
from test_snapshots import tree_signature, write_tree

PROBE = r"""
import errno, json, os, sys
fds = {}
for line in sys.stdin:
    cmd, *args = json.loads(line)
    try:
        if cmd == "ls":
            out = sorted(os.listdir(args[0]))
        elif cmd == "open":
            fds[args[0]] = os.open(args[0], os.O_RDONLY)
            out = None
        elif cmd == "pread":
            out = os.pread(fds[args[0]], 100, 0).decode()
        elif cmd == "read":
            with open(args[0]) as f:
                out = f.read()
        elif cmd == "stat":
            st = os.stat(args[0])
            out = [st.st_ino, st.st_size]
        elif cmd == "cwd":
            out = os.getcwd()
        reply = {"ok": out}
    except OSError as exc:
        reply = {"errno": errno.errorcode[exc.errno]}
    print(json.dumps(reply), flush=True)
"""


class Probe:
    """A Python process whose cwd is ``cwd``, answering one command a line (``ls``, ``open``,
    ``pread``, ``read``, ``stat``, ``cwd``) with its result, or the errno name it got."""

    def __init__(self, cwd: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE], cwd=cwd, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def __call__(self, *command):
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        return reply["ok"] if "ok" in reply else reply["errno"]

    def close(self) -> None:
        self.proc.stdin.close()  # it ends at the end of its input
        try:
            assert self.proc.wait(timeout=30) == 0
        finally:
            self.proc.stdout.close()


@pytest.fixture
def probes():
    """Make probes (``probes(cwd)``); each is ended after the test."""
    made: list[Probe] = []

    def make(cwd: Path) -> Probe:
        made.append(Probe(cwd))
        return made[-1]

    yield make
    for probe in made:
        probe.close()


TREE = {"a/b/c/f.txt": b"f\n", "a/b/c/g.txt": b"g\n", "a/b/side.txt": b"side\n",
        "a/top.txt": b"top\n", "z.txt": b"z\n"}


def test_processes_below_changed_directories_carry_on_across_a_reset(shared_daemon, tmp_path,
                                                                     probes):
    """``a`` and ``a/b`` are changed (copied up), ``a/b/c`` is not: a process in ``a/b/c``
    keeps its cwd and open file, one in ``a/b`` keeps its cwd and lists the snapshot's names
    again, one in a directory the reset deletes gets ESTALE; a file the reset changes back
    shows its snapshot content and size to a new open and stat."""
    d = shared_daemon
    src = write_tree(tmp_path / "src", TREE)
    eid = d.create(d.snapshot(src))
    path = d.exec_path(eid)
    run("sh", "-c", "echo changed > a/top.txt && echo new > a/b/new.txt && rm a/b/side.txt "
                    "&& mkdir a/b/made", cwd=path)
    in_c, in_b, in_made = probes(path / "a/b/c"), probes(path / "a/b"), probes(path / "a/b/made")
    assert in_c("ls", ".") == ["f.txt", "g.txt"]
    assert in_c("open", "f.txt") is None
    c_ino, f_ino = in_c("stat", ".")[0], in_c("stat", "f.txt")[0]
    assert in_b("ls", ".") == ["c", "made", "new.txt"]
    assert in_b("read", "../top.txt") == "changed\n"
    assert in_b("stat", "../top.txt")[1] == 8  # the kernel caches these attributes
    assert in_b("read", "side.txt") == "ENOENT"
    b_ino = in_b("stat", ".")[0]
    assert in_made("ls", ".") == []

    run("sh", "-c", "echo reset > .ramet/ctl", cwd=path)

    assert in_c("ls", ".") == ["f.txt", "g.txt"]
    assert in_c("pread", "f.txt") == "f\n"
    assert (in_c("stat", ".")[0], in_c("stat", "f.txt")[0]) == (c_ino, f_ino)
    assert in_c("cwd") == str(path / "a/b/c")
    assert in_c("ls", "..") == ["c", "side.txt"]
    assert in_b("ls", ".") == ["c", "side.txt"]
    assert in_b("stat", ".")[0] == b_ino and in_b("cwd") == str(path / "a/b")
    assert in_b("read", "side.txt") == "side\n"  # removed in the layer: back, not cached missing
    assert in_b("read", "../top.txt") == "top\n"
    assert in_b("stat", "../top.txt")[1] == 4
    assert in_b("read", "new.txt") == "ENOENT"
    assert in_made("ls", ".") == "ESTALE"
    assert tree_signature(path) == tree_signature(src)

    # The shell of the issue: cd into a/b/c, change a/b, reset, carry on where it is.
    out = run("bash", "-c", "cd a/b/c && echo more > ../more.txt && exec 3< f.txt && "
                            "echo reset > ../../../.ramet/ctl && ls && cat <&3 && /bin/pwd "
                            "&& ls ..", cwd=path).stdout
    assert out == f"f.txt\ng.txt\nf\n{path}/a/b/c\nc\nside.txt\n"
    d.ctl(f"release {eid}")
    assert in_c("ls", ".") == "ESTALE"  # released: nothing of it is kept


def test_a_rebase_keeps_what_both_snapshots_have_and_shows_the_rest(shared_daemon, tmp_path,
                                                                   probes):
    """``reset --to OTHER``: a process in ``a/b/c``, whose entry differs in OTHER (one of
    its files does), keeps its cwd and lists OTHER's names; a file OTHER has alike keeps its
    inode and open file; one it changes is stale open and new when opened again; a name
    cached as missing that OTHER has is found; a directory OTHER lacks is stale."""
    d = shared_daemon
    src = write_tree(tmp_path / "src", {**TREE, "a/gone/x": b"x\n"})
    other = tmp_path / "other"
    shutil.copytree(src, other)  # the same entries: copytree keeps the times
    shutil.rmtree(other / "a/gone")
    (other / "a/b/c/f.txt").write_bytes(b"other f\n")
    (other / "a/b/found.txt").write_bytes(b"found\n")
    base, rebased = d.snapshot(src), d.snapshot(other)
    eid = d.create(base)
    path = d.exec_path(eid)
    in_c, in_b, in_gone = probes(path / "a/b/c"), probes(path / "a/b"), probes(path / "a/gone")
    assert in_c("open", "f.txt") is None and in_c("open", "g.txt") is None
    assert in_c("read", "f.txt") == "f\n"
    c_ino, f_ino, g_ino = (in_c("stat", name)[0] for name in (".", "f.txt", "g.txt"))
    assert in_b("stat", "found.txt") == "ENOENT"  # cached missing by the kernel
    side_ino = in_b("stat", "side.txt")[0]
    assert in_gone("ls", ".") == ["x"]

    d.ctl(f"reset {eid} --to {rebased}")

    assert in_c("ls", ".") == ["f.txt", "g.txt"] and in_c("stat", ".")[0] == c_ino
    assert in_c("cwd") == str(path / "a/b/c")
    assert in_c("pread", "g.txt") == "g\n" and in_c("stat", "g.txt")[0] == g_ino
    assert in_c("pread", "f.txt") == "ESTALE"
    assert in_c("read", "f.txt") == "other f\n"
    new_f = in_c("stat", "f.txt")
    assert new_f[1] == 8 and new_f[0] != f_ino
    assert in_b("read", "found.txt") == "found\n"
    assert in_b("stat", "side.txt")[0] == side_ino
    assert in_b("ls", ".") == ["c", "found.txt", "side.txt"]
    assert in_gone("ls", ".") == "ESTALE"
    assert tree_signature(path) == tree_signature(other)

    d.ctl(f"reset {eid} --to {base}")  # and back: only f.txt, found.txt and gone/ change
    assert in_c("ls", ".") == ["f.txt", "g.txt"] and in_c("stat", ".")[0] == c_ino
    assert in_c("pread", "g.txt") == "g\n"
    assert in_b("read", "found.txt") == "ENOENT"
    assert tree_signature(path) == tree_signature(src)
    d.ctl(f"release {eid}")


def test_a_pool_member_keeps_a_process_in_it_across_return_and_acquire(shared_daemon, tmp_path,
                                                                       probes):
    """A pool member's return resets it to the pool's snapshot: a process in an unchanged
    directory of it carries on into the next lease."""
    d = shared_daemon
    snap = d.snapshot(write_tree(tmp_path / "src", TREE))
    pool = f"keep-{snap[:8]}"
    d.ctl(f"pool {snap} --size 1 --name {pool}")
    lease = d.ctl(f"acquire {pool} --holder first --ttl 60")
    eid, path = lease["execution"], Path(lease["path"])
    in_c = probes(path / "a/b/c")
    assert in_c("open", "g.txt") is None
    c_ino = in_c("stat", ".")[0]
    run("sh", "-c", "echo mine > a/b/mine.txt && echo x >> a/top.txt", cwd=path)
    assert d.ctl(f"return {eid} --holder first")["state"] == "ready"
    again = d.ctl(f"acquire {pool} --holder second --ttl 60")
    assert again["execution"] == eid
    assert in_c("ls", ".") == ["f.txt", "g.txt"] and in_c("stat", ".")[0] == c_ino
    assert in_c("pread", "g.txt") == "g\n"
    assert in_c("ls", "..") == ["c", "side.txt"]
    assert in_c("read", "../../top.txt") == "top\n"
    d.ctl(f"return {eid} --holder second")
    d.ctl(f"drop {pool}")


def test_an_execution_cannot_make_another_s_nodes_stale_or_keep_them_alive(shared_daemon,
                                                                         tmp_path, probes):
    """Two executions of one snapshot have their own inodes: a reset of one (from a process
    inside it) leaves the other's processes and changes alone, and the other's release makes
    its nodes stale although the first still has the same directory, unchanged."""
    d = shared_daemon
    snap = d.snapshot(write_tree(tmp_path / "src", TREE))
    first, second = d.create(snap), d.create(snap)
    p1, p2 = d.exec_path(first), d.exec_path(second)
    in_1, in_2 = probes(p1 / "a/b/c"), probes(p2 / "a/b/c")
    ino_1, ino_2 = in_1("stat", ".")[0], in_2("stat", ".")[0]
    assert ino_1 != ino_2
    run("sh", "-c", "echo mine > mine.txt", cwd=p2 / "a/b/c")
    run("sh", "-c", "echo x >> a/top.txt && echo x >> a/b/c/f.txt && echo reset > .ramet/ctl",
        cwd=p1)
    assert in_2("ls", ".") == ["f.txt", "g.txt", "mine.txt"] and in_2("stat", ".")[0] == ino_2
    assert in_2("read", "../../top.txt") == "top\n"
    assert in_1("ls", ".") == ["f.txt", "g.txt"] and in_1("stat", ".")[0] == ino_1
    d.ctl(f"release {second}")
    assert in_2("ls", ".") == "ESTALE" and in_2("stat", "f.txt") == "ESTALE"
    assert in_1("ls", ".") == ["f.txt", "g.txt"] and in_1("stat", ".")[0] == ino_1
    d.ctl(f"release {first}")
    assert in_1("ls", ".") == "ESTALE"


def test_hard_links_in_a_kept_directory_get_one_inode_again(shared_daemon, tmp_path, probes):
    """A base hard link is never kept (its group's other names would get other inodes): both
    names come back as one inode, in a directory that keeps its own."""
    d = shared_daemon
    src = write_tree(tmp_path / "src", TREE)
    os.link(src / "a/b/c/f.txt", src / "a/b/c/f-link")
    eid = d.create(d.snapshot(src))
    path = d.exec_path(eid)
    in_c = probes(path / "a/b/c")
    c_ino = in_c("stat", ".")[0]
    first = in_c("stat", "f.txt")
    assert in_c("stat", "f-link") == first
    run("sh", "-c", "echo x >> a/top.txt && echo reset > .ramet/ctl", cwd=path)
    assert in_c("stat", ".")[0] == c_ino
    again = in_c("stat", "f.txt")
    assert in_c("stat", "f-link") == again and again[1] == 2
    assert in_c("ls", ".") == ["f-link", "f.txt", "g.txt"]
    assert in_c("read", "f-link") == "f\n"
    d.ctl(f"release {eid}")
