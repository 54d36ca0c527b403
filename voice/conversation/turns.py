"""Audio in -> VAD -> ASR for one session: who has the turn, and what they said.

Client audio is resampled to 16 kHz and endpointed by webrtcvad; ~0.3 s of audio from before
speech is detected goes to ASR with it, so the first syllable is not lost. While the user
talks, partial transcripts come every `asr.partial_interval_ms`. Once they have been quiet for
`asr.early_final_ms`, the final transcript is decoded speculatively (EarlyFinal): if the turn
ended there, that transcript (and the reply the session started on it) is kept and ASR time is
off the critical path; if they speak again, it is dropped.

When the turn ends: after `turn.min_silence_ms` of silence a `Pause` asks the session's
end-of-turn policy (voice/pipeline/endofturn.py: Smart Turn on the audio, the LM on the early final's
words); its verdict (`verdict`) ends the turn now or after more silence, up to `turn.ceiling_ms`,
where the VAD ends it anyway. With `turn.policy = "fixed"` the VAD's `vad.hangover_ms` alone
does. A user who resumes within `turn.resume_ms` of the end, before hearing the reply, continues
the same utterance: the next turn's audio starts with the last one's (`SpeechStarted.resumes` names
that turn), so its transcript holds both halves and nothing said is lost. Each turn still gets its one
final transcript (the superseded one's too, of the audio it had when it ended); the resumed turn's
final says which turn it `resumes`. `limits.max_utterance_s` bounds the whole of
it, the resumed halves included: past it the utterance is cut (`TooLong`) and cannot be resumed.
Once an utterance has `turn.barge_in_ms` of voiced audio it is `Talking`: speech, not a VAD blip,
which is what lets it interrupt a reply before its words are transcribed (voice/conversation/reply.py's Floor).
What was heard lately (`heard_lately`) lets the Floor tell a reply's echo from the user.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, replace

import numpy as np

from voice.pipeline import vad
from voice.pipeline.asr import SAMPLE_RATE, StreamingTranscriber, Transcriber
from voice.audio import StreamResampler, float_to_pcm16, pcm16_to_float, resample
from voice.config import Config
from voice.pipeline.endofturn import EndOfTurn, TextSignal, Verdict
from voice.events import SpeechStarted, SpeechStopped

log = logging.getLogger("voice.session")
PRE_ROLL_S = 0.3  # audio kept from before VAD declares speech, so the first syllable reaches ASR
LATELY_S = 1.5  # `heard_lately`: the last this much of an utterance (its pre-roll included)


@dataclass(frozen=True)
class Partial:
    """A partial transcript is being decoded: `text` gives it (None: nothing new). By then the
    user may have stopped; `TurnTaker.listening(turn)` says whether it is still wanted."""

    turn: int
    text: Awaitable[str | None]


@dataclass(frozen=True)
class Final:
    """The final transcript of `turn`. `ended` is set once the turn is over; before that the
    transcript is a speculation (decoded during the VAD hangover). `resumes`: the earlier turn
    whose words it holds too (SpeechStarted's), 0 if none."""

    turn: int
    transcript: Awaitable[str]
    ended: asyncio.Event
    resumes: int = 0


@dataclass(frozen=True)
class Pause:
    """The user has been quiet `turn.min_silence_ms`: is their turn over? The session asks the
    end-of-turn policy (voice/pipeline/endofturn.py) and gives its verdict back (`TurnTaker.verdict`)."""

    turn: int
    pause: int  # which pause of the session (a verdict for an earlier one is stale)
    audio: np.ndarray  # the utterance so far, 16 kHz float, its silence included
    transcript: asyncio.Future[str] | None  # the early final's (None: not taken)


@dataclass(frozen=True)
class Talking:
    """The user's speech in `turn` has had `turn.barge_in_ms` of voiced audio: speech, not a VAD
    blip, even before it has words (once per utterance)."""

    turn: int
    now: float


@dataclass(frozen=True)
class SpeculationDropped:
    """The user went on talking after a speculative final: it, and what was started on it, is void."""


@dataclass(frozen=True)
class TooLong:
    """The utterance is cut here, at `limit_s` (a SpeechStopped and a Final follow)."""

    limit_s: float


TurnEvent = SpeechStarted | Talking | SpeechStopped | Partial | Final | Pause | SpeculationDropped | TooLong


class EarlyFinal:
    """The final transcript decoded speculatively once the speaker has been quiet `early_ms`, while
    the VAD still waits out its hangover: if the pause was the end, ASR time is off the critical
    path; if they speak again, it is void. Used by the session's TurnTaker and Wyoming's dictation."""

    def __init__(self, transcriber: StreamingTranscriber, early_ms: int):
        self.transcriber, self.early_ms = transcriber, early_ms
        self.pending: asyncio.Future[str] | None = None

    def quiet(self, silence_ms: int, talk: bool = False) -> bool:
        """Has the speaker been quiet long enough to take the final early? `talk`: in background talk twice as
        long, as the level gate may have ended their speech before its last quiet sound (Endpointer.quiet_room:
        at 100 ms tiny.en wrote "seven of heart", at 200 ms "hearts", `voice room-eval` 15 dB under)."""
        return bool(self.early_ms) and silence_ms >= self.early_ms * (2 if talk else 1)

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
        self.asks = config.turn.policy != "fixed"  # else the VAD's hangover alone ends a turn
        # Asking, the VAD waits up to the policy's ceiling; the policy's verdict ends the turn sooner.
        self.endpointer = vad.Endpointer(replace(config.vad, hangover_ms=config.turn.ceiling_ms) if self.asks
                                         else config.vad, SAMPLE_RATE)
        self.whisper, self.transcriber = whisper, StreamingTranscriber(whisper, config.asr)
        self.early = EarlyFinal(self.transcriber, config.asr.early_final_ms)
        self.in_rate, self.resampler = in_rate, StreamResampler(SAMPLE_RATE)
        self.turn = 0
        self.audio_s = 0.0  # seconds of 16 kHz audio received
        self.arrivals: deque[tuple[float, float]] = deque(maxlen=500)  # (audio time, monotonic arrival)
        self.pre_roll: deque[np.ndarray] = deque()
        self.lately = np.zeros(0, np.float32)  # the last LATELY_S of 16 kHz audio received
        self.utterance_start_s = 0.0  # audio time the current utterance started
        self.resumes = 0  # the turn the current one continues (0: none)
        self.talking = False  # the current utterance has been voiced `turn.barge_in_ms` (Talking went out)
        self.partial_task: asyncio.Future[str | None] | None = None
        self.turn_ended: asyncio.Event | None = None  # of the early final (decoded during the hangover)
        self.pauses = 0  # pauses the policy was asked about
        self.asked = False  # about the current silence
        self.stop_at_ms: int | None = None  # the policy's verdict: the turn is over at this much silence
        self.last_word_at = 0.0  # when the last utterance's speech ended (its arrival): a held reply counts from it
        # The last utterance, until its reply is heard or turn.resume_ms has passed: speech that
        # resumes by then continues it (`SpeechStarted.resumes`).
        self.last_utterance: tuple[np.ndarray, float, int] | None = None  # (16 kHz audio, monotonic deadline, turn)

    @property
    def speaking(self) -> bool:
        """The user is talking (the VAD is in speech)."""
        return self.endpointer.in_speech

    def listening(self, turn: int) -> bool:
        """Is `turn` the one being spoken now (so its partial transcripts are still wanted)?"""
        return turn == self.turn and self.endpointer.in_speech

    def push(self, pcm16: bytes, now: float, playing: bool = False) -> list[TurnEvent]:
        """PCM16LE mono at the session's input rate, any length: what it did to the turn, in order.
        `playing`: a reply is playing, whose echo is not the user (voice/pipeline/vad.py's Levels)."""
        audio = self.resampler.push(pcm16_to_float(pcm16), self.in_rate)
        if not len(audio):
            return []
        self.audio_s += len(audio) / SAMPLE_RATE
        self.arrivals.append((self.audio_s, now))
        self.lately = np.concatenate([self.lately, audio])[-round(LATELY_S * SAMPLE_RATE):]
        out: list[TurnEvent] = []
        for ev in self.endpointer.push(float_to_pcm16(audio), playing):
            if isinstance(ev, vad.VoiceStart):
                out.append(self._speech_started(now))
            else:
                out += self._speech_stopped(ev, now)
        if self.endpointer.in_speech and not self.talking and self.endpointer.voiced_ms >= self.config.turn.barge_in_ms:
            self.talking = True
            out.append(Talking(self.turn, now))
        if self.endpointer.in_speech:
            self.transcriber.insert_audio_chunk(audio)
            limit = self.config.limits.max_utterance_s
            silence_ms = self.endpointer.silence_ms
            if limit and self.audio_s - self.utterance_start_s > limit:
                stopped = self.endpointer.force_stop()
                assert stopped is not None  # in speech
                out += [TooLong(limit), *self._speech_stopped(stopped, now, resumable=False)]
            elif self.stop_at_ms is not None and silence_ms >= self.stop_at_ms:
                out += self._end_of_turn(now)
            else:
                out += self._listen(silence_ms)
        else:
            self.pre_roll.append(audio)
            while sum(len(a) for a in self.pre_roll) > PRE_ROLL_S * SAMPLE_RATE:
                self.pre_roll.popleft()
        return out

    def heard_lately(self) -> np.ndarray:
        """The current utterance's last LATELY_S at most (16 kHz), its pre-roll included; its last sample
        came with the last push (the client streams in real time)."""
        samples = round((self.audio_s - self.utterance_start_s + PRE_ROLL_S) * SAMPLE_RATE)
        return self.lately[-samples:] if samples > 0 else self.lately[:0]

    def not_talking_yet(self) -> None:
        """The current utterance's Talking was the reply's own echo (voice/conversation/reply.py's
        `Floor.echo_heard`): the level gate learns it as the echo, and it is asked again at the next audio,
        which may be the user."""
        self.talking = False
        self.endpointer.levels.was_echo()

    def _speech_started(self, now: float) -> SpeechStarted:
        self.turn += 1
        self.utterance_start_s = self.audio_s
        self.talking = False
        self.transcriber.reset()
        last, self.last_utterance = self.last_utterance, None
        self.resumes = 0
        if last is not None and now <= last[1]:
            self.resumes = last[2]
            self.transcriber.insert_audio_chunk(last[0])
            # the carried audio counts: `limits.max_utterance_s` bounds the whole resumed utterance
            self.utterance_start_s -= len(last[0]) / SAMPLE_RATE
        for chunk in self.pre_roll:
            self.transcriber.insert_audio_chunk(chunk)
        self.pre_roll.clear()
        return SpeechStarted(self.turn, now, self.resumes)

    def resumable(self, turn: int, now: float) -> bool:
        """May speech starting now still continue `turn` (it ended in a pause, not by the client or the
        length limit, its reply is not heard yet, `turn.resume_ms` has not passed)?"""
        last = self.last_utterance
        return last is not None and last[2] == turn and now <= last[1]

    def resumes_instead(self, turn: int, earlier: int) -> None:
        """`turn` went on with `earlier`'s utterance but was not the user (the room's talk, with no words of
        its own: voice/conversation/reply.py's `Floor.not_resumed`): speech that resumes it resumes `earlier`."""
        if self.last_utterance is not None and self.last_utterance[2] == turn:
            audio, deadline, _ = self.last_utterance
            self.last_utterance = (audio, deadline, earlier)

    def heard(self) -> None:
        """The reply to the last utterance is being heard: speech from now on is a new utterance."""
        self.last_utterance = None

    async def judge(self, pause: Pause, policy: EndOfTurn, signal: TextSignal) -> list[TurnEvent]:
        """Ask the end-of-turn policy about `pause` (with the early final's transcript, once decoded,
        for the LM's `signal`): what its verdict does to the turn. A policy that fails leaves the
        turn to end at the ceiling."""
        text, transcript = None, pause.transcript
        if transcript is not None and policy.reads_text:
            await asyncio.wait([transcript])
            if transcript.cancelled():
                return []  # they spoke again: this pause is over
            text = None if transcript.exception() is not None else transcript.result()
        silence_ms = self.endpointer.silence_ms
        try:
            verdict = await policy.decide(pause.audio, silence_ms, text, signal)
        except Exception as err:  # noqa: BLE001 - the VAD's ceiling still ends the turn
            log.warning("session=%s the end-of-turn policy failed: %r", self.name, err)
            return []
        log.info("session=%s turn=%d end of turn at %d ms of silence: %s", self.name, self.turn, silence_ms, verdict)
        return self.verdict(pause.pause, verdict, time.monotonic())

    def verdict(self, pause: int, verdict: Verdict, now: float) -> list[TurnEvent]:
        """The end-of-turn policy's answer about `pause`: the turn ends now, or once the silence
        reaches `verdict.wait_ms` (unless the user speaks again first)."""
        if pause != self.pauses or not self.asked or not self.endpointer.in_speech:
            return []  # stale: they spoke again since
        if verdict.done or self.endpointer.silence_ms >= verdict.wait_ms:
            return self._end_of_turn(now)
        self.stop_at_ms = verdict.wait_ms
        return []

    def _end_of_turn(self, now: float) -> list[TurnEvent]:
        stopped = self.endpointer.force_stop(suppress=False)
        return self._speech_stopped(stopped, now) if stopped is not None else []

    def _listen(self, silence_ms: int) -> list[TurnEvent]:
        """Partials while the user talks; a speculative final once they have been quiet a while,
        and the question whether their turn is over."""
        out: list[TurnEvent] = []
        if self.early.quiet(silence_ms, talk=not self.endpointer.quiet_room):
            if (early := self.early.take()) is not None:
                self.turn_ended = asyncio.Event()
                out.append(Final(self.turn, early, self.turn_ended, self.resumes))
        if self.asks and silence_ms >= self.config.turn.min_silence_ms:
            if not self.asked:
                self.asked, self.pauses = True, self.pauses + 1
                out.append(Pause(self.turn, self.pauses, self.transcriber.audio(), self.early.pending))
            return out
        if silence_ms < self.config.turn.min_silence_ms:  # they spoke again: the policy asks at the next pause
            self.asked, self.stop_at_ms = False, None
        if self.early.quiet(silence_ms):
            return out
        if self.early.drop():  # they spoke again: the speculation is stale
            self.turn_ended = None
            out.append(SpeculationDropped())
        if silence_ms == 0 and (self.partial_task is None or self.partial_task.done()):
            self.partial_task = asyncio.ensure_future(self.transcriber.process_iter())
            out.append(Partial(self.turn, self.partial_task))
        return out

    def _speech_stopped(self, ev: vad.VoiceEnd, now: float, resumable: bool = True) -> list[TurnEvent]:
        """The utterance is over. `resumable`: a pause ended it (not the client, not the length
        limit), so speech that resumes soon continues it."""
        # The audio that was just pushed is still part of the utterance's tail; that's fine.
        self.last_word_at = self._arrival_of(ev.speech_end_s)
        out: list[TurnEvent] = [SpeechStopped(self.turn, now, self.last_word_at)]
        if self.partial_task is not None:
            self.partial_task.cancel()
        ended, self.turn_ended = self.turn_ended, None
        self.asked, self.stop_at_ms = False, None
        resume_s = self.config.turn.resume_ms / 1000 if resumable else 0
        self.last_utterance = (self.transcriber.audio(), now + resume_s, self.turn) if resume_s else None
        transcript = self.early.final()  # the early final's, if one was taken (then it went out already)
        if ended is None:
            ended = asyncio.Event()
            out.append(Final(self.turn, transcript, ended, self.resumes))
        ended.set()
        return out

    def end_now(self, now: float) -> list[TurnEvent]:
        """The client says the utterance is over (Realtime `input_audio_buffer.commit`); no events
        if nobody is speaking."""
        ev = self.endpointer.force_stop(suppress=False)
        if ev is None:
            return []
        return self._speech_stopped(ev, now, resumable=False)

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
        return [*out, SpeechStopped(self.turn, now, now), Final(self.turn, nothing, ended)]

    async def transcribe(self, pcm16: bytes) -> tuple[str, float]:
        """A whole recording beside the live audio (a Realtime audio item), at the session's input
        rate, through the same ASR: (its transcript, its seconds)."""
        samples = resample(pcm16_to_float(pcm16), self.in_rate, SAMPLE_RATE)
        transcriber = StreamingTranscriber(self.whisper, self.config.asr)
        transcriber.insert_audio_chunk(samples)
        return (await transcriber.finish()).strip(), len(samples) / SAMPLE_RATE

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
        self.last_utterance = None
        self.transcriber.reset()  # no longer someone talking, for the other sessions' partials
        return [self.partial_task] if self.partial_task is not None else []
