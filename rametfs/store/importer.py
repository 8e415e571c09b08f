"""Import a directory tree into the store as a new snapshot.

The walk never follows symlinks (they are stored as links) and keeps regular files,
directories, symlinks, hard links (a group id per inode seen more than once in the tree),
modes, uid/gid, mtimes (ns), xattrs, device nodes, fifos and sockets.  File contents are cut
into pages (chunks), hashed (BLAKE3) and zstd-compressed on every core; a chunk already in the
store is not compressed or written again, and a file whose (dev, ino, size, mtime, ctime) match
the stat cache of an earlier import is not read at all.

Blocking: run it in a worker thread.
"""

from __future__ import annotations

import errno
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3
import msgpack

from ..errors import InvalidArgument, NoSpace, NotFound, RametError
from ..protocol import CONTROL_DIR
from .store import EMPTY_CONTENT, Snapshot, Store
from .trees import FLAG_HAS_LINKS, Entry
from .writer import ChunkWriter


@dataclass
class ImportStats:
    """Files of one import taken from the stat cache (new chunks are counted by the
    ChunkWriter; the tree's own totals come from ``Store.tree_totals``)."""

    cached_files: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def read_xattrs(path: str | bytes) -> tuple[tuple[bytes, bytes], ...]:
    """The extended attributes of ``path`` (not followed), sorted ``(name, value)`` pairs;
    none where the file system has no xattrs or refuses to list them."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EPERM):
            return ()
        raise
    out = []
    for name in names:
        try:
            out.append((name.encode(), os.getxattr(path, name, follow_symlinks=False)))
        except OSError as exc:
            if exc.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EPERM):
                raise
    return tuple(sorted(out))


class DirectoryImporter:
    """One import of the directory ``source``: :meth:`prepare` walks it and stores the
    contents (no transaction held), :meth:`put_trees` stores its trees in a transaction."""

    def __init__(self, store: Store, source: Path):
        self.store = store
        self.source = source
        self.stats = ImportStats()
        self.writer = ChunkWriter(store)
        self.sources: dict[bytes, list] = {}

    # -- files ---------------------------------------------------------------------------

    @staticmethod
    def _signature(st: os.stat_result) -> list[int]:
        """What the stat cache compares: dev, ino, size, mtime and ctime (ns)."""
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def _cached_content(self, txn, path: str, st: os.stat_result) -> bytes | None:
        """The content id the stat cache holds for ``path`` if its (dev, ino, size, mtime,
        ctime) are unchanged and the content is still stored, else None."""
        cached = txn.get(path.encode("utf-8", "surrogateescape"), db=self.store.db["sources"])
        if cached is None:
            return None
        old = msgpack.unpackb(cached)
        if old[:5] != self._signature(st):
            return None
        if old[5] != EMPTY_CONTENT and txn.get(old[5], db=self.store.db["contents"]) is None:
            return None
        return old[5]

    def _file_content(self, path: str, st: os.stat_result) -> bytes:
        """Read, chunk and store the file at ``path``; returns its content id."""
        with open(path, "rb", buffering=0) as f:
            cid = self.writer.put_file(f.fileno(), st.st_size)
        self.sources[path.encode("utf-8", "surrogateescape")] = self._signature(st) + [cid]
        return cid

    # -- the walk ------------------------------------------------------------------------

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
            top = os.lstat(self.source)
        except FileNotFoundError:
            raise NotFound(f"source {self.source} does not exist") from None
        if not stat.S_ISDIR(top.st_mode):
            raise InvalidArgument(f"source {self.source} is not a directory")
        if os.path.lexists(self.source / CONTROL_DIR):
            raise InvalidArgument(f"source {self.source} contains {CONTROL_DIR!r}, "
                                  "a name rametfs reserves for its control files")
        # Walk once: every directory's listing, in name order, with lstat results.
        dirs: list[tuple[str, list[tuple[bytes, str, os.stat_result]]]] = []
        links: dict[tuple[int, int], list[str]] = {}

        def walk(path: str) -> None:
            with os.scandir(path) as it:
                items = sorted(((os.fsencode(e.name), e.path, e.stat(follow_symlinks=False))
                                for e in it), key=lambda x: x[0])
            dirs.append((path, items))
            for _, child, st in items:
                if stat.S_ISDIR(st.st_mode):
                    walk(child)
                elif st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    links.setdefault((st.st_dev, st.st_ino), []).append(child)

        try:
            walk(str(self.source))
        except PermissionError as exc:
            raise RametError(f"cannot read {exc.filename}: permission denied", errno.EACCES) from None
        link_ids = {key: int.from_bytes(blake3.blake3(os.fsencode(paths[0])[
                    len(os.fsencode(str(self.source))):]).digest()[:8], "big") >> 1
                    for key, paths in links.items() if len(paths) > 1}
        link_counts = {key: len(paths) for key, paths in links.items()}

        self.dirs, self.link_ids, self.link_counts = dirs, link_ids, link_counts

        # Contents: the stat cache first, in this thread and one short read transaction (a
        # re-import is mostly hits, and a job per file would cost more than the lookup; a
        # reader held open while the jobs write would pin LMDB's free pages); then one job
        # per missed inode, on every core.
        contents: dict[tuple[int, int], bytes] = {}
        missed: dict[tuple[int, int], tuple[str, os.stat_result]] = {}
        with self.store.read() as txn:
            for _, items in dirs:
                for _, child, st in items:
                    key = (st.st_dev, st.st_ino)
                    if not stat.S_ISREG(st.st_mode) or key in contents or key in missed:
                        continue
                    cid = self._cached_content(txn, child, st)
                    if cid is None:
                        missed[key] = (child, st)
                    else:
                        contents[key] = cid
        self.stats.cached_files = len(contents)
        try:
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
                jobs = {key: pool.submit(self._file_content, child, st)
                        for key, (child, st) in missed.items()}
                contents.update((key, fut.result()) for key, fut in jobs.items())
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise NoSpace("no space left while importing") from None
            raise RametError(f"cannot read {exc.filename}: {exc.strerror}", exc.errno) from None
        self.contents = contents

    def put_trees(self, txn) -> Entry:
        """Store the trees, bottom-up, and the stat cache in ``txn`` (after :meth:`prepare`);
        returns the entry of the source directory itself (its name ``b""``)."""
        contents, link_ids, link_counts = self.contents, self.link_ids, self.link_counts
        subtrees: dict[str, Entry] = {}
        for path, items in reversed(self.dirs):
            entries = []
            for name, child, st in items:
                mode = st.st_mode
                key = (st.st_dev, st.st_ino)
                xattrs = read_xattrs(child)
                if stat.S_ISDIR(mode):
                    entries.append(subtrees.pop(child).renamed(name))
                    continue
                link = link_ids.get(key, 0)
                nlink = link_counts.get(key, 1) if link else 1
                if stat.S_ISREG(mode):
                    ref, size = contents[key], st.st_size
                elif stat.S_ISLNK(mode):
                    ref, size = os.fsencode(os.readlink(child)), 0
                else:
                    ref, size = b"", st.st_rdev
                entries.append(Entry(name, mode, st.st_uid, st.st_gid, st.st_mtime_ns,
                                     size, ref, xattrs, link, nlink))
            st = os.lstat(path)
            subtrees[path] = put_directory(self.store, txn, entries, st.st_mode, st.st_uid,
                                           st.st_gid, st.st_mtime_ns, read_xattrs(path))
        db = self.store.db["sources"]
        for key, value in self.sources.items():
            txn.put(key, msgpack.packb(value), db=db)
        return subtrees.pop(str(self.source))


def put_directory(store: Store, txn, entries: list[Entry], mode: int, uid: int, gid: int,
                  mtime_ns: int, xattrs: tuple[tuple[bytes, bytes], ...] = ()) -> Entry:
    """Store the tree of ``entries`` (their subtrees already stored) in ``txn``; returns the
    directory's own entry (name ``b""``, ``mode`` the full st_mode, ``mtime_ns`` in ns), with
    its link count (2 + subdirectories) and :data:`FLAG_HAS_LINKS` when a hard link lies
    below."""
    ndirs = sum(1 for e in entries if e.is_dir)
    has_links = any(e.link or e.flags & FLAG_HAS_LINKS for e in entries)
    tid = store.put_tree(txn, entries)
    return Entry(b"", mode, uid, gid, mtime_ns, 0, tid, xattrs, 0, 2 + ndirs,
                 FLAG_HAS_LINKS if has_links else 0)


def import_tree(store: Store, source: str | os.PathLike, label: str = "", message: str = ""
                ) -> Snapshot:
    """Import directory ``source`` (absolute path) as a new snapshot; returns it.

    Raises NotFound (ENOENT) when ``source`` does not exist, InvalidArgument (EINVAL) when it
    is relative, not a directory, or holds the reserved name ``.ramet`` at its top, NoSpace
    (ENOSPC) when the store's disk is full, RametError with the OS errno when a file cannot
    be read.
    """
    return DirectoryImporter(store, Path(source)).run(label, message)
