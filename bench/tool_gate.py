"""Does the model call a tool exactly when it should? Call decisions under the first-token gate.

    python bench/tool_gate.py [--log-odds off 0 1.2] [--model NAME] [--json bench/results/tool_gate.json]

Two sets of 20 prompts of our own, asked as the voice service asks them, offered the three
built-ins (voice/pipeline/tools.py): CALIBRATION (11 that need no tool, 9 that need one), on which each
model's gate was chosen (engine.loading.TOOL_CALL_LOG_ODDS), and HELDOUT (10 and 10), written
after that choice and never tuned on. A prompt scores when the reply calls exactly the expected
tool, or none. `off`: plain greedy (no gate); 0: a call when its probability mass beats the
text's; a number: that gate; `model`: the model's own gate. Each row keeps the log-odds the gate
measured (call vs text, first token), from which the right gate for a model can be read. One thread.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, write_json  # noqa: E402

CALIBRATION = [
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
HELDOUT = [
    ("Could you tell me the current time?", "get_time"), ("What year is it?", "get_time"),
    ("Which day is it today?", "get_time"), ("Start a three minute timer.", "set_timer"),
    ("Set a one hour timer for the roast.", "set_timer"), ("Please time twenty minutes for the laundry.", "set_timer"),
    ("What's 48 plus 76?", "calculate"), ("What is nine squared?", "calculate"),
    ("Multiply 312 by 14.", "calculate"), ("What is 15 percent of 80?", "calculate"),
    ("What is the capital of Spain?", None), ("Who wrote Romeo and Juliet?", None),
    ("At what temperature does water boil in Celsius?", None), ("Tell me a short joke.", None),
    ("What language is spoken in Brazil?", None), ("What do bees make?", None),
    ("Thank you, that's all.", None), ("What's the opposite of hot?", None),
    ("How many days are in a week?", None), ("Good morning!", None),
]


async def run(a) -> dict:
    from engine.grammar import Constraint
    from engine.loading import tool_call_log_odds
    from voice.config import Config
    from voice.pipeline.lm import LocalLM
    from voice.pipeline.tools import Toolbox
    config = Config()
    config.lm.threads = 1
    config.lm.model = a.model or config.lm.model
    config.tools.builtin = ["time", "timer", "calculator"]
    lm, tools = LocalLM(config.lm), Toolbox(config.tools).openai()
    result = {"machine": machine(), "model": config.lm.model, "runs": []}
    gate, gated = Constraint.gate_first, []

    def watched(self, tokens, log_odds):  # keep each reply's constraint, to read what the gate measured
        gated.append(self)
        gate(self, tokens, log_odds)
    for odds in a.log_odds:
        Constraint.gate_first = watched if odds != "off" else lambda self, tokens, log_odds: None
        value = tool_call_log_odds(config.lm.model) if odds == "model" else 0.0 if odds == "off" else float(odds)
        lm.config.tool_call_log_odds = value
        run = {"log_odds": odds, "value": value}
        start = time.perf_counter()
        for name, prompts in (("calibration", CALIBRATION), ("heldout", HELDOUT)):
            rows = []
            for prompt, expected in prompts:
                chat, calls, text = lm.chat(), [], ""
                gated.clear()
                messages = [{"role": "system", "content": config.lm.system_prompt}, {"role": "user", "content": prompt}]
                async for block in chat.reply(messages, tools=tools):
                    calls, text = calls + block.calls, text + block.text
                chat.close()
                got = calls[0]["function"]["name"] if calls else None
                measured = gated[0].first_log_odds if gated else None
                rows.append({"prompt": prompt, "expected": expected, "called": got, "right": got == expected,
                             "measured_log_odds": measured, "text": text})
            right = sum(r["right"] for r in rows)
            print(f"{config.lm.model} log-odds {odds:>5} ({value:+.1f}) {name:>11}: {right}/{len(rows)} right; "
                  f"wrong: {[(r['prompt'], r['called']) for r in rows if not r['right']]}", flush=True)
            run[name] = {"right": right, "of": len(rows), "rows": rows}
        run["seconds"] = round(time.perf_counter() - start)
        result["runs"].append(run)
    Constraint.gate_first = gate
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log-odds", nargs="+", default=["off", "0", "model"],
                   help="gate values to try: off = none, model = the model's own (engine.loading.TOOL_CALL_LOG_ODDS)")
    p.add_argument("--model", default="", help="the LM (default: the voice service's)")
    p.add_argument("--json", default=str(RESULTS / "tool_gate.json"))
    a = p.parse_args()
    write_json(a.json, asyncio.run(run(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
