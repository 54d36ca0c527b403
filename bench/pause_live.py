"""Pauses mid-sentence, live: is a pause answered, and is reply audio heard inside it? (issue 55)

Streams `voice eot-eval`'s items (tests/speech and Piper sentences, whole and with a pause inserted
between two words) in real time to a running `voice serve`, one session, then silence until the reply
is done or --timeout. Per pause item: reply audio that arrived inside the pause (before the user went
on), the turns started (2: the pause ended a turn, and the user resumed it), the answers (reply_done, not
interrupted) and the last final. Per whole item: voice-to-voice, from the end of speech to the first
reply audio. It says something only where a reply can be ready within a pause (a quiet machine): on a
loaded 2-core box no reply is ready within a second, with or without `turn.hold_ms`.

    .venv/bin/voice serve --port 8741 &   # the configuration under test (e.g. --config with [turn] hold_ms = 0)
    .venv/bin/python bench/pause_live.py --url ws://127.0.0.1:8741/ws --pause-s 0.6 --json bench/results/pause_live.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np

from voice.config import load_config
from voice.evals.eot_eval import Item, build_items
from voice.events import ReplyDone, SpeechStarted, Transcript
from voice.evals.room_eval import FRAME, RATE, Echo, Stream, _session

LEAD_S = 0.5  # silence before the user speaks


async def one(url: str, item: Item, timeout_s: float) -> dict:
    """Stream `item` (its own silence after it included), then silence until its reply is done."""
    ws = await _session(url)  # (it waits while the last item's session closes)
    stream = Stream(ws, Echo(None, -26.0))
    receiver = asyncio.create_task(stream.receive())
    lead = int(LEAD_S * RATE)
    signal = np.concatenate([np.zeros(lead, np.float32), item.audio, np.zeros(int(timeout_s * RATE), np.float32)])
    end_at = lead + int(item.true_end_s * RATE)
    start_wall = time.perf_counter()

    def answered() -> bool:
        return stream.sent > end_at and any(isinstance(ev, ReplyDone) and not ev.interrupted for _, ev in stream.events)
    try:
        await stream.play(signal, answered)
        await asyncio.sleep(0.2)
    finally:
        receiver.cancel()
        await ws.close()
    out: dict = {"id": item.id, "pause": item.pauses[0][1] if item.pauses else 0.0,
                 "answers": sum(isinstance(ev, ReplyDone) and not ev.interrupted for _, ev in stream.events),
                 "started": sum(isinstance(ev, SpeechStarted) for _, ev in stream.events)}
    finals = [ev for _, ev in stream.events if isinstance(ev, Transcript) and ev.final]
    out["final"] = finals[-1].text if finals else ""
    if item.pauses:
        at_s, length_s = item.pauses[0]
        pause_from, pause_to = lead + int(at_s * RATE), lead + int((at_s + length_s) * RATE)
        out["audio_in_pause"] = sum(pause_from <= at <= pause_to + FRAME * 5 for at in stream.audio_at)
    answered_at = [wall for at, wall in zip(stream.audio_at, stream.wall, strict=True) if at > end_at - RATE // 2]
    out["v2v_ms"] = ((answered_at[0] - start_wall) * 1000 - (end_at / RATE) * 1000) if answered_at else None
    return out


async def run(url: str, items: list[Item], timeout_s: float) -> list[dict]:
    results = []
    for item in items:
        result = await one(url, item, timeout_s)
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="ws://host:port/ws of a running `voice serve`")
    p.add_argument("--pause-s", type=float, default=0.6, help="the pause items kept (their inserted pause)")
    p.add_argument("--whole", type=int, default=8, help="whole (complete) items streamed too, for voice-to-voice")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds of silence to wait for an answer")
    p.add_argument("--no-synthetic", action="store_true", help="only tests/speech (no Piper sentences)")
    p.add_argument("--json", default="", help="write the results here")
    a = p.parse_args()
    from voice.pipeline.asr import Whisper
    from voice.pipeline.tts import load_voice
    config = load_config(None)
    items = build_items(Whisper(config.asr).model, None if a.no_synthetic else load_voice(config.tts))
    paused = [i for i in items if i.pauses and abs(i.pauses[0][1] - a.pause_s) < 1e-6]
    whole = [i for i in items if not i.pauses][:a.whole]
    load_before = os.getloadavg()
    results = asyncio.run(run(a.url, paused + whole, a.timeout))
    pauses = [r for r in results if r["pause"]]
    kept = [r for r in pauses if r["answers"] == 1 and not r["audio_in_pause"]]
    v2v = [r["v2v_ms"] for r in results if not r["pause"] and r["v2v_ms"] is not None]
    summary = {"pauses": len(pauses), "kept_whole": len(kept),
               "audio_in_pause": sum(bool(r["audio_in_pause"]) for r in pauses),
               "whole_v2v_p50_ms": float(np.percentile(v2v, 50)) if v2v else None, "whole": len(v2v),
               "load_average": {"before": load_before, "after": os.getloadavg()}}
    print(json.dumps(summary))
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "items": results}, indent=1))


if __name__ == "__main__":
    main()
