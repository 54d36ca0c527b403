"""The engine as the voice service sees it: an async stream of committed text per request.

One scheduler thread owns the model. Every round it advances each active request to its
next forward (a denoising step, or an AR token) and runs up to `max_batch` of them as one
batched pass, so concurrent conversations share block-denoising steps instead of queueing
behind each other (continuous batching at block-step granularity). Each round the requests of
the highest priority go first (`priority(text)`, asked per round: a reply that has not delivered a
piece yet is WAITED); the others sit out, each forward at most `max_defer_s`, so they are
delayed, never starved; a BACKGROUND request sits out even alone. What deserves which priority
is the caller's policy (voice/lm.py has the voice service's). Within a priority the least
served requests go first (each is charged its rows' share of the model time of the batches it
was in), and a prompt is prefilled in chunks of about `SLICE_S` of model time, one chunk a
round: a conversation that sends a long prompt cannot hold the model from the others' steps,
and a newcomer goes ahead of it. Nor does a newcomer wait for the chunk under way when it comes:
a forward of long prompts' chunks only stops when someone starts waiting (`interrupt_long_prompts`:
a new request, or the voice service's speech recognition or synthesis for a silent user), on
kernels that can stop one (llama.cpp), and is read again after the others' turn. A prompt
whose new tokens would take longer than `max_prefill_s` to read is refused before any forward,
and again later, as the load changes, if it can no longer be read within that (`_refuse_late`).
Each conversation keeps its own KV cache, so a new turn only prefills what is new. Cancelling a
stream (barge-in) drops the request at the next round; the cache invariant in `engine.decode`
keeps the conversation consistent.

A request made without a conversation (a one-off) runs on a cache borrowed from the engine's
pool and gives it back, cleared, when it finishes or is cancelled, and so does a conversation
the caller abandons (`engine serve`'s, when nobody continues it):
steady-state serving allocates no new ~100 MB caches. (Allocating one per request let glibc's
heap keep growing with freed, still-resident caches: RSS rose by hundreds of MB per 100
requests. bench/serve_soak.py measures it.)
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from engine.decode import (Block, CacheState, ContextOverflow, DecodeConfig, Forward, Steps, drive, plan,
                           prefill_steps, run_many)
from engine.grammar import Constraint, Grammars
from engine.runtime import Interrupted
from engine.tools import Tool, for_template
from engine.loading import LoadedModel, load

log = logging.getLogger("engine.stream")

# Request priorities (`priority(text)`): the highest present runs; the others sit out for a while.
BACKGROUND, NORMAL, WAITED = 0, 1, 2

# A prompt is prefilled in chunks of about this much model time, so a conversation's long prompt
# holds the CPU from the others' steps at most this long at a time (an OS scheduler's quantum).
SLICE_S = 0.25
MIN_PREFILL_CHUNK = 16  # tokens: smaller chunks lose more throughput than they give back in latency
FIRST_PREFILL_CHUNK = 64  # before a forward has measured what a prompt token costs here
# A request alone prefills this many slices a forward: small chunks cost throughput (the 1.5B on
# two Zen 3 cores: 48 tokens/s in chunks of 16, 62 in chunks of 64, 65 in chunks of 512), but a
# reply that arrives meanwhile waits for the whole chunk (four slices of a 1,500-character message
# took 1.35 s on two Zen 5 cores beside speech recognition): so only while nobody else may come
# (`Engine.may_share`).
ALONE_SLICES = 4
# A prompt's chunk that sits out behind a less served request of its priority (a newcomer's reply)
# rejoins after this many times `max_defer_s`, a one-row step after `max_defer_s`: a chunk makes the
# round it joins a slice longer, a step hardly at all. So does a long prompt's chunk (its request
# has had more than `ALONE_SLICES` slices) while other work that someone waits for shares the
# cores (`Engine.yield_to`: the voice service's speech recognition and synthesis). Chunks that sit
# out together share that wait: each rejoins after it times their number, so beside six long
# prompts a newcomer's steps are joined by about one chunk per `PREFILL_DEFER * max_defer_s`, not
# one every round (`engine serve`: an 8-token request beside six ~1,700-token prompts).
PREFILL_DEFER = 4


def _chunk(request: "_Request") -> bool:
    """Is the request's next forward a stretch of its prompt (several rows written at once)?"""
    return request.forward is not None and len(request.forward.clean) > 1


