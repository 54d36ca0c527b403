"""OpenAI's Realtime API on /v1/realtime: any Realtime client talks to the same session as /ws.

A Realtime connection is one more transport on `voice.conversation.session.Session`: its audio goes through
the same VAD, ASR, LM, TTS, barge-in, latency tracker, limits and call records. This module only
translates. Client events in: `session.update`, `input_audio_buffer.append / commit / clear`,
`conversation.item.create` (text, audio, function outputs), `response.create / cancel`,
`conversation.item.truncate`; `session.tools` are the client's own functions: a call of one ends
the response as a `function_call` item, and the client answers with `function_call_output`.
Server events out: the session's events as `input_audio_buffer.speech_started / stopped /
committed`, `conversation.item.added` (+`.done`), `...input_audio_transcription.completed`,
`response.created`, `response.output_item.added`, `response.content_part.added`,
`response.output_audio.delta` and `response.output_audio_transcript.delta` (and their `done`),
`response.done`, `rate_limits.updated`, `error`. The GA names are sent; a client that connects
with `OpenAI-Beta: realtime=v1` gets the beta names (`response.audio.delta`,
`conversation.item.created`, ...). Event by event: docs/REALTIME.md.

Audio: pcm16 at 24 kHz (the default), or G.711 µ-law / A-law at 8 kHz, in and out. The session
is built when audio or a response is first needed, so a `session.update` sent first sets its
formats; once built its formats are fixed (an `error` says so). Every client event is checked
against one typed schema (voice/transports/realtime_events.py) before it is acted on; a bad one
gets an `error` event and the connection goes on. What a client can make the server keep (items
waiting for a response, instructions, tools) is bounded by `[session]`.

This module translates, on the conversation runner (voice/transports/common.py): client events
into the session's calls, the session's events into server events. What those say about the
conversation's items (ids, order, responses, what waits for `response.create`) is kept by
`realtime_items.Items`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.websockets import WebSocket

from engine.common.wire import WireError, decode_json
from voice.audio import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from voice.service.auth import Auth
from voice.pipeline.endofturn import for_eagerness
from voice.events import (Error, Event, ReplyDone, ReplyText, SpeechStarted, SpeechStopped, ToolCall,
                          Transcript, TtsAudio)
from voice.conversation.session import Session
from voice.service.instance import Instance
from voice.pipeline.tools import with_results
from voice.transports.common import FLUSH_S, ConversationRunner, close_ws, run_admitted
from voice.transports.native import system_prompt_problem
from voice.transports.realtime_events import (BETA_FORMATS, FORMATS, AudioAppend, FunctionCallOutput, FunctionTool,
                                              ItemCreate, ItemTruncate, NoFields, ResponseCancel, ResponseCreate,
                                              SessionSettings, SessionUpdate, problem)
from voice.transports.realtime_items import Items, RealtimeError, new_id, where

if TYPE_CHECKING:
    from voice.conversation.playback import Playback

log = logging.getLogger("voice.realtime")
BETA_NAMES = {"response.output_audio.delta": "response.audio.delta",
              "response.output_audio.done": "response.audio.done",
              "response.output_audio_transcript.delta": "response.audio_transcript.delta",
              "response.output_audio_transcript.done": "response.audio_transcript.done",
              "conversation.item.added": "conversation.item.created"}
GA_ONLY = {"conversation.item.done"}  # beta clients get no such event


class RealtimeFront:
    """One /v1/realtime connection: the settings, client events in, server events out."""

    def __init__(self, ws: WebSocket, instance: Instance, principal: str, beta: bool, model: str):
        self.ws, self.instance, self.principal, self.beta = ws, instance, principal, beta
        self.id = new_id("sess")
        self.config = instance.config
        self.session: Session | None = None
        self.runner = ConversationRunner(FLUSH_S["realtime"], self)
        self.settings: dict[str, Any] = {
                         "instructions": self.config.lm.system_prompt, "voice": "joe", "input": "audio/pcm",
                         "output": "audio/pcm", "turn_detection": {
                             "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                             "silence_duration_ms": self.config.vad.hangover_ms, "create_response": True,
                             "interrupt_response": True}, "model": model, "tools": [], "tool_choice": "auto"}
        self.items = Items(self.id, beta, self.settings, self.config.session, self.config.lm.max_new_tokens)
        self.sending = asyncio.Lock()  # the reader's answers and the runner's drain share the socket
        self.audio_ms = 0.0  # input audio appended so far

    # --- sending ----------------------------------------------------------------------------

    async def emit(self, events: list[dict]) -> None:
        """Server events (GA names) onto the wire, renamed for a beta client."""
        async with self.sending:
            for event in events:
                kind = event["type"]
                if self.beta and kind in GA_ONLY:
                    continue
                if self.beta:
                    event = {**event, "type": BETA_NAMES.get(kind, kind)}
                await self.ws.send_json({"event_id": new_id("event"), **event})

    def error_event(self, err: RealtimeError, event_id: str | None = None) -> dict:
        log.info("realtime %s: %s (%s)", err.code, err.message, err.param)
        return {"type": "error", "error": {"type": err.kind, "code": err.code, "message": err.message,
                                           "param": err.param, "event_id": event_id}}

    # --- the session ------------------------------------------------------------------------

    def session_object(self) -> dict:
        s, rates = self.settings, FORMATS
        if self.beta:
            beta_format = {v: k for k, v in BETA_FORMATS.items()}
            # (no `model`: the beta schema allows only OpenAI's own model names there)
            return {"object": "realtime.session", "id": self.id, "modalities": ["audio", "text"],
                    "instructions": s["instructions"], "voice": s["voice"],
                    "input_audio_format": beta_format[s["input"]], "output_audio_format": beta_format[s["output"]],
                    "turn_detection": s["turn_detection"], "tools": s["tools"], "tool_choice": s["tool_choice"],
                    "input_audio_transcription": {"model": "whisper-" + self.config.asr.model}}
        def fmt(kind: str) -> dict:
            return {"type": kind, "rate": rates[kind]} if kind == "audio/pcm" else {"type": kind}
        return {"type": "realtime", "object": "realtime.session", "id": self.id, "model": s["model"],
                "output_modalities": ["audio"], "instructions": s["instructions"], "tools": s["tools"],
                "tool_choice": s["tool_choice"],
                "audio": {"input": {"format": fmt(s["input"]), "turn_detection": s["turn_detection"],
                                    "transcription": {"model": "whisper-" + self.config.asr.model}},
                          "output": {"format": fmt(s["output"]), "voice": s["voice"], "speed": 1.0}}}

    def update(self, body: SessionSettings) -> list[dict]:
        """`session.update`: instructions, voice, formats, turn detection (GA or beta shape)."""
        changes: dict[str, Any] = {side: fmt.type for side in ("input", "output")
                                   if (fmt := body.audio_format(side)) is not None}
        if self.session is not None and any(changes[k] != self.settings[k] for k in changes):
            raise RealtimeError("the audio formats cannot change once audio has flowed", param="session.audio")
        given, turn = body.turn_detection_given()
        if given:
            if self.session is not None:
                raise RealtimeError("turn_detection cannot change once audio has flowed",
                                    param="session.audio.input.turn_detection")
            changes["turn_detection"] = None if turn is None else {**(self.settings["turn_detection"] or {}),
                                                                   **turn.model_dump(exclude_none=True)}
        if body.instructions is not None:
            wrong = system_prompt_problem(body.instructions, self.config.session.max_system_prompt_chars)
            if wrong:
                raise RealtimeError(f"instructions {wrong}", param="session.instructions")
            changes["instructions"] = body.instructions
        if body.tools is not None:
            changes["tools"] = self._tools(body.tools)
        if body.tool_choice is not None:
            changes["tool_choice"] = body.tool_choice
        if body.voice_given() is not None:
            changes["voice"] = body.voice_given()  # any name: this server has one voice (joe), used for all
        self.settings.update(changes)
        if self.session is not None:
            self.session.instruct(self.settings["instructions"])
            self.session.offer_tools(self.offered())
        return [{"type": "session.updated", "session": self.session_object()}]

    def _tools(self, tools: list[FunctionTool]) -> list[dict]:
        """`session.tools`: the client's functions, as declared to the LM with every turn: bounded."""
        declared = [{"type": "function", "name": t.name, "description": t.description,
                     "parameters": t.parameters or {"type": "object", "properties": {}}} for t in tools]
        limits = self.config.session
        if len(declared) > limits.max_tools or len(json.dumps(declared)) > limits.max_tools_chars:
            raise RealtimeError(f"tools must be at most {limits.max_tools} functions of at most "
                                f"{limits.max_tools_chars} characters of JSON together", "too_many_tools",
                                "session.tools")
        return declared

    def offered(self) -> list[dict]:
        """The client's functions as the LM stage declares tools (chat-completions shape)."""
        if self.settings["tool_choice"] == "none":
            return []
        return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                for t in self.settings["tools"]]

    def client_functions(self) -> set[str]:
        return {t["name"] for t in self.settings["tools"]}

    def ensure_session(self) -> Session:
        if self.session is None:
            config = copy.deepcopy(self.config)  # this connection's turn detection
            turn = self.settings["turn_detection"]
            if turn is None:  # the client commits each utterance itself
                config.vad.hangover_ms = int(max(config.limits.max_utterance_s, 1) * 1000) + 1000
                config.turn = replace(config.turn, policy="fixed", resume_ms=0)
            elif turn["type"] == "semantic_vad":  # our end-of-turn policy, as eager as asked
                config.turn = for_eagerness(config.turn, turn.get("eagerness", "auto"))
            else:  # server_vad: the plain endpointer, silence_duration_ms its hangover
                config.vad.hangover_ms = turn.get("silence_duration_ms", config.vad.hangover_ms)
                config.turn = replace(config.turn, policy="fixed")
            peer = f"{self.ws.client.host}:{self.ws.client.port}" if self.ws.client else ""
            self.session = Session(self.instance, FORMATS[self.settings["input"]], FORMATS[self.settings["output"]],
                                   "realtime", self.settings["instructions"], principal=self.principal, peer=peer,
                                   meta={"beta": self.beta, "model": self.settings["model"]}, config=config)
            self.session.offer_tools(self.offered())
            self.runner.open(self.session, self)
        return self.session

    # --- client events -> the session ---------------------------------------------------------

    async def receive(self) -> str | None:
        """`session.created`, then every client event, answered, until the peer goes. A connection
        that never sends audio or asks for a response is closed after `limits.idle_timeout_s`."""
        await self.emit([{"type": "session.created", "session": self.session_object()}])
        self.runner.tasks.append(asyncio.create_task(self._close_if_idle()))
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                return None
            if msg.get("text") is not None:
                await self.emit(await self.handle(msg["text"]))
            else:
                await self.emit([self.error_event(RealtimeError(
                    "binary frames are not part of this protocol: send audio as input_audio_buffer.append",
                    "invalid_event"))])

    async def _close_if_idle(self) -> None:
        idle = self.config.limits.idle_timeout_s
        if not idle:
            return
        await asyncio.sleep(idle)
        if self.session is None:
            await self.emit([self.error_event(RealtimeError(f"no audio and no response requested for {idle:g} s",
                                                            "idle_timeout"))])
            await asyncio.sleep(FLUSH_S["realtime"])
            await close_ws(self.ws, 1008, "idle_timeout")

    async def handle(self, text: str) -> list[dict]:
        """One client event: checked against its schema, then acted on; the server events that
        answer it. Whatever is wrong with it is an `error` event, and the connection goes on."""
        event_id = None
        try:
            try:
                msg = decode_json(text, max_bytes=self.config.session.max_text_bytes
                                  + 2 * self.config.session.max_frame_bytes)
            except WireError as err:
                raise RealtimeError(f"the event is not JSON this server takes: {err.message}", "invalid_json") from None
            if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
                raise RealtimeError("an event must be a JSON object with a string `type`", "invalid_event", "type")
            event_id = msg.get("event_id") if isinstance(msg.get("event_id"), str) else None
            if msg["type"] not in HANDLERS:
                raise RealtimeError(f"unsupported event type {msg['type'][:60]!r} (docs/REALTIME.md lists "
                                    "what is implemented)", "unknown_event", "type")
            schema, handler = HANDLERS[msg["type"]]
            try:
                event = schema.model_validate(msg)
            except ValidationError as err:
                param, message = problem(err)
                raise RealtimeError(f"{param}: {message}", param=param) from None
            return await handler(self, event)
        except RealtimeError as err:
            return [self.error_event(err, event_id)]
        except Exception:  # a fault of ours: logged, the event refused, the conversation goes on
            log.exception("realtime: an event could not be handled")
            return [self.error_event(RealtimeError("this event could not be handled (a server fault, logged)",
                                                   "server_error", kind="server_error"), event_id)]

    async def on_session_update(self, event: SessionUpdate) -> list[dict]:
        return self.update(event.session)

    async def on_append(self, event: AudioAppend) -> list[dict]:
        pcm = self._decode(event.audio, "audio")
        session = self.ensure_session()
        self.audio_ms += len(pcm) / 2 / session.in_rate * 1000
        await session.push_audio(pcm)
        return []

    def _decode(self, audio: str, param: str, max_s: float = 0.0) -> bytes:
        """Base64 audio in the session's input format -> PCM16; at most `session.max_frame_bytes`
        (an append) or `max_s` seconds (an audio item)."""
        kind = self.settings["input"]
        limit = int(max_s * FORMATS[kind] * (2 if kind == "audio/pcm" else 1)) if max_s else \
            self.config.session.max_frame_bytes
        if len(audio) > limit * 4 // 3 + 8:  # before decoding it
            raise RealtimeError(f"more than {limit} bytes of audio at once are refused; send smaller pieces",
                                "frame_too_large", param)
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("audio is not valid base64", param=param) from None
        if len(raw) > limit:
            raise RealtimeError(f"more than {limit} bytes of audio at once are refused; send smaller pieces",
                                "frame_too_large", param)
        if kind == "audio/pcm":
            if len(raw) % 2:
                raise RealtimeError("pcm16 audio must have an even number of bytes", "bad_frame", param)
            return raw
        return (ulaw_decode(raw) if kind == "audio/pcmu" else alaw_decode(raw)).astype("<i2").tobytes()

    async def on_commit(self, event: NoFields) -> list[dict]:
        if self.session is None or not self.session.end_speech():
            raise RealtimeError("the input audio buffer holds no speech to commit", "input_audio_buffer_commit_empty")
        return []

    async def on_clear(self, event: NoFields) -> list[dict]:
        if self.session is not None:
            self.session.clear_speech()
        return [{"type": "input_audio_buffer.cleared"}]

    async def on_item_create(self, event: ItemCreate) -> list[dict]:
        item = event.item
        if isinstance(item, FunctionCallOutput):
            return self.items.function_output(item.id, item.call_id, item.output)
        parts: list[tuple[str, str, float]] = []  # (type, its text, seconds of audio)
        for part in item.content:
            if part.type == "input_text":
                parts.append((part.type, part.text, 0.0))
            else:  # transcribed whole by the session's own ASR
                pcm = self._decode(part.audio, "item.content.audio", self.config.limits.max_utterance_s)
                parts.append((part.type, *await self.ensure_session().turns.transcribe(pcm)))
        text = " ".join(t for _, t, _ in parts if t)
        if len(text) > self.config.session.max_system_prompt_chars:
            raise RealtimeError("the message is too long", "string_above_max_length", "item.content")
        if item.role == "system":
            self._instruct(text)
        return self.items.message(item.id or new_id("item"), item.role, parts)

    def _instruct(self, text: str) -> None:
        """A system item: its text joins the instructions, which stay within `session.max_system_prompt_chars`."""
        instructions = f"{self.settings['instructions']}\n\n{text}".strip()
        limit = self.config.session.max_system_prompt_chars
        if len(instructions) > limit:
            raise RealtimeError(f"the instructions would be longer than {limit} characters with this system item",
                                "string_above_max_length", "item.content")
        self.settings["instructions"] = instructions
        if self.session is not None:
            self.session.instruct(instructions)

    async def on_response_create(self, event: ResponseCreate) -> list[dict]:
        items = self.items
        if items.pending_outputs:  # the answer to a function call: the question again, with the outputs
            runs, items.pending_outputs = items.pending_outputs, []
            session = self.ensure_session()  # the question again, folded with them as voice/pipeline/tools.py does
            question = [{"role": "user", "content": session.take_unanswered()}]
            session.text_turn(with_results(question, runs)[-1]["content"].strip())
            return []
        if not items.pending_text:
            raise RealtimeError("there is nothing new to respond to: add a user message first (with server VAD, "
                                "speech is answered by itself)", "no_input", "response")
        items.answered_by(self.ensure_session().text_turn(" ".join(items.pending_text)))
        return []

    async def on_response_cancel(self, event: ResponseCancel) -> list[dict]:
        if self.session is None or not self.session.cancel_reply():  # as the user talking over it would
            raise RealtimeError("no response is in progress", "response_cancel_not_active")
        return []

    async def on_truncate(self, event: ItemTruncate) -> list[dict]:
        heard, out = self.items.truncate(event.item_id, event.audio_end_ms)
        assert self.session is not None  # it gave the response
        self.session.heard_only(heard)  # what the LM sees next: only what was heard
        return out

    # --- the session's events -> server events (AudioOutput) ----------------------------------

    def _playback(self) -> Playback | None:
        return self.session.reply_playback() if self.session is not None else None

    async def send(self, ev: Event) -> None:
        items, turn = self.items, ev.turn
        if isinstance(ev, SpeechStarted):
            await self.emit(items.speech_started(turn, self.audio_ms))
        elif isinstance(ev, SpeechStopped):
            await self.emit(items.speech_stopped(turn, self.audio_ms))
        elif isinstance(ev, Transcript) and ev.final:
            await self.emit(items.transcribed(turn, ev.text, self.audio_ms, ev.resumes))
        elif isinstance(ev, ReplyText):
            await self.emit(items.reply_text(turn, ev.text, self._playback()))
        elif isinstance(ev, ToolCall) and ev.name in self.client_functions():
            await self.emit(items.function_call(turn, ev, self._playback()))
        elif isinstance(ev, ReplyDone):
            await self.emit(items.done(turn, ev, self._playback()))
        elif isinstance(ev, Error):
            kind = "server_error" if ev.stage and not ev.client else "invalid_request_error"
            if ev.stage:  # a stage failed this turn's reply
                items.failed(turn, kind, ev.code)
            deleted = items.refused(turn) if ev.stage == "lm" and ev.client else []
            await self.emit([self.error_event(RealtimeError(ev.message, ev.code, kind=kind)), *deleted])
        # (Clear: the response ends with response.done, cancelled, when its reply_done comes)

    async def play(self, audio: TtsAudio, heard: Callable[[], None]) -> None:
        session = self.session
        assert session is not None  # opened
        r, out = self.items.spoken(audio.turn, self._playback())
        await self.emit(out)
        step = session.out_rate * 2 * session.config.session.audio_frame_ms // 1000
        for i in range(0, len(audio.pcm), step):
            if not session.is_current(audio.turn):
                return  # cleared by a barge-in
            chunk = audio.pcm[i:i + step]
            if self.settings["output"] != "audio/pcm":
                samples = np.frombuffer(chunk, "<i2")
                chunk = ulaw_encode(samples) if self.settings["output"] == "audio/pcmu" else alaw_encode(samples)
            await self.emit([{"type": "response.output_audio.delta", **where(r),
                              "delta": base64.b64encode(chunk).decode()}])
            if i == 0:
                heard()

    async def clear(self) -> None:
        """Nothing is held here: every delta went out as it came."""

    async def close(self, code: int, reason: str) -> None:
        await close_ws(self.ws, code, reason)


