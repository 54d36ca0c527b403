"""A short spoken turn while another conversation floods the LM (issue 41, item 3).

    python bench/lm_fairness.py [--url http://127.0.0.1:8000] [--chars 3900] [--json out.json]

Against a running `voice serve`. First the short turns alone: tests/speech's 003.wav and
goforward.wav over /ws, voice-to-voice each. Then the same turns while a Realtime client (the
official `openai` client) has put one user message of `--chars` characters into its
conversation (the item bound is 4,000) and asked for a response: on two cores that prompt is
~1,000 tokens, ~16 s of prefill for the 1.5B. Prints the short turns' voice-to-voice in both
conditions and their ratio, and what the flooding client got (its first audio or its error, and
when).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loadavg, machine, write_json  # noqa: E402

SPEECH = ROOT / "tests" / "speech"
FILES = [SPEECH / "003.wav", SPEECH / "goforward.wav"]


def flood_text(chars: int) -> str:
    facts = [f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(1000)]
    text = "Here are some notes. " + " ".join(facts)
    return text[:chars - 40] + " Which of these facts is the last one?"


async def flood(base_url: str, chars: int, outcome: dict) -> None:
    import openai
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none")
    async with client.realtime.connect(model="diffusion-voice") as conn:
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": flood_text(chars)}]})
        start = time.perf_counter()
        await conn.response.create()
        outcome["asked"] = True
        while True:
            ev = json.loads(await conn.recv_bytes())
            kind, at = ev["type"], round((time.perf_counter() - start) * 1000)
            if kind == "response.output_audio.delta" and "first_audio_ms" not in outcome:
                outcome["first_audio_ms"] = at
            elif kind == "error":
                outcome.setdefault("errors", []).append({"ms": at, **ev["error"]})
            elif kind == "response.done":
                r = ev["response"]
                outcome.update(done_ms=at, status=r["status"], details=r.get("status_details"))
                return


async def short_turns(ws_url: str, stages: list[dict]) -> list[float | None]:
    """Voice-to-voice of each short turn; each turn's stages and work timeline go to `stages`."""
    from voice.clients.bench import read_references, run_session
    turns = await run_session(ws_url, FILES, read_references(SPEECH), 16000, None, log=lambda line: print(" ", line))
    for t in turns:
        stages.append({"file": t.file, "stages_ms": t.stages_ms, "work_ms": t.work_ms})
        print("   ", t.file, " ".join(f"{k} {v:.0f}" for k, v in t.stages_ms.items()), "| work",
              " ".join(f"{k} {v:.0f}" for k, v in t.work_ms.items()))
    return [t.v2v_ms for t in turns]


async def main_async(base: str, chars: int) -> dict:
    ws_url = base.replace("http", "ws", 1) + "/ws"
    print("alone:")
    stages: dict[str, list[dict]] = {"alone": [], "beside": []}
    alone = await short_turns(ws_url, stages["alone"])
    outcome: dict = {}
    print(f"beside a Realtime conversation asking about {chars} characters:")
    flooding = asyncio.create_task(flood(base, chars, outcome))
    while not outcome.get("asked") and not flooding.done():
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # its prefill is under way
    beside = await short_turns(ws_url, stages["beside"])
    try:
        await asyncio.wait_for(flooding, 60)
    except asyncio.TimeoutError:
        outcome["timeout"] = "no response.done within 60 s of the short turns"
    return {"alone_v2v_ms": alone, "beside_v2v_ms": beside, "flood": outcome, "stages": stages}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the voice service")
    p.add_argument("--chars", type=int, default=3900, help="the flooding message's length")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    result = asyncio.run(main_async(a.url.rstrip("/"), a.chars))
    alone, beside = result["alone_v2v_ms"], result["beside_v2v_ms"]
    ratios = [b / s if b and s else None for s, b in zip(alone, beside)]
    print("short turn v2v ms alone", [round(x) if x else None for x in alone], "beside the flood",
          [round(x) if x else None for x in beside], "ratio", [round(r, 2) if r else None for r in ratios])
    print("the flooding conversation:", json.dumps(result["flood"]))
    if a.json:
        write_json(a.json, {**result, "ratios": ratios, "machine": machine(), "loadavg": loadavg()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
