"""`engine distill`: the base model's own greedy replies, as a data set that grows across sessions.

A drafter learns what the base says, so its data is the base's replies under what the voice
service sends: its system prompt (`VOICE_SYSTEM_PROMPT`, the `[lm] system_prompt` default),
conversations of one to three turns (the model's own earlier replies in the history, as the
service keeps them), and some turns with the service's built-in tools offered. The user turns
come from chitchat-dataset's train split; the held-out split and every evaluation prompt in
engine/prompts are left out.

Replies are generated in refilled batches: `in_flight` conversations share each batched step
and a finished one is replaced at once, so the batch stays full and no row is padding. They are
written as gzipped JSONL shards of token ids (`shard-NNNN.jsonl.gz`, `SHARD_REPLIES` each, written
whole, then never touched), small enough to commit. No hidden states and no teacher logits: both
come back from one prefill forward of a stored reply, far cheaper than generating it, and the
drafter's layers may change. A run resumes: conversations already in a shard are skipped, so each
session only adds shards. SIGTERM or SIGINT writes what is finished as a last (shorter) shard.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.decode import CacheState, Forward, run_many
from engine.loading import LoadedModel
from engine.tools import Tool, for_template
from engine.train.data import VOICE_SYSTEM_PROMPT, _chitchat_turns, _spoken_length

SHARD_REPLIES = 256  # replies a shard holds: a few minutes of one thread, so a shard lands between commits
MAX_TURNS = 3
TOOL_SHARE = 0.08  # conversations offered the service's tools

# the voice service's built-in tools (voice/pipeline/tools.py `Toolbox`), as its `[tools] builtin` declares them
TOOLS = [
    Tool("get_time", "The current local time and date.",
         {"type": "object", "properties": {}, "additionalProperties": False}),
    Tool("set_timer", "Start a countdown timer that speaks up when it is done.",
         {"type": "object", "properties": {"seconds": {"type": "integer", "minimum": 1, "maximum": 86400},
                                           "label": {"type": "string", "maxLength": 40}},
          "required": ["seconds"], "additionalProperties": False}),
    Tool("calculate", "Evaluate an arithmetic expression, e.g. 17 * 23.",
         {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 100}},
          "required": ["expression"], "additionalProperties": False}),
]
_TOOL_ASKS = [
    lambda r: "What time is it?", lambda r: "What's the date today?", lambda r: "Do you know what day it is?",
    lambda r: f"Set a timer for {r.randint(1, 20)} minutes.", lambda r: f"Remind me in {r.randint(2, 50)} seconds.",
    lambda r: f"Start a {r.randint(2, 15)} minute timer for the {r.choice(['pasta', 'eggs', 'tea', 'laundry'])}.",
    lambda r: f"What is {r.randint(11, 99)} times {r.randint(11, 99)}?",
    lambda r: f"Can you add {r.randint(100, 999)} and {r.randint(100, 999)}?",
    lambda r: f"What's {r.randint(2, 40)} percent of {r.randint(50, 900)}?",
    lambda r: f"How much is {r.randint(1000, 9999)} divided by {r.randint(3, 30)}?",
]


@dataclass
class Conversation:
    """User turns asked one after another, each answered by the base (its reply kept in the history)."""

    key: str  # stable: a run resumes by skipping keys already written
    turns: list[str]
    tools: bool = False
    source: str = "chitchat"


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def evaluation_prompts() -> set[str]:
    """Every prompt in engine/prompts (held-out chitchat turns, answer sets, the bench set), normalised."""
    folder = Path(__file__).parents[1] / "prompts"
    return {_normal(json.loads(line)["prompt"]) for f in folder.glob("*.jsonl") for line in f.open() if line.strip()}


def conversations(seed: int = 0) -> list[Conversation]:
    """The data program's conversations in its fixed order (the same every session, so resuming is
    skipping keys): windows of chitchat's train split, one speaker's turns as the user's (1-3 of
    them), and templated requests with the service's tools offered."""
    rng = random.Random(seed)
    banned = evaluation_prompts()
    out: list[Conversation] = []
    for n, turns in enumerate(_chitchat_turns("train", 5)):
        for start in range(0, len(turns), 2 * MAX_TURNS):
            asked: list[str] = []
            for text in turns[start:start + 2 * rng.randint(1, MAX_TURNS):2]:
                if not _spoken_length(text) or _normal(text) in banned:
                    break
                asked.append(text)
            if asked:
                out.append(Conversation(f"chitchat:{n}:{start}:{len(asked)}", asked))
    tool_asks = int(len(out) * TOOL_SHARE)
    for i in range(tool_asks):
        if i % 2:  # half of them a chitchat turn with tools offered: the reply should still be spoken
            out.append(Conversation(f"tools:{i}:chat", [out[rng.randrange(len(out) - i)].turns[0]], True,
                                    "tools-chat"))
        else:
            out.append(Conversation(f"tools:{i}", [rng.choice(_TOOL_ASKS)(rng)], True, "tools"))
    rng.shuffle(out)
    return out


