"""Tools in the voice loop (voice/pipeline/tools.py), on the real app with stand-in models (tests/fakes.py).

The built-ins are tested as they are; webhooks call a real HTTP server on loopback (Starlette
under uvicorn) that records what it was sent. The stand-in LM is scripted to call tools, so
what is tested here is everything around the model: the calls run (pure ones during a
speculation, webhooks only once the turn is real), the filler, barge-in cancelling a call,
events, the latency report's `tool` stage and the call records. The real model answering
"what time is it" from the tool is in tests/test_tools_live.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sqlite3
import threading
import time
import tracemalloc
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, StreamingResponse
from starlette.routing import Route

from engine.common.keys import ConfigError
from engine.common.redact import redact
from fakes import Client, LiveServer, fake_instance, make_config, speech
from liveserver import serving
from voice.service import records as rec
from voice.config import ToolsConfig, load_config
from voice.service.records import read_sessions
from voice.pipeline.tools import CUT_NOTE, Timers, Toolbox, ToolError, ToolRun, calculate, with_results

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]


BUILT_INS = ["time", "timer", "calculator"]


def call(name: str, arguments: dict | None = None, id: str = "call_1") -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments or {})}}


def run_tool(box: Toolbox, name: str, arguments: dict | None = None, timers: Timers | None = None) -> ToolRun:
    async def go():
        run = ToolRun.of(call(name, arguments))
        await box.run(run, timers or Timers(lambda text: asyncio.sleep(0)))
        await box.aclose()
        return run
    return asyncio.run(go())


# --- the built-ins --------------------------------------------------------------------------

@pytest.mark.parametrize("expression, result", [
    ("17 * 23", "391"), ("17 x 23", "391"), ("2^10", "1024"), ("1250 / 5", "250"), ("3.5 + 4.25", "7.75"),
    ("(2 + 3) * 4", "20"), ("10 / 3", "3.33333"), ("1,000 * 3", "3000"), ("-7 % 3", "2")])
def test_calculator_does_arithmetic(expression, result):
    assert calculate(expression) == f"{expression} = {result}"


@pytest.mark.parametrize("expression", ['__import__("os").system("true")', "open('x')", "a + 1", "9 ** 9 ** 9",
                                        "1 / 0", "2 +"])
def test_calculator_refuses_what_is_not_plain_arithmetic(expression):
    with pytest.raises(ToolError):
        calculate(expression)


def test_time_tool_tells_the_time_in_the_configured_zone():
    box = Toolbox(ToolsConfig(builtin=BUILT_INS, time_zone="Asia/Kolkata"))
    before = datetime.now(ZoneInfo("Asia/Kolkata"))
    run = run_tool(box, "get_time")
    after = datetime.now(ZoneInfo("Asia/Kolkata"))
    assert run.status == "ok" and "IST" in run.result, run
    clocks = {f"{t.hour % 12 or 12}:{t.minute:02d} {'AM' if t.hour < 12 else 'PM'}" for t in (before, after)}
    assert any(run.result.startswith(c) for c in clocks), (run.result, clocks)
    assert f"{after:%A}" in run.result and str(after.year) in run.result


def test_a_timer_speaks_up_when_it_is_due():
    said = []

    async def go():
        timers = Timers(lambda text: asyncio.sleep(0, said.append((time.monotonic(), text))))
        box = Toolbox(ToolsConfig(builtin=BUILT_INS))
        start = time.monotonic()
        run = ToolRun.of(call("set_timer", {"seconds": 1, "label": "tea"}))
        await box.run(run, timers)
        await asyncio.sleep(1.5)
        return start, run
    start, run = asyncio.run(go())
    assert run.status == "ok" and "1 second timer is set for tea" in run.result, run
    assert [text for _, text in said] == ["Your tea timer is done."]
    assert 0.95 < said[0][0] - start < 1.4


@pytest.mark.parametrize("arguments, why", [({"seconds": 0}, "seconds"), ({"seconds": "ten"}, "seconds"),
                                            ({"seconds": True}, "seconds"), ({}, "seconds")])
def test_bad_tool_arguments_are_an_error_for_the_model_not_a_crash(arguments, why):
    run = run_tool(Toolbox(ToolsConfig(builtin=BUILT_INS)), "set_timer", arguments)
    assert run.status == "error" and why in run.result, run


def test_unknown_tool_and_arguments_that_are_not_an_object():
    box = Toolbox(ToolsConfig(builtin=BUILT_INS))
    assert run_tool(box, "launch_rockets").status == "error"
    run = ToolRun.of({"id": "c", "function": {"name": "get_time", "arguments": "[1, 2"}})
    asyncio.run(box.run(run, Timers(lambda text: asyncio.sleep(0))))
    assert run.status == "error" and "JSON object" in run.result


def test_results_are_folded_into_the_users_message():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "What time is it?"}]
    ok, failed = ToolRun("a", "get_time", {}, "3:47 PM", "ok"), ToolRun("b", "lights", {}, "HTTP 500", "error")
    out = with_results(messages, [ok, failed])
    assert out[0] == messages[0] and messages[1]["content"] == "What time is it?"  # not changed in place
    assert out[1]["content"] == "What time is it?\n\n(Result of get_time: 3:47 PM; lights failed: HTTP 500)"


# --- webhooks, against a real HTTP server ---------------------------------------------------

CHUNK = b"sunny " * 10923  # 64 KiB
ENDLESS_BYTES = 256 * 1024 * 1024  # "endless": it ends only so that a client without a bound ends too


class Hooks:
    """A loopback HTTP server that records every request, answers per path, and notices
    requests whose client went away before the answer (barge-in)."""

    def __init__(self):
        self.requests: list[dict] = []
        self.cancelled = threading.Event()

        async def weather(request: Request):
            self.requests.append({"path": "/weather", "json": await request.json(),
                                  "auth": request.headers.get("authorization")})
            delay = float(request.query_params.get("delay", 0))
            try:
                await asyncio.sleep(delay)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            if delay and await request.is_disconnected():
                self.cancelled.set()
            return PlainTextResponse(f"Sunny and 21 degrees in {(await request.json()).get('city')}")

        async def broken(request: Request):
            self.requests.append({"path": "/broken"})
            return PlainTextResponse("no", status_code=500)

        async def elsewhere(request: Request):
            self.requests.append({"path": "/redirect"})
            return RedirectResponse("http://example.invalid/steal", status_code=307)

        async def endless(request: Request):
            async def body():
                for _ in range(ENDLESS_BYTES // len(CHUNK)):
                    yield CHUNK
            return StreamingResponse(body(), media_type="text/plain")

        async def trickle(request: Request):
            async def body():
                for _ in range(100):
                    await asyncio.sleep(0.1)
                    yield b"."
            return StreamingResponse(body(), media_type="text/plain")

        self.app = Starlette(routes=[Route("/weather", weather, methods=["POST"]),
                                     Route("/broken", broken, methods=["POST"]),
                                     Route("/redirect", elsewhere, methods=["POST"]),
                                     Route("/endless", endless, methods=["POST"]),
                                     Route("/trickle", trickle, methods=["POST"])])


@pytest.fixture(scope="module")
def hooks():
    h = Hooks()
    with serving(h.app) as port:
        h.base = f"http://127.0.0.1:{port}"
        yield h


def webhook_config(base: str, path: str = "/weather", **extra) -> ToolsConfig:
    return ToolsConfig(builtin=[], webhook_allow=[base + "/"], webhooks=[{
        "name": "get_weather", "description": "The weather in a city today.", "url": base + path,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        **extra}])


def test_a_webhook_gets_the_arguments_and_its_secret_from_the_environment(hooks, monkeypatch):
    monkeypatch.setenv("WEATHER_TOKEN", "Bearer s3cret")
    box = Toolbox(webhook_config(hooks.base, headers_env={"Authorization": "WEATHER_TOKEN"}))
    run = run_tool(box, "get_weather", {"city": "Paris"})
    assert run.status == "ok" and run.result == "Sunny and 21 degrees in Paris", run
    assert hooks.requests[-1] == {"path": "/weather", "json": {"city": "Paris"}, "auth": "Bearer s3cret"}
    assert box.openai() == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city today.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_webhook_failures_are_results_the_model_can_speak_about(hooks, monkeypatch):
    monkeypatch.delenv("WEATHER_TOKEN", raising=False)
    cases = [(webhook_config(hooks.base, "/weather?delay=2", timeout_s=0.3), "did not answer within 0.3 s"),
             (webhook_config(hooks.base, "/broken"), "answered HTTP 500"),
             (webhook_config(hooks.base, "/redirect"), "answered HTTP 307"),  # never followed off the allow-list
             (webhook_config(hooks.base, headers_env={"Authorization": "WEATHER_TOKEN"}), "secret is missing"),
             (webhook_config("http://127.0.0.1:9"), "could not be reached")]
    for config, why in cases:
        run = run_tool(Toolbox(config), "get_weather", {"city": "Oslo"})
        assert run.status == "error" and why in run.result, (why, run)
        assert run.ms < 1500, run
    assert "/steal" not in str(hooks.requests)


def test_the_timeout_bounds_the_whole_call_and_the_body_is_read_only_as_far_as_the_model_reads(hooks):
    """A body that trickles a byte every 0.1 s for 10 s, and one of 256 MiB: the first is cut at
    `timeout_s`, the second read only up to what the model is given (it was read for 28 s, 1.5 GB)."""
    trickle = run_tool(Toolbox(webhook_config(hooks.base, "/trickle", timeout_s=1.0)), "get_weather", {"city": "Oslo"})
    assert trickle.status == "error" and "did not answer within 1 s" in trickle.result and trickle.ms < 1500, trickle
    tracemalloc.start()
    try:
        endless = run_tool(Toolbox(webhook_config(hooks.base, "/endless", timeout_s=5.0)), "get_weather",
                           {"city": "Oslo"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert endless.status == "ok" and endless.ms < 1500, (endless.status, endless.ms)
    assert endless.result == (CHUNK.decode()[:1000] + CUT_NOTE)
    assert peak < 16 * 1024 * 1024, peak


@pytest.mark.parametrize("secret", ["Bearer s\u00e9cret-token-1234", "Bearer s3cret-token\r\nX-Injected: 1"])
def test_a_secret_http_cannot_carry_stops_start_up_without_being_shown(hooks, monkeypatch, caplog, capsys, secret):
    """A non-ASCII secret once failed each call with a UnicodeEncodeError that quoted it into the log."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("WEATHER_TOKEN", secret)
    with pytest.raises(ConfigError, match="WEATHER_TOKEN") as failed:
        Toolbox(webhook_config(hooks.base, headers_env={"Authorization": "WEATHER_TOKEN"}))
    shown = str(failed.value) + caplog.text + "".join(capsys.readouterr())
    assert "cret-token" not in shown, shown


