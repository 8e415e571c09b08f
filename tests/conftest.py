"""Fixtures for tests that mount the real filesystem through the kernel.

The daemon always runs as a subprocess through the CLI (``python -m rametfs serve ...
--background``), so a test may block in any syscall on the mount, restart or kill the daemon,
and run several mounts at once.  Clean-up follows the house rule: ``rametfs umount``; failing
that ``fusermount3 -u -z``, then SIGTERM, then SIGKILL of the daemon's own pid.

Fixtures:

- ``daemon``: a fresh daemon (own data dir and mountpoint) for one test.
- ``shared_daemon``: one daemon for the whole session, for tests that only need their own
  executions.
- ``allow_other_daemon``: one daemon served with ``--allow-other`` per test module.
- ``ramet``: a :class:`rametfs.Ramet` in each mode (parametrized): on the shared daemon
  (FUSE), or fallback mode forced on a data directory of the test's own; ``cli_where(ramet)``
  gives the CLI options that reach it.
- ``container_engine``: a private container engine for the whole session, parametrized:
  ``docker`` (a ``dockerd`` of its own) and ``podman`` (rootful, storage of its own), each
  with the image ``tools/containers.py`` builds from Debian packages (``sh``, coreutils,
  ``python3``); nothing is pulled from a registry.  Removed, its processes ended and its
  mounts gone, at the end of the session.
- a session janitor that lazily unmounts whatever is still mounted under pytest's basetemp.
- ``store``: a store of the test's own under ``tmp_path``, fsck'd clean and closed after it.
- ``fsck_clean``: ``fsck_clean(store)`` asserts that ``rametfs.store.fsck`` finds no problem
  in a store, its executions' layers included: the model and store fixtures call it at their
  teardown (a test that damages its store on purpose is marked ``corrupts_store``).

After a test, the log of its daemon must have no line containing ``Traceback``, `` ERROR ``
or ``WARNING`` unless the test allows it with ``@pytest.mark.allow_log(regex, ...)``; each
line is matched on its own (``re.search``), so allowing a logged exception means allowing its
traceback lines too.

Tests import helpers with ``from conftest import Daemon, run``.  Mounting needs /dev/fuse; the
mounted tests are skipped, with the reason, only when it is absent.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rametfs import Ramet, protocol
from rametfs.mounts import mount_table
from rametfs.store import Store, fsck

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 600
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30
BAD_LOG_LINE = re.compile(r"Traceback| ERROR |WARNING")


class RunError(subprocess.CalledProcessError):
    """A program exited non-zero; ``str()`` carries its output, so the test report shows it."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def run(*argv: str | os.PathLike, cwd=None, check: bool = True, env: dict | None = None,
        user: str | int | None = None) -> subprocess.CompletedProcess:
    """Run a real program (git, tar, cp ...) to completion, output captured as text.

    Raises :class:`RunError` (a ``CalledProcessError``) on a non-zero exit when ``check``,
    and ``subprocess.TimeoutExpired`` after 600 s.
    """
    argv = [os.fspath(a) for a in argv]
    proc = subprocess.run(argv, cwd=cwd, env=env, user=user, text=True, capture_output=True,
                          timeout=RUN_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise RunError(proc.returncode, argv, proc.stdout, proc.stderr)
    return proc


def wait_until(predicate, timeout_s: float, what: str) -> None:
    """Poll ``predicate()`` until true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a reparented daemon may stay one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def lazy_unmount(path: str | os.PathLike) -> subprocess.CompletedProcess:
    """``fusermount3 -u -z path``, without checking: the mount may already be gone."""
    return subprocess.run(["fusermount3", "-u", "-z", os.fspath(path)], text=True,
                          capture_output=True, timeout=RUN_TIMEOUT_S)


def read_reply(fd: int) -> dict:
    """Read a control reply back from an open ``ctl`` descriptor, from offset 0 to EOF."""
    data = b""
    while chunk := os.pread(fd, 65536, len(data)):
        data += chunk
    return protocol.decode_reply(data)


def ctl_command(path: Path, line: str) -> dict:
    """Write one command to the ``ctl`` file at ``path``; return its JSON reply.

    On failure the ``OSError`` of the write (errno as the daemon chose it) is re-raised with
    the reply attached as ``exc.reply`` (``{"ok": false, "errno": ..., "error": ...}``).
    """
    if not line.endswith("\n"):
        line += "\n"
    fd = os.open(path, os.O_RDWR)
    try:
        try:
            written = os.write(fd, line.encode())
        except OSError as exc:
            exc.reply = read_reply(fd)
            raise
        assert written == len(line.encode()), f"short write to {path}: {written}"
        return read_reply(fd)
    finally:
        os.close(fd)


class Daemon:
    """One rametfs daemon run through the CLI: ``Daemon(data_dir, mountpoint).start()``.

    Each start logs to its own file next to the data dir (``<data>.log.1``, ``.2`` ...), so
    :meth:`log_text` covers every run whatever ``--log`` does with an existing file.
    """

    def __init__(self, data_dir: str | os.PathLike, mountpoint: str | os.PathLike,
                 serve_args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.data_dir = Path(data_dir)
        self._mnt = Path(mountpoint)
        self.serve_args = tuple(serve_args)  # extra ``serve`` flags, e.g. ("--allow-other",)
        self.env = {**os.environ, **(env or {})}  # the daemon's environment
        self.pid: int | None = None
        self._logs: list[Path] = []
        self._runs = itertools.count(1)

    def __repr__(self) -> str:
        return f"Daemon(data={str(self.data_dir)!r}, mnt={str(self._mnt)!r}, pid={self.pid})"

    @property
    def mnt(self) -> Path:
        return self._mnt

    def _python_m(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rametfs", *args], text=True,
                              capture_output=True, timeout=timeout, env=self.env)

    def start(self) -> None:
        """Mount in the background; returns once mounted with :attr:`pid` read from status.
        Fails a test not marked ``kernel`` (the unit level mounts nothing)."""
        assert self.pid is None, f"{self!r} is already running"
        if _running and _running[-1].get_closest_marker("kernel") is None:
            pytest.fail(f"{_running[-1].nodeid} mounts rametfs but is not marked kernel "
                        "(conftest.KERNEL_FIXTURES, or @pytest.mark.kernel)", pytrace=False)
        self._mnt.mkdir(parents=True, exist_ok=True)
        log = self.data_dir.with_name(f"{self.data_dir.name}.log.{next(self._runs)}")
        self._logs.append(log)
        proc = self._python_m("serve", "--data", str(self.data_dir), str(self._mnt),
                              "--background", "--log", str(log), *self.serve_args,
                              timeout=START_TIMEOUT_S)
        assert proc.returncode == 0, (
            f"rametfs serve exited {proc.returncode}\n--- stdout\n{proc.stdout}"
            f"\n--- stderr\n{proc.stderr}\n--- log\n{self.log_text()}")
        wait_until(lambda: os.path.ismount(self._mnt), START_TIMEOUT_S, f"{self._mnt} mounted")
        self.pid = self.status()["pid"]

    def stop(self) -> None:
        """Unmount cleanly and wait for the daemon to exit.

        If ``rametfs umount`` fails or the daemon outlives it, falls back to a lazy unmount,
        SIGTERM and SIGKILL, then raises AssertionError saying what went wrong.
        """
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        problems = []
        try:
            proc = self._python_m("umount", str(self._mnt), timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            problems.append(f"rametfs umount took more than {STOP_TIMEOUT_S} s")
        else:
            if proc.returncode != 0:
                problems.append(f"rametfs umount exited {proc.returncode}: {proc.stderr}")
        if not problems:
            try:
                wait_until(lambda: not pid_alive(pid), STOP_TIMEOUT_S, f"daemon {pid} to exit")
            except AssertionError as exc:
                problems.append(str(exc))
        if problems:
            lazy_unmount(self._mnt)
            _end_process(pid)
            raise AssertionError(f"{self!r} (was pid {pid}) did not stop cleanly: "
                                 f"{'; '.join(problems)}")
        assert not os.path.ismount(self._mnt), f"{self._mnt} still mounted after stop"

    def kill(self) -> None:
        """SIGKILL the daemon (a crash), lazily unmount, wait until the pid is gone."""
        assert self.pid is not None, f"{self!r} is not running"
        pid, self.pid = self.pid, None
        os.kill(pid, signal.SIGKILL)
        lazy_unmount(self._mnt)
        wait_until(lambda: not pid_alive(pid), STOP_TIMEOUT_S, f"daemon {pid} to die")

    def restart(self) -> None:
        self.stop()
        self.start()

    def is_alive(self) -> bool:
        return self.pid is not None and pid_alive(self.pid) and os.path.ismount(self._mnt)

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self._logs if p.exists())

    def status(self) -> dict:
        """The root ``.ramet/status`` JSON."""
        return json.loads((self._mnt / protocol.CONTROL_DIR / protocol.STATUS).read_text())

    def exec_status(self, exec_id: str) -> dict:
        """An execution's ``.ramet/status`` JSON."""
        return json.loads((self.exec_path(exec_id) / protocol.CONTROL_DIR
                           / protocol.STATUS).read_text())

    def exec_path(self, exec_id: str) -> Path:
        return self._mnt / protocol.EXECUTIONS_DIR / exec_id

    def snap_path(self, snap_id: str) -> Path:
        return self._mnt / protocol.SNAPSHOTS_DIR / snap_id

    def ctl(self, line: str) -> dict:
        """Run a root command (see :func:`ctl_command` for the reply and errors)."""
        return ctl_command(self._mnt / protocol.CONTROL_DIR / protocol.CTL, line)

    def exec_ctl(self, exec_id: str, line: str) -> dict:
        """Run a command on one execution (see :func:`ctl_command`)."""
        return ctl_command(self.exec_path(exec_id) / protocol.CONTROL_DIR / protocol.CTL, line)

    def snapshot(self, src: str | os.PathLike, label: str | None = None) -> str:
        """Snapshot the tree at ``src``; returns the snapshot id."""
        line = protocol.format_command("snapshot", os.path.abspath(src), label=label)
        return self.ctl(line)["snapshot"]

    def create(self, snap: str) -> str:
        """Create an execution of snapshot ``snap``; returns the execution id."""
        return self.ctl(protocol.format_command("create", snap))["execution"]


def _end_process(pid: int) -> None:
    """SIGTERM, then SIGKILL after a grace period; returns once ``pid`` is gone."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        try:
            wait_until(lambda: not pid_alive(pid), STOP_TIMEOUT_S / 3, f"{pid} to end")
            return
        except AssertionError:
            continue


def bad_log_lines(text: str, allowed: list[str]) -> list[str]:
    """Lines of ``text`` that look like trouble and that no ``allowed`` regex matches."""
    patterns = [re.compile(a) for a in allowed]
    return [line for line in text.splitlines()
            if BAD_LOG_LINE.search(line) and not any(p.search(line) for p in patterns)]


def allowed_log(request) -> list[str]:
    return [regex for m in request.node.iter_markers("allow_log") for regex in m.args]


def check_log(text: str, allowed: list[str], who: str) -> None:
    bad = bad_log_lines(text, allowed)
    if bad:
        pytest.fail(f"{who} logged {len(bad)} unexpected line(s):\n" + "\n".join(bad),
                    pytrace=False)


def require_fuse() -> None:
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is absent: these tests mount rametfs through the kernel")


def require_bwrap() -> None:
    if os.geteuid() != 0 or not shutil.which("bwrap"):
        pytest.skip("bubblewrap sandboxes need root and bwrap (Debian package bubblewrap)")


def load_tool(name: str):
    """The module ``tools/<name>.py`` (tools/ is not a package, nor on the import path)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


containers = load_tool("containers")


def require_container_engine(name: str) -> None:
    """Skip unless root may run engine ``name`` (docker or podman): its program installed."""
    program, package = {"docker": ("dockerd", "docker.io"), "podman": ("podman", "podman")}[name]
    if os.geteuid() != 0 or not shutil.which(program):
        pytest.skip(f"{name} tests need root and {program} (Debian package {package}, "
                    "installed by tools/setup test)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "allow_log(regex, ...): daemon log lines matching a regex may contain "
                   "Traceback, ' ERROR ' or WARNING without failing the test")
    config.addinivalue_line(
        "markers", "kernel: mounts rametfs through the kernel (set by the fixtures a test "
                   "uses, or by its module); `-m 'not kernel'` runs the unit level")
    config.addinivalue_line(
        "markers", "slow: a system test (sandboxes, containers, demos, workloads, remote "
                   "services, benchmark smoke); `-m 'not slow'` leaves them out")
    config.addinivalue_line(
        "markers", "corrupts_store: the test damages its store on purpose: its fixtures skip "
                   "the fsck at their teardown (fsck_clean)")


# The levels (docs/testing.md): a test is at the kernel level when it uses one of these
# fixtures, is the "fuse" case of a test parametrized over both modes, or its module says
# so (``pytestmark``); the modules of SYSTEM_MODULES are system tests, marked slow as well.
KERNEL_FIXTURES = {"daemon", "shared_daemon", "allow_other_daemon", "container_engine",
                   "faulty", "bounded", "held_work", "_other_users_daemon", "own_daemon",
                   "mode_daemon"}
SYSTEM_MODULES = {"test_bench_smoke", "test_containers", "test_demo_best_of_n",
                  "test_langgraph_example", "test_newcomer", "test_remote", "test_rollouts",
                  "test_sandbox", "test_sandbox_isolation", "test_workloads"}


_running: list[pytest.Item] = []  # the test being set up, run or torn down


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


def pytest_collection_modifyitems(config, items):
    # The modules that run container engines go last: Podman's pause process (catatonit)
    # and conmon live for the session, and every mount made while they live is copied into
    # their namespaces, where it outlives a later test's unmount (umount exits 5, EBUSY).
    engines = {item.module.__name__ for item in items
               if "container_engine" in item.fixturenames}
    items.sort(key=lambda item: item.module.__name__ in engines)  # stable: order kept
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        fuse = getattr(item, "callspec", None) is not None and \
            any(isinstance(v, str) and v == "fuse" for v in item.callspec.params.values())
        if module in SYSTEM_MODULES:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.kernel)
        elif fuse or KERNEL_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.kernel)


