"""The LM on llama.cpp's kernels (engine/llamacpp.py), on the packaged GGUFs as shipped.

What the decoders rely on: logits that follow the model (checked against the PyTorch model on
the same GGUF), per-conversation sequences in one shared cache, an earlier turn's stale tail
dropped before the next turn writes there, forks that share a prefix, batching across
conversations, a full cache that evicts idle conversations rather than failing busy ones, the
threads asked per step, drafted rows (verify) that score as AR steps, the decision that mode
diffusion decodes AR here (and why), and a clear refusal of what this path does not run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import llamacpp
from engine.train.data import chat
from engine.decode import (CacheState, ContextOverflow, DecodeConfig, Forward, drive, generate_ar_batch, plan,
                           run_many)
from engine.loading import ModelLoadError, load
from engine.runtime import Interrupted
from engine.stream import ConversationCache, Engine

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

if llamacpp.available():
    pytest.skip(llamacpp.available(), allow_module_level=True)

REPLY = "Sure! Start with a glass of water, stretch for five minutes, then have a calm breakfast."


@pytest.fixture(scope="module")
def small():
    return load("small", max_seq_len=512, quantize="gguf")


def prompt_ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode_chat(chat(text), add_generation_prompt=True)


def step(model, state: CacheState, tokens: list[int]) -> torch.Tensor:
    return run_many(model, [Forward(state, tokens)])[0][0]


def reply_logits(loaded, text: str) -> torch.Tensor:
    """Logits at each position of a fixed reply: the prompt's prefill, then one token per step."""
    prompt = prompt_ids(loaded, text)
    ids = loaded.tokenizer.encode_chat(chat(text) + [{"role": "assistant", "content": REPLY}])
    state = CacheState.new(loaded.model, 512)
    return torch.stack([step(loaded.model, state, prompt)] + [step(loaded.model, state, [t])
                                                              for t in ids[len(prompt):-1]])


@pytest.mark.parametrize("name", ["small", "default"])
def test_logits_follow_the_pytorch_model_on_the_same_gguf(name, small):
    """Same weights, other kernels (ggml quantises activations too): nearly every next-token
    choice agrees with the fp32 reference and the distributions stay near."""
    ours = small if name == "small" else load(name, max_seq_len=512, quantize="gguf")
    reference = load(name, max_seq_len=512, quantize="none", drafter="")
    agree = total = 0
    for text in ("What's a good way to start my morning?", "Wow. And what do octopuses eat?"):
        a, b = reply_logits(ours, text), reply_logits(reference, text)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(a)
        kl = torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="batchmean")
        assert kl < 0.1, (name, text, float(kl))
    assert agree / total >= 0.9, agree / total


def test_states_for_a_draft_head_are_the_pytorch_models_after_its_final_norm():
    """`read_states`: a step gives ggml's states (after the final norm) for its last `rows` clean
    rows and every drafted row, zeros before them, and the logits stay those of a step without."""
    ours = load("small", max_seq_len=512, quantize="gguf")
    reference = load("small", max_seq_len=512, quantize="none", drafter="")
    prompt = prompt_ids(ours, "How do I make tea?")
    plain = step(ours.model, CacheState.new(ours.model, 512), prompt)
    ours.model.read_states(8)
    state = CacheState.new(ours.model, 512)
    last, _ = run_many(ours.model, [Forward(state, prompt[:-1])])[0]
    last, drafted = run_many(ours.model, [Forward(state, prompt[-1:], draft=[100, 200], draft_causal=True)])[0]
    assert torch.equal(last, plain) and drafted is not None and drafted.shape[0] == 2
    ours_states = state.hidden[:len(prompt) + 2].float()
    ref_state = CacheState.new(reference.model, 512)
    run_many(reference.model, [Forward(ref_state, prompt + [100, 200])])
    ref = reference.model.norm(ref_state.hidden[:len(prompt) + 2])
    kept = torch.arange(len(prompt) + 2) >= len(prompt) - 1 - 8  # the prefill's last 8 rows, then each step's
    assert (ours_states[~kept] == 0).all()
    cos = torch.nn.functional.cosine_similarity(ours_states[kept], ref[kept], dim=-1)
    assert cos.min() > 0.99, cos


