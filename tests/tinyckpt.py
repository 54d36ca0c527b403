"""Tiny random checkpoints for the engine tests, written with transformers / tokenizers / gguf.

A byte-level BPE tokenizer over the 256 byte symbols, a few merges and ChatML special tokens;
Llama / Qwen2 / Qwen3 models with hidden size 64, 2 layers, 4 heads, 2 KV heads, fp32, saved as a
Hugging Face folder (and, for Llama, as a llama.cpp-style GGUF). Weights are redrawn with a
larger spread than the default init so logits are O(1) and parity tests are not trivially met.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("o", "r"), ("e", "r"), ("Ġ", "w")]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EOS = "<|im_end|>"
ROPE_THETA = 50000.0  # not a family default: catches a loader that ignores the checkpoint's value
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)


def _byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def vocab_tokens() -> list[str]:
    return _byte_symbols() + ["".join(m) for m in MERGES] + SPECIALS


VOCAB = len(vocab_tokens())
EOS_ID = vocab_tokens().index(EOS)
MASK_ID = vocab_tokens().index("<|mask|>")


def write_tokenizer(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    tokens = vocab_tokens()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": EOS}))


def hf_model(family: str, tie: bool, seed: int = 0):
    """A random transformers model of `family` (llama | qwen2 | qwen3), fp32, eager attention."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    cfg = config_cls(vocab_size=VOCAB, rope_theta=ROPE_THETA, tie_word_embeddings=tie, eos_token_id=EOS_ID,
                     bos_token_id=None, pad_token_id=None, **DIMS)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model.eval()


def write_hf_folder(folder: Path, family: str, tie: bool, seed: int = 0):
    """Save a tiny random checkpoint + tokenizer to `folder`; return the transformers model."""
    model = hf_model(family, tie, seed)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (rotate-half -> interleaved RoPE)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, hf, tokens: list[str] | None = None) -> None:
    """Write `hf` (a transformers Llama) as an F32 GGUF with llama.cpp naming and a gpt2 BPE tokenizer."""
    import gguf
    cfg = hf.config
    tokens = tokens or vocab_tokens()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_eos_token_id(tokens.index(EOS))
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in names.items():
            t = sd[f"model.layers.{i}.{theirs}.weight"]
            if ours == "attn_q":
                t = _permute(t, cfg.num_attention_heads)
            elif ours == "attn_k":
                t = _permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{ours}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