def _long_prompt(request: "_Request") -> bool:
    """Is the request's next forward a chunk of a long prompt (one that has had more than
    `ALONE_SLICES` slices already)? Such a chunk gives way to work someone waits for."""
    return _chunk(request) and request.used_s > ALONE_SLICES * SLICE_S


class Superseded(Exception):
    """A request ended because a newer one on its conversation took its place."""


@dataclass
class Piece:
    """A committed stretch of the reply: what a caller prints, speaks or sends."""

    text: str
    token_ids: list[int]
    steps: int  # denoising steps spent on this piece's block so far
    forwards: int  # decoding forwards since the request started (the prompt's last prefill chunk included)
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
    # the reply being generated; a new turn closes it first
    active: _Request | Generator[Block, None, None] | None = None
    abandoned: bool = False  # nobody will continue it: its cache goes back to the pool (Engine.abandon)


class _Reply:
    """Turns a decoder's blocks into text pieces (incremental detokenisation, timings)."""

    def __init__(self, engine: "Engine", prompt: list[int], state: CacheState, start: float):
        self.engine, self.start = engine, start
        self.prompt_tokens = len(prompt)
        self.prefilled = len(prompt) - state.cached_prefix(prompt)
        self.ids: list[int] = []
        self.text = ""
        self.first: float | None = None

    def piece(self, block: Block) -> Piece:
        tok = self.engine.tokenizer
        self.ids += block.token_ids
        full = tok.decode(self.ids)
        if full.endswith("\ufffd") and not block.done:  # half a UTF-8 character: wait for the rest
            delta = ""
        else:
            delta, self.text = full[len(self.text):], full
        now = time.perf_counter()
        self.first = self.first or now
        reason = None
        if block.done:
            reason = "stop" if self.ids and self.ids[-1] in tok.eos_ids else "length"
        return Piece(delta, block.token_ids, block.steps, block.forwards, len(self.ids),
                     (self.first - self.start) * 1000, (now - self.start) * 1000, block.done, reason,
                     self.prompt_tokens, self.prefilled)


@dataclass
class _Probe:
    """A request for the next token's probabilities instead of a reply (`Engine.probe`)."""

    prompt: list[int]
    tokens: list[int]
    scores: list[float] = field(default_factory=list)  # filled by its forward
    state: CacheState | None = None  # the copy of the conversation's cache it runs on
    source: CacheState | None = None  # the conversation's cache when it was copied


def probe_steps(state: CacheState, new: list[int], probe: _Probe, prefill_chunk: Callable[[], int]) -> Steps:
    """Forwards writing `new` after `state`'s cached tokens; the probabilities of `probe.tokens` next."""
    rest = yield from prefill_steps(state, new, prefill_chunk)
    last, _ = yield Forward(state, rest)
    probe.scores.extend(last.float().softmax(-1)[probe.tokens].tolist())


