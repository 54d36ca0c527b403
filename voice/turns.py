"""Audio in -> VAD -> ASR for one session: who has the turn, and what they said.

Client audio is resampled to 16 kHz and endpointed by webrtcvad; ~0.3 s of audio from before
speech is detected goes to ASR with it, so the first syllable is not lost. While the user
talks, partial transcripts come every `asr.partial_interval_ms`. Once they have been quiet for
`asr.early_final_ms`, the final transcript is decoded speculatively, while the VAD still waits
out its hangover: if the hangover confirms the turn ended, that transcript (and the reply the
session started on it) is kept and ASR time is off the critical path; if they speak again,
it is dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import soxr

from voice import vad
from voice.asr import SAMPLE_RATE, StreamingTranscriber, Transcriber
from voice.audio import float_to_pcm16, pcm16_to_float
from voice.config import Config

PRE_ROLL_S = 0.3  # audio kept from before VAD declares speech, so the first syllable reaches ASR


@dataclass
class TurnHooks:
    """What the session does at each point of a turn."""

    started: Callable[[int, float], None]  # (turn, now): the user started talking
    stopped: Callable[[int, float, float], None]  # (turn, now, when their speech ended): end of speech
    partial: Callable[[int, str], None]  # (turn, text)
    # (turn, final transcript future, ended): `ended` is set once the turn is over; before that
    # the transcript is a speculation. Returns the task that handles it.
    final: Callable[[int, Awaitable[str], asyncio.Event], asyncio.Task]
    speculation_dropped: Callable[[], None]  # the user went on talking after a speculative final
    too_long: Callable[[float], None]  # (limit_s): the utterance is cut here


class TurnTaker:
    def __init__(self, config: Config, whisper: Transcriber, in_rate: int, hooks: TurnHooks, name: str):
        self.config, self.hooks, self.name = config, hooks, name
        self.endpointer = vad.Endpointer(config.vad, SAMPLE_RATE)
        self.transcriber = StreamingTranscriber(whisper, config.asr)
        self.resampler = (soxr.ResampleStream(in_rate, SAMPLE_RATE, 1, dtype="float32")
                          if in_rate != SAMPLE_RATE else None)
        self.turn = 0
        self.audio_s = 0.0  # seconds of 16 kHz audio received
        self.arrivals: deque[tuple[float, float]] = deque(maxlen=500)  # (audio time, monotonic arrival)
        self.pre_roll: deque[np.ndarray] = deque()
        self.utterance_start_s = 0.0  # audio time the current utterance started
        self.partial_task: asyncio.Task | None = None
        self.final_task: asyncio.Task | None = None
        self.turn_ended: asyncio.Event | None = None  # of a final decoded speculatively during the hangover

    @property
    def in_turn(self) -> bool:
        """The user is talking, or their final transcript is not handled yet."""
        return self.endpointer.in_speech or (self.final_task is not None and not self.final_task.done())

    def push(self, pcm16: bytes, now: float) -> None:
        """PCM16LE mono at the session's input rate, any length."""
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
                self.hooks.too_long(limit)
                stopped = self.endpointer.force_stop()
                assert stopped is not None  # in speech
                self._speech_stopped(stopped, now)
            else:
                self._listen(self.endpointer.silence_ms)
        else:
            self.pre_roll.append(audio)
            while sum(len(a) for a in self.pre_roll) > PRE_ROLL_S * SAMPLE_RATE:
                self.pre_roll.popleft()

    def _speech_started(self, now: float) -> None:
        self.turn += 1
        self.utterance_start_s = self.audio_s
        self.transcriber.reset()
        for chunk in self.pre_roll:
            self.transcriber.insert_audio_chunk(chunk)
        self.pre_roll.clear()
        self.hooks.started(self.turn, now)

    def _listen(self, silence_ms: int) -> None:
        """Partials while the user talks; a speculative final once they have been quiet a while."""
        early_ms = self.config.asr.early_final_ms
        if early_ms and silence_ms >= early_ms:
            if self.turn_ended is None:
                self.turn_ended = asyncio.Event()
                self.final_task = self.hooks.final(self.turn, self.transcriber.snapshot(), self.turn_ended)
            return
        if self.turn_ended is not None:  # they spoke again: the speculation is stale
            assert self.final_task is not None  # the speculative final's
            self.turn_ended = None
            self.final_task.cancel()
            self.hooks.speculation_dropped()
        if silence_ms == 0 and (self.partial_task is None or self.partial_task.done()):
            self.partial_task = asyncio.create_task(self._partial(self.turn))

    def _speech_stopped(self, ev: vad.SpeechStopped, now: float) -> None:
        # The audio that was just pushed is still part of the utterance's tail; that's fine.
        self.hooks.stopped(self.turn, now, self._arrival_of(ev.speech_end_s))
        if self.partial_task is not None:
            self.partial_task.cancel()
        ended, self.turn_ended = self.turn_ended, None
        if ended is None:
            ended = asyncio.Event()
            self.final_task = self.hooks.final(self.turn, self.transcriber.finish(), ended)
        else:
            self.transcriber.reset()
        ended.set()

    def end_now(self, now: float) -> bool:
        """The client says the utterance is over (Realtime `input_audio_buffer.commit`); False if
        nobody is speaking."""
        ev = self.endpointer.force_stop(suppress=False)
        if ev is None:
            return False
        self._speech_stopped(ev, now)
        return True

    def clear(self, now: float) -> None:
        """Forget the utterance so far (Realtime `input_audio_buffer.clear`): a turn in progress
        ends with nothing said."""
        self.pre_roll.clear()
        if not self.endpointer.in_speech:
            return
        self.endpointer.force_stop(suppress=False)
        if self.partial_task is not None:
            self.partial_task.cancel()
        if self.turn_ended is not None:  # a speculative final for what is now dropped
            assert self.final_task is not None
            self.turn_ended = None
            self.final_task.cancel()
            self.hooks.speculation_dropped()
        self.transcriber.reset()
        self.hooks.stopped(self.turn, now, now)
        nothing = asyncio.get_running_loop().create_future()
        nothing.set_result("")
        ended = asyncio.Event()
        ended.set()
        self.final_task = self.hooks.final(self.turn, nothing, ended)

    def new_turn(self) -> int:
        """A turn that starts without speech (a typed message): its number."""
        self.turn += 1
        return self.turn

    def _arrival_of(self, audio_time: float) -> float:
        """When the sample at `audio_time` reached us (the client streams in real time)."""
        for end, arrived in self.arrivals:
            if end >= audio_time:
                return arrived  # the chunk that carried it
        return time.monotonic()

    async def _partial(self, turn: int) -> None:
        text = await self.transcriber.process_iter()
        if text and turn == self.turn and self.endpointer.in_speech:
            self.hooks.partial(turn, text)

    def close(self) -> list[asyncio.Task]:
        """Stop listening; the tasks still running (to cancel)."""
        self.transcriber.reset()  # no longer someone talking, for the other sessions' partials
        return [t for t in (self.partial_task, self.final_task) if t is not None]
