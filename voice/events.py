"""Typed events of one conversation (small dataclasses, Wyoming-style).

The session emits them; transports turn them into bytes on the wire and the latency tracker
watches them. `to_wire` is the native protocol's JSON shape (see PROTOCOL.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PROTOCOL_VERSION = 1


@dataclass
class Event:
    turn: int
    t: float  # time.monotonic() when it happened

    type = "event"

    def to_wire(self) -> dict:
        body = {k: v for k, v in asdict(self).items() if k != "t"}
        return {"type": self.type, **body}


@dataclass
class SpeechStarted(Event):
    type = "speech_started"


@dataclass
class SpeechStopped(Event):
    speech_end: float = 0.0  # monotonic time the user actually stopped (detection minus hangover)
    type = "speech_stopped"

    def to_wire(self) -> dict:
        return {"type": self.type, "turn": self.turn}


@dataclass
class Transcript(Event):
    text: str = ""
    final: bool = False
    type = "transcript"


@dataclass
class ReplyText(Event):
    text: str = ""  # the newly committed text (a delta)
    block: int = 0
    tokens: int = 0
    steps: int = 0
    type = "reply"


@dataclass
class TtsAudio(Event):
    """A synthesised phrase, ready to send (resampled to the client's rate)."""

    pcm: bytes = b""
    rate: int = 16000
    text: str = ""
    type = "tts_audio"

    @property
    def seconds(self) -> float:
        return len(self.pcm) / 2 / self.rate

    def to_wire(self) -> dict:
        return {"type": self.type, "turn": self.turn, "bytes": len(self.pcm), "text": self.text}


@dataclass
class AudioSent(Event):
    """The transport put the first bytes of a phrase on the wire."""

    type = "audio_sent"


@dataclass
class ReplyDone(Event):
    text: str = ""  # everything the LM committed
    heard: str = ""  # what the user heard before a barge-in (== text when not interrupted)
    interrupted: bool = False
    type = "reply_done"


@dataclass
class Clear(Event):
    """Barge-in: drop any reply audio you still hold."""

    type = "clear"


@dataclass
class LatencyReport(Event):
    stages_ms: dict = field(default_factory=dict)
    marks_ms: dict = field(default_factory=dict)  # since end of user speech
    over_budget: list = field(default_factory=list)
    voice_to_voice_ms: float | None = None
    type = "latency"


@dataclass
class Error(Event):
    code: str = "error"
    message: str = ""
    stage: str = ""  # asr | lm | tts for a stage failure or timeout
    apology: bool = False  # the spoken apology follows (binary frames of this turn)
    type = "error"

    def to_wire(self) -> dict:
        body = {"type": self.type, "turn": self.turn, "code": self.code, "message": self.message}
        if self.stage:
            body["stage"] = self.stage
        if self.apology:
            body["apology"] = True
        return body
