"""Conversations' KV caches, and the pool of idle ones.

Each conversation keeps its own cache, so a new turn only prefills what is new. A request made
without a conversation (a one-off) runs on a cache borrowed from the pool and gives it back,
cleared, when it finishes or is cancelled, and so does a conversation the caller abandons
(`engine serve`'s, when nobody continues it): steady-state serving allocates no new ~100 MB
caches. (Allocating one per request let glibc's heap keep growing with freed, still-resident
caches: RSS rose by hundreds of MB per 100 requests. bench/serve_soak.py measures it.)

A conversation also starts from what another one has read (`CachePool.share`): every voice session's
prompt begins with the same system prompt, and on two busy cores reading its 34 tokens again took
0.6-0.7 s of a new caller's first reply. A voice session also reads the turns its history will keep
into a cache aside (`LocalChat.aside`), and the turn after the history forgets copies them from there.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.runtime import CacheState


class Closable(Protocol):
    """What runs on a conversation's cache: a scheduled request, or a reply decoded in the caller's thread."""

    def close(self) -> None: ...


@dataclass
class ConversationCache:
    """A conversation's KV cache and the reply running on it; reuse one across turns so earlier
    turns are not prefilled again. (The voice service's conversation is its Session; each keeps one
    of these through its `LocalChat`.)"""

    state: CacheState | None = None
    active: Closable | None = None  # the reply being generated; a new turn closes it first
    abandoned: bool = False  # nobody will continue it: its cache goes back to the pool (CachePool.abandon)


class CachePool:
    """Idle, cleared caches of one model (any thread may take or give back), at most `size` kept."""

    def __init__(self, new: Callable[[], CacheState], size: int):
        self.new, self.size = new, size
        self.idle: list[CacheState] = []
        self.made: list[weakref.ref[CacheState]] = []  # every cache it made, for `share`
        self.lock = threading.Lock()
        self.leave_lock = threading.Lock()  # a request leaving vs its conversation being abandoned

    def take(self) -> CacheState:
        """An idle cache from the pool, or a new one when none is idle."""
        with self.lock:
            if self.idle:
                return self.idle.pop()
        state = self.new()
        with self.lock:
            self.made = [ref for ref in self.made if ref() is not None] + [weakref.ref(state)]
        return state

    def holder(self, state: CacheState | None, prompt: list[int]) -> tuple[CacheState | None, int]:
        """The cache holding the longest prefix of `prompt` and that prefix's length: `state` itself
        (or None, with nothing held) unless another cache holds more."""
        best = state.cached_prefix(prompt) if state is not None else 0
        source = state
        with self.lock:
            others = [other for ref in self.made if (other := ref()) is not None and other is not state]
        for other in others:
            if (n := other.cached_prefix(prompt)) > best:
                best, source = n, other
        return source, best

    def share(self, state: CacheState, prompt: list[int], copy: Callable[[CacheState, CacheState, int], None]) -> int:
        """Start `state` from the longest prefix of `prompt` another cache holds, if longer than its own:
        `copy(source, state, n)` (the model's `copy_cache`; llama.cpp shares the cells). Call it where
        no forward runs on either (the scheduler's thread, between rounds). Returns the tokens gained."""
        own = state.cached_prefix(prompt)
        source, best = self.holder(state, prompt)
        if source is None or source is state:
            return 0
        copy(source, state, best)
        state.ids, state.blocks = source.ids[:best], list(source.blocks)
        state.reuse_for(prompt)  # drops the blocks past what was copied, as a conversation's own turn does
        return best - own

    def put(self, state: CacheState) -> None:
        """Keep `state`, cleared, for the next taker (dropped if the pool is full)."""
        state.clear()
        with self.lock:
            if len(self.idle) < self.size:
                self.idle.append(state)

    def give_back(self, conversation: ConversationCache) -> None:
        """Take `conversation`'s cache for the pool."""
        state, conversation.state = conversation.state, None
        if state is not None:
            self.put(state)

    def abandon(self, conversation: ConversationCache) -> None:
        """Nobody will continue `conversation` (any thread): its cache goes back to the pool now if
        no request runs on it, else when that request leaves."""
        with self.leave_lock:
            conversation.abandoned = True
            if conversation.active is None:
                self.give_back(conversation)
