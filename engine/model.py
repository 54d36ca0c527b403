"""One transformer for the Llama / Qwen2 / Qwen3 family.

The attention pattern is a parameter: every forward takes a boolean mask. Causal, block-causal
and bidirectional decoding are different masks built by `engine.decode` (see
`visibility_mask`); training builds its own noisy/clean mask. Parameter names follow
Hugging Face checkpoints (minus the leading `model.`) so loading is a plain state-dict copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.runtime import CacheState, Forward, tree_depths


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads


class KVCache(nn.Module):
    """Preallocated keys/values for `batch` sequences; rows are written at their positions.

    A position's entry is final once the decoder has committed its token with the context
    attention pattern; positions past the committed length are scratch that the next
    denoising step overwrites.
    """

    k: Tensor  # buffers: [batch, n_kv_heads, max_seq_len, head_dim]
    v: Tensor

    def __init__(self, batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, max_seq_len, head_dim)
        # Uninitialised on purpose: a row is always written before any query can see it, and
        # zeroing ~100 MB per new conversation showed up in time-to-first-block.
        self.register_buffer("k", torch.empty(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.empty(shape, dtype=dtype, device=device), persistent=False)

    def update(self, slots: Tensor, k: Tensor, v: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        self.k[:, :, slots] = k
        self.v[:, :, slots] = v
        return self.k[:, :, :kv_len], self.v[:, :, :kv_len]

    def lay_out(self, slots: Tensor, at: int) -> None:
        """Copy the entries at `slots` to `at`, `at` + 1, ...: a draft tree's path, placed where an
        AR step would find it (and an accepted path, placed for good)."""
        self.k[:, :, at:at + len(slots)] = self.k[:, :, slots]
        self.v[:, :, at:at + len(slots)] = self.v[:, :, slots]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_tables(args: ModelArgs, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, device=device).float() / args.head_dim))
    t = torch.arange(args.max_seq_len, device=device).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (the Hugging Face layout). x: [B, H, T, D]; cos/sin: [B or 1, 1, T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        hd = args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * hd, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, args.norm_eps)
            self.k_norm = RMSNorm(hd, args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, mask: Tensor,
                cache: KVCache | None) -> Tensor:
        return self.o_proj(self.attend(x, self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin, pos, mask,
                                       cache))

    def attend(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor,
               mask: Tensor, cache: KVCache | None, slots: Tensor | None = None,
               alone: list[tuple[Tensor | None, int]] | None = None) -> Tensor:
        """Attention of one sequence's projected rows against its own cache (before o_proj).

        The rows' keys and values are written at cache `slots` (default: their positions).
        `alone` (verify rows): row i attends alone to the first n cache slots, the very call an AR
        step for that position makes, so a verified row equals the AR row bit for bit (a kernel's
        result may change with the number of query rows or masked slots). A draft-tree row's
        entry also names the slots of its path (its ancestors and itself), laid out at the end
        of those n slots first."""
        a = self.args
        b, t, _ = x.shape
        q = q.view(b, t, a.n_heads, a.head_dim)
        k = k.view(b, t, a.n_kv_heads, a.head_dim)
        v = v.view(b, t, a.n_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(pos if slots is None else slots, k, v, mask.shape[-1])
        gqa = a.n_heads != a.n_kv_heads
        if alone is not None:
            rows = []
            for i, (path, n) in enumerate(alone):
                if path is not None:
                    assert cache is not None  # a draft tree's rows are laid out in the cache they attend to
                    cache.lay_out(path, n - len(path))
                rows.append(F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :n], v[:, :, :n],
                                                           attn_mask=mask[i:i + 1, :n], enable_gqa=gqa))
            y = torch.cat(rows, dim=2)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return y.transpose(1, 2).reshape(b, t, a.n_heads * a.head_dim)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.down_proj = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, mask: Tensor,
                cache: KVCache | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, pos, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    rope_cos: Tensor  # buffers: [max_seq_len, head_dim]
    rope_sin: Tensor
    # why verify's drafted rows do not pay on these kernels ('' where they do: rows independent of
    # their batch, hidden states for a draft head; BENCHMARKS.md, "Verify on this CPU")
    draft_rows = ""
    mask_blocks = True  # its attention takes any mask: denoising blocks and draft trees

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # --- engine.runtime.Model: a conversation's cache, batched steps ---------------------------------

    def open_cache(self, state: CacheState, capacity: int | None) -> None:
        """Preallocated keys and values per layer, and the last hidden state per position (a
        draft head reads them)."""
        state.caches = [*self.new_caches(1, capacity)]
        k = state.caches[0].k
        state.hidden = torch.empty(k.shape[2], self.args.dim, device=k.device)

    def copy_cache(self, src: CacheState, dst: CacheState, n: int) -> None:
        assert src.hidden is not None and dst.hidden is not None  # open_cache gave both
        for mine, theirs in zip(_caches(src), _caches(dst)):
            theirs.k[:, :, :n], theirs.v[:, :, :n] = mine.k[:, :, :n], mine.v[:, :, :n]
        dst.hidden[:n] = src.hidden[:n]

    def step(self, forwards: list[Forward], interruptible: bool = False) -> list[tuple[Tensor, Tensor | None]]:
        """The forwards' segments in one pass (`forward_segments`): (logits, hidden states) each.
        A PyTorch forward is not stopped halfway (`interrupt` does nothing)."""
        return self(segments=[segment(f) for f in forwards])

    def interrupt(self) -> None:
        pass

    def new_caches(self, batch: int = 1, max_seq_len: int | None = None) -> list[KVCache]:
        """A fresh preallocated cache per layer (one set per conversation in `engine.stream`)."""
        a = self.args
        n = max_seq_len or a.max_seq_len
        w = self.embed_tokens.weight
        return [KVCache(batch, a.n_kv_heads, n, a.head_dim, w.dtype, w.device) for _ in self.layers]

    def forward(self, tokens: Tensor | None = None, pos: Tensor | None = None, mask: Tensor | None = None,
                logits_rows: Tensor | slice = slice(None), caches: list[KVCache] | None = None, *,
                segments: list[Segment] | None = None) -> Tensor | list[tuple[Tensor, Tensor]]:
        """tokens [B, T] at positions `pos` [T]; `mask` [T, S] (True = may attend) over `caches`' slots 0..S-1.

        With `segments`, several sequences run in one pass against their own caches instead
        (see `forward_segments`); going through here keeps forward hooks seeing every pass.

        Without a cache the keys are the tokens themselves, so S == T (used by training, where
        a noisy copy of a block sits beside its clean copy at the same positions).
        `logits_rows` picks the rows whose logits are wanted: the LM head is the most
        expensive single matrix here, and prefill needs only the last row.
        """
        if segments is not None:
            return forward_segments(self, segments)
        assert tokens is not None and pos is not None and mask is not None
        return self.lm_head(self.norm(self.hidden(tokens, pos, mask, caches)[:, logits_rows]))

    def hidden(self, tokens: Tensor, pos: Tensor, mask: Tensor, caches: list[KVCache] | None = None) -> Tensor:
        """The last layer's output for every row, before the final norm (what a draft head reads)."""
        cos = self.rope_cos[pos][None, None]
        sin = self.rope_sin[pos][None, None]
        x = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, pos, mask, caches[i] if caches is not None else None)
        return x


