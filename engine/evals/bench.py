"""`engine bench`: autoregressive vs block-diffusion decoding of the same weights on the same prompts.

Each prompt (with `engine.train.data.VOICE_SYSTEM_PROMPT`) is answered once per mode, each time on a
fresh `ConversationCache` (so every request prefills its whole prompt), after one warm-up request
per mode. The order of the two modes alternates between prompts so that slow drift in machine
load does not favour one of them. Per request:

- `ttfb_ms`: call -> first committed piece. For AR that piece is one token; for diffusion it
  is the first block (or its finished left part).
- `ttfb8_ms`: call -> the piece that brings the reply to 8 tokens (the whole reply if it is
  shorter), for comparison with AR engines that report time to a first chunk of text.
- `prefill_ms`: the duration of the request's first model forward, timed with forward hooks
  on the model (no extra forward is run). For AR that forward is the prompt alone; for
  diffusion it is the prompt fused with the first denoising step of the first block, which is
  how the decoder really prefills. `setup_ms` is what comes before it (tokenising, allocating
  the conversation's KV cache) and `forward_ms` the median duration of the later forwards.
- `tok_s`: reply tokens / total request time; `tokens_per_forward`: reply tokens / forwards
  (prefill included). `decode_tok_s`: the tokens after the first piece / the time after it: the
  decoding speed alone, since both modes share the same prompt prefill (which is most of a
  short reply's time). Summaries aggregate tokens/s and tokens/forward over all requests
  (sum of tokens / sum of time or forwards) and give p50/p95 of the latencies.
- `tau`: tokens committed per verify forward while decoding: the tokens after the prefill forward's
  / the forwards after it (the base's own token included, so AR's is 1). The prefill forward has
  nothing to verify yet, and a short reply's one token there would pull tokens/forward toward 1.
  `first_block`: the tokens the first forward after the prefill commits (the reply's first drafted
  block), whose mean (`first_block_tau`) is reported apart: a reply's opening is formulaic.

Timings are wall-clock on whatever else the machine is doing; `machine` records the load
average before and after so a noisy run can be recognised.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine.train.data import VOICE_SYSTEM_PROMPT, chat
from engine.decode import DecodeConfig, Forward
from engine.runtime import Model
from engine.stream import ConversationCache, Engine

MODES = ("ar", "diffusion")
FIRST_N = 8  # ttfb8: time to this many reply tokens


# --- helpers shared with engine.evals.eval -----------------------------------------------------------

def read_prompts(path: Path, limit: int = 0) -> list[str]:
    """Prompts from a JSONL file of {"prompt": "..."} objects (blank lines skipped)."""
    prompts = []
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt' string ({err})") from err
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{path}:{n}: 'prompt' must be a non-empty string")
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts[:limit] if limit and limit > 0 else prompts


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of the finite values; nan if there are none."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else float("nan")


def machine_info() -> dict:
    info: dict[str, object] = {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or None, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads()}
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    if hasattr(os, "getloadavg"):
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def finite_or_none(obj: Any) -> Any:  # JSON
    """Strict JSON has no NaN/Infinity: those become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def write_json(path: Path | None, result: dict) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite_or_none(result), indent=2, ensure_ascii=False, allow_nan=False) + "\n")
    print(f"wrote {path}")


def effective_adapter(model: str, adapter: str | Path | None) -> str | None:
    """The adapter `engine.loading.load` will really merge (None: none), for reports."""
    from engine.loading import DEFAULT_ADAPTER
    if adapter == "default":
        return str(DEFAULT_ADAPTER)
    return str(adapter) if adapter else None


def _fmt(x: float, digits: int = 1) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


class ForwardTimer:
    """(start, end) perf_counter pairs of every forward of `model`: module hooks on PyTorch's, a
    wrapper around llama.cpp's `step` (one call per batched step)."""

    def __init__(self, model: Model) -> None:
        self.spans: list[tuple[float, float]] = []
        self._start = 0.0
        self._model = model

        def before(*_: object) -> None:
            self._start = time.perf_counter()

        def after(*_: object) -> None:
            self.spans.append((self._start, time.perf_counter()))

        if isinstance(model, torch.nn.Module):
            self._handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
            return
        self._handles = []
        inner = model.step

        def timed(forwards: list[Forward], interruptible: bool = False) -> list[tuple[Tensor, Tensor | None]]:
            before()
            try:
                return inner(forwards, interruptible)
            finally:
                after()

        setattr(model, "step", timed)  # noqa: B010 - this instance's step, wrapped (mypy: no assigning to a method)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        if not self._handles:
            del self._model.step  # the class's own again


# --- one timed request -------------------------------------------------------------------------

