"""A session that serves requests instead of holding a conversation: Wyoming's three programs,
the session's `dictate`, `recite` and `answer_in` (voice/conversation/session.py).

    listen   audio from the client's start to its stop -> one final transcript, no reply
             (`Dictation`, the session's TurnTaker: every sample transcribed; the VAD only
             decides when the final may be decoded early, as a TurnTaker's EarlyFinal does)
    speak    text as it comes -> phrases -> audio (`ReplyRunner.recite`: no LM)
    answer   a typed turn in a conversation the caller keeps -> the LM's reply as text (no TTS;
             `NoChat`: the session has no conversation of its own)

Each request is a turn of the session (`Session(..., requests=True)`), so admission, the call
records, latency and metrics, stage faults, the scheduler and the end of the turn are the
session's, as for every other front. What a request says goes out through the session's outbox.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from voice.pipeline import vad
from voice.pipeline.asr import SAMPLE_RATE, Transcriber
from voice.audio import pcm16_to_float
from voice.config import Config
from voice.events import SpeechStarted, SpeechStopped
from voice.pipeline.lm import Piece
from voice.conversation.turns import Final, Partial, SpeculationDropped, TurnEvent, TurnTaker


class Dictation(TurnTaker):
    """Listen only: one utterance from `start` to `end_now` (the client says where it begins and
    ends), all of it transcribed, 16 kHz PCM16 in. The same turn events as a TurnTaker: a partial
    transcript whenever the last is done, a speculative Final once the speaker has been quiet
    `asr.early_final_ms` (dropped if they go on), and at the end SpeechStopped and the Final."""

    def __init__(self, config: Config, whisper: Transcriber, in_rate: int, name: str):
        assert in_rate == SAMPLE_RATE, "a dictation's audio comes resampled to 16 kHz"
        super().__init__(config, whisper, in_rate, name)
        self.asks = False  # the client ends the turn, not a policy
        self.dictating = False
        self.voice_at = 0.0  # when the last audio with speech in it came (the turn's speech end)

    @property
    def speaking(self) -> bool:
        return self.dictating

    def listening(self, turn: int) -> bool:
        return turn == self.turn and self.dictating

    def start(self, now: float) -> list[TurnEvent]:
        """A new utterance (the one in flight, if any, is dropped)."""
        out = self.clear(now)
        self.turn += 1
        self.endpointer = vad.Endpointer(self.config.vad, SAMPLE_RATE)
        self.dictating, self.audio_s, self.voice_at = True, 0.0, now
        return [*out, SpeechStarted(self.turn, now)]

    def push(self, pcm16: bytes, now: float, playing: bool = False) -> list[TurnEvent]:
        limit = self.config.limits.max_utterance_s
        if not self.dictating or not pcm16 or limit and self.audio_s >= limit:
            return []  # (past the utterance limit the rest is not transcribed)
        audio = pcm16_to_float(pcm16)
        self.audio_s += len(audio) / SAMPLE_RATE
        self.transcriber.insert_audio_chunk(audio)
        out: list[TurnEvent] = []
        if any(isinstance(ev, vad.VoiceStart) for ev in self.endpointer.push(pcm16, playing)):
            out += self._drop_early()
        if self.endpointer.in_speech:
            if not self.endpointer.silence_ms:
                self.voice_at = now
            if not self.early.quiet(self.endpointer.silence_ms):
                out += self._drop_early()  # (still) speaking
            elif (early := self.early.take()) is not None:
                self.turn_ended = asyncio.Event()
                out.append(Final(self.turn, early, self.turn_ended))
        if self.partial_task is None or self.partial_task.done():
            self.partial_task = asyncio.ensure_future(self.transcriber.process_iter())
            out.append(Partial(self.turn, self.partial_task))
        return out

    def _drop_early(self) -> list[TurnEvent]:
        if not self.early.drop():
            return []
        self.turn_ended = None
        return [SpeculationDropped()]

    def _stop(self) -> bool:
        """Stop dictating (no more partials); False if it was not dictating."""
        if not self.dictating:
            return False
        self.dictating = False
        if self.partial_task is not None:
            self.partial_task.cancel()
        return True

    def end_now(self, now: float) -> list[TurnEvent]:
        """The client's audio-stop: the final transcript (the early one if only silence followed it)."""
        if not self._stop():
            return []
        ended, self.turn_ended = self.turn_ended, None
        out: list[TurnEvent] = [SpeechStopped(self.turn, now, self.voice_at)]
        transcript = self.early.final()
        if ended is None:
            ended = asyncio.Event()
            out.append(Final(self.turn, transcript, ended))
        ended.set()
        return out

    def clear(self, now: float) -> list[TurnEvent]:
        """The utterance is dropped: nothing of it is decoded any more."""
        if not self._stop():
            return []
        out = self._drop_early()
        self.transcriber.reset()
        return out


class NoChat:
    """A requests session's own chat: it has none (an answer borrows its conversation's)."""

    async def reply(self, messages: list[dict], mode: str | None = None, runs_out: object = None,
                    tools: list[dict] | None = None) -> AsyncGenerator[Piece, None]:
        raise RuntimeError("this session answers only in a conversation it is given")
        yield

    async def prepare(self, messages: list[dict], tools: list[dict] | None = None, aside: bool = False) -> None:
        return None

    async def end_of_turn_probability(self, messages: list[dict], text: str,
                                      tools: list[dict] | None = None) -> float | None:
        return None

    def close(self) -> None:
        return None
