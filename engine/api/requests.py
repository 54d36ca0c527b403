"""Requests of `/v1/chat/completions`: the body read within its bound, checked field by field, into
messages, a decode config and the options of the answer; whatever is wrong is an `APIError` with
OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`)."""

from __future__ import annotations

from collections.abc import Callable

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from engine.common.wire import WireError, ascii_int, decode_json
from engine.decode import COMMIT_RULES, DecodeConfig, DiffusionSpec
from engine.draft import LookupDrafter
from engine.tools import Tool, ToolUse


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


@dataclass(frozen=True)
class Options:
    """How a request wants its answer, besides the decode config."""

    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    json: bool = False  # response_format json_object / json_schema: the reply is held to `schema`
    schema: dict | None = None
    tools: ToolUse | None = None


# What one request may cost the scheduler that every request shares, checked before its first
# forward (`check_work`): every forward of every request waits for the largest row count in its
# batch, so a block is bounded like a prefill chunk (FIRST_PREFILL_CHUNK, about a slice of model
# time on slow machines); and all its forwards together at worst (each commits one token) like
# prefilling 32 contexts of 2,048 tokens. Without them `rule threshold, threshold 1.0,
# first_block_size 1024, max_tokens 1024` denoised a 1,024-row block one token a step (a million
# rows) while everyone else waited.
MAX_BLOCK_ROWS = 64
MAX_REQUEST_ROWS = 65536
MAX_ARGUMENTS_BYTES = 1 << 20  # a tool call's arguments (the body they come in is bounded the same)


@dataclass(frozen=True)
class Runs:
    """What the loaded model can run of a request's decode options: the one place they are checked
    against it (`check_runnable`), for requests and for `engine serve`'s own defaults alike."""

    draft_block: int | None = None  # a draft head drafts at most this many tokens a pass (None: prompt lookup)
    mask_blocks: bool = True  # mask-denoising rules (threshold, topk) need the PyTorch model's forward
    mask_block: int = DiffusionSpec.block_size  # the checkpoint's block, what `block_size 0` denoises

    @classmethod
    def of(cls, engine: Any) -> "Runs":
        """From an `engine.stream.Engine` (what it loaded); anything without `loaded` runs anything."""
        loaded = getattr(engine, "loaded", None)
        if loaded is None:
            return cls()
        drafter, spec = loaded.drafter, getattr(loaded, "spec", None)
        return cls(drafter.block if drafter is not None else None, loaded.model.mask_blocks,
                   (spec.sub_block_size or spec.block_size) if spec is not None else cls.mask_block)


def check_runnable(cfg: DecodeConfig, runs: Runs) -> None:
    """Raise a 400 APIError for a resolved config this model cannot run (it would fail, or hang,
    inside the engine's scheduler, where every other request waits too) or that would cost more
    than one request may (`check_work`)."""
    if cfg.mode != "ar" and cfg.rule == "verify":
        if runs.draft_block is not None and cfg.block_size > runs.draft_block:
            raise APIError(400, f"Invalid value for 'block_size': {cfg.block_size}; this model's draft head drafts "
                           f"at most {runs.draft_block} tokens a forward (0: its own block).", "block_size",
                           "invalid_value")
    elif cfg.mode != "ar" and not runs.mask_blocks:
        raise APIError(400, f"Invalid value for 'rule': '{cfg.rule}' denoises mask blocks, which this model's "
                       "kernels (llama.cpp) cannot run; use rule 'verify' or mode 'ar'.", "rule", "invalid_value")
    check_work(cfg, runs)


