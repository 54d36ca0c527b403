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
import sys
from dataclasses import fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.evals.bench import read_prompts, summarize_mode, timed_request  # noqa: E402
from engine.train.data import VOICE_SYSTEM_PROMPT, chat  # noqa: E402
from engine.decode import DecodeConfig  # noqa: E402
from engine.stream import Engine  # noqa: E402


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
    ap.add_argument("--quantize", default="fp16")  # verify runs on PyTorch's kernels
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", default="engine/prompts/heldout.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--policy", action="append", default=[],
                    help="NAME=field=value,... (DecodeConfig fields; verify by default); repeatable")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    engine = Engine.load(a.model, quantize=a.quantize)
    base = DecodeConfig(max_new_tokens=a.max_new_tokens)
    policies = dict([("AR", replace(base, mode="ar"))] + [parse_policy(p, base) for p in a.policy or ["verify="]])
    prompts = read_prompts(Path(a.prompts), 0)
    names = list(policies)
    rows: dict[str, list[dict]] = {name: [] for name in names}
    for name in names:  # warm-up, as `engine bench` does
        timed_request(engine, chat(prompts[0], VOICE_SYSTEM_PROMPT), policies[name])
    for i, prompt in enumerate(prompts):
        messages = chat(prompt, VOICE_SYSTEM_PROMPT)
        for name in names[i % len(names):] + names[:i % len(names)]:
            rows[name].append(timed_request(engine, messages, policies[name]))
        print(f"[{i + 1}/{len(prompts)}] {rows['AR'][-1]['tokens']} tokens", file=sys.stderr)
    summary = {name: summarize_mode(r) for name, r in rows.items()}
    ar = summary["AR"]
    print(f"{engine.name} ({engine.loaded.weights}), {a.threads} thread(s), {len(prompts)} prompts, "
          "one interleaved run")
    print(f"{'setting':24}{'tok/fwd':>9}{'tok/s':>8}{'x AR':>7}{'after 1st':>11}{'x AR':>7}{'same as AR':>12}")
    for name, s in summary.items():
        same = sum(r["token_ids"] == ar_row["token_ids"] for r, ar_row in zip(rows[name], rows["AR"]))
        print(f"{name:24}{s['tokens_per_forward']:>9.2f}{s['tok_s']:>8.2f}{s['tok_s'] / ar['tok_s']:>7.3f}"
              f"{s['decode_tok_s']:>11.2f}{s['decode_tok_s'] / ar['decode_tok_s']:>7.3f}{same:>7}/{len(prompts)}")


if __name__ == "__main__":
    main()
