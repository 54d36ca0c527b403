"""int8 linear layers for CPU inference whose rows never depend on each other.

A forward of a small model on CPU is bound by reading fp32 weights and by fp32 GEMMs that are
inefficient for the few rows a decoding step has (1 for AR, a drafted block for verify).
`Int8RowLinear` keeps int8 weights (one scale per output channel) and quantises activations
on the fly with one scale *per row*, multiplying in int8 with int32 accumulation
(`torch._int_mm`, VNNI on AVX-512 CPUs). Integer accumulation is exact and the scales are per
row, so a row's output is the same whatever else shares its forward: a verified draft row
equals the AR row, and a conversation's reply does not change with what it is batched with.
(torch.ao's dynamic int8, the previous default, shares one activation scale per tensor: the
huge activations next to the first token spoiled every other row of a prefill, and batching
changed replies.) Candidates and their figures: `bench/fastpath.py`, BENCHMARKS.md.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

log = logging.getLogger("engine.quantize")
CHOICES = ("none", "int8")


class Int8RowLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-8) / 127
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.out_features = linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        row_scale = rows.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
        q = (rows / row_scale).round_().to(torch.int8)
        y = torch._int_mm(q, self.qweight.t()) * row_scale * self.scale
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def swap_linears(model: nn.Module, make, head: bool = True, body: bool = True) -> None:
    """Replace the transformer's linear layers (`body`) and/or its LM head (`head`) with `make(linear)`."""
    if body:
        for layer in model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(parent, name, make(child))
    if head and isinstance(model.lm_head, nn.Linear):
        model.lm_head = make(model.lm_head)


def swap_all_linears(module: nn.Module) -> None:
    """Every nn.Linear inside `module` (a draft head) becomes an `Int8RowLinear`."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8RowLinear(child))
        else:
            swap_all_linears(child)


def int8_supported() -> str:
    """'' if the int8 matmul runs here, else why not."""
    try:
        torch._int_mm(torch.ones(2, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8))
    except (RuntimeError, NotImplementedError) as err:
        return f"int8 matmul is unavailable on this CPU or PyTorch build ({err})"
    return ""


def quantize(model: nn.Module, how: str) -> str:
    """Quantise `model` in place as `how` says (none | int8); returns what it now runs in."""
    if how not in CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(CHOICES)}, not {how!r}")
    if how == "none":
        return "fp32"
    device = next(model.parameters()).device
    if device.type != "cpu":
        log.info("int8 quantisation is for CPU; the model on %s stays as it is", device)
        return "fp32"
    why_not = int8_supported()
    if why_not:
        log.warning("int8 requested but %s: running fp32", why_not)
        return "fp32"
    swap_linears(model, Int8RowLinear)
    return "int8"
