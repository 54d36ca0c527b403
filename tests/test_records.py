"""Call records (voice/records.py): committed before a turn is reported done, survive a crash.

* the writer: FIFO commits, a bounded queue that pushes back, a locked database that times
  turns out instead of hanging them, `voice records` (JSON and CSV);
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
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import websockets

from fakes import LiveServer, fake_stages, make_config, speech
from voice import records as rec
from voice.latency import Metrics

ROOT = Path(__file__).resolve().parents[1]
VOICE = [sys.executable, "-m", "voice.cli"]
FRAME = 640

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def voice_records(db: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(VOICE + ["records", "--db", str(db), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


# --- the writer --------------------------------------------------------------------------------

def test_writes_commit_in_order_and_close_drains(tmp_path):
    db = tmp_path / "r.sqlite3"
    records = rec.Records(db, queue_size=100, timeout_s=5)

    async def scenario():
        records.write_nowait(rec.session_opened("u1", "s1", "native", "anonymous", "", 1.0, {}))
        for turn in range(1, 6):
            records.write_nowait(rec.error("u1", turn, 2.0, "bad_frame", "odd"))
            ok = await records.write(rec.turn_done("u1", turn, 1.0, 2.0, "ok", f"t{turn}", "r", "r", False, False,
                                                   {"voice_to_voice_ms": 5.0}, []))
            assert ok
            # committed: visible to another connection right now, with everything queued before it
            with sqlite3.connect(db) as c:
                assert c.execute("SELECT count(*) FROM turns").fetchone()[0] == turn
                assert c.execute("SELECT count(*) FROM errors").fetchone()[0] == turn
        records.write_nowait(rec.session_closed("u1", 3.0, "disconnect", 5))

    asyncio.run(scenario())
    records.close()
    assert records.written == 12 and records.failed == 0
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    [s] = rec.read_sessions(db)
    assert s["end_reason"] == "disconnect" and s["turn_count"] == 5 and [t["transcript"] for t in s["turns"]] == [
        "t1", "t2", "t3", "t4", "t5"]
    assert len(s["errors"]) == 5 and s["turns"][0]["latency"] == {"voice_to_voice_ms": 5.0}


def test_a_stuck_database_times_turns_out_and_the_queue_pushes_back(tmp_path):
    db = tmp_path / "r.sqlite3"
    metrics = Metrics()
    records = rec.Records(db, queue_size=2, timeout_s=0.5, metrics=metrics)
    blocker = sqlite3.connect(db, isolation_level=None, timeout=0)
    blocker.execute("BEGIN EXCLUSIVE")  # another process holds the write lock

    async def scenario():
        t0 = time.monotonic()
        ok = await records.write(rec.turn_done("u", 1, 1.0, 2.0, "ok", "a", "b", "b", False, False, None, []))
        waited = time.monotonic() - t0
        for i in range(10):  # the writer is stuck on the first write: the queue fills, extra writes are dropped
            records.write_nowait(rec.error("u", 1, 1.0, "x", str(i)))
        return ok, waited

    ok, waited = asyncio.run(scenario())
    assert ok is False and 0.4 < waited < 3.0  # the turn was told "not recorded" in time, not hung
    assert records.failed >= 8 and metrics.records_failed._value.get() >= 8
    blocker.execute("ROLLBACK")
    blocker.close()

    async def later():
        return await records.write(rec.turn_done("u", 2, 1.0, 2.0, "ok", "c", "d", "d", False, False, None, []))

    deadline = time.monotonic() + 20
    while not asyncio.run(later()):  # the writer gets through its backlog (busy timeout) and recovers
        assert time.monotonic() < deadline
    records.close()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT transcript FROM turns WHERE turn = 2").fetchone()[0] == "c"


def test_voice_records_lists_and_exports(tmp_path):
    db = tmp_path / "r.sqlite3"
    records = rec.Records(db)

    async def fill():
        for n in (1, 2):
            records.write_nowait(rec.session_opened(f"u{n}", f"s{n}", "twilio" if n == 2 else "native", "alice",
                                                    "1.2.3.4:5", 1000.0 + n, {"callSid": "CA1"} if n == 2 else {}))
            await records.write(rec.turn_done(f"u{n}", 1, 1000.0, 1001.0, "ok", "hello, there", "Hi \"you\".",
                                              "Hi", True, False, {"voice_to_voice_ms": 812.5,
                                                                  "over_budget": ["asr"]},
                                              [{"code": "bad_frame", "message": "odd"}]))
    asyncio.run(fill())
    records.close()
    out = voice_records(db)
    assert out.returncode == 0, out.stderr
    sessions = json.loads(out.stdout)
    assert [s["session_id"] for s in sessions] == ["s1", "s2"]  # oldest first
    assert sessions[1]["meta"] == {"callSid": "CA1"} and sessions[1]["turns"][0]["heard"] == "Hi"
    only = json.loads(voice_records(db, "--session", "s2").stdout)
    assert [s["uid"] for s in only] == ["u2"]
    assert [s["uid"] for s in json.loads(voice_records(db, "--session", "u1").stdout)] == ["u1"]
    assert [s["uid"] for s in json.loads(voice_records(db, "--limit", "1").stdout)] == ["u2"]
    csv_out = voice_records(db, "--format", "csv").stdout.splitlines()
    assert csv_out[0].startswith("session_id,uid,transport") and len(csv_out) == 3
    assert '"Hi ""you""."' in csv_out[1] and "812.5" in csv_out[1] and "bad_frame" in csv_out[1]
    missing = voice_records(tmp_path / "nope.sqlite3")
    assert missing.returncode == 1 and "no records database" in missing.stderr


# --- the session (stand-in models) ------------------------------------------------------------

def test_turns_are_committed_before_reply_done_arrives(tmp_path):
    db = tmp_path / "r.sqlite3"
    config = make_config(records={"path": str(db)}, limits={"outbox_audio_s": 60.0})
    stages = fake_stages(config)

    def row(turn: int):
        with sqlite3.connect(db) as c:
            c.row_factory = sqlite3.Row
            return c.execute("SELECT * FROM turns WHERE turn = ?", (turn,)).fetchone()

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
                    stages.lm.delay_s = 0.3 if nxt == 2 else 0.0
                    stages.lm.blocks = ["Well,"] + [" and so on,"] * 10 if nxt == 2 else ["Sure,", " fine."]
                    stages.lm.fail_at = 1 if nxt == 4 else None
                    stages.whisper.text = "" if nxt == 5 else "eight of spades"
                    if nxt in (2, 4, 5):
                        await asyncio.sleep(0.5)
                        say("001.wav")
            m.cancel()
            return rows, seen, plan

    with LiveServer(config, stages) as srv:
        rows, seen, plan = asyncio.run(scenario())
        deadline = time.monotonic() + 10
        while stages.live:
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
    [s] = rec.read_sessions(db)
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
        out = voice_records(db, "--format", "json")
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
    sessions = json.loads(voice_records(db).stdout)
    assert len(sessions) == 2 and sessions[1]["end_reason"] == "shutting_down"
    assert [t["status"] for t in sessions[1]["turns"]] == ["ok"]
    assert sessions[1]["turns"][0]["reply"] == done2["text"]
