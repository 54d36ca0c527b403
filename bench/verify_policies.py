"""Several `verify` settings against AR, interleaved on the same prompts in one run.

    .venv/bin/python bench/verify_policies.py --prompts engine/prompts/heldout.jsonl \
        --policy "chain (shipped)=" --policy "one row=block_size=1,draft_threshold=0" \
        --policy "two rows=block_size=2,draft_threshold=0.3"

`engine bench` compares AR with one setting per run; settings whose difference is smaller than the
drift between runs need this: every prompt is answered once per setting (and by AR), the order
rotating from prompt to prompt, so that machine load is shared. Printed per setting: tokens per
forward, tokens/s, tokens/s after the first piece (the prefill is the same for all), and their
ratios to AR; replies are checked to be AR's (greedy verify is lossless).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.data import chat  # noqa: E402
from engine.decode import CacheState, DecodeConfig, generate  # noqa: E402
from engine.loading import load  # noqa: E402
from engine.quantize import DEFAULT_QUANTIZE  # noqa: E402


def parse_policy(text: str, base: DecodeConfig) -> tuple[str, DecodeConfig]:
    """'name=key=value,key=value' -> (name, DecodeConfig)."""
    name, _, settings = text.partition("=")
    types = {f.name: type(getattr(base, f.name)) for f in fields(DecodeConfig)}
    changes = {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"unknown DecodeConfig field {key!r} in --policy {text!r}")
        changes[key] = types[key](value)
    return name, replace(base, **changes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantize", default=DEFAULT_QUANTIZE)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", default="engine/prompts/heldout.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--policy", action="append", default=[],
                    help="NAME=field=value,... (DecodeConfig fields; verify by default); repeatable")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    loaded = load(a.model, max_seq_len=1024, quantize=a.quantize)
    model, tok = loaded.model, loaded.tokenizer
    base = DecodeConfig(max_new_tokens=a.max_new_tokens)
    policies = dict([("AR", replace(base, mode="ar"))] + [parse_policy(p, base) for p in a.policy or ["verify="]])
    prompts = [json.loads(line)["prompt"] for line in open(a.prompts)]
    totals = {name: {"tokens": 0, "forwards": 0, "seconds": 0.0, "after": 0, "after_seconds": 0.0, "same": 0}
              for name in policies}
    names = list(policies)
    for i, prompt in enumerate(prompts):
        ids = tok.encode_chat(chat(prompt))
        replies = {}
        for name in names[i % len(names):] + names[:i % len(names)]:
            start, first, out, forwards = time.perf_counter(), None, [], 0
            for block in generate(model, CacheState.new(model, 1024), ids, policies[name], loaded.spec,
                                  tok.eos_ids, loaded.drafter):
                if first is None:
                    first, first_tokens = time.perf_counter(), len(block.token_ids)
                out += block.token_ids
                forwards = block.forwards
            end = time.perf_counter()
            t = totals[name]
            t["tokens"] += len(out)
            t["forwards"] += forwards
            t["seconds"] += end - start
            t["after"] += len(out) - first_tokens
            t["after_seconds"] += end - first
            replies[name] = out
        for name in names:
            totals[name]["same"] += replies[name] == replies["AR"]
        print(f"[{i + 1}/{len(prompts)}] {len(replies['AR'])} tokens", file=sys.stderr)
    ar = totals["AR"]
    ar_rate, ar_after = ar["tokens"] / ar["seconds"], ar["after"] / ar["after_seconds"]
    print(f"{loaded.name} ({loaded.weights}), {a.threads} thread(s), {len(prompts)} prompts, one interleaved run")
    print(f"{'setting':24}{'tok/fwd':>9}{'tok/s':>8}{'x AR':>7}{'after 1st':>11}{'x AR':>7}{'same as AR':>12}")
    for name, t in totals.items():
        rate, after = t["tokens"] / t["seconds"], t["after"] / t["after_seconds"]
        print(f"{name:24}{t['tokens'] / t['forwards']:>9.2f}{rate:>8.2f}{rate / ar_rate:>7.3f}{after:>11.2f}"
              f"{after / ar_after:>7.3f}{t['same']:>7}/{len(prompts)}")


if __name__ == "__main__":
    main()
