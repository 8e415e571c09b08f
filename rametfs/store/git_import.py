"""Import one revision of a git repository as a snapshot, straight from its objects.

The tree of the commit that ``rev`` names is read from the object database with libgit2
(pygit2): nothing is checked out to disk, and the work tree's state (uncommitted or untracked
files) plays no part.  What a checkout would give, git's tree modes turned into file modes:

- ``100644`` a regular file 0644, ``100755`` one 0755 (any other ``100xxx`` with an owner
  execute bit counts as 0755, as git does);
- ``120000`` a symlink whose target is the blob's bytes;
- ``040000`` a directory 0755;
- ``160000`` a submodule (gitlink): an empty directory 0755, as ``git clone`` without
  ``--recurse-submodules`` leaves it; counted in the stats as ``git_submodules``.

Every entry's mtime is the commit's committer time (whole seconds, as ``git archive`` sets
it); owner and group are the importing process's.  Each distinct blob is read once, by the
calling thread, then cut into pages and stored through the
:class:`~rametfs.store.writer.ChunkWriter` by a pool of one worker per core.  A blob imported
before (any repository: a blob id names its bytes) is found in the ``sources`` database under
``git-blob:`` + its id and not read again, so importing successive revisions costs the changed
blobs only.

With ``with_git_dir`` the repository's ``.git`` directory is imported from disk by the
directory importer (:class:`~rametfs.store.importer.DirectoryImporter`) as the subtree
``.git``, so local commits, branches, stash and index travel with the snapshot.  The index's
stat data (inode, device, ctime) cannot match the snapshot's files, so the first
``git status`` in an execution re-reads the tracked files and rewrites the index (a copy-up
of ``.git/index``); its output is unchanged by that.

Blocking: run it in a worker thread.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack

from ..errors import InvalidArgument, NoSpace, NotFound, RametError
from ..protocol import CONTROL_DIR
from .format import PAGE_SIZE
from .importer import DirectoryImporter, put_directory
from .store import Snapshot, Store
from .trees import Entry
from .writer import ChunkWriter

BLOB_CACHE_PREFIX = b"git-blob:"  # + raw blob id: key of the blob cache in ``sources``
READ_AHEAD_BYTES = 64 << 20  # blob bytes read and waiting for a worker, at most
MAX_BRANCHES_SHOWN = 10  # named when a revision is not found

# git tree entry modes (git's tree-walk.h; libgit2 git_filemode_t)
_TREE = 0o040000
_BLOB_MASK = 0o170000
_BLOB = 0o100000
_LINK = 0o120000
_GITLINK = 0o160000

_FILE_MODE = stat.S_IFREG | 0o644
_EXEC_MODE = stat.S_IFREG | 0o755
_LINK_MODE = stat.S_IFLNK | 0o777
_DIR_MODE = stat.S_IFDIR | 0o755


def _pygit2():
    try:
        import pygit2
    except ImportError:
        raise RametError(errno.EOPNOTSUPP,
                         "git import needs pygit2: pip install 'rametfs[git]' (in a clone: "
                         "tools/setup git)") from None
    return pygit2


class _GitImporter:
    def __init__(self, store: Store, repo: Path, rev: str, with_git_dir: bool):
        self.store = store
        self.path = repo
        self.rev = rev
        self.with_git_dir = with_git_dir
        self.pygit2 = _pygit2()
        self.writer = ChunkWriter(store)
        self.cached_blobs = 0
        self.submodules = 0
        self.blobs: dict[bytes, tuple[int, bytes]] = {}  # new cache entries: id -> (size, cid)

    def _open(self):
        pygit2 = self.pygit2
        try:
            return pygit2.Repository(str(self.path), pygit2.enums.RepositoryOpenFlag.NO_SEARCH)
        except pygit2.GitError as exc:
            raise InvalidArgument(f"{self.path} is not a git repository: {exc}") from None

    def _commit(self, repo):
        pygit2 = self.pygit2
        try:
            return repo.revparse_single(self.rev).peel(pygit2.Commit)
        except (KeyError, pygit2.GitError, ValueError) as exc:
            why = "" if str(exc).strip("'\"") == self.rev else f" ({exc})"  # KeyError: the rev
            branches = sorted(repo.branches.local)[:MAX_BRANCHES_SHOWN]
            raise NotFound(f"{self.path}: no commit {self.rev!r}{why}; its branches: "
                           f"{', '.join(branches) or 'none'}") from None

    # -- contents ------------------------------------------------------------------------

    def _cached(self, oid: bytes) -> tuple[int, bytes] | None:
        if self.store.gc_guard.running:  # a cached content's chunks are not pinned (store.gc)
            return None
        with self.store.read() as txn:
            value = txn.get(BLOB_CACHE_PREFIX + oid, db=self.store.db["sources"])
            if value is None:
                return None
            size, cid = msgpack.unpackb(value)
            if size and txn.get(cid, db=self.store.db["contents"]) is None:
                return None  # the content went away: import the blob again
        return size, cid

    def _store_blob(self, raw: bytes, data: memoryview) -> tuple[int, bytes]:
        """Cut a blob's bytes into pages and store them; ``(size in bytes, content id)``."""
        ids = [self.writer.add(bytes(data[i:i + PAGE_SIZE]))
               for i in range(0, len(data), PAGE_SIZE)]
        result = len(data), self.writer.put_content(len(data), ids)
        self.blobs[raw] = result
        return result

    def _contents(self, repo, oids: list) -> dict:
        """``{blob id: (size, content id)}``.  This thread reads the blobs (libgit2 holds the
        GIL, so more readers only contend); the pool hashes, compresses and stores them.
        The reader waits while :data:`READ_AHEAD_BYTES` of read blobs wait for a worker
        (one larger blob still goes alone)."""
        room = threading.Condition()
        waiting = [0]  # bytes read and not yet stored

        def store(raw: bytes, data: memoryview) -> tuple[int, bytes]:
            try:
                return self._store_blob(raw, data)
            finally:
                with room:
                    waiting[0] -= len(data)
                    room.notify()

        jobs = {}
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            for oid in oids:
                cached = self._cached(oid.raw)
                if cached is not None:
                    self.cached_blobs += 1
                    jobs[oid] = cached
                    continue
                data = memoryview(repo[oid])  # the blob's bytes, without a copy
                with room:
                    room.wait_for(lambda: not waiting[0]
                                  or waiting[0] + len(data) <= READ_AHEAD_BYTES)
                    waiting[0] += len(data)
                jobs[oid] = pool.submit(store, oid.raw, data)
        return {oid: job if isinstance(job, tuple) else job.result()
                for oid, job in jobs.items()}

    # -- the walk ------------------------------------------------------------------------

    def _walk(self, repo, tree) -> list[tuple[bytes, list[tuple[bytes, int, object]]]]:
        """Every directory of ``tree`` as ``(path, [(name, git mode, object id)])``, each
        after its parent (so reversed, children come first)."""
        dirs = []
        stack = [(b"", tree)]
        while stack:
            path, tree = stack.pop()
            items = [(e.raw_name, e.filemode, e.id) for e in tree]
            dirs.append((path, items))
            stack.extend((path + b"/" + name, repo[oid])
                         for name, mode, oid in items if mode == _TREE)
        return dirs

    def run(self, label: str, message: str) -> Snapshot:
        if not self.path.is_absolute():
            raise InvalidArgument(f"repository path {str(self.path)!r} is not absolute")
        if not self.path.exists():
            raise NotFound(f"repository {self.path} does not exist")
        repo = self._open()
        commit = self._commit(repo)
        git_dir = None
        if self.with_git_dir:
            if repo.is_bare or os.path.isfile(os.path.join(repo.workdir, ".git")):
                raise InvalidArgument(f"{self.path}: taking .git along needs a repository "
                                      "with its own .git directory (not a bare repository "
                                      "or a linked worktree)")
            git_dir = DirectoryImporter(self.store, Path(repo.path.rstrip("/")))
        dirs = self._walk(repo, commit.tree)
        if any(name == CONTROL_DIR.encode() for name, _, _ in dirs[0][1]):
            raise InvalidArgument(f"revision {self.rev!r} of {self.path} holds {CONTROL_DIR!r} "
                                  "at its top, a name rametfs reserves for its control files")

        # Contents: each distinct blob once; symlink targets are read inline below.
        oids = list(dict.fromkeys(oid for _, items in dirs for _, mode, oid in items
                                  if mode & _BLOB_MASK == _BLOB))
        try:
            contents = self._contents(repo, oids)
            if git_dir is not None:
                git_dir.prepare()
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise NoSpace("no space left while importing") from None
            raise

        when = commit.commit_time * 1_000_000_000
        uid, gid = os.getuid(), os.getgid()
        with self.store.write() as txn:
            subtrees: dict[bytes, Entry] = {}
            for path, items in reversed(dirs):
                entries = []
                for name, mode, oid in items:
                    if mode == _TREE:
                        entries.append(subtrees.pop(path + b"/" + name).renamed(name))
                    elif mode & _BLOB_MASK == _BLOB:
                        size, cid = contents[oid]
                        entries.append(Entry(name, _EXEC_MODE if mode & 0o100 else _FILE_MODE,
                                             uid, gid, when, size, cid))
                    elif mode == _LINK:
                        entries.append(Entry(name, _LINK_MODE, uid, gid, when, 0,
                                             repo[oid].data))
                    elif mode == _GITLINK:
                        self.submodules += 1
                        entries.append(put_directory(self.store, txn, [], _DIR_MODE, uid, gid,
                                                     when).renamed(name))
                    else:
                        raise InvalidArgument(f"{self.path}: {path + b'/' + name!r} has git "
                                              f"mode {mode:o}, which no checkout makes")
                if path == b"" and git_dir is not None:
                    entries.append(git_dir.put_trees(txn).renamed(b".git"))
                subtrees[path] = put_directory(self.store, txn, entries, _DIR_MODE, uid, gid, when)
            root = subtrees.pop(b"")
            db = self.store.db["sources"]
            for raw, value in self.blobs.items():
                txn.put(BLOB_CACHE_PREFIX + raw, msgpack.packb(list(value)), db=db)
            writers = [self.writer] + ([git_dir.writer] if git_dir else [])
            stats = self.store.tree_totals(txn, root.ref) | {
                "new_chunks": sum(w.new_chunks for w in writers),
                "new_chunk_bytes": sum(w.new_bytes for w in writers),
                "cached_files": self.cached_blobs + (git_dir.stats.cached_files if git_dir else 0),
                "git_commit": str(commit.id), "git_submodules": self.submodules,
                "git_dir": git_dir is not None}
            snap = self.store.put_snapshot(txn, root, [], label, message,
                                           f"{self.path}@{commit.id}", stats)
        self.store.sync()
        return snap


