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
import hmac
import json
import logging
import math
import os
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.decode import COMMIT_RULES, ContextOverflow, DecodeConfig
from engine.grammar import GrammarError
from engine.tools import Tool, ToolUse, calls_in, starts_a_call, tag_terminals
from engine.common.keys import ConfigError, is_loopback, load_keys
from engine.common.redact import install_redaction
from engine.stream import Conversation, Engine, Piece
from engine.common.wire import WireError, ascii_int, decode_json

log = logging.getLogger("engine.server")

LOG_KEY = "engine.request_log"  # per-request details the handlers leave in the ASGI scope for RequestLog
MAX_INPUT_CHARS = 32768  # characters over all messages of one request
MAX_BODY_BYTES = 1 << 20


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# --- request parsing -------------------------------------------------------------------------

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
UNSUPPORTED = {  # fields we refuse rather than silently ignore, with the value that means "off"
    "n": lambda v: v in (None, 1),
    "stop": lambda v: v in (None, "", []),
    "logprobs": lambda v: v in (None, False),
    "functions": lambda v: v in (None, []),  # the legacy form of `tools`
    "function_call": lambda v: v in (None, "none"),
    "logit_bias": lambda v: v in (None, {}),
    "top_logprobs": lambda v: v in (None, 0),
}


def _missing(name: str) -> APIError:
    return APIError(400, f"Missing required parameter: '{name}'.", name, "missing_required_parameter")


def _number(body: dict, name: str, lo: float, hi: float, integer: bool) -> Any:
    value = body.get(name)
    if value is None:
        return None
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or (not integer and not math.isfinite(value)):
        raise APIError(400, f"Invalid type for '{name}': expected {kind}, but got {json.dumps(value)[:40]}.",
                       name, "invalid_type")
    if not lo <= value <= hi:
        raise APIError(400, f"Invalid value for '{name}': {value} is not between {lo} and {hi}.", name,
                       "invalid_value")
    return value


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise _missing("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty array of messages.", "messages", "invalid_value")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"{where} must be an object.", where, "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list or object is not even hashable
            raise APIError(400, f"Invalid value for '{where}.role': {json.dumps(role)[:40]}; supported roles are "
                           f"{', '.join(ROLES)}.", f"{where}.role", "invalid_value")
        content = m.get("content")
        calls = _tool_calls(m, where) if role == "assistant" and m.get("tool_calls") is not None else None
        if content is None and calls:
            content = ""
        if isinstance(content, list):  # content parts: only text is understood here
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(400, f"{where}.content: only text content parts are supported.",
                                   f"{where}.content", "invalid_value")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string or an array of text parts.",
                           f"{where}.content", "invalid_type")
        message: dict[str, Any] = {"role": ROLES[role], "content": content}
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise APIError(400, f"Missing required parameter: '{where}.tool_call_id'.", f"{where}.tool_call_id",
                               "missing_required_parameter")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _tool_calls(m: dict, where: str) -> list[dict]:
    """An assistant message's `tool_calls`, checked: functions with a name and JSON arguments."""
    calls = m["tool_calls"]
    if not isinstance(calls, list):
        raise APIError(400, f"Invalid type for '{where}.tool_calls': expected an array.", f"{where}.tool_calls",
                       "invalid_type")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise APIError(400, f"'{at}' must be a function call with a 'name' and string 'arguments'.", at,
                           "invalid_value")
        try:
            json.loads(fn["arguments"])
        except ValueError:
            raise APIError(400, f"'{at}.function.arguments' is not valid JSON.", f"{at}.function.arguments",
                           "invalid_value") from None
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def _tool_use(body: dict) -> ToolUse | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked (None: no tools offered)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, "Invalid type for 'parallel_tool_calls': expected a boolean.", "parallel_tool_calls",
                       "invalid_type")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise APIError(400, "'tool_choice' is only allowed when 'tools' are specified.", "tool_choice",
                           "invalid_value")
        return None
    if not isinstance(tools, list) or len(tools) > 128:
        raise APIError(400, "'tools' must be an array of at most 128 tools.", "tools", "invalid_value")
    found = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not TOOL_NAME.fullmatch(fn["name"]):
            raise APIError(400, f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                           "with a name of 1-64 letters, digits, '_' or '-'.", f"tools[{i}]", "invalid_value")
        parameters = fn.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise APIError(400, f"Invalid type for 'tools[{i}].function.parameters': expected an object.",
                           f"tools[{i}].function.parameters", "invalid_type")
        found.append(Tool(fn["name"], str(fn.get("description") or ""), parameters))
    names = {t.name for t in found}
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise APIError(400, "'tool_choice' must name one of the 'tools'.", "tool_choice", "invalid_value")
        choice = name
    elif choice is None:
        choice = "auto"
    elif choice not in ("auto", "none", "required"):
        raise APIError(400, "Invalid value for 'tool_choice': expected none, auto, required or a function.",
                       "tool_choice", "invalid_value")
    return ToolUse(found, choice, True if parallel is None else parallel)


