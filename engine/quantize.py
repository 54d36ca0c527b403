"""Int8 linear layers for CPU inference.

A forward of a small model on CPU is bound by reading fp32 weights and by fp32 GEMMs that are
inefficient for the few rows a decoding step has (1 for AR, a block for diffusion). Swapping
every `nn.Linear` (LM head included) for PyTorch's dynamically quantised int8 linear (int8
weights per output channel, activations quantised on the fly, fbgemm kernels) makes a forward
about 3x cheaper on this project's CPUs (figures in BENCHMARKS.md).

What it costs: replies are not token-for-token those of the fp32 model, and the rows of one
batched step share an activation scale, so under continuous batching a reply may differ
slightly with what shares its steps (fp32 keeps batched == sequential exactly). `engine eval
--quantize int8` measures the quality against the fp32 teacher.

fbgemm needs AVX2; where it cannot run, `quantize` says so and the model stays fp32.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

log = logging.getLogger("engine.quantize")
CHOICES = ("none", "int8")


def int8_supported() -> str:
    """'' if int8 linear layers run here, else why not."""
    if "fbgemm" not in torch.backends.quantized.supported_engines and \
            "x86" not in torch.backends.quantized.supported_engines:
        return "this PyTorch build has no x86 quantized engine"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe = _quantize(nn.Sequential(nn.Linear(8, 8)))
            probe(torch.zeros(1, 8))
    except (RuntimeError, AssertionError) as err:  # fbgemm refuses CPUs without AVX2
        return f"int8 kernels are unavailable on this CPU ({err})"
    return ""


def _quantize(model: nn.Module) -> nn.Module:
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    return quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)


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
    with warnings.catch_warnings():  # torch.ao's quantised tensors are deprecated upstream; pinned torch has them
        warnings.simplefilter("ignore")
        _quantize(model)
    return "int8"
