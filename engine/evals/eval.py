"""`engine eval`: diffusion replies of the model under test, judged against its AR teacher.

The teacher is the same checkpoint with no adapter (`Engine.load(model, adapter="")`; for
`small --adapter default` that is the plain packaged SmolLM2, the model the shipped adapter was
distilled from; when no adapter is merged at all, the loaded model serves as its own teacher).
Per prompt (as a chat with `engine.train.data.VOICE_SYSTEM_PROMPT`):

- the model under test replies with diffusion decoding (the given config, mode forced to
  diffusion): tokens per forward and TTFB (call -> first committed piece);
- the teacher samples its own reply in AR mode at temperature 0.7 with a fixed seed;
- the teacher scores both replies: one cache-free causal forward over prompt + reply, mean
  -log p of the reply tokens (EOS included when the reply stopped). The summary NLLs are per
  token over all replies together (token-weighted); `nll_ratio` = diffusion / teacher, so 1.0
  means the diffusion replies are as plausible to the teacher as its own samples;
- repeated-4-gram rate of both replies (see `repeated_ngram_rate`), averaged over prompts.

Scoring needs the teacher and the model under test to share a tokenizer, which holds because
the teacher is the same checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from engine.evals.bench import (effective_adapter, machine_info, percentile, ratio, read_prompts, timed_request,
                                write_json)
from engine.train.data import VOICE_SYSTEM_PROMPT, chat
from engine.decode import DecodeConfig
from engine.model import Transformer, visibility_mask
from engine.stream import Engine

TEACHER_TEMPERATURE = 0.7
TEACHER_SEED = 1234  # + prompt index: reproducible teacher samples


def repeated_ngram_rate(ids: list[int], n: int = 4) -> float:
    """Fraction of the n-grams of `ids` that already occurred earlier in `ids`; 0.0 if there are none."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated / len(grams)


@torch.inference_mode()
def reply_nll(model: Transformer, prompt_ids: list[int], reply_ids: list[int]) -> float:
    """Summed -log p(reply | prompt) under `model`: one causal forward without a KV cache."""
    if not reply_ids:
        return 0.0
    ids = prompt_ids + reply_ids
    t, p = len(ids), len(prompt_ids)
    pos = torch.arange(t)
    logits = model(torch.tensor([ids]), pos, visibility_mask(pos + 1, t), slice(p - 1, t - 1))[0].float()
    logp = logits.log_softmax(-1).gather(-1, torch.tensor(reply_ids)[:, None]).squeeze(-1)
    return float(-logp.sum())


