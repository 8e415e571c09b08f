"""A private Docker engine and a container image built from Debian packages, no registry.

Used by the tests (tests/conftest.py), ``tools/demo-best-of-n --runtime docker|podman`` and
``tools/bench-episodes``; by hand (as root, from the checkout)::

    .venv/bin/python tools/containers.py start DIR    # prints the engine's -H address
    .venv/bin/python tools/containers.py image DIR [NAME]
    .venv/bin/python tools/containers.py stop DIR
    .venv/bin/python tools/containers.py tar [--busybox] > rootfs.tar

:class:`Dockerd` runs ``dockerd`` (Debian package ``docker.io``) as root with everything of
its own under one directory: ``--data-root DIR/data``, ``--exec-root`` a short directory under
``/run`` (its containerd socket path must fit in 108 bytes), ``-H unix://DIR/docker.sock``,
no iptables rules and no bridge (the containers get ``--network none``), and containerd
namespaces named after the directory so that a system containerd it may share keeps its own
containers apart.  :meth:`Dockerd.stop` removes every container, ends dockerd and its
containerd by pid and checks that no mount of theirs is left.

:func:`image_tar` writes a root file system as a tar stream: the files of installed Debian
packages (``dpkg -L``; docs, man pages, locales and gconv left out) on a merged ``/usr``, and
busybox's applets as symlinks: with :data:`PACKAGES` about 40 MB holding ``sh``, the
coreutils and ``python3`` with its standard library; with busybox-static alone
(``tar --busybox``) 2 MB.  :func:`build_image` pipes it into ``CLIENT import - NAME``; so does
``podman import``.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

IMAGE = "rametfs-sandbox:debian"
BUSYBOX = "/bin/busybox"  # busybox-static's, a static binary: needs no library
PYTHON = os.path.basename(os.path.realpath("/usr/bin/python3"))  # Debian's: python3.11 on 12
PACKAGES = ("busybox-static", "libc6", "zlib1g", "libexpat1", f"{PYTHON}-minimal",
            f"lib{PYTHON}-minimal", f"lib{PYTHON}-stdlib", "python3-minimal", "libsqlite3-0")
SKIPPED = ("usr/share/doc/", "usr/share/man/", "usr/share/lintian/", "usr/share/locale/",
           "usr/share/info/", "usr/lib/x86_64-linux-gnu/gconv/", "usr/share/initramfs-tools/")
MERGED = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30
CLIENT_TIMEOUT_S = 120
ULIMIT = 4096  # open files and processes of a Podman container (Podman.options)


class EngineError(RuntimeError):
    """dockerd did not start or stop as it should; the message says what and shows its log."""


def image_tar(out: io.RawIOBase, packages: Sequence[str] = PACKAGES) -> None:
    """Write to ``out`` an uncompressed tar of a root file system made of the installed
    Debian ``packages`` (they must include busybox-static).

    Every path is put where a merged ``/usr`` has it (``/bin/busybox`` at
    ``usr/bin/busybox``, with ``bin -> usr/bin`` and the like); busybox's applets that no
    package file shadows become symlinks to it; ``tmp`` and ``workspace`` are empty
    directories.  Python's ``__pycache__`` files of the included modules come along, so
    imports in a read-only container need not compile.  Raises CalledProcessError when a
    package is not installed.
    """
    files = _package_files(packages)
    applets = subprocess.run([BUSYBOX, "--list-full"], capture_output=True, text=True,
                             check=True).stdout.split()
    with tarfile.open(fileobj=out, mode="w|") as tar:
        for name in ("usr", "usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "etc", "tmp",
                     "workspace", "proc", "sys", "dev"):
            tar.addfile(_member(name, tarfile.DIRTYPE, 0o1777 if name == "tmp" else 0o755))
        for link, target in MERGED.items():
            tar.addfile(_member(link, tarfile.SYMTYPE, 0o777, target))
        made = {"usr", "usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "etc"}
        for source, name in files:
            for parent in reversed(Path(name).parents[:-1]):
                if str(parent) not in made:
                    made.add(str(parent))
                    tar.addfile(_member(str(parent), tarfile.DIRTYPE, 0o755))
            made.add(name)
            info = tar.gettarinfo(source, name)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if info.isreg():
                with open(source, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
        for applet in applets:
            name = _merged(applet)
            if name not in made and str(Path(name).parent) in made:
                made.add(name)
                tar.addfile(_member(name, tarfile.SYMTYPE, 0o777, "/usr/bin/busybox"))
        for name, text in (("etc/passwd", "root:x:0:0::/root:/bin/sh\n"
                                          "nobody:x:65534:65534::/nonexistent:/bin/sh\n"),
                           ("etc/group", "root:x:0:\nnogroup:x:65534:\n")):
            data = text.encode()
            info = _member(name, tarfile.REGTYPE, 0o644)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _package_files(packages: Sequence[str]) -> list[tuple[str, str]]:
    """``(host path, name in the image)`` of every file and symlink of ``packages`` and of
    the ``__pycache__`` entries of their ``.py`` files."""
    listed = subprocess.run(["dpkg", "-L", *packages], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    found: dict[str, str] = {}
    for path in listed:
        name = _merged(path.lstrip("/"))
        if not path.startswith("/") or name in MERGED or os.path.isdir(path) and \
                not os.path.islink(path):
            continue
        if name.startswith(SKIPPED) or not os.path.lexists(path):
            continue
        found[name] = path
        if path.endswith(".py"):
            cache = Path(path).parent / "__pycache__"
            stem = Path(path).stem + "."
            if cache.is_dir():
                for pyc in cache.iterdir():
                    if pyc.name.startswith(stem) and pyc.name.count(".") == 2:
                        found[_merged(str(pyc).lstrip("/"))] = str(pyc)
    return sorted((path, name) for name, path in found.items())


def _merged(name: str) -> str:
    """``name`` (relative to /) where a merged /usr keeps it: ``bin/sh`` -> ``usr/bin/sh``."""
    top, _, rest = name.partition("/")
    return f"{MERGED[top]}/{rest}" if top in MERGED and rest else name


def _member(name: str, kind: bytes, mode: int, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.mtime = kind, mode, target, 0
    info.uname = info.gname = "root"
    return info


def build_image(client: Sequence[str], name: str = IMAGE,
                packages: Sequence[str] = PACKAGES) -> None:
    """Import the root file system of :func:`image_tar` as image ``name`` with ``client``
    (``["docker", "-H", host]`` or ``["podman", ...]``).  Raises CalledProcessError (with
    the client's message) when the import fails."""
    with tempfile.TemporaryFile() as said:
        importer = subprocess.Popen([*client, "import", "-", name], stdin=subprocess.PIPE,
                                    stdout=said, stderr=said)
        with importer:  # closes stdin, then waits
            image_tar(importer.stdin, packages)
        said.seek(0)
        if importer.returncode:
            raise subprocess.CalledProcessError(importer.returncode, importer.args,
                                                said.read().decode(errors="replace"))


class Dockerd:
    """A ``dockerd`` of its own under ``base`` (see the module docstring); root only."""

    def __init__(self, base: str | os.PathLike) -> None:
        self.base = Path(base).resolve()
        tag = hashlib.sha256(os.fsencode(self.base)).hexdigest()[:12]
        self.namespace = f"rametfs-{tag}"
        self.exec_root = Path("/run") / self.namespace
        self.host = f"unix://{self.base / 'docker.sock'}"
        self.client = ["docker", "-H", self.host]
        self.options: list[str] = []  # docker sets no limit this machine's root cannot
        self.log = self.base / "dockerd.log"
        self.pid_file = self.base / "rametfs-dockerd.pid"  # dockerd deletes its own at exit
        self._process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        """The dockerd command line."""
        return ["dockerd", "--data-root", str(self.base / "data"),
                "--exec-root", str(self.exec_root), "-H", self.host,
                "--pidfile", str(self.exec_root / "dockerd.pid"),
                "--containerd-namespace", self.namespace,
                "--containerd-plugins-namespace", f"{self.namespace}-plugins",
                "--iptables=false", "--ip6tables=false", "--ip-masq=false", "--bridge=none"]

    @property
    def pid(self) -> int | None:
        """dockerd's pid (kept in :attr:`pid_file` from start to stop); None before."""
        return _read_pid(self.pid_file)

    def start(self) -> None:
        """Start dockerd and return once it answers; EngineError (with its log) if it does
        not within :data:`START_TIMEOUT_S`, after stopping what started."""
        self.base.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self._process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=log, start_new_session=True)
        self.pid_file.write_text(str(self._process.pid))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self._process.poll() is not None or time.monotonic() > deadline:
                status = self._process.poll()
                self.stop(check=False)
                raise EngineError(f"dockerd did not start (exit status {status}): "
                                  f"{self._log_tail()}")
            time.sleep(0.1)

    def _answers(self) -> bool:
        return subprocess.run([*self.client, "version"], capture_output=True,
                              timeout=CLIENT_TIMEOUT_S).returncode == 0

    def containers(self) -> list[str]:
        """The ids of every container, running or not (``docker ps -aq``)."""
        return subprocess.run([*self.client, "ps", "-aq", "--no-trunc"], capture_output=True,
                              text=True, check=True, timeout=CLIENT_TIMEOUT_S).stdout.split()

    def stop(self, check: bool = True) -> None:
        """Remove every container, end dockerd (SIGTERM, then SIGKILL) and its containerd,
        unmount what they left mounted and delete the data and exec roots.  With ``check``,
        raises EngineError saying what was left, after cleaning it up."""
        pid = self.pid
        if pid is None:
            return
        problems = []
        if self._answers():
            left = self.containers()
            if left:
                subprocess.run([*self.client, "rm", "-f", *left], capture_output=True,
                               timeout=CLIENT_TIMEOUT_S)
        containerd = _read_pid(self.exec_root / "containerd" / "containerd.pid")
        if not self._end(pid):
            problems.append(f"dockerd {pid} needed SIGKILL")
        if containerd is not None and _alive(containerd):
            problems.append(f"containerd {containerd} outlived dockerd")
            self._end(containerd)
        for point in reversed(self.mounts()):
            subprocess.run(["umount", "-l", point], capture_output=True,
                           timeout=CLIENT_TIMEOUT_S)
            problems.append(f"{point} was still mounted")
        self.pid_file.unlink()
        if self._process is not None:
            self._process.wait()
            self._process = None
        for root in (self.base / "data", self.exec_root):  # nothing mounted in them now
            shutil.rmtree(root, ignore_errors=True)
        if problems and check:
            raise EngineError(f"{'; '.join(problems)}: {self._log_tail()}")

    def mounts(self) -> list[str]:
        """Mount points under the data root or the exec root, shallowest first."""
        return _mounts_under((str(self.base / "data"), str(self.exec_root)))

    def _end(self, pid: int) -> bool:
        """SIGTERM ``pid``, SIGKILL it after :data:`STOP_TIMEOUT_S`; True if TERM sufficed."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return True
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while _alive(pid) and time.monotonic() < deadline:
                if self._process is not None and self._process.pid == pid:
                    self._process.poll()  # reaps it once it exited
                else:
                    _reap(pid)
                time.sleep(0.05)
            if not _alive(pid):
                return sig == signal.SIGTERM
        return False

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text[-lines:])


class Podman:
    """Rootful Podman (Debian package ``podman``) with storage of its own under ``base``:
    no daemon, so :meth:`start` only checks that it answers.  :attr:`options` are the
    ``create`` options this machine needs: Podman's default limits for a rootful container
    (1048576 open files, 4194304 processes) are above those of its conmon (here the host's
    20000 open files, and 32768 processes), and raising them needs CAP_SYS_RESOURCE, which
    root lacks on the test machine (runc: "error setting rlimit type 7: operation not
    permitted"); :data:`ULIMIT` of each is below.  The processes a container may start are
    capped by its ``--pids-limit`` anyway."""

    def __init__(self, base: str | os.PathLike) -> None:
        self.base = Path(base).resolve()
        self.client = ["podman", "--root", str(self.base / "storage"),
                       "--runroot", str(self.base / "run"), "--tmpdir", str(self.base / "tmp"),
                       "--cgroup-manager", "cgroupfs",
                       "--events-backend", "file"]
        self.options = ["--ulimit", f"nofile={ULIMIT}:{ULIMIT}",
                        "--ulimit", f"nproc={ULIMIT}:{ULIMIT}"]

    def start(self) -> None:
        """EngineError when ``podman info`` fails (its message)."""
        self.base.mkdir(parents=True, exist_ok=True)
        info = subprocess.run([*self.client, "info"], capture_output=True, text=True,
                              timeout=CLIENT_TIMEOUT_S)
        if info.returncode:
            raise EngineError(f"podman info failed: {info.stderr.strip()}")

    def containers(self) -> list[str]:
        """The ids of every container, running or not (``podman ps -aq``)."""
        return subprocess.run([*self.client, "ps", "-aq", "--no-trunc"], capture_output=True,
                              text=True, check=True, timeout=CLIENT_TIMEOUT_S).stdout.split()

    def stop(self) -> None:
        """Remove every container, unmount the storage (``podman system reset``'s job, but
        that also wants the system's configuration) and delete it; EngineError naming a
        container or mount that was left."""
        problems = []
        left = self.containers()
        if left:
            problems.append(f"containers left: {' '.join(c[:12] for c in left)}")
            subprocess.run([*self.client, "rm", "--force", "--time", "0", *left],
                           capture_output=True, timeout=CLIENT_TIMEOUT_S)
        for point in reversed(_mounts_under((str(self.base),))):
            subprocess.run(["umount", point], capture_output=True, timeout=CLIENT_TIMEOUT_S)
        for point in _mounts_under((str(self.base),)):
            subprocess.run(["umount", "-l", point], capture_output=True,
                           timeout=CLIENT_TIMEOUT_S)
            problems.append(f"{point} was still mounted")
        shutil.rmtree(self.base, ignore_errors=True)
        if problems:
            raise EngineError("; ".join(problems))


def _mounts_under(roots: Sequence[str]) -> list[str]:
    """Mount points at or under one of ``roots``, shallowest first."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if any(point == r or point.startswith(r + "/") for r in roots):
                points.append(point)
    return sorted(points, key=len)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _reap(pid: int) -> None:
    """Reap ``pid`` if it is a child of this process that exited."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def main(argv: list[str]) -> int:
    usage = "usage: containers.py start DIR | stop DIR | image DIR [NAME] | tar [--busybox]"
    if len(argv) >= 2 and argv[0] in ("start", "stop", "image"):
        engine = Dockerd(argv[1])
        if argv[0] == "start":
            engine.start()
            print(engine.host)
        elif argv[0] == "stop":
            engine.stop()
        else:
            build_image(engine.client, argv[2] if len(argv) > 2 else IMAGE)
        return 0
    if argv[:1] == ["tar"]:
        image_tar(sys.stdout.buffer, ("busybox-static",) if "--busybox" in argv else PACKAGES)
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
