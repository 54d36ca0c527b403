"""The engine as the voice service sees it: an async stream of committed text per request.

One worker thread owns the model, so forwards from different conversations never overlap
and the event loop never blocks on a forward. Each conversation keeps its own KV cache, so
a new turn only prefills what is new. Cancelling a stream (barge-in) stops it at the next
block boundary; the cache invariant in `engine.decode` keeps the conversation consistent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace

from engine.decode import CacheState, DecodeConfig, generate
from engine.loading import LoadedModel, load


@dataclass
class Piece:
    """A committed stretch of the reply: what a caller prints, speaks or sends."""

    text: str
    token_ids: list[int]
    steps: int  # denoising steps spent on this piece's block so far
    forwards: int  # model forwards since the request started, prefill included
    tokens: int  # reply tokens so far
    ttfb_ms: float  # request -> first piece
    elapsed_ms: float  # request -> this piece
    done: bool
    finish_reason: str | None = None  # stop | length, on the last piece
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens that were not already cached


@dataclass
class Conversation:
    """A conversation's cache; reuse one across turns so earlier turns are not prefilled again."""

    state: CacheState | None = None
    active: Iterator | None = None  # the reply being generated; a new turn closes it first


class Engine:
    def __init__(self, loaded: LoadedModel, max_seq_len: int = 2048, defaults: DecodeConfig | None = None):
        self.loaded = loaded
        self.model, self.tokenizer, self.spec = loaded.model, loaded.tokenizer, loaded.spec
        self.max_seq_len = min(max_seq_len, self.model.args.max_seq_len)
        self.defaults = defaults or DecodeConfig()
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")

    @classmethod
    def load(cls, name: str = "default", adapter: str | None = None, max_seq_len: int = 2048,
             defaults: DecodeConfig | None = None) -> "Engine":
        return cls(load(name, max_seq_len=max_seq_len, adapter=adapter), max_seq_len, defaults)

    @property
    def name(self) -> str:
        return self.loaded.name

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

    def generate_sync(self, messages: list[dict], cfg: DecodeConfig | None = None,
                      conversation: Conversation | None = None, **overrides) -> Iterator[Piece]:
        """Pieces of the reply to `messages`, in the calling thread."""
        cfg = replace(cfg or self.defaults, **overrides)
        conversation = conversation or Conversation()
        start = time.perf_counter()
        prompt = self.prompt_ids(messages)
        if conversation.active is not None:
            conversation.active.close()  # an abandoned reply: its finished blocks are already cached
        if conversation.state is None:
            conversation.state = CacheState.new(self.model, self.max_seq_len)
        state = conversation.state
        conversation.active = blocks = generate(self.model, state, prompt, cfg, self.spec, self.tokenizer.eos_ids)
        prefilled = len(prompt) - state.cached_prefix(prompt)
        ids: list[int] = []
        text = ""
        first: float | None = None
        for block in blocks:
            ids += block.token_ids
            full = self.tokenizer.decode(ids)
            if full.endswith("\ufffd") and not block.done:  # half a UTF-8 character: wait for the rest
                delta = ""
            else:
                delta, text = full[len(text):], full
            now = time.perf_counter()
            first = first or now
            reason = None
            if block.done:
                reason = "stop" if ids and ids[-1] in self.tokenizer.eos_ids else "length"
            yield Piece(delta, block.token_ids, block.steps, block.forwards, len(ids),
                        (first - start) * 1000, (now - start) * 1000, block.done, reason, len(prompt), prefilled)
        conversation.active = None

    async def stream(self, messages: list[dict], cfg: DecodeConfig | None = None,
                     conversation: Conversation | None = None, **overrides) -> AsyncIterator[Piece]:
        """Pieces as they are committed; closing the iterator cancels at the next piece boundary."""
        loop = asyncio.get_running_loop()
        pieces = self.generate_sync(messages, cfg, conversation, **overrides)
        done = object()
        try:
            while True:
                piece = await loop.run_in_executor(self._worker, next, pieces, done)
                if piece is done:
                    return
                yield piece
        finally:
            # Close the generator on the worker thread (it may be mid-forward there); that
            # releases the conversation lock. Nothing waits for it here.
            self._worker.submit(pieces.close)
