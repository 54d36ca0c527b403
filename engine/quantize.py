"""Faster linear layers for CPU inference whose rows never depend on each other.

`fp16` (the voice service's default): fbgemm's fp16-weight linear (torch.ao dynamic fp16):
half the weight bytes, fp32 activations and accumulation, so replies stay those of fp32 (66 of
67 held-out answers identical) and rows stay independent. `int8`, described below, is ~4x
smaller than fp32 and about as fast here, at 13 of 67 answers identical (the same share right).

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
import warnings

import torch
from torch import Tensor, nn

log = logging.getLogger("engine.quantize")
CHOICES = ("none", "fp16", "int8")
DEFAULT_QUANTIZE = "fp16"  # measured fastest at the same answers (BENCHMARKS.md); voice.config.LmConfig agrees


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
        swap_all_linears(model.layers, make)
    if head and isinstance(model.lm_head, nn.Linear):
        model.lm_head = make(model.lm_head)


def swap_all_linears(module: nn.Module, make) -> None:
    """Every nn.Linear inside `module` becomes `make(linear)`."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
        else:
            swap_all_linears(child, make)


def fp16_linears(module: nn.Module) -> None:
    """Every nn.Linear inside `module` becomes fbgemm's fp16-weight dynamic linear, in place."""
    from torch.ao.quantization import quantize_dynamic
    with warnings.catch_warnings():  # torch.ao is deprecated upstream in favour of torchao; the pinned torch has it
        warnings.simplefilter("ignore")
        quantize_dynamic(module, {nn.Linear}, dtype=torch.float16, inplace=True)


def supported(how: str) -> str:
    """'' if `how`'s kernels run here, else why not."""
    try:
        if how == "int8":
            torch._int_mm(torch.ones(2, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8))
        elif how == "fp16":
            probe = nn.Sequential(nn.Linear(8, 8))
            fp16_linears(probe)
            probe(torch.zeros(1, 8))
    except (RuntimeError, NotImplementedError, AssertionError) as err:
        return f"{how} kernels are unavailable on this CPU or PyTorch build ({err})"
    return ""



def quantize(model: nn.Module, how: str) -> str:
    """Quantise `model` in place as `how` says (none | fp16 | int8); returns what it now runs in."""
    if how not in CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(CHOICES)}, not {how!r}")
    weight = next(model.parameters())
    as_loaded = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(weight.dtype, str(weight.dtype))
    if how == "none":
        return as_loaded
    if weight.device.type != "cpu":
        log.info("%s linear layers are for CPU; the model on %s stays in %s", how, weight.device, as_loaded)
        return as_loaded
    why_not = supported(how)
    if why_not:
        log.warning("%s requested but %s: running fp32", how, why_not)
        return "fp32"
    if how == "fp16":
        fp16_linears(model)
    else:
        swap_linears(model, Int8RowLinear)
    return how


def quantize_like(drafter: nn.Module, weights: str) -> None:
    """Give a draft head the model's kernels: its weights are read every step too."""
    if weights == "fp16":
        fp16_linears(drafter)
    elif weights == "int8":
        swap_all_linears(drafter, Int8RowLinear)
