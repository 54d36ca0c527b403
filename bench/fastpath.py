"""CPU fast-path candidates for the LM, side by side: answer accuracy and ms per forward.

    .venv/bin/python bench/fastpath.py --questions engine/prompts/answers_dev.jsonl --json bench/results/fastpath.json

Each candidate swaps the base model's linear layers for another kernel; the engine's
`quantize` ships the chosen one (`engine/quantize.py`). Per candidate: greedy AR answers to the
questions (the share right, and how many replies are token for token the fp32 ones), and the
median time of one decoding forward with 1 and with 8 new rows against a 100-token cache (8 rows
is a verify step or a batched step). Figures are one run on whatever the machine is doing;
compare ratios within a run.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.evals.bench import machine_info, percentile, timed_request, write_json  # noqa: E402
from engine.train.data import VOICE_SYSTEM_PROMPT, chat  # noqa: E402
from engine.decode import CacheState, DecodeConfig, run  # noqa: E402
from engine.evals.eval import BOILERPLATE, is_right, read_questions  # noqa: E402
from engine.quantize import Int8RowLinear, fp16_linears, swap_linears  # noqa: E402
from engine.stream import Engine  # noqa: E402


class Bf16Linear(nn.Module):
    """bf16 weights and matmul (AVX-512 BF16), fp32 in and out."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().bfloat16())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().bfloat16())

    def forward(self, x):
        return F.linear(x.bfloat16(), self.weight, self.bias).float()


class W8A16Linear(nn.Module):
    """int8 weights per output channel, bf16 activations (`_weight_int8pack_mm`, gpt-fast's int8)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-8) / 127
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.bfloat16())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())

    def forward(self, x):
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]).bfloat16(), self.qweight, self.scale).float()
        y = y.view(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def dynamic_int8(model: nn.Module, keep_head: bool) -> None:
    """The previous default: torch.ao dynamic int8, one activation scale per tensor."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    head = model.lm_head
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(model, {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    if keep_head:
        model.lm_head = head


CANDIDATES = {
    "fp32": lambda m: None,
    "int8 per-tensor act (torch.ao dynamic, old default)": lambda m: dynamic_int8(m, keep_head=False),
    "int8 per-tensor act, fp32 LM head": lambda m: dynamic_int8(m, keep_head=True),
    "int8 per-row act (_int_mm)": lambda m: swap_linears(m, Int8RowLinear, head=True),
    "int8 per-row act, fp32 LM head": lambda m: swap_linears(m, Int8RowLinear, head=False),
    "int8 per-row act, bf16 LM head": lambda m: (swap_linears(m, Int8RowLinear, head=False),
                                                 swap_linears(m, Bf16Linear, head=True, body=False)),
    "bf16": lambda m: swap_linears(m, Bf16Linear, head=True),
    "fp16 weights, fp32 act (torch.ao dynamic fp16)": fp16_linears,
    "int8 weights, bf16 act (_weight_int8pack_mm)": lambda m: swap_linears(m, W8A16Linear, head=True),
}


@torch.inference_mode()
def ms_per_forward(engine: Engine, rows: int, repeats: int = 30) -> float:
    state = CacheState.new(engine.model, 512)
    run(engine.model, state, list(range(100, 200)), False, [])
    times = []
    for _ in range(repeats):
        del state.ids[100:]
        t = time.perf_counter()
        run(engine.model, state, list(range(300, 300 + rows)), False, [])
        times.append((time.perf_counter() - t) * 1000)
    return percentile(times, 50)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--questions", default="engine/prompts/answers_dev.jsonl")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--only", default="", help="comma-separated candidate name prefixes")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    questions = read_questions(Path(a.questions))
    cfg = DecodeConfig(mode="ar", max_new_tokens=a.max_new_tokens)
    results, reference = {}, None
    names = [n for n in CANDIDATES if not a.only or any(n.startswith(o) for o in a.only.split(","))]
    for name in names:
        engine = Engine.load(a.model, drafter="")
        CANDIDATES[name](engine.model)
        one, eight = ms_per_forward(engine, 1), ms_per_forward(engine, 8)
        replies = [timed_request(engine, chat(q["prompt"], VOICE_SYSTEM_PROMPT), cfg) for q in questions]
        right = sum(is_right(r["text"], q["answer"]) for r, q in zip(replies, questions))
        ids = [r["token_ids"] for r in replies]
        reference = reference or ids
        same = sum(x == y for x, y in zip(ids, reference))
        boiler = sum(BOILERPLATE.search(r["text"]) is not None for r in replies)
        results[name] = {"right": right, "n": len(questions), "same_as_fp32": same, "boilerplate": boiler,
                         "ms_forward_1_row": one, "ms_forward_8_rows": eight, "replies": [r["text"] for r in replies]}
        print(f"{name:48} right {right:>3}/{len(questions)}  same as fp32 {same:>3}  boilerplate {boiler:>2}  "
              f"1 row {one:6.1f} ms  8 rows {eight:6.1f} ms", flush=True)
        del engine
    write_json(Path(a.json) if a.json else None, {"machine": machine_info(), "questions": a.questions,
                                                   "threads": a.threads, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
