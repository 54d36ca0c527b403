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

Both guarantees hang on the CPU's kernels, so both are checked here at run time, once:
- fbgemm's AVX2 fp16 kernels (CPUs without AVX-512, such as Zen 3) add up a row's products in one
  order in their 1- and 2-row kernels and in another in their 3- to 6-row ones, and which kernel
  a row gets depends on how many rows share the call: handed as is, a verified row was not the AR
  row. `fp16_row_group` tries row groupings on a small layer and keeps the first that gives every
  row the same result alone or among others: as is (AVX-512), else a multiple of 3 rows per call
  (zero rows appended; fbgemm splits any multiple of 3 among its 3- to 6-row kernels only), else
  of 6. None found: `fp16` is unsupported and the model stays fp32.
- `torch._int_mm` is exact only where oneDNN has VNNI (AVX512-VNNI or AVX-VNNI); without it oneDNN
  adds int8 products in pairs with 16-bit saturation (vpmaddubsw), so large products are clipped:
  `int8` is unsupported there and the model stays fp32.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger("engine.quantize")
CHOICES = ("none", "fp16", "int8")  # PyTorch's; engine.loading adds "gguf" (llama.cpp's kernels)


class Int8RowLinear(nn.Module):
    qweight: Tensor  # buffers
    scale: Tensor
    bias: Tensor | None

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


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module], head: bool = True,
                 body: bool = True) -> None:
    """Replace the transformer's linear layers (`body`) and/or its LM head (`head`) with `make(linear)`."""
    if body:
        swap_all_linears(model.get_submodule("layers"), make)
    if head and isinstance(model.lm_head, nn.Linear):
        model.lm_head = make(model.lm_head)


def swap_all_linears(module: nn.Module, make: Callable[[Any], nn.Module], kind: type = nn.Linear) -> None:
    """Every `kind` (nn.Linear) inside `module` becomes `make(linear)` (`make` takes a `kind`)."""
    for name, child in list(module.named_children()):
        if isinstance(child, kind):
            setattr(module, name, make(child))
        else:
            swap_all_linears(child, make, kind)


class RowGroups(nn.Module):
    """`inner` handed a multiple of `group` rows at a time: zero rows appended, their outputs dropped."""

    def __init__(self, inner: nn.Module, group: int):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        spare = -rows.shape[0] % self.group
        if spare:
            rows = torch.cat([rows, rows.new_zeros(spare, shape[-1])])
        y = self.inner(rows)
        return y[:y.shape[0] - spare].reshape(*shape[:-1], y.shape[-1])


def _fp16(module: nn.Module, group: int) -> None:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import quantize_dynamic
    with warnings.catch_warnings():  # torch.ao is deprecated upstream in favour of torchao; the pinned torch has it
        warnings.simplefilter("ignore")
        quantize_dynamic(module, {nn.Linear}, dtype=torch.float16, inplace=True)
    if group > 1:
        swap_all_linears(module, lambda fp16: RowGroups(fp16, group), DynamicLinear)


# Row groupings tried, in order: as is (fbgemm's AVX-512 kernels sum every row alike), then
# multiples of 3 rows, then of 6 (its AVX2 kernels compute 1-6 rows at a time, its 1- and 2-row
# kernels sum in another order, and its split table runs multiples of 3 on 3- to 6-row kernels).
FP16_ROW_GROUPS = (1, 3, 6)


def _rows_independent(group: int) -> bool:
    """Through fp16 linear layers handed `group` rows at a time, a row's output is bit for bit the
    same alone as among others: 24 different rows among 2-20 (cross-row effects), and one row
    repeated at every place of every row count up to 132 (the kernel a row lands in changes with
    its place and the count; fbgemm works in chunks of 120). The layer spans two of fbgemm's k
    blocks and leaves a fringe of columns, on AVX2 and AVX-512 alike."""
    with torch.random.fork_rng(devices=[]), torch.inference_mode():  # the caller's random stream is left alone
        g = torch.Generator().manual_seed(0)
        linear = nn.Linear(520, 40)
        linear.weight.copy_(torch.randn(40, 520, generator=g) / 23)
        linear.bias.copy_(torch.randn(40, generator=g))
        layer = nn.Sequential(linear)
        _fp16(layer, group)
        x = torch.randn(24, 520, generator=g) * torch.logspace(-2, 2, 24)[:, None]
        alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
        return (all(torch.equal(layer(x[:m]), alone[:m]) for m in range(2, 21))
                and all(torch.equal(layer(x[12].expand(m, -1)), alone[12].expand(m, -1))
                        for m in range(group, 133, group)))


@functools.cache
def fp16_row_group() -> int:
    """How many rows (a multiple of) fbgemm's fp16 linear must be handed at a time on this CPU for a
    row's result not to depend on the rows beside it; 0 where no grouping tried does it. Probed on
    one thread (threads split fbgemm's columns, not its rows): ~10 ms, where two threads on a busy
    2-core machine took 0.1-2 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        group = next((g for g in FP16_ROW_GROUPS if _rows_independent(g)), 0)
    finally:
        torch.set_num_threads(threads)
    if group > 1:
        log.info("fp16 linear layers: fbgemm's kernels here give a row different results with different rows "
                 "beside it; each call is padded to a multiple of %d rows, which keeps rows independent", group)
    return group


def fp16_linears(module: nn.Module) -> None:
    """Every nn.Linear inside `module` becomes fbgemm's fp16-weight dynamic linear, in place (handed
    rows in the groups `fp16_row_group` found; as is where none keeps rows independent)."""
    _fp16(module, fp16_row_group() or 1)


@functools.cache
def _int_mm_exact() -> bool:
    """`torch._int_mm` equals the exact product, extremes included: a row and a column of 127s
    (oneDNN without VNNI shifts the row to unsigned, 127 + 128, and a pair of such products sums
    to 64,770, past 16 bits)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (4, 64), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (64, 8), generator=g, dtype=torch.int8)
    a[0], b[:, 0], b[:, 1] = 127, 127, -127
    return torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())


def supported(how: str) -> str:
    """'' if `how`'s kernels run here and keep what this module promises (rows independent, int8
    exact), else why not."""
    try:
        if how == "int8" and not _int_mm_exact():
            return ("int8 matmul (torch._int_mm) is not exact on this CPU (without VNNI, oneDNN's int8 GEMM "
                    "saturates 16-bit sums of products)")
        if how == "fp16" and not fp16_row_group():
            return ("fbgemm's fp16 linear gives a row different results with different rows beside it on this "
                    "CPU, in every row grouping tried (verify would not equal AR)")
    except (RuntimeError, NotImplementedError, AssertionError) as err:
        return f"{how} kernels are unavailable on this CPU or PyTorch build ({err})"
    return ""


def quantize(model: nn.Module, how: str) -> str:
    """Quantise `model` in place as `how` says (none | fp16 | int8); returns what it now runs in."""
    if how not in CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(CHOICES)}, not {how!r}")
    weight = next(model.parameters())
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    as_loaded = names.get(weight.dtype, str(weight.dtype))
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
    if weights == "fp16" and not supported("fp16"):
        fp16_linears(drafter)
    elif weights == "int8":
        swap_all_linears(drafter, Int8RowLinear)
