"""Does the real LM end a phone call when the caller says goodbye, and only then?

    python bench/call_end.py [--line shipped none "..."] [--model NAME] [--json bench/results/call_end.json]

A phone session's prompt as the session builds it (voice/conversation/calltools.py: the system prompt, the
`[telephony] call_prompt` line when the call's tools are offered, the call's tools): the greeting, then one
caller's turn, either as the call's first turn or after one exchange. GOODBYES (a caller done with the call)
should call `end_call`; QUESTIONS (a caller still talking, some with "thanks", "hold on" or "cancel" in them)
should not: a false end hangs up on someone, worse than a missed one (they hang up themselves). Each row keeps
the gate's measured log-odds (call vs text, first token; the gate is lm.tool_call_log_odds). `--line`: the
call_prompt lines to compare, `shipped` = the default config's, `none` = no line. Greedy, one thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, write_json  # noqa: E402

GREETING = "Hello, thanks for calling. How can I help?"
EXCHANGE = [{"role": "user", "content": "What are your opening hours?"},
            {"role": "assistant", "content": "We're open from nine to five, Monday to Friday."}]
GOODBYES = [
    "That's all, thanks, goodbye.", "That's all. Thanks. Goodbye.", "Okay, thank you, bye.", "Bye!",
    "Thanks for your help, have a nice day.", "Great, that's everything I needed. Bye bye.",
    "No, nothing else. Goodbye.", "Alright, I'll hang up now.", "Thank you so much, goodbye.",
    "Perfect, thanks. Talk to you later.", "That's it, cheers.", "Please end the call.",
]
QUESTIONS = [
    "What time do you close on Saturday?", "Thanks. And do you deliver?", "Hold on a second, let me get a pen.",
    "I want to cancel my order.", "Can you say that again?", "Thank you!", "Okay.", "Wait, one more question.",
    "How do I end my subscription?", "Who am I speaking to?", "Can I talk to a person?",
    "Goodbye is not what I want to hear, can you help me or not?",
]


async def run(a) -> dict:
    from engine.grammar import Constraint
    from voice.config import Config, TelephonyConfig
    from voice.conversation.calltools import call_prompt, call_tools
    from voice.pipeline.lm import LocalLM
    from voice.pipeline.tools import Toolbox

    class NoPhone:
        async def transfer(self, name: str, target: str) -> str | None:
            return "not dialled (a benchmark)"
    async def no_keys(prompt: str) -> str | None:
        return None
    config = Config()
    config.lm.threads = 1
    config.lm.model = a.model or config.lm.model
    lm = LocalLM(config.lm)
    gate, gated = Constraint.gate_first, []

    def watched(self, tokens, log_odds):  # keep each reply's constraint, to read what the gate measured
        gated.append(self)
        gate(self, tokens, log_odds)
    Constraint.gate_first = watched
    result = {"machine": machine(), "model": config.lm.model, "log_odds_gate": lm.tool_call_log_odds,
              "tools": a.tools, "runs": []}
    for line in a.line:
        telephony = TelephonyConfig(tools=a.tools, transfer_targets={"desk": "sip:desk@pbx.example.com"})
        if line != "shipped":
            telephony.call_prompt = "" if line == "none" else line
        tools = Toolbox(config.tools).with_tools(call_tools(telephony, NoPhone(), lambda reason: None,
                                                            no_keys)).openai()
        for tool in tools:
            if a.description and tool["function"]["name"] == "end_call":
                tool["function"]["description"] = a.description
        system = call_prompt(config.lm.system_prompt, telephony)
        run: dict = {"line": telephony.call_prompt, "description": a.description, "rows": []}
        print(f"line {run['line']!r}", flush=True)
        start = time.perf_counter()
        for context, said in (("first turn", []), ("after an exchange", EXCHANGE)):
            chat = lm.chat()  # one conversation cache: each probe prefills only what follows the common start
            for utterance, goodbye in [(u, True) for u in GOODBYES] + [(u, False) for u in QUESTIONS]:
                messages = [{"role": "system", "content": system}, {"role": "assistant", "content": GREETING},
                            *said, {"role": "user", "content": utterance}]
                calls, text = [], ""
                gated.clear()
                async with contextlib.aclosing(chat.reply(messages, tools=tools)) as blocks:
                    async for block in blocks:  # the decision is the first token's: one block tells it
                        calls, text = calls + block.calls, text + block.text
                        break
                row = {"context": context, "utterance": utterance, "goodbye": goodbye,
                       "called": calls[0]["function"]["name"] if calls else None,
                       "log_odds": gated[0].first_log_odds if gated else None, "text": text}
                run["rows"].append(row)
                wrong = (row["called"] == "end_call") != goodbye
                print(f"  {'WRONG' if wrong else 'ok   '} {row['log_odds']:+6.2f} {context:>17}: {utterance!r}"
                      f" -> {row['called'] or repr(text[:40])}", flush=True)
            chat.close()
        rows = run["rows"]
        ends = sum(r["called"] == "end_call" for r in rows if r["goodbye"])
        false = sum(r["called"] == "end_call" for r in rows if not r["goodbye"])
        run.update(ended=ends, goodbyes=sum(r["goodbye"] for r in rows), false_ends=false,
                   questions=sum(not r["goodbye"] for r in rows), seconds=round(time.perf_counter() - start))
        result["runs"].append(run)
        print(f"line {run['line']!r}: end_call on {ends}/{run['goodbyes']} goodbyes, "
              f"on {false}/{run['questions']} questions ({run['seconds']} s)", flush=True)
    Constraint.gate_first = gate
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--line", nargs="+", default=["none", "shipped"],
                   help="[telephony] call_prompt lines to compare: shipped = the default config's, none = no line")
    p.add_argument("--tools", nargs="+", default=["end_call"], help="the call's tools offered")
    p.add_argument("--description", default="", help="end_call's description instead of its own")
    p.add_argument("--model", default="", help="the LM (default: the voice service's)")
    p.add_argument("--json", default=str(RESULTS / "call_end.json"))
    a = p.parse_args()
    write_json(a.json, asyncio.run(run(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