@pytest.fixture
def fsck_clean(request):
    """``check(store)``: fsck of ``store`` (snapshots and executions' layers) finds nothing
    wrong, unless the test is marked ``corrupts_store``."""
    def check(store) -> None:
        if request.node.get_closest_marker("corrupts_store") is None:
            assert fsck(store).problems == []
    return check


@pytest.fixture
def store(tmp_path, fsck_clean):
    """A store of the test's own under ``tmp_path``, closed after fsck found it clean."""
    s = Store(tmp_path / "data")
    yield s
    fsck_clean(s)
    s.close()


@pytest.fixture
def daemon(tmp_path, request):
    """A freshly started daemon of its own (data dir and mountpoint under ``tmp_path``)."""
    require_fuse()
    d = Daemon(tmp_path / "data", tmp_path / "mnt")
    d.start()
    yield d  # pytest resumes here whatever the test's outcome
    try:
        d.stop()
    finally:
        check_log(d.log_text(), allowed_log(request), repr(d))


@pytest.fixture(scope="session")
def _shared_daemon(tmp_path_factory):
    """``(daemon, state)``; ``state["checked"]``: length of the log already checked."""
    require_fuse()
    base = tmp_path_factory.mktemp("shared")
    d = Daemon(base / "data", base / "mnt")
    d.start()
    state = {"checked": 0}
    yield d, state
    try:
        d.stop()
    finally:
        # What the tests logged was checked after each; what is left is the shutdown.
        check_log(d.log_text()[state["checked"]:], [], f"shared {d!r} at shutdown")