def import_git(store: Store, repo: str | os.PathLike, rev: str = "HEAD",
               with_git_dir: bool = False, label: str = "", message: str = "") -> Snapshot:
    """Import the tree of revision ``rev`` (anything ``git rev-parse`` takes that names a
    commit, or a tag of one) of the git repository at ``repo`` (absolute path of its work
    tree, or of a bare repository) as a new snapshot; returns it.  With ``with_git_dir`` the
    repository's ``.git`` directory comes along (see the module docstring).

    The snapshot's ``source`` is ``<repo>@<commit id>``; its stats add ``git_commit``,
    ``git_submodules`` (submodules stored as empty directories) and ``git_dir``.

    Raises InvalidArgument (EINVAL) when ``repo`` is relative or no repository, when the tree
    holds ``.ramet`` at its top, or ``with_git_dir`` is asked of a bare repository or a linked
    worktree; NotFound (ENOENT) when ``repo`` does not exist or ``rev`` names no commit;
    NoSpace (ENOSPC); RametError (EIO) when an object cannot be read, (EOPNOTSUPP) when
    pygit2 is not installed.
    """
    importer = _GitImporter(store, Path(repo), rev, with_git_dir)
    try:
        with store.gc_guard.writing():
            return importer.run(label, message)
    except importer.pygit2.GitError as exc:  # a damaged repository: a missing or bad object
        raise RametError(errno.EIO, f"{repo}: {exc}") from None
