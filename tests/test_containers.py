"""The Docker adapter (rametfs.sandbox.Docker) for real, under Docker and Podman.

Each engine is the session's own (``container_engine`` in conftest.py: a private dockerd,
or Podman with storage of its own) with an image built from Debian packages, so nothing is
pulled from a registry.  The executions are on a daemon served with ``--allow-other`` (the
containers run as uid 65534), on a source tree owned by 65534.  Rootless Podman has a test of
its own, as a user made for it (``rootless``).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import containers, sandbox_project, wait_until
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
    return sandbox_project(ramet, tmp_path_factory.mktemp("src"))


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


@pytest.fixture
def rootless(tmp_path_factory, ramet):
    """Rootless Podman: a user made for the test (useradd, its subordinate uid and gid ranges),
    its storage under the test's tmp directory and the client run as that user through
    ``setpriv``.  Yields ``(client, uid)``.  Skipped, with the reason, without root,
    podman, newuidmap/newgidmap (Debian package uidmap) or when ``podman info`` fails as that
    user; at the end the containers are removed, every process of the user or its ranges is
    killed by pid, the user deleted and the storage removed, even when the test failed."""
    tools = ("podman", "newuidmap", "newgidmap", "useradd", "userdel", "setpriv")
    if os.geteuid() != 0 or not all(map(shutil.which, tools)):
        pytest.skip("rootless podman needs root (to make its user) and "
                    f"{', '.join(tools)} (Debian packages podman, uidmap, passwd, util-linux)")
    base = tmp_path_factory.mktemp("rootless")
    base.chmod(0o711)
    name = f"rametfs-rl-{os.urandom(3).hex()}"
    opened = _open_path(Path(ramet.mount), base)  # the user walks to the mount and its storage
    uid, ranges, client = -1, [], []
    try:
        subprocess.run(["useradd", "--no-create-home", "--home-dir", str(base / "home"),
                        "--shell", "/usr/sbin/nologin", "--user-group", name], check=True,
                       capture_output=True)
        uid = pwd.getpwnam(name).pw_uid
        ranges = [_subordinate(f"/etc/sub{kind}", name) for kind in ("uid", "gid")]
        for sub in ("home", "xdg"):
            (base / sub).mkdir(mode=0o700)
            os.chown(base / sub, uid, uid)
        client = ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--init-groups", "env",
                  f"HOME={base / 'home'}", f"XDG_RUNTIME_DIR={base / 'xdg'}",
                  "podman", "--root", str(base / "home" / "storage"),
                  "--runroot", str(base / "xdg" / "run"), "--tmpdir", str(base / "xdg" / "tmp"),
                  "--cgroup-manager", "cgroupfs", "--events-backend", "file"]
        info = subprocess.run([*client, "info"], capture_output=True, text=True, timeout=120)
        if info.returncode:
            pytest.skip(f"rootless podman cannot run on this machine: {info.stderr.strip()}")
        containers.build_image(client)
        yield client, uid
    finally:
        if client:
            left = subprocess.run([*client, "ps", "-aq"], capture_output=True, text=True,
                                  timeout=120).stdout.split()
            if left:
                subprocess.run([*client, "rm", "--force", "--time", "0", *left],
                               capture_output=True, timeout=120)
        owners = {uid, *(u for start, count in ranges[:1] for u in range(start, start + count))}
        owners.discard(-1)
        for pid in _processes_of(owners):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["userdel", "--force", name], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
        for path, mode in opened:
            path.chmod(mode)


def _open_path(*paths: Path) -> list[tuple[Path, int]]:
    """Add a+x to every directory above ``paths`` that lacks it (rootless Podman chmods, and
    so fails on, a parent of its storage without it); the ``(dir, mode)`` to put back."""
    changed = {}
    for path in paths:
        for parent in path.resolve().parents:
            mode = parent.stat().st_mode & 0o7777
            if mode & 0o111 != 0o111 and parent not in changed:
                changed[parent] = mode
                parent.chmod(mode | 0o111)
    return list(changed.items())


def _subordinate(table: str, name: str) -> tuple[int, int]:
    """``(start, count)`` of ``name``'s range in /etc/subuid or /etc/subgid."""
    for line in Path(table).read_text().splitlines():
        user, start, count = line.split(":")
        if user == name:
            return int(start), int(count)
    pytest.skip(f"useradd gave {name} no range in {table} (SUB_UID_COUNT in /etc/login.defs)")


