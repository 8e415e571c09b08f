"""The Python wrapper for harnesses: snapshots, execution pools, promote and reset.

In FUSE mode (the default) it drives a mounted rametfs through its control files, knowing
only the control protocol (:mod:`rametfs.protocol`) and the standard library, so it works
from any process that can see the mount, without FUSE or the daemon's dependencies::

    ramet = Ramet("/mnt/ramet")                      # or Ramet() to use $RAMET_MOUNT
    base = ramet.snapshot("/src/project", label="clean")
    with ramet.execution_pool(base, concurrency=4) as pool:
        with pool.acquire() as ex:                   # ex.path: <mnt>/executions/<id>
            run_agent(cwd=ex.path)
            saved = ex.promote(label="attempt 1")    # the execution carries on from it
        # leaving acquire() resets the execution, verifies it and hands it back
    # leaving the pool releases every execution

In FUSE mode the daemon keeps the pool and a lease per acquired execution (renewed by this
process in the background; expired leases are returned to the pool by the daemon), so a
named pool outlives the process that made it (:class:`ExecutionPool`).

In fallback mode (``Ramet(data=DIR, mode="fallback")``, for hosts without FUSE) the same
calls run in this process on the data directory: executions are real directories
(``<data>/fallback/executions/<id>``) made by :mod:`rametfs.fallback`, which is imported only
then.  ``mode="auto"`` picks fallback when ``/dev/fuse`` is missing.

In FUSE mode every call is one synchronous command on a ``ctl`` file (or one read of a status
file); each opens its own file descriptor, so calls from several threads do not interfere.
A process that may write the root ``ctl`` (the harness: the daemon's uid, or root) sends an
execution's commands there (``promote <id>``...), so they work whatever the execution's
``control``; any other process uses the execution's own ``.ramet/`` files.
Failures raise :class:`RametError` with the daemon's (or the file system's) errno and message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rametfs import protocol
from rametfs.errors import RametError
from rametfs.ids import ExecutionId, SnapshotId

MOUNT_ENV = "RAMET_MOUNT"
DATA_ENV = "RAMET_DATA"
MODE_ENV = "RAMET_MODE"
MODES = ("fuse", "fallback", "auto")
FUSE_DEVICE = "/dev/fuse"
_MAX_REPLY = 1 << 20
DEFAULT_TTL = 30.0  # seconds a lease lasts unless renewed; the wrapper renews at a third
_POLL_FIRST, _POLL_MAX = 0.002, 0.05  # seconds between acquires of a busy pool (doubling)


class NotMountedError(RametError):
    """No live rametfs at the given mountpoint (errno ENOTCONN)."""

    def __init__(self, mountpoint: str | os.PathLike) -> None:
        super().__init__(errno.ENOTCONN, f"no rametfs mounted at {os.fspath(mountpoint)}")


class PoolTimeout(RametError, TimeoutError):
    """:meth:`ExecutionPool.acquire` found no free execution in time (errno EBUSY)."""


class RestoreError(RametError):
    """A step of :meth:`Ramet.restore` failed (errno EIO: an input missing or changed, or
    a command failed; EFBIG: an input too large; ETIMEDOUT).  ``execution`` is the restored execution, left for inspection;
    ``steps`` every :class:`rametfs.restore.Step` taken, the failed one last."""

    def __init__(self, code: int, message: str, execution: Execution, steps: list) -> None:
        super().__init__(code, message)
        self.execution = execution
        self.steps = steps


@dataclass(frozen=True)
class Restored:
    """What :meth:`Ramet.restore` made: the ``snapshot`` id, the new ``execution`` and the
    ``steps`` of its rebuild (:class:`rametfs.restore.Step`)."""

    snapshot: str
    execution: Execution
    steps: list


def resolve_mode(mode: str | None) -> str:
    """``"fuse"`` or ``"fallback"`` for ``mode`` (None: ``$RAMET_MODE``, else ``"fuse"``);
    ``"auto"`` is fallback when ``/dev/fuse`` is missing.  Raises RametError (EINVAL) for
    another name."""
    mode = mode or os.environ.get(MODE_ENV) or "fuse"
    if mode not in MODES:
        raise RametError(errno.EINVAL, f"unknown mode {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "auto":
        return "fuse" if os.path.exists(FUSE_DEVICE) else "fallback"
    return mode


class Ramet:
    """A handle on one rametfs: a mount (FUSE mode) or a data directory (fallback mode).

    ``mode``: ``"fuse"``, ``"fallback"`` or ``"auto"`` (default ``$RAMET_MODE``, else
    ``"fuse"``).  FUSE mode needs ``mountpoint`` (default ``$RAMET_MOUNT``), fallback mode
    ``data`` (default ``$RAMET_DATA``).  Raises :class:`RametError` (EINVAL) when the one it
    needs is not given or the mode is unknown, :class:`NotMountedError` (ENOTCONN) when no
    rametfs answers at the mountpoint.
    """

    def __init__(self, mountpoint: str | os.PathLike | None = None, *,
                 data: str | os.PathLike | None = None, mode: str | None = None) -> None:
        self.mode = resolve_mode(mode)
        self.mount: Path | None = None  # FUSE mode
        self.data: Path | None = None  # fallback mode
        if self.mode == "fallback":
            self._backend: _Mount | _Local = _Local(data)
            self.data = self._backend.data
        else:
            self._backend = _Mount(mountpoint)
            self.mount = self._backend.mount

    def __enter__(self) -> Ramet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Fallback mode: close the data directory's store in this process (once no other
        Ramet here uses it), e.g. before unmounting its file system.  FUSE mode: nothing."""
        self._backend.close()

    def __repr__(self) -> str:
        if self.mode == "fallback":
            return f"Ramet(data={str(self.data)!r}, mode='fallback')"
        return f"Ramet({str(self.mount)!r})"

    def snapshot(self, source: str | os.PathLike, label: str | None = None,
                 message: str | None = None, on_change: str | None = None) -> SnapshotId:
        """Import the directory tree at ``source`` as a new snapshot; return its id (64 hex).
        An entry that changes while it is imported fails the import (``on_change="fail"``,
        the default) or is left out (``"skip"``, counted in the snapshot's ``skipped``).

        Errors: ENOENT source missing, EINVAL not a directory, it contains ``.ramet`` or
        ``on_change`` is neither, EAGAIN an entry changed (the message names it), ENOSPC, EIO.
        """
        path = os.path.abspath(os.fspath(source))
        return self._backend.run(protocol.Snapshot(
            path, label or "", message or "", on_change or protocol.ON_CHANGE[0]))["snapshot"]

    def snapshot_git(self, repo: str | os.PathLike, rev: str | None = None,
                     with_git_dir: bool = False, label: str | None = None,
                     message: str | None = None) -> SnapshotId:
        """Import the tree of revision ``rev`` (default ``HEAD``) of the git repository at
        ``repo`` as a new snapshot, from the repository's objects (no checkout); return its
        id.  ``with_git_dir`` takes the repository's ``.git`` directory along, so its local
        commits, branches, stash and index are in the snapshot.

        Errors: ENOENT repository missing or ``rev`` names no commit, EINVAL not a
        repository (or ``with_git_dir`` on a bare one), EOPNOTSUPP git support not installed,
        ENOSPC, EIO.
        """
        path = os.path.abspath(os.fspath(repo))
        return self._backend.run(protocol.SnapshotGit(
            path, rev or "HEAD", with_git_dir, label or "", message or ""))["snapshot"]

    def create(self, snapshot: str, name: str | None = None,
               policy: str | os.PathLike | None = None, *, owner: int | None = None,
               group: int | None = None, share: int | None = None,
               control: str | None = None, max_bytes: int | None = None,
               max_inodes: int | None = None) -> Execution:
        """Create a writable execution of ``snapshot`` (id or unique prefix).

        ``policy`` is stored with it and applied by its promotes and previews (unless one
        is given to them): a TOML file, ``"tree"`` (the tree's own ``ramet.toml``; trust
        the agent's policy) or ``"none"`` (docs/policy.md).  ``owner``/``group``: the uid
        and gid it belongs to (default: the daemon's); ``share``: its permission bits, like
        a directory's (default ``0o700``: the owner alone; the owner always has ``rwx``);
        ``control``: what its own control files allow (``"full"``, the default; ``"read"``:
        no writes; ``"none"``: no ``.ramet``); ``max_bytes``/``max_inodes``: what its upper
        layer may take, disk bytes of written data and upper inodes (EDQUOT past them).  See
        docs/security.md.  In fallback mode the access settings are recorded and shown in
        the status (the data directory, 0700, keeps other uids out, and executions have no
        control files); limits are refused there (EOPNOTSUPP).

        Errors: ENOENT unknown snapshot, EINVAL bad name, setting or malformed policy,
        EEXIST name taken.
        """
        reply = self._backend.run(protocol.Create(
            snapshot, name, _policy_text(policy),
            protocol.Access(owner, group, share, control, max_bytes, max_inodes)))
        return Execution(self, reply["execution"])

    def release(self, execution: str | Execution) -> None:
        """Drop an execution and its changes.  Errors: ENOENT unknown execution."""
        self._backend.run(protocol.Release(_execution_id(execution)))

    def name(self, name: str, snapshot: str) -> dict:
        """Point the snapshot name ``name`` at ``snapshot`` (id, prefix or name), creating
        or moving it like a git branch; ``{"name", "snapshot", "previous"}`` (the id it
        pointed at before, or None).  Errors: EINVAL bad name (docs/lifecycle.md), ENOENT
        unknown snapshot."""
        return self._backend.run(protocol.Name(name, snapshot))

    def unname(self, name: str) -> str:
        """Delete the snapshot name ``name``; the id it pointed at.  Errors: ENOENT."""
        return self._backend.run(protocol.Unname(name))["snapshot"]

    def resolve(self, snapshot: str) -> str:
        """The full id of the snapshot ``snapshot`` (id, unique prefix of at least 8 hex
        digits, or name) names.  Errors: ENOENT none, or several."""
        return self._backend.run(protocol.Resolve(snapshot))["snapshot"]

    def publish(self, snapshot: str) -> dict:
        """Publish ``snapshot`` to the daemon's remote (docs/remote.md); what it did:
        ``{"snapshot", "already", "packs", "trees", "contents", "chunks", "bytes",
        "requests", "seconds"}``.  EINVAL in fallback mode or without a remote, EIO when the
        remote fails (the next publish resumes)."""
        return self._backend.run(protocol.Publish(snapshot))["published"]

    def rm(self, snapshot: str, force: bool = False) -> dict:
        """Forget the snapshot ``snapshot`` (its record; gc frees its data):
        ``{"removed": [id], "names": [names deleted]}``.  Errors: ENOENT unknown snapshot;
        EBUSY, saying why, while it is an execution's base or head (reset returns to it) or a
        pool's base, or (unless ``force``: the names go) a name points at it
        (docs/lifecycle.md)."""
        return self._backend.run(protocol.Rm(snapshot, force))

    def forget(self, keep_last: int | None = None, keep_within: str | None = None,
               keep_name: str | None = None, dry_run: bool = False, prune: bool = False,
               progress=None) -> dict:
        """Forget every snapshot that no rule keeps, restic's ``forget``: ``keep_last`` the N
        newest, ``keep_within`` those younger than a duration (``"7d"``, ``"36h"``,
        ``"1y2m"``: y, m months, d, h) before the newest snapshot's time, ``keep_name``
        those a name matching the glob points at; the bases and heads of executions and
        pools' bases are always kept; the names of forgotten snapshots are deleted.
        ``{"dry_run", "kept": [{"snapshot", "reasons"}], "removed": [ids], "names":
        [deleted]}``, newest first; ``prune`` then runs :meth:`gc` (not in a dry run) and
        adds its report as ``"gc"``.  docs/lifecycle.md.  Errors: EINVAL no rule, or a bad
        count or duration; those of gc."""
        reply = self._backend.run(protocol.Forget(
            keep_last, None if keep_within is None else protocol.Duration.parse(keep_within),
            keep_name, dry_run))
        if prune and not dry_run:
            reply["gc"] = self.gc(progress=progress)
        return reply

    def gc(self, dry_run: bool = False, progress=None) -> dict:
        """Delete every chunk, content and tree no snapshot, execution or pool reaches (the
        daemon does it; fallback mode in this process): the report ``{"chunks",
        "chunk_bytes", "contents", "content_bytes", "trees", "tree_bytes", "sources",
        "cache_files", "cache_bytes", "bytes", "kept_chunks", "kept_contents",
        "kept_trees", "roots", "dry_run"}`` (``bytes`` the stored bytes freed for reuse);
        ``dry_run`` counts, deleting nothing; ``progress(phase, done, total)`` is called as
        it goes (FUSE mode: from a thread reading the root status twice a second).
        docs/lifecycle.md.  Errors: EBUSY a gc runs already, EIO the store is damaged
        (nothing deleted)."""
        command = protocol.Gc(dry_run)
        if self.mode == "fallback" or progress is None:
            return self._backend.run(command, progress)["gc"]
        done = threading.Event()

        def poll() -> None:
            while not done.wait(0.5):
                with contextlib.suppress(RametError):
                    state = self.status().get("gc")
                    if state:
                        progress(state["phase"], state["done"], state["total"])

        poller = threading.Thread(target=poll, name="rametfs-gc-progress", daemon=True)
        poller.start()
        try:
            return self._backend.run(command)["gc"]
        finally:
            done.set()
            poller.join()

    def cancel(self, execution: str | Execution | None = None) -> list[str]:
        """Cancel the command running on ``execution`` (None: on every execution) and wait
        until it has stopped; the ids of the executions whose command was cancelled (it fails
        with ECANCELED).  Fallback mode runs commands in their callers' processes: nothing
        to cancel there.  Errors: ENOENT unknown execution."""
        if self.mode == "fallback":
            return []
        execution_id = None if execution is None else _execution_id(execution)
        return self._backend.run(protocol.Cancel(execution_id))["cancelled"]

    def execution(self, execution_id: str) -> Execution:
        """A handle on an existing execution (not checked until first used)."""
        return Execution(self, execution_id)

    @property
    def here(self) -> Execution | None:
        """The execution whose directory this handle was opened on (``Ramet("/workspace")``
        in a sandbox, ``Ramet("<mnt>/executions/<id>")``), or None for a mount or a data
        directory.  Opened on an execution's directory from inside a sandbox, only that
        execution's own commands work (the others raise RametError, EINVAL)."""
        here = self._backend.here
        return None if here is None else Execution(self, here)

    def restore(self, snapshot: str, runtime=None, name: str | None = None,
                on_step=None) -> Restored:
        """Create an execution of ``snapshot`` and rebuild its rebuildable paths from the
        recipes the snapshot recorded: per recipe, check the inputs against their recorded
        BLAKE3 hashes, run the command, run the readiness check (docs/policy.md).

        ``runtime`` runs each command (rametfs.restore.runtime_for): default the sandbox
        recorded with the snapshot (the one that ran the execution it was promoted from);
        ``"bubblewrap"``, ``"docker"``, ``"host"`` (no sandbox: only for recipes you trust),
        a rametfs.sandbox runtime such as ``Bubblewrap()``, or its ``run``.  ``on_step`` is
        called with each step as it ends.  Raises :class:`RestoreError` naming the recipe
        when an input changed or a command or check failed (the execution is kept),
        RametError ENOENT for an unknown snapshot, EINVAL when the snapshot has recipes,
        records no sandbox and ``runtime`` is None (nothing is left behind).
        """
        from rametfs import restore  # only here: it hashes with BLAKE3
        reply = self._backend.run(protocol.Create(snapshot, name))
        execution = Execution(self, reply["execution"])
        record = next(s for s in self.snapshots() if s["id"] == reply["snapshot"])
        recipes = record.get("recipes", [])
        try:
            run = restore.runtime_for(runtime, record.get("runtime"), record["id"]) \
                if recipes or runtime is not None else None
        except RametError:
            self.release(execution)
            raise
        steps = restore.rebuild(execution, recipes, run, on_step)
        if steps and not steps[-1].ok:
            failed = steps[-1]
            raise RestoreError(failed.errno, f"restore of {reply['snapshot'][:12]} into "
                               f"execution {execution.id}: recipe {failed.recipe}: "
                               f"{failed.step} failed: {failed.detail}", execution, steps)
        return Restored(reply["snapshot"], execution, steps)

    def execution_pool(self, snapshot: str, concurrency: int = 4, *, name: str | None = None,
                       ttl: float = DEFAULT_TTL, verify: str = "root",
                       policy: str | os.PathLike | None = None, owner: int | None = None,
                       group: int | None = None, share: int | None = None,
                       control: str | None = None, max_bytes: int | None = None,
                       max_inodes: int | None = None,
                       keep_last: int | None = None) -> ExecutionPool:
        """Keep ``concurrency`` executions of ``snapshot`` warm, to hand out with ``acquire()``.

        The daemon (fallback mode: the data directory) keeps the pool and a lease per
        acquired execution (:class:`ExecutionPool`); ``name`` reattaches to (or creates) a
        named pool that outlives this process, ``ttl`` is the lease time in seconds,
        ``verify`` the check after each reset (``"root"`` or ``"deep"``), ``policy`` the
        persistence policy every member is created with (as :meth:`create` takes it);
        ``owner``, ``group``, ``share``, ``control``, ``max_bytes`` and ``max_inodes`` are
        every member's, as :meth:`create` takes them (a named pool reattached to keeps its
        own; those given must match it); ``keep_last`` N: after each promote of a member,
        the pool's promotes but the N newest and the named ones are forgotten (gc frees
        their data; docs/lifecycle.md).  Errors: ENOENT unknown snapshot, EEXIST a pool of
        that name has another base, policy, settings or keep_last, EINVAL bad name, size,
        policy, setting or keep_last.
        """
        return ExecutionPool(self, snapshot, concurrency, name=name, ttl=ttl, verify=verify,
                             policy=policy, owner=owner, group=group, share=share,
                             control=control, max_bytes=max_bytes, max_inodes=max_inodes,
                             keep_last=keep_last)

    def open_pool(self, snapshot: str, size: int, *, name: str | None = None,
                  policy: str | os.PathLike | None = None, owner: int | None = None,
                  group: int | None = None, share: int | None = None,
                  control: str | None = None, max_bytes: int | None = None,
                  max_inodes: int | None = None, keep_last: int | None = None) -> dict:
        """Create a pool of ``size`` executions of ``snapshot`` kept by the daemon (fallback
        mode: the data directory), or reattach to the pool ``name``, growing it to ``size``;
        the settings and ``policy`` are every member's, as :meth:`create` takes them, and
        ``keep_last`` trims the pool's promotes as :meth:`execution_pool` says.  Unlike
        :meth:`execution_pool` it holds nothing here: the pool stays until :meth:`drop_pool`.
        Returns ``{"ok", "pool", "snapshot", "size", "created", "executions"}``.  Errors as
        :meth:`execution_pool`'s."""
        return self._backend.run(protocol.Pool(
            snapshot, size, name, _policy_text(policy), keep_last,
            protocol.Access(owner, group, share, control, max_bytes, max_inodes)))

    def acquire(self, pool: str, holder: str, ttl: float = DEFAULT_TTL,
                pid: int | None = None, host: str | None = None) -> dict:
        """Lease the ready execution of ``pool`` returned last to ``holder`` (a token the
        caller chooses and gives again to :meth:`renew` and :meth:`return_execution`) for
        ``ttl`` seconds, recording ``pid`` (default: this process) and ``host`` (default:
        this host's name) for people.  Answers at once: ``{"ok", "execution", "path", "pool",
        "snapshot", "lease"}``.  Errors: EBUSY none ready (poll; :meth:`ExecutionPool.acquire`
        does), ENOENT unknown pool, EINVAL a bad ``ttl``."""
        return self._backend.run(protocol.Acquire(
            pool, holder, protocol.seconds_ns(ttl), os.getpid() if pid is None else pid,
            socket.gethostname() if host is None else host))

    def renew(self, execution: str | Execution, holder: str, ttl: float = DEFAULT_TTL
              ) -> dict:
        """Extend ``holder``'s lease on ``execution`` to ``ttl`` seconds from now; the lease
        record (``{"holder", "pid", "host", "expires_ns", "acquired_ns"}``).  Errors: EBUSY
        another holder's, EINVAL not leased (it ended: the execution went back to its pool),
        ENOENT not in a pool."""
        return self._backend.run(protocol.Renew(_execution_id(execution), holder,
                                                protocol.seconds_ns(ttl)))["lease"]

    def return_execution(self, execution: str | Execution, holder: str,
                         verify: str = "root") -> dict:
        """Give ``holder``'s leased ``execution`` back: it is reset to its pool's snapshot,
        verified (``"root"`` or ``"deep"``) and made ready, or quarantined when it differs.
        Returns ``{"ok", "execution", "pool", "state", "reset_ms", "verification"}``.  Errors
        as :meth:`renew`."""
        return self._backend.run(protocol.Return(_execution_id(execution), holder, verify))

    def drop_pool(self, pool: str) -> list[str]:
        """Release every execution of ``pool``, leased ones too, and forget it; the ids of
        the executions released.  Errors: ENOENT unknown pool."""
        return self._backend.run(protocol.Drop(pool))["executions"]

    def pools(self) -> list[dict]:
        """Every pool: ``{"name", "base", "size", "created_ns", "keep_last", "executions",
        "ready", "leased", "quarantined"}`` (the last three count executions in each state;
        ``keep_last`` None: every promote kept)."""
        return self.status()["pools"]

    def status(self) -> dict:
        """The status: ``{"mode", "pid", "data", "mount", "version", "copy_method",
        "open_less", "snapshots_bind", "snapshots", "executions", "pools", "last", "gc",
        "memory"}``, the same keys in both modes (see the project docs for each record);
        ``copy_method`` (``"clonefile"``, ``"reflink"`` or ``"copy"``) is fallback mode's;
        ``mount``, ``open_less``, ``snapshots_bind``, ``gc`` and ``memory`` FUSE mode's;
        each None in the other mode."""
        return self._backend.status()

    def snapshots(self) -> list[dict]:
        """Every snapshot record: ``{"id", "label", "message", "parents", "created_ns",
        "tree", "source", "files", "bytes", "names"}`` (``tree`` the root tree id: equal for
        equal trees)."""
        return self.status()["snapshots"]

    def executions(self) -> list[dict]:
        """Every execution record, with the same keys in both modes: ``{"execution", "id",
        "base", "head", "state", "created_ns", "upper_bytes", "upper_inodes",
        "captured_bytes", "max_bytes", "max_inodes", "last", "pool", "lease",
        "quarantine_reason", "failure", "waiting", "policy", "runtime", "path", "mode",
        "copy_method", "owner", "group", "share", "control"}`` (``upper_bytes``,
        ``upper_inodes`` and ``captured_bytes`` are None in fallback mode, ``copy_method`` in
        FUSE mode; ``share`` octal text, ``"0700"``); ``"lease"`` is ``{"holder", "pid", "host", "expires_ns",
        "acquired_ns"}`` or None; ``"state"`` is ``"ready"``, ``"leased"``,
        ``"quarantined"`` or (FUSE mode) ``"promoting"`` or ``"failed"``; ``"policy"`` where
        its stored policy came from (``"create --policy"``, ``"pool --policy"``,
        ``"ramet.toml"``) or None; ``"runtime"`` the sandbox recorded for it
        (:meth:`Execution.record_runtime`) or None.  A process other than the harness sees
        only the executions shared with it, as their own status shows them (``{"execution",
        "id", "base", "head", "state", "created_ns", "upper_bytes", "upper_inodes",
        "captured_bytes", "max_bytes", "max_inodes", "last"}``)."""
        return self.status()["executions"]


