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
  passes of the base (`engine.train.draft`), and its logits cover a truncated vocabulary (the
  tokens the base actually says), so drafting costs a fraction of a base forward.
- `LookupDrafter`: prompt lookup (copy what followed the last occurrence of the current
  bigram); needs no training, so every model gets some drafting.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model import RMSNorm
from engine.runtime import tree_depths
from engine.sampling import tempered


@dataclass
class Proposal:
    """A drafted block: token ids, and the distribution each was drawn from (None when greedy)."""

    ids: list[int]
    probs: Tensor | None = None  # [len(ids), vocab] over the base vocabulary
    confidence: list[float] | None = None  # the drafter's own probability of each token (None: sure)
    # A tree (greedy only): each token's parent, an index into `ids` before it (-1: the last committed
    # token); siblings are alternatives. None: a chain, each token following the one before it.
    parents: list[int] | None = None

    def first(self, n: int) -> "Proposal":
        """The drafted tokens at most `n` deep (none if n <= 0)."""
        n = max(0, n)
        if self.parents is not None:
            return self._keep([d <= n for d in tree_depths(self.parents)])
        return Proposal(self.ids[:n], self.probs[:n] if self.probs is not None else None,
                        self.confidence[:n] if self.confidence is not None else None)

    def until_unsure(self, threshold: float) -> "Proposal":
        """The drafted tokens whose path the drafter itself gives at least `threshold` probability of
        being right all through (the product of the confidences along it): a draft row costs a
        fifth of a forward here, so rows likely to be rejected are not worth sending. Lossless
        either way (which rows are sent never depends on the base's answer)."""
        if self.confidence is None or threshold <= 0:
            return self
        if self.parents is not None:
            joint: list[float] = []
            for c, parent in zip(self.confidence, self.parents):
                joint.append(c * (joint[parent] if parent >= 0 else 1.0))
            return self._keep([j >= threshold for j in joint])
        return self.first(sure_prefix(self.confidence, threshold))

    def _keep(self, wanted: list[bool]) -> "Proposal":
        """The tree's tokens that are `wanted` and whose ancestors all are, parents renumbered."""
        assert self.parents is not None  # only a tree is pruned
        index: dict[int, int] = {-1: -1}
        ids: list[int] = []
        confidence: list[float] = []
        parents: list[int] = []
        for i, (token, parent) in enumerate(zip(self.ids, self.parents)):
            if wanted[i] and parent in index:
                index[i] = len(ids)
                ids.append(token)
                parents.append(index[parent])
                if self.confidence is not None:
                    confidence.append(self.confidence[i])
        return Proposal(ids, None, confidence if self.confidence is not None else None, parents)


class Drafter(Protocol):
    """What `verify` decoding needs of a drafter (`DraftHead`, `LookupDrafter`): how many tokens it
    drafts per pass, and a proposal after `ids`. `embed` is the base's token embedding and
    `hidden` [len(ids) - 1, dim] its last hidden states (a draft head reads them; lookup does not;
    both None where the model's kernels keep none)."""

    @property
    def block(self) -> int: ...

    def propose(self, embed: nn.Module | None, hidden: Tensor | None, ids: list[int], k: int, temperature: float,
                generator: torch.Generator | None, threshold: float = 0.0) -> Proposal: ...


class TreeDrafter(Drafter, Protocol):
    """A drafter that can also draft a tree of alternatives (`DraftHead` when `drafts_trees`)."""

    @property
    def drafts_trees(self) -> bool: ...

    def propose_tree(self, embed: nn.Module, hidden: Tensor, ids: list[int], k: int, nodes: int) -> Proposal: ...


def sure_prefix(confidence: list[float], threshold: float) -> int:
    """How many leading tokens keep the product of their confidences at least `threshold`."""
    joint, n = 1.0, 0
    for c in confidence:
        joint *= c
        if joint < threshold:
            break
        n += 1
    return n