@dataclass
class _Request:
    """A streamed request inside the scheduler."""

    messages: list[dict]
    cfg: DecodeConfig
    conversation: Conversation
    deliver: Callable  # thread-safe: hands a Piece, an exception or None (end) to the caller
    # asked each round once the first piece is out, with the text decoded so far (default NORMAL)
    priority: Callable[[str], int] | None = None
    constraint: Constraint | None = None
    tools: list[Tool] | None = None
    warm: bool = False  # only prefilling ahead of a request (Engine.warm): BACKGROUND throughout
    probe: _Probe | None = None  # only the next token's probabilities (Engine.probe): WAITED throughout
    start: float = field(default_factory=time.perf_counter)
    steps: Steps | None = None  # set when admitted (with `reply`)
    reply: _Reply | None = None
    result: object = None  # what to send into `steps` next
    forward: Forward | None = None  # the next forward, waiting for its round
    ready_since: float = 0.0  # when `forward` was planned (monotonic)
    used_s: float = 0.0  # model time its forwards took so far: the least served go first
    cancelled: bool = False

    def level(self) -> int:
        if self.warm:
            return BACKGROUND
        if self.probe is not None:
            return WAITED
        assert self.reply is not None  # only admitted requests are ranked
        if self.reply.first is None:  # nothing delivered yet: someone is waiting for it
            return WAITED
        return NORMAL if self.priority is None else self.priority(self.reply.text)


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
        `max_defer_s`: how long a lower-priority forward may sit out rounds. `max_prefill_s`: a
        request whose new prompt tokens would take longer to prefill here is refused up front
        (`ContextOverflow`) instead of running into its caller's timeout; None: never."""
        self.loaded = loaded
        self.model, self.tokenizer, self.spec = loaded.model, loaded.tokenizer, loaded.spec
        self.max_seq_len = min(max_seq_len, self.model.args.max_seq_len)
        self.decoding = decide(loaded)
        self.defaults = self.resolve(defaults or DecodeConfig())
        log.info("%s (%s): mode 'diffusion' decodes %s here: %s", loaded.name, loaded.weights,
                 "by drafted blocks" if self.decoding.mode == "diffusion" else "AR", self.decoding.why)
        self.max_batch, self.max_defer_s, self.max_prefill_s = max_batch, max_defer_s, max_prefill_s
        self.token_s: float | None = None  # model time per prompt token lately, measured on prefill forwards
        self.best_token_s: float | None = None  # ... and the least it took (the machine to itself)
        self.best_slice_token_s: float | None = None  # ... the least in chunks of about a slice
        self.forwards = 0  # batched forwards run so far
        self.interrupted = 0  # forwards stopped by `interrupt_long_prompts` (read again later)
        self._sharing = False  # more than one request is active (the scheduler's view)
        # May another request come and wait any moment? (The voice service: anyone may start talking.)
        self.may_share = False
        # Is work someone waits for running beside the engine on the same cores now?
        self.yield_to: Callable[[], bool] = lambda: False
        self._inbox: queue.Queue[_Request] = queue.Queue()
        self._scheduler: threading.Thread | None = None
        self.batch_sizes: list[int] = []  # recent forwards' batch sizes, for benchmarks
        self.pool_size = max_batch if pool_size is None else pool_size
        self._pool: list[CacheState] = []  # idle, cleared caches (any thread may take or give back)
        self._pool_lock = threading.Lock()
        self._leave_lock = threading.Lock()  # a request leaving vs its conversation being abandoned
        self.grammars = Grammars(self.tokenizer, self.model.args.vocab_size)
        # llama.cpp: one KV cache of this many tokens shared by every conversation (None: each its own)
        self.kv_tokens: int | None = getattr(self.model, "kv_tokens", None)
        # Idle caches someone keeps (engine serve's conversations kept for continuations): asked, from
        # the scheduler thread, to keep at most this many tokens when a request needs the room.
        self.release_idle: Callable[[int], None] = lambda tokens: None
        self._queued: list[_Request] = []  # waiting for room in the shared KV cache, first come first served

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

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per prefill forward while others share the model: about `SLICE_S` of model time."""
        if self.token_s is None:
            return FIRST_PREFILL_CHUNK
        return max(MIN_PREFILL_CHUNK, int(SLICE_S / self.token_s))

    def _chunking(self, background: bool = False) -> Callable[[], int]:
        """A request's prefill chunk, asked before each: `ALONE_SLICES` times the shared one while
        it has the model to itself and nobody else may come (`may_share`), unless it is BACKGROUND
        (someone may come and wait any moment) or a token's cost is not measured yet."""
        return lambda: self.prefill_chunk * (1 if background or self._sharing or self.token_s is None
                                             or self.may_share else ALONE_SLICES)

    def prefill_s(self, tokens: int, sliced: bool = False) -> float | None:
        """The least that prefilling `tokens` new prompt tokens takes here, in big chunks or a slice
        at a time (`sliced`: ~1.4x the cost a token on two Zen 5 cores); None: not measured yet."""
        best = self.best_slice_token_s if sliced and self.best_slice_token_s is not None else self.best_token_s
        return None if best is None else tokens * best

    def _affordable(self, prompt: list[int], state: CacheState | None, others: int = 0) -> None:
        """Refuse a prompt whose new tokens would take longer than `max_prefill_s` to prefill: at the
        fastest cost measured for the chunks it will be read in, times its share of the model: the
        conversations served now (`others`: the scheduler gives each an equal share, so a prefill
        that fits alone may not fit beside them), and at least half while others may come."""
        new = len(prompt) - (state.cached_prefix(prompt) if state is not None else 0)
        alone = self.prefill_s(new, sliced=bool(others) or self.may_share)
        shares = max(1 + others, 2 if self.may_share else 1)
        if self.max_prefill_s is None or alone is None or alone * shares <= self.max_prefill_s:
            return
        shared = (f", shared with {others} other conversation{'s' if others > 1 else ''} now" if others
                  else ", half of it kept for the other sessions" if self.may_share else "")
        raise ContextOverflow(f"the prompt's {new} new tokens would take about {alone * shares:.0f} s to read "
                              f"on this machine{shared}, longer than the {self.max_prefill_s:g} s a reply may wait: "
                              f"shorten the conversation or the message")

    def _refuse_late(self, active: list[_Request]) -> None:
        """Each round, a reply still reading its prompt that can no longer deliver within
        `max_prefill_s` of its start is refused (`ContextOverflow`), not left to run into its
        caller's timeout: its tokens left at the recent cost a token (`token_s`: what the machine
        gives now, beside whatever else runs on it) or the fastest, whichever is more, times the
        conversations sharing the model now. Newest first, each refusal leaving the others a
        larger share: those that came first keep their place (three Realtime clients sending
        2,000 characters at once all timed out at 20 s)."""
        best = self.best_slice_token_s or self.best_token_s
        if self.max_prefill_s is None or best is None:
            return
        token_s = max(best, self.token_s or best)
        shares = sum(1 for r in active if not r.warm and not r.cancelled)
        now = time.perf_counter()
        for request in sorted(active, key=lambda r: r.start, reverse=True):
            reply, state = request.reply, request.conversation.state
            if request.warm or request.probe is not None or request.cancelled or reply is None or \
                    reply.first is not None or state is None:
                continue
            left = reply.prefilled - (len(state.ids) - (reply.prompt_tokens - reply.prefilled))
            waited, needs = now - request.start, left * token_s * shares
            if left <= 0 or waited + needs <= self.max_prefill_s:
                continue
            request.deliver(ContextOverflow(
                f"the prompt's {left} tokens still to read would take about {needs:.0f} s more on this machine now"
                f"{f', shared with {shares - 1} other conversation(s)' if shares > 1 else ''}: past the "
                f"{self.max_prefill_s:g} s a reply may wait: shorten the conversation or the message, or retry"))
            request.cancelled = True  # `_ready` closes its steps and lets its conversation go
            shares -= 1

    def _begin(self, messages: list[dict], cfg: DecodeConfig, conversation: Conversation, start: float,
               constraint: Constraint | None = None, tools: list[Tool] | None = None, background: bool = False,
               others: int = 0) -> tuple[Steps, _Reply]:
        """Plan a reply on `conversation` (closing one still running there) beside `others` being served."""
        cfg = self.resolve(cfg)
        prompt = self.prompt_ids(messages, tools)
        if not background:  # a warm has no one waiting: it may take as long as it takes
            self._affordable(prompt, conversation.state, others)
        if conversation.active is not None:
            self._close(conversation.active)
        if conversation.state is None:
            conversation.state = self._take_cache()
        reply = _Reply(self, prompt, conversation.state, start)
        steps = plan(conversation.state, prompt, cfg, self.spec, self.tokenizer.eos_ids, self.loaded.drafter,
                     self.model.embed_tokens, constraint, self._chunking(background))
        return steps, reply

    def _take_cache(self) -> CacheState:
        """An idle cache from the pool, or a new one when none is idle."""
        with self._pool_lock:
            if self._pool:
                return self._pool.pop()
        return CacheState.new(self.model, self.max_seq_len)

    def abandon(self, conversation: Conversation) -> None:
        """Nobody will continue `conversation` (any thread): its cache goes back to the pool now if
        no request runs on it, else when that request leaves."""
        with self._leave_lock:
            conversation.abandoned = True
            if conversation.active is None:
                self._give_back(conversation)

    def _give_back(self, conversation: Conversation) -> None:
        """Take `conversation`'s cache for the pool, cleared (dropped if the pool is full)."""
        state, conversation.state = conversation.state, None
        if state is not None:
            state.clear()
            with self._pool_lock:
                if len(self._pool) < self.pool_size:
                    self._pool.append(state)

    @staticmethod
    def _close(active: _Request | Generator[Block, None, None]) -> None:
        if isinstance(active, _Request):
            active.cancelled = True
            if active.steps is not None:
                active.steps.close()
        else:
            active.close()

    # --- one request, in the calling thread (CLI, eval, benchmarks) ---------------------------

    def generate_sync(self, messages: list[dict], cfg: DecodeConfig | None = None,
                      conversation: Conversation | None = None, constraint: Constraint | None = None,
                      tools: list[Tool] | None = None, **overrides: Any) -> Iterator[Piece]:
        """Pieces of the reply to `messages`, decoded in the calling thread (as `stream`)."""
        cfg = replace(cfg or self.defaults, **overrides)
        conversation = conversation or Conversation(abandoned=True)  # a one-off: nobody continues it
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
                self._give_back(conversation)

    # --- many requests, batched by the scheduler thread ---------------------------------------

    async def stream(self, messages: list[dict], cfg: DecodeConfig | None = None,
                     conversation: Conversation | None = None, priority: Callable[[str], int] | None = None,
                     constraint: Constraint | None = None, tools: list[Tool] | None = None, warm: bool = False,
                     probe: _Probe | None = None, **overrides: Any) -> AsyncGenerator[Piece, None]:
        """Pieces as they are committed; closing the iterator cancels the request. Until its first
        piece the request is WAITED, then `priority(text)` (NORMAL if None), `text` being what is
        decoded so far: the caller's next piece may already decide its priority before it arrives.
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

        request = _Request(messages, replace(cfg or self.defaults, **overrides),
                           conversation or Conversation(abandoned=True), deliver, priority, constraint, tools, warm,
                           probe)
        self._ensure_scheduler()
        self._inbox.put(request)
        if not warm:
            self.interrupt_long_prompts()
        try:
            while (item := await pieces.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.cancelled = True

    async def warm(self, messages: list[dict], conversation: Conversation, tools: list[Tool] | None = None) -> None:
        """Prefill `messages` into `conversation`'s cache ahead of its next request, which then
        prefills only what is new (the voice service warms a session's system prompt and tools
        while its user speaks). BACKGROUND priority; the one token it decodes is dropped."""
        try:
            async for _ in self.stream(messages, conversation=conversation, tools=tools, warm=True, max_new_tokens=1):
                pass
        except Superseded:  # the request it was warming for came first, and continues from what it wrote
            pass

    async def probe(self, prompt: list[int], tokens: list[int], conversation: Conversation | None = None
                    ) -> list[float]:
        """The model's probability of each of `tokens` right after `prompt` (ids), from one forward
        that someone waits for (WAITED). On `conversation` it runs on a copy of that conversation's
        cache, so only the prompt's uncached tail is prefilled and a reply running there is never
        disturbed; if the conversation is idle when it ends, the copy becomes its cache, so a reply
        whose prompt starts with `prompt` prefills only what follows (the voice service asks whether
        the user's turn is over on the words its reply will start from)."""
        request = _Probe(prompt, tokens)
        async for _ in self.stream([], conversation=conversation, probe=request):
            pass  # a probe delivers no pieces
        return request.scores

    def _begin_probe(self, probe: _Probe, conversation: Conversation, start: float, others: int
                     ) -> tuple[Steps, _Reply]:
        if len(probe.prompt) >= self.max_seq_len:
            raise ContextOverflow(f"a prompt of {len(probe.prompt)} tokens does not fit the context "
                                  f"of {self.max_seq_len}")
        self._affordable(probe.prompt, conversation.state, others)
        probe.source = conversation.state
        probe.state = self._take_cache()
        if probe.source is not None and probe.source.ids:
            probe.source.fork(self.model, into=probe.state)
        reply = _Reply(self, probe.prompt, probe.state, start)
        return probe_steps(probe.state, probe.state.reuse_for(probe.prompt), probe, self._chunking()), reply

    def _settle_probe(self, probe: _Probe, conversation: Conversation) -> None:
        """A finished probe's cache becomes its conversation's if that is idle and still has the cache
        the probe copied; otherwise, and the replaced one, it goes back to the pool (the caller holds
        `_leave_lock`)."""
        keep, spare = probe.state, None
        if keep is not None and probe.scores and not conversation.abandoned and conversation.active is None \
                and conversation.state is probe.source:
            keep, spare, conversation.state = None, conversation.state, keep
        for state in (keep, spare):
            if state is not None:
                state.clear()
                with self._pool_lock:
                    if len(self._pool) < self.pool_size:
                        self._pool.append(state)

    def interrupt_long_prompts(self) -> None:
        """Someone waits now (a new request; the voice service's speech recognition or synthesis
        for a silent user): a forward of long prompts' chunks only, running now, stops (on kernels
        that can stop one) and its chunks are read again after the others' turn, so nobody waits
        for a chunk already under way."""
        self.model.interrupt()

    def _ensure_scheduler(self) -> None:
        if self._scheduler is None:
            self._scheduler = threading.Thread(target=self._schedule, name="engine-scheduler", daemon=True)
            self._scheduler.start()

    def _schedule(self) -> None:
        active: list[_Request] = []
        while True:
            self._admit_new(active, timeout=0 if active or self._queued else None)
            self._refuse_late(active)
            self._sharing = len(active) > 1  # (before `_ready` plans the next forwards and their chunks)
            batch_from = self._this_round(self._ready(active))
            if not batch_from:  # everyone sits out this round: look for newcomers meanwhile
                self._admit_new(active, timeout=0.005)
                continue
            for i in range(0, len(batch_from), self.max_batch):
                batch = batch_from[i:i + self.max_batch]
                self.batch_sizes = (self.batch_sizes + [len(batch)])[-1000:]
                forwards = cast("list[Forward]", [request.forward for request in batch])  # `_ready` planned them
                rows = [len(f.clean) + len(f.draft) for f in forwards]
                results: Sequence[object] | None
                began = time.perf_counter()
                try:
                    results = run_many(self.model, forwards, interruptible=all(map(_long_prompt, batch)))
                except Interrupted:
                    results = None
                except Exception as err:  # one bad batch fails its requests, not the scheduler
                    log.exception("batched forward failed")
                    results = [err] * len(batch)
                took = time.perf_counter() - began
                for request, n in zip(batch, rows):  # each is charged its rows' share, stopped or not
                    request.used_s += took * n / max(sum(rows), 1)
                if results is None:  # the same forwards, planned still, sit out as if deferred
                    self.interrupted += 1
                    log.debug("a forward of %d rows of long prompts stopped after %.0f ms: someone waits",
                              sum(rows), 1000 * took)
                    for request in batch:
                        request.ready_since = time.monotonic()
                    continue
                self._measure(forwards, took)
                for request, result in zip(batch, results):
                    request.result, request.forward = result, None

    def _measure(self, forwards: list[Forward], took: float) -> None:
        """Learn what a prompt token costs from forwards of many rows (prefill, mostly); not from
        the first forward, which also pages the weights in (8 s for 64 tokens of the 1.5B here)."""
        tokens = sum(len(f.clean) + len(f.draft) for f in forwards)
        self.forwards += 1
        if tokens >= MIN_PREFILL_CHUNK and self.forwards > 1:
            sample = took / tokens
            if tokens <= 2 * self.prefill_chunk:  # a slice's worth: the rate of a prompt read beside others
                self.best_slice_token_s = min(sample, self.best_slice_token_s or sample)
            self.token_s = sample if self.token_s is None else 0.7 * self.token_s + 0.3 * sample
            self.best_token_s = min(sample, self.best_token_s or sample)

    def _admit_new(self, active: list[_Request], timeout: float | None) -> None:
        """Admit the queued requests there is room for now, then whatever is in the inbox, first
        waiting up to `timeout` s for it (None: forever)."""
        while self._queued and (self._queued[0].cancelled or self._room_for(self._queued[0], active)):
            request = self._queued.pop(0)
            if not request.cancelled:  # (one whose caller left was never admitted: nothing to let go)
                self._admit(request, active, queued=True)
        if timeout is None and (active or self._queued):
            timeout = 0
        try:
            request = self._inbox.get(timeout=timeout) if timeout != 0 else self._inbox.get_nowait()
            while True:
                self._admit(request, active)
                request = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _ready(self, active: list[_Request]) -> list[_Request]:
        """Plan each request's next forward (finished and cancelled requests leave `active`)."""
        for request in list(active):
            if request.forward is None or request.cancelled:
                request.forward, request.ready_since = self._advance(request), time.monotonic()
                if request.forward is None:
                    active.remove(request)
        return active

    def _this_round(self, ready: list[_Request]) -> list[_Request]:
        """The least served requests of the highest priority present (unless that is BACKGROUND):
        a newcomer goes ahead of a conversation that has had the model for a while (a long
        prompt's prefill); and those that have sat out `max_defer_s` (a prompt's chunk behind a
        newcomer of its priority, or a long prompt's while `yield_to`, `PREFILL_DEFER` times that,
        and as many times again as such chunks sit out together: with six long prompts one of them
        was due every round, and each of a newcomer's steps took a slice longer)."""
        levels = [request.level() for request in ready]
        top, now = max(levels, default=NORMAL), time.monotonic()
        least = min((r.used_s for r, level in zip(ready, levels) if level == top), default=0.0)
        yielding = self.yield_to()
        behind_chunks = sum(1 for r, level in zip(ready, levels)
                            if level == top > BACKGROUND and _chunk(r) and r.used_s > least + SLICE_S)

        def due(request: _Request, level: int) -> bool:
            waited, patient = now - request.ready_since, self.max_defer_s * PREFILL_DEFER
            if yielding and _long_prompt(request) and waited < patient:
                return False
            if level == top > BACKGROUND and request.used_s <= least + SLICE_S:
                return True
            behind = level == top > BACKGROUND and _chunk(request)
            return waited >= (patient * max(1, behind_chunks) if behind else self.max_defer_s)
        chosen = [request for request, level in zip(ready, levels) if due(request, level)]
        # One prompt chunk a round: a round is then at most a slice longer than its steps, and a
        # reply that arrives meanwhile waits for at most that. First one deferred long enough (the
        # one that has waited longest), else the least served's: a newcomer's prompt goes ahead of
        # long prompts that have had less than a slice each so far (six sent 2 s before an 8-token
        # request each went first, a chunk of seconds on a loaded machine).
        def order(r: _Request) -> tuple[bool, float, float]:
            front = r.used_s <= least + SLICE_S
            return front, r.used_s if front else 0.0, r.ready_since
        chunks = sorted((r for r in chosen if _chunk(r)), key=order)
        return [r for r in chosen if not _chunk(r)] + chunks[:1]

    def _room_for(self, request: _Request, active: list[_Request]) -> bool:
        """Is there room in the shared KV cache (llama.cpp's) for the request's whole prompt and
        reply beside those of the requests running, if idle caches kept for later give theirs up?
        Always while nothing runs: one request always fits (the cache holds several contexts)."""
        if self.kv_tokens is None or request.warm or request.probe is not None or not active:
            return True
        running = sum(r.reply.prompt_tokens + r.cfg.max_new_tokens for r in active
                      if r.reply is not None and r.probe is None and r.conversation is not request.conversation)
        try:
            prompt = self.prompt_ids(request.messages, request.tools)
        except Exception:  # noqa: BLE001 - `_begin` meets it again and hands it to the request
            return True
        left = self.kv_tokens - running - len(prompt) - request.cfg.max_new_tokens
        if left < 0:
            return False
        self.release_idle(left)
        return True

    def _admit(self, request: _Request, active: list[_Request], queued: bool = False) -> None:
        """Start the request beside `active`; or, on a shared KV cache without room for it now, queue
        it until there is (a request failing with "the LM's cache is full" after minutes of work, as
        two of six ~1,700-token prompts did on the 1.5B, is worse than one that waits its turn)."""
        conversation = request.conversation
        if not queued and not request.warm and request.probe is None and \
                (self._queued or not self._room_for(request, active)):
            self._queued.append(request)
            return
        others = sum(1 for r in active if not r.warm and r.conversation is not conversation)  # someone waits on them
        if request.probe is not None:  # beside the conversation's reply, on a copy of its cache
            try:
                request.steps, request.reply = self._begin_probe(request.probe, conversation, request.start, others)
            except Exception as err:  # noqa: BLE001 - the request that caused it gets it, the others go on
                request.deliver(err)
                self._leave(request)
                return
            active.append(request)
            return
        if isinstance(conversation.active, _Request) and conversation.active in active:
            active.remove(conversation.active)
            conversation.active.deliver(Superseded("a newer request on this conversation took its place"))
        try:
            request.steps, request.reply = self._begin(request.messages, request.cfg, conversation, request.start,
                                                       request.constraint, request.tools, request.warm, others)
        except Exception as err:  # noqa: BLE001 - the request that caused it gets it, the others go on
            request.deliver(err)
            self._leave(request)
            return
        conversation.active = request
        active.append(request)

    def _advance(self, request: _Request) -> Forward | None:
        """Run the request's decoder up to its next forward, handing out blocks on the way."""
        assert request.steps is not None and request.reply is not None  # set when admitted
        if request.cancelled:
            request.steps.close()
            self._leave(request)
            return None
        try:
            while True:
                if isinstance(request.result, BaseException):
                    raise request.result
                item = request.steps.send(request.result)
                request.result = None
                if isinstance(item, Forward):
                    return item
                request.deliver(request.reply.piece(item))
        except StopIteration:
            request.deliver(None)
        except Exception as err:  # noqa: BLE001 - the request that caused it gets it, the others go on
            request.deliver(err)
        self._leave(request)
        return None

    def _leave(self, request: _Request) -> None:
        """The request is over (finished, failed or cancelled): its conversation lets go of it (else
        the two keep each other, and the cache, alive until a full garbage collection), and an
        abandoned conversation's cache (a one-off's, or one Engine.abandon was called for) goes back
        to the pool."""
        with self._leave_lock:
            if request.probe is not None:
                self._settle_probe(request.probe, request.conversation)
                return
            if request.conversation.active is request:
                request.conversation.active = None
            if request.conversation.abandoned:
                self._give_back(request.conversation)
