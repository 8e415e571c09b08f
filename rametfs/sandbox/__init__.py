"""Sandboxes for executions: run a command with one execution at ``/workspace``.

A runtime has one method, ``run(execution, argv, timeout) -> Result`` (:class:`Runtime`).
Two adapters: :class:`Bubblewrap` (``bwrap``: only ``/usr`` and ``/etc`` of the host,
read-only, no network, a non-root uid) and :class:`Docker` (a container per command, the
execution bind-mounted at ``/workspace``; Podman takes the same command lines); and
:class:`Host`, no sandbox at all, for commands the caller trusts.  None imports anything
outside the standard library and the client wrapper::

    from rametfs.sandbox import Bubblewrap

    result = Bubblewrap().run(execution, ["python3", "-m", "unittest"], timeout=60)
    if result.ok:
        execution.promote()
"""

from rametfs.sandbox.bubblewrap import Bubblewrap
from rametfs.sandbox.docker import Docker
from rametfs.sandbox.runtime import WORKSPACE, Host, Result, Runtime

__all__ = ["WORKSPACE", "Bubblewrap", "Docker", "Host", "Result", "Runtime"]
