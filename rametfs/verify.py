"""Verification: does an execution equal its head snapshot (rametfs.core.heads: its base
until a promote or a ``reset --to``; after a reset, what it was reset to)?  "Base" below is
the snapshot its layer lies over, which after a reset is the head.

Two modes:

* ``root``: the root tree id the execution would promote to (``capture.root_entry``) equals
  its base's root tree id, and the root directory's mode, owner and xattrs are the base's.
  Directories never copied up count by their base subtree id and copied-up files that still
  read only base bytes by their base content id, so after a reset this costs the root's
  listing; every copied-up file that holds upper bytes is re-chunked and rehashed, so a
  change to upper data or to a layer's records shows.
* ``deep``: root, then the same check on the execution as stored (its layer's records and
  upper data read afresh from disk by a second, private overlay, as a restarted daemon would
  serve them, so a record or upper data file changed behind the daemon's back shows), then
  every byte the overlay serves from the base, which is the hydrated copy of each base
  content in the shared cache (``<data>/cache/<content id>``), is rehashed page by page
  against the content's chunk ids, and the rest of the copy (the content's holes) is checked
  to read zeros, where the copy's data extents say it holds anything.  Base content not
  hydrated yet is checked when it is hydrated (every chunk's BLAKE3 id is checked on read).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import trio

from .capture import NO_CANCEL, CancelToken, diff_in_slices, root_entry
from .core.status import verification_json_steps
from .overlay import Execution, Overlay
from .store import EMPTY_CONTENT, PAGE_SIZE, Entry, Store
from .store.chunks import chunk_id, is_zero
from .store.extents import data_extents, pages_of
from .treewalk import Steps

ROOT, DEEP = "root", "deep"
MODES = (ROOT, DEEP)


@dataclass(frozen=True)
class Verification:
    """The outcome: ``differences`` as ``(letter, path)`` pairs like ``diff`` (``M`` for a
    file whose served bytes do not hash to its base content); empty when equal.  Tree ids
    as hex; ``verify_ms`` in milliseconds."""

    mode: str
    root: str
    base_root: str  # the head's root tree id (the reply's name, from when it was the base's)
    differences: list[tuple[str, bytes]]
    verify_ms: float

    @property
    def equal(self) -> bool:
        return not self.differences

    def json_steps(self) -> Steps[dict]:
        """As replies carry it (rametfs.core.status.verification_json), as steps: one per
        difference (a verify of 200,000 differences took 0.1 s to convert)."""
        return verification_json_steps(self.mode, self.root, self.base_root, self.differences,
                                 self.verify_ms)


async def verify(overlay: Overlay, ex: Execution, mode: str = ROOT,
                 cancel: CancelToken = NO_CANCEL) -> Verification:
    """Check ``ex`` against its head (rametfs.core.heads: after a reset, what it was reset
    to) in ``mode`` (``"root"`` or ``"deep"``).  Deep mode rehashes the hydrated copies of
    the contents of the snapshot its layer lies over (``Execution.lower``), whose bytes it
    serves for every file not copied up.

    Raises IntegrityError (EIO) when a base record or chunk it needs is missing or corrupt,
    Cancelled (ECANCELED) once ``cancel`` is.
    """
    started = time.monotonic_ns()
    head = ex.head.root
    root, differences = await _compare(overlay, ex, cancel)
    if mode == DEEP and not differences:
        stored = Overlay(overlay.store)  # after root_entry flushed every pending record
        root, differences = await _compare(stored, stored.execution(ex.id), cancel)
    if mode == DEEP and not differences:
        differences = [("M", path) for path in await trio.to_thread.run_sync(
            _bad_cached_contents, overlay.store, ex.lower.root, cancel)]
    return Verification(mode, root.ref.hex(), head.ref.hex(), differences,
                        round((time.monotonic_ns() - started) / 1e6, 3))


async def _compare(overlay: Overlay, ex: Execution, cancel: CancelToken
                   ) -> tuple[Entry, list[tuple[str, bytes]]]:
    """``(root entry, differences)`` of ``ex`` as ``overlay`` serves it."""
    root, base = await root_entry(overlay, ex, cancel), ex.head.root
    if root.ref == base.ref and (root.mode, root.uid, root.gid, root.xattrs) == (
            base.mode, base.uid, base.gid, base.xattrs):
        return root, []
    # A difference the metadata does not show (bytes of a copied-up page) is named by the
    # file diff marks modified, or else by the root.
    return root, await diff_in_slices(overlay, ex) or [("M", b"")]


def _bad_cached_contents(store: Store, root: Entry, cancel: CancelToken) -> list[bytes]:
    """Paths (first name of each content) below tree ``root`` whose hydrated cache file does
    not hash to the content's chunk ids.  Blocking: a worker thread; Cancelled once
    ``cancel`` is."""
    bad: list[bytes] = []
    seen_trees: set[bytes] = set()
    seen_contents: set[bytes] = set()
    todo = [(b"", root.ref)]
    while todo:
        prefix, tid = todo.pop()
        if tid in seen_trees:
            continue
        seen_trees.add(tid)
        for name, entry in store.tree(tid).items():
            if entry.is_dir:
                todo.append((prefix + name + b"/", entry.ref))
            elif entry.is_reg and entry.ref not in seen_contents and entry.ref != EMPTY_CONTENT:
                seen_contents.add(entry.ref)
                cancel.check()
                if not _cache_matches(store, entry.ref):
                    bad.append(prefix + name)
    return sorted(bad)


def _cache_matches(store: Store, cid: bytes) -> bool:
    """Whether the hydrated copy of content ``cid`` (if any) holds exactly its bytes: each
    page holding data hashes to its chunk id, and every other byte the file's data extents
    (SEEK_DATA) hold is zero, so a sparse copy costs what it stores."""
    try:
        fd = os.open(store.cache_path(cid), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        content = store.content(cid)
        if os.fstat(fd).st_size != content.size:
            return False
        data = content.pages()  # both ascending: merged
        want = next(data, None)
        for page in pages_of(data_extents(fd, 0, content.size)):
            if want is not None and want[0] < page:
                return False  # a page holding data in a hole of the copy: it reads zeros
            raw = os.pread(fd, PAGE_SIZE, page * PAGE_SIZE)
            if want is not None and want[0] == page:
                if chunk_id(raw) != want[1]:
                    return False
                want = next(data, None)
            elif not is_zero(raw):
                return False
        return want is None
    finally:
        os.close(fd)
