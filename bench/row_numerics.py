"""Does a row's result on llama.cpp depend on the forward it runs in? Logits by rows per forward.

    .venv/bin/python bench/row_numerics.py [--model qwen2.5-1.5b] [--json bench/results/row_numerics.json]

Exact equality of two replies (verify against AR, one load against another) holds only where the
kernels give a row the same sums whatever else its forward holds. Three checks on the voice
default's system prompt (six times over), one conversation at a time:
  1. AR's one-row steps against the same tokens sent as drafted rows (verify) in one forward of k rows;
  2. a prompt prefilled in chunks of c rows against the same prompt in chunks of 32;
  3. the same chunks with another conversation's cells in the shared cache first (where its cells lie).
Prints, per case, whether the logits are bit-equal and the largest difference (in logits).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import machine, write_json  # noqa: E402

QUESTION = "How many legs does a spider have? Tell me about spiders please."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from engine.runtime import CacheState, Forward
    from engine.stream import Engine
    from voice.config import Config
    system = Config().lm.system_prompt
    engine = Engine.load(args.model, quantize="gguf")
    model = engine.model
    # a prompt of ~150 tokens, so that chunks of 64 and more are not the whole prompt
    prompt = engine.prompt_ids([{"role": "system", "content": " ".join([system] * 6)},
                                {"role": "user", "content": QUESTION}])

    def prefill(chunk: int, steps: int = 0, draft: list[int] | None = None):
        """The prompt in forwards of `chunk` rows (the last forward at least 8 rows), then `steps`
        one-row greedy steps or `draft` as one forward of drafted rows: the rows' logits."""
        state, rest, outs = CacheState.new(model, 2048), list(prompt), []
        while len(rest) - chunk >= 8:
            model.step([Forward(state, rest[:chunk])])
            state.ids += rest[:chunk]
            rest = rest[chunk:]
        logits = model.step([Forward(state, rest)])[0][0][-1]
        state.ids += rest
        outs.append(logits)
        if draft is not None:
            return list(model.step([Forward(state, [], draft=draft, draft_causal=True)])[0][0])
        for _ in range(steps):
            token = int(logits.argmax())
            logits = model.step([Forward(state, [token])])[0][0][-1]
            state.ids.append(token)
            outs.append(logits)
        return outs

    def compare(a, b) -> tuple[bool, float]:
        return all(bool((x == y).all()) for x, y in zip(a, b)), max(float((x - y).abs().max()) for x, y in zip(a, b))

    rows: list[dict] = []
    ar = prefill(32, steps=14)
    tokens = [int(x.argmax()) for x in ar[:-1]]
    for k in (1, 2, 3, 4, 5, 7, 8, 12, 14):
        same, diff = compare(prefill(32, draft=tokens[:k]), ar[1:k + 1])
        rows.append({"case": f"AR's one-row steps vs {k} drafted rows in one forward", "equal": same, "max_diff": diff})
    reference = prefill(32, steps=4)
    for chunk in (8, 16, 48, 56, 63, 64, 80, 512):
        same, diff = compare(prefill(chunk, steps=4), reference)
        rows.append({"case": f"prompt in chunks of {chunk} vs chunks of 32", "equal": same, "max_diff": diff})
    other = CacheState.new(model, 2048)  # another conversation's cells, written first
    model.step([Forward(other, prompt[:37])])
    other.ids += prompt[:37]
    for chunk in (32, 63, 64, 512):
        alone = prefill(chunk, steps=4) if chunk != 32 else reference
        del other.ids[37:]
        same, diff = compare(prefill(chunk, steps=4), alone)
        rows.append({"case": f"chunks of {chunk}, another conversation's 37 cells in the cache first",
                     "equal": same, "max_diff": diff})
    from engine.llamacpp import cpu_variant
    print(f"{args.model} on llama.cpp ({cpu_variant()} kernels), prompt {len(prompt)} tokens; {machine()['cpu_model']}")
    for row in rows:
        print(f"  {'equal ' if row['equal'] else 'DIFFER'}  max {row['max_diff']:.3f}  {row['case']}")
    if args.json:
        write_json(args.json, {"machine": machine(), "model": args.model, "prompt_tokens": len(prompt), "rows": rows})


if __name__ == "__main__":
    main()