def _processes_of(uids: set[int]) -> list[int]:
    """The pids of the processes whose real uid is in ``uids`` (from ``/proc/PID/status``:
    the owner of ``/proc/PID`` is root for a process that is not dumpable)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
            real = next(line for line in status if line.startswith("Uid:")).split()[1]
            if int(real) in uids:
                pids.append(int(pid))
    return pids


def test_rootless_podman_sees_its_execution_without_capabilities_network_or_escape(
        rootless, ramet, tmp_path_factory, tmp_path):
    """Container uid 65534 is the test's user on the host (``--userns keep-id``), which owns
    the execution; the rest of the container's uids are the user's subordinate range."""
    client, uid = rootless
    src = tmp_path_factory.mktemp("mine")  # the base, but the user's: it is not host 65534
    (src / "README").write_text("base\n")
    for path in (src, src / "README"):
        os.chown(path, uid, uid)
    mine = ramet.snapshot(src)
    ex, sibling = ramet.create(mine, owner=uid), ramet.create(mine)
    try:
        (sibling.path / "secret").write_text("sibling\n")
        keep_id = ["--userns", f"keep-id:uid={NOBODY},gid={NOBODY}"]
        docker = Docker(containers.IMAGE, docker=client, options=keep_id, env={"TOKEN": "t0"})
        absent = [str(ramet.mount), ramet.status()["data"], f"{sibling.path}/secret",
                  "/dev/fuse", str(tmp_path)]
        why = "2>&1 | sed 's/.*: //'"
        script = "; ".join([
            'id -u; id -g; pwd; cat README; echo "$TOKEN"; echo new > made',
            "grep -E '^(Cap|NoNewPrivs)' /proc/self/status",
            "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '",
            *(f"ls -d {path} {why}" for path in absent), f"touch /etc/escape {why}",
            "awk '$5 == \"/workspace\" {for (i = 7; $i != \"-\"; i++); print $4, $5, $(i + 1)}'"
            " /proc/self/mountinfo"])
        result = docker.run(ex, ["sh", "-c", script], timeout=120)
        assert (result.exit_code, result.timed_out) == (0, False), result.stderr
        assert result.stdout.splitlines() == [
            "65534", "65534", "/workspace", "base", "t0",
            *(f"Cap{kind}:\t{'0' * 16}" for kind in ("Inh", "Prm", "Eff", "Bnd", "Amb")),
            "NoNewPrivs:\t1", "lo", *["No such file or directory"] * len(absent),
            "Read-only file system", f"/executions/{ex.id} /workspace fuse.rametfs"]
        assert (ex.path / "made").read_text() == "new\n"
        assert os.stat(ex.path / "made").st_uid == uid  # the user, not a host 65534
        assert ex.diff() == [("A", "made")]
        assert sorted(os.listdir(sibling.path)) == ["README", "secret"]

        writer = "trap '' TERM HUP; while :; do echo x >> log; done"
        result = docker.run(ex, ["sh", "-c", f"setsid sh -c \"{writer}\" & echo started; "
                                 "sleep 600"], timeout=6)
        assert (result.timed_out, result.exit_code, result.stdout) == (True, 128 + 9,
                                                                      "started\n")
        size = os.stat(ex.path / "log").st_size
        assert size > 0
        time.sleep(0.2)  # a surviving writer would grow the log meanwhile
        assert os.stat(ex.path / "log").st_size == size
        assert subprocess.run([*client, "ps", "-aq"], capture_output=True, text=True,
                              check=True).stdout == ""
    finally:
        for each in (ex, sibling):
            ramet.release(each)
