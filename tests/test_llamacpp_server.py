"""The voice service's LM on a third-party server: llama.cpp's OpenAI-compatible server
(`python -m llama_cpp.server`, llama-cpp-python's [server] extra) on the packaged Qwen2.5-Coder-0.5B
GGUF, behind `[lm] backend = "openai"`.

The server is real and runs as its own process, started as docs/SCALING.md says (one request at a
time, `--interrupt_requests False`); the voice app around `RemoteLM` has stand-in ASR and TTS
(tests/fakes.py: a fixed transcript, a tone per character), since what is tested is the LM's path:
replies streamed in blocks, barge-in ending the HTTP stream on the server, tool calls (the server
passes Qwen's calls through as text, which `RemoteChat` reads), the health probe while a reply
streams, and a server that goes away and comes back (/healthz degraded, then healthy).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fakes import Client, FakeWhisper, LiveServer, fake_instance, make_config, speech
from liveserver import free_port, healthz, wait_for
from engine import llamacpp
from voice.pipeline.lm import RemoteLM

pytestmark = [pytest.mark.slow, pytest.mark.live, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SERVER_MODULES = ("llama_cpp", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")
MODEL = "qwen2.5-0.5b"
STORYTELLER = {"system_prompt": "You are a storyteller.", "max_new_tokens": 500}
STORY = "Tell me a long story about a dragon and a knight."


class LlamaServer:
    """llama.cpp's OpenAI server on `port`, as its own process; its output (unbuffered) in `log`."""

    def __init__(self, gguf: Path, port: int, log: Path):
        self.gguf, self.port, self.log = gguf, port, log
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 120.0) -> "LlamaServer":
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llama_cpp.server", "--model", str(self.gguf), "--model_alias", MODEL,
                 "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", "2048", "--n_threads", "1",
                 "--n_threads_batch", "1", "--interrupt_requests", "False"],
                stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **llamacpp.backend_env(), "PYTHONUNBUFFERED": "1"})  # its CPU variant
        deadline = time.monotonic() + timeout_s
        while not self.up():
            assert self.proc.poll() is None, f"llama.cpp's server exited:\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"llama.cpp's server not up in {timeout_s:.0f} s"
            time.sleep(0.2)
        return self

    def up(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/models", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """Gone at once, as in a crash: no graceful shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def disconnects(self) -> int:
        """Streams the server saw its client close before the reply's end (llama-cpp-python says so)."""
        return self.text().count("Disconnected from client")


@pytest.fixture(scope="module")
def gguf(require_system) -> Path:
    require_system(all(importlib.util.find_spec(m) for m in SERVER_MODULES),
                   "llama-cpp-python's [server] extra is not installed (pip install -e '.[test]')")
    from engine.loading import packaged_gguf
    return packaged_gguf(MODEL)


@pytest.fixture(scope="module")
def llama(gguf, tmp_path_factory):
    server = LlamaServer(gguf, free_port(), tmp_path_factory.mktemp("llama") / "server.log").start()
    yield server
    server.kill()


def remote(llama: LlamaServer, transcript: str, tools: list[str] | None = None, **lm):
    """The voice app's config and stages: the LM at llama.cpp's server, stand-in ASR hearing `transcript`."""
    config = make_config(lm={"backend": "openai", "url": llama.url, "model": MODEL, "mode": "ar", **lm},
                         tools={"builtin": tools or []})
    return config, fake_instance(config, whisper=FakeWhisper(transcript), lm=RemoteLM(config.lm))


def turns(srv, *clips: str, timeout: float = 120) -> Client:
    """One session saying each clip in turn, each after the previous reply."""
    async def scenario() -> Client:
        c = await Client.open(srv.ws + "/ws")
        c.listen(speed=1.0)
        for n, clip in enumerate(clips, 1):
            c.say(speech(clip))
            await c.wait(lambda m, n=n: m["type"] == "latency" and m["turn"] == n, timeout)
        await c.shut()
        return c
    return asyncio.run(scenario())


def of_turn(c: Client, kind: str, turn: int) -> list[dict]:
    return [m for m in c.events(kind) if m.get("turn") == turn]


def test_a_reply_streams_in_blocks_through_the_session(llama):
    config, instance = remote(llama, "Tell me a joke.", max_new_tokens=48)
    with LiveServer(config, instance) as srv:
        c = turns(srv, "001.wav")
    blocks, done = of_turn(c, "reply", 1), of_turn(c, "reply_done", 1)[0]
    assert not c.events("error"), c.events("error")
    assert len(blocks) >= 5 and "".join(b["text"] for b in blocks) == done["text"], (blocks, done)
    assert done["interrupted"] is False and done["text"].strip()
    marks = of_turn(c, "latency", 1)[0]["marks_ms"]
    assert len(marks["lm_blocks"]) == len(blocks)
    # streamed: the blocks came over the reply's generation, not all at once at its end
    assert marks["lm_blocks"][-1] - marks["lm_blocks"][0] > 200, marks["lm_blocks"]
    assert any(isinstance(m, bytes) for m in c.log), "the reply was not spoken"


def test_barge_in_ends_the_http_stream_on_the_server(llama):
    """The user speaks over a 500-token story: the reply stops, the server sees its request end
    and stops generating (it serves one request at a time, so the next turn's reply would otherwise
    wait for the rest of the story, 15-40 s here), and the next turn is answered at once."""
    config, instance = remote(llama, STORY, **STORYTELLER)
    before = llama.disconnects()
    with LiveServer(config, instance) as srv:
        async def scenario() -> Client:
            c = await Client.open(srv.ws + "/ws")
            c.listen(speed=1.0)
            c.say(speech("001.wav"))
            await c.wait(lambda m: m["type"] == "reply" and m["turn"] == 1, 60)
            instance.whisper.text = "What is the capital of France?"
            c.say(speech("002.wav"))
            await c.wait(lambda m: m["type"] == "latency" and m["turn"] == 2, 60)
            await c.shut()
            return c
        c = asyncio.run(scenario())
    # (in full suites before ffcfc71: a barge-in lost in wait_for, turn 1 never ended, turn 2 timed out)
    assert of_turn(c, "reply_done", 1), ([m for m in c.events() if m["type"] != "audio"], llama.text()[-3000:])
    first = of_turn(c, "reply_done", 1)[0]
    assert first["interrupted"] is True and of_turn(c, "clear", 1), c.events()
    assert len(first["text"]) < 1000, first  # cut short, far from 500 tokens
    assert llama.disconnects() > before, llama.text()[-2000:]
    assert "/ 500 runs" not in llama.text()  # no request generated its whole 500 tokens
    assert "Paris" in of_turn(c, "reply_done", 2)[0]["text"]
    assert of_turn(c, "latency", 2)[0]["stages_ms"]["lm_first_block"] < 8000, of_turn(c, "latency", 2)


def test_a_tool_call_written_as_text_is_run_and_answered(llama):
    """llama.cpp's server renders Qwen's template with the tools but parses no calls: the 0.5B's
    call arrives as content text (`{"name": "calculate", ...}`), which is read, never spoken."""
    config, instance = remote(llama, "What is seventeen times twenty three?", tools=["calculator"],
                            max_new_tokens=48)
    with LiveServer(config, instance) as srv:
        c = turns(srv, "001.wav")
    calls, results = c.events("tool_call"), c.events("tool_result")
    assert [(m["name"], m["arguments"]) for m in calls] == [("calculate", {"expression": "17 * 23"})], c.events()
    assert results[0]["status"] == "ok" and results[0]["result"].endswith("391"), results
    said = "".join(m["text"] for m in of_turn(c, "reply", 1))
    assert "391" in said and "{" not in said and "calculate" not in said, said
    assert of_turn(c, "reply_done", 1)[0]["text"] == said


def test_the_health_probe_neither_waits_for_nor_cuts_a_streaming_reply(llama):
    """The server answers one request at a time: a GET /models during a reply would wait for the
    reply to end (or, with its default --interrupt_requests, cut it short). While a reply streams,
    the probe is skipped; between replies it asks the server."""
    config, _ = remote(llama, STORY, **{**STORYTELLER, "max_new_tokens": 120})
    lm = RemoteLM(config.lm)
    messages = [{"role": "system", "content": config.lm.system_prompt}, {"role": "user", "content": STORY}]

    async def scenario() -> tuple[float, int, int]:
        probed_s, blocks = 0.0, 0
        async for _ in lm.chat().reply(messages):
            blocks += 1
            if blocks == 2:
                t = time.monotonic()
                await lm.probe()
                probed_s = time.monotonic() - t
        asked = probes()
        await lm.probe()  # the reply is over: this one asks the server
        return probed_s, blocks, asked

    def probes() -> int:
        return llama.text().count('"GET /v1/models')

    probed_s, blocks, asked = asyncio.run(scenario())
    assert probed_s < 0.5 and lm.ok, (probed_s, lm.health())
    assert blocks == 120  # the whole reply: one block per token on this server
    assert lm.ok and wait_for(lambda: probes() == asked + 1, 5, "the probe after the reply never reached the server")


def test_a_server_that_goes_away_and_comes_back(gguf, tmp_path):
    """Killed: the probe sees it, /healthz says degraded, a turn gets the apology. Started again
    on the same port: the probe sees it, /healthz is ok, the next turn is answered by it."""
    llama = LlamaServer(gguf, free_port(), tmp_path / "server.log").start()
    config, instance = remote(llama, "What is the capital of France?", max_new_tokens=24, retries=1,
                            retry_backoff_s=0.05, probe_interval_s=0.3)
    try:
        with LiveServer(config, instance) as srv:
            assert healthz(srv)["status"] == "ok" and healthz(srv)["lm_health"]["ok"]
            llama.kill()
            down = wait_for(lambda: (h := healthz(srv))["status"] == "degraded" and h, 10, "never degraded")
            assert down["lm_health"]["ok"] is False and "Connect" in down["lm_health"]["last_error"], down

            c = turns(srv, "001.wav")
            error = of_turn(c, "error", 1)[0]
            assert (error["code"], error["stage"], error["apology"]) == ("reply_failed", "lm", True), error

            llama.start()
            up = wait_for(lambda: (h := healthz(srv))["lm_health"]["ok"] and h, 10, "the probe never saw it up")
            assert up["lm_health"]["consecutive_failures"] == 0 and up["faults"] == {"lm": "error"}, up
            instance.faults.clear()  # the failed turn keeps /healthz degraded for a minute
            assert healthz(srv)["status"] == "ok"

            c = turns(srv, "001.wav")
            assert not c.events("error"), c.events("error")
            assert "Paris" in of_turn(c, "reply_done", 1)[0]["text"]
    finally:
        llama.kill()