def _response_format(body: dict) -> tuple[bool, dict | None]:
    """(is the reply constrained to JSON, the schema or None for any object) from `response_format`."""
    fmt = body.get("response_format")
    if fmt is None:
        return False, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind != "json_schema":
        raise APIError(400, "Invalid value for 'response_format.type': expected one of text, json_object, "
                       "json_schema.", "response_format.type", "invalid_value")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise APIError(400, "'response_format.json_schema' must be an object with a 'name'.",
                       "response_format.json_schema", "invalid_value")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise APIError(400, "Invalid type for 'response_format.json_schema.schema': expected an object.",
                       "response_format.json_schema.schema", "invalid_type")
    return True, schema  # `strict` or not, the reply is held to the schema


def parse_request(body: Any, defaults: DecodeConfig, context: int) -> tuple[list[dict], DecodeConfig, dict]:
    """(messages, decode config, options) from a chat-completions body; raises APIError."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", None, "invalid_json")
    messages = _messages(body)
    for name, off in UNSUPPORTED.items():
        if not off(body.get(name)):
            raise APIError(400, f"'{name}' is not supported by this server.", name, "unsupported_parameter")
    overrides: dict[str, Any] = {}
    max_tokens = _number(body, "max_completion_tokens", 1, context, True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, context, True)
    if max_tokens is not None:
        overrides["max_new_tokens"] = max_tokens
    for name, field, lo, hi, integer in (("temperature", "temperature", 0, 2, False),
                                         ("seed", "seed", -2**63, 2**64 - 1, True),
                                         ("block_size", "block_size", 0, context, True),
                                         ("first_block_size", "first_block_size", 0, context, True),
                                         ("threshold", "threshold", 0, 1, False),
                                         ("topk", "topk", 1, context, True),
                                         ("max_steps", "max_steps", 0, context, True)):
        value = _number(body, name, lo, hi, integer)
        if value is not None:
            overrides[field] = value
    if "seed" in overrides:
        overrides["seed"] %= 2**63  # torch.Generator seeds are unsigned 64-bit; keep it simple and positive
    _number(body, "top_p", 0, 1, False)  # accepted, not used: sampling is plain temperature sampling
    for name, choices in (("mode", ("diffusion", "ar")), ("rule", tuple(sorted(COMMIT_RULES)))):
        value = body.get(name)
        if value is not None:
            if value not in choices:
                raise APIError(400, f"Invalid value for '{name}': {json.dumps(value)[:40]}; expected one of "
                               f"{', '.join(choices)}.", name, "invalid_value")
            overrides[name] = value
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise APIError(400, "Invalid type for 'stream': expected a boolean.", "stream", "invalid_type")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise APIError(400, "Invalid type for 'stream_options': expected an object.", "stream_options",
                       "invalid_type")
    include_usage = (stream_options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError(400, "Invalid type for 'stream_options.include_usage': expected a boolean.",
                       "stream_options.include_usage", "invalid_type")
    try:
        cfg = replace(defaults, **overrides)
    except ValueError as err:
        raise APIError(400, str(err), None, "invalid_value") from err
    json_only, schema = _response_format(body)
    tool_use = _tool_use(body)
    if json_only and tool_use is not None:
        raise APIError(400, "'response_format' cannot be combined with 'tools' here.", "response_format",
                       "invalid_value")
    for name, asked in (("response_format", json_only), ("tools", tool_use is not None)):
        if asked and cfg.mode != "ar" and cfg.rule != "verify":
            raise APIError(400, f"'{name}' needs rule 'verify' or mode 'ar' (constrained decoding), not rule "
                           f"'{cfg.rule}'.", name, "invalid_value")
    return messages, cfg, {"stream": bool(stream), "include_usage": include_usage, "json": json_only,
                           "schema": schema, "tools": tool_use}


# --- responses -------------------------------------------------------------------------------

def _usage(last: Piece | None, prompt_tokens: int) -> dict:
    completion = last.tokens if last else 0
    prompt = last.prompt_tokens if last else prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _stats(last: Piece | None, cfg: DecodeConfig) -> dict:
    if last is None:
        return {"mode": cfg.mode}
    return {"mode": cfg.mode, "ttfb_ms": round(last.ttfb_ms, 1), "elapsed_ms": round(last.elapsed_ms, 1),
            "forwards": last.forwards, "tokens_per_forward": round(last.tokens / max(last.forwards, 1), 3),
            "prefilled_tokens": last.prefilled_tokens}


async def _wait_for_disconnect(receive) -> None:
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

    def __init__(self, events, on_cancel=None):
        self.events, self.on_cancel = events, on_cancel

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})

        async def pump() -> None:
            async with contextlib.aclosing(self.events) as events:
                async for event in events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        producer = asyncio.create_task(pump())
        watcher = asyncio.create_task(_wait_for_disconnect(receive))
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


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


# --- app -------------------------------------------------------------------------------------

class PrefixCaches:
    """Conversations kept between requests, keyed by the messages their cache covers (the prompt
    and the reply). Least recently used first out, at most `size`; a taken conversation belongs
    to its request alone until it is kept again. Correctness never depends on a hit: the engine
    reuses only the cached tokens that equal the new prompt's. An evicted or unfinished
    conversation is abandoned: its cache goes back to the engine's pool."""

    def __init__(self, engine: Engine, size: int):
        self.engine, self.size = engine, size
        self._kept: OrderedDict[str, Conversation] = OrderedDict()

    @staticmethod
    def key(messages: list[dict]) -> str:
        """The messages' text, with tool calls as (name, arguments) (their ids are made up per reply)."""
        canonical = json.dumps([[m["role"], m["content"].strip(),
                                 [[c["function"]["name"], json.loads(c["function"]["arguments"])]
                                  for c in m.get("tool_calls") or ()]] for m in messages], ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def take(self, messages: list[dict]) -> Conversation:
        """The conversation that ended where `messages` continue (all but the last), or a new one."""
        return self._kept.pop(self.key(messages[:-1]), None) or Conversation()

    def keep(self, messages: list[dict], reply: str, conversation: Conversation, tools_offered: bool) -> None:
        """Keep `conversation` under `messages` + `reply` as the next request will send them (a
        reply that calls tools comes back as an assistant message with `tool_calls`)."""
        calls = calls_in(reply) if tools_offered else []
        said = {"role": "assistant", "content": "", "tool_calls": calls} if calls else \
            {"role": "assistant", "content": reply}
        key = self.key([*messages, said])
        if key in self._kept:  # the same exchange again: the newer cache replaces the older
            self.engine.abandon(self._kept.pop(key))
        self._kept[key] = conversation
        while len(self._kept) > self.size:
            self.engine.abandon(self._kept.popitem(last=False)[1])


def build_app(engine: Engine, defaults: DecodeConfig, api_keys: dict[str, str] | None = None,
              max_input_chars: int = MAX_INPUT_CHARS, max_body_bytes: int = MAX_BODY_BYTES,
              kept_conversations: int = 8) -> Starlette:
    """`api_keys` (name -> key): when given and not empty, /v1/* requires one of them.
    `kept_conversations`: KV caches kept for conversations that may continue (PrefixCaches)."""
    install_redaction((api_keys or {}).values())  # no key in any log line (engine.common.redact)
    caches = PrefixCaches(engine, kept_conversations)
    model_id = engine.name
    created = int(time.time())
    context = engine.max_seq_len

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "engine"}]})

    async def model_info(request: Request) -> Response:
        name = request.path_params["name"]
        if name != model_id:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")
        return JSONResponse({"id": model_id, "object": "model", "created": created, "owned_by": "engine"})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": model_id})

    async def chat_completions(request: Request) -> Response | EventStream:
        info = request.scope.setdefault(LOG_KEY, {})
        raw = await _read_body(request, max_body_bytes)
        try:  # the one decoder of every front (engine.common.wire): bounded depth and numbers, no lone surrogates
            body = decode_json(raw, max_bytes=max_body_bytes)
        except WireError as err:
            if err.reason == "too_large":
                raise APIError(413, f"The request body is too large: {err.message}.", None,
                               "request_too_large") from None
            raise APIError(400, f"We could not parse the JSON body of your request: {err.message}.", None,
                           "invalid_json") from None
        if isinstance(body, dict) and body.get("model") is not None and body.get("model") != model_id:
            info["model"] = str(body.get("model"))[:60]
            raise APIError(404, f"The model `{info['model']}` does not exist; this server has "
                           f"`{model_id}`.", "model", "model_not_found")
        messages, cfg, opts = parse_request(body, defaults, context)
        chars = sum(len(m["content"]) for m in messages)
        if chars > max_input_chars:
            raise APIError(400, f"The messages hold {chars} characters; this server accepts at most "
                           f"{max_input_chars}.", "messages", "string_above_max_length")
        info.update(mode=cfg.mode, stream=opts["stream"], max_tokens=cfg.max_new_tokens)
        try:
            prompt = await asyncio.to_thread(engine.prompt_ids, messages, opts["tools"] and opts["tools"].tools)
        except jinja2.TemplateError as err:
            raise APIError(400, f"The chat template rejected the messages: {err}", "messages",
                           "invalid_value") from err
        info["prompt_tokens"] = len(prompt)
        if len(prompt) + cfg.max_new_tokens > context:
            raise APIError(400, f"This model's maximum context length is {context} tokens. However, you "
                           f"requested {len(prompt) + cfg.max_new_tokens} tokens ({len(prompt)} in the messages, "
                           f"{cfg.max_new_tokens} in the completion).", "messages", "context_length_exceeded")
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        now = int(time.time())
        constraint, tool_use = None, opts["tools"]
        try:
            if opts["json"]:
                constraint = await asyncio.to_thread(engine.grammars.json, opts["schema"])
            elif tool_use is not None:
                constraint = await asyncio.to_thread(engine.grammars.lark,
                                                     tool_use.grammar(tag_terminals(engine.tokenizer)))
        except GrammarError as err:
            raise APIError(400, str(err), "response_format.json_schema.schema" if opts["json"] else "tools",
                           "invalid_value") from err
        conversation = caches.take(messages)
        tools = tool_use.tools if tool_use is not None else None
        pieces = _kept_after(engine.stream(messages, cfg, conversation=conversation, constraint=constraint,
                                           tools=tools), messages, conversation, tool_use is not None)
        if opts["stream"]:
            return EventStream(_chunks(rid, now, pieces, cfg, opts, len(prompt), info),
                               on_cancel=lambda: info.update(finish="cancelled"))
        return await _complete(request, rid, now, pieces, cfg, len(prompt), info, tool_use is not None)

    async def _kept_after(pieces, messages: list[dict], conversation: Conversation, tools_offered: bool):
        """The pieces; then the conversation is kept for a continuation (unless it was cut short)."""
        text, finished = [], False
        try:
            async with contextlib.aclosing(pieces) as stream:
                async for piece in stream:
                    text.append(piece.text)
                    finished = piece.finish_reason is not None
                    yield piece
        finally:
            if finished:
                caches.keep(messages, "".join(text), conversation, tools_offered)
            else:
                engine.abandon(conversation)

    async def _complete(request: Request, rid: str, now: int, pieces, cfg: DecodeConfig, prompt_tokens: int,
                        info: dict, tools_offered: bool) -> Response:
        async def collect() -> tuple[str, Piece | None]:
            text, last = [], None
            async with contextlib.aclosing(pieces) as stream:
                async for piece in stream:
                    text.append(piece.text)
                    last = piece
            return "".join(text), last

        task = asyncio.create_task(collect())
        watcher = asyncio.create_task(_wait_for_disconnect(request.receive))
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
        except ContextOverflow as err:
            raise APIError(400, str(err), "messages", "context_length_exceeded") from err
        finish = last.finish_reason if last else "length"
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        calls = calls_in(text) if tools_offered else []
        if calls:
            message["content"], message["tool_calls"], finish = None, calls, "tool_calls"
        info.update(finish=finish, completion_tokens=last.tokens if last else 0,
                    ttfb_ms=last.ttfb_ms if last else None, forwards=last.forwards if last else 0)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": now, "model": model_id, "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": _usage(last, prompt_tokens), "x_engine": _stats(last, cfg)})

    async def _chunks(rid: str, now: int, pieces, cfg: DecodeConfig, opts: dict, prompt_tokens: int, info: dict):
        usage_field = {"usage": None} if opts["include_usage"] else {}

        def chunk(delta: dict, finish: str | None = None, **extra) -> bytes:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_id,
                         "system_fingerprint": None,
                         "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                         **usage_field, **extra})

        last: Piece | None = None
        calling, text = False, ""  # a reply that starts like a call is tool calls (their grammar says so)
        try:
            async with contextlib.aclosing(pieces) as stream:
                async for piece in stream:
                    text += piece.text
                    if opts["tools"] is not None and starts_a_call(text):
                        calling = True  # sent whole once complete: a call's arguments are JSON only when closed
                    elif last is None:
                        yield chunk({"role": "assistant", "content": piece.text})
                    elif piece.text:
                        yield chunk({"content": piece.text})
                    last = piece
        except ContextOverflow as err:
            info["finish"] = "error"
            yield _sse(APIError(400, str(err), "messages", "context_length_exceeded").body())
            return
        except Exception as err:  # the headers are out: report in-band, as OpenAI does
            log.exception("generation failed")
            info["finish"] = "error"
            yield _sse(APIError(500, f"generation failed: {err}", None, "server_error", "server_error").body())
            return
        finish = last.finish_reason if last else "length"
        if calling:
            calls = calls_in(text)
            yield chunk({"role": "assistant", "content": None,
                         "tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
            finish = "tool_calls" if calls else finish
        info.update(finish=finish, completion_tokens=last.tokens if last else 0,
                    ttfb_ms=last.ttfb_ms if last else None, forwards=last.forwards if last else 0)
        yield chunk({}, finish, x_engine=_stats(last, cfg))
        if opts["include_usage"]:
            yield _sse({"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_id,
                        "system_fingerprint": None, "choices": [], "usage": _usage(last, prompt_tokens)})
        yield b"data: [DONE]\n\n"

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

    app = Starlette(
        routes=[Route("/v1/models", models), Route("/v1/models/{name:path}", model_info),
                Route("/v1/chat/completions", chat_completions, methods=["POST"]), Route("/healthz", healthz)],
        middleware=[Middleware(RequestLog), Middleware(BearerAuth, keys=api_keys or {})],
        # Starlette types every handler as taking any Exception; each is called for its own class only
        exception_handlers={APIError: api_error, HTTPException: http_error,  # type: ignore[dict-item]
                            Exception: server_error})
    app.state.engine, app.state.defaults = engine, defaults
    return app


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length", "")
    if ascii_int(length, 20) is not None and int(length) > limit:
        raise APIError(413, f"The request body is {length} bytes; this server accepts at most {limit}.", None,
                       "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"The request body is over {limit} bytes.", None, "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class BearerAuth:
    """`Authorization: Bearer KEY` on /v1/* when keys are configured (constant-time comparison)."""

    def __init__(self, app, keys: dict[str, str]):
        self.app = app
        self.digests = {name: hashlib.sha256(key.encode()).digest() for name, key in keys.items()}

    def principal(self, scope) -> str | None:
        headers = dict((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", []))
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = hashlib.sha256(key.strip().encode()).digest()
        found = None
        for name, d in self.digests.items():
            if hmac.compare_digest(digest, d):
                found = name
        return found

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.digests or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        name = self.principal(scope)
        if name is None:
            has = any(k.lower() == b"authorization" for k, _ in scope.get("headers", []))
            err = APIError(401, "Incorrect API key provided." if has else
                           "You didn't provide an API key: send 'Authorization: Bearer <key>'.", None,
                           "invalid_api_key", "invalid_request_error")
            scope.setdefault(LOG_KEY, {})["error"] = "invalid_api_key"
            response = err.response()
            response.headers["www-authenticate"] = "Bearer"
            return await response(scope, receive, send)
        scope.setdefault(LOG_KEY, {})["principal"] = name  # the key's name, never the key
        return await self.app(scope, receive, send)


def load_api_keys(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """$ENGINE_API_KEYS and the file named by $ENGINE_API_KEYS_FILE (`engine.common.keys` format)."""
    env = os.environ if env is None else env
    try:
        return load_keys(env, "ENGINE_API_KEYS", env.get("ENGINE_API_KEYS_FILE", ""))
    except ConfigError as err:
        raise SystemExit(f"engine serve: {err}") from err


class RequestLog:
    """One log line per request: method, path, status, time, and what the handler noted."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]
        info = scope.setdefault(LOG_KEY, {})

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            client = scope.get("client") or ("-", 0)
            extra = " ".join(f"{k}={round(v, 1) if isinstance(v, float) else v}" for k, v in info.items())
            log.info("%s %s %s %d %.0fms %s", client[0], scope["method"], scope["path"], status[0],
                     (time.perf_counter() - start) * 1000, extra)


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
    log.info("serving %s (%s) on http://%s:%d/v1 (mode %s, max_tokens %d, %s)", engine.name, engine.loaded.weights,
             host, port, defaults.mode, defaults.max_new_tokens,
             f"API keys: {', '.join(sorted(keys))}" if keys else "no API keys")
    config = uvicorn.Config(build_app(engine, defaults, keys, **limits), host=host, port=port, access_log=False,
                            log_level="info")
    install_redaction(keys.values())  # again, now that uvicorn has set up its loggers' handlers
    server = uvicorn.Server(config)
    server.run()
    if not server.started:  # as uvicorn.run: it could not start (port in use...)
        raise SystemExit(3)
