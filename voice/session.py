"""One conversation: audio in -> VAD -> ASR -> LM -> TTS -> audio out, with barge-in and history.

    transport --push_audio--> TurnTaker (VAD, ASR, speculation)   voice/turns.py
              --final transcript--> ReplyRunner (LM -> TTS)       voice/reply.py
              <--outbox-- events; audio_sent --> Playback ledger  voice/playback.py

Transports feed `push_audio` and drain `outbox`; they report what reached the wire with
`audio_sent`, which is how the session knows what the user actually heard. The session
knows nothing about wire formats, and the latency tracker only watches its events.

Reliability (docs/RELIABILITY.md): each stage runs under a timeout (`[faults]`); a stage that
fails or overruns ends the turn with an `error` and a short spoken apology (synthesised once
at start-up), and the session goes on. Every turn is written to the call records before its
`reply_done` is sent. The outbox is bounded (`[limits]`): reply audio for a client that reads
too slowly is dropped, and past a hard limit the session ends. `ending` is set when the
session must end (a limit, shutdown); the transport then closes the connection.

From the end of the user's speech until their reply's first audio is synthesised, the session
is listed as waiting with the service's `voice.scheduler.Scheduler`: every other session's
background work yields to it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time

from voice import records as rec
from voice.asr import Whisper
from voice.audio import RATES, float_to_int16, resample
from voice.config import Config
from voice.events import (AudioSent, Clear, Error, Event, LatencyReport, ReplyDone, SpeechStarted, SpeechStopped,
                          Transcript, TtsAudio)
from voice.latency import LatencyTracker, Metrics
from voice.limits import Admission
from voice.lm import load_lm
from voice.reply import Reply, ReplyRunner, StageFailure
from voice.scheduler import Scheduler
from voice.tts import Synthesizer, load_voice
from voice.turns import TurnHooks, TurnTaker

log = logging.getLogger("voice.session")
FAULT_WINDOW_S = 60.0  # /healthz says "degraded" for this long after a stage failed or timed out
CLOSE_WAIT_S = 1.0  # on close: time the cancelled replies get to record themselves before the rest is "abandoned"
_session_ids = itertools.count(1)


class Stages:
    """The models and the service-wide state every session shares (each stage queues its own work).
    Built from its parts, so tests can pass fakes; `Stages.load(config)` loads the real models."""

    def __init__(self, config: Config, whisper, synthesizer, lm, scheduler: Scheduler | None = None):
        self.config = config
        self.whisper, self.synthesizer, self.lm = whisper, synthesizer, lm
        self.scheduler = scheduler or Scheduler()
        self.metrics = Metrics()
        self.apology = apologies(synthesizer, config.faults.apology)
        self.admission = Admission(config.limits, self.metrics)
        self.records: rec.Records | None = None  # the app opens them (voice.server)
        self.live: set[Session] = set()  # open sessions
        self.faults: dict[str, tuple[float, str]] = {}  # stage -> (monotonic time, what) of its last fault

    @classmethod
    def load(cls, config: Config) -> "Stages":
        t = time.perf_counter()
        scheduler = Scheduler()
        stages = cls(config, Whisper(config.asr, scheduler.worker("asr")),
                     Synthesizer(load_voice(config.tts), config.tts, scheduler.worker("tts")),
                     load_lm(config.lm, scheduler), scheduler)
        weights = stages.lm.engine.loaded.weights if config.lm.backend == "local" else "remote"
        log.info("models loaded in %.1f s (lm backend=%s model=%s weights=%s mode=%s)", time.perf_counter() - t,
                 config.lm.backend, config.lm.model, weights, config.lm.mode)
        return stages

    def recent_faults(self, window_s: float = FAULT_WINDOW_S) -> dict[str, str]:
        now = time.monotonic()
        return {stage: what for stage, (t, what) in self.faults.items() if now - t < window_s}


def apologies(synthesizer: Synthesizer, text: str) -> dict[int, bytes]:
    """The apology as PCM16 at every rate a client may ask for: synthesised once, resampled per rate."""
    if not text.strip():
        return {}
    pcm = synthesizer._render(text, synthesizer.voice_rate)
    audio = pcm.astype("float32") / 32768.0
    return {rate: float_to_int16(resample(audio, synthesizer.voice_rate, rate)).astype("<i2").tobytes()
            for rate in RATES}


class Outbox(asyncio.Queue):
    """The session's outgoing events; keeps a tally of the reply audio it holds."""

    def _init(self, maxsize):
        super()._init(maxsize)
        self.audio_s = 0.0

    def _put(self, item):
        super()._put(item)
        if isinstance(item, TtsAudio):
            self.audio_s += item.seconds

    def _get(self):
        item = super()._get()
        if isinstance(item, TtsAudio):
            self.audio_s = max(self.audio_s - item.seconds, 0.0)
        return item


