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
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from voice.asr import echoes, has_words
from voice.config import Config
from voice.events import (Announcement, AudioSent, Clear, Error, Event, ReplyDone, ReplyText, ToolCall, ToolResult,
                          TtsAudio, Work)
from voice.faults import StageFailure, blocks_within, synthesis_within
from voice.lm import Chat
from voice.playback import Playback
from voice.scheduler import LM_HORIZON_S, TTS_HORIZON_S, Due
from voice.tools import Timers, Toolbox, ToolRun, with_results
from voice.tts import PhraseSplitter, SpeechSynthesizer

if TYPE_CHECKING:
    from voice.session import Session

# A reply whose audio is about to run out (less than this left to play, nothing being synthesised)
# speaks the words it has, at least this many, without waiting for the phrase's punctuation: a cut
# between words (its silence trimmed, voice/tts.py) is heard less than a pause mid-sentence.
DRY_CUT_S, DRY_CUT_WORDS = 0.15, 3

log = logging.getLogger("voice.reply")
session_log = logging.getLogger("voice.session")  # the Floor logs as the session it is part of
ECHO_TAIL_S = 0.3  # after a reply has played, its echo (a room's reverberation, a client's buffer) may still come back


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
    unvoiced: int = 0  # phrases given to the speaker whose audio is not handed over yet
    tools: list[ToolRun] = field(default_factory=list)  # the calls the LM made
    announcement: bool = False  # not a reply to a turn (a timer speaking up): no latency, no record
    superseded: bool = False  # the user resumed before hearing it: the next turn's transcript holds this one's
    # Set once the user's turn is over and the final transcript is out: until then nothing of a
    # speculative reply reaches the client, the history or the records.
    released: asyncio.Event = field(default_factory=asyncio.Event)
    # When its work happened (time.monotonic()), released or not yet: the latency report's timeline.
    work: dict[str, float] = field(default_factory=lambda: {"reply_start": time.monotonic()})

    def did(self, name: str) -> None:
        """Mark the first time the reply did `name` (see `Work`)."""
        self.work.setdefault(name, time.monotonic())


def cancel(task: asyncio.Task) -> None:
    """Cancel a reply's task; one that has not begun yet (a response cancelled as soon as it was
    asked for) first takes its first step, so that its `finally` ends the turn with a reply_done."""
    if inspect.getcoroutinestate(cast(Coroutine, task.get_coro())) == inspect.CORO_CREATED:  # a coroutine's task
        asyncio.get_running_loop().call_soon(task.cancel)  # callbacks run in order: after that step
    else:
        task.cancel()


