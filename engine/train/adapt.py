"""Turn an AR checkpoint into a block-diffusion one: LoRA + a learned mask token, masked-block loss.

Each training sequence is the clean example (prompt + reply, causal: the context the decoder
caches) followed by a noisy copy of the reply's blocks, where a random fraction of each block
is replaced by the mask token. A noisy row sees the clean tokens before its block and its own
whole noisy block, exactly what the decoder's draft rows see. With token shift the row at i
predicts token i+1, so the AR head keeps its meaning: the clean rows carry the ordinary
next-token loss (which also trains every block's first token) and the noisy rows learn to
fill masked positions in parallel. Several examples are packed per step with a block-diagonal
mask to keep the matrices large enough for the CPU.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.decode import DiffusionSpec
from engine.lora import attach, save_adapter
from engine.model import Transformer

Example = tuple[list[int], int]  # (token ids, prompt length), as engine.train.data.training_examples gives them
# (tokens, positions, mask, targets, weights): one noisy example as lists, a packed batch as tensors
NoisyExample = tuple[list[int], list[int], torch.Tensor, list[int], list[float]]
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class AdaptConfig:
    block_size: int = 4
    shift: bool = True
    rank: int = 16
    alpha: float = 32.0
    lr: float = 5e-4
    warmup_steps: int = 20
    pack_tokens: int = 512  # tokens per packed training sequence (clean + noisy)
    min_mask_ratio: float = 0.1
    noisy_weight: float = 1.0  # loss weight of masked-block rows relative to the clean next-token rows
    max_tokens: int = 0  # stop after this many trained tokens (0: no limit)
    max_minutes: float = 0.0  # stop after this long (0: no limit)
    save_every: int = 50  # steps
    seed: int = 0


def noisy_example(ids: list[int], prompt_len: int, cfg: AdaptConfig, mask_id: int, rng: random.Random
                  ) -> NoisyExample:
    """One example as (tokens, positions, mask, targets) with block-causal noisy rows after the clean ones."""
    n = len(ids)
    reply = list(range(prompt_len, n))
    noisy, targets_noisy = [], []
    noisy_block_start = []
    for s in range(prompt_len, n, cfg.block_size):
        block = list(range(s, min(s + cfg.block_size, n)))
        ratio = rng.uniform(cfg.min_mask_ratio, 1.0)
        masked = [rng.random() < ratio for _ in block]
        if not any(masked[1:] if cfg.shift and len(block) > 1 else masked):
            masked[-1] = True
        noisy += [mask_id if m else ids[i] for i, m in zip(block, masked)]
        noisy_block_start += [s] * len(block)
        for j, i in enumerate(block):
            if cfg.shift:  # row i predicts i+1, inside the block only
                target = ids[i + 1] if j + 1 < len(block) and masked[j + 1] else -100
            else:
                target = ids[i] if masked[j] else -100
            targets_noisy.append(target)
    n_noisy = len(noisy)
    tokens = ids + noisy
    positions = list(range(n)) + reply
    total = n + n_noisy
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:n, :n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    start = torch.tensor(noisy_block_start)
    mask[n:, :n] = torch.arange(n)[None, :] < start[:, None]
    mask[n:, n:] = start[:, None] == start[None, :]
    if cfg.shift:
        targets_clean = [ids[i + 1] if i + 1 >= prompt_len and i + 1 < n else -100 for i in range(n)]
    else:
        targets_clean = [-100] * n  # an unshifted model predicts in place: clean rows carry no loss
    weights = [1.0] * n + [cfg.noisy_weight] * n_noisy
    return tokens, positions, mask, targets_clean + targets_noisy, weights


def pack(examples: list[Example], cfg: AdaptConfig, mask_id: int, rng: random.Random) -> Batch:
    """Concatenate noisy examples up to cfg.pack_tokens with a block-diagonal mask."""
    parts: list[NoisyExample] = []
    used = 0
    while examples:
        ids, prompt_len = examples[-1]
        size = len(ids) + len(ids) - prompt_len
        if parts and used + size > cfg.pack_tokens:
            break
        examples.pop()
        parts.append(noisy_example(ids, prompt_len, cfg, mask_id, rng))
        used += size
    tokens = torch.tensor([t for p in parts for t in p[0]])[None]
    positions = torch.tensor([q for p in parts for q in p[1]])
    mask = torch.block_diag(*[p[2] for p in parts])
    targets = torch.tensor([t for p in parts for t in p[3]])
    weights = torch.tensor([w for p in parts for w in p[4]])
    return tokens, positions, mask, targets, weights


def loss_on(model: Transformer, batch: Batch) -> torch.Tensor:
    tokens, positions, mask, targets, weights = batch
    rows = (targets != -100).nonzero().squeeze(-1)
    logits = model(tokens, positions, mask, rows)[0]
    losses = F.cross_entropy(logits.float(), targets[rows], reduction="none")
    return (losses * weights[rows]).sum() / weights[rows].sum()


def train(model: Transformer, examples: Sequence[Example], spec: DiffusionSpec, cfg: AdaptConfig, out: Path,
          heldout: Sequence[Example] | None = None, log: Callable[[str], object] = print) -> dict:
    """Train LoRA + mask embedding on `model` in place; checkpoints to `out`, resumes from it."""
    torch.manual_seed(cfg.seed)
    params = attach(model, cfg.rank, cfg.alpha, spec.mask_id)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "train_state.pt"
    step, tokens_seen, epoch = 0, 0, 0
    if state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        trainable = dict(model.named_parameters())
        for name, value in saved["adapter"].items():
            trainable[name].data.copy_(value)
        opt.load_state_dict(saved["optimizer"])
        step, tokens_seen, epoch = saved["step"], saved["tokens"], saved["epoch"]
        log(f"resumed at step {step}, {tokens_seen} tokens")
    rng = random.Random(cfg.seed + step)
    queue = list(examples)
    random.Random(cfg.seed + epoch).shuffle(queue)
    start, start_tokens = time.perf_counter(), tokens_seen
    model.train()
    history = []

    def checkpoint() -> None:
        torch.save({"adapter": {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad},
                    "optimizer": opt.state_dict(), "step": step, "tokens": tokens_seen, "epoch": epoch},
                   state_path)
        save_adapter(out / "adapter.safetensors", model, spec, cfg.rank, cfg.alpha,
                     {"step": step, "tokens": tokens_seen, "config": asdict(cfg)})

    while True:
        elapsed = (time.perf_counter() - start) / 60
        if cfg.max_tokens and tokens_seen >= cfg.max_tokens or cfg.max_minutes and elapsed >= cfg.max_minutes:
            break
        if not queue:
            epoch += 1
            queue = list(examples)
            random.Random(cfg.seed + epoch).shuffle(queue)
        batch = pack(queue, cfg, spec.mask_id, rng)
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)
        loss = loss_on(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens_seen += batch[0].shape[1]
        history.append(loss.item())
        if step % 5 == 0:
            rate = (tokens_seen - start_tokens) / (time.perf_counter() - start)
            budget = []
            if cfg.max_tokens:
                budget.append((cfg.max_tokens - tokens_seen) / rate / 60)
            if cfg.max_minutes:
                budget.append(cfg.max_minutes - (time.perf_counter() - start) / 60)
            eta = f"eta {min(budget):.1f} min" if budget else ""
            log(f"step {step}  epoch {epoch}  loss {sum(history[-5:]) / 5:.3f}  tokens {tokens_seen}  "
                f"{rate:.0f} tok/s  {eta}")
        if step % cfg.save_every == 0:
            checkpoint()
            if heldout:
                log(f"step {step}  heldout loss {evaluate_loss(model, heldout, spec, cfg):.3f}")
    checkpoint()
    model.eval()
    return {"steps": step, "tokens": tokens_seen, "loss_last": sum(history[-10:]) / max(1, len(history[-10:]))}


@torch.no_grad()
def evaluate_loss(model: Transformer, examples: Sequence[Example], spec: DiffusionSpec, cfg: AdaptConfig) -> float:
    was_training = model.training
    model.eval()
    rng = random.Random(1234)
    queue = list(examples)
    losses = []
    while queue:
        losses.append(float(loss_on(model, pack(queue, cfg, spec.mask_id, rng))))
    model.train(was_training)
    return sum(losses) / len(losses)


def write_log_header(out: Path, argv: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "command.json").open("w") as f:
        json.dump({"argv": argv, "started": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
