"""OpenAI-compatible HTTP server: `/v1/models`, `/v1/chat/completions` (plain and SSE), `/healthz`.

The API is stateless, but conversations are not: a request whose messages, all but the last,
are an earlier request's messages plus the reply it got continues that request's KV cache
(`PrefixCaches`), so a remote voice service prefills only the new turn; any other request gets
a cache the engine lends from its pool. Generation runs through `Engine.stream`, so the event
loop only awaits committed pieces and stays responsive.
With `stream: true` each committed piece becomes one `chat.completion.chunk`. A client that
disconnects cancels its generation at the next piece boundary, streaming or not.

Besides the standard fields, the body may carry (the `openai` client's `extra_body`):
`mode` ("diffusion" | "ar"), `block_size`, `first_block_size`, `threshold`, `rule`, `topk`,
`max_steps`. Responses add a non-standard `x_engine` object with the decoder's statistics.
Errors use OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Security and limits (docs/SECURITY.md): with API keys configured, every `/v1/*` request needs
`Authorization: Bearer KEY` (`/healthz` stays open); `serve` reads the keys from
`$ENGINE_API_KEYS` (comma-separated, each `key` or `name:key`) and/or the file named by
`$ENGINE_API_KEYS_FILE`, and refuses to listen on a non-loopback host without any unless
`ENGINE_ALLOW_UNAUTHENTICATED=1`. Request bodies are capped (`$ENGINE_MAX_BODY_BYTES`, 1 MiB:
413) and so is the text of the messages (`$ENGINE_MAX_INPUT_CHARS`, 32768 characters: 400
`string_above_max_length`). Bodies are decoded by `engine.common.wire.decode_json`, the one JSON
decoder of every front (bounded depth and number length, no lone surrogates: 400
`invalid_json`), and `engine.common.redact` keeps keys out of every log line.
"""


from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.api.middleware import LOG_KEY, BearerAuth, RequestLog, load_api_keys
from engine.api.requests import APIError, Options, Runs, check_runnable, parse_request, read_body
from engine.api.responses import (Answer, EventStream, chunks, client_error, completion, finished,
                                  wait_for_disconnect)
from engine.common.deadlines import guarded_http
from engine.common.keys import is_loopback
from engine.common.redact import install_redaction
from engine.common.wire import WireError, ascii_int, decode_json
from engine.decode import ContextOverflow, DecodeConfig
from engine.grammar import GrammarError
from engine.stream import ConversationCache, Engine, Piece
from engine.tools import calls_in, tag_terminals

log = logging.getLogger("engine.server")

MAX_INPUT_CHARS = 32768  # characters over all messages of one request
MAX_BODY_BYTES = 1 << 20


