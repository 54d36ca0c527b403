"""Correctness of the engine: parity with transformers, exact caching, decoding rules, cancellation, bad input.

Tiny random checkpoints (tests/tinyckpt.py) cover the model families and the decoder's bookkeeping;
the packaged SmolLM2 GGUF (loaded once for the module) covers the tokenizer, the chat template and
greedy decoding against transformers' own GGUF loader.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import threading
import time

import pytest
import torch

from decoding import generate, generate_ar, generate_diffusion
from engine.decode import CacheState, ContextOverflow, DecodeConfig, DiffusionSpec, generate_ar_batch, run
from engine.loading import ModelLoadError, load, packaged_smollm2_gguf
from engine.model import visibility_mask
from engine.runtime import Interrupted
import engine.decode
import engine.serving.scheduler
from engine.stream import ConversationCache, Engine

import tinyckpt
from tinyckpt import MASK_ID

ATOL = 1e-4


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def causal_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Our forward without a KV cache under the plain causal mask: [T, V]."""
    t = tokens.shape[-1]
    with torch.no_grad():
        return model(tokens.view(1, -1), torch.arange(t), visibility_mask(torch.arange(t) + 1, t))[0]


def random_ids(n: int, seed: int) -> list[int]:
    """Random ids below the special tokens (so never the mask or EOS token)."""
    return torch.randint(0, MASK_ID - 4, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    tinyckpt.write_hf_folder(folder, "llama", tie=True, seed=3)
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load(str(tiny_dir), max_seq_len=128)


# --- 1. parity with transformers on tiny random checkpoints ----------------------------------

@pytest.mark.parametrize("family,tie", [("llama", True), ("llama", False), ("qwen2", False), ("qwen2", True),
                                        ("qwen3", True), ("qwen3", False)])
def test_hf_folder_matches_transformers(tmp_path, family, tie):
    hf = tinyckpt.write_hf_folder(tmp_path, family, tie)
    loaded = load(str(tmp_path))
    args = loaded.model.args
    assert (args.tie_embeddings, args.qkv_bias, args.qk_norm) == (tie, family == "qwen2", family == "qwen3")
    assert args.rope_theta == tinyckpt.ROPE_THETA
    tokens = torch.tensor(random_ids(40, seed=1) + [MASK_ID, tinyckpt.EOS_ID])
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0]
    ours = causal_logits(loaded.model, tokens)
    assert ref.abs().max() > 1.0  # not a trivially small comparison
    assert (ours - ref).abs().max() <= ATOL


@pytest.mark.parametrize("tie", [True, False])
def test_llama_gguf_matches_transformers(tmp_path, tie):
    hf = tinyckpt.hf_model("llama", tie, seed=5)
    path = tmp_path / "tiny.gguf"
    tinyckpt.write_llama_gguf(path, hf)
    loaded = load(str(path))
    assert loaded.model.args.tie_embeddings == tie
    assert loaded.model.args.rope_theta == tinyckpt.ROPE_THETA
    tokens = torch.tensor(random_ids(40, seed=2))
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0]
    assert (causal_logits(loaded.model, tokens) - ref).abs().max() <= ATOL
    # the tokenizer rebuilt from GGUF metadata agrees with the tokenizer.json it was written from
    tinyckpt.write_tokenizer(tmp_path / "tok")
    from engine.tokenizer import tokenizer_from_folder
    folder_tok = tokenizer_from_folder(tmp_path / "tok")
    messages = [{"role": "user", "content": "the weather in Paris, 2024: wet!"},
                {"role": "assistant", "content": "or not"}, {"role": "user", "content": "tell me ñ"}]
    assert loaded.tokenizer.encode_chat(messages) == folder_tok.encode_chat(messages)
    assert loaded.tokenizer.eos_ids == folder_tok.eos_ids == {tinyckpt.EOS_ID}


def test_ar_checkpoint_spec_is_the_same_from_gguf_and_hf_folder(tmp_path):
    """An AR checkpoint predicts the next token at every row, whatever file format it came in."""
    hf = tinyckpt.write_hf_folder(tmp_path / "hf", "llama", tie=True)
    tinyckpt.write_llama_gguf(tmp_path / "m.gguf", hf)
    a, b = load(str(tmp_path / "hf")).spec, load(str(tmp_path / "m.gguf")).spec
    assert (a.shift, a.context, a.trained) == (b.shift, b.context, b.trained) == (True, "causal", False)
    # diffusion checkpoints keep what their config says: SDAR predicts in place, Fast-dLLM v2 shifts
    from engine.loading import spec_from_hf_config
    from engine.tokenizer import tokenizer_from_folder
    tok = tokenizer_from_folder(tmp_path / "hf")
    sdar = spec_from_hf_config({"model_type": "sdar", "block_size": 4}, tok)
    assert (sdar.mask_id, sdar.shift, sdar.context, sdar.trained) == (MASK_ID, False, "block_causal", True)
    fast = spec_from_hf_config({"model_type": "Fast_dLLM_Qwen", "bd_size": 32, "small_block_size": 8}, tok)
    assert (fast.shift, fast.context, fast.block_size, fast.sub_block_size) == (True, "block_causal", 32, 8)


# --- 2. the real SmolLM2 GGUF against transformers ---------------------------------------------

@pytest.fixture(scope="module")
def smol():
    """The packaged base GGUF itself (not `default`, which may merge our adapter)."""
    return load(str(packaged_smollm2_gguf()), max_seq_len=1024)


@pytest.fixture(scope="module")
def smol_hf():
    transformers = pytest.importorskip("transformers")
    path = packaged_smollm2_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return tok, model.eval()


