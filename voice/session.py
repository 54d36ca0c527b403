"""One conversation: audio in -> VAD -> ASR -> LM -> TTS -> audio out, with barge-in and history.

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
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import soxr

from voice import records as rec
from voice import vad
from voice.asr import SAMPLE_RATE, StreamingTranscriber, Whisper
from voice.audio import RATES, float_to_int16, float_to_pcm16, pcm16_to_float, resample
from voice.config import Config
from voice.events import (AudioSent, Clear, Error, Event, LatencyReport, ReplyDone, ReplyText, SpeechStarted,
                          SpeechStopped, Transcript, TtsAudio)
from voice.latency import LatencyTracker, Metrics
from voice.limits import Admission
from voice.lm import load_lm
from voice.scheduler import LM_HORIZON_S, TTS_HORIZON_S, Scheduler
from voice.tts import PhraseSplitter, Synthesizer, load_voice

log = logging.getLogger("voice.session")
PRE_ROLL_S = 0.3  # audio kept from before VAD declares speech, so the first syllable reaches ASR
FAULT_WINDOW_S = 60.0  # /healthz says "degraded" for this long after a stage failed or timed out
CLOSE_WAIT_S = 1.0  # on close: time the cancelled replies get to record themselves before the rest is "abandoned"
_session_ids = itertools.count(1)


class Stages:
    """The models and the service-wide state every session shares (each stage queues its own work).
    Built from its parts, so tests can pass fakes; `Stages.load(config)` loads the real models."""

    def __init__(self, config: Config, whisper, synthesizer, lm, scheduler: Scheduler | None = None,
                 metrics: Metrics | None = None):
        self.config = config
        self.whisper, self.synthesizer, self.lm = whisper, synthesizer, lm
        self.scheduler = scheduler or Scheduler()
        self.metrics = metrics or Metrics()
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


class StageFailure(Exception):
    """A stage failed or overran its timeout: the turn ends with `code` and an apology."""

    def __init__(self, code: str, message: str, stage: str, kind: str):
        super().__init__(message)
        self.code, self.message, self.stage, self.kind = code, message, stage, kind


def client_caused(err: BaseException) -> bool:
    """Did the LM fail because of what this client sent, rather than being broken? A conversation
    too long for its context (engine ContextOverflow), text it cannot encode, or a remote LM
    answering 400/413/422. Such a failure ends the turn like any other but is no service fault."""
    if isinstance(err, UnicodeError) or any(c.__name__ == "ContextOverflow" for c in type(err).__mro__):
        return True
    return getattr(err, "status_code", None) in (400, 413, 422)


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


@dataclass
class _Reply:
    """The reply being spoken: what has been sent, so barge-in can tell what was heard."""

    turn: int
    text: str = ""
    task: asyncio.Task | None = None
    # (text, start, seconds) per phrase on the wire; the client plays each one when it arrives
    # or when the previous one ends, whichever is later
    phrases: list[tuple[str, float, float]] = field(default_factory=list)
    pending: int = 0  # phrases handed to the transport but not on the wire yet
    playback_start: float | None = None
    finished: bool = False
    emitted: int = 0  # phrases handed to the transport
    apology_at: int | None = None  # phrases from this index on are the apology, not the reply
    failure: StageFailure | None = None
    # Set once the user's turn is over and the final transcript is out. A speculative reply
    # (started during the VAD hangover) is generated and synthesised before that, but nothing
    # of it reaches the client, the history or the records until then.
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def playback_end(self) -> float | None:
        if not self.phrases:
            return None
        _, start, seconds = self.phrases[-1]
        return start + seconds

    def sent(self, text: str, now: float, seconds: float) -> None:
        end = self.playback_end()
        self.phrases.append((text, now if end is None else max(end, now), seconds))

    def runs_dry(self, now: float, horizon_s: float) -> bool:
        """Is the audio on the wire about to run out (less than `horizon_s` left to play)?"""
        end = self.playback_end()
        return end is not None and end - now < horizon_s

    def playing(self, now: float) -> bool:
        end = self.playback_end()
        return end is not None and now < end

    def heard(self, now: float) -> str:
        """Text the user heard by `now`, assuming each phrase plays in real time."""
        words: list[str] = []
        for text, start, seconds in self.phrases[:self.apology_at]:
            parts = text.split()
            if now >= start + seconds:
                words += parts
            else:
                words += parts[: int(len(parts) * max(now - start, 0) / seconds)]
                break
        return " ".join(words)


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
        self.endpointer = vad.Endpointer(cfg.vad, SAMPLE_RATE)
        self.transcriber = StreamingTranscriber(stages.whisper, cfg.asr)
        self.chat = stages.lm.chat()
        self.resampler = soxr.ResampleStream(in_rate, SAMPLE_RATE, 1, dtype="float32") if in_rate != SAMPLE_RATE else None
        self.history: list[dict] = []
        self.turn = 0
        self.audio_s = 0.0  # seconds of 16 kHz audio received
        self.arrivals: deque[tuple[float, float]] = deque(maxlen=500)  # (audio time, monotonic arrival)
        self.pre_roll: deque[np.ndarray] = deque()
        self.partial_task: asyncio.Task | None = None
        self.turn_ended: asyncio.Event | None = None  # of a final decoded speculatively during the hangover
        self.final_task: asyncio.Task | None = None
        self.reply: _Reply | None = None
        self.reply_tasks: set[asyncio.Task] = set()  # replies still running (a barge-in's too), for close()
        self.closed = False
        self.opened = self.last_audio = time.monotonic()
        self.utterance_start_s = 0.0  # audio time the current utterance started
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
    def busy(self) -> bool:
        """A turn is in flight: the user is speaking, or their turn is not done yet."""
        tasks = (self.final_task, self.reply.task if self.reply else None)
        return self.endpointer.in_speech or any(t is not None and not t.done() for t in tasks)

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

    # --- audio in ------------------------------------------------------------------------------

    async def push_audio(self, pcm16: bytes) -> None:
        """PCM16LE mono at the session's input rate, any length."""
        now = time.monotonic()
        self.last_audio = now
        audio = pcm16_to_float(pcm16)
        if self.resampler is not None:
            audio = self.resampler.resample_chunk(audio)
        if not len(audio):
            return
        self.audio_s += len(audio) / SAMPLE_RATE
        self.arrivals.append((self.audio_s, now))
        for ev in self.endpointer.push(float_to_pcm16(audio)):
            if isinstance(ev, vad.SpeechStarted):
                self._speech_started(now)
            else:
                self._speech_stopped(ev, now)
        if self.endpointer.in_speech:
            self.transcriber.insert_audio_chunk(audio)
            limit = self.config.limits.max_utterance_s
            if limit and self.audio_s - self.utterance_start_s > limit:
                self.error("utterance_too_long", f"speech longer than {limit:g} s is cut off here; the rest of "
                                                 "it is ignored until you pause")
                self._speech_stopped(self.endpointer.force_stop(), now)
            else:
                self._listen(self.endpointer.silence_ms)
        else:
            self.pre_roll.append(audio)
            while sum(len(a) for a in self.pre_roll) > PRE_ROLL_S * SAMPLE_RATE:
                self.pre_roll.popleft()

    def _listen(self, silence_ms: int) -> None:
        """Partials while the user talks; a speculative final once they have been quiet a while."""
        early_ms = self.config.asr.early_final_ms
        if early_ms and silence_ms >= early_ms:
            if self.turn_ended is None:
                self.turn_ended = asyncio.Event()
                self.stages.scheduler.start_waiting(self)
                self.final_task = asyncio.create_task(
                    self._finalise(self.turn, self.transcriber.snapshot(), self.turn_ended))
            return
        if self.turn_ended is not None:  # they spoke again: the speculation is stale
            self._drop_speculation()
        if silence_ms == 0 and (self.partial_task is None or self.partial_task.done()):
            self.partial_task = asyncio.create_task(self._partial(self.turn))

    def _drop_speculation(self) -> None:
        self.turn_ended = None
        self.stages.scheduler.stop_waiting(self)
        self.final_task.cancel()
        if self.reply is not None and not self.reply.released.is_set():
            self.reply.task.cancel()
            self.reply = None

    def _speech_started(self, now: float) -> None:
        self.barge_in(now)
        self.turn += 1
        self.utterance_start_s = self.audio_s
        self.turn_meta[self.turn] = {"started": time.time()}
        self.transcriber.reset()
        for chunk in self.pre_roll:
            self.transcriber.insert_audio_chunk(chunk)
        self.pre_roll.clear()
        self.emit(SpeechStarted(self.turn, now))

    def _speech_stopped(self, ev: vad.SpeechStopped, now: float) -> None:
        # The audio that was just pushed is still part of the utterance's tail; that's fine.
        speech_end = self._arrival_of(ev.speech_end_s)
        self.emit(SpeechStopped(self.turn, now, speech_end))
        if self.partial_task is not None:
            self.partial_task.cancel()
        ended, self.turn_ended = self.turn_ended, None
        if ended is None:
            ended = asyncio.Event()
            self.stages.scheduler.start_waiting(self)
            self.final_task = asyncio.create_task(self._finalise(self.turn, self.transcriber.finish(), ended))
        else:
            self.transcriber.reset()
        ended.set()

    def _arrival_of(self, audio_time: float) -> float:
        """When the sample at `audio_time` reached us (the client streams in real time)."""
        for end, arrived in self.arrivals:
            if end >= audio_time:
                return arrived  # the chunk that carried it
        return time.monotonic()

    async def _partial(self, turn: int) -> None:
        try:
            text = await self.transcriber.process_iter()
        except asyncio.CancelledError:
            return
        except Exception as err:  # partials are optional: the final transcript will tell
            log.warning("session=%s turn=%d partial transcript failed: %s", self.id, turn, err)
            return
        if text and turn == self.turn and self.endpointer.in_speech:
            self.emit(Transcript(turn, time.monotonic(), text, False))

    async def _finalise(self, turn: int, transcript: asyncio.Future, ended: asyncio.Event) -> None:
        """The final transcript, then the reply. Speculatively (during the hangover, `ended` not
        set yet) the reply starts as soon as the transcript is known, held back until `ended`."""
        timeout = self.config.faults.asr_timeout_s
        try:
            text = (await asyncio.wait_for(transcript, timeout)).strip()
        except asyncio.TimeoutError:
            failure = StageFailure("asr_timeout", f"speech recognition took longer than {timeout:g} s", "asr",
                                   "timeout")
        except Exception as err:  # the ASR failing must not take the session down
            log.exception("session=%s asr failed", self.id)
            failure = StageFailure("asr_failed", f"speech recognition failed: {err}", "asr", "error")
        else:
            failure = None
        if failure is not None:
            await ended.wait()
            if turn != self.turn:  # the user spoke again meanwhile: just note it
                self._fault(failure)
                self._record_unreplied(turn, "", "asr_failed")
                return
            reply = self.reply = _Reply(turn, task=asyncio.current_task())
            reply.released.set()
            self._fail(reply, failure)
            try:
                await self._played(reply)
            finally:
                await self._reply_done(reply, "", "asr_failed")
            return
        if turn != self.turn:
            self._record_unreplied(turn, text, "superseded")
            return
        reply = None
        if text and (self.config.session.speculative_reply or ended.is_set()):
            reply = self.reply = _Reply(turn)
            reply.task = self._spawn(self._respond(reply, text))
        await ended.wait()
        if turn != self.turn:  # the user spoke again in the same breath: a barge-in dropped the reply
            self._record_unreplied(turn, text, "superseded")
            return
        self.emit(Transcript(turn, time.monotonic(), text, True))
        self.turn_meta.setdefault(turn, {})["transcript"] = text
        if text and reply is None:
            reply = self.reply = _Reply(turn)
            reply.task = self._spawn(self._respond(reply, text))
        if reply is not None:
            reply.released.set()
        else:
            self._record_unreplied(turn, "", "no_speech")

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

    # --- reply -----------------------------------------------------------------------------

    def _messages(self, user_text: str) -> list[dict]:
        keep = self.history if self.config.lm.history_turns else []
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + keep + [{"role": "user", "content": user_text}]

    async def _respond(self, reply: _Reply, user_text: str) -> None:
        messages = self._messages(user_text)
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
                self._fail(reply, failure)
            except Exception as err:  # a bug of ours: the same treatment as a failing stage
                speaker.cancel()
                log.exception("session=%s turn=%d reply failed", self.id, reply.turn)
                await reply.released.wait()
                self._fail(reply, StageFailure("reply_failed", f"the reply failed: {err}", "session", "error"))
            await reply.released.wait()
            await self._played(reply)  # until then a barge-in still interrupts it
            reply.finished = reply.failure is None
        except asyncio.CancelledError:
            speaker.cancel()
            raise
        finally:
            if reply.released.is_set():  # else a speculation that was dropped: it never happened
                await self._reply_done(reply, user_text, "ok" if reply.finished else
                                       "failed" if reply.failure else "interrupted")

    async def _generate(self, reply: _Reply, messages: list[dict], phrases: asyncio.Queue,
                        speaker: asyncio.Task) -> None:
        """LM blocks -> reply events and phrases for the speaker, each block under its timeout."""
        faults, limit = self.config.faults, self.config.limits.max_reply_chars
        splitter = PhraseSplitter(self.config.tts.min_chars, self.config.tts.first_words)
        phrased = False
        blocks = self.chat.reply(messages, self.lm_mode,
                                 urgent=lambda: not phrased or reply.runs_dry(time.monotonic(), LM_HORIZON_S))
        block_no = 0
        try:
            while True:
                timeout = faults.lm_first_block_timeout_s if block_no == 0 else faults.lm_block_timeout_s
                try:
                    block = await asyncio.wait_for(blocks.__anext__(), timeout)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    which = "first block" if block_no == 0 else f"block {block_no + 1}"
                    raise StageFailure("reply_timeout", f"the language model took longer than {timeout:g} s "
                                                        f"for its {which}", "lm", "timeout") from None
                except (StageFailure, asyncio.CancelledError):
                    raise
                except Exception as err:
                    if client_caused(err):  # this conversation, not the service: no fault in /healthz
                        log.warning("session=%s turn=%d LM refused this conversation: %r", self.id, reply.turn, err)
                        raise StageFailure("reply_failed", f"the language model could not take this conversation: "
                                                           f"{err}"[:300], "lm", "client") from err
                    log.warning("session=%s turn=%d LM failed: %r", self.id, reply.turn, err)
                    raise StageFailure("reply_failed", f"the language model failed: {err}", "lm", "error") from err
                if speaker.done() and not speaker.cancelled() and speaker.exception() is not None:
                    raise speaker.exception()  # TTS failed: no point in generating more
                block_no += 1
                reply.text += block.text
                for phrase in splitter.push(block.text):
                    phrases.put_nowait(phrase)
                    phrased = True
                await reply.released.wait()
                self.emit(ReplyText(reply.turn, time.monotonic(), block.text, block_no, block.tokens, block.steps))
                if len(reply.text) >= limit:
                    log.warning("session=%s turn=%d reply cut at %d characters", self.id, reply.turn, limit)
                    break
        finally:
            try:
                await asyncio.wait_for(blocks.aclose(), 5.0)
            except (Exception, asyncio.TimeoutError) as err:
                log.warning("session=%s turn=%d closing the LM stream failed: %r", self.id, reply.turn, err)
        rest = splitter.flush()
        if rest:
            phrases.put_nowait(rest)

    async def _speak(self, reply: _Reply, phrases: asyncio.Queue) -> None:
        timeout = self.config.faults.tts_timeout_s
        while (phrase := await phrases.get()) is not None:
            try:
                synthesis = self.stages.synthesizer.synthesize(phrase, self.out_rate, urgent=lambda: (
                    not reply.emitted or reply.runs_dry(time.monotonic(), TTS_HORIZON_S)))
                pcm = await asyncio.wait_for(synthesis, timeout)
            except asyncio.TimeoutError:
                raise StageFailure("reply_timeout", f"speech synthesis took longer than {timeout:g} s", "tts",
                                   "timeout") from None
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("session=%s turn=%d TTS failed: %r", self.id, reply.turn, err)
                raise StageFailure("reply_failed", f"speech synthesis failed: {err}", "tts", "error") from err
            self.stages.scheduler.stop_waiting(self)  # the first audio is ready: nothing of ours is urgent any more
            await reply.released.wait()
            if len(pcm) and self.emit(TtsAudio(reply.turn, time.monotonic(), pcm.tobytes(), self.out_rate, phrase)):
                reply.pending += 1
                reply.emitted += 1

    def _fault(self, failure: StageFailure) -> None:
        if failure.kind == "client":  # caused by this client's input: not a fault of the service
            return
        self.stages.metrics.stage_faults.labels(failure.stage, failure.kind).inc()
        self.stages.faults[failure.stage] = (time.monotonic(), failure.kind)

    def _fail(self, reply: _Reply, failure: StageFailure) -> None:
        """The turn failed: say so (an `error`), then the cached apology instead of the rest of the reply."""
        self.stages.scheduler.stop_waiting(self)
        self._fault(failure)
        reply.failure = failure
        reply.apology_at = reply.emitted
        pcm = self.stages.apology.get(self.out_rate)
        apology = bool(pcm) and self.is_current(reply.turn)
        self.emit(Error(reply.turn, time.monotonic(), failure.code, failure.message, failure.stage, apology))
        if apology and self.emit(TtsAudio(reply.turn, time.monotonic(), pcm, self.out_rate,
                                          self.config.faults.apology), track=False):
            reply.pending += 1
            reply.emitted += 1

    async def _reply_done(self, reply: _Reply, user_text: str, status: str) -> None:
        """Record the turn, then send its reply_done and latency (held back until the record is committed)."""
        self.stages.scheduler.stop_waiting(self)
        now = time.monotonic()
        heard = reply.text.strip() if reply.finished else reply.heard(now)
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
        if self.records is not None:
            latency = next((e.to_wire() for e in held if isinstance(e, LatencyReport)), None)
            if latency is not None:
                latency.pop("type", None)
                latency.pop("turn", None)
            ok = await self.records.write(rec.turn_done(
                self.uid, reply.turn, meta.get("started"), time.time(), status, user_text, reply.text.strip(),
                heard, not reply.finished, reply.apology_at is not None and reply.emitted > reply.apology_at,
                latency, meta.get("errors", [])))
            if not ok:
                self.error("record_failed", "this turn could not be written to the call records")
        for ev in held:
            if not self.closed:
                self.outbox.put_nowait(ev)

    async def _played(self, reply: _Reply) -> None:
        """Wait until the transport has sent every phrase and the client has played them."""
        while True:
            now = time.monotonic()
            if reply.pending:
                await asyncio.sleep(0.02)
            elif reply.playing(now):
                await asyncio.sleep(reply.playback_end() - now)
            else:
                return

    def barge_in(self, now: float) -> None:
        """User speech while a reply is pending or playing: stop it and drop queued audio."""
        reply = self.reply
        if reply is None:
            return
        if reply.task is not None and not reply.task.done():
            reply.task.cancel()
        elif not reply.playing(now):
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
        now = time.monotonic()
        apology = reply.apology_at is not None and len(reply.phrases) >= reply.apology_at
        if reply.playback_start is None and not apology:
            reply.playback_start = now
            self.emit(AudioSent(turn, now), wire=False)
        reply.pending -= 1
        reply.sent(text, now, seconds)

    def is_current(self, turn: int) -> bool:
        """Is audio of `turn` still wanted (not cleared by a barge-in)?"""
        return self.reply is not None and self.reply.turn == turn

    async def close(self, reason: str = "closed") -> None:
        if self.closed:
            return
        self.closed = True
        self.stages.scheduler.stop_waiting(self)
        self.transcriber.reset()  # no longer someone talking, for the other sessions' partials
        cancelled = []
        for task in (self.partial_task, self.final_task, self.reply.task if self.reply else None, self.watchdog,
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
