"""The systems compared: how each forks a writable isolated view of a tree, resets it, promotes
it (keeps its state as a new immutable base) and discards it.

| system | fork | reset | promote | discard |
|---|---|---|---|---|
| native | - (the tree is copied once, untimed, and written in place) | - | - | - |
| native-changed | - (the same, with the 10 files rametfs-changed changes changed; its reference) | - | - | - |
| cp-a | ``cp -a tree view`` | ``rm -rf`` + ``cp -a`` | ``cp -a view copy`` | ``rm -rf`` |
| git-worktree | ``git worktree add --detach`` | ``git reset --hard`` + ``git clean -fdq`` | ``git add -A`` + ``git commit`` | ``git worktree remove --force`` |
| overlayfs | mount(2) overlay, lower = tree | unmount, empty upper, mount | ``cp -a upper layer`` (a new lower layer) | unmount, ``rm -rf`` upper |
| fuse-overlayfs | ``fuse-overlayfs -o lowerdir=...`` | ``fusermount3 -u``, empty upper, mount | ``cp -a upper layer`` | ``fusermount3 -u``, ``rm -rf`` |
| rametfs | ``create`` | ``reset`` | ``promote`` | ``release`` |
| rametfs-changed | ``create``, then 10 files changed | ``reset`` | ``promote`` | ``release`` |
| rametfs-snapshot | - (the read-only snapshot itself: read workloads only) | - | - | - |
| rametfs-procs | ``create`` on daemon i mod 4 of 4, each its own data directory (the parallel untar only) | - | - | ``release`` |
| fallback-copy | ``create`` in fallback mode: a real directory, files copied | ``reset`` | ``promote`` | ``release`` |
| fallback-reflink | the same, the data directory on a loop-mounted xfs image: files reflinked | ``reset`` | ``promote`` | ``release`` |

Every mount a system makes is undone by :meth:`System.close`, whatever happened before; the
rametfs daemon is stopped by unmounting it (``rametfs umount``), then by its pid only.  The
fallback systems run rametfs.fallback in this process (no daemon), as the wrapper does.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rametfs import Execution, Ramet

from .trees import BenchError, Tree, change_files, git, remove, run

MNT_DETACH = 2
VIEW_CHANGED_FILES = 10  # files rametfs-changed changes in each view it forks
STOP_SECONDS = 60.0
PROCS_DAEMONS = 4  # rametfs-procs: daemons, each serving every 4th view
XFS_IMAGE_BYTES = 16 << 30  # a sparse file: only what xfs writes takes disk space
# What a reset or promote reports doing (fallback: rametfs.fallback's reply stats; FUSE
# promote: its capture stats), kept with the timings.
COUNTERS = ("scanned", "hashed_files", "changed_files", "new_chunk_bytes", "kept", "removed",
            "written", "file_bytes")
LOG_LINES = 40  # daemon log lines kept with a failure
_libc = ctypes.CDLL(None, use_errno=True)


class Unsupported(Exception):
    """The system has no such operation (or not on this tree): the workload skips it."""


@dataclass
class View:
    """A writable view of ``tree`` at ``path``; ``handle`` is the system's own state."""

    tree: Tree
    path: Path
    handle: object = None


class System:
    """One system under test.  Operations raise :class:`Unsupported` where it has none."""

    id = ""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch / self.id
        self.scratch.mkdir()
        self._names = itertools.count()

    @staticmethod
    def unavailable() -> str | None:
        """Why this system cannot run here, or None."""
        return None

    def _new_dir(self, prefix: str) -> Path:
        return self.scratch / f"{prefix}{next(self._names)}"

    def prepare(self, tree: Tree) -> None:
        """Untimed set-up for ``tree`` (a native copy, a snapshot import), done once."""

    def fork(self, tree: Tree) -> View:
        """A new writable isolated view of ``tree``."""
        raise Unsupported

    def reset(self, view: View) -> None:
        """Return ``view`` to its tree's state."""
        raise Unsupported

    def promote(self, view: View) -> None:
        """Keep ``view``'s current state as a new immutable base; the view carries on."""
        raise Unsupported

    def discard(self, view: View) -> None:
        """Drop ``view`` and what it holds."""
        raise Unsupported

    @contextlib.contextmanager
    def view(self, tree: Tree) -> Iterator[Path]:
        """A writable view of ``tree`` for the I/O workloads, discarded afterwards."""
        self.prepare(tree)
        v = self.fork(tree)
        try:
            yield v.path
        finally:
            self.discard(v)

    def stored_paths(self, tree: Tree, views: list[View]) -> list[Path]:
        """Paths whose disk usage is what the system stores for ``tree`` and ``views``."""
        raise Unsupported

    def base_bytes(self, tree: Tree) -> int:
        """Disk bytes the system stores for ``tree`` alone."""
        return disk_usage([tree.path])

    def counters(self, view: View) -> dict[str, int]:
        """What the last reset or promote of ``view`` reports doing (:data:`COUNTERS`: paths
        scanned, files hashed, bytes of files written ...), or {} when it reports nothing."""
        return {}

    def diagnose(self) -> str:
        """What may explain a failure (a log's tail), or ""."""
        return ""

    def close(self) -> None:
        """Undo every mount and stop every process this system started."""


