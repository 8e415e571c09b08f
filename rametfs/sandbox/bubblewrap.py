"""The bubblewrap adapter: one execution at ``/workspace``, the host read-only, no network.

The sandbox (Debian package ``bubblewrap``, the ``bwrap`` command) gets a fresh root on tmpfs
holding read-only binds of the host's top-level directories, a private ``/tmp`` and ``/run``
(tmpfs, gone when the command ends), a minimal ``/dev``, its own ``/proc``, and new PID, IPC,
UTS and (by default) network namespaces: only a loopback interface of its own.  The rametfs
mountpoint and the data directory are covered by empty tmpfs mounts, so the other executions,
the snapshots, the root ``.ramet/ctl`` and the store are out of reach; the one execution is
bound at ``/workspace``, the only writable path that outlives the command.  What its own
``/workspace/.ramet/`` lets the sandbox do is the harness's choice when it creates the
execution (``Ramet.create(base, owner=uid, control="full"|"read"|"none")``,
docs/security.md): with the sandbox's uid as owner and ``control="full"`` it may promote or
reset itself; the harness acts through the root ``ctl`` whatever it chose.  Nothing is
mounted inside ``/workspace``: the kernel detaches a mount inside an execution whenever it
drops the execution's cached names (a reset, a release, a lookup another uid is refused), so
``hide`` takes host paths only and ``control="none"`` is how ``.ramet`` is hidden.

The command runs as ``uid``:``gid`` (default 65534, nobody) with no capabilities and
``no_new_privs``: bwrap runs as root, keeps only CAP_SETUID and CAP_SETGID, and ``setpriv``
(util-linux) drops to the uid before the command starts.  So the harness runs as root (as the
daemon does), the mount must be served with ``--allow-other`` (the kernel then checks the
sandbox's access from file modes, ``default_permissions``), and the files the command must
change must be writable by that uid: own the source tree by it before the snapshot.

The environment is cleared: ``PATH``, ``HOME=/tmp``, ``LANG=C.UTF-8`` and what ``env`` adds.
On timeout the sandbox's PID namespace is killed (SIGKILL to its init, which takes every
process in it along) and :meth:`Bubblewrap.run` returns once all of them are gone.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from rametfs.client import Execution
from rametfs.sandbox.runtime import (NOBODY, WORKSPACE, Result, require_allow_other,
                                      run_group)

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FRESH = {"proc", "dev", "sys", "tmp", "run"}  # host top-level directories not bound
STATUS_WAIT_S = 10  # how long a timed-out bwrap may take to report its child's pid


class Bubblewrap:
    """Run commands in executions under bubblewrap (see the module docstring).

    ``uid``/``gid``: who the command runs as (not 0).  ``network``: keep the host's network
    (default False: a network namespace with loopback only).  ``env``: extra environment
    variables.  ``hide``: more host paths (absolute, not in ``/workspace``) to cover with
    an empty tmpfs.  ``bwrap``: the program.  Raises ValueError for uid or gid 0, and for a
    ``hide`` path that is relative or in ``/workspace``.
    """

    def __init__(self, uid: int = NOBODY, gid: int = NOBODY, *, network: bool = False,
                 env: Mapping[str, str] | None = None, hide: Sequence[str | os.PathLike] = (),
                 bwrap: str = "bwrap") -> None:
        if uid == 0 or gid == 0:
            raise ValueError("the sandbox must not run as root: give a uid and gid other than 0")
        self.uid, self.gid, self.network = uid, gid, network
        self.env = {"PATH": PATH, "HOME": "/tmp", "LANG": "C.UTF-8", **(env or {})}
        self.hide = [os.path.normpath(os.fspath(p)) for p in hide]
        for path in self.hide:
            if not os.path.isabs(path) or os.path.commonpath([path, WORKSPACE]) == WORKSPACE:
                raise ValueError(f"hide takes absolute host paths outside {WORKSPACE}, not "
                                 f"{path!r}: a mount inside an execution does not last (the "
                                 "kernel detaches it when it drops the execution's names); "
                                 "create the execution with control='none' to hide .ramet")
        self.bwrap = bwrap
        self._data_dirs: dict[Path, str] = {}  # mountpoint -> its daemon's data directory

    def command(self, execution: Execution, argv: Sequence[str],
                status_fd: int | None = None) -> list[str]:
        """The bwrap command line that runs ``argv`` in ``execution``; with ``status_fd``,
        bwrap writes its JSON status (the child's pid first) to that descriptor.

        Raises RametError (EACCES) when the execution is on a FUSE mount served without
        ``allow_other``, which the sandbox's uid could not enter.
        """
        ramet = execution.ramet
        hidden = [*self.hide, *(os.fspath(p) for p in (ramet.mount, ramet.data) if p)]
        require_allow_other(ramet, self.uid)
        if ramet.mount is not None:
            if ramet.mount not in self._data_dirs:
                self._data_dirs[ramet.mount] = ramet.status()["data"]
            hidden.append(self._data_dirs[ramet.mount])
        args = [self.bwrap, "--die-with-parent", "--new-session", "--unshare-pid",
                "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if not self.network:
            args.append("--unshare-net")
        if status_fd is not None:
            args += ["--json-status-fd", str(status_fd)]
        for entry in sorted(os.scandir("/"), key=lambda e: e.name):
            if entry.name in FRESH or entry.path == WORKSPACE:
                continue
            if entry.is_symlink():  # /bin -> usr/bin on a merged /usr
                args += ["--symlink", os.readlink(entry.path), entry.path]
            else:
                args += ["--ro-bind", entry.path, entry.path]
        args += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp",
                 "--tmpfs", "/run"]
        for path in sorted(set(hidden)):
            args += ["--tmpfs", path]
        args += ["--bind", os.fspath(execution.path), WORKSPACE, "--chdir", WORKSPACE,
                 "--clearenv"]
        for key, value in sorted(self.env.items()):
            args += ["--setenv", key, value]
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--",
                 "setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--", *argv]
        return args

    def run(self, execution: Execution, argv: Sequence[str],
            timeout: float | None = None) -> Result:
        """Run ``argv`` in ``execution`` for at most ``timeout`` seconds (None: no limit).

        Returns once every process of the sandbox has ended.  Records first on the
        execution that bubblewrap, as this uid and gid, runs it
        (:meth:`Execution.record_runtime`).  Raises RametError (EACCES) as :meth:`command`
        does; a bwrap that fails to set up reports exit code 1 and its message in
        ``stderr``.
        """
        status_read, status_write = os.pipe()
        try:
            try:
                argv = self.command(execution, argv, status_fd=status_write)
                execution.record_runtime("bubblewrap", self.uid, self.gid)
            except BaseException:
                os.close(status_write)
                raise
            return run_group(argv, timeout, lambda p: _stop(p, status_read), (status_write,))
        finally:
            os.close(status_read)


def _stop(process: subprocess.Popen, status_fd: int) -> None:
    """Kill the sandbox's PID namespace and wait (without reaping bwrap) until it is empty.

    bwrap writes ``{"child-pid": N, ...}`` right after it clones the namespace's init; the
    kernel kills every process of a namespace whose init dies, and bwrap exits only after
    reaping that init.  If no pid came (bwrap failed before), bwrap itself is killed.
    """
    pid = _child_pid(status_fd)
    try:
        os.kill(pid if pid is not None else process.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended meanwhile
        pass
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)


def _child_pid(status_fd: int) -> int | None:
    """The first JSON document bwrap wrote to ``status_fd``: its ``child-pid``, or None if
    bwrap closed the pipe (or wrote nothing within :data:`STATUS_WAIT_S`) without one."""
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([status_fd], [], [], STATUS_WAIT_S)
        chunk = os.read(status_fd, 4096) if ready else b""
        if not chunk:
            return None
        line += chunk
    return json.loads(line.split(b"\n", 1)[0]).get("child-pid")
