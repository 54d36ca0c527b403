"""A short request beside long prompts on `engine serve` (issue 56, item 5), and hostile decode options.

    python bench/serve_fairness.py [--model default] [--long 6] [--long-tokens 1700] [--json out.json]

Starts `engine serve --model M` on a free port. First a short request (one sentence, --short-tokens
new tokens) alone, --idle times. Then --long requests whose prompts are about --long-tokens tokens
each (numbered facts), sent at once, and 2 s later the short request again, while they run. Prints
the short request's latency alone and beside them (and the ratio), and what each long request got
(status, error code, seconds): a request that fails with "cache full" after it started is the defect.
With --hostile it also sends each of the pass's hostile decode options (HOSTILE) and, while each
runs (or after its answer), a normal request: its status and latency (a wedge shows as seconds).
The server's log is counted for "Traceback".
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, free_port, loadavg, machine, write_json  # noqa: E402

SHORT = {"messages": [{"role": "user", "content": "Say hi."}]}
HOSTILE = [  # the adversarial pass's options (issue 56: items 1, 2, 7)
    {"rule": "threshold", "threshold": 1.0, "first_block_size": 1024, "max_tokens": 1024},
    {"rule": "threshold", "block_size": 1900, "max_steps": 1900, "max_tokens": 1900},
    {"rule": "topk", "topk": 1, "block_size": 512, "max_tokens": 512},
    {"temperature": 1e-300}, {"temperature": 5e-324},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 1000 + "]" * 1000}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x"}]},
]


def long_prompt(n: int, tokens: int) -> dict:
    """About `tokens` tokens of numbered facts (~19 tokens a fact in SmolLM2's and Qwen2.5's tokenizers)."""
    facts = " ".join(f"Fact {n}.{i}: box {i} holds {i * 7 % 100} marbles." for i in range(tokens // 19))
    return {"messages": [{"role": "user", "content": f"{facts} Which box holds the most marbles?"}]}


def post(port: int, body: dict, timeout: float = 900.0) -> tuple[int, dict, float]:
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        r = conn.getresponse()
        answer = json.loads(r.read() or b"{}")
        return r.status, answer, time.perf_counter() - start
    except (OSError, ValueError) as err:
        return 0, {"error": {"code": type(err).__name__, "message": str(err)}}, time.perf_counter() - start
    finally:
        conn.close()


def summary(status: int, answer: dict, seconds: float) -> dict:
    out = {"status": status, "s": round(seconds, 2)}
    if "error" in answer:
        out["error"] = answer["error"].get("code")
        out["message"] = str(answer["error"].get("message"))[:160]
    else:
        out["prompt_tokens"] = answer.get("usage", {}).get("prompt_tokens")
    return out


def beside(port: int, bodies: list[dict], short: dict, after_s: float) -> tuple[list[dict], dict]:
    """Send `bodies` at once and `short` `after_s` later: (each body's outcome, the short one's)."""
    results: list[dict] = [{} for _ in bodies]

    def send(i: int) -> None:
        results[i] = summary(*post(port, bodies[i]))
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    time.sleep(after_s)
    short_result = summary(*post(port, short, timeout=300))
    for t in threads:
        t.join()
    return results, short_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--long-tokens", type=int, default=1700)
    ap.add_argument("--long-max-tokens", type=int, default=16)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--idle", type=int, default=3)
    ap.add_argument("--hostile", action="store_true", help="also the hostile decode options, each beside a normal one")
    ap.add_argument("--serve-args", nargs="*", default=[], help="more `engine serve` arguments")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    port, log_path = free_port(), Path(tempfile.mkdtemp()) / "engine.log"
    proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "engine"), "serve", "--model", a.model, "--port", str(port),
                             *a.serve_args], stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"engine serve did not start:\n{log_path.read_text()[-3000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        short = {**SHORT, "max_tokens": a.short_tokens}
        post(port, short)  # warm-up: weights paged in
        idle = [summary(*post(port, short)) for _ in range(a.idle)]
        idle_s = min(r["s"] for r in idle)
        print(f"short request alone: {[r['s'] for r in idle]} s")
        result: dict = {"model": a.model, "machine": machine(), "idle": idle}
        if a.hostile:
            result["hostile"] = []
            for options in HOSTILE:
                body = {**SHORT, **options} if "messages" not in options else options
                [outcome], normal = beside(port, [body], short, 0.5)
                result["hostile"].append({"options": json.dumps(options)[:120], **outcome, "normal": normal})
                print(f"  {json.dumps(options)[:90]:90s} -> {outcome['status']} {outcome.get('error', '')} "
                      f"({outcome['s']} s); a normal request beside it: {normal['status']} in {normal['s']} s")
        if a.long:
            bodies = [{**long_prompt(n, a.long_tokens), "max_tokens": a.long_max_tokens} for n in range(a.long)]
            started = time.perf_counter()
            longs, loaded = beside(port, bodies, short, 2.0)
            result.update(longs=longs, short_beside=loaded, ratio=round(loaded["s"] / idle_s, 2),
                          longs_wall_s=round(time.perf_counter() - started, 1))
            print(f"short request beside {a.long} long prompts: {loaded} ({result['ratio']}x alone)")
            for r in longs:
                print(f"  long: {r}")
        tracebacks = log_path.read_text().count("Traceback")
        result.update(tracebacks=tracebacks, loadavg=loadavg(), log=str(log_path))
        print(f"tracebacks in the server log: {tracebacks} ({log_path})")
        if a.json:
            write_json(a.json, result)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
