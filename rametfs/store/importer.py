"""Import a directory tree into the store as a new snapshot.

The walk never follows symlinks (they are stored as links) and keeps regular files,
directories, symlinks, hard links (a group id per inode seen more than once in the tree),
modes, uid/gid, mtimes (ns, clamped to what a record holds: :func:`~.format.clamp_time_ns`),
xattrs, device nodes, fifos and sockets.  File contents are cut into pages (chunks), hashed
(BLAKE3) and zstd-compressed on every core; a chunk already in the store is not compressed or
written again, and a file whose (dev, ino, size, mtime, ctime) match the stat cache of an
earlier import is not read at all.

The source may belong to someone who changes it while the import runs (an agent's uid, while
root imports).  The import sees exactly one tree, the one it lists:

- The source path is resolved once, when it is opened (its last component not followed).
  Below it every entry is reached by its name relative to its directory's open fd
  (``openat``, ``fstatat``, ``readlinkat``) with ``O_NOFOLLOW``, and the fstat of what was
  opened must show the listing's device, inode and type; its xattrs and symlink target are
  read through that fd (an ``O_PATH`` fd via ``/proc/self/fd`` for a symlink or a special
  file, which are never opened for I/O).  So no link is followed that is not stored as a
  link, and no file is read that is not the one listed.
- Regular files are opened ``O_NONBLOCK``: a FIFO swapped in for one cannot block the open
  (it fails the fstat check).  A file whose size, mtime or ctime differ after it was read
  from the fstat before changed while it was read.
- One directory fd is open at a time, plus at most :data:`READ_AHEAD_FILES` files waiting for
  a reader: the walk is iterative and climbs back through ``..``, checking that it is the
  directory it came from (as fts(3) does) and finding it again from the top by name when it
  is not.  Neither depth nor path length is limited (each call takes one name).
- An entry that changed between the listing and its open or read (gone, another inode or
  type, rewritten, a directory moved, or an inode met under more names than it has links,
  so each directory is walked once) fails the import with :class:`SourceChanged`
  (EAGAIN) naming its path; with ``on_change="skip"`` it is left out instead (a directory
  with all below it) and counted in the stats as ``skipped``.

Hard links to files the attacker cannot read are the kernel's to refuse
(``fs.protected_hardlinks``); a hard link is in the tree when it is listed.

Blocking: run it in a worker thread.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import msgpack

from ..errors import InvalidArgument, NoSpace, NotFound, RametError
from ..nofollow import DIR_FLAGS, FILE_FLAGS, GONE, same_file
from ..protocol import CONTROL_DIR, ON_CHANGE
from .format import clamp_time_ns, source_key
from .entries import directory_entry, link_id
from .store import EMPTY_CONTENT, Snapshot, Store
from .trees import Entry
from .writer import ChunkWriter

READ_AHEAD_FILES = 64  # files opened and waiting for a reader thread, at most (open fds)
SHOWN_PATH_BYTES = 1024  # of a path in an error message (the middle is elided)

_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_CHANGED = object()  # a content job's result: the file changed while read (on_change skip)


class SourceChanged(RametError):
    """An entry of the source changed while it was imported (EAGAIN: import again, or skip
    such entries with ``on_change="skip"``)."""

    code = errno.EAGAIN

    def __init__(self, path: str, what: str):
        super().__init__(f"source {path} {what}: it changed during the import; import "
                         "again, or leave changed entries out (--on-change skip)")


@dataclass
class ImportStats:
    """Files of one import taken from the stat cache, and entries left out because they
    changed under the import (new chunks are counted by the ChunkWriter; the tree's own
    totals come from ``Store.tree_totals``)."""

    cached_files: int = 0
    skipped: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _xattrs(target: str | bytes | int, follow: bool) -> tuple[tuple[bytes, bytes], ...]:
    try:
        names = os.listxattr(target, follow_symlinks=follow)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EPERM):
            return ()
        raise
    out = []
    for name in names:
        try:
            out.append((name.encode(), os.getxattr(target, name, follow_symlinks=follow)))
        except OSError as exc:
            if exc.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EPERM):
                raise
    return tuple(sorted(out))


def read_xattrs(path: str | bytes) -> tuple[tuple[bytes, bytes], ...]:
    """The extended attributes of ``path`` (not followed), sorted ``(name, value)`` pairs;
    none where the file system has no xattrs or refuses to list them."""
    return _xattrs(path, False)


def _fd_xattrs(fd: int, o_path: bool) -> tuple[tuple[bytes, bytes], ...]:
    """:func:`read_xattrs` of the file open as ``fd``; an ``O_PATH`` fd (no f*xattr calls)
    through its ``/proc/self/fd`` link, which resolves to the file itself, a symlink too."""
    if not o_path:
        return _xattrs(fd, True)
    try:
        return _xattrs(f"/proc/self/fd/{fd}", True)
    except FileNotFoundError:
        raise RametError(errno.EOPNOTSUPP,
                         "importing symlinks and special files needs /proc mounted (their "
                         "xattrs are read through /proc/self/fd)") from None


def _shown(path: bytes) -> str:
    """``path`` for a message, its middle elided past :data:`SHOWN_PATH_BYTES`."""
    if len(path) > SHOWN_PATH_BYTES:
        half = SHOWN_PATH_BYTES // 2
        path = path[:half] + b"..." + path[-half:]
    return os.fsdecode(path)


class _Node:
    """One entry of the walk.  ``st`` is the listing's lstat until the entry is opened, then
    the fstat of what was opened; ``children`` (a directory, once listed) in name order."""

    __slots__ = ("name", "parent", "st", "xattrs", "target", "children", "skipped", "entry")

    def __init__(self, name: bytes, parent: _Node | None, st: os.stat_result | None):
        self.name, self.parent, self.st = name, parent, st
        self.xattrs: tuple[tuple[bytes, bytes], ...] = ()
        self.target = b""  # a symlink's
        self.children: list[_Node] | None = None
        self.skipped = False
        self.entry: Entry | None = None  # a directory's, once its tree is stored

    def path(self) -> bytes:
        """The path below the source, ``b"/a/b"`` (``b""`` for the top)."""
        names = []
        node = self
        while node.parent is not None:
            names.append(node.name)
            node = node.parent
        return b"".join(b"/" + name for name in reversed(names))

    @property
    def is_dir(self) -> bool:
        return self.st is not None and stat.S_ISDIR(self.st.st_mode)


class DirectoryImporter:
    """One import of the directory ``source``: :meth:`prepare` walks it and stores the
    contents (no transaction held), :meth:`put_trees` stores its trees in a transaction.
    ``on_change`` is ``"fail"`` or ``"skip"`` (module docstring)."""

    def __init__(self, store: Store, source: Path, on_change: str = "fail"):
        if on_change not in ON_CHANGE:
            raise InvalidArgument(f"on_change must be fail or skip, not {on_change!r}")
        self.store = store
        self.source = source
        self.skip = on_change == "skip"
        self.stats = ImportStats()
        self.writer = ChunkWriter(store)
        self.sources: dict[bytes, list] = {}
        self._prefix = os.fsencode(str(source))  # of every stat cache path
        self._slots = threading.BoundedSemaphore(READ_AHEAD_FILES)
        self._abort = threading.Event()  # a content job failed: stop walking
        self._met: dict[tuple[int, int], int] = {}  # (dev, ino) -> names it was met under

    # -- files ---------------------------------------------------------------------------

    @staticmethod
    def _signature(st: os.stat_result) -> list[int]:
        """What the stat cache compares: dev, ino, size, mtime and ctime (ns)."""
        return [st.st_dev, st.st_ino, st.st_size, clamp_time_ns(st.st_mtime_ns),
                clamp_time_ns(st.st_ctime_ns)]

    def _cached_content(self, key: bytes, st: os.stat_result) -> bytes | None:
        """The content id the stat cache holds under ``key`` if the file's (dev, ino, size,
        mtime, ctime) are unchanged and the content is still stored, else None (always
        while a gc runs: a cached content's chunks are not pinned, rametfs.store.gc)."""
        if self.store.gc_guard.running:
            return None
        with self.store.read() as txn:
            cached = txn.get(key, db=self.store.db["sources"])
            if cached is None:
                return None
            old = msgpack.unpackb(cached)
            if old[:5] != self._signature(st):
                return None
            if old[5] != EMPTY_CONTENT and txn.get(old[5], db=self.store.db["contents"]) is None:
                return None
        return old[5]

    def _file_content(self, fd: int, st: os.stat_result) -> bytes:
        """Read, chunk and store the file open as ``fd``; returns its content id."""
        return self.writer.put_file(fd, st.st_size)

    def _read_file(self, fd: int, node: _Node, key: bytes) -> bytes | object:
        """A content job: the content id of the file open as ``fd`` (closed here), recorded
        in the stat cache under ``key``; :data:`_CHANGED` (skip) or SourceChanged (fail)
        when it changed while read."""
        try:
            if self._abort.is_set():
                return None
            os.set_blocking(fd, True)  # it is a regular file: O_NONBLOCK only guarded the open
            try:
                cid = self._file_content(fd, node.st)
                after = os.fstat(fd)
            except OSError as exc:
                raise self._unreadable(node.path(), exc) from None
            if self._signature(after) != self._signature(node.st):
                if self.skip:
                    return _CHANGED
                raise SourceChanged(self._show(node.path()), "changed while it was read")
            self.sources[key] = self._signature(node.st) + [cid]
            return cid
        except BaseException:
            self._abort.set()
            raise
        finally:
            os.close(fd)
            self._slots.release()

    # -- the walk ------------------------------------------------------------------------

    def _show(self, rel: bytes) -> str:
        return _shown(self._prefix + rel)

    def _unreadable(self, rel: bytes, exc: OSError) -> RametError:
        if isinstance(exc, RametError):  # said already (SourceChanged, NoSpace...)
            return exc
        if exc.errno == errno.ENOSPC:
            return NoSpace("no space left while importing")
        return RametError(exc.errno, f"cannot read {self._show(rel)}: {exc.strerror}")

    def _changed(self, node: _Node, what: str) -> None:
        """``node`` changed under the walk: skip it, or raise SourceChanged."""
        if not self.skip:
            raise SourceChanged(self._show(node.path()), what)
        node.skipped = True

    def _open(self, dir_fd: int, node: _Node, flags: int, again: bool = False) -> int | None:
        """``node`` opened by name relative to ``dir_fd``, checked against the listing (its
        ``st`` becomes the fstat); None when it changed and is skipped.  An inode met under
        more names than its link count (a directory: more than one) moved during the walk
        (unless ``again``: the walk finding a directory it met once more)."""
        try:
            fd = os.open(node.name, flags, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in GONE:
                raise
            self._changed(node, GONE[exc.errno])
            return None
        st = os.fstat(fd)
        what = None if same_file(st, node.st) else "is another file than the one listed"
        if what is None and not again:
            key = (st.st_dev, st.st_ino)
            met = self._met.get(key, 0) + 1
            if met > (1 if stat.S_ISDIR(st.st_mode) else max(st.st_nlink, 1)):
                what = "was met under another name too"
            self._met[key] = met
        if what is not None:
            os.close(fd)
            self._changed(node, what)
            return None
        node.st = st
        return fd

    def _list(self, fd: int, node: _Node, pool: ThreadPoolExecutor) -> None:
        """List the directory ``node`` open as ``fd``: its xattrs, and each entry's stat,
        xattrs and symlink target, through fds; each regular file's content from the stat
        cache or a job in ``pool``."""
        rel = node.path()
        try:
            node.xattrs = _fd_xattrs(fd, False)
            names = sorted(os.fsencode(name) for name in os.listdir(fd))
        except OSError as exc:
            raise self._unreadable(rel, exc) from None
        if node.parent is None and CONTROL_DIR.encode() in names:
            raise InvalidArgument(f"source {self.source} contains {CONTROL_DIR!r}, "
                                  "a name rametfs reserves for its control files")
        node.children = []
        for name in names:
            child = _Node(name, node, None)
            node.children.append(child)
            try:
                self._list_entry(fd, child, rel, pool)
            except OSError as exc:
                raise self._unreadable(rel + b"/" + name, exc) from None

    def _list_entry(self, dir_fd: int, child: _Node, rel: bytes,
                    pool: ThreadPoolExecutor) -> None:
        try:
            child.st = os.stat(child.name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            self._changed(child, "is gone")
            return
        mode = child.st.st_mode
        if stat.S_ISDIR(mode):
            return  # opened when the walk gets to it
        regular = stat.S_ISREG(mode)
        fd = self._open(dir_fd, child, FILE_FLAGS if regular else _PATH_FLAGS)
        if fd is None:
            return
        try:
            child.xattrs = _fd_xattrs(fd, not regular)
            if stat.S_ISLNK(mode):
                child.target = os.readlink(b"", dir_fd=fd)
            if not regular:
                return
            key = (child.st.st_dev, child.st.st_ino)
            if key in self.contents:  # another name of an inode met before
                return
            cache_key = source_key(self._prefix + rel + b"/" + child.name)
            cid = self._cached_content(cache_key, child.st)
            if cid is not None:
                self.contents[key] = cid
                self.stats.cached_files += 1
                return
            self._slots.acquire()
            self.contents[key] = pool.submit(self._read_file, fd, child, cache_key)
            fd = None  # the job closes it
        finally:
            if fd is not None:
                os.close(fd)

    def _climb(self, fd: int, top: int, stack: list[tuple[_Node, object]],
               left: _Node) -> int:
        """From the directory ``left`` (open as ``fd``, closed here) back to its parent
        ``stack[-1]``; the parent's fd.  Through ``..`` when that is still the parent, else
        found again from ``top`` (:meth:`_reach`), and ``left`` moved during its walk."""
        try:
            up = os.open("..", DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:  # ``left`` was removed
            up = None
        os.close(fd)
        if up is not None:
            if same_file(os.fstat(up), stack[-1][0].st):
                if len(stack) == 1:
                    os.close(up)
                    return top
                return up
            os.close(up)
        fd = self._reach(top, stack)
        if stack[-1][0] is left.parent:  # the parent is where it was: ``left`` moved
            self._changed(left, "was moved during the import")
        return fd

    def _reach(self, top: int, stack: list[tuple[_Node, object]]) -> int:
        """The fd of the deepest directory of ``stack`` still found from ``top`` by name,
        each checked against the walk; a directory not found is skipped (or raises), and it
        and the ones below it leave ``stack``."""
        fd = top
        for depth in range(1, len(stack)):
            sub = self._open(fd, stack[depth][0], DIR_FLAGS, again=True)
            if sub is None:
                del stack[depth:]
                return fd
            if fd != top:
                os.close(fd)
            fd = sub
        return fd

    def _walk(self, top: int, pool: ThreadPoolExecutor) -> _Node:
        """List the tree open as ``top``, depth first, one directory fd open at a time."""
        root = _Node(b"", None, os.fstat(top))
        self._met[(root.st.st_dev, root.st.st_ino)] = 1
        self._list(top, root, pool)
        stack: list[tuple[_Node, object]] = [(root, iter([c for c in root.children if c.is_dir]))]
        fd = top
        try:
            while stack and not self._abort.is_set():
                node, pending = stack[-1]
                child = next(pending, None)
                if child is None:
                    stack.pop()
                    if stack:
                        fd = self._climb(fd, top, stack, node)
                    continue
                try:
                    sub = self._open(fd, child, DIR_FLAGS)
                except OSError as exc:
                    raise self._unreadable(child.path(), exc) from None
                if sub is None:
                    continue
                if fd != top:
                    os.close(fd)
                fd = sub
                self._list(fd, child, pool)
                stack.append((child, iter([c for c in child.children if c.is_dir])))
        finally:
            if fd != top:
                os.close(fd)
        return root

    def run(self, label: str, message: str) -> Snapshot:
        self.prepare()
        with self.store.write() as txn:
            root = self.put_trees(txn)
            snap = self.store.put_snapshot(txn, root, [], label, message, str(self.source),
                                           self.store.tree_totals(txn, root.ref)
                                           | self.stats.as_dict()
                                           | {"new_chunks": self.writer.new_chunks,
                                              "new_chunk_bytes": self.writer.new_bytes})
        self.store.sync()
        return snap

    def prepare(self) -> None:
        """Walk the source and store every file's content; raises as :func:`import_tree`."""
        if not self.source.is_absolute():
            raise InvalidArgument(f"source path {str(self.source)!r} is not absolute")
        try:
            top = os.open(self.source, DIR_FLAGS)
        except FileNotFoundError:
            raise NotFound(f"source {self.source} does not exist") from None
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise InvalidArgument(f"source {self.source} is not a directory") from None
            raise self._unreadable(b"", exc) from None
        # contents: (dev, ino) -> content id, or the job storing it
        self.contents: dict[tuple[int, int], bytes | Future] = {}
        try:
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
                try:
                    self.root = self._walk(top, pool)
                except OSError as exc:  # climbing back: each entry's own are named in _list
                    self._abort.set()
                    raise self._unreadable(b"", exc) from None
                except BaseException:
                    self._abort.set()  # the queued jobs close their fds and return
                    raise
            for key, value in self.contents.items():
                if isinstance(value, Future):
                    self.contents[key] = value.result()
        finally:
            os.close(top)
        self._settle()

    def _settle(self) -> None:
        """After the walk: leave out the files that changed while read (skip), count what
        is left out, give each inode met more than once its hard-link group, and list the
        directories kept, each before those below it (as ``self.dirs``)."""
        self.dirs: list[_Node] = [self.root]
        links: dict[tuple[int, int], list[_Node]] = {}
        stack = [iter(self.root.children)]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                stack.pop()
                continue
            st = child.st
            if not child.skipped and stat.S_ISREG(st.st_mode):
                child.skipped = self.contents[(st.st_dev, st.st_ino)] is _CHANGED
            if child.skipped:
                self.stats.skipped += 1
            elif child.is_dir:
                self.dirs.append(child)
                stack.append(iter(child.children))
            elif st.st_nlink > 1:
                links.setdefault((st.st_dev, st.st_ino), []).append(child)
        self.link_ids = {key: link_id(nodes[0].path())
                         for key, nodes in links.items() if len(nodes) > 1}
        self.link_counts = {key: len(nodes) for key, nodes in links.items()}

    def put_trees(self, txn) -> Entry:
        """Store the trees, bottom-up, and the stat cache in ``txn`` (after :meth:`prepare`);
        returns the entry of the source directory itself (its name ``b""``)."""
        contents, link_ids, link_counts = self.contents, self.link_ids, self.link_counts
        for node in reversed(self.dirs):
            entries = []
            for child in node.children:
                if child.skipped:
                    continue
                if child.is_dir:
                    entries.append(child.entry.renamed(child.name))
                    child.entry = None
                    continue
                st = child.st
                key = (st.st_dev, st.st_ino)
                link = link_ids.get(key, 0)
                nlink = link_counts[key] if link else 1
                if stat.S_ISREG(st.st_mode):
                    ref, size = contents[key], st.st_size
                elif stat.S_ISLNK(st.st_mode):
                    ref, size = child.target, 0
                else:
                    ref, size = b"", st.st_rdev
                entries.append(Entry(child.name, st.st_mode, st.st_uid, st.st_gid,
                                     clamp_time_ns(st.st_mtime_ns), size, ref, child.xattrs,
                                     link, nlink))
            st = node.st
            node.entry = put_directory(self.store, txn, entries, st.st_mode, st.st_uid,
                                       st.st_gid, clamp_time_ns(st.st_mtime_ns), node.xattrs)
        db = self.store.db["sources"]
        for key, value in self.sources.items():
            txn.put(key, msgpack.packb(value), db=db)
        return self.root.entry


def put_directory(store: Store, txn, entries: list[Entry], mode: int, uid: int, gid: int,
                  mtime_ns: int, xattrs: tuple[tuple[bytes, bytes], ...] = ()) -> Entry:
    """Store the tree of ``entries`` (their subtrees already stored) in ``txn``; returns the
    directory's own entry, named ``b""`` (rametfs.store.entries.directory_entry)."""
    return directory_entry(entries, store.put_tree(txn, entries), mode, uid, gid, mtime_ns,
                           xattrs)


def import_tree(store: Store, source: str | os.PathLike, label: str = "", message: str = "",
                on_change: str = "fail") -> Snapshot:
    """Import directory ``source`` (absolute path) as a new snapshot; returns it.  An entry
    that changes during the import fails it (``on_change="fail"``) or is left out
    (``"skip"``; the snapshot's stats count them as ``skipped``).

    Raises NotFound (ENOENT) when ``source`` does not exist, InvalidArgument (EINVAL) when it
    is relative, not a directory (a symlink to one included), or holds the reserved name
    ``.ramet`` at its top, or ``on_change`` is neither; SourceChanged (EAGAIN) naming the
    entry that changed; NoSpace (ENOSPC) when the store's disk is full; RametError with the
    OS errno when a file cannot be read.
    """
    with store.gc_guard.writing():
        return DirectoryImporter(store, Path(source), on_change).run(label, message)
