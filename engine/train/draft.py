"""`engine draft`: train a draft head on the frozen base model's own greedy replies.

1. Distil: the base answers chitchat turns and templated assistant questions greedily
   (`engine.train.data.distill`); deterministic targets are what a parallel drafter can learn.
2. Read: one causal forward of the base over each prompt + reply gives its last hidden state
   at every position; nothing else of the base is ever run, so a CPU hour covers many more
   tokens than training through the model would.
3. Train: at each reply position p (the token the base just committed), the head sees the
   hidden states of the `window` positions before p, each with the token after it, and learns
   the base's next `block` tokens. Earlier offsets weigh more: a draft is accepted left to right.
   A chained head's row j also reads the true token before it (teacher forcing): greedy verify
   keeps row j only when rows 0..j-1 were right, i.e. exactly when its drafted inputs were true.

Checkpoints to `--out` and resumes from it, on CPU or CUDA. Two held-out figures: the
teacher-forced mean (1 + tokens kept, over every reply position) and the one that predicts
decoding, `decoded` tokens per forward: each held-out reply walked as greedy `verify` decodes it,
visiting only the positions decoding reaches, with the rows the decoder would send. The mean
over every position overstates decoding (2.33 vs 1.68 on `default`): an easy stretch is crossed
in few forwards, a hard one costs a forward per token, so decoding spends most forwards on the
hard positions.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable
from typing import cast
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.train.data import chat
from engine.draft import DraftArgs, DraftHead, load_head, read_head_info, save_head
from engine.loading import LoadedModel
from engine.decode import CacheState, DecodeConfig, Forward, ar_batch, run
from engine.model import Transformer

# (hidden, embedded next tokens, valid, targets, embedded previous tokens or None, the base's top-K
# next tokens as draft-vocabulary rows (-100: none) and their probabilities, or None): one training batch
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
              torch.Tensor | None, torch.Tensor | None]

OFFSET_WEIGHTS = (1.0, 0.8, 0.6, 0.4, 0.3, 0.2, 0.2, 0.2)


@dataclass
class DraftTrainConfig:
    block: int = 4
    window: int = 16
    n_layers: int = 2
    draft_vocab: int = 8192
    chain: bool = False  # see engine.draft (more tokens per forward, a head pass per drafted token; default's head)
    batch: int = 256
    lr: float = 2e-3
    warmup_steps: int = 50
    max_steps: int = 1500
    max_minutes: float = 0.0
    eval_every: int = 250
    seed: int = 0
    layers: tuple[int, ...] = ()  # the base layers a head reads (states "layers"); () = the one state
    dropout: float = 0.0
    width: int = 0  # the head's own width (0: the base's)
    weight_decay: float = 0.01
    distill_weight: float = 0.0  # share of the loss from the base's top-K distribution (HASS), the rest greedy CE
    patience: int = 0  # stop after this many evaluations without a better decoded held-out figure (0: never)
    init: str = ""  # a head file to go on training (its weights and vocabulary; the LR schedule starts again)


@dataclass
class Corpus:
    """Every example's ids, the base's hidden states and its greedy next token at each position,
    padded in front by `window` zero rows."""

    ids: torch.Tensor  # [N] all examples' tokens, each example preceded by `window` pad ids (0)
    hidden: torch.Tensor  # [N, dim] fp16, zero rows in front of each example
    targets: torch.Tensor  # [N] the base's greedy token after each position; -1 where not known
    starts: list[int]  # where each example's own tokens begin in `ids`
    train_from: list[int]  # the example's first position a head learns to draft after
    lengths: list[int]
    distilled: list[bool]  # the base's own reply (held-out figures come from these only)
    top_ids: torch.Tensor | None = None  # [N, K] the base's K likeliest tokens after each position (-1: unknown)
    top_probs: torch.Tensor | None = None  # [N, K] their probabilities

    def positions(self, examples: list[int]) -> torch.Tensor:
        """Global indices of every training position p of `examples` that has a target after it."""
        out = []
        for e in examples:
            s, n = self.starts[e], self.lengths[e]
            out.append(torch.arange(s + self.train_from[e], s + n - 1))
        pos = torch.cat(out)
        return pos[self.targets[pos] >= 0]

    @staticmethod
    def join(parts: list["Corpus"]) -> "Corpus":
        offsets = [sum(len(c.ids) for c in parts[:i]) for i in range(len(parts))]
        tops = all(c.top_ids is not None for c in parts)
        return Corpus(torch.cat([c.ids for c in parts]), torch.cat([c.hidden for c in parts]),
                      torch.cat([c.targets for c in parts]),
                      [o + s for c, o in zip(parts, offsets) for s in c.starts],
                      [t for c in parts for t in c.train_from], [n for c in parts for n in c.lengths],
                      [d for c in parts for d in c.distilled],
                      torch.cat([cast(torch.Tensor, c.top_ids) for c in parts]) if tops else None,
                      torch.cat([cast(torch.Tensor, c.top_probs) for c in parts]) if tops else None)


SHARD = 500  # replies per saved shard of hidden states


@torch.inference_mode()
def read_corpus(base: LoadedModel, path: Path, window: int, greedy: bool = False,
                log: Callable[[str], object] = print) -> Corpus:
    """Run the base over every reply in `path` (JSONL of prompt + reply_ids). `greedy=False`: the
    replies are the base's own greedy ones (`distill`), so each reply token is the target after the
    one before it. `greedy=True`: any text (people's replies): the base's argmax at every position
    from the user's message on is computed and becomes the target, so a head learns what the base
    would say next after text it did not write, for the cost of one forward and no generation.
    Shards are saved beside `path` so an interrupted or repeated run only reads what is new."""
    rows = [json.loads(line) for line in path.open()]
    prefix = "" if path.stem == "distilled" else f"{path.stem}-"
    shards = []
    t0, done = time.perf_counter(), 0
    for first in range(0, len(rows), SHARD):
        part = rows[first:first + SHARD]
        shard_path = path.parent / f"{prefix}hidden-{first:06d}.pt"
        if shard_path.exists() and (saved := torch.load(shard_path, weights_only=True))["n"] == len(part):
            shards.append(saved)
            continue
        shard = _read_rows(base, part, window, greedy)
        torch.save(shard, shard_path)  # a short last shard too: `n` tells a later, longer file to redo it
        shards.append(shard)
        done += len(part)
        log(f"read {first + len(part)}/{len(rows)} of {path.name} through the base "
            f"({done / (time.perf_counter() - t0):.1f}/s)")
    eos_ids = base.tokenizer.eos_ids
    parts = []
    for first, shard in zip(range(0, len(rows), SHARD), shards):
        ids, starts = shard["ids"], shard["starts"].tolist()
        lengths, prompt_lens = shard["lengths"].tolist(), shard["prompt_lens"].tolist()
        if "targets" in shard:
            targets, train_from = shard["targets"].long(), shard["train_from"].tolist()
        else:  # distilled: the base's greedy token after position i is the reply's token i + 1
            targets = torch.full_like(ids, -1)
            for i, (s, p_len, n) in enumerate(zip(starts, prompt_lens, lengths)):
                targets[s + p_len - 1:s + n - 1] = ids[s + p_len:s + n]
                reply = rows[first + i]["reply_ids"]
                if not reply or reply[-1] not in eos_ids:  # cut off at the token limit: the base would go on
                    targets[s + n - 2] = -1
            train_from = prompt_lens
        parts.append(Corpus(ids, shard["hidden"], targets, starts, train_from, lengths, [not greedy] * len(starts)))
    return Corpus.join(parts)


def _read_rows(base: LoadedModel, rows: list[dict], window: int, greedy: bool) -> dict:
    """Causal forwards through a KV cache: the prefix every example shares (the system prompt) is
    computed once, each example adds only its own tokens; `CacheState.hidden` keeps every row's state."""
    tok, model = base.tokenizer, base.model
    assert isinstance(model, Transformer)  # the head reads PyTorch's hidden states
    eos = tok.turn_end_id
    state = CacheState.new(model, 1024)
    ids, hidden, targets, starts, prompt_lens, train_from, lengths, offset = [], [], [], [], [], [], [], 0
    for row in rows:
        prompt = tok.encode_chat(chat(row["prompt"]))
        reply = [t for t in row["reply_ids"] if t not in tok.eos_ids] + [eos]
        seq = prompt + reply
        new = state.reuse_for(seq + [eos])  # the extra token keeps all of seq new-or-cached
        shared = len(seq) + 1 - len(new)  # the system prompt, after the first example
        run(model, state, new, False, [])
        assert state.hidden is not None
        h = state.hidden[:len(seq)].float()
        if greedy:
            best = model.lm_head(model.norm(h[shared:].to(model.lm_head.weight.dtype))).argmax(-1).cpu()
            best[-1] = -1  # nothing is drafted after the turn's end
            targets.append(torch.cat([torch.full((window + shared,), -1), best]))
            train_from.append(shared)
        ids += [0] * window + seq
        hidden += [torch.zeros(window, h.shape[-1], dtype=torch.float16), h.cpu().half()]
        starts.append(offset + window)
        prompt_lens.append(len(prompt))
        lengths.append(len(seq))
        offset += window + len(seq)
    shard = {"n": len(rows), "ids": torch.tensor(ids), "hidden": torch.cat(hidden), "starts": torch.tensor(starts),
             "prompt_lens": torch.tensor(prompt_lens), "lengths": torch.tensor(lengths)}
    if greedy:
        shard |= {"targets": torch.cat(targets).int(), "train_from": torch.tensor(train_from)}
    return shard


@torch.inference_mode()
def distill_states(base: LoadedModel, prompts: list[str], path: Path, window: int, max_new_tokens: int = 48,
                   batch_size: int = 32, log: Callable[[str], object] = print) -> None:
    """Distil and read in one pass, for a base on llama.cpp's kernels (`quantize="gguf"`): its greedy
    replies to `prompts` (appended to `path`, as `engine.train.data.distill` writes them) and, from
    the same forwards, the hidden states a head reads (ggml's, after the final norm:
    `LlamaCppModel.read_states`), saved in `read_corpus`'s shards. Reading them again would cost a
    prefill of every example; here they come with the generation. An example keeps the last
    `window` prompt positions (all a head reads before the reply). Resumes by whole shards."""
    from engine.llamacpp import LlamaCppModel
    model, tok = base.model, base.tokenizer
    assert isinstance(model, LlamaCppModel)
    model.read_states(1 << 20)  # every row's state
    lines = path.open().readlines() if path.exists() else []
    done = len(prompts) if len(lines) >= len(prompts) else len(lines) // SHARD * SHARD
    if len(lines) > done:  # drop a partial shard's replies: its states were not saved
        path.write_text("".join(lines[:done]))
    t0 = time.perf_counter()
    for first in range(done, len(prompts), SHARD):
        part, rows = prompts[first:first + SHARD], list[dict]()
        ids: list[int] = []
        hidden, starts, prompt_lens, lengths = [], [], [], []
        for i in range(0, len(part), batch_size):
            batch = [tok.encode_chat(chat(p)) for p in part[i:i + batch_size]]
            replies, caches = ar_batch(model, batch, max_new_tokens, tok.eos_ids)
            for prompt, reply, cache in zip(batch, replies, caches):
                states = cast(torch.Tensor, cache.hidden)[:len(cache.ids)]  # read_states keeps them
                keep = prompt[-window:]
                seq = keep + [t for t in reply if t not in tok.eos_ids] + [tok.turn_end_id]
                h = states[len(prompt) - len(keep):len(prompt) - len(keep) + len(seq)]
                starts.append(len(ids) + window)
                ids += [0] * window + seq
                hidden += [torch.zeros(window, h.shape[-1], dtype=torch.float16),
                           torch.cat([h, h.new_zeros(len(seq) - len(h), h.shape[-1])])]
                prompt_lens.append(len(keep))
                lengths.append(len(seq))
                rows.append({"prompt": part[len(rows)], "reply_ids": reply, "reply": tok.decode(reply)})
            n = first + len(rows)
            rate = (n - done) / (time.perf_counter() - t0)
            log(f"distil {n}/{len(prompts)}  {rate:.1f} replies/s  eta {(len(prompts) - n) / rate / 60:.1f} min")
        torch.save({"n": len(part), "ids": torch.tensor(ids), "hidden": torch.cat(hidden),
                    "starts": torch.tensor(starts), "prompt_lens": torch.tensor(prompt_lens),
                    "lengths": torch.tensor(lengths)}, path.parent / f"hidden-{first:06d}.pt")
        with path.open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    model.read_states(0)


TOP_K = 8  # the base's likeliest next tokens kept per position for distillation (HASS)


@torch.inference_mode()
def read_shards(base: LoadedModel, folder: Path, window: int, limit: int = 0, batch: int = 8,
                cache: Path | None = None, skip: int = 0, log: Callable[[str], object] = print) -> Corpus:
    """The replies of `engine distill`'s shards in `folder` (the first `limit` after the whole shards
    that hold the first `skip`; 0: all) read back
    through the base on llama.cpp's kernels, each prompt + reply in one forward with the reply as
    drafted rows, as verify runs it: the tapped layers' states (`LlamaCppModel(layers=...)`) of the
    last `window` prompt rows and of every reply row, and the base's top-K next tokens after each
    reply position. None of it is committed: one prefill gives it back. `cache`: a folder (of the
    run, not the data) where each shard's read-back is kept, so a stopped run (hours for 15k replies
    on two cores) goes on where it stopped and a second head on the same layers reads nothing.
    `skip` is how a head goes on learning from the shards after those it was trained on (`init`):
    the cache is the run's, and a sitting reads ~12k replies back on two cores."""
    from engine.llamacpp import LlamaCppModel
    from engine.train.distill import read_shard, shard_paths
    model = base.model
    assert isinstance(model, LlamaCppModel)
    tag = f"l{'-'.join(map(str, model.layers))}-w{window}"
    parts: list[Corpus] = []
    total, t0, read = 0, time.perf_counter(), 0
    model.read_states(window)
    skipped = 0
    for path in shard_paths(folder):
        if skipped < skip:
            skipped += len(read_shard(path))
            continue
        rows = read_shard(path)[:limit - total if limit else None]
        if not rows:
            break
        total += len(rows)
        kept = cache / f"{path.name.split('.')[0]}-{tag}.pt" if cache else None
        if kept and kept.exists() and (saved := torch.load(kept, weights_only=True))["n"] == len(rows):
            parts.append(Corpus(**saved["corpus"]))
            continue
        part = _read_back(base, rows, window, batch)
        if kept:
            kept.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"n": len(rows), "corpus": asdict(part)}, kept.with_suffix(".part"))
            kept.with_suffix(".part").rename(kept)  # whole or absent
        parts.append(part)
        read += len(rows)
        log(f"read {total} replies ({path.name}) through the base ({read / (time.perf_counter() - t0):.2f}/s)")
    model.read_states(0)
    return Corpus.join(parts)


