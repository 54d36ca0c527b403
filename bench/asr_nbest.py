"""The LM choosing among what Whisper might have heard: `tiny.en`'s N best hypotheses of each spoken
question (`voice spoken-eval`'s 40 questions, 16 kHz and G.711), each scored by the voice LM as the
user's turn (the sum of its tokens' and `<|im_end|>`'s log-probabilities under the voice system
prompt), and the best of Whisper's sum of log-probabilities + λ x the LM's taken.

Prints, per configuration and λ, the mean per-turn WER and how many questions were heard exactly;
the decode time of the shipped beam against beam N with N hypotheses (interleaved, clip by clip);
and what scoring the N hypotheses costs as one batched forward. `--as-questions FILE` writes the
transcripts chosen at `--pick` as `engine eval --answers` questions (answers right, same prompt).

    .venv/bin/python bench/asr_nbest.py --clips /tmp/clips --json bench/results/asr_nbest.json \\
        --as-questions /tmp/picked.jsonl --pick 0.5
    .venv/bin/engine eval --model qwen2.5-1.5b --quantize gguf --modes ar --answers /tmp/picked.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from common import machine, percentile, write_json
from engine.decode import CacheState, Forward, run_many
from engine.loading import load
from engine.train.data import VOICE_SYSTEM_PROMPT
from voice.pipeline.asr import SAMPLE_RATE, Whisper, encode_window, most_tokens
from voice.audio import read_wav, resample
from voice.config import AsrConfig
from voice.evals.spoken_eval import build_clips, turn_wer

LAMBDAS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 2.0)


def hypotheses(whisper: Whisper, audio: np.ndarray, beam: int, n: int) -> tuple[list[tuple[str, float]], float]:
    """Whisper's `n` best transcripts of `audio` as (text, sum of token log-probabilities), and the
    decode's time in ms (features, encoder and beam search, as the service's final decode)."""
    model, tokenizer = whisper.model, whisper._tokenizer
    assert tokenizer is not None  # tiny.en: English only
    started = time.perf_counter()
    encoded = encode_window(model, audio, whisper.window_s(len(audio)))
    prompt = model.get_prompt(tokenizer, whisper._prompt_tokens(tokenizer), without_timestamps=True, prefix="")
    result = model.model.generate(encoded, [prompt], beam_size=beam, num_hypotheses=n, return_scores=True,
                                  max_length=most_tokens(model, prompt, audio), suppress_blank=True,
                                  suppress_tokens=[-1])[0]
    took = (time.perf_counter() - started) * 1000
    # CTranslate2's score is the log-probability divided by the length (length_penalty 1)
    return [(tokenizer.decode(ids).strip(), float(score) * len(ids))
            for ids, score in zip(result.sequences_ids, result.scores)], took


class TurnScorer:
    """The LM's log-probability of texts as the user's turn, all of a clip's in one batched forward on
    the cached system prompt (what the service would run)."""

    def __init__(self, model_name: str):
        self.lm = load(model_name, quantize="gguf", max_seq_len=1024)
        self.base = self._ids("")
        self.root = CacheState.new(self.lm.model, 1024)
        run_many(self.lm.model, [Forward(self.root, self.base[:-1])])
        self.states: list[CacheState] = []

    def _ids(self, text: str) -> list[int]:
        return self.lm.tokenizer.encode_chat_open([{"role": "system", "content": VOICE_SYSTEM_PROMPT},
                                                   {"role": "user", "content": text}])

    def scores(self, texts: list[str]) -> tuple[list[float], float]:
        while len(self.states) < len(texts):
            self.states.append(self.root.fork(self.lm.model))
        forwards, targets = [], []
        for state, text in zip(self.states, texts):
            ids = self._ids(text)
            assert ids[:len(self.base)] == self.base, "the user's text changed the template before it"
            target = ids[len(self.base):] + [self.lm.tokenizer.turn_end_id]
            state.reuse_for(self.base)  # the system prompt stays cached; its last token is written again
            forwards.append(Forward(state, [self.base[-1]], False, target, draft_causal=True))
            targets.append(target)
        started = time.perf_counter()
        results = run_many(self.lm.model, forwards)
        took = (time.perf_counter() - started) * 1000
        out = []
        for (last, drafted), target in zip(results, targets):
            assert last is not None and drafted is not None
            logits = torch.cat([last[None], drafted[:-1]]).float()
            out.append(float(torch.log_softmax(logits, -1)[torch.arange(len(target)), torch.tensor(target)].sum()))
        return out, took


def exact(reference: str, text: str) -> bool:
    return text.lower().strip("?.! ") == reference.lower().strip("?.! ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clips", default="runs/spoken-eval-clips", help="folder of the spoken questions (made if missing)")
    p.add_argument("--beam", type=int, default=8, help="beam size and hypotheses kept")
    p.add_argument("--model", default="qwen2.5-1.5b", help="the LM that scores (on llama.cpp)")
    p.add_argument("--pick", type=float, default=0.5, help="λ of --as-questions")
    p.add_argument("--as-questions", default="", help="write the transcripts chosen at --pick here (JSONL)")
    p.add_argument("--json", default="", help="write every clip's hypotheses, scores and the summary here")
    a = p.parse_args()

    clips = build_clips(Path(a.clips))
    asr = AsrConfig()
    whisper = Whisper(asr)
    scorer = TurnScorer(a.model)
    rows, shipped_ms, nbest_ms, score_ms = [], [], [], []
    for clip in clips:
        audio, rate = read_wav(clip.path)
        audio = resample(audio, rate, SAMPLE_RATE)
        shipped, took = hypotheses(whisper, audio, asr.beam_size, 1)
        best = shipped[0][0]
        shipped_ms.append(took)
        nbest, took = hypotheses(whisper, audio, a.beam, a.beam)
        nbest_ms.append(took)
        lm, took = scorer.scores([text for text, _ in nbest])
        score_ms.append(took)
        rows.append({"question": clip.question, "answer": clip.answer, "config": clip.config, "voice": clip.voice,
                     "shipped": best, "hypotheses": [{"text": t, "asr": s, "lm": q} for (t, s), q in zip(nbest, lm)]})
        print(f"{clip.config:4s} {clip.voice:18s} {clip.question!r}: {len(nbest)} hypotheses, "
              f"heard {best!r}, question among them: {any(exact(clip.question, t) for t, _ in nbest)}", flush=True)

    def chosen(row: dict, lam: float) -> str:
        return max(row["hypotheses"], key=lambda h: h["asr"] + lam * h["lm"])["text"]

    summary: dict = {"decode_ms": {"shipped_p50": percentile(shipped_ms, 50), "shipped_p95": percentile(shipped_ms, 95),
                                   "nbest_p50": percentile(nbest_ms, 50), "nbest_p95": percentile(nbest_ms, 95)},
                     "score_ms": {"p50": percentile(score_ms, 50), "p95": percentile(score_ms, 95)}, "configs": {}}
    for config in dict.fromkeys(row["config"] for row in rows):
        part = [row for row in rows if row["config"] == config]
        result = {"shipped": {"wer": float(np.mean([turn_wer(r["question"], r["shipped"]) for r in part])),
                              "exact": sum(exact(r["question"], r["shipped"]) for r in part)},
                  "among": sum(any(exact(r["question"], h["text"]) for h in r["hypotheses"]) for r in part)}
        print(f"{config}: shipped beam {asr.beam_size} WER {result['shipped']['wer']:.3f}, exact "
              f"{result['shipped']['exact']}/{len(part)}; the question among the {a.beam} best: {result['among']}")
        for lam in LAMBDAS:
            picks = [chosen(r, lam) for r in part]
            picked = {"wer": float(np.mean([turn_wer(r["question"], t) for r, t in zip(part, picks)])),
                      "exact": sum(exact(r["question"], t) for r, t in zip(part, picks))}
            result[f"lambda_{lam:g}"] = picked
            print(f"  λ {lam:<4g} WER {picked['wer']:.3f}  exact {picked['exact']}")
        summary["configs"][config] = result
    d, s = summary["decode_ms"], summary["score_ms"]
    print(f"decode p50/p95: beam {asr.beam_size} {d['shipped_p50']:.0f}/{d['shipped_p95']:.0f} ms, beam {a.beam} x "
          f"{a.beam} {d['nbest_p50']:.0f}/{d['nbest_p95']:.0f} ms; the LM scoring {a.beam} as one forward "
          f"{s['p50']:.0f}/{s['p95']:.0f} ms")
    if a.as_questions:
        Path(a.as_questions).write_text("".join(
            json.dumps({"prompt": chosen(r, a.pick) or "...", "answer": r["answer"], "question": r["question"],
                        "config": r["config"]}) + "\n" for r in rows))
        print(f"wrote {a.as_questions} (engine eval --answers {a.as_questions})")
    if a.json:
        write_json(a.json, {"machine": machine(), "beam": a.beam, "model": a.model, "summary": summary, "clips": rows})


if __name__ == "__main__":
    main()
