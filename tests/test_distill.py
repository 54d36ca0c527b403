"""`engine distill`, the data program that grows across sessions (engine/train/distill.py), on the
packaged SmolLM2 GGUF on llama.cpp's kernels: a refilled batch gives each conversation the reply
decoding it alone gives, later turns carry the model's own earlier replies as the service keeps
them, shards are written whole, and a second run only adds what the first did not answer."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace

import pytest
import torch

from engine import llamacpp
from engine.decode import CacheState, DecodeConfig, Forward, generate_ar_batch, run_many
from engine.loading import load
from engine.stream import Engine
from engine.train import distill
from engine.train.distill import Conversation

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

if llamacpp.available():
    pytest.skip(llamacpp.available(), allow_module_level=True)

SYSTEM = distill.VOICE_SYSTEM_PROMPT
TOKENS = 48
# A reply may part from the one decoding its prompt alone gives where ggml rounds a near tie the other
# way (a batch's rows, a prefill cut elsewhere: tests/test_llamacpp.py); where it does, the two tokens'
# logits after the common part (one teacher-forced forward) are this close (measured: 0.01-0.22; a
# wrong cache gives whole logits)
TIE = 0.5


@pytest.fixture(scope="module")
def small():
    return load("small", max_seq_len=1024, quantize="gguf")


def talks() -> list[Conversation]:
    return [Conversation("a", ["Hi, how was your weekend?", "Did you go hiking?", "Where do you like to walk?"]),
            Conversation("b", ["What is the capital of France?"]),
            Conversation("c", ["I love rainy days.", "Do you like the rain?"]),
            Conversation("d", ["Set a timer for five minutes."], tools=True, source="tools"),
            Conversation("e", ["Tell me something about dogs."]),
            Conversation("f", ["What's your favourite colour?", "Why that one?"])]


def test_replies_are_what_the_service_would_get_and_a_second_run_only_adds(small, tmp_path, monkeypatch):
    monkeypatch.setattr(distill, "conversations", lambda seed=0: talks())
    monkeypatch.setattr(distill, "SHARD_REPLIES", 4)
    assert distill.grow(small, tmp_path, in_flight=3, max_new_tokens=TOKENS, max_replies=5, log=print) == 5
    first = list(distill.read_shards(tmp_path))
    assert [p.name for p in distill.shard_paths(tmp_path)] == ["shard-0000.jsonl.gz", "shard-0001.jsonl.gz"]
    added = distill.grow(small, tmp_path, in_flight=3, max_new_tokens=TOKENS, log=print)
    rows = list(distill.read_shards(tmp_path))
    assert rows[:len(first)] == first and len(rows) == len(first) + added
    # a conversation with a reply written in the first run is not asked again
    assert not {r["key"] for r in first} & {r["key"] for r in rows[len(first):]}
    assert json.loads((tmp_path / "meta.json").read_text())["system_prompt"] == SYSTEM

    engine = Engine(small, max_seq_len=1024)
    for row in rows:
        messages = [{"role": "system", "content": SYSTEM}, *row["messages"]]
        tools = distill.TOOLS if row["tools"] else None
        assert row["prompt_ids"] == engine.prompt_ids(messages, tools)  # what the voice service sends
        assert 0 < len(row["reply_ids"]) <= TOKENS
        alone = generate_ar_batch(small.model, [row["prompt_ids"]], TOKENS, small.tokenizer.eos_ids)[0]
        parted = next((i for i, (a, b) in enumerate(zip(alone, row["reply_ids"])) if a != b), None)
        if parted is not None:
            state = CacheState.new(small.model, 1024)
            last = run_many(small.model, [Forward(state, row["prompt_ids"] + row["reply_ids"][:parted])])[0][0]
            assert float(last[alone[parted]] - last[row["reply_ids"][parted]]).__abs__() < TIE, row
        else:
            assert alone == row["reply_ids"]
        if row["turn"]:  # the history holds the model's own earlier reply
            earlier = next(r for r in rows if r["key"] == row["key"] and r["turn"] == row["turn"] - 1)
            said = small.tokenizer.decode([t for t in earlier["reply_ids"] if t not in small.tokenizer.eos_ids])
            assert row["messages"][-2] == {"role": "assistant", "content": said.strip()}
    assert max(r["turn"] for r in rows) >= 1  # a conversation went on with its own replies
    with gzip.open(distill.shard_paths(tmp_path)[0], "rt") as f:
        assert set(json.loads(f.readline())) == {"key", "turn", "source", "messages", "tools", "prompt_ids",
                                                 "reply_ids"}


def test_the_program_leaves_out_every_evaluation_prompt_and_the_held_out_split():
    convs = distill.conversations()
    banned = distill.evaluation_prompts()
    asked = [t for c in convs for t in c.turns]
    assert len(convs) > 10_000 and 1 <= max(len(c.turns) for c in convs) <= distill.MAX_TURNS
    assert not {distill._normal(t) for t in asked} & banned
    assert sum(c.tools for c in convs) > 0.05 * len(convs)
    train = {t for turns in distill._chitchat_turns("train", 5) for t in turns}
    held_only = {t for turns in distill._chitchat_turns("heldout", 5) for t in turns} - train
    assert len(held_only) > 1000 and not held_only & {t for c in convs for t in c.turns}


def test_a_head_on_several_layers_trains_on_the_shards_and_verify_keeps_the_ar_replies(tmp_path, monkeypatch):
    """The layers a head reads come from ggml's eval callback in the forward that verifies: read back
    from the shards with the base's top-K, trained (output rows frozen, dropout, early stopping), loaded
    by its file's word on which layers, and drafting on llama.cpp's kernels changes no greedy reply
    beyond the tolerance tests/test_llamacpp.py states for batched rows."""
    from safetensors.torch import load_file
    from engine.draft import read_head_info
    from engine.evals.bench import draft_despite
    from engine.train import draft as train_draft
    layers = (3, 15, 29)
    base = load("small", max_seq_len=1024, quantize="gguf", layers=layers)
    monkeypatch.setattr(distill, "conversations", lambda seed=0: talks() * 3)
    monkeypatch.setattr(distill, "SHARD_REPLIES", 10)  # 30 replies: three shards
    distill.grow(base, tmp_path / "data", in_flight=6, max_new_tokens=24, log=print)
    corpus = train_draft.read_shards(base, tmp_path / "data", 8, cache=tmp_path / "read-back", log=print)
    said: list[str] = []  # a second read (a resumed run, another head on the same layers) runs nothing
    again = train_draft.read_shards(base, tmp_path / "data", 8, cache=tmp_path / "read-back", log=said.append)
    assert not said and torch.equal(again.hidden, corpus.hidden) and again.starts == corpus.starts
    assert corpus.hidden.shape == (len(corpus.ids), len(layers) * base.model.args.dim)
    assert corpus.top_ids is not None and corpus.top_probs is not None
    at = corpus.positions(list(range(len(corpus.starts))))
    assert (corpus.hidden[at].float().abs().sum(-1) > 0).all()  # every reply position has its states
    # the base's top-1 after a reply token is the greedy token it said there (near ties aside)
    assert (corpus.top_ids[at, 0].long() == corpus.targets[at]).float().mean() > 0.85
    cfg = train_draft.DraftTrainConfig(block=3, window=8, n_layers=1, draft_vocab=256, batch=32, max_steps=30,
                                       eval_every=10, layers=layers, dropout=0.1, width=128, distill_weight=0.5,
                                       patience=2)
    result = train_draft.train(base, corpus, cfg, tmp_path / "run", log=print)
    head_file = tmp_path / "run" / "drafter.safetensors"
    assert result["heldout_decoded_tokens_per_forward"] >= 1.0
    loaded = load("small", max_seq_len=1024, quantize="gguf", drafter=str(head_file))
    assert loaded.drafter is not None and loaded.drafter.args.layers == layers
    engine = Engine(loaded, max_seq_len=1024)
    assert engine.decoding.mode == "ar"  # drafting pays on no CPU class measured: /healthz says with which figure
    assert f"on layers 3,15,29 decoded {result['heldout_decoded_tokens_per_forward']:.2f}" in engine.decoding.why
    # a head goes on learning from the shards after those it learnt from (a sitting reads ~10k replies back)
    first = len(distill.read_shard(distill.shard_paths(tmp_path / "data")[0]))
    rest = train_draft.read_shards(base, tmp_path / "data", 8, cache=tmp_path / "read-back", skip=first, log=print)
    assert 0 < len(rest.starts) < len(corpus.starts) and torch.equal(rest.hidden, corpus.hidden[-len(rest.hidden):])
    train_draft.train(base, rest, replace(cfg, init=str(head_file), max_steps=0, patience=0), tmp_path / "on",
                      log=print)
    started, saved = (load_file(str(f)) for f in (head_file, tmp_path / "on" / "drafter.safetensors"))
    assert started.keys() == saved.keys() and all(torch.equal(started[k], saved[k]) for k in started)
    assert read_head_info(tmp_path / "on" / "drafter.safetensors")["replies"] == \
        read_head_info(head_file)["replies"] + len(rest.starts)
    with pytest.raises(ValueError, match="another shape"):
        train_draft.train(base, rest, replace(cfg, init=str(head_file), width=64), tmp_path / "other", log=print)
    draft_despite(engine)
    same = 0
    for talk in talks():
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": talk.turns[0]}]
        ar, verify = ([t for p in engine.generate_sync(messages, DecodeConfig(mode=mode, max_new_tokens=24))
                       for t in p.token_ids] for mode in ("ar", "diffusion"))
        same += verify == ar
    assert same >= 0.8 * len(talks()), same
