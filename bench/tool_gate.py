"""Does the model call a tool exactly when it should? Call decisions under the first-token gate.

    python bench/tool_gate.py [--log-odds off 0 1.2] [--model NAME] [--json bench/results/tool_gate.json]

20 prompts of our own (12 that need no tool, 8 that need one of the built-ins), asked as the
voice service asks them, offered the three built-ins (voice/tools.py). A prompt scores when the
reply calls exactly the expected tool, or none. `off`: plain greedy (no gate); 0: a call when its
probability mass beats the text's; 1.2: the default gate (`[lm] tool_call_log_odds`). One thread.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, write_json  # noqa: E402

PROMPTS = [
    ("What is fifteen plus five?", "calculate"), ("How many sides does a hexagon have?", None),
    ("How many continents are there?", None), ("What color do you get when you mix blue and yellow?", None),
    ("How many seconds are in a minute?", None), ("What month comes after March?", None),
    ("Which planet is closest to the sun?", None), ("How many legs does a spider have?", None),
    ("What is the largest mammal on Earth?", None), ("How many wheels does a bicycle have?", None),
    ("Eight of spades, four of clubs, seven of hearts.", None), ("Hello, how are you?", None),
    ("What time is it?", "get_time"), ("What's the date today?", "get_time"),
    ("What day of the week is it?", "get_time"), ("Set a timer for five minutes.", "set_timer"),
    ("Timer for ten minutes for the pasta, please.", "set_timer"), ("What is 17 times 23?", "calculate"),
    ("How much is 1250 divided by 5?", "calculate"), ("Is it morning or afternoon right now?", "get_time"),
]


async def run(a) -> dict:
    from voice.config import Config
    from voice.lm import LocalLM
    from voice.tools import Toolbox
    config = Config()
    config.lm.threads = 1
    config.lm.model = a.model or config.lm.model
    config.tools.builtin = ["time", "timer", "calculator"]
    lm, tools = LocalLM(config.lm), Toolbox(config.tools).openai()
    result = {"machine": machine(), "runs": []}
    from engine.grammar import Constraint
    gate = Constraint.gate_first
    for odds in a.log_odds:
        Constraint.gate_first = gate if odds != "off" else lambda self, tokens, log_odds: None
        lm.config.tool_call_log_odds = 0.0 if odds == "off" else float(odds)
        rows, start = [], time.perf_counter()
        for prompt, expected in PROMPTS:
            chat, calls = lm.chat(), []
            messages = [{"role": "system", "content": config.lm.system_prompt}, {"role": "user", "content": prompt}]
            async for block in chat.reply(messages, tools=tools):
                calls += block.calls
            chat.close()
            got = calls[0]["function"]["name"] if calls else None
            rows.append({"prompt": prompt, "expected": expected, "called": got, "right": got == expected})
        right = sum(r["right"] for r in rows)
        print(f"log-odds {odds:>4}: {right}/{len(rows)} right decisions ({time.perf_counter() - start:.0f} s); "
              f"wrong: {[(r['prompt'], r['called']) for r in rows if not r['right']]}", flush=True)
        result["runs"].append({"log_odds": odds, "right": right, "of": len(rows), "rows": rows})
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log-odds", nargs="+", default=["off", "0", "1.2"], help="gate values to try; off = none")
    p.add_argument("--model", default="", help="the LM (default: the voice service's)")
    p.add_argument("--json", default=str(RESULTS / "tool_gate.json"))
    a = p.parse_args()
    write_json(a.json, asyncio.run(run(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
