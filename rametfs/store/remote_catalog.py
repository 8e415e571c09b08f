"""The remote catalog: which pack object holds each published chunk, content record and
tree, and which snapshots are published, in PostgreSQL (docs/remote.md).

Tables (created on first use, under an advisory lock so that two workers starting together
do not race; all in the connection's first ``search_path`` schema)::

    rametfs_meta       key text PRIMARY KEY, value text: format version, the remote's URL
    rametfs_packs      name text PRIMARY KEY, bytes, objects, created
    rametfs_objects    (kind, id) PRIMARY KEY, pack, off, len: where an object's bytes lie
                       (indexed by (pack, off) too: read-ahead asks what follows)
    rametfs_snapshots  id PRIMARY KEY, record (the store's snapshot value), label, created_ns,
                       published

A pack's rows are inserted in one transaction after its PUT succeeded, so every row names
bytes that are durable; a snapshot row is inserted, in a transaction of its own, only when its
root tree's row is there (a publish uploads a tree after everything below it, so a tree's row
means its whole closure is published: ``rametfs.store.remote``).

The connection comes from libpq's chain: the DSN given (``--catalog``/``RAMET_CATALOG``, a
URI or ``key=value`` string, possibly empty), ``PG*`` variables, ``.pgpass``.  No message
this module makes holds a password: the DSN is shown by :func:`safe_dsn`, and a server's
error text is scrubbed of the password before it is raised.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Iterable, Iterator

from ..errors import InvalidArgument, RametError

log = logging.getLogger(__name__)

CATALOG_FORMAT = "1"
BATCH = 5000  # ids per query of ANY(%s)
RETRIES = 3  # connection attempts of one call before it fails (EIO)
CONNECT_TIMEOUT_S = 2  # per attempt (libpq's connect_timeout)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rametfs_meta (key text PRIMARY KEY, value text NOT NULL);
CREATE TABLE IF NOT EXISTS rametfs_packs (
    name text PRIMARY KEY, bytes bigint NOT NULL, objects integer NOT NULL,
    created timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS rametfs_objects (
    kind smallint NOT NULL, id bytea NOT NULL, pack text NOT NULL REFERENCES rametfs_packs,
    off bigint NOT NULL, len integer NOT NULL, PRIMARY KEY (kind, id));
CREATE INDEX IF NOT EXISTS rametfs_objects_by_place ON rametfs_objects (pack, off);
CREATE TABLE IF NOT EXISTS rametfs_snapshots (
    id bytea PRIMARY KEY, record bytea NOT NULL, label text NOT NULL,
    created_ns bigint NOT NULL, published timestamptz NOT NULL DEFAULT now());
"""
_LOCK_KEY = 0x72616D6574  # pg_advisory_xact_lock: "ramet"


def safe_dsn(dsn: str) -> str:
    """``dsn`` without its password (for messages); ``"(libpq defaults)"`` when empty."""
    import psycopg.conninfo
    if not dsn:
        return "(libpq defaults: PG* variables)"
    try:
        parts = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "(a malformed DSN)"
    parts.pop("password", None)
    return " ".join(f"{k}={v}" for k, v in parts.items())


def _password(dsn: str) -> str | None:
    import psycopg.conninfo
    try:
        return psycopg.conninfo.conninfo_to_dict(dsn).get("password") if dsn else None
    except psycopg.ProgrammingError:
        return None


