"""Limits, back-pressure and graceful shutdown, on the real app with stand-in models (tests/fakes.py).

Real speech clips drive the real VAD; the ASR, LM and TTS are fakes, so every turn takes
milliseconds and the limits can be small. Each breach must produce its documented error and
close code, and leave nothing behind (sessions, admission tickets).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import websockets

from fakes import Client, LiveServer, RawWebSocket, fake_instance, make_config, speech
from voice.events import ReplyText, TtsAudio
from voice.service.records import read_sessions
from voice.conversation.session import Session

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]
FRAME = 640  # 20 ms at 16 kHz


def wait_idle(instance, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while instance.live or instance.admission.total:
        assert time.monotonic() < deadline, (instance.live, instance.admission.active)
        time.sleep(0.05)


def http_status(url: str) -> tuple[int, dict]:
    """(status, JSON body) of a GET, whatever the status."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def ends_with_error_and_close(c: Client, code: str, close_code: int):
    errors = c.events("error")
    assert errors and errors[-1]["code"] == code and errors[-1]["message"], c.events()
    assert c.close == (close_code, code), c.close


# --- session-wide limits -----------------------------------------------------------------------

def test_idle_session_is_closed():
    config = make_config(limits={"idle_timeout_s": 1.0})
    instance = fake_instance(config)
    with LiveServer(config, instance) as srv:
        async def scenario():
            c = await Client.open(srv.ws + "/ws")
            t0 = time.monotonic()
            await c.closed(10)  # we send nothing at all
            return c, time.monotonic() - t0
        c, took = asyncio.run(scenario())
        ends_with_error_and_close(c, "idle_timeout", 1008)
        assert 0.9 < took < 5, took
        wait_idle(instance)
        assert instance.metrics.ended.labels("idle_timeout")._value.get() == 1


def test_session_duration_is_limited_even_while_streaming():
    config = make_config(limits={"max_session_s": 1.5})
    instance = fake_instance(config)
    with LiveServer(config, instance) as srv:
        async def scenario():
            c = await Client.open(srv.ws + "/ws")
            c.listen(speed=1.0)  # silence, in real time: never idle
            return c, await c.closed(10)
        c, _ = asyncio.run(scenario())
        ends_with_error_and_close(c, "session_too_long", 1008)
        wait_idle(instance)


def test_long_utterance_is_cut_and_not_chopped_into_turns():
    config = make_config(limits={"max_utterance_s": 1.0})
    instance = fake_instance(config)
    with LiveServer(config, instance) as srv:
        async def scenario():
            c = await Client.open(srv.ws + "/ws")
            c.listen(speed=2.0)
            c.say(speech("005.wav"))  # 3.5 s of continuous speech
            await c.wait(lambda m: m["type"] == "latency")
            await asyncio.sleep(1.0)  # the rest of the clip, then silence
            await c.shut()
            return c
        c = asyncio.run(scenario())
    kinds = [e["type"] for e in c.events()]
    assert kinds.count("speech_started") == 1, kinds  # the rest of the monologue did not start new turns
    err = c.events("error")[0]
    assert err["code"] == "utterance_too_long" and err["turn"] == 1
    assert kinds.index("error") < kinds.index("speech_stopped") < kinds.index("reply_done")
    assert c.events("reply_done")[0]["interrupted"] is False


def test_reply_length_is_capped():
    config = make_config(limits={"max_reply_chars": 30})
    instance = fake_instance(config)
    instance.lm.blocks = ["word " * 2] * 50  # 500 characters if nobody stops it
    with LiveServer(config, instance) as srv:
        async def scenario():
            c = await Client.open(srv.ws + "/ws")
            c.listen(speed=3.0)
            c.say(speech("001.wav"))
            await c.wait(lambda m: m["type"] == "latency")
            await c.shut()
            return c
        c = asyncio.run(scenario())
    done = c.events("reply_done")[0]
    assert 30 <= len(done["text"]) + 1 <= 40 and len(c.events("reply")) == 3, done


