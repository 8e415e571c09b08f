"""POSIX steps on one tree, through one of three drivers: the model (``rametfs.overlay``
called directly, no kernel), a path on the mount, and a path on the host's ext4 (the oracle).

The conformance cases written over a :class:`Tree` run at two levels, against the model
and through the kernel, as rclone's ``vfstest`` runs one suite against its VFS and through
``cmd/mount``; both results must equal ext4's.  Paths are relative to the tree's top, as
``str`` or ``bytes``; errors are ``OSError`` with the errno either way (the model's
``RametError`` is turned into one, as the FUSE adapter turns it into the errno the kernel
returns).  Open files are :class:`Handle` objects: ``pread``, ``pwrite``, ``write`` (at
the handle's offset, or at the end with ``O_APPEND``), ``fstat``, ``close``; ``O_TMPFILE``
opens a file of no name in a directory, which ``link_open`` names.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from pathlib import Path
from typing import NamedTuple

from rametfs.errors import RametError

AT_FDCWD, AT_SYMLINK_FOLLOW = -100, 0x400
_libc = ctypes.CDLL(None, use_errno=True)

class Stat(NamedTuple):
    """What the cases compare of stat(2): file type letter (``f d l c``), permission bits,
    link count, size in bytes, inode number (compare only within one tree)."""

    kind: str
    perm: int
    nlink: int
    size: int
    ino: int


def _stat(mode: int, nlink: int, size: int, ino: int) -> Stat:
    kind = {stat.S_IFREG: "f", stat.S_IFDIR: "d", stat.S_IFLNK: "l",
            stat.S_IFCHR: "c"}[stat.S_IFMT(mode)]
    return Stat(kind, stat.S_IMODE(mode), nlink, size, ino)


def _b(path: str | bytes) -> bytes:
    return path if isinstance(path, bytes) else os.fsencode(path)


class OsTree:
    """The steps as system calls on a real directory: an execution on the mount, or the
    ext4 copy of its source."""

    def __init__(self, root: Path):
        self.root = root

    def p(self, path: str | bytes) -> bytes:
        return os.path.join(os.fsencode(self.root), _b(path)) if path else os.fsencode(self.root)

    def read(self, path) -> bytes:
        with open(self.p(path), "rb") as f:
            return f.read()

    def write(self, path, data: bytes) -> None:
        with open(self.p(path), "wb") as f:
            f.write(data)

    def append(self, path, data: bytes) -> None:
        with open(self.p(path), "ab") as f:
            f.write(data)

    def mkdir(self, path) -> None:
        os.mkdir(self.p(path))

    def rmdir(self, path) -> None:
        os.rmdir(self.p(path))

    def unlink(self, path) -> None:
        os.unlink(self.p(path))

    def rename(self, old, new) -> None:
        os.rename(self.p(old), self.p(new))

    def link(self, old, new) -> None:
        os.link(self.p(old), self.p(new))

    def symlink(self, target, path) -> None:
        os.symlink(_b(target), self.p(path))

    def readlink(self, path) -> bytes:
        return os.readlink(self.p(path))

    def listdir(self, path=b"") -> list[bytes]:
        return sorted(os.listdir(self.p(path)))

    def lstat(self, path) -> Stat:
        s = os.lstat(self.p(path))
        return _stat(s.st_mode, s.st_nlink, s.st_size, s.st_ino)

    def exists(self, path) -> bool:
        return os.path.lexists(self.p(path))

    def open(self, path, flags: int, mode: int = 0o644) -> "OsHandle":
        return OsHandle(os.open(self.p(path), flags, mode))

    def link_open(self, handle: "OsHandle", path) -> None:
        """Name open file ``handle`` ``path`` (an O_TMPFILE file): ``linkat(AT_FDCWD,
        "/proc/self/fd/N", AT_FDCWD, path, AT_SYMLINK_FOLLOW)``, as open(2) shows (os.link
        calls link(2), which links the /proc symlink itself: EXDEV)."""
        if _libc.linkat(AT_FDCWD, f"/proc/self/fd/{handle.fd}".encode(), AT_FDCWD,
                        self.p(path), AT_SYMLINK_FOLLOW) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), os.fsdecode(self.p(path)))


class OsHandle:
    def __init__(self, fd: int):
        self.fd = fd

    def pread(self, size: int, off: int) -> bytes:
        return os.pread(self.fd, size, off)

    def pwrite(self, data: bytes, off: int) -> int:
        return os.pwrite(self.fd, data, off)

    def write(self, data: bytes) -> int:
        return os.write(self.fd, data)

    def fstat(self) -> Stat:
        s = os.fstat(self.fd)
        return _stat(s.st_mode, s.st_nlink, s.st_size, s.st_ino)

    def close(self) -> None:
        os.close(self.fd)


@contextlib.contextmanager
def _as_oserror():
    try:
        yield
    except RametError as exc:
        raise OSError(exc.errno, os.strerror(exc.errno), str(exc)) from None


class ModelTree:
    """The steps as calls of the model (``rametfs.overlay.Overlay``) on execution ``ex``,
    as the FUSE adapter makes them for the kernel: each name looked up from the top, then
    one call; files created 0644 and directories 0755 by root, as the cases' own process
    would be.  What the kernel checks itself (permissions, a directory moved below itself)
    is not checked here."""

    def __init__(self, overlay, ex):
        self.overlay, self.ex = overlay, ex

    def _node(self, path):
        node = self.overlay.node(self.ex.root_ino)
        for part in filter(None, _b(path).split(b"/")):
            if not stat.S_ISDIR(node.mode):
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            with _as_oserror():
                node = self.overlay.lookup(node.ino, part)
        return node

    def _parent(self, path) -> tuple[object, bytes]:
        head, _, name = _b(path).rpartition(b"/")
        return self._node(head), name

    def _content(self, node) -> bytes:
        with _as_oserror(), self._base_fd(node) as fd:
            return self.overlay.read(node, 0, node.size, fd)

    @contextlib.contextmanager
    def _base_fd(self, node):
        cid = node.base_content
        fd = os.open(self.overlay.store.hydrate(cid), os.O_RDONLY) if cid and \
            node.entry.size else None
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def read(self, path) -> bytes:
        return self._content(self._node(path))

    def write(self, path, data: bytes) -> None:
        h = self.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        h.write(data)
        h.close()

    def append(self, path, data: bytes) -> None:
        h = self.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        h.write(data)
        h.close()

    def mkdir(self, path) -> None:
        parent, name = self._parent(path)
        with _as_oserror():
            self.overlay.mkdir(parent.ino, name, 0o755, 0, 0)

    def rmdir(self, path) -> None:
        parent, name = self._parent(path)
        with _as_oserror():
            self.overlay.rmdir(parent.ino, name)

    def unlink(self, path) -> None:
        parent, name = self._parent(path)
        with _as_oserror():
            self.overlay.unlink(parent.ino, name)

    def rename(self, old, new) -> None:
        (old_parent, old_name), (new_parent, new_name) = self._parent(old), self._parent(new)
        with _as_oserror():
            self.overlay.rename(old_parent.ino, old_name, new_parent.ino, new_name, 0)

    def link(self, old, new) -> None:
        node = self._node(old)
        parent, name = self._parent(new)
        with _as_oserror():
            self.overlay.link(node.ino, parent.ino, name)

    def symlink(self, target, path) -> None:
        parent, name = self._parent(path)
        with _as_oserror():
            self.overlay.symlink(parent.ino, name, _b(target), 0, 0)

    def readlink(self, path) -> bytes:
        with _as_oserror():
            return self.overlay.readlink(self._node(path))

    def listdir(self, path=b"") -> list[bytes]:
        with _as_oserror():
            return sorted(name for name, _ in self.overlay.listdir(self._node(path).ino)
                          if name not in (b".", b".."))

    def lstat(self, path) -> Stat:
        a = self.overlay.attrs(self._node(path))
        return _stat(a.mode, a.nlink, a.size, a.ino)

    def exists(self, path) -> bool:
        try:
            self._node(path)
        except FileNotFoundError:
            return False
        return True

    def open(self, path, flags: int, mode: int = 0o644) -> "ModelHandle":
        if (flags & os.O_TMPFILE) == os.O_TMPFILE:  # path is the directory
            with _as_oserror():
                node = self.overlay.tmpfile(self._node(path).ino, mode, 0, 0,
                                            linkable=not flags & os.O_EXCL)
            return ModelHandle(self, node, flags)
        try:
            node = self._node(path)
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
            parent, name = self._parent(path)
            with _as_oserror():
                node = self.overlay.create(parent.ino, name, mode, 0, 0)
        else:
            if flags & os.O_CREAT and flags & os.O_EXCL:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST))
            if flags & os.O_TRUNC:
                with _as_oserror():
                    self.overlay.setattr(node, size=0)
        return ModelHandle(self, node, flags)


    def link_open(self, handle: "ModelHandle", path) -> None:
        parent, name = self._parent(path)
        with _as_oserror():
            self.overlay.link(handle.node.ino, parent.ino, name)


class ModelHandle:
    """An open file of the model: its node, held (as the kernel holds an open file's inode
    whatever happens to its names), and the offset of plain writes."""

    def __init__(self, tree: ModelTree, node, flags: int):
        self.tree, self.node, self.flags, self.offset = tree, node, flags, 0

    def pread(self, size: int, off: int) -> bytes:
        with _as_oserror(), self.tree._base_fd(self.node) as fd:
            return self.tree.overlay.read(self.node, off, size, fd)

    def pwrite(self, data: bytes, off: int) -> int:
        if self.flags & os.O_APPEND:  # Linux: pwrite on O_APPEND appends
            off = self.node.size
        with _as_oserror():
            return self.tree.overlay.write(self.node, off, data)

    def write(self, data: bytes) -> int:
        off = self.node.size if self.flags & os.O_APPEND else self.offset
        with _as_oserror():
            n = self.tree.overlay.write(self.node, off, data)
        self.offset = off + n
        return n

    def fstat(self) -> Stat:
        a = self.tree.overlay.attrs(self.node)
        return _stat(a.mode, a.nlink, a.size, a.ino)

    def close(self) -> None:
        pass


def signature(tree) -> list[tuple]:
    """Every path of ``tree`` below its top with its file type, permission bits, link
    count, size and content (a symlink's target), sorted: equal trees, equal signatures."""
    out = []

    def walk(path: bytes) -> None:
        for name in tree.listdir(path):
            p = path + b"/" + name if path else name
            s = tree.lstat(p)
            what = tree.read(p) if s.kind == "f" else tree.readlink(p) if s.kind == "l" else b""
            out.append((p, s.kind, s.perm, s.nlink, s.size if s.kind != "d" else 0, what))
            if s.kind == "d":
                walk(p)

    walk(b"")
    return out


def errno_of(fn, *args) -> str:
    """``"ok"`` when ``fn(*args)`` returns, else the errno name of the OSError it raises."""
    try:
        fn(*args)
    except OSError as exc:
        return errno.errorcode[exc.errno]
    return "ok"