def test_webhook_secrets_are_redacted_from_every_log_line(hooks, monkeypatch):
    monkeypatch.setenv("WEATHER_TOKEN", "Token 9f8e7d6c5b4a-weather")
    Toolbox(webhook_config(hooks.base, headers_env={"X-Weather": "WEATHER_TOKEN"}))
    assert redact("sent 9f8e7d6c5b4a-weather, Token 9f8e7d6c5b4a-weather") == "sent REDACTED, REDACTED"


@pytest.mark.parametrize("values, why", [
    ({"builtin": ["time", "weather"]}, "unknown tool"),
    ({"time_zone": "Mars/Olympus"}, "not a known time zone"),
    ({"webhook_allow": ["https://ok.example/"], "webhooks": [{"name": "x", "url": "https://evil.example/x"}]},
     "not under any of tools.webhook_allow"),
    ({"webhooks": [{"name": "x", "url": "https://a.example/x"}]}, "empty"),
    ({"webhook_allow": ["https://a/"], "webhooks": [{"name": "get_time", "url": "https://a/x"}]}, "built-in"),
    ({"webhook_allow": ["https://a/"], "webhooks": [{"name": "x", "url": "https://a/x", "secret": "s"}]},
     "unknown option"),
    ({"webhook_allow": ["https://a/"], "webhooks": [{"name": "x", "url": "ftp://a/x"}]}, "http"),
    ({"webhook_allow": ["https://a/"], "webhooks": [{"name": "x", "url": "https://a/x"}] * 2}, "same name"),
])
def test_tool_config_mistakes_are_caught_at_start_up(tmp_path, values, why):
    path = tmp_path / "voice.toml"
    lines = ["[tools]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items() if k != "webhooks"]
    for hook in values.get("webhooks", []):
        lines += ["[[tools.webhooks]]"] + [f"{k} = {json.dumps(v)}" for k, v in hook.items()]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=why):
        load_config(path)


