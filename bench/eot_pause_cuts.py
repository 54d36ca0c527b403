"""Where does `voice eot-eval` put its pauses: between two words, or inside one?

`voice eot-eval`'s builder inserts a pause at a word boundary from faster-whisper's word timestamps, at the
quietest 10 ms near it (`eot_eval.boundary_s`): before, by tiny.en's times alone; now the quieter of that place by
tiny.en's and by Whisper base's times (`eot_eval.pause_at_s`). For each boundary it pauses (`--pause`'s items,
0: all) and each way of placing the cut (`--cuts`): the cut's 10 ms frame's level, in dB under the clip's speech
level (its 90th percentile frame; "quiet" when under the level `speech_end_s` calls speech), the 100 ms before it
(its level, the share of its frames voiced or a fricative), and what Whisper base (the larger packaged model, as
a listener) hears in the audio before the cut and after it: "Ten of clubs." | "Oops." is a cut after "clu".
BENCHMARKS.md "Heard in a room".

    PYTHONPATH=. .venv/bin/python bench/eot_pause_cuts.py [--pause 0.6] [--json bench/results/eot_pause_cuts.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from voice.config import Config
from voice.evals.eot_eval import PAUSES_S, SAMPLE_RATE, _frames_rms, _word_times, boundary_s, loud_level, \
    pause_at_s, quiet_fill, sources
from voice.pipeline.asr import Whisper
from voice.pipeline.tts import load_voice


def frame_features(audio: np.ndarray, at: int) -> tuple[float, float]:
    """A 20 ms window centred on the 10 ms frame `at`: the share of its power above 3 kHz (a fricative, "s"),
    and its normalised autocorrelation's peak at a pitch of 80-400 Hz (voiced)."""
    window = audio[max(at * 160 - 80, 0):at * 160 + 240].astype(np.float64)
    window = np.pad(window, (0, 320 - len(window))) - window.mean()
    spectrum = np.abs(np.fft.rfft(window * np.hanning(len(window)))) ** 2
    high = float(spectrum[np.fft.rfftfreq(len(window), 1 / SAMPLE_RATE) > 3000].sum() / max(spectrum.sum(), 1e-20))
    lags = np.correlate(window, window, "full")[len(window) - 1:]
    return high, float(lags[40:200].max() / max(lags[0], 1e-20))


def listen(whisper: Whisper, audio: np.ndarray) -> str:
    padded = np.concatenate([quiet_fill(audio, 0.3), audio, quiet_fill(audio, 1.0)])
    return whisper.transcribe(padded)


def describe(audio: np.ndarray, cut_s: float, base: Whisper) -> dict:
    rms = _frames_rms(audio)
    db = 20 * np.log10(rms + 1e-9)
    speech_db = float(np.percentile(db, 90))
    frame = min(int(round(cut_s * 100)), len(rms) - 1)
    before = range(max(frame - 10, 0), frame)
    feats = [frame_features(audio, i) for i in before]
    cut = int(cut_s * SAMPLE_RATE)
    return {"cut_s": round(cut_s, 3), "cut_db": round(float(db[frame]), 1),
            "under_speech_db": round(speech_db - float(db[frame]), 1),
            "quiet": bool(rms[frame] <= loud_level(rms)),
            "before_100ms_db": round(float(20 * np.log10(np.sqrt(np.mean(np.square(rms[before]))) + 1e-9)), 1),
            "before_voiced": round(float(np.mean([v > 0.35 for _, v in feats])), 2),
            "before_fricative": round(float(np.mean([h > 0.5 for h, _ in feats])), 2),
            "heard_before": listen(base, audio[:cut]), "heard_after": listen(base, audio[cut:])}


def place(name: str, audio: np.ndarray, k: int, words: list, base_words: list) -> float | None:
    """The cut after word k by tiny.en's times, base's (None when it counts other words), or both."""
    if name == "both":
        return pause_at_s(audio, k, [words, base_words])
    times = words if name == "tiny" else base_words
    return boundary_s(audio, times[k - 1][1], times[k][0]) if len(times) == len(words) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pause", type=float, default=0.6, help="only the boundaries that get this pause (0: all)")
    parser.add_argument("--cuts", default="tiny,both", help="tiny / base: `boundary_s` on tiny.en's / base's word "
                        "times (tiny: the builder before); both: `pause_at_s` (the builder now)")
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    config = Config()
    tiny = Whisper(config.asr)
    base = Whisper(replace(config.asr, model="base"))
    counter, rows = 0, []
    names = a.cuts.split(",")
    for source in sources(load_voice(config.tts)):
        audio = np.concatenate([source.audio, quiet_fill(source.audio, 2.0)])  # as `_items_from`
        words = _word_times(tiny.model, source.audio)
        base_words = _word_times(base.model, source.audio)
        for k in range(1, len(words)) if source.after is None else source.after:
            if not 0 < k < len(words):
                continue
            pauses = [PAUSES_S[(counter + i) % len(PAUSES_S)] for i in range(2)]
            counter += 2
            if a.pause and not any(abs(p - a.pause) < 1e-6 for p in pauses):
                continue
            row = {"id": f"{source.name}/after{k}", "text": source.text, "pauses": pauses,
                   "tiny_times": [round(words[k - 1][1], 2), round(words[k][0], 2)],
                   "base_times": [round(base_words[k - 1][1], 2), round(base_words[k][0], 2)]
                   if len(base_words) == len(words) else None}
            for name in names:
                cut = place(name, audio, k, words, base_words)
                row[name] = None if cut is None else describe(audio, cut, base)
            rows.append(row)
            print(f"{row['id'][:44]:44} tiny.en's boundary {row['tiny_times']}, base's {row['base_times']}")
            for name in names:
                d = row[name]
                if d is None:
                    print(f"   {name:5} (base counts other words: {len(base_words)} / {len(words)})")
                    continue
                print(f"   {name:5} cut {d['cut_s']:.2f} s {d['cut_db']:6.1f} dB ({d['under_speech_db']:5.1f} under "
                      f"speech, {'quiet' if d['quiet'] else 'SPEECH'}); 100 ms before {d['before_100ms_db']:6.1f} dB, "
                      f"voiced {d['before_voiced']:.1f} fricative {d['before_fricative']:.1f}; base hears "
                      f"{d['heard_before']!r} | {d['heard_after']!r}")
    for name in names:
        placed = [r[name] for r in rows if r[name] is not None]
        print(f"{name}: {sum(d['quiet'] for d in placed)}/{len(placed)} cuts in quiet")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
