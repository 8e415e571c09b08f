"""What the bubblewrap sandbox shows of the host (docs/security.md, "The bubblewrap sandbox").

The hostile-agent pass found two gaps: the sandbox reached host unix sockets (``--unshare-net``
does not cover path sockets, and every top-level host directory was bound read-only), and
``/proc/1/cmdline`` inside showed bwrap's whole argv (the mountpoint, the data directory, the
execution id).  Each test runs real bubblewrap as uid 65534 on a daemon served with
``--allow-other`` (or a fallback execution) and asserts the exact outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import require_bwrap
from rametfs import Ramet
from rametfs.sandbox import Bubblewrap
from rametfs.sandbox.bubblewrap import SYSTEM

NOBODY = 65534
ROOT = Path(__file__).resolve().parents[1]  # the checkout
HELLO = b"hello from the sandbox"

# Connect to the unix socket argv[1] ("@name": abstract) and send HELLO; print the outcome.
CONNECT = f"""
import errno, socket, sys
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX)
try:
    s.connect("\\0" + path[1:] if path.startswith("@") else path)
    s.sendall({HELLO!r})
    print("connected")
except OSError as e:
    print(errno.errorcode[e.errno])
"""

# Every process's cmdline and our own, then the open descriptors, as JSON.
CMDLINES = r"""
import json, os
lines = {pid: open(f"/proc/{pid}/cmdline", "rb").read().decode()
         for pid in os.listdir("/proc") if pid.isdigit()}
lines["self"] = open("/proc/self/cmdline", "rb").read().decode()
try:
    open("/proc/1/environ", "rb").read()
    environ = "read"
except OSError as e:
    environ = e.strerror
print(json.dumps({"cmdlines": lines, "fds": sorted(os.listdir("/proc/self/fd")),
                  "environ": environ}))
