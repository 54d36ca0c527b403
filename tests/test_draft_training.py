"""`engine draft`: what a draft head learns from, and that its training resumes.

On a tiny random checkpoint: the corpus's targets are the base's own greedy next tokens, whether
read off the base's greedy replies or computed over text it did not write; a chained head trains
on both, its held-out figure comes from the base's replies only, and a second run resumes; the
decoded held-out figure is exactly what greedy `verify` decoding with the head then does.
"""

from __future__ import annotations

import json

import pytest
import torch

from decoding import generate
from engine.train.data import chat
from engine.decode import CacheState, DecodeConfig, generate_ar_batch
from engine.draft import load_head
from engine.loading import load
from engine.model import visibility_mask
from engine.train.draft import Corpus, DraftTrainConfig, held_out_figures, read_corpus, split, train

import tinyckpt
from tinyckpt import EOS_ID

pytestmark = pytest.mark.usefixtures("one_torch_thread")
WINDOW = 8


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_draft")
    tinyckpt.write_hf_folder(folder, "qwen2", tie=False, seed=3)
    return load(str(folder), max_seq_len=256, drafter="")


def full_argmax(loaded, seq: list[int]) -> list[int]:
    """The base's greedy next token after every position, from one plain causal forward."""
    t = len(seq)
    with torch.no_grad():
        logits = loaded.model(torch.tensor([seq]), torch.arange(t), visibility_mask(torch.arange(t) + 1, t))[0]
    return logits.argmax(-1).tolist()


def write_rows(path, rows: list[tuple[str, list[int]]]) -> None:
    with path.open("w") as f:
        for prompt, reply in rows:
            f.write(json.dumps({"prompt": prompt, "reply_ids": reply}) + "\n")


PROMPTS = ["hello there friend", "what is the time", "tell me about cats", "good morning to you",
           "how are you today", "where is the park", "I like green tea", "any plans tonight"]


@pytest.fixture(scope="module")
def distilled(tiny, tmp_path_factory):
    """The tiny base's own greedy replies, as `engine.train.data.distill` writes them."""
    tok = tiny.tokenizer
    replies = generate_ar_batch(tiny.model, [tok.encode_chat(chat(p)) for p in PROMPTS], 12, tok.eos_ids)
    path = tmp_path_factory.mktemp("run") / "distilled.jsonl"
    write_rows(path, list(zip(PROMPTS, replies)))
    return path


def test_text_targets_are_the_base_greedy_tokens_after_every_position(tiny, tmp_path):
    rng = torch.Generator().manual_seed(0)
    rows = [(p, torch.randint(5, 200, (10,), generator=rng).tolist()) for p in PROMPTS[:3]]
    write_rows(tmp_path / "text.jsonl", rows)
    corpus = read_corpus(tiny, tmp_path / "text.jsonl", WINDOW, greedy=True, log=quiet)
    assert corpus.distilled == [False] * 3
    for e in range(3):
        s, n, start = corpus.starts[e], corpus.lengths[e], corpus.train_from[e]
        seq = corpus.ids[s:s + n].tolist()
        assert seq[-1] == tiny.tokenizer.turn_end_id and seq[-11:-1] == rows[e][1]
        expected = full_argmax(tiny, seq)
        assert corpus.targets[s + start:s + n - 1].tolist() == expected[start:n - 1]
        assert corpus.targets[s + n - 1] == -1 and (corpus.targets[s - WINDOW:s + start] == -1).all()
    # the shared system prompt is learned on once (the first example), not again in every example
    assert corpus.train_from[0] == 0 and corpus.train_from[1] == corpus.train_from[2] > 5


