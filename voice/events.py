"""Typed events of one conversation (small dataclasses, Wyoming-style).

The session emits them; transports turn them into bytes on the wire and the latency tracker
watches them. `to_wire` is the native protocol's JSON shape (see PROTOCOL.md) and `from_wire`
reads it back: the one codec of the server and every client (mic, bench, soak).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import ClassVar

PROTOCOL_VERSION = 1


@dataclass
class Event:
    turn: int
    t: float  # time.monotonic() when it happened

    type = "event"
    optional: ClassVar[tuple[str, ...]] = ()  # fields the wire may leave out (from_wire gives them their defaults)

    def to_wire(self) -> dict:
        body = {k: v for k, v in asdict(self).items() if k != "t"}
        return {"type": self.type, **body}


@dataclass
class Ready(Event):
    """The server accepted `start` (turn 0); audio may flow."""

    version: int = PROTOCOL_VERSION
    session_id: str = ""
    sample_rate: int = 16000  # of the reply audio
    encoding: str = "pcm_s16le"
    type = "ready"

    def to_wire(self) -> dict:
        return {"type": self.type, "version": self.version, "session_id": self.session_id,
                "sample_rate": self.sample_rate, "encoding": self.encoding}


@dataclass
class SpeechStarted(Event):
    """The user started talking: turn `turn` begins. `resumes`: the turn this one continues (0:
    none): they went on after a pause that ended it before its reply was heard, so this turn's
    transcript holds that one's words too and supersedes it (voice/conversation/turns.py). On the wire only
    when set."""

    resumes: int = 0
    type = "speech_started"
    optional = ("resumes",)

    @property
    def resumed(self) -> bool:
        return bool(self.resumes)

    def to_wire(self) -> dict:
        return {"type": self.type, "turn": self.turn, **({"resumes": self.resumes} if self.resumes else {})}


@dataclass
class SpeechStopped(Event):
    speech_end: float = 0.0  # monotonic time the user actually stopped (detection minus hangover)
    type = "speech_stopped"
    optional = ("speech_end",)  # the server's clock: not sent

    def to_wire(self) -> dict:
        return {"type": self.type, "turn": self.turn}


@dataclass
class Transcript(Event):
    """`resumes` (a final's, 0: none): the earlier turn this one's text holds too (SpeechStarted's);
    on the wire only when set."""

    text: str = ""
    final: bool = False
    resumes: int = 0
    type = "transcript"
    optional = ("resumes",)

    def to_wire(self) -> dict:
        return {"type": self.type, "turn": self.turn, "text": self.text, "final": self.final,
                **({"resumes": self.resumes} if self.resumes else {})}


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
    optional = ("pcm", "rate")  # the PCM follows as binary frames at the session's rate

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
class ToolCall(Event):
    """The LM called a tool (voice/pipeline/tools.py); its result follows as `tool_result`."""

    id: str = ""
    name: str = ""
    arguments: dict = field(default_factory=dict)
    type = "tool_call"


@dataclass
class ToolResult(Event):
    id: str = ""
    name: str = ""
    result: str = ""
    status: str = "ok"  # ok | error | cancelled
    ms: float = 0.0
    type = "tool_result"


@dataclass
class Announcement(Event):
    """Speech outside a turn (a timer that is due); its audio follows as for a reply. `turn`: the last turn."""

    text: str = ""
    type = "announcement"


@dataclass
class Work(Event):
    """When a reply's work happened, whether the user was waiting yet or not: a speculative reply
    decodes and synthesises during the hangover, before its events are released. Not sent; the
    latency report's timeline (`marks_ms["work"]`)."""

    marks: dict = field(default_factory=dict)  # name -> time.monotonic()
    type = "work"


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
    client: bool = False  # what the client sent caused it (its code says so on the wire; for the codecs)
    type = "error"
    optional = ("stage", "apology", "client")  # `client`: not sent

    def to_wire(self) -> dict:
        body = {"type": self.type, "turn": self.turn, "code": self.code, "message": self.message}
        if self.stage:
            body["stage"] = self.stage
        if self.apology:
            body["apology"] = True
        return body


WIRE_TYPES: dict[str, type[Event]] = {cls.type: cls for cls in (
    Ready, SpeechStarted, SpeechStopped, Transcript, ReplyText, ToolCall, ToolResult, Announcement, TtsAudio, ReplyDone,
    Clear, LatencyReport, Error)}


# A field's annotation -> what its JSON value must be an instance of (from_wire)
FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "str": str, "int": int, "float": (int, float), "bool": bool, "dict": dict, "list": list,
    "float | None": (int, float, type(None)), "bytes": bytes}


def from_wire(body: object, t: float = 0.0) -> Event:
    """The event a JSON message of the native protocol stands for (`t`: when it arrived). Unknown
    fields are ignored (a newer server may add some); ValueError on an unknown type, a missing
    field (other than an event's `optional` ones) or a field of the wrong type. A `tts_audio`
    comes back without its PCM (that is a binary frame)."""
    if not isinstance(body, dict) or body.get("type") not in WIRE_TYPES:
        kind = body.get("type") if isinstance(body, dict) else type(body).__name__
        raise ValueError(f"not an event of this protocol: {kind!r}")
    cls = WIRE_TYPES[body["type"]]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [name for name in fields if name not in body and name != "t" and name not in cls.optional
               and not (cls is Ready and name == "turn")]
    if missing:
        raise ValueError(f"{body['type']} event without {', '.join(missing)}")
    values = {"turn": body.get("turn", 0), "t": t}
    for name, value in body.items():
        f = fields.get(name)
        if f is None or name in ("t", "turn"):
            continue  # e.g. tts_audio's "bytes"; newer servers may add fields
        expected = FIELD_TYPES.get(str(f.type))
        if expected is not None and (not isinstance(value, expected) or (expected is int and isinstance(value, bool))):
            raise ValueError(f"{body['type']}.{name} should be {f.type}, got {type(value).__name__}")
        values[name] = value
    if not isinstance(values["turn"], int) or isinstance(values["turn"], bool):
        raise ValueError(f"{body['type']}.turn should be an int")
    return cls(**values)
