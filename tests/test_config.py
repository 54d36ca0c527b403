from pathlib import Path

import pytest

from voice.config import CONFIG_DIR, Config, load_config


def test_default_toml_documents_exactly_the_defaults():
    assert load_config(CONFIG_DIR / "default.toml") == Config()


def test_gpu_profile_overrides_only_what_it_names():
    gpu = load_config(CONFIG_DIR / "gpu.toml")
    assert gpu.budget.voice_to_voice < Config().budget.voice_to_voice
    assert gpu.tts == Config().tts


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
    from engine.quantize import CHOICES, DEFAULT_QUANTIZE
    from voice.config import LmConfig
    lm, decode = LmConfig(), DecodeConfig()
    assert lm.quantize == DEFAULT_QUANTIZE and DEFAULT_QUANTIZE in CHOICES
    assert (lm.rule, lm.block_size, lm.first_block_size, lm.threshold, lm.draft_threshold) == \
        (decode.rule, decode.block_size, decode.first_block_size, decode.threshold, decode.draft_threshold)
