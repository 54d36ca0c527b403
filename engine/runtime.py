"""The one seam between the decoders and a model's kernels: `Model`, which PyTorch's transformer
(`engine.model.Transformer`: GPUs, training, verify with a draft head) and llama.cpp's kernels
(`engine.llamacpp.LlamaCppModel`: the CPU default) both implement, so `engine.decode` never asks
which one it has. A conversation's cache is a `engine.decode.CacheState`; the model opens it,
copies a prefix of it into another, and runs batched steps (`Forward`s) on it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor, nn

if TYPE_CHECKING:
    from engine.decode import CacheState, Forward


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
