"""The voice service's LM on llama.cpp's OpenAI server against `engine serve`, same GGUF, same threads.

    .venv/bin/python bench/remote_lm.py --model qwen2.5-1.5b --repeat 3

Both LM servers run the packaged GGUF on llama.cpp's kernels, AR, one thread, as their own processes:

  llamacpp   python -m llama_cpp.server (llama-cpp-python's [server] extra), as docs/SCALING.md says
             (--interrupt_requests False: one request at a time, none cut short for another)
  engine     engine serve --quantize gguf (our AR decoder on the same kernels; its per-conversation
             prefix cache)

and one `voice serve` in front of each ([lm] backend = "openai", url at that server, mode "ar",
everything else as configs/default.toml: the real Whisper and Piper). Two measurements, each
interleaved (the order of the systems alternates from round to round, so drift in the machine's
load is spread over both):

  voice      bench/drive.py's client plays every clip of --audio to each voice service (one session
             per system per round): the LM's first block = the latency event's `lm_first_block`
             stage (final transcript -> first streamed text of the reply, through the service),
             blocks per reply, voice-to-voice;
  direct     the same questions (the clips' reference transcripts, under the service's system
             prompt) straight to each LM server with the `openai` client, streamed: time to the
             first text, blocks (streamed pieces with text), the whole reply. llama.cpp's server
             reuses the previous request's cached prefix (the shared system prompt), `engine
             serve` only a conversation it continues; --fresh-prefix starts every direct
             request's system prompt with its own number, so neither reuses anything.

Prints p50/p95 per system and the ratios llamacpp/engine; writes --json (default
bench/results/remote_lm.json). Logs of the four services go to bench/results/logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, fmt, free_port, loadavg, machine, percentile, ratio, write_json  # noqa: E402
from drive import clip_list, run_session  # noqa: E402
from voice_loop import VENV_BIN, Service, http_ok  # noqa: E402

SYSTEMS = ("llamacpp", "engine")


def models_up(url: str):
    """Ready when GET {url}/models answers (llama.cpp's server has no /healthz)."""
    import urllib.request

    def check(_svc) -> bool:
        try:
            with urllib.request.urlopen(url + "/models", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False
    return check


def voice_config(path: Path, url: str, model: str, max_new_tokens: int) -> Path:
    """configs/default.toml but the LM at `url`; records kept out of runs/."""
    path.write_text("\n".join([
        "[lm]", 'backend = "openai"', f'url = "{url}"', f'model = "{model}"', 'mode = "ar"',
        f"max_new_tokens = {max_new_tokens}", "probe_interval_s = 10.0",
        "[records]", f'path = "{path.with_suffix(".sqlite3")}"']) + "\n")
    return path


async def direct(url: str, model: str, system_prompt: str, question: str, max_tokens: int) -> dict:
    """One streamed chat straight to an LM server: time to the first text, blocks, the whole reply."""
    import openai
    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120) as client:
        t0 = time.perf_counter()
        first, blocks, text = None, 0, ""
        stream = await client.chat.completions.create(
            model=model, stream=True, max_tokens=max_tokens, temperature=0, extra_body={"mode": "ar"},
            messages=[{"role": "system", "content": system_prompt}, {"role": "user", "content": question}])
        async for chunk in stream:
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                first = first if first is not None else time.perf_counter() - t0
                blocks += 1
                text += piece
        return {"first_text_ms": None if first is None else first * 1000, "blocks": blocks,
                "reply_ms": (time.perf_counter() - t0) * 1000, "chars": len(text)}


def p50_p95(values: list) -> tuple[float, float]:
    return percentile(values, 50), percentile(values, 95)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-1.5b", choices=["qwen2.5-1.5b", "qwen2.5-0.5b"],
                   help="the packaged GGUF both servers run (default: the voice service's, qwen2.5-1.5b)")
    p.add_argument("--audio", default="tests/speech", help="folder of WAVs (+ transcripts.tsv)")
    p.add_argument("--limit", type=int, default=0, help="only the first N clips (0: all)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads of each LM server (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="reply length, as the service's default")
    p.add_argument("--skip", choices=["voice", "direct"], default=None, help="leave out one measurement")
    p.add_argument("--fresh-prefix", action="store_true",
                   help="direct: no cached prefix to reuse (each system prompt starts with the request's number)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a service may take to load")
    p.add_argument("--json", default=str(RESULTS / "remote_lm.json"), help="results file")
    a = p.parse_args(argv)

    from engine.loading import packaged_gguf
    from voice.config import Config
    gguf = packaged_gguf(a.model)
    clips = clip_list(Path(a.audio), a.limit)
    questions = [ref for _, ref in clips if ref]
    system_prompt = Config().lm.system_prompt
    mach = machine()
    log_dir = RESULTS / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"remote LM: llama.cpp's server vs engine serve on {gguf.name}, {a.threads} thread(s); {len(clips)} clips "
          f"x {a.repeat} rounds; load average {mach.get('loadavg_start')}", flush=True)

    services: dict[str, Service] = {}
    lm_urls: dict[str, str] = {}
    voice_urls: dict[str, str] = {}
    tmp = Path(tempfile.mkdtemp(prefix="remote_lm-"))
    from engine.llamacpp import backend_env
    os.environ.update(backend_env())  # llama.cpp's server finds its CPU variant (engine/llamacpp.py)
    try:
        port = free_port()
        lm_urls["llamacpp"] = f"http://127.0.0.1:{port}/v1"
        services["llamacpp"] = Service(
            "remote_lm-llamacpp", [str(VENV_BIN / "python"), "-m", "llama_cpp.server", "--model", str(gguf),
                                   "--model_alias", a.model, "--host", "127.0.0.1", "--port", str(port),
                                   "--n_ctx", "2048", "--n_threads", str(a.threads), "--n_threads_batch",
                                   str(a.threads), "--interrupt_requests", "False"],
            log_dir, models_up(lm_urls["llamacpp"]))
        port = free_port()
        lm_urls["engine"] = f"http://127.0.0.1:{port}/v1"
        services["engine"] = Service(
            "remote_lm-engine", [str(VENV_BIN / "engine"), "serve", "--model", a.model, "--quantize", "gguf",
                                 "--mode", "ar", "--threads", str(a.threads), "--port", str(port)],
            log_dir, http_ok(f"http://127.0.0.1:{port}/healthz"))
        for name in SYSTEMS:
            print(f"  {name} LM server ready on {lm_urls[name]} ({services[name].wait_ready(a.start_timeout):.0f} s)",
                  flush=True)
        if a.skip != "voice":
            for name in SYSTEMS:
                port = free_port()
                config = voice_config(tmp / f"voice-{name}.toml", lm_urls[name], a.model, a.max_new_tokens)
                services[f"voice-{name}"] = Service(
                    f"remote_lm-voice-{name}", [str(VENV_BIN / "voice"), "serve", "--config", str(config),
                                                "--port", str(port)],
                    log_dir, http_ok(f"http://127.0.0.1:{port}/healthz"), unset=("VOICE_API_KEYS",))
                voice_urls[name] = f"ws://127.0.0.1:{port}/ws"
            for name in SYSTEMS:
                t = services[f"voice-{name}"].wait_ready(a.start_timeout)
                print(f"  voice serve with the LM on {name} ready on {voice_urls[name]} ({t:.0f} s)", flush=True)

        turns: dict[str, list] = {name: [] for name in SYSTEMS}
        replies: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
        warm, sent = " (warm-up: not counted)", 0
        for r in range(-1, a.repeat):  # round -1 warms both up
            order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
            print(f"round {r + 1}/{a.repeat}{warm if r < 0 else ''}: {', '.join(order)}", flush=True)
            for name in order:
                if a.skip != "direct":
                    for q in questions[:1] if r < 0 else questions:
                        sent += 1
                        prompt = f"Request {sent}. {system_prompt}" if a.fresh_prefix else system_prompt
                        one = asyncio.run(direct(lm_urls[name], a.model, prompt, q, a.max_new_tokens))
                        if r >= 0:
                            replies[name].append({**one, "question": q, "round": r})
                if a.skip != "voice":
                    session = asyncio.run(run_session(voice_urls[name], name, clips[:1] if r < 0 else clips,
                                                      round_no=r))
                    if r >= 0:
                        turns[name] += session

        summary: dict[str, dict] = {}
        for name in SYSTEMS:
            s: dict = {}
            if a.skip != "voice":
                ts = turns[name]
                s["voice_lm_first_block_ms"] = p50_p95([t.stages_ms.get("lm_first_block") for t in ts])
                s["voice_blocks"] = p50_p95([len(t.marks_ms.get("lm_blocks") or []) for t in ts if t.marks_ms])
                s["voice_v2v_ms"] = p50_p95([t.v2v_ms for t in ts])
                s["voice_turns"], s["voice_errors"] = len(ts), sum(1 for t in ts if t.error)
            if a.skip != "direct":
                rs = replies[name]
                s["direct_first_text_ms"] = p50_p95([x["first_text_ms"] for x in rs])
                s["direct_blocks"] = p50_p95([x["blocks"] for x in rs])
                s["direct_reply_ms"] = p50_p95([x["reply_ms"] for x in rs])
                s["direct_requests"] = len(rs)
            summary[name] = s

        print(f"\n{a.model}, {a.threads} thread(s), {mach['cpu_model']}; load average {loadavg()}")
        print(f"{'':28s} {'llamacpp p50 / p95':>22s} {'engine p50 / p95':>22s} {'ratio p50':>10s}")
        for key in summary["llamacpp"]:
            ours, theirs = summary["engine"][key], summary["llamacpp"][key]
            if isinstance(ours, tuple):
                print(f"{key:28s} {fmt(theirs[0]):>10s} / {fmt(theirs[1]):>9s} {fmt(ours[0]):>10s} / "
                      f"{fmt(ours[1]):>9s} {fmt(ratio(theirs[0], ours[0]), 2):>10s}")
            else:
                print(f"{key:28s} {theirs:>22} {ours:>22}")
        mach["loadavg_end"] = loadavg()
        write_json(a.json, {"command": " ".join(sys.argv), "model": a.model, "gguf": gguf.name, "threads": a.threads,
                            "fresh_prefix": a.fresh_prefix,
                            "machine": mach, "summary": summary,
                            "turns": {k: [asdict(t) for t in v] for k, v in turns.items()}, "direct": replies})
    finally:
        for svc in services.values():
            svc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
