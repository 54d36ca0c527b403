"""Endpointing: where voice starts and ends in a stream of PCM, with webrtcvad (in audio time; the
turn those make is voice/conversation/turns.py's, and events.SpeechStarted / SpeechStopped are its moments).

Single voiced frames are common in noise and short pauses are common in speech, so the
start needs a run of voiced frames and the stop needs a run of unvoiced ones (the hangover).
webrtcvad also calls the first ~100 ms of any noise speech while its noise model adapts,
so speech cannot start during a short warm-up.

webrtcvad calls any speech "speech", however far below the user it is: background talk 15 dB under
the user held a turn open forever (issue 55). So a voiced frame is the user's only when it is loud
like them (`Levels`): within `vad.user_margin_db` of their speech level, or `vad.floor_margin_db` above
the room's floor, both tracked per stream (Pipecat gates Silero with an absolute smoothed volume; the
margins here are relative, so a quiet microphone and a loud one are alike). Once the user speaks the
gate holds them more easily (hysteresis, so clean speech stays whole): in a room the detector hears as
silence, what it voices within a second of their last loud frame is still theirs; a pause in their
speech teaches the floor only after its first 100 ms; and after a cut at the utterance limit their
pause, heard against the room, not a reply's echo, is what lets speech start again. The room is
learnt from the stream's first frames: talk at the moment a stream opens is the room's, not a user's
(the room-alone goal of issue 55), so a stream that opens mid-word has its first words taken for the
room until they pause (~1 s); microphones open before their users speak.
"""

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import webrtcvad

from voice.config import VadConfig

SUPPORTED_RATES = (8000, 16000, 32000, 48000)


@dataclass(frozen=True)
class VoiceStart:
    t_audio_s: float  # stream time when the start was detected


@dataclass(frozen=True)
class VoiceEnd:
    t_audio_s: float  # stream time when the stop was detected
    speech_end_s: float  # stream time where voiced audio ended (detection minus hangover)


