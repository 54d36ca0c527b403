"""One reply: LM blocks -> phrases -> synthesis -> reply events, each stage under its timeout.

The LM streams blocks; a PhraseSplitter cuts them into phrases that a second task synthesises
while later blocks are still being decoded. A speculative reply (started on the transcript
taken during the VAD hangover) runs the same way, but nothing of it reaches the client until
`reply.released` is set (the user's turn really ended). A stage that fails or overruns its
timeout (`[faults]`) ends the reply with an `error` and the cached apology
(docs/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

from voice.config import Config
from voice.events import Error, Event, ReplyText, ToolCall, ToolResult, TtsAudio
from voice.faults import StageFailure, blocks_within, synthesis_within
from voice.lm import Chat
from voice.playback import Playback
from voice.scheduler import LM_HORIZON_S, TTS_HORIZON_S
from voice.tools import Timers, Toolbox, ToolRun, with_results
from voice.tts import PhraseSplitter, SpeechSynthesizer

log = logging.getLogger("voice.reply")


@dataclass
class Reply:
    turn: int
    text: str = ""
    task: asyncio.Task | None = None
    playback: Playback = field(default_factory=Playback)
    finished: bool = False
    failure: StageFailure | None = None
    blocks: int = 0  # text blocks so far (LM blocks and the tool filler)
    phrased: bool = False  # a phrase went to synthesis
    tools: list[ToolRun] = field(default_factory=list)  # the calls the LM made
    announcement: bool = False  # not a reply to a turn (a timer speaking up): no latency, no record
    superseded: bool = False  # the user resumed before hearing it: the next turn's transcript holds this one's
    # Set once the user's turn is over and the final transcript is out: until then nothing of a
    # speculative reply reaches the client, the history or the records.
    released: asyncio.Event = field(default_factory=asyncio.Event)


class ReplySink(Protocol):
    """Where a reply goes: the session (voice/session.py), as a ReplyRunner sees it."""

    def emit(self, ev: Event, wire: bool = True, track: bool = True) -> bool:
        """Send `ev` to the client (if `wire`) and the latency tracker (if `track`); False if not queued."""
        ...

    def first_audio(self) -> None:
        """A reply's first audio is synthesised: nobody waits in silence any more."""
        ...

    def fault(self, failure: StageFailure) -> None:
        """Count a stage's fault (for /healthz and the metrics)."""
        ...

    def is_current(self, turn: int) -> bool:
        """Is audio of `turn` still wanted (not cleared by a barge-in)?"""
        ...


