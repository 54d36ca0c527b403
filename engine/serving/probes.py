"""End-of-turn probes: the model's probability of some tokens right after a prompt, from one
forward someone waits for (the voice service asks whether the user's turn is over). A probe on a
conversation runs on a copy of its cache, so only the prompt's uncached tail is prefilled and a
reply running there is never disturbed; if the conversation is idle when it ends, the copy becomes
its cache, so a reply whose prompt starts with the probe's prefills only what follows."""

from __future__ import annotations

from collections.abc import Callable

from engine.decode import Steps, prefill_steps
from engine.runtime import CacheState, Forward, Model
from engine.serving.caches import CachePool, ConversationCache
from engine.serving.requests import Probe, Reply
from engine.tokenizer import Tokenizer


def probe_steps(state: CacheState, new: list[int], probe: Probe, prefill_chunk: Callable[[], int]) -> Steps:
    """Forwards writing `new` after `state`'s cached tokens; the probabilities of `probe.tokens` next."""
    rest = yield from prefill_steps(state, new, prefill_chunk)
    last, _ = yield Forward(state, rest)
    probe.scores.extend(last.float().softmax(-1)[probe.tokens].tolist())


def begin(probe: Probe, conversation: ConversationCache, model: Model, pool: CachePool, tokenizer: Tokenizer,
          start: float, prefill_chunk: Callable[[], int]) -> tuple[Steps, Reply]:
    """The probe's steps, on a pooled copy of `conversation`'s cache."""
    probe.source = conversation.state
    probe.state = pool.take()
    if probe.source is not None and probe.source.ids:
        probe.source.fork(model, into=probe.state)
    reply = Reply(tokenizer, probe.prompt, probe.state, start)
    return probe_steps(probe.state, probe.state.reuse_for(probe.prompt), probe, prefill_chunk), reply


def settle(probe: Probe, conversation: ConversationCache, pool: CachePool) -> None:
    """A finished probe's cache becomes its conversation's if that is idle and still has the cache
    the probe copied; otherwise, and the replaced one, it goes back to the pool (the caller holds
    the pool's `leave_lock`)."""
    keep, spare = probe.state, None
    if keep is not None and probe.scores and not conversation.abandoned and conversation.active is None \
            and conversation.state is probe.source:
        keep, spare, conversation.state = None, conversation.state, keep
    for state in (keep, spare):
        if state is not None:
            pool.put(state)