def worst_rows(cfg: DecodeConfig, runs: Runs) -> tuple[int, int]:
    """(tokens of the request's largest block, rows of all its forwards) at worst, before any runs:
    AR writes a token a forward; verify checks up to a block of drafted rows a forward and may
    commit only the base's own token; a mask rule denoises a block in at most `max_steps` steps,
    committing at worst one token a step (threshold) or `topk`."""
    n = cfg.max_new_tokens
    if cfg.mode == "ar":
        return 0, n
    if cfg.rule == "verify":  # the drafted rows, after the token they follow
        block = cfg.block_size or runs.draft_block or LookupDrafter.block
        return block, n * (1 + block)

    def block_rows(size: int) -> int:  # all the forwards of one block of `size` masks
        steps = size if cfg.rule == "threshold" else -(-size // cfg.topk)
        return size * min(cfg.max_steps or steps, steps)
    block = cfg.block_size or runs.mask_block
    first = min(cfg.first_block_size or block, n)
    full, tail = divmod(n - first, block)
    return max(first, block if full else tail), block_rows(first) + full * block_rows(block) + block_rows(tail)


def check_work(cfg: DecodeConfig, runs: Runs) -> None:
    """Refuse (400) a config whose forwards would hold the shared model too long: a block over
    `MAX_BLOCK_ROWS` rows, or over `MAX_REQUEST_ROWS` rows in all (`worst_rows`)."""
    largest, total = worst_rows(cfg, runs)
    if largest > MAX_BLOCK_ROWS:
        first = cfg.rule != "verify" and cfg.first_block_size > (cfg.block_size or runs.mask_block)
        name = "first_block_size" if first else "block_size"
        raise APIError(400, f"Invalid value for '{name}': {getattr(cfg, name)}; a block here holds at most "
                       f"{MAX_BLOCK_ROWS} tokens (every request's forward waits for the largest).", name,
                       "invalid_value")
    if total > MAX_REQUEST_ROWS:
        raise APIError(400, f"This request could cost up to {total} rows of model work (max_tokens "
                       f"{cfg.max_new_tokens}, rule '{cfg.rule}', blocks of up to {largest} tokens), more than the "
                       f"{MAX_REQUEST_ROWS} one request may take here: lower 'max_tokens', 'block_size' or "
                       "'max_steps'.", "max_tokens", "invalid_value")


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
        try:  # the one bounded decoder (engine.common.wire): `"[" * 1000` is a 400, not a RecursionError
            decode_json(fn["arguments"], max_bytes=MAX_ARGUMENTS_BYTES)
        except WireError as err:
            raise APIError(400, f"'{at}.function.arguments' is not valid JSON: {err.message}.",
                           f"{at}.function.arguments", "invalid_value") from None
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
        if (ref := ref_cycle(parameters)) is not None:
            raise APIError(400, f"Invalid 'tools[{i}].function.parameters': the '$ref' {json.dumps(ref)[:80]} leads "
                           "back to itself without any value in between, so no arguments match it.",
                           f"tools[{i}].function.parameters", "invalid_value")
        found.append(Tool(fn["name"], str(fn.get("description") or ""), parameters))
    names = {t.name for t in found}
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in names:
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
    if (ref := ref_cycle(schema)) is not None:
        raise APIError(400, f"Invalid 'response_format.json_schema.schema': the '$ref' {json.dumps(ref)[:80]} leads "
                       "back to itself without any value in between, so no JSON matches it.",
                       "response_format.json_schema.schema", "invalid_value")
    return True, schema  # `strict` or not, the reply is held to the schema


def ref_cycle(schema: dict) -> str | None:
    """A `$ref` of `schema` that leads back to where it is through `$ref`s and `allOf`s alone (no
    property or item in between: `{"$ref": "#"}`, two `$defs` naming each other), or None. Such a
    schema matches no value; compiled, it let only an empty, non-JSON reply through. A recursion
    through `properties` or `items` (a tree) is fine."""
    def target(ref: str) -> dict | None:  # a local JSON pointer (RFC 6901), else None (not followed)
        node: Any = schema
        for part in ref[1:].split("/")[1:] if ref.startswith("#") else [None]:
            if part is None:
                return None
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node if isinstance(node, dict) else None

    def same_value(node: dict) -> list[tuple[str | None, dict]]:  # what `node`'s value must also match
        ref, every = node.get("$ref"), node.get("allOf")
        out: list[tuple[str | None, dict]] = [(ref, t)] if isinstance(ref, str) and (t := target(ref)) is not None \
            else []
        return out + [(None, m) for m in every if isinstance(m, dict)] if isinstance(every, list) else out

    done: set[int] = set()
    for start in _subschemas(schema):
        path, stack = {id(start)}, [(start, iter(same_value(start)))]
        while stack:
            step = next(stack[-1][1], None)
            if step is None:
                node, _ = stack.pop()
                path.discard(id(node))
                done.add(id(node))
                continue
            ref, node = step
            if id(node) in path:
                return ref or "allOf"
            if id(node) not in done:
                path.add(id(node))
                stack.append((node, iter(same_value(node))))
    return None


def _subschemas(schema: dict) -> list[dict]:
    """Every object inside `schema`, itself included (the decoder bounded its depth)."""
    found, todo = [], [schema]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            found.append(item)
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return found


def parse_request(body: Any, defaults: DecodeConfig, context: int,
                  resolve: Callable[[DecodeConfig], DecodeConfig] = lambda cfg: cfg, runs: Runs = Runs(),
                  ) -> tuple[list[dict], DecodeConfig, Options]:
    """(messages, decode config, options) from a chat-completions body; raises APIError. `resolve`:
    the engine's `Engine.resolve` (mode 'diffusion' is AR where the model decodes AR), so the
    checks below and `x_engine.mode` see what will run; `runs`: what the model can run of it."""
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
        cfg = resolve(replace(defaults, **overrides))
    except ValueError as err:
        raise APIError(400, str(err), None, "invalid_value") from err
    check_runnable(cfg, runs)
    json_only, schema = _response_format(body)
    tool_use = _tool_use(body)
    if json_only and tool_use is not None:
        raise APIError(400, "'response_format' cannot be combined with 'tools' here.", "response_format",
                       "invalid_value")
    for name, asked in (("response_format", json_only), ("tools", tool_use is not None)):
        if asked and cfg.mode != "ar" and cfg.rule != "verify":
            raise APIError(400, f"'{name}' needs rule 'verify' or mode 'ar' (constrained decoding), not rule "
                           f"'{cfg.rule}'.", name, "invalid_value")
    return messages, cfg, Options(bool(stream), include_usage, json_only, schema, tool_use)



async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length", "")
    if ascii_int(length, 20) is not None and int(length) > limit:
        raise APIError(413, f"The request body is {length} bytes; this server accepts at most {limit}.", None,
                       "request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"The request body is over {limit} bytes.", None, "request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # gone before its body was in: nobody to answer, nothing went wrong here
        raise APIError(499, "The client closed the connection before sending the whole body.", None,
                       "client_disconnected") from None
    return b"".join(chunks)