class Native(System):
    """The tree copied once with ``cp -a`` on the same disk; workloads write in place."""

    id = "native"

    def __init__(self, scratch: Path) -> None:
        super().__init__(scratch)
        self.copies: dict[str, Path] = {}

    def prepare(self, tree: Tree) -> None:
        if tree.name not in self.copies:
            dest = self._new_dir("copy")
            run("cp", "-a", tree.path, dest)
            self.copies[tree.name] = dest

    @contextlib.contextmanager
    def view(self, tree: Tree) -> Iterator[Path]:
        self.prepare(tree)
        yield self.copies[tree.name]


class NativeChanged(Native):
    """The native copy with the files :class:`RametfsChanged` changes changed the same way:
    what ``rametfs-changed`` is compared to."""

    id = "native-changed"

    def prepare(self, tree: Tree) -> None:
        if tree.name not in self.copies:
            super().prepare(tree)
            change_files(self.copies[tree.name], changed_sample(tree), "changed view")


class CpA(System):
    id = "cp-a"

    def fork(self, tree: Tree) -> View:
        dest = self._new_dir("view")
        run("cp", "-a", tree.path, dest)
        return View(tree, dest, [])

    def reset(self, view: View) -> None:
        remove(view.path)
        run("cp", "-a", view.tree.path, view.path)

    def promote(self, view: View) -> None:
        dest = self._new_dir("promoted")
        run("cp", "-a", view.path, dest)
        view.handle.append(dest)

    def discard(self, view: View) -> None:
        for path in [view.path, *view.handle]:
            remove(path)

    def stored_paths(self, tree: Tree, views: list[View]) -> list[Path]:
        return [tree.path, *(v.path for v in views)]


class GitWorktree(System):
    id = "git-worktree"

    @staticmethod
    def unavailable() -> str | None:
        return None if shutil.which("git") else "git is not installed"

    def fork(self, tree: Tree) -> View:
        if not tree.git:
            raise Unsupported
        dest = self._new_dir("worktree")
        git("worktree", "add", "-q", "--detach", str(dest), "HEAD", cwd=tree.path)
        return View(tree, dest)

    def reset(self, view: View) -> None:
        git("reset", "-q", "--hard", cwd=view.path)
        git("clean", "-fdq", cwd=view.path)

    def promote(self, view: View) -> None:
        git("add", "-A", cwd=view.path)
        git("commit", "-q", "-m", "promote", cwd=view.path)

    def discard(self, view: View) -> None:
        git("worktree", "remove", "--force", str(view.path), cwd=view.tree.path)


