"""Fallback executions: real directories under the data directory, driven in-process.

Layout (docs/fallback.md)::

    <data>/fallback/executions/<id>/   the execution's tree: where the sandbox works
    <data>/fallback/meta/<id>          its record and manifest (rametfs.fallback.manifest)
    <data>/fallback/locks/<id>         flock(2)ed while a command runs on it

An execution exists while its record does.  Every command on one execution takes its lock
(EBUSY when another holds it), so processes and threads sharing a data directory do not
interleave.  Snapshots live in the data directory's store, shared with FUSE mode.

Arguments are the values of rametfs.protocol's commands, checked there; rametfs.fallback.service
runs each command here.  Replies are the dicts the control protocol returns (``{"ok": true,
"snapshot": ...}``).  Errors are rametfs.errors classes with their errno, or OSError from the
file system.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .. import protocol
from ..authority import Access
from ..core import lifecycle, retention, status
from ..core import policy as _policy
from ..core.heads import reset_target
from ..core.diff import diff_trees
from ..errors import Busy, Exists, InvalidArgument, NotFound, RametError
from ..longpath import cached
from ..store import Entry, Store, gc, import_git, import_tree
from ..store.gc_guard import Progress
from ..store.entries import directory_entry
from ..store.trees import tree_id
from ..treewalk import Steps, done
from . import clone, manifest, scan, sync
from .pools import Pools

# LMDB must not be opened twice in one process: one Store per data directory, shared by
# every Fallback on it and closed with the last of them.  realpath -> [store, users]
_stores: dict[str, list] = {}
_stores_lock = threading.Lock()


def _open_store(data: str | os.PathLike) -> Store:
    key = os.path.realpath(data)
    with _stores_lock:
        if key not in _stores:
            _stores[key] = [Store(key), 0]
        _stores[key][1] += 1
        return _stores[key][0]


def _close_store(store: Store) -> None:
    key = str(store.root)
    with _stores_lock:
        _stores[key][1] -= 1
        if _stores[key][1] == 0:
            del _stores[key]
            store.close()


class Fallback:
    """Executions as real directories over the store of the data directory ``data``.

    ``copy_method`` is how files are put in place here: ``"clonefile"``, ``"reflink"`` or
    ``"copy"`` (rametfs.fallback.clone).  Raises RametError (EIO) for a store of another
    format, OSError when the directory cannot be made.
    """

    def __init__(self, data: str | os.PathLike):
        self.store = _open_store(data)
        self.data = self.store.root
        self.executions_dir = self.data / "fallback" / "executions"
        self.meta_dir = self.data / "fallback" / "meta"
        self.locks_dir = self.data / "fallback" / "locks"
        try:
            for directory in (self.data / "fallback", self.executions_dir, self.meta_dir,
                              self.locks_dir):
                directory.mkdir(mode=0o700, exist_ok=True)
            self.copy_method = clone.probe(os.fsencode(self.data / "fallback"))
        except BaseException:
            _close_store(self.store)
            raise
        self.closed = False
        self.pools = Pools(self)

    def close(self) -> None:
        """Let go of the store (closed with the last Fallback on it in this process)."""
        if not self.closed:
            self.closed = True
            _close_store(self.store)

    # -- root commands -------------------------------------------------------------------

    def snapshot(self, source: str, label: str = "", message: str = "",
                 on_change: str = "fail") -> dict:
        """Import the directory ``source`` (absolute) as a snapshot (``import_tree``)."""
        snap = import_tree(self.store, source, label, message, on_change)
        return {"ok": True, "snapshot": snap.id, "stats": snap.stats}

    def snapshot_git(self, repo: str, rev: str = "HEAD", with_git_dir: bool = False,
                     label: str = "", message: str = "") -> dict:
        """Import revision ``rev`` of the git repository ``repo`` (absolute) as a snapshot
        (``import_git``); ``with_git_dir`` takes its ``.git`` directory along."""
        snap = import_git(self.store, repo, rev, with_git_dir, label, message)
        return {"ok": True, "snapshot": snap.id, "stats": snap.stats}

    def create(self, snapshot: str, name: str | None = None, policy: str | None = None, *,
               stored_policy: dict | None = None,
               access: protocol.Access = protocol.Access()) -> dict:
        """Materialise ``snapshot`` (id or unique prefix) as a new execution, storing with it
        the persistence policy ``policy`` (a ``--policy`` value: text, ``tree`` or
        ``none``), or the policy record ``stored_policy`` (a pool's); ``access`` the
        ``owner``, ``group``, ``share`` and ``control`` options, recorded and shown in its
        status (the data directory, 0700, keeps every other uid out, and the tree has no
        control files, so neither changes what a sandbox may do; docs/fallback.md).

        Raises NotFound (ENOENT) unknown snapshot, InvalidArgument (EINVAL) malformed policy,
        Exists (EEXIST) name taken, OSError (ENOSPC ...) while writing the tree.
        """
        settings = Access().given(access)
        if settings.max_bytes is not None or settings.max_inodes is not None:
            raise RametError(errno.EOPNOTSUPP,
                             "create: --max-bytes and --max-inodes need FUSE mode (a fallback "
                             "execution is a plain directory: use the file system's project "
                             "quotas)")
        stored_policy = _policy.stored(policy, _policy.CREATE) or stored_policy
        snap = self.store.snapshot(snapshot)
        eid = name or secrets.token_hex(6)
        path = self.path(eid)
        try:
            path.mkdir(mode=0o700)  # reserves the name
        except FileExistsError:
            raise Exists(f"execution {eid!r} already exists") from None
        try:
            with self._locked(eid, create=True):
                started = time.monotonic_ns()
                records, stats = sync.sync(self.store, os.fsencode(path), snap, {},
                                           self.copy_method)
                meta = manifest.Meta(eid, snap.id, snap.id, time.time_ns(), None, records,
                                     settings.to_record(), policy=stored_policy)
                manifest.save(self._meta_path(eid), meta)
        except BaseException:
            sync.remove_tree(os.fsencode(path))
            self._lock_path(eid).unlink(missing_ok=True)
            raise
        return {"ok": True, "execution": eid, "snapshot": snap.id, "path": str(path),
                "stats": {**stats.as_dict(), "create_ms": _ms_since(started)}}

    def release(self, eid: str) -> dict:
        """Delete execution ``eid`` and its directory.  Raises NotFound (ENOENT), Busy."""
        self._check_name(eid)
        self.pools.forget(eid)
        path = self.path(eid)
        with self._locked(eid, create=True):  # a crash in create may have left no lock
            meta_path = self._meta_path(eid)
            found = meta_path.exists() or path.exists()
            meta_path.unlink(missing_ok=True)  # first: the execution is gone from here on
            if path.exists():
                sync.remove_tree(os.fsencode(path))
            self._lock_path(eid).unlink()  # a command that opened it next finds no record
        if not found:
            raise NotFound(self._missing(eid))
        return {"ok": True, "execution": eid}

    def runtime(self, eid: str, runtime: dict) -> dict:
        """Record the sandbox that runs execution ``eid`` (its record: protocol.Runtime.record);
        the manifest is rewritten only when it changes."""
        with self._locked(eid):
            if self._load(eid, records=False).runtime != runtime:
                meta = self._load(eid)
                meta.runtime = runtime
                manifest.save(self._meta_path(eid), meta)
        return {"ok": True, "execution": eid, "runtime": runtime}

    def status(self) -> dict:
        """The root status, with a daemon's keys (rametfs.core.status.root_status): no
        mount, adapter, ``snapshots/`` bind, gc running or daemon memory (None)."""
        executions = [self._json(meta) for meta in self._metas()]
        return status.root_status(
            mode=status.FALLBACK, pid=os.getpid(), data=str(self.data), mount=None,
            copy_method=self.copy_method, snapshots=self.store.snapshots_json(),
            executions=executions, pools=self.pools.to_json(), last=None)

    # -- snapshot lifecycle (rametfs.core.lifecycle, docs/lifecycle.md) --------------------

    def name(self, name: str, snapshot: str) -> dict:
        """Point snapshot name ``name`` at ``snapshot`` (Store.set_name)."""
        snap, previous = self.store.set_name(name, snapshot)
        return {"ok": True, "name": name, "snapshot": snap.id, "previous": previous}

    def unname(self, name: str) -> dict:
        """Delete snapshot name ``name`` (Store.delete_name)."""
        return {"ok": True, "name": name, "snapshot": self.store.delete_name(name)}

    def resolve(self, snapshot: str) -> dict:
        """The id of the snapshot ``snapshot`` names (Store.snapshot)."""
        return {"ok": True, "snapshot": self.store.snapshot(snapshot).id}

    def rm(self, snapshot: str, force: bool = False) -> dict:
        """Forget ``snapshot`` (lifecycle.remove_snapshots); EBUSY while it is used."""
        return lifecycle.remove_snapshots(self.store, [snapshot], force,
                                          self._execution_uses())

    def forget(self, policy: retention.Policy, dry_run: bool = False) -> dict:
        """Forget what the retention policy does not keep (lifecycle.forget_snapshots)."""
        return lifecycle.forget_snapshots(self.store, policy, dry_run, self._execution_uses())

    def gc(self, dry_run: bool = False, compact: bool = False,
           progress: Progress | None = None) -> dict:
        """Collect the store's garbage in this process (rametfs.store.gc.collect), its roots
        the store's and every execution manifest's; ``compact`` is offline only (the CLI's
        ``gc --compact --data``: this store is open here).  Raises as ``collect``."""
        if compact:
            raise InvalidArgument("gc --compact runs on a closed store: rametfs gc "
                                  "--compact --data DIR")
        report = gc.collect(self.store, functools.partial(manifest.gc_roots, self.data),
                            dry_run, progress)
        return {"ok": True, "gc": report.to_json()}

    def _execution_uses(self) -> list[tuple[str, str, str, str]]:
        """``(id, base id, head id, lower id)`` of every execution: what rm and forget keep
        (lifecycle.uses; a fallback execution's tree is synced to its head: its lower)."""
        return [(m.id, m.base, m.head, m.head) for m in self._metas()]

    def _metas(self, records: bool = False) -> Iterator[manifest.Meta]:
        """Every execution's record (``records``: with its manifest), by id."""
        for meta_path in sorted(self.meta_dir.iterdir()):
            if not meta_path.name.startswith("."):  # not a temporary file
                with contextlib.suppress(FileNotFoundError):  # released meanwhile
                    yield manifest.load(meta_path, records=records)

    # -- execution commands --------------------------------------------------------------

    def path(self, eid: str) -> Path:
        """The execution's directory."""
        return self.executions_dir / eid

    def promote(self, eid: str, label: str = "", message: str = "",
                policy: str | None = None) -> dict:
        """Snapshot the execution's tree (parent: its head) and make it the head.

        The persistence policy is the ``--policy`` value ``policy`` (text, ``tree`` or
        ``none``), else the one stored with the execution (rametfs.core.policy.choose);
        InvalidArgument (EINVAL) when it is malformed or this state breaks it (changed shared
        paths, recipe inputs missing or not kept).
        """
        reply = self._capture(eid, label, message, True, policy, stored=True)
        lifecycle.trim_pool(self.store, eid, self._execution_uses())  # pool --keep-last
        return reply

    def checkpoint(self, eid: str, label: str = "", message: str = "",
                   policy: str | None = None) -> dict:
        """Snapshot the execution's tree without moving its head (policy: only ``policy``)."""
        return self._capture(eid, label, message, False, policy, stored=False)

    def preview(self, eid: str, policy: str | None = None) -> dict:
        """What a promote would keep, by class (rametfs.core.policy.Plan.report), under the
        policy a promote would apply.  Stores nothing."""
        with self._locked(eid):
            meta = self._load(eid)
            root = os.fsencode(self.path(eid))
            pol = _load_policy(root, _policy.choose(policy, meta.policy))
            with cached():
                applied = _policy.apply(pol, _policy.FsTree(), _policy.FsTree.root(root),
                                        _Side(self.store, root, meta), durable=True)
        return applied.report()

    def reset(self, eid: str, to: str | None = None, base: bool = False) -> dict:
        """Make the tree equal its head again (``to``: the snapshot with that id or prefix;
        ``base``: its base), which becomes its head (rametfs.core.heads): put back the paths
        that differ and remove the added ones.  Raises NotFound (ENOENT) for an unknown
        snapshot."""
        with self._locked(eid):
            meta = self._load(eid)
            target = self.store.snapshot(reset_target(to, base, meta.base, meta.head))
            started = time.monotonic_ns()
            meta.records, stats = sync.sync(self.store, os.fsencode(self.path(eid)), target,
                                            meta.records, self.copy_method)
            meta.head = target.id
            meta.last = {"ok": True, "snapshot": target.id, "reset_ms": _ms_since(started),
                         "stats": stats.as_dict()}
            manifest.save(self._meta_path(eid), meta)
            return meta.last

    def diff(self, eid: str) -> list[tuple[str, bytes]]:
        """``[(letter, path)]`` against the head, as FUSE's ``.ramet/diff`` has them; reads
        only the files the manifest cannot vouch for, and stores nothing."""
        with self._locked(eid):
            meta = self._load(eid)
            now = scan.scan(self.store, os.fsencode(self.path(eid)), meta.records)
        head = self.store.snapshot(meta.head)
        return diff_trees(head.root, now.root, lambda tid: now.tree(self.store, tid))

    def verification(self, eid: str, mode: str) -> dict:
        """Verify execution ``eid`` in ``mode``: ``"root"``, quick, as far as the manifest
        tells, reading no file (a path it does not vouch for counts as different), or
        ``"deep"``, reading and hashing every file; the verification as replies carry it
        (rametfs.core.status.verification_json).  Its ``root`` is the tree id the execution
        holds: the base's when quick mode finds no difference, else that of a scan (reading
        what the manifest does not vouch for; every file in deep mode).  It compares with the
        head (rametfs.core.heads)."""
        started = time.monotonic_ns()
        with self._locked(eid):
            meta = self._load(eid)
            base = self.store.snapshot(meta.head)
            root = os.fsencode(self.path(eid))
            if mode == "deep":
                now = scan.scan(self.store, root, meta.records, hash_all=True)
                differences = diff_trees(base.root, now.root,
                                         lambda tid: now.tree(self.store, tid))
            else:
                differences = sync.differences(self.store, root, base, meta.records)
                now = scan.scan(self.store, root, meta.records) if differences else None
        tree = base.root if now is None else now.root
        return status.verification_json(mode, tree.ref.hex(), base.root.ref.hex(),
                                        differences, _ms_since(started))

    def execution_status(self, eid: str) -> dict:
        """Execution ``eid``'s record, with a daemon's keys (rametfs.core.status
        .execution_record): its upper bytes and inodes are not tracked and no capture is
        charged (None), none is marked failed and nothing waits on a freeze."""
        self._check_name(eid)
        try:
            return self._json(manifest.load(self._meta_path(eid), records=False))
        except FileNotFoundError:
            raise NotFound(self._missing(eid)) from None

    # -- helpers -------------------------------------------------------------------------

    def _capture(self, eid: str, label: str, message: str, move_head: bool,
                 policy: str | None, stored: bool) -> dict:
        with self._locked(eid), self.store.gc_guard.writing():
            meta = self._load(eid)
            root = self.path(eid)
            if os.path.lexists(root / protocol.CONTROL_DIR):
                raise InvalidArgument(f"execution {eid!r} contains {protocol.CONTROL_DIR!r}, "
                                      "a name rametfs reserves for its control files")
            started = time.monotonic_ns()
            rootb = os.fsencode(root)
            pol = _load_policy(rootb, _policy.choose(policy, meta.policy if stored else None))
            side = _Side(self.store, rootb, meta, store_contents=True)
            with cached():
                applied = _policy.apply(pol, _policy.FsTree(), _policy.FsTree.root(rootb),
                                        side)
            applied.check()
            now = side.scan(applied.skip)
            stats = {"changed_files": now.stats.changed_files,
                     "hashed_files": now.stats.hashed_files, "scanned": now.stats.scanned,
                     "new_chunks": now.stats.new_chunks,
                     "new_chunk_bytes": now.stats.new_chunk_bytes}
            root_entry = now.root
            if applied.shared:
                base = self.store.snapshot(meta.head).root
                for path in applied.shared:
                    parts = os.fsencode(path).split(b"/")
                    root_entry = self._graft(now, root_entry, parts,
                                             self._base_entry(base, parts))
            try:
                digests = {p: _policy.path_digest(rootb, p) for p in applied.inputs}
            except _policy.InputError as exc:
                raise applied.stopped(exc) from None
            stats.update(applied.stats())
            recipes = applied.recipes(digests)
            with self.store.write() as txn:
                for entries in now.trees.values():  # subtrees first, as put_tree needs
                    self.store.put_tree(txn, entries)
                stats.update(self.store.tree_totals(txn, root_entry.ref))
                stats["capture_ms"] = _ms_since(started)
                snap = self.store.put_snapshot(txn, root_entry, [meta.head], label, message,
                                               f"execution:{eid}", stats, recipes,
                                               meta.runtime)
            self.store.sync()
            meta.records = now.records
            meta.head = snap.id if move_head else meta.head
            meta.last = {"ok": True, "snapshot": snap.id, "stats": snap.stats}
            manifest.save(self._meta_path(eid), meta)
            return meta.last

    def _base_entry(self, entry: Entry, parts: list[bytes]) -> Entry:
        for name in parts:
            entry = self.store.tree(entry.ref)[name]
        return entry

    def _graft(self, now: scan.Scan, top: Entry, parts: list[bytes], new: Entry) -> Entry:
        """``top`` with the entry at ``parts`` replaced by ``new``; new trees go to ``now``."""
        path = [top]  # the directories from top down to the parent of the grafted entry
        for name in parts[:-1]:
            path.append(now.tree(self.store, path[-1].ref)[name])
        entry = new
        for up, name in zip(reversed(path), reversed(parts)):  # bottom-up
            entries = now.tree(self.store, up.ref)
            entries[name] = entry.renamed(name)
            children = list(entries.values())
            tid = tree_id(children)
            now.trees[tid] = children
            entry = directory_entry(children, tid, up.mode, up.uid, up.gid, up.mtime_ns,
                                    up.xattrs, up.name)
        return entry

    def _json(self, meta: manifest.Meta) -> dict:
        access = Access.from_record(meta.access)
        pool_fields = self.pools.member_json(meta.id)
        view = status.execution_view(meta.id, meta.base, meta.head, pool_fields["state"],
                                     meta.created_ns, access, meta.last)
        return status.execution_record(view, pool_fields, access, mode=status.FALLBACK,
                                       path=str(self.path(meta.id)), policy_record=meta.policy,
                                       runtime=meta.runtime, last=meta.last,
                                       copy_method=self.copy_method)

    def _load(self, eid: str, records: bool = True) -> manifest.Meta:
        try:
            return manifest.load(self._meta_path(eid), records)
        except FileNotFoundError:
            raise NotFound(self._missing(eid)) from None

    def _missing(self, eid: str) -> str:
        return f"no execution {eid!r} in {self.data}"

    def _check_name(self, eid: str) -> None:
        if not protocol.EXECUTION_NAME_RE.fullmatch(eid):
            raise NotFound(self._missing(eid))

    def _meta_path(self, eid: str) -> Path:
        return self.meta_dir / eid

    def _lock_path(self, eid: str) -> Path:
        return self.locks_dir / eid

    @contextlib.contextmanager
    def _locked(self, eid: str, create: bool = False) -> Iterator[None]:
        """Hold execution ``eid``'s lock (made by ``create``); Busy (EBUSY) when another
        command holds it, NotFound (ENOENT) when there is none."""
        self._check_name(eid)
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self._lock_path(eid), flags, 0o600)
        except FileNotFoundError:
            raise NotFound(self._missing(eid)) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise Busy(f"execution {eid!r} is running another command") from None
            yield
        finally:
            os.close(fd)


def _ms_since(started_ns: int) -> float:
    return round((time.monotonic_ns() - started_ns) / 1e6, 3)


def _load_policy(root: bytes, chosen: _policy.Setting | None) -> _policy.Policy | None:
    """The policy ``chosen`` (rametfs.core.policy.load_chosen), the tree's ``ramet.toml``
    opened without following a symlink or waiting on a FIFO the agent put there."""
    def tree_file() -> tuple[int, int, Callable[[], bytes]] | None:
        path = root + b"/" + _policy.POLICY_FILE.encode()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            return stat.S_IFLNK, 0, bytes
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # a directory or FIFO, refused by its mode
            os.close(fd)
            return st.st_mode, st.st_size, bytes
        with os.fdopen(fd, "rb") as f:
            data = f.read(_policy.MAX_POLICY_BYTES)
        return st.st_mode, st.st_size, lambda: data

    return _policy.load_chosen(chosen, tree_file)


class _Side:
    """rametfs.core.policy.Side over an execution's directory ``root``: its diff from a scan
    against its manifest (``meta``), made once (:meth:`scan`; ``store_contents`` as
    rametfs.fallback.scan.scan takes it)."""

    def __init__(self, store: Store, root: bytes, meta: manifest.Meta,
                 store_contents: bool = False):
        self.store, self.root, self.meta = store, root, meta
        self.store_contents = store_contents
        self.exists = _policy.exists_under(root)
        self.scanned: scan.Scan | None = None

    def scan(self, skip: frozenset[str]) -> scan.Scan:
        """The tree scanned, ``skip`` left out (the same ``skip`` at every call)."""
        if self.scanned is None:
            self.scanned = scan.scan(self.store, self.root, self.meta.records,
                                     store_contents=self.store_contents,
                                     skip=frozenset(map(os.fsencode, skip)))
        return self.scanned

    def changes(self, skip: frozenset[str]) -> Steps[list[tuple[str, bytes]]]:
        now = self.scan(skip)
        head = self.store.snapshot(self.meta.head)
        return done(diff_trees(head.root, now.root, lambda tid: now.tree(self.store, tid)))
