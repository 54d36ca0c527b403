"""How many spoken questions any choice among what Whisper heard could get answered right: the upper
bound for every rescoring or N-best scheme on the packaged ASR models (issue 42's 90% goal).

Reads `bench/asr_nbest.py`'s JSON (tiny.en's N best hypotheses of each clip). `--questions` writes
every distinct hypothesis as `engine eval --answers` questions; given that run's JSON (`--answers`),
prints per configuration: the shipped transcript answered right, and the clips where *some*
hypothesis is (an oracle choosing among the N, and among the first 3). `--also` adds another ASR's
best transcripts (`voice spoken-eval --asr-only --as-questions DIR`'s VARIANT.jsonl) with their own
`engine eval` JSON, so the oracle may also pick that model's transcript.

    .venv/bin/python bench/asr_oracle.py --nbest bench/results/asr_nbest_amx.json --questions /tmp/hyps.jsonl
    .venv/bin/engine eval --model qwen2.5-1.5b --quantize gguf --modes ar --answers /tmp/hyps.jsonl \\
        --max-new-tokens 48 --json /tmp/hyps_answers.json
    .venv/bin/python bench/asr_oracle.py --nbest bench/results/asr_nbest_amx.json --answers /tmp/hyps_answers.json \\
        --also /tmp/q/base.jsonl=/tmp/base_answers.json --json bench/results/asr_oracle_amx.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from common import write_json


def answered(engine_eval: Path) -> dict[str, bool]:
    """An `engine eval --answers` JSON's verdicts, by the question's text."""
    rows = json.loads(engine_eval.read_text())["per_mode"]["ar"]
    return {r["prompt"].strip(): bool(r["right"]) for r in rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nbest", type=Path, required=True, help="bench/asr_nbest.py's JSON")
    p.add_argument("--questions", type=Path, help="write every distinct hypothesis here as questions")
    p.add_argument("--answers", type=Path, help="`engine eval --answers` JSON on --questions' file")
    p.add_argument("--also", action="append", default=[], metavar="QUESTIONS=ANSWERS",
                   help="another ASR's transcripts (spoken-eval --as-questions) and engine eval's JSON on them")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    clips = json.loads(args.nbest.read_text())["clips"]
    if args.questions:
        texts = {h["text"].strip(): c["answer"] for c in clips for h in c["hypotheses"] if h["text"].strip()}
        texts.update({c["shipped"].strip(): c["answer"] for c in clips})
        args.questions.write_text("".join(json.dumps({"prompt": t, "answer": a}) + "\n" for t, a in texts.items()))
        print(f"wrote {len(texts)} distinct transcripts to {args.questions}")
        return
    assert args.answers, "--answers (engine eval's JSON on the --questions file), or --questions"
    right = answered(args.answers)
    others: dict[tuple[str, str], bool] = {}  # (question, config) -> another ASR's transcript answered right
    for pair in args.also:
        questions, verdicts = (Path(x) for x in pair.split("=", 1))
        by_text = answered(verdicts)
        for line in questions.read_text().splitlines():
            q = json.loads(line)
            others[q["question"], q["config"]] = others.get((q["question"], q["config"]), False) \
                or by_text[q["prompt"].strip()]
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    unreachable = []  # clips no transcript of theirs gets answered right
    for c in clips:
        hyps = [right[h["text"].strip()] for h in c["hypotheses"] if h["text"].strip()]
        other = others.get((c["question"], c["config"]), False)
        n = counts[c["config"]]
        n["clips"] += 1
        n["shipped_right"] += right[c["shipped"].strip()]
        n["oracle_top3"] += any(hyps[:3])
        n[f"oracle_top{len(c['hypotheses'])}"] += any(hyps)
        if args.also:
            n["oracle_all_with_also"] += any(hyps) or other
        if not (any(hyps) or other):
            unreachable.append({k: c[k] for k in ("config", "voice", "question", "shipped")})
    for config, n in sorted(counts.items()):
        print(f"{config:5} " + ", ".join(f"{k} {v}" for k, v in n.items()))
    if args.json:
        write_json(args.json, {"nbest": str(args.nbest), "also": args.also, "by_config": counts,
                               "unreachable": unreachable})


if __name__ == "__main__":
    main()