def test_tools_are_off_by_default_and_the_built_ins_are_three():
    assert Toolbox(load_config(None).tools).openai() == []
    assert [t["function"]["name"] for t in Toolbox(ToolsConfig(builtin=BUILT_INS)).openai()] \
        == ["get_time", "set_timer", "calculate"]


# --- in a session ---------------------------------------------------------------------------

def one_turn(srv, clip: str = "001.wav", until=lambda m: m["type"] == "latency", timeout: float = 20):
    async def scenario():
        c = await Client.open(srv.ws + "/ws")
        c.listen(speed=3.0)
        c.say(speech(clip))
        await c.wait(until, timeout)
        await asyncio.sleep(0.3)  # the audio of what was awaited
        await c.shut()
        return c
    return asyncio.run(scenario())


def test_without_tools_the_lm_is_offered_none():
    instance = fake_instance(make_config())
    instance.lm.tool_calls = [call("get_time")]  # would be called if offered
    with LiveServer(instance.config, instance) as srv:
        c = one_turn(srv)
    assert [tools for _, tools in instance.lm.asked] == [None] and not c.events("tool_call")
    assert c.events("reply_done")[0]["text"] == "Sure, here is a short reply."


def test_a_tool_turn_calls_the_tool_then_speaks_the_answer_and_is_recorded(tmp_path):
    config = make_config(records={"path": str(tmp_path / "records.sqlite3")},
                         tools={"time_zone": "UTC", "builtin": BUILT_INS})
    instance = fake_instance(config)
    instance.lm.tool_calls = [call("get_time")]
    instance.lm.blocks = ["It is", " a quarter to four."]
    with LiveServer(config, instance) as srv:
        c = one_turn(srv)
    kinds = [m["type"] for m in c.events() if m["type"] in ("tool_call", "tool_result", "reply", "reply_done")]
    assert kinds == ["tool_call", "tool_result", "reply", "reply", "reply_done"], kinds
    result = c.events("tool_result")[0]
    assert result["name"] == "get_time" and result["status"] == "ok" and "UTC" in result["result"], result
    assert c.events("reply_done")[0]["text"] == "It is a quarter to four."
    # the model was offered the tools, then asked again with the result in the user's message
    (first, offered), (second, none) = instance.lm.asked
    assert [t["function"]["name"] for t in offered] == ["get_time", "set_timer", "calculate"] and none is None
    assert second[-1]["content"] == f"{first[-1]['content']}\n\n(Result of get_time: {result['result']})"
    latency = c.events("latency")[0]
    assert latency["stages_ms"]["tool"] >= 0 and "tool_call" in latency["marks_ms"], latency
    turn = read_sessions(config.records.path)[0]["turns"][0]
    assert turn["status"] == "ok" and turn["tools"] == [{
        "id": "call_1", "name": "get_time", "arguments": {}, "result": result["result"], "status": "ok",
        "ms": turn["tools"][0]["ms"]}], turn
    assert turn["latency"]["stages_ms"]["tool"] == latency["stages_ms"]["tool"]