@dataclass(frozen=True)
class Execution:
    """One execution: a writable view of a snapshot at :attr:`path`.

    Its commands act on this execution only (in FUSE mode through ``<path>/.ramet/``); an
    unknown or released execution raises :class:`RametError` (ENOENT).
    """

    ramet: Ramet
    id: ExecutionId

    @property
    def path(self) -> Path:
        """Where the sandbox works: ``<mnt>/executions/<id>``, or in fallback mode the real
        directory ``<data>/fallback/executions/<id>``."""
        return self.ramet._backend.execution_path(self.id)

    def promote(self, label: str | None = None, message: str | None = None,
                policy: str | os.PathLike | None = None, publish: bool = False) -> SnapshotId:
        """Save the current tree as a new snapshot and carry on from it; return its id.

        The persistence policy applied is ``policy`` (a TOML file, ``"tree"``: the tree's
        own ``ramet.toml``, or ``"none"``), else the one stored with the execution at
        create (docs/policy.md).  ``publish``: then publish it to the daemon's remote
        (docs/remote.md; FUSE mode, from the harness's root ``ctl``).  Errors: EINVAL for a
        malformed policy (the message names the line) or one the tree breaks (every
        offending path named), and for ``publish`` without a remote; EIO when the remote
        fails (the snapshot is made and is the head; publish it again with
        :meth:`Ramet.publish`).
        """
        return self.ramet._backend.run(protocol.Promote(
            self.id, label or "", message or "", _policy_text(policy), publish))["snapshot"]

    def checkpoint(self, label: str | None = None, message: str | None = None,
                   policy: str | os.PathLike | None = None) -> SnapshotId:
        """Save the current tree as a new snapshot without moving the head; return its id.
        Everything is kept unless a ``policy`` is given (as :meth:`promote` takes it)."""
        return self.ramet._backend.run(protocol.Checkpoint(
            self.id, label or "", message or "", _policy_text(policy)))["snapshot"]

    def preview(self, policy: str | os.PathLike | None = None) -> dict:
        """What a promote would keep, changing nothing: ``{"ok", "policy", "paths",
        "totals", "recipes", "problems"}`` (docs/policy.md); ``paths`` lists each path with
        its ``"class"`` and ``"bytes"``, ``totals`` the paths, files and bytes per class.
        Under ``policy`` (as :meth:`promote` takes it), else the execution's stored policy,
        else none."""
        return self.ramet._backend.run(protocol.Preview(self.id, _policy_text(policy)))["preview"]

    def reset(self, to: str | None = None, base: bool = False) -> str:
        """Drop every change since the head (the last promote, else the base it was created
        from) and return the head's snapshot id.  ``to`` (a snapshot id or unique prefix)
        rebases it onto that snapshot instead, and ``base`` onto its base; either becomes its
        head (what :meth:`diff`, :meth:`verify` and the next promote refer to).  O(1) in FUSE
        mode whatever the target.

        Errors: EINVAL both given, ENOENT unknown snapshot, EACCES ``to`` through the
        execution's own control file (a sandbox's: which snapshot it stands on is the
        harness's).
        """
        return self.ramet._backend.run(protocol.Reset(self.id, to, base))["snapshot"]

    def record_runtime(self, name: str, uid: int, gid: int, image: str | None = None) -> None:
        """Record that sandbox ``name`` (``"bubblewrap"`` or ``"docker"``, with ``image``)
        runs this execution's commands as ``uid``:``gid``; the rametfs.sandbox adapters call
        it before each command.  A promote keeps it with the recipes it stores, and
        :meth:`Ramet.restore` runs them there by default.  A root command: only the harness
        can record it.  Errors: EINVAL a bad sandbox, ENOENT unknown execution."""
        self.ramet._backend.run(protocol.Runtime(self.id, name, uid, gid, image))

    def diff(self) -> list[tuple[str, str]]:
        """What changed against the head (see :meth:`reset`): sorted ``(status, path)`` pairs, status one of
        ``"A"``, ``"M"``, ``"D"``, path relative to :attr:`path` (a name that is not UTF-8
        is decoded as ``os.fsdecode`` does: ``os.fsencode`` gives its bytes back)."""
        return self.ramet._backend.diff(self.id)

    def verify(self, deep: bool = False) -> list[tuple[str, str]]:
        """How the tree differs from the head, as ``(status, path)`` pairs; empty when it
        equals the head, as it must after :meth:`reset`.

        Fallback mode checks the manifest (a path it cannot vouch for counts as different);
        ``deep`` reads and hashes every file.  FUSE mode compares the root tree id the
        execution would promote to with its head's, rehashing files that hold changed
        bytes; ``deep`` also rehashes every base byte it serves.  A ready execution of a
        pool that differs is quarantined by the daemon (never handed out again).
        """
        reply = self.ramet._backend.run(protocol.Verify(self.id, "deep" if deep else "root"))
        return [tuple(pair) for pair in reply["verification"]["differences"]]

    def status(self) -> dict:
        """Its record (the keys of :meth:`Ramet.executions`); ``"last"`` is the reply of its
        last command, with the promote's ``"stats"``.  A process other than the harness reads
        the execution's own ``.ramet/status``: ``{"execution", "id", "base", "head",
        "state", "created_ns", "upper_bytes", "upper_inodes", "captured_bytes", "max_bytes",
        "max_inodes", "last"}``, the last reply without store-wide figures."""
        return self.ramet._backend.execution_status(self.id)


