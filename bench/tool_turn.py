"""Voice-to-voice of a tool turn: the filler, then the answer, over /ws with the real models.

    python bench/tool_turn.py [--repeat 2] [--webhook-ms 600] [--json bench/results/tool_turn.json]

The voice service runs in this process with the built-in tools on and one webhook
(`get_weather`, a loopback HTTP server answering after --webhook-ms). Questions are
synthesised by our Piper voice and streamed in real time, each in a fresh session (as a new
caller would). Per question kind: end of speech -> first audio (the filler when the tool is
slow), -> first audio of the answer, the tool stage, and what was said.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, write_json  # noqa: E402

QUESTIONS = [("builtin", "What time is it?"), ("webhook", "What is the weather like in Paris today?"),
             ("no tool", "What is the capital of France?")]
FRAME_MS = 20


def weather_app(delay_s: float):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def weather(request):
        city = (await request.json()).get("city", "there")
        await asyncio.sleep(delay_s)
        return PlainTextResponse(f"Sunny and 21 degrees Celsius in {city}.")
    return Starlette(routes=[Route("/weather", weather, methods=["POST"])])


def serve(app, port: int) -> threading.Thread:
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws="websockets"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return thread


async def one_turn(url: str, pcm: bytes, speech_s: float) -> dict:
    import websockets
    got = {"events": [], "first_audio": None, "answer_audio": None}
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "start", "sample_rate": 16000}))
        await ws.recv()
        done, tool_done = asyncio.Event(), []

        async def receive():
            async for msg in ws:
                now = time.perf_counter()
                if isinstance(msg, bytes):
                    got["first_audio"] = got["first_audio"] or now
                    if tool_done or not any(e["type"] == "tool_call" for e in got["events"]):
                        got["answer_audio"] = got["answer_audio"] or now
                    continue
                ev = json.loads(msg)
                got["events"].append(ev)
                if ev["type"] == "tool_result":
                    tool_done.append(now)
                if ev["type"] in ("latency", "error"):
                    done.set()
        reader = asyncio.create_task(receive())
        n, start = 16000 * FRAME_MS // 1000 * 2, time.perf_counter()
        chunks = [pcm[i:i + n] for i in range(0, len(pcm), n)]
        i = 0
        while not done.is_set() and time.perf_counter() - start < 60:
            await ws.send(chunks[i] if i < len(chunks) else bytes(n))
            i += 1
            await asyncio.sleep(max(0.0, start + i * FRAME_MS / 1000 - time.perf_counter()))
        reader.cancel()
    end = start + speech_s
    latency = next(e for e in got["events"] if e["type"] == "latency")
    tool = next((e for e in got["events"] if e["type"] == "tool_result"), None)
    return {"first_audio_ms": round((got["first_audio"] - end) * 1000), "answer_audio_ms":
            round((got["answer_audio"] - end) * 1000) if got["answer_audio"] else None,
            "tool_ms": latency["stages_ms"].get("tool"), "tool": tool and tool["name"],
            "reply": next(e["text"] for e in got["events"] if e["type"] == "reply_done")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--webhook-ms", type=float, default=600.0)
    p.add_argument("--lead-s", type=float, default=0.0, help="silence before the question (the session's LM "
                   "prefix is prepared meanwhile)")
    p.add_argument("--json", default=str(RESULTS / "tool_turn.json"))
    a = p.parse_args()
    from voice.audio import float_to_int16, resample
    from voice.clients.bench import speech_end_s
    from voice.config import Config, ToolsConfig
    from voice.service.server import build_app
    from voice.service.instance import Instance
    from common import free_port

    hook_port, port = free_port(), free_port()
    serve(weather_app(a.webhook_ms / 1000), hook_port)
    config = Config()
    config.records.path = str(Path(tempfile.mkdtemp()) / "records.sqlite3")
    config.tools = ToolsConfig(builtin=["time", "timer", "calculator"], webhook_allow=[f"http://127.0.0.1:{hook_port}/"],
                               webhooks=[{"name": "get_weather", "description": "Today's weather in a city.",
                                          "url": f"http://127.0.0.1:{hook_port}/weather", "parameters": {
                                              "type": "object", "required": ["city"], "additionalProperties": False,
                                              "properties": {"city": {"type": "string", "maxLength": 40}}}}])
    instance = Instance.load(config)
    serve(build_app(config, instance), port)
    synth = instance.synthesizer
    rows = []
    for r in range(a.repeat):
        for kind, question in QUESTIONS:
            audio = resample(synth.render(question, synth.voice_rate).astype("float32") / 32768.0,
                             synth.voice_rate, 16000)
            lead = bytes(2 * int(16000 * a.lead_s))
            pcm = lead + float_to_int16(audio).astype("<i2").tobytes() + bytes(16000)  # 0.5 s of silence after
            row = asyncio.run(one_turn(f"ws://127.0.0.1:{port}/ws", pcm, a.lead_s + speech_end_s(audio, 16000)))
            rows.append({"kind": kind, "question": question, **row})
            print(f"[{r + 1}] {kind:8} first audio {row['first_audio_ms']:5} ms, answer {row['answer_audio_ms']} ms, "
                  f"tool {row['tool']} {row['tool_ms']} ms: {row['reply']!r}", flush=True)
    summary = {}
    for kind, _ in QUESTIONS:
        mine = [r for r in rows if r["kind"] == kind]
        summary[kind] = {k: statistics.median([r[k] for r in mine if r[k] is not None] or [0])
                         for k in ("first_audio_ms", "answer_audio_ms", "tool_ms")}
    print(f"\n{'turn':10} {'first audio p50':>16} {'answer audio p50':>17} {'tool p50':>9}")
    for kind, s in summary.items():
        print(f"{kind:10} {s['first_audio_ms']:>13.0f} ms {s['answer_audio_ms']:>14.0f} ms {s['tool_ms']:>6.0f} ms")
    write_json(a.json, {"machine": machine(), "webhook_ms": a.webhook_ms, "lead_s": a.lead_s, "summary": summary,
                        "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
