"""Regression tests for the hostile-input review: one test per defect, each reproducing it.

Every test here failed before its fix (see the report in docs/RELIABILITY.md, "Fuzz inputs"):
a JSON integer over Python's 4,300-digit limit killing /ws and /twilio, a Twilio `chunk` of
"²", API keys in query strings reaching the access log, an unchecked `session.system_prompt`
(lone surrogate, 900 KB) that made every turn fail and flipped /healthz to "degraded", a
browser token with a non-ASCII signature answered with HTTP 500, `engine serve` answering 500
to deep nesting and lone surrogates, turns cut off by a disconnect missing from the call
records, and RTP packets of any size accepted.

Everything runs against the real app around the stand-in models of tests/fakes.py (no model is
loaded); the engine tests use the real `engine serve` app around a stand-in engine.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import sqlite3
import time

import pytest
import websockets

from fakes import EncodingEngine, FakeLM, LiveServer, fake_instance, make_config, speech
from liveserver import healthz, next_json, serving
from strategies import INVITE, SDP
from voice.service.auth import Auth, AuthError, RedactSecrets
from voice.transports import rtp
from voice.transports.sipmsg import SipError, SipMessage
from voice.transports.telephony import calls

FRAME = 640  # 20 ms of 16 kHz PCM16
HUGE_INT = "9" * 4400  # over Python's int-string conversion limit (4,300 digits)
KEY = "web-key-0123456789abcdef"

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]


class StrictLM(FakeLM):
    """The stand-in LM, but it treats its input as a real engine does: the text is encoded (a lone
    surrogate can't be) and must fit the context (here 1,500 characters)."""

    context_chars = 1500

    def chat(self):
        lm, inner = self, super().chat()

        class Chat:
            async def reply(self, messages, mode=None, runs_out=None, tools=None):
                text = "".join(m["content"] for m in messages)
                text.encode("utf-8")  # UnicodeEncodeError on a lone surrogate, like a tokenizer
                if len(text) > lm.context_chars:
                    from engine.decode import ContextOverflow
                    raise ContextOverflow(f"{len(text)} characters do not fit the context")
                async for block in inner.reply(messages, mode, runs_out, tools):
                    yield block

            async def prepare(self, messages, tools=None, aside=False):
                await inner.prepare(messages, tools)

            def close(self):
                inner.close()

        return Chat()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    db = tmp_path_factory.mktemp("records") / "records.sqlite3"
    config = make_config(records={"path": str(db)})
    instance = fake_instance(config, lm=StrictLM())
    with LiveServer(config, instance) as srv:
        srv.db = db
        yield srv


async def still_serving(ws) -> None:
    """The session answers an unknown control message with an error: it is still up."""
    await ws.send(json.dumps({"type": "ping"}))
    await next_json(ws, lambda m: m["type"] == "error" and m["code"] == "unknown_message")


async def refused_start(url: str, text: str) -> tuple[dict, int | None, str]:
    async with websockets.connect(url, max_size=None, open_timeout=10) as ws:
        await ws.send(text)
        first = await next_json(ws)
        await asyncio.wait_for(ws.wait_closed(), 10)
        return first, ws.close_code, ws.close_reason


# --- 1. integers over Python's int-string limit --------------------------------------------------

def test_native_huge_integer_after_start_is_bad_json_and_the_session_goes_on(server):
    async def scenario():
        async with websockets.connect(server.ws + "/ws", max_size=None) as ws:
            await ws.send(json.dumps({"type": "start", "sample_rate": 16000}))
            await next_json(ws, lambda m: m["type"] == "ready")
            await ws.send('{"v":' + HUGE_INT + '}')
            ev = await next_json(ws, lambda m: m["type"] == "error")
            assert ev["code"] == "bad_json" and "digits" in ev["message"], ev
            await still_serving(ws)

    asyncio.run(scenario())


def test_native_huge_integer_in_start_is_bad_json_and_closes_1008(server):
    first, code, reason = asyncio.run(refused_start(
        server.ws + "/ws", '{"type":"start","sample_rate":' + HUGE_INT + '}'))
    assert first["type"] == "error" and first["code"] == "bad_json", first
    assert (code, reason) == (1008, "bad_json")


TWILIO_START = {"event": "start", "streamSid": "MZhostile", "start": {
    "streamSid": "MZhostile", "callSid": "CAhostile",
    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}


async def twilio_call(srv, sid: str, hostile: list[str]) -> tuple[int | None, object]:
    """Start a call, send `hostile`, then a valid media message and `stop`: (close code, call record)."""
    start = json.loads(json.dumps(TWILIO_START).replace("MZhostile", sid))
    async with websockets.connect(srv.ws + "/twilio", max_size=None) as ws:
        await ws.send(json.dumps(start))
        for text in hostile:
            await ws.send(text)
        await ws.send(json.dumps({"event": "media", "streamSid": sid, "media": {"payload": "/w==", "chunk": "9"}}))
        await asyncio.sleep(0.3)
        record = next(r for r in calls.find("twilio") if r.id == sid)
        assert record.ended is None, "the call ended on hostile input"
        await ws.send(json.dumps({"event": "stop", "streamSid": sid}))
        await asyncio.wait_for(ws.wait_closed(), 10)
        return ws.close_code, record


def test_twilio_huge_integer_is_dropped_and_the_call_goes_on(server):
    code, record = asyncio.run(twilio_call(server, "MZhugeint", ['{"event":"media","v":' + HUGE_INT + '}']))
    assert code == 1000 and record.end_reason == "caller_hangup"
    assert record.counters["dropped_bad_json"] == 1 and record.counters["media_in"] == 1


# --- 2. a Twilio media.chunk of unicode digits ----------------------------------------------------

def test_twilio_unicode_digit_chunk_is_ignored_and_the_call_goes_on(server):
    chunks = ["²", "\u0663", "1" * 5000]  # isdigit() is true for all three; int("²") raises
    hostile = [json.dumps({"event": "media", "media": {"payload": "/w==", "chunk": c}}) for c in chunks]
    code, record = asyncio.run(twilio_call(server, "MZdigits", hostile))
    assert code == 1000 and record.end_reason == "caller_hangup"
    assert record.counters["media_in"] == 4  # the audio of each message was still taken


# --- 4. API keys in query strings reach the access log -------------------------------------------

def test_query_string_keys_are_redacted_in_uvicorn_log_lines():
    secrets = ["access-secret-0123456789", "plain-key-0123456789ab", "tok.en-secret-98765",
               "apikey-dash-0123456789"]
    path = f"/ws?api_key={secrets[0]}&key={secrets[1]}&x=1&token={secrets[2]}&API-KEY={secrets[3]}"
    for name, msg, args in (("uvicorn.error", '%s - "WebSocket %s" [accepted]', ("127.0.0.1:5", path)),
                            ("uvicorn.access", '%s - "%s %s HTTP/%s" %d', ("127.0.0.1:5", "GET", path, "1.1", 200))):
        record = logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)
        RedactSecrets().filter(record)
        line = record.getMessage()
        assert not [s for s in secrets if s in line], line
        assert "x=1" in line and line.count("REDACTED") == 4, line


# --- 5. session.system_prompt unchecked ------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["\ud800 be brief", "x" * 900_000], ids=["lone_surrogate", "900KB"])
def test_bad_system_prompt_is_refused_at_start_and_health_stays_ok(server, prompt):
    text = json.dumps({"type": "start", "sample_rate": 16000, "session": {"system_prompt": prompt}})
    first, code, reason = asyncio.run(refused_start(server.ws + "/ws", text))
    assert first["type"] == "error" and first["code"] in ("bad_json", "bad_session"), first
    assert (code, reason) == (1008, first["code"])
    assert healthz(server)["status"] == "ok"


def test_a_turn_the_request_itself_breaks_is_not_a_service_fault(server):
    """A system prompt within the limit that the LM can't fit with the turn: the turn fails with
    the apology, the session goes on, and /healthz does not blame the service."""
    async def scenario():
        async with websockets.connect(server.ws + "/ws", max_size=None) as ws:
            await ws.send(json.dumps({"type": "start", "sample_rate": 16000,
                                      "session": {"system_prompt": "Be brief. " * 160}}))
            await next_json(ws, lambda m: m["type"] == "ready")
            pcm = speech("005.wav") + bytes(32000)
            for i in range(0, len(pcm), FRAME):
                await ws.send(pcm[i:i + FRAME])
                await asyncio.sleep(0.02 / 3)
            err = await next_json(ws, lambda m: m["type"] == "error", 30)
            done = await next_json(ws, lambda m: m["type"] == "reply_done", 30)
            await still_serving(ws)
            return err, done

    err, done = asyncio.run(scenario())
    assert err["code"] == "context_length_exceeded" and err["apology"] and done["interrupted"], (err, done)
    health = healthz(server)
    assert health["status"] == "ok" and "faults" not in health, health


# --- 6. a token with a non-ASCII signature ---------------------------------------------------------

def test_token_with_non_ascii_signature_is_bad_token():
    auth = Auth(keys={"web": KEY}, secret=b"s" * 32)
    for token in ("v1.d2Vi.9999999999.é", "v1.d2Vi.9999999999.\ud800", "v1.d2Vé.9999999999.abc"):
        with pytest.raises(AuthError) as err:
            auth.check_token(token)
        assert err.value.code == "bad_token"


def test_ws_with_non_ascii_token_signature_gets_bad_token_not_500():
    config = make_config()
    with LiveServer(config, fake_instance(config), Auth(keys={"web": KEY}, secret=b"s" * 32)) as srv:
        async def scenario():
            async with websockets.connect(srv.ws + "/ws?token=v1.d2Vi.9999999999.%C3%A9", open_timeout=10) as ws:
                first = await next_json(ws)
                await asyncio.wait_for(ws.wait_closed(), 10)
                return first, ws.close_code

        first, code = asyncio.run(scenario())
    assert first["code"] == "bad_token" and code == 1008


# --- 7. engine serve: deep nesting, lone surrogates -------------------------------------------------

def post(port: int, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def engine_port():
    from engine.decode import DecodeConfig
    from engine.api.server import build_app
    with serving(build_app(EncodingEngine(), DecodeConfig(max_new_tokens=8))) as port:
        yield port


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + HUGE_INT.encode() + b"}",
    b'{"messages": [{"role": ["user"], "content": "hi"}]}',  # found by the fuzzer: unhashable role
    b'{"messages": [{"role": {"a": 1}, "content": "hi"}]}',
], ids=["deep", "deep_messages", "surrogate", "surrogate_part", "huge_int", "list_role", "dict_role"])
def test_engine_answers_400_to_hostile_json(engine_port, body):
    status, answer = post(engine_port, body)
    assert status == 400, (status, answer)
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
    status, answer = post(engine_port, json.dumps({"messages": [{"role": "user", "content": "hello"}]}).encode())
    assert status == 200 and answer["choices"][0]["message"]["content"] == "Hello there."


