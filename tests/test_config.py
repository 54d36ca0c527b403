from pathlib import Path

import pytest

from voice.config import CONFIG_DIR, Config, load_config


def test_default_toml_documents_exactly_the_defaults():
    assert load_config(CONFIG_DIR / "default.toml") == Config()


def test_gpu_profile_overrides_only_what_it_names():
    gpu = load_config(CONFIG_DIR / "gpu.toml")
    assert gpu.budget.voice_to_voice < Config().budget.voice_to_voice
    assert gpu.tts == Config().tts
    assert gpu.lm.device == "cuda" and gpu.asr.device == "cuda"


def test_the_lm_device_choice(monkeypatch):
    """`[lm] device`: auto takes CUDA only when PyTorch sees it; cuda without one is a clear error
    before anything loads; a GPU gets bf16 weights (fp16 where bf16 is missing), the CPU fp32."""
    import torch

    from engine.loading import ModelLoadError, pick_device, weights_dtype
    from voice.config import LmConfig
    from voice.pipeline.lm import LocalLM
    with pytest.raises(ValueError, match="lm.device"):
        LmConfig(device="tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == "cpu" and pick_device("cpu") == "cpu"
    with pytest.raises(ModelLoadError, match="no CUDA GPU"):
        LocalLM(LmConfig(device="cuda", model="no-such-model-is-loaded", threads=0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("auto") == "cuda" and pick_device("cuda") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert weights_dtype("cuda") == torch.bfloat16 and weights_dtype("cpu") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert weights_dtype("cuda") == torch.float16


def test_a_forward_is_built_on_the_cache_device():
    """Decoding feeds a model on any device: a forward's tokens, positions and mask are made where
    its conversation's cache lives (the meta device stands in for a GPU here)."""
    import torch

    from engine.decode import CacheState, Forward
    from engine.model import KVCache, segment
    caches = [KVCache(1, 2, 32, 8, torch.bfloat16, torch.device("meta")) for _ in range(2)]
    state = CacheState(caches, None, [1, 2, 3])
    for draft_causal in (False, True):
        rows = segment(Forward(state, [4, 5], False, [6, 7, 8], "causal", draft_causal))
        assert {t.device.type for t in (rows.tokens, rows.pos, rows.mask, rows.logits_rows)} == {"meta"}
        assert rows.mask.shape == (5, 8)
    chain = segment(Forward(state, [4, 5], False, [6, 7, 8], "causal", True))
    assert chain.alone == [(None, n) for n in (4, 5, 6, 7, 8)] and chain.slots is None
    # a tree (6 and 7 both follow 4, 8 follows 7): rows at their depths' positions, keys written past
    # the deepest path, each row seeing its own path laid out after the cached prefix
    on_cpu = CacheState([KVCache(1, 2, 32, 8, torch.float32) for _ in range(2)], None, [1, 2, 3])
    tree = segment(Forward(on_cpu, [4], False, [6, 7, 8], "causal", True, parents=[-1, -1, 1]))
    assert tree.pos.tolist() == [3, 4, 4, 5] and tree.slots.tolist() == [3, 6, 7, 8]
    assert [(p if p is None else p.tolist(), n) for p, n in tree.alone] == [(None, 4), ([6], 5), ([7], 5), ([7, 8], 6)]
    assert tree.mask.shape == (4, 9)


def test_unknown_options_are_named(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[lm]\nmodle = 'x'\n")
    with pytest.raises(ValueError, match="modle"):
        load_config(bad)


def test_bad_values_are_rejected(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[lm]\nbackend = 'carrier-pigeon'\n")
    with pytest.raises(ValueError, match="backend"):
        load_config(bad)


def test_voice_and_engine_decode_defaults_agree():
    """voice.config may not import the engine (torch); the shared defaults are checked here instead."""
    from engine.decode import DecodeConfig
    from engine.loading import DEFAULT_QUANTIZE, QUANTIZE
    from voice.config import LmConfig
    lm, decode = LmConfig(), DecodeConfig()
    assert lm.quantize == DEFAULT_QUANTIZE and DEFAULT_QUANTIZE in QUANTIZE
    assert (lm.rule, lm.block_size, lm.first_block_size, lm.threshold, lm.draft_threshold) == \
        (decode.rule, decode.block_size, decode.first_block_size, decode.threshold, decode.draft_threshold)


def test_auto_kernels_follow_the_cpu_class_and_the_draft_head(monkeypatch):
    """quantize auto (BENCHMARKS.md, "The LM on llama.cpp's kernels"): fp16 + verify where PyTorch
    runs AVX-512 and the model ships a draft head; the GGUF on llama.cpp otherwise; a GPU's own dtype."""
    import torch

    from engine.loading import resolve_quantize
    for capability, default in (("AVX512", "fp16"), ("AVX2", "gguf"), ("DEFAULT", "gguf")):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert resolve_quantize("auto", "cpu", "default") == default
        assert resolve_quantize("auto", "cpu", "qwen2.5-1.5b") == "gguf"  # no head: nothing to verify
        assert resolve_quantize("auto", "cuda", "default") == "none"
        assert resolve_quantize("int8", "cpu", "default") == "int8"
