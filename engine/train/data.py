"""Training data for the diffusion adaptation: chitchat prompts and the AR teacher's own replies.

Self-distillation keeps the teacher's style and makes targets easier to predict in parallel.
The split is by conversation (a stable hash of its id), so held-out prompts never leak in.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from engine.decode import generate_ar_batch
from engine.loading import LoadedModel
from engine.tokenizer import Tokenizer

VOICE_SYSTEM_PROMPT = ("You are a friendly voice assistant. Answer in one or two short spoken sentences, "
                       "without lists or markdown.")


def _chitchat_turns(split: str, heldout_percent: int) -> list[list[str]]:
    """Each chitchat conversation of `split` (`train` or `heldout`) as its turns' texts. The split is by
    a stable hash of the conversation's id, so held-out turns never leak into training."""
    try:
        import chitchat_dataset
    except ImportError:
        raise SystemExit("chitchat prompts need the [train] extra: pip install 'diffusion-voice[train]'") from None
    out = []
    for conv_id, conv in chitchat_dataset.Dataset().items():
        in_heldout = int(hashlib.sha1(conv_id.encode()).hexdigest(), 16) % 100 < heldout_percent
        if in_heldout == (split == "heldout"):
            out.append([" ".join(u["text"].strip() for u in turn).strip() for turn in conv["messages"]])
    return out


def _spoken_length(text: str) -> bool:
    return 3 <= len(text.split()) <= 30


def chitchat_prompts(split: str, heldout_percent: int = 5) -> list[str]:
    """Opening user turns of chitchat conversations (3-30 words), for `train` or `heldout`."""
    return [t for turns in _chitchat_turns(split, heldout_percent) for t in turns[:4] if _spoken_length(t)]


def chitchat_pairs(split: str, n: int, seed: int = 0, heldout_percent: int = 5) -> list[tuple[str, str]]:
    """`n` (turn, the person's reply to it) pairs of chitchat conversations (each 3-30 words), shuffled:
    text a draft head can learn the base's next tokens on (`engine.train.draft.read_corpus`)."""
    pairs = [(a, b) for turns in _chitchat_turns(split, heldout_percent) for a, b in zip(turns, turns[1:])
             if _spoken_length(a) and _spoken_length(b)]
    random.Random(seed).shuffle(pairs)
    return pairs[:n]


def write_text_replies(tokenizer: Tokenizer, pairs: list[tuple[str, str]], out: Path) -> None:
    """The pairs as JSONL rows shaped like distilled ones (prompt, reply_ids), extending `out`."""
    have = sum(1 for _ in out.open()) if out.exists() else 0
    with out.open("a") as f:
        for prompt, reply in pairs[have:]:
            f.write(json.dumps({"prompt": prompt, "reply_ids": tokenizer.encode(reply), "reply": reply}) + "\n")


def chat(prompt: str, system: str = VOICE_SYSTEM_PROMPT) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]


def distill(teacher: LoadedModel, prompts: list[str], out: Path, max_new_tokens: int = 48,
            batch_size: int = 32, max_minutes: float = 0.0, log: Callable[[str], object] = print) -> None:
    """Append the teacher's greedy replies to `out` (JSONL) for every prompt it lacks, so a run resumes
    where a previous one stopped and a longer prompt list only adds; `max_minutes` (0: no limit) stops
    after the batch that crosses it, leaving the rest for a later run."""
    have = {json.loads(line)["prompt"] for line in out.open()} if out.exists() else set()
    todo = [p for p in prompts if p not in have]
    if not todo:
        return
    log(f"distilling {len(todo)} replies ({len(have)} already in {out})")
    tok = teacher.tokenizer
    start = time.perf_counter()
    with out.open("a") as f:
        for i in range(0, len(todo), batch_size):
            batch = todo[i:i + batch_size]
            ids = [tok.encode_chat(chat(p)) for p in batch]
            replies = generate_ar_batch(teacher.model, ids, max_new_tokens, tok.eos_ids)
            for p, r in zip(batch, replies):
                f.write(json.dumps({"prompt": p, "reply_ids": r, "reply": tok.decode(r)}) + "\n")
            f.flush()
            n = i + len(batch)
            elapsed = time.perf_counter() - start
            log(f"distill {n}/{len(todo)}  {n / elapsed:.1f} replies/s  "
                f"eta {(len(todo) - n) * elapsed / n / 60:.1f} min")
            if max_minutes and elapsed / 60 >= max_minutes and n < len(todo):
                log(f"distilling stopped after {max_minutes:g} min; {len(todo) - n} replies left for a later run")
                return