class PrefixCaches:
    """Conversations kept between requests, keyed by the messages their cache covers (the prompt
    and the reply). Least recently used first out, at most `size`; a taken conversation belongs
    to its request alone until it is kept again. Correctness never depends on a hit: the engine
    reuses only the cached tokens that equal the new prompt's. An evicted or unfinished
    conversation is abandoned: its cache goes back to the engine's pool."""

    def __init__(self, engine: Engine, size: int):
        self.engine, self.size = engine, size
        self._kept: OrderedDict[str, ConversationCache] = OrderedDict()
        self._lock = threading.Lock()  # the engine's scheduler thread may `release` some
        engine.admission.release_idle = self.release

    @staticmethod
    def key(messages: list[dict]) -> str:
        """The messages' text, with tool calls as (name, arguments) (their ids are made up per reply)."""
        canonical = json.dumps([[m["role"], m["content"].strip(),
                                 [[c["function"]["name"], json.loads(c["function"]["arguments"])]
                                  for c in m.get("tool_calls") or ()]] for m in messages], ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def take(self, messages: list[dict]) -> ConversationCache:
        """The conversation that ended where `messages` continue (all but the last), or a new one."""
        key = self.key(messages[:-1])
        with self._lock:
            return self._kept.pop(key, None) or ConversationCache()

    def keep(self, messages: list[dict], reply: str, conversation: ConversationCache, tools_offered: bool) -> None:
        """Keep `conversation` under `messages` + `reply` as the next request will send them (a
        reply that calls tools comes back as an assistant message with `tool_calls`)."""
        calls = calls_in(reply) if tools_offered else []
        said = {"role": "assistant", "content": "", "tool_calls": calls} if calls else \
            {"role": "assistant", "content": reply}
        key = self.key([*messages, said])
        with self._lock:
            if key in self._kept:  # the same exchange again: the newer cache replaces the older
                self.engine.abandon(self._kept.pop(key))
            self._kept[key] = conversation
            while len(self._kept) > self.size:
                self.engine.abandon(self._kept.popitem(last=False)[1])

    def release(self, tokens: int) -> None:
        """Keep at most `tokens` tokens cached, least recently used out first: on llama.cpp's shared
        KV cache a request waiting for room needs theirs (`Admission.release_idle`)."""
        with self._lock:
            while self._kept and sum(len(c.state.ids) for c in self._kept.values() if c.state) > tokens:
                self.engine.abandon(self._kept.popitem(last=False)[1])


class ChatAPI:
    """The app: one engine, the conversations kept for continuations, and a handler per route.
    `api_keys` (name -> key): when given and not empty, /v1/* requires one of them.
    `kept_conversations`: KV caches kept for conversations that may continue (PrefixCaches)."""

    def __init__(self, engine: Engine, defaults: DecodeConfig, api_keys: dict[str, str] | None = None,
                 max_input_chars: int = MAX_INPUT_CHARS, max_body_bytes: int = MAX_BODY_BYTES,
                 kept_conversations: int = 8):
        install_redaction((api_keys or {}).values())  # no key in any log line (engine.common.redact)
        self.engine, self.defaults = engine, defaults
        self.max_input_chars, self.max_body_bytes = max_input_chars, max_body_bytes
        self.caches = PrefixCaches(engine, kept_conversations)
        self.runs = Runs.of(engine)  # what the model can run of a request's options (checked in parse_request)
        self.model_id, self.created, self.context = engine.name, int(time.time()), engine.max_seq_len
        self.app = Starlette(
            routes=[Route("/v1/models", self.models), Route("/v1/models/{name:path}", self.model_info),
                    Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                    Route("/healthz", self.healthz)],
            middleware=[Middleware(RequestLog), Middleware(BearerAuth, keys=api_keys or {})],
            # Starlette types every handler as taking any Exception; each is called for its own class only
            exception_handlers={APIError: api_error, HTTPException: http_error,  # type: ignore[dict-item]
                                Exception: server_error})

    def model(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "engine"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model()]})

    async def model_info(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name != self.model_id:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        return JSONResponse(self.model())

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_id})

    async def chat_completions(self, request: Request) -> Response | EventStream:
        info = request.scope.setdefault(LOG_KEY, {})
        messages, cfg, opts = self.parse(await read_body(request, self.max_body_bytes), info)
        engine, tool_use = self.engine, opts.tools
        try:
            prompt = await asyncio.to_thread(engine.prompt_ids, messages, tool_use.tools if tool_use else None)
        except jinja2.TemplateError as err:
            raise APIError(400, f"The chat template rejected the messages: {err}", "messages",
                           "invalid_value") from err
        info["prompt_tokens"] = len(prompt)
        if len(prompt) + cfg.max_new_tokens > self.context:
            raise APIError(400, f"This model's maximum context length is {self.context} tokens. However, you "
                           f"requested {len(prompt) + cfg.max_new_tokens} tokens ({len(prompt)} in the messages, "
                           f"{cfg.max_new_tokens} in the completion).", "messages", "context_length_exceeded")
        answer = Answer(f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), self.model_id, cfg, len(prompt))
        constraint = None
        try:
            if opts.json:
                constraint = await asyncio.to_thread(engine.grammars.json, opts.schema)
            elif tool_use is not None:
                constraint = await asyncio.to_thread(engine.grammars.lark,
                                                     tool_use.grammar(tag_terminals(engine.tokenizer)))
        except GrammarError as err:
            raise APIError(400, str(err), "response_format.json_schema.schema" if opts.json else "tools",
                           "invalid_value") from err
        conversation = self.caches.take(messages)
        pieces = self.kept_after(engine.stream(messages, cfg, conversation=conversation, constraint=constraint,
                                               tools=tool_use.tools if tool_use is not None else None,
                                               deadline=waited_throughout),
                                 messages, conversation, tool_use is not None)
        if opts.stream:
            return EventStream(chunks(answer, pieces, opts, info), on_cancel=lambda: info.update(finish="cancelled"))
        return await self.complete(request, answer, pieces, info, opts)

    def parse(self, raw: bytes, info: dict) -> tuple[list[dict], DecodeConfig, Options]:
        """The request's body, checked: its messages, decode config and options."""
        try:  # the one decoder of every front (engine.common.wire): bounded depth and numbers, no lone surrogates
            body = decode_json(raw, max_bytes=self.max_body_bytes)
        except WireError as err:
            if err.reason == "too_large":
                raise APIError(413, f"The request body is too large: {err.message}.", None,
                               "request_too_large") from None
            raise APIError(400, f"We could not parse the JSON body of your request: {err.message}.", None,
                           "invalid_json") from None
        if isinstance(body, dict) and body.get("model") is not None and body.get("model") != self.model_id:
            info["model"] = str(body.get("model"))[:60]
            raise APIError(404, f"The model `{info['model']}` does not exist; this server has "
                           f"`{self.model_id}`.", "model", "model_not_found")
        try:
            messages, cfg, opts = parse_request(body, self.defaults, self.context, self.engine.resolve, self.runs)
        except (TypeError, AttributeError, KeyError, IndexError, ValueError) as err:
            # a shape parse_request does not name yet: still the body's fault, so a 400 (and a note to name it)
            log.warning("request body not checked by name: %s: %s", type(err).__name__, err)
            raise APIError(400, f"The request body could not be read: {type(err).__name__}: {err}", None,
                           "invalid_value") from None
        chars = sum(len(m["content"]) for m in messages)
        if chars > self.max_input_chars:
            raise APIError(400, f"The messages hold {chars} characters; this server accepts at most "
                           f"{self.max_input_chars}.", "messages", "string_above_max_length")
        info.update(mode=cfg.mode, stream=opts.stream, max_tokens=cfg.max_new_tokens)
        return messages, cfg, opts

    async def kept_after(self, pieces: AsyncGenerator[Piece, None], messages: list[dict],
                         conversation: ConversationCache, tools_offered: bool) -> AsyncGenerator[Piece, None]:
        """The pieces; then the conversation is kept for a continuation (unless it was cut short)."""
        text, done = [], False
        try:
            async with contextlib.aclosing(pieces) as stream:
                async for piece in stream:
                    text.append(piece.text)
                    done = piece.finish_reason is not None
                    yield piece
        finally:
            if done:
                self.caches.keep(messages, "".join(text), conversation, tools_offered)
            else:
                self.engine.abandon(conversation)

    async def complete(self, request: Request, answer: Answer, pieces: AsyncGenerator[Piece, None], info: dict,
                       opts: Options) -> Response:
        """The whole reply as one `chat.completion`; a client that goes away cancels it (499)."""
        async def collect() -> tuple[str, Piece | None]:
            text, last = [], None
            async with contextlib.aclosing(pieces) as stream:
                async for piece in stream:
                    text.append(piece.text)
                    last = piece
            return "".join(text), last

        task = asyncio.create_task(collect())
        watcher = asyncio.create_task(wait_for_disconnect(request.receive))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
        if not task.done() or task.cancelled():
            await asyncio.gather(task, return_exceptions=True)
            info["finish"] = "cancelled"
            return Response(status_code=499)  # nobody is listening any more
        try:
            text, last = task.result()
        except (ContextOverflow, GrammarError) as err:
            raise client_error(err, opts) from None
        body = completion(answer, text, last, opts.tools is not None)
        info.update(finished(last, body["choices"][0]["finish_reason"]))
        return JSONResponse(body)


