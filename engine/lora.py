"""LoRA adapters: train a small delta on a frozen base, ship it, merge it at load time.

The shipped file holds the low-rank factors, the learned mask-token embedding and the
diffusion settings the adapter was trained for, so `default` = package GGUF + this file.
Merged weights make inference exactly as fast as the base model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from engine.decode import DiffusionSpec
from engine.model import Transformer

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale

    def delta(self) -> Tensor:
        return (self.lora_b @ self.lora_a) * self.scale


class MaskEmbedding(nn.Module):
    """Embedding with one trainable row: the mask token, learned from scratch by the adapter."""

    def __init__(self, base: nn.Embedding, mask_id: int):
        super().__init__()
        self.base, self.mask_id = base, mask_id
        self.mask_vector = nn.Parameter(base.weight[mask_id].detach().clone())

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.base(tokens)
        return torch.where((tokens == self.mask_id)[..., None], self.mask_vector.to(x.dtype), x)


def attach(model: Transformer, rank: int, alpha: float, mask_id: int) -> list[nn.Parameter]:
    """Freeze `model`, wrap its projections with LoRA, make the mask embedding trainable."""
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in TARGETS:
                if isinstance(getattr(parent, name, None), nn.Linear):
                    setattr(parent, name, LoRALinear(getattr(parent, name), rank, alpha))
    # replaced by a module that is no longer an nn.Embedding (the attribute's type), hence add_module
    model.add_module("embed_tokens", MaskEmbedding(model.embed_tokens, mask_id))
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state(model: Transformer) -> dict[str, Tensor]:
    return {name: p.detach().to(torch.float16 if "lora" in name else torch.float32).contiguous()
            for name, p in model.named_parameters() if p.requires_grad}


def save_adapter(path: str | Path, model: Transformer, spec: DiffusionSpec, rank: int, alpha: float,
                 extra: dict | None = None) -> None:
    meta = {"rank": str(rank), "alpha": str(alpha), "spec": json.dumps(spec.__dict__),
            "info": json.dumps(extra or {})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(model), str(path), metadata=meta)


def read_adapter(path: str | Path) -> tuple[dict[str, Tensor], dict]:
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "spec" not in meta:
        raise ValueError(f"{path} is not one of our adapters (no diffusion spec in its metadata)")
    return load_file(str(path)), meta


def load_adapter(model: Transformer, path: str | Path, spec: DiffusionSpec) -> DiffusionSpec:
    """Merge the adapter at `path` into `model`'s weights; return the spec it was trained for."""
    state, meta = read_adapter(path)
    scale = float(meta["alpha"]) / float(meta["rank"])
    with torch.no_grad():
        for name, a in state.items():
            if name.endswith("lora_a"):
                prefix = name[: -len(".lora_a")]
                b = state[prefix + ".lora_b"]
                linear = model.get_submodule(prefix.removesuffix(".base"))
                assert isinstance(linear, nn.Linear)  # TARGETS are linear layers
                linear.weight += (b.float() @ a.float() * scale).to(linear.weight.dtype)
        new_spec = DiffusionSpec(**json.loads(meta["spec"]))
        mask_vector = state.get("embed_tokens.mask_vector")
        if mask_vector is not None:
            if model.args.tie_embeddings:  # keep the head's row for the mask token as it was
                model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone())
            model.embed_tokens.weight[new_spec.mask_id] = mask_vector.to(model.embed_tokens.weight.dtype)
    return new_spec
