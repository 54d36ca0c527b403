"""Tools a voice turn may call: the built-ins (time, timer, calculator) and the user's webhooks.

The LM is offered them as OpenAI function tools ([tools] in the config). A reply that calls
tools is not spoken: the calls run, and the model answers again with their results folded into
the user's message, `What time is it?\\n\\n(Result of get_time: 3:47 PM on ...)`. Our default
model answers that form well; given OpenAI's `tool` messages instead it talked about the JSON
("This response indicates that...": docs/TOOLS.md). Pure tools (time, calculator) may run
while the reply is still a speculation (voice/conversation/turns.py); webhooks and timers act on the world,
so they wait until the user's turn has really ended. Barge-in cancels calls still running.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import json
import logging
import math
import operator
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, tzinfo
from typing import TYPE_CHECKING, cast

from engine.common.keys import ConfigError
from engine.common.redact import add_secrets
from voice.config import ToolsConfig, WebhookConfig

if TYPE_CHECKING:
    import httpx2

log = logging.getLogger("voice.tools")
CUT_NOTE = " [cut: the rest was too long]"  # so the model does not take a part for the whole


@dataclass
class ToolRun:
    """One call and what came of it, as the call records keep it."""

    id: str
    name: str
    arguments: dict
    result: str = ""
    status: str = "running"  # ok | error | cancelled
    ms: float = 0.0
    started: float = 0.0  # monotonic, when it was started

    @classmethod
    def of(cls, call: dict) -> "ToolRun":
        """From an OpenAI-shaped call (`function.arguments` a JSON string)."""
        fn = call.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = None
        run = cls(call.get("id", ""), str(fn.get("name", "")), args if isinstance(args, dict) else {})
        if not isinstance(args, dict):
            run.status, run.result = "error", "the arguments are not a JSON object"
        return run

    def record(self) -> dict:
        return {"id": self.id, "name": self.name, "arguments": self.arguments, "result": self.result,
                "status": self.status, "ms": round(self.ms, 1)}


class ToolError(Exception):
    """What the model is told instead of a result."""


def clipped(text: str, max_chars: int) -> str:
    """`text`, or its first `max_chars` characters and CUT_NOTE."""
    return text if len(text) <= max_chars else text[:max_chars] + CUT_NOTE


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token (RFC 9110)
_HEADER_VALUE = re.compile(r"^[\x20-\x7e\t]*$")  # what every HTTP client sends as it is: printable ASCII


def webhook_secrets(config: ToolsConfig) -> dict[str, dict[str, str] | None]:
    """Each webhook's headers, read from the environment once, at start-up; None for a webhook whose
    variable is unset (its calls fail, and the model says so). A header HTTP cannot carry is a
    ConfigError that names the variable, never the value (an encoding error would quote it), and
    every value is redacted from the log from now on."""
    found: dict[str, dict[str, str] | None] = {}
    for hook in config.webhooks:
        headers: dict[str, str] | None = {}
        for header, env in hook.headers_env.items():
            value = os.environ.get(env)
            if value is None:
                headers = None
                continue
            if not _HEADER_NAME.match(header) or not _HEADER_VALUE.match(value):
                raise ConfigError(f"tools.webhooks.{hook.name}: ${env} cannot be sent as the {header!r} header "
                                  "(HTTP headers are printable ASCII, without line breaks)")
            add_secrets([value, *value.split()[-1:]])  # `Bearer <token>`: the token alone too
            if headers is not None:
                headers[header] = value
        found[hook.name] = headers
    return found


def with_results(messages: list[dict], runs: list[ToolRun]) -> list[dict]:
    """`messages` with the tools' results folded into the last user message (see the module doc)."""
    notes = "; ".join(f"Result of {r.name}: {r.result}" if r.status == "ok" else f"{r.name} failed: {r.result}"
                      for r in runs)
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = list(messages)
    out[last] = {**messages[last], "content": f"{messages[last]['content']}\n\n({notes})"}
    return out


# --- the built-ins ------------------------------------------------------------------------------

def spoken_duration(seconds: int) -> str:
    parts = []
    for unit, size in (("hour", 3600), ("minute", 60), ("second", 1)):
        n, seconds = divmod(seconds, size)
        if n:
            parts.append(f"{n} {unit}{'s' if n != 1 else ''}")
    return " ".join(parts) or "0 seconds"


def spoken_clock(t: datetime) -> str:
    return f"{t.hour % 12 or 12}:{t.minute:02d} {'AM' if t.hour < 12 else 'PM'}"