def test_distilling_keeps_the_states_a_teacher_forced_read_gives(tmp_path, monkeypatch):
    """`engine draft --quantize gguf`: the states captured while the base generates its replies are
    the ones reading each reply again gives (the head trains on what it will read)."""
    from engine.train import draft as train_draft
    loaded = load("small", max_seq_len=512, quantize="gguf")
    monkeypatch.setattr(train_draft, "SHARD", 2)
    prompts = ["What do bees make?", "Name three colours.", "How do I make tea?"]
    train_draft.distill_states(loaded, prompts, tmp_path / "distilled.jsonl", 16, 12, batch_size=2)
    corpus = train_draft.read_corpus(loaded, tmp_path / "distilled.jsonl", 16)
    assert len(corpus.starts) == 3 and (tmp_path / "hidden-000002.pt").exists()
    loaded.model.read_states(1 << 20)
    for e, question in enumerate(prompts):
        start, n = corpus.starts[e], corpus.lengths[e]
        state = CacheState.new(loaded.model, 512)
        prompt = prompt_ids(loaded, question)
        reply = corpus.ids[start + corpus.train_from[e]:start + n].tolist()
        run_many(loaded.model, [Forward(state, prompt + reply)])
        read = state.hidden[len(prompt) - corpus.train_from[e]:len(prompt) + len(reply) - 1].float()
        kept = corpus.hidden[start:start + len(read)].float()
        assert corpus.ids[start:start + corpus.train_from[e]].tolist() == prompt[-corpus.train_from[e]:]
        fed = kept.abs().sum(-1) > 0  # all but a cut-off reply's last token, never fed (no target after it)
        assert fed[:-1].all()
        assert torch.nn.functional.cosine_similarity(read[fed], kept[fed], dim=-1).min() > 0.999


def test_a_head_loads_on_the_kernels_whose_states_it_read_and_verify_keeps_the_ar_replies(tmp_path):
    """A head trained on ggml's states (`states="normed"`) drafts on llama.cpp, reading the GGUF's
    token table; on PyTorch it is refused, as a PyTorch head is on llama.cpp. Whatever it drafts
    (here an untrained head, every draft sent), verify commits the base's own greedy tokens."""
    from engine.draft import DraftArgs, DraftHead, save_head
    from engine.loading import shipped_drafter
    reference = load("small", max_seq_len=512, quantize="none", drafter="")
    a = reference.model.args
    torch.manual_seed(0)
    vocab = torch.arange(0, 4000)
    head = DraftHead(DraftArgs(dim=a.dim, vocab_size=a.vocab_size, draft_vocab=len(vocab), states="normed",
                               chain=True), vocab)
    save_head(tmp_path / "head.safetensors", head)
    loaded = load("small", max_seq_len=512, quantize="gguf", drafter=str(tmp_path / "head.safetensors"))
    pays = llamacpp.cpu_variant() in llamacpp.DRAFTING_PAYS  # decided once, by this CPU class's row costs
    assert loaded.drafter is not None and loaded.model.head_window == head.args.window
    assert loaded.model.state_rows == (head.args.window if pays else 0)  # states only where the head drafts
    with pytest.raises(ModelLoadError, match="llama.cpp"):
        load("small", max_seq_len=512, quantize="none", drafter=str(tmp_path / "head.safetensors"))
    with pytest.raises(ModelLoadError, match="PyTorch"):
        load("small", max_seq_len=512, quantize="gguf", drafter=str(shipped_drafter("small")))
    assert Engine(loaded, max_seq_len=512).decoding.mode == ("diffusion" if pays else "ar")
    assert (loaded.model.draft_rows == "") == pays and "no draft head" not in loaded.model.draft_rows
    model, eos = loaded.model, loaded.tokenizer.eos_ids
    model.read_states(head.args.window)  # drafting here even where it does not pay: the replies must hold
    ids = torch.tensor([5, 700, 3999])  # the token table it reads with the states: the GGUF's embedding
    assert torch.allclose(model.embed_tokens(ids), reference.model.embed_tokens(ids).float(), atol=1e-3)
    drafted, step_of = [], model.step
    model.step = lambda forwards, interruptible=False: (drafted.extend(len(f.draft) for f in forwards),
                                                        step_of(forwards, interruptible))[1]
    for q in ("What do bees make?", "Count from one to ten."):
        prompt = prompt_ids(loaded, q)
        ar = drive(model, plan(CacheState.new(model, 512), prompt, DecodeConfig(mode="ar", max_new_tokens=24),
                               loaded.spec, eos))
        cfg = DecodeConfig(mode="diffusion", max_new_tokens=24, draft_threshold=0.0)  # every draft sent
        verify = list(drive(model, plan(CacheState.new(model, 512), prompt, cfg, loaded.spec, eos, loaded.drafter,
                                        model.embed_tokens)))
        assert [t for b in verify for t in b.token_ids] == [t for b in ar for t in b.token_ids]
    assert max(drafted) == head.args.block  # the head's blocks went through llama_decode as rows


