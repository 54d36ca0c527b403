"""A phone call's own tools, offered to the LM on telephony sessions only (`[telephony] tools`).

`end_call`: the call ends once the reply that called it has been spoken to the end (its goodbye: the
model answers again with the tool's result, as with any tool); a caller who talks over the goodbye
stays on the line. `transfer_call(target)`: the transport hands the caller to one of
`[telephony] transfer_targets` (SIP REFER, Twilio's REST API) and the call ends; a refused or failed
transfer keeps the caller, and the model is told why, to say so. The target is a name from the
configuration: the tool's schema is an `enum` of the names (the constrained decoding cannot write
another) and the executor refuses any other, so the model can neither invent nor dial a number.
`read_keypad(prompt)`: `prompt` is said as part of the reply, then the next key sequence the caller
presses (voice/conversation/keypad.py) is the tool's result instead of a turn of theirs: digits go to the
model as data it asked for (an account number, a PIN); no keys within `[telephony] keypad_timeout_s`: the
result says so.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from voice.config import TelephonyConfig
from voice.pipeline.tools import Timers, Tool, ToolError

# The first-token gate of tool calls (voice.pipeline.lm, `[lm] tool_call_log_odds`) on a phone call offering end_call,
# per model and the tools offered (the tools' descriptions in the prompt move the log-odds), while `[telephony]
# tool_call_log_odds` is unset: the 1.5B answers most goodbyes in words at its own -2.6. Each chosen on
# bench/call_end.py's calibration split (0.5 above its highest ordinary turn), then measured on its held-out split
# (BENCHMARKS.md, "A phone agent ends the call, held out"). Any other model or set of tools keeps the LM's own gate.
CALL_GATES: dict[tuple[str, tuple[str, ...]], float] = {("qwen2.5-1.5b", ("end_call",)): -3.3}


class Phone(Protocol):
    """What a call's transport does for its tools (voice/transports/sip.py, twilio.py)."""

    async def transfer(self, name: str, target: str) -> str | None:
        """Hand the caller to `target` (a SIP URI or a phone number); None once they are handed over (the
        transport then ends the call), else why it failed, in words for the model."""
        ...


def call_tools(config: TelephonyConfig, phone: Phone, end_after_reply: Callable[[str], None],
               read_keys: Callable[[str], Awaitable[str | None]]) -> dict[str, Tool]:
    """The tools of `config.tools`; `end_after_reply(reason)` ends the call once the current reply is heard;
    `read_keys(prompt)` says `prompt`, then waits for the caller's next key sequence (None: none came in time)."""
    tools: dict[str, Tool] = {}
    if "end_call" in config.tools:
        async def end_call(args: dict, timers: Timers) -> str:
            end_after_reply("end_call")
            return "the call ends after this reply: say goodbye"
        tools["end_call"] = Tool("End the phone call, once the caller's business is done or they say goodbye.", {
            "type": "object", "properties": {}, "additionalProperties": False}, False, end_call)
    if "transfer_call" in config.tools and config.transfer_targets:
        targets = dict(config.transfer_targets)

        def transfer_call(args: dict, timers: Timers) -> Awaitable[str]:
            return _transfer(phone, targets, args)
        tools["transfer_call"] = Tool("Transfer the caller to a person: one of the listed targets.", {
            "type": "object", "properties": {"target": {"type": "string", "enum": sorted(targets)}},
            "required": ["target"], "additionalProperties": False}, False, transfer_call)
    if "read_keypad" in config.tools:
        async def read_keypad(args: dict, timers: Timers) -> str:
            keys = await read_keys(str(args.get("prompt", ""))[:200])
            if keys is None:
                return f"the caller pressed no keys within {config.keypad_timeout_s:g} seconds"
            return f"the caller pressed {' '.join(keys)}"
        tools["read_keypad"] = Tool(
            "Ask the caller to type digits on their phone's keypad (an account number, a PIN, a menu choice): "
            "the prompt is said to them and the keys they press are the result.", {
                "type": "object", "properties": {"prompt": {"type": "string", "maxLength": 200}},
                "required": ["prompt"], "additionalProperties": False}, False, read_keypad, speaks=True)
    return tools


def call_prompt(system_prompt: str, config: TelephonyConfig) -> str:
    """A phone call's system prompt: `config.call_prompt` added when end_call is offered (the default model
    needs to be told when a call ends: BENCHMARKS.md, "A phone agent ends the call")."""
    if "end_call" not in config.tools or not config.call_prompt:
        return system_prompt
    return f"{system_prompt} {config.call_prompt}" if system_prompt else config.call_prompt


def call_gate(config: TelephonyConfig, model: str, offered: list[str]) -> float | None:
    """The tool-call gate of a phone call's replies when end_call is among the tools `offered`:
    `config.tool_call_log_odds`, else the one CALL_GATES has for the model and these tools; None: the LM's own."""
    if "end_call" not in offered:
        return None
    if config.tool_call_log_odds is not None:
        return config.tool_call_log_odds
    return CALL_GATES.get((model, tuple(sorted(offered))))


async def _transfer(phone: Phone, targets: dict[str, str], args: dict) -> str:
    name = args.get("target")
    if not isinstance(name, str) or name not in targets:
        raise ToolError(f"{str(name)[:40]!r} is not a transfer target; the targets are {', '.join(sorted(targets))}")
    why = await phone.transfer(name, targets[name])
    if why is not None:
        raise ToolError(f"the transfer to {name} failed ({why}); the caller is still on the line")
    return f"the caller is transferred to {name}"