def _mean(values: list[float]) -> float:
    xs = [v for v in values if v is not None and math.isfinite(v)]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: list[dict]) -> dict:
    tok_d = sum(r["nll_tokens_diffusion"] for r in rows)
    tok_t = sum(r["nll_tokens_teacher"] for r in rows)
    nll_d = sum(r["nll_sum_diffusion"] for r in rows) / tok_d if tok_d else float("nan")
    nll_t = sum(r["nll_sum_teacher"] for r in rows) / tok_t if tok_t else float("nan")
    tokens = sum(r["tokens"] for r in rows)
    forwards = sum(r["forwards"] for r in rows)
    return {"n": len(rows),
            "tokens_per_forward": tokens / forwards if forwards else float("nan"),
            "ttfb_ms_p50": percentile([r["ttfb_ms"] for r in rows], 50),
            "ttfb_ms_p95": percentile([r["ttfb_ms"] for r in rows], 95),
            "tok_s": tokens / (sum(r["total_ms"] for r in rows) / 1000) if rows else float("nan"),
            "nll_diffusion": nll_d, "nll_teacher": nll_t, "nll_ratio": ratio(nll_d, nll_t),
            "rep4_diffusion": _mean([r["rep4_diffusion"] for r in rows]),
            "rep4_teacher": _mean([r["rep4_teacher"] for r in rows]),
            "reply_tokens_diffusion": _mean([r["tokens"] for r in rows]),
            "reply_tokens_teacher": _mean([r["teacher_tokens"] for r in rows]),
            "stop_rate_diffusion": _mean([r["finish_reason"] == "stop" for r in rows]),
            "stop_rate_teacher": _mean([r["teacher_finish_reason"] == "stop" for r in rows])}


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def format_table(rows: list[dict], summary: dict) -> str:
    lines = [f"{'#':>3} {'tok/fwd':>7} {'ttfb ms':>8} {'nll diff':>8} {'nll teach':>9} {'rep4 d':>6} "
             f"{'rep4 t':>6}  prompt"]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:>3} {_fmt(r['tokens_per_forward']):>7} {_fmt(r['ttfb_ms'], 0):>8} "
                     f"{_fmt(r['nll_diffusion']):>8} {_fmt(r['nll_teacher']):>9} {_fmt(r['rep4_diffusion']):>6} "
                     f"{_fmt(r['rep4_teacher']):>6}  {r['prompt'][:40]!r}")
    s = summary
    lines += ["", f"tokens/forward {_fmt(s['tokens_per_forward'])}   TTFB p50 {_fmt(s['ttfb_ms_p50'], 0)} ms "
              f"(p95 {_fmt(s['ttfb_ms_p95'], 0)})   {_fmt(s['tok_s'], 1)} tok/s",
              f"teacher NLL/token: diffusion {_fmt(s['nll_diffusion'], 3)}  teacher samples "
              f"{_fmt(s['nll_teacher'], 3)}  ratio {_fmt(s['nll_ratio'], 3)}",
              f"repeated 4-grams: diffusion {_fmt(s['rep4_diffusion'], 3)}  teacher {_fmt(s['rep4_teacher'], 3)}   "
              f"reply tokens: diffusion {_fmt(s['reply_tokens_diffusion'], 1)}  teacher "
              f"{_fmt(s['reply_tokens_teacher'], 1)}   stopped: diffusion {_fmt(s['stop_rate_diffusion'])}  "
              f"teacher {_fmt(s['stop_rate_teacher'])}"]
    return "\n".join(lines)


