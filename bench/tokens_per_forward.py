"""Tokens per forward of greedy `verify` decoding with a given draft head, at several draft thresholds.

    .venv/bin/python bench/tokens_per_forward.py --drafter runs/draft-qwen05-v2/shipped-fp16.safetensors --limit 12

Real decoding (not teacher-forced) of the first `--limit` held-out prompts through the engine:
a quick check of a freshly trained head before the full `engine bench`. Counts are pooled over
the prompts (all tokens / all forwards, prefill included).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.bench import read_prompts  # noqa: E402
from engine.data import chat  # noqa: E402
from engine.decode import DecodeConfig  # noqa: E402
from engine.stream import Conversation, Engine  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--drafter", default=None, help="a head file (default: the model's shipped head)")
    p.add_argument("--prompts", default="engine/prompts/heldout.jsonl")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--quantize", default="fp16")
    p.add_argument("--thresholds", default="0.5,0", help="draft_threshold values to try")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    engine = Engine.load(a.model, quantize=a.quantize, drafter=a.drafter)
    prompts = read_prompts(Path(a.prompts), a.limit)
    for threshold in (float(t) for t in a.thresholds.split(",")):
        tokens = forwards = 0
        for prompt in prompts:
            cfg = DecodeConfig(max_new_tokens=48, draft_threshold=threshold)
            last = list(engine.generate_sync(chat(prompt), cfg, Conversation()))[-1]
            tokens, forwards = tokens + last.tokens, forwards + last.forwards
        print(f"draft_threshold {threshold:g}: {tokens} tokens in {forwards} forwards = {tokens / forwards:.2f} "
              f"tokens/forward ({len(prompts)} prompts)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