class ReplySink(Protocol):
    """Where a reply goes: the session's `Floor` (below), as a ReplyRunner sees it."""

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

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run `coro` beside the reply; the session cancels it when it closes."""
        ...


class ReplyRunner:
    """Runs a session's replies. What it needs of the session is its `sink` (a ReplySink) and
    the session's `timers`."""

    def __init__(self, config: Config, chat: Chat, synthesizer: SpeechSynthesizer, out_rate: int, lm_mode: str | None,
                 apology: bytes | None, sink: ReplySink, name: str, tools: Toolbox, timers: Timers,
                 requests: bool = False):
        self.config, self.chat, self.synthesizer = config, chat, synthesizer
        self.out_rate, self.lm_mode = out_rate, lm_mode
        self.tools, self.timers = tools, timers
        self.client_tools: list[dict] = []  # functions the client runs itself (Realtime `session.tools`)
        self.apology = apology
        self.sink = sink
        self.name = name  # the session, for logs
        # A session that serves requests (voice/modes.py): its LM replies are text only, and the
        # conversation is its caller's (nothing is prepared ahead in it).
        self.requests = requests

    async def prepare(self, messages: list[dict]) -> None:
        """The LM prefills `messages` ahead of the reply that will start with them: the session's
        start, the words heard so far, the next turn's conversation (best effort)."""
        if self.requests:
            return
        try:
            await self.chat.prepare(messages, (self.tools.openai() + self.client_tools) or None)
        except Exception as err:  # noqa: BLE001 - the reply will simply prefill it itself
            log.warning("session=%s preparing the LM failed: %r", self.name, err)

    async def prepare_next(self, reply: Reply, ahead: Callable[[str], list[dict]]) -> None:
        """Once the decoded reply is released to the user, prefill the conversation the next turn
        will start from. When the history forgets its oldest turns the prompt's start changes, and
        without this the next turn would prefill the whole conversation again while the user waits
        (a first block of 1.4-1.5 s instead of 0.35 s, every fourth turn on two cores)."""
        await reply.released.wait()
        await self.prepare(ahead(reply.text.strip()))

    async def run(self, reply: Reply, messages: list[dict],
                  ahead: Callable[[str], list[dict]] | None = None) -> None:
        """The whole reply, until the client has played it (a barge-in cancels this task).
        `ahead(text)`: the next turn's conversation if this reply is heard whole; the LM prefills
        it as soon as the reply is decoded, while it is spoken (`prepare_next`)."""
        phrases: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(reply, phrases))
        try:
            try:
                await self._generate(reply, messages, phrases, speaker)
                phrases.put_nowait(None)
                if ahead is not None and not reply.tools:
                    self.sink.spawn(self.prepare_next(reply, ahead))
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
        if rest := splitter.flush():
            self._give(reply, rest, phrases)

    async def _blocks(self, reply: Reply, messages: list[dict], splitter: PhraseSplitter, phrases: asyncio.Queue,
                      speaker: asyncio.Task, tools: list[dict] | None) -> list[dict]:
        """One LM reply, each block under its timeout; the tool calls it makes instead of text, if any."""
        limit = self.config.limits.max_reply_chars
        # Urgent until the first phrase is decoded (the LM knows before we do: then its next forward
        # would share the cores with that phrase's synthesis), and again once the audio runs low.
        stream = self.chat.reply(messages, self.lm_mode, urgent=lambda text: (
            not (reply.phrased or splitter.would_phrase(text))
            or reply.playback.runs_dry(time.monotonic(), LM_HORIZON_S)), tools=tools)
        calls: list[dict] = []
        try:
            async with aclosing(blocks_within(stream, self.config.faults)) as blocks:
                async for block in blocks:
                    if speaker.done() and not speaker.cancelled() and (tts_error := speaker.exception()) is not None:
                        raise tts_error  # TTS failed: no point in generating more
                    calls += block.calls
                    reply.did("lm_first_block")
                    if block.text:
                        complete = splitter.push(block.text)
                        if not complete and reply.phrased and not reply.unvoiced \
                                and reply.playback.runs_dry(time.monotonic(), DRY_CUT_S):
                            complete = splitter.words(DRY_CUT_WORDS)
                        self._say(reply, block.text, complete, phrases)
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
            ReplyRunner._give(reply, phrase, phrases)

    @staticmethod
    def _give(reply: Reply, phrase: str, phrases: asyncio.Queue) -> None:
        """Hand a phrase to the speaker."""
        phrases.put_nowait(phrase)
        reply.unvoiced += 1
        reply.phrased = True
        reply.did("first_phrase")

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
        with their outputs (voice/transports/realtime.py). Calls of our tools in the same reply are dropped."""
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

    async def recite(self, reply: Reply, texts: AsyncIterator[str]) -> None:
        """Speak `texts` as they come, no LM (voice/modes.py's speak): phrase by phrase, each next
        one handed over once the last is on the wire, so a client that reads slowly holds the
        synthesis back rather than the outbox dropping its audio."""
        tts = self.config.tts
        splitter = PhraseSplitter(tts.min_chars, tts.first_words, tts.max_phrase_chars)
        phrases: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(reply, phrases, paced=True))
        try:
            async for text in texts:
                self._say(reply, text, splitter.push(text), phrases)
                if text:
                    self.sink.emit(ReplyText(reply.turn, time.monotonic(), text, reply.blocks))
            self._give(reply, splitter.flush(), phrases)
            phrases.put_nowait(None)
            await speaker
            reply.finished = True
        except StageFailure as failure:
            self.fail(reply, failure)
        finally:
            speaker.cancel()

    async def _speak(self, reply: Reply, phrases: asyncio.Queue, paced: bool = False) -> None:
        while (phrase := await phrases.get()) is not None:
            try:
                await self._voice(reply, phrase, paced)
            finally:
                reply.unvoiced -= 1

    async def _voice(self, reply: Reply, phrase: str, paced: bool) -> None:
        """One phrase: synthesised and handed to the transport."""
        if not phrase.strip():
            return
        if self.requests and not paced:  # a text-only reply: its first phrase is its first output
            self.sink.first_audio()
            return
        playback = reply.playback
        reply.did("tts_asked")
        pcm = await synthesis_within(self.synthesizer, phrase, self.out_rate, self.config.faults,
                                     urgent=Due(playback.runs_out, TTS_HORIZON_S))
        reply.did("tts_first_audio")
        self.sink.first_audio()
        await reply.released.wait()
        if len(pcm) and self.sink.emit(TtsAudio(reply.turn, time.monotonic(), pcm.tobytes(), self.out_rate, phrase)):
            playback.handed_over()
            if paced:
                await playback.on_wire()

    async def announce(self, reply: Reply, text: str) -> None:
        """Speak `text` as it is (no LM), until the client has played it."""
        async with asyncio.timeout(self.config.faults.tts_timeout_s):  # (wait_for could swallow a barge-in)
            pcm = await self.synthesizer.synthesize(text, self.out_rate)
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
        self.sink.emit(Error(reply.turn, time.monotonic(), failure.code, failure.message, failure.stage, apology,
                             failure.kind == "client"))
        if apology and self.apology is not None and self.sink.emit(
                TtsAudio(reply.turn, time.monotonic(), self.apology, self.out_rate, self.config.faults.apology),
                track=False):
            reply.playback.handed_over()



class Floor:
    """The assistant's side of one conversation (voice/session.py): the reply that has the floor,
    from its start to its record, what of it reaches the wire and is heard, the user talking over
    it (barge-in), and announcements between turns. It is its ReplyRunner's sink."""

    def __init__(self, session: Session):
        self.session = session
        self.reply: Reply | None = None
        self.tasks: set[asyncio.Task] = set()  # replies still running (a barge-in's too), for close()
        self.contender: int | None = None  # the user's turn begun over a reply: a barge-in once it is speech

    def start(self, turn: int, user_text: str) -> Reply:
        reply = self.reply = Reply(turn)
        reply.task = self.spawn(self._respond(reply, user_text))
        return reply

    async def _respond(self, reply: Reply, user_text: str) -> None:
        s = self.session
        try:
            await s.replies.run(reply, s.history.messages(user_text), functools.partial(s.history.ahead, user_text))
        finally:
            if reply.released.is_set():  # else a speculation that was dropped: it never happened
                await self._reply_done(reply, user_text, "ok" if reply.finished else "superseded" if reply.superseded
                                       else "failed" if reply.failure else "interrupted")

    async def _reply_done(self, reply: Reply, user_text: str, status: str) -> None:
        """Record the turn, then send its reply_done and latency (held back until the record is committed)."""
        s = self.session
        s.stages.scheduler.stop_waiting(s)
        now = time.monotonic()
        heard = reply.text.strip() if reply.finished else reply.playback.heard(now)
        # (a superseded turn's words are in the next one's; a refused one's, too long for the LM or
        # not for it at all, would have every later turn refused too: the client is told it is gone)
        refused = reply.failure is not None and reply.failure.kind == "client"
        if user_text and not reply.superseded and not refused:
            s.history.add(user_text, heard)
        s.emit(Work(reply.turn, now, reply.work), wire=False)
        with s.outbox.holding() as held:
            s.emit(ReplyDone(reply.turn, now, reply.text.strip(), heard, not reply.finished))
        if not await s.call_log.reply_done(reply, status, user_text, heard, held):
            s.error("record_failed", "this turn could not be written to the call records")
        if not s.closed:
            s.outbox.release(held)

    def recite(self, turn: int, texts: AsyncIterator[str]) -> Reply:
        """A reply that speaks `texts` as they come (voice/modes.py's speak), recorded as any."""
        reply = self.reply = Reply(turn)
        reply.released.set()
        reply.task = self.spawn(self._recited(reply, texts))
        return reply

    async def _recited(self, reply: Reply, texts: AsyncIterator[str]) -> None:
        try:
            await self.session.replies.recite(reply, texts)
        finally:
            await self._reply_done(reply, "", "ok" if reply.finished else "failed" if reply.failure
                                   else "interrupted")

    async def listened(self, turn: int, transcript: str) -> None:
        """A turn that only listens (voice/modes.py's listen) ends at its final transcript: recorded
        with it, its reply_done and latency report sent, nothing said."""
        reply = Reply(turn, finished=True)
        reply.released.set()
        await self._reply_done(reply, transcript, "ok")

    async def asr_failed(self, turn: int, failure: StageFailure) -> None:
        """The turn ends with the error and the apology, unless the user has spoken again since."""
        s = self.session
        if turn != s.turn:
            s.stages.fault(failure)
            s.unreplied(turn, "", "asr_failed")
            return
        reply = self.reply = Reply(turn, task=asyncio.current_task())
        reply.released.set()
        s.replies.fail(reply, failure)
        try:
            await reply.playback.played()
        finally:
            await self._reply_done(reply, "", "asr_failed")

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # --- what the user hears ------------------------------------------------------------------

    def speech_started(self, turn: int, now: float, resumes: int) -> None:
        """The user started talking. Going on with the utterance whose reply they have not heard yet,
        that reply stops at once (its words are in this turn's transcript too). Over any other reply
        still pending or playing, this turn is a contender: it stops the reply only once it is speech
        (`talked_over`, `heard_words`), so a VAD blip (a knock, a breath, a microphone's processing
        noise) leaves it playing."""
        reply, self.contender = self.reply, None
        if reply is not None and resumes and reply.turn == resumes:
            reply.superseded = True
            self.barge_in(now)
        elif reply is not None and self._interruptible(reply, now):
            self.contender = turn

    def talked_over(self, turn: int, now: float) -> None:
        """`turn` has been voiced long enough to be speech (voice/turns.py's Talking): a barge-in."""
        if turn == self.contender:
            self._contended(turn, now)

    def heard_words(self, turn: int, text: str, now: float, final: bool = False) -> bool:
        """`turn`'s transcript so far (`final`: all of it) is `text`: is it a turn to answer? One begun over
        a reply must hold words, not Whisper's near-silence "you" (voice/asr.py's has_words) nor mostly the
        reply's own (its echo through a speakerphone: `echoes`), and then it is a barge-in; else it is no
        speech, and the reply goes on."""
        if turn != self.contender:
            return True
        if not has_words(text) or self.reply is not None and echoes(text, self.reply.text, final):
            return False
        self._contended(turn, now)
        return True

    def _contended(self, turn: int, now: float) -> None:
        """The contender `turn` is speech: the reply it began over stops, never the turn's own (a late
        partial can land after its speculative reply started)."""
        if self.reply is not None and self.reply.turn != turn:
            self.barge_in(now)

    def playing(self, now: float) -> bool:
        """Is a reply playing at the user's end, or has it just stopped (its echo may still come back)?"""
        return self.reply is not None and self.reply.playback.playing(now - ECHO_TAIL_S)

    @staticmethod
    def _interruptible(reply: Reply, now: float) -> bool:
        """Is `reply` still being made, or played?"""
        return reply.task is not None and not reply.task.done() or reply.playback.playing(now)

    def barge_in(self, now: float) -> None:
        """Stop the reply pending or playing (the user's speech, a Realtime `response.cancel`, a
        typed turn) and drop queued audio."""
        reply = self.reply
        if reply is None or not self._interruptible(reply, now):
            return
        if reply.task is not None and not reply.task.done():
            cancel(reply.task)
        self.session.stages.metrics.barge_ins.inc()
        session_log.info("session=%s turn=%d barge-in", self.session.id, reply.turn)
        self.emit(Clear(reply.turn, now))
        self.reply = None

    def audio_sent(self, turn: int, text: str, seconds: float) -> None:
        """The transport put a phrase's audio on the wire (called once per phrase)."""
        reply = self.reply
        if reply is None or reply.turn != turn:
            return
        now, playback = time.monotonic(), reply.playback
        if playback.started is None and not playback.apology_started():
            playback.started = now
            self.session.turns.heard()  # speech from now on is a new utterance, not the last one resumed
            self.emit(AudioSent(turn, now), wire=False, track=not reply.announcement)
        playback.sent(text, now, seconds)

    async def announce(self, text: str) -> None:
        """Say `text` between turns (a timer that is due): once nobody is speaking or being answered.
        The user talking over it interrupts it like a reply."""
        s = self.session
        while not s.closed and (s.busy or (self.reply is not None and self.reply.playback.playing(time.monotonic()))):
            await asyncio.sleep(0.2)
        if s.closed:
            return
        reply = self.reply = Reply(s.turn, task=asyncio.current_task(), announcement=True)
        reply.released.set()
        session_log.info("session=%s announces: %s", s.id, text)
        self.emit(Announcement(s.turn, time.monotonic(), text))
        try:
            await s.replies.announce(reply, text)
        finally:
            if self.reply is reply:
                self.reply = None

    # --- the sink (ReplySink) -----------------------------------------------------------------

    def emit(self, ev: Event, wire: bool = True, track: bool = True) -> bool:
        return self.session.emit(ev, wire, track)

    def is_current(self, turn: int) -> bool:
        """Is audio of `turn` still wanted (not cleared by a barge-in)?"""
        return self.reply is not None and self.reply.turn == turn

    def first_audio(self) -> None:
        """The reply's first audio is synthesised: nothing of ours is urgent any more."""
        self.session.stages.scheduler.stop_waiting(self.session)

    def fault(self, failure: StageFailure) -> None:
        """A stage failed or overran its timeout (for /healthz and the metrics)."""
        self.session.stages.fault(failure)