class _Mount:
    """FUSE mode: every call is a command on, or a read of, the mount's control files.

    ``mountpoint`` may also be an execution's directory (``<mnt>/executions/<id>``, or
    ``/workspace`` in a sandbox): ``here`` is then that execution's id.  Where the mount
    holding it is in reach and this process is the harness, the mount is used as if given
    (``mount`` is its root); else only that execution's own ``.ramet/`` files are
    (``own``), and a call that needs the mount raises RametError (EINVAL) saying so.
    """

    def __init__(self, mountpoint: str | os.PathLike | None) -> None:
        if mountpoint is None:
            mountpoint = os.environ.get(MOUNT_ENV)
            if not mountpoint:
                raise RametError(errno.EINVAL, f"no mountpoint given and ${MOUNT_ENV} is not set")
        path = Path(os.path.abspath(mountpoint))
        self.here: str | None = None
        self.own: Path | None = None  # an execution's directory, reached through its own files
        top = path.parent.parent
        in_executions = path.parent.name == protocol.EXECUTIONS_DIR and _is_root(top)
        if not _reachable(_control_file(path, protocol.STATUS)):
            if not in_executions:  # (--control none: an execution without .ramet)
                raise NotMountedError(path)
            self.here, path = path.name, top
        elif os.path.exists(_control_file(path, protocol.PROMOTE)):  # only an execution's has it
            self.here = _read_json(_control_file(path, protocol.STATUS), path)["execution"]
            if in_executions and path.name == self.here \
                    and os.access(_control_file(top, protocol.CTL), os.W_OK):
                path = top
            else:
                self.own = path
        self.mount = path
        self.root_ctl = _control_file(path, protocol.CTL)
        self.harness = self.own is None and os.access(self.root_ctl, os.W_OK)  # else: own files

    def close(self) -> None:
        pass

    def _needs_mount(self, what: str) -> None:
        """RametError (EINVAL) when only an execution's own files are in reach."""
        if self.own is not None:
            raise RametError(errno.EINVAL, f"{self.own} is execution {self.here}'s directory, "
                             f"not a rametfs mount: {what} needs the mountpoint (the "
                             "harness's, outside any sandbox); this execution's own commands "
                             "work here")

    def run(self, command: protocol.Command, progress=None) -> dict:
        """Write ``command`` to the root ``ctl``, or, for an execution's command from a
        process that is not the harness, to that execution's own ``ctl``; its reply."""
        if isinstance(command, protocol.ExecutionCommand):
            eid = command.execution
            ctl = self._control(eid, protocol.CTL)
            if not self.harness:
                line = protocol.format(dataclasses.replace(command, execution=None))
                return _command(ctl, line, self.mount, self._missing(eid))
            return self._root_on(eid, command)
        return self._root(command)

    def _root(self, command: protocol.Command) -> dict:
        self._needs_mount(command.NAME)
        return _command(self.root_ctl, protocol.format(command), self.mount)

    def status(self) -> dict:
        self._needs_mount("the mount's status")
        return _read_json(self.mount / protocol.CONTROL_DIR / protocol.STATUS, self.mount)

    def execution_path(self, execution_id: str) -> Path:
        if self.own is not None:
            if execution_id != self.here:
                self._needs_mount(f"execution {execution_id!r}")
            return self.own
        return self.mount / protocol.EXECUTIONS_DIR / execution_id

    def _root_on(self, execution_id: str, command: protocol.Command) -> dict:
        """Root ``<command> <execution_id> ...``; the daemon's "no execution" error reads as
        the path route's does."""
        try:
            return self._root(command)
        except RametError as exc:
            if exc.errno == errno.ENOENT and str(exc) == f"no execution {execution_id!r}":
                raise RametError(errno.ENOENT, self._missing(execution_id)) from None
            raise

    def diff(self, execution_id: str) -> list[tuple[str, str]]:
        if self.harness:
            self._control(execution_id, protocol.DIFF)  # the name's check
            return [tuple(pair) for pair in
                    self._root_on(execution_id, protocol.Diff(execution_id))["diff"]]
        text = self._read(execution_id, protocol.DIFF)
        out = []
        for line in text.split("\n")[:-1]:  # one line per change, each ending in "\n"
            letter, _, quoted = line.partition(" ")
            try:
                out.append((letter, os.fsdecode(protocol.unquote_path(quoted))))
            except protocol.ProtocolError as exc:
                raise RametError(errno.EIO, f"{execution_id}/.ramet/diff: {exc}") from None
        return out

    def execution_status(self, execution_id: str) -> dict:
        status = self._control(execution_id, protocol.STATUS)
        if self.harness:
            return self._root_on(execution_id, protocol.Status(execution_id))["status"]
        return _read_json(status, self.mount, self._missing(execution_id))

    def _control(self, execution_id: str, name: str) -> Path:
        if not protocol.EXECUTION_NAME_RE.fullmatch(execution_id):  # "..": the root's files
            raise RametError(errno.ENOENT, self._missing(execution_id))
        return _control_file(self.execution_path(execution_id), name)

    def _missing(self, execution_id: str) -> str:
        return f"no execution {execution_id!r} at {self.mount}"

    def _read(self, execution_id: str, name: str) -> str:
        return _read_text(self._control(execution_id, name), self.mount,
                          self._missing(execution_id))