def run_eval(model: str, adapter: str | None, prompts_path: Path, json_path: Path | None, cfg: DecodeConfig,
             limit: int = 0, log: Callable[[str], object] = print, quantize: str = "none") -> dict:
    """Evaluate `model`'s diffusion replies against its AR teacher; print, write JSON if asked, return."""
    prompts = read_prompts(prompts_path, limit)
    machine = machine_info()
    t = time.perf_counter()
    merged = effective_adapter(model, adapter)
    student = Engine.load(model, adapter=adapter, quantize=quantize)
    # The teacher is the fp32 checkpoint without adapter; with no adapter merged and no quantisation,
    # that is the student itself.
    teacher = Engine.load(model, adapter="") if merged or student.loaded.weights != "fp32" else student
    assert isinstance(teacher.model, Transformer)  # fp32: PyTorch's
    log(f"loaded {student.name} ({student.loaded.weights}, adapter: {merged or 'none'}) and its AR teacher in "
        f"{time.perf_counter() - t:.1f} s; {len(prompts)} prompts, max_new_tokens {cfg.max_new_tokens}")
    dcfg = replace(cfg, mode="diffusion")
    stop_ids = teacher.tokenizer.eos_ids
    timed_request(student, chat(prompts[0], VOICE_SYSTEM_PROMPT), dcfg)  # warm-up, not counted
    rows = []
    for i, prompt in enumerate(prompts):
        messages = chat(prompt, VOICE_SYSTEM_PROMPT)
        d = timed_request(student, messages, dcfg)
        tcfg = replace(cfg, mode="ar", temperature=TEACHER_TEMPERATURE, seed=TEACHER_SEED + i)
        t_ids: list[int] = []
        t_text, t_finish = [], None
        for piece in teacher.generate_sync(messages, tcfg):
            t_ids += piece.token_ids
            t_text.append(piece.text)
            t_finish = piece.finish_reason or t_finish
        prompt_ids = teacher.prompt_ids(messages)
        nll_d, nll_t = reply_nll(teacher.model, prompt_ids, d["token_ids"]), reply_nll(teacher.model, prompt_ids, t_ids)
        row = {"prompt": prompt, "reply_diffusion": d["text"], "reply_teacher": "".join(t_text),
               "tokens": d["tokens"], "forwards": d["forwards"], "tokens_per_forward": d["tokens_per_forward"],
               "ttfb_ms": d["ttfb_ms"], "total_ms": d["total_ms"], "finish_reason": d["finish_reason"],
               "teacher_tokens": len(t_ids), "teacher_finish_reason": t_finish,
               "nll_sum_diffusion": nll_d, "nll_tokens_diffusion": len(d["token_ids"]),
               "nll_sum_teacher": nll_t, "nll_tokens_teacher": len(t_ids),
               "nll_diffusion": nll_d / len(d["token_ids"]) if d["token_ids"] else float("nan"),
               "nll_teacher": nll_t / len(t_ids) if t_ids else float("nan"),
               "rep4_diffusion": repeated_ngram_rate([x for x in d["token_ids"] if x not in stop_ids]),
               "rep4_teacher": repeated_ngram_rate([x for x in t_ids if x not in stop_ids]),
               "token_ids_diffusion": d["token_ids"], "token_ids_teacher": t_ids}
        rows.append(row)
        log(f"[{i + 1}/{len(prompts)}] {row['tokens_per_forward']:.2f} tok/fwd, ttfb {row['ttfb_ms']:.0f} ms, "
            f"nll {row['nll_diffusion']:.2f} vs teacher {row['nll_teacher']:.2f}, rep4 {row['rep4_diffusion']:.2f}/"
            f"{row['rep4_teacher']:.2f} | {prompt[:40]!r}\n    diffusion: {row['reply_diffusion'][:100]!r}\n"
            f"    teacher:   {row['reply_teacher'][:100]!r}")
    summary = summarize(rows)
    if hasattr(os, "getloadavg"):
        machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result = {"model": student.name, "adapter": merged, "weights": student.loaded.weights,
              "teacher": {"model": teacher.name, "adapter": None, "mode": "ar", "temperature": TEACHER_TEMPERATURE,
                          "seed": f"{TEACHER_SEED} + prompt index"},
              "prompts": str(prompts_path), "config": asdict(dcfg), "machine": machine, "summary": summary,
              "per_prompt": rows}
    log("")
    log(format_table(rows, summary))
    write_json(json_path, result)
    return result


# --- answer accuracy ---------------------------------------------------------------------------

# Openings that say nothing: apologies and "as a voice assistant" disclaimers instead of an answer.
BOILERPLATE = re.compile(r"^\W*(i'?m sorry|sorry\b|i apologi[sz]e|as an? (ai|voice|language|virtual)|"
                         r"i'?m (just |only )?an? (ai|voice|language|virtual)|i (do not|don't) have (access|"
                         r"real-time|the ability))", re.IGNORECASE)