def test_a_slow_tool_gets_the_filler_phrase_first(hooks):
    config = make_config(tools=vars(webhook_config(hooks.base, "/weather?delay=0.6")))
    instance = fake_instance(config)
    instance.lm.tool_calls = [call("get_weather", {"city": "Rome"})]
    instance.lm.blocks = ["Sunny in Rome."]
    with LiveServer(config, instance) as srv:
        c = one_turn(srv)
    kinds = ["audio" if isinstance(m, bytes) else m["type"] for m in c.log]
    assert kinds.index("tool_call") < kinds.index("reply") < kinds.index("audio") < kinds.index("tool_result"), kinds
    assert [m["text"] for m in c.events("reply")] == ["One moment. ", "Sunny in Rome."]
    assert c.events("tool_result")[0]["result"] == "Sunny and 21 degrees in Rome"
    assert c.events("latency")[0]["stages_ms"]["tool"] >= 550
    assert c.events("reply_done")[0]["text"] == "One moment. Sunny in Rome."


def test_a_fast_tool_gets_no_filler(hooks):
    config = make_config(tools=vars(webhook_config(hooks.base)))
    instance = fake_instance(config)
    instance.lm.tool_calls = [call("get_weather", {"city": "Rome"})]
    with LiveServer(config, instance) as srv:
        c = one_turn(srv)
    assert "One moment" not in c.events("reply_done")[0]["text"]
    assert c.events("latency")[0]["stages_ms"]["tool"] < 300


