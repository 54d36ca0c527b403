"""One client for every system under test: talk to it like a person with a microphone, time each turn.

    .venv/bin/python bench/drive.py --url ws://127.0.0.1:8000/ws --audio tests/speech [--json out.json]
    .venv/bin/python bench/drive.py --url ws://127.0.0.1:8765 --audio tests/speech   # the Pipecat pipeline

Why not `voice bench`: it ends a turn on our `latency` event, which only our service sends. This
client needs nothing but our protocol's subset that both systems speak: a JSON `start` answered
by `ready`, then binary PCM16LE mono at 16 kHz up and binary reply audio down. JSON events, when
a system sends them (ours does), are recorded but never change the timing.

A session: 0.5 s of silence, then for each clip:
  1. stream the clip in real time (20 ms frames), then keep streaming silence, like a live mic;
  2. voice-to-voice = arrival of the first reply audio frame - the moment the clip's last voiced
     sample was sent (energy gate, as `voice bench`: trailing silence in the file is not counted);
  3. the reply is "played" as it arrives (a playout clock: each frame plays after the previous
     one, at real-time speed); the turn ends once playback has finished and no audio has arrived
     for --gap seconds (default 2), or --reply-timeout seconds after the end of speech with no
     reply. So the next clip never barges in on a reply, whichever way a system paces its audio.
Audio that arrives before the end of speech (the tail of the previous reply when it paused for
longer than --gap, or a system answering a pause mid-utterance) is not counted as the reply's
start; its amount is recorded per turn (early_audio_s). Events that carry our `turn` number are
filed under the clip whose `speech_started` had that number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import websockets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt, percentile, write_json  # noqa: E402

FRAME_MS = 20
LEAD_IN_S = 0.5


@dataclass
class Turn:
    system: str
    file: str
    reference: str = ""
    round: int = 0
    v2v_ms: float | None = None
    reply_audio_s: float = 0.0
    early_audio_s: float = 0.0
    transcript: str = ""  # only from systems that send our events
    reply: str = ""
    stages_ms: dict = field(default_factory=dict)
    marks_ms: dict = field(default_factory=dict)
    over_budget: list = field(default_factory=list)
    events: int = 0
    error: str = ""


def load_clip(path: Path, rate: int) -> tuple[np.ndarray, float]:
    from voice.audio import read_wav, resample
    from voice.clients.bench import speech_end_s
    audio, file_rate = read_wav(path)
    audio = resample(audio, file_rate, rate)
    return audio, speech_end_s(audio, rate)


class Session:
    """One websocket conversation; a receiver task keeps the playout clock for the current turn."""

    def __init__(self, ws, out_rate: int):
        self.ws, self.out_rate = ws, out_rate
        self.turn: Turn | None = None
        self.speech_end_wall: float | None = None
        self.last_audio = 0.0
        self.play_end = 0.0
        self.first_audio: float | None = None
        self.no_reply = asyncio.Event()
        self.by_server_turn: dict[int, Turn] = {}

    def start_turn(self, turn: Turn) -> None:
        self.turn, self.speech_end_wall, self.first_audio = turn, None, None
        self.no_reply.clear()

    async def receive(self) -> None:
        async for msg in self.ws:
            now = time.perf_counter()
            turn = self.turn
            if isinstance(msg, bytes):
                seconds = len(msg) / 2 / self.out_rate
                self.last_audio = now
                self.play_end = max(self.play_end, now) + seconds
                if turn is None:
                    continue
                if self.speech_end_wall is None or now < self.speech_end_wall:
                    turn.early_audio_s += seconds
                    continue
                if self.first_audio is None:
                    self.first_audio = now
                    turn.v2v_ms = (now - self.speech_end_wall) * 1000
                turn.reply_audio_s += seconds
                continue
            try:
                ev = json.loads(msg)
            except ValueError:
                continue
            if not isinstance(ev, dict):
                continue
            # our events carry the server's turn number: file them under the clip that turn began in,
            # even when they arrive after the client has moved on to the next clip
            server_turn = ev.get("turn")
            if ev.get("type") == "speech_started" and turn is not None and server_turn is not None:
                self.by_server_turn.setdefault(server_turn, turn)
            turn = self.by_server_turn.get(server_turn, turn)
            if turn is None:
                continue
            turn.events += 1
            kind = ev.get("type")
            if kind == "transcript" and ev.get("final"):
                turn.transcript = ev.get("text", "")
                if not turn.transcript and turn is self.turn:
                    self.no_reply.set()  # ours says no reply will follow
            elif kind == "reply_done":
                turn.reply = ev.get("text", "")
            elif kind == "latency":
                turn.stages_ms, turn.marks_ms = ev.get("stages_ms") or {}, ev.get("marks_ms") or {}
                turn.over_budget = ev.get("over_budget") or []
            elif kind == "error":
                turn.error = f"{ev.get('code')}: {ev.get('message')}"


async def run_session(url: str, system: str, clips: list[tuple[Path, str]], rate: int = 16000, out_rate: int = 16000,
                      lm_mode: str | None = None, gap_s: float = 2.0, reply_timeout_s: float = 20.0,
                      round_no: int = 0, log=print, api_key: str = "") -> list[Turn]:
    start_msg = {"type": "start", "version": 1, "sample_rate": rate, "output_sample_rate": out_rate,
                 "encoding": "pcm_s16le"}
    if lm_mode:
        start_msg["session"] = {"lm_mode": lm_mode}
    n = rate * FRAME_MS // 1000
    silence = np.zeros(n, dtype=np.float32)
    from voice.audio import float_to_pcm16
    turns: list[Turn] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with websockets.connect(url, max_size=None, open_timeout=30, additional_headers=headers) as ws:
        await ws.send(json.dumps(start_msg))
        ready = json.loads(await asyncio.wait_for(ws.recv(), 30))
        if ready.get("type") != "ready":
            raise RuntimeError(f"{system}: server refused the session: {ready}")
        out_rate = int(ready.get("sample_rate") or out_rate)
        s = Session(ws, out_rate)
        receiver = asyncio.create_task(s.receive())
        clock = time.perf_counter()
        sent = 0  # samples sent since `clock`

        async def send(chunk: np.ndarray) -> None:
            nonlocal sent
            await ws.send(float_to_pcm16(chunk))
            sent += len(chunk)
            await asyncio.sleep(max(0.0, clock + sent / rate - time.perf_counter()))

        try:
            for _ in range(int(LEAD_IN_S * 1000 / FRAME_MS)):
                await send(silence)
            for path, reference in clips:
                audio, end_s = load_clip(path, rate)
                turn = Turn(system, path.name, reference, round_no)
                s.start_turn(turn)
                t0 = clock + sent / rate  # when this clip's first sample is due
                for i in range(0, len(audio), n):
                    chunk = audio[i:i + n]
                    await send(chunk if len(chunk) == n else np.pad(chunk, (0, n - len(chunk))))
                    if s.speech_end_wall is None and (i + n) / rate >= end_s:
                        s.speech_end_wall = t0 + end_s
                if s.speech_end_wall is None:
                    s.speech_end_wall = t0 + end_s
                while True:  # silence until the reply has played and gone quiet, or time out
                    await send(silence)
                    now = time.perf_counter()
                    if receiver.done():
                        turn.error = turn.error or "connection closed"
                        break
                    if s.first_audio is not None:
                        if now >= s.play_end + gap_s and now >= s.last_audio + gap_s:
                            break
                    elif s.no_reply.is_set() or now - s.speech_end_wall > reply_timeout_s:
                        turn.error = turn.error or ("no reply (empty transcript)" if s.no_reply.is_set()
                                                    else f"no reply audio within {reply_timeout_s:.0f} s")
                        break
                turns.append(turn)
                log(f"  {system:10s} {turn.file:16s} v2v {fmt(turn.v2v_ms, 0):>6} ms  reply audio "
                    f"{turn.reply_audio_s:4.1f} s  {('heard ' + repr(turn.transcript)) if turn.events else ''}"
                    f"{('  reply ' + repr(turn.reply[:50])) if turn.reply else ''} {turn.error}")
                if receiver.done():
                    break
        finally:
            s.turn = None
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
    return turns


def read_references(folder: Path) -> dict[str, str]:
    from voice.clients.bench import read_references as read
    return read(folder)


def clip_list(audio_dir: Path, limit: int = 0) -> list[tuple[Path, str]]:
    files = sorted(audio_dir.glob("*.wav"))
    if not files:
        raise SystemExit(f"no .wav files in {audio_dir}")
    refs = read_references(audio_dir)
    files = files[:limit] if limit > 0 else files
    return [(f, refs.get(f.name, "")) for f in files]


def summarise(turns: list[Turn]) -> dict:
    v2v = [t.v2v_ms for t in turns if t.v2v_ms is not None]
    stages = sorted({k for t in turns for k in t.stages_ms})
    out = {"turns": len(turns), "answered": len(v2v),
           "v2v_ms_p50": percentile(v2v, 50), "v2v_ms_p95": percentile(v2v, 95),
           "v2v_ms_mean": sum(v2v) / len(v2v) if v2v else float("nan"),
           "v2v_ms_min": min(v2v) if v2v else float("nan"), "v2v_ms_max": max(v2v) if v2v else float("nan"),
           "errors": sum(1 for t in turns if t.error),
           "early_audio_turns": sum(1 for t in turns if t.early_audio_s > 0),
           "stages_ms_p50": {s: percentile([t.stages_ms[s] for t in turns if s in t.stages_ms], 50) for s in stages}}
    refs = [t for t in turns if t.reference and t.events]
    if refs:
        try:
            import jiwer

            from voice.clients.bench import normalise
            out["wer"] = jiwer.wer([normalise(t.reference) for t in refs], [normalise(t.transcript) for t in refs])
        except Exception:  # noqa: BLE001 - WER is a by-product here
            pass
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="ws://127.0.0.1:8000/ws (ours) or ws://127.0.0.1:8765 (Pipecat)")
    p.add_argument("--audio", default="tests/speech", help="folder of WAVs (+ transcripts.tsv)")
    p.add_argument("--limit", type=int, default=0, help="only the first N clips")
    p.add_argument("--repeat", type=int, default=1, help="sessions in a row (each plays every clip once)")
    p.add_argument("--label", default="system", help="name in the output")
    p.add_argument("--lm-mode", choices=["diffusion", "ar"], default=None, help="ask our service for this LM mode")
    p.add_argument("--gap", type=float, default=2.0, help="quiet seconds after playback that end a turn")
    p.add_argument("--reply-timeout", type=float, default=20.0, help="seconds after end of speech without audio")
    p.add_argument("--json", default="", help="write summary and turns here")
    p.add_argument("--api-key-env", default="", help="send `Authorization: Bearer $VAR` (a service with auth on)")
    a = p.parse_args(argv)
    import os
    api_key = os.environ.get(a.api_key_env, "") if a.api_key_env else ""
    clips = clip_list(Path(a.audio), a.limit)
    turns: list[Turn] = []
    for r in range(a.repeat):
        turns += asyncio.run(run_session(a.url, a.label, clips, lm_mode=a.lm_mode, gap_s=a.gap,
                                         reply_timeout_s=a.reply_timeout, round_no=r, api_key=api_key))
    summary = summarise(turns)
    print(f"\n{a.label}: {summary['answered']}/{summary['turns']} answered, voice-to-voice p50 "
          f"{fmt(summary['v2v_ms_p50'], 0)} ms, p95 {fmt(summary['v2v_ms_p95'], 0)} ms")
    if a.json:
        write_json(a.json, {"summary": summary, "turns": [asdict(t) for t in turns]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
