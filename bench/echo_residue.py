"""The reply's echo through `voice mic`'s canceller while it adapts again, offline: how much of what the server
hears the reply explains (`Playback.echo_of`), against the user talking over a reply, at each moment the level gate
makes it `Talking` (600 ms of speech: a barge-in before voice/conversation/reply.py's `Floor.echo_heard`).

The question (tests/speech/003.wav), then replies of recorded speech 2 s apart, each fed back 10 dB under
through its own echo path: the first 60 ms late, so WebRTC's AEC3 (`voice.clients.mic.EchoCanceller`, as
`voice mic` feeds it) converges; every later one with the path changed (`--paths`: delay in ms, gain in dB),
so AEC3 lets it through while it adapts again. Then the same with the user (002.wav) over the first reply at
`--user-at` seconds; and the user over the reply's full echo, `--no-aec-db` under them, with no canceller.
The server's gate (`voice.conversation.turns.TurnTaker`) hears what the client sent.

    PYTHONPATH=. .venv/bin/python bench/echo_residue.py
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import numpy as np

from voice.audio import float_to_pcm16, read_wav, resample
from voice.clients.mic import EchoCanceller
from voice.config import Config
from voice.conversation.playback import Playback
from voice.conversation.reply import ECHO_PART
from voice.conversation.turns import Talking, TurnTaker
from voice.pipeline.asr import SAMPLE_RATE as RATE
from voice.service.scheduler import Scheduler

SPEECH = Path(__file__).resolve().parents[1] / "tests" / "speech"
REPLIES = (("005.wav", "001.wav"), ("004.wav", "forever.wav"), ("goforward.wav", "005.wav"), ("001.wav", "004.wav"))
FRAME = RATE // 50


class Silent:
    """No transcripts: only the gate's Talking is looked at."""

    def __init__(self) -> None:
        self.speaking: set = set()
        self.worker = Scheduler().worker("asr")

    def transcribe(self, audio: np.ndarray, prefix: str = "") -> str:
        return ""

    def transcribe_final(self, audio: np.ndarray) -> str:
        return ""


def clip(*names: str) -> np.ndarray:
    return np.concatenate([resample(*read_wav(SPEECH / name), RATE) for name in names]).astype(np.float32)


Spans = list[tuple[int, int]]
Room = tuple[np.ndarray, np.ndarray, Spans]  # what the client played, what it sent, where each reply plays


def room(paths: list[tuple[int, float]], user_at: float | None, aec: bool = True) -> Room:
    """(what the client played, what it sent (through its canceller if `aec`), each reply's span in samples)."""
    gap = np.zeros(2 * RATE, np.float32)
    parts: list[np.ndarray] = [np.zeros(RATE, np.float32), np.zeros(len(clip("003.wav")), np.float32), gap]
    for names in REPLIES[:len(paths)]:
        parts += [clip(*names), gap]
    played = np.concatenate(parts)
    starts = np.cumsum([0, *map(len, parts)])
    spans = [(int(starts[3 + 2 * i]), int(starts[4 + 2 * i])) for i in range(len(paths))]
    heard = np.zeros_like(played)
    heard[RATE:starts[2]] = clip("003.wav")
    for (a, b), (delay_ms, gain_db) in zip(spans, paths):
        at = a + RATE * delay_ms // 1000
        heard[at:at + b - a] += played[a:b] * 10 ** ((gain_db - 10) / 20)
    if user_at is not None:
        user = clip("002.wav")
        at = spans[0][0] + int(user_at * RATE)
        heard[at:at + len(user)] += user
    if not aec:
        return played, heard, spans
    canceller, sent = EchoCanceller(RATE), []
    for i in range(0, len(played) - FRAME + 1, FRAME):
        canceller.played(float_to_pcm16(played[i:i + FRAME]))
        sent.append(canceller.heard(float_to_pcm16(heard[i:i + FRAME])))
    return played, np.frombuffer(b"".join(sent), "<i2").astype(np.float32) / 32768, spans


def peaks(played: np.ndarray, sent: np.ndarray, spans: Spans) -> list[tuple[int, float, float]]:
    """At each Talking over a reply: (which reply, seconds into it, the share of it the reply explains), as the
    session asks: under ECHO_PART it would cut the reply (no more is asked of that speech); from it on it is held
    as the echo (`TurnTaker.not_talking_yet`: the gate learns it) and asked again at the next frame."""

    async def run() -> list[tuple[int, float, float]]:
        taker = TurnTaker(Config(), Silent(), RATE, "bench")  # type: ignore[arg-type]
        playback, out, cut, pending = Playback(), [], set(), [*spans]
        for i in range(0, len(sent) - FRAME + 1, FRAME):
            now = i / RATE
            if pending and i >= pending[0][0]:  # the reply goes on the wire
                a, b = pending.pop(0)
                playback.handed_over()
                playback.sent("", now, (b - a) / RATE, played[a:b])
            reply = next((n for n, (a, b) in enumerate(spans) if a <= i < b + 0.3 * RATE), None)
            for ev in taker.push(float_to_pcm16(sent[i:i + FRAME]), now, reply is not None):
                if isinstance(ev, Talking) and reply is not None and ev.turn not in cut:
                    part = playback.echo_of(taker.heard_lately(), now)
                    out.append((reply, now - spans[reply][0] / RATE, part))
                    if part >= ECHO_PART:
                        taker.not_talking_yet()
                    else:
                        cut.add(ev.turn)
        return out

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default="60:0,200:0,120:6,300:0", help="each reply's echo: delay ms:gain dB")
    parser.add_argument("--user-at", default="0.3,1,2,3", help="seconds into the first reply the user starts")
    parser.add_argument("--no-aec-db", default="10,20", help="without a canceller: the echo this far under the user")
    args = parser.parse_args()
    paths = [(int(d), float(g)) for d, g in (p.split(":") for p in args.paths.split(","))]
    print(f"the part of its power the reply explains from which speech over it is its echo: {ECHO_PART}")
    print("the echo alone, each reply (its path):")
    found = peaks(*room(paths, None))
    for n, path in enumerate(paths):
        print(f"  reply {n + 1}, {path[0]} ms, {path[1]:+g} dB: {summary([(i, p) for r, i, p in found if r == n])}")
    print("the user over the first reply (its canceller converged):")
    for at in (float(x) for x in args.user_at.split(",")):
        print(f"  from {at:.1f} s: {summary([(i, p) for r, i, p in peaks(*room(paths[:1], at)) if r == 0])}")
    for under in (float(x) for x in args.no_aec_db.split(",")):
        print(f"no canceller, the echo {under:g} dB under the user: alone "
              f"{summary([(i, p) for _, i, p in peaks(*room([(60, 10 - under)], None, aec=False))])}")
        for at in (float(x) for x in args.user_at.split(",")):
            found = [(i, p) for r, i, p in peaks(*room([(60, 10 - under)], at, aec=False)) if r == 0]
            print(f"  the user from {at:.1f} s: {summary(found)}")


def summary(found: list[tuple[float, float]]) -> str:
    if not found:
        return "never Talking"
    (at, first), *held = found
    verdict = "cut" if first < ECHO_PART else "held as the echo"
    parts = [p for _, p in held]
    more = f"; held {len(held) * 20} ms more ({min(parts):.3f}..{max(parts):.3f})" if held else ""
    return f"Talking {at:.2f} s in, share {first:.3f}: {verdict}{more}"


if __name__ == "__main__":
    main()
