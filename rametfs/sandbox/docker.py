"""The Docker adapter: ``docker run`` with the execution bind-mounted at ``/workspace``.

The command line :meth:`Docker.command` builds (every option is a constructor argument)::

    docker run --rm --name rametfs-<execution>-<8 hex> --init
        -v <execution path>:/workspace -w /workspace --user UID:GID
        --network none --cap-drop ALL --security-opt no-new-privileges
        --read-only --tmpfs /tmp --memory 2g --cpus 1 --pids-limit 512
        [-e KEY=VALUE ...] IMAGE ARGV...

The container's root file system is read-only; ``/workspace`` (the execution) is its only
writable path that outlives it, ``/tmp`` a private tmpfs.  Podman takes the same command line
(``Docker(image, docker="podman")``).  As with bubblewrap, a FUSE mount must be served with
``--allow-other`` for a non-root ``--user`` (the Docker daemon itself runs as root, like the
rametfs daemon), and the files to change must be writable by that uid.

On timeout the container is killed by name (``docker kill``), waited for (``docker wait``),
and then the ``docker run`` client; killing only the client would leave the container running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import Mapping, Sequence

from rametfs.client import Execution
from rametfs.sandbox.runtime import (NOBODY, WORKSPACE, Result, require_allow_other,
                                      run_group)

CLEANUP_TIMEOUT_S = 60  # for each of docker kill and docker wait


class Docker:
    """Run commands in executions in Docker containers of ``image``.

    ``uid``/``gid``: the container's user.  ``network``: a Docker network name (default
    ``"none"``: loopback only).  ``memory``: a ``--memory`` value (``"2g"``), ``cpus``: a
    ``--cpus`` value, ``pids_limit``: at most this many processes; None omits the option.
    ``env``: environment variables.  ``docker``: the client program (``"podman"`` works).
    """

    def __init__(self, image: str, uid: int = NOBODY, gid: int = NOBODY, *,
                 network: str = "none", memory: str | None = "2g", cpus: float | None = 1,
                 pids_limit: int | None = 512, env: Mapping[str, str] | None = None,
                 docker: str = "docker") -> None:
        self.image, self.uid, self.gid = image, uid, gid
        self.network, self.memory, self.cpus, self.pids_limit = network, memory, cpus, pids_limit
        self.env = dict(env or {})
        self.docker = docker

    def command(self, execution: Execution, argv: Sequence[str], name: str) -> list[str]:
        """The ``docker run`` command line for ``argv`` in ``execution``, container ``name``."""
        args = [self.docker, "run", "--rm", "--name", name, "--init",
                "-v", f"{os.fspath(execution.path)}:{WORKSPACE}", "-w", WORKSPACE,
                "--user", f"{self.uid}:{self.gid}", "--network", self.network,
                "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "--read-only", "--tmpfs", "/tmp"]
        for option, value in (("--memory", self.memory), ("--cpus", self.cpus),
                              ("--pids-limit", self.pids_limit)):
            if value is not None:
                args += [option, str(value)]
        for key, value in sorted(self.env.items()):
            args += ["-e", f"{key}={value}"]
        return [*args, self.image, *argv]

    def run(self, execution: Execution, argv: Sequence[str],
            timeout: float | None = None) -> Result:
        """Run ``argv`` in a new container on ``execution`` for at most ``timeout`` seconds.

        Records first on the execution that docker, with this image, uid and gid, runs it
        (:meth:`Execution.record_runtime`).  Raises RametError (EACCES) when the
        execution's FUSE mount lacks ``allow_other`` and the user is not root.  A container
        that cannot start reports Docker's exit code (125: the daemon's error, 126/127: the
        command) and its message in ``stderr``.
        """
        require_allow_other(execution.ramet, self.uid)
        execution.record_runtime("docker", self.uid, self.gid, self.image)
        name = f"rametfs-{execution.id}-{uuid.uuid4().hex[:8]}"
        return run_group(self.command(execution, argv, name), timeout,
                         lambda process: self._stop(process, name))

    def _stop(self, process: subprocess.Popen, name: str) -> None:
        """Kill and wait for container ``name``, then the ``docker run`` client."""
        for verb in ("kill", "wait"):  # both fail harmlessly on a container already gone
            subprocess.run([self.docker, verb, name], stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=CLEANUP_TIMEOUT_S)
        os.kill(process.pid, signal.SIGKILL)  # not yet reaped: the pid is still this client
