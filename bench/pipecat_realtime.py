"""A second real Realtime client: Pipecat's OpenAIRealtimeLLMService pointed at our /v1/realtime.

    voice serve --port 8000 &
    bench/.venv-pipecat/bin/python bench/pipecat_realtime.py --url ws://127.0.0.1:8000/v1/realtime

Runs in the bench's Pipecat venv (bench/setup.sh pipecat). The pipeline is Pipecat's own
speech-to-speech service and a sink: each clip of --audio is pushed as 24 kHz InputAudioRawFrames
in real time (20 ms), then silence; the service sends it to us (`input_audio_buffer.append`),
our server VAD ends the turn, and the service turns our events back into Pipecat frames. A sink
on each side times the first TTSAudioRawFrame after the end of the clip's speech (voice-to-voice)
and keeps the TranscriptionFrames (which Pipecat sends upstream). Ends with a table and --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import wave
from pathlib import Path

import numpy as np

RATE, FRAME_MS = 24000, 20
REPO = Path(__file__).resolve().parent.parent


def clip(path: Path) -> tuple[bytes, float]:
    """The clip as 24 kHz PCM16 and where its speech ends (s): the last 20 ms louder than -35 dBFS."""
    with wave.open(str(path)) as w:
        audio = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
        rate = w.getframerate()
    audio = np.interp(np.arange(int(len(audio) * RATE / rate)) * rate / RATE, np.arange(len(audio)), audio)
    n = RATE * FRAME_MS // 1000
    loud = [i for i in range(0, len(audio) - n, n) if 20 * np.log10(np.sqrt(np.mean(audio[i:i + n] ** 2)) + 1e-9) > -35]
    end = (loud[-1] + n) / RATE if loud else len(audio) / RATE
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes(), end


async def amain(a) -> dict:
    from pipecat.frames.frames import InputAudioRawFrame, TranscriptionFrame, TTSAudioRawFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
    from pipecat.workers.runner import WorkerRunner

    seen = {"audio": [], "transcripts": []}

    class Sink(FrameProcessor):
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                seen["audio"].append(time.perf_counter())
            elif isinstance(frame, TranscriptionFrame):
                seen["transcripts"].append(frame.text)
            await self.push_frame(frame, direction)

    llm = OpenAIRealtimeLLMService(api_key=a.api_key, base_url=a.url,
                                   settings=OpenAIRealtimeLLMService.Settings(model="diffusion-voice"))
    # transcriptions travel upstream, audio downstream: a sink on each side
    worker = PipelineWorker(Pipeline([Sink(), llm, Sink()]),
                            params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE),
                            idle_timeout_secs=None, enable_rtvi=False)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    await asyncio.sleep(2.0)  # the service connects and sends its session.update
    rows = []
    n = RATE * FRAME_MS // 1000 * 2
    for path in sorted(Path(a.audio).glob("*.wav")) * a.repeat:
        pcm, end_s = clip(path)
        pcm += bytes(int(RATE * 2 * a.tail_s))
        before_audio, before_text = len(seen["audio"]), len(seen["transcripts"])
        start = time.perf_counter()
        for i in range(0, len(pcm), n):
            await worker.queue_frame(InputAudioRawFrame(audio=pcm[i:i + n], sample_rate=RATE, num_channels=1))
            await asyncio.sleep(max(0.0, start + (i + n) / 2 / RATE - time.perf_counter()))
        first = next((t for t in seen["audio"][before_audio:] if t > start + end_s), None)
        v2v = (first - start - end_s) * 1000 if first else None
        rows.append({"file": path.name, "v2v_ms": v2v, "transcript": " ".join(seen["transcripts"][before_text:])})
        print(f"pipecat realtime {path.name:16s} v2v {v2v or float('nan'):6.0f} ms  heard {rows[-1]['transcript']!r}",
              flush=True)
    await worker.cancel()
    running.cancel()
    v2v = [r["v2v_ms"] for r in rows if r["v2v_ms"] is not None]
    summary = {"turns": len(rows), "answered": len(v2v), "v2v_ms_p50": statistics.median(v2v) if v2v else None}
    print(f"\nPipecat OpenAIRealtimeLLMService -> {a.url}: answered {len(v2v)}/{len(rows)}, "
          f"v2v p50 {summary['v2v_ms_p50'] or float('nan'):.0f} ms")
    return {"summary": summary, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime")
    p.add_argument("--api-key", default="none")
    p.add_argument("--audio", default=str(REPO / "tests" / "speech"))
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--tail-s", type=float, default=4.0, help="silence after each clip (the reply plays meanwhile)")
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "pipecat_realtime.json"))
    a = p.parse_args()
    result = asyncio.run(amain(a))
    Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.json}")
    return 0 if result["summary"]["answered"] == result["summary"]["turns"] else 1


if __name__ == "__main__":
    sys.exit(main())
