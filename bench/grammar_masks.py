"""Which constrained-decoding library for JSON-schema output: compile time and mask cost per token.

    pip install llguidance xgrammar outlines-core     # the three candidates (issue 16)
    python bench/grammar_masks.py [--model default] [--json bench/results/grammar_masks.json]

For each library and schema: compile the schema against the model's own tokenizer (Qwen2.5's
151k tokens), then walk a valid reply token by token, timing the allowed-token mask at each
step (what constrained decoding pays per committed token, on top of the forward) and checking
that the reply's own next token is allowed. One process, one run, one thread.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, fmt, machine, percentile, write_json  # noqa: E402

SCHEMAS = {
    "tool arguments": ({"type": "object", "properties": {
        "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "unit"], "additionalProperties": False},
        '{"location": "Paris, France", "unit": "celsius"}'),
    "record": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}}, "active": {"type": "boolean"}},
        "required": ["name", "age", "email", "tags", "active"], "additionalProperties": False},
        '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["maths", "engines"], '
        '"active": true}'),
    "any json_object": ({"type": "object"},
                        '{"answer": "Madrid", "confidence": 0.9, "sources": ["atlas"], "notes": null}'),
}


def walk(ids: list[int], step) -> tuple[list[float], bool]:
    """`step(token)` -> (is `token` allowed by the mask, seconds the mask took); advances past it."""
    times, ok = [], True
    for token in ids:
        allowed, seconds = step(token)
        times.append(seconds * 1000)
        ok = ok and allowed
    return times, ok


def llguidance_case(hf, vocab_size: int, schema: dict, ids: list[int]):
    import llguidance
    import llguidance.hf
    import llguidance.torch
    t = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
    compile_s = time.perf_counter() - t
    assert not matcher.is_error(), matcher.get_error()
    mask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)

    def step(token):
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        took = time.perf_counter() - start
        allowed = bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
        matcher.consume_token(token)
        return allowed, took
    return setup, compile_s, step


def xgrammar_case(hf, vocab_size: int, schema: dict, ids: list[int]):
    import xgrammar as xgr
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    compile_s = time.perf_counter() - t
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def step(token):
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        took = time.perf_counter() - start
        allowed = bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
        matcher.accept_token(token)
        return allowed, took
    return setup, compile_s, step


def outlines_case(hf, vocab_size: int, schema: dict, ids: list[int]):
    from outlines_core import Guide, Index, Vocabulary, json_schema
    t = time.perf_counter()
    tokens: dict[str, list[int]] = {}
    eos = hf.eos_token_id
    for text, i in hf.get_vocab().items():
        if i != eos and i < vocab_size:
            tokens.setdefault(text, []).append(i)
    vocabulary = Vocabulary(eos, tokens)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    guide = Guide(Index(json_schema.build_regex_from_schema(json.dumps(schema)), vocabulary))
    compile_s = time.perf_counter() - t

    def step(token):
        start = time.perf_counter()
        allowed_ids = guide.get_tokens()
        took = time.perf_counter() - start
        allowed = token in set(allowed_ids)
        guide.advance(token)
        return allowed, took
    return setup, compile_s, step


CASES = {"llguidance": llguidance_case, "xgrammar": xgrammar_case, "outlines-core": outlines_case}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="whose tokenizer (an engine model name)")
    p.add_argument("--json", default=str(RESULTS / "grammar_masks.json"))
    a = p.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    import torch
    from transformers import PreTrainedTokenizerFast

    from engine.loading import load
    torch.set_num_threads(1)
    loaded = load(a.model)
    tok = loaded.tokenizer
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eos_token or None)
    vocab_size = loaded.model.args.vocab_size
    results: dict = {"model": loaded.name, "vocab_size": vocab_size, "machine": machine(), "cases": {}}
    for library, case in CASES.items():
        for (name, (schema, spaced)), layout in itertools.product(SCHEMAS.items(), ("spaced", "compact")):
            reply = spaced if layout == "spaced" else json.dumps(json.loads(spaced), separators=(",", ":"))
            name = f"{name}, {layout}"
            ids = tok.encode(reply)
            try:
                setup, compile_s, step = case(hf, vocab_size, schema, ids)
                times, ok = walk(ids, step)
            except Exception as err:  # noqa: BLE001 - a library that cannot do a case says why
                results["cases"][f"{library} / {name}"] = {"error": f"{type(err).__name__}: {err}"[:300]}
                print(f"{library:14s} {name:24s} failed: {err}", flush=True)
                continue
            row = {"tokenizer_setup_ms": round(setup * 1000, 1), "compile_ms": round(compile_s * 1000, 1),
                   "mask_ms_mean": round(sum(times) / len(times), 3), "mask_ms_p50": round(percentile(times, 50), 3),
                   "mask_ms_p95": round(percentile(times, 95), 3), "mask_ms_max": round(max(times), 3),
                   "tokens": len(ids), "reply_allowed": ok}
            results["cases"][f"{library} / {name}"] = row
            print(f"{library:14s} {name:24s} setup {fmt(row['tokenizer_setup_ms'], 0):>6s} ms  compile "
                  f"{fmt(row['compile_ms'], 1):>7s} ms  mask p50 {row['mask_ms_p50']:.3f}  p95 {row['mask_ms_p95']:.3f}"
                  f"  max {row['mask_ms_max']:.3f} ms  ({len(ids)} tokens, reply allowed: {ok})", flush=True)
    write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
