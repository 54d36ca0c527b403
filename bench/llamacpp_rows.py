"""What a drafted row costs on llama.cpp's kernels: one `llama_decode` of n rows (logits for every
row, as `verify` needs) after a prompt, by quantisation type, threads and weight repacking.

    .venv/bin/python bench/llamacpp_rows.py --model qwen2.5-1.5b --quants packaged,q4_0,q8_0
    bench/.venv-llamacpp/bin/python bench/llamacpp_rows.py --gguf PATH   # llama.cpp built natively

Verify pays only when the rows after the first are much cheaper than a step of their own: at a
cost of c per extra row (in 1-row steps), k drafted rows of which a are accepted on average give
(1 + a) tokens for (1 + c*k) steps. ggml's batched matrix kernels differ by weight type: the K-quants
(the packaged Q4_K/Q6_K) dot each row against the weights again, while Q4_0/Q8_0 (and IQ4_NL) have
repacked GEMM kernels (`use_extra_bufts`, ggml's CPU_REPACK buffer) that reuse unpacked weights across
rows. Re-quantised files are written once to the model cache (`requant/`) from the packaged GGUF.
Timings are medians over interleaved, shuffled repeats. Prints a table; `--json` keeps it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = ("You are a helpful voice assistant. Answer in one or two short spoken sentences. "
          "The user asks: tell me something interesting about the moon and the tides, and why "
          "there are two high tides a day rather than one, in words a child would follow.")


def packaged_gguf(model: str) -> Path:
    from engine.loading import gguf_path  # the product's venv; pass --gguf elsewhere
    return gguf_path(model)


def time_rows(lib, path: Path, repack: bool, threads: list[int], rows: list[int], repeats: int,
              prompt_len: int) -> dict[str, float]:
    mparams = lib.llama_model_default_params()
    mparams.use_extra_bufts = repack
    model = lib.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    cparams = lib.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 1024, 512, 512
    ctx = lib.llama_init_from_model(model, cparams)
    mem = lib.llama_get_memory(ctx)
    vocab = lib.llama_model_get_vocab(model)
    buf = (lib.llama_token * 512)()
    text = PROMPT.encode()
    n = lib.llama_tokenize(vocab, text, len(text), buf, 512, True, False)
    ids = [buf[i] for i in range(n)] * (prompt_len // max(n, 1) + 1)
    ids = ids[:prompt_len]
    batch = lib.llama_batch_init(512, 0, 1)

    def decode(tokens: list[int], start: int) -> float:
        for j, tok in enumerate(tokens):
            batch.token[j], batch.pos[j], batch.logits[j] = tok, start + j, True
            batch.n_seq_id[j], batch.seq_id[j][0] = 1, 0
        batch.n_tokens = len(tokens)
        t = time.perf_counter()
        if lib.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        return (time.perf_counter() - t) * 1000

    decode(ids, 0)
    jobs = [(t, k) for t in threads for k in rows] * repeats
    random.Random(0).shuffle(jobs)
    times: dict[str, list[float]] = {}
    for t, k in jobs:
        lib.llama_set_n_threads(ctx, t, t)
        ms = decode(ids[-k:], prompt_len)
        lib.llama_memory_seq_rm(mem, 0, prompt_len, -1)
        times.setdefault(f"{t}:{k}", []).append(ms)
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)
    return {key: statistics.median(v) for key, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b", help="a packaged model name (the product's venv)")
    ap.add_argument("--gguf", type=Path, help="a GGUF file instead of --model")
    ap.add_argument("--quants", default="packaged,q4_0,q8_0", help="packaged and/or q4_0, q8_0, q4_k_m, iq4_nl")
    ap.add_argument("--repack", default="on,off", help="ggml's weight repacking (use_extra_bufts): on, off or both")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,3,4,5,8")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    try:  # the product's venv: the best CPU variant of its llama.cpp, as the service loads it
        from engine.llamacpp import bindings, cpu_variant
        lib = bindings()
        variant = cpu_variant()
    except ImportError:
        from llama_cpp import llama_cpp as lib
        lib.llama_backend_init()
        variant = "native build"
    system = lib.llama_print_system_info().decode()
    src = a.gguf or packaged_gguf(a.model)
    threads = [int(t) for t in a.threads.split(",")]
    rows = [int(r) for r in a.rows.split(",")]
    print(f"{src.name}; llama.cpp CPU variant: {variant}; {system}")
    results = []
    for quant in a.quants.split(","):
        if quant != "packaged":
            from engine.llamacpp import requantised  # the product's venv (re-quantised into its model cache)
        path = src if quant == "packaged" else requantised(src, quant, max(threads), print)
        for repack in a.repack.split(","):
            med = time_rows(lib, path, repack == "on", threads, rows, a.repeats, a.prompt_len)
            for t in threads:
                one = med[f"{t}:1"]
                line = {"quant": quant, "repack": repack, "threads": t,
                        "ms": {k: round(med[f"{t}:{k}"], 1) for k in rows},
                        "x_one_row": {k: round(med[f"{t}:{k}"] / one, 2) for k in rows}}
                results.append(line)
                cells = "  ".join(f"{k}:{med[f'{t}:{k}']:6.1f} ({med[f'{t}:{k}'] / one:.2f}x)" for k in rows)
                print(f"{quant:8} repack {repack:3} {t} thr  {cells}", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"gguf": src.name, "variant": variant, "system": system,
                                      "prompt_len": a.prompt_len, "repeats": a.repeats, "results": results},
                                     indent=1) + "\n")


if __name__ == "__main__":
    main()
