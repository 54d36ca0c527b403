"""PNGs from bench/results/voice_loop.json (matplotlib lives in bench/.venv-pipecat, not our .venv).

    bench/.venv-pipecat/bin/python bench/plots.py [--voice-loop bench/results/voice_loop.json]

  v2v_cdf.png  empirical CDF of voice-to-voice latency per system (p50/p95 in the legend)
  stages.png   our service's latency reports, per stage (endpoint, asr, lm_first_block,
               tts_first_audio, send): left, the mean of each stage stacked per system (the stack
               is the mean voice-to-voice of the turns that reached audio, as the server measured
               it); right, the same stack for every turn of `ours`
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, percentile  # noqa: E402

STAGES = ("endpoint", "asr", "lm_first_block", "tts_first_audio", "send")
COLORS = {"endpoint": "#8da0cb", "asr": "#66c2a5", "lm_first_block": "#fc8d62", "tts_first_audio": "#e78ac3",
          "send": "#a6d854"}
SYSTEM_COLORS = {"ours": "#1b9e77", "ours_ar": "#7570b3", "pipecat": "#d95f02", "pipecat_ar": "#e6ab02"}


def title_suffix(data: dict) -> str:
    m = data.get("machine", {})
    opts = data.get("options", {})
    return (f"{m.get('cpu_model', '?')}, {m.get('cores', '?')} cores; {len(data.get('clips', []))} clips x "
            f"{opts.get('repeat', '?')} rounds; our LM {opts.get('ours_lm', '?')}")


def v2v_cdf(data: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in data["systems"]:
        values = sorted(t["v2v_ms"] for t in data["turns"] if t["system"] == name and t["v2v_ms"] is not None)
        if not values:
            continue
        n = len(values)
        ys = [(i + 1) / n for i in range(n)]
        label = f"{name}: p50 {percentile(values, 50):.0f} ms, p95 {percentile(values, 95):.0f} ms (n={n})"
        ax.step([values[0]] + values, [0] + ys, where="post", label=label, color=SYSTEM_COLORS.get(name), lw=2)
    ax.axhline(0.5, color="grey", lw=0.5, ls=":")
    ax.axhline(0.95, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("voice-to-voice latency (ms): first reply audio frame - end of speech")
    ax.set_ylabel("fraction of turns")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    ax.set_title(f"Voice-to-voice latency CDF\n{title_suffix(data)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")


def stage_turns(data: dict, name: str) -> list[dict]:
    return [t for t in data["turns"] if t["system"] == name and all(s in t["stages_ms"] for s in STAGES)]


def stages(data: dict, out: Path) -> None:
    systems = [s for s in data["systems"] if stage_turns(data, s)]
    if not systems:
        print("no latency reports in the results (our service not run?): stages.png not drawn")
        return
    ours = "ours" if "ours" in systems else systems[0]
    per_turn = stage_turns(data, ours)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [1, 2.2]})
    for i, name in enumerate(systems):
        turns = stage_turns(data, name)
        bottom = 0.0
        for stage in STAGES:
            mean = sum(t["stages_ms"][stage] for t in turns) / len(turns)
            left.bar(i, mean, bottom=bottom, color=COLORS[stage], width=0.6)
            if mean > 60:
                left.text(i, bottom + mean / 2, f"{mean:.0f}", ha="center", va="center", fontsize=8)
            bottom += mean
        left.text(i, bottom, f"{bottom:.0f} ms", ha="center", va="bottom", fontsize=9)
    left.set_xticks(range(len(systems)), [f"{s}\n(n={len(stage_turns(data, s))})" for s in systems])
    left.set_ylabel("ms (mean per stage; the stack = mean voice-to-voice)")
    left.set_title("per stage, mean over turns", fontsize=10)
    left.set_ylim(0, left.get_ylim()[1] * 1.08)
    left.grid(axis="y", alpha=0.3)
    for j, t in enumerate(per_turn):
        bottom = 0.0
        for stage in STAGES:
            right.bar(j, t["stages_ms"][stage], bottom=bottom, color=COLORS[stage], width=0.8)
            bottom += t["stages_ms"][stage]
    right.set_xticks(range(len(per_turn)), [f"{t['file'].removesuffix('.wav')}\nr{t['round'] + 1}" for t in per_turn],
                     fontsize=7, rotation=90 if len(per_turn) > 20 else 0)
    right.set_ylabel("ms")
    right.set_title(f"{ours}: every turn (clip, round)", fontsize=10)
    right.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Our service's latency reports by stage\n{title_suffix(data)}", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[s]) for s in STAGES]
    fig.legend(handles, STAGES, loc="lower center", ncol=len(STAGES), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--voice-loop", default=str(RESULTS / "voice_loop.json"), help="bench/voice_loop.py's JSON")
    p.add_argument("--out-dir", default="", help="where the PNGs go (default: beside the JSON)")
    a = p.parse_args(argv)
    path = Path(a.voice_loop)
    data = json.loads(path.read_text())
    out_dir = Path(a.out_dir) if a.out_dir else path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    v2v_cdf(data, out_dir / "v2v_cdf.png")
    stages(data, out_dir / "stages.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