def timed_request(engine: Engine, messages: list[dict], cfg: DecodeConfig, timer: ForwardTimer | None = None) -> dict:
    """Run one request on a fresh conversation and measure it (see the module docstring)."""
    if timer:
        timer.spans.clear()
    start = time.perf_counter()
    first = first_n = None
    first_tokens = 0
    last = None
    ids: list[int] = []
    text: list[str] = []
    tokens_after: dict[int, int] = {}  # reply tokens committed once each forward is done
    for piece in engine.generate_sync(messages, cfg, ConversationCache()):
        tokens_after[piece.forwards] = piece.tokens
        now = time.perf_counter()
        if first is None:
            first, first_tokens = now, piece.tokens
        if first_n is None and piece.tokens >= FIRST_N:
            first_n = now
        ids += piece.token_ids
        text.append(piece.text)
        last = piece
    end = time.perf_counter()
    tokens = last.tokens if last else 0
    forwards = last.forwards if last else 0
    row = {"mode": cfg.mode, "tokens": tokens, "forwards": forwards,
           "ttfb_ms": (first - start) * 1000 if first else float("nan"),
           "ttfb8_ms": ((first_n or end) - start) * 1000,
           "total_ms": (end - start) * 1000,
           "tok_s": tokens / (end - start) if end > start else float("nan"),
           "decode_tokens": tokens - first_tokens, "decode_ms": (end - (first or end)) * 1000,
           "tokens_per_forward": tokens / forwards if forwards else float("nan"),
           **verify_counts(tokens_after, tokens, forwards),
           "finish_reason": last.finish_reason if last else None,
           "prompt_tokens": last.prompt_tokens if last else 0,
           "text": "".join(text), "token_ids": ids}
    if timer and timer.spans:
        s0, e0 = timer.spans[0]
        rest = [(e - s) * 1000 for s, e in timer.spans[1:]]
        row.update(prefill_ms=(e0 - s0) * 1000, setup_ms=(s0 - start) * 1000,
                   forward_ms=percentile(rest, 50) if rest else float("nan"))
    return row


def verify_counts(tokens_after: dict[int, int], tokens: int, forwards: int) -> dict:
    """A request's decoding counts apart from its prefill forward (see the module docstring):
    `decode_forwards`, the tokens they committed (`verified_tokens`), `tau` and `first_block`
    (None where the reply ended with the prefill, or a piece held more than one forward's tokens)."""
    prefilled = tokens_after.get(1)
    if prefilled is None or forwards < 2:
        return {"decode_forwards": 0, "verified_tokens": 0, "tau": float("nan"), "first_block": None}
    second = tokens_after.get(2)
    return {"decode_forwards": forwards - 1, "verified_tokens": tokens - prefilled,
            "tau": (tokens - prefilled) / (forwards - 1), "first_block": second - prefilled if second else None}


def summarize_mode(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["total_ms"] for r in rows) / 1000
    forwards = sum(r["forwards"] for r in rows)
    decode_seconds = sum(r["decode_ms"] for r in rows) / 1000
    firsts = [r for r in rows if r["first_block"] is not None]
    out = {"n": len(rows), "tok_s": tokens / seconds if seconds else float("nan"),
           "decode_tok_s": sum(r["decode_tokens"] for r in rows) / decode_seconds if decode_seconds else float("nan"),
           "tokens_per_forward": tokens / forwards if forwards else float("nan"),
           "tau": ratio(sum(r["verified_tokens"] for r in rows), sum(r["decode_forwards"] for r in rows)),
           "first_block_tau": ratio(sum(r["first_block"] for r in firsts), len(firsts)),
           "reply_tokens_mean": tokens / len(rows) if rows else float("nan"),
           "tok_s_p50": percentile([r["tok_s"] for r in rows], 50)}
    for key in ("ttfb_ms", "ttfb8_ms", "prefill_ms", "setup_ms", "forward_ms", "total_ms"):
        values = [r.get(key, float("nan")) for r in rows]
        out[f"{key}_p50"] = percentile(values, 50)
        out[f"{key}_p95"] = percentile(values, 95)
    out["per_prompt"] = rows
    return out


TABLE = (("TTFB p50 (ms)", "ttfb_ms_p50", 1), ("TTFB p95 (ms)", "ttfb_ms_p95", 1),
         (f"first {FIRST_N} tokens p50 (ms)", "ttfb8_ms_p50", 1),
         (f"first {FIRST_N} tokens p95 (ms)", "ttfb8_ms_p95", 1),
         ("prefill forward p50 (ms)", "prefill_ms_p50", 1), ("setup before it p50 (ms)", "setup_ms_p50", 1),
         ("later forwards p50 (ms)", "forward_ms_p50", 1), ("request total p50 (ms)", "total_ms_p50", 1),
         ("tokens/s", "tok_s", 2), ("tokens/s after the first piece", "decode_tok_s", 2),
         ("tokens/forward (prefill in)", "tokens_per_forward", 2),
         ("tau: tokens/verify forward", "tau", 2), ("first block tau", "first_block_tau", 2),
         ("reply tokens (mean)", "reply_tokens_mean", 1))
