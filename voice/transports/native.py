"""The native websocket protocol (PROTOCOL.md): JSON control + PCM16LE binary frames.

Bad input is answered with an `error` event and dropped; only a missing or invalid `start`
closes the socket, because without it nothing else can be understood. Every text frame goes
through `engine.common.wire.decode_json`, the one bounded JSON decoder of every front (size, depth,
number length, no lone surrogates), so that nothing a client sends raises past it. Before
that, the connection is authenticated and admitted (`voice.service.auth`, `voice.service.limits`); a refusal is an
`error` and a close too. A session the server ends (a limit, shutdown) gets its `error`,
then a close with the error code as reason.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.common.wire import WireError, decode_json
from voice.audio import RATES
from voice.service.auth import Auth
from voice.config import SessionConfig
from voice.events import PROTOCOL_VERSION, Event, Ready, TtsAudio
from voice.conversation.session import Session
from voice.service.instance import Instance
from voice.transports.common import FLUSH_S, ConversationRunner, close_ws, fail, run_admitted

log = logging.getLogger("voice.native")
ENCODINGS = ("pcm_s16le",)
MAX_SYSTEM_PROMPT_CHARS = SessionConfig.max_system_prompt_chars
MAX_TEXT_BYTES = SessionConfig.max_text_bytes
_SURROGATE = re.compile("[\ud800-\udfff]")


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def parse_start(text: str, max_prompt_chars: int = MAX_SYSTEM_PROMPT_CHARS,
                max_text_bytes: int = MAX_TEXT_BYTES) -> dict:
    """Validate a `start` message; returns {in_rate, out_rate, system_prompt, lm_mode}."""
    msg = decode(text, max_text_bytes, "expected a JSON start message")
    if not isinstance(msg, dict) or msg.get("type") != "start":
        raise ProtocolError("expected_start", "the first message must be {\"type\": \"start\", ...}")
    version = msg.get("version", PROTOCOL_VERSION)
    if not _is_int(version) or version != PROTOCOL_VERSION:
        raise ProtocolError("unsupported_version", f"protocol version {str(version)[:40]!r} is not supported "
                                                   f"(this server speaks {PROTOCOL_VERSION})")
    rate = msg.get("sample_rate")
    out_rate = msg.get("output_sample_rate", rate)
    for name, value in (("sample_rate", rate), ("output_sample_rate", out_rate)):
        if not _is_int(value) or value not in RATES:
            raise ProtocolError("bad_sample_rate", f"{name} must be one of {RATES}, not {value!r}"[:200])
    if msg.get("encoding", "pcm_s16le") not in ENCODINGS:
        raise ProtocolError("bad_encoding", f"encoding must be one of {ENCODINGS}")
    session = msg.get("session")
    if session is None:
        session = {}
    if not isinstance(session, dict):
        raise ProtocolError("bad_session", "session must be an object")
    mode = session.get("lm_mode")
    if mode not in (None, "ar", "diffusion"):
        raise ProtocolError("bad_session", "session.lm_mode must be 'ar' or 'diffusion'")
    system = session.get("system_prompt")
    if system is not None:
        problem = system_prompt_problem(system, max_prompt_chars)
        if problem:
            raise ProtocolError("bad_session", f"session.system_prompt {problem}")
    return {"in_rate": rate, "out_rate": out_rate, "system_prompt": system, "lm_mode": mode}


def system_prompt_problem(value: object, max_chars: int) -> str:
    """What is wrong with a client's system prompt ("" if nothing): the LM must be able to take it."""
    if not isinstance(value, str):
        return "must be a string"
    if len(value) > max_chars:
        return f"is {len(value)} characters long; this server accepts at most {max_chars}"
    if _SURROGATE.search(value):
        return "holds a lone surrogate (\\ud800-\\udfff), which is not valid Unicode"
    return ""


def decode(text: str, max_bytes: int, what: str) -> Any:  # JSON
    """A JSON text frame, through the one decoder of every front (engine.common.wire): ProtocolError bad_json."""
    try:
        return decode_json(text, max_bytes=max_bytes)
    except WireError as err:
        raise ProtocolError("bad_json", f"{what}: {err.message}") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def handle(ws: WebSocket, instance: Instance, auth: Auth | None = None) -> None:
    async def serve(principal: str) -> None:
        await ws.accept()
        await NativeFront(ws, instance, principal).runner.serve()
    await run_admitted(ws, instance, auth, serve)


