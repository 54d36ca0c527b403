"""A request inside the engine, and what it hands its caller: `Piece`s of committed text, made
from a decoder's blocks by `Reply` (incremental detokenisation, timings). When a request's reader
runs out of text (`Request.runs_out`, on the monotonic clock) is what the scheduler orders rounds
by; the caller says when that is (voice/pipeline/lm.py: when the listener's audio runs out)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.decode import Block, DecodeConfig, Steps
from engine.grammar import Constraint
from engine.runtime import CacheState, Forward
from engine.serving.caches import ConversationCache
from engine.tokenizer import Tokenizer
from engine.tools import Tool


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


class Reply:
    """Turns a decoder's blocks into text pieces (incremental detokenisation, timings)."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], state: CacheState, start: float):
        self.tokenizer, self.start = tokenizer, start
        self.prompt_tokens = len(prompt)
        self.prefilled = len(prompt) - state.cached_prefix(prompt)
        self.ids: list[int] = []
        self.text = ""
        self.first: float | None = None

    def piece(self, block: Block) -> Piece:
        tok = self.tokenizer
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
class Probe:
    """A request for the next token's probabilities instead of a reply (`Engine.probe`)."""

    prompt: list[int]
    tokens: list[int]
    scores: list[float] = field(default_factory=list)  # filled by its forward
    state: CacheState | None = None  # the copy of the conversation's cache it runs on
    source: CacheState | None = None  # the conversation's cache when it was copied


@dataclass
class Request:
    """A streamed request inside the scheduler."""

    messages: list[dict]
    cfg: DecodeConfig
    conversation: ConversationCache
    deliver: Callable  # thread-safe: hands a Piece, an exception or None (end) to the caller
    # asked each round once the first piece is out, with the text decoded so far: when its reader runs
    # out of text (monotonic; -inf: they wait now; inf, the default: nobody waits on a clock)
    deadline: Callable[[str], float] | None = None
    constraint: Constraint | None = None
    tools: list[Tool] | None = None
    warm: bool = False  # only prefilling ahead of a request (Engine.warm): nobody waits, it sits out throughout
    probe: Probe | None = None  # only the next token's probabilities (Engine.probe): waited for throughout
    start: float = field(default_factory=time.perf_counter)
    steps: Steps | None = None  # set when admitted (with `reply`)
    reply: Reply | None = None
    result: object = None  # what to send into `steps` next
    forward: Forward | None = None  # the next forward, waiting for its round
    ready_since: float = 0.0  # when `forward` was planned (monotonic)
    used_s: float = 0.0  # model time its forwards took so far: the least served go first
    cancelled: bool = False
    needs: int | None = None  # its prompt's and reply's tokens, once counted (Admission.tokens)

    def prompt_left(self) -> int:
        """Prompt tokens not read into the cache yet (0 once the reply has begun)."""
        reply, state = self.reply, self.conversation.state
        if reply is None or state is None or reply.first is not None:
            return 0
        return max(0, reply.prefilled - (len(state.ids) - (reply.prompt_tokens - reply.prefilled)))

    def rows_left(self) -> int:
        """The most rows of model work the request still needs: its prompt's tokens not read yet
        and its reply's tokens not decoded yet (`max_new_tokens` at most)."""
        decoded = len(self.reply.ids) if self.reply is not None else 0
        return self.prompt_left() + max(0, self.cfg.max_new_tokens - decoded)

    def runs_out(self) -> float:
        """When its reader runs out of text (monotonic): -inf until its first piece (someone waits for
        it now), then what its `deadline` says; inf for a warm (nobody waits for it)."""
        if self.warm:
            return math.inf
        if self.probe is not None:
            return -math.inf
        assert self.reply is not None  # only admitted requests are ranked
        if self.reply.first is None:
            return -math.inf
        return math.inf if self.deadline is None else self.deadline(self.reply.text)

    def close(self) -> None:
        """A newer turn on its conversation takes its place: it stops at the next round."""
        self.cancelled = True
        if self.steps is not None:
            self.steps.close()
