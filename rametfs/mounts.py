"""The read-only bind mount of ``snapshots/`` over itself, made by the daemon and taken down
by ``rametfs umount``; the kernel's mount table; and what keeps a mount or its daemon alive
(processes using it, copies in other mount namespaces) and how to end its FUSE connection;
where a daemon may serve (its mountpoint, and its data directory's lock, which names it).

In open-less mode the kernel sends no open, so the daemon cannot refuse a snapshot file
opened for writing, and a shared writable mmap of it changes the kernel's cached pages.  A
read-only mount makes the VFS refuse such opens itself (EROFS) before FUSE sees them.

The bind is made with the kernel's mount API (open_tree(2) clone, mount_setattr(2),
move_mount(2); Linux 5.12+) so that it is read-only before it is attached: where the mount
root propagates (a shared parent, systemd's default), every copy it propagates is read-only
too.  It keeps the propagation it gets, so that unmounting the mount root also unmounts those
copies (a copy left with a child mount would keep the FUSE connection, and the daemon, alive).
The price: an rbind copy of the mount root in the same peer group shares it, and unmounting
that copy unmounts the bind too (the root status then says "absent").  It needs
CAP_SYS_ADMIN; without it the daemon drops a snapshot file's pages when their write-back
reaches it (docs/conformance.md).  Being a mount under the FUSE mount, it makes a plain
unmount of the mountpoint fail EBUSY until it is gone; a lazy one (what the daemon and
libfuse do) takes both.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import tempfile
from dataclasses import dataclass

from .errors import RametError
from .protocol import SNAPSHOTS_DIR

FSTYPE = "fuse.rametfs"  # the daemon mounts with subtype=rametfs
_FUSECTL = "/sys/fs/fuse/connections"  # where fusectl is usually mounted
SHOWN_PIDS = 4  # processes named per mount namespace holding a copy

# Syscall numbers of the mount API: one table for every architecture (asm-generic, 424+).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_OPEN_TREE_CLONE = 1
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):  # struct mount_attr, linux/mount.h
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _checked(ret: int, name: str, path: str | None = None) -> int:
    """``ret`` of a libc call, or OSError from its errno."""
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}", path)
    return ret


def _syscall(name: str, number: int, *args) -> int:
    return _checked(_libc.syscall(ctypes.c_long(number), *args), name)


def snapshots_path(mountpoint: str) -> str:
    return os.path.join(mountpoint, SNAPSHOTS_DIR)


def bind_snapshots_read_only(mountpoint: str) -> str | None:
    """Bind ``<mountpoint>/snapshots`` read-only (and nosuid, nodev, like the FUSE mount)
    over itself; None when done, else why not.  Blocks on FUSE lookups: call it off the
    daemon's event loop."""
    path = os.fsencode(snapshots_path(mountpoint))
    try:
        fd = _syscall("open_tree", _SYS_OPEN_TREE, ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(path),
                      ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC))
        try:
            attr = _MountAttr(attr_set=_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID |
                              _MOUNT_ATTR_NODEV)
            _syscall("mount_setattr", _SYS_MOUNT_SETATTR, ctypes.c_int(fd), ctypes.c_char_p(b""),
                     ctypes.c_uint(_AT_EMPTY_PATH), ctypes.byref(attr),
                     ctypes.c_size_t(ctypes.sizeof(attr)))
            _syscall("move_mount", _SYS_MOVE_MOUNT, ctypes.c_int(fd), ctypes.c_char_p(b""),
                     ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(path),
                     ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH))
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.strerror
    return None


@dataclass(frozen=True)
class Mount:
    """One mount: where, what file system type, its per-mount options, which directory of
    its file system it shows (``/`` unless it is a bind of a subdirectory), the file
    system's device (``"major:minor"``, one per FUSE connection) and the mount's id."""

    point: str
    fstype: str
    options: tuple[str, ...]
    root: str
    dev: str = ""
    id: int = 0


def _unescape(field: bytes) -> str:
    # The kernel escapes space, tab, newline and backslash in octal (\040 ...).
    return os.fsdecode(field.decode("unicode_escape").encode("latin-1"))


