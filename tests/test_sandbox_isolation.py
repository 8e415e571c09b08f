"""What the bubblewrap sandbox shows of the host (docs/security.md, "The bubblewrap sandbox").

The hostile-agent pass found two gaps: the sandbox reached host unix sockets (``--unshare-net``
does not cover path sockets, and every top-level host directory was bound read-only), and
``/proc/1/cmdline`` inside showed bwrap's whole argv (the mountpoint, the data directory, the
execution id).  Each test runs real bubblewrap as uid 65534 on a daemon served with
``--allow-other`` (or a fallback execution) and asserts the exact outcome.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import shutil
import socket
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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
    assert result.stdout == ("\n".join(sandbox_root()) + "\n\n/home:\n\n/media:\n\n/mnt:\n\n"
                             "/opt:\n\n"
                             "/root:\n\n/srv:\n\n/var:\ntmp\n\n1777 root\n1777 root\nx\n")
    # find printed no socket (it exits 1: some directories of /etc are closed to the uid)


def sandbox_root() -> list[str]:
    """The names ``ls -A /`` shows in the sandbox, sorted."""
    system = [name for name in SYSTEM if os.path.lexists(f"/{name}")]
    return sorted([*system, "dev", "home", "media", "mnt", "opt", "proc", "root", "run", "srv",
                   "tmp", "var", "workspace"])


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


# ----- 3. a hostile command against the harness and the host ---------------------------------

def test_a_secret_in_env_is_in_no_cmdline_on_the_host(ex):
    """``env=`` values reach the command's environment only: every ``/proc/*/cmdline`` of the
    host, read while the sandbox runs, lacks them (before ``--args``, bwrap's own cmdline,
    readable by every host uid, held ``--setenv TOKEN <value>``).  ``argv`` does show: it is
    the command's own cmdline."""
    secret, marker = f"secret-{os.urandom(8).hex()}", f"marker-{os.urandom(8).hex()}"
    script = (f": {marker}; touch ready; while [ ! -e go ]; do sleep 0.05; done; "
              'printf %s "$TOKEN"')
    argv = ["sh", "-c", script]
    sandbox = Bubblewrap(env={"TOKEN": secret})
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(sandbox.run, ex, argv, 30)
        try:
            deadline = time.monotonic() + 20
            while not (ex.path / "ready").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            cmdlines = host_cmdlines()
            shown = {pid: line for pid, line in cmdlines.items() if marker in line}
            environs = [environ(pid) for pid in shown]
        finally:
            (ex.path / "go").touch()
        result = running.result()
    assert (result.exit_code, result.stdout, result.stderr) == (0, secret, "")
    assert [pid for pid, line in cmdlines.items() if secret in line] == []
    # bwrap, its init in the sandbox (a fork of it), and the command setpriv became
    fd = min(shown.values()).split("\0")[2]  # bwrap's --args descriptor
    bwrap = "\0".join(["bwrap", "--args", fd, "--", *sandbox._drop(argv)]) + "\0"
    assert fd.isdigit() and sorted(shown.values()) == [bwrap, bwrap, "\0".join(argv) + "\0"]
    assert sum(f"TOKEN={secret}" in text for text in environs) == 1  # the command's own


