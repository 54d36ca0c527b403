"""Helpers shared by the bench/ scripts. Standard library only: every benchmark venv imports it."""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import socket
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
MAIN_PYTHON = REPO / ".venv" / "bin" / "python"
LLAMACPP_PYTHON = BENCH_DIR / ".venv-llamacpp" / "bin" / "python"
PIPECAT_PYTHON = BENCH_DIR / ".venv-pipecat" / "bin" / "python"


def free_port() -> int:
    """A TCP port free on loopback right now (for a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of the finite values; nan if none (as engine.evals.bench)."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ratio(a, b) -> float:
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return float("nan")
    return a / b


def fmt(x, digits: int = 1) -> str:
    return "-" if x is None or not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:.{digits}f}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    info = {"platform": platform.platform(), "cpu_model": cpu_model(), "cores": os.cpu_count(),
            "python": platform.python_version()}
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    if hasattr(os, "getloadavg"):
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    try:
        mem = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()
        info["mem_total_gib"] = round(int(mem[1]) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    return info


def loadavg() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def peak_rss_mb() -> float:
    """This process's peak resident set size (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def finite_or_none(obj):
    """Strict JSON has no NaN/Infinity: those become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def write_json(path, result: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite_or_none(result), indent=2, ensure_ascii=False, allow_nan=False) + "\n")
    print(f"wrote {path}", flush=True)


LATEST_KEYS = ("v2v_ms_p50_ours", "v2v_ms_p50_ours_ar", "v2v_ms_p50_pipecat", "v2v_ratio_vs_pipecat", "ttfb_ms_ours",
               "ttfb_ms_llamacpp", "sessions_within_budget_before", "sessions_within_budget_after", "machine")
FILLED_BY_OTHERS = ("sessions_within_budget_before", "sessions_within_budget_after")


def update_latest(values: dict, path=RESULTS / "latest.json") -> None:
    """Merge `values` into bench/results/latest.json: every key is present (null until measured); a
    None in `values` (not measured this run) keeps what is there; the keys others fill are never touched."""
    path = Path(path)
    current = {}
    if path.exists():
        try:
            current = json.loads(path.read_text())
        except ValueError:
            current = {}
    for key in LATEST_KEYS:
        current.setdefault(key, None)
    current.update({k: v for k, v in finite_or_none(values).items() if v is not None and k not in FILLED_BY_OTHERS})
    write_json(path, current)


def log(*args) -> None:
    print(*args, flush=True)


def die(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)
