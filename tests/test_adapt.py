"""`engine adapt`: the masked-block objective trains, and the saved adapter reproduces the trained model."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

import engine.loading
from engine.train.adapt import AdaptConfig, evaluate_loss, pack, train
from engine.decode import DiffusionSpec
from engine.lora import LoRALinear, load_adapter
from engine.loading import load, packaged_smollm2_gguf
from engine.model import visibility_mask

import tinyckpt
from tinyckpt import EOS_ID, MASK_ID

ATOL = 1e-4


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def quiet(*_):
    pass


def tiny_examples(n: int = 6, prompt_len: int = 8, reply_len: int = 12) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    examples = []
    for _ in range(n):
        prompt = [rng.randrange(200) for _ in range(prompt_len)]
        first = rng.randrange(150)
        reply = [first + 3 * k for k in range(reply_len)] + [EOS_ID]  # a learnable pattern per example
        examples.append((prompt + reply, prompt_len))
    return examples


def round_lora_to_fp16(model) -> None:
    """What save_adapter stores: LoRA factors in fp16 (the mask embedding stays fp32)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_a.copy_(module.lora_a.half().float())
                module.lora_b.copy_(module.lora_b.half().float())


def probe_batches(examples, cfg: AdaptConfig):
    """A packed noisy batch (mask tokens, block masks, packed positions) and a plain causal sequence."""
    tokens, positions, mask, _, _ = pack(list(examples), cfg, MASK_ID, random.Random(7))
    plain = torch.tensor([examples[0][0] + [MASK_ID, MASK_ID]])
    t = plain.shape[1]
    return [(tokens, positions, mask), (plain, torch.arange(t), visibility_mask(torch.arange(t) + 1, t))]


def logits_on(model, batches) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(*b)[0] for b in batches]


@pytest.mark.parametrize("tie", [True, False])
def test_train_lowers_loss_and_adapter_round_trips(tmp_path, tie):
    folder = tmp_path / "base"
    tinyckpt.write_hf_folder(folder, "llama", tie=tie, seed=11)
    base = load(str(folder))
    spec = DiffusionSpec(mask_id=MASK_ID, block_size=4, shift=True, context="causal", trained=True)
    cfg = AdaptConfig(block_size=4, shift=True, rank=8, alpha=16.0, lr=5e-3, warmup_steps=1, pack_tokens=128,
                      max_tokens=3000, save_every=10_000, seed=0)
    examples = tiny_examples()
    before = evaluate_loss(base.model, examples, spec, cfg)
    result = train(base.model, examples, spec, cfg, tmp_path / "run", log=quiet)
    after = evaluate_loss(base.model, examples, spec, cfg)
    assert result["steps"] >= 25
    assert after < 0.5 * before, (before, after)

    # the saved adapter merged into a fresh copy of the base == the trained LoRA model
    path = tmp_path / "run" / "adapter.safetensors"
    assert path.exists() and (tmp_path / "run" / "train_state.pt").exists()
    round_lora_to_fp16(base.model)
    batches = probe_batches(examples, cfg)
    want = logits_on(base.model, batches)
    fresh = load(str(folder))
    untrained = logits_on(fresh.model, batches)
    assert load_adapter(fresh.model, path, fresh.spec) == spec
    got = logits_on(fresh.model, batches)
    for g, w, u in zip(got, want, untrained):
        assert (g - w).abs().max() <= ATOL
        assert (g - u).abs().max() > 1e-2  # the adapter does change the model
    # the tied head keeps the base row for the mask token; only the input embedding learned it
    assert torch.equal(fresh.model.lm_head.weight[MASK_ID], load(str(folder)).model.lm_head.weight[MASK_ID])


def test_default_with_adapter_trained_on_the_real_base(tmp_path, monkeypatch):
    """One training step on the packaged SmolLM2, then `load("small", adapter=...)`, offline."""
    def no_network(repo_id):
        raise AssertionError(f"tried to download {repo_id}")
    monkeypatch.setattr(engine.loading, "_download", no_network)

    base = load(str(packaged_smollm2_gguf()), max_seq_len=256)
    tok = base.tokenizer
    eos = next(iter(tok.eos_ids))
    prompt = tok.encode_chat([{"role": "user", "content": "Hi there! How are you?"}])
    examples = [(prompt + tok.encode("I'm doing well, thanks for asking!") + [eos], len(prompt))]
    spec = replace(base.spec, block_size=4, shift=True, trained=True)
    cfg = AdaptConfig(block_size=4, shift=True, rank=4, alpha=8.0, lr=1e-3, warmup_steps=1, pack_tokens=128,
                      max_tokens=1, save_every=10_000)
    t = len(examples[0][0])
    causal = (torch.tensor([examples[0][0]]), torch.arange(t), visibility_mask(torch.arange(t) + 1, t))
    noisy = pack(list(examples), cfg, spec.mask_id, random.Random(3))[:3]
    plain = logits_on(base.model, [causal, noisy])

    result = train(base.model, examples, spec, cfg, tmp_path, log=quiet)
    assert result["steps"] == 1
    round_lora_to_fp16(base.model)
    want = logits_on(base.model, [causal, noisy])

    loaded = load("small", adapter=tmp_path / "adapter.safetensors", max_seq_len=256)
    assert loaded.name == "small" and loaded.spec == spec
    got = logits_on(loaded.model, [causal, noisy])
    for g, w, p in zip(got, want, plain):
        # 30 layers and logits up to ~30: merging W + BA reorders fp32 sums, ~1e-4 apart at the end
        assert (g - w).abs().max() <= 5 * ATOL, float((g - w).abs().max())
        assert (g - p).abs().max() > 100 * ATOL, float((g - p).abs().max())