TREE_WIDTH = 4  # draft trees: paths extended per pass, and alternatives drafted per path


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
    # the base's states it reads: "last" (its last layer before the final norm: PyTorch's model) or
    # "normed" (after it: what llama.cpp outputs as embeddings), or "layers": the outputs of the base
    # layers `layers` side by side (e.g. a low, a middle and the last: EAGLE-3, DFlash), which
    # llama.cpp's kernels read in the forward that verifies (`engine.llamacpp.LayerTap`)
    states: str = "last"
    layers: tuple[int, ...] = ()
    dropout: float = 0.0  # training only: on the context features and each layer's updates
    # the head's own width (0: the base's `dim`): a narrower head drafts sooner, and projects up to the
    # base's width before its output rows (the base's own, frozen)
    width: int = 0


class DraftLayer(nn.Module):
    """Draft rows attend to the context features and to each other, then an MLP."""

    def __init__(self, a: DraftArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.attn_norm, self.ctx_norm, self.mlp_norm = (RMSNorm(a.dim, a.norm_eps) for _ in range(3))
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(a.dim, a.dim, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(a.dim, a.hidden_dim, bias=False), nn.Linear(a.dim, a.hidden_dim, bias=False)
        self.down = nn.Linear(a.hidden_dim, a.dim, bias=False)
        self.drop = nn.Dropout(a.dropout)

    def forward(self, x: Tensor, ctx: Tensor, mask: Tensor) -> Tensor:
        """All rows x [B, rows, dim] at once over the context `ctx` [B, W, dim] (training, parallel heads)."""
        h = self.attn_norm(x)
        kv = torch.cat([self.ctx_norm(ctx), h], 1)
        return self._attend_and_mlp(x, self.heads(self.wq(h)), self.heads(self.wk(kv)), self.heads(self.wv(kv)), mask)


    def context_kv(self, ctx: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """The context's keys and values, as the lists `step` extends."""
        c = self.ctx_norm(ctx)
        return [self.heads(self.wk(c))], [self.heads(self.wv(c))]

    def step(self, x: Tensor, keys: list[Tensor], values: list[Tensor], mask: Tensor) -> Tensor:
        """One more chained row x [B, 1, dim]: its key and value join `keys`/`values`, so the context and
        the earlier rows are projected once per proposal instead of once per drafted token (the
        projections of ~20 rows were most of a proposal's time)."""
        h = self.attn_norm(x)
        keys.append(self.heads(self.wk(h)))
        values.append(self.heads(self.wv(h)))
        b = x.shape[0]  # several paths of a draft tree share the context's keys and values
        k, v = (torch.cat([t.expand(b, -1, -1, -1) for t in kv], 2) for kv in (keys, values))
        return self._attend_and_mlp(x, self.heads(self.wq(h)), k, v, mask)

    def heads(self, t: Tensor) -> Tensor:
        b, n, d = t.shape
        return t.view(b, n, self.n_heads, d // self.n_heads).transpose(1, 2)

    def _attend_and_mlp(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        b, rows, d = x.shape
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.drop(self.wo(y.transpose(1, 2).reshape(b, rows, d)))
        h = self.mlp_norm(x)
        return x + self.drop(self.down(F.silu(self.gate(h)) * self.up(h)))


class DraftHead(nn.Module):
    vocab_ids: Tensor  # buffer: the base-vocabulary id of each draft-vocabulary token

    def __init__(self, args: DraftArgs, vocab_ids: Tensor):
        super().__init__()
        self.args = args
        width = args.width or args.dim
        self.in_norm = RMSNorm(args.dim, args.norm_eps)  # each layer's state normed alike, then fused
        self.fuse = nn.Linear((max(1, len(args.layers)) + 1) * args.dim, width, bias=False)
        self.drop = nn.Dropout(args.dropout)
        self.ctx_pos = nn.Parameter(torch.zeros(args.window, width))
        self.queries = nn.Parameter(torch.randn(args.block, width) * 0.02)
        if args.chain:
            self.prev_norm = RMSNorm(args.dim, args.norm_eps)
            self.prev_in = nn.Linear(args.dim, width, bias=False)
        self.layers = nn.ModuleList(DraftLayer(replace(args, dim=width)) for _ in range(args.n_layers))
        self.norm = RMSNorm(width, args.norm_eps)
        self.widen = nn.Linear(width, args.dim, bias=False) if width != args.dim else nn.Identity()
        self.head = nn.Linear(args.dim, len(vocab_ids), bias=False)
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=True)

    @property
    def draft_layers(self) -> list[DraftLayer]:
        """`layers`, typed (a ModuleList's items are plain Modules to a type checker)."""
        return cast("list[DraftLayer]", self.layers)

    @property
    def block(self) -> int:
        """Tokens drafted per pass."""
        return self.args.block

    @property
    def drafts_trees(self) -> bool:
        """Only a chained head can grow alternatives from its own drafted tokens (`propose_tree`)."""
        return self.args.chain

    def forward(self, hidden: Tensor, next_emb: Tensor, valid: Tensor, prev_emb: Tensor | None = None) -> Tensor:
        """hidden, next_emb [B, W, dim] (oldest first), valid [B, W] -> logits [B, rows, draft_vocab].
        Chained: `prev_emb` [B, rows <= block, dim] embeds the token before each drafted row."""
        return self.rows(self.context(hidden, next_emb), valid, prev_emb)

    def context(self, hidden: Tensor, next_emb: Tensor) -> Tensor:
        """The features every draft row attends to: [B, W, dim]. `hidden` [B, W, layers * dim]."""
        states = self.in_norm(hidden.unflatten(-1, (-1, self.args.dim))).flatten(-2)
        return self.drop(self.fuse(torch.cat([states, next_emb], -1))) + self.ctx_pos

    def rows(self, ctx: Tensor, valid: Tensor, prev_emb: Tensor | None = None) -> Tensor:
        """Logits of the draft rows over the context `ctx` (see `forward`)."""
        b, w = valid.shape
        if self.args.chain:
            assert prev_emb is not None  # a chained head reads the token before each row
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
        return self.logits(x)

    def logits(self, x: Tensor) -> Tensor:
        """Draft-vocabulary logits of the rows `x` [..., width]."""
        return self.head(self.widen(self.norm(x)))

    @torch.inference_mode()
    def propose(self, embed: nn.Module | None, hidden: Tensor | None, ids: list[int], k: int, temperature: float,
                generator: torch.Generator | None, threshold: float = 0.0) -> Proposal:
        """Draft `k` (<= block) tokens after `ids`; `hidden` [len(ids) - 1, dim] are the base's states at
        every position but the last (each paired with the token after it, the last one's being ids[-1]).
        A chained head stops drafting once the drafted prefix is less than `threshold` likely right."""
        if hidden is None or embed is None:
            raise ValueError("a draft head reads the base's hidden states; this model's kernels keep none")
        h, e, valid = self._window(embed, hidden, ids)
        if not self.args.chain:
            return self._pick(self(h, e, valid)[0, :k].float(), temperature, generator)
        ctx = self.context(h, e)
        cache = [layer.context_kv(ctx) for layer in self.draft_layers]
        ids_out: list[int] = []
        confidence: list[float] = []
        probs: list[Tensor] = []
        while len(ids_out) < k:
            prev = embed(torch.tensor([(ids + ids_out)[-1]], device=h.device)).float()[None]
            x = self._step(len(ids_out), prev, valid, cache)
            one = self._pick(self.logits(x)[0].float(), temperature, generator)
            ids_out += one.ids
            assert one.confidence is not None  # _pick always says how sure it is
            confidence += one.confidence
            if one.probs is not None:
                probs.append(one.probs)
            if sure_prefix(confidence, threshold) < len(confidence):
                break
        return Proposal(ids_out, torch.cat(probs) if probs else None, confidence)

    @torch.inference_mode()
    def propose_tree(self, embed: nn.Module, hidden: Tensor, ids: list[int], k: int, nodes: int) -> Proposal:
        """Greedy, chained heads: a tree of `nodes` tokens at most `k` deep after `ids` (EAGLE-2-like).
        Each pass drafts the next token of the TREE_WIDTH likeliest paths so far, TREE_WIDTH
        alternatives each; of all tokens drafted, the `nodes` likeliest paths are kept (a path's
        likelihood is the product of its tokens' confidences, so a kept token's parent is kept).
        Verify then accepts the longest path the base agrees with: one forward checks every
        alternative, which pays where a forward's cost hardly grows with its rows (a GPU)."""
        h, e, valid = self._window(embed, hidden, ids)
        cache = [layer.context_kv(self.context(h, e)) for layer in self.draft_layers]
        tokens: list[int] = []
        parents: list[int] = []
        confidence: list[float] = []
        joint: list[float] = []
        paths, path_joint, last = [-1], torch.ones(1), [ids[-1]]  # the paths being extended
        for depth in range(min(k, self.args.block)):
            x = self._step(depth, embed(torch.tensor(last, device=h.device)).float()[:, None], valid, cache)
            p, best = self.logits(x)[:, 0].float().softmax(-1).topk(TREE_WIDTH, -1)
            first = len(tokens)
            tokens += self.vocab_ids[best].flatten().tolist()
            parents += [parent for parent in paths for _ in range(TREE_WIDTH)]
            confidence += p.flatten().tolist()
            grown = (path_joint[:, None] * p.cpu()).flatten()
            joint += grown.tolist()
            keep = grown.topk(min(TREE_WIDTH, len(grown))).indices
            for keys, values in cache:  # the kept paths' rows so far; keys[0] is the shared context
                keys[1:] = [t[keep // TREE_WIDTH] for t in keys[1:]]
                values[1:] = [t[keep // TREE_WIDTH] for t in values[1:]]
            paths = [first + int(i) for i in keep]
            path_joint, last = grown[keep], [tokens[i] for i in paths]
        order = sorted(range(len(tokens)), key=lambda i: -joint[i])[:nodes]
        chosen = set(order)
        return Proposal(tokens, None, confidence, parents)._keep([i in chosen for i in range(len(tokens))])

    def _window(self, embed: nn.Module, hidden: Tensor, ids: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """The last `window` positions' hidden states and next-token embeddings, padded in front, and
        which are real: the head's context."""
        w, device = self.args.window, hidden.device
        n = min(w, hidden.shape[0])
        pad = w - n
        h = F.pad(hidden[-n:].float(), (0, 0, pad, 0))[None]
        valid = h.abs().sum(-1) > 0  # padding, and rows whose state the kernels did not give (as in training)
        e = F.pad(embed(torch.tensor(ids[-n:], device=device)).float(), (0, 0, pad, 0))[None]
        return h, e, valid

    def _step(self, row: int, prev: Tensor, valid: Tensor, cache: list) -> Tensor:
        """Chained row `row` for each of B paths, given the token before it (`prev` [B, 1, dim])."""
        x = self.queries[row:row + 1] + self.prev_in(self.prev_norm(prev))
        b = x.shape[0]
        mask = torch.cat([valid.expand(b, -1), valid.new_ones(b, row + 1)], -1)[:, None, None]
        for layer, (keys, values) in zip(self.draft_layers, cache):
            x = layer.step(x, keys, values, mask)
        return x

    def _pick(self, logits: Tensor, temperature: float, generator: torch.Generator | None) -> Proposal:
        """Greedy or sampled tokens from draft-vocabulary logits [rows, draft_vocab]."""
        if temperature <= 0:
            confidence, best = logits.softmax(-1).max(-1)
            return Proposal(self.vocab_ids[best].tolist(), None, confidence.tolist())
        q = tempered(logits, temperature).cpu()  # sampled with the decoder's CPU generator
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


def read_head_args(path: str | Path) -> DraftArgs:
    """A saved head's arguments (its file's metadata; the weights are not read)."""
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "args" not in meta:
        raise ValueError(f"{path} is not one of our draft heads (no args in its metadata)")
    args = DraftArgs(**json.loads(meta["args"]))
    args.layers = tuple(args.layers)  # JSON gave a list
    return args


def read_head_info(path: str | Path) -> dict:
    """What a saved head's training measured (`save_head`'s `info`: its held-out figures, ...)."""
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {}).get("info", "{}"))


def load_head(path: str | Path, dim: int, vocab_size: int) -> DraftHead:
    from safetensors.torch import load_file
    args = read_head_args(path)
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

    def propose(self, embed: nn.Module | None, hidden: Tensor | None, ids: list[int], k: int, temperature: float,
                generator: torch.Generator | None, threshold: float = 0.0) -> Proposal:
        n = self.ngram
        if len(ids) <= n:
            return Proposal([])
        tail = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == tail:
                return Proposal(ids[start + n:start + n + k])
        return Proposal([])
