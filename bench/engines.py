"""Our engine vs its peers on the same base model, the same prompt tokens and the same threads.

    .venv/bin/python bench/engines.py [--limit N] [--threads 1] [--max-new-tokens 96]

Engines (each in its own subprocess, so peak RSS is its own and nothing is shared):

  ours_diffusion  engine.stream.Engine, block diffusion (the `default` model: packaged GGUF and
                  its draft head, lossless `verify`, on the kernels --diffusion-quantize names;
                  --adapter merges a LoRA adapter for lossy rules)
  ours_ar         engine.stream.Engine, autoregressive, on the *base* GGUF (no adapter), i.e.
                  exactly the weights the two peers load (--quantize gguf: on llama.cpp's kernels)
  transformers    AutoModelForCausalLM.from_pretrained(folder, gguf_file=..., dtype=float32),
                  greedy `generate` with a streamer that timestamps every token
  llamacpp        llama-cpp-python (bench/.venv-llamacpp, llama.cpp built from source for this
                  CPU) on the same GGUF, create_completion(stream=True), greedy

Every prompt of --prompts (with engine.train.data.VOICE_SYSTEM_PROMPT) is rendered once, by our
tokenizer, and every engine gets the same token ids (our engine re-renders the messages and
the ids are checked to match). Each request starts from an empty KV cache (our engine: a fresh
ConversationCache; llama.cpp: reset(); transformers: a new generate call). After one warm-up request
per engine, the prompts are sent round-robin with the engine order rotated per prompt, so slow
drift in machine load is spread over all engines. Workers stay loaded but idle while another
engine runs. Torch/OpenMP/llama.cpp threads all = --threads.

Per request:
  first_token_ms  call -> first generated token (diffusion: the first committed piece)
  first8_ms       call -> the 8th reply token (whole reply if shorter)
  ttfb_ms         the headline TTFB: diffusion -> first committed block (= first_token_ms),
                  AR engines -> first8_ms (what a voice pipeline needs before it can speak)
  tok_s           reply tokens / request time (prefill included); decode_tok_s excludes the
                  time to the first piece
Reply tokens exclude the end-of-turn token. Peak RSS is the worker's ru_maxrss at the end.
Output: a table, --json (bench/results/engines.json), and the ttfb_ms_ours (ours_diffusion
TTFB p50) / ttfb_ms_llamacpp (llamacpp TTFB p50) keys of bench/results/latest.json.
Worker logs: bench/results/logs/engines-*.log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (LLAMACPP_PYTHON, MAIN_PYTHON, REPO, RESULTS, cpu_model, fmt, loadavg,  # noqa: E402
                    machine, peak_rss_mb, percentile, update_latest, write_json)

ENGINES = ("ours_diffusion", "ours_ar", "transformers", "llamacpp")
FIRST_N = 8


# --- worker side (runs in the engine's own interpreter; stdlib imports at module level only) ------

def timing_row(start: float, end: float, events: list[tuple[float, int]], mode: str) -> dict:
    """events: (time, new reply tokens) per piece/token, in order."""
    tokens = sum(n for _, n in events)
    first = next((t for t, n in events if n > 0), None)
    first8, seen = None, 0
    for t, n in events:
        seen += n
        if seen >= FIRST_N:
            first8 = t
            break
    first8 = first8 or end
    ms = lambda t: (t - start) * 1000 if t is not None else float("nan")  # noqa: E731
    first_piece_tokens = next((n for t, n in events if n > 0), 0)
    decode_s = end - first if first else 0.0
    row = {"tokens": tokens, "first_token_ms": ms(first), "first8_ms": ms(first8), "total_ms": ms(end),
           "tok_s": tokens / (end - start) if end > start else float("nan"),
           "decode_tok_s": (tokens - first_piece_tokens) / decode_s if decode_s > 0 else float("nan"),
           "pieces": sum(1 for _, n in events if n > 0)}
    row["ttfb_ms"] = row["first_token_ms"] if mode == "diffusion" else row["first8_ms"]
    return row


class OursWorker:
    def __init__(self, a, mode: str):
        import torch

        from engine.decode import DecodeConfig
        from engine.stream import Engine
        torch.set_num_threads(a.threads)
        self.mode = mode
        adapter = a.adapter if mode == "diffusion" else a.ar_adapter
        if adapter == "none":
            adapter = ""
        self.engine = Engine.load(a.model, adapter=adapter,
                                  quantize=a.quantize if mode == "ar" else a.diffusion_quantize)
        if mode == "diffusion" and a.draft_anyway:  # measure drafting where the engine decided it does not pay
            from engine.stream import Decoding
            self.engine.decoding = Decoding("diffusion", "--draft-anyway")
            drafter, model = self.engine.loaded.drafter, self.engine.model
            if drafter is not None and hasattr(model, "read_states"):  # llama.cpp: states for the head
                model.read_states(drafter.args.window)
        self.cfg = DecodeConfig(mode=mode, max_new_tokens=a.max_new_tokens, block_size=a.block_size,
                                first_block_size=a.first_block_size, threshold=a.threshold)
        from engine.evals.bench import effective_adapter
        self.info = {"engine": f"ours ({mode})", "model": a.model, "adapter": effective_adapter(a.model, adapter),
                     "weights": self.engine.loaded.weights,
                     "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                     "decode": {k: getattr(self.cfg, k) for k in ("mode", "max_new_tokens", "block_size",
                                                                  "first_block_size", "threshold")},
                     "block_size_effective": self.engine.spec.block_size}

    def run(self, req: dict) -> dict:
        from dataclasses import replace

        from engine.stream import ConversationCache
        if self.engine.prompt_ids(req["messages"]) != req["prompt_ids"]:
            raise RuntimeError("our tokenizer rendered the prompt differently from the shared prompt ids")
        eos = set(req["eos_ids"])
        cfg = replace(self.cfg, max_new_tokens=req["max_new_tokens"])
        events, ids, finish, forwards = [], [], None, 0
        start = time.perf_counter()
        for piece in self.engine.generate_sync(req["messages"], cfg, ConversationCache()):
            now = time.perf_counter()
            new = [t for t in piece.token_ids if t not in eos]
            ids += new
            events.append((now, len(new)))
            finish, forwards = piece.finish_reason or finish, piece.forwards
        end = time.perf_counter()
        row = timing_row(start, end, events, self.mode)
        row["forwards"] = forwards
        row["token_ids"] = ids
        row["finish_reason"] = finish
        return row


class TransformersWorker:
    def __init__(self, a):
        import torch
        import transformers
        torch.set_num_threads(a.threads)
        path = Path(a.gguf)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        self.info = {"engine": "transformers generate (greedy, fp32 from GGUF)",
                     "transformers": transformers.__version__, "torch": torch.__version__,
                     "torch_threads": torch.get_num_threads()}

    def run(self, req: dict) -> dict:
        torch = self.torch
        eos = list(req["eos_ids"])
        times: list[float] = []

        class Streamer:  # generate() calls put(prompt) once, then put(token) per new token, then end()
            prompt_seen = False

            def put(self, value):
                if not self.prompt_seen:
                    self.prompt_seen = True
                    return
                times.append(time.perf_counter())

            def end(self):
                pass

        ids = torch.tensor([req["prompt_ids"]], dtype=torch.long)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req["max_new_tokens"],
                                      do_sample=False, num_beams=1, eos_token_id=eos, pad_token_id=eos[0],
                                      streamer=Streamer(), use_cache=True)
        end = time.perf_counter()
        new = out[0, ids.shape[1]:].tolist()
        events = [(t, 0 if tok in eos else 1) for t, tok in zip(times, new)]
        row = timing_row(start, end, events, "ar")
        row["token_ids"] = [t for t in new if t not in eos]
        row["finish_reason"] = "stop" if any(t in eos for t in new) else "length"
        return row


class LlamaCppWorker:
    def __init__(self, a):
        import llama_cpp
        try:  # the product's venv: ./dev's llama.cpp loads its CPU variant through engine/llamacpp.py
            from engine.llamacpp import bindings
            bindings()
        except ImportError:  # bench/.venv-llamacpp: llama.cpp built for this CPU alone
            pass
        self.llama_cpp = llama_cpp
        if a.llamacpp_extra_bufts == "off":  # Llama() takes no such argument: its model parameters are patched
            low, default_params = llama_cpp.llama_cpp, llama_cpp.llama_cpp.llama_model_default_params

            def params_without_extra_bufts():
                params = default_params()
                params.use_extra_bufts = False
                return params
            low.llama_model_default_params = params_without_extra_bufts
        self.llm = llama_cpp.Llama(model_path=a.gguf, n_ctx=2048, n_batch=512, n_threads=a.threads,
                                   n_threads_batch=a.threads, seed=0, verbose=False)
        self.info = {"engine": "llama.cpp via llama-cpp-python (greedy)",
                     "llama_cpp_python": llama_cpp.__version__, "n_threads": a.threads,
                     "extra_bufts": a.llamacpp_extra_bufts,
                     "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}

    def run(self, req: dict) -> dict:
        llama_cpp = self.llama_cpp
        prompt = list(req["prompt_ids"])
        sampled: dict[int, float] = {}

        # llama-cpp-python calls the stopping criteria right after sampling each token (the end-of-turn
        # token too), with the ids evaluated so far (one call per length), and once more at the end
        # (with a length already seen): the first time per length is the token's sampling time.
        def on_token(input_ids, logits) -> bool:
            sampled.setdefault(len(input_ids), time.perf_counter())
            return False

        self.llm.reset()  # empty KV cache: no prefix reuse from the previous request
        text, finish = [], None
        start = time.perf_counter()
        for chunk in self.llm.create_completion(prompt=prompt, max_tokens=req["max_new_tokens"], temperature=0.0,
                                                top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, stream=True,
                                                stopping_criteria=llama_cpp.StoppingCriteriaList([on_token])):
            text.append(chunk["choices"][0]["text"])
            finish = chunk["choices"][0].get("finish_reason") or finish
        end = time.perf_counter()
        times = [sampled[k] for k in sorted(sampled)]
        if finish == "stop" and times:
            times = times[:-1]  # the end-of-turn token: not a reply token
        row = timing_row(start, end, [(t, 1) for t in times], "ar")
        # evaluated ids (the last sampled token of a reply cut by max_tokens is never evaluated)
        row["token_ids"] = [int(t) for t in self.llm._input_ids[len(prompt):self.llm.n_tokens]]
        row["finish_reason"] = finish
        return row


def worker_main(a) -> int:
    # Our protocol owns the real stdout; anything the libraries print goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    t = time.perf_counter()
    if a.worker in ("ours_diffusion", "ours_ar"):
        w = OursWorker(a, "diffusion" if a.worker == "ours_diffusion" else "ar")
    elif a.worker == "transformers":
        w = TransformersWorker(a)
    elif a.worker == "llamacpp":
        w = LlamaCppWorker(a)
    else:
        raise SystemExit(f"unknown engine {a.worker}")
    info = dict(w.info, load_s=time.perf_counter() - t, rss_after_load_mb=peak_rss_mb(), python=sys.executable)
    proto.write(json.dumps({"ready": True, "info": info}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            proto.write(json.dumps({"peak_rss_mb": peak_rss_mb()}) + "\n")
            return 0
        try:
            row = w.run(req)
        except Exception as err:  # noqa: BLE001 - reported to the orchestrator, which stops
            row = {"error": f"{type(err).__name__}: {err}"}
        row["peak_rss_mb"] = peak_rss_mb()
        proto.write(json.dumps(row) + "\n")
    return 0


# --- orchestrator side (our venv) ----------------------------------------------------------

class Worker:
    def __init__(self, name: str, python: Path, a, log_dir: Path):
        self.name = name
        args = [str(python), str(Path(__file__).resolve()), "--worker", name, "--gguf", a.gguf,
                "--threads", str(a.threads), "--max-new-tokens", str(a.max_new_tokens), "--model", a.model,
                "--adapter", a.adapter, "--ar-adapter", a.ar_adapter, "--block-size", str(a.block_size),
                "--first-block-size", str(a.first_block_size), "--threshold", str(a.threshold),
                "--quantize", a.quantize, "--diffusion-quantize", a.diffusion_quantize,
                "--llamacpp-extra-bufts", a.llamacpp_extra_bufts] + (["--draft-anyway"] if a.draft_anyway else [])
        n = str(a.threads)
        env = dict(os.environ, OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n,
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error",
                   HF_HUB_OFFLINE="1")
        self.log_path = log_dir / f"engines-{name}.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, cwd=REPO, env=env)
        self.info: dict = {}
        self.peak_rss_mb: float | None = None

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"{self.name} worker exited (code {self.proc.returncode}); log {self.log_path}:\n{tail}")
        return json.loads(line)

    def ready(self) -> None:
        msg = self.read()
        self.info = msg["info"]

    def ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        row = self.read()
        if "error" in row:
            raise RuntimeError(f"{self.name}: {row['error']} (log {self.log_path})")
        return row

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.peak_rss_mb = self.read().get("peak_rss_mb")
                self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001 - a worker that cannot stop cleanly is killed
            if self.proc.poll() is None:
                self.proc.kill()
        finally:
            self.log.close()


def shared_prompts(a):
    """(requests, eos ids, tokenizer): each prompt rendered once by our tokenizer (no model load needed)."""
    import gguf

    from engine.evals.bench import read_prompts
    from engine.train.data import VOICE_SYSTEM_PROMPT, chat
    from engine.tokenizer import tokenizer_from_gguf
    reader = gguf.GGUFReader(a.gguf)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tok = tokenizer_from_gguf(fields)
    reqs = []
    for prompt in read_prompts(Path(a.prompts), a.limit):
        messages = chat(prompt, VOICE_SYSTEM_PROMPT)
        reqs.append({"prompt": prompt, "messages": messages, "prompt_ids": tok.encode_chat(messages),
                     "max_new_tokens": a.max_new_tokens})
    return reqs, sorted(tok.eos_ids), tok


def summarize(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["total_ms"] for r in rows) / 1000
    out = {"n": len(rows), "tok_s": tokens / seconds if seconds else float("nan"),
           "reply_tokens_mean": tokens / len(rows) if rows else float("nan"),
           "decode_tok_s_p50": percentile([r["decode_tok_s"] for r in rows], 50)}
    if all("forwards" in r for r in rows):  # ours: tokens committed per forward of the base
        out["tokens_per_forward"] = sum(len(r["token_ids"]) for r in rows) / max(1, sum(r["forwards"] for r in rows))
    for key in ("ttfb_ms", "first_token_ms", "first8_ms", "total_ms"):
        out[f"{key}_p50"] = percentile([r[key] for r in rows], 50)
        out[f"{key}_p95"] = percentile([r[key] for r in rows], 95)
    return out


def prefix_agreement(a: list[int], b: list[int]) -> float:
    """Share of the shorter reply's tokens that the two replies have in common before they diverge."""
    n = min(len(a), len(b))
    if n == 0:
        return float("nan")
    k = next((i for i in range(n) if a[i] != b[i]), n)
    return k / n