def training_examples(teacher: LoadedModel, distilled: Path, seed: int = 0
                      ) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per example: system + user prompt, then the reply and EOS."""
    tok = teacher.tokenizer
    eos = tok.turn_end_id
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


_ANIMALS = ["a horse", "a cat", "an ant", "a bird", "a cow", "a frog", "a snake", "a duck", "a bee", "an octopus",
            "a crab", "a starfish", "a chicken", "a kangaroo", "a penguin", "a goat", "an elephant", "a butterfly"]
_OBJECTS = ["grass", "snow", "a lemon", "an orange", "a tomato", "coal", "milk", "the sun", "a carrot", "chocolate",
            "a strawberry", "a lime", "a cloud", "a pumpkin", "an emerald", "a flamingo"]
_WORKS = [("wrote", "Hamlet"), ("wrote", "Pride and Prejudice"), ("wrote", "The Odyssey"), ("painted", "Starry Night"),
          ("painted", "The Last Supper"), ("invented", "the telephone"), ("invented", "the light bulb"),
          ("discovered", "gravity"), ("invented", "the printing press"), ("composed", "the Moonlight Sonata"),
          ("wrote", "Harry Potter"), ("discovered", "radium"), ("invented", "the airplane")]
_ADJECTIVES = ["big", "fast", "happy", "early", "light", "old", "wet", "loud", "full", "strong", "soft", "rich",
               "open", "young", "tall", "empty", "left"]
_NOUNS = ["child", "foot", "tooth", "goose", "man", "woman", "person", "leaf", "knife", "cactus", "sheep", "fish"]
_LANGUAGES = ["Spanish", "French", "German", "Italian", "Japanese", "Portuguese"]
_PHRASES = ["goodbye", "good morning", "please", "water", "friend", "good night", "yes", "cat"]
_PLACES = ["Spain", "France", "Mexico", "Brazil", "Egypt", "India", "Germany", "China", "Russia", "Canada", "Kenya",
           "Japan", "Italy", "Greece", "Australia", "Peru", "Sweden", "Turkey"]
_SUPERLATIVES = ["the largest country in the world", "the smallest country in the world", "the longest river in "
                 "the world", "the biggest ocean", "the coldest place on Earth", "the largest animal on land",
                 "the tallest animal", "the smallest planet", "the hottest planet", "the largest bone in the body",
                 "the largest organ of the body", "the most spoken language", "the deepest ocean",
                 "the biggest city in the United States", "the largest continent"]
_TOOLS = [("hammer", "nails"), ("ruler", "length"), ("scale", "weight"), ("clock", "time"), ("compass", "direction"),
          ("telescope", "stars"), ("stethoscope", "heartbeats"), ("broom", "floors"), ("ladder", "high shelves")]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]
_SHAPES = ["pentagon", "octagon", "rectangle", "circle", "cube", "heptagon", "decagon"]


def _knowledge_makers(rng: random.Random) -> list:
    """Short factual questions of the kinds voice users ask: animals, colours, who-did-what, words, places."""
    return [
        lambda: f"How many legs does {rng.choice(_ANIMALS)} have?",
        lambda: f"What do {rng.choice(_ANIMALS).split(' ', 1)[1]}s eat?",
        lambda: f"Where does {rng.choice(_ANIMALS)} live?",
        lambda: f"What is a baby {rng.choice(_ANIMALS).split(' ', 1)[1]} called?",
        lambda: f"What color is {rng.choice(_OBJECTS)}?",
        lambda: "Who {} {}?".format(*rng.choice(_WORKS)),
        lambda: f"What is the opposite of {rng.choice(_ADJECTIVES)}?",
        lambda: f"What is the plural of {rng.choice(_NOUNS)}?",
        lambda: f"How do you say {rng.choice(_PHRASES)} in {rng.choice(_LANGUAGES)}?",
        lambda: f"What is the currency of {rng.choice(_PLACES)}?",
        lambda: f"Which continent is {rng.choice(_PLACES)} in?",
        lambda: f"What is {rng.choice(_SUPERLATIVES)}?",
        lambda: "What do you use a {} for?".format(rng.choice(_TOOLS)[0]),
        lambda: "What tool do you use to measure {}?".format(rng.choice(_TOOLS)[1]),
        lambda: f"What day comes after {rng.choice(_DAYS)}?",
        lambda: f"What day comes before {rng.choice(_DAYS)}?",
        lambda: f"What month comes after {rng.choice(_MONTHS)}?",
        lambda: f"How many days are in {rng.choice(_MONTHS)}?",
        lambda: f"How many sides does a {rng.choice(_SHAPES)} have?",
        lambda: f"What is {rng.randint(2, 12)} times {rng.randint(2, 12)}?",
        lambda: f"What is {rng.randint(10, 200)} divided by {rng.choice([2, 4, 5, 10])}?",
        lambda: f"What is half of {rng.choice([10, 30, 40, 60, 80, 90, 120, 200])}?",
        lambda: f"What is the square root of {rng.choice([4, 16, 25, 36, 49, 64, 81, 100])}?",
    ]


def answer_set_prompts() -> set[str]:
    folder = Path(__file__).parents[1] / "prompts"
    return {json.loads(line)["prompt"] for f in folder.glob("answers_*.jsonl") for line in f.open() if line.strip()}


def knowledge_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct short factual questions, none of them in an answer-accuracy set."""
    rng = random.Random(seed)
    return _distinct(_knowledge_makers(rng), n, rng)


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
    return _distinct(makers, n, rng)


def _distinct(makers: list, n: int, rng: random.Random) -> list[str]:
    """Up to `n` distinct prompts from random templates, none of them an evaluation question."""
    seen, prompts = answer_set_prompts(), []
    for _ in range(n * 50):
        p = rng.choice(makers)()
        if p not in seen:
            seen.add(p)
            prompts.append(p)
        if len(prompts) == n:
            break
    return prompts


def drafter_prompts(n_chat: int, n_assistant: int, n_first: int = 0, n_knowledge: int = 0,
                    seed: int = 0) -> list[str]:
    """Training prompts for a drafter: chitchat turns (train split) and templated assistant questions,
    shuffled, the first `n_first` of them (0: all), then `n_knowledge` short factual questions."""
    prompts = sample_prompts("train", n_chat, seed) + assistant_prompts(n_assistant, seed)
    random.Random(seed).shuffle(prompts)
    return (prompts[:n_first] if n_first else prompts) + knowledge_prompts(n_knowledge, seed)