def mount_table(pid: int | str = "self") -> list[Mount]:
    """The mounts process ``pid`` sees (default: the caller's), in mount order
    (/proc/PID/mountinfo, proc(5)):
    ``id parent dev root point options [optional...] - fstype source super-options``."""
    table = []
    with open(f"/proc/{pid}/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index(b"-") + 1]
            table.append(Mount(_unescape(fields[4]), fstype.decode(),
                               tuple(fields[5].decode().split(",")), _unescape(fields[3]),
                               fields[2].decode(), int(fields[0])))
    return table


def mount_at(path: str) -> Mount | None:
    """The topmost mount at ``path`` exactly, or None."""
    found = [m for m in mount_table() if m.point == path]
    return found[-1] if found else None


def snapshots_bound(mountpoint: str) -> bool:
    """Whether the daemon's read-only bind is on ``<mountpoint>/snapshots`` (a rametfs mount
    on a rametfs mount, read-only)."""
    bind, root = mount_at(snapshots_path(mountpoint)), mount_at(mountpoint)
    return bind is not None and root is not None and bind.fstype == root.fstype == FSTYPE \
        and "ro" in bind.options


def unbind_snapshots(mountpoint: str) -> None:
    """Unmount the read-only bind of ``<mountpoint>/snapshots`` (umount(2)); OSError (EBUSY
    while a process works in it).  Checks nothing: see :func:`snapshots_bound`."""
    path = snapshots_path(mountpoint)
    _checked(_libc.umount2(os.fsencode(path), 0), "umount", path)


# ----- who keeps a mount, or its daemon, alive (rametfs umount) -----------------------------

@dataclass(frozen=True)
class User:
    """A process using a mount: ``pid``, its command name and how (``"working directory"``,
    ``"root directory"``, ``"program"``, ``"open file PATH"``, ``"mapped file PATH"``)."""

    pid: int
    command: str
    how: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command}): {self.how}"


