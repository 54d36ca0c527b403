"""Call records (voice/service/records.py): committed before a turn is reported done, survive a crash.

The writer, `voice records` and the session tests run on both databases: an SQLite file, and a
real PostgreSQL (Debian's `postgresql`, a throwaway server from tests/postgres.py; those cases
are marked `live`, and skip locally / fail under VOICE_CI=1 without it).

* the writer: FIFO commits, a committed turn readable from another connection the moment its
  write returns, a locked database that times turns out instead of hanging them, a queue that
  pushes back, schema migrations from version 1, several processes creating the tables at once,
  `voice records` (JSON and CSV);
* PostgreSQL only: a killed connection is reopened and the turn still committed; a server that
  goes away makes turns time out, and what was queued lands once it is back;
* the session (stand-in models): the record of a turn is in the database the moment its
  `reply_done` arrives; barge-in, apology and no-speech turns are recorded as such;
* the real thing: `voice serve` as a subprocess with a temporary database, one turn over the
  websocket, SIGKILL as soon as `reply_done` arrives, then a restart on the same database and
  `voice records --format json`: the turn is there. The restarted server then gets SIGTERM
  mid-reply: the turn finishes, the client gets `shutting_down` and close 1001, and the
  records say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from fakes import LiveServer, fake_instance, make_config, speech
from voice.service import records as rec
from voice.config import RecordsConfig
from voice.conversation.latency import Metrics
from voice.service.recordsdb import SCHEMA_VERSION, RecordsError, open_database

ROOT = Path(__file__).resolve().parents[1]
VOICE = [sys.executable, "-m", "voice.cli"]
FRAME = 640

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]


class Store:
    """One test's database, seen from outside the writer: its own connections, as another process's."""

    def __init__(self, kind: str, database: str):
        self.kind, self.database = kind, database

    def query(self, sql: str, args: tuple = ()) -> list[dict]:
        """Rows as dicts, through a new connection (`?` placeholders)."""
        db = open_database(self.database)
        conn = db.connect(readonly=True)
        try:
            return db.rows(conn, sql, args)
        finally:
            conn.close()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Another connection holds the write lock until the block ends."""
        if self.kind == "sqlite":
            blocker = sqlite3.connect(self.database, isolation_level=None, timeout=0)
            blocker.execute("BEGIN EXCLUSIVE")
        else:
            import psycopg
            blocker = psycopg.connect(self.database, autocommit=True)
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE sessions, turns, errors IN ACCESS EXCLUSIVE MODE")
        try:
            yield
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()

    def cli(self) -> list[str]:
        return ["--db", self.database] if self.kind == "sqlite" else ["--url", self.database]

    def config_toml(self) -> str:
        key = "path" if self.kind == "sqlite" else "url"
        return f'[records]\n{key} = "{self.database}"\n'


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.live)])
def store(request, tmp_path) -> Store:
    if request.param == "sqlite":
        return Store("sqlite", str(tmp_path / "r.sqlite3"))
    return Store("postgresql", request.getfixturevalue("postgres_url"))


