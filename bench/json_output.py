"""JSON output with and without constrained decoding: valid-JSON rate and what the grammar costs.

    python bench/json_output.py [--model default] [--json bench/results/json_output.json]

50 requests (5 schemas x 10 questions), each asked twice, greedy, lossless `verify`:
- unconstrained: the schema is in the system prompt, as a client without `response_format`
  would do; the reply counts as valid if it parses and validates (jsonschema), after stripping a
  Markdown code fence around it;
- constrained: the same messages with the grammar of the schema (engine.grammar).
Also the mask time per committed token (the grammar's own cost, timed inside `Constraint`) and
tokens per forward (the grammar's forced tokens are drafted for free). One thread.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, percentile, write_json  # noqa: E402

S = {"type": "string", "maxLength": 60}
SCHEMAS = {
    "answer": ({"type": "object", "properties": {"answer": S, "confident": {"type": "boolean"}},
                "required": ["answer", "confident"], "additionalProperties": False},
               ["What is the capital of Spain?", "How many legs does a spider have?", "What is seven times eight?",
                "Which planet is closest to the sun?", "What colour do you get by mixing blue and yellow?",
                "How many days are in a leap year?", "What is the boiling point of water in Celsius?",
                "Who wrote Romeo and Juliet?", "What is the largest ocean?", "How many minutes are in an hour?"]),
    "timer": ({"type": "object", "properties": {"minutes": {"type": "integer", "minimum": 0, "maximum": 600},
                                                "label": S}, "required": ["minutes", "label"],
               "additionalProperties": False},
              ["Set a timer for ten minutes for the pasta.", "Remind me in half an hour to call mum.",
               "Timer for five minutes, tea.", "I need a two hour timer for the roast.",
               "Start a 45 minute timer for laundry.", "Set a timer for one minute.",
               "Give me a timer of 20 minutes called homework.", "Timer: 3 minutes, eggs.",
               "Set a 90 minute timer for the movie.", "Put a timer on for a quarter of an hour."]),
    "weather": ({"type": "object", "properties": {"city": S, "unit": {"enum": ["celsius", "fahrenheit"]},
                                                  "day": {"enum": ["today", "tomorrow"]}},
                 "required": ["city", "unit", "day"], "additionalProperties": False},
                ["What's the weather in Paris today?", "Will it rain in London tomorrow?",
                 "How warm is it in Tokyo right now, in Fahrenheit?", "Weather for Berlin tomorrow please.",
                 "Is it cold in Oslo today?", "What will the weather be like in Madrid tomorrow?",
                 "Temperature in New York today in Fahrenheit.", "Do I need an umbrella in Dublin today?",
                 "Forecast for Rome tomorrow.", "How hot is it in Cairo today?"]),
    "shopping": ({"type": "object", "properties": {"items": {"type": "array", "items": S, "maxItems": 8}},
                  "required": ["items"], "additionalProperties": False},
                 ["Add milk and eggs to my shopping list.", "I need bread, butter and jam.",
                  "Put apples on the list.", "We are out of coffee and sugar.", "Add three onions and garlic.",
                  "Shopping list: rice, beans, tortillas.", "Add toothpaste.", "Get pasta and tomato sauce.",
                  "I need batteries and light bulbs.", "Add chicken, carrots and potatoes to the list."]),
    "contact": ({"type": "object", "properties": {"name": S, "action": {"enum": ["call", "message"]},
                                                  "text": S}, "required": ["name", "action", "text"],
                 "additionalProperties": False},
                ["Call Anna.", "Send a message to Tom saying I'm late.", "Text my sister that dinner is ready.",
                 "Phone the office.", "Message Priya: see you at eight.", "Call dad please.",
                 "Tell Marco I'll bring the cake.", "Ring the dentist.", "Send Lisa a text: happy birthday!",
                 "Call my wife."]),
}


def strip_fence(text: str) -> str:
    found = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    return (found.group(1) if found else text).strip()


def valid(text: str, schema: dict) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(strip_fence(text)), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--json", default=str(RESULTS / "json_output.json"))
    a = p.parse_args()
    import torch

    from engine.decode import DecodeConfig
    from engine.grammar import Constraint
    from engine.stream import Engine
    torch.set_num_threads(1)
    engine = Engine.load(a.model)
    cfg = DecodeConfig(max_new_tokens=a.max_new_tokens)
    mask_ms: list[float] = []
    restrict = Constraint.restrict

    def timed(self, logits):
        start = time.perf_counter()
        out = restrict(self, logits)
        mask_ms.append((time.perf_counter() - start) * 1000)
        return out
    Constraint.restrict = timed
    rows, totals = [], {"unconstrained": [0, 0, 0, 0.0], "constrained": [0, 0, 0, 0.0]}  # valid, tokens, fwd, s
    for name, (schema, questions) in SCHEMAS.items():
        system = ("Reply with only a JSON object that matches this JSON schema, and nothing else: "
                  + json.dumps(schema))
        for question in questions:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            row = {"schema": name, "question": question}
            for how in ("unconstrained", "constrained"):
                constraint = engine.grammars.json(schema) if how == "constrained" else None
                start = time.perf_counter()
                pieces = list(engine.generate_sync(messages, cfg, constraint=constraint))
                seconds = time.perf_counter() - start
                text = "".join(piece.text for piece in pieces)
                ok = valid(text, schema)
                total = totals[how]
                total[0] += ok
                total[1] += pieces[-1].tokens
                total[2] += pieces[-1].forwards
                total[3] += seconds
                row[how] = {"text": text, "valid": ok, "tokens": pieces[-1].tokens, "forwards": pieces[-1].forwards,
                            "finish": pieces[-1].finish_reason, "ms": round(seconds * 1000)}
            print(f"{name:9s} {question[:44]:44s} unconstrained {'ok ' if row['unconstrained']['valid'] else 'BAD'}"
                  f"  constrained {'ok ' if row['constrained']['valid'] else 'BAD'}  {row['constrained']['text']!r}",
                  flush=True)
            rows.append(row)
    n = len(rows)
    summary = {how: {"valid": v, "of": n, "rate": round(v / n, 3), "tokens_per_forward": round(t / max(f, 1), 2),
                     "ms_per_token": round(s * 1000 / max(t, 1), 1)} for how, (v, t, f, s) in totals.items()}
    summary["mask_ms_per_token"] = {"mean": round(sum(mask_ms) / max(len(mask_ms), 1), 3),
                                    "p50": round(percentile(mask_ms, 50), 3), "p95": round(percentile(mask_ms, 95), 3),
                                    "max": round(max(mask_ms, default=0.0), 3), "n": len(mask_ms)}
    print(json.dumps(summary, indent=1))
    write_json(a.json, {"model": engine.name, "summary": summary, "rows": rows, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
