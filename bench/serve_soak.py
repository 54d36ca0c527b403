"""Soak `engine serve`: many streamed chat requests, about half cancelled mid-stream, and the
server's resident memory (RSS) after every request.

Starts `engine serve` as a subprocess on a free port (the default model, --threads 1 and
--quantize int8 unless told otherwise), then sends --requests streamed chat completions with
the official `openai` client, --concurrency at a time. A random --cancel-fraction of them are
cancelled after a random number (1..--cancel-after-max) of chunks by closing the stream, which
is what a client that hangs up (or a voice client on barge-in) does; the server should see a
disconnect and drop the generation. After each request completes, the server process's RSS is
sampled (psutil, else /proc/PID/status VmRSS).

Printed: the RSS after warm-up (the first --warmup requests) and then every --every requests,
the growth from warm-up to the end, and the slope over the second half (MB per 100 requests;
a server that plateaus shows ~0). --json writes every sample. A leak, or memory the allocator
keeps but never reuses, shows as a curve that keeps rising. --env KEY=VALUE passes extra
environment to the server (e.g. MALLOC_ARENA_MAX=2, for diagnosis).

Usage (short run, ~3 min on a busy 2-core box):
    nice -n 19 .venv/bin/python bench/serve_soak.py --requests 160 --max-tokens 32 --json /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, free_port, loadavg, machine, write_json  # noqa: E402

ENGINE = REPO / ".venv" / "bin" / "engine"
PROMPTS = [
    "Hi!",
    "What is the capital of France?",
    "Tell me something about the moon.",
    "Name three fruits and say which one you like best.",
    "Write a short poem about rain on a tin roof.",
    "Explain in a few sentences how a bicycle stays upright when it moves.",
    "I'm planning a trip to Japan in spring. What should I pack, and what should I see in Kyoto? "
    "Please keep it short, I will ask follow-up questions later.",
]
SYSTEM = "You are a friendly voice assistant. Answer briefly, in plain spoken sentences."


def rss_mb(pid: int) -> float:
    """Resident set size of process `pid` in MB (psutil if installed, else /proc)."""
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss / 2**20
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no RSS for process {pid}")


def messages_for(rng: random.Random, long_tokens: int = 0) -> list[dict]:
    """One to three turns of varied length, so conversations touch different amounts of cache; a
    last message of about `long_tokens` tokens of numbered facts when that is set."""
    msgs = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(0, 2)):
        msgs += [{"role": "user", "content": rng.choice(PROMPTS)},
                 {"role": "assistant", "content": "Sure. " + rng.choice(PROMPTS)}]
    last = rng.choice(PROMPTS)
    if long_tokens:  # ~19 tokens a fact; a different set each time, so no cached prefix is reused
        first = rng.randrange(10_000)
        last = " ".join(f"Fact {first + i}: box {i} holds {i * 7 % 100} marbles." for i in range(long_tokens // 19)) \
            + " " + last
    return msgs + [{"role": "user", "content": last}]


def start_server(a, port: int, log_path: Path) -> subprocess.Popen:
    env = dict(os.environ)  # engine serve sets how its thread pools wait (engine/__init__.py)
    for item in a.env:
        key, _, value = item.partition("=")
        env[key] = value
    args = [a.engine, "serve", "--port", str(port), "--model", a.model, "--threads", str(a.threads),
            "--quantize", a.quantize, *a.serve_args]
    log = log_path.open("w")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def wait_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float = 300) -> None:
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"engine serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"engine serve not ready after {timeout_s:.0f} s; see {log_path}")


async def soak(a, base_url: str, pid: int) -> list[dict]:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = (await client.models.list()).data[0].id
    rng = random.Random(a.seed)
    long_rng = random.Random(a.seed + 1)  # (the plan of short prompts stays as without --long-fraction)
    plans = [(messages_for(rng, a.long_tokens if long_rng.random() < a.long_fraction else 0),
              rng.random() < a.cancel_fraction, rng.randint(1, a.cancel_after_max)) for _ in range(a.requests)]
    gate = asyncio.Semaphore(a.concurrency)
    samples: list[dict] = []

    async def one(i: int) -> None:
        messages, cancel, after = plans[i]
        chunks, cancelled, error = 0, False, None
        t = time.perf_counter()
        async with gate:
            try:
                stream = await client.chat.completions.create(model=model, messages=messages, stream=True,
                                                              max_tokens=a.max_tokens)
                async for _ in stream:
                    chunks += 1
                    if cancel and chunks >= after:
                        await stream.close()  # hang up mid-stream: the server sees a disconnect
                        cancelled = True
                        break
            except Exception as err:  # noqa: BLE001 - recorded, the soak goes on
                error = f"{type(err).__name__}: {err}"[:200]
            samples.append({"n": len(samples) + 1, "request": i, "cancelled": cancelled, "chunks": chunks,
                            "seconds": round(time.perf_counter() - t, 3), "error": error,
                            "rss_mb": round(rss_mb(pid), 1)})
            if a.verbose:
                print(f"  {len(samples):4d} rss {samples[-1]['rss_mb']:7.1f} MB  chunks {chunks:3d}"
                      f"{'  cancelled' if cancelled else ''}{'  ' + error if error else ''}", flush=True)

    await asyncio.gather(*(one(i) for i in range(a.requests)))
    await client.close()
    return samples


def curve(samples: list[dict], warmup: int, every: int) -> list[tuple[int, float]]:
    points = sorted({min(warmup, len(samples))} | set(range(warmup, len(samples) + 1, every)) | {len(samples)})
    return [(n, samples[n - 1]["rss_mb"]) for n in points if n >= 1]


def slope_per_100(samples: list[dict]) -> float:
    """Least-squares slope of RSS over the second half of the requests, MB per 100 requests."""
    tail = samples[len(samples) // 2:]
    if len(tail) < 2:
        return float("nan")
    xs, ys = [s["n"] for s in tail], [s["rss_mb"] for s in tail]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=160, help="streamed chat requests to send (default 160)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request (default 32)")
    p.add_argument("--cancel-fraction", type=float, default=0.5,
                   help="share of requests cancelled mid-stream (default 0.5)")
    p.add_argument("--cancel-after-max", type=int, default=6,
                   help="a cancelled request is closed after 1..N chunks (default 6)")
    p.add_argument("--long-fraction", type=float, default=0.0,
                   help="fraction of requests whose last message is about --long-tokens tokens (default 0)")
    p.add_argument("--long-tokens", type=int, default=1500, help="a long message's tokens (default 1500)")
    p.add_argument("--warmup", type=int, default=20, help="requests before the baseline sample (default 20)")
    p.add_argument("--every", type=int, default=20, help="print the RSS every N requests (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request plan (prompts, which to cancel, when)")
    p.add_argument("--engine", default=str(ENGINE), help="the engine executable (default: .venv/bin/engine)")
    p.add_argument("--model", default="default", help="engine serve --model (default: the packaged one)")
    p.add_argument("--threads", type=int, default=1, help="engine serve --threads (default 1)")
    p.add_argument("--quantize", default="int8", choices=["none", "int8"],
                   help="engine serve --quantize (default int8, as the voice service runs)")
    p.add_argument("--serve-arg", dest="serve_args", action="append", default=[],
                   help="extra argument for engine serve (repeatable), e.g. --serve-arg=--mode=ar")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for the server (repeatable), e.g. MALLOC_ARENA_MAX=2")
    p.add_argument("--log", default="", help="server log file (default: a temporary file, path printed)")
    p.add_argument("--json", default="", help="write the samples and summary here")
    p.add_argument("--verbose", action="store_true", help="print every sample")
    a = p.parse_args(argv)

    port = free_port()
    log_path = Path(a.log) if a.log else Path(tempfile.mkdtemp(prefix="serve_soak-")) / "serve.log"
    base_url = f"http://127.0.0.1:{port}"
    print(f"engine serve on {base_url} (log {log_path})", flush=True)
    info = machine()
    proc = start_server(a, port, log_path)
    try:
        wait_ready(proc, base_url, log_path)
        rss_ready = rss_mb(proc.pid)
        print(f"ready: RSS {rss_ready:.1f} MB; {a.requests} requests, {a.concurrency} at a time, "
              f"~{a.cancel_fraction:.0%} cancelled, max_tokens {a.max_tokens}", flush=True)
        t = time.perf_counter()
        samples = asyncio.run(soak(a, base_url, proc.pid))
        seconds = time.perf_counter() - t
        time.sleep(1.0)  # let the server finish logging and dropping the last requests
        rss_idle = rss_mb(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    server_log = log_path.read_text(errors="replace")
    seen_cancelled = len(re.findall(r"finish=cancelled", server_log))
    errors = [s for s in samples if s["error"]]
    points = curve(samples, a.warmup, a.every)
    warm = points[0][1]
    print(f"\n{'requests':>9} {'RSS MB':>8} {'vs warm-up':>11}")
    for n, rss in points:
        print(f"{n:9d} {rss:8.1f} {rss - warm:+11.1f}")
    slope = slope_per_100(samples)
    print(f"\nready {rss_ready:.1f} MB, after warm-up ({points[0][0]}) {warm:.1f} MB, after {len(samples)} "
          f"{samples[-1]['rss_mb']:.1f} MB ({samples[-1]['rss_mb'] - warm:+.1f}), idle {rss_idle:.1f} MB; "
          f"second-half slope {slope:+.1f} MB/100 requests")
    print(f"{sum(s['cancelled'] for s in samples)} cancelled by the client, {seen_cancelled} seen as cancelled by "
          f"the server, {len(errors)} errors; {seconds:.0f} s")
    for s in errors[:5]:
        print(f"  error in request {s['request']}: {s['error']}")
    if a.json:
        write_json(a.json, {
            "what": "engine serve RSS under streamed requests, some cancelled mid-stream (bench/serve_soak.py)",
            "args": vars(a), "machine": info, "loadavg_end": loadavg(), "seconds": round(seconds, 1),
            "rss_ready_mb": round(rss_ready, 1), "rss_warm_mb": warm, "rss_end_mb": samples[-1]["rss_mb"],
            "rss_idle_mb": round(rss_idle, 1), "growth_mb": round(samples[-1]["rss_mb"] - warm, 1),
            "slope_mb_per_100": round(slope, 2), "curve": points, "server_cancelled": seen_cancelled,
            "errors": len(errors), "samples": samples})
    return 1 if len(errors) == len(samples) else 0


if __name__ == "__main__":
    sys.exit(main())
