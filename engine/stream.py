"""The engine as the voice service sees it: an async stream of committed text per request.

`Engine` is the door: it loads a model, decides once how `mode = "diffusion"` decodes on it
(`decide`), turns messages into a prompt and a decoder's steps, and hands the steps to its parts
(engine/serving/): the scheduler thread, which batches every conversation's forwards in rounds
by deadline and fairness and prefills long prompts in chunks (`Scheduler`); admission, which
refuses a prompt that cannot be read in time here and, on a KV cache shared by every
conversation, makes a request wait for room (`Admission`); each conversation's own KV cache, so
a new turn only prefills what is new, and the pool of idle ones that one-off requests borrow
(`CachePool`); and the end-of-turn probes (`engine.serving.probes`). When a request's reader runs
out of text is the caller's to say (voice/pipeline/lm.py: when the listener's audio runs out).
Cancelling a stream (barge-in) drops the request at the next round; the cache invariant in
`engine.decode` keeps the conversation consistent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from engine.decode import ContextOverflow, DecodeConfig, Steps, drive, plan
from engine.grammar import Constraint, Grammars
from engine.loading import LoadedModel, load
from engine.runtime import CacheState
from engine.serving import probes
from engine.serving.admission import Admission
from engine.serving.caches import CachePool, ConversationCache
from engine.serving.cost import PrefillCost
from engine.serving.requests import Piece, Probe, Reply, Request, Superseded
from engine.serving.scheduler import Scheduler
from engine.tools import Tool, for_template

__all__ = ["ConversationCache", "Decoding", "Engine", "Piece", "Superseded", "decide"]

log = logging.getLogger("engine.stream")


@dataclass(frozen=True)
class Decoding:
    """What `mode = "diffusion"` runs for a model here: decided once, at load (`decide`), and
    reported the same way by the log, engine serve's `x_engine` and the voice service's /healthz."""

    mode: str  # "diffusion": drafted blocks that the base verifies (lossless) | "ar": a token per forward
    why: str


def decide(loaded: LoadedModel) -> Decoding:
    """Drafting pays where the model's kernels run extra rows cheaply and a drafter can read what
    they give (`model.draft_rows`: '' where they pay, else why not); AR otherwise."""
    why_not = loaded.model.draft_rows
    if why_not and not loaded.lookup:
        return Decoding("ar", why_not)
    if why_not:
        return Decoding("diffusion", f"prompt lookup (asked for) proposes tokens, verified by the base; not the "
                                     f"default here: {why_not}")
    if loaded.drafter is not None:
        return Decoding("diffusion", f"its draft head proposes {loaded.drafter.block} tokens a forward, "
                                     "verified by the base (lossless)")
    return Decoding("diffusion", "prompt lookup proposes tokens, verified by the base (lossless)")


class Engine:
    def __init__(self, loaded: LoadedModel, max_seq_len: int = 2048, defaults: DecodeConfig | None = None,
                 max_batch: int = 8, pool_size: int | None = None, max_defer_s: float = 0.3,
                 max_prefill_s: float | None = None):
        """`pool_size`: idle KV caches kept for requests without a conversation (default `max_batch`).
        `max_defer_s`: how long a forward nobody waits for may sit out rounds (`Scheduler`).
        `max_prefill_s`: a request whose new prompt tokens would take longer to prefill here is
        refused up front (`Admission`); None: never."""
        self.loaded = loaded
        self.model, self.tokenizer, self.spec = loaded.model, loaded.tokenizer, loaded.spec
        self.max_seq_len = min(max_seq_len, self.model.args.max_seq_len)
        self.decoding = decide(loaded)
        self.defaults = self.resolve(defaults or DecodeConfig())
        log.info("%s (%s): mode 'diffusion' decodes %s here: %s", loaded.name, loaded.weights,
                 "by drafted blocks" if self.decoding.mode == "diffusion" else "AR", self.decoding.why)
        self.grammars = Grammars(self.tokenizer, self.model.args.vocab_size)
        self.caches = CachePool(lambda: CacheState.new(self.model, self.max_seq_len),
                                max_batch if pool_size is None else pool_size)
        self.cost = PrefillCost()
        # llama.cpp: one KV cache of this many tokens shared by every conversation (None: each its own)
        self.admission = Admission(self.cost, self.prompt_ids, max_prefill_s, getattr(self.model, "kv_tokens", None))
        self.scheduler = Scheduler(self.model, self.cost, self.admission, self.caches, self._plan, max_batch,
                                   max_defer_s)

    @classmethod
    def load(cls, name: str = "default", adapter: str | None = None, max_seq_len: int = 2048,
             defaults: DecodeConfig | None = None, max_batch: int = 8, quantize: str = "none",
             drafter: str | None = None, device: str = "cpu") -> "Engine":
        return cls(load(name, max_seq_len=max_seq_len, adapter=adapter, quantize=quantize, drafter=drafter,
                        device=device), max_seq_len, defaults, max_batch)

    @property
    def name(self) -> str:
        return self.loaded.name

    def resolve(self, cfg: DecodeConfig) -> DecodeConfig:
        """`cfg` as it runs here: mode 'diffusion' is AR where this model's decision says so
        (`self.decoding`); the one place a request's mode meets the model's."""
        return replace(cfg, mode="ar") if cfg.mode == "diffusion" and self.decoding.mode == "ar" else cfg

    def prompt_ids(self, messages: list[dict], tools: list[Tool] | None = None) -> list[int]:
        """The prompt: `messages` (tool calls and results too) and `tools`, in the model's template."""
        messages, rendered = for_template(messages, tools or [], self.tokenizer.supports_tools)
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True, tools=rendered)

    def open_prompt_ids(self, messages: list[dict], tools: list[Tool] | None = None) -> list[int]:
        """`prompt_ids` with the last message left open (no end-of-turn token after it): a prefix of
        the prompt of a reply to the same messages."""
        messages, rendered = for_template(messages, tools or [], self.tokenizer.supports_tools)
        return self.tokenizer.encode_chat_open(messages, tools=rendered)

    def _plan(self, request: Request, others: int) -> tuple[Steps, Reply]:
        """An admitted request's steps beside `others` being served (the scheduler asks)."""
        if request.probe is not None:
            return self._begin_probe(request.probe, request.conversation, request.start, others)
        return self._begin(request.messages, request.cfg, request.conversation, request.start, request.constraint,
                           request.tools, request.warm, others)

    def _begin(self, messages: list[dict], cfg: DecodeConfig, conversation: ConversationCache, start: float,
               constraint: Constraint | None = None, tools: list[Tool] | None = None, background: bool = False,
               others: int = 0) -> tuple[Steps, Reply]:
        """Plan a reply on `conversation` (closing one still running there) beside `others` being served."""
        cfg = self.resolve(cfg)
        prompt = self.prompt_ids(messages, tools)
        if not background:  # a warm has no one waiting: it may take as long as it takes
            self.admission.affordable(prompt, self.caches.holder(conversation.state, prompt)[1], others)
        if conversation.active is not None:
            conversation.active.close()
        if conversation.state is None:
            conversation.state = self.caches.take()
        if shared := self.caches.share(conversation.state, prompt, self.model.copy_cache):
            log.debug("a prompt of %d tokens: %d more of it from another conversation's cache", len(prompt), shared)
        reply = Reply(self.tokenizer, prompt, conversation.state, start)
        steps = plan(conversation.state, prompt, cfg, self.spec, self.tokenizer.eos_ids, self.loaded.drafter,
                     self.model.embed_tokens, constraint, self.scheduler.chunking(background))
        return steps, reply

    def _begin_probe(self, probe: Probe, conversation: ConversationCache, start: float, others: int
                     ) -> tuple[Steps, Reply]:
        if len(probe.prompt) >= self.max_seq_len:
            raise ContextOverflow(f"a prompt of {len(probe.prompt)} tokens does not fit the context "
                                  f"of {self.max_seq_len}")
        state = conversation.state  # a probe reads on a copy of its conversation's cache, none other
        self.admission.affordable(probe.prompt, state.cached_prefix(probe.prompt) if state is not None else 0, others)
        return probes.begin(probe, conversation, self.model, self.caches, self.tokenizer, start,
                            self.scheduler.chunking())

    def abandon(self, conversation: ConversationCache) -> None:
        """Nobody will continue `conversation` (any thread): its cache goes back to the pool now if
        no request runs on it, else when that request leaves."""
        self.caches.abandon(conversation)

    def interrupt_long_prompts(self) -> None:
        """Someone waits now: a forward of long prompts' chunks under way stops (`Scheduler.interrupt`)."""
        self.scheduler.interrupt()

    # --- one request, in the calling thread (CLI, eval, benchmarks) ---------------------------

    def generate_sync(self, messages: list[dict], cfg: DecodeConfig | None = None,
                      conversation: ConversationCache | None = None, constraint: Constraint | None = None,
                      tools: list[Tool] | None = None, **overrides: Any) -> Iterator[Piece]:
        """Pieces of the reply to `messages`, decoded in the calling thread (as `stream`)."""
        cfg = replace(cfg or self.defaults, **overrides)
        conversation = conversation or ConversationCache(abandoned=True)  # a one-off: nobody continues it
        steps, reply = self._begin(messages, cfg, conversation, time.perf_counter(), constraint, tools)
        blocks = drive(self.model, steps)
        conversation.active = blocks
        try:
            for block in blocks:
                yield reply.piece(block)
        finally:  # finished, or closed by the caller
            blocks.close()
            if conversation.active is blocks:
                conversation.active = None
            if conversation.abandoned:
                self.caches.give_back(conversation)

    # --- many requests, batched by the scheduler thread ---------------------------------------

    async def stream(self, messages: list[dict], cfg: DecodeConfig | None = None,
                     conversation: ConversationCache | None = None, deadline: Callable[[str], float] | None = None,
                     constraint: Constraint | None = None, tools: list[Tool] | None = None, warm: bool = False,
                     probe: Probe | None = None, **overrides: Any) -> AsyncGenerator[Piece, None]:
        """Pieces as they are committed; closing the iterator cancels the request. Until its first
        piece someone waits for it, then until `deadline(text)`, when its reader runs out of text
        (monotonic; None: on no clock), `text` being what is decoded so far: the caller's next piece
        may already move its deadline before it arrives (`Scheduler` orders rounds by it).
        Without a `conversation` the request is a one-off on a pooled cache. `constraint`
        (engine.grammar): the reply stays inside its grammar (JSON, tool calls); `tools`
        (engine.tools) are rendered into the prompt; `warm`: a prefill ahead of time (`warm()`), never urgent."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()

        def deliver(item: Piece | BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(pieces.put_nowait, item)
            except RuntimeError:  # the caller's event loop is gone; nobody is listening
                pass

        request = Request(messages, replace(cfg or self.defaults, **overrides),
                          conversation or ConversationCache(abandoned=True), deliver, deadline, constraint, tools, warm,
                          probe)
        self.scheduler.submit(request)
        if not warm:
            self.interrupt_long_prompts()
        try:
            while (item := await pieces.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.cancelled = True

    async def warm(self, messages: list[dict], conversation: ConversationCache, tools: list[Tool] | None = None
                   ) -> None:
        """Prefill `messages` into `conversation`'s cache ahead of its next request, which then
        prefills only what is new (the voice service warms a session's system prompt and tools
        while its user speaks). Nobody waits for it; the one token it decodes is dropped."""
        try:
            async for _ in self.stream(messages, conversation=conversation, tools=tools, warm=True, max_new_tokens=1):
                pass
        except Superseded:  # the request it was warming for came first, and continues from what it wrote
            pass

    async def probe(self, prompt: list[int], tokens: list[int], conversation: ConversationCache | None = None
                    ) -> list[float]:
        """The model's probability of each of `tokens` right after `prompt` (ids), from one forward
        that someone waits for, on a copy of `conversation`'s cache (`engine.serving.probes`):
        the voice service asks whether the user's turn is over on the words its reply will start from."""
        request = Probe(prompt, tokens)
        async for _ in self.stream([], conversation=conversation, probe=request):
            pass  # a probe delivers no pieces
        return request.scores
