"""Call records: every session and every turn, in an embedded SQLite database (the default) or
in PostgreSQL (`[records] url`, shared by several instances); voice/service/recordsdb.py has the schema
and the two dialects.

One writer thread per process owns the connection and drains a bounded queue of writes,
committing them in batches in the order they were queued. A turn that ends with a reply awaits
its own write (`Records.write`): the session sends `reply_done` and `latency` only once the
record is committed, so whatever a client was told is done survives a crash of the server
(docs/RELIABILITY.md). Everything else (sessions opening and closing, errors, turns that got no
reply) is queued without waiting; because the queue is FIFO, a committed turn also means every
earlier write of the process is committed. A lost PostgreSQL connection is reopened and the
batch retried (rows are keyed, so a retried turn is still one row); meanwhile waiting turns time
out as `record_failed`.

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
import threading
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from voice.service.recordsdb import TABLES, Op, RecordsError, open_database

if TYPE_CHECKING:
    from voice.conversation.latency import Metrics

log = logging.getLogger("voice.records")

SCHEMA = ";\n".join(TABLES) + ";\n"  # SQLite's rendering, for tests that build old databases
_STOP = object()


def init_db(database: str | Path) -> None:
    """Create the tables or migrate them (idempotent); raises RecordsError on an unusable database."""
    open_database(database).init()


class _Write:
    __slots__ = ("ops", "loop", "future")

    def __init__(self, ops: list[Op], loop: asyncio.AbstractEventLoop | None, future: asyncio.Future | None):
        self.ops, self.loop, self.future = ops, loop, future


class Records:
    """The process's one writer. `write` waits for the commit; `write_nowait` doesn't.
    `database`: the path of an SQLite file or a `postgresql://` URL."""

    def __init__(self, database: str | Path, queue_size: int = 1000, timeout_s: float = 5.0,
                 metrics: Metrics | None = None, probe_s: float = 5.0):
        self.db = open_database(database)
        self.timeout_s, self.probe_s = timeout_s, probe_s
        self.metrics = metrics
        self.db.init()
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.written = 0  # committed writes
        self.failed = 0  # writes that could not be committed (or queued), ever
        self.problem: str | None = None  # why the writer is unhealthy now (None: its last attempt succeeded)
        self.committing_since: float | None = None  # monotonic start of the commit in progress
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="records-writer", daemon=True)
        self.thread.start()
        log.info("call records in %s", self.db)

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

    def health(self) -> dict:
        """The writer's state now: `ok` unless its last write or probe failed, or a commit is stuck."""
        problem = self.problem
        since = self.committing_since
        if problem is None and since is not None and time.monotonic() - since > self.timeout_s:
            problem = f"a commit has been waiting for {time.monotonic() - since:.0f} s"
        body: dict[str, Any] = {"ok": problem is None, "written": self.written, "failed": self.failed}
        if problem is not None:
            body["error"] = problem
        return body

    def _failed(self, why: str) -> None:
        self.problem = why
        self.failed += 1
        if self.metrics is not None:
            self.metrics.records_failed.inc()
        log.error("records: %s (%d failed writes so far)", why, self.failed)

    # --- the writer thread ----------------------------------------------------------------------

    def _run(self) -> None:
        conn = None
        stop = False
        try:
            while not stop:
                try:  # idle while unhealthy: probe the database, so that health comes back without a write
                    first = self.queue.get(timeout=self.probe_s if self.problem is not None else None)
                except queue.Empty:
                    conn = self._probe(conn)
                    continue
                batch = [first]
                while len(batch) < 200:  # what piled up while we committed the last batch
                    try:
                        batch.append(self.queue.get_nowait())
                    except queue.Empty:
                        break
                if _STOP in batch:
                    stop = True
                    batch = [w for w in batch if w is not _STOP]
                self.committing_since = time.monotonic()
                try:
                    conn = self._commit(conn, batch)
                finally:
                    self.committing_since = None
        finally:
            if conn is not None:
                conn.close()

    def _commit(self, conn: Any, batch: list[_Write]) -> Any:
        """Commit `batch`, resolve its futures; returns the connection (reopened if it was lost)."""
        if not batch:
            return conn
        while True:
            if conn is None:
                conn = self._connect()
                if conn is None:
                    results = [False] * len(batch)
                    break
            try:
                results = self._apply(conn, batch)
                break
            except self.db.errors as err:  # the connection is gone: reopen it, retry the batch
                log.error("records: lost the connection to %s (%s); reconnecting", self.db, err)
                conn.close()
                conn = None
        if any(results):
            self.problem = None  # committed: healthy again, whatever failed before
        for w, ok in zip(batch, results):
            if ok:
                self.written += 1
            else:
                self._failed("a write was rejected by the database")
            if w.future is not None:
                assert w.loop is not None  # given with the future
                try:
                    w.loop.call_soon_threadsafe(_resolve, w.future, ok)
                except RuntimeError:  # the loop is gone (shutdown)
                    pass
        return conn

    def _probe(self, conn: Any) -> Any:
        """`SELECT 1` on the connection (opened if need be, once): success clears the problem."""
        try:
            if conn is None:
                conn = self.db.connect()
            self.db.rows(conn, "SELECT 1 AS one")
            self.problem = None
            log.info("records: %s answers again", self.db)
        except self.db.errors as err:
            self.problem = f"{self.db} does not answer: {err}"
            if conn is not None and self.db.lost(conn):
                conn.close()
                conn = None
        return conn

    def _apply(self, conn: Any, batch: list[_Write]) -> list[bool]:
        """One transaction for the batch; if it fails, one per write to find the culprit. Raises
        only when the connection was lost."""
        try:
            self.db.run(conn, [op for w in batch for op in w.ops])
            return [True] * len(batch)
        except self.db.errors as err:
            if self.db.lost(conn):
                raise
            log.error("records: batch of %d writes failed (%s); retrying one by one", len(batch), err)
        results = []
        for w in batch:
            try:
                self.db.run(conn, w.ops)
                results.append(True)
            except self.db.errors as one:
                if self.db.lost(conn):
                    raise
                log.error("records: write failed: %s", one)
                results.append(False)
        return results

    def _connect(self) -> Any:
        """A connection, retried with backoff while the database is unreachable; None once the
        records are closing and it still is."""
        delay, attempt = 0.1, 0
        while True:
            attempt += 1
            try:
                conn = self.db.connect()
                if attempt > 1:
                    log.warning("records: connected to %s again after %d attempts", self.db, attempt)
                return conn
            except self.db.errors as err:
                self.problem = f"cannot connect to {self.db}: {err}"
                if self.closed:
                    log.error("records: %s is unreachable (%s) and the records are closing", self.db, err)
                    return None
                if attempt == 1:
                    log.error("records: cannot connect to %s (%s); retrying", self.db, err)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)


