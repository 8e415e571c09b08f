"""Make an execution's directory equal to a snapshot, touching only the paths that differ.

Materialising a new execution is the same job on an empty directory; ``reset`` is this job
on a used one.  In three steps:

1. *plan*: walk the snapshot's trees and the directory side by side, one ``lstat`` per path
   and no file read.  A path is kept when its manifest record vouches for it (same inode,
   ctime, mtime, mode, size) and records the snapshot's entry (content id, owner, xattrs,
   link count); anything else there is removed, anything missing is created.  A hard-linked
   group is kept or written again whole, so its names stay one inode.
2. *apply*: remove; make directories; write files from the shared hydration cache
   (``Store.hydrate``) with the copy method of :mod:`.clone`, one job per content id on every
   core, further names of a hard-linked inode with link(2); make symlinks, fifos, device
   nodes; set owner, xattrs, mode and mtime (ns) of each written path; then fix each
   directory's attributes, deepest first (its mtime last, after its entries changed).
3. the new manifest: the kept records, and an ``lstat`` of each path written.

Symlinks are never followed (``lstat``, ``O_NOFOLLOW``, ``follow_symlinks=False``).  Owners
are set only when running as root.  Blocking.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..core import acl
from ..longpath import cached, forget, short
from ..store import EMPTY_CONTENT, Entry, Snapshot, Store
from ..treewalk import postorder, preorder
from .clone import clone_file
from .manifest import Record
from ..store.importer import read_xattrs
from .scan import join


@dataclass
class SyncStats:
    """Counts of one sync: paths kept, removed and written; files written per copy method
    (``{"reflink": 3}``) and their bytes."""

    kept: int = 0
    removed: int = 0
    written: int = 0
    methods: Counter = field(default_factory=Counter)
    file_bytes: int = 0

    def as_dict(self) -> dict:
        return {"kept": self.kept, "removed": self.removed, "written": self.written,
                "methods": dict(self.methods), "file_bytes": self.file_bytes}


class _Sync:
    def __init__(self, store: Store, root: bytes, records: dict[bytes, Record], method: str):
        self.store = store
        self.root = root
        self.method = method
        self.by_ino = {r.ino: r for r in records.values()}
        self.as_root = os.geteuid() == 0
        self.stats = SyncStats()
        self.order: list[tuple[bytes, Entry]] = []  # every snapshot path, parents first
        self.changes: list[tuple[str, bytes]] = []  # how the directory differs (verify)
        self.remove: list[bytes] = []
        self.mkdirs: list[bytes] = []
        self.files: dict[bytes, list[list[tuple[bytes, Entry]]]] = {}  # content id -> inodes
        self.others: list[list[tuple[bytes, Entry]]] = []  # symlinks, fifos, devices, sockets
        self.dirs: list[tuple[bytes, Entry]] = []  # children before parents
        self.groups: dict[int, list[tuple[bytes, Entry, os.stat_result | None]]] = {}
        self.kept: dict[bytes, Record] = {}
        self.written: set[bytes] = set()
        # Directories with a default ACL: what is made in them inherits ACLs (and a directory
        # the default ACL too) on the host, which _set_attrs takes off where unwanted.
        self.inheriting: set[bytes] = set()
        self.lock = threading.Lock()

    def path(self, rel: bytes) -> bytes:
        """The absolute path of ``rel``: maybe longer than PATH_MAX (rametfs.longpath)."""
        return self.root + b"/" + rel if rel else self.root

    # -- plan ----------------------------------------------------------------------------

    def plan(self, root: Entry) -> None:
        self.order.append((b"", root))
        with cached():
            for _ in preorder([(b"", root, os.lstat(self.root))], self._plan_dir):
                pass
        self.dirs.append((b"", root))
        for members in self.groups.values():
            self._plan_group(members)

    def _plan_dir(self, item: tuple[bytes, Entry, os.stat_result | None]
                  ) -> Iterator[tuple[bytes, Entry, os.stat_result | None]]:
        """Plan one directory of the snapshot (``st`` its lstat there, None if missing);
        yields its subdirectories, which the walk plans before this one goes on."""
        rel, b, st = item
        current: dict[bytes, os.stat_result] = {}
        if st is not None:
            with short(self.path(rel)) as path:
                xattrs = self._dir_xattrs(path, st)
                if acl.DEFAULT in dict(xattrs):
                    self.inheriting.add(rel)
                if self._dir_differs(path, b, st, xattrs):
                    self.changes.append(("M", rel + b"/"))
                with os.scandir(path) as it:
                    current = {e.name: e.stat(follow_symlinks=False) for e in it}
        base = self.store.tree(b.ref)
        for name in sorted(current.keys() - base.keys()):
            self.changes.append(("A", join(rel, name)))
            self.remove.append(join(rel, name))
        for name, be in base.items():
            p = join(rel, name)
            self.order.append((p, be))
            cst = current.get(name)
            if cst is not None and stat.S_IFMT(cst.st_mode) != stat.S_IFMT(be.mode):
                self.changes.append(("M", p))
                self.remove.append(p)
                cst = None
            if be.is_dir:
                if cst is None:
                    self.changes.append(("D", p + b"/"))
                    self.mkdirs.append(p)
                yield p, be, cst
                self.dirs.append((p, be))  # after its subtree: children before parents
            elif be.link:
                self.groups.setdefault(be.link, []).append((p, be, cst))
            elif cst is not None and self._clean(be, cst):
                self._keep(p, be, cst)
            else:
                self._rewrite([(p, be, cst)])

    def _plan_group(self, members: list[tuple[bytes, Entry, os.stat_result | None]]) -> None:
        first = members[0][2]
        if first is not None and all(st is not None and st.st_ino == first.st_ino
                                     for _, _, st in members) \
                and self._clean(members[0][1], first):
            for p, be, st in members:
                self._keep(p, be, st)
        else:
            self._rewrite(members)

    def _keep(self, rel: bytes, be: Entry, st: os.stat_result) -> None:
        record = self.by_ino[st.st_ino]
        self.kept[rel] = Record(be, record.ino, record.ctime_ns)

    def _rewrite(self, names: list[tuple[bytes, Entry, os.stat_result | None]]) -> None:
        """Write the inode these names stand for, removing what they name now."""
        for p, _, st in names:
            self.changes.append(("M" if st is not None else "D", p))
            if st is not None:
                self.remove.append(p)
        be = names[0][1]
        job = [(p, e) for p, e, _ in names]
        if be.is_reg:
            self.files.setdefault(be.ref, []).append(job)
        else:
            self.others.append(job)

    def _clean(self, be: Entry, st: os.stat_result) -> bool:
        record = self.by_ino.get(st.st_ino)
        if record is None or not record.vouches_for(st):
            return False
        e = record.entry
        return (e.ref == be.ref and e.mode == be.mode and e.mtime_ns == be.mtime_ns
                and e.size == be.size and e.uid == be.uid and e.gid == be.gid
                and e.xattrs == be.xattrs and st.st_nlink == (be.nlink if be.link else 1))

    def _dir_xattrs(self, path: bytes, st: os.stat_result) -> tuple[tuple[bytes, bytes], ...]:
        """The xattrs of the directory at ``path`` (short), ``st`` its lstat, sorted
        ``(name, value)`` pairs: its record's when that vouches for it, else read."""
        record = self.by_ino.get(st.st_ino)
        return (record.entry.xattrs if record is not None and record.vouches_for(st)
                else read_xattrs(path))

    def _dir_differs(self, path: bytes, be: Entry, st: os.stat_result,
                     xattrs: tuple[tuple[bytes, bytes], ...] | None = None) -> bool:
        """Whether the directory at ``path`` (short: rametfs.longpath), ``st`` its lstat,
        differs from ``be`` in mode, mtime, xattrs (``xattrs``, or its own) or (as root)
        owner."""
        if xattrs is None:
            xattrs = self._dir_xattrs(path, st)
        return (st.st_mode != be.mode or st.st_mtime_ns != be.mtime_ns or xattrs != be.xattrs
                or (self.as_root and (st.st_uid, st.st_gid) != (be.uid, be.gid)))

    # -- apply ---------------------------------------------------------------------------

    def apply(self) -> None:
        for rel in self.remove:
            self._make_writable(os.path.dirname(rel))
            with short(self.path(rel)) as path:
                is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
                if not is_dir:
                    os.unlink(path)
            if is_dir:
                remove_tree(self.path(rel))
        self.stats.removed = len(self.remove)
        with cached():  # from here on directories are only made
            self._write()

    def _write(self) -> None:
        for rel in self.mkdirs:
            self._make_writable(os.path.dirname(rel))
            with short(self.path(rel)) as path:
                os.mkdir(path, 0o700)
            self.written.add(rel)
            if os.path.dirname(rel) in self.inheriting:  # parents come first
                self.inheriting.add(rel)
        if self.files:
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
                list(pool.map(self._write_content, self.files.keys(), self.files.values()))
        for names in self.others:
            self._make_writable(os.path.dirname(names[0][0]))
            with short(self.path(names[0][0])) as path:
                self._make_node(path, names[0][1],
                                os.path.dirname(names[0][0]) in self.inheriting)
            self._link_rest(names)
        for rel, be in self.dirs:
            with short(self.path(rel)) as path:
                if self._dir_differs(path, be, os.lstat(path)):
                    self._set_attrs(path, be, fresh=rel in self.written,
                                    inherited=os.path.dirname(rel) in self.inheriting)
                    self.written.add(rel)

    def _write_content(self, cid: bytes, inodes: list[list[tuple[bytes, Entry]]]) -> None:
        src = None if cid == EMPTY_CONTENT else os.fsencode(self.store.hydrate(cid))
        for names in inodes:
            rel, be = names[0]
            self._make_writable(os.path.dirname(rel))
            with short(self.path(rel)) as path:
                if src is None:
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                     0o600))
                    method = "empty"
                else:
                    method = clone_file(src, path, self.method)
                self._set_attrs(path, be, inherited=os.path.dirname(rel) in self.inheriting)
            self._link_rest(names)
            with self.lock:
                self.stats.methods[method] += 1
                self.stats.file_bytes += be.size

    def _make_node(self, path: bytes, be: Entry, inherited: bool) -> None:
        """Make the symlink, fifo, device node or socket ``be`` at ``path`` (short), in a
        directory with a default ACL if ``inherited``."""
        if be.is_symlink:
            os.symlink(be.ref, path)
        elif stat.S_ISFIFO(be.mode):
            os.mkfifo(path, 0o600)
        else:  # device node or socket; a device needs root
            os.mknod(path, stat.S_IFMT(be.mode) | 0o600, be.size)
        self._set_attrs(path, be, inherited=inherited)

    def _link_rest(self, names: list[tuple[bytes, Entry]]) -> None:
        for rel, _ in names:
            if rel != names[0][0]:
                self._make_writable(os.path.dirname(rel))
                with short(self.path(names[0][0])) as first, short(self.path(rel)) as path:
                    os.link(first, path, follow_symlinks=False)
            with self.lock:
                self.written.add(rel)

    def _set_attrs(self, path: bytes, be: Entry, fresh: bool = True,
                   inherited: bool = False) -> None:
        """Owner, xattrs, mode and mtime of ``be`` on ``path`` (short); a ``fresh`` path (made just
        now) has no xattrs to remove, so none are read (nor is a security label dropped), but
        for the POSIX ACLs the default ACL of the directory it was made in gave it, when
        ``inherited`` (the host's ``posix_acl_create``)."""
        # chown first: it clears setuid bits and security.capability; xattrs before chmod,
        # since a user.* xattr needs write permission, and chmod sets an access ACL's mask;
        # the mtime last.
        if self.as_root:
            os.chown(path, be.uid, be.gid, follow_symlinks=False)
        if not fresh:
            current = dict(read_xattrs(path))
        elif inherited and not be.is_symlink:
            current = dict.fromkeys(acl.NAMES if be.is_dir else (acl.ACCESS,), b"")
        else:
            current = {}
        wanted = dict(be.xattrs)
        for name in current.keys() - wanted.keys():
            try:
                os.removexattr(path, name, follow_symlinks=False)
            except OSError as exc:  # an ACL the mode said whole was not stored
                if not (fresh and exc.errno == errno.ENODATA):
                    raise
        for name, value in wanted.items():
            if current.get(name) != value:
                os.setxattr(path, name, value, follow_symlinks=False)
        if not be.is_symlink:  # Linux cannot chmod a symlink; its mode is always 0777
            os.chmod(path, stat.S_IMODE(be.mode))
        os.utime(path, ns=(be.mtime_ns, be.mtime_ns), follow_symlinks=False)

    def _make_writable(self, rel: bytes) -> None:
        # root writes anywhere; another user may need to open up a read-only directory,
        # whose mode the last pass (over self.dirs) puts back.
        if self.as_root:
            return
        with short(self.path(rel)) as path:
            mode = os.lstat(path).st_mode
            if mode & 0o300 != 0o300:
                os.chmod(path, stat.S_IMODE(mode) | 0o700)

    # -- the new manifest ----------------------------------------------------------------

    def records(self) -> dict[bytes, Record]:
        with cached():
            return self._records()

    def _records(self) -> dict[bytes, Record]:
        out = {}
        for rel, be in self.order:
            record = self.kept.get(rel)  # directories are never kept: their ctime moved
            if record is None:
                with short(self.path(rel)) as path:
                    st = os.lstat(path)
                record = Record(be, st.st_ino, st.st_ctime_ns)
            out[rel] = record
        self.stats.kept = len(self.kept)
        self.stats.written = len(self.written)
        return out


