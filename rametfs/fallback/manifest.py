"""An execution's record and manifest: one msgpack file per execution, replaced atomically.

``<data>/fallback/meta/<id>`` is a msgpack stream (docs/fallback.md):

1. a header map ``{"format": 1, "id", "base", "head", "created_ns", "last", "access"
   [, "policy"][, "runtime"]}``: snapshot ids as hex, ``created_ns`` in ns, ``last`` the
   reply of the last command (or nil), ``access`` the settings it was created with
   (``rametfs.authority.Access`` as a record; absent from a record written before them),
   ``policy`` and ``runtime`` as in the daemon's execution record (docs/format.md; absent:
   none);
2. one list per path of the execution's tree as rametfs last wrote or read it, parents before
   children: ``[path, entry, ino, ctime_ns]``.  ``path`` is bytes relative to the execution
   root (``b""`` for the root); ``entry`` the tree entry the path stands for, as a snapshot
   stores it (``Entry.pack()``: mode, uid, gid, mtime_ns, size, content id or target or
   subtree id, xattrs, hard-link id, nlink); ``ino`` and ``ctime_ns`` its ``lstat`` when
   recorded.  ``ctime_ns`` is -1 when the record must not be trusted (see :data:`UNTRUSTED`).

A record *vouches* for a file when the file's inode, ctime, mtime, mode and size are the
recorded ones: then its content id and xattrs are the recorded ones, without reading it
(ctime moves with every write, chmod, chown, xattr change, link and rename, and cannot be
set back).  Records are looked up by inode, so a renamed file keeps its record.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgpack

from ..errors import IntegrityError
from ..store import Entry

FORMAT = 1
UNTRUSTED = -1  # ctime_ns of a record written while the file may still have been changing


@dataclass(frozen=True, slots=True)
class Record:
    """What rametfs knows of one path: its tree entry and the lstat identity it had."""

    entry: Entry
    ino: int
    ctime_ns: int

    def vouches_for(self, st: os.stat_result) -> bool:
        """Whether the file ``st`` is unchanged since this record was made."""
        e = self.entry
        return (st.st_ino == self.ino and st.st_ctime_ns == self.ctime_ns
                and st.st_mtime_ns == e.mtime_ns and st.st_mode == e.mode
                and (st.st_size == e.size or not stat.S_ISREG(st.st_mode)))


@dataclass
class Meta:
    """One execution: ids as hex, ``created_ns`` in ns, ``records`` by relative path,
    ``access`` its settings as a record (empty: the defaults); ``policy`` and ``runtime``
    the harness's settings (rametfs.overlay.Execution's)."""

    id: str
    base: str
    head: str
    created_ns: int
    last: dict | None = None
    records: dict[bytes, Record] = field(default_factory=dict)
    access: dict = field(default_factory=dict)
    policy: dict | None = None
    runtime: dict | None = None


def save(path: str | os.PathLike, meta: Meta) -> None:
    """Write ``meta`` to ``path`` atomically (temporary file, fsync, rename).  Blocking."""
    directory, name = os.path.split(os.fspath(path))
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{threading.get_ident()}")
    packer = msgpack.Packer(use_bin_type=True)
    try:
        with open(tmp, "wb") as f:
            header = {"format": FORMAT, "id": meta.id, "base": meta.base, "head": meta.head,
                      "created_ns": meta.created_ns, "last": meta.last, "access": meta.access}
            header.update((key, value) for key, value in (("policy", meta.policy),
                                                          ("runtime", meta.runtime)) if value)
            f.write(packer.pack(header))
            for rel, r in meta.records.items():
                f.write(packer.pack([rel, r.entry.pack(), r.ino, r.ctime_ns]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | os.PathLike, records: bool = True) -> Meta:
    """Read the file ``save`` wrote; with ``records=False`` only its header.

    Raises FileNotFoundError when absent, IntegrityError (EIO) when it does not parse.
    """
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False)
        try:
            head = next(unpacker)
            if head.get("format") != FORMAT:
                raise ValueError(f"format {head.get('format')!r}, expected {FORMAT}")
            meta = Meta(head["id"], head["base"], head["head"], head["created_ns"], head["last"],
                        access=head.get("access", {}), policy=head.get("policy"),
                        runtime=head.get("runtime"))
            if records:
                for rel, entry, ino, ctime_ns in unpacker:
                    meta.records[rel] = Record(Entry.unpack(entry), ino, ctime_ns)
        except (StopIteration, ValueError, KeyError, TypeError,
                msgpack.UnpackException) as exc:
            raise IntegrityError(f"{os.fspath(path)}: damaged execution record: {exc}") from None
    return meta


def gc_roots(data: str | os.PathLike) -> Iterator[tuple[str, Entry]]:
    """``(label, entry)`` of every regular file a fallback execution's manifest under the
    data directory ``data`` vouches for: gc keeps their contents (rametfs.store.gc), since
    a promote reuses a vouched-for content id without storing it again.  Blocking."""
    meta_dir = os.path.join(os.fspath(data), "fallback", "meta")
    try:
        names = sorted(os.listdir(meta_dir))
    except FileNotFoundError:  # no fallback execution was ever made here
        return
    for name in names:
        if name.startswith("."):  # a temporary file
            continue
        try:
            meta = load(os.path.join(meta_dir, name))
        except FileNotFoundError:  # released meanwhile
            continue
        for rel, record in meta.records.items():
            if record.entry.is_reg:
                yield f"execution {meta.id} {os.fsdecode(rel)}", record.entry
