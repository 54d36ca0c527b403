"""Smoke tests of `engine bench` and `engine eval` on two prompts, and their helpers."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.evals import bench, eval as evaluate
from engine.evals.bench import percentile, read_prompts
from engine.decode import DecodeConfig
from engine.evals.eval import repeated_ngram_rate
from engine.model import visibility_mask
from engine.stream import Engine

pytestmark = pytest.mark.slow

PROMPTS = Path(__file__).parents[1] / "engine" / "prompts"
CFG = DecodeConfig(max_new_tokens=12)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The test machine's CPUs are shared with other jobs: a single intra-op thread avoids OpenMP
    oversubscription, which slows forwards down by an order of magnitude there."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", autouse=True)
def shared_engines():
    """Load each distinct checkpoint once for the whole module (the loads dominate the run time)."""
    cache: dict = {}
    original = Engine.load.__func__

    def load(cls, name="default", adapter=None, **kwargs):
        key = (name, str(adapter or ""))
        if key not in cache:
            cache[key] = original(cls, name, adapter=adapter, **kwargs)
        return cache[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "load", classmethod(load))
        yield cache


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_repeated_ngram_rate():
    assert repeated_ngram_rate([]) == 0.0
    assert repeated_ngram_rate([1, 2, 3]) == 0.0  # shorter than one 4-gram
    assert repeated_ngram_rate([1, 2, 3, 4]) == 0.0
    assert repeated_ngram_rate([1, 2, 3, 4, 5, 6]) == 0.0
    # 4-grams: 1234 2341 3412 4123 1234 -> the last one occurred before: 1 of 5
    assert repeated_ngram_rate([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)
    # 7 identical tokens: 4 four-grams, all equal, 3 of them repeats
    assert repeated_ngram_rate([9] * 7) == pytest.approx(3 / 4)
    assert repeated_ngram_rate([5, 6, 5, 6, 5], n=2) == pytest.approx(2 / 4)


def test_percentile_and_prompts(tmp_path):
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    assert math.isnan(percentile([], 50))
    assert len(read_prompts(PROMPTS / "heldout.jsonl")) >= 35
    assert len(read_prompts(PROMPTS / "bench.jsonl", limit=3)) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="prompt"):
        read_prompts(bad)


def test_bench_smoke(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench.run_bench("small", None, PROMPTS / "bench.jsonl", out, CFG, limit=2)
    assert result["model"] == "small" and set(result["summary"]) == {"ar", "diffusion", "ratios"}
    printed = capsys.readouterr().out
    assert "[2/2]" in printed and "diff/AR" in printed
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert set(summary) >= {"ar", "diffusion", "ratios"}
    for mode in ("ar", "diffusion"):
        s = summary[mode]
        for key in ("ttfb_ms_p50", "ttfb_ms_p95", "tok_s", "tokens_per_forward", "prefill_ms_p50", "ttfb8_ms_p50"):
            assert finite_positive(s[key]), (mode, key, s[key])
        assert s["ttfb_ms_p50"] <= s["ttfb_ms_p95"]
        assert s["ttfb_ms_p50"] <= s["ttfb8_ms_p50"]
        assert s["prefill_ms_p50"] <= s["ttfb_ms_p95"]
        assert len(s["per_prompt"]) == 2
        for row in s["per_prompt"]:
            assert 0 < row["tokens"] <= CFG.max_new_tokens and row["text"]
            # decoding after the first piece: the rest of the reply, in the rest of the time
            assert row["decode_tokens"] < row["tokens"] and row["decode_ms"] < row["total_ms"]
        if sum(r["decode_tokens"] for r in s["per_prompt"]):
            assert finite_positive(s["decode_tok_s"])
    assert summary["ar"]["tokens_per_forward"] == pytest.approx(1.0)  # one token per forward, prefill included
    assert all(finite_positive(v) for k, v in summary["ratios"].items() if k != "forward_ms_p50"), summary["ratios"]
    machine = data["machine"]
    assert machine["cpu_count"] >= 1 and machine["torch"] and machine["torch_threads"] >= 1 and machine["platform"]


def test_eval_smoke(tmp_path, capsys):
    out = tmp_path / "eval.json"
    result = evaluate.run_eval("small", None, PROMPTS / "heldout.jsonl", out, CFG, limit=2)
    printed = capsys.readouterr().out
    assert "[2/2]" in printed and "teacher NLL/token" in printed
    data = json.loads(out.read_text())
    s = data["summary"]
    for key in ("tokens_per_forward", "ttfb_ms_p50", "nll_diffusion", "nll_teacher", "nll_ratio"):
        assert finite_positive(s[key]), (key, s[key])
    for key in ("rep4_diffusion", "rep4_teacher"):
        assert 0.0 <= s[key] <= 1.0
    assert len(data["per_prompt"]) == 2
    for row in data["per_prompt"]:
        assert row["reply_diffusion"] and row["reply_teacher"]
        assert 0 < row["tokens"] <= CFG.max_new_tokens and 0 < row["teacher_tokens"] <= CFG.max_new_tokens
    assert data["config"]["mode"] == "diffusion"
    assert result["summary"]["n"] == 2


def test_answers_smoke(tmp_path, capsys):
    """Answer accuracy: every question asked in both modes on the same weights; greedy verify
    replies are the AR replies, so both modes are right on the same questions."""
    out = tmp_path / "answers.json"
    result = evaluate.run_answers("small", None, PROMPTS / "answers_heldout.jsonl", out, CFG, limit=4)
    printed = capsys.readouterr().out
    assert "[4/4]" in printed and "accuracy" in printed
    s = json.loads(out.read_text())["summary"]
    assert s["identical_replies"] == {"diffusion": 4}
    assert s["ar"]["right"] == s["diffusion"]["right"]
    assert s["ar"]["tokens_per_forward"] == pytest.approx(1.0) and s["diffusion"]["tokens_per_forward"] > 1.0
    rows = result["per_mode"]["diffusion"]
    assert all(row["right"] == evaluate.is_right(row["reply"], row["answer"]) for row in rows)


def test_answer_sets_are_well_formed_and_disjoint():
    dev = evaluate.read_questions(PROMPTS / "answers_dev.jsonl")
    held = evaluate.read_questions(PROMPTS / "answers_heldout.jsonl")
    assert len(dev) + len(held) >= 100 and len(held) >= 50
    assert not {q["prompt"] for q in dev} & {q["prompt"] for q in held}
    assert evaluate.is_right("The capital of Spain is Madrid.", r"madrid")
    assert evaluate.BOILERPLATE.search("I'm sorry for any confusion, but") is not None
    assert evaluate.BOILERPLATE.search("Madrid is the capital of Spain.") is None


def test_reply_nll_agrees_with_cached_decoding():
    """The cache-free scoring forward sees what the cached AR decoder saw: its greedy tokens are the argmax."""
    engine = Engine.load("small", adapter="")
    messages = evaluate.chat("Tell me a short joke.", evaluate.VOICE_SYSTEM_PROMPT)
    reply = [t for p in engine.generate_sync(messages, DecodeConfig(mode="ar", max_new_tokens=6)) for t in p.token_ids]
    prompt = engine.prompt_ids(messages)
    ids, n = prompt + reply, len(prompt)
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        logits = engine.model(torch.tensor([ids]), pos, visibility_mask(pos + 1, len(ids)), slice(n - 1, len(ids) - 1))
    assert logits[0].argmax(-1).tolist() == reply
    nll = evaluate.reply_nll(engine.model, prompt, reply)
    expected = -logits[0].float().log_softmax(-1).gather(-1, torch.tensor(reply)[:, None]).sum()
    assert nll == pytest.approx(float(expected), rel=1e-4)
    assert evaluate.reply_nll(engine.model, prompt, list(reversed(reply))) > nll


def test_eval_with_adapter_scores_with_the_base(tmp_path, shared_engines):
    """With an adapter, the student has it merged and the teacher is the same checkpoint without it."""
    base = Engine.load("small", adapter="")
    q = base.model.layers[0].self_attn.q_proj
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "tiny-adapter.safetensors"
    save_file({"layers.0.self_attn.q_proj.lora_a": torch.randn(2, q.in_features, generator=g) * 0.05,
               "layers.0.self_attn.q_proj.lora_b": torch.randn(q.out_features, 2, generator=g) * 0.05},
              str(path), metadata={"rank": "2", "alpha": "2.0", "info": "{}",
                                   "spec": json.dumps(asdict(replace(base.spec, trained=True)))})
    result = evaluate.run_eval("small", str(path), PROMPTS / "heldout.jsonl", None, CFG, limit=1)
    assert result["adapter"] == str(path)
    assert {("small", ""), ("small", str(path))} <= set(shared_engines)
    student = shared_engines[("small", str(path))]
    assert student is not base and student.spec.trained and not base.spec.trained
    assert not torch.equal(student.model.layers[0].self_attn.q_proj.weight, q.weight)
    s = result["summary"]
    assert all(finite_positive(s[k]) for k in ("tokens_per_forward", "ttfb_ms_p50", "nll_diffusion", "nll_teacher"))


def test_answers_under_another_system_prompt(tmp_path):
    """`engine eval --answers --system-prompt`: the questions are asked under that prompt (a prompt
    for misheard speech is judged this way), the voice service's by default."""
    from engine.cli import main
    from engine.train.data import VOICE_SYSTEM_PROMPT
    replies = {}
    for name, extra in (("voice", []), ("banana", ["--system-prompt", "Whatever you are asked, answer only: banana."])):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "--model", "small", "--answers", str(PROMPTS / "answers_heldout.jsonl"), "--modes", "ar",
                     "--limit", "2", "--max-new-tokens", "12", "--json", str(out), *extra]) == 0
        result = json.loads(out.read_text())
        assert result["system_prompt"] == (extra[1] if extra else VOICE_SYSTEM_PROMPT)
        replies[name] = [row["reply"] for row in result["per_mode"]["ar"]]
    assert replies["voice"] != replies["banana"], replies