def voice_records(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(VOICE + ["records", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def a_turn(uid: str, turn: int, transcript: str = "t") -> list:
    return rec.turn_done(uid, turn, 1.0, 2.0, "ok", transcript, "r", "r", False, False, {"voice_to_voice_ms": 5.0}, [])


# --- the writer --------------------------------------------------------------------------------

def test_writes_commit_in_order_and_close_drains(store):
    records = rec.Records(store.database, queue_size=100, timeout_s=5)

    async def scenario():
        records.write_nowait(rec.session_opened("u1", "s1", "native", "anonymous", "", 1.0, {}))
        for turn in range(1, 6):
            records.write_nowait(rec.error("u1", turn, 2.0, "bad_frame", "odd"))
            ok = await records.write(a_turn("u1", turn, f"t{turn}"))
            assert ok
            # committed: visible to another connection right now, with everything queued before it
            assert store.query("SELECT count(*) AS n FROM turns")[0]["n"] == turn
            assert store.query("SELECT count(*) AS n FROM errors")[0]["n"] == turn
        records.write_nowait(rec.session_closed("u1", 3.0, "disconnect", 5))

    asyncio.run(scenario())
    records.close()
    assert records.written == 12 and records.failed == 0
    if store.kind == "sqlite":
        with sqlite3.connect(store.database) as c:
            assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    [s] = rec.read_sessions(store.database)
    assert s["end_reason"] == "disconnect" and s["turn_count"] == 5 and [t["transcript"] for t in s["turns"]] == [
        "t1", "t2", "t3", "t4", "t5"]
    assert len(s["errors"]) == 5 and s["turns"][0]["latency"] == {"voice_to_voice_ms": 5.0}
    assert s["started"] == 1.0 and isinstance(s["turns"][0]["turn"], int)


def test_a_rewritten_turn_is_still_one_row(store):
    records = rec.Records(store.database)

    async def twice():
        assert await records.write(a_turn("u", 1, "first"))
        assert await records.write(a_turn("u", 1, "again"))
    asyncio.run(twice())
    records.close()
    assert store.query("SELECT transcript FROM turns") == [{"transcript": "again"}]


def test_a_turn_with_any_text_is_recorded_alike_in_both_dialects(store):
    """A Realtime `input_text` with `\\u0000` lost its turn on PostgreSQL ("text fields cannot contain
    NUL (0x00) bytes": `record_failed`, 0 rows); a lone surrogate failed on both. Each is stored as
    U+FFFD now, the same in SQLite and PostgreSQL, and the rest of the text kept."""
    records = rec.Records(store.database)
    hostile = "say\x00hi \ud800 there"

    async def scenario():
        records.write_nowait(rec.session_opened("u1", "s\x001", "realtime", "anonymous", "", 1.0, {"x": "a\x00b"}))
        ok = await records.write(rec.turn_done("u1", 1, 1.0, 2.0, "ok", hostile, "r\x00", "r\x00", False, False, {},
                                               [{"code": "x\x00", "message": hostile}]))
        assert ok
        assert await records.write(rec.error("u1", 1, 2.0, "bad\x00", hostile))

    asyncio.run(scenario())
    records.close()
    assert records.failed == 0
    [turn] = store.query("SELECT transcript, reply, heard FROM turns")
    assert turn == {"transcript": "say\ufffdhi \ufffd there", "reply": "r\ufffd", "heard": "r\ufffd"}
    assert store.query("SELECT session_id FROM sessions") == [{"session_id": "s\ufffd1"}]
    assert {r["message"] for r in store.query("SELECT message FROM errors")} == {"say\ufffdhi \ufffd there"}


def test_a_stuck_database_times_turns_out_and_the_queue_pushes_back(store):
    metrics = Metrics()
    records = rec.Records(store.database, queue_size=2, timeout_s=0.5, metrics=metrics)

    async def scenario():
        t0 = time.monotonic()
        ok = await records.write(rec.turn_done("u", 1, 1.0, 2.0, "ok", "a", "b", "b", False, False, None, []))
        waited = time.monotonic() - t0
        for i in range(10):  # the writer is stuck on the first write: the queue fills, extra writes are dropped
            records.write_nowait(rec.error("u", 1, 1.0, "x", str(i)))
        return ok, waited

    with store.locked():  # another process holds the write lock
        ok, waited = asyncio.run(scenario())
        assert ok is False and 0.4 < waited < 3.0  # the turn was told "not recorded" in time, not hung
        assert records.failed >= 8 and metrics.records_failed._value.get() >= 8

    async def later():
        return await records.write(rec.turn_done("u", 2, 1.0, 2.0, "ok", "c", "d", "d", False, False, None, []))

    deadline = time.monotonic() + 20
    while not asyncio.run(later()):  # the writer gets through its backlog and recovers
        assert time.monotonic() < deadline
    records.close()
    assert store.query("SELECT transcript FROM turns WHERE turn = 2") == [{"transcript": "c"}]


def test_health_is_the_writers_state_now_not_its_failure_count(store):
    """Issue 41, item 1: one stretch of failed writes made /healthz "degraded" until a restart.
    Health follows the writer: unhealthy while the database is stuck, healthy once it commits again,
    or once its probe gets through when no write comes; `failed` keeps counting."""
    from starlette.testclient import TestClient

    from voice.service.server import build_app
    config = make_config()
    instance = fake_instance(config)
    records = instance.records = rec.Records(store.database, timeout_s=0.3, probe_s=0.2)
    client = TestClient(build_app(config, instance))

    def health() -> dict:
        response = client.get("/healthz")
        assert response.status_code == 200
        return response.json()

    assert health()["status"] == "ok" and health()["records"]["ok"] is True
    with store.locked():
        assert asyncio.run(records.write(a_turn("u", 1))) is False
        h = health()
        assert h["status"] == "degraded" and h["records"]["ok"] is False and h["records"]["failed"] == 1
    deadline = time.monotonic() + 20  # the lock is gone: the queued turn commits, health is back
    while health()["status"] != "ok":
        assert time.monotonic() < deadline, health()
        time.sleep(0.05)
    assert health()["records"] == {"ok": True, "written": 1, "failed": 1}
    # a write the database rejects, and then no write at all: the idle writer's probe restores health
    assert asyncio.run(records.write([("INSERT INTO nowhere VALUES (1)", ())])) is False
    assert health()["records"]["ok"] is False
    deadline = time.monotonic() + 10
    while not health()["records"]["ok"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert health()["records"]["failed"] == 2 and health()["status"] == "ok"
    records.close()


def test_a_first_version_database_is_migrated(store):
    db = open_database(store.database)
    conn = db.connect()
    with db.transaction(conn):  # version 1: no turns.tools, no sessions.dtmf
        for sql in db.tables:
            db.execute(conn, re.sub(r"\n\s*(tools|dtmf) TEXT[^\n]*", "", sql))
        db.execute(conn, "INSERT INTO meta (key, value) VALUES ('schema_version', '1')")
        db.execute(conn, "INSERT INTO sessions (uid, session_id, transport, started) VALUES ('u', 's1', 'native', 1.0)")
        db.execute(conn, "INSERT INTO turns (session_uid, turn, ended, status) VALUES ('u', 1, 2.0, 'ok')")
    conn.close()

    records = rec.Records(store.database)
    tools = [{"id": "c1", "name": "get_time", "arguments": {}, "result": "noon", "status": "ok", "ms": 3}]
    assert asyncio.run(records.write(rec.turn_done("u", 2, 1.0, 3.0, "ok", "what time", "Noon.", "Noon.", False,
                                                   False, None, [], tools)))
    records.close()
    [s] = rec.read_sessions(store.database)
    assert [t["tools"] for t in s["turns"]] == [[], tools]
    assert store.query("SELECT value FROM meta WHERE key = 'schema_version'") == [{"value": str(SCHEMA_VERSION)}]
    rec.init_db(store.database)  # again: nothing to do
    assert len(rec.read_sessions(store.database)[0]["turns"]) == 2


def test_a_database_of_a_newer_version_is_refused(store):
    rec.init_db(store.database)
    db = open_database(store.database)
    conn = db.connect()
    with db.transaction(conn):
        db.execute(conn, "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    conn.close()
    with pytest.raises(RecordsError, match=f"schema version {SCHEMA_VERSION + 1}, newer"):
        rec.Records(store.database)


def test_several_processes_create_the_tables_at_once(store):
    failures: list[BaseException] = []
    start = threading.Barrier(4)

    def create():
        start.wait()
        try:
            rec.init_db(store.database)
        except BaseException as err:  # noqa: BLE001 - collected and asserted below
            failures.append(err)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failures == []
    assert store.query("SELECT value FROM meta") == [{"value": str(SCHEMA_VERSION)}]


def test_voice_records_lists_and_exports(store, tmp_path):
    records = rec.Records(store.database)

    async def fill():
        for n in (1, 2):
            records.write_nowait(rec.session_opened(f"u{n}", f"s{n}", "twilio" if n == 2 else "native", "alice",
                                                    "1.2.3.4:5", 1000.0 + n, {"callSid": "CA1"} if n == 2 else {}))
            await records.write(rec.turn_done(f"u{n}", 1, 1000.0, 1001.0, "ok", "hello, there", "Hi \"you\".",
                                              "Hi", True, False, {"voice_to_voice_ms": 812.5,
                                                                  "over_budget": ["asr"]},
                                              [{"code": "bad_frame", "message": "odd"}]))
        await records.write(rec.session_closed("u2", 1010.0, "transfer:desk", 1, "12#"))  # a call: how it ended, keys
    asyncio.run(fill())
    records.close()
    out = voice_records(*store.cli())
    assert out.returncode == 0, out.stderr
    sessions = json.loads(out.stdout)
    assert [s["session_id"] for s in sessions] == ["s1", "s2"]  # oldest first
    assert sessions[1]["meta"] == {"callSid": "CA1"} and sessions[1]["turns"][0]["heard"] == "Hi"
    assert sessions[1]["started_at"] == "1970-01-01T00:16:42.000+00:00"
    assert (sessions[1]["end_reason"], sessions[1]["dtmf"], sessions[0]["dtmf"]) == ("transfer:desk", "12#", "")
    only = json.loads(voice_records(*store.cli(), "--session", "s2").stdout)
    assert [s["uid"] for s in only] == ["u2"]
    assert [s["uid"] for s in json.loads(voice_records(*store.cli(), "--session", "u1").stdout)] == ["u1"]
    assert [s["uid"] for s in json.loads(voice_records(*store.cli(), "--limit", "1").stdout)] == ["u2"]
    csv_out = voice_records(*store.cli(), "--format", "csv").stdout.splitlines()
    assert csv_out[0].startswith("session_id,uid,transport") and len(csv_out) == 3
    assert '"Hi ""you""."' in csv_out[1] and "812.5" in csv_out[1] and "bad_frame" in csv_out[1]
    assert ",transfer:desk,12#,1," in csv_out[2]
    config = tmp_path / "voice.toml"  # the database the config names
    config.write_text(store.config_toml())
    from_config = voice_records("--config", str(config))
    assert from_config.returncode == 0 and json.loads(from_config.stdout) == sessions, from_config.stderr
    if store.kind == "sqlite":
        missing = voice_records("--db", str(tmp_path / "nope.sqlite3"))
        assert missing.returncode == 1 and "no records database" in missing.stderr
    else:
        missing = voice_records("--url", store.database.rsplit("/", 1)[0] + "/nope")
        assert missing.returncode == 1 and 'database "nope" does not exist' in missing.stderr, missing.stderr
        assert voice_records("--url", "mysql://x/y").returncode == 2


def test_the_records_url_must_be_postgresql():
    with pytest.raises(ValueError, match="postgresql://"):
        RecordsConfig(url="mysql://u@h/db")
    assert RecordsConfig(url="postgresql://u@h/db").database == "postgresql://u@h/db"
    assert RecordsConfig(path="").database == ""  # records off


# --- PostgreSQL: the connection and the server can go away -------------------------------------

@pytest.mark.live
def test_a_killed_connection_is_reopened_and_the_turn_committed(postgres_url):
    import psycopg
    records = rec.Records(postgres_url, timeout_s=10)
    assert asyncio.run(records.write(a_turn("u", 1)))
    with psycopg.connect(postgres_url, autocommit=True) as admin:  # the writer's backend dies (as on a failover)
        killed = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                               "WHERE application_name = 'voice records' AND pid <> pg_backend_pid()").fetchall()
    assert killed == [(True,)]
    assert asyncio.run(records.write(a_turn("u", 2)))
    records.close()
    turns = Store("postgresql", postgres_url).query("SELECT turn FROM turns ORDER BY turn")
    assert records.failed == 0 and [t["turn"] for t in turns] == [1, 2]


@pytest.mark.live
def test_a_server_that_goes_away_times_turns_out_and_queued_writes_land_when_it_is_back(require_system):
    from postgres import PostgresServer, binaries
    require_system(binaries(), "PostgreSQL's initdb/postgres are not installed (apt-get install postgresql)")
    with PostgresServer() as pg:
        url = pg.create_database("records")
        records = rec.Records(url, timeout_s=1.0)
        assert asyncio.run(records.write(a_turn("u", 1)))
        pg.stop()
        t0 = time.monotonic()
        assert asyncio.run(records.write(a_turn("u", 2))) is False  # told "not recorded", in time
        assert time.monotonic() - t0 < 3.0
        pg.start()
        deadline = time.monotonic() + 30
        while not asyncio.run(records.write(a_turn("u", 3))):
            assert time.monotonic() < deadline
        records.close()
        turns = Store("postgresql", url).query("SELECT turn FROM turns ORDER BY turn")
    assert [t["turn"] for t in turns] == [1, 2, 3]  # turn 2 was queued and committed once the server was back


# --- the session (stand-in models) ------------------------------------------------------------

def test_turns_are_committed_before_reply_done_arrives(store):
    config = make_config(records={"path": store.database} if store.kind == "sqlite" else {"url": store.database},
                         limits={"outbox_audio_s": 60.0})
    instance = fake_instance(config)

    def row(turn: int):
        rows = store.query("SELECT * FROM turns WHERE turn = ?", (turn,))
        return rows[0] if rows else None

    async def scenario():
        rows = {}
        async with websockets.connect(f"ws://127.0.0.1:{srv.port}/ws", max_size=None) as ws:
            await ws.send(json.dumps({"type": "start", "sample_rate": 16000}))
            queue: list[bytes] = []

            async def mic():
                while True:
                    await ws.send(queue.pop(0) if queue else bytes(FRAME))
                    await asyncio.sleep(0.02 / 3)

            def say(name):
                pcm = speech(name)
                queue.extend(pcm[i:i + FRAME] for i in range(0, len(pcm), FRAME))

            m = asyncio.create_task(mic())
            say("001.wav")  # turn 1: a normal reply
            seen: list[dict] = []
            plan = {1: "normal", 2: "interrupted by 3", 3: "the barge-in, normal", 4: "apology", 5: "no speech"}
            turn_done = 0
            deadline = time.monotonic() + 90
            while turn_done < 5 and time.monotonic() < deadline:
                msg = await asyncio.wait_for(ws.recv(), 30)
                if isinstance(msg, bytes):
                    continue
                ev = json.loads(msg)
                seen.append(ev)
                if ev["type"] == "reply" and ev["turn"] == 2 and ev["block"] == 2:
                    say("goforward.wav")  # talk over turn 2's reply
                if ev["type"] == "reply_done":
                    rows[ev["turn"]] = row(ev["turn"])  # at once: it must already be committed
                if ev["type"] in ("latency", "transcript") and ev.get("turn", 0) > turn_done and (
                        ev["type"] == "latency" or (ev.get("final") and not ev["text"])):
                    turn_done = ev["turn"]
                    nxt = turn_done + 1
                    instance.lm.delay_s = 0.3 if nxt == 2 else 0.0
                    instance.lm.blocks = ["Well,"] + [" and so on,"] * 10 if nxt == 2 else ["Sure,", " fine."]
                    instance.lm.fail_at = 1 if nxt == 4 else None
                    instance.whisper.text = "" if nxt == 5 else "eight of spades"
                    if nxt in (2, 4, 5):
                        await asyncio.sleep(0.5)
                        say("001.wav")
            m.cancel()
            return rows, seen, plan

    with LiveServer(config, instance) as srv:
        rows, seen, plan = asyncio.run(scenario())
        deadline = time.monotonic() + 10
        while instance.live:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    done = {e["turn"]: e for e in seen if e["type"] == "reply_done"}
    latency = {e["turn"]: e for e in seen if e["type"] == "latency"}
    assert set(rows) == set(done) == {1, 2, 3, 4}, (rows, [e["type"] for e in seen])
    for turn, r in rows.items():
        assert r is not None, f"turn {turn} was reported done before its record was committed"
        assert r["reply"] == done[turn]["text"] and r["heard"] == done[turn]["heard"]
        assert json.loads(r["latency"])["stages_ms"] == latency[turn]["stages_ms"]
    assert rows[1]["status"] == "ok" and rows[1]["transcript"] == "eight of spades"
    assert rows[2]["status"] == "interrupted" and rows[2]["interrupted"] == 1
    assert rows[2]["heard"] == " ".join(rows[2]["reply"].split()[:len(rows[2]["heard"].split())])
    assert rows[4]["status"] == "failed" and rows[4]["apology"] == 1
    assert json.loads(rows[4]["errors"])[0]["code"] == "reply_failed"
    [s] = rec.read_sessions(store.database)
    statuses = {t["turn"]: t["status"] for t in s["turns"]}
    assert statuses == {1: "ok", 2: "interrupted", 3: "ok", 4: "failed", 5: "no_speech"}, statuses
    assert s["end_reason"] == "disconnect" and s["turn_count"] == 5
    assert [e["code"] for e in s["errors"]] == ["reply_failed"]


# --- the real thing: voice serve, SIGKILL, restart, SIGTERM ---------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VoiceServe:
    def __init__(self, config: Path, log: Path):
        self.port = _free_port()
        self.log = open(log, "ab")
        env = {k: v for k, v in os.environ.items() if k not in ("VOICE_API_KEYS", "TWILIO_AUTH_TOKEN")}
        self.proc = subprocess.Popen(VOICE + ["serve", "--config", str(config), "--port", str(self.port)], cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, f"voice serve exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "voice serve did not come up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                    if json.loads(r.read())["status"] == "ok":
                        break
            except OSError:
                pass
            time.sleep(0.3)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.log.close()


async def one_turn(port: int, on_event) -> list:
    """005.wav in real time, then silence; `on_event(ev)` sees each JSON event; ends when it returns True
    or the connection closes."""
    seen = []
    async with websockets.connect(f"ws://127.0.0.1:{port}/ws", max_size=None, open_timeout=30) as ws:
        await ws.send(json.dumps({"type": "start", "sample_rate": 16000}))
        frames = [speech("005.wav")[i:i + FRAME] for i in range(0, len(speech("005.wav")), FRAME)]

        async def mic():
            try:
                while True:
                    await ws.send(frames.pop(0) if frames else bytes(FRAME))
                    await asyncio.sleep(0.02)
            except websockets.ConnectionClosed:
                pass

        m = asyncio.create_task(mic())
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                msg = await asyncio.wait_for(ws.recv(), 120)
                if isinstance(msg, str):
                    ev = json.loads(msg)
                    seen.append(ev)
                    if on_event(ev):
                        break
        except websockets.ConnectionClosed:
            seen.append({"type": "closed", "code": ws.close_code, "reason": ws.close_reason})
        finally:
            m.cancel()
    return seen


def test_records_survive_sigkill_and_shutdown_is_graceful(tmp_path):
    db = tmp_path / "records.sqlite3"
    config = tmp_path / "voice.toml"
    config.write_text(f'[lm]\nmax_new_tokens = 16\n\n[records]\npath = "{db}"\n\n[limits]\nshutdown_grace_s = 60.0\n')
    log = tmp_path / "serve.log"

    # 1. a turn, then SIGKILL the moment reply_done arrives
    server = VoiceServe(config, log)
    try:
        def kill_on_done(ev):
            if ev["type"] == "reply_done":
                os.kill(server.proc.pid, signal.SIGKILL)
                return True
            return False
        seen = asyncio.run(one_turn(server.port, kill_on_done))
    finally:
        server.stop()
    assert server.proc.returncode == -signal.SIGKILL
    done = next(e for e in seen if e["type"] == "reply_done")
    assert done["text"], seen

    # 2. restart on the same database; the turn is there
    server = VoiceServe(config, log)
    try:
        out = voice_records("--db", str(db), "--format", "json")
        assert out.returncode == 0, out.stderr
        [crashed] = json.loads(out.stdout)
        assert crashed["ended"] is None  # it never closed: the process died
        [turn] = crashed["turns"]
        assert turn["status"] == "ok" and "spades" in turn["transcript"].lower()
        assert turn["reply"] == done["text"] and turn["heard"] == done["heard"]
        assert "voice_to_voice" in turn["latency"]["stages_ms"]
        print(f"\nrecord after SIGKILL: {turn['transcript']!r} -> {turn['reply']!r}, "
              f"voice-to-voice {turn['latency']['voice_to_voice_ms']} ms")

        # 3. SIGTERM while a reply is being generated: it finishes, then goodbye
        def term_on_first_reply(ev):
            if ev["type"] == "reply" and ev["block"] == 1:
                server.proc.send_signal(signal.SIGTERM)
            return False
        seen = asyncio.run(one_turn(server.port, term_on_first_reply))
        server.proc.wait(60)
    finally:
        server.stop()
    kinds = [e["type"] for e in seen]
    assert "reply_done" in kinds and kinds.index("reply_done") < kinds.index("error"), kinds
    done2 = next(e for e in seen if e["type"] == "reply_done")
    assert done2["interrupted"] is False, done2
    assert seen[-2]["type"] == "error" and seen[-2]["code"] == "shutting_down", seen[-3:]
    assert seen[-1] == {"type": "closed", "code": 1001, "reason": "shutting_down"}, seen[-3:]
    assert server.proc.returncode in (0, -signal.SIGTERM), server.proc.returncode
    sessions = json.loads(voice_records("--db", str(db)).stdout)
    assert len(sessions) == 2 and sessions[1]["end_reason"] == "shutting_down"
    assert [t["status"] for t in sessions[1]["turns"]] == ["ok"]
    assert sessions[1]["turns"][0]["reply"] == done2["text"]