class Session:
    def __init__(self, stages: Stages, in_rate: int, out_rate: int, transport: str = "native",
                 system_prompt: str | None = None, lm_mode: str | None = None, principal: str = "anonymous",
                 peer: str = "", meta: dict | None = None):
        cfg = stages.config
        self.id = f"s{next(_session_ids)}"
        self.uid = secrets.token_hex(8)  # unique across processes (ids restart at s1): the call records' key
        self.stages, self.config, self.in_rate, self.out_rate = stages, cfg, in_rate, out_rate
        self.transport, self.principal, self.peer = transport, principal, peer
        self.system_prompt = system_prompt if system_prompt is not None else cfg.lm.system_prompt
        self.lm_mode = lm_mode
        self.outbox: Outbox = Outbox()
        self.tracker = LatencyTracker(cfg.budget, stages.metrics, self.emit, self.id)
        self.turns = TurnTaker(cfg, stages.whisper, in_rate, TurnHooks(
            self._speech_started, self._speech_stopped, self._partial, self._final, self._drop_speculation,
            self._utterance_too_long), self.id)
        self.replies = ReplyRunner(cfg, stages.lm.chat(), stages.synthesizer, out_rate, lm_mode,
                                   stages.apology.get(out_rate), self.emit, self._first_audio, self._fault,
                                   self.is_current, self.id)
        self.history: list[dict] = []
        self.reply: Reply | None = None
        self.reply_tasks: set[asyncio.Task] = set()  # replies still running (a barge-in's too), for close()
        self.closed = False
        self.opened = self.last_audio = time.monotonic()
        self.turn_meta: dict[int, dict] = {}  # turn -> started (unix time), transcript, errors: for the records
        self.ending = asyncio.Event()  # set when the session must end; the transport closes the connection
        self.end_reason = ""  # the error code that ended it
        self.close_code = 1000
        self._held: list[Event] | None = None  # events held back until a turn's record is committed
        self.error_counts: dict[str, int] = {}
        self.records = stages.records
        stages.metrics.sessions.labels(transport).inc()
        stages.live.add(self)
        self._record(rec.session_opened(self.uid, self.id, transport, principal, peer, time.time(),
                                        {"in_rate": in_rate, "out_rate": out_rate, "lm_mode": lm_mode,
                                         "custom_system_prompt": system_prompt is not None, **(meta or {})}))
        try:
            self.watchdog: asyncio.Task | None = asyncio.get_running_loop().create_task(self._watch())
        except RuntimeError:  # no event loop (a unit test building a bare session)
            self.watchdog = None
        log.info("session=%s open transport=%s in_rate=%d out_rate=%d principal=%s uid=%s", self.id, transport,
                 in_rate, out_rate, principal, self.uid)

    # --- events ------------------------------------------------------------------------------

    def emit(self, ev: Event, wire: bool = True, track: bool = True) -> bool:
        """Send `ev` to the client (if `wire`) and show it to the latency tracker (if `track`).
        False if it was not queued: the session is closed, or reply audio over the outbox limit."""
        queued = False
        limits = self.config.limits
        if wire and not self.closed:
            if self._held is not None:
                self._held.append(ev)
                queued = True
            elif self.outbox.qsize() >= limits.outbox_max_events:  # the client stopped reading long ago
                if isinstance(ev, TtsAudio):
                    self._drop_audio(ev)
                self.terminate("slow_client", f"the client is not reading: {self.outbox.qsize()} messages are "
                                              "waiting to be sent")
            elif isinstance(ev, TtsAudio) and self.outbox.audio_s > 0 and \
                    self.outbox.audio_s + ev.seconds > limits.outbox_audio_s:
                self._drop_audio(ev)
            else:
                self.outbox.put_nowait(ev)  # before the tracker sees it: a turn's latency report follows its reply_done
                queued = True
        if track:
            self.tracker.observe(ev)
        if isinstance(ev, Error):
            self._error_seen(ev)
        return queued

    def _error_seen(self, ev: Error) -> None:
        """Count, log and record an error (a client repeating a mistake is logged and recorded sparingly)."""
        self.stages.metrics.errors.labels(ev.code).inc()
        n = self.error_counts[ev.code] = self.error_counts.get(ev.code, 0) + 1
        if n > 10 and n % 100:
            return
        log.warning("session=%s turn=%d error %s (#%d): %s", self.id, ev.turn, ev.code, n, ev.message)
        meta = self.turn_meta.get(ev.turn)
        if meta is not None and len(meta.setdefault("errors", [])) < 20:
            meta["errors"].append({"code": ev.code, "message": ev.message})
        self._record(rec.error(self.uid, ev.turn, time.time(), ev.code, ev.message))

    def error(self, code: str, message: str) -> None:
        self.emit(Error(self.turn, time.monotonic(), code, message))

    def _drop_audio(self, ev: TtsAudio) -> None:
        self.stages.metrics.audio_dropped.labels(self.transport).inc(ev.seconds)
        log.warning("session=%s turn=%d client reads too slowly: %.1f s of reply audio queued, %.1f s dropped",
                    self.id, ev.turn, self.outbox.audio_s, ev.seconds)

    def _record(self, ops) -> None:
        if self.records is not None:
            self.records.write_nowait(ops)

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
        return self.turns.in_turn or (reply_task is not None and not reply_task.done())

    async def _watch(self) -> None:
        """Session-wide limits: total duration and audio idleness."""
        lim = self.config.limits
        period = min([1.0] + [x / 4 for x in (lim.max_session_s, lim.idle_timeout_s) if x])
        while not self.closed and not self.ending.is_set():
            await asyncio.sleep(period)
            now = time.monotonic()
            if lim.max_session_s and now - self.opened > lim.max_session_s:
                self.terminate("session_too_long", f"sessions are limited to {lim.max_session_s:g} s")
            elif lim.idle_timeout_s and now - self.last_audio > lim.idle_timeout_s:
                self.terminate("idle_timeout", f"no audio for {lim.idle_timeout_s:g} s")

    # --- the pipeline ---------------------------------------------------------------------------

    async def push_audio(self, pcm16: bytes) -> None:
        """PCM16LE mono at the session's input rate, any length: on to VAD and ASR."""
        self.last_audio = now = time.monotonic()
        self.turns.push(pcm16, now)

    def _speech_started(self, turn: int, now: float) -> None:
        self.barge_in(now)
        self.turn_meta[turn] = {"started": time.time()}
        self.emit(SpeechStarted(turn, now))

    def _speech_stopped(self, turn: int, now: float, speech_end: float) -> None:
        self.emit(SpeechStopped(turn, now, speech_end))

    def _partial(self, turn: int, text: str) -> None:
        self.emit(Transcript(turn, time.monotonic(), text, False))

    def _final(self, turn: int, transcript, ended: asyncio.Event) -> asyncio.Task:
        self.stages.scheduler.start_waiting(self)  # from here until the first audio, this user hears nothing
        return asyncio.create_task(self._finalise(turn, transcript, ended))

    async def _finalise(self, turn: int, transcript, ended: asyncio.Event) -> None:
        """The final transcript, then the reply. Speculatively (during the hangover, `ended` not
        set yet) the reply starts as soon as the transcript is known, held back until `ended`."""
        try:
            text = await self._transcript(transcript)
        except StageFailure as failure:
            await ended.wait()
            if turn != self.turn:  # the user spoke again meanwhile: just note it
                self._fault(failure)
                self._record_unreplied(turn, "", "asr_failed")
                return
            reply = self.reply = Reply(turn, task=asyncio.current_task())
            reply.released.set()
            self.replies.fail(reply, failure)
            try:
                await reply.playback.played()
            finally:
                await self._reply_done(reply, "", "asr_failed")
            return
        if turn != self.turn:
            self._record_unreplied(turn, text, "superseded")
            return
        reply = None
        if text and (self.config.session.speculative_reply or ended.is_set()):
            reply = self._start_reply(turn, text)
        await ended.wait()
        if turn != self.turn:  # the user spoke again in the same breath: a barge-in dropped the reply
            self._record_unreplied(turn, text, "superseded")
            return
        self.emit(Transcript(turn, time.monotonic(), text, True))
        self.turn_meta.setdefault(turn, {})["transcript"] = text
        if text and reply is None:
            reply = self._start_reply(turn, text)
        if reply is not None:
            reply.released.set()
        else:
            self._record_unreplied(turn, "", "no_speech")

    async def _transcript(self, transcript) -> str:
        timeout = self.config.faults.asr_timeout_s
        try:
            return (await asyncio.wait_for(transcript, timeout)).strip()
        except asyncio.TimeoutError:
            raise StageFailure("asr_timeout", f"speech recognition took longer than {timeout:g} s", "asr",
                               "timeout") from None
        except Exception as err:  # the ASR failing must not take the session down
            log.exception("session=%s asr failed", self.id)
            raise StageFailure("asr_failed", f"speech recognition failed: {err}", "asr", "error") from err

    def _start_reply(self, turn: int, user_text: str) -> Reply:
        reply = self.reply = Reply(turn)
        reply.task = self._spawn(self._respond(reply, user_text))
        return reply

    async def _respond(self, reply: Reply, user_text: str) -> None:
        try:
            await self.replies.run(reply, self._messages(user_text))
        finally:
            if reply.released.is_set():  # else a speculation that was dropped: it never happened
                await self._reply_done(reply, user_text, "ok" if reply.finished else
                                       "failed" if reply.failure else "interrupted")

    def _drop_speculation(self) -> None:
        self.stages.scheduler.stop_waiting(self)
        if self.reply is not None and not self.reply.released.is_set():
            self.reply.task.cancel()
            self.reply = None

    def _utterance_too_long(self, limit: float) -> None:
        self.error("utterance_too_long", f"speech longer than {limit:g} s is cut off here; the rest of "
                                         "it is ignored until you pause")

    def _first_audio(self) -> None:
        self.stages.scheduler.stop_waiting(self)  # nothing of ours is urgent any more

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.reply_tasks.add(task)
        task.add_done_callback(self.reply_tasks.discard)
        return task

    def _record_unreplied(self, turn: int, transcript: str, status: str) -> None:
        """A turn that ends without a reply_done: recorded without waiting."""
        self.stages.scheduler.stop_waiting(self)
        self.tracker.forget(turn)
        meta = self.turn_meta.pop(turn, {})
        self._record(rec.turn_done(self.uid, turn, meta.get("started"), time.time(), status, transcript, "", "",
                                   False, False, None, meta.get("errors", [])))

    # --- replies and history -----------------------------------------------------------------

    def _messages(self, user_text: str) -> list[dict]:
        keep = self.history if self.config.lm.history_turns else []
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + keep + [{"role": "user", "content": user_text}]

    def _fault(self, failure: StageFailure) -> None:
        if failure.kind == "client":  # caused by this client's input: not a fault of the service
            return
        self.stages.metrics.stage_faults.labels(failure.stage, failure.kind).inc()
        self.stages.faults[failure.stage] = (time.monotonic(), failure.kind)

    async def _reply_done(self, reply: Reply, user_text: str, status: str) -> None:
        """Record the turn, then send its reply_done and latency (held back until the record is committed)."""
        self.stages.scheduler.stop_waiting(self)
        now = time.monotonic()
        heard = reply.text.strip() if reply.finished else reply.playback.heard(now)
        if user_text:
            self.history += [{"role": "user", "content": user_text}]
            if heard:
                self.history.append({"role": "assistant", "content": heard})
            # Forget old turns half a window at a time, not one per turn: a window that slides every
            # turn changes the prompt's start, and the LM would prefill the whole conversation again.
            window = 2 * max(self.config.lm.history_turns, 1)
            if len(self.history) > window:
                del self.history[:len(self.history) - window // 2]
        held: list[Event] = []
        self._held = held
        try:
            self.emit(ReplyDone(reply.turn, now, reply.text.strip(), heard, not reply.finished))
        finally:
            self._held = None
        meta = self.turn_meta.pop(reply.turn, {})
        playback = reply.playback
        if self.records is not None:
            latency = next((e.to_wire() for e in held if isinstance(e, LatencyReport)), None)
            if latency is not None:
                latency.pop("type", None)
                latency.pop("turn", None)
            ok = await self.records.write(rec.turn_done(
                self.uid, reply.turn, meta.get("started"), time.time(), status, user_text, reply.text.strip(),
                heard, not reply.finished, playback.apology_at is not None and playback.emitted > playback.apology_at,
                latency, meta.get("errors", [])))
            if not ok:
                self.error("record_failed", "this turn could not be written to the call records")
        for ev in held:
            if not self.closed:
                self.outbox.put_nowait(ev)

    def barge_in(self, now: float) -> None:
        """User speech while a reply is pending or playing: stop it and drop queued audio."""
        reply = self.reply
        if reply is None:
            return
        if reply.task is not None and not reply.task.done():
            reply.task.cancel()
        elif not reply.playback.playing(now):
            return
        self.stages.metrics.barge_ins.inc()
        log.info("session=%s turn=%d barge-in", self.id, reply.turn)
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
            self.emit(AudioSent(turn, now), wire=False)
        playback.sent(text, now, seconds)

    def is_current(self, turn: int) -> bool:
        """Is audio of `turn` still wanted (not cleared by a barge-in)?"""
        return self.reply is not None and self.reply.turn == turn

    async def close(self, reason: str = "closed") -> None:
        if self.closed:
            return
        self.closed = True
        self.stages.scheduler.stop_waiting(self)
        cancelled = []
        for task in (*self.turns.close(), self.reply.task if self.reply else None, self.watchdog,
                     *self.reply_tasks):
            if task is not None and not task.done() and task is not asyncio.current_task():
                task.cancel()
                cancelled.append(task)
        self.stages.metrics.sessions.labels(self.transport).dec()
        self.stages.live.discard(self)
        reason = self.end_reason or reason
        try:
            if cancelled and self.turn_meta:  # a cancelled reply records its own turn (interrupted) first
                await asyncio.wait(cancelled, timeout=CLOSE_WAIT_S)
        finally:
            self._record_abandoned(reason)
            self._record(rec.session_closed(self.uid, time.time(), reason, self.turn))
            log.info("session=%s closed (%s) after %d turns", self.id, reason, self.turn)

    def _record_abandoned(self, reason: str) -> None:
        """Turns the session ended in the middle of (the user was speaking, the end of speech or the
        final transcript was pending): recorded as `abandoned`, so every turn has its row."""
        for turn in sorted(self.turn_meta):
            meta = self.turn_meta.pop(turn)
            errors = meta.get("errors", []) + [{"code": "abandoned", "message": f"the session ended ({reason}) "
                                                                                "before the turn did"}]
            self._record(rec.turn_done(self.uid, turn, meta.get("started"), time.time(), "abandoned",
                                       meta.get("transcript", ""), "", "", False, False, None, errors[-20:]))
