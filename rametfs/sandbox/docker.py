"""The Docker adapter: a container with the execution bind-mounted at ``/workspace``.

:meth:`Docker.run` creates the container, then starts it attached, then (on timeout) removes
it by force.  The command line :meth:`Docker.command` builds (every option is a constructor
argument; ``CLIENT`` is the client and its global options, ``docker -H unix:///...``)::

    CLIENT create --rm --pull never --name rametfs-<execution>-<8 hex> --init
        --mount type=bind,source=<execution path>,target=/workspace -w /workspace
        --user UID:GID --network none --cap-drop ALL --security-opt no-new-privileges
        --read-only --tmpfs /tmp --memory 2g --cpus 1 --pids-limit 512
        [-e KEY ...] [OPTIONS ...] IMAGE ARGV...
    CLIENT start --attach rametfs-<execution>-<8 hex>

The container's root file system is read-only; ``/workspace`` (the execution) is its only
writable path that outlives it, ``/tmp`` a private tmpfs.  ``--mount`` refuses a source that
does not exist (``-v`` would create it, as root, wherever the execution was: in fallback mode
inside the data directory); ``--pull never`` refuses an image that is not there rather than
fetching it from a registry.  ``-e KEY`` without a value makes the client pass the value from
its own environment, so no ``env`` value is on any host command line.  Podman takes the same
command lines (``Docker(image, docker="podman")``; where root lacks CAP_SYS_RESOURCE it needs
``options=["--ulimit", ...]``, docs/integrations.md).  As with bubblewrap, a FUSE mount must be
served with ``--allow-other`` for a non-root ``--user`` (the Docker daemon runs as root,
like the rametfs daemon), and the files to change must be writable by that uid.

The container exists before its command starts, so a timeout always finds it: ``CLIENT
kill`` (SIGKILL) and ``CLIENT rm --force`` end and remove it (a ``docker run`` killed while
it creates the container could leave one that starts afterwards, out of reach; Podman's ``rm
--force`` alone would send SIGTERM and wait 10 s); the attached client then exits by itself
with the container's status, 137.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence

from rametfs.client import Execution
from rametfs.sandbox.runtime import (NOBODY, WORKSPACE, Result, require_allow_other,
                                      run_group)

CLIENT_TIMEOUT_S = 60  # for docker create and docker rm
CREATE_FAILED = 125  # the exit status of a container that could not be created, as docker run's
EXIT_WAIT_S = 10  # how long the attached client may take to exit once its container is gone


class Docker:
    """Run commands in executions in Docker containers of ``image``.

    ``uid``/``gid``: the container's user.  ``network``: a Docker network name (default
    ``"none"``: loopback only).  ``memory``: a ``--memory`` value (``"2g"``), ``cpus``: a
    ``--cpus`` value, ``pids_limit``: at most this many processes; None omits the option.
    ``env``: environment variables.  ``options``: more ``create`` options, put before the
    image (``["--ulimit", "nofile=1024:1024"]``).  ``docker``: the client, a program
    (``"podman"`` works) or a program and its global options (``["docker", "-H",
    "unix:///run/x.sock"]``).
    """

    def __init__(self, image: str, uid: int = NOBODY, gid: int = NOBODY, *,
                 network: str = "none", memory: str | None = "2g", cpus: float | None = 1,
                 pids_limit: int | None = 512, env: Mapping[str, str] | None = None,
                 options: Sequence[str] = (), docker: str | Sequence[str] = "docker") -> None:
        self.image, self.uid, self.gid = image, uid, gid
        self.network, self.memory, self.cpus, self.pids_limit = network, memory, cpus, pids_limit
        self.env, self.options = dict(env or {}), list(options)
        self.client = [docker] if isinstance(docker, str) else list(docker)

    def command(self, execution: Execution, argv: Sequence[str], name: str) -> list[str]:
        """The ``docker create`` command line for ``argv`` in ``execution``, container
        ``name``.  Raises ValueError for an execution path holding a comma, which
        ``--mount`` would split."""
        source = os.fspath(execution.path)
        if "," in source:
            raise ValueError(f"{source}: the execution's path holds a comma, which docker's "
                             "--mount would take for the end of the source")
        args = [*self.client, "create", "--rm", "--pull", "never", "--name", name, "--init",
                "--mount", f"type=bind,source={source},target={WORKSPACE}", "-w", WORKSPACE,
                "--user", f"{self.uid}:{self.gid}", "--network", self.network,
                "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "--read-only", "--tmpfs", "/tmp"]
        for option, value in (("--memory", self.memory), ("--cpus", self.cpus),
                              ("--pids-limit", self.pids_limit)):
            if value is not None:
                args += [option, str(value)]
        for key in sorted(self.env):
            args += ["-e", key]
        return [*args, *self.options, self.image, *argv]

    def run(self, execution: Execution, argv: Sequence[str],
            timeout: float | None = None) -> Result:
        """Run ``argv`` in a new container on ``execution`` for at most ``timeout`` seconds
        (counted from the container's start; its creation is bounded by
        :data:`CLIENT_TIMEOUT_S`).

        Records first on the execution that docker, with this image, uid and gid, runs it
        (:meth:`Execution.record_runtime`).  Raises RametError (EACCES) when the
        execution's FUSE mount lacks ``allow_other``, ValueError as :meth:`command` does.
        A container that cannot be created (an image that is not there: none is pulled; an
        execution path that does not exist) reports exit status 125 (as ``docker run``
        does) and the client's message in ``stderr``; one whose command cannot start, 126 or
        127.  Returns once the container has exited;
        after a timeout, once it is removed too.
        """
        require_allow_other(execution.ramet, self.uid)
        name = f"rametfs-{execution.id}-{uuid.uuid4().hex[:8]}"
        command = self.command(execution, argv, name)
        execution.record_runtime("docker", self.uid, self.gid, self.image)
        start = time.perf_counter()
        try:
            created = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                                     timeout=CLIENT_TIMEOUT_S, env={**os.environ, **self.env})
        except BaseException:
            self._remove(name)  # a create cut short may still have made it
            raise
        if created.returncode:  # docker create says 1, podman create 125
            return Result(CREATE_FAILED, created.stdout.decode(errors="replace"),
                          created.stderr.decode(errors="replace"), False,
                          time.perf_counter() - start)
        result = run_group([*self.client, "start", "--attach", name], timeout,
                           lambda process: self._stop(process, name))
        return dataclasses.replace(result, seconds=time.perf_counter() - start)

    def _remove(self, name: str) -> None:
        """SIGKILL and remove container ``name``; harmless when it is already gone."""
        for verb in ("kill", "rm --force"):
            subprocess.run([*self.client, *verb.split(), name], stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=CLIENT_TIMEOUT_S)

    def _stop(self, process: subprocess.Popen, name: str) -> None:
        """Remove container ``name``, then give its attached client :data:`EXIT_WAIT_S` to
        exit (without reaping it) before killing it."""
        self._remove(name)
        deadline = time.monotonic() + EXIT_WAIT_S
        while time.monotonic() < deadline:
            if os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                return
            time.sleep(0.01)
        os.kill(process.pid, signal.SIGKILL)  # not yet reaped: the pid is still this client