@dataclass
class Row:
    """One reply: what is committed to a shard."""

    key: str
    turn: int
    source: str
    messages: list[dict]  # the conversation without the system prompt, ending with the user turn answered
    tools: bool
    prompt_ids: list[int]
    reply_ids: list[int]  # the base's greedy reply, its end-of-turn token included when it ended

    def json(self) -> str:
        return json.dumps({"key": self.key, "turn": self.turn, "source": self.source, "messages": self.messages,
                           "tools": self.tools, "prompt_ids": self.prompt_ids, "reply_ids": self.reply_ids},
                          ensure_ascii=False)


@dataclass
class _Going:
    """A conversation being answered: its cache, the reply so far, the tokens its next forward writes."""

    conv: Conversation
    state: CacheState
    turn: int = 0
    messages: list[dict] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    reply: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)


class Prompter:
    """The prompt the voice service would send for a conversation so far (`Engine.prompt_ids`)."""

    def __init__(self, loaded: LoadedModel, system: str) -> None:
        self.tokenizer, self.system = loaded.tokenizer, system

    def __call__(self, messages: list[dict], tools: bool) -> list[int]:
        full = [{"role": "system", "content": self.system}, *messages]
        rendered, declared = for_template(full, TOOLS if tools else [], self.tokenizer.supports_tools)
        return self.tokenizer.encode_chat(rendered, add_generation_prompt=True, tools=declared)


def replies(loaded: LoadedModel, todo: Iterator[Conversation], in_flight: int, max_new_tokens: int,
            system: str = VOICE_SYSTEM_PROMPT, capacity: int = 768) -> Iterator[Row]:
    """The base's greedy replies to `todo`'s conversations, turn after turn, `in_flight` at a time in
    one batched step each; a finished conversation is replaced by the next at once. The prefix every
    prompt shares (the system prompt) is prefilled once and forked into each conversation's cache."""
    model, stop_ids = loaded.model, loaded.tokenizer.eos_ids
    prompt_of = Prompter(loaded, system)
    shared = list(os.path.commonprefix([prompt_of([{"role": "user", "content": text}], False) for text in "ab"]))
    root = CacheState.new(model, capacity)
    run_many(model, [Forward(root, shared[:-1])])
    free: list[CacheState] = []
    going: list[_Going] = []

    def ask(g: _Going) -> None:
        g.messages.append({"role": "user", "content": g.conv.turns[g.turn]})
        g.prompt = prompt_of(g.messages, g.conv.tools)
        g.reply = []
        g.pending = g.state.reuse_for(g.prompt)

    def start() -> bool:
        conv = next(todo, None)
        if conv is None:
            return False
        g = _Going(conv, root.fork(model, into=free.pop() if free else None))
        ask(g)
        going.append(g)
        return True

    while len(going) < in_flight and start():
        pass
    while going:
        fits = [g for g in going if len(g.state.ids) + len(g.pending) + 1 <= g.state.capacity]
        results = run_many(model, [Forward(g.state, g.pending) for g in fits])
        finished: list[_Going] = [g for g in going if g not in fits]  # too long to go on: dropped
        for g, (last, _) in zip(fits, results):
            assert last is not None  # each forward wrote a clean token
            token = int(torch.argmax(last))
            g.reply.append(token)
            g.pending = [token]
            if token in stop_ids or len(g.reply) >= max_new_tokens:
                yield Row(g.conv.key, g.turn, g.conv.source, list(g.messages), g.conv.tools, g.prompt, g.reply)
                g.turn += 1
                text = loaded.tokenizer.decode([t for t in g.reply if t not in stop_ids])
                if g.turn < len(g.conv.turns) and token in stop_ids and text.strip():
                    g.messages.append({"role": "assistant", "content": text.strip()})
                    ask(g)
                else:
                    finished.append(g)
        for g in finished:
            going.remove(g)
            free.append(g.state)
        while len(going) < in_flight and start():
            pass