def test_barge_in_cancels_a_pending_tool_call(hooks, tmp_path):
    hooks.cancelled.clear()
    config = make_config(records={"path": str(tmp_path / "records.sqlite3")},
                         tools={**vars(webhook_config(hooks.base, "/weather?delay=5")), "filler": ""},
                         turn={"resume_ms": 0})  # a barge-in, not the first utterance resumed (test_endofturn)
    instance = fake_instance(config)
    instance.lm.tool_calls = [call("get_weather", {"city": "Rome"})]
    with LiveServer(config, instance) as srv:
        async def scenario():
            c = await Client.open(srv.ws + "/ws")
            c.listen(speed=1.0)
            c.say(speech("001.wav"))
            await c.wait(lambda m: m["type"] == "tool_call")
            c.say(speech("002.wav"))  # the user speaks again while the webhook is still out
            await c.wait(lambda m: m["type"] == "clear")
            result = await c.wait(lambda m: m["type"] == "tool_result")
            await c.wait(lambda m: m["type"] == "reply_done" and m["turn"] == 1)
            await c.shut()
            return c, result
        c, result = asyncio.run(scenario())
    assert result["status"] == "cancelled" and result["ms"] < 4000, result
    assert hooks.cancelled.wait(10), "the webhook's request was not cancelled"
    assert c.events("reply_done")[0]["interrupted"]
    turn = read_sessions(config.records.path)[0]["turns"][0]
    assert turn["status"] == "interrupted" and turn["tools"][0]["status"] == "cancelled", turn


def test_a_webhook_waits_for_the_turn_to_be_real_but_a_pure_tool_does_not(hooks):
    """A speculative reply (started during the VAD hangover) may run get_time, never a webhook:
    if the user goes on talking, the webhook must not have been called."""
    from voice.conversation.reply import Reply, ReplyRunner
    config = make_config(tools=vars(webhook_config(hooks.base)))
    config.tools.builtin = ["time"]
    instance = fake_instance(config)
    box = Toolbox(config.tools)
    instance.lm.tool_calls = [call("get_time", id="a"), call("get_weather", {"city": "Lima"}, id="b")]
    emitted = []

    class Sink:  # the session, as the runner sees it (voice.conversation.reply.ReplySink)
        def emit(self, ev, wire=True, track=True):
            emitted.append(ev)
            return True

        def first_audio(self):
            pass

        def fault(self, failure):
            pass

        def is_current(self, turn):
            return True

        async def voiced(self, reply):
            await reply.released.wait()

    async def go():
        runner = ReplyRunner(config, instance.lm.chat(), instance.synthesizer, 16000, None, None, Sink(), "s", box,
                             Timers(lambda text: asyncio.sleep(0)))
        reply = Reply(1)
        before = len(hooks.requests)
        task = asyncio.create_task(runner.run(reply, [{"role": "user", "content": "Weather?"}]))
        await asyncio.sleep(0.5)
        speculated = [(r.name, r.status) for r in reply.tools], len(hooks.requests) - before, list(emitted)
        reply.released.set()  # the turn is real now
        await asyncio.sleep(0.5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await box.aclose()
        return speculated, [(r.name, r.status) for r in reply.tools], len(hooks.requests) - before
    speculated, released, requests = asyncio.run(go())
    assert speculated == ([("get_time", "ok"), ("get_weather", "running")], 0, []), speculated
    assert released == [("get_time", "ok"), ("get_weather", "ok")] and requests == 1


def test_a_timer_set_in_a_turn_speaks_up_in_the_session():
    config = make_config(tools={"builtin": ["timer"]})
    instance = fake_instance(config)
    instance.lm.tool_calls = [call("set_timer", {"seconds": 1})]
    instance.lm.blocks = ["Timer set."]
    with LiveServer(config, instance) as srv:
        c = one_turn(srv, until=lambda m: m["type"] == "announcement", timeout=10)
    announced = c.events("announcement")
    assert [a["text"] for a in announced] == ["Your 1 second timer is done."], c.events()
    kinds = ["audio" if isinstance(m, bytes) else m["type"] for m in c.log]
    assert kinds.index("reply_done") < kinds.index("announcement")  # after the turn, not in it
    assert len(c.events("latency")) == 1 and c.events("reply_done")[0]["text"] == "Timer set."


def test_records_of_the_first_version_gain_the_tools_column(tmp_path):
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(re.sub(r"\n\s*(tools|dtmf) TEXT[^\n]*", "", rec.SCHEMA))  # version 1
    conn.execute("INSERT INTO sessions (uid, session_id, transport, started) VALUES ('u', 's1', 'native', 1.0)")
    conn.execute("INSERT INTO turns (session_uid, turn, ended, status) VALUES ('u', 1, 2.0, 'ok')")
    conn.commit()
    conn.close()
    rec.init_db(path)
    turn = read_sessions(path)[0]["turns"][0]
    assert turn["tools"] == [] and turn["status"] == "ok"
