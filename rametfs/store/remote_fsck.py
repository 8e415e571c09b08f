"""Check the remote (``rametfs fsck --remote``, docs/remote.md): every snapshot the catalog
lists has all it needs published, in packs that are there.

For each listed snapshot: its record matches its id; every tree below its root and every
content record of its files is located by the catalog, fetched and checked against its id;
every chunk of those records is located; and every pack a located object lies in exists in
the object store, at least as long as the object's end (one HEAD per pack).  Chunks are not
downloaded (that would be the whole remote): their bytes are checked when a worker reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from . import chunks
from .chunks import Content
from .remote import KIND_CHUNK, KIND_CONTENT, KIND_TREE, Remote
from .store import EMPTY_CONTENT


@dataclass
class RemoteReport:
    """What was checked, and one line per problem found (empty: none)."""

    snapshots: int = 0
    trees: int = 0
    contents: int = 0
    chunks: int = 0
    packs: int = 0
    problems: list[str] = field(default_factory=list)


def check(remote: Remote) -> RemoteReport:
    """Check every listed snapshot (see the module's docstring).  Raises RametError (EIO)
    when the object store or the catalog cannot be read; damage found is reported, not
    raised (an object that does not match its id included)."""
    from ..errors import IntegrityError
    report = RemoteReport()
    seen_trees: set[bytes] = set()
    seen_contents: set[bytes] = set()
    ends: dict[str, int] = {}  # pack -> the end of the furthest object located in it

    def located(kind: int, ids: list[bytes], what: str) -> list[bytes]:
        where = remote.catalog.locate(kind, ids)
        for oid in ids:
            if oid not in where:
                report.problems.append(f"{what} {oid.hex()} is not published")
        for pack, off, length in where.values():
            ends[pack] = max(ends.get(pack, 0), off + length)
        return [oid for oid in ids if oid in where]

    def fetched(kind: int, ids: list[bytes], what: str) -> dict:
        ids = located(kind, ids, what)
        try:
            got = remote.fetch(kind, ids)
        except IntegrityError:  # one bad object: check them one by one to name it
            got = {}
            for oid in ids:
                try:
                    got.update(remote.fetch(kind, [oid]))
                except IntegrityError as exc:
                    report.problems.append(str(exc))
        return got

    for sid, record in remote.catalog.snapshots():
        report.snapshots += 1
        if chunks.chunk_id(record) != sid:
            report.problems.append(f"snapshot {sid.hex()}: its record does not match its id")
            continue
        root = msgpack.unpackb(record)["root"][6]
        level = [root] if root not in seen_trees else []
        while level:
            seen_trees.update(level)
            trees = fetched(KIND_TREE, level, f"snapshot {sid.hex()[:12]}: tree")
            report.trees += len(trees)
            subtrees, contents = [], []
            for value, _ in trees.values():
                for e in msgpack.unpackb(value, use_list=True):
                    mode, ref = e[1], e[6]
                    if mode & 0o170000 == 0o040000 and ref not in seen_trees:
                        subtrees.append(ref)
                    elif (mode & 0o170000 == 0o100000 and ref != EMPTY_CONTENT
                          and ref not in seen_contents):
                        contents.append(ref)
            contents = list(dict.fromkeys(contents))
            seen_contents.update(contents)
            records = fetched(KIND_CONTENT, contents, f"snapshot {sid.hex()[:12]}: content")
            report.contents += len(records)
            wanted = list(dict.fromkeys(c for cid, value in records.items()
                                        for c in Content.unpack(cid, value).chunk_ids()))
            report.chunks += len(located(KIND_CHUNK, wanted,
                                         f"snapshot {sid.hex()[:12]}: chunk"))
            level = list(dict.fromkeys(subtrees))
    for pack, end in sorted(ends.items()):
        report.packs += 1
        size = remote.objects.size(pack)
        if size is None:
            report.problems.append(f"pack {pack} is missing from the object store")
        elif size < end:
            report.problems.append(f"pack {pack} holds {size} bytes; objects end at {end}")
    return report