class Levels:
    """The stream's levels, in dB of a frame's power smoothed over ~50 ms: the room's floor (the median of
    the last few seconds that were not the user's: background talk's loudest moments are within ~7 dB of
    it, `voice room-eval`); the user's speech (learnt from their frames well above the floor, kept across
    utterances, so their quieter syllables count too once they have spoken: an envelope that rises fast
    and falls slowly, near their louder syllables); and while a reply plays, its echo (the loudest of what
    the microphone hears then that is not the user: on a speakerphone the reply comes back, with
    headphones or the browser's echo cancellation nothing does)."""

    SMOOTHING = 0.3  # of the smoothed level per 20 ms frame
    FLOOR_S = 5.0  # the floor: the median of this much of the room
    ECHO_S, ECHO_PERCENTILE = 3.0, 90  # the echo: this percentile of the last ECHO_S heard while replies played
    ECHO_READY = 25  # frames of it before it is trusted (until then: vad.echo_margin_db under the user's level)
    USER_RISE, USER_FALL = 0.2, 0.005  # of the user's level per frame of their speech louder / quieter than it
    SILENCE_DB = -90.0  # digital silence counts as this
    QUIET_ROOM = 0.25  # a room whose frames the detector voices less often than this is quiet: see `quiet_room`
    ROOM_KNOWN = 25  # frames of the room before its voicing is judged (until then it counts as quiet)
    HOLD_S = 1.0  # in a quiet room, voiced audio this soon after the user's last frame loud like them is still theirs
    GAP_FRAMES = 5  # a pause in speech teaches the floor from its 5th frame on: before, the level holds the syllable

    def __init__(self, config: VadConfig) -> None:
        self.config = config
        self.level: float | None = None  # the last frame's smoothed level
        self.recent: deque[float] = deque(maxlen=round(self.FLOOR_S * 1000 / config.frame_ms))
        self.floor = self.SILENCE_DB
        self.room_voiced: deque[bool] = deque(maxlen=self.recent.maxlen)  # the detector's say on those frames
        self.user: float | None = None  # None until the user first spoke
        self.gap = 0  # unvoiced frames in a row inside speech
        self.since_loud = 0  # frames inside speech since the last one loud like the user
        self.echoed: deque[float] = deque(maxlen=round(self.ECHO_S * 1000 / config.frame_ms))
        self.echo = self.SILENCE_DB

    def hear(self, frame: bytes, voiced: bool, in_speech: bool, playing: bool = False) -> bool:
        """Is this frame, voiced or not by the detector, the user's speech? Learns from it. `playing`: a
        reply is playing, so its own voice may come back at the microphone: then only speech well above
        the room and `vad.echo_margin_db` above the echo is theirs."""
        cfg = self.config
        samples = np.frombuffer(frame, dtype="<i2").astype(np.float32) / 32768
        db = max(10 * math.log10(float(np.dot(samples, samples)) / len(samples) + 1e-12), self.SILENCE_DB)
        level = self.level = db if self.level is None else self.level + self.SMOOTHING * (db - self.level)
        floor = self.floor
        clear = level >= floor + cfg.floor_margin_db  # well above the room: whoever it is, they are near
        if playing:
            users = voiced and clear and level >= self._echo_threshold()
        else:
            users = voiced and (clear or (self.user is not None and level >= self.user - cfg.user_margin_db
                                          and level >= floor + cfg.room_margin_db))
            self.since_loud = 0 if users else self.since_loud + 1
            users = users or (voiced and in_speech and self.quiet_room
                              and self.since_loud * cfg.frame_ms <= self.HOLD_S * 1000)
        self.gap = self.gap + 1 if in_speech and not voiced else 0
        if users and in_speech and clear and not playing:
            rate = self.USER_RISE if self.user is None or level > self.user else self.USER_FALL
            self.user = level if self.user is None else self.user + rate * (level - self.user)
        elif not users and not (in_speech and (voiced or self.gap < self.GAP_FRAMES)):  # (not their quiet syllables)
            if playing:
                self.echoed.append(level)
                self.echo = float(np.percentile(self.echoed, self.ECHO_PERCENTILE))
            else:
                self.recent.append(level)
                self.floor = float(np.median(self.recent))
                if not in_speech:  # (inside speech only the room's unvoiced gaps are learnt: not a fair sample)
                    self.room_voiced.append(voiced)
        return users

    def was_echo(self) -> None:
        """The last frame, taken for the user's, was the reply's echo (voice/conversation/reply.py's
        `Floor.echo_heard` compared it with the reply): learnt as the echo, so that the gate holds it back
        from now on (an echo canceller adapting again lets through ~1 s far louder than the residue learnt)."""
        if self.level is not None:
            self.echoed.append(self.level)
            self.echo = float(np.percentile(self.echoed, self.ECHO_PERCENTILE))

    @property
    def quiet_room(self) -> bool:
        """Does the detector hear the room as silence? Then, once the user speaks, a frame it voices up to
        HOLD_S after their last loud one is theirs, as without the gate: their fading syllables and soft
        onsets may be as quiet as the room's noise (a clean recording's last syllable 2-6 dB above its
        floor, `tests/test_room.py`), and level alone would cut them. In background talk the room is
        voiced too and the margins alone decide (webrtcvad can take a second to voice faint talk, hence
        the bound). Until ROOM_KNOWN frames of it are heard it counts as quiet: a recording that starts
        speaking at once has only its onset, which the detector voices, to judge it by."""
        known = len(self.room_voiced)
        return known < self.ROOM_KNOWN or sum(self.room_voiced) < self.QUIET_ROOM * known

    def _echo_threshold(self) -> float:
        """The least a frame heard while a reply plays must have to be the user's."""
        if len(self.echoed) >= self.ECHO_READY:
            return self.echo + self.config.echo_margin_db
        # the echo not heard yet: it may be as loud as the reply fed back on a speakerphone
        return self.SILENCE_DB if self.user is None else self.user - self.config.echo_margin_db


