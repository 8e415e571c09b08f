"""The read-only bind mount of ``snapshots/`` over itself, made by the daemon, undone by
``rametfs umount``.

In open-less mode the kernel sends no open, so the daemon cannot refuse a snapshot file
opened for writing, and a shared writable mmap of it changes the kernel's cached pages.  A
read-only mount makes the VFS refuse such opens itself (EROFS) before FUSE sees them.  Mount
calls need CAP_SYS_ADMIN; without it the bind is not made and the daemon drops a snapshot
file's pages when their write-back reaches it (docs/conformance.md).  The bind is a mount
under the FUSE mount: a plain ``umount``/``fusermount3 -u`` of the mountpoint fails EBUSY
until it is gone, a lazy one (``-z``, what the daemon and libfuse do) takes both.  Both
commands are util-linux ``mount(8)``/``umount(8)``.
"""

from __future__ import annotations

import os
import subprocess

from .protocol import SNAPSHOTS_DIR


def snapshots_path(mountpoint: str) -> str:
    return os.path.join(mountpoint, SNAPSHOTS_DIR)


def bind_snapshots_read_only(mountpoint: str) -> str | None:
    """Bind ``<mountpoint>/snapshots`` read-only over itself; None when done, else why not
    (mount(8)'s message).  Blocks on FUSE lookups: call it off the daemon's event loop."""
    path = snapshots_path(mountpoint)
    try:
        done = subprocess.run(["mount", "--bind", "-o", "ro,nosuid,nodev", path, path],
                              capture_output=True, text=True)
    except OSError as exc:  # no mount(8)
        return str(exc)
    if done.returncode != 0:
        return done.stderr.strip() or f"mount exited {done.returncode}"
    return None


def unbind_snapshots(mountpoint: str) -> bool:
    """Unmount the read-only bind of ``<mountpoint>/snapshots``; whether there was one."""
    try:
        return subprocess.run(["umount", snapshots_path(mountpoint)],
                              capture_output=True).returncode == 0
    except OSError:
        return False
