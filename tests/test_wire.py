"""The one JSON decoder and the one log filter, and hostile JSON fuzzed into every front.

* `engine.common.wire.decode_json` (every JSON that arrives on /ws, /twilio and `engine serve`): only
  `WireError` ever comes out, whatever goes in; what it accepts is bounded (depth, numbers,
  size) and encodable (no lone surrogates); on ordinary JSON it agrees with `json.loads`.
* `engine.common.redact` (every log line of both servers): keys in query strings and headers, tokens,
  Twilio signatures and the configured secret values are redacted, on any logger.
* Live fuzzing with hypothesis (`tests/strategies.py` `hostile_json`: integers of 4,300+
  digits, lone surrogates, 100,000-deep nesting, wrong types, unicode digits, broken JSON)
  against the real app around the stand-in models (tests/fakes.py) and the real `engine
  serve` app around a stand-in engine. Each fuzz test checks every example on its own (the
  connection stayed open, or closed with the documented code and reason; the HTTP status is
  a documented 4xx or 200), that nothing was logged as a crash (no ERROR record, no
  traceback), and then that a well-formed session or request still works end to end.
* Last, the log grep: both servers with keys, a token secret and a Twilio auth token
  configured, uvicorn logging at info with its access log, requests carrying secrets in every
  place a client might put them; the captured output (stdout, stderr and a handler on every
  logger) must not contain any of them.

Counts (`FUZZ`) are printed by the last test (pytest -s) and quoted in docs/RELIABILITY.md.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import io
import itertools
import json
import logging
import time
import urllib.request

import pytest
import uvicorn
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.common.redact import RedactSecrets, install_redaction, redact
from engine.common.wire import MAX_DEPTH, REASONS, WireError, ascii_int, decode_json
from fakes import SPEECH, Client, EncodingEngine, LiveServer, StandInEngine, fake_instance, make_config, speech
from liveserver import healthz, next_json, serving
from strategies import (BROKEN, ENGINE_BODIES, NATIVE_CONTROLS, NATIVE_STARTS, TWILIO_MESSAGES, hostile_json,
                        json_value, poison)
from voice.audio import float_to_int16, read_wav, resample, ulaw_encode
from voice.service.auth import Auth
from voice.transports import native

PURE = settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
LIVE_NATIVE = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
LIVE_TWILIO = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
LIVE_ENGINE = settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
FUZZ: dict[str, dict[str, int]] = {}
START_CODES = {"bad_json", "expected_start", "unsupported_version", "bad_sample_rate", "bad_encoding", "bad_session"}
CONTROL_CODES = {"bad_json", "already_started", "unknown_message"}

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def tally(front: str, inputs: int = 0, crashes: int = 0, outcome: str | None = None) -> None:
    entry = FUZZ.setdefault(front, {"inputs": 0, "crashes": 0})
    entry["inputs"] += inputs
    entry["crashes"] += crashes
    if outcome is not None:
        outcomes = entry.setdefault("outcomes", {})
        outcomes[outcome] = outcomes.get(outcome, 0) + 1


def depth(value) -> int:
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


# --- the decoder -----------------------------------------------------------------------------------

ALL_TEMPLATES = NATIVE_STARTS + NATIVE_CONTROLS + TWILIO_MESSAGES + ENGINE_BODIES


@PURE
@given(st.one_of(hostile_json(ALL_TEMPLATES), poison, st.text(max_size=200), st.binary(max_size=200),
                 hostile_json(ALL_TEMPLATES).map(lambda t: t.encode("utf-8", "surrogatepass")),
                 st.text(st.one_of(st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010),
                                   st.sampled_from('[]{}",:1\\u')), max_size=40)))
def test_decode_json_raises_only_wire_errors_and_accepts_only_bounded_encodable_json(data):
    tally("decoder (pure)", 1)
    try:
        value = decode_json(data)
    except WireError as err:
        assert err.reason in REASONS and 0 < len(err.message) < 200, err.message
        return
    json.dumps(value, ensure_ascii=False).encode("utf-8")  # no lone surrogate anywhere
    assert depth(value) <= MAX_DEPTH


@PURE
@given(json_value)
def test_decode_json_agrees_with_json_loads_on_ordinary_json(value):
    text = json.dumps(value)
    assert decode_json(text) == json.loads(text) == decode_json(text.encode())


def test_decode_json_bounds():
    ok = {"a": [1, -2.5, "é😀", True, None]}
    assert decode_json(json.dumps(ok)) == ok
    assert decode_json(" [" * MAX_DEPTH + "]" * MAX_DEPTH + "\n") is not None  # exactly the limit
    cases = {
        "bad_number": ["9" * 4400, '{"v": -' + "9" * 5000 + "}", "1" * 65, "1e999", "-1e400", "0." + "1" * 80],
        "too_deep": ["[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), '{"a":' * 40 + "1" + "}" * 40, "[" * 30_000],
        "bad_string": ['"\\ud800"', '{"\\udfff": 1}', '["a\\ud83d"]', '"\\ude00\\ud83d"'],
        "syntax": ["NaN", "[Infinity]", "-Infinity", "", "{", '{"a": 1} x', "\ufeff{}", "[1,]", '"\\x"'],
        "too_large": ["[" + "1," * 40000 + "1]", b" " * 70000],
        "not_utf8": [b'{"a": "\xff"}', b'"\xed\xa0\x80"'],  # the second: a surrogate, UTF-8-encoded
        "not_text": [5, None, ["[]"]],
    }
    for reason, inputs in cases.items():
        for data in inputs:
            with pytest.raises(WireError) as err:
                decode_json(data)
            assert err.value.reason == reason, (reason, str(data)[:40], err.value.message)
    for deep in ("[" * 100_000 + "]" * 100_000, b"[" * 100_000, '{"a":' * 100_000):  # engine serve's 1 MiB
        with pytest.raises(WireError) as err:
            decode_json(deep, max_bytes=1 << 20)
        assert err.value.reason == "too_deep"
    assert decode_json('"\\ud83d\\ude00"') == "😀"  # a surrogate *pair* is one character
    assert decode_json("[" + "1," * 40000 + "1]", max_bytes=1 << 20)[-1] == 1


def test_ascii_int():
    assert ascii_int("0") == 0 and ascii_int("160") == 160 and ascii_int("9" * 18) == 10 ** 18 - 1
    for bad in ("²", "٣", "１", "", " 1", "1 ", "+1", "-1", "1.0", "9" * 19, 5, None, "0x10"):
        assert ascii_int(bad) is None, bad


# --- redaction ----------------------------------------------------------------------------------------

def test_redact_hides_every_kind_of_secret():
    install_redaction(["exact-secret-value-42"])
    lines = {
        "GET /v1/models?api_key=SEC1abcdefgh HTTP/1.1": "SEC1abcdefgh",
        "/ws?key=SEC2abcdefgh&x=1": "SEC2abcdefgh",
        "/ws?foo=1&token=v1.d2Vi.123.SEC3abcdefghijklmnop": "SEC3abcdefghijklmnop",
        "/ws?Api-Key=SEC4abcdefgh": "SEC4abcdefgh",
        "/x?access_token=SEC5abcdefgh#frag": "SEC5abcdefgh",
        "/x?password=SEC6abcdefgh": "SEC6abcdefgh",
        "Authorization: Bearer SEC7abcdefgh": "SEC7abcdefgh",
        "{'authorization': 'Bearer SEC8abcdefgh'}": "SEC8abcdefgh",
        "x-twilio-signature: SEC9abcdefgh+/=": "SEC9abcdefgh",
        "connected with v1.YWxpY2U.1767225600.SEC10abcdefghijklmno": "SEC10abcdefghijklmno",
        "the key exact-secret-value-42 leaked": "exact-secret-value-42",
        "/twilio?signature=SEC11abcdefg": "SEC11abcdefg",
    }
    for line, secret in lines.items():
        clean = redact(line)
        assert secret not in clean and "REDACTED" in clean, (line, clean)
    for harmless in ("max_tokens=48 prompt_tokens=12 principal=ops", "monkey=1 tokens=5", "session=s7 turn=2"):
        assert redact(harmless) == harmless


def test_the_filter_keeps_uvicorns_access_args_and_covers_tracebacks():
    f = RedactSecrets()
    access = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/ws?api_key=SECRETabcdefgh", "1.1", 101), None)
    f.filter(access)
    assert isinstance(access.args, tuple) and len(access.args) == 5 and access.args[4] == 101
    assert "SECRETabcdefgh" not in access.getMessage()
    try:
        raise RuntimeError("failed with token=SECRETtraceback1")
    except RuntimeError:
        import sys
        boom = logging.LogRecord("x", logging.ERROR, __file__, 1, "boom %s", ("Bearer SECRETarg12345",),
                                 sys.exc_info())
    f.filter(boom)
    text = logging.Formatter().format(boom)
    assert "SECRETtraceback1" not in text and "SECRETarg12345" not in text and "RuntimeError" in text


# --- live fronts ----------------------------------------------------------------------------------------

class Capture(logging.Handler):
    """Every log record of the servers, to count crashes (ERROR records, tracebacks)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def crashes(self, since: int) -> list[str]:
        return [f"{r.name}: {r.getMessage()[:300]}" for r in self.records[since:]
                if r.levelno >= logging.ERROR or r.exc_info]