@dataclass(frozen=True)
class Copy:
    """A mount namespace other than the caller's that holds rametfs mounts: the ``pids``
    of its processes, the command names of the first few, and the ``mounts`` there."""

    pids: tuple[int, ...]
    commands: tuple[str, ...]
    mounts: tuple[Mount, ...]

    def __str__(self) -> str:
        shown = ", ".join(f"{pid} ({cmd})" for pid, cmd in zip(self.pids, self.commands))
        more = f" and {len(self.pids) - len(self.commands)} more" \
            if len(self.pids) > len(self.commands) else ""
        return (f"the mount namespace of pid {shown}{more} (at "
                f"{', '.join(m.point for m in self.mounts)})")


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def users(mountpoint: str) -> list[User]:
    """The processes of the caller's mount namespace that use the mount at ``mountpoint``
    or one under it, as ``fuser -m`` finds them: working or root directory, program, open
    files (by the mount id in /proc/PID/fdinfo) and mapped files.  Touches no file of the
    mount, so a hung daemon cannot hang it; processes it may not inspect are left out."""
    ids = {m.id for m in mount_table() if _inside(m.point, mountpoint)}
    own = os.readlink("/proc/self/ns/mnt")
    found = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            if os.readlink(f"/proc/{pid}/ns/mnt") != own:
                continue
            hows = [how for link, how in (("cwd", "working directory"),
                                          ("root", "root directory"), ("exe", "program"))
                    if _inside(os.readlink(f"/proc/{pid}/{link}"), mountpoint)]
            for fd in os.listdir(f"/proc/{pid}/fdinfo"):
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    mnt_id = next((int(line.split()[1]) for line in f
                                   if line.startswith("mnt_id:")), None)
                if mnt_id in ids:
                    hows.append(f"open file {os.readlink(f'/proc/{pid}/fd/{fd}')}")
            with open(f"/proc/{pid}/maps") as f:  # address perms offset dev inode [path]
                mapped = {fields[5].strip() for fields in (line.split(None, 5) for line in f)
                          if len(fields) == 6}
            hows += [f"mapped file {path}" for path in sorted(mapped)
                     if _inside(path, mountpoint)]
            command = _comm(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # it exited meanwhile, or is another user's
        found += [User(pid, command, how) for how in hows]
    return found


def copies_elsewhere(dev: str | None = None, point: str | None = None) -> list[Copy]:
    """The mount namespaces other than the caller's that hold a rametfs mount of the file
    system ``dev`` (``"major:minor"``), or else one mounted at ``point``: such a copy (made
    by a sandbox, ``unshare -m`` or xfstests' ``check`` while the mount existed) keeps the
    FUSE connection, and so the daemon, alive after the mount here is gone."""
    own = os.readlink("/proc/self/ns/mnt")
    spaces: dict[str, list[int]] = {}
    for pid in _pids():
        try:
            ns = os.readlink(f"/proc/{pid}/ns/mnt")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if ns != own:
            spaces.setdefault(ns, []).append(pid)
    copies = []
    for pids in spaces.values():
        try:
            found = tuple(m for m in mount_table(pids[0]) if m.fstype == FSTYPE
                          and (m.dev == dev if dev else m.point == point and m.root == "/"))
            commands = tuple(_comm(pid) for pid in pids[:SHOWN_PIDS])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        except OSError as exc:  # a process that exited since: its mountinfo is EINVAL
            if exc.errno != errno.EINVAL:
                raise
            continue
        if found:
            copies.append(Copy(tuple(pids), commands, found))
    return copies


def abort_connection(dev: str) -> None:
    """End the FUSE connection of file system ``dev`` (``"major:minor"``) by writing its
    fusectl ``abort`` file (the kernel's docs/filesystems/fuse.rst): every copy of the mount
    then fails ENOTCONN and the daemon, whose /dev/fuse reads end, unmounts and exits.
    fusectl is mounted on a temporary directory for the write if it is not at
    /sys/fs/fuse/connections.  OSError: EPERM without CAP_SYS_ADMIN, ENOENT no such
    connection."""
    major, minor = (int(n) for n in dev.split(":"))
    name = str(major << 20 | minor)  # the kernel's dev_t, as fusectl names it
    if os.path.isdir(f"{_FUSECTL}/{name}"):
        _write_abort(f"{_FUSECTL}/{name}/abort")
        return
    top = tempfile.mkdtemp(prefix="rametfs-fusectl-")
    try:
        _checked(_libc.mount(b"fusectl", os.fsencode(top), b"fusectl", ctypes.c_ulong(0),
                             None), "mount fusectl", top)
        try:
            _write_abort(f"{top}/{name}/abort")
        finally:
            _checked(_libc.umount2(os.fsencode(top), 0), "umount", top)
    finally:
        os.rmdir(top)


def _write_abort(path: str) -> None:
    with open(path, "w") as f:
        f.write("1")


# ----- where a daemon may serve ------------------------------------------------------------

def check_mountpoint(mountpoint: str) -> None:
    """RametError when a daemon cannot mount at ``mountpoint``: ENOENT missing, ENOTDIR
    not a directory, EBUSY mounted (from the mount table: a dead FUSE mount too),
    ENOTEMPTY not empty."""
    if mount_at(mountpoint) is not None:
        raise RametError(errno.EBUSY, f"{mountpoint} is already a mountpoint")
    if not os.path.lexists(mountpoint):
        raise RametError(errno.ENOENT, f"mountpoint {mountpoint} does not exist")
    if not os.path.isdir(mountpoint):
        raise RametError(errno.ENOTDIR, f"mountpoint {mountpoint} is not a directory")
    if os.listdir(mountpoint):
        raise RametError(errno.ENOTEMPTY, f"mountpoint {mountpoint} is not empty")


LOCK_FILE = "daemon.lock"


def take_data_lock(data_dir: str) -> int:
    """A descriptor holding the flock of ``<data_dir>/daemon.lock`` (made if missing; the
    daemon holds it while it serves the store), its content untouched.  Raises RametError
    (EBUSY) naming the daemon that holds it (its pid and mountpoint, which it wrote there)
    and how to end it."""
    fd = os.open(os.path.join(data_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, where, _ = _lock_fields(os.pread(fd, 4096, 0).decode(errors="replace"))
        os.close(fd)
        raise RametError(errno.EBUSY,
                         _in_use(data_dir, pid.strip() or "?", where.strip())) from None
    return fd


def write_data_lock(lock: int, mountpoint: str, dev: str) -> None:
    """The data directory lock's content, held by :func:`take_data_lock`'s descriptor
    ``lock``: this daemon's pid, ``mountpoint`` and its FUSE connection ``dev``
    (``"major:minor"``, once mounted, else empty), a line each: :func:`take_data_lock` names
    the daemon by them, and ``rametfs umount --force`` finds the connection by them after
    the mount here is gone (:func:`served_by`)."""
    os.ftruncate(lock, 0)
    os.pwrite(lock, f"{os.getpid()}\n{mountpoint}\n{dev}\n".encode(), 0)


def _lock_fields(content: str) -> tuple[str, str, str]:
    """The pid, mountpoint and connection :func:`write_data_lock` wrote in ``content``, as
    written (an empty string for each line missing)."""
    pid, mountpoint, dev = (content.split("\n") + ["", "", ""])[:3]
    return pid, mountpoint, dev


def served_by(mountpoint: str) -> tuple[int, str] | None:
    """The pid and FUSE connection (``"major:minor"``) of the rametfs daemon that mounted
    ``mountpoint``, whether or not the mount is still here: found by the data directory
    lock it holds open, in which it wrote its pid, mountpoint and connection
    (:func:`write_data_lock`).  Only processes of the caller's uid or root count, so that another
    user's file of that name cannot point ``umount --force`` at a connection.  None when no
    such process holds such a lock."""
    trusted = {0, os.geteuid()}
    for pid in _pids():
        try:
            if os.stat(f"/proc/{pid}").st_uid not in trusted:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.path.basename(os.readlink(f"/proc/{pid}/fd/{fd}")) != LOCK_FILE:
                    continue
                with open(f"/proc/{pid}/fd/{fd}") as f:
                    holder, where, dev = _lock_fields(f.read())
                if holder == str(pid) and where == mountpoint and dev:
                    return pid, dev
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # it exited meanwhile, or is another user's
    return None


def _in_use(data_dir: str, pid: str, mountpoint: str) -> str:
    message = f"{data_dir} is in use by the rametfs daemon pid {pid}"
    if not mountpoint:
        return message
    top = mount_at(mountpoint)
    if top is not None and top.fstype == FSTYPE:
        return f"{message}, serving {mountpoint}: rametfs umount {mountpoint} stops it"
    return (f"{message}, which served {mountpoint}: that is no longer mounted here, but a "
            f"copy made in another mount namespace (a sandbox, unshare -m) keeps the daemon "
            f"serving; rametfs umount --force {mountpoint} ends it (or kill {pid})")


def check_mount_options(allow_devices: bool, allow_suid: bool) -> None:
    """EPERM unless the caller is root when ``allow_devices`` (mount ``dev``) or
    ``allow_suid`` (``suid``) is asked for: the kernel gives those to a FUSE mount only when
    root mounts it (fusermount3 forces ``nodev,nosuid`` on others), and a daemon that let
    them drop would serve device nodes and set-user-ID files other than asked."""
    asked = [flag for flag, on in (("--allow-devices", allow_devices),
                                   ("--allow-suid", allow_suid)) if on]
    if asked and os.geteuid() != 0:
        raise RametError(errno.EPERM,
                         f"{' and '.join(asked)}: only root may mount with device nodes or "
                         f"set-user-ID bits honoured (euid {os.geteuid()})")


def check_can_serve(data_dir: str, mountpoint: str) -> None:
    """Raise now the RametError the daemon would raise at its start for ``data_dir`` and
    ``mountpoint`` (another daemon holds the data directory, EBUSY; the mountpoint is
    missing, not a directory, mounted or not empty), holding nothing after: ``mount``
    checks first, as a detached daemon's own errors go to its log file and a daemon in the
    foreground starts its interpreter again (rametfs.allocator)."""
    if os.path.isdir(data_dir):
        os.close(take_data_lock(data_dir))
    check_mountpoint(os.path.realpath(mountpoint))
