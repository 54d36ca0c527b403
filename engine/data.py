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


# Everyday assistant questions for the drafter's training data, built from templates over
# entities that the answer-accuracy sets (`engine/prompts/answers_*.jsonl`) do not use, so the
# drafter never sees an evaluation question. Voice users ask these as often as they chat.
_COUNTRIES = ["Norway", "Sweden", "Poland", "Peru", "Chile", "India", "Turkey", "Austria", "Belgium", "Finland",
              "Denmark", "Hungary", "Argentina", "Colombia", "Vietnam", "Thailand", "Morocco", "Nigeria", "Cuba",
              "Iceland", "Switzerland", "the Netherlands", "South Korea", "Indonesia", "Pakistan", "Ukraine"]
_THINGS = ["a volcano", "a rainbow", "photosynthesis", "a black hole", "an atom", "a galaxy", "democracy", "a verb",
           "an allergy", "a vaccine", "inflation", "a comet", "an earthquake", "a glacier", "a mammal", "a fraction",
           "electricity", "a battery", "a noun", "a tornado", "the internet", "a recipe", "a password", "a calendar"]
_TASKS = ["make a cup of tea", "tie a tie", "fall asleep faster", "cook rice", "clean a cast iron pan",
          "remember names better", "save money each month", "start running", "water a cactus", "fix a flat tire",
          "learn a new language", "make pancakes", "stay focused while working", "plant tomatoes",
          "get rid of hiccups", "write a thank you note", "stretch my back", "keep bread fresh"]
_UNITS = [("feet", "a yard"), ("ounces", "a pound"), ("days", "a year"), ("weeks", "a year"), ("cups", "a quart"),
          ("millimeters", "a centimeter"), ("quarters", "a dollar"), ("years", "a century"), ("pints", "a gallon")]
_WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "thirteen",
          "fourteen", "sixteen", "seventeen", "eighteen", "nineteen", "thirty", "forty"]


def answer_set_prompts() -> set[str]:
    folder = Path(__file__).parent / "prompts"
    return {json.loads(line)["prompt"] for f in folder.glob("answers_*.jsonl") for line in f.open() if line.strip()}


def assistant_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct templated questions, none of them in an answer-accuracy set."""
    rng = random.Random(seed)
    makers = [
        lambda: f"What is the capital of {rng.choice(_COUNTRIES)}?",
        lambda: f"What language do they speak in {rng.choice(_COUNTRIES)}?",
        lambda: f"What is {rng.choice(_THINGS)}?",
        lambda: f"Can you explain {rng.choice(_THINGS)} simply?",
        lambda: f"How do I {rng.choice(_TASKS)}?",
        lambda: f"What's the best way to {rng.choice(_TASKS)}?",
        lambda: "How many {} are in {}?".format(*rng.choice(_UNITS)),
        lambda: f"What is {rng.choice(_WORDS)} {rng.choice(['plus', 'minus', 'times'])} {rng.choice(_WORDS)}?",
        lambda: f"What is {rng.randint(13, 99)} {rng.choice(['plus', 'minus'])} {rng.randint(2, 40)}?",
        lambda: f"Tell me a fun fact about {rng.choice(_COUNTRIES)}.",
    ]
    seen, prompts = answer_set_prompts(), []
    for _ in range(n * 20):
        p = rng.choice(makers)()
        if p not in seen:
            seen.add(p)
            prompts.append(p)
        if len(prompts) == n:
            break
    return prompts


def drafter_prompts(n_chat: int, n_assistant: int, seed: int = 0) -> list[str]:
    """Training prompts for a drafter: chitchat turns (train split) and templated assistant questions."""
    prompts = sample_prompts("train", n_chat, seed) + assistant_prompts(n_assistant, seed)
    random.Random(seed).shuffle(prompts)
    return prompts
