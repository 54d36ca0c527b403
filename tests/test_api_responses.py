"""engine/api/responses.py's answers as functions of pieces, without a server or a model: what a
client of `engine serve` reads, streaming or not (the HTTP path around them: tests/test_server.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from engine.api.requests import APIError, Options, parse_request
from engine.api.responses import Answer, chunks, completion
from engine.decode import ContextOverflow, DecodeConfig
from engine.stream import Decoding, Engine, Piece
from engine.tools import Tool, ToolUse

ANSWER = Answer("chatcmpl-1", 1700000000, "tiny", DecodeConfig(), prompt_tokens=12)
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'


def pieces(*texts: str, finish: str = "stop", fail: Exception | None = None):
    async def gen():
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            yield Piece(text, [], 1, i + 2, i + 1, 40.0, 40.0 + 10 * i, last, finish if last else None, 12, 12)
        if fail is not None:
            raise fail
    return gen()


def events(stream) -> list:
    async def collect():
        return [raw async for raw in stream]
    out = []
    for raw in asyncio.run(collect()):
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
        body = raw[6:-2]
        out.append(body.decode() if body == b"[DONE]" else json.loads(body))
    return out


def test_a_completion_carries_the_text_usage_and_the_decoders_statistics():
    async def last_of(gen):
        return [p async for p in gen][-1]
    last = asyncio.run(last_of(pieces("Hello", " there.")))
    body = completion(ANSWER, "Hello there.", last, tools_offered=False)
    message = {"role": "assistant", "content": "Hello there.", "refusal": None}
    assert body["choices"] == [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}
    assert body["x_engine"]["forwards"] == 3 and body["x_engine"]["tokens_per_forward"] == round(2 / 3, 3)
    assert (body["id"], body["model"], body["object"]) == ("chatcmpl-1", "tiny", "chat.completion")


def test_a_reply_that_calls_a_tool_is_tool_calls_only_when_tools_were_offered():
    body = completion(ANSWER, CALL, None, tools_offered=True)
    message = body["choices"][0]["message"]
    assert message["content"] is None and body["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_time", {"city": "Oslo"})]
    assert completion(ANSWER, CALL, None, tools_offered=False)["choices"][0]["message"]["content"] == CALL


def test_chunks_stream_the_role_first_then_text_then_finish_usage_and_done():
    info: dict = {}
    got = events(chunks(ANSWER, pieces("Hel", "lo", ""), Options(stream=True, include_usage=True), info))
    deltas = [e["choices"][0]["delta"] for e in got[:-2]]
    assert deltas == [{"role": "assistant", "content": "Hel"}, {"content": "lo"}, {}]
    assert got[-3]["choices"][0]["finish_reason"] == "stop" and got[-3]["x_engine"]["mode"] == "diffusion"
    assert all(e["usage"] is None for e in got[:-2])
    assert got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] == 3
    assert got[-1] == "[DONE]"
    assert info == {"finish": "stop", "completion_tokens": 3, "ttfb_ms": 40.0, "forwards": 4}


def test_a_streamed_tool_call_is_held_back_and_sent_whole():
    tools = ToolUse([Tool("get_time", "", {"type": "object"})], "auto", True)
    half = len(CALL) // 2
    got = events(chunks(ANSWER, pieces(CALL[:half], CALL[half:]), Options(stream=True, tools=tools), {}))
    assert len(got) == 3 and got[-1] == "[DONE]"
    delta = got[0]["choices"][0]["delta"]
    assert delta["content"] is None and delta["tool_calls"][0]["index"] == 0
    assert json.loads(delta["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert got[1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("failure, status, code", [(ContextOverflow("the cache is full"), 400,
                                                    "context_length_exceeded"),
                                                   (RuntimeError("boom"), 500, "server_error")])
def test_a_failure_after_the_headers_is_reported_in_band_and_ends_the_stream(failure, status, code):
    info: dict = {}
    got = events(chunks(ANSWER, pieces("Hi", finish="", fail=failure), Options(stream=True), info))
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert got[-1]["error"]["code"] == code and len(got) == 2  # no [DONE] after an error
    assert info["finish"] == "error"


def test_parse_request_gives_typed_options():
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "response_format": {"type": "json_object"}, "mode": "ar"}
    messages, cfg, opts = parse_request(body, DecodeConfig(), 2048)
    assert messages == [{"role": "user", "content": "hi"}] and cfg.mode == "ar"
    assert opts == Options(stream=True, include_usage=True, json=True, schema=None, tools=None)


def test_a_model_that_decodes_ar_only_answers_a_diffusion_request_in_ar():
    """A model that decodes AR here (`Engine.decoding`, e.g. a GGUF on llama.cpp): a request asking for
    diffusion (a voice service's default `[lm] mode`) is decoded AR and says so, instead of failing
    every reply; tools need no verify rule."""
    body = {"messages": [{"role": "user", "content": "hi"}], "mode": "diffusion", "rule": "threshold",
            "tools": [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]}
    engine = SimpleNamespace(decoding=Decoding("ar", "drafted rows do not pay here"))
    _, cfg, opts = parse_request(body, DecodeConfig(), 2048, lambda c: Engine.resolve(engine, c))
    assert cfg.mode == "ar" and opts.tools is not None
    with pytest.raises(APIError):  # elsewhere: diffusion with a lossy rule cannot be held to a grammar
        parse_request(body, DecodeConfig(), 2048)