CHATS = [
    [{"role": "user", "content": "What is 12345 + 678? Answer with digits only."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Héllo, wörld! Ça va? 東京 🚀 — “quotes”, <tags> & 3.14e-5%"}],
    [{"role": "user", "content": "Name a fruit."},
     {"role": "assistant", "content": "A banana."},
     {"role": "user", "content": "  And a colour?\n\tJust one, please!!"}],
]


def hf_chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_smollm2_chat_ids_match_transformers(smol, smol_hf, i):
    tok, _ = smol_hf
    assert smol.tokenizer.encode_chat(CHATS[i]) == hf_chat_ids(tok, CHATS[i])


def test_smollm2_plain_text_ids_match_transformers(smol, smol_hf):
    tok, _ = smol_hf
    for text in ["Version 2.0.11 costs $1,299.99!", "naïve café: 你好, мир 👋🏽", "  two  spaces\n\nand tabs\t."]:
        assert smol.tokenizer.encode(text) == tok.encode(text, add_special_tokens=False), text
        assert smol.tokenizer.decode(smol.tokenizer.encode(text)) == text


def test_smollm2_greedy_ar_matches_transformers(smol, smol_hf):
    tok, hf = smol_hf
    engine = Engine(smol, max_seq_len=512)
    for messages in CHATS:
        prompt = hf_chat_ids(tok, messages)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=24, do_sample=False)
        ref = out[0, len(prompt):].tolist()
        pieces = list(engine.generate_sync(messages, DecodeConfig(mode="ar", max_new_tokens=24)))
        ours = [t for p in pieces for t in p.token_ids]
        assert ours == ref, (tok.decode(ours), tok.decode(ref))
        assert pieces[-1].done and pieces[-1].finish_reason == ("stop" if ours[-1] in smol.tokenizer.eos_ids
                                                                 else "length")


# --- 3. the cache is exact: cached forwards == full recompute with the equivalent mask ------------

class Reference:
    """The committed sequence with each row's visibility, recomputed from scratch without a cache."""

    def __init__(self, model, context: str):
        self.model, self.context = model, context
        self.tokens: list[int] = []
        self.visible: list[int] = []  # row i attends tokens < visible[i]

    def forward(self, clean: list[int], clean_is_block: bool, draft: list[int]):
        start, n = len(self.tokens), len(clean)
        end = start + n + len(draft)
        if self.context == "block_causal" and clean_is_block:
            clean_visible = [start + n] * n
        else:
            clean_visible = list(range(start + 1, start + n + 1))
        tokens = self.tokens + clean + draft
        visible = self.visible + clean_visible + [end] * len(draft)
        with torch.no_grad():
            logits = self.model(torch.tensor([tokens]), torch.arange(end),
                                visibility_mask(torch.tensor(visible), end))[0].float()
        self.tokens, self.visible = self.tokens + clean, self.visible + clean_visible
        return (logits[start + n - 1] if n else None), (logits[start + n:] if draft else None)

    def truncate(self, keep: int) -> None:
        assert max(self.visible[:keep], default=0) <= keep, \
            "a kept cache row attended to tokens that the cache no longer holds"
        del self.tokens[keep:], self.visible[keep:]


@pytest.mark.parametrize("context", ["causal", "block_causal"])
def test_cached_run_equals_full_recompute(tiny, context):
    model, m = tiny.model, MASK_ID
    state, ref = CacheState.new(model, 64), Reference(model, context)
    prompt, b1, b2 = random_ids(7, 10), random_ids(4, 11), random_ids(3, 12)

    def step(clean, clean_is_block, draft):
        got = run(model, state, clean, clean_is_block, draft, context)
        want = ref.forward(clean, clean_is_block, draft)
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                assert (g - w).abs().max() <= ATOL
        assert state.ids == ref.tokens

    step(prompt, False, [m] * 4)  # prefill fused with the first denoising step
    step([], False, [b1[0], m, b1[2], m])  # a later step of the same block
    step(b1, True, [m] * 4)  # commit block 1 while denoising block 2 (scratch rows overwritten)
    step(b2, True, [])  # a short last block, no draft
    # next turn diverges inside block 1 (barge-in: only part of the reply was heard)
    new_prompt = prompt + b1[:2] + random_ids(5, 13)
    tail = state.reuse_for(new_prompt)
    ref.truncate(len(state.ids))
    assert state.ids + tail == new_prompt
    step(tail, False, [m] * 4)
    step([], False, [m, b2[0], m, m])
    step(random_ids(4, 14), True, [m] * 2)


# --- 4. topk=1 decoding is sequential unmasking by confidence ---------------------------------------

def sequential_unmasking(model, prompt: list[int], spec: DiffusionSpec, max_new: int, stop_ids: set[int]):
    """Recompute everything each step, commit the single surest masked position; block by block."""
    ref = Reference(model, spec.context)
    ref.forward(prompt, False, [])
    out: list[int] = []
    while len(out) < max_new:
        size = min(spec.block_size, max_new - len(out))
        block, masked, stop_at = [spec.mask_id] * size, [True] * size, size
        while any(masked[:stop_at]):
            start = len(ref.tokens)
            tokens = ref.tokens + block
            visible = ref.visible + [start + size] * size  # the block sees the prefix and all of itself
            with torch.no_grad():
                logits = model(torch.tensor([tokens]), torch.arange(len(tokens)),
                               visibility_mask(torch.tensor(visible), len(tokens)))[0].float()
            rows = logits[start - 1:start - 1 + size] if spec.shift else logits[start:]
            rows[:, spec.mask_id] = float("-inf")
            confidence, best = rows.softmax(-1).max(-1)
            j = max((i for i in range(stop_at) if masked[i]), key=lambda i: float(confidence[i]))
            block[j], masked[j] = int(best[j]), False
            if block[j] in stop_ids:
                stop_at = min(stop_at, j + 1)
        out += block[:stop_at]
        if stop_at < size or block[stop_at - 1] in stop_ids:
            break
        ref.forward(block, True, [])
    return out


@pytest.mark.parametrize("context", ["causal", "block_causal"])
@pytest.mark.parametrize("shift", [True, False])
def test_topk1_is_sequential_unmasking(tiny, shift, context):
    spec = DiffusionSpec(mask_id=MASK_ID, block_size=4, shift=shift, context=context)
    prompt = random_ids(9, 20)
    free = sequential_unmasking(tiny.model, prompt, spec, 10, set())
    assert len(free) == 10
    stop = {free[5]}  # a token the model does produce, to exercise the stop handling as well
    for stop_ids in (set(), stop):
        want = sequential_unmasking(tiny.model, prompt, spec, 10, stop_ids)
        for cfg in (DecodeConfig(rule="topk", topk=1, max_new_tokens=10),
                    DecodeConfig(rule="threshold", threshold=1.01, max_new_tokens=10, release_prefix=False)):
            state = CacheState.new(tiny.model, 64)
            blocks = list(generate_diffusion(tiny.model, state, prompt, cfg, spec, stop_ids))
            assert [t for b in blocks for t in b.token_ids] == want
            assert blocks[-1].done and not any(b.done for b in blocks[:-1])


def test_ar_batch_equals_one_at_a_time(tiny):
    prompts = [random_ids(n, 30 + n) for n in (3, 9, 6, 5, 7)]
    free = generate_ar_batch(tiny.model, prompts, 8, set())
    # stop tokens some replies say early, so they leave the batch while the others go on
    stop_sets = [{tinyckpt.EOS_ID}, {free[0][2], free[3][4]}]
    for stop_ids in stop_sets:
        batch = generate_ar_batch(tiny.model, prompts, 8, stop_ids)
        for prompt, reply in zip(prompts, batch):
            state = CacheState.new(tiny.model, 64)
            single = [b.token_ids[0] for b in generate_ar(tiny.model, state, prompt,
                                                           DecodeConfig(mode="ar", max_new_tokens=8), stop_ids)]
            assert reply == single
    lengths = [len(r) for r in generate_ar_batch(tiny.model, prompts, 8, stop_sets[1])]
    assert min(lengths) < 8 and max(lengths) == 8  # some left early, some decoded to the limit


# --- 5. cancellation and multi-turn prefix reuse on the real model -------------------------------

FIRST = [{"role": "user", "content": "Tell me something about the moon."}]


def reply_ids(pieces) -> list[int]:
    return [t for p in pieces for t in p.token_ids]


@pytest.fixture(scope="module")
def smol_engine(smol):
    return Engine(smol, max_seq_len=512, defaults=DecodeConfig(max_new_tokens=12))


def apart(smol) -> Engine:
    """An engine of its own on the same weights: its conversations read nothing another engine's have
    (`CachePool.share`), so its replies are references read from an empty cache."""
    return Engine(smol, max_seq_len=512, defaults=DecodeConfig(max_new_tokens=12))


@pytest.fixture(scope="module")
def barge_in(smol_engine, smol):
    """First turn cut after its first piece; the second turn's messages and a fresh conversation's reply."""
    conv = ConversationCache()
    pieces = smol_engine.generate_sync(FIRST, conversation=conv)
    first = next(pieces)
    pieces.close()
    assert not first.done and first.text.strip()
    second = FIRST + [{"role": "assistant", "content": first.text},
                      {"role": "user", "content": "Interesting. And the sun?"}]
    fresh = list(apart(smol).generate_sync(second, conversation=ConversationCache()))
    return conv, second, fresh


def test_closing_a_reply_then_next_turn_equals_fresh(smol_engine, barge_in):
    conv, second, fresh = barge_in
    pieces = list(smol_engine.generate_sync(second, conversation=conv))
    assert reply_ids(pieces) == reply_ids(fresh)
    assert "".join(p.text for p in pieces) == "".join(p.text for p in fresh)
    assert pieces[0].prompt_tokens == fresh[0].prompt_tokens == fresh[0].prefilled_tokens
    assert 0 < pieces[0].prefilled_tokens < pieces[0].prompt_tokens


def test_cancelled_async_stream_then_next_turn_equals_fresh(smol_engine, barge_in):
    _, second, fresh = barge_in

    async def scenario():
        conv = ConversationCache()
        stream = smol_engine.stream(FIRST, conversation=conv)
        first = await stream.__anext__()
        await stream.aclose()  # what the service does on barge-in
        assert first.text == second[1]["content"]
        return [p async for p in smol_engine.stream(second, conversation=conv)]

    pieces = asyncio.run(scenario())
    assert reply_ids(pieces) == reply_ids(fresh)
    assert pieces[0].prefilled_tokens < pieces[0].prompt_tokens


def test_cancelled_task_mid_reply_then_next_turn_equals_fresh(smol_engine, barge_in):
    """Cancel the consuming task while a forward is running on the worker thread."""
    _, second, fresh = barge_in

    async def scenario():
        conv = ConversationCache()
        got_first = asyncio.Event()

        async def consume():
            async for _ in smol_engine.stream(FIRST, conversation=conv):
                got_first.set()

        task = asyncio.create_task(consume())
        await got_first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return [p async for p in smol_engine.stream(second, conversation=conv)]

    pieces = asyncio.run(scenario())
    assert reply_ids(pieces) == reply_ids(fresh)


def test_full_multi_turn_reuses_prefix_and_equals_fresh(smol):
    engine, conv = apart(smol), ConversationCache()
    cfg = DecodeConfig(mode="ar", max_new_tokens=8)
    first = list(engine.generate_sync(FIRST, cfg, conversation=conv))
    assert first[0].prefilled_tokens == first[0].prompt_tokens
    second = FIRST + [{"role": "assistant", "content": "".join(p.text for p in first)},
                      {"role": "user", "content": "Thanks!"}]
    again = list(engine.generate_sync(second, cfg, conversation=conv))
    fresh = list(apart(smol).generate_sync(second, cfg, conversation=ConversationCache()))
    assert reply_ids(again) == reply_ids(fresh)
    assert again[0].prefilled_tokens < again[0].prompt_tokens - first[0].prompt_tokens


def test_a_new_conversation_starts_from_what_another_has_read(smol):
    """Every voice session's prompt starts with the same system prompt: the second session's first
    turn reads only what its prompt does not share with the first's, and replies as if it read it all."""
    engine, cfg = apart(smol), DecodeConfig(mode="ar", max_new_tokens=8)
    system = {"role": "system", "content": "You are a friendly voice assistant. Answer in one short sentence."}
    one = [system, {"role": "user", "content": "What colour is the sky?"}]
    two = [system, {"role": "user", "content": "Name a fruit."}]
    a, b = ConversationCache(), ConversationCache()
    first = list(engine.generate_sync(one, cfg, conversation=a))
    assert first[0].prefilled_tokens == first[0].prompt_tokens
    second = list(engine.generate_sync(two, cfg, conversation=b))
    fresh = list(apart(smol).generate_sync(two, cfg, conversation=ConversationCache()))
    shared = len(os.path.commonprefix([engine.prompt_ids(one), engine.prompt_ids(two)]))
    assert shared > 10  # the system prompt and the user's turn header
    assert second[0].prefilled_tokens == second[0].prompt_tokens - shared == fresh[0].prefilled_tokens - shared
    assert reply_ids(second) == reply_ids(fresh)
    again = list(engine.generate_sync(one, cfg, conversation=a))  # the first goes on from its own cache
    assert reply_ids(again) == reply_ids(first) and again[0].prefilled_tokens < first[0].prompt_tokens - shared


# --- 6. bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["/nonexistent/model-dir", "./no-such-model", "no-such-model", "missing.gguf"])
def test_unknown_model_is_a_clear_error(name):
    with pytest.raises(ModelLoadError, match="no such|neither"):
        load(name)


def test_corrupt_gguf_is_a_load_error(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        load(str(garbage))
    good = tmp_path / "good.gguf"
    tinyckpt.write_llama_gguf(good, tinyckpt.hf_model("llama", True))
    data = good.read_bytes()
    for cut in (len(data) // 2, len(data) - 100, 64):
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError):
            load(str(truncated))


def test_gguf_without_tokenizer_is_a_load_error(tmp_path):
    import gguf
    path = tmp_path / "notok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_embedding_length(64)
    w.add_tensor("token_embd.weight", torch.zeros(8, 64).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError):
        load(str(path))


@pytest.mark.parametrize("model_type,arch", [("gpt_neox", "GPTNeoXForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"),
                                             ("mllama", "MllamaForConditionalGeneration")])
def test_unsupported_hf_family_is_named(tmp_path, tiny_dir, model_type, arch):
    shutil.copytree(tiny_dir, tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    import json
    cfg = json.loads(cfg_path.read_text())
    cfg.update(model_type=model_type, architectures=[arch])
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=model_type):
        load(str(tmp_path / "m"))


def test_hf_folder_missing_files(tmp_path, tiny_dir):
    for missing in ("config.json", "tokenizer.json", "model.safetensors"):
        folder = tmp_path / missing
        shutil.copytree(tiny_dir, folder)
        (folder / missing).unlink()
        with pytest.raises(ModelLoadError, match=missing.replace("model.", r"\*\.")):
            load(str(folder))


def test_prompt_longer_than_context(tiny):
    engine = Engine(tiny, max_seq_len=32, defaults=DecodeConfig(max_new_tokens=4))
    short = [{"role": "user", "content": "hi"}]
    long_chat = [{"role": "user", "content": "the weather " * 20}]
    assert len(engine.prompt_ids(short)) + 4 <= 32 < len(engine.prompt_ids(long_chat))
    conv = ConversationCache()
    for mode in ("diffusion", "ar"):
        with pytest.raises(ContextOverflow):
            list(engine.generate_sync(long_chat, conversation=conv, mode=mode))
    # the conversation is still usable afterwards, and nothing of the failed turn leaks into it
    assert reply_ids(engine.generate_sync(short, conversation=conv)) == reply_ids(engine.generate_sync(short))
    state = CacheState.new(tiny.model, 16)
    with pytest.raises(ContextOverflow):
        run(tiny.model, state, random_ids(20, 1), False, [])
    # a prompt that fits but leaves no room for the reply
    with pytest.raises(ContextOverflow):
        list(generate(tiny.model, CacheState.new(tiny.model, 16), random_ids(10, 2),
                      DecodeConfig(max_new_tokens=8), tiny.spec, set()))


# --- 8. batching across conversations ---------------------------------------------------------

def test_batched_forwards_equal_one_at_a_time(tiny):
    """Sequences of different lengths, caches and patterns in one pass give their own logits."""
    from engine.decode import Forward, run_many
    prompts = [random_ids(n, seed) for n, seed in ((7, 1), (13, 2), (4, 3))]
    drafts = [[3] * 4, [], [3] * 2]
    alone, batched = [], []
    for out, together in ((alone, False), (batched, True)):
        states = [CacheState.new(tiny.model, 64) for _ in prompts]
        forwards = [Forward(s, p, False, d, "block_causal") for s, p, d in zip(states, prompts, drafts)]
        results = run_many(tiny.model, forwards) if together else [run_many(tiny.model, [f])[0] for f in forwards]
        # a second step on top of the cached prefixes, to check the caches were written right
        seconds = [Forward(s, random_ids(4, 9), True, [3] * 4, "block_causal") for s in states]
        results += run_many(tiny.model, seconds) if together else [run_many(tiny.model, [f])[0] for f in seconds]
        out += results
    for (a_last, a_draft), (b_last, b_draft) in zip(alone, batched):
        for a, b in ((a_last, b_last), (a_draft, b_draft)):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_concurrent_streams_are_batched_and_equal_sequential_replies(smol):
    engine = Engine(smol, max_seq_len=512, defaults=DecodeConfig(max_new_tokens=10), max_batch=4)
    chats = [[{"role": "user", "content": q}] for q in ("Name a fruit.", "What is two plus two?",
                                                         "Say hello to Sam.")]
    expected = [reply_ids(engine.generate_sync(c)) for c in chats]

    async def collect(chat):
        return reply_ids([p async for p in engine.stream(chat)])

    async def main():
        return await asyncio.gather(*(collect(c) for c in chats))

    got = asyncio.run(main())
    assert got == expected
    assert max(engine.scheduler.batch_sizes) > 1  # the three requests really shared forwards


@pytest.mark.parametrize("wanted", [1, 3])
def test_a_waited_for_reply_goes_ahead_of_a_flowing_one(smol, wanted):
    """Someone waits in silence for a reply's first piece (and, while its caller's deadline is now,
    for more: a whole first phrase); a reply already flowing has slack and sits out meanwhile."""
    engine = Engine(smol, max_seq_len=512, max_batch=4, max_defer_s=60.0)
    flowing_cfg = DecodeConfig(mode="ar", max_new_tokens=40)  # a piece per forward
    newcomer_cfg = DecodeConfig(rule="topk", topk=1, max_new_tokens=8)  # one token per forward
    # the question whose pieces take the most forwards (diffusion may settle later words first)
    replies = {q: list(engine.generate_sync([{"role": "user", "content": q}], newcomer_cfg))
               for q in ("List three colours.", "Name a fruit.", "Say hello to Sam.", "Write a haiku about rain.")}
    question = max(replies, key=lambda q: replies[q][wanted - 1].forwards if len(replies[q]) >= wanted else 0)
    newcomer_chat, expected = [{"role": "user", "content": question}], replies[question]
    assert expected[wanted - 1].forwards >= 4  # a flowing reply sharing its rounds would deliver that many pieces
    events: list[str] = []

    async def main():
        flowing_started = asyncio.Event()

        async def flowing():
            async for _ in engine.stream(FIRST, flowing_cfg):
                events.append("flowing")
                flowing_started.set()

        async def newcomer():
            pieces = []
            async for piece in engine.stream(newcomer_chat, newcomer_cfg,
                                             deadline=lambda text: -math.inf if len(pieces) < wanted else math.inf):
                events.append("newcomer")
                pieces.append(piece)
            return pieces

        flowing_task = asyncio.create_task(flowing())
        await flowing_started.wait()
        events.append("submitted")
        pieces = await newcomer()
        await flowing_task
        return pieces

    pieces = asyncio.run(main())
    assert reply_ids(pieces) == reply_ids(expected)
    start = events.index("submitted")
    got_wanted = [i for i, e in enumerate(events) if e == "newcomer"][wanted - 1]
    assert events[start:got_wanted].count("flowing") <= 2  # at most what was in flight when it came
    assert events.count("flowing") == 40  # and then the flowing reply finished


def test_a_background_reply_sits_out_but_is_never_starved(smol):
    """A reply nobody waits for while someone waits outside the engine (the voice service's: for
    speech recognition or synthesis) sits out rounds past its first piece, each forward at most
    `max_defer_s`, even alone, and still finishes unchanged."""
    engine = Engine(smol, max_seq_len=512, max_defer_s=0.2)
    engine.scheduler.someone_waits = lambda: True
    cfg = DecodeConfig(mode="ar", max_new_tokens=6)
    expected = reply_ids(engine.generate_sync(FIRST, cfg))

    async def main():
        arrivals = []
        async for piece in engine.stream(FIRST, cfg):
            arrivals.append((time.monotonic(), piece))
        return arrivals

    arrivals = asyncio.run(main())
    assert reply_ids([piece for _, piece in arrivals]) == expected
    gaps = [b - a for (a, _), (b, _) in zip(arrivals, arrivals[1:])]
    assert len(gaps) == 5 and all(0.2 <= gap < 2.0 for gap in gaps)


def test_a_reply_about_to_run_dry_keeps_its_forwards_beside_a_less_served_one(smol, monkeypatch):
    """Two replies someone listens to, on a clock that stands still: the older one, which has had more
    model time and much left to say, is the one whose listener's audio runs out first, so it keeps
    getting forwards beside the newer one. Before (least served first among replies someone waits for
    alike), it sat out every round of the newer one's first 8 pieces (`max_defer_s` is a minute here)."""
    monkeypatch.setattr(engine.serving.scheduler, "SLICE_S", 0.0)  # strictly least served first, as before
    eng = Engine(smol, max_seq_len=512, max_batch=4, max_defer_s=60.0)
    eng.scheduler.clock, eng.scheduler.horizon_s = lambda: 100.0, 2.0
    older_cfg, newer_cfg = DecodeConfig(mode="ar", max_new_tokens=120), DecodeConfig(mode="ar", max_new_tokens=40)
    newer_chat = [{"role": "user", "content": "Write a short story about a cat."}]
    expected = [reply_ids(eng.generate_sync(FIRST, older_cfg)), reply_ids(eng.generate_sync(newer_chat, newer_cfg))]
    events: list[str] = []

    async def listen(name: str, messages: list[dict], cfg: DecodeConfig, runs_out: float) -> list[int]:
        pieces = []
        async for piece in eng.stream(messages, cfg, deadline=lambda text: runs_out):
            events.append(name)
            pieces.append(piece)
        return reply_ids(pieces)

    async def main():
        older = asyncio.create_task(listen("older", FIRST, older_cfg, 100.5))  # its audio runs out in 0.5 s
        while events.count("older") < 20:
            await asyncio.sleep(0.005)
        newer = asyncio.create_task(listen("newer", newer_chat, newer_cfg, 101.5))  # this one's in 1.5 s
        return list(await asyncio.gather(older, newer))

    assert asyncio.run(main()) == expected
    newer = [i for i, e in enumerate(events) if e == "newer"]
    assert len(newer) >= 8 and events[newer[0]:newer[7]].count("older") >= 4  # main: 0


LONG = [{"role": "user", "content": "Summarise this list: " + ", ".join(f"item {i}" for i in range(60))}]
SHORT = [{"role": "user", "content": "Name a fruit."}]


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_a_prompt_prefilled_in_chunks_gives_the_same_reply(smol, mode, monkeypatch):
    """A long prompt written in chunks (64 tokens a forward here: alone, 4 slices of 16; a slice
    while others may come), so others' steps could run between them, decodes exactly what one
    whole-prompt forward does."""
    whole, chunked = Engine(smol, max_seq_len=512), Engine(smol, max_seq_len=512)
    chunked.cost.token_s = engine.serving.scheduler.SLICE_S / 16  # as if a prompt token cost that much here
    cfg = DecodeConfig(mode=mode, max_new_tokens=8)
    expected = list(whole.generate_sync(LONG, cfg))
    written: list[int] = []
    run_many = engine.decode.run_many

    def counting(model, forwards):
        written.extend(len(f.clean) for f in forwards)
        return run_many(model, forwards)

    monkeypatch.setattr(engine.decode, "run_many", counting)
    got = list(chunked.generate_sync(LONG, cfg))
    alone = 16 * engine.serving.scheduler.ALONE_SLICES  # the request has the model to itself: bigger chunks
    assert chunked.scheduler.prefill_chunk == 16 and got[0].prompt_tokens > 250
    assert reply_ids(got) == reply_ids(expected)
    chunks = (got[0].prompt_tokens - 1) // alone
    assert written[:chunks] == [alone] * chunks and written[chunks] < alone  # the prompt, a chunk a forward
    written.clear()
    chunked.admission.may_share = True  # others may come (the voice service): a slice a forward
    assert reply_ids(list(chunked.generate_sync(LONG, cfg))) == reply_ids(expected)
    chunks = (got[0].prompt_tokens - 1) // 16
    assert written[:chunks] == [16] * chunks and written[chunks] <= 16


def test_a_prompt_chunk_behind_a_newcomer_sits_out_longer_than_a_step(smol):
    """The round's choice (`Scheduler.this_round`): beside a newcomer of the same priority, a well
    served request's one-row step rejoins after `max_defer_s`, its prompt chunk only after
    `PREFILL_DEFER` times that (a chunk makes the newcomer's round a slice longer), and of two
    chunks due, only the one waiting longest runs; while work someone waits for runs beside the
    engine (`yield_to`), a long prompt's chunk waits as long."""
    from types import SimpleNamespace
    eng = Engine(smol, max_seq_len=512, max_defer_s=0.3)
    now = time.monotonic()

    def request(used_s: float, rows: int, waited_s: float, left: int = 10_000) -> SimpleNamespace:
        return SimpleNamespace(runs_out=lambda: -math.inf, warm=False, used_s=used_s, ready_since=now - waited_s,
                               rows_left=lambda: left,
                               forward=SimpleNamespace(clean=[1] * rows, draft=[]))

    newcomer, step, chunk = request(0.0, 1, 0.0), request(5.0, 1, 0.5), request(5.0, 16, 0.5)
    assert eng.scheduler.this_round([newcomer, step, chunk]) == [newcomer, step]
    chunk.ready_since = now - 0.3 * engine.serving.scheduler.PREFILL_DEFER - 0.01
    assert eng.scheduler.this_round([newcomer, step, chunk]) == [newcomer, step, chunk]
    newcomers_chunk = request(0.0, 12, 0.0)  # its prompt's tail: the older chunk goes first
    assert eng.scheduler.this_round([newcomers_chunk, step, chunk]) == [step, chunk]
    eng.scheduler.yield_to = lambda: True  # a final transcript or a first phrase is being made beside the engine
    long_chunk = request(5.0, 16, 0.5)  # a long prompt's, alone at its level: it waits too
    assert eng.scheduler.this_round([long_chunk, step]) == [step]
    assert eng.scheduler.this_round([newcomers_chunk, long_chunk]) == [newcomers_chunk]  # a short prompt does not
    long_chunk.ready_since = now - 0.3 * engine.serving.scheduler.PREFILL_DEFER - 0.01
    assert eng.scheduler.this_round([long_chunk]) == [long_chunk]  # never for longer than that


def test_a_round_writes_one_prompt_chunk(smol, monkeypatch):
    """Two long prompts at once: each forward writes at most one of them (a round is at most a
    slice longer than its steps: before, both chunks went in one forward, and a reply arriving
    meanwhile waited for both), and both replies are unchanged."""
    eng = Engine(smol, max_seq_len=512)
    eng.cost.token_s = engine.serving.scheduler.SLICE_S / 16
    # the cost stays as set: forwards would measure it, and a fast machine writes bigger (so fewer) chunks
    monkeypatch.setattr(eng.scheduler, "measure", lambda forwards, took: None)
    cfg = DecodeConfig(mode="ar", max_new_tokens=6)
    other = [{"role": "user", "content": "Count these: " + ", ".join(f"thing {i}" for i in range(50))}]
    expected = [reply_ids(eng.generate_sync(m, cfg)) for m in (LONG, other)]
    chunks_a_forward: list[int] = []
    run_many = engine.decode.run_many

    def counting(model, forwards, interruptible=False):
        chunks_a_forward.append(sum(len(f.clean) > 1 for f in forwards))
        return run_many(model, forwards, interruptible)

    monkeypatch.setattr(engine.serving.scheduler, "run_many", counting)

    async def main():
        async def ask(messages):
            return reply_ids([p async for p in eng.stream(messages, cfg, deadline=lambda text: -math.inf)])
        return await asyncio.gather(ask(LONG), ask(other))

    assert asyncio.run(main()) == expected
    assert max(chunks_a_forward) == 1 and len(chunks_a_forward) > 20


def test_a_short_turn_is_not_held_behind_a_long_prompt(smol, monkeypatch):
    """Two conversations: one sends a long prompt, the other a short question just after. The
    short one is answered in full before the long one's first piece: the long prompt is prefilled
    in chunks and the least served request goes first, so it cannot hold the model for seconds."""
    # chunks of MIN_PREFILL_CHUNK, strictly least served first
    monkeypatch.setattr(engine.serving.scheduler, "SLICE_S", 0.0)
    eng = Engine(smol, max_seq_len=512, max_defer_s=60.0)
    cfg = DecodeConfig(mode="ar", max_new_tokens=6)
    expected_long, expected_short = (reply_ids(eng.generate_sync(m, cfg)) for m in (LONG, SHORT))
    events: list[str] = []

    async def ask(name, messages):
        pieces = []
        async for piece in eng.stream(messages, cfg, deadline=lambda text: -math.inf):  # both someone waits for
            events.append(name)
            pieces.append(piece)
        return reply_ids(pieces)

    async def main():
        long = asyncio.create_task(ask("long", LONG))
        await asyncio.sleep(0)
        return await asyncio.gather(long, ask("short", SHORT))

    got_long, got_short = asyncio.run(main())
    assert (got_long, got_short) == (expected_long, expected_short)
    assert events.index("long") > max(i for i, e in enumerate(events) if e == "short")


class StoppableModel:
    """The PyTorch model behind `Model.interrupt`'s contract, as llama.cpp's kernels keep it: a step
    begun interruptible runs only if nobody interrupts it within `hold_s` (its time on the cores),
    else it raises `Interrupted` and writes nothing."""

    def __init__(self, model, hold_s: float) -> None:
        self.model, self.hold_s = model, hold_s
        self.stopped, self.began = threading.Event(), threading.Event()
        self.interrupted = 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def step(self, forwards, interruptible=False):
        if interruptible:
            self.stopped.clear()
            self.began.set()
            if self.stopped.wait(self.hold_s):
                self.interrupted += 1
                raise Interrupted("stopped")
        return self.model.step(forwards)

    def interrupt(self) -> None:
        self.stopped.set()


def test_a_newcomer_stops_a_long_prompts_chunk_under_way(smol, monkeypatch):
    """A request someone waits for arrives while a long prompt's chunk is being read: the chunk
    stops (`Engine.interrupt_long_prompts`) instead of holding the newcomer for its length, the
    newcomer's first piece comes first, the chunk is read again after, and both replies are the
    ones each gives alone. Before, the newcomer waited for the whole chunk (here 5 s)."""
    monkeypatch.setattr(engine.serving.scheduler, "SLICE_S", 0.01)  # a prompt is long after its first chunk's 0.04 s
    eng = Engine(smol, max_seq_len=512, max_defer_s=0.05)
    cfg = DecodeConfig(mode="ar", max_new_tokens=6)
    expected = [reply_ids(eng.generate_sync(m, cfg)) for m in (LONG, SHORT)]
    model = StoppableModel(smol.model, hold_s=5.0)
    monkeypatch.setattr(eng.scheduler, "model", model)
    eng.admission.may_share = True
    # chunks of 64 rows (the short prompt in one), as set, not measured
    eng.cost.token_s = engine.serving.scheduler.SLICE_S / 64
    monkeypatch.setattr(eng.scheduler, "measure", lambda forwards, took: None)
    firsts: dict[str, float] = {}

    async def ask(name, messages):
        pieces = []
        async for piece in eng.stream(messages, cfg, deadline=lambda text: -math.inf):
            firsts.setdefault(name, time.monotonic())
            pieces.append(piece)
        return reply_ids(pieces)

    async def main():
        reading = asyncio.create_task(ask("long", LONG))
        await asyncio.to_thread(model.began.wait)  # the long prompt's second chunk is under way
        asked = time.monotonic()
        short = await ask("short", SHORT)
        model.hold_s = 0.0  # from now on chunks run at once
        model.interrupt()
        return [await reading, short], firsts["short"] - asked

    replies, short_waited_s = asyncio.run(main())
    assert replies == expected
    assert model.interrupted >= 1 and eng.scheduler.interrupted == model.interrupted
    assert short_waited_s < 2.5 and firsts["short"] < firsts["long"]


def test_a_prompt_too_slow_to_answer_is_refused_up_front(smol):
    """With `max_prefill_s`, a prompt whose new tokens would take longer than that to prefill at
    the measured cost is refused before any forward (a clear error), and short ones still run; a
    warm of the same prompt is not refused, and the reply after it (or another conversation's
    reply to it) prefills only what is new."""
    eng = Engine(smol, max_seq_len=512, max_prefill_s=1.0)
    eng.cost.best_token_s = 0.01  # measured: 100 new tokens fit in a second
    cfg = DecodeConfig(mode="ar", max_new_tokens=4)
    with pytest.raises(ContextOverflow, match="would take about [0-9] s to read"):
        list(eng.generate_sync(LONG, cfg))

    async def stream(messages):
        return [p async for p in eng.stream(messages, cfg)]

    with pytest.raises(ContextOverflow, match="shorten the conversation"):
        asyncio.run(stream(LONG))
    assert eng.scheduler.batch_sizes == []  # refused before any forward
    assert reply_ids(asyncio.run(stream(SHORT)))

    conversation = ConversationCache()

    async def warm_then_reply():  # a warm is never refused (nobody waits for it): the reply then fits
        await eng.warm(LONG, conversation)
        eng.cost.best_token_s = 0.01  # as measured before (the warm's own forwards measured this machine)
        return [p async for p in eng.stream(LONG, cfg, conversation=conversation)]

    assert reply_ids(asyncio.run(warm_then_reply()))

    async def another_conversation():  # what another conversation's cache holds need not be read either
        eng.cost.best_token_s = 0.01
        return [p async for p in eng.stream(LONG, cfg, conversation=ConversationCache())]

    assert reply_ids(asyncio.run(another_conversation())) and conversation.state is not None


def test_a_prompt_that_fits_alone_is_refused_while_another_conversation_shares_the_model(smol):
    """The estimate counts the conversations being served: the scheduler gives each an equal share,
    so a prefill that fits `max_prefill_s` alone is refused beside another reply, and runs alone."""
    eng = Engine(smol, max_seq_len=1024)
    medium = [{"role": "user", "content": "Summarise this list: " + ", ".join(f"item {i}" for i in range(20))}]
    shared = len(os.path.commonprefix([eng.prompt_ids(medium), eng.prompt_ids(LONG)]))  # the other's cache holds it
    new_tokens = len(eng.prompt_ids(medium)) - shared

    async def beside_another():
        conversation = ConversationCache()
        other = eng.stream(LONG, DecodeConfig(mode="ar", max_new_tokens=400), conversation=conversation)
        await anext(other)  # the other conversation is being served (its prompt read at this machine's pace)
        eng.admission.max_prefill_s = 1.0
        # measured: alone, the prefill takes 0.8 s
        eng.cost.best_token_s = eng.cost.best_slice_token_s = 0.8 / new_tokens
        try:
            with pytest.raises(ContextOverflow, match="about 2 s to read on this machine, shared with 1 other"):
                [p async for p in eng.stream(medium, DecodeConfig(mode="ar", max_new_tokens=4))]
        finally:
            await other.aclose()
        for _ in range(100):  # the scheduler lets the cancelled reply go
            if conversation.active is None:
                break
            await asyncio.sleep(0.05)
        eng.cost.best_token_s = 0.8 / new_tokens
        # alone it is admitted; then each round re-checks it at the cost a token has lately here
        # (`_refuse_late`), which this machine's real forwards set: a slow, shared one must not fail it
        eng.admission.max_prefill_s = 30.0
        return [p async for p in eng.stream(medium, DecodeConfig(mode="ar", max_new_tokens=4))]

    assert reply_ids(asyncio.run(beside_another()))


def test_a_warm_that_a_reply_overtakes_ends(smol):
    """Warming a conversation's cache, then its reply at once: the reply takes over the cache and
    the warm ends (it used to wait forever), and the reply is unchanged."""
    eng = Engine(smol, max_seq_len=512)
    cfg = DecodeConfig(mode="ar", max_new_tokens=6)
    expected = reply_ids(eng.generate_sync(LONG, cfg))

    async def main():
        conversation = ConversationCache()
        warming = asyncio.create_task(eng.warm(LONG, conversation))
        await asyncio.sleep(0)
        pieces = [p async for p in eng.stream(LONG, cfg, conversation=conversation)]
        await asyncio.wait_for(warming, 10.0)
        return pieces

    assert reply_ids(asyncio.run(main())) == expected


def test_a_warm_that_comes_while_a_reply_runs_leaves_the_reply_alone(smol):
    """A warm of a conversation arriving while its reply runs (a session's read-ahead of the words heard
    so far, spawned just before the reply began) ends at once: it used to take the reply's place, and
    the reply failed ("a newer request on this conversation took its place", CI's soak at cb5df53)."""
    eng = Engine(smol, max_seq_len=512)
    cfg = DecodeConfig(mode="ar", max_new_tokens=6)
    expected = reply_ids(eng.generate_sync(LONG, cfg))

    async def main():
        conversation = ConversationCache()
        stream = eng.stream(LONG, cfg, conversation=conversation)
        first = await anext(stream)  # the reply runs
        await asyncio.wait_for(eng.warm(LONG[:1], conversation), 10.0)
        return [first] + [p async for p in stream]

    assert reply_ids(asyncio.run(main())) == expected


def test_a_prompt_that_fits_alone_is_refused_while_other_sessions_may_come(smol):
    """While another session may speak (`may_share`), a long prompt is read a slice at a time and
    half the time a reply may wait is kept for the others: the estimate uses the slice-sized rate
    and that share, so a prompt that fits alone is refused with a clear error, and runs alone."""
    eng = Engine(smol, max_seq_len=1024, max_prefill_s=1.0)
    new_tokens = len(eng.prompt_ids(LONG))
    # alone: 0.5 s, sliced: 0.7 s
    eng.cost.best_token_s, eng.cost.best_slice_token_s = 0.5 / new_tokens, 0.7 / new_tokens
    eng.admission.may_share = True
    with pytest.raises(ContextOverflow, match="about 1 s to read on this machine, half of it kept for the other"):
        list(eng.generate_sync(LONG, DecodeConfig(mode="ar", max_new_tokens=4)))
    eng.admission.may_share = False
    eng.cost.best_token_s, eng.cost.best_slice_token_s = 0.5 / new_tokens, 0.7 / new_tokens
    assert reply_ids(eng.generate_sync(LONG, DecodeConfig(mode="ar", max_new_tokens=4)))
