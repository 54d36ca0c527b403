"""Capacity of one voice instance with the LM local and remote, and what the load balancer costs.

The topology of docs/SCALING.md on this one machine (tests/cluster.py starts every piece): a
throwaway PostgreSQL (tests/postgres.py) for every instance's call records; `engine serve` with
the voice service's model (the remote LM); `local`, a `voice serve` with the LM in-process, as
shipped; `remote1` and `remote2`, `voice serve` with `[lm] backend = "openai"` on that
`engine serve`; HAProxy with configs/haproxy.cfg in front of remote1 and remote2. Everything runs
on the same cores: the remote LM here takes CPU from the speech stages, where a real deployment
gives it a machine of its own, so its figures are a floor, not what a separate LM server costs.

capacity: for each N of --sessions, `voice bench`'s N-session run (voice.clients.bench: N sessions
  started 0.7 s apart, each playing the clips --repeat times in real time) against `local`, then
  against `remote1`, interleaved by N, so both see the same machine; "held" = the largest N whose
  voice-to-voice p95 is within the budget (configs/default.toml [budget]) together with every
  smaller N, as `voice bench --sessions`.
balancer: one session at a time playing the clips, straight to remote1 and through HAProxy
  (leastconn sends it to remote1 or remote2), in alternating order for --rounds rounds: voice-to-
  voice p50/p95 by route.

The load average is recorded before and after every run: the machine may be shared.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, REPO, loadavg, machine, write_json

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from cluster import HAProxy, engine_serve, free_port, voice_config, voice_serve  # noqa: E402
from postgres import PostgresServer  # noqa: E402

from voice.clients.bench import read_references, run_concurrent, run_session, sessions_held, summarise  # noqa: E402
from voice.config import Config  # noqa: E402

RATE = 16000


def sweep_entry(url: str, files: list[Path], refs: dict[str, str], n: int, budget_ms: float) -> dict:
    """N sessions at once against `url` (voice.clients.bench.run_concurrent), summarised."""
    before = loadavg()
    turns, refused = asyncio.run(run_concurrent(url, files, refs, RATE, None, n))
    entry = summarise(turns) | {"sessions": n, "refused": len(refused), "loadavg_before": before,
                                "loadavg_after": loadavg(), "per_turn": [t.__dict__ for t in turns]}
    entry["within_budget"] = entry["v2v_ms_p95"] is not None and entry["v2v_ms_p95"] <= budget_ms \
        and entry["answered"] == entry["turns"]
    return entry


def one_session(url: str, files: list[Path], refs: dict[str, str]) -> list:
    return asyncio.run(run_session(url, files, refs, RATE, None, log=lambda *_: None))


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="capacity,balancer", help="capacity, balancer or both (default)")
    p.add_argument("--model", default=Config().lm.model, help="the LM, local and on engine serve (default: the "
                                                               "voice service's)")
    p.add_argument("--turn-policy", default="fixed",
                   help="[turn] policy of every instance (default fixed, the VAD's hangover: with a remote LM the "
                        "LM's end-of-turn signal is missing, so the other policies would answer at other moments "
                        "local and remote, not only from another LM)")
    p.add_argument("--lm-mode", default="ar", choices=["ar", "diffusion"],
                   help="[lm] mode of every instance (default ar: the voice model runs on llama.cpp's kernels, AR "
                        "only, where engine serve refuses diffusion and the local engine decodes AR anyway)")
    p.add_argument("--sessions", default="1,2,4", help="capacity: simultaneous sessions to try (default 1,2,4)")
    p.add_argument("--repeat", type=int, default=2, help="capacity: each session plays the clips this often")
    p.add_argument("--rounds", type=int, default=2, help="balancer: rounds of (direct, through HAProxy)")
    p.add_argument("--audio", default=str(REPO / "tests" / "speech"), help="folder of WAVs + transcripts.tsv")
    p.add_argument("--json", default=str(RESULTS / "scale_out.json"), help="results file")
    a = p.parse_args(argv)
    parts = {part.strip() for part in a.parts.split(",") if part.strip()}
    if not parts or parts - {"capacity", "balancer"}:
        p.error(f"--parts: capacity and/or balancer, not {a.parts!r}")
    sessions = [int(n) for n in a.sessions.split(",")]
    audio = Path(a.audio)
    files, refs = sorted(audio.glob("*.wav")), read_references(audio)
    budget_ms = Config().budget.voice_to_voice
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or None
    result: dict = {"machine": machine(), "commit": commit, "model": a.model, "lm_mode": a.lm_mode,
                    "turn_policy": a.turn_policy,
                    "budget_ms": budget_ms,
                    "clips": [f.name for f in files], "command": " ".join(sys.argv)}
    print(f"scale-out bench, {a.model}, {len(files)} clips, budget {budget_ms:.0f} ms, load average "
          f"{result['machine'].get('loadavg_start')}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="scale_out-"))
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    children = []
    with PostgresServer(durable=True) as pg:
        try:
            engine_port = free_port()
            engine = engine_serve(engine_port, logs, a.model, threads=Config().lm.threads)
            children.append(engine)
            records = {"url": pg.create_database()}
            turn = {"policy": a.turn_policy}
            lm = {"model": a.model, "mode": a.lm_mode}
            local_cfg = voice_config(work / "local.toml", {"turn": turn, "lm": lm, "records": records})
            remote_cfg = voice_config(work / "remote.toml", {"turn": turn, "lm": lm | {
                "backend": "openai", "url": f"http://127.0.0.1:{engine_port}/v1"}, "records": records})
            ports = {"local": free_port(), "remote1": free_port(), "remote2": free_port()}
            voices = {"remote1": voice_serve(ports["remote1"], remote_cfg, logs)}
            if "capacity" in parts:
                voices["local"] = voice_serve(ports["local"], local_cfg, logs)
            if "balancer" in parts:
                voices["remote2"] = voice_serve(ports["remote2"], remote_cfg, logs)
            children += voices.values()
            t0 = time.monotonic()
            engine.wait_ready(900)
            for voice in voices.values():
                voice.wait_ready(900)
            urls = {name: f"ws://127.0.0.1:{ports[name]}/ws" for name in voices}
            if "balancer" in parts:
                lb = HAProxy(free_port(), (ports["remote1"], ports["remote2"]), logs)
                children.append(lb)
                lb.wait_ready(30)
                urls["haproxy"] = lb.ws + "/ws"
            print(f"ready in {time.monotonic() - t0:.0f} s: {', '.join(urls)}", flush=True)
            for name in ("local", "remote1", "remote2"):  # a first turn (caches, lazy loads), not counted
                if name in voices:
                    one_session(urls[name], files[:1], refs)

            if "capacity" in parts:
                sweeps: dict[str, list[dict]] = {"local": [], "remote": []}
                for n in sessions:
                    for system, name in (("local", "local"), ("remote", "remote1")):
                        entry = sweep_entry(urls[name], files * a.repeat, refs, n, budget_ms)
                        sweeps[system].append(entry)
                        print(f"  {system:6s} {n} sessions: v2v p50 {fmt_ms(entry['v2v_ms_p50'])} ms, p95 "
                              f"{fmt_ms(entry['v2v_ms_p95'])} ms, {entry['answered']}/{entry['turns']} answered, "
                              f"{'within' if entry['within_budget'] else 'OVER'} budget; load average "
                              f"{entry['loadavg_before']} -> {entry['loadavg_after']}", flush=True)
                result["capacity"] = {system: {"sweep": sweep, "sessions_held": sessions_held(sweep)}
                                      for system, sweep in sweeps.items()}
                print("sessions held: " + ", ".join(f"{system} {v['sessions_held']}"
                                                    for system, v in result["capacity"].items()), flush=True)

            if "balancer" in parts:
                turns: dict[str, list] = {"direct": [], "haproxy": []}
                rounds = []
                for r in range(a.rounds):
                    order = ["direct", "haproxy"] if r % 2 == 0 else ["haproxy", "direct"]
                    for route in order:
                        before = loadavg()
                        got = one_session(urls["remote1" if route == "direct" else "haproxy"], files, refs)
                        turns[route] += got
                        rounds.append({"round": r, "route": route, "loadavg_before": before,
                                       "loadavg_after": loadavg(), "per_turn": [t.__dict__ for t in got]})
                result["balancer"] = {"routes": {route: summarise(ts) for route, ts in turns.items()},
                                      "rounds": rounds}
                for route, summary in result["balancer"]["routes"].items():
                    print(f"  {route:8s} v2v p50 {fmt_ms(summary['v2v_ms_p50'])} ms, p95 "
                          f"{fmt_ms(summary['v2v_ms_p95'])} ms over {summary['answered']}/{summary['turns']} "
                          "turns", flush=True)
        finally:
            for child in reversed(children):
                child.close()
    result["machine"]["loadavg_end"] = loadavg()
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
