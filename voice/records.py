"""Call records: every session and every turn, in an embedded SQLite database.

One writer thread per process owns the connection (WAL mode, `synchronous=FULL`) and drains
a bounded queue of writes, committing them in batches in the order they were queued. A turn
that ends with a reply awaits its own write (`Records.write`): the session sends `reply_done`
and `latency` only once the record is committed, so whatever a client was told is done
survives a crash of the server (docs/RELIABILITY.md). Everything else (sessions opening and
closing, errors, turns that got no reply) is queued without waiting; because the queue is
FIFO, a committed turn also means every earlier write of the process is committed.

Tables: `sessions` (one row per session, keyed by `uid`: session ids like `s7` restart with
every process), `turns` (one row per user turn) and `errors`. `voice records` reads them.
Audio is never recorded.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger("voice.records")

SCHEMA_VERSION = 2  # 2: turns.tools
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    uid TEXT PRIMARY KEY,           -- unique over processes
    session_id TEXT NOT NULL,       -- what the client saw (ready.session_id); restarts at s1 per process
    transport TEXT NOT NULL,        -- native | twilio | sip
    principal TEXT NOT NULL DEFAULT '',  -- API key name, "twilio", "sip:ADDR", "anonymous"
    peer TEXT NOT NULL DEFAULT '',
    started REAL NOT NULL,          -- unix time
    ended REAL,
    end_reason TEXT,
    turns INTEGER NOT NULL DEFAULT 0,
    meta TEXT NOT NULL DEFAULT '{}' -- JSON: rates, lm_mode, Twilio callSid...
);
CREATE INDEX IF NOT EXISTS sessions_by_id ON sessions (session_id);
CREATE INDEX IF NOT EXISTS sessions_by_start ON sessions (started);
CREATE TABLE IF NOT EXISTS turns (
    session_uid TEXT NOT NULL,
    turn INTEGER NOT NULL,
    started REAL,                   -- unix time the user started speaking
    ended REAL NOT NULL,            -- unix time the turn ended (reply done)
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
);
CREATE TABLE IF NOT EXISTS errors (
    id INTEGER PRIMARY KEY,
    session_uid TEXT NOT NULL,
    turn INTEGER NOT NULL,
    at REAL NOT NULL,
    code TEXT NOT NULL,
    message TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS errors_by_session ON errors (session_uid);
"""

_STOP = object()
Op = tuple[str, tuple]


def connect(path: str | Path, readonly: bool = False) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=10.0, isolation_level=None)  # explicit transactions
    conn.execute("PRAGMA busy_timeout = 10000")
    if readonly:
        conn.execute("PRAGMA query_only = ON")
    return conn


