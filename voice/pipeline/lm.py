"""The LM stage: the one door into `engine/`, or to any OpenAI-compatible endpoint.

`reply(messages)` yields committed text pieces as they are final; closing the iterator
(barge-in) cancels generation. With `tools` (OpenAI function declarations) a reply is either
text or tool calls, never both (a local engine's grammar says so): calls come as one last
`Piece` with `calls`; `runs_out(text)` says when the listener runs out of audio (monotonic; -inf:
they wait in silence for it now; inf: nothing is waited for from the LM yet), given the text
decoded so far (a local engine asks before that text reaches the caller, and orders its rounds by
it: `LocalChat.deadline`). Each
session gets its own `Chat` so a local engine keeps the conversation's prefix cached between turns.

A remote endpoint that can't be reached is retried with backoff before the first block
(`lm.retries`, `lm.retry_backoff_s`); its health (last success or failure, and a periodic
probe of `/models`, skipped while a reply streams) is what /healthz reports. A remote reply
offered tools may write its calls as text (`<tool_call>{...}</tool_call>` or bare JSON: Qwen's
template on llama.cpp's server, which parses none) instead of as `tool_calls`: such text is
never spoken, and its calls are read from it (docs/SCALING.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from engine.common.wire import WireError, decode_json
from engine.tools import MAX_CALL_BYTES, calls_in, starts_a_call
from voice.config import LmConfig
from voice.service.scheduler import LM_HORIZON_S, Scheduler

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolUnionParam
    from torch import Tensor

    from engine.tools import Tool

log = logging.getLogger("voice.lm")


@dataclass
class Piece:
    """A stretch of reply text the LM committed, as the stage hands it on: a local engine's
    `engine.stream.Piece` less its timings, or an endpoint's streamed delta; a reply's last piece
    carries its tool calls. (engine/decode.py's `Block` is a decoder's: the token ids one step commits.)"""

    text: str
    tokens: int = 0  # reply tokens so far (0 when the backend doesn't say)
    steps: int = 0
    calls: list[dict] = field(default_factory=list)  # OpenAI-shaped tool calls (the reply's last piece)


class Chat(Protocol):
    """One conversation with the LM: `LocalChat` (its cache kept between turns), `RemoteChat`;
    tests' FakeChat."""

    def reply(self, messages: list[dict], mode: str | None = None, runs_out: Callable[[str], float] | None = None,
              tools: list[dict] | None = None) -> AsyncGenerator[Piece, None]:
        """The reply's pieces as they come (an async generator); the last one carries any tool calls."""
        ...

    async def prepare(self, messages: list[dict], tools: list[dict] | None = None, aside: bool = False) -> None:
        """Get ready for a conversation that starts with `messages` (the user is still speaking).
        `aside`: not the next turn's start but a later one's (after the history forgets): kept apart
        from what the next turn continues."""

    async def end_of_turn_probability(self, messages: list[dict], text: str,
                                      tools: list[dict] | None = None) -> float | None:
        """How likely the user's turn is over after saying `text` (a transcript, maybe partial),
        following `messages`: the LM's probability of ending the user's message there. None: this
        backend cannot tell (voice.pipeline.endofturn then decides on the audio alone)."""
        ...

    def close(self) -> None:
        """The conversation is over: give back what it holds."""