class NativeFront:
    """The native protocol as a codec on the conversation runner (voice/transports/common.py)."""

    def __init__(self, ws: WebSocket, instance: Instance, principal: str):
        self.ws, self.instance, self.principal = ws, instance, principal
        self.session: Session | None = None
        self.runner = ConversationRunner(FLUSH_S["native"], self)

    async def receive(self) -> str | None:
        """The start (refused with an error and a close), `ready`, then audio and control frames."""
        ws, cfg = self.ws, self.instance.config.session
        try:
            start = await asyncio.wait_for(_read_start(ws, self.instance), cfg.start_timeout_s)
        except asyncio.TimeoutError:
            await fail(ws, "start_timeout", f"no start message within {cfg.start_timeout_s:.0f} s")
            return None
        except ProtocolError as err:
            await fail(ws, err.code, str(err))
            return None
        peer = f"{ws.client.host}:{ws.client.port}" if ws.client else ""
        session = self.session = Session(self.instance, start["in_rate"], start["out_rate"], "native",
                                         start["system_prompt"], start["lm_mode"], principal=self.principal, peer=peer)
        self.runner.session = session  # counted as open from here: closed whatever happens
        await ws.send_json(Ready(0, time.monotonic(), session_id=session.id, sample_rate=start["out_rate"]).to_wire())
        self.runner.open(session, self)
        await _receive(ws, session)
        return None

    async def play(self, audio: TtsAudio, heard: Callable[[], None]) -> None:
        session = self.session
        assert session is not None  # opened
        frame_bytes = session.out_rate * 2 * session.config.session.audio_frame_ms // 1000
        for i in range(0, len(audio.pcm), frame_bytes):
            if not session.is_current(audio.turn):
                break  # cleared by a barge-in
            await self.ws.send_bytes(audio.pcm[i:i + frame_bytes])
            if i == 0:
                heard()

    async def clear(self) -> None:
        """Nothing is held here: every frame went out as it came (the `clear` event tells the client)."""

    async def send(self, event: Event) -> None:
        await self.ws.send_json(event.to_wire())

    async def close(self, code: int, reason: str) -> None:
        await close_ws(self.ws, code, reason)


async def _read_start(ws: WebSocket, instance: Instance) -> dict:
    """Wait for a valid start; audio before it is answered with an error and ignored."""
    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(msg.get("code", 1000))
        if msg.get("bytes") is not None:
            await ws.send_json({"type": "error", "code": "expected_start",
                                "message": "audio arrived before the start message; it was dropped"})
            continue
        cfg = instance.config.session
        return parse_start(msg.get("text") or "", cfg.max_system_prompt_chars, cfg.max_text_bytes)


async def _receive(ws: WebSocket, session: Session) -> None:
    limit = session.config.session.max_frame_bytes
    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            return
        data, text = msg.get("bytes"), msg.get("text")
        if data is not None:
            if len(data) > limit:
                session.error("frame_too_large", f"audio frame of {len(data)} bytes exceeds {limit}; dropped")
            elif len(data) % 2:
                session.error("bad_frame", "PCM16 frames must have an even number of bytes; dropped")
            else:
                await session.push_audio(data)
        elif text is not None:
            _control(session, text, session.config.session.max_text_bytes)


def _control(session: Session, text: str, max_bytes: int = MAX_TEXT_BYTES) -> None:
    try:
        msg = decode(text, max_bytes, "text frames must be JSON control messages (audio goes in binary frames)")
    except ProtocolError as err:
        session.error(err.code, str(err))
        return
    kind = msg.get("type") if isinstance(msg, dict) else None
    if kind == "start":
        session.error("already_started", "the session has already started")
    elif kind == "dtmf":
        key = msg.get("digit")
        if isinstance(key, str):
            session.press(key)
        else:
            session.error("bad_dtmf", "a dtmf message needs a `digit`: one of 0-9, *, #, A-D")
    else:
        session.error("unknown_message", f"unknown control message type {str(kind)[:40]!r}")
