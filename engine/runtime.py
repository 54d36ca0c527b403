"""The one seam between the decoders and a model's kernels: `Model`, which PyTorch's transformer
(`engine.model.Transformer`: GPUs, training, verify with a draft head) and llama.cpp's kernels
(`engine.llamacpp.LlamaCppModel`: the CPU default) both implement, so `engine.decode` never asks
which one it has. A conversation's cache is a `CacheState` and a step's rows of it a `Forward`,
both defined here, below the backends and the decoders (PyTorch keeps its `LayerCache`s in it,
llama.cpp its `Sequence`); the model opens it, copies a prefix of it into another, and runs
batched steps on it. Nothing in engine/ imports upward (tests/test_architecture.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor, nn


class ContextOverflow(ValueError):
    """The conversation no longer fits in the preallocated cache."""


class Interrupted(Exception):
    """A step begun `interruptible` was stopped by `Model.interrupt()`; nothing of it was kept."""


class Model(Protocol):
    """What the decoders need of a model.

    `args`: `dim`, `vocab_size`, `max_seq_len`. `embed_tokens`: the token embedding a draft head
    reads with the hidden states (None where the kernels keep no hidden states). `draft_rows`:
    why verify's drafted rows do not pay on these kernels ('' where they do). `mask_blocks`: whether
    a forward may carry a block of mask rows that attend to each other (the lossy denoising rules)
    or a draft tree, rather than only causal drafted rows."""

    args: Any
    mask_blocks: bool

    @property
    def draft_rows(self) -> str: ...

    @property
    def embed_tokens(self) -> nn.Module | None: ...

    def open_cache(self, state: CacheState, capacity: int | None) -> None:
        """Give `state` an empty cache of `capacity` positions (None: the model's context)."""
        ...

    def copy_cache(self, src: CacheState, dst: CacheState, n: int) -> None:
        """`dst`'s cache starts with `src`'s first `n` positions."""
        ...

    def step(self, forwards: list[Forward], interruptible: bool = False) -> list[tuple[Tensor, Tensor | None]]:
        """One batched pass over several conversations' forwards: per forward, the logits of its
        last clean row and of its drafted rows, and its rows' last hidden states (None where the
        kernels keep none). Rows past each `state.ids` are scratch: a step may overwrite them.
        `interruptible`: `interrupt()` may stop it (it raises `Interrupted`)."""
        ...

    def interrupt(self) -> None:
        """Stop the step running now if it was begun `interruptible` (from any thread); kernels
        that cannot stop a step finish it."""
        ...


class LayerCache(Protocol):
    """One layer's keys and values of a conversation in PyTorch (`engine.model.KVCache`)."""

    k: Tensor  # [batch, n_kv_heads, capacity, head_dim]
    v: Tensor


class Sequence(Protocol):
    """A conversation's sequence in llama.cpp's shared cache (`engine.llamacpp.Slot`)."""

    capacity: int

    def forget(self) -> None:
        """Drop every cached token of the sequence."""
        ...


def tree_depths(parents: list[int]) -> list[int]:
    """Each draft-tree token's depth: 1 for a child of the last committed token."""
    depth: list[int] = []
    for parent in parents:
        depth.append(depth[parent] + 1 if parent >= 0 else 1)
    return depth


@dataclass
class CacheState:
    """One conversation's KV cache and the tokens whose rows in it are final: PyTorch's `caches`,
    or a `slot` (its sequence) in llama.cpp's shared cache (each backend's own, behind `Model`)."""

    caches: list[LayerCache]
    hidden: Tensor | None = None  # [capacity, dim]: the base's last hidden state at each position (for drafters)
    ids: list[int] = field(default_factory=list)
    # (start, end) of cached stretches whose rows attend forward within the stretch (block_causal
    # blocks): cutting one would keep rows that saw dropped tokens, so reuse stops at its start
    blocks: list[tuple[int, int]] = field(default_factory=list)
    slot: Sequence | None = None

    @classmethod
    def new(cls, model: Model, max_seq_len: int | None = None) -> "CacheState":
        state = cls([], None)
        model.open_cache(state, max_seq_len)
        return state

    @property
    def capacity(self) -> int:
        return self.slot.capacity if self.slot is not None else self.caches[0].k.shape[2]

    def clear(self) -> None:
        """Forget every cached token (all rows become scratch): as good as a new state, without allocating."""
        self.ids.clear()
        self.blocks.clear()
        if self.slot is not None:
            self.slot.forget()

    def cached_prefix(self, prompt: list[int]) -> int:
        """How much of `prompt` is already cached (at least its last token always stays new)."""
        keep = 0
        for a, b in zip(self.ids, prompt[:-1]):
            if a != b:
                break
            keep += 1
        for start, end in self.blocks:
            if start < keep < end:
                return start
        return keep

    def fork(self, model: Model, into: "CacheState | None" = None) -> "CacheState":
        """A state holding this one's cached tokens (their cache rows copied), to go on separately:
        `into` (an idle state of the same model and capacity, e.g. from a pool), else a new one."""
        other = into if into is not None else CacheState.new(model, self.capacity)
        model.copy_cache(self, other, len(self.ids))
        other.ids, other.blocks = list(self.ids), list(self.blocks)
        return other

    def reuse_for(self, prompt: list[int]) -> list[int]:
        """Keep the longest cached prefix of `prompt`, drop the rest of the cache; return what is new."""
        keep = self.cached_prefix(prompt)
        del self.ids[keep:]
        self.blocks = [b for b in self.blocks if b[1] <= keep]
        return prompt[keep:]


@dataclass
class Forward:
    """One sequence's forward: write `clean` into its cache after `state.ids`, and denoise
    `draft` after it. Decoders yield these; a driver runs them alone or batched."""

    state: CacheState
    clean: list[int]
    clean_is_block: bool = False
    draft: list[int] = field(default_factory=list)
    context: str = "causal"
    draft_causal: bool = False  # verify: drafted tokens run as causal rows (True) instead of a mask block
    parents: list[int] | None = None  # verify: the draft is a tree (see `Proposal.parents`); None: a chain

    def tree_homes(self, start: int, deepest: int) -> list[int]:
        """Where the tree's tokens' keys and values are written: past the deepest path's slots."""
        return [start + 1 + deepest + i for i in range(len(self.draft))]

    def check_fits(self, end: int) -> None:
        """ContextOverflow if the rows up to `end` do not fit the state's cache."""
        if end > self.state.capacity:
            raise ContextOverflow(f"conversation needs {end} tokens but the context holds {self.state.capacity}")

    def commit(self, logits: Tensor, hidden: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """Record the clean tokens as cached; split the logits into (last clean row, draft rows).
        `hidden`: the rows' last hidden states (None from llama.cpp, whose states keep none)."""
        state, n_clean = self.state, len(self.clean)
        if state.hidden is not None:  # rows past the clean ones stay scratch until a verify step keeps them
            assert hidden is not None  # a PyTorch forward returns them
            state.hidden[len(state.ids):len(state.ids) + len(hidden)] = hidden.float()
        if self.context == "block_causal" and self.clean_is_block and n_clean > 1:
            state.blocks.append((len(state.ids), len(state.ids) + n_clean))
        state.ids.extend(self.clean)
        logits = logits.float().cpu()  # the commit rules run on the CPU, beside the sampler's generator
        return (logits[0] if n_clean else None), (logits[1 if n_clean else 0:] if self.draft else None)
