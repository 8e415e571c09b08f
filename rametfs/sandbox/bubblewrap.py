"""The bubblewrap adapter: one execution at ``/workspace``, only the system read-only, no network.

The sandbox (Debian package ``bubblewrap``, the ``bwrap`` command) gets a fresh root on tmpfs
that holds what a command needs to run and nothing else of the host: read-only binds of
``/usr`` and ``/etc`` (and of ``/bin``, ``/sbin``, ``/lib*`` where ``/usr`` is not merged;
where it is, the same symlinks into ``usr``), empty ``/home``, ``/root``, ``/srv``, ``/mnt``,
``/media`` and ``/opt``, a private ``/var`` holding only ``/var/tmp``, private ``/tmp`` and
``/run`` (tmpfs, all gone when the command ends), a minimal ``/dev``, its own ``/proc``, and
new PID, IPC, UTS and (by default) network namespaces: only a loopback interface of its own.
So no host file is in reach but the system's, and no host unix socket either: a path socket
needs its file (``--unshare-net`` covers only abstract sockets), and neither ``/usr`` nor a
Debian ``/etc`` holds one.  ``/opt`` stays empty because it holds whatever add-on software a
site installs, sockets and credentials included; bind what the command needs of it with
``ro_binds``: host paths bound read-only at the same path (a socket under one is reachable:
a read-only mount does not stop a connect).  The rametfs mountpoint and the data directory
are never bound: a bind that contains them or is inside them is refused (ValueError), so the
other executions, the snapshots, the root ``.ramet/ctl`` and the store are out of reach; the
one execution is bound at ``/workspace``, the only writable path that outlives the command.
What its own ``/workspace/.ramet/`` lets the sandbox do is the harness's choice when it
creates the execution (``Ramet.create(base, owner=uid, control="full"|"read"|"none")``,
docs/security.md): with the sandbox's uid as owner and ``control="full"`` it may promote or
reset itself; the harness acts through the root ``ctl`` whatever it chose.  Nothing is
mounted inside ``/workspace``: the kernel detaches a mount inside an execution whenever it
drops the execution's cached names (a reset, a release, a lookup another uid is refused), so
``hide`` and ``ro_binds`` take host paths only and ``control="none"`` is how ``.ramet`` is
hidden.

bwrap reads its options from a memfd (``--args FD``), so the sandbox's ``/proc/1/cmdline``
(bwrap's init) reads ``bwrap --args N -- setpriv ... -- ARGV``: no host path, no execution
id, no ``env`` value (those reach only the command's ``environ``; ``ARGV`` is every host
uid's to read, so a secret goes in ``env``).  Its ``/proc/self/mountinfo`` still shows each
bind's root, the bound directory's path within its file system: ``/executions/<id>`` for the
workspace on a rametfs mount; in fallback mode the execution's path within the host file
system that holds the data directory (docs/security.md, "The bubblewrap sandbox").

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

from rametfs.client import Execution, Ramet
from rametfs.sandbox.runtime import (NOBODY, WORKSPACE, Result, require_allow_other,
                                      run_group)

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SYSTEM = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")  # bound, if present
EMPTY = ("home", "root", "srv", "mnt", "media", "opt")  # fresh empty directories
STATUS_WAIT_S = 10  # how long a timed-out bwrap may take to report its child's pid


class Bubblewrap:
    """Run commands in executions under bubblewrap (see the module docstring).

    ``uid``/``gid``: who the command runs as (not 0).  ``network``: keep the host's network
    namespace (default False: one with loopback only); with it the sandbox reaches the host's
    abstract unix sockets too.  ``env``: extra environment variables.  ``ro_binds``: host
    paths (absolute, not in ``/workspace``) to bind read-only at the same path, after the
    fresh directories (so ``/var/cache/x`` or ``/tmp/x`` works).  ``hide``: host paths inside
    the binds to cover with an empty tmpfs.  ``bwrap``: the program.  Raises ValueError for
    uid or gid 0, and for a ``hide`` or ``ro_binds`` path that is relative or in
    ``/workspace``; :meth:`command` and :meth:`run` raise it for a bind that contains the
    mountpoint or the data directory or is inside one.
    """

    def __init__(self, uid: int = NOBODY, gid: int = NOBODY, *, network: bool = False,
                 env: Mapping[str, str] | None = None,
                 ro_binds: Sequence[str | os.PathLike] = (),
                 hide: Sequence[str | os.PathLike] = (), bwrap: str = "bwrap") -> None:
        if uid == 0 or gid == 0:
            raise ValueError("the sandbox must not run as root: give a uid and gid other than 0")
        self.uid, self.gid, self.network = uid, gid, network
        self.env = {"PATH": PATH, "HOME": "/tmp", "LANG": "C.UTF-8", **(env or {})}
        self.ro_binds = _host_paths(ro_binds, "ro_binds takes absolute host paths outside "
                                    f"{WORKSPACE}, not {{!r}}")
        self.hide = _host_paths(hide, f"hide takes absolute host paths outside {WORKSPACE}, "
                                "not {!r}: a mount inside an execution does not last (the "
                                "kernel detaches it when it drops the execution's names); "
                                "create the execution with control='none' to hide .ramet")
        self.bwrap = bwrap
        self._data_dirs: dict[Path, str] = {}  # mountpoint -> its daemon's data directory

    def command(self, execution: Execution, argv: Sequence[str],
                status_fd: int | None = None) -> list[str]:
        """The bwrap command line that runs ``argv`` in ``execution``; with ``status_fd``,
        bwrap writes its JSON status (the child's pid first) to that descriptor.
        :meth:`run` passes the same options through ``--args``.

        Raises RametError (EACCES) when the execution is on a FUSE mount served without
        ``allow_other``, which the sandbox's uid could not enter; ValueError for a bind
        that overlaps the mountpoint or the data directory.
        """
        return [self.bwrap, *self._options(execution, status_fd), "--", *self._drop(argv)]

    def _options(self, execution: Execution, status_fd: int | None) -> list[str]:
        """bwrap's options (all but the command) for ``execution``; raises as :meth:`command`."""
        require_allow_other(execution.ramet, self.uid)
        unreachable = self._unreachable(execution.ramet)
        args = ["--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
                "--unshare-uts", "--unshare-cgroup-try"]
        if not self.network:
            args.append("--unshare-net")
        if status_fd is not None:
            args += ["--json-status-fd", str(status_fd)]
        for name in SYSTEM:
            path = f"/{name}"
            if os.path.islink(path):  # /bin -> usr/bin on a merged /usr
                args += ["--symlink", os.readlink(path), path]
            elif os.path.exists(path):
                _refuse_overlap(path, unreachable, f"the sandbox binds {path}, but it")
                args += ["--ro-bind", path, path]
        for name in EMPTY:
            args += ["--dir", f"/{name}"]
        args += ["--tmpfs", "/var", "--perms", "1777", "--dir", "/var/tmp",
                 "--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp",
                 "--tmpfs", "/run"]
        for path in self.ro_binds:
            _refuse_overlap(path, unreachable, f"ro_binds: {path}")
            # bwrap (0.8) would make the missing parents 0700 (root's), out of the uid's reach
            for parent in reversed(Path(path).parents[:-1]):
                args += ["--dir", str(parent)]
            args += ["--ro-bind", path, path]
        for path in self.hide:
            args += ["--tmpfs", path]
        args += ["--bind", os.fspath(execution.path), WORKSPACE, "--chdir", WORKSPACE,
                 "--clearenv"]
        for key, value in sorted(self.env.items()):
            args += ["--setenv", key, value]
        return [*args, "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]

    def _drop(self, argv: Sequence[str]) -> list[str]:
        """``argv`` behind setpriv, which drops to the uid, gid and no capabilities."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--", *argv]

    def _unreachable(self, ramet: Ramet) -> list[tuple[str, str]]:
        """``(what, real path)`` of the mountpoint (FUSE mode) and the data directory."""
        if ramet.mount is None:
            return [("the data directory", os.path.realpath(ramet.data))]
        if ramet.mount not in self._data_dirs:
            self._data_dirs[ramet.mount] = ramet.status()["data"]
        return [("the rametfs mount", os.path.realpath(ramet.mount)),
                ("the data directory", os.path.realpath(self._data_dirs[ramet.mount]))]

    def run(self, execution: Execution, argv: Sequence[str],
            timeout: float | None = None) -> Result:
        """Run ``argv`` in ``execution`` for at most ``timeout`` seconds (None: no limit).

        Returns once every process of the sandbox has ended.  Records first on the
        execution that bubblewrap, as this uid and gid, runs it
        (:meth:`Execution.record_runtime`).  Raises RametError (EACCES) and ValueError as
        :meth:`command` does; a bwrap that fails to set up (a ``ro_binds`` path that does
        not exist, say) reports exit code 1 and its message in ``stderr``.
        """
        status_read, status_write = os.pipe()
        args_fd = os.memfd_create("bwrap-args")  # close-on-exec; pass_fds lets bwrap have it
        try:
            try:
                options = self._options(execution, status_write)
                with open(args_fd, "wb", closefd=False) as f:
                    f.write(b"".join(os.fsencode(arg) + b"\0" for arg in options))
                os.lseek(args_fd, 0, os.SEEK_SET)
                execution.record_runtime("bubblewrap", self.uid, self.gid)
            except BaseException:
                for fd in (status_write, args_fd):
                    os.close(fd)
                raise
            command = [self.bwrap, "--args", str(args_fd), "--", *self._drop(argv)]
            return run_group(command, timeout, lambda p: _stop(p, status_read),
                             (status_write, args_fd))
        finally:
            os.close(status_read)


def _host_paths(paths: Sequence[str | os.PathLike], refusal: str) -> list[str]:
    """``paths`` normalized; ValueError (``refusal`` formatted with the path) for one that is
    relative or in :data:`WORKSPACE`."""
    normal = [os.path.normpath(os.fspath(p)) for p in paths]
    for path in normal:
        if not os.path.isabs(path) or os.path.commonpath([path, WORKSPACE]) == WORKSPACE:
            raise ValueError(refusal.format(path))
    return normal


def _refuse_overlap(path: str, unreachable: list[tuple[str, str]], subject: str) -> None:
    """ValueError when host ``path`` (symlinks resolved: bwrap binds what it names) contains
    or is inside one of ``unreachable`` (:meth:`Bubblewrap._unreachable`)."""
    real = os.path.realpath(path)
    if real != path:
        subject += f" (that is {real})"
    for what, target in unreachable:
        if os.path.commonpath([real, target]) in (real, target):
            how = "contains" if os.path.commonpath([real, target]) == real else "is inside"
            raise ValueError(f"{subject} {how} {what} {target}: the sandbox must not reach "
                             "it (docs/security.md, \"The bubblewrap sandbox\")")


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