TABLE = (("TTFB p50 (ms)", "ttfb_ms_p50", 0), ("TTFB p95 (ms)", "ttfb_ms_p95", 0),
         ("first token p50 (ms)", "first_token_ms_p50", 0), (f"first {FIRST_N} tokens p50 (ms)", "first8_ms_p50", 0),
         (f"first {FIRST_N} tokens p95 (ms)", "first8_ms_p95", 0), ("request total p50 (ms)", "total_ms_p50", 0),
         ("tokens/s", "tok_s", 1), ("decode tokens/s p50", "decode_tok_s_p50", 1),
         ("tokens per forward", "tokens_per_forward", 2),
         ("reply tokens (mean)", "reply_tokens_mean", 1), ("peak RSS (MB)", "peak_rss_mb", 0),
         ("load (s)", "load_s", 1), ("same tokens as ours_ar", "prefix_agreement_vs_ours_ar", 2))


def format_table(summary: dict, engines: list[str]) -> str:
    lines = [f"{'':26}" + "".join(f"{e:>16}" for e in engines)]
    for label, key, digits in TABLE:
        lines.append(f"{label:26}" + "".join(f"{fmt(summary[e].get(key), digits):>16}" for e in engines))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)} (default: all)")
    p.add_argument("--prompts", default=str(REPO / "engine/prompts/bench.jsonl"), help="JSONL of {\"prompt\": ...}")
    p.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0: all)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for every engine (default 1: shared box)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="reply length limit (default 96, as engine bench)")
    p.add_argument("--model", default="default", help="our engine's model, by name or GGUF path (default: default)")
    p.add_argument("--adapter", default="none",
                   help="ours_diffusion LoRA adapter: 'none' (default: the base weights, verified drafts), "
                        "'default' (the shipped one, for lossy rules) or a path")
    p.add_argument("--ar-adapter", default="none",
                   help="ours_ar adapter (default 'none': the base weights the peers run)")
    p.add_argument("--block-size", type=int, default=0, help="diffusion block size (0: the model's)")
    p.add_argument("--first-block-size", type=int, default=0)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--quantize", choices=["none", "fp16", "int8", "gguf"], default="gguf",
                   help="our engine's kernels: gguf = the GGUF as packaged on llama.cpp's (default); "
                        "none/fp16/int8 = PyTorch")
    p.add_argument("--diffusion-quantize", choices=["auto", "none", "fp16", "int8", "gguf"], default="auto",
                   help="ours_diffusion's kernels (default auto: as the voice default loads the model; gguf = "
                        "llama.cpp's, with a head trained on their states; none/fp16/int8 = PyTorch's)")
    p.add_argument("--draft-anyway", action="store_true",
                   help="ours_diffusion drafts and verifies even where the engine decides AR for this CPU class "
                        "(to measure what drafting gives there)")
    p.add_argument("--gguf", default="", help="GGUF file for transformers and llama.cpp (default: --model's)")
    p.add_argument("--python", default=str(MAIN_PYTHON if MAIN_PYTHON.exists() else sys.executable),
                   help="interpreter for ours_* and transformers (default: .venv)")
    p.add_argument("--llamacpp-python", default=str(MAIN_PYTHON if MAIN_PYTHON.exists() else LLAMACPP_PYTHON),
                   help="interpreter with llama_cpp (default: the project's .venv, which has it)")
    p.add_argument("--llamacpp-extra-bufts", choices=["on", "off"], default="on",
                   help="llamacpp's weight repacking and AMX buffers (use_extra_bufts): 'off' for a native build "
                        "on an AMX Xeon without ./dev's AMX fix, which crashes on its first decode with them on")
    p.add_argument("--json", default=str(RESULTS / "engines.json"), help="results file ('' for none)")
    p.add_argument("--no-latest", action="store_true", help="do not update bench/results/latest.json")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return worker_main(a)

    from engine.loading import gguf_path
    a.gguf = a.gguf or str(gguf_path(a.model))  # the peers run exactly the weights of --model
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise SystemExit(f"unknown engine(s) {bad}; choose from {ENGINES}")
    if "llamacpp" in engines and not Path(a.llamacpp_python).exists():
        raise SystemExit(f"{a.llamacpp_python} is missing: run bench/setup.sh llamacpp (or leave out llamacpp)")
    mach = machine()
    reqs, eos, tok = shared_prompts(a)
    for r in reqs:
        r["eos_ids"] = eos
    log_dir = (Path(a.json).parent if a.json else RESULTS) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"{len(reqs)} prompts x {len(engines)} engines, {a.threads} thread(s), max_new_tokens {a.max_new_tokens}, "
          f"GGUF {a.gguf}; load average {mach.get('loadavg_start')}", flush=True)

    workers: dict[str, Worker] = {}
    rows: dict[str, list[dict]] = {e: [] for e in engines}
    try:
        for e in engines:  # loaded one after the other so loads do not compete
            t = time.perf_counter()
            python = Path(a.llamacpp_python if e == "llamacpp" else a.python)
            workers[e] = Worker(e, python, a, log_dir)
            workers[e].ready()
            print(f"  {e}: loaded in {time.perf_counter() - t:.1f} s, "
                  f"RSS {workers[e].info['rss_after_load_mb']:.0f} MB", flush=True)
        for e in engines:  # warm-up: first-call costs stay out of the numbers
            workers[e].ask(reqs[0])
        for i, req in enumerate(reqs):
            order = engines[i % len(engines):] + engines[:i % len(engines)]
            parts = []
            for e in order:
                row = workers[e].ask(req)
                row["prompt"] = req["prompt"]
                row["text"] = tok.decode(row["token_ids"])  # every engine's reply decoded the same way
                row["prompt_tokens"] = len(req["prompt_ids"])
                rows[e].append(row)
            for e in engines:
                r = rows[e][-1]
                parts.append(f"{e} {r['tokens']}tok ttfb {r['ttfb_ms']:.0f}ms {r['tok_s']:.1f}tok/s")
            print(f"[{i + 1}/{len(reqs)}] " + " | ".join(parts) + f" | {req['prompt'][:40]!r}", flush=True)
    finally:
        for w in workers.values():
            w.close()

    summary = {}
    for e in engines:
        s = summarize(rows[e])
        s.update(peak_rss_mb=workers[e].peak_rss_mb, load_s=workers[e].info.get("load_s"),
                 rss_after_load_mb=workers[e].info.get("rss_after_load_mb"))
        if "ours_ar" in rows and e != "ours_ar":
            agree = [prefix_agreement(x["token_ids"], y["token_ids"]) for x, y in zip(rows[e], rows["ours_ar"])]
            s["prefix_agreement_vs_ours_ar"] = sum(agree) / len(agree) if agree else float("nan")
        s["per_prompt"] = rows[e]
        summary[e] = s
    mach["loadavg_end"] = loadavg()
    print()
    print(format_table(summary, engines))
    print(f"(TTFB = first committed block for diffusion, first {FIRST_N} tokens for AR engines; {len(reqs)} prompts; "
          f"{a.threads} thread(s); load average {mach.get('loadavg_start')} -> {mach.get('loadavg_end')})", flush=True)
    result = {"benchmark": "engines", "gguf": a.gguf, "prompts": a.prompts, "n_prompts": len(reqs),
              "threads": a.threads, "max_new_tokens": a.max_new_tokens, "engines": engines,
              "engine_info": {e: workers[e].info for e in engines}, "machine": mach,
              "command": " ".join(sys.argv), "summary": summary}
    if a.json:
        write_json(a.json, result)
    if not a.no_latest:  # the same keys bench/voice_loop.py copies from engines.json
        update_latest({"ttfb_ms_ours": summary.get("ours_diffusion", {}).get("ttfb_ms_p50"),
                       "ttfb_ms_llamacpp": summary.get("llamacpp", {}).get("ttfb_ms_p50"),
                       "machine": {"platform": mach["platform"], "cpu_model": cpu_model(), "cores": mach["cores"]}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
