"""Voice-to-voice latency, side by side: our service (diffusion and AR) vs a Pipecat pipeline.

    .venv/bin/python bench/voice_loop.py --repeat 5

One command, one run. It starts, one after the other (so model loads do not compete):

  engine     `engine serve` (our LM behind the OpenAI API; only if pipecat or --ours-lm serve)
  ours       `voice serve` (diffusion LM), the product as configured by configs/default.toml
  ours_ar    `voice serve --lm-mode ar` (same weights, autoregressive decoding)
  pipecat    bench/pipecat_pipeline.py in bench/.venv-pipecat (LLM = that engine serve, diffusion)
  pipecat_ar the same pipeline asking engine serve for AR decoding (not in the default --systems)

then drives each with the same clips (--audio, default tests/speech) through bench/drive.py,
the same client for all: real-time streaming, voice-to-voice = first reply audio frame - end of
speech in the file. First one warm-up session per system (first clip, not counted), then
--repeat rounds; in each round every system gets one session (a fresh conversation) playing every
clip once, and the order of the systems rotates from round to round so drift in machine load is
spread over all of them. Only one system is being talked to at a time; the others sit idle.

Threads: --threads (default 1) torch threads for our LM wherever it runs (lm.threads for the
in-process engine, `engine serve --threads`). faster-whisper and Piper keep their defaults in
both systems (CTranslate2 and onnxruntime choose), which are the same code paths in both.
--model and --quantize (default: the voice default, qwen2.5-1.5b, quantize auto, as shipped: the
packaged GGUF on llama.cpp's kernels where PyTorch has no AVX-512) apply to our LM wherever it
runs, Pipecat's engine serve included.

--ours-lm local (default) runs our service as shipped: the engine in-process, the conversation's
KV cache kept between turns. --ours-lm serve points our service at the same `engine serve` as
Pipecat (OpenAI API, stateless, whole prompt prefilled each turn), for an LM path identical to
Pipecat's.

Prints p50/p95 per system and the ratios; writes --json (bench/results/voice_loop.json) and
updates bench/results/latest.json; draws the PNGs with bench/plots.py (pipecat venv) unless --no-plots.
Service logs go to bench/results/logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (BENCH_DIR, PIPECAT_PYTHON, REPO, RESULTS, cpu_model, fmt, free_port, loadavg,  # noqa: E402
                    machine, ratio, update_latest, write_json)
from drive import clip_list, run_session, summarise  # noqa: E402

sys.path.insert(0, str(REPO))
from voice.config import LmConfig  # noqa: E402  (the shipped LM: what this benchmark measures by default)

SYSTEMS = ("ours", "ours_ar", "pipecat", "pipecat_ar")
DEFAULT_SYSTEMS = ("ours", "ours_ar", "pipecat")
NO_AUTH = ("VOICE_API_KEYS",)  # our services run on loopback without keys (auth off), like the Pipecat one
VENV_BIN = REPO / ".venv" / "bin"


class Service:
    """A child process we started, with its log file and a readiness check."""

    def __init__(self, name: str, args: list[str], log_dir: Path, ready, unset: tuple[str, ...] = ()):
        self.name, self.args, self.ready = name, args, ready
        self.log_path = log_dir / f"voice_loop-{name}.log"
        self.log = self.log_path.open("w")
        env = {k: v for k, v in os.environ.items() if k not in unset}
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env)

    def wait_ready(self, timeout_s: float) -> float:
        t = time.perf_counter()
        while time.perf_counter() - t < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}; see {self.log_path}:\n"
                                   + self.log_path.read_text()[-2000:])
            if self.ready(self):
                return time.perf_counter() - t
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def http_ok(url: str):
    def check(_svc) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                body = json.loads(r.read() or b"{}")
                return r.status == 200 and body.get("status") == "ok"
        except (OSError, ValueError):
            return False
    return check


def log_says(text: str):
    def check(svc) -> bool:
        svc.log.flush()
        return text in svc.log_path.read_text(errors="replace")
    return check


def our_config(a, engine_url: str | None, path: Path) -> Path:
    """A TOML that differs from the defaults (configs/default.toml) only where this benchmark needs it."""
    import dataclasses

    from voice.config import Config
    lines = ["[lm]", f"threads = {a.threads}", f'model = "{a.model}"', f'quantize = "{a.quantize}"']
    if a.ours_lm == "serve":
        lines = [line for line in lines if not line.startswith("model")]
        lines += ['backend = "openai"', f'url = "{engine_url}"', f'model = "{a.model}"']
    if "records" in {f.name for f in dataclasses.fields(Config)}:  # keep bench turns out of runs/records.sqlite3
        lines += ["[records]", f'path = "{path.with_suffix(".sqlite3")}"']
    path.write_text("\n".join(lines) + "\n")
    return path


def engines_ttfb() -> dict:
    """TTFB keys for latest.json from bench/results/engines.json, when it exists."""
    path = RESULTS / "engines.json"
    out = {"ttfb_ms_ours": None, "ttfb_ms_llamacpp": None}
    if path.exists():
        try:
            summary = json.loads(path.read_text())["summary"]
            out["ttfb_ms_ours"] = (summary.get("ours_diffusion") or {}).get("ttfb_ms_p50")
            out["ttfb_ms_llamacpp"] = (summary.get("llamacpp") or {}).get("ttfb_ms_p50")
        except (ValueError, KeyError):
            pass
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma list of {', '.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})")
    p.add_argument("--audio", default=str(REPO / "tests" / "speech"), help="folder of WAVs")
    p.add_argument("--limit", type=int, default=0, help="only the first N clips (0: all)")
    p.add_argument("--repeat", type=int, default=3, help="rounds; each plays every clip once per system (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for our LM (in-process or engine serve)")
    p.add_argument("--model", default=LmConfig.model, help=f"our LM (default {LmConfig.model}, the voice default)")
    p.add_argument("--quantize", choices=["auto", "gguf", "none", "fp16", "int8"], default=LmConfig.quantize,
                   help=f"our LM's weights, in our service and in the engine serve Pipecat uses (default "
                        f"{LmConfig.quantize}, as shipped)")
    p.add_argument("--ours-lm", choices=["local", "serve"], default="local",
                   help="our service's LM: in-process engine (as shipped) or the shared engine serve")
    p.add_argument("--pipecat-turn", choices=["smart", "timeout"], default="smart",
                   help="Pipecat end of turn: smart (its default, smart-turn v3) or timeout (VAD + 0.2 s)")
    p.add_argument("--pipecat-whisper-beam", type=int, default=None,
                   help="Pipecat Whisper beam size (default: ours, asr.beam_size; 0 = faster-whisper's 5)")
    p.add_argument("--gap", type=float, default=2.0, help="drive.py: quiet seconds after playback that end a turn")
    p.add_argument("--reply-timeout", type=float, default=20.0, help="drive.py: seconds without reply audio")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up session per system")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a service may take to load")
    p.add_argument("--pipecat-python", default=str(PIPECAT_PYTHON), help="interpreter with pipecat (bench/setup.sh)")
    p.add_argument("--json", default=str(RESULTS / "voice_loop.json"), help="results file")
    p.add_argument("--no-latest", action="store_true", help="do not update bench/results/latest.json")
    p.add_argument("--no-plots", action="store_true", help="do not run bench/plots.py afterwards")
    a = p.parse_args(argv)

    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        raise SystemExit(f"unknown system(s) {bad}; choose from {SYSTEMS}")
    pipecats = [s for s in systems if s.startswith("pipecat")]
    if pipecats and not Path(a.pipecat_python).exists():
        raise SystemExit(f"{a.pipecat_python} is missing: run bench/setup.sh pipecat (or leave out pipecat)")
    clips = clip_list(Path(a.audio), a.limit)
    mach = machine()
    log_dir = RESULTS / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"voice loop: {', '.join(systems)}; {len(clips)} clips x {a.repeat} rounds from {a.audio}; "
          f"LM threads {a.threads}; our LM {a.ours_lm}; load average {mach.get('loadavg_start')}", flush=True)

    services: dict[str, Service] = {}
    urls: dict[str, str] = {}
    info: dict[str, dict] = {}
    tmp = Path(tempfile.mkdtemp(prefix="voice_loop-"))
    try:
        engine_url = None
        if pipecats or a.ours_lm == "serve":
            port = free_port()
            engine_url = f"http://127.0.0.1:{port}/v1"
            services["engine"] = Service("engine", [str(VENV_BIN / "engine"), "serve", "--port", str(port),
                                                    "--model", a.model, "--threads", str(a.threads),
                                                    "--quantize", a.quantize], log_dir,
                                         http_ok(f"http://127.0.0.1:{port}/healthz"))
            t = services["engine"].wait_ready(a.start_timeout)
            print(f"  engine serve ready on {engine_url} ({t:.0f} s)", flush=True)
        for name, mode in (("ours", "diffusion"), ("ours_ar", "ar")):
            if name not in systems:
                continue
            config = our_config(a, engine_url, tmp / f"{name}.toml")
            port = free_port()
            services[name] = Service(name, [str(VENV_BIN / "voice"), "serve", "--config", str(config), "--port",
                                            str(port), "--lm-mode", mode], log_dir,
                                     http_ok(f"http://127.0.0.1:{port}/healthz"), unset=NO_AUTH)
            t = services[name].wait_ready(a.start_timeout)
            urls[name] = f"ws://127.0.0.1:{port}/ws"
            info[name] = {"url": urls[name], "lm": a.ours_lm, "lm_mode": mode, "config": config.read_text(),
                          "command": " ".join(services[name].args)}
            print(f"  {name} ready on {urls[name]} ({t:.0f} s)", flush=True)
        for name in pipecats:
            mode = "ar" if name == "pipecat_ar" else "diffusion"
            port = free_port()
            args = [a.pipecat_python, str(BENCH_DIR / "pipecat_pipeline.py"), "--port", str(port), "--llm-url",
                    engine_url, "--llm-model", a.model, "--lm-mode", mode, "--turn", a.pipecat_turn]
            if a.pipecat_whisper_beam is not None:
                args += ["--whisper-beam-size", str(a.pipecat_whisper_beam)]
            services[name] = Service(name, args, log_dir, log_says("pipecat pipeline ready"))
            t = services[name].wait_ready(a.start_timeout)
            urls[name] = f"ws://127.0.0.1:{port}"
            version = subprocess.run([a.pipecat_python, "-c", "import importlib.metadata as m; "
                                      "print(m.version('pipecat-ai'))"], capture_output=True, text=True).stdout.strip()
            info[name] = {"url": urls[name], "pipecat_ai": version, "turn": a.pipecat_turn, "llm": engine_url,
                          "lm_mode": mode, "command": " ".join(args)}
            print(f"  {name} (pipecat-ai {version}) ready on {urls[name]} ({t:.0f} s)", flush=True)

        def session(name: str, clip_set, round_no: int):
            return asyncio.run(run_session(urls[name], name, clip_set, gap_s=a.gap, reply_timeout_s=a.reply_timeout,
                                           round_no=round_no, log=lambda m: print(m, flush=True)))

        warmup = []
        if not a.no_warmup:
            print("warm-up (not counted):", flush=True)
            for name in systems:
                warmup += session(name, clips[:1], -1)
        turns = []
        for r in range(a.repeat):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            print(f"round {r + 1}/{a.repeat} ({' -> '.join(order)}), load average {loadavg()}:", flush=True)
            for name in order:
                turns += session(name, clips, r)
    finally:
        for svc in reversed(list(services.values())):
            svc.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    mach["loadavg_end"] = loadavg()
    summary = {name: summarise([t for t in turns if t.system == name]) for name in systems}
    p50 = {name: summary[name]["v2v_ms_p50"] for name in systems}
    ratios = {}
    for ours, theirs in (("ours", "pipecat"), ("ours_ar", "pipecat"), ("ours_ar", "pipecat_ar")):
        if ours in systems and theirs in systems:
            ratios[f"{ours}_vs_{theirs}_p50"] = ratio(p50[ours], p50[theirs])
            ratios[f"{ours}_vs_{theirs}_p95"] = ratio(summary[ours]["v2v_ms_p95"], summary[theirs]["v2v_ms_p95"])
    if "ours" in systems and "ours_ar" in systems:
        ratios["ours_vs_ours_ar_p50"] = ratio(p50["ours"], p50["ours_ar"])

    print(f"\n{'voice-to-voice (ms)':22}{'p50':>8}{'p95':>8}{'mean':>8}{'answered':>10}{'errors':>8}")
    for name in systems:
        s = summary[name]
        print(f"{name:22}{fmt(s['v2v_ms_p50'], 0):>8}{fmt(s['v2v_ms_p95'], 0):>8}{fmt(s['v2v_ms_mean'], 0):>8}"
              f"{s['answered']:>6}/{s['turns']:<3}{s['errors']:>8}")
    for key, value in ratios.items():
        print(f"  {key:28} {fmt(value, 2)}")
    for name in systems:
        if summary[name]["stages_ms_p50"]:
            stages = "  ".join(f"{k} {fmt(v, 0)}" for k, v in summary[name]["stages_ms_p50"].items())
            print(f"  {name} stage p50 (ms): {stages}")
    print(f"(same clips for all; {a.repeat} round(s); load average {mach.get('loadavg_start')} -> "
          f"{mach.get('loadavg_end')})", flush=True)

    result = {"benchmark": "voice_loop", "command": " ".join(sys.argv), "machine": mach,
              "options": {k: v for k, v in vars(a).items()}, "clips": [str(c) for c, _ in clips],
              "systems": systems, "system_info": info, "summary": summary, "ratios": ratios,
              "turns": [asdict(t) for t in turns], "warmup_turns": [asdict(t) for t in warmup]}
    write_json(a.json, result)
    if not a.no_latest:
        latest = {"v2v_ms_p50_ours": p50.get("ours"), "v2v_ms_p50_ours_ar": p50.get("ours_ar"),
                  "v2v_ms_p50_pipecat": p50.get("pipecat"),
                  "v2v_ratio_vs_pipecat": ratios.get("ours_vs_pipecat_p50"),
                  **engines_ttfb(),
                  "machine": {"platform": mach["platform"], "cpu_model": cpu_model(), "cores": mach["cores"]}}
        update_latest(latest)
    if not a.no_plots:
        python = a.pipecat_python if Path(a.pipecat_python).exists() else sys.executable
        subprocess.run([python, str(BENCH_DIR / "plots.py"), "--voice-loop", a.json], cwd=REPO, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
