"""Training data for the diffusion adaptation: chitchat prompts and the AR teacher's own replies.

Self-distillation keeps the teacher's style and makes targets easier to predict in parallel.
The split is by conversation (a stable hash of its id), so held-out prompts never leak in.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

from engine.decode import generate_ar_batch
from engine.loading import LoadedModel

VOICE_SYSTEM_PROMPT = ("You are a friendly voice assistant. Answer in one or two short spoken sentences, "
                       "without lists or markdown.")


def chitchat_prompts(split: str, heldout_percent: int = 5) -> list[str]:
    """Opening user turns of chitchat conversations (3-30 words), for `train` or `heldout`."""
    import chitchat_dataset
    prompts = []
    for conv_id, conv in chitchat_dataset.Dataset().items():
        in_heldout = int(hashlib.sha1(conv_id.encode()).hexdigest(), 16) % 100 < heldout_percent
        if in_heldout != (split == "heldout"):
            continue
        for turn in conv["messages"][:4]:
            text = " ".join(u["text"].strip() for u in turn).strip()
            if 3 <= len(text.split()) <= 30:
                prompts.append(text)
    return prompts


def chat(prompt: str, system: str = VOICE_SYSTEM_PROMPT) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]


def distill(teacher: LoadedModel, prompts: list[str], out: Path, max_new_tokens: int = 48,
            batch_size: int = 32, log=print) -> None:
    """Append the teacher's greedy replies to `out` (JSONL); resumes where a previous run stopped."""
    done = sum(1 for _ in out.open()) if out.exists() else 0
    tok = teacher.tokenizer
    start = time.perf_counter()
    with out.open("a") as f:
        for i in range(done, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            ids = [tok.encode_chat(chat(p)) for p in batch]
            replies = generate_ar_batch(teacher.model, ids, max_new_tokens, tok.eos_ids)
            for p, r in zip(batch, replies):
                f.write(json.dumps({"prompt": p, "reply_ids": r, "reply": tok.decode(r)}) + "\n")
            f.flush()
            n = i + len(batch) - done
            rate = n / (time.perf_counter() - start)
            log(f"distill {i + len(batch)}/{len(prompts)}  {rate:.1f} replies/s  "
                f"eta {(len(prompts) - i - len(batch)) / rate / 60:.1f} min")


def training_examples(teacher: LoadedModel, distilled: Path, seed: int = 0
                      ) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per example: system + user prompt, then the reply and EOS."""
    tok = teacher.tokenizer
    eos = next(iter(tok.eos_ids))
    examples = []
    for line in distilled.open():
        row = json.loads(line)
        prompt = tok.encode_chat(chat(row["prompt"]))
        reply = [t for t in row["reply_ids"] if t not in tok.eos_ids] + [eos]
        examples.append((prompt + reply, len(prompt)))
    random.Random(seed).shuffle(examples)
    return examples


def sample_prompts(split: str, n: int, seed: int = 0) -> list[str]:
    prompts = chitchat_prompts(split)
    random.Random(seed).shuffle(prompts)
    return prompts[:n]
