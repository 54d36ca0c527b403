"""The Realtime client events /v1/realtime takes, as types: every event is validated by one schema
before it is acted on, and whatever fails becomes an `error` event naming the field
(voice/transports/realtime.py), never an exception in the connection.

GA and beta clients send the same event names; `session.update` takes both shapes (GA's
`audio.input.format`, beta's `input_audio_format`, ...). Types are JSON's, strictly (no "5" for
5, no `true` for 1). Fields this server does not use are ignored: OpenAI's own clients send many.
Limits that come from the configuration (lengths, counts) are checked where the event is handled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError, \
    model_validator

from voice.config import TOOL_NAME

FORMATS = {"audio/pcm": 24000, "audio/pcmu": 8000, "audio/pcma": 8000}  # GA format types -> rate
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
ITEM_KINDS = ("message", "function_call_output")  # the `type`s that pick an item's schema...
PART_KINDS = ("input_text", "input_audio")  # ...and a content part's


class Strict(BaseModel):
    """Types as JSON has them: a string is not a number, `true` is not 1."""

    model_config = ConfigDict(strict=True)


def _named_format(value: object) -> object:
    """A format given by name (beta's "pcm16", or a GA type as a string) is that format's object."""
    return {"type": BETA_FORMATS.get(value, value)} if isinstance(value, str) else value


class AudioFormat(Strict):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
    rate: int | None = None

    @model_validator(mode="after")
    def _one_rate(self) -> AudioFormat:
        if self.rate is not None and self.rate != FORMATS[self.type]:
            raise ValueError(f"{self.type} is supported at {FORMATS[self.type]} Hz only")
        return self


Format = Annotated[AudioFormat, BeforeValidator(_named_format)]


class TurnDetection(Strict):
    """server_vad: the VAD alone, `silence_duration_ms` its hangover; semantic_vad: our end-of-turn
    policy (voice/pipeline/endofturn.py), `eagerness` mapped onto its threshold and ceiling."""

    type: Literal["server_vad", "semantic_vad"]
    eagerness: Literal["low", "medium", "high", "auto"] | None = None
    threshold: float | None = Field(None, ge=0, le=1)
    prefix_padding_ms: int | None = Field(None, ge=0)
    silence_duration_ms: int | None = Field(None, ge=100, le=5000)
    create_response: bool | None = None
    interrupt_response: bool | None = None


class InputSettings(Strict):
    format: Format | None = None
    turn_detection: TurnDetection | None = None  # null: the client commits each utterance itself


class OutputSettings(Strict):
    format: Format | None = None
    voice: str | None = Field(None, min_length=1)


class Audio(Strict):
    input: InputSettings | None = None
    output: OutputSettings | None = None


class FunctionTool(Strict):
    type: Literal["function"] = "function"  # MCP tools are not supported
    name: str = Field(pattern=TOOL_NAME.pattern)
    description: str = ""
    parameters: dict | None = None  # a JSON schema


class SessionSettings(Strict):
    """`session.update`'s `session`, GA or beta shape."""

    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    voice: str | None = Field(None, min_length=1)  # beta
    input_audio_format: Format | None = None  # beta
    output_audio_format: Format | None = None  # beta
    turn_detection: TurnDetection | None = None  # beta
    audio: Audio | None = None  # GA

    def audio_format(self, side: Literal["input", "output"]) -> AudioFormat | None:
        """The format asked for on one side, from wherever the client put it."""
        ga = getattr(self.audio, side) if self.audio else None
        return (ga.format if ga else None) or getattr(self, f"{side}_audio_format")

    def turn_detection_given(self) -> tuple[bool, TurnDetection | None]:
        """(was turn detection set, to what): null is a setting (off), absence is not."""
        ga = self.audio.input if self.audio and self.audio.input else None
        if ga is not None and "turn_detection" in ga.model_fields_set:
            return True, ga.turn_detection
        return "turn_detection" in self.model_fields_set, self.turn_detection

    def voice_given(self) -> str | None:
        ga = self.audio.output if self.audio and self.audio.output else None
        return (ga.voice if ga else None) or self.voice


class InputText(Strict):
    type: Literal["input_text"]
    text: str = Field(min_length=1)


class InputAudio(Strict):
    type: Literal["input_audio"]
    audio: str  # base64, in the session's input format


def _kind(default: str) -> Callable[[object], str | None]:
    """The `type` of an object (`default` if it has none) picks its schema; not an object: none."""
    def kind(value: object) -> str | None:
        return value.get("type", default) if isinstance(value, dict) else None
    return kind


Part = Annotated[Annotated[InputText, Tag("input_text")] | Annotated[InputAudio, Tag("input_audio")],
                 Discriminator(_kind(""))]


class Message(Strict):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "system"]
    content: list[Part] = Field(min_length=1)

    @model_validator(mode="after")
    def _system_is_text(self) -> Message:
        if self.role == "system" and any(isinstance(part, InputAudio) for part in self.content):
            raise ValueError("a system message has input_text parts only")
        return self


class FunctionCallOutput(Strict):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: str


Item = Annotated[Annotated[Message, Tag("message")] | Annotated[FunctionCallOutput, Tag("function_call_output")],
                 Discriminator(_kind("message"))]


class ClientEvent(Strict):
    event_id: str | None = None


class SessionUpdate(ClientEvent):
    session: SessionSettings


class AudioAppend(ClientEvent):
    audio: str  # base64, in the session's input format


class NoFields(ClientEvent):
    """input_audio_buffer.commit and .clear."""


class ItemCreate(ClientEvent):
    item: Item


class ResponseCreate(ClientEvent):
    response: dict | None = None  # per-response overrides: not supported, ignored


class ResponseCancel(ClientEvent):
    response_id: str | None = None


class ItemTruncate(ClientEvent):
    item_id: str
    content_index: int = Field(0, ge=0)
    audio_end_ms: int = Field(ge=0)


FIXED_MESSAGES = {"model_type": "Input should be an object",  # pydantic's names our classes
                  "union_tag_not_found": "Input should be an object with a type"}


def problem(err: ValidationError) -> tuple[str, str]:
    """(the bad field's path, what is wrong with it) of a validation's first failure."""
    first = err.errors()[0]
    path = ""
    for step in first["loc"]:
        if isinstance(step, int):
            path += f"[{step}]"
        elif step not in ITEM_KINDS + PART_KINDS:  # the schema picked by an object's `type`, not a field
            path += f".{step}" if path else step
    if first["type"] == "union_tag_invalid":
        return path, f"type {str(first['ctx']['tag'])[:40]!r} is not one of {first['ctx']['expected_tags']}"
    return path, FIXED_MESSAGES.get(first["type"], first["msg"])
