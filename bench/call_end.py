"""Does the real LM end a phone call when the caller says goodbye, and only then?

    python bench/call_end.py [--line shipped none "..."] [--chitchat 300] [--model NAME] [--json FILE]

A phone session's prompt as the session builds it (voice/conversation/calltools.py: the system prompt, the
`[telephony] call_prompt` line when the call's tools are offered, the call's tools): the greeting, then one
caller's turn, either as the call's first turn or after one exchange. Goodbyes (a caller done with the call)
should call `end_call`; the others (a caller still talking: hard cases with "thanks", "hold on", "wait" or "bye"
inside a sentence, and ordinary lines of real chats from the `chitchat-dataset` package) should not: a false end
hangs up on someone, worse than a missed one (they hang up themselves). Two splits: `calibration` (the 12 goodbyes
and 12 hard cases of the first sittings, half the chat lines) to choose a gate on, `held-out` (new goodbye
phrasings, new hard cases, the other half) to report. Each row keeps the gate's measured log-odds (call vs
text, first token: lm.tool_call_log_odds, or a call's own: calltools.call_gate), so any gate's figures
follow from one run. `--line`: the call_prompt lines to compare, `shipped` = the default config's, `none` = no
line. Greedy, one thread.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, write_json  # noqa: E402

GREETING = "Hello, thanks for calling. How can I help?"
EXCHANGE = [{"role": "user", "content": "What are your opening hours?"},
            {"role": "assistant", "content": "We're open from nine to five, Monday to Friday."}]
CONTEXTS = {"first turn": [], "after an exchange": EXCHANGE}
GOODBYES = {  # a caller done with the call
    "calibration": [
        "That's all, thanks, goodbye.", "That's all. Thanks. Goodbye.", "Okay, thank you, bye.", "Bye!",
        "Thanks for your help, have a nice day.", "Great, that's everything I needed. Bye bye.",
        "No, nothing else. Goodbye.", "Alright, I'll hang up now.", "Thank you so much, goodbye.",
        "Perfect, thanks. Talk to you later.", "That's it, cheers.", "Please end the call."],
    "held-out": [
        "Okay, that's all I needed. Thanks, bye.", "Alright, goodbye now.", "Thanks a lot, bye for now.",
        "Cool, thanks. See you.", "I think that's everything. Have a good one.", "Nope, that's it. Bye.",
        "Great, thank you very much. Goodbye.", "Okay bye.", "Thanks, you've been very helpful. Bye.",
        "That answers my question, thanks. Take care.", "I'm done, thanks. You can hang up.",
        "All good, thanks, bye bye.", "Okay. I have to go now. Bye.", "Wonderful, have a great evening. Goodbye.",
        "Nothing else, thank you. Bye.", "Thanks. Bye."],
}
HARD = {  # a caller still talking, in words a goodbye is made of
    "calibration": [
        "What time do you close on Saturday?", "Thanks. And do you deliver?", "Hold on a second, let me get a pen.",
        "I want to cancel my order.", "Can you say that again?", "Thank you!", "Okay.", "Wait, one more question.",
        "How do I end my subscription?", "Who am I speaking to?", "Can I talk to a person?",
        "Goodbye is not what I want to hear, can you help me or not?"],
    "held-out": [
        "Hold on.", "Wait.", "Thanks.", "Thanks, that helps. What about Sundays?", "Sorry, can you hold on a moment?",
        "I said bye to my sister and then called you.", "Before I say goodbye, how much is a large pizza?",
        "Thank you. One more thing.", "Great, thanks! Can I also book a table?", "No, wait, don't hang up.",
        "Hang on, let me check.", "Yes.", "Okay, thanks. And how much is it?", "Can you call me back later?",
        "My daughter says bye to everyone she meets, it's sweet. Anyway, do you have a kids' menu?",
        "Thanks for waiting. I found my order number.", "Alright.", "No, that's not all, I have another question.",
        "I'll say goodbye to my old phone plan if you have a better one.", "Cheers. Do you take cards?"],
}
# a chat line that closes a conversation is a goodbye, not an ordinary turn: left out of the negatives
CLOSING = re.compile(r"\b(bye|goodbye|later|gtg|g2g|gotta go|got to go|have to go|need to go|good ?night|"
                     r"nice (talking|chatting|meeting)|have a (good|great|nice)|take care|see (ya|you)|ttyl|cya|"
                     r"talk to you|hang up|end the call|that'?s all)\b", re.I)


def chat_lines(n: int) -> dict[str, list[str]]:
    """`n` ordinary lines from the middle of real chats (chitchat-dataset, not their first 3 or last 6 messages,
    nor any line with a closing in it), a fixed sample split in halves; a sixth are acknowledgements ("thanks",
    "okay", "cool"), the ordinary turns nearest a goodbye."""
    import chitchat_dataset
    lines: list[str] = []
    for conversation in sorted(chitchat_dataset.Dataset().items()):
        said = [m["text"].strip() for turn in conversation[1]["messages"] for m in turn]
        lines += [t for t in said[3:-6] if 4 <= len(t) <= 160 and t.isascii() and not CLOSING.search(t)]
    pick = random.Random(58)
    acks = sorted({t for t in lines if re.match(r"(?i)(thanks|thank you|ok|okay|alright|cool)\b", t)})
    chosen = pick.sample(acks, n // 6)
    chosen += pick.sample(sorted(set(lines) - set(chosen)), n - len(chosen))
    pick.shuffle(chosen)
    return {"calibration": chosen[::2], "held-out": chosen[1::2]}


def cases(chitchat: int) -> list[dict]:
    """Every probe: (split, kind, context, utterance); goodbyes and hard cases in both contexts, a chat line in one."""
    rows = []
    for split in ("calibration", "held-out"):
        for kind, said in (("goodbye", GOODBYES[split]), ("hard", HARD[split])):
            rows += [{"split": split, "kind": kind, "context": c, "utterance": u} for c in CONTEXTS for u in said]
        lines = chat_lines(chitchat)[split] if chitchat else []
        rows += [{"split": split, "kind": "chat", "context": list(CONTEXTS)[i % 2], "utterance": u}
                 for i, u in enumerate(lines)]
    return rows


def tally(rows: list[dict], gate: float) -> dict:
    """What a gate of `gate` on end_call's log-odds does, per split: goodbyes ended, others ended (false ends)."""
    out = {}
    for split in ("calibration", "held-out"):
        mine = [r for r in rows if r["split"] == split]
        goodbyes = [r for r in mine if r["kind"] == "goodbye"]
        others = [r for r in mine if r["kind"] != "goodbye"]
        out[split] = {"ended": sum(r["log_odds"] >= gate for r in goodbyes), "goodbyes": len(goodbyes),
                      "false_ends": sum(r["log_odds"] >= gate for r in others), "others": len(others),
                      "nearest_other": max((r["log_odds"] for r in others), default=None)}
    return out