class Catalog:
    """One PostgreSQL connection to the catalog, shared by the threads that call it (psycopg
    serialises them); reconnected on the next call after the server went away.

    ``remote_url`` is the remote whose catalog it must be (recorded by the first use;
    another is InvalidArgument, EINVAL), or None to read any (``rametfs ls --remote``).
    Every method raises RametError (EIO) naming the catalog (:func:`safe_dsn`) when the
    server cannot be reached after :data:`RETRIES` attempts or fails a statement.
    """

    def __init__(self, dsn: str, remote_url: str | None):
        self.dsn = dsn
        self.where = safe_dsn(dsn)
        self._secret = _password(dsn)
        self._remote_url = remote_url
        self._conn = None
        self._lock = threading.Lock()
        self._schema_checked = False
        self.recorded_remote: str | None = remote_url  # the remote the catalog records

    def _error(self, what: str, exc: Exception) -> RametError:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if self._secret:
            text = text.replace(self._secret, "***")
        return RametError(errno.EIO, f"catalog {self.where}: {what}: {text}")

    def _connect(self):
        import psycopg
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return self._conn
        # autocommit: a read holds no transaction; writes open theirs (conn.transaction()).
        self._conn = psycopg.connect(self.dsn, connect_timeout=CONNECT_TIMEOUT_S,
                                     autocommit=True)
        if not self._schema_checked:
            self._check_schema(self._conn)
            self._schema_checked = True
        return self._conn

    def _check_schema(self, conn) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
            conn.execute(_SCHEMA)
            rows = dict(conn.execute("SELECT key, value FROM rametfs_meta").fetchall())
            self.recorded_remote = rows.get("remote")
            if not rows and self._remote_url is not None:
                conn.execute("INSERT INTO rametfs_meta VALUES ('format', %s), ('remote', %s)",
                             (CATALOG_FORMAT, self._remote_url))
                self.recorded_remote = self._remote_url
                return
            if not rows:
                return
        if rows.get("format") != CATALOG_FORMAT:
            raise InvalidArgument(f"catalog {self.where}: format {rows.get('format')!r}, this "
                                  f"rametfs reads {CATALOG_FORMAT!r}")
        if self._remote_url is not None and rows.get("remote") != self._remote_url:
            raise InvalidArgument(f"catalog {self.where} belongs to the remote "
                                  f"{rows.get('remote')}, not {self._remote_url}")

    def _call(self, what: str, fn):
        """``fn(connection)`` under the lock, with a new connection and again after a lost
        one, at most :data:`RETRIES` times."""
        import psycopg
        last: Exception | None = None
        with self._lock:
            for _ in range(RETRIES):
                try:
                    return fn(self._connect())
                except psycopg.OperationalError as exc:  # connection refused or lost
                    last = exc
                    if self._conn is not None:
                        self._conn.close()
                    self._conn = None
                except psycopg.Error as exc:
                    raise self._error(what, exc) from None
        raise self._error(what, last) from None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # -- objects ---------------------------------------------------------------------------

    def locate(self, kind: int, ids: Iterable[bytes]) -> dict[bytes, tuple[str, int, int]]:
        """``{id: (pack, offset, length)}`` of those of ``ids`` published as ``kind``."""
        found: dict[bytes, tuple[str, int, int]] = {}
        for batch in _batches(ids):
            def query(conn, batch=batch):
                return conn.execute(
                    "SELECT id, pack, off, len FROM rametfs_objects WHERE kind = %s AND "
                    "id = ANY(%s)", (kind, batch)).fetchall()
            for oid, pack, off, length in self._call("locate objects", query):
                found[bytes(oid)] = (pack, off, length)
        return found

    def objects_in(self, kind: int, pack: str, start: int, stop: int
                   ) -> list[tuple[bytes, int, int]]:
        """``(id, offset, length)`` of the objects of ``kind`` whose row places them in pack
        ``pack`` at an offset in ``[start, stop)``, by offset."""
        rows = self._call(f"list objects of pack {pack}", lambda conn: conn.execute(
            "SELECT id, off, len FROM rametfs_objects WHERE pack = %s AND off >= %s AND "
            "off < %s AND kind = %s ORDER BY off", (pack, start, stop, kind)).fetchall())
        return [(bytes(i), off, length) for i, off, length in rows]

    def missing(self, kind: int, ids: Iterable[bytes]) -> list[bytes]:
        """Those of ``ids`` (distinct) not published as ``kind``, in their order."""
        ids = list(ids)
        there = self.locate(kind, ids)
        return [i for i in ids if i not in there]

    def add_pack(self, name: str, size: int, rows: list[tuple[int, bytes, int, int]]) -> None:
        """Record pack ``name`` (``size`` bytes, durable) and its objects ``(kind, id, off,
        len)``, in one transaction; an object already published elsewhere keeps its row."""
        def insert(conn):
            with conn.transaction():
                conn.execute("INSERT INTO rametfs_packs (name, bytes, objects) VALUES "
                             "(%s, %s, %s) ON CONFLICT DO NOTHING", (name, size, len(rows)))
                conn.execute("CREATE TEMP TABLE IF NOT EXISTS rametfs_new (kind smallint, "
                             "id bytea, off bigint, len integer) ON COMMIT DELETE ROWS")
                with conn.cursor().copy("COPY rametfs_new FROM STDIN") as copy:
                    for row in rows:
                        copy.write_row(row)
                conn.execute("INSERT INTO rametfs_objects SELECT kind, id, %s, off, len FROM "
                             "rametfs_new ON CONFLICT DO NOTHING", (name,))
        self._call(f"record pack {name}", insert)

    # -- snapshots -------------------------------------------------------------------------

    def add_snapshot(self, sid: bytes, record: bytes, label: str, created_ns: int,
                     root_tree: bytes, kind_tree: int) -> bool:
        """List snapshot ``sid`` (its ``record`` as the store keeps it), in one transaction
        that first checks its root tree is published; True when it was not listed before.
        Raises RametError (EIO) when the root tree is not published."""
        def insert(conn):
            with conn.transaction():
                there = conn.execute("SELECT 1 FROM rametfs_objects WHERE kind = %s AND "
                                     "id = %s", (kind_tree, root_tree)).fetchone()
                if there is None:
                    raise RametError(errno.EIO, f"snapshot {sid.hex()}: its root tree "
                                     f"{root_tree.hex()} is not published")
                cur = conn.execute("INSERT INTO rametfs_snapshots (id, record, label, "
                                   "created_ns) VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                                   (sid, record, label, created_ns))
                return cur.rowcount == 1
        return self._call(f"list snapshot {sid.hex()}", insert)

    def snapshots(self) -> list[tuple[bytes, bytes]]:
        """``(id, record)`` of every published snapshot, oldest first."""
        rows = self._call("list snapshots", lambda conn: conn.execute(
            "SELECT id, record FROM rametfs_snapshots ORDER BY created_ns, id").fetchall())
        return [(bytes(i), bytes(r)) for i, r in rows]

    def snapshot(self, ref: str) -> list[tuple[bytes, bytes]]:
        """``(id, record)`` of the published snapshots whose hex id starts with ``ref`` (at
        most two: enough to tell one from several)."""
        # A range of the primary key (the whole bytes of the prefix), then the odd digit.
        low = bytes.fromhex(ref[:len(ref) // 2 * 2])
        end = int.from_bytes(low, "big") + 1
        high = end.to_bytes(len(low), "big") if low and end < 1 << 8 * len(low) else None
        rows = self._call(f"find snapshot {ref}", lambda conn: conn.execute(
            "SELECT id, record FROM rametfs_snapshots WHERE id >= %s AND (%s::bytea IS NULL "
            "OR id < %s) AND encode(id, 'hex') LIKE %s ORDER BY id LIMIT 2",
            (low, high, high, ref.lower() + "%")).fetchall())
        return [(bytes(i), bytes(r)) for i, r in rows]

    def has_snapshot(self, sid: bytes) -> bool:
        row = self._call(f"find snapshot {sid.hex()}", lambda conn: conn.execute(
            "SELECT 1 FROM rametfs_snapshots WHERE id = %s", (sid,)).fetchone())
        return row is not None


def _batches(ids: Iterable[bytes]) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for i in ids:
        batch.append(i)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch
