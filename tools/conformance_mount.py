"""The mount helper tools/conformance installs as ``mount.fuse.rametfs`` for a suite's run.

``mount -t fuse.rametfs SOURCE DIR -o OPTIONS`` runs it as ``mount.fuse.rametfs SOURCE DIR -o
OPTIONS``.  It serves a daemon of its own for the source (data under the state directory) in
a mount namespace of its own, imports a directory as a snapshot, creates one execution of it,
and puts a copy of the execution's mount on DIR (open_tree(2) in the daemon's namespace,
move_mount(2) in the caller's: how mounts are given to another namespace).  DIR is then the
only mount of the daemon the suite sees, its source SOURCE (``--fsname``), as fstests finds
its TEST_DEV.  Unmounting DIR leaves the daemon serving; the next mount of the same source
gets the same execution at once.  With ``RAMETFS_CONFORMANCE_CYCLE=restart`` in the
environment (mount(8) passes it on), each mount restarts the daemon first, so every mount
cycle of the suite is a daemon restart (its unmount stores every record, and the new daemon
reads them back).

* fstests: the snapshot is of the directory in the ``source=`` option (else SOURCE, which is
  fstests's TEST_DEV), taken once.
* unionmount-testsuite (options ``lowerdir=L,upperdir=U,workdir=W``): the snapshot is of L,
  and U's files (the suite's "pure upper" file) are copied into the new execution, as the
  upper layer they are.  A new U (the suite's next test makes its layers again) gets a new
  execution; the same U mounted again gets the one it had.

The daemon serves ``--allow-other``, and ``--allow-devices`` and ``--allow-suid`` unless the
options say ``nodev`` or ``nosuid`` (mount(8) passes those, never their defaults ``dev`` and
``suid``), as a kernel file system is mounted; the others (``rw``, ``noatime``, ...) change
nothing.  ``--stop`` stops every daemon of the state directory (the end of a run);
``--isolated CMD...`` runs CMD in a mount namespace of its own (:func:`isolated`).

Usage: ``RAMETFS_CONFORMANCE_STATE=DIR python tools/conformance_mount.py SOURCE DIR [-o
OPTIONS]`` or ``... --stop`` (the installed helper sets the variable).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE_ENV = "RAMETFS_CONFORMANCE_STATE"
CYCLE_ENV = "RAMETFS_CONFORMANCE_CYCLE"  # "restart": each mount restarts the daemon first
WAIT_S = 60.0  # for a stopped daemon to exit
CLONE_NEWNS = 0x00020000
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429  # asm-generic numbers, every architecture
OPEN_TREE_CLONE, OPEN_TREE_CLOEXEC = 1, os.O_CLOEXEC
MOVE_MOUNT_F_EMPTY_PATH = 0x4
AT_FDCWD = -100
libc = ctypes.CDLL(None, use_errno=True)


def fail(message: str) -> None:
    sys.exit(f"mount.fuse.rametfs: {message}")


def checked(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        fail(f"{what}: {os.strerror(err)}")
    return ret


def setns(fd: int) -> None:
    checked(libc.setns(fd, CLONE_NEWNS), "setns")


def rametfs(*args: str, ns_pid: int | None = None, check: bool = True) -> str | None:
    """Run the rametfs CLI of this Python (in daemon ``ns_pid``'s mount namespace when
    given); its stdout.  On failure: exits with its message, or says it and returns None
    when not ``check``."""
    argv = [sys.executable, "-m", "rametfs", *args]
    if ns_pid is not None:
        argv = ["nsenter", f"--mount=/proc/{ns_pid}/ns/mnt", "--", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        if check:
            fail(f"rametfs {' '.join(args)}: {proc.stderr.strip()}")
        print(f"mount.fuse.rametfs: rametfs {' '.join(args)}: {proc.stderr.strip()}",
              file=sys.stderr)
        return None
    return proc.stdout


def parse(argv: list[str]) -> tuple[str, str, dict[str, str]]:
    """``(source, mountpoint, options)`` from mount(8)'s helper arguments; an option
    without ``=`` maps to ``""``."""
    args, options = [], {}
    it = iter(argv)
    for arg in it:
        if arg == "-o":
            for opt in next(it, "").split(","):
                name, _, value = opt.partition("=")
                if name:
                    options[name] = value
        elif not arg.startswith("-"):  # -n, -v, -s: mount(8)'s own
            args.append(arg)
    if len(args) != 2:
        fail("usage: mount.fuse.rametfs SOURCE MOUNTPOINT [-o OPTIONS]")
    return args[0], os.path.realpath(args[1]), options


def identity(path: str) -> list[int]:
    """What tells a directory from a new one made under the same name."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_ctime_ns]


def alive(state: Path) -> int | None:
    """The pid of the daemon serving ``state``, if it runs."""
    try:
        pid = int((state / "pid").read_text())
        os.kill(pid, 0)
    except (FileNotFoundError, ProcessLookupError):
        return None
    return pid


def stop(state: Path, check: bool = True) -> None:
    """Unmount the daemon of ``state`` in its namespace and wait for it to exit; one whose
    execution is still mounted somewhere is left serving when not ``check``."""
    pid = alive(state)
    if pid is None:
        return
    if rametfs("umount", str(state / "root"), ns_pid=pid, check=check) is None:
        return
    deadline = time.monotonic() + WAIT_S
    while alive(state) == pid:
        if time.monotonic() > deadline:
            fail(f"the daemon pid {pid} did not exit after its unmount")
        time.sleep(0.05)