def conversation_chains(rows: list[dict]) -> list[list[dict]]:
    """`rows` as chains of one conversation's turns, each turn's prompt beginning with the turn
    before's prompt and reply (the model's own reply in the history): one forward over the last
    turn computes every earlier turn's rows too (causal attention), so a chain costs its longest
    sequence instead of the sum of its turns' (1.44x fewer rows on the 1.5B's shards)."""
    by_key: dict[str, list[dict]] = {}
    for row in rows:
        by_key.setdefault(row["key"], []).append(row)
    chains: list[list[dict]] = []
    for turns in by_key.values():
        chain: list[dict] = []
        for row in sorted(turns, key=lambda r: r["turn"]):
            if chain and row["tools"] == chain[-1]["tools"] and \
                    row["prompt_ids"][:len(sequence(chain[-1]))] == sequence(chain[-1]):
                chain.append(row)
            else:
                chain = [row]
                chains.append(chain)
    return chains


def sequence(row: dict) -> list[int]:
    return row["prompt_ids"] + row["reply_ids"]


def _read_back(base: LoadedModel, rows: list[dict], window: int, batch: int) -> Corpus:
    """`read_shards` of one shard's rows: the rows offered the same tools share their prompt's
    prefix (the system prompt, the tools' schema), cached once and forked into `batch` states; a
    conversation's turns are read in one forward (`conversation_chains`), everything after the
    first turn's prompt as drafted rows, which give their states and logits."""
    from engine.llamacpp import LlamaCppModel
    model = base.model
    assert isinstance(model, LlamaCppModel)
    eos_ids, dim = base.tokenizer.eos_ids, model.state_dim
    groups: dict[str, list[list[dict]]] = {}
    for chain in conversation_chains(rows):
        groups.setdefault(json.dumps(chain[0]["tools"]), []).append(chain)
    ids: list[int] = []
    hidden, tops, probs, starts, prompt_lens, lengths, ends_cut = [], [], [], [], [], [], []

    def zeros(n: int, width: int, fill: int = 0, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return torch.full((n, width), fill, dtype=dtype)

    root = CacheState.new(model, 2048)
    states = [CacheState.new(model, 2048) for _ in range(batch)]
    for group in groups.values():
        shared = list(os.path.commonprefix([c[0]["prompt_ids"] for c in group]))[:-1]
        root.clear()
        run(model, root, shared, False, [])
        for state in states:
            root.fork(model, into=state)  # their ids stay `shared`: each forward is scratch
        for first in range(0, len(group), batch):
            part = group[first:first + batch]
            forwards = [Forward(state, c[0]["prompt_ids"][len(shared):],
                                draft=sequence(c[-1])[len(c[0]["prompt_ids"]):], draft_causal=True)
                        for state, c in zip(states, part)]
            for f, chain, (logits, h) in zip(forwards, part, model.step(forwards)):
                assert h is not None  # read_states asked for them
                # h: the last `window` clean rows' states (zeros before them) and every drafted row's;
                # logits: after the last clean row and after each drafted row
                full, stated_from = shared + f.clean + f.draft, len(shared)
                logits_from = len(shared) + len(f.clean) - 1
                for row in chain:
                    end, reply = len(row["prompt_ids"]), row["reply_ids"]
                    keep_from = max(0, end - window)
                    keep = full[keep_from:end]
                    cut = reply[-1] not in eos_ids  # stopped at the token limit: the base would have gone on
                    seq = keep + reply + ([base.tokenizer.turn_end_id] if cut else [])
                    starts.append(len(ids) + window)
                    ids += [0] * window + seq
                    lo = max(keep_from, stated_from)
                    hidden += [zeros(window + lo - keep_from, dim),
                               h[lo - stated_from:end + len(reply) - stated_from].half(),
                               zeros(len(seq) - len(keep) - len(reply), dim)]
                    # the base's top-K after the last prompt token and after each reply token but the last
                    p, top = logits[end - 1 - logits_from:end - 1 - logits_from + len(reply)].float().softmax(-1) \
                        .topk(TOP_K, -1)
                    rest = len(seq) - (len(keep) - 1) - len(reply)
                    tops += [zeros(window + len(keep) - 1, TOP_K, -1, torch.int32), top.int(),
                             zeros(rest, TOP_K, -1, torch.int32)]
                    probs += [zeros(window + len(keep) - 1, TOP_K), p.half(), zeros(rest, TOP_K)]
                    prompt_lens.append(len(keep))
                    lengths.append(len(seq))
                    ends_cut.append(cut)
    ids_t = torch.tensor(ids)
    targets = torch.full_like(ids_t, -1)
    for s0, p_len, n, cut in zip(starts, prompt_lens, lengths, ends_cut):
        targets[s0 + p_len - 1:s0 + n - 1] = ids_t[s0 + p_len:s0 + n]
        if cut:  # the end-of-turn appended to a cut-off reply is no target
            targets[s0 + n - 2] = -1
    return Corpus(ids_t, torch.cat(hidden), targets, starts, prompt_lens, lengths, [True] * len(starts),
                  torch.cat(tops), torch.cat(probs))


def draft_vocabulary(corpus: Corpus, positions: torch.Tensor, size: int, eos_ids: set[int]) -> torch.Tensor:
    """The `size` tokens the base most often says next at `positions` (EOS always in): all a head ever
    needs to propose."""
    counts = torch.bincount(corpus.targets[positions])
    top = counts.argsort(descending=True)[:size]
    return torch.tensor(sorted(set(top[counts[top] > 0].tolist()) | set(eos_ids)))


def batch_at(corpus: Corpus, positions: torch.Tensor, embed: nn.Embedding, to_draft: torch.Tensor,
             cfg: DraftTrainConfig, device: str) -> Batch:
    """Inputs and targets for bonus positions `positions` (global indices into the corpus)."""
    w, k = cfg.window, cfg.block
    ctx = positions[:, None] - w + torch.arange(w)[None]  # positions p-w .. p-1
    hidden = corpus.hidden[ctx].float()
    nxt = corpus.ids[ctx + 1]
    valid = corpus.ids.new_ones(ctx.shape, dtype=torch.bool) & (hidden.abs().sum(-1) > 0)
    # row j drafts the base's token after position p + j (past an example's end: the next one's
    # padding or the corpus's last token, whose targets are -1)
    row_pos = (positions[:, None] + torch.arange(k)[None]).clamp(max=len(corpus.ids) - 1)
    wanted = corpus.targets[row_pos]
    targets = torch.where(wanted >= 0, to_draft[wanted.clamp(min=0)], -100)
    with torch.no_grad():
        emb = embed(nxt.to(embed.weight.device)).float()
        # chained: row j reads the true token before it (positions p .. p+k-1)
        prev = embed(corpus.ids[row_pos].to(embed.weight.device)).float() if cfg.chain else None
    top = probs = None
    if corpus.top_ids is not None and corpus.top_probs is not None:
        ids = corpus.top_ids[row_pos].long()
        top = torch.where(ids >= 0, to_draft[ids.clamp(min=0)], -100).to(device)
        probs = corpus.top_probs[row_pos].float().to(device)
    return (hidden.to(device), emb.to(device), valid.to(device), targets.to(device),
            prev.to(device) if prev is not None else None, top, probs)


def loss_and_accepted(head: DraftHead, batch: Batch, weights: torch.Tensor, distill_weight: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The offset-weighted loss: cross-entropy on the base's greedy token, mixed with `distill_weight`
    of cross-entropy on its top-K distribution (HASS; the mass outside the head's vocabulary dropped),
    which says how sure the base was and what else it weighed, not only what it said."""
    hidden, emb, valid, targets, prev, top, probs = batch
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16):  # ~1.5x faster on AVX-512 BF16 CPUs too
        logits = head(hidden, emb, valid, prev).float()
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    ce = ce.view(targets.shape)
    if distill_weight and top is not None and probs is not None:
        known = (top != -100).float() * probs
        soft = -(known * logits.log_softmax(-1).gather(-1, top.clamp(min=0))).sum(-1) / known.sum(-1).clamp(min=1e-6)
        ce = (1 - distill_weight) * ce + distill_weight * soft
    mask = (targets != -100).float()
    loss = (ce * mask * weights).sum() / (mask * weights).sum()
    return loss, kept(logits, targets)


def kept(logits: torch.Tensor, targets: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """Drafted tokens greedy verify keeps at each position [B]: the agreeing prefix of the rows sent
    (the decoder sends the longest prefix whose confidences multiply to at least `threshold`)."""
    confidence, best = logits.softmax(-1).max(-1)
    hits = (best == targets) & (targets != -100) & (confidence.cumprod(-1) >= threshold)
    return hits.int().cumprod(-1).sum(-1)


def draft_index(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Base token id -> the head's row for it (-100: a token the head cannot propose)."""
    to_draft = torch.full((vocab_size,), -100, dtype=torch.long)
    to_draft[vocab] = torch.arange(len(vocab))
    return to_draft


@torch.no_grad()
def held_out_figures(head: DraftHead, corpus: Corpus, examples: list[int], embed: nn.Embedding,
                     threshold: float, device: str = "cpu") -> tuple[float, float]:
    """(teacher-forced, decoded) tokens per forward on `examples` (the base's own replies), the head in
    fp32 as the decoder runs it; `threshold` is the decoder's draft threshold."""
    a = head.args
    cfg = DraftTrainConfig(block=a.block, window=a.window, chain=a.chain, layers=a.layers)
    to_draft = draft_index(head.vocab_ids.cpu(), a.vocab_size)
    positions = corpus.positions(examples)
    every = 0
    kept_at: dict[int, int] = {}
    for i in range(0, len(positions), 1024):
        pos = positions[i:i + 1024]
        hidden, emb, valid, targets, prev, _, _ = batch_at(corpus, pos, embed, to_draft, cfg, device)
        logits = head(hidden, emb, valid, prev).float()
        every += int(kept(logits, targets).sum())
        kept_at.update(zip(pos.tolist(), kept(logits, targets, threshold).tolist()))
    walks = [decode_walk(corpus, e, kept_at) for e in examples]
    return 1 + every / len(positions), sum(t for t, _ in walks) / sum(f for _, f in walks)


def decode_walk(corpus: Corpus, example: int, kept_at: dict[int, int]) -> tuple[int, int]:
    """(reply tokens, forwards) of greedy `verify` decoding of one of the base's own replies, given the
    tokens kept when drafting after each position: the prefill commits the first reply token, then
    each forward drafts after the last committed token and commits what is kept plus the base's own
    next token, stopping at the reply's end (its EOS, or its last token when cut off at the limit)."""
    s, n, first = corpus.starts[example], corpus.lengths[example], corpus.train_from[example]
    last = s + n - 1 if corpus.targets[s + n - 2] >= 0 else s + n - 2
    p, forwards = s + first, 1
    while p < last:
        p += min(kept_at.get(p, 0), last - p - 1) + 1
        forwards += 1
    return last - (s + first) + 1, forwards


def split(corpus: Corpus, seed: int) -> tuple[list[int], list[int]]:
    """(held-out, training) example indices: 5% of the base's own replies never trained on (the
    figure that predicts decoding); every other example trains."""
    examples = [e for e, own in enumerate(corpus.distilled) if own]
    random.Random(seed).shuffle(examples)
    n_held = max(1, len(examples) // 20)
    others = [e for e, own in enumerate(corpus.distilled) if not own]
    return examples[:n_held], examples[n_held:] + others


def base_tables(base: LoadedModel) -> tuple[nn.Embedding, torch.Tensor, str]:
    """(token embedding, LM head weight, `DraftArgs.states`) of the base a head is trained for:
    PyTorch's model, or a GGUF on llama.cpp's kernels (tables dequantised from the file)."""
    if isinstance(base.model, Transformer):
        return base.model.embed_tokens, base.model.lm_head.weight, "last"
    from engine.loading import gguf_path, gguf_token_table, ModelLoadError
    path = gguf_path(base.name)
    table = torch.from_numpy(np.asarray(gguf_token_table(path), dtype=np.float32))
    try:
        lm_head = torch.from_numpy(np.asarray(gguf_token_table(path, "output.weight"), dtype=np.float32))
    except ModelLoadError:  # tied embeddings
        lm_head = table
    return nn.Embedding.from_pretrained(table), lm_head, "normed"


def train(base: LoadedModel, corpus: Corpus, cfg: DraftTrainConfig, out: Path, device: str = "cpu",
          log: Callable[[str], object] = print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    held, train_set = split(corpus, cfg.seed)
    state_path = out / "train_state.pt"
    saved = torch.load(state_path, weights_only=False) if state_path.exists() else None
    # what the run learns from: a resumed run must have the same, or its held-out replies are others,
    # most of them trained on (the split is drawn over the whole corpus)
    data = {"replies": len(corpus.distilled), "positions": len(corpus.ids), "seed": cfg.seed}
    if saved and saved.get("data") != data:
        raise ValueError(f"{state_path} is a run on other data ({saved.get('data')}) than this one ({data}): "
                         "use another --out, or delete it to start over")
    init = load_head(cfg.init, base.model.args.dim, base.model.args.vocab_size) if cfg.init else None
    if saved:
        vocab = saved["vocab_ids"]
    elif init is not None:
        vocab = init.vocab_ids.cpu()
    else:
        vocab = draft_vocabulary(corpus, corpus.positions(train_set), cfg.draft_vocab, base.tokenizer.eos_ids)
    a = base.model.args
    embed, lm_head, states = base_tables(base)
    head = DraftHead(DraftArgs(dim=a.dim, vocab_size=a.vocab_size, draft_vocab=len(vocab), block=cfg.block,
                               window=cfg.window, n_layers=cfg.n_layers, chain=cfg.chain,
                               states="layers" if cfg.layers else states, layers=cfg.layers, dropout=cfg.dropout,
                               width=cfg.width,
                               norm_eps=getattr(a, "norm_eps", DraftArgs.norm_eps)), vocab)
    with torch.no_grad():
        head.head.weight.copy_(lm_head[vocab.to(lm_head.device)].float().cpu())
    before = 0  # replies the head learnt from before this run (`init`)
    if init is not None:
        if replace(init.args, dropout=cfg.dropout) != head.args:
            raise ValueError(f"{cfg.init} is a head of another shape ({init.args}) than the one asked for "
                             f"({head.args})")
        head.load_state_dict(init.state_dict())
        before = int(read_head_info(cfg.init).get("replies", 0))
        log(f"going on from {cfg.init} (trained on {before} replies)")
    if cfg.layers:  # the base's output rows, frozen (DFlash): the head learns states the base's own head reads
        head.head.weight.requires_grad_(False)
    head.to(device)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    step = 0
    if saved:
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["optimizer"])
        step = saved["step"]
        log(f"resumed at step {step}")
    to_draft = draft_index(vocab, a.vocab_size)
    train_pos, held_pos = corpus.positions(train_set), corpus.positions(held)
    weights = torch.tensor(OFFSET_WEIGHTS[:cfg.block], device=device)
    log(f"{len(train_set)} training replies ({len(train_pos)} positions), {len(held)} held out "
        f"({len(held_pos)}); draft vocabulary {len(vocab)}; "
        f"head {sum(p.numel() for p in head.parameters()) / 1e6:.1f}M parameters on {device}")

    def evaluate() -> tuple[float, float]:
        head.eval()
        figures = held_out_figures(head, corpus, held, embed, DecodeConfig.draft_threshold, device)
        head.train()
        return figures

    def checkpoint(figures: tuple[float, float] | None) -> None:
        torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step, "vocab_ids": vocab,
                    "data": data}, state_path)
        save_head(out / "drafter.safetensors", head.cpu(), {"step": step, "config": asdict(cfg), **result(figures),
                                                            "replies": before + sum(corpus.distilled)})
        head.to(device)

    def result(figures: tuple[float, float] | None) -> dict:
        return {"heldout_tokens_per_forward": figures[0] if figures else None,
                "heldout_decoded_tokens_per_forward": figures[1] if figures else None}

    def report(figures: tuple[float, float], when: str) -> None:
        log(f"{when} held-out tokens/forward: decoded {figures[1]:.3f} (greedy verify, draft threshold "
            f"{DecodeConfig.draft_threshold:g}), teacher-forced {figures[0]:.3f} (every position, every row)")

    start, history, figures = time.perf_counter(), [], None
    best, stale = -1.0, 0  # early stopping on the decoded held-out figure: the best head is the one kept
    gen = torch.Generator().manual_seed(cfg.seed + step)
    head.train()
    while step < cfg.max_steps:
        if cfg.max_minutes and (time.perf_counter() - start) / 60 >= cfg.max_minutes:
            break
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * step / cfg.max_steps))
        for group in opt.param_groups:
            group["lr"] = lr
        pos = train_pos[torch.randint(len(train_pos), (cfg.batch,), generator=gen)]
        loss, accepted = loss_and_accepted(head, batch_at(corpus, pos, embed, to_draft, cfg, device),
                                           weights, cfg.distill_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        history.append((loss.item(), accepted.float().mean().item()))
        if step % 25 == 0:
            recent = history[-25:]
            rate = len(history) / (time.perf_counter() - start)
            log(f"step {step}/{cfg.max_steps}  loss {sum(x for x, _ in recent) / len(recent):.3f}  "
                f"train tokens/forward {1 + sum(y for _, y in recent) / len(recent):.2f}  lr {lr:.2e}  "
                f"{rate:.1f} steps/s  eta {(cfg.max_steps - step) / rate / 60:.1f} min")
        if step % cfg.eval_every == 0:
            figures = evaluate()
            report(figures, f"step {step}")
            if not cfg.patience or figures[1] > best:
                best, stale = figures[1], 0
                checkpoint(figures)
            else:
                stale += 1
                if stale >= cfg.patience:
                    log(f"stopped early: no better decoded held-out figure in {stale} evaluations (best {best:.3f})")
                    break
    if cfg.patience and best >= 0:
        return {"steps": step, "heldout_decoded_tokens_per_forward": best, "drafter": str(out / "drafter.safetensors")}
    figures = evaluate()
    report(figures, "final")
    checkpoint(figures)
    return {"steps": step, **result(figures), "drafter": str(out / "drafter.safetensors")}