def init_db(path: Path) -> None:
    """Create the database and tables (idempotent); raises on an unusable path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = connect(path)
    try:
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode.lower() != "wal":
            log.warning("records: %s is not in WAL mode (%s)", path, mode)
        conn.executescript(SCHEMA)
        if "tools" not in {row[1] for row in conn.execute("PRAGMA table_info(turns)")}:  # a version 1 database
            conn.execute("ALTER TABLE turns ADD COLUMN tools TEXT NOT NULL DEFAULT '[]'")
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    finally:
        conn.close()


class _Write:
    __slots__ = ("ops", "loop", "future")

    def __init__(self, ops: list[Op], loop: asyncio.AbstractEventLoop | None, future: asyncio.Future | None):
        self.ops, self.loop, self.future = ops, loop, future


class Records:
    """The process's one writer. `write` waits for the commit; `write_nowait` doesn't."""

    def __init__(self, path: str | Path, queue_size: int = 1000, timeout_s: float = 5.0, metrics=None):
        self.path = Path(path).expanduser()
        self.timeout_s = timeout_s
        self.metrics = metrics
        init_db(self.path)
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.written = 0  # committed writes
        self.failed = 0  # writes that could not be committed (or queued)
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="records-writer", daemon=True)
        self.thread.start()
        log.info("call records in %s", self.path)

    # --- the API the session uses ---------------------------------------------------------------

    async def write(self, ops: list[Op]) -> bool:
        """Queue `ops` as one transaction and wait until it is committed; False if it wasn't in time."""
        if self.closed:
            return False
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        item = _Write(ops, loop, future)
        deadline = time.monotonic() + self.timeout_s
        while True:  # a full queue: wait for room (the bounded queue pushes back on the sessions)
            try:
                self.queue.put_nowait(item)
                break
            except queue.Full:
                if time.monotonic() > deadline:
                    self._failed("the records queue stayed full")
                    return False
                await asyncio.sleep(0.01)
        try:  # shielded: once queued, the write happens even if the waiting turn is cancelled
            return await asyncio.wait_for(asyncio.shield(future), max(deadline - time.monotonic(), 0.01))
        except asyncio.TimeoutError:
            self._failed(f"no commit within {self.timeout_s:.1f} s")
            return False

    def write_nowait(self, ops: list[Op]) -> None:
        if self.closed:
            return
        try:
            self.queue.put_nowait(_Write(ops, None, None))
        except queue.Full:
            self._failed("the records queue is full; a write was dropped")

    def close(self, timeout: float = 10.0) -> None:
        """Commit whatever is queued, then stop the writer."""
        if self.closed:
            return
        self.closed = True
        try:
            self.queue.put(_STOP, timeout=timeout)
        except queue.Full:
            log.error("records: the queue did not drain on close; pending writes are lost")
            return
        self.thread.join(timeout)

    def _failed(self, why: str) -> None:
        self.failed += 1
        if self.metrics is not None:
            self.metrics.records_failed.inc()
        log.error("records: %s (%d failed writes so far)", why, self.failed)

    # --- the writer thread ----------------------------------------------------------------------

    def _run(self) -> None:
        conn = connect(self.path)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = FULL")  # a committed turn survives power loss too
        stop = False
        try:
            while not stop:
                batch = [self.queue.get()]
                while len(batch) < 200:  # what piled up while we committed the last batch
                    try:
                        batch.append(self.queue.get_nowait())
                    except queue.Empty:
                        break
                if _STOP in batch:
                    stop = True
                    batch = [w for w in batch if w is not _STOP]
                self._commit(conn, batch)
        finally:
            conn.close()

    def _commit(self, conn: sqlite3.Connection, batch: list[_Write]) -> None:
        if not batch:
            return
        try:
            self._transaction(conn, [op for w in batch for op in w.ops])
            results = [True] * len(batch)
        except sqlite3.Error as err:  # find the culprit: one transaction per write
            log.error("records: batch of %d writes failed (%s); retrying one by one", len(batch), err)
            results = []
            for w in batch:
                try:
                    self._transaction(conn, w.ops)
                    results.append(True)
                except sqlite3.Error as one:
                    log.error("records: write failed: %s", one)
                    results.append(False)
        for w, ok in zip(batch, results):
            if ok:
                self.written += 1
            else:
                self._failed("a write was rejected by SQLite")
            if w.future is not None:
                assert w.loop is not None  # given with the future
                try:
                    w.loop.call_soon_threadsafe(_resolve, w.future, ok)
                except RuntimeError:  # the loop is gone (shutdown)
                    pass

    @staticmethod
    def _transaction(conn: sqlite3.Connection, ops: list[Op]) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for sql, args in ops:
                conn.execute(sql, args)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


def _resolve(future: asyncio.Future, ok: bool) -> None:
    if not future.done():
        future.set_result(ok)


# --- what gets written ---------------------------------------------------------------------------

def session_opened(uid: str, session_id: str, transport: str, principal: str, peer: str, started: float,
                   meta: dict) -> list[Op]:
    return [("INSERT OR REPLACE INTO sessions (uid, session_id, transport, principal, peer, started, meta) "
             "VALUES (?, ?, ?, ?, ?, ?, ?)",
             (uid, session_id, transport, principal, peer, started, json.dumps(meta, default=str)))]


def session_closed(uid: str, ended: float, reason: str, turns: int, meta: dict | None = None) -> list[Op]:
    ops: list[Op] = [("UPDATE sessions SET ended = ?, end_reason = ?, turns = ? WHERE uid = ?",
                      (ended, reason, turns, uid))]
    if meta:
        ops.append(("UPDATE sessions SET meta = json_patch(meta, ?) WHERE uid = ?",
                    (json.dumps(meta, default=str), uid)))
    return ops


