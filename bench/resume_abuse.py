"""Talking on and on with short pauses (issue 41, item 2): how long an utterance grows and what
each final transcript costs when every pause is resumed.

    python bench/resume_abuse.py [--seconds 90] [--asr real|fake] [--json bench/results/resume_abuse.json]

A /ws client streams tests/speech's clips in real time, one after another, with a pause of
0.5-1.5 s (seeded) after each, for `--seconds`. The service runs in this process with the real
Whisper (`--asr real`, the default [asr]) or a stand-in whose time grows with the audio
(`--asr fake`), and a stand-in LM that takes 2 s per block, so no reply is heard within a pause
and every pause within `turn.resume_ms` is resumed: the worst case for the utterance's growth.
Every final decode is timed inside the ASR (the seconds of audio it was given, how long it took);
the client counts `speech_stopped` and final transcripts per turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from fakes import Client, FakeLM, FakeWhisper, LiveServer, fake_instance, make_config, speech  # noqa: E402

CLIPS = ["001.wav", "002.wav", "003.wav", "004.wav", "005.wav", "forever.wav", "goforward.wav"]


class GrowingWhisper(FakeWhisper):
    """A stand-in ASR taking `per_s` seconds per second of audio (a real one's cost grows with it)."""

    def __init__(self, per_s: float = 0.05):
        super().__init__()
        self.per_s = per_s

    def transcribe(self, audio, prefix=""):
        time.sleep(self.per_s * len(audio) / 16000)
        return f"{len(audio) / 16000:.1f} seconds"

    def transcribe_final(self, audio):
        return self.transcribe(audio)


INSIDE = threading.local()  # a final's own decode calls `transcribe`: not a partial


def timed(fn, log: list, final: bool):
    """`fn` (an ASR call), logging (start, seconds of audio, seconds taken) of each call."""
    def run(audio, *args):
        if not final and getattr(INSIDE, "final", False):
            return fn(audio, *args)
        t = time.monotonic()
        INSIDE.final = final
        try:
            return fn(audio, *args)
        finally:
            INSIDE.final = False
            log.append((t, len(audio) / 16000, time.monotonic() - t))
    return run


def whisper_for(kind: str, config):
    if kind == "fake":
        return GrowingWhisper()
    from voice.pipeline.asr import Whisper
    from voice.service.scheduler import Scheduler
    return Whisper(config.asr, Scheduler().worker("asr"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=90.0, help="how long the client talks")
    ap.add_argument("--asr", choices=["real", "fake"], default="real")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-utterance-s", type=float, default=30.0,
                    help="limits.max_utterance_s (0: no bound, as a resumed utterance had before issue 41)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    config = make_config(limits={"max_utterance_s": args.max_utterance_s})
    lm = FakeLM(blocks=("Ok.",))
    lm.delay_s = 2.0
    whisper = whisper_for(args.asr, config)
    finals: list[tuple[float, float, float]] = []
    partials: list[tuple[float, float, float]] = []
    whisper.transcribe_final = timed(whisper.transcribe_final, finals, True)  # (early finals too)
    whisper.transcribe = timed(whisper.transcribe, partials, False)
    instance = fake_instance(config, whisper, lm=lm)

    load_start = [round(x, 2) for x in os.getloadavg()]
    rng = random.Random(args.seed)
    pcm, talked, pauses = b"", 0.0, []
    while talked < args.seconds:
        clip = speech(CLIPS[len(pauses) % len(CLIPS)])
        pause = rng.uniform(0.5, 1.5)
        pcm += clip + bytes(int(pause * 16000) * 2)
        talked += len(clip) / 32000 + pause
        pauses.append(round(pause, 2))

    with LiveServer(config, instance) as srv:
        async def scenario():
            c = await Client.open(srv.ws + "/ws")
            t0 = time.monotonic()
            c.listen(speed=1.0)
            c.say(pcm)
            await asyncio.sleep(talked + 0.5)
            quiet_at = t0 + talked - pauses[-1]  # the end of the last clip (streamed in real time)
            turns = len(c.events("speech_started"))
            await c.wait(lambda m: m["type"] == "reply_done" and m["turn"] >= turns and not m["interrupted"],
                         timeout=120)
            answered_at = time.monotonic()
            await asyncio.sleep(1.0)
            await c.shut()
            return c, t0, quiet_at, answered_at
        c, t0, quiet_at, answered_at = asyncio.run(scenario())

    events = [m for m in c.log if isinstance(m, dict)]
    stopped = [m["turn"] for m in events if m["type"] == "speech_stopped"]
    final_turns = [m["turn"] for m in events if m["type"] == "transcript" and m["final"]]
    resumed = [m for m in events if m["type"] == "speech_started" and m.get("resumes")]
    too_long = [m for m in events if m["type"] == "error" and m["code"] == "utterance_too_long"]
    decodes = [{"at_s": round(t - t0, 2), "audio_s": round(a, 2), "asr_s": round(d, 3)} for t, a, d in finals]
    out = {
        "asr": args.asr, "seconds_talked": round(talked, 1), "clips": len(pauses), "pauses_s": pauses,
        "max_utterance_s": config.limits.max_utterance_s, "resume_ms": config.turn.resume_ms,
        "speech_stopped": len(stopped), "finals": len(final_turns),
        "one_final_per_stopped": sorted(final_turns) == sorted(stopped) and len(set(final_turns)) == len(final_turns),
        "resumed_turns": len(resumed), "utterance_too_long": len(too_long),
        "final_decodes": len(decodes),
        "longest_final_audio_s": max((d["audio_s"] for d in decodes), default=0.0),
        "longest_final_asr_s": max((d["asr_s"] for d in decodes), default=0.0),
        "partial_decodes": len(partials),
        "longest_partial_audio_s": round(max((a for _, a, _ in partials), default=0.0), 2),
        "answer_after_quiet_s": round(answered_at - quiet_at, 2),  # (2 s of it the stand-in LM's)
        "loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "decodes": decodes,
    }
    text = json.dumps(out, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(json.dumps({k: v for k, v in out.items() if k not in ("decodes", "pauses_s")}, indent=1))
    print("final decodes (at s: audio s -> asr s):",
          " ".join(f"{d['at_s']:.0f}:{d['audio_s']:.1f}->{d['asr_s']:.2f}" for d in decodes))


if __name__ == "__main__":
    main()