def shard_paths(folder: Path) -> list[Path]:
    return sorted(folder.glob("shard-*.jsonl.gz"))


def read_shards(folder: Path) -> Iterator[dict]:
    """Every reply in `folder`'s shards, in order."""
    for path in shard_paths(folder):
        yield from read_shard(path)


def read_shard(path: Path) -> list[dict]:
    """The replies of one shard, in order."""
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def write_shard(folder: Path, rows: list[Row]) -> Path:
    """The next shard, written whole under a temporary name first (a stopped run leaves no half shard)."""
    taken = [int(p.name[len("shard-"):].split(".")[0]) for p in shard_paths(folder)]
    path = folder / f"shard-{max(taken, default=-1) + 1:04d}.jsonl.gz"
    tmp = path.with_suffix(".part")
    with gzip.open(tmp, "wt") as f:
        f.writelines(r.json() + "\n" for r in rows)
    tmp.rename(path)
    return path


def describe(loaded: LoadedModel, system: str, max_new_tokens: int, seed: int) -> dict:
    """What a folder's replies are replies of: a resumed run must match it."""
    from engine import llamacpp
    model = loaded.model
    weights = Path(getattr(model, "path", loaded.name))
    return {"model": loaded.name, "weights": weights.name, "cpu_variant": llamacpp.cpu_variant()
            if isinstance(model, llamacpp.LlamaCppModel) else "pytorch", "system_prompt": system,
            "system_prompt_sha1": hashlib.sha1(system.encode()).hexdigest()[:12], "max_new_tokens": max_new_tokens,
            "seed": seed, "greedy": True, "max_turns": MAX_TURNS, "tools": [t.name for t in TOOLS]}


def grow(loaded: LoadedModel, folder: Path, in_flight: int = 32, max_new_tokens: int = 48, seed: int = 0,
         max_minutes: float = 0.0, max_replies: int = 0, system: str = VOICE_SYSTEM_PROMPT,
         log: Callable[[str], object] = print) -> int:
    """Add shards of replies to `folder` until every conversation is answered, `max_minutes` pass,
    `max_replies` are added, or SIGTERM/SIGINT; returns the replies added."""
    folder.mkdir(parents=True, exist_ok=True)
    meta_path, meta = folder / "meta.json", describe(loaded, system, max_new_tokens, seed)
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        differs = {k for k in ("model", "system_prompt", "max_new_tokens", "seed") if old.get(k) != meta[k]}
        if differs:
            raise SystemExit(f"{folder} holds replies made with other {', '.join(sorted(differs))}: "
                             "use another folder")
    else:
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    done = {row["key"] for row in read_shards(folder)}
    have = sum(1 for _ in read_shards(folder))
    todo = [c for c in conversations(seed) if c.key not in done]
    log(f"{have} replies in {len(done)} conversations already in {folder}; {len(todo)} conversations to go, "
        f"{in_flight} in flight, {torch.get_num_threads()} thread(s)")
    stop = {"asked": False}

    def ask_stop(signum: int, _frame: object) -> None:
        stop["asked"] = True
        log(f"signal {signum}: writing what is finished, then stopping")

    old_handlers = {s: signal.signal(s, ask_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    start, added, tokens = time.perf_counter(), 0, 0
    rows: list[Row] = []
    source = iter(todo)

    def more() -> Iterator[Conversation]:
        for conv in source:
            if stop["asked"] or (max_minutes and time.perf_counter() - start > 60 * max_minutes):
                return
            yield conv

    try:
        for row in replies(loaded, more(), in_flight, max_new_tokens, system):
            rows.append(row)
            added, tokens = added + 1, tokens + len(row.reply_ids)
            if len(rows) >= SHARD_REPLIES:
                minutes = (time.perf_counter() - start) / 60
                log(f"{write_shard(folder, rows).name}: {added} replies added in {minutes:.1f} min "
                    f"({added / minutes:.1f} replies/min, {tokens / minutes / 60:.1f} reply tokens/s)")
                rows = []
            if stop["asked"] or (max_replies and added >= max_replies):
                break  # replies still being written are dropped (a conversation with none written comes again)
    finally:
        if rows:
            minutes = (time.perf_counter() - start) / 60
            log(f"{write_shard(folder, rows).name} (last, {len(rows)} replies): {added} replies added in "
                f"{minutes:.1f} min ({added / max(minutes, 1e-9):.1f} replies/min)")
        for s, h in old_handlers.items():
            signal.signal(s, h)
    return added
