"""Temperature on logits, the one way every sampling path applies it (`engine.decode.pick`, the
verify rule, the draft head's proposals).

A client may ask for any temperature in (0, 2]; `logits / 1e-300` is inf in float32 (the
divisor rounds to 0), and softmax of inf is nan, which `torch.multinomial` refuses. Shifting the
logits so the largest is 0 first makes a small temperature give -inf for the others (a one-hot
distribution, the limit), and a temperature under the dtype's smallest normal number is that
limit outright.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """softmax(logits / temperature) over the last dimension, finite for any temperature > 0."""
    if temperature < torch.finfo(logits.dtype).tiny:  # 0 in the logits' dtype (5e-324): the limit, one-hot
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return ((logits - logits.amax(-1, keepdim=True)) / temperature).softmax(-1)
