"""Call records: SQLite against PostgreSQL on this machine, through `voice.service.records.Records`.

Two figures per database, measured in rounds that alternate the databases (time is noisy here):

* commit latency: one session awaiting each turn's write in turn (what a `reply_done` waits for):
  p50 / p95 / max ms over --turns writes;
* throughput: --sessions sessions each awaiting its writes as fast as they can (the writer then
  commits several turns per transaction): turns committed per second.

Both durable as shipped: SQLite in WAL mode with `synchronous=FULL`; PostgreSQL a throwaway server
(tests/postgres.py, Debian's `postgresql`) with its defaults (fsync on, `synchronous_commit=on`),
over TCP on loopback, on the same disk as the SQLite file.

    .venv/bin/python bench/records_pg.py --rounds 3 --turns 300 --sessions 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from postgres import PostgresServer  # noqa: E402  (tests/postgres.py)

from voice.service import records as rec  # noqa: E402


def turn(uid: str, n: int) -> list:
    reply = "Sure, the eight of spades is a fine card to start with, and so on. " * 2
    return rec.turn_done(uid, n, time.time() - 2, time.time(), "ok", "pick a card for me please", reply, reply,
                         False, False, {"voice_to_voice_ms": 812.5, "stages_ms": {"asr": 120.0, "lm": 300.0}}, [])


async def latency(records: rec.Records, turns: int, tag: str) -> list[float]:
    ms = []
    for n in range(1, turns + 1):
        t0 = time.perf_counter()
        assert await records.write(turn(f"lat-{tag}", n))
        ms.append((time.perf_counter() - t0) * 1000)
    return ms


async def throughput(records: rec.Records, sessions: int, seconds: float, tag: str) -> float:
    done = 0
    stop = time.monotonic() + seconds

    async def session(s: int) -> None:
        nonlocal done
        n = 0
        while time.monotonic() < stop:
            n += 1
            assert await records.write(turn(f"tp-{tag}-{s}", n))
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(session(s) for s in range(sessions)))
    return done / (time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turns", type=int, default=300, help="sequential writes per round (commit latency)")
    ap.add_argument("--sessions", type=int, default=16, help="concurrent sessions (throughput)")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each throughput run")
    ap.add_argument("--json", default="", help="also write the figures here")
    a = ap.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="records-bench-"))
    results: dict[str, dict[str, list]] = {name: {"latency_ms": [], "turns_per_s": []}
                                          for name in ("sqlite", "postgresql")}
    with PostgresServer(durable=True) as pg:
        where = {"sqlite": str(folder / "records.sqlite3"), "postgresql": pg.create_database("bench")}
        writers = {name: rec.Records(db, queue_size=1000, timeout_s=30) for name, db in where.items()}
        try:
            for r in range(a.rounds):
                order = list(writers) if r % 2 == 0 else list(reversed(writers))
                for name in order:
                    results[name]["latency_ms"] += asyncio.run(latency(writers[name], a.turns, str(r)))
                    results[name]["turns_per_s"].append(
                        asyncio.run(throughput(writers[name], a.sessions, a.seconds, str(r))))
        finally:
            for w in writers.values():
                w.close()
            shutil.rmtree(folder, ignore_errors=True)
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}; {a.rounds} rounds, alternating")
    print(f"{'database':<12}{'p50 ms':>9}{'p95 ms':>9}{'max ms':>9}   turns/s with {a.sessions} sessions (per round)")
    summary = {}
    for name, res in results.items():
        lat, tps = res["latency_ms"], res["turns_per_s"]
        summary[name] = {"p50_ms": statistics.median(lat), "p95_ms": pct(lat, 0.95), "max_ms": max(lat),
                         "turns_per_s": tps}
        print(f"{name:<12}{summary[name]['p50_ms']:>9.2f}{summary[name]['p95_ms']:>9.2f}{max(lat):>9.1f}   "
              + "  ".join(f"{t:,.0f}" for t in tps))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
