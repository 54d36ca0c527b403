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
from collections.abc import Awaitable
from dataclasses import dataclass

import numpy as np

from voice import vad
from voice.asr import SAMPLE_RATE, StreamingTranscriber, Transcriber
from voice.audio import StreamResampler, float_to_pcm16, pcm16_to_float
from voice.config import Config

PRE_ROLL_S = 0.3  # audio kept from before VAD declares speech, so the first syllable reaches ASR


@dataclass(frozen=True)
class Started:
    """The user started talking: turn `turn` begins."""

    turn: int
    now: float


@dataclass(frozen=True)
class Stopped:
    """End of speech, detected at `now`; `speech_end` is when their speech really ended."""

    turn: int
    now: float
    speech_end: float


@dataclass(frozen=True)
class Partial:
    """A partial transcript is being decoded: `text` gives it (None: nothing new). By then the
    user may have stopped; `TurnTaker.listening(turn)` says whether it is still wanted."""

    turn: int
    text: Awaitable[str | None]


@dataclass(frozen=True)
class Final:
    """The final transcript of `turn`. `ended` is set once the turn is over; before that the
    transcript is a speculation (decoded during the VAD hangover)."""

    turn: int
    transcript: Awaitable[str]
    ended: asyncio.Event


@dataclass(frozen=True)
class SpeculationDropped:
    """The user went on talking after a speculative final: it, and what was started on it, is void."""


@dataclass(frozen=True)
class TooLong:
    """The utterance is cut here, at `limit_s` (a Stopped and a Final follow)."""

    limit_s: float


TurnEvent = Started | Stopped | Partial | Final | SpeculationDropped | TooLong