def _resolve(future: asyncio.Future, ok: bool) -> None:
    if not future.done():
        future.set_result(ok)


# --- what gets written ---------------------------------------------------------------------------

def session_opened(uid: str, session_id: str, transport: str, principal: str, peer: str, started: float,
                   meta: dict) -> list[Op]:
    return [("INSERT INTO sessions (uid, session_id, transport, principal, peer, started, meta) "
             "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (uid) DO UPDATE SET session_id = excluded.session_id, "
             "transport = excluded.transport, principal = excluded.principal, peer = excluded.peer, "
             "started = excluded.started, meta = excluded.meta",
             (uid, session_id, transport, principal, peer, started, json.dumps(meta, default=str)))]


def session_closed(uid: str, ended: float, reason: str, turns: int, dtmf: str = "") -> list[Op]:
    return [("UPDATE sessions SET ended = ?, end_reason = ?, turns = ?, dtmf = ? WHERE uid = ?",
             (ended, reason, turns, dtmf, uid))]


def turn_done(uid: str, turn: int, started: float | None, ended: float, status: str, transcript: str, reply: str,
              heard: str, interrupted: bool, apology: bool, latency: dict | None, errors: list[dict],
              tools: list[dict] | None = None) -> list[Op]:
    """The turn's one row (a retried write replaces it: rows are keyed by session and turn)."""
    return [("INSERT INTO turns (session_uid, turn, started, ended, status, transcript, reply, heard, "
             "interrupted, apology, latency, errors, tools) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
             "ON CONFLICT (session_uid, turn) DO UPDATE SET started = excluded.started, ended = excluded.ended, "
             "status = excluded.status, transcript = excluded.transcript, reply = excluded.reply, "
             "heard = excluded.heard, interrupted = excluded.interrupted, apology = excluded.apology, "
             "latency = excluded.latency, errors = excluded.errors, tools = excluded.tools",
             (uid, turn, started, ended, status, transcript, reply, heard, int(interrupted), int(apology),
              json.dumps(latency or {}), json.dumps(errors), json.dumps(tools or [], ensure_ascii=False)))]


def error(uid: str, turn: int, at: float, code: str, message: str) -> list[Op]:
    return [("INSERT INTO errors (session_uid, turn, at, code, message) VALUES (?, ?, ?, ?, ?)",
             (uid, turn, at, code, message[:2000]))]


# --- reading (voice records) ---------------------------------------------------------------------

def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


def read_sessions(database: str | Path, session: str = "", limit: int = 20) -> list[dict]:
    """The `limit` most recent sessions (or those whose id or uid is `session`), oldest first,
    each with its turns and errors. `database`: an SQLite path or a `postgresql://` URL."""
    db = open_database(database)
    try:
        conn = db.connect(readonly=True)
    except db.errors as err:
        raise RecordsError(f"cannot open the call records in {db}: {err}") from err
    try:
        if session:
            rows = db.rows(conn, "SELECT * FROM sessions WHERE session_id = ? OR uid = ? ORDER BY started DESC "
                                 "LIMIT ?", (session, session, limit))
        else:
            rows = db.rows(conn, "SELECT * FROM sessions ORDER BY started DESC LIMIT ?", (limit,))
        out = []
        for s in reversed(rows):
            s["turn_count"] = s.pop("turns")
            s["meta"] = json.loads(s["meta"] or "{}")
            s["started_at"], s["ended_at"] = _iso(s["started"]), _iso(s["ended"])
            s["turns"] = []
            for t in db.rows(conn, "SELECT * FROM turns WHERE session_uid = ? ORDER BY turn", (s["uid"],)):
                t.pop("session_uid")
                t["interrupted"], t["apology"] = bool(t["interrupted"]), bool(t["apology"])
                t["latency"], t["errors"], t["tools"] = (json.loads(t["latency"]), json.loads(t["errors"]),
                                                         json.loads(t["tools"]))
                s["turns"].append(t)
            s["errors"] = db.rows(conn, "SELECT turn, at, code, message FROM errors WHERE session_uid = ? ORDER BY id",
                                  (s["uid"],))
            out.append(s)
        return out
    except db.errors as err:
        raise RecordsError(f"cannot read the call records in {db}: {err}") from err
    finally:
        conn.close()


CSV_FIELDS = ["session_id", "uid", "transport", "principal", "peer", "session_started", "end_reason", "dtmf", "turn",
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
                "end_reason": s["end_reason"] or "", "dtmf": s["dtmf"]}
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