def test_a_new_turn_drops_the_stale_tail_of_the_last(small):
    """Turn 1's reply was cut (barge-in): turn 2's prompt keeps only part of it. The cells past
    the kept prefix must be gone before turn 2 writes there, or its rows would see them."""
    first = prompt_ids(small, "Tell me a story about a cat.")
    state = CacheState.new(small.model, 512)
    step(small.model, state, first)
    reply = [int(step(small.model, state, [t]).argmax()) for t in [first[-1]] * 0] or []
    last = step(small.model, state, [small.tokenizer.encode("Once upon a time")[0]])
    for _ in range(6):
        token = int(last.argmax())
        last = step(small.model, state, [token])
        reply.append(token)
    second = small.tokenizer.encode_chat(chat("Tell me a story about a cat.") + [
        {"role": "assistant", "content": "Once upon"}, {"role": "user", "content": "A dog, please."}],
        add_generation_prompt=True)
    new = state.reuse_for(second)
    assert 0 < len(new) < len(second)  # the shared prefix stays cached
    resumed = step(small.model, state, new)
    fresh = step(small.model, CacheState.new(small.model, 512), second)
    assert int(resumed.argmax()) == int(fresh.argmax())
    assert torch.allclose(resumed.softmax(-1), fresh.softmax(-1), atol=2e-3)


def test_conversations_batched_together_each_get_their_own_reply(small):
    prompts = [prompt_ids(small, text) for text in ("What is the capital of Spain?", "How do I make tea?",
                                                    "Name three colours.")]
    alone = [generate_ar_batch(small.model, [p], 20, small.tokenizer.eos_ids)[0] for p in prompts]
    together = generate_ar_batch(small.model, prompts, 20, small.tokenizer.eos_ids)
    assert len({tuple(r) for r in alone}) == 3
    assert together == alone


def test_a_fork_shares_the_prefix_and_goes_on_separately(small):
    prompt = prompt_ids(small, "Tell me a story about a cat.")
    root = CacheState.new(small.model, 512)
    step(small.model, root, prompt[:-3])
    a, b = root.fork(small.model), root.fork(small.model)
    assert a.ids == b.ids == prompt[:-3] and len({a.slot.seq, b.slot.seq, root.slot.seq}) == 3
    la, lb = step(small.model, a, prompt[-3:]), step(small.model, b, [prompt[0]] * 3)
    ref = step(small.model, CacheState.new(small.model, 512), prompt)
    assert int(la.argmax()) == int(ref.argmax()) and torch.allclose(la.softmax(-1), ref.softmax(-1), atol=2e-3)
    assert not torch.allclose(lb, la)