class LanguageModel(Protocol):
    """What the sessions need of the LM backend (`LocalLM`, `RemoteLM`; tests' FakeLM): how it
    decodes unless a session asks otherwise, and a `Chat` per conversation (a session may ask for
    mode 'ar' or 'diffusion' of either; the in-process engine runs 'diffusion' as it decided at load)."""

    @property
    def mode(self) -> str: ...

    def chat(self) -> Chat: ...

    def fits(self, messages: list[dict]) -> bool:
        """Do `messages` and a whole reply fit the LM's context, by its own tokenizer? (True where
        it cannot count: the history's bound in characters is then the only one, voice/conversation/history.py.)"""
        ...

    def serve(self, max_prefill_s: float, tools: list[dict]) -> None:
        """Get ready to serve sessions, before the first: a prompt that would take longer than
        `max_prefill_s` to read is refused up front, and the grammar of calls of `tools` is built."""
        ...

    def describe(self) -> dict[str, str] | None:
        """What runs, for /healthz's `decoding` and the start-up log: the mode, why, the kernels
        (None: an endpoint elsewhere decides)."""
        ...

    def health(self) -> dict | None:
        """An endpoint's own health for /healthz's `lm_health` (None: the LM is this process's)."""
        ...


class LocalLM:
    """The in-process engine (llama.cpp's kernels or PyTorch), shared by all sessions; how it decodes (drafted
    blocks or AR) it decides at load, per model and CPU (`describe`)."""

    def __init__(self, config: LmConfig, scheduler: Scheduler | None = None):
        import torch

        from engine.decode import DecodeConfig
        from engine.stream import Engine
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.decode = DecodeConfig(mode=config.mode, max_new_tokens=config.max_new_tokens,
                                   rule=config.rule, block_size=config.block_size,
                                   first_block_size=config.first_block_size, threshold=config.threshold,
                                   draft_threshold=config.draft_threshold)
        self.engine = Engine.load(config.model, adapter=config.adapter or None, defaults=self.decode,
                                  max_batch=config.max_batch, quantize=config.quantize, device=config.device)
        self.scheduler = scheduler or Scheduler()
        self.engine.scheduler.max_defer_s = self.scheduler.max_defer_s
        if self.engine.loaded.weights == "gguf":  # llama.cpp: threads are chosen per step
            busy, idle = config.threads or torch.get_num_threads(), config.idle_threads or os.cpu_count() or 1
            self.engine.model.threads = lambda: busy if self.scheduler.stages_busy() else idle
        # a reply is waited for once its listener's audio runs out within the horizon; what nobody
        # waits for sits out while someone waits in silence (for speech recognition or synthesis too)
        self.engine.scheduler.horizon_s = LM_HORIZON_S
        self.engine.scheduler.someone_waits = self.scheduler.busy
        # a long prompt's chunk waits for a final, a first phrase ...
        self.engine.scheduler.yield_to = self.scheduler.stage_waited
        self.scheduler.on_waited_job.append(self.engine.interrupt_long_prompts)  # ... and one under way stops
        self._grammars: dict[str, tuple[list[Tool], str, Tensor]] = {}

    @property
    def mode(self) -> str:
        """How replies are decoded unless a session asks otherwise (the engine's decision at load)."""
        return self.engine.defaults.mode

    def describe(self) -> dict[str, str]:
        """What runs, for /healthz: the mode, why, and the kernels."""
        from engine.llamacpp import LlamaCppModel, cpu_variant
        model = self.engine.model
        if isinstance(model, LlamaCppModel):  # which file: as packaged, or re-quantised for this CPU
            kernels = f"llama.cpp, CPU variant {cpu_variant()}, {model.path.name}"
        else:
            kernels = f"PyTorch, {self.engine.loaded.weights} weights"
        return {"mode": self.engine.defaults.mode, "why": self.engine.decoding.why, "kernels": kernels}

    @property
    def tool_call_log_odds(self) -> float:
        """The first-token gate of tool calls: the configured one, else the model's own."""
        from engine.loading import tool_call_log_odds
        chosen = self.config.tool_call_log_odds
        return tool_call_log_odds(self.config.model) if chosen is None else chosen

    def chat(self) -> "LocalChat":
        return LocalChat(self)

    def fits(self, messages: list[dict]) -> bool:
        """Do `messages` and a whole reply fit the engine's context, by its own tokenizer? (The
        history's bound beyond characters: voice/conversation/history.py.)"""
        return len(self.engine.prompt_ids(messages)) + self.decode.max_new_tokens <= self.engine.max_seq_len

    def serve(self, max_prefill_s: float, tools: list[dict]) -> None:
        # a prompt this machine cannot read before the first block's timeout is refused up front
        self.engine.admission.max_prefill_s = max_prefill_s
        # anyone may start talking: a long prompt is read a slice at a time, and one that would
        # take more than half the time a reply may wait is refused (the rest is for the others)
        self.engine.admission.may_share = True
        if tools:
            self.tool_grammar(tools)  # llguidance's vocabulary, built once, before any turn

    def health(self) -> dict | None:
        return None

    def tool_grammar(self, tools: list[dict]) -> tuple[list[Tool], str, Tensor]:
        """(engine tools, the grammar of a reply that may call them, the tokens that start a call),
        made once per tool set. The first also builds llguidance's view of the vocabulary (~1 s):
        call it at start-up."""
        key = json.dumps(tools, sort_keys=True)
        if key not in self._grammars:
            from engine.tools import Tool, ToolUse, tag_terminals
            declared = [Tool(t["function"]["name"], t["function"].get("description", ""),
                             t["function"].get("parameters") or {}) for t in tools]
            tags = tag_terminals(self.engine.tokenizer)
            grammar = ToolUse(declared, "auto").grammar(tags)
            grammars = self.engine.grammars  # compiling here: a bad schema fails at start-up
            plain = ToolUse(declared, "none").grammar(tags)
            starts = grammars.lark(grammar).allowed() & ~grammars.lark(plain).allowed()
            self._grammars[key] = declared, grammar, starts
            while len(self._grammars) > 32:  # Realtime clients bring tool sets of their own
                self._grammars.pop(next(iter(self._grammars)))
        return self._grammars[key]