def remove_tree(path: bytes) -> None:
    """Remove the directory tree at ``path`` (absolute, any length and depth; symlinks are
    removed, never followed), opening up read-only directories on the way (they stop a user
    other than root).  Raises OSError: ENOTDIR when ``path`` is no directory, EACCES for a
    directory that cannot be listed.  (shutil.rmtree recurses, and keeps a descriptor open
    per level.)"""
    def children(item: tuple[bytes, bool]) -> list[tuple[bytes, bool]] | None:
        p, is_dir = item
        if not is_dir:
            return None
        with short(p) as sp, os.scandir(sp) as it:
            return [(p + b"/" + e.name, e.is_dir(follow_symlinks=False)) for e in it]

    def remove(item: tuple[bytes, bool], _below: list | None) -> None:
        p, is_dir = item
        function = os.rmdir if is_dir else os.unlink
        if is_dir:
            forget(p)
        with short(p) as sp:
            try:
                function(sp)
            except PermissionError:
                with short(os.path.dirname(p)) as parent:
                    os.chmod(parent, 0o700)
                function(sp)

    with short(path) as p:
        if not stat.S_ISDIR(os.lstat(p).st_mode):
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), os.fsdecode(path))
    with cached():  # children go before their directory: no cached one is gone while used
        postorder((path, True), children, remove)


def sync(store: Store, root: bytes, snapshot: Snapshot, records: dict[bytes, Record],
         method: str) -> tuple[dict[bytes, Record], SyncStats]:
    """Make the directory ``root`` (absolute) hold exactly ``snapshot``'s tree.

    ``records`` is its manifest (empty for a new directory); returns the new manifest and
    the counts.  Raises OSError (ENOSPC, EACCES, EPERM for a device node without root ...),
    IntegrityError (EIO) when stored content is damaged.
    """
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            os.unlink(root)
            os.mkdir(root, 0o700)
    except FileNotFoundError:
        os.mkdir(root, 0o700)
    s = _Sync(store, root, records, method)
    s.plan(snapshot.root)
    s.apply()
    return s.records(), s.stats


def differences(store: Store, root: bytes, snapshot: Snapshot,
                records: dict[bytes, Record]) -> list[tuple[str, bytes]]:
    """How the directory differs from ``snapshot`` as far as its manifest can tell, without
    reading a file: ``A`` there but not in the snapshot, ``D`` missing, ``M`` different or
    not vouched for by its record.  Empty right after ``sync``."""
    s = _Sync(store, root, records, "copy")
    s.plan(snapshot.root)
    return sorted(s.changes, key=lambda change: change[1])

