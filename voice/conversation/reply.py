"""One reply: LM blocks -> phrases -> synthesis -> reply events, each stage under its timeout.

One path for a phrase, in ReplyRunner's words: a block's text is added to the reply (`_add_text`),
each phrase it completes queued (`_queue_phrase`) for the reply's `_speaker` task, which
synthesises it and hands it over (`_synthesize_phrase`). `recite` feeds the same path with given
text (no LM); `announce` speaks one text whole (a timer that is due).

The LM streams blocks; a PhraseSplitter cuts them into phrases that a second task synthesises
while later blocks are still being decoded. A speculative reply (started on the transcript
taken during the VAD hangover) runs the same way, but nothing of it reaches the client until
`reply.released` is set (the user's turn really ended) and, when their words trail off, the Floor's
hold is over (`Floor.voiced`). A stage that fails or overruns its
timeout (`[faults]`) ends the reply with an `error` and the cached apology
(docs/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

from prometheus_client import Counter

from voice.pipeline.asr import backchannel, echoes, goes_on, has_words
from voice.conversation.calllog import CallLog
from voice.config import Config
from voice.pipeline.endofturn import EndOfTurn, hold_for, unfinished
from voice.events import (Announcement, AudioSent, Clear, Error, Event, ReplyDone, ReplyText, ToolCall, ToolResult,
                          TtsAudio, Work)
from voice.conversation.faults import StageFailure, blocks_within, synthesis_within
from voice.conversation.history import History
from voice.pipeline.lm import Chat
from voice.conversation.outbox import Outbox
from voice.conversation.playback import Playback
from voice.service.scheduler import TTS_HORIZON_S, Due, Scheduler
from voice.pipeline.tools import Timers, Toolbox, ToolRun, with_results
from voice.pipeline.tts import PhraseSplitter, SpeechSynthesizer
from voice.conversation.turns import TurnTaker

if TYPE_CHECKING:
    import numpy as np


class Send(Protocol):
    """The session's way out (voice/conversation/session.py's `emit`): to the client if `wire`, to the latency
    tracker if `track`; False if the client was not sent it."""

    def __call__(self, ev: Event, wire: bool = True, track: bool = True) -> bool: ...

# A reply whose audio is about to run out (nothing being synthesised, and less left to play than this
# margin, about one forward under load, plus what synthesising the words it has takes) speaks those words,
# at least this many, without waiting for the phrase's punctuation: a cut between words (its silence
# trimmed, voice/pipeline/tts.py) is heard less than a pause mid-sentence.
DRY_CUT_S, DRY_CUT_WORDS = 0.15, 3


@dataclass
class SynthesisPace:
    """How long a phrase takes from asking for its synthesis to its audio, queue included, per character
    of it and `FIXED_CHARS` more (a call's own cost): on two idle cores ~2 ms, beside two other talkers'
    replies 4-6 ms (tests/speech). Learned from each phrase a session synthesises while its listener's
    audio runs low (as a dry cut's is), quick to rise and slow to fall: a cut a little early costs a seam,
    one too late a silence."""

    FIXED_CHARS: ClassVar[int] = 10
    per_char_s: float = 0.004

    def seconds(self, text: str) -> float:
        return self.per_char_s * (len(text) + self.FIXED_CHARS)

    def took(self, text: str, seconds: float) -> None:
        measured = seconds / (len(text) + self.FIXED_CHARS)
        self.per_char_s += (measured - self.per_char_s) * (0.5 if measured > self.per_char_s else 0.1)

log = logging.getLogger("voice.reply")
session_log = logging.getLogger("voice.session")  # the Floor logs as the session it is part of
ECHO_TAIL_S = 0.3  # after a reply has played, its echo (a room's reverberation, a client's buffer) may still come back
ECHO_PART = 0.3  # speech over a reply this much of whose power the reply explains is its echo (`Floor.echo_heard`)
ECHO_RECHECK_S = 0.1  # how often speech found to be the reply's echo is heard again


@dataclass
class Reply:
    turn: int
    text: str = ""
    user_text: str = ""  # what it answers (a turn that resumes it must say more to be the user going on)
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
    hold_s: float = 0.0  # its first audio waits for this much silence after the user's last word (Floor.voiced)
    unfinished: str | None = None  # why the words it answers may be unfinished (endofturn.unfinished), if spoken
    sounds_finished: asyncio.Future[float | None] | None = None  # a list's: Smart Turn on the utterance (Floor.voiced)
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

    async def voiced(self, reply: Reply) -> None:
        """Until `reply` may be heard: released, and its hold (if any) over."""
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
        self.pace = SynthesisPace()  # how soon a reply about to run dry must cut its next phrase
        # A session that serves requests (voice/conversation/oneshot.py): its LM replies are text only, and the
        # conversation is its caller's (nothing is prepared ahead in it).
        self.requests = requests

    async def prepare(self, messages: list[dict], chat: Chat | None = None, aside: bool = False) -> None:
        """The LM prefills `messages` ahead of the reply that will start with them: the session's
        start, the words heard so far, the next turn's conversation (best effort). `chat`: the
        conversation, if not the session's own; `aside`: into its cache aside (`Chat.prepare`)."""
        if self.requests:
            return
        try:
            await (chat or self.chat).prepare(messages, (self.tools.openai() + self.client_tools) or None, aside)
        except Exception as err:  # noqa: BLE001 - the reply will simply prefill it itself
            log.warning("session=%s preparing the LM failed: %r", self.name, err)

    async def prepare_next(self, reply: Reply, after: Callable[[str], History], chat: Chat | None = None) -> None:
        """Once the decoded reply is released to the user, prefill the conversation the next turn
        will start from. When the history forgets its oldest turns the prompt's start changes, and
        without this the next turn would prefill the whole conversation again while the user waits
        (a first block of 1.4-1.5 s instead of 0.35 s, every fourth turn on two cores); and the turns
        it will keep then are read aside as they end (`History.kept`), so that this prefill, when it
        comes, reads one turn, not three (three talkers on two cores often leave it no time)."""
        await reply.released.wait()
        later = after(reply.text.strip())
        await self.prepare(later.messages(""), chat)
        if kept := later.kept():
            await self.prepare(kept, chat, aside=True)

    async def run(self, reply: Reply, messages: list[dict],
                  after: Callable[[str], History] | None = None, chat: Chat | None = None) -> None:
        """The whole reply, until the client has played it (a barge-in cancels this task).
        `after(text)`: the history once this reply is heard whole; the LM prefills the next turn's
        conversation as soon as the reply is decoded, while it is spoken (`prepare_next`). `chat`: the
        conversation it is a turn of, if not the session's own (Wyoming's answer)."""
        phrases: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speaker(reply, phrases))
        try:
            try:
                await self._generate(reply, messages, phrases, speaker, chat or self.chat)
                phrases.put_nowait(None)
                if after is not None and not reply.tools:
                    self.sink.spawn(self.prepare_next(reply, after, chat))
                await speaker
            except StageFailure as failure:
                speaker.cancel()
                await self.sink.voiced(reply)
                self.fail(reply, failure)
            except Exception as err:  # a bug of ours: the same treatment as a failing stage
                speaker.cancel()
                log.exception("session=%s turn=%d reply failed", self.name, reply.turn)
                await self.sink.voiced(reply)
                self.fail(reply, StageFailure("reply_failed", f"the reply failed: {err}", "session", "error"))
            await reply.released.wait()
            await reply.playback.played()  # until then a barge-in still interrupts it
            reply.finished = reply.failure is None
        except asyncio.CancelledError:
            speaker.cancel()
            raise

    async def _generate(self, reply: Reply, messages: list[dict], phrases: asyncio.Queue,
                        speaker: asyncio.Task, chat: Chat) -> None:
        """LM blocks -> reply events and phrases for the speaker. A reply that calls tools is not
        spoken: the calls run and the model answers again with their results (voice/pipeline/tools.py)."""
        splitter = PhraseSplitter(self.config.tts.min_chars, self.config.tts.first_words,
                                  self.config.tts.max_phrase_chars)
        offered = (self.tools.openai() + self.client_tools) or None
        calls = await self._blocks(reply, chat, messages, splitter, phrases, speaker, offered)
        theirs = {t["function"]["name"] for t in self.client_tools}
        if any(c["function"]["name"] in theirs for c in calls):
            await self._hand_over(reply, [c for c in calls if c["function"]["name"] in theirs])
        elif calls:
            runs = await self._use_tools(reply, calls, phrases)
            await self._blocks(reply, chat, with_results(messages, runs), splitter, phrases, speaker, None)
        elif offered and not reply.text:  # a call cut off by max_new_tokens: answer without tools
            log.warning("session=%s turn=%d the LM's tool call was incomplete; answering without tools",
                        self.name, reply.turn)
            await self._blocks(reply, chat, messages, splitter, phrases, speaker, None)
        if rest := splitter.flush():
            self._queue_phrase(reply, rest, phrases)

    async def _blocks(self, reply: Reply, chat: Chat, messages: list[dict], splitter: PhraseSplitter,
                      phrases: asyncio.Queue, speaker: asyncio.Task, tools: list[dict] | None) -> list[dict]:
        """One LM reply, each block under its timeout; the tool calls it makes instead of text, if any."""
        limit = self.config.limits.max_reply_chars
        # The listener waits in silence until the first phrase is decoded (the LM knows before we do:
        # then its next forward would share the cores with that phrase's synthesis); then the LM's
        # deadline is when the audio on the wire runs out (none while the first phrase is synthesised).
        reply.did("lm_asked")

        def runs_out(text: str) -> float:
            if not (reply.phrased or splitter.would_phrase(text)):
                return -math.inf
            end = reply.playback.end()
            return math.inf if end is None else end
        stream = chat.reply(messages, self.lm_mode, runs_out=runs_out, tools=tools)
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
                        if not complete and reply.phrased and not reply.unvoiced and reply.playback.runs_dry(
                                time.monotonic(), DRY_CUT_S + self.pace.seconds(splitter.pending)):
                            complete = splitter.words(DRY_CUT_WORDS)
                        self._add_text(reply, block.text, complete, phrases)
                        await self.sink.voiced(reply)
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
    def _add_text(reply: Reply, text: str, complete: list[str], phrases: asyncio.Queue) -> None:
        """`text` is the reply's next block; `complete` the phrases it completes, for the speaker."""
        reply.blocks += 1
        reply.text += text
        for phrase in complete:
            ReplyRunner._queue_phrase(reply, phrase, phrases)

    @staticmethod
    def _queue_phrase(reply: Reply, phrase: str, phrases: asyncio.Queue) -> None:
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
            await self.sink.voiced(reply)
            cfg = self.config.tools
            _, pending = await asyncio.wait(tasks, timeout=cfg.filler_ms / 1000)
            if pending and cfg.filler.strip() and not any(self.tools.speaks(run.name) for run in runs):
                filler = cfg.filler.strip()
                self._add_text(reply, filler + " ", [filler], phrases)  # a phrase of its own
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
        await self.sink.voiced(reply)
        for call in calls:
            run = ToolRun.of(call)
            run.status, run.result = "client", "run by the client"
            reply.tools.append(run)
            self.sink.emit(ToolCall(reply.turn, time.monotonic(), run.id, run.name, run.arguments))

    async def _run_tool(self, reply: Reply, run: ToolRun) -> None:
        """A pure tool runs at once (also during a speculation); one that acts only once the turn is real
        and the reply may be heard (not while it is held: the user may yet go on)."""
        work = asyncio.ensure_future(self.tools.run(run, self.timers)) if self.tools.pure(run.name) else None
        try:
            await self.sink.voiced(reply)
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
        """Speak `texts` as they come, no LM (voice/conversation/oneshot.py's speak): phrase by phrase, each next
        one handed over once the last is on the wire, so a client that reads slowly holds the
        synthesis back rather than the outbox dropping its audio."""
        tts = self.config.tts
        splitter = PhraseSplitter(tts.min_chars, tts.first_words, tts.max_phrase_chars)
        phrases: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speaker(reply, phrases, paced=True))
        try:
            async for text in texts:
                self._add_text(reply, text, splitter.push(text), phrases)
                if text:
                    self.sink.emit(ReplyText(reply.turn, time.monotonic(), text, reply.blocks))
            self._queue_phrase(reply, splitter.flush(), phrases)
            phrases.put_nowait(None)
            await speaker
            reply.finished = True
        except StageFailure as failure:
            self.fail(reply, failure)
        finally:
            speaker.cancel()

    async def _speaker(self, reply: Reply, phrases: asyncio.Queue, paced: bool = False) -> None:
        """The reply's speaker task: each queued phrase synthesised and handed over, in order, until None."""
        while (phrase := await phrases.get()) is not None:
            try:
                await self._synthesize_phrase(reply, phrase, paced)
            finally:
                reply.unvoiced -= 1

    async def _synthesize_phrase(self, reply: Reply, phrase: str, paced: bool) -> None:
        """One phrase: synthesised and handed to the transport."""
        if not phrase.strip():
            return
        if self.requests and not paced:  # a text-only reply: its first phrase is its first output
            self.sink.first_audio()
            return
        playback = reply.playback
        reply.did("tts_asked")
        asked, urgent = time.monotonic(), Due(playback.runs_out, TTS_HORIZON_S)
        hurried = urgent()  # else it may be held behind others' urgent phrases: not what a dry cut waits for
        pcm = await synthesis_within(self.synthesizer, phrase, self.out_rate, self.config.faults, urgent=urgent)
        if hurried:
            self.pace.took(phrase, time.monotonic() - asked)
        reply.did("tts_first_audio")
        self.sink.first_audio()
        await self.sink.voiced(reply)
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
    """The assistant's side of one conversation (voice/conversation/session.py): the reply that has the floor,
    from its start to its record, what of it reaches the wire and is heard, the user talking over
    it (barge-in), and announcements between turns. It is its ReplyRunner's sink.

    It gets the session's parts it works with, never the Session: the user's turns (whose turn it
    is, when they heard us), the history, the outbox, the call log, the scheduler (where the
    session's `name` waits), and `send`, the session's way to the client and the latency tracker.
    What the session asks of it at a point of the user's turn (`speech_started`, `talked_over`,
    `barge_in`, `audio_sent`) returns the events to send, as the TurnTaker's `push` does; the
    replies it runs as tasks send theirs as they go."""

    def __init__(self, name: str, turns: TurnTaker, history: History, outbox: Outbox, call_log: CallLog,
                 scheduler: Scheduler, send: Send, fault: Callable[[StageFailure], None], barge_ins: Counter,
                 end_of_turn: EndOfTurn | None = None):
        """`end_of_turn`: the session's policy, whose Smart Turn hears whether a list said is finished (`voiced`)."""
        self.name, self.turns, self.history, self.outbox, self.call_log = name, turns, history, outbox, call_log
        self.scheduler, self.send, self.fault, self.barge_ins = scheduler, send, fault, barge_ins
        self.end_of_turn = end_of_turn
        self.replies: ReplyRunner  # the session's, whose sink this is: set once both are built
        self.reply: Reply | None = None
        self.tasks: set[asyncio.Task] = set()  # replies still running (a barge-in's too), for close()
        self.contender: int | None = None  # the user's turn begun over a reply: a barge-in once it is speech
        self.echo_checked: tuple[int, float] | None = None  # the last turn heard as the reply's echo, and when
        # The turn that may go on with the unheard reply's utterance (SpeechStarted.resumes): the user's or
        # the room's? Until `resume_decided` is set the reply is not voiced, nor dropped (`speech_started`).
        self.resuming: int | None = None
        self.resume_decided = asyncio.Event()
        self.closed = False

    def start(self, turn: int, user_text: str, history: History | None = None, chat: Chat | None = None,
              spoken: bool = False) -> Reply:
        """The reply to `user_text`, a turn of the session's conversation, or of the one `history`
        and `chat` hold (Wyoming's answer: the caller keeps it). `spoken`: the user said it (and may
        go on after a pause), not typed it: words that trail off hold its first audio (`voiced`)."""
        reply = self.reply = Reply(turn, user_text=user_text)
        self._resume_decided()
        turn_config = self.turns.config.turn
        if spoken:
            reply.unfinished = unfinished(user_text)
            # (a list's hold, until Smart Turn is heard in `voiced`, is the longest; it hears it beside the reply)
            hold_ms = hold_for(reply.unfinished, None, turn_config.hold_ms, turn_config.hold_unmarked_ms)
            reply.hold_s = max(hold_ms, turn_config.voice_after_ms) / 1000
            audio = self._utterance(turn)
            if reply.unfinished == "open_list" and self.end_of_turn is not None and audio is not None:
                reply.sounds_finished = asyncio.ensure_future(self.end_of_turn.sounds_finished(audio))
        reply.task = self.spawn(self._respond(reply, user_text, history or self.history, chat))
        return reply

    async def _respond(self, reply: Reply, user_text: str, history: History, chat: Chat | None) -> None:
        try:
            await self.replies.run(reply, history.messages(user_text), functools.partial(history.after, user_text),
                                   chat)
        finally:
            if reply.released.is_set():  # else a speculation that was dropped: it never happened
                await self._reply_done(reply, user_text, "ok" if reply.finished else "superseded" if reply.superseded
                                       else "failed" if reply.failure else "interrupted", history)

    async def _reply_done(self, reply: Reply, user_text: str, status: str, history: History | None = None) -> None:
        """Record the turn, then send its reply_done and latency (held back until the record is committed)."""
        self.scheduler.stop_waiting(self.name)
        now = time.monotonic()
        heard = reply.text.strip() if reply.finished else reply.playback.heard(now)
        # (a superseded turn's words are in the next one's; a refused one's, too long for the LM or
        # not for it at all, would have every later turn refused too: the client is told it is gone)
        refused = reply.failure is not None and reply.failure.kind == "client"
        if user_text and not reply.superseded and not refused:
            (history or self.history).add(user_text, heard)
        self.send(Work(reply.turn, now, reply.work), wire=False)
        with self.outbox.holding() as held:
            self.send(ReplyDone(reply.turn, now, reply.text.strip(), heard, not reply.finished))
        playback = reply.playback
        if not await self.call_log.reply_done(
                reply.turn, status, user_text, reply.text.strip(), heard, not reply.finished,
                playback.apology_at is not None and playback.emitted > playback.apology_at,
                [run.record() for run in reply.tools], held):
            self.send(Error(reply.turn, time.monotonic(), "record_failed",
                            "this turn could not be written to the call records"))
        if not self.closed:
            self.outbox.release(held)

    def recite(self, turn: int, texts: AsyncIterator[str]) -> Reply:
        """A reply that speaks `texts` as they come (Wyoming's speak), recorded as any."""
        reply = self.reply = Reply(turn)
        reply.released.set()
        reply.task = self.spawn(self._recited(reply, texts))
        return reply

    async def _recited(self, reply: Reply, texts: AsyncIterator[str]) -> None:
        try:
            await self.replies.recite(reply, texts)
        finally:
            await self._reply_done(reply, "", "ok" if reply.finished else "failed" if reply.failure
                                   else "interrupted")

    async def listened(self, turn: int, transcript: str) -> None:
        """A turn that only listens (Wyoming's listen) ends at its final transcript: recorded
        with it, its reply_done and latency report sent, nothing said."""
        reply = Reply(turn, finished=True)
        reply.released.set()
        await self._reply_done(reply, transcript, "ok")

    async def asr_failed(self, turn: int, failure: StageFailure) -> None:
        """The current turn ends with the error and the apology (the reply to an utterance it may have
        gone on with is dropped: no second voice)."""
        if turn == self.resuming and self.reply is not None:
            self.reply.superseded = True
            for ev in self.barge_in(time.monotonic()):
                self.send(ev)
        reply = self.reply = Reply(turn, task=asyncio.current_task())
        reply.released.set()
        self.replies.fail(reply, failure)
        try:
            await reply.playback.played()
        finally:
            await self._reply_done(reply, "", "asr_failed")

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def close(self) -> list[asyncio.Task]:
        """The session closes: nothing more is released to its outbox. The tasks to cancel."""
        self.closed = True
        return [*self.tasks, *([self.reply.task] if self.reply is not None and self.reply.task else [])]

    # --- what the user hears ------------------------------------------------------------------

    def speech_started(self, turn: int, now: float, resumes: int) -> list[Event]:
        """The user started talking. Going on with the utterance whose reply they have not heard yet, this
        turn is resuming it: that reply is neither voiced nor dropped until the turn is the user's (`talked_over`:
        `turn.barge_in_ms` of speech loud like them, or words beyond the reply's turn's, `heard_words`), when
        it stops (its words are in this turn's transcript too), or ends without (the room's talk: `not_resumed`).
        Over any other reply still pending or playing, this turn is a contender: it stops the reply only once
        it is speech, so a VAD blip (a knock, a breath, a microphone's processing noise) leaves it playing."""
        reply, self.contender = self.reply, None
        if self.resuming is not None and resumes != self.resuming:  # it ended (its final late, superseded by
            self._resume_decided()  # this turn) without being the user, and this turn does not go on with it
        if reply is not None and resumes and resumes in (reply.turn, self.resuming):  # (or the turn resuming it)
            self.resuming = turn
            self.resume_decided.clear()
            return []
        if reply is not None and self._interruptible(reply, now):
            self.contender = turn
        return []

    def talked_over(self, turn: int, now: float) -> list[Event]:
        """`turn` is speech (voice/conversation/turns.py's Talking, or words heard: `heard_words`): if it is the
        contender, the reply it began over stops, never the turn's own (a late partial can land
        after its speculative reply started); if it is resuming the reply's utterance, that reply is dropped."""
        reply = self.reply
        if turn == self.resuming and reply is not None:
            reply.superseded = True
            return self.barge_in(now)
        if turn == self.contender and reply is not None and reply.turn != turn:
            return self.barge_in(now)
        return []

    def echo_heard(self, turn: int, heard: np.ndarray, now: float) -> bool:
        """Is the speech `turn` began over the reply, `heard` lately (`TurnTaker.heard_lately`, its last sample
        come `now`), that reply's own echo? It is when the reply explains ECHO_PART of its power (`Playback.echo_of`).
        On a speakerphone an echo canceller that loses the echo's path (its delay or level changed) lets ~1 s of
        it through while it adapts again, as loud as no canceller, and the level gate, which learnt the converged
        canceller's quiet residue, takes it for speech (600 ms of it cut a reply), and Whisper may hear words in
        it ("I'm sure." for "I'm sorry": bench/mic_echo_live.py). The user talking over the reply, even over its
        full echo, is not explained by it. Asked again every ECHO_RECHECK_S while it holds (the user may start)."""
        reply = self.reply
        if reply is None or turn != self.contender or reply.turn == turn:
            return False
        checked = self.echo_checked
        if checked is not None and checked[0] == turn and now - checked[1] < ECHO_RECHECK_S:
            return True  # (heard as the echo a moment ago)
        part = reply.playback.echo_of(heard, now)
        if part < ECHO_PART:
            return False
        if checked is None or checked[0] != turn:
            session_log.info("session=%s turn=%d its speech is turn %d's reply's echo (%.2f): no barge-in", self.name,
                             turn, reply.turn, part)
        self.echo_checked = (turn, now)
        return True

    def not_resumed(self, turn: int, resumes: int) -> int:
        """`turn`, resuming the utterance `resumes` (its SpeechStarted's), ended without being the user:
        its reply is voiced after all, and speech that resumes now resumes that utterance still. What the
        turn's final resumes (0: none)."""
        if turn != self.resuming or self.reply is None:
            return resumes
        self._resume_decided()
        self.turns.resumes_instead(turn, self.reply.turn)
        session_log.info("session=%s turn=%d no words beyond turn %d's: its reply goes on", self.name, turn,
                         self.reply.turn)
        return 0

    def _resume_decided(self) -> None:
        self.resuming = None
        self.resume_decided.set()

    def heard_words(self, turn: int, text: str, final: bool = False) -> bool:
        """`turn`'s transcript so far (`final`: all of it) is `text`: is it a turn to answer? One begun over
        a reply must hold words, not Whisper's near-silence "you" (voice/pipeline/asr.py's has_words), nor only a
        listener's "yeah" or "okay" (`backchannel`: what an echo canceller's residue is heard as, too), nor mostly
        the reply's own (its echo through a speakerphone: `echoes`, the apology's words included once it
        played), and then it talks over the reply (`talked_over`); else it is no speech, and the reply goes
        on. One resuming the utterance of a reply not heard yet must hold more words than that utterance
        (`goes_on`: the same words are the room's talk, or a blip, heard with the carried audio)."""
        reply = self.reply
        if turn == self.resuming and reply is not None:
            return goes_on(text, reply.user_text)
        if turn != self.contender:
            return True
        if not has_words(text) or backchannel(text):
            return False
        if reply is None:
            return True
        said = f"{reply.text} {self.turns.config.faults.apology}" if reply.failure else reply.text
        return not echoes(text, said, final)

    def playing(self, now: float, echo_tail_s: float = ECHO_TAIL_S) -> bool:
        """Is a reply playing at the user's end, or has it just stopped (its echo may still come back)?"""
        return self.reply is not None and self.reply.playback.playing(now - echo_tail_s)

    def replying(self) -> bool:
        """A reply is being made or played."""
        return self.reply is not None and self.reply.task is not None and not self.reply.task.done()

    @staticmethod
    def _interruptible(reply: Reply, now: float) -> bool:
        """Is `reply` still being made, or played?"""
        return reply.task is not None and not reply.task.done() or reply.playback.playing(now)

    def barge_in(self, now: float) -> list[Event]:
        """Stop the reply pending or playing (the user's speech, a Realtime `response.cancel`, a
        typed turn): the client drops its queued audio (a `Clear`)."""
        reply = self.reply
        if reply is None or not self._interruptible(reply, now):
            return []
        if reply.task is not None and not reply.task.done():
            cancel(reply.task)
        self.barge_ins.inc()
        session_log.info("session=%s turn=%d barge-in", self.name, reply.turn)
        self.reply = None
        self._resume_decided()
        return [Clear(reply.turn, now)]

    def audio_sent(self, turn: int, text: str, seconds: float, audio: np.ndarray | None = None) -> list[Event]:
        """The transport put a phrase's audio on the wire (called once per phrase): at the first,
        an `AudioSent` for the latency tracker (none for an announcement: no latency of its own).
        `audio`: the phrase's at playback.ECHO_RATE, for its echo (`echo_heard`)."""
        reply = self.reply
        if reply is None or reply.turn != turn:
            return []
        now, playback = time.monotonic(), reply.playback
        out: list[Event] = []
        if playback.started is None and not playback.apology_started():
            playback.started = now
            self.turns.heard()  # speech from now on is a new utterance, not the last one resumed
            out = [] if reply.announcement else [AudioSent(turn, now)]
        playback.sent(text, now, seconds, audio)
        return out

    async def announce(self, text: str) -> None:
        """Say `text` now (a timer that is due; the session waits until nobody is speaking or being
        answered). The user talking over it interrupts it like a reply."""
        reply = self.reply = Reply(self.turns.turn, task=asyncio.current_task(), announcement=True)
        reply.released.set()
        session_log.info("session=%s announces: %s", self.name, text)
        self.send(Announcement(reply.turn, time.monotonic(), text))
        try:
            await self.replies.announce(reply, text)
        finally:
            if self.reply is reply:
                self.reply = None

    # --- the sink (ReplySink) -----------------------------------------------------------------

    def emit(self, ev: Event, wire: bool = True, track: bool = True) -> bool:
        return self.send(ev, wire, track)

    def is_current(self, turn: int) -> bool:
        """Is audio of `turn` still wanted (not cleared by a barge-in)?"""
        return self.reply is not None and self.reply.turn == turn

    def first_audio(self) -> None:
        """The reply's first audio is synthesised: nothing of ours is urgent any more."""
        self.scheduler.stop_waiting(self.name)

    async def voiced(self, reply: Reply) -> None:
        """Until `reply` may be heard: released (the user's turn is over) and, if their words may be unfinished
        (`Reply.hold_s`: "Set a timer for.", `endofturn.hold_for`), until they have been quiet `turn.hold_ms`
        (`turn.hold_unmarked_ms` for words that only lack an end mark; a list only if Smart Turn does not hear it
        finished; any reply:
        `turn.voice_after_ms`, if set). A pause mid-sentence
        ends the turn at the VAD's hangover; if the user goes on within the hold, their turn resumes
        (`speech_started`) and this reply, prepared, is dropped unheard once that is the user. While a turn
        that may be them resuming is undecided (`resuming`), nothing of the reply is voiced either.
        BENCHMARKS.md "Heard in a room"."""
        await reply.released.wait()
        await self._undecided(reply)
        if not reply.hold_s:
            return
        if not self.turns.resumable(reply.turn, time.monotonic()):  # (the client ended it: nothing to wait for)
            reply.hold_s = 0.0
            await self._undecided(reply)
            return
        if reply.sounds_finished is not None:  # (never waited for past the hold it may lift)
            left = self.turns.last_word_at + reply.hold_s - time.monotonic()
            await self._hear_the_list(reply, reply.sounds_finished, max(left, 0.0))
            reply.sounds_finished = None
        delay = self.turns.last_word_at + reply.hold_s - time.monotonic()
        if delay > 0:
            reply.did("held")
            await asyncio.sleep(delay)
        if reply.hold_s:
            reply.hold_s = 0.0
            session_log.info("session=%s turn=%d held until %.0f ms after the last word: voiced after %.0f ms more",
                             self.name, reply.turn, (time.monotonic() - self.turns.last_word_at) * 1000,
                             max(delay, 0) * 1000)
        await self._undecided(reply)

    def _utterance(self, turn: int) -> np.ndarray | None:
        """The audio of `turn`'s utterance so far, its silence included (None: not at hand)."""
        last = self.turns.last_utterance
        if last is not None and last[2] == turn:
            return last[0]
        audio = self.turns.transcriber.audio() if turn == self.turns.turn else None
        return audio if audio is not None and len(audio) else None

    async def _hear_the_list(self, reply: Reply, sounds_finished: asyncio.Future[float | None],
                             within_s: float) -> None:
        """A list not closed ("Eight of spades, four of clubs, seven of hearts."): its hold stands only if Smart
        Turn, heard `within_s`, does not hear the utterance as finished (`endofturn.hold_for`)."""
        try:
            heard = await asyncio.wait_for(asyncio.shield(sounds_finished), within_s)
        except TimeoutError:  # the hold is over before Smart Turn is: it has cost nothing more
            return
        except Exception as err:  # noqa: BLE001 - the hold stands, as it did without the model
            session_log.warning("session=%s turn=%d Smart Turn failed on a list: %r", self.name, reply.turn, err)
            return
        config = self.turns.config.turn
        hold_ms = hold_for(reply.unfinished, heard, config.hold_ms, config.hold_unmarked_ms)
        reply.hold_s = max(hold_ms, config.voice_after_ms) / 1000
        session_log.info("session=%s turn=%d a list Smart Turn hears %s finished: held %d ms", self.name, reply.turn,
                         "-" if heard is None else f"{heard:.2f}", hold_ms)

    async def _undecided(self, reply: Reply) -> None:
        """Until no turn that may be the user going on with `reply`'s utterance is undecided."""
        while self.resuming is not None and self.reply is reply:
            reply.did("resuming")
            await self.resume_decided.wait()