def unmount_all_but(needed: list[str]) -> None:
    """In this (new, private) namespace, unmount every copy of the host's mounts but those
    holding a path of ``needed`` and the kernel's own trees: a copy here would keep another
    user's mount alive after they unmount theirs (a FUSE daemon serving on, a loop device
    busy)."""
    keep = ("/proc", "/sys", "/dev", "/run")
    with open("/proc/self/mountinfo") as f:
        targets = [line.split()[4].encode().decode("unicode_escape") for line in f]
    for target in sorted(set(targets), key=len, reverse=True):
        inside = any(target == k or target.startswith(k + "/") for k in keep)
        holds = any(p == target or p.startswith(target.rstrip("/") + "/") for p in needed)
        if not inside and not holds:
            subprocess.run(["umount", "--lazy", target], capture_output=True)


def start(state: Path, source: str, flags: list[str], needed: list[str]) -> int:
    """Serve ``state``'s data in a new mount namespace (its mounts propagate nowhere, and it
    holds only the host's mounts of ``needed`` paths); the daemon's pid.  This process comes
    back to its own namespace."""
    own = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        checked(libc.unshare(CLONE_NEWNS), "unshare")
        subprocess.run(["mount", "--make-rprivate", "/"], check=True)
        unmount_all_but([str(state), *needed, sys.executable, __file__])
        root = state / "root"
        root.mkdir(exist_ok=True)
        rametfs("mount", "--data", str(state / "data"), str(root), "--background",
                "--fsname", source, *flags)
        pid = json.loads((root / ".ramet" / "status").read_text())["pid"]
    finally:
        setns(own)
        os.close(own)
    (state / "pid").write_text(str(pid))
    return pid


def give(pid: int, path: Path, mountpoint: str) -> None:
    """Mount a copy of ``path``'s mount in daemon ``pid``'s namespace on ``mountpoint``,
    in this process's namespace."""
    own = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    theirs = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(theirs)
        try:
            tree = checked(libc.syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(path),
                                        OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC), "open_tree")
        finally:
            setns(own)
        checked(libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, os.fsencode(mountpoint),
                             MOVE_MOUNT_F_EMPTY_PATH), "move_mount")
        os.close(tree)
    finally:
        os.close(own)
        os.close(theirs)


def isolated(argv: list[str]) -> None:
    """Run ``argv`` in a private mount namespace holding only the host's mounts of the
    paths it needs (its working directory, the state directory's parent, this Python):
    fstests finds TEST_DEV by its source, and another user's mount of the same source
    (fuse-overlayfs names every mount so) would abort the run.  It gets the default
    SIGPIPE and SIGXFSZ a shell gives, not this Python's ignored ones (an ignored signal
    stays ignored across exec): a test's writer to a closed pipe is killed, and its write
    past ``ulimit -f`` too, where it would otherwise fail with EPIPE or EFBIG and say so."""
    checked(libc.unshare(CLONE_NEWNS), "unshare")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    unmount_all_but([os.getcwd(), str(Path(os.environ[STATE_ENV]).parent), sys.executable,
                     __file__])
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    os.execvp(argv[0], argv)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--isolated"]:
        return isolated(argv[1:])
    top = Path(os.environ[STATE_ENV])
    if argv == ["--stop"]:
        for state in sorted(top.iterdir()) if top.is_dir() else ():
            if state.is_dir():
                stop(state, check=False)
        return
    source, mountpoint, options = parse(argv)
    union = "lowerdir" in options
    lower = options["lowerdir"].split(":")[-1] if union else options.get("source", source)
    upper = options.get("upperdir")
    key_path = os.path.realpath(upper if union else lower)
    state = top / hashlib.sha256(key_path.encode()).hexdigest()[:16]
    state.mkdir(parents=True, exist_ok=True)
    record = state / "execution.json"
    ident = identity(key_path)
    known = json.loads(record.read_text()) if record.exists() else None
    restart = os.environ.get(CYCLE_ENV) == "restart"
    if known is None or known["identity"] != ident or restart:
        stop(state)
    if known is None or known["identity"] != ident:  # a new source (or upper layer): anew
        shutil.rmtree(state / "data", ignore_errors=True)
        record.unlink(missing_ok=True)
        known = None
    # mount(8) passes nodev and nosuid, never their defaults dev and suid.
    flags = ["--allow-other"] + ["--allow-devices"] * ("nodev" not in options) \
        + ["--allow-suid"] * ("nosuid" not in options)
    pid = alive(state) or start(state, source, flags,
                                [os.path.realpath(p) for p in (lower, upper) if p])
    root = state / "root"
    if known is None:
        snap = rametfs("snapshot", "-m", str(root), lower, ns_pid=pid).split()[-1]
        # 0755: the suites run some steps as other users (fstests's fsgqa), whose path walks
        # start at the mount, inside the execution.
        eid = rametfs("create", "-m", str(root), snap, "--share", "0755",
                      ns_pid=pid).split()[-1]
        if union:  # the upper layer's files, as they are
            subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", "--", "cp", "-a", "--",
                            f"{upper}/.", str(root / "executions" / eid)], check=True)
        known = {"identity": ident, "execution": eid}
        record.write_text(json.dumps(known))
    give(pid, root / "executions" / known["execution"], mountpoint)


if __name__ == "__main__":
    main(sys.argv[1:])
