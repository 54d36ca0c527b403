"""Where the call records live: an embedded SQLite file (the default, `[records] path`) or a
PostgreSQL server (`[records] url`), which several voice instances can share (docs/SCALING.md).

Both get the same tables from one schema and the same numbered migrations, and offer the writer
(voice/service/records.py) the same few operations: connect, run statements (written once, with `?`
placeholders) as one transaction, read rows as dicts, and say whether a failure lost the
connection (PostgreSQL: the writer reconnects and retries; an SQLite file cannot be lost).

PostgreSQL is reached through psycopg 3 (`pip install 'diffusion-voice[postgres]'`), the
maintained PostgreSQL driver of Python on libpq, with the same plain SQL as SQLite: the statements
are the few the writer and `voice records` need, so a query builder or ORM (SQLAlchemy) would add
a layer without removing any SQL. Only two things differ by dialect: the auto-numbered key of
`errors` and the placeholder (`?` for sqlite3, `%s` for psycopg).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("voice.records")

SCHEMA_VERSION = 3  # 2: turns.tools; 3: sessions.dtmf
# The tables at SCHEMA_VERSION, in both dialects (DOUBLE PRECISION is a float in SQLite too: its
# type affinity goes by the name). Timestamps are unix times; the JSON columns are TEXT in both.
TABLES: list[str] = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS sessions (
    uid TEXT PRIMARY KEY,           -- unique over processes
    session_id TEXT NOT NULL,       -- what the client saw (ready.session_id); restarts at s1 per process
    transport TEXT NOT NULL,        -- native | twilio | sip
    principal TEXT NOT NULL DEFAULT '',  -- API key name, "twilio", "sip:ADDR", "anonymous"
    peer TEXT NOT NULL DEFAULT '',
    started DOUBLE PRECISION NOT NULL,   -- unix time
    ended DOUBLE PRECISION,
    end_reason TEXT,                -- caller_hangup | end_call | transfer:NAME | media_timeout... | an error code
    dtmf TEXT NOT NULL DEFAULT '',  -- the keys pressed in the session, in order (DTMF, the native `dtmf` event)
    turns INTEGER NOT NULL DEFAULT 0,
    meta TEXT NOT NULL DEFAULT '{}' -- JSON: rates, lm_mode, Twilio callSid...
)""",
    "CREATE INDEX IF NOT EXISTS sessions_by_id ON sessions (session_id)",
    "CREATE INDEX IF NOT EXISTS sessions_by_start ON sessions (started)",
    """CREATE TABLE IF NOT EXISTS turns (
    session_uid TEXT NOT NULL,
    turn INTEGER NOT NULL,
    started DOUBLE PRECISION,       -- unix time the user started speaking
    ended DOUBLE PRECISION NOT NULL,  -- unix time the turn ended (reply done)
    status TEXT NOT NULL,           -- ok | interrupted | failed | no_speech | asr_failed | superseded | abandoned
    transcript TEXT NOT NULL DEFAULT '',
    reply TEXT NOT NULL DEFAULT '', -- everything the LM committed
    heard TEXT NOT NULL DEFAULT '', -- what the user heard (a prefix of reply after a barge-in)
    interrupted INTEGER NOT NULL DEFAULT 0,
    apology INTEGER NOT NULL DEFAULT 0,  -- the spoken apology was played (a stage failed)
    latency TEXT NOT NULL DEFAULT '{}',  -- JSON: the latency event (stages_ms, marks_ms, over_budget)
    errors TEXT NOT NULL DEFAULT '[]',   -- JSON: [{code, message}] of this turn
    tools TEXT NOT NULL DEFAULT '[]',    -- JSON: [{id, name, arguments, result, status, ms}] the LM called
    PRIMARY KEY (session_uid, turn)
)""",
    """CREATE TABLE IF NOT EXISTS errors (
    id INTEGER PRIMARY KEY,
    session_uid TEXT NOT NULL,
    turn INTEGER NOT NULL,
    at DOUBLE PRECISION NOT NULL,
    code TEXT NOT NULL,
    message TEXT NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS errors_by_session ON errors (session_uid)",
]
# MIGRATIONS[v]: what brings a database of version v - 1 to version v (a fresh one gets TABLES).
MIGRATIONS: dict[int, list[str]] = {
    2: ["ALTER TABLE turns ADD COLUMN tools TEXT NOT NULL DEFAULT '[]'"],
    3: ["ALTER TABLE sessions ADD COLUMN dtmf TEXT NOT NULL DEFAULT ''"],
}
Op = tuple[str, tuple]
# What a database refuses in text, each written as U+FFFD (the Unicode replacement character):
# NUL (PostgreSQL: "text fields cannot contain NUL (0x00) bytes"; SQLite stores it, but C string
# functions and the sqlite3 shell stop there) and lone surrogates (no UTF-8 for them: both fail).
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(text: str) -> str:
    """`text` as both dialects store it alike (`UNSTORABLE` replaced)."""
    return UNSTORABLE.sub("\ufffd", text)


class RecordsError(Exception):
    """The records database could not be opened, created, migrated or read."""


class Database:
    """One dialect's way to the records. Connections are used by one thread at a time."""

    errors: tuple[type[Exception], ...] = ()
    tables: list[str] = TABLES

    def connect(self, readonly: bool = False) -> Any:
        raise NotImplementedError

    def execute(self, conn: Any, sql: str, args: Sequence = ()) -> Any:
        raise NotImplementedError

    def transaction(self, conn: Any, lock: bool = False) -> contextlib.AbstractContextManager:
        """A write transaction; `lock`: also exclusive of other processes' migrations."""
        raise NotImplementedError

    def has_table(self, conn: Any, name: str) -> bool:
        raise NotImplementedError

    def lost(self, conn: Any) -> bool:
        """Whether the last failure left the connection unusable (reconnect, then retry)."""
        return False

    def run(self, conn: Any, ops: list[Op]) -> None:
        """`ops` as one transaction: all committed, or none (and the error raised). Text goes in as
        both dialects can store it (`storable`), so no turn is lost for what its user typed."""
        with self.transaction(conn):
            for sql, args in ops:
                self.execute(conn, sql, tuple(storable(a) if isinstance(a, str) else a for a in args))

    def rows(self, conn: Any, sql: str, args: Sequence = ()) -> list[dict]:
        return [dict(row) for row in self.execute(conn, sql, args).fetchall()]

    def init(self) -> None:
        """Create the tables, or migrate older ones to SCHEMA_VERSION (idempotent; several processes
        may do it at once). Raises RecordsError when the database cannot be used."""
        try:
            conn = self.connect()
        except self.errors as err:
            raise RecordsError(f"cannot open the call records in {self}: {err}") from err
        try:
            with self.transaction(conn, lock=True):
                self._migrate(conn)
        except self.errors as err:
            raise RecordsError(f"cannot create or migrate the call records in {self}: {err}") from err
        finally:
            conn.close()

    def _migrate(self, conn: Any) -> None:
        version = self._version(conn)
        if version is None:  # a new database
            steps = self.tables
        elif version > SCHEMA_VERSION:
            raise RecordsError(f"the call records in {self} are at schema version {version}, newer than this "
                               f"program's {SCHEMA_VERSION}: upgrade it")
        else:
            steps = [sql for v in range(version + 1, SCHEMA_VERSION + 1) for sql in MIGRATIONS[v]]
            if steps:
                log.info("records: migrating %s from schema version %d to %d", self, version, SCHEMA_VERSION)
        for sql in steps:
            self.execute(conn, sql)
        if version != SCHEMA_VERSION:
            self.execute(conn, "INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
                               "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (str(SCHEMA_VERSION),))

    def _version(self, conn: Any) -> int | None:
        """None for a database without our tables; 1 for one made before versions were kept."""
        if not self.has_table(conn, "turns"):
            return None
        row = self.rows(conn, "SELECT value FROM meta WHERE key = 'schema_version'") if self.has_table(
            conn, "meta") else []
        return int(row[0]["value"]) if row else 1


class SQLite(Database):
    """A file, WAL mode, `synchronous=FULL` (a committed turn survives power loss too)."""

    errors = (sqlite3.Error,)

    def __init__(self, path: Path):
        self.path = path

    def __str__(self) -> str:
        return str(self.path)

    def connect(self, readonly: bool = False) -> sqlite3.Connection:
        if readonly and not self.path.exists():
            raise RecordsError(f"no records database at {self.path}")
        if not readonly:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(self.path), timeout=10.0, isolation_level=None)  # explicit transactions
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA busy_timeout = 10000")
        if readonly:
            conn.execute("PRAGMA query_only = ON")
        else:
            self._wal(conn)
            conn.execute("PRAGMA synchronous = FULL")
        return conn

    def _wal(self, conn: sqlite3.Connection) -> None:
        """WAL mode (persistent, so once per file). Switching is not covered by busy_timeout: two
        processes opening a new file at once get "database is locked", so retry for as long."""
        deadline = time.monotonic() + 10.0
        while True:
            try:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                break
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        if mode.lower() != "wal":
            log.warning("records: %s is not in WAL mode (%s)", self.path, mode)

    def execute(self, conn: sqlite3.Connection, sql: str, args: Sequence = ()) -> sqlite3.Cursor:
        return conn.execute(sql, args)

    @contextlib.contextmanager
    def transaction(self, conn: sqlite3.Connection, lock: bool = False) -> Iterator[None]:
        conn.execute("BEGIN IMMEDIATE")  # the write lock at once: writers queue on busy_timeout, never deadlock
        try:
            yield
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def has_table(self, conn: sqlite3.Connection, name: str) -> bool:
        return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() \
            is not None