RATIO_KEYS = ("ttfb_ms_p50", "ttfb_ms_p95", "ttfb8_ms_p50", "prefill_ms_p50", "forward_ms_p50", "total_ms_p50",
              "tok_s", "decode_tok_s", "tokens_per_forward", "tau", "first_block_tau")


def format_table(summary: dict) -> str:
    lines = [f"{'':28}{'AR':>12}{'diffusion':>12}{'diff/AR':>10}"]
    for label, key, digits in TABLE:
        a, d = summary["ar"][key], summary["diffusion"][key]
        lines.append(f"{label:28}{_fmt(a, digits):>12}{_fmt(d, digits):>12}{_fmt(ratio(d, a), 2):>10}")
    return "\n".join(lines)


def draft_despite(engine: Engine) -> None:
    """Mode diffusion drafts with the engine's drafter where its load-time decision keeps AR: a
    draft head on llama.cpp's kernels is given the states it reads."""
    from engine.stream import Decoding
    reason = engine.decoding.why
    engine.decoding = Decoding("diffusion", f"--draft-anyway (the load-time decision keeps AR here: {reason})")
    from engine.llamacpp import LlamaCppModel
    head, model = engine.loaded.drafter, engine.model
    if head is not None and isinstance(model, LlamaCppModel):
        model.read_states(head.args.window)


def run_bench(model: str, adapter: str | None, prompts_path: Path, json_path: Path | None, cfg: DecodeConfig,
              limit: int = 0, log: Callable[[str], object] = print, quantize: str = "none",
              drafter: str | None = None, draft_anyway: bool = False) -> dict:
    """Benchmark AR vs diffusion decoding of `model`; print a table, write JSON if asked, return the result.
    `draft_anyway`: mode diffusion drafts even where the load-time decision keeps AR (to measure it)."""
    prompts = read_prompts(prompts_path, limit)
    machine = machine_info()
    t = time.perf_counter()
    engine = Engine.load(model, adapter=adapter, quantize=quantize, drafter=drafter)
    if draft_anyway and engine.decoding.mode == "ar":
        draft_despite(engine)
    log(f"loaded {engine.name} ({engine.loaded.weights}, adapter: {effective_adapter(model, adapter) or 'none'}) in "
        f"{time.perf_counter() - t:.1f} s; {len(prompts)} prompts, "
        f"max_new_tokens {cfg.max_new_tokens}, torch threads {torch.get_num_threads()}")
    configs = {mode: replace(cfg, mode=mode) for mode in MODES}
    log(f"mode diffusion decodes {engine.decoding.mode} here: {engine.decoding.why}")
    timer = ForwardTimer(engine.model)
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        for mode in MODES:  # warm-up: first-call costs (allocation, kernels) stay out of the numbers
            timed_request(engine, chat(prompts[0], VOICE_SYSTEM_PROMPT), configs[mode], timer)
        for i, prompt in enumerate(prompts):
            messages = chat(prompt, VOICE_SYSTEM_PROMPT)
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                row = timed_request(engine, messages, configs[mode], timer)
                row["prompt"] = prompt
                rows[mode].append(row)
            a, d = rows["ar"][-1], rows["diffusion"][-1]
            log(f"[{i + 1}/{len(prompts)}] ar: {a['tokens']} tok, ttfb {a['ttfb_ms']:.0f} ms, {a['tok_s']:.1f} tok/s"
                f" | diffusion: {d['tokens']} tok, ttfb {d['ttfb_ms']:.0f} ms, {d['tok_s']:.1f} tok/s, "
                f"{d['tokens_per_forward']:.2f} tok/fwd | {prompt[:50]!r}")
    finally:
        timer.remove()
    summary = {mode: summarize_mode(rows[mode]) for mode in MODES}
    # lossless verify: greedy replies token for token the AR ones (ggml's batched kernels may round
    # a row differently from the one-row kernel, so this is measured, not assumed)
    identical = sum(a["token_ids"] == d["token_ids"] for a, d in zip(rows["ar"], rows["diffusion"]))
    summary["ratios"] = {k: ratio(summary["diffusion"][k], summary["ar"][k]) for k in RATIO_KEYS}
    if hasattr(os, "getloadavg"):
        machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result = {"model": engine.name, "adapter": effective_adapter(model, adapter), "weights": engine.loaded.weights,
              "decoding": {"mode": engine.decoding.mode, "why": engine.decoding.why}, "identical_replies": identical,
              "prompts": str(prompts_path), "config": asdict(cfg), "machine": machine, "summary": summary}
    log("")
    log(format_table(summary))
    log(f"replies identical to AR: {identical}/{len(prompts)}")
    log(f"(ratios are diffusion / AR; {len(prompts)} prompts; load average {machine.get('loadavg_start')} -> "
        f"{machine.get('loadavg_end')} on {machine.get('cpus_usable', machine['cpu_count'])} CPUs)")
    write_json(json_path, result)
    sys.stdout.flush()
    return result