def test_engine_bench_runs_the_shipped_configuration(tmp_path):
    """`engine bench --model qwen2.5-1.5b --quantize auto` is what the voice service runs (llama.cpp's
    kernels here): its forward timer wraps llama.cpp's `step`, which the decoders call with
    `interruptible` (a wrapper that took only the forwards crashed the command). tau, the tokens a
    forward commits while decoding with the prefill forward left out, is 1 for AR."""
    from engine import llamacpp
    from engine.cli import main
    if llamacpp.available():
        pytest.skip(llamacpp.available())
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "qwen2.5-1.5b", "--quantize", "auto", "--threads", "1", "--prompts",
                 str(PROMPTS / "bench.jsonl"), "--limit", "1", "--max-new-tokens", "8", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["weights"] == "gguf" and data["identical_replies"] == 1
    for mode in ("ar", "diffusion"):
        s = data["summary"][mode]
        for key in ("ttfb_ms_p50", "ttfb8_ms_p50", "prefill_ms_p50", "forward_ms_p50", "decode_tok_s"):
            assert finite_positive(s[key]), (mode, key, s[key])
        row = s["per_prompt"][0]
        assert row["tokens"] == 8 and row["forwards"] == 8  # AR here: the decision keeps drafting off
        assert row["decode_forwards"] == 7 and row["verified_tokens"] == 7 and row["first_block"] == 1
        assert s["tau"] == pytest.approx(1.0) and s["first_block_tau"] == pytest.approx(1.0)


def test_tau_leaves_the_prefill_forward_out_and_counts_the_first_block_apart():
    # a reply of 9 tokens: the prefill commits 1, then forwards committing 4, 1 and 3 (each with the base's own)
    counts = bench.verify_counts({1: 1, 2: 5, 3: 6, 4: 9}, tokens=9, forwards=4)
    assert counts == {"decode_forwards": 3, "verified_tokens": 8, "tau": 8 / 3, "first_block": 4}
    # a reply that ended with the prefill has nothing verified
    assert bench.verify_counts({1: 1}, tokens=1, forwards=1)["first_block"] is None
