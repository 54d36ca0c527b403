"""Voice-to-voice over /v1/realtime (the official `openai` SDK's realtime client) against /ws.

    python bench/realtime_v2v.py [--audio tests/speech] [--repeat 2] [--json bench/results/realtime_v2v.json]

The voice service runs in this process on the real default models. The same clips are streamed
in real time to both fronts, pcm16 at 24 kHz in 20 ms pieces, one session per front per round
(rounds alternate /ws and /v1/realtime so drift hits both): end of the clip's speech -> first
reply audio received. /ws uses `voice bench`'s own client (voice.clients.bench).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, free_port, machine, percentile, write_json  # noqa: E402

RATE, FRAME_MS = 24000, 20


async def realtime_session(url: str, files: list[Path]) -> list[dict]:
    import openai

    from voice.audio import float_to_pcm16, read_wav, resample
    from voice.clients.bench import speech_end_s
    client = openai.AsyncOpenAI(base_url=url, api_key="none")
    rows = []
    async with client.realtime.connect(model="diffusion-voice") as conn:
        for path in files:
            audio, rate = read_wav(path)
            audio = resample(audio, rate, RATE)
            end_s, n = speech_end_s(audio, RATE), RATE * FRAME_MS // 1000
            got: dict = {"first": None, "done": False, "transcript": "", "reply": ""}

            async def receive(got: dict):
                while not got["done"]:
                    ev = json.loads(await conn.recv_bytes())
                    if ev["type"] == "response.output_audio.delta" and got["first"] is None:
                        got["first"] = time.perf_counter()
                    elif ev["type"] == "conversation.item.input_audio_transcription.completed":
                        got["transcript"] = ev["transcript"]
                    elif ev["type"] == "response.done":
                        content = ev["response"]["output"][0]["content"]
                        got["reply"] = "".join(c.get("transcript") or "" for c in content)
                        got["done"] = True
            reader = asyncio.create_task(receive(got))
            start, i = time.perf_counter(), 0
            while not got["done"] and time.perf_counter() - start < len(audio) / RATE + 30:
                chunk = audio[i:i + n] if i < len(audio) else np.zeros(n, dtype=np.float32)
                await conn.input_audio_buffer.append(audio=base64.b64encode(float_to_pcm16(chunk)).decode())
                i += n
                await asyncio.sleep(max(0.0, start + i / RATE - time.perf_counter()))
            for _ in range(500 // FRAME_MS):  # the tail plays out, the microphone still open
                await conn.input_audio_buffer.append(audio=base64.b64encode(bytes(2 * n)).decode())
                await asyncio.sleep(FRAME_MS / 1000)
            reader.cancel()
            v2v = (got["first"] - (start + end_s)) * 1000 if got["first"] else None
            rows.append({"file": path.name, "v2v_ms": v2v, "transcript": got["transcript"], "reply": got["reply"]})
            print(f"realtime {path.name:16s} v2v {v2v or float('nan'):6.0f} ms  heard {got['transcript']!r}",
                  flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--audio", default=str(Path(__file__).resolve().parent.parent / "tests" / "speech"))
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", default=str(RESULTS / "realtime_v2v.json"))
    a = p.parse_args()
    import uvicorn

    from voice.clients.bench import read_references, run_session
    from voice.config import Config
    from voice.service.server import build_app
    from voice.service.instance import Instance

    config = Config()
    config.records.path = str(Path(tempfile.mkdtemp()) / "records.sqlite3")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(config, Instance.load(config)), host="127.0.0.1", port=port,
                                           log_level="warning", ws="websockets"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    files = sorted(Path(a.audio).glob("*.wav"))
    refs = read_references(Path(a.audio))
    ws, rt = [], []
    for _ in range(a.repeat):
        ws += [{"file": t.file, "v2v_ms": t.v2v_ms, "transcript": t.transcript, "reply": t.reply}
               for t in asyncio.run(run_session(f"ws://127.0.0.1:{port}/ws", files, refs, RATE, None))]
        rt += asyncio.run(realtime_session(f"http://127.0.0.1:{port}/v1", files))
    summary = {}
    for name, rows in (("ws", ws), ("realtime", rt)):
        v2v = [row["v2v_ms"] for row in rows if row["v2v_ms"] is not None]
        summary[name] = {"turns": len(rows), "answered": len(v2v), "v2v_ms_p50": percentile(v2v, 50),
                         "v2v_ms_p95": percentile(v2v, 95)}
    diff = summary["realtime"]["v2v_ms_p50"] - summary["ws"]["v2v_ms_p50"]
    print(f"\n{'front':10} {'answered':>9} {'v2v p50':>9} {'v2v p95':>9}")
    for name, s in summary.items():
        print(f"{name:10} {s['answered']:>4}/{s['turns']:<4} {s['v2v_ms_p50']:>6.0f} ms {s['v2v_ms_p95']:>6.0f} ms")
    print(f"/v1/realtime - /ws, p50: {diff:+.0f} ms (goal: within 50 ms)")
    write_json(a.json, {"machine": machine(), "summary": summary, "realtime_minus_ws_p50_ms": diff,
                        "ws": ws, "realtime": rt})
    server.should_exit = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
