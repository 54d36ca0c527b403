"""Responses of `/v1/chat/completions`, as functions of the engine's pieces: one `chat.completion`
(`completion`), or `chat.completion.chunk` server-sent events (`chunks`, sent by `EventStream`, which
cancels the generation when the client goes). Testable without a server or a model: they take
pieces (`engine.stream.Piece`) and give bodies. Besides OpenAI's fields, each answer carries
`x_engine`, the decoder's statistics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope, Send

from engine.api.middleware import LOG_KEY
from engine.api.requests import APIError, Options
from engine.decode import ContextOverflow, DecodeConfig
from engine.grammar import GrammarError
from engine.stream import Piece
from engine.tools import calls_in, starts_a_call

log = logging.getLogger("engine.server")


@dataclass(frozen=True)
class Answer:
    """What every response of one request shares."""

    id: str  # chatcmpl-...
    created: int  # unix time
    model: str
    cfg: DecodeConfig
    prompt_tokens: int


def usage(last: Piece | None, prompt_tokens: int) -> dict:
    completion_tokens = last.tokens if last else 0
    prompt = last.prompt_tokens if last else prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def stats(last: Piece | None, cfg: DecodeConfig) -> dict:
    """`x_engine`: the decoder's statistics."""
    if last is None:
        return {"mode": cfg.mode}
    return {"mode": cfg.mode, "ttfb_ms": round(last.ttfb_ms, 1), "elapsed_ms": round(last.elapsed_ms, 1),
            "forwards": last.forwards, "tokens_per_forward": round(last.tokens / max(last.forwards, 1), 3),
            "prefilled_tokens": last.prefilled_tokens}


def finished(last: Piece | None, finish: str | None) -> dict:
    """What the request log notes of a finished generation."""
    return {"finish": finish, "completion_tokens": last.tokens if last else 0,
            "ttfb_ms": last.ttfb_ms if last else None, "forwards": last.forwards if last else 0}


def completion(answer: Answer, text: str, last: Piece | None, tools_offered: bool) -> dict:
    """The `chat.completion` of a generation that gave `text` (its last piece `last`): a reply
    that is tool calls (when tools were offered) becomes `tool_calls`."""
    finish = last.finish_reason if last else "length"
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    calls = calls_in(text) if tools_offered else []
    if calls:
        message["content"], message["tool_calls"], finish = None, calls, "tool_calls"
    return {"id": answer.id, "object": "chat.completion", "created": answer.created, "model": answer.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": usage(last, answer.prompt_tokens), "x_engine": stats(last, answer.cfg)}


def client_error(err: ContextOverflow | GrammarError, opts: Options) -> APIError:
    """A generation that failed because of what the request asked (400): its conversation does not
    fit the context, or its schema or tools make a grammar the constraint cannot follow (llguidance
    stops on a parser that grows too complex, e.g. a recursive `$ref`, only once decoding starts)."""
    if isinstance(err, ContextOverflow):
        return APIError(400, str(err), "messages", "context_length_exceeded")
    param = "response_format" if opts.json else "tools"
    first = str(err).split("\n", 1)[0][:300]
    return APIError(400, f"The {'JSON schema' if opts.json else 'tools'} cannot be followed while decoding: "
                    f"{first}. Simplify it (fewer properties, no recursion, shorter patterns).", param, "invalid_value")


async def chunks(answer: Answer, pieces: AsyncGenerator[Piece, None], opts: Options,
                 info: dict) -> AsyncGenerator[bytes, None]:
    """The pieces as `chat.completion.chunk` events, then `[DONE]`. A reply that starts like a tool
    call is held back and sent whole as `tool_calls` once complete (a call's arguments are JSON only
    when closed). A failure after the headers went out is reported in-band, as OpenAI does. `info`
    gets what the request log notes."""
    usage_field = {"usage": None} if opts.include_usage else {}

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> bytes:
        return sse({"id": answer.id, "object": "chat.completion.chunk", "created": answer.created,
                    "model": answer.model, "system_fingerprint": None,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                    **usage_field, **extra})

    last: Piece | None = None
    calling, text, sent = False, "", False
    try:
        async with contextlib.aclosing(pieces) as stream:
            async for piece in stream:
                text += piece.text
                if opts.tools is not None and starts_a_call(text):
                    calling = True
                elif last is None:
                    sent = True
                    yield chunk({"role": "assistant", "content": piece.text})
                elif piece.text:
                    sent = True
                    yield chunk({"content": piece.text})
                last = piece
    except (ContextOverflow, GrammarError) as err:  # the request's fault: a 400, in-band once a chunk went out
        info["finish"] = "error"
        if not sent:
            raise client_error(err, opts) from None  # EventStream answers it as a plain HTTP 400
        yield sse(client_error(err, opts).body())
        return
    except Exception as err:  # the headers are out: report in-band
        log.exception("generation failed")
        info["finish"] = "error"
        yield sse(APIError(500, f"generation failed: {err}", None, "server_error", "server_error").body())
        return
    finish = last.finish_reason if last else "length"
    if calling:
        calls = calls_in(text)
        yield chunk({"role": "assistant", "content": None,
                     "tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
        finish = "tool_calls" if calls else finish
    info.update(finished(last, finish))
    yield chunk({}, finish, x_engine=stats(last, answer.cfg))
    if opts.include_usage:
        yield sse({"id": answer.id, "object": "chat.completion.chunk", "created": answer.created,
                   "model": answer.model, "system_fingerprint": None, "choices": [],
                   "usage": usage(last, answer.prompt_tokens)})
    yield b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns once the client has gone (the request body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStream:
    """An SSE response that cancels its producer when the client disconnects.

    (Starlette's StreamingResponse only watches for disconnects under older ASGI spec
    versions; doing it here keeps cancellation independent of the server's spec version.)
    """

    def __init__(self, events: AsyncGenerator[bytes, None], on_cancel: Callable[[], object] | None = None) -> None:
        self.events, self.on_cancel = events, on_cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]}

        async def pump() -> None:
            """The headers go out with the first event, so that an APIError before it (the request's
            fault, found once decoding starts) is still answered as a plain HTTP error."""
            started = False
            try:
                async with contextlib.aclosing(self.events) as events:
                    async for event in events:
                        if not started:
                            started = True
                            await send(start)
                        await send({"type": "http.response.body", "body": event, "more_body": True})
            except APIError as err:
                if started:
                    raise
                scope.setdefault(LOG_KEY, {})["error"] = err.code or err.type
                await err.response()(scope, receive, send)
                return
            if not started:
                await send(start)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        producer = asyncio.create_task(pump())
        watcher = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (producer, watcher):
                task.cancel()
            results = await asyncio.gather(producer, watcher, return_exceptions=True)
        if isinstance(results[0], asyncio.CancelledError):  # the client went away first
            if self.on_cancel:
                self.on_cancel()
        elif isinstance(results[0], BaseException):
            raise results[0]
