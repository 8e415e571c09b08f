"""Sandboxes (rametfs.sandbox): bubblewrap for real on a mounted rametfs, Docker's command line
(tests/test_containers.py runs Docker and Podman for real).

The bubblewrap tests share one daemon served with ``--allow-other`` (the sandbox runs as uid
65534), on a source tree owned by 65534.  They need ``bwrap`` (Debian package bubblewrap,
installed by tools/setup) and root.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

import pytest

from conftest import require_bwrap, sandbox_project
from rametfs import Ramet, RametError
from rametfs.sandbox import Bubblewrap, Docker, Result

NOBODY = 65534


@pytest.fixture(scope="module")
def ramet(allow_other_daemon):
    require_bwrap()
    return Ramet(allow_other_daemon.mnt)


@pytest.fixture(scope="module")
def base(ramet, tmp_path_factory):
    return sandbox_project(ramet, tmp_path_factory.mktemp("src"))


@pytest.fixture
def pair(ramet, base):
    """Two executions of the base; the second holds a file the first must not see.  The
    first belongs to the sandbox's uid, so its own control files answer it."""
    first, second = ramet.create(base, owner=NOBODY), ramet.create(base)
    (second.path / "secret").write_text("sibling\n")
    yield first, second
    for ex in (first, second):
        ramet.release(ex)


def sh(execution, script: str, timeout: float | None = 30, **options) -> Result:
    return Bubblewrap(**options).run(execution, ["sh", "-c", script], timeout=timeout)


def test_runs_as_nobody_in_workspace_and_writes_through(pair):
    ex, _ = pair
    result = sh(ex, "id -u; id -g; id -G; pwd; cat README; echo new > made; "
                    "echo changed >> pkg/mod.py; grep Cap /proc/self/status")
    assert result == Result(0, result.stdout, "", False, result.seconds)
    lines = result.stdout.splitlines()
    assert lines[:5] == ["65534", "65534", "65534", "/workspace", "base"]
    assert [line.split()[1] for line in lines[5:]] == ["0" * 16] * 5  # no capabilities
    assert (ex.path / "made").read_text() == "new\n"
    assert (ex.path / "pkg" / "mod.py").read_text() == "X = 1\nchanged\n"
    assert os.stat(ex.path / "made").st_uid == NOBODY
    assert sorted(ex.diff()) == [("A", "made"), ("M", "pkg/mod.py")]


def test_cannot_see_siblings_the_mount_or_the_data_dir(ramet, pair):
    ex, sibling = pair
    data = ramet.status()["data"]
    probes = {
        "mount": f"ls -A {ramet.mount}",
        "data": f"ls -A {data}",
        "sibling": f"cat {sibling.path}/secret",
        "root_ctl": f"ls {ramet.mount}/.ramet/ctl",
        "daemon": "cat /proc/[0-9]*/cmdline | tr '\\\\0' ' ' | grep '[s]erve --data'",
        "fuse": "ls /dev/fuse",
    }
    script = "; ".join(f"echo {name}: $({cmd} 2>&1 | wc -l) $({cmd} >/dev/null 2>&1; echo $?)"
                       for name, cmd in probes.items())
    result = sh(ex, script)
    assert result.exit_code == 0, result.stderr
    seen = dict(line.split(": ") for line in result.stdout.splitlines())
    # no such file: the sandbox has nothing of the host but the system directories
    assert seen == {"mount": "1 2", "data": "1 2", "sibling": "1 1", "root_ctl": "1 2",
                    "daemon": "0 1", "fuse": "1 2"}


def test_cannot_write_outside_the_workspace(pair, tmp_path):
    ex, sibling = pair
    outside = Path("/tmp") / f"rametfs-escape-{os.getpid()}"
    targets = ["/etc/escape", "/escape", "/usr/escape", str(tmp_path / "escape"),
               f"{sibling.path}/escape", f"{ex.ramet.mount}/escape"]
    script = "; ".join(f"touch {t} 2>/dev/null; echo $?" for t in targets)
    result = sh(ex, f"{script}; touch {outside} && echo tmp-ok")
    assert result.stdout.splitlines() == ["1"] * len(targets) + ["tmp-ok"]
    assert not outside.exists()  # the sandbox's /tmp is its own tmpfs
    assert not (tmp_path / "escape").exists()
    assert sorted(os.listdir(sibling.path)) == ["README", "pkg", "secret"]