@pytest.fixture(scope="module")
def fronts(tmp_path_factory):
    from engine.decode import DecodeConfig
    from engine.api.server import build_app
    db = tmp_path_factory.mktemp("records") / "records.sqlite3"
    config = make_config(records={"path": str(db)})
    instance = fake_instance(config)
    with LiveServer(config, instance) as voice, \
            serving(build_app(EncodingEngine(), DecodeConfig(max_new_tokens=8), max_input_chars=4000)) as port:
        capture = Capture()
        loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.access")]
        for lg in loggers:  # after uvicorn.Config has (re)configured its loggers
            lg.addHandler(capture)
        voice.engine_port, voice.capture = port, capture
        try:
            yield voice
        finally:
            for lg in loggers:
                lg.removeHandler(capture)


VALID_START = json.dumps({"type": "start", "sample_rate": 16000})


async def native_once(url: str, start: str, controls: list[str]) -> None:
    async with websockets.connect(url, max_size=None, open_timeout=10) as ws:
        await ws.send(start)
        first = await next_json(ws)
        if first["type"] != "ready":  # refused: the error, then close 1008 with its code as reason
            assert first["type"] == "error" and first["code"] in START_CODES, first
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert (ws.close_code, ws.close_reason) == (1008, first["code"]), (start[:200], first)
            tally("/ws", outcome=f"start refused: {first['code']}")
            return
        tally("/ws", outcome="ready")
        for text in controls:  # after start: each is answered with one error; the session stays up
            await ws.send(text)
            ev = await next_json(ws)
            assert ev["type"] == "error" and ev["code"] in CONTROL_CODES, (text[:200], ev)
            tally("/ws", outcome=f"after start: {ev['code']}")
        await ws.send('{"type": "ping"}')
        ev = await next_json(ws)
        assert ev["type"] == "error" and ev["code"] == "unknown_message", ev
        assert ws.close_code is None


async def full_native_turn(url: str) -> list[dict]:
    c = await Client.open(url)
    c.listen(speed=3.0)
    c.say(speech("005.wav"))
    await c.wait(lambda m: m["type"] == "latency", 60)
    await c.shut()
    return c.events()


def test_fuzz_native_ws(fronts):
    mark = len(fronts.capture.records)

    @LIVE_NATIVE
    @given(st.one_of(hostile_json(NATIVE_STARTS), st.just(VALID_START)),
           st.lists(hostile_json(NATIVE_CONTROLS), max_size=3))
    def run(start, controls):
        tally("/ws", 1 + len(controls))
        asyncio.run(asyncio.wait_for(native_once(fronts.ws + "/ws", start, controls), 60))

    run()
    crashes = fronts.capture.crashes(mark)
    tally("/ws", crashes=len(crashes))
    assert not crashes, crashes
    events = asyncio.run(full_native_turn(fronts.ws + "/ws"))  # a well-formed session still works
    final = [e for e in events if e["type"] == "transcript" and e["final"]]
    assert final and final[0]["text"] and any(e["type"] == "reply_done" for e in events)
    assert not [e for e in events if e["type"] == "error"], events
    health = healthz(fronts)
    assert health["status"] == "ok" and health["records"]["failed"] == 0, health


_sids = itertools.count(1)


def twilio_start(sid: str) -> str:
    return json.dumps({"event": "start", "streamSid": sid, "start": {
        "streamSid": sid, "callSid": "CA" + sid,
        "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})


def is_stop(text: str) -> bool:
    try:
        msg = json.loads(text)
    except (ValueError, RecursionError):
        return False
    return isinstance(msg, dict) and msg.get("event") == "stop"


async def twilio_once(url: str, messages: list[str], start_first: bool) -> None:
    sid = f"MZfuzz{next(_sids)}"
    async with websockets.connect(url, max_size=None, open_timeout=10) as ws:
        if start_first:
            await ws.send(twilio_start(sid))
        for text in messages:
            await ws.send(text)
        await ws.send(twilio_start(sid))  # a duplicate (dropped) or the first start
        await ws.send(json.dumps({"event": "media", "streamSid": sid, "media": {"payload": "/w==", "chunk": "1"}}))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ws.wait_closed(), 0.05)
        if ws.close_code is not None:  # only a `stop` ends a call: Twilio's own, documented end
            assert ws.close_code == 1000 and any(is_stop(m) for m in messages), (ws.close_code, messages)
            return
        await ws.send(json.dumps({"event": "stop", "streamSid": sid}))
        await asyncio.wait_for(ws.wait_closed(), 10)
        assert ws.close_code == 1000, (ws.close_code, ws.close_reason)


def ulaw_speech(name: str) -> bytes:
    audio, rate = read_wav(SPEECH / name)
    return ulaw_encode(float_to_int16(resample(audio, rate, 8000)))


async def full_twilio_call(url: str) -> list[dict]:
    """A well-formed call: speech in, a reply (media + a mark) back."""
    sid = "MZafterfuzz"
    got: list[dict] = []
    async with websockets.connect(url, max_size=None, open_timeout=10) as ws:
        await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await ws.send(twilio_start(sid))
        audio = ulaw_speech("005.wav") + b"\xff" * 8000 * 3

        async def talk():
            for n, i in enumerate(range(0, len(audio), 160)):
                await ws.send(json.dumps({"event": "media", "streamSid": sid, "media": {
                    "track": "inbound", "chunk": str(n + 1), "timestamp": str(n * 20),
                    "payload": base64.b64encode(audio[i:i + 160]).decode()}}))
                await asyncio.sleep(0.02 / 3)

        mic = asyncio.create_task(talk())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(m["event"] == "mark" for m in got):
            got.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
        mic.cancel()
        await ws.send(json.dumps({"event": "stop", "streamSid": sid}))
        await asyncio.wait_for(ws.wait_closed(), 10)
    return got


def test_fuzz_twilio(fronts):
    mark = len(fronts.capture.records)

    @LIVE_TWILIO
    @given(st.lists(hostile_json(TWILIO_MESSAGES), min_size=1, max_size=6), st.booleans())
    def run(messages, start_first):
        tally("/twilio", len(messages))
        asyncio.run(asyncio.wait_for(twilio_once(fronts.ws + "/twilio", messages, start_first), 60))

    run()
    crashes = fronts.capture.crashes(mark)
    tally("/twilio", crashes=len(crashes))
    assert not crashes, crashes
    got = asyncio.run(full_twilio_call(fronts.ws + "/twilio"))  # a well-formed call still works
    assert any(m["event"] == "media" for m in got) and any(m["event"] == "mark" for m in got)
    assert healthz(fronts)["status"] == "ok"


def post(port: int, body: bytes, path: str = "/v1/chat/completions") -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read(), r.getheader("content-type", "")
    finally:
        conn.close()


def test_fuzz_engine_http(fronts):
    mark = len(fronts.capture.records)

    @LIVE_ENGINE
    @given(st.one_of(hostile_json(ENGINE_BODIES), st.sampled_from(BROKEN)))
    def run(body):
        tally("engine serve", 1)
        status, raw, ctype = post(fronts.engine_port, body.encode("utf-8", "surrogatepass"))
        assert status in (200, 400, 404, 413), (status, body[:200], raw[:300])
        if status != 200:
            err = json.loads(raw)["error"]
            assert err["type"] == "invalid_request_error" and err["message"] and err["code"], err
            tally("engine serve", outcome=f"{status} {err['code']}")
            return
        tally("engine serve", outcome="200")
        if ctype.startswith("text/event-stream"):
            assert raw.endswith(b"data: [DONE]\n\n") or b'"error"' in raw, raw[-200:]
        else:
            assert json.loads(raw)["choices"][0]["message"]["content"] == "Hello there."

    run()
    crashes = fronts.capture.crashes(mark)
    tally("engine serve", crashes=len(crashes))
    assert not crashes, crashes
    status, raw, _ = post(fronts.engine_port, json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == "Hello there."


def test_parse_start_limits_the_system_prompt():
    ok = native.parse_start(json.dumps({"type": "start", "sample_rate": 16000,
                                        "session": {"system_prompt": "é" * 4000}}))
    assert ok["system_prompt"] == "é" * 4000
    for prompt in ("x" * 4001, 5, ["x"]):
        with pytest.raises(native.ProtocolError) as err:
            native.parse_start(json.dumps({"type": "start", "sample_rate": 16000,
                                           "session": {"system_prompt": prompt}}))
        assert err.value.code == "bad_session"
    with pytest.raises(native.ProtocolError) as err:
        native.parse_start('{"type": "start", "sample_rate": 16000, "session": {"system_prompt": "\\udc00"}}')
    assert err.value.code == "bad_json" and "surrogate" in str(err.value)
    assert native.system_prompt_problem("a\ud800", 10)  # for a prompt that did not come through the decoder
    with pytest.raises(native.ProtocolError) as err:
        native.parse_start(json.dumps({"type": "start", "sample_rate": 16000, "session": []}))
    assert err.value.code == "bad_session"


# --- secrets never reach a log line --------------------------------------------------------------------

KEY = "voice-api-key-SECRET-0123456789"
ENGINE_KEY = "engine-api-key-SECRET-9876543210"
TOKEN_SECRET = "token-secret-SECRET-abcdefghijkl"
TWILIO_TOKEN = "twilio-auth-token-SECRET-12345678"


@contextlib.contextmanager
def uvicorn_with_default_logging(app):
    """`app` under uvicorn configured as the servers run it: uvicorn's own logging config (stderr and
    stdout handlers), info level, access log on."""
    import socket
    import threading
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, ws="websockets", log_level="debug", access_log=True))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def test_zz_no_secret_reaches_any_log_line(capfd):
    from engine.decode import DecodeConfig
    from engine.api.server import build_app as engine_app
    from voice.service.server import build_app as voice_app

    config = make_config()
    auth = Auth(keys={"web": KEY}, secret=TOKEN_SECRET.encode(), token_ttl_s=60, twilio_token=TWILIO_TOKEN,
                secret_is_random=False)
    token = auth.issue_token("web")[0]
    signature = base64.b64encode(b"SECRET-signature-bytes-000").decode()
    secrets = [KEY, ENGINE_KEY, TOKEN_SECRET, TWILIO_TOKEN, token, token.rsplit(".", 1)[1], signature]
    saved = {n: list(logging.getLogger(n).handlers) for n in ("uvicorn", "uvicorn.error", "uvicorn.access")}
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    with uvicorn_with_default_logging(voice_app(config, fake_instance(config), auth)) as vport, \
            uvicorn_with_default_logging(engine_app(StandInEngine(), DecodeConfig(max_new_tokens=4),
                                                    {"ops": ENGINE_KEY})) as eport:
        loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.access")]
        for lg in loggers:
            lg.addHandler(handler)
        old_level = logging.getLogger().level
        logging.getLogger().setLevel(logging.DEBUG)
        try:
            async def clients():
                for query in (f"?api_key={KEY}", f"?key={KEY}", f"?token={token}", f"?access_token={KEY}",
                              f"?x=1&API-KEY={KEY}", f"?token={token}&key={KEY}&signature={signature}"):
                    with contextlib.suppress(Exception):
                        async with websockets.connect(f"ws://127.0.0.1:{vport}/ws{query}", open_timeout=10) as ws:
                            await ws.send(VALID_START)
                            await asyncio.wait_for(ws.recv(), 5)
                for headers in ({"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Basic {KEY}"},
                                {"X-Twilio-Signature": signature}):
                    with contextlib.suppress(Exception):
                        async with websockets.connect(f"ws://127.0.0.1:{vport}/twilio?key={KEY}",
                                                      additional_headers=headers, open_timeout=10) as ws:
                            await asyncio.wait_for(ws.recv(), 5)

            asyncio.run(clients())
            for path in (f"/metrics?api_key={KEY}", f"/healthz?token={token}"):
                with contextlib.suppress(Exception):
                    urllib.request.urlopen(f"http://127.0.0.1:{vport}{path}", timeout=10).read()
            for path in (f"/v1/models?api_key={ENGINE_KEY}", f"/v1/models?key={ENGINE_KEY}"):
                conn = http.client.HTTPConnection("127.0.0.1", eport, timeout=10)
                conn.request("GET", path, headers={"Authorization": f"Bearer {ENGINE_KEY}"})
                conn.getresponse().read()
                conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", eport, timeout=10)
            conn.request("POST", f"/v1/chat/completions?api_key={ENGINE_KEY}", body=b"{}",
                         headers={"Authorization": f"Bearer wrong-{ENGINE_KEY}"})
            conn.getresponse().read()
            conn.close()
            # any logger at all, a message, its arguments and a traceback: still redacted
            logging.getLogger("some.library").warning("connecting with %s and %s", KEY, f"token={token}")
            logging.getLogger("voice.session").info(f"auth token is {TWILIO_TOKEN}, secret {TOKEN_SECRET}")
            try:
                raise RuntimeError(f"bad key {ENGINE_KEY}")
            except RuntimeError:
                logging.getLogger("engine.server").exception("failed with Authorization: Bearer %s", KEY)
            time.sleep(0.3)
        finally:
            logging.getLogger().setLevel(old_level)
            for lg in loggers:
                lg.removeHandler(handler)
            for name, handlers in saved.items():  # uvicorn's handlers write to capfd's (closing) streams
                logging.getLogger(name).handlers[:] = handlers
    out, err = capfd.readouterr()
    captured = stream.getvalue() + out + err
    assert captured.count("\n") > 20 and "REDACTED" in captured, captured[:2000]
    assert "/ws?" in captured and "GET /v1/models" in captured  # the access lines are there, redacted
    found = [s for s in secrets if s in captured]
    tally("log lines", captured.count("\n"))
    FUZZ["secrets in logs"] = {"found": len(found)}
    assert not found, [line for line in captured.splitlines() if any(s in line for s in found)][:10]
    print("\nhostile inputs per front:", json.dumps(FUZZ, indent=1))


# --- the one event codec: to_wire / from_wire ------------------------------------------------------

def test_every_event_reads_back_as_itself():
    from voice.events import (Announcement, Clear, Error, LatencyReport, Ready, ReplyDone, ReplyText, SpeechStarted,
                              SpeechStopped, ToolCall, ToolResult, Transcript, TtsAudio, WIRE_TYPES, from_wire)
    events = [Ready(0, 0.0, session_id="s7", sample_rate=24000), SpeechStarted(3, 0.0), SpeechStopped(3, 0.0),
              Transcript(3, 0.0, "ten of clubs", True), ReplyText(3, 0.0, "Sure", 1, 2, 3),
              TtsAudio(3, 0.0, b"", 16000, "Sure."), ReplyDone(3, 0.0, "Sure.", "Sure", True), Clear(3, 0.0),
              LatencyReport(3, 0.0, {"asr": 1.5}, {"first_audio": 600.0}, ["asr"], 612.0),
              Error(3, 0.0, "asr_timeout", "slow", "asr", True), Error(0, 0.0, "bad_frame", "odd length"),
              ToolCall(4, 0.0, "call_1", "calculate", {"expression": "2 + 2"}),
              ToolResult(4, 0.0, "call_1", "calculate", "2 + 2 = 4", "ok", 0.3),
              Announcement(4, 0.0, "Your timer is done."),
              SpeechStarted(5, 0.0, 4), Transcript(5, 0.0, "ten of clubs and more", True, 4)]  # a resumed turn
    assert {type(e) for e in events} == set(WIRE_TYPES.values())
    assert "resumes" not in SpeechStarted(3, 0.0).to_wire() and "resumes" not in events[3].to_wire()  # only when set
    for ev in events:
        assert from_wire(ev.to_wire()) == ev


@pytest.mark.parametrize("body, complaint", [
    ({"type": "surprise"}, "not an event"), (["a list"], "not an event"), ({"turn": 1}, "not an event"),
    ({"type": "transcript", "turn": 1}, "without text, final"),
    ({"type": "transcript", "turn": 1, "text": 5, "final": True}, "text should be str"),
    ({"type": "reply_done", "turn": "1", "text": "", "heard": "", "interrupted": False}, "turn should be an int"),
    ({"type": "latency", "turn": 1, "stages_ms": [], "marks_ms": {}, "over_budget": [], "voice_to_voice_ms": None},
     "stages_ms should be dict"),
])
def test_malformed_events_are_refused_by_name(body, complaint):
    from voice.events import from_wire
    with pytest.raises(ValueError, match=complaint):
        from_wire(body)


def test_fields_a_newer_server_adds_are_ignored():
    from voice.events import Clear, from_wire
    assert from_wire({"type": "clear", "turn": 2, "reason": "barge-in"}) == Clear(2, 0.0)