class ReplyRunner:
    """Runs a session's replies. What it needs of the session is its `sink` (a ReplySink) and
    the session's `timers`."""

    def __init__(self, config: Config, chat: Chat, synthesizer: SpeechSynthesizer, out_rate: int, lm_mode: str | None,
                 apology: bytes | None, sink: ReplySink, name: str, tools: Toolbox, timers: Timers):
        self.config, self.chat, self.synthesizer = config, chat, synthesizer
        self.out_rate, self.lm_mode = out_rate, lm_mode
        self.tools, self.timers = tools, timers
        self.client_tools: list[dict] = []  # functions the client runs itself (Realtime `session.tools`)
        self.apology = apology
        self.sink = sink
        self.name = name  # the session, for logs

    async def prepare(self, messages: list[dict]) -> None:
        """Before the first turn: the LM prefills the conversation's start (best effort)."""
        try:
            await self.chat.prepare(messages, self.tools.openai() or None)
        except Exception as err:  # noqa: BLE001 - the first turn will simply prefill it itself
            log.warning("session=%s preparing the LM failed: %r", self.name, err)

    async def run(self, reply: Reply, messages: list[dict]) -> None:
        """The whole reply, until the client has played it (a barge-in cancels this task)."""
        phrases: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(reply, phrases))
        try:
            try:
                await self._generate(reply, messages, phrases, speaker)
                phrases.put_nowait(None)
                await speaker
            except StageFailure as failure:
                speaker.cancel()
                await reply.released.wait()
                self.fail(reply, failure)
            except Exception as err:  # a bug of ours: the same treatment as a failing stage
                speaker.cancel()
                log.exception("session=%s turn=%d reply failed", self.name, reply.turn)
                await reply.released.wait()
                self.fail(reply, StageFailure("reply_failed", f"the reply failed: {err}", "session", "error"))
            await reply.released.wait()
            await reply.playback.played()  # until then a barge-in still interrupts it
            reply.finished = reply.failure is None
        except asyncio.CancelledError:
            speaker.cancel()
            raise

    async def _generate(self, reply: Reply, messages: list[dict], phrases: asyncio.Queue,
                        speaker: asyncio.Task) -> None:
        """LM blocks -> reply events and phrases for the speaker. A reply that calls tools is not
        spoken: the calls run and the model answers again with their results (voice/tools.py)."""
        splitter = PhraseSplitter(self.config.tts.min_chars, self.config.tts.first_words,
                                  self.config.tts.max_phrase_chars)
        offered = (self.tools.openai() + self.client_tools) or None
        calls = await self._blocks(reply, messages, splitter, phrases, speaker, offered)
        theirs = {t["function"]["name"] for t in self.client_tools}
        if any(c["function"]["name"] in theirs for c in calls):
            await self._hand_over(reply, [c for c in calls if c["function"]["name"] in theirs])
        elif calls:
            runs = await self._use_tools(reply, calls, phrases)
            await self._blocks(reply, with_results(messages, runs), splitter, phrases, speaker, None)
        elif offered and not reply.text:  # a call cut off by max_new_tokens: answer without tools
            log.warning("session=%s turn=%d the LM's tool call was incomplete; answering without tools",
                        self.name, reply.turn)
            await self._blocks(reply, messages, splitter, phrases, speaker, None)
        rest = splitter.flush()
        if rest:
            phrases.put_nowait(rest)

    async def _blocks(self, reply: Reply, messages: list[dict], splitter: PhraseSplitter, phrases: asyncio.Queue,
                      speaker: asyncio.Task, tools: list[dict] | None) -> list[dict]:
        """One LM reply, each block under its timeout; the tool calls it makes instead of text, if any."""
        limit = self.config.limits.max_reply_chars
        stream = self.chat.reply(messages, self.lm_mode, urgent=lambda: (
            not reply.phrased or reply.playback.runs_dry(time.monotonic(), LM_HORIZON_S)), tools=tools)
        calls: list[dict] = []
        try:
            async with aclosing(blocks_within(stream, self.config.faults)) as blocks:
                async for block in blocks:
                    if speaker.done() and not speaker.cancelled() and (tts_error := speaker.exception()) is not None:
                        raise tts_error  # TTS failed: no point in generating more
                    calls += block.calls
                    if block.text:
                        self._say(reply, block.text, splitter.push(block.text), phrases)
                        await reply.released.wait()
                        self.sink.emit(ReplyText(reply.turn, time.monotonic(), block.text, reply.blocks, block.tokens,
                                                 block.steps))
                    if len(reply.text) >= limit:
                        log.warning("session=%s turn=%d reply cut at %d characters", self.name, reply.turn, limit)
                        break
        except StageFailure as failure:
            if failure.stage == "lm":
                log.warning("session=%s turn=%d %s", self.name, reply.turn, failure.message)
            raise
        return calls

    @staticmethod
    def _say(reply: Reply, text: str, complete: list[str], phrases: asyncio.Queue) -> None:
        """`text` is the reply's next block; `complete` the phrases it completes, for the speaker."""
        reply.blocks += 1
        reply.text += text
        for phrase in complete:
            phrases.put_nowait(phrase)
            reply.phrased = True

    async def _use_tools(self, reply: Reply, calls: list[dict], phrases: asyncio.Queue) -> list[ToolRun]:
        """Run the calls (all at once); if the user would wait longer than `tools.filler_ms` for them,
        the filler phrase is spoken first. Cancelling (barge-in) cancels the calls still running."""
        runs = [ToolRun.of(call) for call in calls]
        reply.tools += runs
        tasks = [asyncio.create_task(self._run_tool(reply, run)) for run in runs]
        try:
            await reply.released.wait()
            cfg = self.config.tools
            _, pending = await asyncio.wait(tasks, timeout=cfg.filler_ms / 1000)
            if pending and cfg.filler.strip():
                filler = cfg.filler.strip()
                self._say(reply, filler + " ", [filler], phrases)  # a phrase of its own
                self.sink.emit(ReplyText(reply.turn, time.monotonic(), filler + " ", reply.blocks))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=1.0)  # so the turn's record says which calls were cancelled
        return runs

    async def _hand_over(self, reply: Reply, calls: list[dict]) -> None:
        """Calls of the client's own functions end the reply: the client runs them and asks again
        with their outputs (Session.answer_with). Calls of our tools in the same reply are dropped."""
        await reply.released.wait()
        for call in calls:
            run = ToolRun.of(call)
            run.status, run.result = "client", "run by the client"
            reply.tools.append(run)
            self.sink.emit(ToolCall(reply.turn, time.monotonic(), run.id, run.name, run.arguments))

    async def _run_tool(self, reply: Reply, run: ToolRun) -> None:
        """A pure tool runs at once (also during a speculation); one that acts only once the turn is real."""
        work = asyncio.ensure_future(self.tools.run(run, self.timers)) if self.tools.pure(run.name) else None
        try:
            await reply.released.wait()
            self.sink.emit(ToolCall(reply.turn, time.monotonic(), run.id, run.name, run.arguments))
            await (work or self.tools.run(run, self.timers))
        finally:
            if work is not None:
                work.cancel()
            if run.status == "running":  # cancelled before it started
                run.status, run.result = "cancelled", "cancelled (the user spoke)"
            if reply.released.is_set():
                self.sink.emit(ToolResult(reply.turn, time.monotonic(), run.id, run.name, run.result, run.status,
                                          round(run.ms, 1)))

    async def _speak(self, reply: Reply, phrases: asyncio.Queue) -> None:
        playback = reply.playback
        while (phrase := await phrases.get()) is not None:
            pcm = await synthesis_within(self.synthesizer, phrase, self.out_rate, self.config.faults, urgent=lambda: (
                not playback.emitted or playback.runs_dry(time.monotonic(), TTS_HORIZON_S)))
            self.sink.first_audio()
            await reply.released.wait()
            if len(pcm) and self.sink.emit(TtsAudio(reply.turn, time.monotonic(), pcm.tobytes(), self.out_rate,
                                                    phrase)):
                playback.handed_over()

    async def announce(self, reply: Reply, text: str) -> None:
        """Speak `text` as it is (no LM), until the client has played it."""
        pcm = await asyncio.wait_for(self.synthesizer.synthesize(text, self.out_rate), self.config.faults.tts_timeout_s)
        reply.text = text
        if len(pcm) and self.sink.emit(TtsAudio(reply.turn, time.monotonic(), pcm.tobytes(), self.out_rate, text),
                                       track=False):
            reply.playback.handed_over()
        await reply.playback.played()

    def fail(self, reply: Reply, failure: StageFailure) -> None:
        """The turn failed: say so (an `error`), then the cached apology instead of the rest of the reply."""
        self.sink.first_audio()
        self.sink.fault(failure)
        reply.failure = failure
        reply.playback.apology_at = reply.playback.emitted
        apology = bool(self.apology) and self.sink.is_current(reply.turn)
        self.sink.emit(Error(reply.turn, time.monotonic(), failure.code, failure.message, failure.stage, apology))
        if apology and self.apology is not None and self.sink.emit(
                TtsAudio(reply.turn, time.monotonic(), self.apology, self.out_rate, self.config.faults.apology),
                track=False):
            reply.playback.handed_over()