def test_a_new_conversation_shares_the_cells_another_has_read(small):
    """A session's first turn starts from the system prompt another session's sequence holds
    (`CachePool.share`: llama_memory_seq_cp, no copy) and replies as one that read it all does."""
    system = {"role": "system", "content": "You are a friendly voice assistant. Answer in one short sentence."}
    one = [system, {"role": "user", "content": "What colour is the sky?"}]
    two = [system, {"role": "user", "content": "Name a fruit."}]
    cfg = DecodeConfig(mode="ar", max_new_tokens=8)
    engine = Engine(small, max_seq_len=512, defaults=cfg)
    a, b = ConversationCache(), ConversationCache()
    list(engine.generate_sync(one, conversation=a))
    second = list(engine.generate_sync(two, conversation=b))
    fresh = list(Engine(small, max_seq_len=512, defaults=cfg).generate_sync(two))
    shared = len(os.path.commonprefix([engine.prompt_ids(one), engine.prompt_ids(two)]))
    assert second[0].prefilled_tokens == second[0].prompt_tokens - shared and shared > 10
    assert a.state is not None and b.state is not None and a.state.slot.seq != b.state.slot.seq
    assert [t for p in second for t in p.token_ids] == [t for p in fresh for t in p.token_ids]


def test_a_full_cache_evicts_idle_conversations_not_busy_ones():
    loaded = load("small", max_seq_len=256, quantize="gguf")
    prompt = prompt_ids(loaded, "What is the capital of Spain?")
    loaded.model.kv_tokens = 2 * len(prompt) + 10  # as if the shared cache were this small
    idle, busy = CacheState.new(loaded.model, 256), CacheState.new(loaded.model, 256)
    step(loaded.model, idle, prompt)
    step(loaded.model, busy, prompt)
    with pytest.raises(ContextOverflow, match="cache is full"):  # nobody has been idle long enough
        step(loaded.model, CacheState.new(loaded.model, 256), prompt)
    idle.slot.last_used -= llamacpp.IDLE_EVICT_S
    third = CacheState.new(loaded.model, 256)
    step(loaded.model, third, prompt)
    assert idle.ids == [] and idle.slot.seq is None  # evicted: its next turn prefills again
    assert busy.ids == prompt and third.ids == prompt
    third.slot.last_used -= llamacpp.IDLE_EVICT_S  # the evicted one comes back: the idle one makes room
    assert step(loaded.model, idle, prompt).shape[-1] == loaded.model.args.vocab_size
    assert third.ids == [] and busy.ids == prompt


def test_an_interrupted_step_leaves_the_cache_as_it_was(small):
    """`interrupt()` stops a step begun interruptible, from another thread: it raises, keeps none
    of its rows (the conversation's earlier ones stay), and the same step run again gives what it
    gives where it was never stopped. A step not begun interruptible is not stopped."""
    prompt = prompt_ids(small, "Summarise this list: " + ", ".join(f"item {i}" for i in range(90)))
    head, rest = prompt[:20], prompt[20:]
    state = CacheState.new(small.model, 512)
    step(small.model, state, head)
    done = threading.Event()

    def interrupting() -> None:
        while not done.is_set():
            small.model.interrupt()
            time.sleep(0.001)

    interrupter = threading.Thread(target=interrupting)
    interrupter.start()
    try:
        began = time.perf_counter()
        with pytest.raises(Interrupted):
            run_many(small.model, [Forward(state, rest)], interruptible=True)
        stopped_s = time.perf_counter() - began
        assert state.ids == head and state.slot.cells == len(head)
        assert small.model._lib.llama_memory_seq_pos_max(small.model._mem, state.slot.seq) == len(head) - 1
        began = time.perf_counter()
        again = step(small.model, state, rest)  # not interruptible: it runs through
        assert stopped_s < (time.perf_counter() - began) / 2
    finally:
        done.set()
        interrupter.join()
    never = CacheState.new(small.model, 512)  # the same two steps, never interrupted
    step(small.model, never, head)
    expected = step(small.model, never, rest)
    # The rows land elsewhere in the shared cache than where they were never stopped, and ggml's
    # attention sums in blocks of cells: probabilities move by up to ~0.04 for that alone (measured
    # with no interruption: rows written, removed and written again; AMX and AVX2 kernels). Rows left
    # behind are caught above (the sequence's last position) and by llama.cpp (positions out of order).
    assert int(again.argmax()) == int(expected.argmax())
    assert torch.allclose(again.softmax(-1), expected.softmax(-1), atol=0.1)


