"""Garbage collection of the remote (``rametfs gc --remote``, docs/remote.md): delete the
catalog rows of every object no listed snapshot reaches, then the packs left with no row.

*Mark*: every listed snapshot is walked from its root tree as ``fsck --remote`` walks it
(trees and content records fetched, by levels), and what it reaches is kept, ``(kind, id)``.

*Sweep*, in one transaction that holds ``rametfs_publishes`` exclusively, so that no publish
registers, records a pack or lists a snapshot meanwhile (``Catalog.collect``): it deletes
nothing while a publish has been seen within the grace period, nor while a snapshot is listed
that the mark did not walk (it was listed since: it is walked and the sweep tried again).

Why a concurrent publish is safe: a publish registers before it asks what is published, and
skips what it finds; so what it relies on is whatever had rows after it registered.  While it
is registered and seen, no sweep deletes anything.  A publish not seen within the grace period
(stopped, or slower than the grace) has its registration deleted by the sweep, and then every
later step of it fails (its packs' rows and its listing each renew the registration in their
transaction): it lists nothing, and runs again from what is there.  Safety never depends on
time, only progress does: a grace too short fails slow publishes, it never lists a snapshot
whose objects are gone.

A pack object the catalog does not record (a publish stopped between its PUT and its rows, or
a sweep stopped before its deletes) is deleted when it is older than the sweep's time less the
grace period, by the object store's clock against the catalog's: keep them within the grace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

from ..errors import Busy, IntegrityError
from . import chunks
from .chunks import Content
from .remote import KIND_CHUNK, KIND_CONTENT, KIND_NAMES, KIND_TREE, Remote
from .store import EMPTY_CONTENT

GRACE_S = 3600.0  # a publish not seen for this long is taken for dead
WAIT_S = 600.0  # how long a gc waits for running publishes to end before it gives up
POLL_S = 1.0


@dataclass
class RemoteGcReport:
    """What a remote gc kept and deleted: ``snapshots`` marked, objects ``kept`` and
    ``deleted`` by kind name, ``packs`` and their ``bytes`` deleted, ``stray_packs`` (the
    catalog recorded none of them) deleted, ``stale_publishes`` taken for dead, ``rounds`` of
    sweeping (one more per snapshot listed during the mark), ``dry_run``."""

    dry_run: bool
    snapshots: int = 0
    kept: dict = field(default_factory=dict)
    deleted: dict = field(default_factory=dict)
    packs: int = 0
    bytes: int = 0
    stray_packs: int = 0
    stale_publishes: int = 0
    rounds: int = 0

    def to_json(self) -> dict:
        return dict(self.__dict__)


class _Mark:
    """What the listed snapshots reach, grown one snapshot at a time."""

    def __init__(self, remote: Remote):
        self.remote = remote
        self.snapshots: set[bytes] = set()
        self.live: dict[int, set[bytes]] = {KIND_TREE: set(), KIND_CONTENT: set(),
                                            KIND_CHUNK: set()}

    def walk(self, sid: bytes, record: bytes) -> None:
        """Keep what snapshot ``sid`` reaches.  IntegrityError (EIO) for an object of it that
        is missing or does not match its id: a sweep then would delete what it lost track
        of, so none runs (``fsck --remote`` says what)."""
        if chunks.chunk_id(record) != sid:
            raise IntegrityError(f"published snapshot {sid.hex()} does not match its id")
        trees, contents = self.live[KIND_TREE], self.live[KIND_CONTENT]
        root = msgpack.unpackb(record)["root"][6]
        level = [root] if root not in trees else []
        while level:
            got = self._fetch(KIND_TREE, level)
            trees.update(level)
            subtrees, files = [], []
            for value, _ in got.values():
                for e in msgpack.unpackb(value, use_list=True):
                    kind = e[1] & 0o170000
                    if kind == 0o040000 and e[6] not in trees:
                        subtrees.append(e[6])
                    elif kind == 0o100000 and e[6] != EMPTY_CONTENT and e[6] not in contents:
                        files.append(e[6])
            files = list(dict.fromkeys(files))
            records = self._fetch(KIND_CONTENT, files)
            contents.update(files)
            self.live[KIND_CHUNK].update(c for cid, value in records.items()
                                         for c in Content.unpack(cid, value).chunk_ids())
            level = list(dict.fromkeys(subtrees))
        self.snapshots.add(sid)

    def _fetch(self, kind: int, ids: list[bytes]) -> dict:
        got = self.remote.fetch(kind, ids)
        if len(got) != len(ids):
            lost = next(i for i in ids if i not in got)
            raise IntegrityError(f"{KIND_NAMES[kind]} {lost.hex()} of a listed snapshot is not "
                                 "published: no gc until fsck --remote finds the remote whole")
        return got

    def rows(self):
        for kind, ids in self.live.items():
            for oid in ids:
                yield kind, oid


def collect(remote: Remote, dry_run: bool = False, grace_s: float = GRACE_S,
            wait_s: float = WAIT_S,
            progress: Callable[[str, int, int], None] | None = None) -> RemoteGcReport:
    """Mark and sweep the remote (the module's docstring); ``dry_run``: delete nothing, say
    what would go.  ``grace_s``: seconds after which a publish not seen is taken for dead;
    ``wait_s``: how long to wait for running publishes to end.  ``progress(phase, done,
    total)`` after each snapshot marked.

    Raises Busy (EBUSY) when publishes still run after ``wait_s``, IntegrityError (EIO) when
    a listed snapshot lacks an object (nothing is deleted), RametError (EIO) when the catalog
    or the object store fails (what was deleted stays deleted; run it again).
    """
    report = RemoteGcReport(dry_run)
    mark = _Mark(remote)
    waited_until = time.monotonic() + wait_s
    while True:
        listed = remote.catalog.snapshots()
        for n, (sid, record) in enumerate(listed):
            if sid not in mark.snapshots:
                mark.walk(sid, record)
            if progress is not None:
                progress("mark", n + 1, len(listed))
        report.rounds += 1
        swept = None
        if not remote.catalog.publishes(grace_s):
            swept = remote.catalog.collect(mark.snapshots, mark.rows(), grace_s, dry_run)
        if swept is not None:
            break
        if remote.catalog.publishes(grace_s):
            if time.monotonic() > waited_until:
                raise Busy(f"gc --remote: publishes still run after {wait_s:g} s: try again "
                           "when they are done")
            time.sleep(POLL_S)
    report.snapshots = len(mark.snapshots)
    report.kept = {KIND_NAMES[k]: len(ids) for k, ids in mark.live.items()}
    report.deleted = {KIND_NAMES[k]: swept["objects"].get(k, 0) for k in mark.live}
    report.packs = len(swept["packs"])
    report.bytes = sum(size for _, size in swept["packs"])
    report.stale_publishes = swept["stale"]
    if dry_run:
        return report
    remote.objects.delete([name for name, _ in swept["packs"]])
    recorded = remote.catalog.packs()
    strays = [name for name, modified in remote.objects.list_packs()
              if name not in recorded and modified < swept["cutoff"]]
    remote.objects.delete(strays)
    report.stray_packs = len(strays)
    return report