@pytest.fixture
def shared_daemon(_shared_daemon, request):
    """One daemon for the whole session; each test checks the log lines logged during it.

    A test that leaves it dead fails, and the daemon is started again for the next test.
    """
    d, state = _shared_daemon
    if not d.is_alive():
        pytest.fail(f"shared {d!r} is not running (an earlier test killed it?)")
    state["checked"] = len(d.log_text())
    yield d
    alive = d.is_alive()
    if not alive:
        if d.pid is not None:
            _end_process(d.pid)
            d.pid = None
        lazy_unmount(d.mnt)
        d.start()
    text = d.log_text()
    new, state["checked"] = text[state["checked"]:], len(text)
    check_log(new, allowed_log(request), f"shared {d!r}")
    if not alive:
        pytest.fail(f"the shared daemon died during the test (started again); its log:\n{new}",
                    pytrace=False)


@contextlib.contextmanager
def serving(base: Path, serve_args: tuple[str, ...] = (), allowed: list[str] = ()
            ) -> Iterator[Daemon]:
    """A daemon of its own under ``base`` (``rametfs serve ... *serve_args``), stopped at the
    end, whose whole log is then checked (``allowed``: regexes, as ``allow_log``)."""
    require_fuse()
    d = Daemon(base / "data", base / "mnt", serve_args=serve_args)
    d.start()
    try:
        yield d
    finally:
        d.stop()
        check_log(d.log_text(), list(allowed), repr(d))


