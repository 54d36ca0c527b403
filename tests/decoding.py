"""The decoders driven one forward at a time, for tests: the engine itself reaches them through
`engine.decode.plan` and `drive` (and `engine.stream`'s batching)."""

from __future__ import annotations

from collections.abc import Iterator

from engine.decode import Block, CacheState, DecodeConfig, DiffusionSpec, ar_steps, decoder_steps, drive, plan
from engine.draft import Drafter
from engine.model import Transformer


def generate_ar(model: Transformer, state: CacheState, new_prompt: list[int], cfg: DecodeConfig,
                stop_ids: set[int]) -> Iterator[Block]:
    return drive(model, ar_steps(state, new_prompt, cfg, stop_ids))


def generate_diffusion(model: Transformer, state: CacheState, new_prompt: list[int], cfg: DecodeConfig,
                       spec: DiffusionSpec, stop_ids: set[int], drafter: Drafter | None = None) -> Iterator[Block]:
    return drive(model, decoder_steps(state, new_prompt, cfg, spec, stop_ids, drafter, model.embed_tokens))


def generate(model: Transformer, state: CacheState, prompt: list[int], cfg: DecodeConfig,
             spec: DiffusionSpec, stop_ids: set[int], drafter: Drafter | None = None) -> Iterator[Block]:
    return drive(model, plan(state, prompt, cfg, spec, stop_ids, drafter, model.embed_tokens))
