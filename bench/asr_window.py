"""Whisper models and encoder windows: word error rate and decode time per `[asr] model` and
`[asr] min_window_s`.

Every real clip of tests/speech is decoded behind 0, 0.1, 0.2 and 0.3 s of silence (the
session's VAD pre-roll varies like this) and before 0.16 or 0.24 s of silence (the speculative
final is taken ~200 ms into the pause), once per window floor, in one process, one thread.
A loop is a transcript in which a run of 2-4 words comes three times in a row; the service
decodes such a transcript again with the full window, and `loops` counts them before that.

    .venv/bin/python bench/asr_window.py                 # windows 12, 16, 20, 30 s
    .venv/bin/python bench/asr_window.py --windows 16,30 --json bench/results/asr_window.json
    .venv/bin/python bench/asr_window.py --models tiny.en,base --windows 16 --json bench/results/asr_models.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jiwer
import numpy as np

from common import REPO, machine, write_json
from voice.pipeline.asr import Whisper, repeats_itself
from voice.config import FULL_WINDOW_S, AsrConfig
from voice.audio import read_wav
from voice.clients.bench import normalise, read_references

LEADS_S = (0.0, 0.1, 0.2, 0.3)
TAILS_S = (0.16, 0.24)


def clips(audio_dir: Path) -> list[tuple[np.ndarray, str]]:
    out = []
    for name, reference in read_references(audio_dir).items():
        audio, rate = read_wav(audio_dir / name)
        assert rate == 16000, f"{name}: {rate} Hz, need 16 kHz"
        for lead in LEADS_S:
            for tail in TAILS_S:
                padded = np.concatenate([np.zeros(int(lead * rate), np.float32), audio,
                                         np.zeros(int(tail * rate), np.float32)])
                out.append((padded, reference))
    return out


def measure(model: str, window_s: float, cases: list[tuple[np.ndarray, str]]) -> dict:
    whisper = Whisper(AsrConfig(model=model, min_window_s=window_s, cpu_threads=1))
    whisper.transcribe(cases[0][0])  # warm-up
    hypotheses, loops, seconds = [], 0, 0.0
    for audio, _ in cases:
        start = time.perf_counter()
        window = whisper.window_s(len(audio))
        # the window alone, without the service's full-window retry of a loop
        text = whisper._transcribe_window(audio, "", window) if window < FULL_WINDOW_S else whisper.transcribe(audio)
        seconds += time.perf_counter() - start
        loops += repeats_itself(text)
        hypotheses.append(normalise(text))
    return {"model": model, "min_window_s": window_s, "decodes": len(cases),
            "wer": jiwer.wer([r for _, r in cases], hypotheses), "loops": loops,
            "mean_decode_ms": seconds / len(cases) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny.en", help="comma-separated `[asr] model` values")
    parser.add_argument("--windows", default="12,16,20,30", help="comma-separated window floors, seconds")
    parser.add_argument("--audio", type=Path, default=REPO / "tests" / "speech",
                        help="folder of 16 kHz WAVs with transcripts.tsv")
    parser.add_argument("--json", type=Path, help="write the table here")
    args = parser.parse_args()
    cases = clips(args.audio)
    rows = []
    print(f"{len(cases)} decodes per window ({args.audio}), 1 CPU thread, no loop retry")
    for model in args.models.split(","):
        for window_s in (float(w) for w in args.windows.split(",")):
            row = measure(model, window_s, cases)
            rows.append(row)
            print(f"{model:8s} window {window_s:4.0f} s: WER {row['wer']:.3f}  "
                  f"loops {row['loops']:2d}/{row['decodes']}  mean decode {row['mean_decode_ms']:.0f} ms", flush=True)
    if args.json:
        write_json(args.json, {"machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