@pytest.fixture(scope="module")
def allow_other_daemon(tmp_path_factory):
    """A daemon served with ``--allow-other`` for one test module, so that commands run as
    another uid (a sandbox's 65534) may enter its executions; its log is checked at the end."""
    with serving(tmp_path_factory.mktemp("allow-other"), ("--allow-other",)) as d:
        yield d


def sandbox_project(ramet: Ramet, src: Path) -> str:
    """Snapshot a small project at ``src`` (``README``, ``pkg/mod.py``) owned by uid 65534,
    the sandboxes' uid, so that a sandboxed command may change it; its snapshot id."""
    (src / "README").write_text("base\n")
    (src / "pkg").mkdir()
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    for path in (src, src / "README", src / "pkg", src / "pkg" / "mod.py"):
        os.chown(path, 65534, 65534)
    return ramet.snapshot(src)


@pytest.fixture(scope="session", params=["docker", "podman"])
def container_engine(request, tmp_path_factory):
    """A running engine (``containers.Dockerd`` or ``containers.Podman``: ``client``, the
    client and its global options; ``options``, the create options this machine needs;
    ``containers()``) holding :data:`containers.IMAGE`.  Skipped, with the reason, without
    root, without the program (Debian package docker.io or podman, which ``tools/setup
    test`` installs), or when the engine cannot start here; stopped at the end, which fails
    the session's last test if a container, process or mount was left."""
    require_container_engine(request.param)
    base = tmp_path_factory.mktemp(request.param)
    engine = (containers.Dockerd if request.param == "docker" else containers.Podman)(base)
    try:
        engine.start()
    except containers.EngineError as exc:
        pytest.skip(f"{request.param} cannot run on this machine: {exc}")
    try:
        containers.build_image(engine.client)
        yield engine
    finally:
        engine.stop()


