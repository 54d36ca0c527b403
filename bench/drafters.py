"""Which drafter: the LoRA adapter drafting a mask block vs draft heads, at the same positions.

    .venv/bin/python bench/drafters.py --base small --run runs/draft-smollm2-v2 --json bench/results/drafters.json
    .venv/bin/python bench/drafters.py --base qwen2.5-0.5b --run runs/draft-qwen05 --adapter '' \
        --heads runs/draft-qwen05/drafter.safetensors,runs/chain-qwen05/drafter.safetensors

On the held-out 5% of a draft run's distilled replies (the base model's own greedy replies,
never trained on by the head), at every 4th reply position p: given the reply through p, each
drafter proposes the next `block` tokens in one pass, and greedy `verify` would keep the prefix
that equals the base's reply. Reported: tokens per forward = 1 + mean kept, per drafter.

- adapter (TiDAR-like): the base with the shipped LoRA adapter merged, fed the clean reply
  before p, then [t_p, mask, mask, mask] as one block (exactly what its decoder sees). At
  inference it costs a forward of the whole adapted model per draft.
- head (DFlash/EAGLE-like): a trained draft head on the base's hidden states (a small
  fraction of a forward); `--heads` compares several (a parallel and a chained one) on the
  held-out replies of `--run`, which none of them may have trained on.
- lookup: prompt lookup, for reference.

Each head's *decoded* figure follows: the held-out replies walked as greedy `verify` decodes
them, at the decoder's draft threshold (`engine.train.draft.held_out_figures`), which is what
`engine bench` measures on such replies; the every-`block`-positions figure above overstates it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.evals.bench import write_json  # noqa: E402
from engine.draft import LookupDrafter, load_head  # noqa: E402
from engine.loading import DEFAULT_ADAPTER, load  # noqa: E402
from engine.decode import DecodeConfig  # noqa: E402
from engine.train.draft import held_out_figures, read_corpus, split  # noqa: E402


@torch.inference_mode()
def adapter_kept(adapted, seq: list[int], prompt_len: int, block: int) -> list[int]:
    """Kept draft tokens at p = prompt_len, prompt_len + block, ... from one packed forward."""
    mask_id = adapted.spec.mask_id
    n = len(seq)
    starts = list(range(prompt_len, n - 1, block))
    tokens, positions, owner = list(seq), list(range(n)), []
    for s in starts:
        width = min(block, n - s)
        tokens += [seq[s]] + [mask_id] * (width - 1)
        positions += list(range(s, s + width))
        owner += [s] * width
    total = len(tokens)
    visible = torch.zeros(total, total, dtype=torch.bool)
    visible[:n, :n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    own = torch.tensor(owner)
    visible[n:, :n] = torch.arange(n)[None, :] < own[:, None]
    visible[n:, n:] = own[:, None] == own[None, :]
    model = adapted.model
    logits = model(torch.tensor([tokens]), torch.tensor(positions), visible)[0, n:]
    logits[:, mask_id] = float("-inf")
    guesses = logits.argmax(-1).tolist()
    kept, row = [], 0
    for s in starts:
        width = min(block, n - s)
        k = 0
        while k < width and s + k + 1 < n and guesses[row + k] == seq[s + k + 1]:
            k += 1
        kept.append(k)
        row += width
    return kept


@torch.inference_mode()
def head_kept(head, embed, corpus, e: int, block: int) -> list[int]:
    s0, p_len, n = corpus.starts[e], corpus.train_from[e], corpus.lengths[e]
    seq = corpus.ids[s0:s0 + n].tolist()
    hidden = corpus.hidden[s0:s0 + n].float()
    kept = []
    for p in range(p_len, n - 1, block):
        proposal = head.propose(embed, hidden[:p], seq[:p + 1], block, 0.0, None).ids
        k = 0
        while k < len(proposal) and p + k + 1 < n and proposal[k] == seq[p + k + 1]:
            k += 1
        kept.append(k)
    return kept


def lookup_kept(seq: list[int], p_len: int, block: int) -> list[int]:
    kept = []
    for p in range(p_len, len(seq) - 1, block):
        proposal = LookupDrafter().propose(None, None, seq[:p + 1], block, 0.0, None).ids
        k = 0
        while k < len(proposal) and p + k + 1 < len(seq) and proposal[k] == seq[p + k + 1]:
            k += 1
        kept.append(k)
    return kept


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="small", help="the model the heads draft for (a --model value)")
    p.add_argument("--run", default="runs/draft-smollm2-v2", help="the `engine draft` run folder (held-out replies)")
    p.add_argument("--heads", default="", help="comma-separated head files (default: the run's drafter)")
    p.add_argument("--adapter", default=str(DEFAULT_ADAPTER), help="the mask-denoising adapter ('' to skip; "
                                                                   "SmolLM2's only)")
    p.add_argument("--limit", type=int, default=0, help="held-out replies to use (0: all)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    run = Path(a.run)
    base = load(a.base, adapter="", drafter="")
    adapted = load(a.base, adapter=a.adapter, drafter="") if a.adapter else None
    paths = a.heads.split(",") if a.heads else [str(run / "drafter.safetensors")]
    heads = {("head" if len(paths) == 1 else f"head {Path(h).parent.name}/{Path(h).name}"):
             load_head(h, base.model.args.dim, base.model.args.vocab_size) for h in paths}
    first = next(iter(heads.values()))
    block = first.args.block
    if any((h.args.block, h.args.window) != (block, first.args.window) for h in heads.values()):
        raise SystemExit("--heads must draft the same block from the same window to be compared")
    corpus = read_corpus(base, run / "distilled.jsonl", first.args.window)
    held, _ = split(corpus, 0)
    held = held[:a.limit] if a.limit else held
    kept = {**({"adapter": []} if adapted else {}), **{name: [] for name in heads}, "lookup": []}
    for i, e in enumerate(held, 1):
        s0, p_len, n = corpus.starts[e], corpus.train_from[e], corpus.lengths[e]
        seq = corpus.ids[s0:s0 + n].tolist()
        if adapted:
            kept["adapter"] += adapter_kept(adapted, seq, p_len, block)
        for name, head in heads.items():
            kept[name] += head_kept(head, base.model.embed_tokens, corpus, e, block)
        kept["lookup"] += lookup_kept(seq, p_len, block)
        if i % 25 == 0 or i == len(held):
            print(f"[{i}/{len(held)}] " + "  ".join(f"{k} {1 + sum(v) / len(v):.3f}" for k, v in kept.items()),
                  flush=True)
    result = {name: {"positions": len(v), "tokens_per_forward": 1 + sum(v) / len(v),
                     "kept_histogram": [v.count(k) for k in range(block + 1)]} for name, v in kept.items()}
    print("tokens per forward (teacher-forced, greedy, held-out replies): " +
          ", ".join(f"{k} {r['tokens_per_forward']:.3f}" for k, r in result.items()))
    threshold = DecodeConfig.draft_threshold
    for name, head in heads.items():
        result[name]["decoded_tokens_per_forward"] = held_out_figures(head, corpus, held, base.model.embed_tokens,
                                                                      threshold)[1]
    print(f"decoded tokens per forward (greedy verify, draft threshold {threshold:g}): " +
          ", ".join(f"{k} {result[k]['decoded_tokens_per_forward']:.3f}" for k in heads))
    write_json(Path(a.json) if a.json else None, {"run": str(run), "held_out_replies": len(held), "block": block,
                                                  "results": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