def test_threads_are_asked_for_every_step(small):
    state = CacheState.new(small.model, 512)
    asked = []
    small.model.threads = lambda: asked.append(2) or 2
    try:
        step(small.model, state, prompt_ids(small, "Hi!"))
        assert asked and small.model._lib.llama_n_threads(small.model._ctx) == 2
    finally:
        small.model.threads = torch.get_num_threads


def test_the_engine_decides_once_that_diffusion_decodes_ar_here_and_says_why(small):
    engine = Engine(small, max_seq_len=512)
    assert small.weights == "gguf" and engine.decoding.mode == "ar" and "llama.cpp" in engine.decoding.why
    assert engine.defaults.mode == "ar"  # the default diffusion mode is AR here
    pieces = list(engine.generate_sync(chat("What is the capital of Spain?"), max_new_tokens=12))
    assert pieces[-1].done and "".join(p.text for p in pieces).strip()
    asked = list(engine.generate_sync(chat("What is the capital of Spain?"), DecodeConfig(mode="diffusion"),
                                      max_new_tokens=12))  # asked for diffusion: the same AR reply
    assert [p.token_ids for p in asked] == [p.token_ids for p in pieces]
    with pytest.raises(ValueError, match="causal rows"):  # a draft tree needs PyTorch's attention masks
        run_many(small.model, [Forward(CacheState.new(small.model, 512), [1, 2], draft=[3, 4], draft_causal=True,
                                       parents=[-1, -1])])
    with pytest.raises(ModelLoadError, match="not a GGUF model"):
        load("/tmp", quantize="gguf")
    with pytest.raises(ModelLoadError, match="adapter"):
        load("small", quantize="gguf", adapter="default")


def test_drafted_rows_score_as_the_steps_they_stand_for(small):
    """Verify on llama.cpp: the clean token and a drafted chain in one llama_decode give, at each
    drafted row, the logits one AR step at a time gives (ggml's batched kernels round a little
    differently: same choice, near distributions); rejected rows are dropped before the next step."""
    prompt = prompt_ids(small, "Tell me a story about a cat.")
    ar = CacheState.new(small.model, 512)
    steps = [step(small.model, ar, prompt)]
    for _ in range(5):
        steps.append(step(small.model, ar, [int(steps[-1].argmax())]))
    reply = ar.ids[len(prompt):] + [int(steps[-1].argmax())]
    state = CacheState.new(small.model, 512)
    step(small.model, state, prompt[:-1])
    last, drafted = run_many(small.model, [Forward(state, [prompt[-1]], draft=reply[:4], draft_causal=True)])[0]
    rows = torch.cat([last[None], drafted])
    assert rows.argmax(-1).tolist() == [int(s.argmax()) for s in steps[:5]]
    assert torch.allclose(rows.softmax(-1), torch.stack(steps[:5]).softmax(-1), atol=5e-3)
    assert state.ids == prompt and state.slot.cells == len(prompt) + 4  # drafted rows are scratch
    wrong = step(small.model, state, [reply[0] + 1])  # reject the draft: the next step overwrites its rows
    fresh = step(small.model, CacheState.new(small.model, 512), prompt + [reply[0] + 1])
    assert int(wrong.argmax()) == int(fresh.argmax())
    assert torch.allclose(wrong.softmax(-1), fresh.softmax(-1), atol=5e-3)


def test_json_schema_output_is_constrained_on_llamacpp_logits(small):
    """llguidance masks llama.cpp's logits as it does PyTorch's: the reply is JSON of the schema."""
    import json

    engine = Engine(small, max_seq_len=512)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    pieces = list(engine.generate_sync(chat("Name a big city and its population, as JSON."),
                                       constraint=engine.grammars.json(schema), max_new_tokens=60))
    reply = json.loads("".join(p.text for p in pieces))
    assert set(reply) == {"city", "population"} and isinstance(reply["population"], int)