@pytest.fixture(params=["fuse", "fallback"])
def ramet(request, tmp_path):
    """The wrapper in each mode: ``Ramet`` on the shared daemon's mount, or
    ``Ramet(data=tmp_path / "data", mode="fallback")`` (forced, although this host has
    /dev/fuse), closed after the test."""
    if request.param == "fuse":
        yield Ramet(request.getfixturevalue("shared_daemon").mnt)
    else:
        with Ramet(data=tmp_path / "data", mode="fallback") as r:
            yield r


def cli_where(ramet: Ramet) -> list[str]:
    """The CLI options that reach ``ramet``: ``-m MNT``, or ``--mode fallback --data DIR``."""
    if ramet.mode == "fuse":
        return ["-m", str(ramet.mount)]
    return ["--mode", "fallback", "--data", str(ramet.data)]


def _mounts_under(base: str) -> list[tuple[str, str]]:
    """(mountpoint, fstype) of the mounts at or under ``base``, deepest first."""
    found = [(m.point, m.fstype) for m in mount_table()
             if m.point == base or m.point.startswith(base + "/")]
    return sorted(found, key=lambda m: len(m[0]), reverse=True)


@pytest.fixture(scope="session", autouse=True)
def _janitor(tmp_path_factory):
    """At session end, lazily unmount anything still mounted under pytest's basetemp."""
    yield
    base = os.path.realpath(tmp_path_factory.getbasetemp())
    for point, fstype in _mounts_under(base):
        print(f"\njanitor: lazily unmounting leftover {fstype} mount {point}", file=sys.stderr)
        if fstype.startswith("fuse"):
            lazy_unmount(point)
        else:
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=RUN_TIMEOUT_S)