def test_a_greedy_reply_gives_the_same_targets_read_either_way(tiny, distilled, tmp_path):
    """On the base's own reply, the next reply token is its argmax: both readings agree."""
    own = read_corpus(tiny, distilled, WINDOW, log=quiet)
    (tmp_path / "same.jsonl").write_text(distilled.read_text())
    computed = read_corpus(tiny, tmp_path / "same.jsonl", WINDOW, greedy=True, log=quiet)
    assert own.distilled == [True] * len(PROMPTS)
    for e in range(len(PROMPTS)):
        pos = own.positions([e])
        assert len(pos) > 3
        assert torch.equal(own.targets[pos], computed.targets[pos])


def test_a_chained_head_trains_on_both_and_resumes_only_on_the_same_data(tiny, distilled, tmp_path):
    rows = [(p, list(range(20 + i, 32 + i))) for i, p in enumerate(PROMPTS)]
    write_rows(tmp_path / "text.jsonl", rows)
    corpus = Corpus.join([read_corpus(tiny, distilled, WINDOW, log=quiet),
                          read_corpus(tiny, tmp_path / "text.jsonl", WINDOW, greedy=True, log=quiet)])
    held, trained = split(corpus, 0)
    assert all(corpus.distilled[e] for e in held) and len(trained) == 2 * len(PROMPTS) - len(held)
    cfg = DraftTrainConfig(block=3, window=WINDOW, n_layers=1, batch=16, max_steps=4, eval_every=2, warmup_steps=1,
                           chain=True)
    lines: list[str] = []
    first = train(tiny, corpus, cfg, tmp_path / "out", log=lines.append)
    assert first["steps"] == 4 and 1.0 <= first["heldout_tokens_per_forward"] <= 4.0
    head = load_head(tmp_path / "out" / "drafter.safetensors", tiny.model.args.dim, tiny.model.args.vocab_size)
    assert head.args.chain and EOS_ID in head.vocab_ids.tolist()
    lines.clear()
    again = train(tiny, corpus, DraftTrainConfig(**{**cfg.__dict__, "max_steps": 6}), tmp_path / "out",
                  log=lines.append)
    assert "resumed at step 4" in lines and again["steps"] == 6
    # other data in the same folder is another run: resuming it would hold out replies already trained on
    fewer = read_corpus(tiny, distilled, WINDOW, log=quiet)
    with pytest.raises(ValueError, match="other data"):
        train(tiny, fewer, DraftTrainConfig(**{**cfg.__dict__, "max_steps": 8}), tmp_path / "out", log=lines.append)


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_the_decoded_figure_is_what_verify_decoding_does(tiny, distilled, tmp_path, chain, threshold):
    """Per reply, tokens per forward from walking the corpus equals greedy verify decoding's own count,
    with a head that keeps some drafts and misses others: the figure is a prediction, not a proxy."""
    corpus = read_corpus(tiny, distilled, WINDOW, log=quiet)
    cfg = DraftTrainConfig(block=3, window=WINDOW, n_layers=1, batch=32, max_steps=40, eval_every=1000,
                           warmup_steps=1, chain=chain, lr=5e-3)
    train(tiny, corpus, cfg, tmp_path / "out", log=quiet)
    head = load_head(tmp_path / "out" / "drafter.safetensors", tiny.model.args.dim, tiny.model.args.vocab_size)
    tok, model = tiny.tokenizer, tiny.model
    decode = DecodeConfig(max_new_tokens=12, draft_threshold=threshold)
    per_reply = []
    for e, prompt in enumerate(PROMPTS):
        blocks = list(generate(model, CacheState.new(model, 256), tok.encode_chat(chat(prompt)), decode, tiny.spec,
                               tok.eos_ids, head))
        tokens = sum(len(b.token_ids) for b in blocks)
        predicted = held_out_figures(head, corpus, [e], model.embed_tokens, threshold)[1]
        assert predicted == pytest.approx(tokens / blocks[-1].forwards), prompt
        per_reply.append(tokens / blocks[-1].forwards)
    assert max(per_reply) > 1.0 and min(per_reply) < 3.5  # drafts were kept, and some were not