_OPS: dict[type, Callable[..., float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Arithmetic only (numbers, + - * / // % ** and parentheses; `x`, `×`, `÷`, `^` as people
    write them), read with Python's own parser and walked here, never evaluated as code."""
    text = expression.replace("×", "*").replace("÷", "/").replace("^", "**").replace(",", "")
    text = re.sub(r"(?<=[\d)\s])x(?=[\s\d(])", "*", text)

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return cast(float, node.value)  # an int or a float
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 100 or abs(left) > 1e6):
                raise ToolError("that power is too large to work out")
            out = _OPS[type(node.op)](left, right)
            if isinstance(out, complex):
                raise ToolError("that has no real-number answer")
            if isinstance(out, int) and out.bit_length() > 1024 or isinstance(out, float) and not math.isfinite(out):
                raise ToolError("the numbers get too large to work out")
            return out
        raise ToolError(f"only arithmetic can be calculated, not {expression!r}")

    try:
        result = value(ast.parse(text, mode="eval").body)
        if isinstance(result, int) and abs(result) >= 10**15:
            result = float(result)
    except SyntaxError:
        raise ToolError(f"{expression!r} is not an arithmetic expression") from None
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (ArithmeticError, ValueError, TypeError, MemoryError, RecursionError) as err:
        # Python's own words ("int too large to convert to float") are not for the model to read out
        log.info("calculate(%r): %s: %s", expression[:80], type(err).__name__, err)
        raise ToolError("that cannot be worked out") from None
    if isinstance(result, float):
        if not math.isfinite(result):  # `1e999` is infinity already as written
            raise ToolError("the numbers get too large to work out")
        shown = str(int(result)) if result.is_integer() and abs(result) < 1e15 else f"{result:.6g}"
        return f"{expression.strip()} = {shown}"
    return f"{expression.strip()} = {result}"


class Timers:
    """One session's timers: each says so (through `announce`) when it is due, while the session is open."""

    def __init__(self, announce: Callable[[str], Awaitable[None]], zone: tzinfo | None = None) -> None:
        self.announce, self.zone = announce, zone
        self.running: set[asyncio.Task] = set()

    def start(self, seconds: int, label: str) -> str:
        due = datetime.now(self.zone) + timedelta(seconds=seconds)
        what = f"{label} timer" if label else f"{spoken_duration(seconds)} timer"
        task = asyncio.create_task(self._ring(seconds, f"Your {what} is done."))
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        return f"A {spoken_duration(seconds)} timer is set{f' for {label}' if label else ''}; it rings at " \
               f"{spoken_clock(due)}."

    async def _ring(self, seconds: float, text: str) -> None:
        await asyncio.sleep(seconds)
        await self.announce(text)

    def cancel_all(self) -> None:
        for task in list(self.running):
            task.cancel()


@dataclass
class Tool:
    description: str
    parameters: dict
    pure: bool  # no effect on the world: may run while the reply is a speculation
    run: Callable[[dict, Timers], Awaitable[str]]
    speaks: bool = False  # it says something to the user itself while it runs (read_keypad's prompt): no filler


@dataclass
class Toolbox:
    """The tools of the service (one per process; each session brings its own Timers)."""

    config: ToolsConfig
    tools: dict[str, Tool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        import zoneinfo
        self.zone = zoneinfo.ZoneInfo(self.config.time_zone) if self.config.time_zone else None
        self._client: httpx2.AsyncClient | None = None  # the webhooks' (made on first use)
        self.secrets = webhook_secrets(self.config)
        string = {"type": "string", "maxLength": 100}
        if "time" in self.config.builtin:
            self.tools["get_time"] = Tool("The current local time and date.", {
                "type": "object", "properties": {}, "additionalProperties": False}, True, self._time)
        if "timer" in self.config.builtin:
            self.tools["set_timer"] = Tool("Start a countdown timer that speaks up when it is done.", {
                "type": "object", "properties": {"seconds": {"type": "integer", "minimum": 1, "maximum": 86400},
                                                 "label": {"type": "string", "maxLength": 40}},
                "required": ["seconds"], "additionalProperties": False}, False, self._timer)
        if "calculator" in self.config.builtin:
            self.tools["calculate"] = Tool("Evaluate an arithmetic expression, e.g. 17 * 23.", {
                "type": "object", "properties": {"expression": string}, "required": ["expression"],
                "additionalProperties": False}, True, self._calculate)
        for hook in self.config.webhooks:
            def run(args: dict, _timers: Timers, hook: WebhookConfig = hook) -> Awaitable[str]:
                return self._webhook(hook, args)
            self.tools[hook.name] = Tool(hook.description, hook.parameters, False, run)

    def __bool__(self) -> bool:
        return bool(self.tools)

    def with_tools(self, extra: dict[str, Tool]) -> Toolbox:
        """These tools and `extra` (one session's own: a phone call's, conversation/calltools.py); the webhooks' client
        stays this toolbox's."""
        out = copy.copy(self)
        out.tools = {**self.tools, **extra}
        return out

    def openai(self) -> list[dict]:
        """The tools as the chat-completions API declares them."""
        return [{"type": "function", "function": {"name": name, "description": t.description,
                                                  "parameters": t.parameters}} for name, t in self.tools.items()]

    def pure(self, name: str) -> bool:
        return name in self.tools and self.tools[name].pure

    def speaks(self, name: str) -> bool:
        return name in self.tools and self.tools[name].speaks

    async def run(self, run: ToolRun, timers: Timers) -> None:
        """Run one call, filling in its result, status and time (a failure is a result too: the
        model is told and says so). Cancelling the task cancels the call."""
        start = time.monotonic()
        tool = self.tools.get(run.name)
        try:
            if run.status == "error":
                raise ToolError(run.result)
            if tool is None:
                raise ToolError(f"there is no tool called {run.name!r}")
            run.result, run.status = clipped(await tool.run(run.arguments, timers), self.config.max_result_chars), "ok"
        except asyncio.CancelledError:
            run.status, run.result = "cancelled", "cancelled (the user spoke)"
            raise
        except ToolError as err:
            run.status, run.result = "error", str(err)
        except Exception as err:  # noqa: BLE001 - a tool's bug or a broken webhook: the model says it could not
            log.warning("tool %s failed: %r", run.name, err, exc_info=True)
            # the model is told that it failed, in words: never Python's exception text
            run.status, run.result = "error", f"the {run.name} tool failed on the server"
        finally:
            run.ms = (time.monotonic() - start) * 1000
            log.info("tool %s(%s) -> %s in %.0f ms: %s", run.name, json.dumps(run.arguments)[:200], run.status,
                     run.ms, run.result[:200])

    async def _time(self, args: dict, timers: Timers) -> str:
        now = datetime.now(self.zone) if self.zone else datetime.now().astimezone()
        return f"{spoken_clock(now)} on {now:%A}, {now.day} {now:%B %Y} ({now.tzname()})"

    async def _timer(self, args: dict, timers: Timers) -> str:
        seconds, label = args.get("seconds"), args.get("label") or ""
        if not isinstance(seconds, int) or isinstance(seconds, bool) or not 1 <= seconds <= 86400:
            raise ToolError("seconds must be a whole number from 1 to 86400")
        if not isinstance(label, str):
            raise ToolError("label must be text")
        return timers.start(seconds, label.strip()[:40])

    async def _calculate(self, args: dict, timers: Timers) -> str:
        expression = args.get("expression")
        if not isinstance(expression, str) or not expression.strip():
            raise ToolError("expression must be text")
        return calculate(expression[:200])

    async def _webhook(self, hook: WebhookConfig, args: dict) -> str:
        """POST the arguments; the body, read no further than the model is given. `timeout_s` bounds
        the whole call: a server that trickles its body is cut off like one that does not answer."""
        import httpx2
        headers = self.secrets[hook.name]
        if headers is None:
            raise ToolError(f"the {hook.name} tool is not set up (its secret is missing on the server)")
        if self._client is None:
            self._client = httpx2.AsyncClient(follow_redirects=False)  # a redirect must not leave the allow-list
        try:
            async with asyncio.timeout(hook.timeout_s):
                async with self._client.stream("POST", hook.url, json=args, timeout=hook.timeout_s,
                                               headers={**headers, "Accept-Encoding": "identity"}) as response:
                    if response.status_code >= 300:
                        raise ToolError(f"{hook.name} answered HTTP {response.status_code}")
                    body = await self._read_body(response)
        except (TimeoutError, httpx2.TimeoutException):
            raise ToolError(f"{hook.name} did not answer within {hook.timeout_s:g} s") from None
        except httpx2.HTTPError as err:
            raise ToolError(f"{hook.name} could not be reached ({type(err).__name__})") from None
        return body.decode(response.encoding or "utf-8", "replace").strip() or "done"

    async def _read_body(self, response: httpx2.Response) -> bytes:
        """The body's first bytes: enough for `max_result_chars` characters of any encoding (4 bytes at
        most each), and one more, so that the result is cut with a note; the rest is never read."""
        wanted = 4 * self.config.max_result_chars + 1
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk[:wanted - len(body)]
            if len(body) >= wanted:
                break
        return bytes(body)

    async def aclose(self) -> None:
        """Close the webhooks' connections (a later call opens new ones, on its own event loop)."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
