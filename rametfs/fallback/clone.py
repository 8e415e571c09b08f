"""Copy one hydrated file into an execution: macOS clonefile(2), Linux FICLONE, or a plain copy.

A clone shares the source's blocks until either side writes (copy-on-write in the file
system), so making an execution costs metadata, not bytes.  :func:`probe` picks the fastest
method a directory's file system has; :func:`clone_file` still falls back to a copy for a file
the file system refuses to clone (another device, an unsupported file system).

Paths are bytes (names in a snapshot are raw bytes).  Blocking.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
import sys
import threading

CLONEFILE = "clonefile"
REFLINK = "reflink"
COPY = "copy"

_FICLONE = getattr(fcntl, "FICLONE", 0x40049409)  # _IOW(0x94, 9, int); fcntl has it from 3.12
_CLONE_NOFOLLOW = 0x0001      # sys/clonefile.h
_CLONE_NOOWNERCOPY = 0x0002
# What a file system answers when it cannot clone this pair of files: copy instead.
_CANNOT_CLONE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EINVAL, errno.ENOTTY,
                 errno.ENOSYS}


def _load_clonefile():
    if sys.platform != "darwin":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    function = libc.clonefile
    function.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint32]
    function.restype = ctypes.c_int
    return function


_clonefile = _load_clonefile()


def _try_clonefile(src: bytes, dst: bytes) -> bool:
    """clonefile(2) ``src`` to the new path ``dst``; False when the file system cannot."""
    if _clonefile(src, dst, _CLONE_NOFOLLOW | _CLONE_NOOWNERCOPY) == 0:
        return True
    err = ctypes.get_errno()
    if err in _CANNOT_CLONE:
        return False
    raise OSError(err, os.strerror(err), os.fsdecode(dst))


def _try_reflink(src: bytes, dst: bytes) -> bool:
    """ioctl(FICLONE) ``src`` into the new file ``dst``; False (and no ``dst``) when the file
    system cannot (ext4, tmpfs, another device)."""
    source = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        try:
            fcntl.ioctl(target, _FICLONE, source)
            return True
        except OSError as exc:
            if exc.errno not in _CANNOT_CLONE:
                raise
        finally:
            os.close(target)
        os.unlink(dst)
        return False
    finally:
        os.close(source)


def clone_file(src: bytes, dst: bytes, method: str) -> str:
    """Create the file ``dst`` (it must not exist) with the bytes of ``src``.

    ``method`` is what :func:`probe` chose; returns the method used for this file (``"copy"``
    when the clone was refused).  The new file's mode is not final: the caller sets it.
    Raises OSError (ENOSPC, EEXIST ...).
    """
    if method == CLONEFILE and _try_clonefile(src, dst):
        return CLONEFILE
    if method == REFLINK and _try_reflink(src, dst):
        return REFLINK
    shutil.copyfile(src, dst)  # sendfile(2) on Linux, fcopyfile(3) on macOS
    return COPY


def probe(directory: bytes) -> str:
    """The fastest method that works inside ``directory``: ``"clonefile"`` (macOS, APFS),
    ``"reflink"`` (Linux, xfs or btrfs), else ``"copy"``."""
    tag = f".probe-{os.getpid()}-{threading.get_ident()}"
    src = os.path.join(directory, f"{tag}-src".encode())
    dst = os.path.join(directory, f"{tag}-dst".encode())
    for path in (src, dst):
        if os.path.lexists(path):
            os.unlink(path)
    with open(src, "wb") as f:
        f.write(b"rametfs clone probe\n")
    try:
        if _clonefile is not None and _try_clonefile(src, dst):
            return CLONEFILE
        if sys.platform.startswith("linux") and _try_reflink(src, dst):
            return REFLINK
        return COPY
    finally:
        for path in (src, dst):
            if os.path.lexists(path):
                os.unlink(path)