def waited_throughout(text: str) -> float:
    """An HTTP client waits for the whole reply, not only its first piece (as a voice client,
    whose first words buy the rest time): every request's reader runs out of text now (-inf), so
    the scheduler serves the least served first, and a short request is not put behind long
    prompts still being read (an 8-token request beside six ~1,700-token prompts took 115 s on the 1.5B)."""
    return -math.inf


async def api_error(request: Request, exc: APIError) -> Response:
    request.scope.setdefault(LOG_KEY, {})["error"] = exc.code or exc.type
    return exc.response()


async def http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None, code).response()


async def server_error(request: Request, exc: Exception) -> Response:
    log.exception("request failed")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "server_error",
                    "server_error").response()


def build_app(engine: Engine, defaults: DecodeConfig, api_keys: dict[str, str] | None = None,
              **limits: int) -> Starlette:
    """The ASGI app of `engine serve` (ChatAPI's)."""
    return ChatAPI(engine, defaults, api_keys, **limits).app


def serve(model: str, adapter: str | None, host: str, port: int, defaults: DecodeConfig, quantize: str = "none",
          drafter: str | None = None, device: str = "cpu") -> None:
    """Load `model` and serve it until interrupted."""
    import uvicorn

    from engine.loading import ModelLoadError
    keys = load_api_keys()
    if not keys and not is_loopback(host) and os.environ.get("ENGINE_ALLOW_UNAUTHENTICATED") != "1":
        raise SystemExit(f"engine serve: refusing to listen on {host or 'all interfaces'} without API keys: set "
                         "$ENGINE_API_KEYS (or $ENGINE_API_KEYS_FILE), listen on 127.0.0.1, or set "
                         "ENGINE_ALLOW_UNAUTHENTICATED=1 if a proxy in front authenticates.")
    limits = {}
    for name, var in (("max_input_chars", "ENGINE_MAX_INPUT_CHARS"), ("max_body_bytes", "ENGINE_MAX_BODY_BYTES")):
        value = os.environ.get(var, "")
        if value:
            if ascii_int(value) is None or int(value) < 1:
                raise SystemExit(f"engine serve: ${var} must be a positive integer")
            limits[name] = int(value)
    try:
        engine = Engine.load(model, adapter=adapter, defaults=defaults, quantize=quantize, drafter=drafter,
                             device=device)
    except ModelLoadError as err:
        raise SystemExit(f"engine serve: {err}") from err
    try:  # the server's own defaults (--block-size ...) must be something this model runs
        check_runnable(engine.resolve(defaults), Runs.of(engine))
    except APIError as err:
        raise SystemExit(f"engine serve: {err.message}") from None
    log.info("serving %s (%s) on http://%s:%d/v1 (mode %s, max_tokens %d, %s)", engine.name, engine.loaded.weights,
             host, port, engine.defaults.mode, defaults.max_new_tokens,
             f"API keys: {', '.join(sorted(keys))}" if keys else "no API keys")
    config = uvicorn.Config(build_app(engine, defaults, keys, **limits), host=host, port=port, access_log=False,
                            log_level="info", http=guarded_http())  # head and body read deadlines
    install_redaction(keys.values())  # again, now that uvicorn has set up its loggers' handlers
    server = uvicorn.Server(config)
    server.run()
    if not server.started:  # as uvicorn.run: it could not start (port in use...)
        raise SystemExit(3)
