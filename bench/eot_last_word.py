"""Does Whisper's own confidence tell a word it made up for speech cut mid-word from a finished last word?

`voice eot-eval`'s items (tests/speech whole and with pauses, Piper's sentences), streamed through the
service's VAD as eot-eval streams them; at every silence that reaches `asr.early_final_ms` the utterance so
far is decoded as the service decodes its early final (`Whisper._transcribe_window`: the shipped tiny.en, beam
5, one thread), and CTranslate2's `align` gives each token's probability given the ones before it (the
figures faster-whisper's `word_timestamps=True` averages into a word's probability). Printed per silence that
matters: a pause that ended the turn (at least the hangover long, the user spoke again: it should be held)
and each complete item's end (it should not be): the transcript, `endofturn.unfinished`'s reason, the last
word's probability (its tokens, punctuation excluded), the end mark's, the decode's
average log-probability, Smart Turn's probability at the early final, and what the alignment costs per
final. BENCHMARKS.md "Heard in a room".

    PYTHONPATH=. .venv/bin/python bench/eot_last_word.py [--json bench/results/eot_last_word.json]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np

from voice.config import Config
from voice.evals.eot_eval import PAUSES_S, SAMPLE_RATE, build_items, speech_frames
from voice.pipeline.asr import Whisper, encode_window, most_tokens
from voice.pipeline.endofturn import SmartTurn, unfinished
from voice.pipeline.tts import load_voice


def decode(whisper: Whisper, audio: np.ndarray) -> dict:
    """The early final's decode, and each of its tokens' probability (teacher-forced, the EOT last)."""
    model, tokenizer = whisper.model, whisper._tokenizer
    assert tokenizer is not None
    seconds = whisper.window_s(len(audio))
    t0 = time.perf_counter()
    encoded = encode_window(model, audio, seconds)
    prompt = model.get_prompt(tokenizer, [], without_timestamps=True)
    result = model.model.generate(encoded, [prompt], beam_size=whisper.config.beam_size,
                                  max_length=most_tokens(model, prompt, audio), suppress_blank=True,
                                  suppress_tokens=[-1], return_scores=True, return_no_speech_prob=True)[0]
    decode_ms = (time.perf_counter() - t0) * 1000
    tokens = [t for t in result.sequences_ids[0] if t < tokenizer.eot]
    t0 = time.perf_counter()
    frames = int(len(audio) / model.feature_extractor.hop_length)
    aligned = model.model.align(encoded, tokenizer.sot_sequence, [tokens], frames)[0] if tokens else None
    align_ms = (time.perf_counter() - t0) * 1000
    probs = list(aligned.text_token_probs) if aligned is not None else []
    pieces = [tokenizer.decode([t]) for t in tokens]
    return {"text": tokenizer.decode(tokens).strip(), "pieces": pieces, "probs": probs,
            "log_prob": float(result.scores[0]), "decode_ms": decode_ms, "align_ms": align_ms}


def last_word(decoded: dict) -> dict:
    """The last word's probability (the mean of its word tokens', as faster-whisper's) and the end mark's. (The
    end of text's cannot be read this way: aligned as a text token it scored 0.00 on every item.)"""
    pieces, probs = decoded["pieces"], decoded["probs"]
    end = len(pieces)
    while end > 0 and re.fullmatch(r"[.?!,…]+", pieces[end - 1].strip() or "x"):
        end -= 1  # the end mark's tokens
    start = end - 1
    while start > 0 and not pieces[start].startswith(" "):
        start -= 1  # the word's first token starts with its space
    word = probs[max(start, 0):end]
    return {"word": "".join(pieces[max(start, 0):end]).strip(),
            "word_p": float(np.mean(word)) if word else None, "word_min_p": float(min(word)) if word else None,
            "mark_p": float(min(probs[end:len(pieces)])) if len(pieces) > end else None}


def silences_of(item, config: Config, whisper: Whisper, smart_turn: SmartTurn) -> list[dict]:
    """Every silence in speech that reached the early final, as the service's VAD hears the item, with the
    early final's decode and how long the silence lasted (the last: to the item's end)."""
    out: list[dict] = []
    current: dict | None = None
    for end, start_s, silence_ms in speech_frames(item.audio, config.vad, config.vad.frame_ms):
        if silence_ms == 0:
            current = None
            continue
        if current is not None:
            current["length_ms"] = silence_ms
        elif silence_ms >= config.asr.early_final_ms:
            utterance = item.audio[int(start_s * SAMPLE_RATE):end]
            decoded = decode(whisper, utterance)
            t0 = time.perf_counter()
            heard = smart_turn.probability(utterance)
            current = {"length_ms": silence_ms, **decoded, **last_word(decoded), "why": unfinished(decoded["text"]),
                       "smart_turn": heard, "smart_turn_ms": (time.perf_counter() - t0) * 1000}
            out.append(current)
    if current is not None:
        current["last"] = True  # silence to the item's end
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--pause", type=float, default=0.6, help="the inserted pause scored (s)")
    a = parser.parse_args()
    config = Config()
    whisper = Whisper(config.asr)
    items = build_items(whisper.model, load_voice(config.tts))
    smart_turn = SmartTurn(threads=1)
    assert a.pause in PAUSES_S
    rows = []
    for item in items:
        paused = bool(item.pauses)
        if paused and abs(item.pauses[0][1] - a.pause) > 1e-6:
            continue
        for s in silences_of(item, config, whisper, smart_turn):
            final = s.get("last", False)
            ends_turn = final or s["length_ms"] >= config.vad.hangover_ms
            if not ends_turn or (final and paused):
                continue
            rows.append({"id": item.id, "kind": "complete" if final else "pause", **s})
    for row in rows:
        def p(x: float | None) -> str:
            return "-" if x is None else f"{x:.2f}"
        print(f"{row['kind']:8} {row['id'][:46]:46} {row['text'][:44]!r:48} {str(row['why']):9} "
              f"word {row['word'][:10]!r:12} {p(row['word_p'])} min {p(row['word_min_p'])} mark {p(row['mark_p'])} "
              f"lp {row['log_prob']:.2f} st {p(row['smart_turn'])}")
    align = [r["align_ms"] for r in rows]
    st = [r["smart_turn_ms"] for r in rows]
    print(f"Smart Turn at the early final p50 {np.percentile(st, 50):.0f} ms")
    dec = [r["decode_ms"] for r in rows]
    print(f"per final: decode p50 {np.percentile(dec, 50):.0f} ms, align p50 {np.percentile(align, 50):.1f} ms "
          f"/ p95 {np.percentile(align, 95):.1f} ms ({len(rows)} finals)")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