def read_questions(path: Path, limit: int = 0) -> list[dict]:
    """{"prompt", "answer"} rows; `answer` is a regular expression searched case-insensitively."""
    rows = []
    for n, line in enumerate(Path(path).open(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            re.compile(row["answer"])
            if not isinstance(row["prompt"], str):
                raise TypeError("prompt is not a string")
        except (ValueError, KeyError, TypeError, re.error) as err:
            raise ValueError(f"{path}:{n}: expected {{\"prompt\": str, \"answer\": regex}} ({err})") from err
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} has no questions")
    return rows[:limit] if limit and limit > 0 else rows


def is_right(reply: str, answer: str) -> bool:
    return re.search(answer, reply, re.IGNORECASE) is not None


def answer_summary(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    forwards = sum(r["forwards"] for r in rows)
    seconds = sum(r["total_ms"] for r in rows) / 1000
    return {"n": len(rows), "right": sum(r["right"] for r in rows),
            "accuracy": sum(r["right"] for r in rows) / len(rows),
            "boilerplate_rate": sum(r["boilerplate"] for r in rows) / len(rows),
            "tokens_per_forward": tokens / forwards if forwards else float("nan"),
            "tok_s": tokens / seconds if seconds else float("nan"),
            "ttfb_ms_p50": percentile([r["ttfb_ms"] for r in rows], 50),
            "reply_tokens_mean": tokens / len(rows)}


def run_answers(model: str, adapter: str | None, questions_path: Path, json_path: Path | None, cfg: DecodeConfig,
                limit: int = 0, log: Callable[[str], object] = print, quantize: str = "none",
                modes: tuple[str, ...] = ("ar", "diffusion"), system: str = VOICE_SYSTEM_PROMPT,
                drafter: str | None = None) -> dict:
    """Ask every question in each decoding mode on the same weights; report the share answered right
    (the reference regex found in the reply), boilerplate openings, tokens per forward and speed,
    and how many replies are identical across modes (greedy `verify` must make them all so)."""
    questions = read_questions(questions_path, limit)
    machine = machine_info()
    engine = Engine.load(model, adapter=adapter, quantize=quantize, drafter=drafter)
    drafter_name = type(engine.loaded.drafter).__name__ if engine.loaded.drafter else "LookupDrafter"
    log(f"loaded {engine.name} ({engine.loaded.weights}, adapter: {effective_adapter(model, adapter) or 'none'}, "
        f"drafter: {drafter_name}); {len(questions)} questions, modes {', '.join(modes)}")
    configs = {m: replace(cfg, mode=m) for m in modes}
    for m in modes:  # warm-up, not counted
        timed_request(engine, chat(questions[0]["prompt"], system), configs[m])
    per_mode: dict[str, list[dict]] = {m: [] for m in modes}
    for i, q in enumerate(questions):
        for m in modes:
            r = timed_request(engine, chat(q["prompt"], system), configs[m])
            per_mode[m].append({"prompt": q["prompt"], "answer": q["answer"], "reply": r["text"],
                                "right": is_right(r["text"], q["answer"]),
                                "boilerplate": BOILERPLATE.search(r["text"]) is not None,
                                "tokens": r["tokens"], "forwards": r["forwards"], "ttfb_ms": r["ttfb_ms"],
                                "total_ms": r["total_ms"], "token_ids": r["token_ids"]})
        marks = " ".join(f"{m}:{'right' if per_mode[m][-1]['right'] else 'WRONG'}" for m in modes)
        log(f"[{i + 1}/{len(questions)}] {marks} | {q['prompt']!r} -> {per_mode[modes[-1]][-1]['reply'][:80]!r}")
    summary = {m: answer_summary(rows) for m, rows in per_mode.items()}
    if len(modes) > 1:
        first = per_mode[modes[0]]
        summary["identical_replies"] = {m: sum(a["token_ids"] == b["token_ids"] for a, b in zip(first, per_mode[m]))
                                        for m in modes[1:]}
    if hasattr(os, "getloadavg"):
        machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    log("")
    log(f"{'mode':10} {'right':>9} {'accuracy':>9} {'boilerplate':>11} {'tok/fwd':>8} {'tok/s':>7} {'TTFB p50':>9}")
    for m in modes:
        s = summary[m]
        log(f"{m:10} {s['right']:>4}/{s['n']:<4} {s['accuracy']:>9.1%} {s['boilerplate_rate']:>11.1%} "
            f"{_fmt(s['tokens_per_forward']):>8} {_fmt(s['tok_s'], 1):>7} {_fmt(s['ttfb_ms_p50'], 0):>6} ms")
    if "identical_replies" in summary:
        log(f"replies identical to {modes[0]}: " + ", ".join(f"{m} {n}/{len(questions)}"
                                                           for m, n in summary["identical_replies"].items()))
    result = {"model": engine.name, "adapter": effective_adapter(model, adapter), "weights": engine.loaded.weights,
              "drafter": drafter_name, "questions": str(questions_path), "system_prompt": system,
              "config": asdict(cfg), "machine": machine, "summary": summary, "per_mode": per_mode}
    write_json(json_path, result)
    return result