# --- 9. a turn cut off by a disconnect leaves a record -----------------------------------------------

def turn_rows(db, session_id: str, timeout: float = 8.0) -> list[dict]:
    """The turns of the latest session called `session_id`, once its close is committed."""
    deadline = time.monotonic() + timeout
    while True:
        with sqlite3.connect(db) as c:
            c.row_factory = sqlite3.Row
            s = c.execute("SELECT * FROM sessions WHERE session_id = ? ORDER BY started DESC LIMIT 1",
                          (session_id,)).fetchone()
            if s is not None and s["ended"] is not None:
                return [dict(r) for r in c.execute("SELECT * FROM turns WHERE session_uid = ? ORDER BY turn",
                                                   (s["uid"],))]
        assert time.monotonic() < deadline, f"session {session_id} not closed in the records"
        time.sleep(0.05)


async def cut_off(srv, until: str | None, asr_delay_s: float = 0.0, tail_s: float = 0.0) -> str:
    """Speak (at twice real time), disconnect as soon as `until` is seen (None: at the end of the
    clip), after `tail_s` more seconds of silence in real time; returns the session id."""
    srv.instance.whisper.delay_s = asr_delay_s
    try:
        async with websockets.connect(srv.ws + "/ws", max_size=None) as ws:
            await ws.send(json.dumps({"type": "start", "sample_rate": 16000}))
            ready = await next_json(ws, lambda m: m["type"] == "ready")
            pcm = speech("005.wav") + (bytes(64000) if until else b"")
            seen = asyncio.create_task(next_json(ws, lambda m: m["type"] == until, 30)) if until else None
            for i in range(0, len(pcm), FRAME):
                if seen is not None and seen.done():
                    break
                await ws.send(pcm[i:i + FRAME])
                await asyncio.sleep(0.02 / 2)
            if seen is not None:
                await seen
            for _ in range(int(tail_s / 0.02)):
                await ws.send(bytes(FRAME))
                await asyncio.sleep(0.02)
        return ready["session_id"]
    finally:
        srv.instance.whisper.delay_s = 0.0