class LocalChat:
    def __init__(self, lm: LocalLM):
        from engine.stream import ConversationCache
        self.lm, self.conversation = lm, ConversationCache()
        # where `prepare(aside=True)` reads: a later prompt's start, copied from here when it comes (CachePool.share)
        self.aside = ConversationCache()
        self.tool_call_log_odds: float | None = None  # this conversation's own gate (a phone call's), else the LM's

    @staticmethod
    def deadline(runs_out: Callable[[str], float] | None, tools: bool = False) -> Callable[[str], float] | None:
        """The engine's deadline for a reply: when its listener runs out of audio, asked with the
        text to be spoken so far: none while the reply writes a tool call."""
        if runs_out is None:
            return None
        return lambda text: runs_out("" if tools and starts_a_call(text) else text)

    async def reply(self, messages: list[dict], mode: str | None = None, runs_out: Callable[[str], float] | None = None,
                    tools: list[dict] | None = None) -> AsyncGenerator[Piece, None]:
        from engine.tools import calls_in, starts_a_call
        overrides: dict[str, Any] = {"mode": mode} if mode else {}
        declared, constraint = None, None
        if tools:
            declared, grammar, starts = self.lm.tool_grammar(tools)
            constraint = await asyncio.to_thread(self.lm.engine.grammars.lark, grammar)
            gate = self.lm.tool_call_log_odds if self.tool_call_log_odds is None else self.tool_call_log_odds
            constraint.gate_first(starts, gate)
        text, calling = "", False
        async for piece in self.lm.engine.stream(messages, conversation=self.conversation, constraint=constraint,
                                                 tools=declared, deadline=self.deadline(runs_out, bool(tools)),
                                                 **overrides):
            text += piece.text
            calling = bool(tools) and starts_a_call(text)  # calls are never spoken
            if piece.text and not calling:
                yield Piece(piece.text, piece.tokens, piece.steps)
        if calling:
            yield Piece("", calls=calls_in(text))

    async def prepare(self, messages: list[dict], tools: list[dict] | None = None, aside: bool = False) -> None:
        """Prefill the start of the conversation (system prompt, tools) while the user is still
        speaking, so their first turn prefills only their words; or (`aside`) a later turn's start."""
        await self.lm.engine.warm(messages, self.aside if aside else self.conversation,
                                  self.lm.tool_grammar(tools)[0] if tools else None)

    async def end_of_turn_probability(self, messages: list[dict], text: str,
                                      tools: list[dict] | None = None) -> float | None:
        """The probability of the template's end-of-turn token (Qwen's <|im_end|>) right after the
        user's `text`. Its forward prefills the user's words into this conversation's cache (when no
        reply runs there), so a reply to `text` then prefills only the few tokens that follow."""
        engine = self.lm.engine
        prompt = engine.open_prompt_ids([*messages, {"role": "user", "content": text}],
                                        self.lm.tool_grammar(tools)[0] if tools else None)
        return (await engine.probe(prompt, [engine.tokenizer.turn_end_id], self.conversation))[0]

    def close(self) -> None:
        """Nobody continues this conversation: its KV caches go back to the engine's pool."""
        self.lm.engine.abandon(self.conversation)
        self.lm.engine.abandon(self.aside)