class Endpointer:
    """Stateful VAD over int16 PCM chunks of any size; times count the audio pushed since reset."""

    def __init__(self, config: VadConfig, sample_rate: int = 16000) -> None:
        if sample_rate not in SUPPORTED_RATES:
            raise ValueError(f"webrtcvad takes sample rates {SUPPORTED_RATES}, not {sample_rate}")
        self.config = config
        self.sample_rate = sample_rate
        self._frame_bytes = 2 * sample_rate * config.frame_ms // 1000
        self._start_frames = math.ceil(config.start_ms / config.frame_ms)
        self._stop_frames = math.ceil(config.hangover_ms / config.frame_ms)
        self._warmup_frames = math.ceil(config.warmup_ms / config.frame_ms)
        self.reset()

    @property
    def in_speech(self) -> bool:
        return self._in_speech

    @property
    def voiced_ms(self) -> int:
        """Voiced audio in the current speech so far, its start included (0 when not in speech): how
        much of it is speech, not how long the VAD has been in speech (a blip of noise holds it there
        for a whole hangover)."""
        return self._voiced * self.config.frame_ms if self._in_speech else 0

    @property
    def quiet_room(self) -> bool:
        """Does the detector hear the room as silence (`Levels.quiet_room`; always, the gate off)? In a room it
        voices (background talk) the gate may end the user's speech before their last quiet sound: the "s" of
        "hearts" 15 dB over the talk came 100-200 ms after it (voice/conversation/turns.py's early final)."""
        return not self.config.follow_user or self.levels.quiet_room

    @property
    def seconds_heard(self) -> float:
        """Audio pushed since the reset (whole frames), in seconds: the stream time events are in."""
        return self._seconds(self._frames_seen)

    @property
    def silence_ms(self) -> int:
        """Unvoiced audio at the end of the current speech so far (0 when not in speech)."""
        return self._run * self.config.frame_ms if self._in_speech else 0

    def reset(self) -> None:
        """Start over as if newly built, for a new stream (utterances need no reset)."""
        self._vad = webrtcvad.Vad(self.config.aggressiveness)
        self.levels = Levels(self.config)
        self._pending = b""
        self._frames_seen = 0
        self._run = 0  # consecutive frames that disagree with the current state
        self._voiced = 0  # voiced frames of the current speech
        self._in_speech = False
        self._suppressed = False  # after force_stop: no new speech until a hangover of silence

    def push(self, pcm16: bytes, playing: bool = False) -> list[VoiceStart | VoiceEnd]:
        """Feed audio; return the events it completed, in order. `playing`: the reply is playing (Levels.hear)."""
        self._pending += pcm16
        events: list[VoiceStart | VoiceEnd] = []
        whole = len(self._pending) - len(self._pending) % self._frame_bytes
        for offset in range(0, whole, self._frame_bytes):
            event = self._step(self._pending[offset : offset + self._frame_bytes], playing)
            if event is not None:
                events.append(event)
        self._pending = self._pending[whole:]
        return events

    def force_stop(self, suppress: bool = True) -> VoiceEnd | None:
        """End the current speech now: an utterance over the length limit, or a client that says
        it is over (`suppress=False`). Suppressed, speech can only start again after the user
        pauses for a hangover, so a monologue or steady noise is not chopped into back-to-back turns."""
        if not self._in_speech:
            return None
        unvoiced, self._in_speech, self._run, self._suppressed = self._run, False, 0, suppress
        return VoiceEnd(t_audio_s=self._seconds(self._frames_seen),
                             speech_end_s=self._seconds(self._frames_seen - unvoiced))

    def _step(self, frame: bytes, playing: bool) -> VoiceStart | VoiceEnd | None:
        self._frames_seen += 1
        warming_up = self._frames_seen <= self._warmup_frames
        voiced = self._vad.is_speech(frame, self.sample_rate) and not warming_up
        if self.config.follow_user:
            # suppressed, the user is still talking past the limit: their pause lifts it, heard against the
            # room (the reply to what they said may be playing meanwhile; its echo holds it too, never starts speech)
            voiced = self.levels.hear(frame, voiced, self._in_speech or self._suppressed,
                                      playing and not self._suppressed)
        if self._suppressed:
            self._run = 0 if voiced else self._run + 1
            if self._run >= self._stop_frames:
                self._suppressed, self._run = False, 0
            return None
        self._run = self._run + 1 if voiced != self._in_speech else 0
        if voiced and self._in_speech:
            self._voiced += 1
        if not self._in_speech and self._run >= self._start_frames:
            self._in_speech, self._run, self._voiced = True, 0, self._run
            return VoiceStart(t_audio_s=self._seconds(self._frames_seen))
        if self._in_speech and self._run >= self._stop_frames:
            speech_end_frames = self._frames_seen - self._run
            self._in_speech, self._run = False, 0
            return VoiceEnd(
                t_audio_s=self._seconds(self._frames_seen),
                speech_end_s=self._seconds(speech_end_frames),
            )
        return None

    def _seconds(self, frames: int) -> float:
        return frames * self.config.frame_ms / 1000