# --- back-pressure ------------------------------------------------------------------------------

def test_outbox_drops_audio_then_ends_a_session_nobody_reads():
    """Unit level: nothing drains the outbox. Reply audio over the limit is dropped (and counted);
    past the event limit the session ends with slow_client."""
    config = make_config(limits={"outbox_audio_s": 2.0, "outbox_max_events": 30})
    instance = fake_instance(config)

    async def scenario():
        s = Session(instance, 16000, 16000)
        one_second = bytes(32000)
        queued = [s.emit(TtsAudio(1, time.monotonic(), one_second, 16000, "x")) for _ in range(4)]
        assert queued == [True, True, False, False]  # a phrase fits while the queue is empty, then 2 s
        assert s.outbox.audio_s == 2.0 and not s.ending.is_set()
        for i in range(40):
            s.emit(ReplyText(1, time.monotonic(), "x", i + 1, i + 1, 1))
        assert s.ending.is_set() and s.end_reason == "slow_client" and s.close_code == 1008
        assert s.outbox.qsize() == 30  # bounded: nothing more was queued
        await s.close()
        return s

    asyncio.run(scenario())
    assert instance.metrics.audio_dropped.labels("native")._value.get() == 2.0
    assert instance.metrics.ended.labels("slow_client")._value.get() == 1


def test_a_client_that_stops_reading_is_cut_off_and_others_are_fine():
    config = make_config(limits={"outbox_audio_s": 3.0, "outbox_max_events": 40, "max_reply_chars": 100000})
    instance = fake_instance(config)
    instance.lm.blocks = [f"This is phrase number {i}, " for i in range(400)]  # ~1.4 s of "audio" each
    with LiveServer(config, instance) as srv:
        async def scenario():
            ws = RawWebSocket("127.0.0.1", srv.port, "/ws")  # reads nothing after the handshake
            send = lambda data: asyncio.to_thread(ws.send, data)  # noqa: E731 - blocking socket
            await send(json.dumps({"type": "start", "sample_rate": 16000, "output_sample_rate": 48000}))
            pcm = speech("001.wav") + bytes(32000)
            for i in range(0, len(pcm), FRAME):
                await send(pcm[i:i + FRAME])
            t0 = time.monotonic()
            try:
                while time.monotonic() - t0 < 60 and not instance.metrics.ended.labels("slow_client")._value.get():
                    await send(bytes(FRAME))
                    await asyncio.sleep(0.02)
            except OSError:
                pass
            took = time.monotonic() - t0
            ws.abort()
            instance.lm.blocks = ["Fine."]
            c = await Client.open(srv.ws + "/ws")  # someone else is served normally
            c.listen(speed=3.0)
            c.say(speech("001.wav"))
            await c.wait(lambda m: m["type"] == "latency")
            await c.shut()
            return took
        took = asyncio.run(scenario())
        wait_idle(instance)
    assert instance.metrics.ended.labels("slow_client")._value.get() == 1, took
    assert instance.metrics.audio_dropped.labels("native")._value.get() > 0
    print(f"\nslow client cut off after {took:.1f} s")


# --- graceful shutdown --------------------------------------------------------------------------