class _OverlayBase(System):
    """Views as overlay mounts: lower = the tree, upper and work dirs under scratch."""

    def __init__(self, scratch: Path) -> None:
        super().__init__(scratch)
        self.mounted: set[Path] = set()

    def _mount(self, lower: Path, upper: Path, work: Path, target: Path) -> None:
        raise NotImplementedError

    def _unmount(self, target: Path, lazy: bool = False) -> None:
        raise NotImplementedError

    def _layout(self, view: View) -> tuple[Path, Path, Path]:
        return view.handle / "upper", view.handle / "work", view.path

    def _up(self, view: View) -> None:
        upper, work, merged = self._layout(view)
        for d in (upper, work, merged):
            d.mkdir(exist_ok=True)
        self._mount(view.tree.path, upper, work, merged)
        self.mounted.add(merged)

    def _down(self, view: View) -> None:
        self._unmount(view.path)
        self.mounted.discard(view.path)

    def fork(self, tree: Tree) -> View:
        root = self._new_dir("view")
        root.mkdir()
        view = View(tree, root / "merged", root)
        self._up(view)
        return view

    def reset(self, view: View) -> None:
        self._down(view)
        upper, work, _ = self._layout(view)
        remove(upper)
        remove(work)
        self._up(view)

    def promote(self, view: View) -> None:
        upper, _, _ = self._layout(view)
        run("cp", "-a", upper, self._new_dir("layer"))

    def discard(self, view: View) -> None:
        self._down(view)
        remove(view.handle)

    def stored_paths(self, tree: Tree, views: list[View]) -> list[Path]:
        return [tree.path, *(self._layout(v)[0] for v in views)]

    def close(self) -> None:
        for target in list(self.mounted):
            with contextlib.suppress(OSError, BenchError):
                self._unmount(target)
                self.mounted.discard(target)
        for target in list(self.mounted):  # still busy: detach it, so nothing is left mounted
            with contextlib.suppress(OSError, BenchError):
                self._unmount(target, lazy=True)
                self.mounted.discard(target)


