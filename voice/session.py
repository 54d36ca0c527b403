"""One conversation: audio in -> VAD -> ASR -> LM -> TTS -> audio out, with barge-in and history.

    transport --push_audio--> TurnTaker (VAD, ASR, speculation)   voice/turns.py
              <--its turn events, dispatched in `_on_turn`
              --final transcript--> ReplyRunner (LM -> TTS)       voice/reply.py
              <--outbox-- events; audio_sent --> Playback ledger  voice/playback.py

Transports feed `push_audio` and drain `outbox`; they report what reached the wire with
`audio_sent`, which is how the session knows what the user actually heard. The session
knows nothing about wire formats, and the latency tracker only watches its events. The
TurnTaker returns what happened to the user's turn (voice/turns.py's events) and the session
acts on them in one place, `_on_turn`; a ReplyRunner sends its reply through the session as
its `ReplySink` (emit, first_audio, fault, is_current).

The parts beside the line: the call log (voice/calllog.py) writes each turn's row before its
`reply_done` is sent; the outbox (voice/outbox.py) is bounded; the history (voice/history.py)
is what the LM sees; `watch_session` (voice/limits.py) ends a session past its limits. A stage
that fails or overruns its timeout ends the turn with an `error` and a spoken apology, and the
session goes on (docs/RELIABILITY.md). `ending` is set when the session must end (a limit,
shutdown); the transport then closes the connection.

From the end of the user's speech until their reply's first audio is synthesised, the session
is listed as waiting with the service's `voice.scheduler.Scheduler`: every other session's
background work yields to it.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Coroutine
from typing import assert_never, cast

from voice.calllog import CallLog
from voice.config import Config
from voice.events import (Announcement, AudioSent, Clear, Error, Event, LatencyReport, ReplyDone, SpeechStarted,
                          SpeechStopped, Transcript)
from voice.faults import StageFailure, transcript_within
from voice.history import History
from voice.latency import LatencyTracker
from voice.limits import watch_session
from voice.outbox import Outbox
from voice.reply import Reply, ReplyRunner
from voice.stages import Stages
from voice.tools import Timers, with_results
from voice.turns import Final, Partial, Pause, SpeculationDropped, Started, Stopped, TooLong, TurnEvent, TurnTaker

log = logging.getLogger("voice.session")
CLOSE_WAIT_S = 1.0  # on close: time the cancelled replies get to record themselves before the rest is "abandoned"
_session_ids = itertools.count(1)


class Session:
    def __init__(self, stages: Stages, in_rate: int, out_rate: int, transport: str = "native",
                 system_prompt: str | None = None, lm_mode: str | None = None, principal: str = "anonymous",
                 peer: str = "", meta: dict | None = None, config: Config | None = None):
        cfg = config or stages.config  # a transport may adjust its own copy (Realtime turn detection)
        self.id = f"s{next(_session_ids)}"
        self.uid = secrets.token_hex(8)  # unique across processes (ids restart at s1): the call records' key
        self.stages, self.config, self.in_rate, self.out_rate = stages, cfg, in_rate, out_rate
        self.transport = transport
        self.outbox = Outbox(cfg.limits, stages.metrics.audio_dropped.labels(transport), self.id)
        self.call_log = CallLog(stages.records, self.uid, self.id, stages.metrics.errors)
        self.tracker = LatencyTracker(cfg.budget, stages.metrics, self.emit, self.id)
        self.history = History(system_prompt if system_prompt is not None else cfg.lm.system_prompt,
                               cfg.lm.history_turns, cfg.lm.max_prompt_chars)
        self.turns = TurnTaker(cfg, stages.whisper, in_rate, self.id)
        self.end_of_turn = stages.end_of_turn(cfg)
        self.judge_task: asyncio.Task | None = None  # the end-of-turn policy deciding about the current pause
        self.timers = Timers(self.announce, stages.tools.zone)
        self.replies = ReplyRunner(cfg, stages.lm.chat(), stages.synthesizer, out_rate, lm_mode,
                                   stages.apology.get(out_rate), self, self.id, stages.tools, self.timers)
        self.final_task: asyncio.Task | None = None  # handles the latest final transcript (then its reply)
        self.partial_tasks: set[asyncio.Task] = set()  # partial transcripts on their way to the client
        self.reply: Reply | None = None
        self.reply_tasks: set[asyncio.Task] = set()  # replies still running (a barge-in's too), for close()
        self.closed = False
        self.opened = self.last_audio = time.monotonic()
        self.ending = asyncio.Event()  # set when the session must end; the transport closes the connection
        self.end_reason = ""  # the error code that ended it
        self.close_code = 1000
        stages.metrics.sessions.labels(transport).inc()
        stages.live.add(self)
        self.call_log.opened(transport, principal, peer, {
            "in_rate": in_rate, "out_rate": out_rate, "lm_mode": lm_mode,
            "custom_system_prompt": system_prompt is not None, **(meta or {})})
        try:
            self.watchdog: asyncio.Task | None = asyncio.get_running_loop().create_task(watch_session(self))
        except RuntimeError:  # no event loop (a unit test building a bare session)
            self.watchdog = None
        else:
            self._spawn(self.replies.prepare(self.history.messages("")))
        log.info("session=%s open transport=%s in_rate=%d out_rate=%d principal=%s uid=%s", self.id, transport,
                 in_rate, out_rate, principal, self.uid)

    # --- the pipeline ---------------------------------------------------------------------------

    async def push_audio(self, pcm16: bytes) -> None:
        """PCM16LE mono at the session's input rate, any length: on to VAD and ASR."""
        self.last_audio = now = time.monotonic()
        self._on_turn(self.turns.push(pcm16, now))

    def _on_turn(self, events: list[TurnEvent]) -> None:
        """What the session does at each point of the user's turn (the TurnTaker's events, in order)."""
        for ev in events:
            match ev:
                case Started(turn, now, resumed):  # the user started talking: a reply still playing stops
                    if resumed and self.reply is not None:  # its words are in this turn's transcript too
                        self.reply.superseded = True
                    self.barge_in(now)
                    self.call_log.started(turn)
                    self.emit(SpeechStarted(turn, now))
                case Partial(turn, text):
                    task = asyncio.create_task(self._partial(turn, text))
                    self.partial_tasks.add(task)
                    task.add_done_callback(self.partial_tasks.discard)
                case Pause(turn, pause, audio, transcript):  # quiet a while: is the turn over?
                    if self.judge_task is not None:
                        self.judge_task.cancel()
                    self.judge_task = asyncio.create_task(self._judge(pause, audio, transcript))
                case SpeculationDropped():  # the user went on talking: the final and its reply are void
                    assert self.final_task is not None  # the speculative final's
                    self.final_task.cancel()
                    self._drop_speculation()
                case Stopped(turn, now, speech_end):
                    self.emit(SpeechStopped(turn, now, speech_end))
                case Final(turn, transcript, ended):
                    self.stages.scheduler.start_waiting(self)  # until the first audio, this user hears nothing
                    self.final_task = asyncio.create_task(self._finalise(turn, transcript, ended))
                case TooLong(limit):
                    self.error("utterance_too_long", f"speech longer than {limit:g} s is cut off here; the rest of "
                                                     "it is ignored until you pause")
                case _:
                    assert_never(ev)

    async def _judge(self, pause: int, audio, transcript: asyncio.Future[str] | None) -> None:
        """Ask the end-of-turn policy about a pause (with the early final's transcript, once decoded,
        for the LM's signal), and give the TurnTaker its verdict. A policy that fails leaves the
        turn to end at the ceiling."""
        text = None
        if transcript is not None and self.end_of_turn.reads_text:
            await asyncio.wait([transcript])
            if transcript.cancelled():
                return  # they spoke again: this pause is over
            text = None if transcript.exception() is not None else transcript.result()
        try:
            verdict = await self.end_of_turn.decide(audio, self.turns.endpointer.silence_ms, text, self._end_signal)
        except Exception as err:  # noqa: BLE001 - the VAD's ceiling still ends the turn
            log.warning("session=%s the end-of-turn policy failed: %r", self.id, err)
            return
        log.info("session=%s turn=%d end of turn at %d ms of silence: %s (p %s: audio %s, text %s), wait %d ms, "
                 "decided in %.0f ms", self.id, self.turn, self.turns.endpointer.silence_ms,
                 "done" if verdict.done else "not yet", _p(verdict.probability), _p(verdict.audio), _p(verdict.text),
                 verdict.wait_ms, verdict.spent_ms)
        self._on_turn(self.turns.verdict(pause, verdict, time.monotonic()))

    async def _end_signal(self, text: str) -> float | None:
        """The LM's probability that the user's turn ends after `text` (voice/endofturn.py)."""
        replies = self.replies
        tools = (replies.tools.openai() + replies.client_tools) or None
        return await replies.chat.end_of_turn_probability(self.history.messages(text)[:-1], text, tools)

    async def _partial(self, turn: int, text: Awaitable[str | None]) -> None:
        said = await text
        if said and self.turns.listening(turn):
            self.emit(Transcript(turn, time.monotonic(), said, False))

    async def _finalise(self, turn: int, transcript: Awaitable[str], ended: asyncio.Event) -> None:
        """The final transcript, then the reply. Speculatively (during the hangover, `ended` not
        set yet) the reply starts as soon as the transcript is known, held back until `ended`."""
        try:
            text = await transcript_within(transcript, self.config.faults)
        except StageFailure as failure:
            log.warning("session=%s turn=%d %s", self.id, turn, failure.message)
            await ended.wait()
            await self._asr_failed(turn, failure)
            return
        if turn != self.turn:
            self._unreplied(turn, text, "superseded")
            return
        reply = None
        if text and (self.config.session.speculative_reply or ended.is_set()):
            reply = self._start_reply(turn, text)
        await ended.wait()
        if turn != self.turn:  # the user spoke again in the same breath: a barge-in dropped the reply
            self._unreplied(turn, text, "superseded")
            return
        self.emit(Transcript(turn, time.monotonic(), text, True))
        self.call_log.transcript(turn, text)
        if text and reply is None:
            reply = self._start_reply(turn, text)
        if reply is not None:
            reply.released.set()
        else:
            self._unreplied(turn, "", "no_speech")

    def _start_reply(self, turn: int, user_text: str) -> Reply:
        reply = self.reply = Reply(turn)
        reply.task = self._spawn(self._respond(reply, user_text))
        return reply

    async def _respond(self, reply: Reply, user_text: str) -> None:
        try:
            await self.replies.run(reply, self.history.messages(user_text))
        finally:
            if reply.released.is_set():  # else a speculation that was dropped: it never happened
                await self._reply_done(reply, user_text, "ok" if reply.finished else "superseded" if reply.superseded
                                       else "failed" if reply.failure else "interrupted")

    async def _reply_done(self, reply: Reply, user_text: str, status: str) -> None:
        """Record the turn, then send its reply_done and latency (held back until the record is committed)."""
        self.stages.scheduler.stop_waiting(self)
        now = time.monotonic()
        heard = reply.text.strip() if reply.finished else reply.playback.heard(now)
        if user_text and not reply.superseded:  # (a superseded turn's words are in the next one's)
            self.history.add(user_text, heard)
        with self.outbox.holding() as held:
            self.emit(ReplyDone(reply.turn, now, reply.text.strip(), heard, not reply.finished))
        latency = next((e.to_wire() for e in held if isinstance(e, LatencyReport)), None)
        if latency is not None:
            latency.pop("type", None)
            latency.pop("turn", None)
        playback = reply.playback
        apologised = playback.apology_at is not None and playback.emitted > playback.apology_at
        if not await self.call_log.replied(reply.turn, status, user_text, reply.text.strip(), heard, not reply.finished,
                                           apologised, latency, [run.record() for run in reply.tools]):
            self.error("record_failed", "this turn could not be written to the call records")
        if not self.closed:
            self.outbox.release(held)

    # --- turns without a reply ----------------------------------------------------------------

    async def _asr_failed(self, turn: int, failure: StageFailure) -> None:
        """The turn ends with the error and the apology, unless the user has spoken again since."""
        if turn != self.turn:
            self.stages.fault(failure)
            self._unreplied(turn, "", "asr_failed")
            return
        reply = self.reply = Reply(turn, task=asyncio.current_task())
        reply.released.set()
        self.replies.fail(reply, failure)
        try:
            await reply.playback.played()
        finally:
            await self._reply_done(reply, "", "asr_failed")

    def _unreplied(self, turn: int, transcript: str, status: str) -> None:
        """A turn that ends without a reply_done: recorded without waiting."""
        self.stages.scheduler.stop_waiting(self)
        self.tracker.forget(turn)
        self.call_log.unreplied(turn, transcript, status)

    def _drop_speculation(self) -> None:
        self.stages.scheduler.stop_waiting(self)
        if self.reply is not None and not self.reply.released.is_set():
            assert self.reply.task is not None  # started with the reply
            self.reply.task.cancel()
            self.reply = None

    # --- the reply's sink (voice.reply.ReplySink): emit, is_current, and these -----------------

    def first_audio(self) -> None:
        """The reply's first audio is synthesised: nothing of ours is urgent any more."""
        self.stages.scheduler.stop_waiting(self)

    def fault(self, failure: StageFailure) -> None:
        """A stage failed or overran its timeout (for /healthz and the metrics)."""
        self.stages.fault(failure)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.reply_tasks.add(task)
        task.add_done_callback(self.reply_tasks.discard)
        return task

    # --- turns a client drives (the Realtime API) ----------------------------------------------

    def text_turn(self, text: str) -> int:
        """A turn typed instead of spoken: it is answered like a transcript. Its number."""
        now = time.monotonic()
        self.barge_in(now)
        turn = self.turns.new_turn()
        self.call_log.started(turn)
        self.call_log.transcript(turn, text)
        self.emit(Transcript(turn, now, text, True))
        self.stages.scheduler.start_waiting(self)
        self._start_reply(turn, text).released.set()
        return turn

    def answer_with(self, runs: list) -> int:
        """Ask the last question again with the outputs of the functions the client ran (Realtime
        function calling): a new turn, whose prompt folds them in as voice/tools.py does."""
        question = self.history.take_unanswered()
        folded = with_results([{"role": "user", "content": question}], runs)[-1]["content"]
        return self.text_turn(folded.strip())

    def end_speech(self) -> bool:
        """The client says the user stopped talking; False if nobody was."""
        events = self.turns.end_now(time.monotonic())
        self._on_turn(events)
        return bool(events)

    def clear_speech(self) -> None:
        """The client drops what the user said so far in this utterance."""
        self._on_turn(self.turns.clear(time.monotonic()))

    def cancel_reply(self) -> None:
        """The client cancels the reply in progress (as a barge-in would)."""
        self.barge_in(time.monotonic())

    # --- what the user hears ------------------------------------------------------------------

    def barge_in(self, now: float) -> None:
        """User speech while a reply is pending or playing: stop it and drop queued audio."""
        reply = self.reply
        if reply is None:
            return
        if reply.task is not None and not reply.task.done():
            self._cancel(reply.task)
        elif not reply.playback.playing(now):
            return
        self.stages.metrics.barge_ins.inc()
        log.info("session=%s turn=%d barge-in", self.id, reply.turn)
        self.emit(Clear(reply.turn, now))
        self.reply = None

    @staticmethod
    def _cancel(task: asyncio.Task) -> None:
        """Cancel a reply's task; one that has not begun yet (a response cancelled as soon as it was
        asked for) first takes its first step, so that its `finally` ends the turn with a reply_done."""
        if inspect.getcoroutinestate(cast(Coroutine, task.get_coro())) == inspect.CORO_CREATED:  # a coroutine's task
            asyncio.get_running_loop().call_soon(task.cancel)  # callbacks run in order: after that step
        else:
            task.cancel()

    def audio_sent(self, turn: int, text: str, seconds: float) -> None:
        """The transport put a phrase's audio on the wire (called once per phrase)."""
        reply = self.reply
        if reply is None or reply.turn != turn:
            return
        now, playback = time.monotonic(), reply.playback
        if playback.started is None and not playback.apology_started():
            playback.started = now
            self.turns.heard()  # speech from now on is a new utterance, not the last one resumed
            self.emit(AudioSent(turn, now), wire=False, track=not reply.announcement)
        playback.sent(text, now, seconds)

    async def announce(self, text: str) -> None:
        """Say `text` between turns (a timer that is due): once nobody is speaking or being answered.
        The user talking over it interrupts it like a reply."""
        while not self.closed and (self.busy or (self.reply is not None and
                                                 self.reply.playback.playing(time.monotonic()))):
            await asyncio.sleep(0.2)
        if self.closed:
            return
        reply = self.reply = Reply(self.turn, task=asyncio.current_task(), announcement=True)
        reply.released.set()
        log.info("session=%s announces: %s", self.id, text)
        self.emit(Announcement(self.turn, time.monotonic(), text))
        try:
            await self.replies.announce(reply, text)
        finally:
            if self.reply is reply:
                self.reply = None

    def is_current(self, turn: int) -> bool:
        """Is audio of `turn` still wanted (not cleared by a barge-in)?"""
        return self.reply is not None and self.reply.turn == turn

    # --- events and the session's end ---------------------------------------------------------

    def emit(self, ev: Event, wire: bool = True, track: bool = True) -> bool:
        """Send `ev` to the client (if `wire`) and show it to the latency tracker (if `track`).
        False if it was not queued: the session is closed, or the outbox refused it."""
        # Queued before the tracker sees it: a turn's latency report follows its reply_done.
        queued = wire and not self.closed and self.outbox.offer(ev)
        if wire and not queued and self.outbox.stalled:
            self.terminate("slow_client", f"the client is not reading: {self.outbox.qsize()} messages are "
                                          "waiting to be sent")
        if track:
            self.tracker.observe(ev)
        if isinstance(ev, Error):
            self.call_log.error(ev)
        return queued

    def error(self, code: str, message: str) -> None:
        self.emit(Error(self.turn, time.monotonic(), code, message))

    def terminate(self, code: str, message: str, close_code: int = 1008) -> None:
        """End the session from our side: an `error` with `code`, then the transport closes the
        connection (websocket close `close_code`, reason `code`; SIP BYE)."""
        if self.ending.is_set() or self.closed:
            return
        self.end_reason, self.close_code = code, close_code
        self.ending.set()
        self.stages.metrics.ended.labels(code).inc()
        self.emit(Error(self.turn, time.monotonic(), code, message))

    @property
    def turn(self) -> int:
        return self.turns.turn

    @property
    def busy(self) -> bool:
        """A turn is in flight: the user is speaking, or their turn is not done yet."""
        reply_task = self.reply.task if self.reply else None
        return (self.turns.speaking or (self.final_task is not None and not self.final_task.done())
                or (reply_task is not None and not reply_task.done()))

    async def close(self, reason: str = "closed") -> None:
        if self.closed:
            return
        self.closed = True
        self.stages.scheduler.stop_waiting(self)
        cancelled = []
        self.timers.cancel_all()
        for task in (*self.turns.close(), *self.partial_tasks, self.final_task, self.judge_task,
                     self.reply.task if self.reply else None, self.watchdog, *self.reply_tasks):
            if task is not None and not task.done() and task is not asyncio.current_task():
                task.cancel()
                cancelled.append(task)
        self.stages.metrics.sessions.labels(self.transport).dec()
        self.stages.live.discard(self)
        reason = self.end_reason or reason
        try:
            if cancelled and self.call_log.open_turns:  # a cancelled reply records its own turn (interrupted) first
                await asyncio.wait(cancelled, timeout=CLOSE_WAIT_S)
        finally:
            self.replies.chat.close()  # nobody continues the conversation: its LM cache goes back
            self.call_log.closed(reason, self.turn)
            log.info("session=%s closed (%s) after %d turns", self.id, reason, self.turn)


def _p(probability: float | None) -> str:
    return "-" if probability is None else f"{probability:.2f}"