def turn_done(uid: str, turn: int, started: float | None, ended: float, status: str, transcript: str, reply: str,
              heard: str, interrupted: bool, apology: bool, latency: dict | None, errors: list[dict],
              tools: list[dict] | None = None) -> list[Op]:
    return [("INSERT OR REPLACE INTO turns (session_uid, turn, started, ended, status, transcript, reply, heard, "
             "interrupted, apology, latency, errors, tools) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
             (uid, turn, started, ended, status, transcript, reply, heard, int(interrupted), int(apology),
              json.dumps(latency or {}), json.dumps(errors), json.dumps(tools or [], ensure_ascii=False)))]


def error(uid: str, turn: int, at: float, code: str, message: str) -> list[Op]:
    return [("INSERT INTO errors (session_uid, turn, at, code, message) VALUES (?, ?, ?, ?, ?)",
             (uid, turn, at, code, message[:2000]))]


# --- reading (voice records) ---------------------------------------------------------------------

def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


def read_sessions(path: str | Path, session: str = "", limit: int = 20) -> list[dict]:
    """The `limit` most recent sessions (or those whose id or uid is `session`), oldest first,
    each with its turns and errors."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no records database at {path}")
    conn = connect(path, readonly=True)
    conn.row_factory = sqlite3.Row
    try:
        if session:
            rows = conn.execute("SELECT * FROM sessions WHERE session_id = ? OR uid = ? ORDER BY started DESC "
                                "LIMIT ?", (session, session, limit)).fetchall()
        else:
            rows = conn.execute("SELECT * FROM sessions ORDER BY started DESC LIMIT ?", (limit,)).fetchall()
        out = []
        for row in reversed(rows):
            s = dict(row)
            s["turn_count"] = s.pop("turns")
            s["meta"] = json.loads(s["meta"] or "{}")
            s["started_at"], s["ended_at"] = _iso(s["started"]), _iso(s["ended"])
            turns = conn.execute("SELECT * FROM turns WHERE session_uid = ? ORDER BY turn", (s["uid"],)).fetchall()
            s["turns"] = []
            for t in turns:
                t = dict(t)
                t.pop("session_uid")
                t["interrupted"], t["apology"] = bool(t["interrupted"]), bool(t["apology"])
                t["latency"], t["errors"], t["tools"] = (json.loads(t["latency"]), json.loads(t["errors"]),
                                                         json.loads(t["tools"]))
                s["turns"].append(t)
            s["errors"] = [dict(e) for e in conn.execute(
                "SELECT turn, at, code, message FROM errors WHERE session_uid = ? ORDER BY id", (s["uid"],))]
            out.append(s)
        return out
    finally:
        conn.close()


CSV_FIELDS = ["session_id", "uid", "transport", "principal", "peer", "session_started", "end_reason", "turn",
              "turn_ended", "status", "transcript", "reply", "heard", "interrupted", "apology",
              "voice_to_voice_ms", "over_budget", "errors", "tools"]


def to_csv(sessions: Iterable[dict]) -> str:
    """One row per turn (sessions without turns get one row with an empty turn)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    w.writeheader()
    for s in sessions:
        base = {"session_id": s["session_id"], "uid": s["uid"], "transport": s["transport"],
                "principal": s["principal"], "peer": s["peer"], "session_started": s["started_at"],
                "end_reason": s["end_reason"] or ""}
        if not s["turns"]:
            w.writerow(base)
        for t in s["turns"]:
            w.writerow({**base, "turn": t["turn"], "turn_ended": _iso(t["ended"]), "status": t["status"],
                        "transcript": t["transcript"], "reply": t["reply"], "heard": t["heard"],
                        "interrupted": int(t["interrupted"]), "apology": int(t["apology"]),
                        "voice_to_voice_ms": (t["latency"] or {}).get("voice_to_voice_ms"),
                        "over_budget": " ".join((t["latency"] or {}).get("over_budget", [])),
                        "errors": " ".join(e["code"] for e in t["errors"]),
                        "tools": " ".join(f"{c['name']}:{c['status']}" for c in t["tools"])})
    return buf.getvalue()
