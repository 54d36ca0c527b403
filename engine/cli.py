"""`engine generate | serve | bench | eval | draft | adapt | distill`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from engine.decode import COMMIT_RULES, DecodeConfig
from engine.loading import DEFAULT_QUANTIZE, QUANTIZE
from engine.train.data import VOICE_SYSTEM_PROMPT


def add_decode_options(p: argparse.ArgumentParser) -> None:
    """Every default is DecodeConfig's (declared once, in engine.decode)."""
    d = DecodeConfig()
    g = p.add_argument_group("decoding")
    g.add_argument("--mode", choices=["diffusion", "ar"], default=d.mode,
                   help="block diffusion (default) or the autoregressive baseline on the same weights")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help=f"reply length limit in tokens (default {d.max_new_tokens})")
    g.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy (default)")
    g.add_argument("--block-size", type=int, default=d.block_size,
                   help="verify: tokens drafted per forward (default: the drafter's); threshold/topk: tokens per "
                        "mask block (default: the checkpoint's)")
    g.add_argument("--first-block-size", type=int, default=d.first_block_size,
                   help="a smaller first block gets the first words out sooner (default: same as --block-size)")
    g.add_argument("--rule", choices=sorted(COMMIT_RULES), default=d.rule,
                   help="commit rule: 'verify' (default, lossless) commits the drafted tokens the base model agrees "
                        "with plus its own next one, so replies are the AR replies; the lossy mask-denoising rules "
                        "need a diffusion-trained model (e.g. --adapter default): 'threshold' commits every position "
                        "at least --threshold sure (and the surest one), 'topk' the --topk surest per step")
    g.add_argument("--threshold", type=float, default=d.threshold, help="confidence threshold for --rule threshold")
    g.add_argument("--topk", type=int, default=d.topk, help="positions committed per step for --rule topk")
    g.add_argument("--draft-threshold", type=float, default=d.draft_threshold,
                   help="verify: send the longest drafted prefix the drafter gives at least this chance of being all "
                        "right (the product of its tokens' confidences; each draft row costs arithmetic; 0 = always "
                        "the whole block; lossless either way)")
    g.add_argument("--draft-tree", type=int, default=d.draft_tree,
                   help="verify, greedy, chained draft heads: draft a tree of this many tokens (alternatives checked "
                        "in the same forward) instead of a chain; --draft-threshold still drops paths the head "
                        "thinks less likely (0 sends the whole tree); pays where extra rows are nearly free (a GPU), "
                        "not on a small CPU (BENCHMARKS.md); 0 = a chain")
    g.add_argument("--max-steps", type=int, default=d.max_steps,
                   help="denoising steps per block before committing the rest (default: block size)")
    g.add_argument("--no-release-prefix", action="store_true",
                   help="hold a block until all of it is committed instead of releasing its finished left part")