class RemoteLM:
    """Any OpenAI-compatible chat endpoint (our `engine serve`, a hosted diffusion LM, SGLang...)."""


    def __init__(self, config: LmConfig):
        import openai
        self.config = config
        self.mode = config.mode
        self.client = openai.AsyncOpenAI(base_url=config.url, api_key=os.environ.get(config.api_key_env, "none"),
                                         max_retries=0, timeout=30.0)  # we retry ourselves, and say so in /healthz
        self.ok = True
        self.failures = 0  # consecutive
        self.streaming = 0  # replies being streamed from the endpoint now
        self.last_error = ""
        self.since = time.time()  # of the current state

    def chat(self) -> "RemoteChat":
        return RemoteChat(self)

    def fits(self, messages: list[dict]) -> bool:
        return True  # its tokenizer is the endpoint's: the history's bound in characters holds

    def serve(self, max_prefill_s: float, tools: list[dict]) -> None:
        return None  # the endpoint is served by its own process

    def describe(self) -> dict[str, str] | None:
        return None

    def health(self) -> dict | None:
        return {"ok": self.ok, "url": self.config.url, "consecutive_failures": self.failures,
                "last_error": self.last_error, "since": round(self.since, 3)}

    def succeeded(self) -> None:
        if not self.ok:
            log.info("LM endpoint %s is reachable again", self.config.url)
            self.since = time.time()
        self.ok, self.failures = True, 0

    def failed(self, err: BaseException) -> None:
        if self.ok:
            self.since = time.time()
        self.ok = False
        self.failures += 1
        self.last_error = f"{type(err).__name__}: {err}"[:300]
        if self.failures <= 3 or self.failures % 30 == 0:
            log.warning("LM endpoint %s failed (%d in a row): %s", self.config.url, self.failures, self.last_error)

    async def probe(self) -> None:
        """GET /models: is the endpoint up (for /healthz, between real calls)? Not while a reply
        streams: that is proof enough, and a server that serves one request at a time (llama.cpp's
        Python server) would answer the probe only after the reply, or cut the reply short for it."""
        if self.streaming:
            return
        try:
            await asyncio.wait_for(self.client.models.list(), 5.0)
        except Exception as err:  # noqa: BLE001 - any failure means "down"
            self.failed(err)
        else:
            self.succeeded()

    @staticmethod
    def retryable(err: BaseException) -> bool:
        import openai
        return isinstance(err, (openai.APIConnectionError, openai.APITimeoutError, openai.RateLimitError,
                                openai.InternalServerError))


FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*(?:```)?\s*$", re.S)


def looks_like_a_call(text: str) -> bool:
    """Does a remote reply offered tools that begins with `text` write a call as text: in tags or as
    bare JSON (engine.tools.starts_a_call), or in a Markdown fence (never how a spoken reply begins)?"""
    text = text.lstrip()
    return starts_a_call(text) or text.startswith("`")


def calls_written(text: str) -> list[dict]:
    """The tool calls a remote reply wrote as text, OpenAI-shaped ([] if none is whole): in tags or
    as bare JSON lines (engine.tools.calls_in), or one JSON object over several lines, fenced or
    not (Qwen2.5-Coder-1.5B on llama.cpp's server writes ```json\n{\n  "name": ...\n}\n```)."""
    fenced = FENCED.match(text.strip())
    body = fenced.group(1) if fenced else text.strip()
    if calls := calls_in(body):
        return calls
    try:  # bounded (engine.common.wire): a remote reply of 1,000 "[" is no RecursionError
        return calls_in(json.dumps(decode_json(body, max_bytes=MAX_CALL_BYTES)))
    except WireError:
        return []


class RemoteChat:
    def __init__(self, lm: RemoteLM):
        self.lm = lm

    async def prepare(self, messages: list[dict], tools: list[dict] | None = None, aside: bool = False) -> None:
        """Nothing to prepare: the endpoint keeps its own caches."""

    async def end_of_turn_probability(self, messages: list[dict], text: str,
                                      tools: list[dict] | None = None) -> float | None:
        """No signal: chat completions give no probabilities of a user's message ending."""
        return None

    def close(self) -> None:
        """Nothing to give back: the endpoint keeps its own caches."""

    async def reply(self, messages: list[dict], mode: str | None = None, runs_out: Callable[[str], float] | None = None,
                    tools: list[dict] | None = None) -> AsyncGenerator[Piece, None]:
        from openai import omit  # what the SDK sends for an argument not given
        cfg, lm = self.lm.config, self.lm  # `runs_out` is for a local engine's scheduler; an endpoint has its own
        for attempt in range(cfg.retries + 1):
            try:
                # messages and tools: JSON dicts in the shapes of the SDK's TypedDicts
                stream = await lm.client.chat.completions.create(
                    model=cfg.model, messages=cast("list[ChatCompletionMessageParam]", messages), stream=True,
                    max_tokens=cfg.max_new_tokens, temperature=0, extra_body={"mode": mode or cfg.mode},
                    tools=cast("list[ChatCompletionToolUnionParam]", tools) if tools else omit,
                    tool_choice="auto" if tools else omit)
                break
            except Exception as err:
                lm.failed(err)
                if attempt == cfg.retries or not lm.retryable(err):
                    raise
                await asyncio.sleep(cfg.retry_backoff_s * 2 ** attempt)
        lm.succeeded()
        calls: dict[int, dict] = {}  # index -> the call so far (its arguments may come in pieces)
        text, said = "", 0  # the reply's text so far; how much of it was yielded
        lm.streaming += 1
        try:
            async for chunk in stream:
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta is not None and delta.content:
                    text += delta.content
                    # offered tools, the reply's first visible characters say whether it is a call written as text
                    if not tools or (text.strip() and not looks_like_a_call(text)):
                        yield Piece(text[said:])
                        said = len(text)
                for part in (delta.tool_calls if delta is not None else None) or ():
                    call = calls.setdefault(part.index, {"id": "", "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                    call["id"] = part.id or call["id"]
                    if part.function is not None:
                        call["function"]["name"] += part.function.name or ""
                        call["function"]["arguments"] += part.function.arguments or ""
            written = calls_written(text) if tools and looks_like_a_call(text) else []
            if calls or written:  # none from a call written wrong: the reply is empty, and answered without tools
                yield Piece("", calls=[calls[i] for i in sorted(calls)] + written)
        except Exception as err:  # the endpoint went away mid-reply
            lm.failed(err)
            raise
        finally:
            lm.streaming -= 1
            await stream.close()


def load_lm(config: LmConfig, scheduler: Scheduler | None = None) -> LocalLM | RemoteLM:
    return LocalLM(config, scheduler) if config.backend == "local" else RemoteLM(config)
