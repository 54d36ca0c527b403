"""Do the voice loop's tools cost answers? The answer-accuracy questions with and without tools.

    python bench/tool_answers.py [--questions engine/prompts/answers_heldout.jsonl] [--json ...]

Each question is asked as the voice service asks it (its system prompt, its LM settings, a fresh
conversation), once with no tools and once offered the configured tools ([tools], by default
time, timer and calculator); a reply that calls tools gets the real results folded in and is
asked again, as voice/conversation/reply.py does. Reported: answers right both ways, how often a tool was
called, and the first text block's time (tools make the prompt longer). One thread.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


async def ask(chat, messages: list[dict], toolbox, timers) -> dict:
    """One voice turn's LM part: (text, the tools called, ms to the first text block)."""
    from voice.pipeline.tools import ToolRun, with_results
    start, first, text, calls = time.perf_counter(), None, "", []
    async for block in chat.reply(messages, tools=toolbox.openai() or None if toolbox else None):
        text, calls = text + block.text, calls + block.calls
        first = first or (time.perf_counter() if block.text else None)
    runs = [ToolRun.of(call) for call in calls]
    for run in runs:
        await toolbox.run(run, timers)
    if runs:
        async for block in chat.reply(with_results(messages, runs)):
            text += block.text
            first = first or time.perf_counter()
    return {"reply": text, "tools": [r.record() for r in runs],
            "first_text_ms": round((first - start) * 1000, 1) if first else None}


async def run(a) -> dict:
    from engine.evals.eval import is_right, read_questions
    from voice.config import load_config
    from voice.pipeline.lm import LocalLM
    from voice.pipeline.tools import Timers, Toolbox

    config = load_config(a.config)
    config.lm.threads = 1
    lm = LocalLM(config.lm)
    toolbox = Toolbox(config.tools)
    timers = Timers(lambda text: asyncio.sleep(0))
    questions = read_questions(Path(a.questions), a.limit)
    rows = []
    for i, q in enumerate(questions):
        messages = [{"role": "system", "content": config.lm.system_prompt}, {"role": "user", "content": q["prompt"]}]
        row = {"prompt": q["prompt"], "answer": q["answer"]}
        for name, box in (("plain", None), ("tools", toolbox)):
            chat = lm.chat()
            got = await ask(chat, messages, box, timers)
            chat.close()
            row[name] = {**got, "right": is_right(got["reply"], q["answer"])}
        rows.append(row)
        called = ",".join(t["name"] for t in row["tools"]["tools"]) or "-"
        print(f"[{i + 1}/{len(questions)}] plain {'ok' if row['plain']['right'] else 'NO'} tools "
              f"{'ok' if row['tools']['right'] else 'NO'} ({called}) {q['prompt']}", flush=True)
    timers.cancel_all()
    summary = {}
    for name in ("plain", "tools"):
        firsts = [r[name]["first_text_ms"] for r in rows if r[name]["first_text_ms"] is not None]
        summary[name] = {"right": sum(r[name]["right"] for r in rows), "of": len(rows),
                         "called_a_tool": sum(bool(r[name]["tools"]) for r in rows),
                         "first_text_ms_p50": round(statistics.median(firsts), 1) if firsts else None}
    return {"machine": machine(), "questions": a.questions, "tools": [t["function"]["name"] for t in toolbox.openai()],
            "summary": summary, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", default=str(ROOT / "engine/prompts/answers_heldout.jsonl"))
    p.add_argument("--config", default=None, help="voice config TOML (default: the embedded defaults)")
    p.add_argument("--limit", type=int, default=0, help="only the first N questions")
    p.add_argument("--json", default=str(RESULTS / "tool_answers.json"))
    a = p.parse_args()
    result = asyncio.run(run(a))
    s = result["summary"]
    print(f"\n{'':8} {'right':>9} {'called a tool':>14} {'first text p50':>15}")
    for name in ("plain", "tools"):
        print(f"{name:8} {s[name]['right']:>4}/{s[name]['of']:<4} {s[name]['called_a_tool']:>14} "
              f"{s[name]['first_text_ms_p50']:>12} ms")
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