async def run(a) -> dict:
    from engine.stream import ConversationCache
    from voice.config import Config, TelephonyConfig
    from voice.conversation.calltools import call_gate, call_prompt, call_tools
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
    probes = cases(a.chitchat)
    result = {"machine": machine(), "model": config.lm.model, "lm_gate": lm.tool_call_log_odds,
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
        declared, grammar, starts = lm.tool_grammar(tools)
        system = call_prompt(config.lm.system_prompt, telephony)
        phone_gate = call_gate(telephony, config.lm.model, [tool["function"]["name"] for tool in tools])
        gate = lm.tool_call_log_odds if phone_gate is None else phone_gate  # as the session's LocalChat has it
        run: dict = {"line": telephony.call_prompt, "description": a.description, "gate": gate, "rows": []}
        print(f"line {run['line']!r}", flush=True)
        start = time.perf_counter()
        for context, said in CONTEXTS.items():
            conversation = ConversationCache()  # each probe prefills only what follows the common start
            for case in [c for c in probes if c["context"] == context]:
                messages = [{"role": "system", "content": system}, {"role": "assistant", "content": GREETING},
                            *said, {"role": "user", "content": case["utterance"]}]
                # the reply's first token under the reply's own constraint and gate (voice.pipeline.lm.LocalChat):
                # the decision to call is that token's, so one token tells it
                constraint = lm.engine.grammars.lark(grammar)
                constraint.gate_first(starts, gate)
                first = ""
                async for piece in lm.engine.stream(messages, conversation=conversation, constraint=constraint,
                                                    tools=declared, max_new_tokens=1):
                    first += piece.text
                row = {**case, "log_odds": constraint.first_log_odds, "first": first}
                run["rows"].append(row)
                ends = row["log_odds"] >= gate
                wrong = ends != (case["kind"] == "goodbye")
                print(f"  {'WRONG' if wrong else 'ok   '} {row['log_odds']:+6.2f} {case['split']:>11} {case['kind']:>7}"
                      f" {context:>17}: {case['utterance'][:60]!r} -> {'end_call' if ends else repr(first)}",
                      flush=True)
            lm.engine.abandon(conversation)
        run.update(seconds=round(time.perf_counter() - start), at_gate=tally(run["rows"], gate),
                   at_lm_gate=tally(run["rows"], lm.tool_call_log_odds))
        for split, t in run["at_gate"].items():
            print(f"line {run['line'][:40]!r}, gate {gate:g}, {split}: end_call on {t['ended']}/{t['goodbyes']} "
                  f"goodbyes, on {t['false_ends']}/{t['others']} others (nearest: {t['nearest_other']:+.2f})")
        result["runs"].append(run)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--line", nargs="+", default=["shipped"],
                   help="[telephony] call_prompt lines to compare: shipped = the default config's, none = no line")
    p.add_argument("--tools", nargs="+", default=["end_call"], help="the call's tools offered")
    p.add_argument("--description", default="", help="end_call's description instead of its own")
    p.add_argument("--chitchat", type=int, default=300, help="ordinary chat lines (half calibration, half held-out)")
    p.add_argument("--model", default="", help="the LM (default: the voice service's)")
    p.add_argument("--json", default=str(RESULTS / "call_end.json"))
    a = p.parse_args()
    write_json(a.json, asyncio.run(run(a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