class _Local:
    """Fallback mode: :mod:`rametfs.fallback` runs each call in this process."""

    here = None  # a data directory is never an execution's

    def __init__(self, data: str | os.PathLike | None) -> None:
        if data is None:
            data = os.environ.get(DATA_ENV)
            if not data:
                raise RametError(errno.EINVAL, "fallback mode needs a data directory: "
                                 f"give data= or set ${DATA_ENV}")
        # only here: they load the store (lmdb, blake3, zstandard)
        from rametfs.fallback import Fallback, service
        self.service = service
        with service.file_errors():
            self.engine = Fallback(data)
        self.data = self.engine.data

    def close(self) -> None:
        self.engine.close()

    def run(self, command: protocol.Command, progress=None) -> dict:
        return self.service.run(self.engine, command, progress)

    def status(self) -> dict:
        with self.service.file_errors():
            return self.engine.status()

    def execution_path(self, execution_id: str) -> Path:
        return self.engine.path(execution_id)

    def diff(self, execution_id: str) -> list[tuple[str, str]]:
        with self.service.file_errors():
            return [(letter, os.fsdecode(path)) for letter, path in self.engine.diff(execution_id)]

    def execution_status(self, execution_id: str) -> dict:
        with self.service.file_errors():
            return self.engine.execution_status(execution_id)