def test_network_is_off_unless_asked(pair):
    ex, _ = pair
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        probe = ("import socket\ntry:\n socket.create_connection(('127.0.0.1', %d), 5)\n"
                 " print('connected')\nexcept OSError as e:\n print(e.errno)" % port)
        argv = ["/usr/bin/python3", "-c", probe]
        off = Bubblewrap().run(ex, argv, timeout=30)
        on = Bubblewrap(network=True).run(ex, argv, timeout=30)
    assert (off.stdout, on.stdout) == (f"{errno.ECONNREFUSED}\n", "connected\n")
    links = sh(ex, "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
    assert links.stdout == "lo\n"


def test_its_own_ctl_promotes_and_resets_itself(ramet, pair):
    ex, sibling = pair
    result = sh(ex, "echo kept > kept; echo promote > .ramet/ctl && cat .ramet/promote")
    assert result.exit_code == 0, result.stderr
    promoted = result.stdout.strip()
    assert ex.status()["head"] == promoted
    assert (ramet.mount / "snapshots" / promoted / "kept").read_text() == "kept\n"
    result = sh(ex, "echo more > more; echo reset > .ramet/ctl; ls")
    assert result.stdout.split() == ["README", "kept", "pkg"]  # back to the head: the promote
    result = sh(ex, "echo 'reset --base yes' > .ramet/ctl; ls")
    assert result.stdout.split() == ["README", "pkg"]  # back to the base
    assert ex.diff() == [] and sorted(os.listdir(sibling.path)) == ["README", "pkg", "secret"]


def test_timeout_kills_every_process_before_returning(pair):
    ex, _ = pair
    # A writer that leaves the process group (setsid) and ignores SIGTERM and SIGHUP.
    writer = "trap '' TERM HUP; while :; do echo x >> log; done"
    start = time.monotonic()
    result = sh(ex, f"setsid sh -c \"{writer}\" & echo started; sleep 60", timeout=1)
    assert result.timed_out and result.exit_code == 128 + 9  # bwrap's report of a SIGKILL
    assert result.stdout == "started\n" and 1 <= result.seconds < 10
    assert time.monotonic() - start < 10
    size = os.stat(ex.path / "log").st_size
    assert size > 0
    time.sleep(0.2)  # a surviving writer would grow the log meanwhile
    assert os.stat(ex.path / "log").st_size == size
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit()
                and _owner(pid) == NOBODY and b"log" in _cmdline(pid)]
    assert ex.reset() and ex.diff() == []


def test_refuses_a_mount_without_allow_other(shared_daemon, tmp_path):
    (tmp_path / "f").write_text("x")
    ramet = Ramet(shared_daemon.mnt)
    ex = ramet.create(ramet.snapshot(tmp_path))
    try:
        with pytest.raises(RametError) as caught:
            Bubblewrap().run(ex, ["true"])
        assert caught.value.errno == errno.EACCES
        assert str(caught.value) == (f"{shared_daemon.mnt} is not served with --allow-other: "
                                     "a sandbox running as uid 65534 could not enter its "
                                     "executions")
    finally:
        ramet.release(ex)


def test_a_fallback_execution_is_sandboxed_the_same_way(tmp_path):
    require_bwrap()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_text("a\n")
    for path in (tmp_path / "src", tmp_path / "src" / "a"):
        os.chown(path, NOBODY, NOBODY)
    with Ramet(data=tmp_path / "data", mode="fallback") as ramet:
        base = ramet.snapshot(tmp_path / "src")
        ex, sibling = ramet.create(base), ramet.create(base)
        result = sh(ex, f"id -u; echo b > b; ls -A {ramet.data}; ls {sibling.path}; ls")
        assert result.stdout == "65534\na\nb\n"
        assert result.stderr == (f"ls: cannot access '{ramet.data}': No such file or "
                                 f"directory\nls: cannot access '{sibling.path}': No such "
                                 "file or directory\n")
        assert ex.diff() == [("A", "b")] and sibling.diff() == []


def test_root_is_refused():
    with pytest.raises(ValueError):
        Bubblewrap(uid=0)


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return None


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


# ----- Docker: the command line (tests/test_containers.py runs it for real) ----------------

@pytest.fixture
def fallback_execution(tmp_path):
    """An execution in fallback mode: a real directory, no mount needed."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("x")
    with Ramet(data=tmp_path / "data", mode="fallback") as ramet:
        yield ramet.create(ramet.snapshot(tmp_path / "src"))


def test_docker_command_line(fallback_execution):
    ex = fallback_execution
    docker = Docker("python:3.11-slim", 1000, 1001, memory="1g", cpus=2.5, pids_limit=None,
                    env={"B": "2", "A": "1"}, options=["--ulimit", "nofile=64:64"],
                    docker=["docker", "-H", "unix:///run/d.sock"])
    assert docker.command(ex, ["python", "-m", "pytest", "-q"], "box") == [
        "docker", "-H", "unix:///run/d.sock", "create", "--rm", "--pull", "never",
        "--name", "box", "--init", "--mount", f"type=bind,source={ex.path},target=/workspace",
        "-w", "/workspace", "--user", "1000:1001",
        "--network", "none", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--read-only", "--tmpfs", "/tmp", "--memory", "1g", "--cpus", "2.5",
        "-e", "A", "-e", "B", "--ulimit", "nofile=64:64", "python:3.11-slim",
        "python", "-m", "pytest", "-q"]  # -e KEY: the values come through the environment
    assert Docker("img", docker="podman").command(ex, ["true"], "n") == [
        "podman", "create", "--rm", "--pull", "never", "--name", "n", "--init",
        "--mount", f"type=bind,source={ex.path},target=/workspace",
        "-w", "/workspace", "--user", "65534:65534", "--network", "none", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--read-only", "--tmpfs", "/tmp",
        "--memory", "2g", "--cpus", "1", "--pids-limit", "512", "img", "true"]


def test_docker_refuses_a_path_that_mount_would_split(tmp_path):
    with Ramet(data=tmp_path / "a,b", mode="fallback") as ramet:
        (tmp_path / "src").mkdir()
        ex = ramet.create(ramet.snapshot(tmp_path / "src"))
        with pytest.raises(ValueError) as caught:
            Docker("img").run(ex, ["true"])
    assert str(caught.value) == (f"{ex.path}: the execution's path holds a comma, which "
                                 "docker's --mount would take for the end of the source")
