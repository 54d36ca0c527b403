"""One conversation: audio in -> VAD -> ASR -> LM -> TTS -> audio out, with barge-in and history.

Transports feed `push_audio` and drain `outbox`; they report what reached the wire with
`audio_sent`, which is how the session knows what the user actually heard. The session
knows nothing about wire formats, and the latency tracker only watches its events.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import soxr

from voice import vad
from voice.asr import SAMPLE_RATE, StreamingTranscriber, load_whisper
from voice.audio import float_to_pcm16, pcm16_to_float
from voice.config import Config
from voice.events import (AudioSent, Clear, Error, Event, ReplyDone, ReplyText, SpeechStarted, SpeechStopped,
                          Transcript, TtsAudio)
from voice.latency import LatencyTracker, Metrics
from voice.lm import load_lm
from voice.tts import PhraseSplitter, Synthesizer, load_voice

log = logging.getLogger("voice.session")
PRE_ROLL_S = 0.3  # audio kept from before VAD declares speech, so the first syllable reaches ASR
_session_ids = itertools.count(1)


class Stages:
    """The models, loaded once and shared by every session (each stage queues its own work)."""

    def __init__(self, config: Config):
        t = time.perf_counter()
        self.config = config
        self.whisper = load_whisper(config.asr)
        self.synthesizer = Synthesizer(load_voice(config.tts), config.tts)
        self.lm = load_lm(config.lm)
        self.metrics = Metrics()
        log.info("models loaded in %.1f s (lm backend=%s model=%s mode=%s)", time.perf_counter() - t,
                 config.lm.backend, config.lm.model, config.lm.mode)


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

    def playback_end(self) -> float | None:
        if not self.phrases:
            return None
        _, start, seconds = self.phrases[-1]
        return start + seconds

    def sent(self, text: str, now: float, seconds: float) -> None:
        end = self.playback_end()
        self.phrases.append((text, now if end is None else max(end, now), seconds))

    def playing(self, now: float) -> bool:
        end = self.playback_end()
        return end is not None and now < end

    def heard(self, now: float) -> str:
        """Text the user heard by `now`, assuming each phrase plays in real time."""
        words: list[str] = []
        for text, start, seconds in self.phrases:
            parts = text.split()
            if now >= start + seconds:
                words += parts
            else:
                words += parts[: int(len(parts) * max(now - start, 0) / seconds)]
                break
        return " ".join(words)


class Session:
    def __init__(self, stages: Stages, in_rate: int, out_rate: int, transport: str = "native",
                 system_prompt: str | None = None, lm_mode: str | None = None):
        cfg = stages.config
        self.id = f"s{next(_session_ids)}"
        self.stages, self.config, self.in_rate, self.out_rate = stages, cfg, in_rate, out_rate
        self.transport = transport
        self.system_prompt = system_prompt if system_prompt is not None else cfg.lm.system_prompt
        self.lm_mode = lm_mode
        self.outbox: asyncio.Queue[Event] = asyncio.Queue()
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
        self.early_final: asyncio.Future | None = None  # speculative final during the VAD hangover
        self.final_task: asyncio.Task | None = None
        self.reply: _Reply | None = None
        self.closed = False
        stages.metrics.sessions.labels(transport).inc()
        log.info("session=%s open transport=%s in_rate=%d out_rate=%d", self.id, transport, in_rate, out_rate)

    # --- events ------------------------------------------------------------------------------

    def emit(self, ev: Event, wire: bool = True) -> None:
        if wire and not self.closed:
            self.outbox.put_nowait(ev)  # before the tracker sees it: a turn's latency report follows its reply_done
        self.tracker.observe(ev)
        if isinstance(ev, Error):
            self.stages.metrics.errors.labels(ev.code).inc()
            log.warning("session=%s error %s: %s", self.id, ev.code, ev.message)

    def error(self, code: str, message: str) -> None:
        self.emit(Error(self.turn, time.monotonic(), code, message))

    # --- audio in ------------------------------------------------------------------------------

    async def push_audio(self, pcm16: bytes) -> None:
        """PCM16LE mono at the session's input rate, any length."""
        now = time.monotonic()
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
            self._listen(self.endpointer.silence_ms)
        else:
            self.pre_roll.append(audio)
            while sum(len(a) for a in self.pre_roll) > PRE_ROLL_S * SAMPLE_RATE:
                self.pre_roll.popleft()

    def _listen(self, silence_ms: int) -> None:
        """Partials while the user talks; a speculative final once they have been quiet a while."""
        early_ms = self.config.asr.early_final_ms
        if early_ms and silence_ms >= early_ms:
            if self.early_final is None:
                self.early_final = self.transcriber.snapshot()
            return
        self.early_final = None  # they spoke again: the speculation is stale
        if silence_ms == 0 and (self.partial_task is None or self.partial_task.done()):
            self.partial_task = asyncio.create_task(self._partial(self.turn))

    def _speech_started(self, now: float) -> None:
        self.barge_in(now)
        self.turn += 1
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
        transcript, self.early_final = self.early_final, None
        if transcript is None:
            transcript = self.transcriber.finish()
        else:
            self.transcriber.reset()
        self.final_task = asyncio.create_task(self._finalise(self.turn, transcript))

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
        if text and turn == self.turn and self.endpointer.in_speech:
            self.emit(Transcript(turn, time.monotonic(), text, False))

    async def _finalise(self, turn: int, transcript: asyncio.Future) -> None:
        try:
            text = (await transcript).strip()
        except Exception as err:  # the ASR failing must not take the session down
            log.exception("session=%s asr failed", self.id)
            self.error("asr_failed", f"speech recognition failed: {err}")
            return
        if turn != self.turn:
            return
        self.emit(Transcript(turn, time.monotonic(), text, True))
        if text:
            self.reply = _Reply(turn)
            self.reply.task = asyncio.create_task(self._respond(self.reply, text))

    # --- reply -----------------------------------------------------------------------------

    def _messages(self, user_text: str) -> list[dict]:
        keep = self.history[-2 * self.config.lm.history_turns:] if self.config.lm.history_turns else []
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + keep + [{"role": "user", "content": user_text}]

    async def _respond(self, reply: _Reply, user_text: str) -> None:
        messages = self._messages(user_text)
        phrases: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.create_task(self._speak(reply, phrases))
        splitter = PhraseSplitter(self.config.tts.min_chars, self.config.tts.first_words)
        try:
            block_no = 0
            async for block in self.chat.reply(messages, self.lm_mode):
                block_no += 1
                reply.text += block.text
                self.emit(ReplyText(reply.turn, time.monotonic(), block.text, block_no, block.tokens, block.steps))
                for phrase in splitter.push(block.text):
                    phrases.put_nowait(phrase)
            rest = splitter.flush()
            if rest:
                phrases.put_nowait(rest)
            phrases.put_nowait(None)
            await speaker
            await self._played(reply)  # until then a barge-in still interrupts it
            reply.finished = True
        except asyncio.CancelledError:
            speaker.cancel()
            raise
        except Exception as err:
            speaker.cancel()
            log.exception("session=%s turn=%d reply failed", self.id, reply.turn)
            self.error("reply_failed", f"the reply failed: {err}")
        finally:
            heard = reply.text.strip() if reply.finished else reply.heard(time.monotonic())
            self.history += [{"role": "user", "content": user_text}]
            if heard:
                self.history.append({"role": "assistant", "content": heard})
            self.emit(ReplyDone(reply.turn, time.monotonic(), reply.text.strip(), heard, not reply.finished))

    async def _speak(self, reply: _Reply, phrases: asyncio.Queue) -> None:
        while (phrase := await phrases.get()) is not None:
            pcm = await self.stages.synthesizer.synthesize(phrase, self.out_rate)
            if len(pcm):
                reply.pending += 1
                self.emit(TtsAudio(reply.turn, time.monotonic(), pcm.tobytes(), self.out_rate, phrase))

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
        if reply.playback_start is None:
            reply.playback_start = now
            self.emit(AudioSent(turn, now), wire=False)
        reply.pending -= 1
        reply.sent(text, now, seconds)

    def is_current(self, turn: int) -> bool:
        """Is audio of `turn` still wanted (not cleared by a barge-in)?"""
        return self.reply is not None and self.reply.turn == turn

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in (self.partial_task, self.final_task, self.reply.task if self.reply else None):
            if task is not None and not task.done():
                task.cancel()
        self.stages.metrics.sessions.labels(self.transport).dec()
        log.info("session=%s closed after %d turns", self.id, self.turn)
