"""Drafters: whatever proposes the next block of tokens for the base model to verify.

Under the `verify` commit rule (`engine.decode`) the base model's own weights decide every
committed token; a drafter only proposes. A good proposal saves forwards, a bad one costs a
little arithmetic and nothing else, so replies are the base model's whatever the drafter does.

- `DraftHead`: a small block-diffusion head that reads the frozen base model's last hidden
  states (DFlash/EAGLE-like). One parallel pass drafts a whole block: `block` mask rows, one
  per offset, attend to the last `window` positions (each the base's hidden state there plus
  the embedding of the token that followed it) and to each other. A *chained* head (`chain`)
  also gives each row the token before it and lets it see only the rows before it: trained on
  the true previous tokens (exact for greedy verify, which only ever keeps a row whose earlier
  rows were right), drafting row by row from its own tokens. Training needs only forward
  passes of the base (`engine.train_draft`), and its logits cover a truncated vocabulary (the
  tokens the base actually says), so drafting costs a fraction of a base forward.
- `LookupDrafter`: prompt lookup (copy what followed the last occurrence of the current
  bigram); needs no training, so every model gets some drafting.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model import RMSNorm


@dataclass
class Proposal:
    """A drafted block: token ids, and the distribution each was drawn from (None when greedy)."""

    ids: list[int]
    probs: Tensor | None = None  # [len(ids), vocab] over the base vocabulary
    confidence: list[float] | None = None  # the drafter's own probability of each token (None: sure)

    def first(self, n: int) -> "Proposal":
        """The first `n` drafted tokens (none if n <= 0)."""
        n = max(0, n)
        return Proposal(self.ids[:n], self.probs[:n] if self.probs is not None else None,
                        self.confidence[:n] if self.confidence is not None else None)

    def until_unsure(self, threshold: float) -> "Proposal":
        """The drafted prefix the drafter itself is at least `threshold` sure of: a draft row costs
        arithmetic, so rows likely to be rejected are not worth sending. Lossless either way (which
        rows are sent never depends on the base's answer)."""
        if self.confidence is None or threshold <= 0:
            return self
        return self.first(next((i for i, c in enumerate(self.confidence) if c < threshold), len(self.ids)))


@dataclass
class DraftArgs:
    dim: int  # the base model's hidden size
    vocab_size: int  # the base model's vocabulary
    draft_vocab: int = 8192  # most frequent reply tokens the head can propose
    block: int = 4  # tokens drafted per pass
    window: int = 16  # base positions read
    n_layers: int = 2
    n_heads: int = 8
    hidden_dim: int = 1536
    norm_eps: float = 1e-5
    chain: bool = False  # each row reads the token before it and sees only earlier rows (heads saved before it: False)


class DraftLayer(nn.Module):
    """Draft rows attend to the context features and to each other, then an MLP."""

    def __init__(self, a: DraftArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.attn_norm, self.ctx_norm, self.mlp_norm = (RMSNorm(a.dim, a.norm_eps) for _ in range(3))
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(a.dim, a.dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(a.dim, a.hidden_dim, bias=False), nn.Linear(a.dim, a.hidden_dim, bias=False)
        self.down = nn.Linear(a.hidden_dim, a.dim, bias=False)

    def forward(self, x: Tensor, ctx: Tensor, mask: Tensor) -> Tensor:
        b, k, d = x.shape
        h = self.attn_norm(x)
        kv = torch.cat([self.ctx_norm(ctx), h], 1)
        split = lambda t: t.view(b, t.shape[1], self.n_heads, d // self.n_heads).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(split(self.wq(h)), split(self.wk(kv)), split(self.wv(kv)), attn_mask=mask)
        x = x + self.wo(y.transpose(1, 2).reshape(b, k, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class DraftHead(nn.Module):
    def __init__(self, args: DraftArgs, vocab_ids: Tensor):
        super().__init__()
        self.args = args
        self.in_norm = RMSNorm(args.dim, args.norm_eps)
        self.fuse = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.ctx_pos = nn.Parameter(torch.zeros(args.window, args.dim))
        self.queries = nn.Parameter(torch.randn(args.block, args.dim) * 0.02)
        if args.chain:
            self.prev_norm = RMSNorm(args.dim, args.norm_eps)
            self.prev_in = nn.Linear(args.dim, args.dim, bias=False)
        self.layers = nn.ModuleList(DraftLayer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Linear(args.dim, len(vocab_ids), bias=False)
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=True)

    @property
    def block(self) -> int:
        """Tokens drafted per pass."""
        return self.args.block

    def forward(self, hidden: Tensor, next_emb: Tensor, valid: Tensor, prev_emb: Tensor | None = None) -> Tensor:
        """hidden, next_emb [B, W, dim] (oldest first), valid [B, W] -> logits [B, rows, draft_vocab].
        Chained: `prev_emb` [B, rows <= block, dim] embeds the token before each drafted row."""
        return self.rows(self.context(hidden, next_emb), valid, prev_emb)

    def context(self, hidden: Tensor, next_emb: Tensor) -> Tensor:
        """The features every draft row attends to: [B, W, dim]."""
        return self.fuse(torch.cat([self.in_norm(hidden), next_emb], -1)) + self.ctx_pos

    def rows(self, ctx: Tensor, valid: Tensor, prev_emb: Tensor | None = None) -> Tensor:
        """Logits of the draft rows over the context `ctx` (see `forward`)."""
        b, w = valid.shape
        if self.args.chain:
            rows = prev_emb.shape[1]
            x = self.queries[:rows] + self.prev_in(self.prev_norm(prev_emb))
            among = torch.ones(rows, rows, dtype=torch.bool, device=valid.device).tril()
        else:
            rows = self.args.block
            x = self.queries.expand(b, -1, -1)
            among = valid.new_ones(rows, rows)
        mask = torch.cat([valid[:, None, :].expand(b, rows, w), among.expand(b, rows, rows)], -1)[:, None]
        for layer in self.layers:
            x = layer(x, ctx, mask)
        return self.head(self.norm(x))

    @torch.inference_mode()
    def propose(self, embed: nn.Embedding, hidden: Tensor, ids: list[int], k: int, temperature: float,
                generator: torch.Generator | None, threshold: float = 0.0) -> Proposal:
        """Draft `k` (<= block) tokens after `ids`; `hidden` [len(ids) - 1, dim] are the base's states at
        every position but the last (each paired with the token after it, the last one's being ids[-1]).
        A chained head stops drafting at the first token it is less than `threshold` sure of."""
        w, device = self.args.window, hidden.device
        n = min(w, hidden.shape[0])
        nxt = torch.tensor(ids[-n:], device=device)
        pad = w - n
        valid = (torch.arange(w, device=device) >= pad)[None]
        h = F.pad(hidden[-n:].float(), (0, 0, pad, 0))[None]
        e = F.pad(embed(nxt).float(), (0, 0, pad, 0))[None]
        if not self.args.chain:
            return self._pick(self(h, e, valid)[0, :k].float(), temperature, generator)
        ctx = self.context(h, e)
        ids_out, confidence, probs = [], [], []
        while len(ids_out) < k:
            prev = embed(torch.tensor([ids[-1]] + ids_out, device=device)).float()[None]
            one = self._pick(self.rows(ctx, valid, prev)[0, -1:].float(), temperature, generator)
            ids_out += one.ids
            confidence += one.confidence
            if one.probs is not None:
                probs.append(one.probs)
            if one.confidence[0] < threshold:
                break
        return Proposal(ids_out, torch.cat(probs) if probs else None, confidence)

    def _pick(self, logits: Tensor, temperature: float, generator: torch.Generator | None) -> Proposal:
        """Greedy or sampled tokens from draft-vocabulary logits [rows, draft_vocab]."""
        if temperature <= 0:
            confidence, best = logits.softmax(-1).max(-1)
            return Proposal(self.vocab_ids[best].tolist(), None, confidence.tolist())
        q = (logits / temperature).softmax(-1).cpu()  # sampled with the decoder's CPU generator
        vocab = self.vocab_ids.cpu()
        picks = torch.multinomial(q, 1, generator=generator).squeeze(-1)
        full = torch.zeros(len(q), self.args.vocab_size)
        full[:, vocab] = q
        return Proposal(vocab[picks].tolist(), full, q.gather(-1, picks[:, None]).squeeze(-1).tolist())


def save_head(path: str | Path, head: DraftHead, info: dict | None = None, dtype: torch.dtype | None = None) -> None:
    """`dtype`: store the float tensors in it (fp16 halves a shipped head; loading casts back)."""
    from safetensors.torch import save_file
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, str(path), metadata={"args": json.dumps(asdict(head.args)), "info": json.dumps(info or {})})


def load_head(path: str | Path, dim: int, vocab_size: int) -> DraftHead:
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "args" not in meta:
        raise ValueError(f"{path} is not one of our draft heads (no args in its metadata)")
    args = DraftArgs(**json.loads(meta["args"]))
    if (args.dim, args.vocab_size) != (dim, vocab_size):
        raise ValueError(f"{path} drafts for a model of hidden size {args.dim} and vocabulary {args.vocab_size}, "
                         f"not {dim} and {vocab_size}")
    state = load_file(str(path))
    head = DraftHead(args, state["vocab_ids"])
    head.load_state_dict(state)
    return head.eval()


class LookupDrafter:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the last two tokens."""

    ngram = 2
    block = 4

    def propose(self, embed, hidden, ids: list[int], k: int, temperature: float, generator,
                threshold: float = 0.0) -> Proposal:
        n = self.ngram
        if len(ids) <= n:
            return Proposal([])
        tail = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == tail:
                return Proposal(ids[start + n:start + n + k])
        return Proposal([])