def variant_in_subprocess(forced: str | None) -> subprocess.CompletedProcess:
    """A fresh process (ggml loads its CPU backend once) loads `small` and decodes a token."""
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_VARIANT"}
    if forced is not None:
        env["GGML_CPU_VARIANT"] = forced
    code = ("from engine import llamacpp; from engine.loading import load; from engine.decode import CacheState, run;"
            "m = load('small', max_seq_len=64, quantize='gguf').model;"
            "print(llamacpp.cpu_variant(), int(run(m, CacheState.new(m, 64), [1, 2, 3], False, [])[0].argmax()))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_cpu_variant_is_the_best_this_cpu_runs_and_can_be_forced():
    """One build, every CPU class: ggml's variants score this CPU and the best one runs; another
    class's kernels can be forced (GGML_CPU_VARIANT), and give the same next token here."""
    shipped = {p.name[len("libggml-cpu-"):].split(".")[0] for p in llamacpp.library_dir().glob("libggml-cpu-*.so")}
    if not shipped:
        pytest.skip("this llama-cpp-python was built for one CPU class (no loadable variants)")
    flags = set(Path("/proc/cpuinfo").read_text().split())
    best = variant_in_subprocess(None)
    assert best.returncode == 0, best.stderr[-2000:]
    name, token = best.stdout.split()
    zen4 = {"avx512vbmi", "avx512_vnni", "avx512_bf16"}
    expected = ("sapphirerapids" if zen4 | {"amx_tile", "amx_int8"} <= flags else "zen4" if zen4 <= flags else
                "skylakex" if "avx512f" in flags else "haswell" if "avx2" in flags else "x64")
    assert name == (expected if expected in shipped else name) and name in shipped
    avx2 = variant_in_subprocess("haswell")  # ./dev builds it on every x86 machine: the class CI forces
    assert avx2.returncode == 0 and avx2.stdout.split() == ["haswell", token], avx2.stderr[-2000:]
    wrong = variant_in_subprocess("pentium")
    assert wrong.returncode != 0 and "GGML_CPU_VARIANT='pentium' is not one of this build's" in wrong.stderr


LOSSLESS_AT_LEAST = 0.9  # replies of greedy verify equal to greedy AR, token for token, on llama.cpp's kernels


def test_greedy_verify_on_llamacpp_gives_the_ar_replies_within_the_stated_tolerance():
    """ggml's batched kernels round a drafted row a little differently from the one-row kernel, so a
    near tie may flip: losslessness on llama.cpp is a measured share, and this is its bound."""
    loaded = load("small", max_seq_len=512, quantize="gguf", drafter="")  # prompt lookup, asked for
    engine = Engine(loaded, max_seq_len=512)
    assert engine.decoding.mode == "diffusion" and "prompt lookup" in engine.decoding.why
    questions = ["What is the capital of Spain?", "Repeat after me: red, green, blue, red, green, blue.",
                 "How do I make tea?", "Count from one to ten.", "Name three colours.",
                 "Say 'hello world' three times.", "What do bees make?", "Spell the word 'banana'.",
                 "List the days of the week.", "What is two plus two?"]
    same = forwards = tokens = 0
    for q in questions:
        ar = [t for p in engine.generate_sync(chat(q), DecodeConfig(mode="ar", max_new_tokens=32)) for t in p.token_ids]
        pieces = list(engine.generate_sync(chat(q), DecodeConfig(mode="diffusion", max_new_tokens=32)))
        verify = [t for p in pieces for t in p.token_ids]
        same += verify == ar
        forwards, tokens = forwards + pieces[-1].forwards, tokens + pieces[-1].tokens
    assert same >= LOSSLESS_AT_LEAST * len(questions), same
    assert tokens > forwards  # the repeated phrases were drafted and accepted