"""


@pytest.fixture(scope="module")
def ramet(allow_other_daemon):
    require_bwrap()
    return Ramet(allow_other_daemon.mnt)


@pytest.fixture(scope="module")
def base(ramet, tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    (src / "README").write_text("base\n")
    os.chown(src, NOBODY, NOBODY)
    return ramet.snapshot(src)


@pytest.fixture
def ex(ramet, base):
    execution = ramet.create(base, owner=NOBODY)
    yield execution
    ramet.release(execution)


@contextlib.contextmanager
def host_dir(parent: str | os.PathLike) -> Iterator[Path]:
    """A new directory in ``parent``, mode 0755 (any uid may look inside), removed after."""
    path = Path(tempfile.mkdtemp(prefix="rametfs-iso-", dir=parent))
    try:
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path)


@contextlib.contextmanager
def listening(address: str) -> Iterator[socket.socket]:
    """A unix stream socket listening at ``address`` (a path, mode 0777, or ``"@name"``:
    abstract), not blocking."""
    with socket.socket(socket.AF_UNIX) as server:
        abstract = address.startswith("@")
        server.bind("\0" + address[1:] if abstract else address)
        if not abstract:
            os.chmod(address, 0o777)
        server.listen()
        server.setblocking(False)
        yield server


def received(server: socket.socket) -> bytes | None:
    """What the one pending connection sent (its peer has closed it), or None: none came."""
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return None
    with conn:
        conn.settimeout(10)
        return conn.recv(1024)


def connect(execution, address: str, **options) -> str:
    result = Bubblewrap(**options).run(execution, ["/usr/bin/python3", "-c", CONNECT, address],
                                       timeout=30)
    assert (result.exit_code, result.stderr) == (0, "")
    return result.stdout


def sh(execution, script: str, **options):
    return Bubblewrap(**options).run(execution, ["sh", "-c", script], timeout=30)


# ----- 1. nothing of the host but what a command needs to run --------------------------------

@pytest.mark.parametrize("where", ["/var/tmp", "/tmp", "checkout"])
def test_host_unix_sockets_are_out_of_reach(ex, where):
    """The issue's case: a socket at mode 0777 in a directory any uid may enter, under
    ``/var/tmp``, ``/tmp`` and the checkout (``/work/...`` here)."""
    with host_dir(ROOT if where == "checkout" else where) as directory:
        path = str(directory / "sock")
        with listening(path) as server:
            seen = connect(ex, path)
            assert (seen, received(server)) == ("ENOENT\n", None)
            # the same socket from the host, as uid 65534: the sandbox is what stops it (unless
            # a directory above, such as a home of mode 0700, keeps that uid out anyway)
            if all(os.stat(p).st_mode & 0o001 for p in directory.parents):
                assert connect_on_host(path) == "connected\n" and received(server) == HELLO


def connect_on_host(path: str) -> str:
    """Run :data:`CONNECT` on the host as uid 65534."""
    return subprocess.run(["/usr/bin/python3", "-c", CONNECT, path], user=NOBODY, group=NOBODY,
                          capture_output=True, text=True, timeout=30, check=True).stdout


def test_abstract_sockets_are_reachable_only_with_the_host_network(ex):
    """Abstract unix sockets belong to a network namespace: out of reach by default, reachable
    with ``network=True`` (the host's namespace)."""
    with listening(f"@rametfs-iso-{os.getpid()}") as server:
        assert (connect(ex, f"@rametfs-iso-{os.getpid()}"), received(server)) == (
            "ECONNREFUSED\n", None)
        assert (connect(ex, f"@rametfs-iso-{os.getpid()}", network=True), received(server)) == (
            "connected\n", HELLO)


def test_the_root_holds_only_the_system_directories(ex):
    result = sh(ex, "ls -A /; echo; ls -A /home /root /srv /mnt /media /opt /var; echo; "
                    "stat -c '%a %U' /var/tmp /tmp; echo x > /var/tmp/x && cat /var/tmp/x; "
                    "find / -path /proc -prune -o -type s -print 2>/dev/null")
    system = sorted(name for name in SYSTEM if os.path.lexists(f"/{name}"))
    top = sorted([*system, "dev", "home", "media", "mnt", "opt", "proc", "root", "run", "srv",
                  "tmp", "var", "workspace"])
    assert result.stdout == ("\n".join(top) + "\n\n/home:\n\n/media:\n\n/mnt:\n\n/opt:\n\n"
                             "/root:\n\n/srv:\n\n/var:\ntmp\n\n1777 root\n1777 root\nx\n")
    # find printed no socket (it exits 1: some directories of /etc are closed to the uid)


def test_ro_binds_show_a_host_path_read_only_and_nothing_else(ex):
    with host_dir("/var/tmp") as directory:
        shown, sibling = directory / "shown", directory / "sibling"
        for path in (shown, sibling):
            path.mkdir()
        (shown / "file").write_text("visible\n")
        (sibling / "secret").write_text("hidden\n")
        with listening(str(shown / "sock")) as server:
            result = sh(ex, f"cat {shown}/file; ls -A {directory}; touch {shown}/new; "
                            f"ls {sibling}; ls -A /var", ro_binds=[shown])
            # a socket in a path the harness binds is reachable: read-only stops no connect
            bound = connect(ex, str(shown / "sock"), ro_binds=[shown])
            assert (bound, received(server)) == ("connected\n", HELLO)
        assert (result.exit_code, result.stdout, result.stderr) == (
            0, "visible\nshown\ntmp\n",
            f"touch: cannot touch '{shown}/new': Read-only file system\n"
            f"ls: cannot access '{sibling}': No such file or directory\n")
        assert sorted(os.listdir(shown)) == ["file", "sock"]
    assert Bubblewrap(ro_binds=["/opt/", "/usr/share/doc/../doc"]).ro_binds == [
        "/opt", "/usr/share/doc"]


def test_a_virtual_environment_runs_with_its_two_ro_binds(ex):
    """The checkout's venv python (docs/integrations.md): absent by default; with the
    environment and the interpreter it links to bound, it runs and imports its packages."""
    argv = [sys.executable, "-c", "import sys, click; print(sys.prefix, click.__name__)"]
    absent = Bubblewrap().run(ex, argv, timeout=30)
    assert (absent.exit_code, absent.stderr) == (
        127, f"setpriv: failed to execute {sys.executable}: No such file or directory\n")
    bound = Bubblewrap(ro_binds=[sys.prefix, sys.base_prefix]).run(ex, argv, timeout=60)
    assert (bound.exit_code, bound.stdout, bound.stderr) == (0, f"{sys.prefix} click\n", "")


def test_ro_binds_that_overlap_the_mount_or_the_data_dir_are_refused(ramet, ex, tmp_path):
    mnt, data = str(ramet.mount), ramet.status()["data"]
    link = tmp_path / "link"
    link.symlink_to(Path(data) / "store")
    cases = [
        (mnt, f"ro_binds: {mnt} contains the rametfs mount {mnt}"),
        (f"{mnt}/snapshots", f"ro_binds: {mnt}/snapshots is inside the rametfs mount {mnt}"),
        (os.path.dirname(mnt), f"ro_binds: {os.path.dirname(mnt)} contains the rametfs mount "
                               f"{mnt}"),
        (data, f"ro_binds: {data} contains the data directory {data}"),
        (f"{data}/store", f"ro_binds: {data}/store is inside the data directory {data}"),
        (str(link), f"ro_binds: {link} (that is {data}/store) is inside the data directory "
                    f"{data}"),
        ("/", f"ro_binds: / contains the rametfs mount {mnt}"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError) as caught:
            Bubblewrap(ro_binds=[path]).run(ex, ["true"])
        assert str(caught.value) == (f"{message}: the sandbox must not reach it (docs/"
                                     "security.md, \"The bubblewrap sandbox\")")
    assert ex.status()["runtime"] is None  # refused before anything was recorded or run
    for path in ("/workspace/x", "relative"):
        with pytest.raises(ValueError) as caught:
            Bubblewrap(ro_binds=[path])
        assert str(caught.value) == (f"ro_binds takes absolute host paths outside /workspace, "
                                     f"not {path!r}")


def test_a_fallback_data_dir_is_refused_too(tmp_path):
    require_bwrap()
    (tmp_path / "src").mkdir()
    with Ramet(data=tmp_path / "data", mode="fallback") as ramet:
        ex = ramet.create(ramet.snapshot(tmp_path / "src"))
        with pytest.raises(ValueError) as caught:
            Bubblewrap(ro_binds=[tmp_path]).run(ex, ["true"])
        assert str(caught.value) == (
            f"ro_binds: {tmp_path} contains the data directory {tmp_path / 'data'}: the "
            "sandbox must not reach it (docs/security.md, \"The bubblewrap sandbox\")")


# ----- 2. what the sandbox sees of the harness ------------------------------------------------

def test_no_cmdline_shows_the_mount_the_data_dir_or_the_execution(ramet, ex):
    argv = ["/usr/bin/python3", "-c", CMDLINES]
    result = Bubblewrap().run(ex, argv, timeout=30)
    assert result.exit_code == 0, result.stderr
    seen = json.loads(result.stdout)
    cmdlines = seen["cmdlines"]
    secrets = [str(ramet.mount), ramet.status()["data"], ex.id]
    assert [(pid, s) for pid, line in cmdlines.items() for s in secrets if s in line] == []
    init = cmdlines.pop("1").split("\0")
    assert init[:2] == ["bwrap", "--args"] and init[2].isdigit()
    assert init[3:] == ["--", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
                        *argv, ""]
    command = "\0".join(argv) + "\0"
    assert cmdlines == {"2": command, "self": command}
    # bwrap's environment is root's; the --args descriptor is closed before the command runs
    assert (seen["environ"], seen["fds"]) == ("Permission denied", ["0", "1", "2", "3"])


def mountinfo(text: str) -> list[tuple[str, str, str, str]]:
    """``(root, mount point, fstype, source)`` of each line of a mountinfo (proc(5))."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        rest = fields[fields.index("-") + 1:]
        mounts.append((fields[3], fields[4], rest[0], rest[1]))
    return mounts


def sandbox_mounts(execution) -> list[tuple[str, str, str, str]]:
    """The sandbox's mounts (:func:`mountinfo`) but those under /dev and /proc (bwrap's
    own: devtmpfs nodes, devpts, proc)."""
    result = sh(execution, "cat /proc/self/mountinfo")
    assert result.exit_code == 0, result.stderr
    return [m for m in mountinfo(result.stdout) if m[1].split("/")[1] not in ("dev", "proc")]


def as_bound(path: str) -> list[tuple[str, str, str, str]]:
    """What a bind of host ``path`` at the same path shows: its root is the path within
    the host file system that holds it, then the host mounts below it (a bind takes them
    along), each as the host shows it."""
    with open("/proc/self/mountinfo") as f:
        host = mountinfo(f.read())
    root, point, fstype, source = max(
        (m for m in host if os.path.commonpath([m[1], path]) == m[1]), key=lambda m: len(m[1]))
    inside = os.path.normpath(os.path.join(root, os.path.relpath(path, point)))
    return [(inside, path, fstype, source)] + [m for m in host if m[1].startswith(path + "/")]


def test_mountinfo_shows_the_execution_only_as_its_path_in_rametfs(ramet, ex):
    """What cannot be hidden: a bind's root field is the bound directory's path within its
    own file system, so the workspace line reads ``/executions/<id>``; the mountpoint and the
    data directory appear nowhere (nothing covers them: they are not in the sandbox)."""
    mounts = sandbox_mounts(ex)
    system = [f"/{name}" for name in SYSTEM
              if os.path.lexists(f"/{name}") and not os.path.islink(f"/{name}")]
    assert sorted(mounts) == sorted(
        [("/newroot", "/", "tmpfs", "tmpfs")] + [m for path in system for m in as_bound(path)]
        + [("/", "/var", "tmpfs", "tmpfs"), ("/", "/tmp", "tmpfs", "tmpfs"),
           ("/", "/run", "tmpfs", "tmpfs"),
           (f"/executions/{ex.id}", "/workspace", "fuse.rametfs", "rametfs")])
    text = repr(mounts)
    assert str(ramet.mount) not in text and ramet.status()["data"] not in text


def test_mountinfo_of_a_fallback_execution_shows_its_host_path(tmp_path):
    """In fallback mode the execution is a host directory: its line's root field is its path
    within the host file system, ``<data>/fallback/executions/<id>`` when the data directory
    is on the file system of ``/`` (here), which no bind can hide."""
    require_bwrap()
    (tmp_path / "src").mkdir()
    os.chown(tmp_path / "src", NOBODY, NOBODY)
    with Ramet(data=tmp_path / "data", mode="fallback") as ramet:
        ex = ramet.create(ramet.snapshot(tmp_path / "src"))
        workspace, = [m for m in sandbox_mounts(ex) if m[1] == "/workspace"]
        root, _, fstype, source = as_bound(str(ex.path))[0]
        assert workspace == (root, "/workspace", fstype, source)
        assert workspace[0].endswith(f"/data/fallback/executions/{ex.id}")
