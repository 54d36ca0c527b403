"""What reading several of the base's layers costs in the forward that verifies: ggml's eval
callback (`engine.llamacpp.LayerTap`, `cb_eval`) on `l_out-N`, against the same step without it.

    .venv/bin/python bench/layer_taps.py --model qwen2.5-1.5b --layers 6,14,27 --threads 2

Two `LlamaCppModel`s of the same GGUF (one context each: the callback is a context parameter), one
with the tap, one without; a step of 1 row (AR) and of 1 + k rows (verify of a drafted block) after
a prompt, timed alternately on each so machine load falls on both alike. Medians in ms, and the
tapped / plain ratio. `--json` keeps it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "Tell me something interesting about the moon and the tides, in words a child would follow."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--layers", default="6,14,27", help="the base layers read (l_out-N)")
    p.add_argument("--rows", default="1,5", help="rows per step (1 = AR; 1 + k = verify of k drafted)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="")
    a = p.parse_args()
    import torch

    from engine.decode import CacheState, Forward, run_many
    from engine.loading import gguf_path, gguf_tokenizer
    from engine.llamacpp import LlamaCppModel, cpu_variant
    from engine.train.data import chat
    torch.set_num_threads(a.threads)
    path = gguf_path(a.model)
    layers = tuple(int(x) for x in a.layers.split(","))
    models = {"plain": LlamaCppModel(path, 512), "tapped": LlamaCppModel(path, 512, layers=layers)}
    models["tapped"].read_states(16)
    prompt = gguf_tokenizer(path).encode_chat(chat(PROMPT))
    times: dict[str, dict[int, list[float]]] = {name: {int(r): [] for r in a.rows.split(",")} for name in models}
    states = {name: CacheState.new(m, 512) for name, m in models.items()}
    for name, m in models.items():
        run_many(m, [Forward(states[name], prompt)])
    for _ in range(a.repeats):
        for rows in times["plain"]:
            for name, m in models.items():
                state = states[name]
                start = time.perf_counter()
                _, hidden = m.step([Forward(state, [prompt[-1]], draft=prompt[-rows:-1], draft_causal=True)])[0]
                times[name][rows].append((time.perf_counter() - start) * 1000)
                if name == "tapped":
                    assert hidden is not None and hidden.shape == (rows, len(layers) * m.args.dim), hidden
    result = {"model": a.model, "cpu_variant": cpu_variant(), "threads": a.threads, "layers": layers,
              "loadavg": os.getloadavg(), "ms": {name: {r: statistics.median(v) for r, v in t.items()}
                                                  for name, t in times.items()}}
    print(f"{a.model} on {cpu_variant()}, {a.threads} threads, layers {layers}, medians of {a.repeats} "
          f"(load {result['loadavg'][0]:.1f})")
    for rows in times["plain"]:
        plain, tapped = result["ms"]["plain"][rows], result["ms"]["tapped"][rows]
        print(f"{rows} row(s): plain {plain:.1f} ms, tapped {tapped:.1f} ms ({tapped / plain:.3f}x, "
              f"+{tapped - plain:.1f} ms)")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
