"""Tool calling: OpenAI's `tools` in the model's own chat template, calls held to their schemas.

A call is written the way Qwen2.5 was trained to write it, `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>` (or as that JSON object alone, which small models often do), and a
tool's result comes back as `<tool_response>...</tool_response>` in a user turn. A template
with a tool format of its own (Qwen2.5's) renders `tools`, assistant `tool_calls` and `tool`
messages itself; for one without (SmolLM2's) the same text is put into plain messages (the
documented fallback): the tool list in the system message, calls and results as ordinary turns.

The reply is constrained by a grammar (engine.grammar) built from `tool_choice`:
- "auto": either text, which may not start like a call ("<", "{" or a Markdown fence: small
  models often write a call that way, and must then write a valid one), or one call (several
  with `parallel_tool_calls`), whose arguments match the named tool's parameters schema;
- "required" / a named function: only calls (of that function);
- "none": only text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.common.wire import WireError, decode_json

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
MAX_CALL_BYTES = 1 << 20  # one call's JSON in a reply (a reply is far shorter)
CALL_STARTS = ("<", "{")  # how a call begins, in tags or as bare JSON; the grammar's text begins with neither


def starts_a_call(text: str) -> bool:
    """Is a reply that begins with `text` tool calls rather than text (under `ToolUse.grammar`)?"""
    return text.startswith(CALL_STARTS)


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class ToolUse:
    """The tools a request offers and how the reply may use them."""

    tools: list[Tool]
    choice: str = "auto"  # auto | none | required | the name of one function
    parallel: bool = True

    def grammar(self, tags: tuple[str, str] = ('"<tool_call>"', '"</tool_call>"')) -> str:
        """The reply's grammar, in llguidance's Lark (JSON schemas embedded with %json); `tags`: how
        it spells the call's opening and closing tag (see `tag_terminals`)."""
        from engine.grammar import LAYOUT  # here: reading calls (`calls_in`) needs neither torch nor llguidance
        # Text may not start like a call: small models (Qwen2.5-Coder-0.5B) often write a call as bare
        # JSON or in a Markdown fence instead of in tags; either way it must then be a valid call.
        text = 'TEXT: /[^<{`](?s:.)*/\n'  # none of CALL_STARTS, nor a fence
        if self.choice == "none":
            return "start: TEXT\n" + text
        allowed = [t for t in self.tools if self.choice in ("auto", "required", t.name)]
        call_schema = {"oneOf": [{"type": "object", "properties": {"name": {"const": t.name},
                                                                    "arguments": t.parameters or {"type": "object"}},
                                  "required": ["name", "arguments"], "additionalProperties": False}
                                 for t in allowed], "x-guidance": LAYOUT}
        calls = 'calls: call ("\\n" call)*\n' if self.parallel else "calls: call\n"
        start = "start: TEXT | calls\n" if self.choice == "auto" else "start: calls\n"
        return (start + calls + f'call: {tags[0]} "\\n" body "\\n" {tags[1]} | body\n'
                f"body: %json {json.dumps(call_schema)}\n" + text)


def tag_terminals(tokenizer: Tokenizer) -> tuple[str, str]:
    """`<tool_call>` and `</tool_call>` as grammar terminals: the token by id where the vocabulary
    has the tag as one token (Qwen2.5: special tokens, which never match as text), else the text."""
    found = []
    for tag in ("<tool_call>", "</tool_call>"):
        token = tokenizer.token_id(tag)
        found.append(f"<[{token}]>" if token is not None else json.dumps(tag))
    return found[0], found[1]


def calls_in(text: str) -> list[dict]:
    """The tool calls a reply makes, OpenAI-shaped ([] for a plain text reply): calls in tags, or
    (the grammar's other form) bare JSON objects, one per line."""
    found = []
    bodies = [m.group(1) for m in CALL.finditer(text)] or \
        [line for line in text.strip().splitlines() if line.startswith("{")]
    for body in bodies:
        try:  # bounded (engine.common.wire): a reply of 1,000 "[" is no RecursionError
            call = decode_json(body, max_bytes=MAX_CALL_BYTES)
        except WireError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call:
            found.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"],
                                       "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}})
    return found


def for_template(messages: list[dict], tools: list[Tool], native: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as the chat template takes them. `native`: the template has a tool format;
    else everything is turned into plain system/user/assistant text the same way Qwen2.5 writes it."""
    def arguments(call: dict) -> dict:
        args = call["function"]["arguments"]
        return json.loads(args) if isinstance(args, str) else args

    if native:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "content": m.get("content") or "",
                     "tool_calls": [{"function": {"name": c["function"]["name"], "arguments": arguments(c)}}
                                    for c in m["tool_calls"]]}
            out.append(m)
        return out, [t.openai() for t in tools] or None
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": arguments(c)})
                              + "\n</tool_call>" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        listing = "\n".join(json.dumps(t.openai()) for t in tools)
        note = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                f"with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\nFor "
                "each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, None