class EarlyFinal:
    """The final transcript decoded speculatively once the speaker has been quiet `early_ms`, while
    the VAD still waits out its hangover: if the pause was the end, ASR time is off the critical
    path; if they speak again, it is void. Used by the session's TurnTaker and Wyoming's dictation."""

    def __init__(self, transcriber: StreamingTranscriber, early_ms: int):
        self.transcriber, self.early_ms = transcriber, early_ms
        self.pending: asyncio.Future[str] | None = None

    def quiet(self, silence_ms: int) -> bool:
        """Has the speaker been quiet long enough to take the final early?"""
        return bool(self.early_ms) and silence_ms >= self.early_ms

    def take(self) -> asyncio.Future[str] | None:
        """Start decoding the final now: its future, or None if it was taken in this pause already."""
        if self.pending is not None:
            return None
        self.pending = self.transcriber.snapshot()
        return self.pending

    def drop(self) -> bool:
        """The speaker went on: the early final (if one was taken) is void. Was there one?"""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.cancel()
        return pending is not None

    def final(self) -> Awaitable[str]:
        """The utterance is over: the early final if nothing but silence followed it, else decoded now."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.transcriber.reset()
            return pending
        return self.transcriber.finish()


class TurnTaker:
    """Audio in, turn events out: `push`, `end_now` and `clear` return what happened, in order,
    for the session to act on. The ASR's tasks are its own; what is done with a transcript is not."""

    def __init__(self, config: Config, whisper: Transcriber, in_rate: int, name: str):
        self.config, self.name = config, name
        self.endpointer = vad.Endpointer(config.vad, SAMPLE_RATE)
        self.transcriber = StreamingTranscriber(whisper, config.asr)
        self.early = EarlyFinal(self.transcriber, config.asr.early_final_ms)
        self.in_rate, self.resampler = in_rate, StreamResampler(SAMPLE_RATE)
        self.turn = 0
        self.audio_s = 0.0  # seconds of 16 kHz audio received
        self.arrivals: deque[tuple[float, float]] = deque(maxlen=500)  # (audio time, monotonic arrival)
        self.pre_roll: deque[np.ndarray] = deque()
        self.utterance_start_s = 0.0  # audio time the current utterance started
        self.partial_task: asyncio.Future[str | None] | None = None
        self.turn_ended: asyncio.Event | None = None  # of the early final (decoded during the hangover)

    @property
    def speaking(self) -> bool:
        """The user is talking (the VAD is in speech)."""
        return self.endpointer.in_speech

    def listening(self, turn: int) -> bool:
        """Is `turn` the one being spoken now (so its partial transcripts are still wanted)?"""
        return turn == self.turn and self.endpointer.in_speech

    def push(self, pcm16: bytes, now: float) -> list[TurnEvent]:
        """PCM16LE mono at the session's input rate, any length: what it did to the turn, in order."""
        audio = self.resampler.push(pcm16_to_float(pcm16), self.in_rate)
        if not len(audio):
            return []
        self.audio_s += len(audio) / SAMPLE_RATE
        self.arrivals.append((self.audio_s, now))
        out: list[TurnEvent] = []
        for ev in self.endpointer.push(float_to_pcm16(audio)):
            if isinstance(ev, vad.SpeechStarted):
                out.append(self._speech_started(now))
            else:
                out += self._speech_stopped(ev, now)
        if self.endpointer.in_speech:
            self.transcriber.insert_audio_chunk(audio)
            limit = self.config.limits.max_utterance_s
            if limit and self.audio_s - self.utterance_start_s > limit:
                stopped = self.endpointer.force_stop()
                assert stopped is not None  # in speech
                out += [TooLong(limit), *self._speech_stopped(stopped, now)]
            else:
                out += self._listen(self.endpointer.silence_ms)
        else:
            self.pre_roll.append(audio)
            while sum(len(a) for a in self.pre_roll) > PRE_ROLL_S * SAMPLE_RATE:
                self.pre_roll.popleft()
        return out

    def _speech_started(self, now: float) -> Started:
        self.turn += 1
        self.utterance_start_s = self.audio_s
        self.transcriber.reset()
        for chunk in self.pre_roll:
            self.transcriber.insert_audio_chunk(chunk)
        self.pre_roll.clear()
        return Started(self.turn, now)

    def _listen(self, silence_ms: int) -> list[TurnEvent]:
        """Partials while the user talks; a speculative final once they have been quiet a while."""
        if self.early.quiet(silence_ms):
            if (early := self.early.take()) is None:
                return []
            self.turn_ended = asyncio.Event()
            return [Final(self.turn, early, self.turn_ended)]
        out: list[TurnEvent] = []
        if self.early.drop():  # they spoke again: the speculation is stale
            self.turn_ended = None
            out.append(SpeculationDropped())
        if silence_ms == 0 and (self.partial_task is None or self.partial_task.done()):
            self.partial_task = asyncio.ensure_future(self.transcriber.process_iter())
            out.append(Partial(self.turn, self.partial_task))
        return out

    def _speech_stopped(self, ev: vad.SpeechStopped, now: float) -> list[TurnEvent]:
        # The audio that was just pushed is still part of the utterance's tail; that's fine.
        out: list[TurnEvent] = [Stopped(self.turn, now, self._arrival_of(ev.speech_end_s))]
        if self.partial_task is not None:
            self.partial_task.cancel()
        ended, self.turn_ended = self.turn_ended, None
        transcript = self.early.final()  # the early final's, if one was taken (then it went out already)
        if ended is None:
            ended = asyncio.Event()
            out.append(Final(self.turn, transcript, ended))
        ended.set()
        return out

    def end_now(self, now: float) -> list[TurnEvent]:
        """The client says the utterance is over (Realtime `input_audio_buffer.commit`); no events
        if nobody is speaking."""
        ev = self.endpointer.force_stop(suppress=False)
        if ev is None:
            return []
        return self._speech_stopped(ev, now)

    def clear(self, now: float) -> list[TurnEvent]:
        """Forget the utterance so far (Realtime `input_audio_buffer.clear`): a turn in progress
        ends with nothing said."""
        self.pre_roll.clear()
        if not self.endpointer.in_speech:
            return []
        self.endpointer.force_stop(suppress=False)
        if self.partial_task is not None:
            self.partial_task.cancel()
        out: list[TurnEvent] = []
        if self.early.drop():  # a speculative final for what is now dropped
            self.turn_ended = None
            out.append(SpeculationDropped())
        self.transcriber.reset()
        nothing = asyncio.get_running_loop().create_future()
        nothing.set_result("")
        ended = asyncio.Event()
        ended.set()
        return [*out, Stopped(self.turn, now, now), Final(self.turn, nothing, ended)]

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

    def close(self) -> list[asyncio.Future]:
        """Stop listening; the tasks still running (to cancel)."""
        self.early.drop()
        self.transcriber.reset()  # no longer someone talking, for the other sessions' partials
        return [self.partial_task] if self.partial_task is not None else []
