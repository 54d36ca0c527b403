"""Serving memory: one-off requests (the HTTP server's) run on a small pool of reused KV caches,
and a finished or cancelled request lets go of its cache at once.

Regression for `engine serve` RSS growing by hundreds of MB per 100 requests, many cancelled
mid-stream (bench/serve_soak.py): every request allocated a fresh ~100 MB cache that glibc's heap
kept after it was freed, and a cancelled request stayed in a reference cycle with its conversation
(`ConversationCache.active` pointed back at it), cache and all, until a full garbage collection.
The tests run with the cyclic garbage collector off, so only what is really let go is freed.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
import weakref
from types import SimpleNamespace

import openai
import pytest
import torch

from engine.decode import CacheState, DecodeConfig
from engine.loading import load
from engine.api.server import build_app
from engine.stream import ConversationCache, Engine

import tinyckpt
from liveserver import serving

pytestmark = pytest.mark.slow

CHATS = [[{"role": "user", "content": text}] for text in ("hello there", "the weather is nice", "a b c d e f",
                                                          "tell me about the moon")]


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """A tiny model on a shared 2-core box: one intra-op thread is fastest."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_memory")
    tinyckpt.write_hf_folder(folder, "llama", tie=True, seed=3)
    return load(str(folder), max_seq_len=128)


POOL = 8  # Engine's default pool size: its default max_batch


@pytest.fixture
def caches(monkeypatch):
    """The CacheStates made during the test: `made` (how many) and `alive()` (those not yet freed)."""
    refs: list[weakref.ref] = []
    seen = SimpleNamespace(made=0, alive=lambda: [state for state in (r() for r in refs) if state is not None])
    new = CacheState.new

    def counting(model, max_seq_len=None):
        state = new(model, max_seq_len)
        seen.made += 1
        refs.append(weakref.ref(state))
        return state

    monkeypatch.setattr(CacheState, "new", staticmethod(counting))
    return seen


def settled(caches, kept: int = 0) -> bool:
    """At most the pool's number of caches is alive, all cleared but the `kept` ones: every request
    has given its back."""
    alive = caches.alive()
    return len(alive) <= POOL + kept and sum(bool(state.ids) for state in alive) <= kept


@pytest.fixture
def no_cyclic_gc():
    """Only reference counting frees objects: a reference cycle shows as memory still held."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def reply_ids(pieces) -> list[int]:
    return [t for p in pieces for t in p.token_ids]


def test_cancelled_and_finished_streams_reuse_the_pool(tiny, caches, no_cyclic_gc):
    """40 one-off streams, 4 at a time, every other one cancelled after its first piece: they share
    at most `pool_size` caches, none is allocated once the pool is warm, and none outlives the pool."""
    engine = Engine(tiny, max_seq_len=128, defaults=DecodeConfig(max_new_tokens=8))

    async def one(i: int) -> None:
        stream = engine.stream(CHATS[i % len(CHATS)], max_new_tokens=8 + i % 5)
        async for _ in stream:
            if i % 2:
                break  # hang up after the first piece
        await stream.aclose()

    async def main(start: int) -> None:
        for first in range(start, start + 20, 4):
            await asyncio.gather(*(one(i) for i in range(first, first + 4)))

    asyncio.run(main(0))
    assert wait_until(lambda: settled(caches)), f"{len(caches.alive())} caches still held after 20 requests"
    warm = caches.made
    assert warm <= POOL  # at most two per client: one being given back, one being taken
    asyncio.run(main(20))
    assert wait_until(lambda: settled(caches)), f"{len(caches.alive())} caches still held after 40 requests"
    assert caches.made == warm, "a warm pool should serve every request"


def test_a_reused_cache_gives_the_fresh_reply(tiny, caches):
    """A pooled cache comes back cleared: the reply is a fresh conversation's, and what it reads is its
    whole prompt but for what it shares with another chat's (`CachePool.share` may take that from one
    still being given back), never what a cache of its own chat kept."""
    engine = Engine(tiny, max_seq_len=128, defaults=DecodeConfig(max_new_tokens=10))
    for mode in ("diffusion", "ar"):
        fresh = {i: list(engine.generate_sync(c, mode=mode, conversation=ConversationCache(
            state=CacheState.new(tiny.model, 128)))) for i, c in enumerate(CHATS)}

        async def main(mode: str):
            out = {}
            for i in (3, 0, 2, 1, 3):  # each on the one pooled cache, after the others
                cut = engine.stream(CHATS[(i + 1) % len(CHATS)], mode=mode)
                await cut.__anext__()
                await cut.aclose()  # a cancelled request in between, too
                out[i] = [p async for p in engine.stream(CHATS[i], mode=mode)]
            return out

        prompts = [engine.prompt_ids(c) for c in CHATS]
        shared = {i: max(len(os.path.commonprefix([p, q])) for j, q in enumerate(prompts) if j != i)
                  for i, p in enumerate(prompts)}
        made = caches.made
        for i, pieces in asyncio.run(main(mode)).items():
            assert reply_ids(pieces) == reply_ids(fresh[i])
            assert pieces[0].prompt_tokens == fresh[i][0].prompt_tokens
            assert pieces[0].prompt_tokens - shared[i] <= pieces[0].prefilled_tokens <= pieces[0].prompt_tokens
        assert caches.made - made <= 2  # ten requests really ran on reused caches


def test_generate_sync_without_a_conversation_reuses_one_cache(tiny, caches, no_cyclic_gc):
    engine = Engine(tiny, max_seq_len=128, defaults=DecodeConfig(max_new_tokens=8))
    for i in range(12):
        pieces = engine.generate_sync(CHATS[i % len(CHATS)])
        if i % 2:
            next(pieces)
            pieces.close()  # stopped mid-reply
        else:
            list(pieces)
    assert caches.made == 1 and len(caches.alive()) == 1


@pytest.mark.parametrize("kept", [0, 2])
def test_server_requests_cancelled_mid_stream_share_the_pool(tiny, caches, no_cyclic_gc, kept):
    """Through HTTP with the official client: clients that hang up mid-stream leave nothing behind,
    and the conversations kept for a continuation (engine.api.server.PrefixCaches) hold at most
    `kept` caches; an evicted one's goes back to the pool."""
    engine = Engine(tiny, max_seq_len=128)
    app = build_app(engine, DecodeConfig(max_new_tokens=12), kept_conversations=kept)
    with serving(app) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for i in range(16):
            stream = client.chat.completions.create(model=engine.name, messages=CHATS[i % len(CHATS)],
                                                    max_tokens=12, stream=True)
            for _ in stream:
                if i % 2:
                    break
            stream.close()  # for the odd ones: the server sees the client leave mid-reply
        assert wait_until(lambda: settled(caches, kept)), f"{len(caches.alive())} caches still held"
        # one request at a time: one cache, one while a cancelled one ends, and the kept ones
        assert caches.made <= 2 + kept