class Postgres(Database):
    """A server: one connection per writer, autocommit outside explicit transactions. A commit is
    durable as the server's `synchronous_commit` says (on by default: flushed to its WAL)."""

    MIGRATION_LOCK = 7_466_810_001  # pg_advisory_xact_lock key: one process migrates at a time
    tables = [sql.replace("id INTEGER PRIMARY KEY", "id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
              for sql in TABLES]

    def __init__(self, url: str):
        try:
            import psycopg
            from psycopg.conninfo import conninfo_to_dict
        except ImportError as err:
            raise RecordsError("records.url is a PostgreSQL URL but psycopg is not installed: "
                               "pip install 'diffusion-voice[postgres]'") from err
        self.psycopg = psycopg
        self.errors = (psycopg.Error,)
        try:
            self.params: dict[str, Any] = conninfo_to_dict(url)
        except psycopg.ProgrammingError as err:
            raise RecordsError(f"records.url is not a valid PostgreSQL URL: {err}") from err
        self.params.setdefault("connect_timeout", 10)
        self.params.setdefault("application_name", "voice records")

    def __str__(self) -> str:  # for logs: never the password
        p = self.params
        user = f"{p['user']}@" if p.get("user") else ""
        port = f":{p['port']}" if p.get("port") else ""
        return f"postgresql://{user}{p.get('host', '')}{port}/{p.get('dbname', '')}"

    def connect(self, readonly: bool = False) -> Any:
        from psycopg.rows import dict_row
        params = dict(self.params)
        if readonly:
            params["options"] = (params.get("options", "") + " -c default_transaction_read_only=on").strip()
        return self.psycopg.connect(autocommit=True, row_factory=dict_row, **params)

    def execute(self, conn: Any, sql: str, args: Sequence = ()) -> Any:
        return conn.execute(_placeholders(sql), args or None)

    @contextlib.contextmanager
    def transaction(self, conn: Any, lock: bool = False) -> Iterator[None]:
        with conn.transaction():
            if lock:
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (self.MIGRATION_LOCK,))
            yield

    def has_table(self, conn: Any, name: str) -> bool:
        return conn.execute("SELECT to_regclass(%s) IS NOT NULL AS found", (name,)).fetchone()["found"]

    def rows(self, conn: Any, sql: str, args: Sequence = ()) -> list[dict]:
        return self.execute(conn, sql, args).fetchall()  # dict_row

    def lost(self, conn: Any) -> bool:
        return bool(conn.closed or conn.broken)


@functools.lru_cache(maxsize=64)
def _placeholders(sql: str) -> str:
    """sqlite3's `?` as psycopg's `%s` (our statements have no `?` or `%` of their own)."""
    assert "%" not in sql, sql
    return sql.replace("?", "%s")


def open_database(where: str | Path) -> Database:
    """A `postgresql://` (or `postgres://`) URL, else the path of an SQLite file."""
    if isinstance(where, str) and where.startswith(("postgresql://", "postgres://")):
        return Postgres(where)
    return SQLite(Path(where).expanduser())