# event type -> (its schema, its handler, which takes the validated event)
HANDLERS: dict[str, tuple[type[BaseModel], Callable[[RealtimeFront, Any], Awaitable[list[dict]]]]] = {
    "session.update": (SessionUpdate, RealtimeFront.on_session_update),
    "input_audio_buffer.append": (AudioAppend, RealtimeFront.on_append),
    "input_audio_buffer.commit": (NoFields, RealtimeFront.on_commit),
    "input_audio_buffer.clear": (NoFields, RealtimeFront.on_clear),
    "conversation.item.create": (ItemCreate, RealtimeFront.on_item_create),
    "response.create": (ResponseCreate, RealtimeFront.on_response_create),
    "response.cancel": (ResponseCancel, RealtimeFront.on_response_cancel),
    "conversation.item.truncate": (ItemTruncate, RealtimeFront.on_truncate)}


async def handle(ws: WebSocket, instance: Instance, auth: Auth | None = None) -> None:
    async def serve(principal: str) -> None:
        beta = "realtime=v1" in ws.headers.get("openai-beta", "")
        front = RealtimeFront(ws, instance, principal, beta, ws.query_params.get("model", "diffusion-voice"))
        await ws.accept()
        await front.runner.serve()
    await run_admitted(ws, instance, auth, serve)
