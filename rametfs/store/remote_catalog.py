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
    rametfs_names      name PRIMARY KEY, snapshot (a listed one), updated
    rametfs_publishes  id PRIMARY KEY, snapshot, started, seen: the publishes running, each
                       registered before its first query and renewed with each pack; a
                       remote gc deletes nothing while one has been seen within its grace
                       period (rametfs.store.remote_gc)

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
import time
from collections.abc import Iterable, Iterator

from ..errors import Busy, InvalidArgument, NotFound, RametError
from .names import HEX_REF

log = logging.getLogger(__name__)

CATALOG_FORMAT = "1"
BATCH = 5000  # ids per query of ANY(%s)
RETRIES = 3  # connection attempts of one call before it fails (EIO)
CONNECT_TIMEOUT_S = 2  # per attempt (libpq's connect_timeout)
# After a call found the server unreachable, calls fail at once for this long with its error
# rather than each waiting RETRIES x CONNECT_TIMEOUT_S: lookups queued behind the first one
# (one connection, one call at a time) then answer EIO promptly.
DOWN_S = 5.0

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
CREATE TABLE IF NOT EXISTS rametfs_names (
    name text PRIMARY KEY, snapshot bytea NOT NULL REFERENCES rametfs_snapshots,
    updated timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS rametfs_publishes (
    id bigserial PRIMARY KEY, snapshot bytea NOT NULL,
    started timestamptz NOT NULL DEFAULT now(), seen timestamptz NOT NULL DEFAULT now());
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
    server cannot be reached after :data:`RETRIES` attempts (and for :data:`DOWN_S` seconds
    after that, at once) or fails a statement.
    """

    def __init__(self, dsn: str, remote_url: str | None):
        self.dsn = dsn
        self.where = safe_dsn(dsn)
        self._secret = _password(dsn)
        self._remote_url = remote_url
        self._conn = None
        self._lock = threading.Lock()
        self._schema_checked = False
        self._down: tuple[float, Exception] | None = None  # (until, monotonic s; the cause)
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
            if self._down is not None and time.monotonic() < self._down[0]:
                raise self._error(what, self._down[1]) from None
            self._down = None
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
            self._down = (time.monotonic() + DOWN_S, last)
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

    def add_pack(self, name: str, size: int, rows: list[tuple[int, bytes, int, int]],
                 publishing: int) -> None:
        """Record pack ``name`` (``size`` bytes, durable) and its objects ``(kind, id, off,
        len)``, in one transaction that renews the registration ``publishing``
        (:meth:`begin_publish`); an object already published elsewhere keeps its row.
        Raises RametError (EIO) when a remote gc took the registration as dead."""
        def insert(conn):
            with conn.transaction():
                _renew(conn, publishing)
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
                     root_tree: bytes, kind_tree: int, publishing: int) -> bool:
        """List snapshot ``sid`` (its ``record`` as the store keeps it), in one transaction
        that first checks the registration ``publishing`` is there (no remote gc has
        deleted what this publish found published) and its root tree is published; True
        when it was not listed before.  Raises RametError (EIO) when either is not."""
        def insert(conn):
            with conn.transaction():
                _renew(conn, publishing)
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
        most two: enough to tell one from several), or that the name ``ref`` points at
        (anything but 8 or more hex digits)."""
        if not HEX_REF.fullmatch(ref):
            return self.named(ref)
        # A range of the primary key (the whole bytes of the prefix), then the odd digit.
        low = bytes.fromhex(ref[:len(ref) // 2 * 2])
        end = int.from_bytes(low, "big") + 1
        high = end.to_bytes(len(low), "big") if low and end < 1 << 8 * len(low) else None
        rows = self._call(f"find snapshot {ref}", lambda conn: conn.execute(
            "SELECT id, record FROM rametfs_snapshots WHERE id >= %s AND (%s::bytea IS NULL "
            "OR id < %s) AND encode(id, 'hex') LIKE %s ORDER BY id LIMIT 2",
            (low, high, high, ref.lower() + "%")).fetchall())
        return [(bytes(i), bytes(r)) for i, r in rows]

    def named(self, name: str) -> list[tuple[bytes, bytes]]:
        """``[(id, record)]`` of the snapshot the catalog's name ``name`` points at (empty:
        no such name)."""
        rows = self._call(f"find name {name}", lambda conn: conn.execute(
            "SELECT s.id, s.record FROM rametfs_names n JOIN rametfs_snapshots s ON "
            "s.id = n.snapshot WHERE n.name = %s", (name,)).fetchall())
        return [(bytes(i), bytes(r)) for i, r in rows]

    def names(self) -> dict[str, str]:
        """Every name in the catalog and the id (hex) it points at, by name."""
        rows = self._call("list names", lambda conn: conn.execute(
            "SELECT name, snapshot FROM rametfs_names ORDER BY name").fetchall())
        return {n: bytes(sid).hex() for n, sid in rows}

    def set_name(self, name: str, sid: bytes) -> str | None:
        """Point name ``name`` at the listed snapshot ``sid`` (created, or moved); the id
        (hex) it pointed at before, None when new.  NotFound (ENOENT) when ``sid`` is not
        listed."""
        import psycopg

        def upsert(conn):
            with conn.transaction():
                old = conn.execute("SELECT snapshot FROM rametfs_names WHERE name = %s FOR "
                                   "UPDATE", (name,)).fetchone()
                try:
                    conn.execute("INSERT INTO rametfs_names (name, snapshot) VALUES (%s, %s) "
                                 "ON CONFLICT (name) DO UPDATE SET snapshot = excluded.snapshot,"
                                 " updated = now()", (name, sid))
                except psycopg.errors.ForeignKeyViolation:
                    raise NotFound(f"snapshot {sid.hex()} is not published: publish it "
                                   "first") from None
                return None if old is None else bytes(old[0]).hex()
        return self._call(f"set name {name}", upsert)

    def delete_name(self, name: str) -> str:
        """Delete name ``name``; the id (hex) it pointed at.  NotFound (ENOENT) when there is
        no such name."""
        row = self._call(f"delete name {name}", lambda conn: conn.execute(
            "DELETE FROM rametfs_names WHERE name = %s RETURNING snapshot", (name,)).fetchone())
        if row is None:
            raise NotFound(f"no published name {name!r}")
        return bytes(row[0]).hex()

    def remove_snapshots(self, sids: list[bytes], force: bool) -> list[str]:
        """Delist the snapshots ``sids``, all or none, in one transaction; the names deleted
        with them (``force``).  Busy (EBUSY) naming them when names point at them and not
        ``force``; NotFound (ENOENT) when one is not listed."""
        def remove(conn):
            with conn.transaction():
                names = conn.execute("SELECT name, snapshot FROM rametfs_names WHERE snapshot "
                                     "= ANY(%s) ORDER BY name FOR UPDATE", (sids,)).fetchall()
                if names and not force:
                    raise Busy("; ".join(
                        f"snapshot {bytes(sid).hex()[:12]}: name {n!r} points at it"
                        for n, sid in names) + ": --force deletes the names")
                conn.execute("DELETE FROM rametfs_names WHERE snapshot = ANY(%s)", (sids,))
                gone = conn.execute("DELETE FROM rametfs_snapshots WHERE id = ANY(%s) "
                                    "RETURNING id", (sids,)).fetchall()
                missing = set(sids) - {bytes(i) for i, in gone}
                if missing:
                    raise NotFound(f"snapshot {min(missing).hex()} is not published")
                return [n for n, _ in names]
        return self._call("remove snapshots", remove)

    # -- publishes and gc (rametfs.store.remote_gc) ----------------------------------------

    def begin_publish(self, sid: bytes) -> int:
        """Register a publish of ``sid`` (before it asks what is published); its id.  Waits
        while a remote gc deletes (it holds the table's lock)."""
        return self._call(f"register a publish of {sid.hex()}", lambda conn: conn.execute(
            "INSERT INTO rametfs_publishes (snapshot) VALUES (%s) RETURNING id",
            (sid,)).fetchone()[0])

    def end_publish(self, publishing: int) -> None:
        self._call("end a publish", lambda conn: conn.execute(
            "DELETE FROM rametfs_publishes WHERE id = %s", (publishing,)))

    def publishes(self, grace_s: float) -> int:
        """How many publishes were seen within the last ``grace_s`` seconds (running)."""
        return self._call("count publishes", lambda conn: conn.execute(
            "SELECT count(*) FROM rametfs_publishes WHERE seen > now() - make_interval("
            "secs => %s)", (grace_s,)).fetchone()[0])

    def collect(self, snapshots: set[bytes], live: Iterable[tuple[int, bytes]],
                grace_s: float, dry_run: bool) -> dict | None:
        """Delete, in one transaction holding ``rametfs_publishes`` exclusively (no publish
        registers or lists meanwhile), every object row not in ``live`` (``(kind, id)``:
        what ``snapshots`` reach) and every pack left with no row, and the registrations of
        publishes not seen within ``grace_s`` seconds; ``dry_run``: roll it back.

        None, deleting nothing, when a publish was seen within ``grace_s`` or a listed
        snapshot is not among ``snapshots`` (listed since they were marked: mark it and call
        again).  Otherwise ``{"objects": {kind: rows}, "packs": [(name, bytes)], "stale":
        registrations deleted, "cutoff": the database's time less grace_s (epoch seconds:
        a pack the catalog does not record, older than it, is a dead publish's)}``.
        """
        class Retry(Exception):
            pass

        def run(conn):
            with conn.transaction(force_rollback=dry_run):
                conn.execute("LOCK TABLE rametfs_publishes IN EXCLUSIVE MODE")
                busy = conn.execute("SELECT count(*) FROM rametfs_publishes WHERE seen > now()"
                                    " - make_interval(secs => %s)", (grace_s,)).fetchone()[0]
                listed = {bytes(i) for i, in conn.execute(
                    "SELECT id FROM rametfs_snapshots").fetchall()}
                if busy or listed - snapshots:
                    raise Retry
                stale = conn.execute("DELETE FROM rametfs_publishes").rowcount
                conn.execute("CREATE TEMP TABLE rametfs_live (kind smallint, id bytea, "
                             "PRIMARY KEY (kind, id)) ON COMMIT DROP")
                with conn.cursor().copy("COPY rametfs_live FROM STDIN") as copy:
                    for row in live:
                        copy.write_row(row)
                objects = dict(conn.execute(
                    "WITH gone AS (DELETE FROM rametfs_objects o WHERE NOT EXISTS (SELECT 1 "
                    "FROM rametfs_live l WHERE l.kind = o.kind AND l.id = o.id) RETURNING "
                    "kind) SELECT kind, count(*) FROM gone GROUP BY kind").fetchall())
                packs = conn.execute(
                    "DELETE FROM rametfs_packs p WHERE NOT EXISTS (SELECT 1 FROM "
                    "rametfs_objects o WHERE o.pack = p.name) RETURNING name, bytes"
                    ).fetchall()
                cutoff = conn.execute("SELECT extract(epoch FROM now()) - %s",
                                      (grace_s,)).fetchone()[0]
                return {"objects": objects, "packs": sorted(packs), "stale": stale,
                        "cutoff": float(cutoff)}
        try:
            return self._call("collect garbage", run)
        except Retry:
            return None

    def packs(self) -> set[str]:
        """The names of the packs the catalog records."""
        return {n for n, in self._call("list packs", lambda conn: conn.execute(
            "SELECT name FROM rametfs_packs").fetchall())}

    def has_snapshot(self, sid: bytes) -> bool:
        row = self._call(f"find snapshot {sid.hex()}", lambda conn: conn.execute(
            "SELECT 1 FROM rametfs_snapshots WHERE id = %s", (sid,)).fetchone())
        return row is not None


def _renew(conn, publishing: int) -> None:
    """Renew registration ``publishing`` inside the caller's transaction (waiting while a gc
    holds the table); RametError (EIO) when a gc deleted it as dead."""
    if conn.execute("UPDATE rametfs_publishes SET seen = now() WHERE id = %s",
                    (publishing,)).rowcount != 1:
        raise RametError(errno.EIO, "a remote gc took this publish for dead (not seen within "
                         "its grace period) and may have deleted what it found published: run "
                         "it again")


def _batches(ids: Iterable[bytes]) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for i in ids:
        batch.append(i)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch
