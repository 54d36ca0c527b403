"""Regression tests for the second adversarial run (issue 41): one test per defect, each failing
before its fix. Stand-in models only (tests/fakes.py); `engine serve` is its real app around a
stand-in engine.

* item 5: `engine serve` answered 500 to a `tool_choice` whose `function` is not an object, to a
  JSON schema llguidance gives up on once decoding starts (a recursive `$ref`: "Too many items"),
  and logged a client that left mid-body as a 500 with a traceback.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time

import pytest

from fakes import EncodingEngine
from liveserver import serving

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]

HELLO = {"messages": [{"role": "user", "content": "hello"}]}


def post(port: int, body: dict | bytes) -> tuple[int, dict | str]:
    """(status, the JSON body, or the raw text of an event stream)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=raw, headers={"content-type": "application/json"})
        r = conn.getresponse()
        text = r.read().decode()
        if r.getheader("content-type", "").startswith("text/event-stream"):
            return r.status, text
        return r.status, json.loads(text or "{}")
    finally:
        conn.close()


class GivesUpEngine(EncodingEngine):
    """As the real engine with a schema llguidance cannot follow: the grammar compiles, then its
    matcher stops with "Too many items" at the first token (after `late` pieces)."""

    late = 0

    class tokenizer:
        @staticmethod
        def token_id(text):
            return None  # the tool-call tags as text

    async def stream(self, messages, cfg, conversation, constraint=None, tools=None, deadline=None):
        from engine.grammar import GrammarError
        from engine.stream import Piece
        if constraint is not None:
            for i in range(self.late):
                yield Piece("{", [i], 1, i + 1, i + 1, 1.0, 2.0, False, None, 3, 3)
            raise GrammarError("token 39428 is not allowed here: parser error: Too many items (limit 50000; "
                               "ff_tokens)\n<state>...</state>")
        async for piece in super().stream(messages, cfg, conversation):
            yield piece

    class grammars:
        @staticmethod
        def json(schema):
            return object()

        lark = json


@pytest.fixture(scope="module")
def engine():
    from engine.api.server import build_app
    from engine.decode import DecodeConfig
    stand_in = GivesUpEngine()
    with serving(build_app(stand_in, DecodeConfig(max_new_tokens=8))) as port:
        yield stand_in, port


def still_answers(port: int) -> None:
    status, answer = post(port, HELLO)
    assert status == 200 and answer["choices"][0]["message"]["content"] == "Hello there."


def assert_400(status, answer, param=None) -> None:
    assert status == 400, (status, answer)
    assert isinstance(answer, dict) and answer["error"]["type"] == "invalid_request_error", answer
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    if param is not None:
        assert answer["error"]["param"] == param, answer


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": 5}, {"type": "function", "function": "f"}, {"type": "function", "function": []},
    {"type": "function", "function": {"name": 5}}, {"type": "function", "function": {"name": ["f"]}},
    {"type": "function"}, {"function": {"name": "f"}}, {}, 5, ["f"],
])
def test_a_tool_choice_of_the_wrong_shape_is_400(engine, choice):
    _, port = engine
    assert_400(*post(port, {**HELLO, "tools": TOOLS, "tool_choice": choice}), "tool_choice")
    still_answers(port)


SCHEMA = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#/$defs/a", "$defs": {
    "a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}}}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("what", ["response_format", "tools"])
def test_a_grammar_that_gives_up_while_decoding_is_400_not_500(engine, stream, what, caplog):
    stand_in, port = engine
    stand_in.late = 0
    body = {**HELLO, "stream": stream, **({"response_format": SCHEMA} if what == "response_format" else
                                          {"tools": TOOLS, "tool_choice": "required"})}
    with caplog.at_level(logging.INFO):
        status, answer = post(port, body)
    assert_400(status, answer, what)
    assert "Too many items" in answer["error"]["message"] and "<state>" not in answer["error"]["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    still_answers(port)


def test_a_grammar_that_gives_up_after_the_first_chunk_is_reported_in_band_as_400(engine, caplog):
    stand_in, port = engine
    stand_in.late = 1
    try:
        status, text = post(port, {**HELLO, "stream": True, "response_format": SCHEMA})
    finally:
        stand_in.late = 0
    assert status == 200 and isinstance(text, str)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["content"] == "{"
    assert events[-1]["error"]["type"] == "invalid_request_error" and events[-1]["error"]["param"] == "response_format"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_client_that_leaves_mid_body_is_not_a_500(engine, caplog):
    _, port = engine
    with caplog.at_level(logging.INFO, logger="engine.server"):
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"messages\": [")
            time.sleep(0.1)
            s.close()
        deadline = time.monotonic() + 5
        while len([r for r in caplog.records if " POST " in r.getMessage()]) < 3:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if " POST " in r.getMessage()]
    assert all(" 499 " in line and "client_disconnected" in line for line in lines), lines
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    still_answers(port)


# --- item 4: request options checked against what the loaded model runs -------------------------

def test_options_are_checked_against_what_the_model_runs():
    """Issue 41, item 4: `"block_size": 6` on `default` (a draft head of block 4) wedged the engine.
    One check (`check_runnable`) of the resolved config against the model, for every request."""
    from engine.api.requests import APIError, Runs, parse_request
    from engine.decode import DecodeConfig
    head, llama = Runs(draft_block=4, mask_blocks=True), Runs(draft_block=None, mask_blocks=False)

    def parse(runs, **extra):
        return parse_request({**HELLO, **extra}, DecodeConfig(), 2048, runs=runs)[1]

    for bad in (5, 6, 64, 2048):
        with pytest.raises(APIError) as err:
            parse(head, block_size=bad)
        assert err.value.status == 400 and err.value.param == "block_size" and "at most 4" in err.value.message
    assert [parse(head, block_size=n).block_size for n in (0, 1, 4)] == [0, 1, 4]
    assert parse(head, block_size=6, mode="ar").mode == "ar"  # AR drafts nothing: nothing to refuse
    assert parse(head, block_size=6, rule="threshold").block_size == 6  # a mask block, not a draft
    for rule in ("threshold", "topk"):
        with pytest.raises(APIError) as err:
            parse(llama, rule=rule)
        assert err.value.status == 400 and err.value.param == "rule"
    assert parse(llama, rule="threshold", mode="ar").mode == "ar"
    assert parse(llama, block_size=64).block_size == 64  # prompt lookup drafts what it finds


class DraftHeadEngine(EncodingEngine):
    """The stand-in, loaded as `default` is: the PyTorch model with a draft head of block 4."""

    class loaded:
        class drafter:
            block = 4

        class model:
            mask_blocks = False  # and no mask blocks either (the `topk` request)


@pytest.mark.parametrize("extra", [{"block_size": 6}, {"block_size": 5, "stream": True}, {"rule": "topk"}])
def test_engine_serve_refuses_options_the_model_cannot_run(extra):
    from engine.api.server import build_app
    from engine.decode import DecodeConfig
    with serving(build_app(DraftHeadEngine(), DecodeConfig(max_new_tokens=8))) as port:
        assert_400(*post(port, {**HELLO, **extra}), next(iter(extra)))
        still_answers(port)


# --- item 6: read deadlines on the HTTP servers ------------------------------------------------

def open_fds() -> int:
    import os
    return len(os.listdir("/proc/self/fd"))


def unfinished_heads(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n")  # never the blank line
        socks.append(s)
    return socks


@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "keep_alive_only"])
def test_300_unfinished_request_heads_are_not_held(guard):
    """Issue 41, item 6: 300 connections that never finish their headers held 300 fds for good.
    uvicorn's `timeout_keep_alive` does not help (its timer starts after a first response): the
    guard (engine.common.deadlines) closes them at the head deadline, with a 408."""
    from engine.common.deadlines import guarded_http
    from fakes import fake_instance, make_config
    from liveserver import Served
    from voice.service.server import build_app
    config = make_config()
    options = {"http": guarded_http(head_s=3.0, body_s=3.0)} if guard else {"timeout_keep_alive": 1}
    with Served(build_app(config, fake_instance(config)), **options) as srv:
        time.sleep(0.3)
        baseline = open_fds()
        socks = unfinished_heads(srv.port, 300)
        held_by = time.monotonic() + 2.5  # within the 3 s deadline; a loaded machine accepts them slowly
        while (during := open_fds() - 300) < baseline + 290 and time.monotonic() < held_by:  # less our 300
            time.sleep(0.1)
        time.sleep(4.0)
        after = open_fds() - 300
        answers = []
        for s in socks[:5]:
            s.settimeout(0.5)
            try:
                answers.append(s.recv(100))
            except OSError:
                answers.append(b"")
        for s in socks:
            s.close()
        still = urllib_get(srv.port, "/healthz")
    print(f"fds: baseline {baseline}, with 300 unfinished heads {during}, past the deadline {after}")
    assert during >= baseline + 290  # the server holds them while they are within the deadline
    if guard:
        assert after <= baseline + 5, (baseline, after)
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers
    else:
        assert after >= baseline + 290  # what the issue measured: held, past any keep-alive timeout
    assert still == 200


def urllib_get(port: int, path: str) -> int:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.status


def test_a_stalled_body_is_cut_at_the_body_deadline_and_the_app_hears_a_disconnect(caplog):
    from engine.api.server import build_app
    from engine.common.deadlines import guarded_http
    from engine.decode import DecodeConfig
    from liveserver import Served
    with Served(build_app(EncodingEngine(), DecodeConfig(max_new_tokens=8)),
                http=guarded_http(head_s=5.0, body_s=0.5)) as srv, caplog.at_level(logging.INFO):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.settimeout(5)
        t0 = time.monotonic()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"messages\": [")
        answer = s.recv(200)
        assert s.recv(100) == b""  # closed
        waited = time.monotonic() - t0
        s.close()
        assert answer.startswith(b"HTTP/1.1 408 ") and 0.4 < waited < 3.0, (answer, waited)
        deadline = time.monotonic() + 5
        while not any(" 499 " in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        # a whole request, slower than nothing but within its deadlines, and a kept-alive second one
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        for _ in range(2):
            conn.request("POST", "/v1/chat/completions", body=json.dumps(HELLO).encode(),
                         headers={"content-type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["choices"][0]["message"]["content"] == "Hello there."
            time.sleep(0.8)  # longer than body_s between requests: the deadline is per request, not idle time
        conn.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


def test_a_websocket_outlives_the_head_deadline():
    import asyncio

    import websockets

    from engine.common.deadlines import guarded_http
    from fakes import fake_instance, make_config
    from liveserver import Served
    from voice.service.server import build_app
    config = make_config()
    with Served(build_app(config, fake_instance(config)), http=guarded_http(head_s=0.3, body_s=0.3)) as srv:
        async def talk():
            async with websockets.connect(f"{srv.ws}/ws") as ws:
                await ws.send(json.dumps({"type": "start", "sample_rate": 16000}))
                first = json.loads(await ws.recv())
                await asyncio.sleep(1.0)  # past both deadlines
                await ws.send(json.dumps({"type": "ping"}))
                await asyncio.sleep(0.2)
                return first, ws.close_code
        first, code = asyncio.run(talk())
    assert first["type"] == "ready" and code is None


def test_both_servers_run_with_the_read_deadlines(monkeypatch):
    import uvicorn

    from engine.api import server as engine_server
    from engine.common.deadlines import HEAD_S
    from voice.service import server as voice_server
    seen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.append(self.config.http))
    voice_server.serve(make_config_for_serve())
    from engine.decode import DecodeConfig

    class Loaded(EncodingEngine):
        defaults = DecodeConfig()

        class loaded:
            weights, drafter = "stand-in", None

            class model:
                mask_blocks = False

    monkeypatch.setattr(engine_server.Engine, "load", classmethod(lambda cls, *a, **k: Loaded()))
    with pytest.raises(SystemExit):  # the stand-in never "started": serve says so, after running
        engine_server.serve("stand-in", None, "127.0.0.1", 0, DecodeConfig())
    assert len(seen) == 2 and all(isinstance(h, type) and h.__name__.startswith("Guarded") for h in seen), seen
    assert HEAD_S <= 10


def make_config_for_serve():
    from fakes import make_config
    return make_config()


# --- item 7: the webhook allow-list on parsed URLs ----------------------------------------------

ALLOW = ["https://home.example.com/api/", "http://10.0.0.5:8123/hooks"]


@pytest.mark.parametrize("url", [
    "https://home.example.com/api/../admin", "https://home.example.com/api/%2e%2e/admin",
    "https://home.example.com/api/%2E%2e/admin", "https://home.example.com/api/./x",
    "https://home.example.com/api-private/x", "https://home.example.com/apix",
    "https://user@home.example.com/api/x", "https://home.example.com:443@evil.com/api/x",
    "https://home.example.com\\@evil.com/api/x", "https://home.example.com:8443/api/x",
    "https://home.example.com:443.evil.com/api/x", "https://home.example.com:x/api/x",
    "https://home.example.com:99999/api/x", "https://home.example.com.evil.com/api/x",
    "https://home.example.com /api/x", "https://home.example.com/api /x", "https://home.example.com/api/x\t",
    "https://home.example.com/api%2fx", "https://home.example.com/api//x", "http://home.example.com/api/x",
    "https://home.example.com/API/x", "http://10.0.0.5:812/hooks/x", "http://10.0.0.5:81234/hooks/x",
    "http://10.0.0.5/hooks/x", "http://10.0.0.5:8123/hooks-x", "https://hоme.example.com/api/x",  # Cyrillic о
    "https://home.example.com/api/x#@evil.com",  # a fragment: found by the adversarial pass
])
def test_a_webhook_outside_the_allow_list_by_url_tricks_stops_start_up(url):
    """Issue 41, item 7: string prefixes let `..`, `/api-private`, `user@host`, ports and spaces out."""
    from voice.config import ToolsConfig
    with pytest.raises(ValueError, match="tools.webhooks.hook"):
        ToolsConfig(webhook_allow=ALLOW, webhooks=[{"name": "hook", "url": url}])


@pytest.mark.parametrize("url", [
    "https://home.example.com/api/lights", "https://home.example.com/api", "https://home.example.com/api/",
    "https://HOME.example.com:443/api/x?room=1", "https://home.example.com./api/x",
    "http://10.0.0.5:8123/hooks", "http://10.0.0.5:8123/hooks/a/b%20c",
])
def test_a_webhook_under_the_allow_list_is_accepted(url):
    from voice.config import ToolsConfig
    assert ToolsConfig(webhook_allow=ALLOW, webhooks=[{"name": "hook", "url": url}]).webhooks[0].url == url


@pytest.mark.parametrize("allow", ["https://u@home.example.com/", "https://home.example.com/a/../b", "ftp://h/",
                                   "https://home.example.com:x/"])
def test_an_allow_list_entry_that_reads_two_ways_is_refused(allow):
    from voice.config import ToolsConfig
    with pytest.raises(ValueError, match="tools.webhook_allow"):
        ToolsConfig(webhook_allow=[allow])


# --- item 8: /ws refusals say why first; tool failures in words ----------------------------------

WS_KEY = "web-key-0123456789abcdef"


@pytest.mark.parametrize("query,headers,code", [
    (f"?token={WS_KEY}", {}, "bad_token"),  # an API key passed as a token
    (f"?token=web:{WS_KEY}", {}, "bad_token"),
    ("", {"Authorization": "Basic d2ViOndlYi1rZXktMDEyMzQ1Njc4OWFiY2RlZg=="}, "unauthorized"),
    ("", {"Authorization": f"Basic {WS_KEY}"}, "unauthorized"),
    ("", {"Authorization": "Bearer"}, "unauthorized"),
    (f"?api_key={WS_KEY}", {}, "unauthorized"),
    ("?token=v1.d2Vi.1.x", {}, "bad_token"),
])
def test_a_refused_websocket_gets_the_error_event_before_1008(query, headers, code):
    import asyncio

    import websockets

    from fakes import LiveServer, fake_instance, make_config
    from voice.service.auth import Auth
    config = make_config()

    async def refused(url):
        async with websockets.connect(url, additional_headers=headers) as ws:
            try:  # a client that does not wait (the close may beat its start: then only reading is left)
                await ws.send(json.dumps({"type": "start", "sample_rate": 16000}))
            except websockets.ConnectionClosed:
                pass
            got = []
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    got.append(json.loads(await asyncio.wait_for(ws.recv(), 5)))
            return got, ws.close_code, ws.close_reason

    with LiveServer(config, fake_instance(config), Auth(keys={"web": WS_KEY})) as srv:
        got, close_code, reason = asyncio.run(refused(f"{srv.ws}/ws{query}"))
    assert [e["type"] for e in got] == ["error"] and got[0]["code"] == code and got[0]["message"], got
    assert close_code == 1008 and reason == code


@pytest.mark.parametrize("expression,says", [
    ("*".join(["10**100"] * 45), "too large"),  # was ValueError: Exceeds the limit (4300 digits) ...
    ("10**100*10**100/1e-300", "too large"),  # was "= inf"
    ("1e308*10", "too large"),
    ("(-8)**0.5", "no real"),  # was a complex number
    ("99**99*99**99*99**99", "too large"),
    ("1e999", "too large"),  # infinity as written (found by the adversarial pass)
])
def test_the_calculator_answers_in_words_not_python(expression, says):
    from voice.pipeline.tools import ToolError, calculate
    with pytest.raises(ToolError) as err:
        calculate(expression)
    text = str(err.value)
    assert says in text and "Error" not in text and "sys." not in text and "inf" not in text


def test_a_failing_tool_is_reported_to_the_model_without_python_text():
    import asyncio

    from voice.config import ToolsConfig
    from voice.pipeline.tools import Timers, Toolbox, ToolRun
    box = Toolbox(ToolsConfig(builtin=["calculator"]))

    async def broken(args, timers):
        raise KeyError("internal detail /srv/secret/path")

    box.tools["calculate"].run = broken
    run = ToolRun("c1", "calculate", {"expression": "1+1"})

    async def call():
        await box.run(run, Timers(lambda text: asyncio.sleep(0)))

    asyncio.run(call())
    assert run.status == "error" and "KeyError" not in run.result and "secret" not in run.result, run.result
    assert run.result == "the calculate tool failed on the server"


# --- item 2: max_utterance_s bounds a resumed utterance ------------------------------------------

def test_resuming_again_and_again_cannot_grow_an_utterance_past_max_utterance_s():
    """Issue 41, item 2: talking with short pauses resumed the utterance each time; its audio (and
    ASR time) grew to 104 s against a 30 s limit. The carried audio counts towards the limit."""
    from fakes import FakeWhisper, make_config, speech
    from voice.pipeline.endofturn import Verdict
    from voice.events import SpeechStarted
    from voice.conversation.turns import Pause, TooLong, TurnTaker
    limit = 6.0
    taker = TurnTaker(make_config(turn={"policy": "smart_turn", "resume_ms": 3000},
                                  limits={"max_utterance_s": limit}), FakeWhisper(), 16000, "t")
    words = speech("001.wav")
    frame = 640

    async def talk(rounds: int):
        events, longest = [], 0.0
        for _ in range(rounds):
            pcm = words + bytes(int(0.6 * 16000) * 2)
            for i in range(0, len(pcm), frame):
                now = time.monotonic()
                for ev in taker.push(pcm[i:i + frame], now):
                    events.append(ev)
                    if isinstance(ev, Pause):
                        events += taker.verdict(ev.pause, Verdict(True, 200), now)
                longest = max(longest, len(taker.transcriber.audio()) / 16000)
        return events, longest

    events, longest = asyncio_run(talk(12))  # ~12 x (1.5-3 s of speech + 0.6 s of pause)
    assert any(isinstance(e, SpeechStarted) and e.resumed for e in events)  # resuming still works
    assert any(isinstance(e, TooLong) for e in events)
    assert longest <= limit + 1.0, longest  # the VAD's frame and pre-roll of slack, never the sum of the halves


def asyncio_run(coro):
    import asyncio
    return asyncio.run(coro)


# --- the third adversarial pass (bench/hostile_pass.py) --------------------------------------------

def test_a_websocket_upgrade_with_a_non_ascii_header_is_not_a_500():
    """uvicorn's legacy websockets protocol re-encoded the headers as latin-1 and answered 500."""
    from fakes import fake_instance, make_config
    from liveserver import Served
    from voice.service.server import build_app
    config = make_config()
    with Served(build_app(config, fake_instance(config))) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as conn:
            conn.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                         + "X-Junk: \u00e9\r\nOrigin: http://\u202eevil\r\n\r\n".encode())
            status = conn.recv(200).split(b"\r\n")[0]
    assert status == b"HTTP/1.1 101 Switching Protocols", status


def test_a_tiny_temperature_samples_the_likeliest_token_instead_of_failing():
    """A temperature of 5e-324 (valid: 0 to 2) divided the logits into inf and nan: a 500."""
    import torch

    from engine.decode import pick
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, -1.0, 5.0]])
    for temperature in (5e-324, 1e-40, 1e-30):  # under float32's range, denormal, and small
        token, probability = pick(logits, temperature, torch.Generator().manual_seed(0))
        assert token.tolist() == [1, 2] and probability.tolist() == [1.0, 1.0], temperature


def test_ctrl_c_stops_engine_serve_without_a_traceback():
    """uvicorn shuts down gracefully on SIGINT and then raises it again: the CLI printed a traceback."""
    import signal
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = Path(sys.executable).parent / "engine"
    # As from a terminal: Ctrl-C not ignored. A suite started in the background of a shell without job control
    # (`nohup ./dev test &`) has SIGINT ignored, its children inherit that, uvicorn's re-raise is then ignored
    # too and the server exits 0, not 130; so SIGINT is set back to its default before `engine` is exec'd.
    command = [str(engine), "serve", "--model", "small", "--port", str(port)]
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
                             "signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])", *command],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "engine serve did not start"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in out, out[-3000:]
