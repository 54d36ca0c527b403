"""Who is admitted, who waits and who is refused: a prompt whose new tokens would take longer
than `max_prefill_s` to read is refused before any forward (`affordable`), and again later, as the
load changes, if it can no longer be read within that (`refuse_late`); on a KV cache shared by
every conversation (llama.cpp's), a request waits for room for its prompt and reply (`room_for`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.runtime import ContextOverflow
from engine.serving.cost import PrefillCost
from engine.serving.requests import Request
from engine.tools import Tool


class Admission:
    def __init__(self, cost: PrefillCost, prompt_ids: Callable[[list[dict], list[Tool] | None], list[int]],
                 max_prefill_s: float | None = None, kv_tokens: int | None = None):
        """`max_prefill_s`: a request whose new prompt tokens would take longer to prefill here is
        refused up front (`ContextOverflow`) instead of running into its caller's timeout; None: never.
        `kv_tokens`: llama.cpp's one KV cache of this many tokens shared by every conversation (None:
        each its own)."""
        self.cost, self.prompt_ids = cost, prompt_ids
        self.max_prefill_s, self.kv_tokens = max_prefill_s, kv_tokens
        # May another request come and wait any moment? (The voice service: anyone may start talking.)
        self.may_share = False
        # Idle caches someone keeps (engine serve's conversations kept for continuations): asked, from
        # the scheduler thread, to keep at most this many tokens when a request needs the room.
        self.release_idle: Callable[[int], None] = lambda tokens: None

    def affordable(self, prompt: list[int], cached: int, others: int = 0) -> None:
        """Refuse a prompt whose new tokens would take longer than `max_prefill_s` to prefill: at the
        fastest cost measured for the chunks it will be read in, times its share of the model: the
        conversations served now (`others`: the scheduler gives each an equal share, so a prefill
        that fits alone may not fit beside them), and at least half while others may come. `cached`:
        the prompt's first tokens it need not read (its conversation's cache, or another's: `CachePool.holder`)."""
        new = len(prompt) - cached
        alone = self.cost.prefill_s(new, sliced=bool(others) or self.may_share)
        shares = max(1 + others, 2 if self.may_share else 1)
        if self.max_prefill_s is None or alone is None or alone * shares <= self.max_prefill_s:
            return
        shared = (f", shared with {others} other conversation{'s' if others > 1 else ''} now" if others
                  else ", half of it kept for the other sessions" if self.may_share else "")
        raise ContextOverflow(f"the prompt's {new} new tokens would take about {alone * shares:.0f} s to read "
                              f"on this machine{shared}, longer than the {self.max_prefill_s:g} s a reply may wait: "
                              f"shorten the conversation or the message")

    def refuse_late(self, active: list[Request]) -> None:
        """Each round, a reply still reading its prompt that can no longer deliver within
        `max_prefill_s` of its start is refused (`ContextOverflow`), not left to run into its
        caller's timeout: its tokens left at the recent cost a token (`token_s`: what the machine
        gives now, beside whatever else runs on it) or the fastest, whichever is more, times the
        conversations sharing the model now. Newest first, each refusal leaving the others a
        larger share: those that came first keep their place (three Realtime clients sending
        2,000 characters at once all timed out at 20 s)."""
        best = self.cost.best_slice_token_s or self.cost.best_token_s
        if self.max_prefill_s is None or best is None:
            return
        token_s = max(best, self.cost.token_s or best)
        shares = sum(1 for r in active if not r.warm and not r.cancelled)
        now = time.perf_counter()
        for request in sorted(active, key=lambda r: r.start, reverse=True):
            if request.warm or request.probe is not None or request.cancelled:
                continue
            left = request.prompt_left()
            waited, needs = now - request.start, left * token_s * shares
            if left <= 0 or waited + needs <= self.max_prefill_s:
                continue
            request.deliver(ContextOverflow(
                f"the prompt's {left} tokens still to read would take about {needs:.0f} s more on this machine now"
                f"{f', shared with {shares - 1} other conversation(s)' if shares > 1 else ''}: past the "
                f"{self.max_prefill_s:g} s a reply may wait: shorten the conversation or the message, or retry"))
            request.cancelled = True  # the scheduler closes its steps and lets its conversation go
            shares -= 1

    def room_for(self, request: Request, active: list[Request]) -> bool:
        """Is there room in the shared KV cache (llama.cpp's) for the request's whole prompt and
        reply beside those of the requests running, if idle caches kept for later give theirs up?
        Always while nothing runs: one request always fits (the cache holds several contexts)."""
        if self.kv_tokens is None or request.warm or request.probe is not None or not active:
            return True
        running = sum(r.reply.prompt_tokens + r.cfg.max_new_tokens for r in active
                      if r.reply is not None and r.probe is None and r.conversation is not request.conversation)
        needs = self.tokens(request)
        if needs is None:
            return True
        left = self.kv_tokens - running - needs
        if left < 0:
            return False
        self.release_idle(left)
        return True

    def tokens(self, request: Request) -> int | None:
        """The cache cells the request's prompt and reply take at most (None: its prompt cannot be built;
        its planning meets that again and hands it to the request). Counted once per request."""
        if request.needs is None:
            try:
                request.needs = len(self.prompt_ids(request.messages, request.tools)) + request.cfg.max_new_tokens
            except Exception:  # noqa: BLE001 - see above
                return None
        return request.needs
