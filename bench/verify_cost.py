"""What lossless `verify` pays for its drafts on this machine: one forward of the base by rows sent,
and one proposal of the shipped draft head (chain and tree).

    .venv/bin/python bench/verify_cost.py --model default --threads 1

A verify forward writes the last committed token and checks k drafted tokens as k more rows; an AR
step is the same forward with k = 0. Speculative decoding pays when extra rows are nearly free
(a forward bound by reading the weights, as on a GPU); where they are not, each rejected row is
time lost. Timings are medians over interleaved repeats (the order is shuffled so that drift in
machine load is shared), at a context of ~100 tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.train.data import chat  # noqa: E402
from engine.decode import CacheState, run  # noqa: E402
from engine.loading import load  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--quantize", default="fp16")  # verify runs on PyTorch's kernels
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rows", default="0,1,2,3,4,8,16", help="drafted rows per forward to time")
    ap.add_argument("--trees", default="8,16,32", help="draft-tree sizes to time the head's proposal for")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    loaded = load(a.model, max_seq_len=1024, quantize=a.quantize)
    model, tok, head = loaded.model, loaded.tokenizer, loaded.drafter
    prompt = tok.encode_chat(chat("Tell me something interesting about the moon and the tides, please."))
    state = CacheState.new(model, 1024)
    run(model, state, prompt, False, [])
    n = len(state.ids)
    rows = [int(r) for r in a.rows.split(",")]
    times: dict[str, list[float]] = {}
    jobs = [("rows", k) for k in rows]
    if head is not None:
        jobs += [("chain", 4)] + [("tree", t) for t in (int(x) for x in a.trees.split(",") if x)]
    order = jobs * a.repeats
    random.Random(0).shuffle(order)
    for kind, k in order:
        t = time.perf_counter()
        if kind == "rows":
            run(model, state, [prompt[-1]], False, prompt[-k - 1:-1] if k else [], draft_causal=True)
            del state.ids[n:]
        elif kind == "chain":
            head.propose(model.embed_tokens, state.hidden[:n - 1], state.ids, k, 0.0, None)
        else:
            head.propose_tree(model.embed_tokens, state.hidden[:n - 1], state.ids, 4, k)
        times.setdefault(f"{kind} {k}", []).append((time.perf_counter() - t) * 1000)
    ar = statistics.median(times["rows 0"])
    print(f"{loaded.name} ({loaded.weights}), {a.threads} thread(s), context {n} tokens, {a.repeats} repeats each")
    print(f"{'verify forward, drafted rows':32}{'ms p50':>10}{'x AR step':>11}{'ms per row':>12}")
    for k in rows:
        m = statistics.median(times[f"rows {k}"])
        print(f"{k:<32}{m:>10.1f}{m / ar:>11.2f}{(m - ar) / k if k else float('nan'):>12.1f}")
    if head is not None:
        print(f"{'draft head proposal':32}{'ms p50':>10}{'x AR step':>11}")
        for kind, k in jobs:
            if kind != "rows":
                m = statistics.median(times[f"{kind} {k}"])
                label = "chain of 4 (no threshold)" if kind == "chain" else f"tree of {k}, 4 deep"
                print(f"{label:32}{m:>10.1f}{m / ar:>11.2f}")


if __name__ == "__main__":
    main()