def host_cmdlines() -> dict[str, str]:
    """``/proc/<pid>/cmdline`` of every host process (NUL-separated), as root sees them."""
    lines = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            lines[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    return lines


def environ(pid: str) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")


# Probe, as the sandbox's uid, what it can reach of processes and of the paths outside.
PROCESSES = r"""
import ctypes, errno, json, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
def outcome(call):
    try:
        return call()
    except OSError as e:
        return errno.errorcode[e.errno]
def ptrace_attach(pid):
    attached = libc.ptrace(16, pid, None, None) == 0  # PTRACE_ATTACH
    return "attached" if attached else errno.errorcode[ctypes.get_errno()]
host = int(sys.argv[1])  # a host process of the sandbox's uid
seen = {
    "pids": sorted(p for p in os.listdir("/proc") if p.isdigit()),
    "init root": outcome(lambda: os.readlink("/proc/1/root")),
    "init cwd": outcome(lambda: os.readlink("/proc/1/cwd")),
    "init root listing": outcome(lambda: os.listdir("/proc/1/root")),
    "init fds": outcome(lambda: os.listdir("/proc/1/fd")),
    "own root": os.readlink("/proc/self/root"),
    "own fds": {fd: outcome(lambda: os.readlink(f"/proc/self/fd/{fd}"))
                for fd in os.listdir("/proc/self/fd")},
    "above the workspace": outcome(lambda: sorted(os.listdir("/workspace/../.."))),
    "the mount's executions": outcome(lambda: os.listdir("/workspace/../executions")),
    "ptrace init": ptrace_attach(1),
    "kill init": outcome(lambda: os.kill(1, signal.SIGKILL)),
    "signal the host process": outcome(lambda: os.kill(host, 0)),
    "ptrace the host process": ptrace_attach(host),
    "kill everyone": outcome(lambda: os.kill(-1, signal.SIGKILL)),
}
print(json.dumps(seen))
"""


def test_processes_and_paths_outside_are_out_of_reach(ex):
    """``/proc/1`` (bwrap's init, root) and the host's processes: a host process of the
    sandbox's own uid is neither seen nor signalled, not even by ``kill(-1, SIGKILL)``; the
    sandbox's root is where ``..`` and ``/proc/self/root`` end."""
    host = subprocess.Popen(["sleep", "60"], user=NOBODY, group=NOBODY)
    try:
        result = Bubblewrap().run(ex, ["/usr/bin/python3", "-c", PROCESSES, str(host.pid)],
                                  timeout=30)
        assert (result.exit_code, result.stderr) == (0, "")
        assert host.poll() is None  # kill(-1) reached only the sandbox's processes
    finally:
        host.kill()
        host.wait()
    seen = json.loads(result.stdout)
    assert seen == {
        "pids": ["1", "2"], "init root": "EACCES", "init cwd": "EACCES",
        "init root listing": "EACCES", "init fds": "EACCES", "own root": "/",
        "own fds": {"0": "/dev/null", "1": seen["own fds"]["1"], "2": seen["own fds"]["2"],
                    "3": "ENOENT"},  # 3: the listing's own descriptor, closed by then
        "above the workspace": sandbox_root(), "the mount's executions": "ENOENT",
        "ptrace init": "EPERM", "kill init": "EPERM", "signal the host process": "ESRCH",
        "ptrace the host process": "ESRCH", "kill everyone": "ESRCH"}
    assert [seen["own fds"][fd][:6] for fd in "12"] == ["pipe:[", "pipe:["]


# A file handle for /etc and the descriptor it is opened with (open_by_handle_at(2): what
# "shocker" used to leave a container for any inode of the host file system), then, in a
# user namespace of the command's own (root there), an unmount of a bind and a mount over
# the workspace.  Prints each outcome.
HANDLES = r"""
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def outcome(result):
    return "ok" if result >= 0 else errno.errorcode[ctypes.get_errno()]
class FileHandle(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int),
                ("f_handle", ctypes.c_char * 128)]
handle, mount_id = FileHandle(128), ctypes.c_int()
named = libc.name_to_handle_at(-100, b"/etc", ctypes.byref(handle), ctypes.byref(mount_id), 0)
opened = libc.open_by_handle_at(os.open("/etc", os.O_RDONLY), ctypes.byref(handle), os.O_RDONLY)
print(os.getuid(), outcome(named), outcome(opened))
if sys.argv[1:] == ["userns"]:
    print(outcome(libc.umount2(b"/usr", 2)), outcome(libc.umount2(b"/workspace", 2)))
    print(outcome(libc.mount(b"none", b"/workspace", b"tmpfs", 0, None)))
    open("/workspace/over", "w").close()
    print(sorted(os.listdir("/workspace")))
"""


def test_file_handles_and_user_namespaces_leave_the_view_as_it_is(ex):
    """The kernel here lets a command create user namespaces (the sandbox has no user
    namespace of its own to forbid them in); root in one is root over nothing the sandbox
    shows: bwrap's binds are locked to the sandbox's mount namespace (umount: EINVAL), a
    mount changes only the new namespace's view, and ``open_by_handle_at`` needs
    CAP_DAC_READ_SEARCH in the file system's namespace (EPERM in both)."""
    plain = Bubblewrap().run(ex, ["/usr/bin/python3", "-c", HANDLES], timeout=30)
    nested = Bubblewrap().run(ex, ["unshare", "-Urm", "/usr/bin/python3", "-c", HANDLES,
                                   "userns"], timeout=30)
    assert (plain.exit_code, plain.stdout, plain.stderr) == (0, "65534 ok EPERM\n", "")
    assert (nested.exit_code, nested.stdout, nested.stderr) == (
        0, "0 ok EPERM\nEINVAL EINVAL\nok\n['over']\n", "")
    assert os.listdir(ex.path) == ["README"] and ex.diff() == []


# TIOCSTI (ioctl_tty(2)) pushes a byte into a terminal's input as if typed there: into the
# harness's shell, were the terminal the command's controlling one.
TIOCSTI = r"""
import errno, fcntl, os, termios
def outcome(call):
    try:
        call()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
print(outcome(lambda: fcntl.ioctl(0, termios.TIOCSTI, b"!")),
      outcome(lambda: os.open("/dev/tty", os.O_RDWR)))
"""


def test_a_terminal_of_the_harness_takes_no_injected_input(ex):
    """:meth:`Bubblewrap.command` run by hand on the harness's terminal (its controlling
    one): with bwrap's ``--new-session`` the command is in a session of its own, so TIOCSTI
    on the inherited terminal is EPERM and ``/dev/tty`` ENXIO; the same line without
    ``--new-session`` injects (``dev.tty.legacy_tiocsti`` is 1 here), as the control shows."""
    command = Bubblewrap().command(ex, ["/usr/bin/python3", "-c", TIOCSTI])
    assert "--new-session" in command
    assert on_a_terminal(command) == "EPERM ENXIO\n"
    if Path("/proc/sys/dev/tty/legacy_tiocsti").read_text() == "1\n":
        assert on_a_terminal([a for a in command if a != "--new-session"]) == "ok ok\n"


def on_a_terminal(argv: list[str]) -> str:
    """Run ``argv`` with a new pseudo-terminal as its stdin and controlling terminal; its
    stdout."""
    leader, follower = pty.openpty()
    try:
        result = subprocess.run(argv, stdin=follower, capture_output=True, text=True,
                                timeout=30, start_new_session=True,
                                preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    finally:
        os.close(follower)
        os.close(leader)
    assert (result.returncode, result.stderr) == (0, "")
    return result.stdout