@dataclass
class Segment:
    """One sequence's share of a batched forward: its tokens, positions, mask and cache."""

    tokens: Tensor  # [T]
    pos: Tensor  # [T]
    mask: Tensor  # [T, S]
    caches: list[KVCache]
    logits_rows: Tensor  # rows of this segment whose logits are wanted
    slots: Tensor | None = None  # cache slots the rows are written to (None: their positions)
    alone: list[tuple[Tensor | None, int]] | None = None  # verify rows attending one at a time (`Attention.attend`)


def forward_segments(model: Transformer, segments: list[Segment]) -> list[tuple[Tensor, Tensor]]:
    """Several sequences in one pass, each against its own cache: the projections and the MLP
    (nearly all the arithmetic) run on every row at once, attention runs per sequence.
    This is how requests from different conversations share a decoding step. Per segment:
    (logits of its `logits_rows`, final hidden states of all its rows, before the last norm;
    a drafter reads those)."""
    sizes = [len(s.tokens) for s in segments]
    x = model.embed_tokens(torch.cat([s.tokens for s in segments])[None])
    ropes = [(model.rope_cos[s.pos][None, None], model.rope_sin[s.pos][None, None]) for s in segments]
    for i, layer in enumerate(cast("list[Layer]", model.layers)):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        outs, start = [], 0
        for seg, n, (cos, sin) in zip(segments, sizes, ropes):
            rows = slice(start, start + n)
            outs.append(attn.attend(h[:, rows], q[:, rows], k[:, rows], v[:, rows], cos, sin, seg.pos, seg.mask,
                                    seg.caches[i], seg.slots, seg.alone))
            start += n
        x = x + attn.o_proj(torch.cat(outs, dim=1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    wanted = torch.cat([s.logits_rows + o for s, o in zip(segments, offsets)])
    logits = model.lm_head(model.norm(x[:, wanted]))[0]
    return list(zip(logits.split([len(s.logits_rows) for s in segments]), x[0].split(sizes)))


def visibility_mask(visible: Tensor, kv_len: int) -> Tensor:
    """Query row i may attend cache slots < visible[i]: the one shape every pattern here takes.

    causal: visible = pos + 1; block-causal: visible = end of the row's block;
    bidirectional: visible = sequence length.
    """
    return torch.arange(kv_len, device=visible.device)[None, :] < visible[:, None]


# --- a Forward's rows, as this transformer runs them ------------------------------------------

def _caches(state: CacheState) -> list[KVCache]:
    """The state's cache, as `Transformer.open_cache` made it."""
    return cast("list[KVCache]", state.caches)


def segment(forward: Forward) -> Segment:
    """A forward's rows as the transformer runs them: tokens, positions, mask, its cache."""
    state, clean, draft = forward.state, forward.clean, forward.draft
    if forward.parents is not None:
        return _tree_segment(forward)
    start = len(state.ids)
    n_clean, n_draft = len(clean), len(draft)
    end = start + n_clean + n_draft
    forward.check_fits(end)
    device = state.caches[0].k.device  # the model's: everything a forward reads lives there
    pos = torch.arange(start, end, device=device)
    if forward.context == "bidirectional":
        visible = torch.full((n_clean + n_draft,), end, device=device)
    elif forward.context == "block_causal" and forward.clean_is_block:
        visible = torch.full((n_clean + n_draft,), end, device=device)
        visible[:n_clean] = start + n_clean
    elif forward.draft_causal:
        visible = pos + 1
    else:
        visible = torch.cat([pos[:n_clean] + 1, torch.full((n_draft,), end, device=device)])
    rows = torch.arange(n_clean - 1 if n_clean else 0, n_clean + n_draft, device=device)
    alone: list[tuple[Tensor | None, int]] | None = (
        [(None, n) for n in range(start + 1, end + 1)] if forward.draft_causal and n_draft else None)
    return Segment(torch.tensor(clean + draft, dtype=torch.long, device=device), pos,
                   visibility_mask(visible, end), _caches(state), rows, alone=alone)


def _tree_segment(forward: Forward) -> Segment:
    """The last committed token, then a draft tree's tokens (parents first). A token at depth d
    sits at position start + d, but its key and value are written past the deepest path (its
    *home*); before its row attends, its path is laid out at start + 1 .. start + d, so the row
    sees exactly what an AR step at that position would (see `Attention.attend`)."""
    assert forward.parents is not None  # a tree
    state, start = forward.state, len(forward.state.ids)
    depth = tree_depths(forward.parents)
    homes = forward.tree_homes(start, max(depth, default=0))
    end = (homes[-1] + 1) if homes else start + 1
    forward.check_fits(end)
    device = state.caches[0].k.device
    pos = torch.tensor([start] + [start + d for d in depth], device=device)
    slots = torch.tensor([start] + homes, device=device)
    paths: list[list[int]] = []
    for parent in forward.parents:
        paths.append((paths[parent] if parent >= 0 else []) + [homes[len(paths)]])
    alone: list[tuple[Tensor | None, int]] = [(None, start + 1)]
    alone += [(torch.tensor(p, device=device), start + 1 + len(p)) for p in paths]
    visible = torch.tensor([n for _, n in alone], device=device)
    return Segment(torch.tensor(forward.clean + forward.draft, dtype=torch.long, device=device), pos,
                   visibility_mask(visible, end), _caches(state), torch.arange(len(pos), device=device),
                   slots, alone)


def settle(forward: Forward, path: list[int]) -> None:
    """After a tree forward: move the accepted tokens' cache entries and hidden states (`path`:
    their indices in `draft`, root first) to their positions, right after the committed token."""
    assert forward.parents is not None  # a tree
    state = forward.state
    start = len(state.ids) - 1  # `commit` has recorded the committed token
    homes = forward.tree_homes(start, max(tree_depths(forward.parents), default=0))
    device = state.caches[0].k.device
    slots = torch.tensor([homes[i] for i in path], dtype=torch.long, device=device)
    for cache in _caches(state):
        cache.lay_out(slots, start + 1)
    if state.hidden is not None:  # `commit` wrote draft row i's state at start + 1 + i
        state.hidden[start + 1:start + 1 + len(path)] = state.hidden[[start + 1 + i for i in path]]
