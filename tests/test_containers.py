"""The Docker adapter (rametfs.sandbox.Docker) for real, under Docker and rootful Podman.

Each engine is the session's own (``container_engine`` in conftest.py: a private dockerd,
or Podman with storage of its own) with an image built from Debian packages, so nothing is
pulled from a registry.  The executions are on a daemon served with ``--allow-other`` (the
containers run as uid 65534), on a source tree owned by 65534.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from conftest import containers, wait_until
from rametfs import Ramet
from rametfs.sandbox import Docker, Result

NOBODY = 65534
IMAGE_ROOT = ["bin", "dev", "etc", "lib", "lib64", "proc", "sbin", "sys", "tmp", "usr",
              "workspace"]


@pytest.fixture(scope="module")
def ramet(allow_other_daemon):
    return Ramet(allow_other_daemon.mnt)


@pytest.fixture(scope="module")
def base(ramet, tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    (src / "README").write_text("base\n")
    (src / "pkg").mkdir()
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    for path in (src, src / "README", src / "pkg", src / "pkg" / "mod.py"):
        os.chown(path, NOBODY, NOBODY)
    return ramet.snapshot(src)


@pytest.fixture
def pair(ramet, base):
    """Two executions of the base, the first the sandbox uid's; the second holds a file the
    first must not see."""
    first, second = ramet.create(base, owner=NOBODY), ramet.create(base)
    (second.path / "secret").write_text("sibling\n")
    yield first, second
    for ex in (first, second):
        ramet.release(ex)


def runtime(engine, **options) -> Docker:
    return Docker(containers.IMAGE, docker=engine.client, options=engine.options, **options)


def sh(engine, execution, script: str, timeout: float | None = 60, **options) -> Result:
    return runtime(engine, **options).run(execution, ["sh", "-c", script], timeout=timeout)


def test_runs_as_the_uid_in_its_execution_without_capabilities_or_network(
        container_engine, pair):
    ex, _ = pair
    result = sh(container_engine, ex, "id -u; id -g; id -G; pwd; cat README; echo new > made; "
                "echo changed >> pkg/mod.py; grep -E '^(Cap|NoNewPrivs)' /proc/self/status; "
                "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '; python3 -c 'print(6 * 7)'")
    assert (result.exit_code, result.stderr, result.timed_out) == (0, "", False)
    assert result.stdout.splitlines() == [
        "65534", "65534", "65534", "/workspace", "base",
        *(f"Cap{kind}:\t{'0' * 16}" for kind in ("Inh", "Prm", "Eff", "Bnd", "Amb")),
        "NoNewPrivs:\t1", "lo", "42"]
    assert (ex.path / "made").read_text() == "new\n"
    assert (ex.path / "pkg" / "mod.py").read_text() == "X = 1\nchanged\n"
    assert os.stat(ex.path / "made").st_uid == NOBODY
    assert sorted(ex.diff()) == [("A", "made"), ("M", "pkg/mod.py")]
    assert ex.status()["runtime"] == {"name": "docker", "uid": NOBODY, "gid": NOBODY,
                                      "image": containers.IMAGE}


def test_sees_only_its_execution(container_engine, ramet, pair, tmp_path):
    ex, sibling = pair
    data = ramet.status()["data"]
    absent = [str(ramet.mount), data, f"{sibling.path}/secret", f"{ramet.mount}/.ramet/ctl",
              "/dev/fuse", str(tmp_path)]
    writes = ["/etc/escape", "/escape", "/usr/escape", f"{sibling.path}/escape",
              f"{tmp_path}/escape"]
    why = "2>&1 | sed 's/.*: //'"  # the error alone: busybox says "ls: PATH: ERROR"
    script = "; ".join([*(f"ls -d {path} {why}" for path in absent),
                        *(f"touch {path} {why}" for path in writes)])
    result = sh(container_engine, ex, f"{script}; ls /; touch /tmp/scratch && echo tmp-ok; "
                "awk '$5 == \"/workspace\" {for (i = 7; $i != \"-\"; i++); "
                "print $4, $5, $(i + 1)}' /proc/self/mountinfo")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    enoent, erofs = "No such file or directory", "Read-only file system"
    assert lines[:len(absent) + len(writes)] == [enoent] * len(absent) + [erofs] * 3 + [enoent] * 2
    # Podman's --read-only keeps tmpfs on /run and /var/tmp (--read-only-tmpfs)
    podman_adds = ["run", "var"] if "podman" in container_engine.client else []
    assert lines[len(absent) + len(writes):] == [
        *sorted(IMAGE_ROOT + podman_adds), "tmp-ok", f"/executions/{ex.id} /workspace fuse.rametfs"]
    assert sorted(os.listdir(sibling.path)) == ["README", "pkg", "secret"]
    assert not (tmp_path / "escape").exists() and ex.diff() == []


def test_a_timeout_kills_and_removes_the_container(container_engine, pair):
    ex, _ = pair
    # A writer that leaves the process group (setsid) and ignores SIGTERM and SIGHUP.
    writer = "trap '' TERM HUP; while :; do echo x >> log; done"
    result = sh(container_engine, ex, f"setsid sh -c \"{writer}\" & echo started; sleep 600",
                timeout=4)  # counted from the start: the container's own set-up is in it
    assert (result.timed_out, result.exit_code, result.stdout) == (True, 128 + 9, "started\n")
    assert 4 <= result.seconds < 30
    size = os.stat(ex.path / "log").st_size
    assert size > 0
    time.sleep(0.2)  # a surviving writer would grow the log meanwhile
    assert os.stat(ex.path / "log").st_size == size
    assert container_engine.containers() == []  # gone from docker ps -a
    assert ex.reset() and ex.diff() == []


def test_an_image_that_is_not_there_is_not_pulled(container_engine, pair):
    ex, _ = pair
    result = Docker("rametfs-no-such-image", docker=container_engine.client).run(
        ex, ["true"], timeout=60)
    assert (result.exit_code, result.stdout, result.timed_out) == (125, "", False)
    assert "rametfs-no-such-image" in result.stderr and "registry" not in result.stderr
    assert container_engine.containers() == []


def test_env_reaches_the_command_and_no_host_cmdline(container_engine, pair):
    ex, _ = pair
    secret = f"token-{os.urandom(8).hex()}"
    done: list[Result] = []
    thread = threading.Thread(target=lambda: done.append(sh(
        container_engine, ex, 'echo "$TOKEN"; sleep 1', env={"TOKEN": secret})))
    thread.start()
    seen = set()
    while thread.is_alive():  # every host process's command line, while the run lasts
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                seen.add(Path(f"/proc/{pid}/cmdline").read_bytes())
            except OSError:  # gone meanwhile
                pass
        time.sleep(0.02)
    thread.join()
    assert (done[0].exit_code, done[0].stdout) == (0, f"{secret}\n")
    assert any(b"start\0--attach\0rametfs-" in cmdline for cmdline in seen)
    assert [cmdline for cmdline in seen if secret.encode() in cmdline] == []


def test_a_reset_on_the_host_shows_at_once_in_the_running_container(container_engine, pair):
    ex, _ = pair
    done: list[Result] = []
    script = "echo mine > mine; while [ ! -e go ]; do sleep 0.05; done; ls; cat README"
    thread = threading.Thread(target=lambda: done.append(sh(container_engine, ex, script)))
    thread.start()
    wait_until(lambda: (ex.path / "mine").exists(), 60, "the container's first write")
    assert ex.diff() == [("A", "mine")]
    ex.reset()  # no remount: the container's bind is the same FUSE inode, its tree reset
    (ex.path / "go").write_text("")
    thread.join()
    assert (done[0].exit_code, done[0].stdout) == (0, "README\ngo\npkg\nbase\n")