def decode_config(a: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(mode=a.mode, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                        block_size=a.block_size, first_block_size=a.first_block_size, rule=a.rule,
                        threshold=a.threshold, topk=a.topk, draft_threshold=a.draft_threshold,
                        draft_tree=a.draft_tree, max_steps=a.max_steps, release_prefix=not a.no_release_prefix)


def add_model_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (packaged Qwen2.5-Coder-0.5B-Instruct, with its draft head), 'small' (packaged "
                        "SmolLM2-135M-Instruct), 'qwen2.5-1.5b' (packaged Qwen2.5-Coder-1.5B-Instruct, the voice "
                        "service's default), a .gguf file, a Hugging Face model folder, or a hub id such as "
                        "JetLM/SDAR-1.7B-Chat (needs network)")
    p.add_argument("--adapter", default=None,
                   help="a LoRA adapter from `engine adapt` to merge into --model, or 'default' for the one shipped "
                        "for 'small'; it changes the weights, so it is for the lossy --rule threshold/topk only")
    p.add_argument("--drafter", default=None,
                   help="a draft head from `engine draft` for --rule verify; '' = prompt lookup "
                        "(default: the model's shipped head, prompt lookup if it has none)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (default: torch's choice; 1 is faster on a busy 2-core machine)")
    p.add_argument("--quantize", choices=QUANTIZE, default=DEFAULT_QUANTIZE,
                   help="gguf: the GGUF as packaged on llama.cpp's kernels (CPU; mode diffusion decodes AR there "
                        "unless --drafter '' asks for prompt lookup); or PyTorch's linear layers, whose rows stay "
                        "independent so verify stays lossless: "
                        "fp16 weights (fbgemm), int8 weights with per-row int8 activations, or none (fp32; "
                        f"bf16 on a GPU); eval keeps its teacher fp32 (default: {DEFAULT_QUANTIZE}, "
                        "as the voice service)")


def cmd_generate(a: argparse.Namespace) -> int:
    from engine.stream import Engine
    engine = Engine.load(a.model, adapter=a.adapter, quantize=a.quantize, drafter=a.drafter, device=a.device)
    cfg = decode_config(a)
    messages = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": a.prompt}]
    start = time.perf_counter()
    stats = None
    for piece in engine.generate_sync(messages, cfg):
        print(piece.text, end="", flush=True)
        stats = piece
    print()
    if stats:
        print(f"[{stats.tokens} tokens, {stats.forwards} forwards, first block {stats.ttfb_ms:.0f} ms, "
              f"total {(time.perf_counter() - start) * 1000:.0f} ms]", file=sys.stderr)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from engine.api.server import serve
    try:
        serve(a.model, a.adapter, a.host, a.port, decode_config(a), a.quantize, a.drafter, a.device)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then raised it again
        return 130
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from engine.evals.bench import run_bench
    run_bench(a.model, a.adapter, Path(a.prompts), Path(a.json) if a.json else None, decode_config(a), a.limit,
              quantize=a.quantize, drafter=a.drafter, draft_anyway=a.draft_anyway)
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from engine.evals.eval import run_answers, run_eval
    if bool(a.prompts) == bool(a.answers):
        raise SystemExit("engine eval: give exactly one of --prompts (replies vs the AR teacher) and --answers "
                         "(answer accuracy)")
    if a.answers:
        run_answers(a.model, a.adapter, Path(a.answers), Path(a.json) if a.json else None, decode_config(a), a.limit,
                    quantize=a.quantize, modes=tuple(a.modes.split(",")), drafter=a.drafter,
                    system=a.system_prompt)
    else:
        run_eval(a.model, a.adapter, Path(a.prompts), Path(a.json) if a.json else None, decode_config(a), a.limit,
                 quantize=a.quantize)
    return 0


def cmd_adapt(a: argparse.Namespace) -> int:
    from engine.train import adapt, data
    from engine.loading import load
    from engine.model import Transformer
    out = Path(a.out)
    adapt.write_log_header(out, sys.argv)
    teacher = load(a.base)
    distilled = out / "distilled.jsonl"
    prompts = data.sample_prompts("train", a.distill, seed=a.seed)
    data.distill(teacher, prompts, distilled, a.reply_tokens, a.distill_batch)
    examples = data.training_examples(teacher, distilled, seed=a.seed)
    n_held = max(1, len(examples) // 20)
    heldout, train_set = examples[:n_held], examples[n_held:]
    spec = teacher.spec
    spec.block_size, spec.shift, spec.trained = a.block_size, not a.no_shift, True
    cfg = adapt.AdaptConfig(block_size=a.block_size, shift=not a.no_shift, rank=a.rank, alpha=2.0 * a.rank, lr=a.lr,
                            max_tokens=a.max_tokens, max_minutes=a.max_minutes, save_every=a.save_every,
                            noisy_weight=a.noisy_weight, seed=a.seed)
    assert isinstance(teacher.model, Transformer)  # load's default quantize: PyTorch's
    result = adapt.train(teacher.model, train_set, spec, cfg, out, heldout)
    print(json.dumps(result))
    print(f"adapter: {out / 'adapter.safetensors'}")
    return 0


def cmd_draft(a: argparse.Namespace) -> int:
    import torch
    from engine.train import data, draft as train_draft
    from engine.draft import load_head, save_head
    from engine.loading import load, pick_device
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device = pick_device(a.device)
    layers = tuple(int(x) for x in a.layers_read.split(",")) if a.layers_read else ()
    if a.data and a.quantize != "gguf":
        raise SystemExit("--data reads the replies back through the GGUF on llama.cpp's kernels: add --quantize gguf")
    # fp32 targets, as on CPU; or the GGUF on llama.cpp's kernels, whose states the head then reads
    base = load(a.base, adapter="", drafter="", device=device, dtype=torch.float32, quantize=a.quantize,
                layers=layers)
    distilled = out / "distilled.jsonl"
    prompts = data.drafter_prompts(a.chat_prompts, a.assistant_prompts, a.replies, a.knowledge_prompts, seed=a.seed)
    if a.data:
        corpus = train_draft.read_shards(base, Path(a.data), a.window, a.replies, cache=out / "read-back",
                                         skip=a.data_from)
    elif a.quantize == "gguf":
        if a.text_replies:
            raise SystemExit("--text-replies needs the PyTorch model (--quantize none)")
        train_draft.distill_states(base, prompts, distilled, a.window, a.reply_tokens, a.distill_batch)
    else:
        data.distill(base, prompts, distilled, a.reply_tokens, a.distill_batch, a.distill_minutes)
    if not a.data:
        corpus = train_draft.read_corpus(base, distilled, a.window)
    if a.text_replies:
        text = out / "text.jsonl"
        data.write_text_replies(base.tokenizer, data.chitchat_pairs("train", a.text_replies, a.seed), text)
        corpus = train_draft.Corpus.join([corpus, train_draft.read_corpus(base, text, a.window, greedy=True)])
    cfg = train_draft.DraftTrainConfig(block=a.block, window=a.window, n_layers=a.layers, draft_vocab=a.draft_vocab,
                                       chain=a.chain,
                                       batch=a.batch, lr=a.lr, max_steps=a.steps, max_minutes=a.max_minutes,
                                       seed=a.seed, layers=layers, dropout=a.dropout, width=a.width,
                                       weight_decay=a.weight_decay,
                                       distill_weight=a.distill_weight, patience=a.patience, eval_every=a.eval_every,
                                       init=a.init)
    try:
        result = train_draft.train(base, corpus, cfg, out, device)
    except ValueError as err:  # --init of another shape, --out holding a run on other data: said, not a traceback
        raise SystemExit(f"engine draft: {err}") from None
    if a.ship:  # the file a release carries: fp16 (half the size; the head's drafts are the same to ~1e-3)
        head = load_head(out / "drafter.safetensors", base.model.args.dim, base.model.args.vocab_size)
        save_head(a.ship, head, result, dtype=torch.float16)
        result["shipped"] = a.ship
    print(json.dumps(result))
    return 0


def cmd_distill(a: argparse.Namespace) -> int:
    from engine.loading import load
    from engine.train.distill import grow
    # room in llama.cpp's shared cache (4 x max_seq_len) for every conversation in flight at three turns
    loaded = load(a.model, max_seq_len=4096, adapter="", drafter="", quantize=a.quantize)
    grow(loaded, Path(a.out), a.in_flight, a.max_new_tokens, a.seed, a.max_minutes, a.max_replies)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engine",
                                     description="LM engine (AR, or drafted blocks the base verifies where that pays, "
                                                 "decided at load): generate, serve, benchmark, adapt an AR model to "
                                                 "block diffusion, and evaluate it.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="reply to one prompt, streaming committed blocks to stdout")
    add_model_option(p)
    add_decode_options(p)
    p.add_argument("--device", default="cpu", help="cpu | cuda (bf16 weights) | auto (cuda when there is one)")
    p.add_argument("prompt", help="the user message")
    p.add_argument("--system", default="", help="system prompt (default: the chat template's)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/models, /v1/chat/completions)")
    add_model_option(p)
    add_decode_options(p)
    p.add_argument("--device", default="cpu", help="cpu | cuda (bf16 weights) | auto (cuda when there is one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.set_defaults(func=cmd_serve)

    for name, func, text in (("bench", cmd_bench, "AR vs diffusion on the same prompts: TTFB, tokens/s, "
                                                   "tokens per forward, prefill time"),
                             ("eval", cmd_eval, "diffusion replies vs the AR teacher: tokens per forward, TTFB, "
                                                "teacher NLL, repetition")):
        p = sub.add_parser(name, help=text, description=text)
        add_model_option(p)
        add_decode_options(p)
        p.add_argument("--prompts", required=name == "bench", default="",
                       help="JSONL file, one {\"prompt\": \"...\"} per line")
        if name == "eval":
            p.add_argument("--answers", default="",
                           help="answer accuracy instead: JSONL of {\"prompt\", \"answer\": regex} (e.g. "
                                "engine/prompts/answers_heldout.jsonl); each question is asked in every --modes")
            p.add_argument("--modes", default="ar,diffusion", help="with --answers: decoding modes to compare")
            p.add_argument("--system-prompt", default=VOICE_SYSTEM_PROMPT,
                           help="with --answers: the system prompt each question is asked under (default: the "
                                "voice service's [lm] system_prompt)")
        if name == "bench":
            p.add_argument("--draft-anyway", action="store_true",
                           help="mode diffusion drafts with the model's draft head even where the load-time decision "
                                "keeps AR (llama.cpp's kernels on most CPU classes): to measure tau and tokens/s")
        p.add_argument("--json", default="", help="write the full results here")
        p.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
        # bench measures what ships (auto); eval compares the diffusion decoders with an fp32 teacher
        p.set_defaults(func=func, quantize=DEFAULT_QUANTIZE if name == "bench" else "fp16")

    p = sub.add_parser("adapt", help="train a block-diffusion LoRA adapter on an AR checkpoint",
                       description="Distil the AR teacher's replies to chitchat prompts, then train LoRA + a mask "
                                   "token embedding with the masked-block objective. Resumes from --out.")
    p.add_argument("--base", default="small", help="AR checkpoint to adapt (default: packaged SmolLM2)")
    p.add_argument("--out", default="runs/adapt", help="run folder: distilled data, checkpoints, adapter")
    p.add_argument("--distill", type=int, default=800, help="number of prompts to distil teacher replies for")
    p.add_argument("--distill-batch", type=int, default=32)
    p.add_argument("--reply-tokens", type=int, default=40, help="teacher reply length limit")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--no-shift", action="store_true", help="predict tokens in place instead of the next token")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--noisy-weight", type=float, default=1.0,
                   help="loss weight of the masked-block rows relative to the clean next-token rows")
    p.add_argument("--max-tokens", type=int, default=0, help="stop after this many trained tokens")
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop after this long")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_adapt)

    p = sub.add_parser("draft", help="train a draft head for lossless `verify` decoding of a base model",
                       description="Distil the base model's greedy replies, read its hidden states over them, and "
                                   "train a small block-drafting head on them. Resumes from --out.")
    p.add_argument("--base", default="default", help="the model to draft for (a --model value; default: 'default')")
    p.add_argument("--ship", default="", help="also write the trained head here in fp16 (e.g. "
                                             "engine/weights/qwen2.5-0.5b-drafter.safetensors)")
    p.add_argument("--out", default="runs/draft", help="run folder: distilled data, checkpoints, drafter")
    p.add_argument("--chat-prompts", type=int, default=4500, help="chitchat turns to distil replies for")
    p.add_argument("--assistant-prompts", type=int, default=1500, help="templated assistant questions to distil")
    p.add_argument("--replies", type=int, default=0,
                   help="distil only the first N of those (shuffled) prompts (0: all)")
    p.add_argument("--knowledge-prompts", type=int, default=1186,
                   help="short factual questions (templated, none from the answer sets) distilled after them")
    p.add_argument("--text-replies", type=int, default=0,
                   help="also read this many people's chitchat replies through the base and learn its greedy "
                        "next token at every position: one forward each, no generation, so many more "
                        "positions per CPU second than distilling (chitchat train split)")
    p.add_argument("--distill-batch", type=int, default=32)
    p.add_argument("--distill-minutes", type=float, default=0.0,
                   help="stop distilling after this long and train on what is there (0: distil every prompt)")
    p.add_argument("--reply-tokens", type=int, default=48, help="teacher reply length limit")
    p.add_argument("--block", type=int, default=4, help="tokens drafted per forward")
    p.add_argument("--window", type=int, default=16, help="base positions the head reads")
    p.add_argument("--layers", type=int, default=2, help="head layers")
    p.add_argument("--draft-vocab", type=int, default=8192, help="tokens the head can propose (most frequent)")
    p.add_argument("--chain", action="store_true",
                   help="chained head: each drafted token reads the one before it (more tokens per forward, a "
                        "head pass per token; default's shipped head is one, see BENCHMARKS.md)")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps (the LR schedule spans them)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop after this long (resume later)")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument("--quantize", default="none", choices=("none", "gguf"),
                   help="the base as it will decode: 'none' = PyTorch's model (the head reads its last states, "
                        "before the final norm); 'gguf' = the GGUF on llama.cpp's kernels (CPU; the head reads "
                        "ggml's states, after the final norm, captured while distilling)")
    p.add_argument("--data", default="",
                   help="train on `engine distill`'s shards in this folder (e.g. engine/data/qwen2.5-1.5b), read back "
                        "through the base on llama.cpp's kernels (--quantize gguf; --replies: only the first N)")
    p.add_argument("--data-from", type=int, default=0,
                   help="skip the whole shards that hold the first N replies (with --init: go on learning from the "
                        "shards after those the head was trained on; reading 15k replies back takes ~2.3 hours on "
                        "two Zen 4 cores, more than a sitting)")
    p.add_argument("--init", default="",
                   help="go on training this head file (its shape, weights and draft vocabulary; the LR schedule "
                        "starts again); the held-out replies are drawn from this run's data, which it never saw")
    p.add_argument("--layers-read", default="",
                   help="the base layers the head reads, e.g. 4,14,27 (a low, a middle and the last: llama.cpp's eval "
                        "callback reads them in the forward that verifies; output rows frozen); default: the one state")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--width", type=int, default=0,
                   help="the head's own width (default: the base's); narrower drafts sooner, projected up to the "
                        "base's width before its output rows")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--distill-weight", type=float, default=0.0,
                   help="share of the loss from the base's top-K next-token distribution (--data only), the rest "
                        "cross-entropy on its greedy token")
    p.add_argument("--patience", type=int, default=0,
                   help="stop after this many evaluations without a better decoded held-out figure (0: never)")
    p.add_argument("--eval-every", type=int, default=250, help="optimizer steps between held-out evaluations")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_draft)

    p = sub.add_parser("distill", help="add shards of the base's greedy voice replies to a data folder (resumes)",
                       description="The base model's own greedy replies under the voice system prompt, to 1-3 turn "
                                   "chitchat conversations (train split) and tool requests, generated IN_FLIGHT at a "
                                   "time with refilled batches and written as gzipped shards of token ids. Each run "
                                   "adds shards; SIGTERM writes what is finished and stops.")
    p.add_argument("--model", default="qwen2.5-1.5b", help="the base (a --model value; default: the voice service's)")
    p.add_argument("--quantize", default="gguf", choices=QUANTIZE,
                   help="gguf (default): the GGUF as shipped on llama.cpp's kernels, as the voice service runs it")
    p.add_argument("--out", default="engine/data/qwen2.5-1.5b", help="the data folder (shards and meta.json)")
    p.add_argument("--in-flight", type=int, default=32, help="conversations decoded together in each batched step")
    p.add_argument("--max-new-tokens", type=int, default=48, help="reply length limit ([lm] max_new_tokens)")
    p.add_argument("--max-minutes", type=float, default=0.0, help="start no conversation after this long (0: none)")
    p.add_argument("--max-replies", type=int, default=0, help="stop after adding this many replies (0: no limit)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (1 on a shared 2-core machine)")
    p.add_argument("--seed", type=int, default=0, help="the conversations' order (a folder keeps one)")
    p.set_defaults(func=cmd_distill)

    a = parser.parse_args(argv)
    if getattr(a, "threads", 0):
        import torch
        torch.set_num_threads(a.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
