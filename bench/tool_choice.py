"""Tool selection: does the model call the right tool (or none) for everyday voice requests?

    python bench/tool_choice.py [--model default] [--json bench/results/tool_choice.json]

Six tools a voice assistant would offer; 36 requests of our own, each with the tool it should
call (or none: chit-chat and general questions); `tool_choice: auto`, greedy, lossless verify,
the call constrained to its schema (engine.tools). A request scores when the model calls
exactly the expected tool (for "none": answers in text). One thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, write_json  # noqa: E402

S = {"type": "string", "maxLength": 40}
TOOLS = {
    "get_weather": ("The weather in a city today or tomorrow.",
                    {"type": "object", "properties": {"city": S, "day": {"enum": ["today", "tomorrow"]}},
                     "required": ["city", "day"], "additionalProperties": False}),
    "get_time": ("The current local time and date.", {"type": "object", "properties": {},
                                                       "additionalProperties": False}),
    "set_timer": ("Start a countdown timer.", {"type": "object", "properties": {
        "minutes": {"type": "integer", "minimum": 1, "maximum": 600}, "label": S},
        "required": ["minutes"], "additionalProperties": False}),
    "calculate": ("Evaluate an arithmetic expression.", {"type": "object", "properties": {"expression": S},
                                                         "required": ["expression"], "additionalProperties": False}),
    "add_to_shopping_list": ("Add items to the shopping list.", {"type": "object", "properties": {
        "items": {"type": "array", "items": S, "maxItems": 8}}, "required": ["items"],
        "additionalProperties": False}),
    "turn_on_light": ("Turn on the lights in a room.", {"type": "object", "properties": {"room": S},
                                                        "required": ["room"], "additionalProperties": False}),
}
REQUESTS = [
    ("What's the weather like in Paris?", "get_weather"), ("Will it rain in London tomorrow?", "get_weather"),
    ("Is it cold in Oslo today?", "get_weather"), ("Do I need an umbrella in Dublin tomorrow?", "get_weather"),
    ("Forecast for Rome tomorrow, please.", "get_weather"), ("How hot is it in Cairo?", "get_weather"),
    ("What time is it?", "get_time"), ("What's the date today?", "get_time"), ("Tell me the time.", "get_time"),
    ("What day of the week is it?", "get_time"), ("Is it past noon yet?", "get_time"),
    ("Set a timer for ten minutes.", "set_timer"), ("Remind me in half an hour with a timer.", "set_timer"),
    ("Start a 45 minute timer for the laundry.", "set_timer"), ("Timer for three minutes, eggs.", "set_timer"),
    ("Put a two hour timer on for the roast.", "set_timer"), ("Set a timer for one minute.", "set_timer"),
    ("What is 17 times 23?", "calculate"), ("How much is 1250 divided by 5?", "calculate"),
    ("Calculate 15 percent of 80.", "calculate"), ("What's 3.5 plus 4.25?", "calculate"),
    ("What is 2 to the power of 10?", "calculate"), ("Add milk and eggs to my shopping list.", "add_to_shopping_list"),
    ("Put bread on the shopping list.", "add_to_shopping_list"),
    ("We're out of coffee, add it to the list.", "add_to_shopping_list"),
    ("Add apples, pears and bananas to the list.", "add_to_shopping_list"),
    ("Turn on the kitchen lights.", "turn_on_light"), ("Switch the lights on in the bedroom.", "turn_on_light"),
    ("Lights on in the living room, please.", "turn_on_light"),
    ("It's dark in the hallway, light it up.", "turn_on_light"),
    ("Hello, how are you?", None), ("Tell me a joke.", None), ("Who wrote Romeo and Juliet?", None),
    ("What is the capital of Spain?", None), ("Thank you, that's all.", None), ("Why is the sky blue?", None),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--json", default=str(RESULTS / "tool_choice.json"))
    a = p.parse_args()
    import torch

    from engine.decode import DecodeConfig
    from engine.stream import Engine
    from engine.tools import Tool, ToolUse, calls_in, tag_terminals
    torch.set_num_threads(1)
    engine = Engine.load(a.model)
    tools = [Tool(name, description, schema) for name, (description, schema) in TOOLS.items()]
    use = ToolUse(tools, "auto", parallel=False)
    grammar = use.grammar(tag_terminals(engine.tokenizer))
    system = "You are a voice assistant. Use a tool when one fits the request; otherwise answer briefly."
    rows, right, by_tool = [], 0, {}
    for request, expected in REQUESTS:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": request}]
        start = time.perf_counter()
        pieces = list(engine.generate_sync(messages, DecodeConfig(max_new_tokens=48),
                                           constraint=engine.grammars.lark(grammar), tools=tools))
        text = "".join(piece.text for piece in pieces)
        calls = calls_in(text)
        called = [c["function"]["name"] for c in calls]
        ok = called == ([expected] if expected else [])
        right += ok
        stats = by_tool.setdefault(expected or "none", [0, 0])
        stats[0] += ok
        stats[1] += 1
        rows.append({"request": request, "expected": expected, "called": called,
                     "arguments": [c["function"]["arguments"] for c in calls], "text": "" if calls else text,
                     "right": ok, "ms": round((time.perf_counter() - start) * 1000)})
        print(f"{'ok ' if ok else 'BAD'} {request[:46]:46s} expected {expected or '-':22s} got "
              f"{', '.join(called) or 'text: ' + text[:40]!s}", flush=True)
    summary = {"right": right, "of": len(REQUESTS), "rate": round(right / len(REQUESTS), 3),
               "by_expected": {k: f"{v[0]}/{v[1]}" for k, v in by_tool.items()}}
    print(json.dumps(summary, indent=1))
    write_json(a.json, {"model": engine.name, "summary": summary, "rows": rows, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
