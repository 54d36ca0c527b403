"""A remote LM endpoint (`[lm] backend = "openai"`) that is down, then comes up.

The voice app (stand-in ASR/TTS from tests/fakes.py, the real `RemoteLM`) points at a
loopback port where nothing listens yet: /healthz says "degraded" (the periodic probe), a
turn is retried with backoff and then ends with the spoken apology, and the session goes on.
Then `engine serve`'s app (around a stand-in engine) starts on that port: the probe sees it,
/healthz is "ok" again, and the next turn gets its reply from it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.request

import pytest
import uvicorn

from fakes import Client, LiveServer, StandInEngine, fake_instance, make_config, speech
from liveserver import wait_for
from voice.pipeline.lm import RemoteLM

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def health(srv) -> dict:
    with urllib.request.urlopen(srv.http + "/healthz", timeout=10) as r:
        return json.loads(r.read())


def test_remote_lm_down_is_retried_reported_and_recovers(monkeypatch):
    from engine.decode import DecodeConfig
    from engine.api.server import build_app as engine_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        lm_port = s.getsockname()[1]  # nothing listens here for now
    config = make_config(lm={"backend": "openai", "url": f"http://127.0.0.1:{lm_port}/v1", "model": "stand-in",
                             "retries": 2, "retry_backoff_s": 0.05, "probe_interval_s": 0.3})
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    instance = fake_instance(config, lm=RemoteLM(config.lm))
    lm_server = None
    with LiveServer(config, instance) as srv:
        down = wait_for(lambda: (h := health(srv))["status"] == "degraded" and h, 10, "healthz never degraded")
        assert down["lm_health"]["ok"] is False and "Connect" in down["lm_health"]["last_error"], down

        async def turn(c: Client, n: int) -> list[dict]:
            c.say(speech("001.wav"))
            await c.wait(lambda m: m["type"] == "latency" and m["turn"] == n, 30)
            return [e for e in c.events() if e.get("turn") == n]

        async def first():
            c = await Client.open(srv.ws + "/ws")
            c.listen(speed=3.0)
            failures_before = instance.lm.failures
            events = await turn(c, 1)
            return c, events, instance.lm.failures - failures_before

        loop = asyncio.new_event_loop()
        try:
            c, events, failures = loop.run_until_complete(first())
            err = next(e for e in events if e["type"] == "error")
            assert (err["code"], err["stage"], err["apology"]) == ("reply_failed", "lm", True), err
            assert failures >= 3  # the first try and two retries
            assert next(e for e in events if e["type"] == "reply_done")["interrupted"] is True

            # the endpoint comes up
            app = engine_app(StandInEngine(), DecodeConfig(max_new_tokens=8))
            lm_server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=lm_port, log_level="warning"))
            threading.Thread(target=lm_server.run, daemon=True).start()
            up = wait_for(lambda: (h := health(srv))["lm_health"]["ok"] and h, 20, "the probe never saw it up")
            assert up["lm_health"]["consecutive_failures"] == 0
            # still "degraded" for a minute because a turn failed, and only for that reason
            assert up["status"] == "degraded" and up["faults"] == {"lm": "error"}, up
            instance.faults.clear()
            assert health(srv)["status"] == "ok"

            events = loop.run_until_complete(turn(c, 2))  # same session
            done = next(e for e in events if e["type"] == "reply_done")
            assert done["text"] == "Hello there." and done["interrupted"] is False
            assert not [e for e in events if e["type"] == "error"]
            loop.run_until_complete(c.shut())
        finally:
            loop.close()
            if lm_server is not None:
                lm_server.should_exit = True


@pytest.mark.parametrize("text, called", [
    ('{"name": "calculate", "arguments": {"expression": "17 * 23"}}', {"expression": "17 * 23"}),  # the 0.5B
    ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "17 * 23"}}\n</tool_call>',
     {"expression": "17 * 23"}),
    ('```json\n{\n  "name": "calculate",\n  "arguments": {\n    "expression": "17 * 23"\n  }\n}\n```',  # the 1.5B
     {"expression": "17 * 23"}),
    ('{"name": "calculate", "arguments": {"expression": "17', None),  # cut off by max_tokens
    ('```python\nprint(17 * 23)\n```', None),
])
def test_tool_calls_a_server_writes_as_text_are_read(text, called):
    """llama.cpp's server passes Qwen's calls through as text (tests/test_llamacpp_server.py runs it);
    these are the shapes the packaged models write there. Each is held back from speech; a call
    written wrong gives no call (the reply is then answered without tools)."""
    from voice.pipeline.lm import calls_written, looks_like_a_call
    assert looks_like_a_call(text) and not looks_like_a_call("Sure, 17 times 23 is 391.")
    calls = calls_written(text)
    if called is None:
        assert calls == []
    else:
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [("calculate", called)]