def _policy_text(path: str | os.PathLike | None) -> str | None:
    """The ``--policy`` value for ``path``: the text of the policy file there, or the word
    ``"tree"`` or ``"none"`` given as a str (a file of that name: ``"./tree"``); None when
    none is given.  RametError if the file is unreadable."""
    if path is None or path in (protocol.POLICY_TREE, protocol.POLICY_NONE):
        return path
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        code = getattr(exc, "errno", None) or errno.EINVAL
        raise RametError(code, f"policy {os.fspath(path)}: {exc}") from None


def _execution_id(execution: str | Execution) -> str:
    return execution.id if isinstance(execution, Execution) else execution


class ExecutionPool:
    """``concurrency`` executions of one snapshot, handed out one holder at a time; the pool
    and its leases are kept by the daemon (FUSE mode) or in the data directory (fallback
    mode), so they outlive this process.  :meth:`acquire` may be called from several threads.

    Each :meth:`acquire` takes a lease on one execution for ``ttl`` seconds, recorded with
    this pool handle's :attr:`holder` token, this pid and host; a background thread renews
    the leases held here every ``ttl / 3`` seconds.  Leaving ``acquire()`` returns the
    execution: it is reset, verified (``verify``: ``"root"`` or ``"deep"``) and put back,
    or quarantined when verification fails (then the pool makes a new one).  If this
    process dies, its leases expire: the daemon returns those executions itself; in
    fallback mode the next ``acquire`` that finds no ready execution takes one of them.

    Creating the pool creates its executions (or reattaches to the pool ``name``).  Unnamed
    pools are dropped (every execution released, held ones too) by :meth:`close`, or on
    leaving the ``with`` block; a named pool stays for the next process to reattach to, and
    :meth:`close` only returns the executions still held here; :meth:`drop` deletes it.
    :attr:`renew_error` is the last error of the renewing thread (None while renewals
    succeed).
    """

    def __init__(self, ramet: Ramet, snapshot: str, concurrency: int, *,
                 name: str | None = None, ttl: float = DEFAULT_TTL, verify: str = "root",
                 policy: str | os.PathLike | None = None, owner: int | None = None,
                 group: int | None = None, share: int | None = None,
                 control: str | None = None, max_bytes: int | None = None,
                 max_inodes: int | None = None, keep_last: int | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        if not ttl > 0:
            raise ValueError(f"ttl must be positive seconds, not {ttl}")
        self.ramet = ramet
        self.ttl = ttl
        self.verify = verify
        self.host = socket.gethostname()
        self.holder = f"{self.host}:{os.getpid()}:{secrets.token_hex(4)}"
        reply = ramet.open_pool(snapshot, concurrency, name=name, policy=policy, owner=owner,
                                group=group, share=share, control=control,
                                max_bytes=max_bytes, max_inodes=max_inodes,
                                keep_last=keep_last)
        self.name: str = reply["pool"]
        self.base: str = reply["snapshot"]
        self._owned = name is None
        self._lock = threading.Lock()
        self._held: dict[str, Execution] = {}
        self._closed = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.renew_error: RametError | None = None

    def __enter__(self) -> ExecutionPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextlib.contextmanager
    def acquire(self, timeout: float | None = None) -> Iterator[Execution]:
        """Hold a free execution for the ``with`` block; wait up to ``timeout`` seconds
        (``None``: forever) for one, asking again every few ms (at most 50 ms apart).
        Leaving the block resets and verifies the execution and returns it to the pool (or
        quarantines it).

        Raises :class:`PoolTimeout` (EBUSY) when none is free in time, :class:`RametError`
        (EINVAL) when the pool is closed, ENOENT when it was dropped; on leaving, EINVAL
        when the lease was lost (it expired: the execution went back to the pool).
        """
        execution = self._take(timeout)
        try:
            yield execution
        finally:
            self._give_back(execution)

    def close(self) -> None:
        """Unnamed pool: drop it (release every execution, held ones too).  Named pool:
        return the executions held here.  Raises the first error after trying them all."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            held, self._held = list(self._held.values()), {}
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self._owned:
            self.ramet.drop_pool(self.name)
            return
        first_error = None
        for execution in held:
            try:
                self._return(execution)
            except RametError as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def drop(self) -> None:
        """Release every execution of the pool, held ones too, and delete the pool."""
        self._owned = True
        self.close()

    def _take(self, timeout: float | None) -> Execution:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = _POLL_FIRST
        while True:
            if self._closed:
                raise RametError(errno.EINVAL, "the execution pool is closed")
            try:
                reply = self.ramet.acquire(self.name, self.holder, self.ttl, host=self.host)
            except RametError as exc:
                if self._closed:  # closed (and maybe dropped) by another thread meanwhile
                    raise RametError(errno.EINVAL, "the execution pool is closed") from None
                if exc.errno != errno.EBUSY:
                    raise
                remaining = math.inf if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    raise PoolTimeout(errno.EBUSY, f"no free execution after {timeout} s: "
                                      f"{exc}") from None
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, _POLL_MAX)
                continue
            execution = Execution(self.ramet, reply["execution"])
            with self._lock:
                self._held[execution.id] = execution
                if self._renewer is None:
                    self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                                     name=f"rametfs lease renewer {self.name}")
                    self._renewer.start()
            return execution

    def _give_back(self, execution: Execution) -> None:
        with self._lock:
            if self._held.pop(execution.id, None) is None:
                return  # the pool was closed meanwhile
        self._return(execution)

    def _return(self, execution: Execution) -> dict:
        return self.ramet.return_execution(execution, self.holder, self.verify)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._lock:
                held = list(self._held)
            for execution_id in held:
                try:
                    self.ramet.renew(execution_id, self.holder, self.ttl)
                    self.renew_error = None
                except RametError as exc:  # the daemon may be restarting: try again later
                    with self._lock:
                        if execution_id in self._held:  # not returned meanwhile
                            self.renew_error = exc


def _reachable(path: Path) -> bool:
    """Whether ``path`` exists; RametError (EACCES) when this uid may not look (an execution
    of another owner, which is there, not "not mounted")."""
    try:
        os.stat(path)
    except PermissionError:
        raise RametError(errno.EACCES, f"{path}: permission denied: uid {os.getuid()} may not "
                         f"use this execution (its owner, create --owner, and --share "
                         f"decide)") from None
    except OSError:
        return False
    return True


def _control_file(directory: Path, name: str) -> Path:
    return directory / protocol.CONTROL_DIR / name


def _is_root(path: Path) -> bool:
    """Whether ``path`` is a rametfs mount's root: its ``.ramet/`` has a status file and no
    ``promote`` (which only an execution's has)."""
    return os.path.exists(_control_file(path, protocol.STATUS)) \
        and not os.path.exists(_control_file(path, protocol.PROMOTE))


def _error(exc: OSError, mount: Path, missing: str | None = None) -> RametError:
    """Turn an OSError on the mount into a RametError with a readable message."""
    if exc.errno == errno.ENOTCONN:
        return NotMountedError(mount)
    if exc.errno == errno.ENOENT and missing:
        return RametError(errno.ENOENT, missing)
    return RametError(exc.errno or errno.EIO, f"{exc.filename}: {exc.strerror}")


def _read_text(path: Path, mount: Path, missing: str | None = None) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise _error(exc, mount, missing) from None


def _read_json(path: Path, mount: Path, missing: str | None = None) -> dict:
    """The JSON document in the status file at ``path`` (each content of a control file is
    an inode of its own, so a read never joins two versions)."""
    return json.loads(_read_text(path, mount, missing))


def _command(ctl: Path, line: str, mount: Path, missing: str | None = None) -> dict:
    """Write one command line to ``ctl`` and return its JSON reply, read back from the file.
    Raises :class:`RametError` with the reply's errno and message on failure.

    Each open of a ``ctl`` file is an inode of its own, holding the reply to the command
    written to it; two opens racing in one path lookup can share one, so the write and the
    read hold an exclusive flock(2) on it.
    """
    try:
        fd = os.open(ctl, os.O_RDWR)
    except OSError as exc:
        raise _error(exc, mount, missing) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        data = line.encode()
        try:
            written = os.write(fd, data)
        except OSError as exc:
            failure = exc
        else:
            failure = None if written == len(data) else OSError(
                errno.EIO, f"short write of a command ({written} of {len(data)} bytes)")
        raw = b""
        try:
            while chunk := os.pread(fd, _MAX_REPLY, len(raw)):  # a preview can be long
                raw += chunk
        except OSError as exc:
            raise _error(exc, mount) from None
    finally:
        os.close(fd)
    reply = protocol.decode_reply(raw) if raw.strip() else {}
    if failure is None and reply.get("ok"):
        return reply
    code = reply.get("errno") or (failure.errno if failure else None) or errno.EIO
    message = reply.get("error") or (failure.strerror if failure else None) \
        or f"{line.strip()!r}: no reply from the daemon"
    raise RametError(code, message)
