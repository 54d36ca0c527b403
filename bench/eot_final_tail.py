"""Does less trailing silence in the audio Whisper decodes change the end mark it writes at a pause?

`voice eot-eval`'s items with a 0.6 s pause (and the complete ones, `--complete`), streamed through the
service's VAD as eot-eval streams them; in the silence of the inserted pause (or after the last word), when it
reaches `asr.early_final_ms` (the service's early final) and `turn.min_silence_ms` (where eot-eval asks), the
utterance so far is decoded (`Whisper.transcribe`, the shipped tiny.en) as it is, and trimmed to its energy's end
(`speech_end_s`) plus `--tails` ms: the transcript and `endofturn.unfinished`'s reason for each. BENCHMARKS.md
"Heard in a room".

    PYTHONPATH=. .venv/bin/python bench/eot_final_tail.py [--tails 0,50,100] [--complete]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from voice.config import Config
from voice.evals.eot_eval import SAMPLE_RATE, build_items, speech_end_s, speech_frames
from voice.pipeline.asr import Whisper
from voice.pipeline.endofturn import unfinished
from voice.pipeline.tts import load_voice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tails", default="0,50,100", help="ms of the audio kept after the speech's end")
    parser.add_argument("--complete", action="store_true", help="the complete items' ends too")
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    config = Config()
    whisper = Whisper(config.asr)
    tails = [int(t) for t in a.tails.split(",")]
    rows = []
    for item in build_items(whisper.model, load_voice(config.tts)):
        paused = bool(item.pauses) and abs(item.pauses[0][1] - 0.6) < 1e-6
        if not paused and (item.pauses or not a.complete):
            continue
        asked: set[int] = set()
        after_s = item.pauses[0][0] if paused else item.true_end_s  # the inserted pause's silence, or the end's
        for end, start_s, silence_ms in speech_frames(item.audio, config.vad, config.vad.frame_ms):
            if end / SAMPLE_RATE < after_s or (silence_ms and end / SAMPLE_RATE - silence_ms / 1000 > after_s + 0.15):
                continue  # before it, or a later silence
            if silence_ms == 0 and asked:
                break
            for at_ms in (config.asr.early_final_ms, config.turn.min_silence_ms):
                if silence_ms < at_ms or at_ms in asked:
                    continue
                asked.add(at_ms)
                utterance = item.audio[int(start_s * SAMPLE_RATE):end]
                spoken_s = speech_end_s(utterance)
                tail_ms = round((len(utterance) / SAMPLE_RATE - spoken_s) * 1000)
                row = {"id": item.id, "at_ms": at_ms, "tail_ms": tail_ms, "as_is": whisper.transcribe(utterance)}
                for tail in tails:
                    row[f"tail_{tail}"] = whisper.transcribe(utterance[:int((spoken_s + tail / 1000) * SAMPLE_RATE)])
                rows.append(row)
                texts = [row["as_is"]] + [row[f"tail_{t}"] for t in tails]
                print(f"{item.id[:44]:44} at {at_ms} ms (tail {row['tail_ms']} ms): "
                      + " | ".join(f"{t!r} {unfinished(t)}" for t in texts))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