class Overlayfs(_OverlayBase):
    """Kernel overlayfs, mounted with mount(2) directly (no process spawned per fork)."""

    id = "overlayfs"

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "mounting overlayfs needs root"
        with open("/proc/filesystems") as f:
            if not any(line.split()[-1] == "overlay" for line in f if line.strip()):
                return "the kernel has no overlay file system"
        return None

    def _mount(self, lower: Path, upper: Path, work: Path, target: Path) -> None:
        options = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
        if _libc.mount(b"overlay", os.fsencode(target), b"overlay", 0, options) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount overlay: {os.strerror(err)}", str(target))

    def _unmount(self, target: Path, lazy: bool = False) -> None:
        if _libc.umount2(os.fsencode(target), MNT_DETACH if lazy else 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount: {os.strerror(err)}", str(target))


class FuseOverlayfs(_OverlayBase):
    """fuse-overlayfs (Debian package); each mount is one fuse-overlayfs process."""

    id = "fuse-overlayfs"

    @staticmethod
    def unavailable() -> str | None:
        if not shutil.which("fuse-overlayfs"):
            return "fuse-overlayfs is not installed (tools/bench installs it)"
        return None if os.path.exists("/dev/fuse") else "/dev/fuse is absent"

    def _mount(self, lower: Path, upper: Path, work: Path, target: Path) -> None:
        run("fuse-overlayfs", "-o", f"lowerdir={lower},upperdir={upper},workdir={work}", target)

    def _unmount(self, target: Path, lazy: bool = False) -> None:
        run("fusermount3", "-u", *(["-z"] * lazy), target)


class _Executions(System):
    """Views as rametfs executions of one snapshot per tree, through the wrapper
    (``self.ramet``, set by the subclass before :meth:`prepare`)."""

    ramet: Ramet
    data: Path

    def __init__(self, scratch: Path) -> None:
        super().__init__(scratch)
        self.snapshots: dict[str, str] = {}
        self.import_seconds: dict[str, float] = {}
        self.base_stored: dict[str, int] = {}  # tree name -> data dir growth of its import

    def prepare(self, tree: Tree) -> None:
        if tree.name not in self.snapshots:
            before = disk_usage([self.data])
            start = time.perf_counter()
            self.snapshots[tree.name] = self.ramet.snapshot(tree.path, label=tree.name)
            self.import_seconds[tree.name] = time.perf_counter() - start
            self.base_stored[tree.name] = disk_usage([self.data]) - before

    def fork(self, tree: Tree) -> View:
        execution = self.ramet.create(self.snapshots[tree.name])
        os.stat(execution.path)
        return View(tree, execution.path, execution)

    def reset(self, view: View) -> None:
        execution: Execution = view.handle
        execution.reset()

    def promote(self, view: View) -> None:
        execution: Execution = view.handle
        execution.promote()

    def discard(self, view: View) -> None:
        self.ramet.release(view.handle)

    def counters(self, view: View) -> dict[str, int]:
        execution: Execution = view.handle
        stats = (execution.status()["last"] or {}).get("stats", {})
        return {key: stats[key] for key in COUNTERS if key in stats}

    def stored_paths(self, tree: Tree, views: list[View]) -> list[Path]:
        return [self.data]

    def base_bytes(self, tree: Tree) -> int:
        self.prepare(tree)
        return self.base_stored[tree.name]


class Rametfs(_Executions):
    """One rametfs daemon (``rametfs serve --background``) for the whole run; a snapshot per
    tree, an execution per view."""

    id = "rametfs"

    def __init__(self, scratch: Path) -> None:
        super().__init__(scratch)
        self.data = self.scratch / "data"
        self.mount = self.scratch / "mnt"
        self.mount.mkdir()
        self.pid: int | None = None
        self.start()

    @staticmethod
    def unavailable() -> str | None:
        if not os.path.exists("/dev/fuse"):
            return "/dev/fuse is absent"
        return None if shutil.which("fusermount3") else "fusermount3 is not installed"

    def _cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rametfs", *args], text=True,
                              capture_output=True, timeout=STOP_SECONDS + 30)

    def start(self) -> None:
        """Start the daemon; raises BenchError with its output if it does not come up."""
        done = self._cli("serve", "--data", str(self.data), str(self.mount), "--background")
        if done.returncode != 0:
            raise BenchError(f"rametfs serve failed: {done.stderr.strip()}")
        self.ramet = Ramet(self.mount)
        self.pid = self.ramet.status()["pid"]

    def stop(self) -> None:
        """Unmount and wait for the daemon to exit; failing that, detach the mount and end the
        daemon by its pid (SIGTERM, then SIGKILL)."""
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        if self._cli("umount", str(self.mount)).returncode == 0:
            return
        subprocess.run(["fusermount3", "-u", "-z", str(self.mount)], capture_output=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            deadline = time.monotonic() + STOP_SECONDS / 2
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not _alive(pid):
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def restart(self) -> None:
        """A fresh daemon process on the same data directory (snapshots are kept)."""
        self.stop()
        self.start()

    def memory(self) -> dict[str, int]:
        """The daemon's resident memory (bytes): ``{"rss", "anon", "file"}``, where ``file``
        is mostly LMDB's memory map (pages the kernel can drop) and ``anon`` the heap."""
        fields = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file"}
        found = {}
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                key = line.split(maxsplit=1)[0]
                if key in fields:
                    found[fields[key]] = int(line.split()[1]) * 1024
        if len(found) != len(fields):
            raise BenchError(f"no memory figures for pid {self.pid}")
        return found

    def diagnose(self) -> str:
        log = self.data / "daemon.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        return "\n".join(lines[-LOG_LINES:])

    def close(self) -> None:
        self.stop()


class RametfsChanged(Rametfs):
    """rametfs, each view an execution in which :data:`VIEW_CHANGED_FILES` files were
    changed (copied up), as an attempt's workspace is."""

    id = "rametfs-changed"

    def fork(self, tree: Tree) -> View:
        view = super().fork(tree)
        change_files(view.path, changed_sample(tree), "changed view")
        return view


class RametfsSnapshot(Rametfs):
    """rametfs read-only: the views are the snapshot directory itself."""

    id = "rametfs-snapshot"

    @contextlib.contextmanager
    def view(self, tree: Tree) -> Iterator[Path]:
        self.prepare(tree)
        yield self.mount / "snapshots" / self.snapshots[tree.name]


class RametfsProcs(System):
    """The bound of serving executions from several processes (issue 21): PROCS_DAEMONS
    rametfs daemons, each its own process, FUSE connection and data directory with every tree
    imported, the i-th view forked is an execution of daemon i mod PROCS_DAEMONS, so up to
    PROCS_DAEMONS views at once never share a daemon and nothing is coordinated between them
    (docs/concurrency.md, "Serving on more than one core").  The daemons start at the first
    :meth:`prepare`, not with the run: only the workloads that list this system use them."""

    id = "rametfs-procs"
    unavailable = staticmethod(Rametfs.unavailable)

    def __init__(self, scratch: Path) -> None:
        super().__init__(scratch)
        self.daemons: list[Rametfs] = []
        self._forks = itertools.count()

    def prepare(self, tree: Tree) -> None:
        while len(self.daemons) < PROCS_DAEMONS:
            home = self._new_dir("daemon")
            home.mkdir()
            self.daemons.append(Rametfs(home))
        for daemon in self.daemons:
            daemon.prepare(tree)

    def fork(self, tree: Tree) -> View:
        daemon = self.daemons[next(self._forks) % len(self.daemons)]
        view = daemon.fork(tree)
        return View(tree, view.path, (daemon, view))

    def discard(self, view: View) -> None:
        daemon, own = view.handle
        daemon.discard(own)

    def stored_paths(self, tree: Tree, views: list[View]) -> list[Path]:
        return [daemon.data for daemon in self.daemons]

    def diagnose(self) -> str:
        return "\n".join(f"daemon {k} ({daemon.data}):\n{daemon.diagnose()}"
                         for k, daemon in enumerate(self.daemons))

    def close(self) -> None:
        with contextlib.ExitStack() as stack:  # every daemon stopped, whichever fails
            for daemon in self.daemons:
                stack.callback(daemon.close)


class _Fallback(_Executions):
    """rametfs in fallback mode (``Ramet(data=..., mode="fallback")``) in this process: each
    view is a real directory made with :attr:`method` (``"copy"``, ``"reflink"``)."""

    method = ""
    ramet: Ramet | None = None

    def __init__(self, scratch: Path) -> None:
        super().__init__(scratch)
        try:
            self.data = self._data_dir() / "data"
            self.ramet = Ramet(data=self.data, mode="fallback")
            found = self.ramet.status()["copy_method"]
            if found != self.method:
                raise BenchError(f"the data directory's file system gives {found!r}, "
                                 f"not {self.method!r}")
        except BaseException:
            self.close()
            raise

    def _data_dir(self) -> Path:
        """The directory the data directory goes in."""
        return self.scratch

    def close(self) -> None:
        if self.ramet is not None:
            self.ramet.close()
            self.ramet = None


class FallbackCopy(_Fallback):
    """Fallback mode with the data directory on the scratch disk (ext4: plain copies)."""

    id = "fallback-copy"
    method = "copy"


class FallbackReflink(_Fallback):
    """Fallback mode with the data directory on an xfs file system (``mkfs.xfs -m
    reflink=1``) in a sparse image on the scratch disk, loop-mounted for the run."""

    id = "fallback-reflink"
    method = "reflink"
    xfs: Path | None = None  # the mountpoint, while mounted

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "mounting a loop device needs root"
        return None if shutil.which("mkfs.xfs") else "mkfs.xfs is absent (Debian xfsprogs)"

    def _data_dir(self) -> Path:
        image, mnt = self.scratch / "xfs.img", self.scratch / "xfs"
        mnt.mkdir()
        with open(image, "wb") as f:
            f.truncate(XFS_IMAGE_BYTES)
        run("mkfs.xfs", "-q", "-m", "reflink=1", image)
        run("mount", "-o", "loop", image, mnt)
        self.xfs = mnt
        return mnt

    def close(self) -> None:
        super().close()  # the store first: LMDB keeps its files open
        if self.xfs is not None:
            done = subprocess.run(["umount", str(self.xfs)], capture_output=True)
            if done.returncode != 0:  # still busy: detach it, so nothing is left mounted
                subprocess.run(["umount", "-l", str(self.xfs)], capture_output=True)
            self.xfs = None


def changed_sample(tree: Tree) -> list[str]:
    """The files the ``-changed`` systems change in every view of ``tree``."""
    return tree.sample(VIEW_CHANGED_FILES, seed=1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def disk_usage(paths: list[Path]) -> int:
    """Bytes of disk blocks used under ``paths`` (``du -scx``: one file system, hard links
    counted once), after a ``sync`` so delayed allocations are counted.  A file removed
    while du runs (the daemon collecting a dropped layer) is not counted."""
    os.sync()
    done = subprocess.run(["du", "-scx", "-B1", *map(str, paths)], capture_output=True,
                          text=True)
    vanished = all(line.endswith("No such file or directory")
                   for line in done.stderr.splitlines())
    if done.returncode != 0 and not (vanished and done.stdout):
        raise BenchError(f"du failed: {done.stderr.strip()}")
    return int(done.stdout.splitlines()[-1].split()[0])


SYSTEMS: dict[str, type[System]] = {
    cls.id: cls for cls in (Native, NativeChanged, CpA, GitWorktree, Overlayfs, FuseOverlayfs, Rametfs,
                            RametfsChanged, RametfsSnapshot,
                            RametfsProcs, FallbackCopy, FallbackReflink)}