def test_shutdown_lets_the_turn_in_flight_finish_then_says_goodbye(tmp_path):
    config = make_config(records={"path": str(tmp_path / "r.sqlite3")}, limits={"shutdown_grace_s": 10.0})
    instance = fake_instance(config)
    instance.lm.blocks = ["One,", " two,", " three,", " four,", " five."]
    instance.lm.delay_s = 0.4  # about 2 s of generation: still going when the shutdown starts
    srv = LiveServer(config, instance, graceful=True).__enter__()
    try:
        async def scenario():
            busy = await Client.open(srv.ws + "/ws")
            idle = await Client.open(srv.ws + "/ws")
            idle.listen(speed=1.0)
            busy.listen(speed=3.0)
            busy.say(speech("001.wav"))
            await busy.wait(lambda m: m["type"] == "reply")
            t0 = time.monotonic()
            threading.Thread(target=srv.stop, daemon=True).start()  # SIGTERM, as far as uvicorn is concerned
            await asyncio.sleep(0.3)
            # still listening while it drains, so that a load balancer sees it (docs/SCALING.md)
            health = await asyncio.to_thread(http_status, srv.http + "/healthz")
            try:
                late = await Client.open(srv.ws + "/ws")
                late_result = ("served", late.events())
            except websockets.InvalidStatus as err:
                late_result = ("refused", err.response.status_code, json.loads(err.response.body)["error"]["code"])
            await busy.closed(20)
            await idle.closed(20)
            return busy, idle, late_result, health, time.monotonic() - t0
        busy, idle, late, health, took = asyncio.run(scenario())
    finally:
        srv.stop()
    kinds = [e["type"] for e in busy.events()]
    assert kinds[-3:] == ["reply_done", "latency", "error"], kinds
    assert busy.events("reply_done")[0]["interrupted"] is False
    assert busy.events("reply_done")[0]["text"] == "One, two, three, four, five."
    ends_with_error_and_close(busy, "shutting_down", 1001)
    ends_with_error_and_close(idle, "shutting_down", 1001)
    assert late == ("refused", 503, "shutting_down"), late  # before the upgrade: a balancer retries it elsewhere
    assert health[0] == 503 and health[1]["status"] == "shutting_down", health
    assert took < 12, took
    records = read_sessions(tmp_path / "r.sqlite3")
    assert sorted(r["end_reason"] for r in records) == ["shutting_down", "shutting_down"], records
    turn = next(r for r in records if r["turns"])["turns"][0]
    assert turn["status"] == "ok" and turn["reply"] == "One, two, three, four, five."
    print(f"\nshutdown with a turn in flight took {took:.1f} s")


def test_bad_frame_flood_is_bounded():
    """A client repeating a mistake fast gets its errors, but nothing grows without bound."""
    config = make_config()
    instance = fake_instance(config)

    async def scenario():
        s = Session(instance, 16000, 16000)
        for _ in range(5000):
            s.error("bad_frame", "odd length")
        assert len(s.call_log.open_turns) == 0 and s.call_log.error_counts["bad_frame"] == 5000
        assert len(s.tracker.turns) == 0
        await s.close()
        assert instance.lm.closed == 1  # the session's conversation was given back
    asyncio.run(scenario())
    assert np.isclose(instance.metrics.errors.labels("bad_frame")._value.get(), 5000)


RELEASED_MEMORY = """
import gc, sys, time
import psutil
from voice.config import LimitsConfig
from voice.service.limits import Admission
process = psutil.Process()
ticket = Admission(LimitsConfig()).acquire("someone")
blocks = [bytes(2000) for _ in range(100_000)]  # ~200 MB through malloc (over pymalloc's 512 bytes)
kept = blocks[::50]  # what the process still uses sits between the freed blocks
del blocks
gc.collect()
before = process.memory_info().rss
if sys.argv[1] == "release":
    ticket.release()
deadline = time.monotonic() + 5
while process.memory_info().rss > before - 100 * 2**20 and time.monotonic() < deadline:
    time.sleep(0.05)
print(before - process.memory_info().rss, len(kept))
"""


def test_memory_a_session_freed_goes_back_to_the_system_when_it_ends():
    """Buffers freed with a few blocks still live between them stay in glibc's heap (RSS does not
    fall); releasing a session's ticket hands those pages back. In a fresh process: one that has
    run many tests has its heap shaped by them."""
    import subprocess
    import sys

    def freed_mb(how: str) -> float:
        out = subprocess.run([sys.executable, "-c", RELEASED_MEMORY, how], capture_output=True, text=True,
                             check=True, timeout=60).stdout.split()
        assert out[1] == "2000"
        return int(out[0]) / 2**20
    assert freed_mb("keep") < 50  # left alone, glibc keeps the pages
    assert freed_mb("release") > 100