@pytest.mark.parametrize("when", ["speech", "hangover", "final_transcript"])
def test_a_turn_cut_off_by_a_disconnect_is_recorded_as_abandoned(server, when):
    if when == "speech":  # mid-utterance
        sid = asyncio.run(cut_off(server, "speech_started"))
    elif when == "hangover":  # the user paused; the end of speech is not confirmed yet (or just so)
        sid = asyncio.run(cut_off(server, None, asr_delay_s=2.0, tail_s=0.25))
    else:  # speech_stopped, the final transcript is still being decoded
        sid = asyncio.run(cut_off(server, "speech_stopped", asr_delay_s=2.0))
    rows = turn_rows(server.db, sid)
    assert [r["status"] for r in rows] == ["abandoned"], rows
    assert rows[0]["turn"] == 1 and rows[0]["started"] and rows[0]["ended"] >= rows[0]["started"]
    assert rows[0]["reply"] == "" and not rows[0]["interrupted"]


# --- RTP: no size cap -------------------------------------------------------------------------------

def test_oversized_rtp_packets_are_dropped_and_counted():
    from voice.config import SipConfig
    from voice.transports.sip import SipEndpoint

    config = make_config()
    instance = fake_instance(config)

    class Transport:
        def sendto(self, data, addr):
            pass

        def close(self):
            pass

    async def scenario():
        ep = SipEndpoint(instance, SipConfig(port=0, rtp_port_min=41200, rtp_port_max=41299))
        ep.transport = Transport()
        ep.datagram(INVITE.format(length=len(SDP), body=SDP).replace("fuzz-call-1", "rtp-cap-1").encode(),
                    ("127.0.0.1", 5099))
        call = ep.calls["rtp-cap-1"]
        try:
            for seq, size in ((1, 60_000), (2, 160), (3, 2_100)):
                call.rtp_in(rtp.RtpPacket(0, seq, seq * 160, 77, b"\xff" * size).build(), ("127.0.0.1", 40000))
            return dict(call.record.counters)
        finally:
            await ep.stop()

    counters = asyncio.run(scenario())
    assert counters["packets_in"] == 1, counters  # only the 172-byte one
    assert counters["dropped_rtp_too_large"] == 2, counters


# --- noticed on the way: unicode digits in SIP numbers --------------------------------------------

@pytest.mark.parametrize("header", ["Content-Length: \u00b2", "CSeq: \u00b2 INVITE", "Via: SIP/2.0/UDP h:\u00b2"])
def test_sip_unicode_digits_are_sip_errors(header):
    name = header.split(":")[0]
    lines = [line for line in INVITE.format(length=0, body="").split("\r\n") if not line.startswith(name + ":")]
    text = "\r\n".join(lines[:2] + [header] + lines[2:])
    try:
        msg = SipMessage.parse(text.encode())
    except SipError:
        return
    from voice.transports.sipmsg import sent_by
    sent_by(msg.get("via") or "")  # what parses must be usable
    assert msg.cseq[1] == "INVITE"
