"""OpenAI's Realtime API on /v1/realtime: any Realtime client talks to the same session as /ws.

A Realtime connection is one more transport on `voice.session.Session`: its audio goes through
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
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import json
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.common.wire import WireError, decode_json
from voice.audio import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from voice.auth import Auth
from voice.endofturn import for_eagerness
from voice.events import (Clear, Error, ReplyDone, ReplyText, SpeechStarted, SpeechStopped, ToolCall, Transcript,
                          TtsAudio)
from voice.session import Session
from voice.tools import ToolRun
from voice.stages import Stages
from voice.transports.common import FLUSH_S, close_when_ending, close_ws, finish, run_admitted
from voice.transports.native import system_prompt_problem
from voice.transports.realtime_events import (BETA_FORMATS, FORMATS, AudioAppend, FunctionCallOutput, FunctionTool,
                                              ItemCreate, ItemTruncate, NoFields, ResponseCancel, ResponseCreate,
                                              SessionSettings, SessionUpdate, problem)

log = logging.getLogger("voice.realtime")
BETA_NAMES = {"response.output_audio.delta": "response.audio.delta",
              "response.output_audio.done": "response.audio.done",
              "response.output_audio_transcript.delta": "response.audio_transcript.delta",
              "response.output_audio_transcript.done": "response.audio_transcript.done",
              "conversation.item.added": "conversation.item.created"}
GA_ONLY = {"conversation.item.done"}  # beta clients get no such event
MAX_QUEUED = 256  # server events waiting for the socket before the session's own outbox takes the strain
_ids = itertools.count(1)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}{next(_ids)}"


class RealtimeError(ValueError):
    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.code, self.param, self.kind = message, code, param, kind


class Connection:
    def __init__(self, ws: WebSocket, stages: Stages, principal: str, beta: bool, model: str):
        self.ws, self.stages, self.principal, self.beta = ws, stages, principal, beta
        self.id = new_id("sess")
        self.config = stages.config
        self.session: Session | None = None
        self.opened = asyncio.Event()  # set once the session is built (on first audio or response)
        self.settings: dict[str, Any] = {
                         "instructions": self.config.lm.system_prompt, "voice": "joe", "input": "audio/pcm",
                         "output": "audio/pcm", "turn_detection": {
                             "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                             "silence_duration_ms": self.config.vad.hangover_ms, "create_response": True,
                             "interrupt_response": True}, "model": model, "tools": [], "tool_choice": "auto"}
        self.out: asyncio.Queue[dict] = asyncio.Queue()
        self.user_items: dict[int, str] = {}  # turn -> the user item's id
        self.responses: dict[int, dict] = {}  # turn -> {id, item, transcript, playback}
        self.pending_text: list[str] = []  # typed user messages not answered yet
        self.pending_outputs: list[ToolRun] = []  # the client's function outputs not answered yet
        self.calls: dict[str, str] = {}  # call_id -> function name, of the calls the LM made
        self.last_item: str | None = None
        self.audio_ms = 0.0  # input audio appended so far

    # --- sending ----------------------------------------------------------------------------

    def send(self, event: dict) -> None:
        kind = event["type"]
        if self.beta and kind in GA_ONLY:
            return
        if self.beta:
            event = {**event, "type": BETA_NAMES.get(kind, kind)}
        self.out.put_nowait({"event_id": new_id("event"), **event})

    def error(self, err: RealtimeError, event_id: str | None = None) -> None:
        log.info("realtime %s: %s (%s)", err.code, err.message, err.param)
        self.send({"type": "error", "error": {"type": err.kind, "code": err.code, "message": err.message,
                                              "param": err.param, "event_id": event_id}})

    async def pump(self) -> None:
        while True:
            await self.ws.send_json(await self.out.get())

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

    def update(self, body: SessionSettings) -> None:
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
            self.session.history.system_prompt = self.settings["instructions"]
            self.session.replies.client_tools = self.offered()
        self.send({"type": "session.updated", "session": self.session_object()})

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
            self.session = Session(self.stages, FORMATS[self.settings["input"]], FORMATS[self.settings["output"]],
                                   "realtime", self.settings["instructions"], principal=self.principal, peer=peer,
                                   meta={"beta": self.beta, "model": self.settings["model"]}, config=config)
            self.session.replies.client_tools = self.offered()
            self.opened.set()
        return self.session

    # --- client events ----------------------------------------------------------------------

    async def handle(self, text: str) -> None:
        """One client event: checked against its schema, then acted on. Whatever is wrong with it is
        an `error` event, and the connection goes on."""
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
            await handler(self, event)
        except RealtimeError as err:
            self.error(err, event_id)
        except Exception:  # a fault of ours: logged, the event refused, the conversation goes on
            log.exception("realtime: an event could not be handled")
            self.error(RealtimeError("this event could not be handled (a server fault, logged)", "server_error",
                                     kind="server_error"), event_id)

    async def on_session_update(self, event: SessionUpdate) -> None:
        self.update(event.session)

    async def on_append(self, event: AudioAppend) -> None:
        pcm = self._decode(event.audio, "audio")
        session = self.ensure_session()
        self.audio_ms += len(pcm) / 2 / session.in_rate * 1000
        await session.push_audio(pcm)

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

    async def on_commit(self, event: NoFields) -> None:
        if self.session is None or not self.session.end_speech():
            raise RealtimeError("the input audio buffer holds no speech to commit", "input_audio_buffer_commit_empty")

    async def on_clear(self, event: NoFields) -> None:
        if self.session is not None:
            self.session.clear_speech()
        self.send({"type": "input_audio_buffer.cleared"})

    async def on_item_create(self, event: ItemCreate) -> None:
        if isinstance(event.item, FunctionCallOutput):
            self._function_output(event.item)
            return
        item = event.item
        item_id = item.id or new_id("item")
        said, seconds = [], {}  # the text of each part; seconds of audio of the audio parts
        for i, part in enumerate(item.content):
            if part.type == "input_text":
                said.append(part.text)
            else:
                heard, seconds[i] = await self._transcribe(part.audio)
                said.append(heard)
        text = " ".join(t for t in said if t)
        if len(text) > self.config.session.max_system_prompt_chars:
            raise RealtimeError("the message is too long", "string_above_max_length", "item.content")
        if item.role == "system":
            self._instruct(text)
        elif text:
            self._check_room(len(text))
            self.pending_text.append(text)
        added = {"id": item_id, "type": "message", "object": "realtime.item", "status": "completed",
                 "role": item.role, "content": [{"type": "input_text", "text": t} if p.type == "input_text" else
                             {"type": "input_audio", "transcript": t} for p, t in zip(item.content, said)]}
        self.send({"type": "conversation.item.added", "previous_item_id": self.last_item, "item": added})
        for i, (part, heard) in enumerate(zip(item.content, said)):
            if part.type == "input_audio":
                self.send({"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
                           "content_index": i, "transcript": heard,
                           "usage": {"type": "duration", "seconds": round(seconds[i], 3)}})
        self.send({"type": "conversation.item.done", "previous_item_id": self.last_item, "item": added})
        self.last_item = item_id

    def _instruct(self, text: str) -> None:
        """A system item: its text joins the instructions, which stay within `session.max_system_prompt_chars`."""
        instructions = f"{self.settings['instructions']}\n\n{text}".strip()
        limit = self.config.session.max_system_prompt_chars
        if len(instructions) > limit:
            raise RealtimeError(f"the instructions would be longer than {limit} characters with this system item",
                                "string_above_max_length", "item.content")
        self.settings["instructions"] = instructions
        if self.session is not None:
            self.session.history.system_prompt = instructions

    def _check_room(self, chars: int) -> None:
        """Items waiting for a response are kept here and go to the LM as one question: their number
        and size are bounded (`session.max_items`, `session.max_items_chars`)."""
        limits = self.config.session
        waiting = self.pending_text + [run.result for run in self.pending_outputs]
        held = sum(map(len, waiting))
        if len(waiting) >= limits.max_items or held + chars > limits.max_items_chars:
            raise RealtimeError(f"the conversation already holds {len(waiting)} items of {held} characters waiting "
                                f"for a response (at most {limits.max_items} items of {limits.max_items_chars} "
                                "characters together): send response.create first", "conversation_full", "item")

    async def _transcribe(self, audio: str) -> tuple[str, float]:
        """An audio part of an item, decoded like an append and transcribed whole by the session's
        ASR: (transcript, seconds of audio)."""
        from voice.asr import SAMPLE_RATE, StreamingTranscriber
        from voice.audio import pcm16_to_float, resample
        pcm = self._decode(audio, "item.content.audio", self.config.limits.max_utterance_s)
        samples = resample(pcm16_to_float(pcm), FORMATS[self.settings["input"]], SAMPLE_RATE)
        transcriber = StreamingTranscriber(self.stages.whisper, self.config.asr)
        transcriber.insert_audio_chunk(samples)
        return (await transcriber.finish()).strip(), len(samples) / SAMPLE_RATE

    def _function_output(self, item: FunctionCallOutput) -> None:
        if item.call_id not in self.calls:
            raise RealtimeError(f"no function call {item.call_id[:60]!r} in this conversation", param="item.call_id")
        if len(item.output) > self.config.session.max_system_prompt_chars:
            raise RealtimeError("output must be a string of at most "
                                f"{self.config.session.max_system_prompt_chars} characters", param="item.output")
        self._check_room(len(item.output))
        self.pending_outputs.append(ToolRun(item.call_id, self.calls[item.call_id], {}, item.output, "ok"))
        added = {"id": item.id or new_id("item"), "type": "function_call_output", "object": "realtime.item",
                 "status": "completed", "call_id": item.call_id, "output": item.output}
        self.send({"type": "conversation.item.added", "previous_item_id": self.last_item, "item": added})
        self.send({"type": "conversation.item.done", "previous_item_id": self.last_item, "item": added})
        self.last_item = added["id"]

    async def on_response_create(self, event: ResponseCreate) -> None:
        if self.pending_outputs:  # the answer to a function call: the question again, with the outputs
            runs, self.pending_outputs = self.pending_outputs, []
            self.ensure_session().answer_with(runs)
            return
        if not self.pending_text:
            raise RealtimeError("there is nothing new to respond to: add a user message first (with server VAD, "
                                "speech is answered by itself)", "no_input", "response")
        text, self.pending_text = " ".join(self.pending_text), []
        self.ensure_session().text_turn(text)

    async def on_response_cancel(self, event: ResponseCancel) -> None:
        if self.session is None or self.session.reply is None:
            raise RealtimeError("no response is in progress", "response_cancel_not_active")
        self.session.cancel_reply()

    async def on_truncate(self, event: ItemTruncate) -> None:
        found = next((r for r in self.responses.values() if r["item"] == event.item_id), None)
        if found is None:
            raise RealtimeError(f"no assistant audio item {event.item_id[:60]!r}", "item_truncate_invalid_item_id",
                                "item_id")
        heard = found["playback"].heard_within(event.audio_end_ms / 1000) if found["playback"] else ""
        assert self.session is not None  # it gave the response
        self.session.history.heard_only(heard)  # what the LM sees next: only what was heard
        found["heard"] = heard
        self.send({"type": "conversation.item.truncated", "item_id": event.item_id, "content_index": 0,
                   "audio_end_ms": event.audio_end_ms})

    # --- session events -> server events ----------------------------------------------------

    async def relay(self) -> None:
        """The session's outbox, translated."""
        await self.opened.wait()
        session = self.session
        assert session is not None  # opened
        while True:
            while self.out.qsize() > MAX_QUEUED:  # a client that reads slowly: the session's outbox fills
                await asyncio.sleep(0.01)         # up instead, and its limits apply (slow_client)
            ev = await session.outbox.get()
            if ev is None:
                return
            self.translate(session, ev)

    async def closer(self) -> None:
        """A session the server ends (a limit, shutdown): its error goes out, then the close. A
        connection that never sends audio or asks for a response is closed after `limits.idle_timeout_s`."""
        idle = self.config.limits.idle_timeout_s or None
        try:
            await asyncio.wait_for(self.opened.wait(), idle)
        except asyncio.TimeoutError:
            self.error(RealtimeError(f"no audio and no response requested for {idle:g} s", "idle_timeout"))
            await asyncio.sleep(FLUSH_S["realtime"])
            await close_ws(self.ws, 1008, "idle_timeout")
            return
        session = self.session
        assert session is not None  # opened
        await close_when_ending(session, lambda: close_ws(self.ws, session.close_code, session.end_reason),
                                FLUSH_S["realtime"])

    def translate(self, session: Session, ev) -> None:
        turn = ev.turn
        if isinstance(ev, SpeechStarted):
            self.user_items[turn] = new_id("item")
            self.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": int(self.audio_ms),
                       "item_id": self.user_items[turn]})
        elif isinstance(ev, SpeechStopped):
            item = self.user_items.setdefault(turn, new_id("item"))
            self.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": int(self.audio_ms),
                       "item_id": item})
            self.send({"type": "input_audio_buffer.committed", "previous_item_id": self.last_item, "item_id": item})
            self.send({"type": "conversation.item.added", "previous_item_id": self.last_item, "item": self._user(item)})
            self.last_item = item
        elif isinstance(ev, Transcript) and ev.final:
            spoken = self.user_items.get(turn)
            if spoken is not None:  # a spoken turn (a typed one was announced when it was created)
                self.send({"type": "conversation.item.input_audio_transcription.completed", "item_id": spoken,
                           "content_index": 0, "transcript": ev.text,
                           "usage": {"type": "duration", "seconds": round(self.audio_ms / 1000, 3)}})
                self.send({"type": "conversation.item.done", "previous_item_id": None,
                           "item": self._user(spoken, ev.text)})
        elif isinstance(ev, ReplyText):
            r = self._message(session, turn)
            r["transcript"] += ev.text
            self.send({"type": "response.output_audio_transcript.delta", **self._where(r), "delta": ev.text})
        elif isinstance(ev, TtsAudio):
            r = self._message(session, turn)
            if not session.is_current(turn):
                return
            pcm = ev.pcm
            step = session.out_rate * 2 * session.config.session.audio_frame_ms // 1000
            for i in range(0, len(pcm), step):
                chunk = pcm[i:i + step]
                if self.settings["output"] != "audio/pcm":
                    samples = np.frombuffer(chunk, "<i2")
                    chunk = ulaw_encode(samples) if self.settings["output"] == "audio/pcmu" else alaw_encode(samples)
                self.send({"type": "response.output_audio.delta", **self._where(r),
                           "delta": base64.b64encode(chunk).decode()})
            session.audio_sent(turn, ev.text, ev.seconds)
        elif isinstance(ev, ToolCall) and ev.name in self.client_functions():
            self._function_call(session, turn, ev)
        elif isinstance(ev, ReplyDone):  # a reply cancelled before its first output is a response too
            self._finish(self._response(session, turn), ev)
        elif isinstance(ev, Error):
            kind = "server_error" if ev.stage else "invalid_request_error"
            self.error(RealtimeError(ev.message, ev.code, kind=kind))
        elif isinstance(ev, Clear):
            pass  # the response ends with response.done (cancelled) when its reply_done comes

    def _user(self, item: str, transcript: str | None = None) -> dict:
        return {"id": item, "type": "message", "object": "realtime.item", "role": "user",
                "status": "completed", "content": [{"type": "input_audio", "transcript": transcript}]}

    def _where(self, r: dict) -> dict:
        return {"response_id": r["id"], "item_id": r["item"], "output_index": r["index"], "content_index": 0}

    def _response(self, session: Session, turn: int) -> dict:
        """This turn's response, announced with its first output."""
        r = self.responses.get(turn)
        if r is None:
            r = self.responses[turn] = {"id": new_id("resp"), "item": None, "index": 0, "transcript": "",
                                        "calls": [], "playback": session.reply.playback if session.reply else None}
            while len(self.responses) > 64:
                self.responses.pop(next(iter(self.responses)))
            tokens = self.config.lm.max_new_tokens
            self.send({"type": "rate_limits.updated", "rate_limits": [
                {"name": "tokens", "limit": tokens, "remaining": tokens, "reset_seconds": 0.0}]})
            self.send({"type": "response.created", "response": self._response_object(r, "in_progress")})
        return r

    def _message(self, session: Session, turn: int) -> dict:
        """The response, with its spoken message item (added on the first text or audio)."""
        r = self._response(session, turn)
        if r["item"] is None:
            r["item"], r["index"] = new_id("item"), len(r["calls"])
            self.send({"type": "response.output_item.added", "response_id": r["id"], "output_index": r["index"],
                       "item": self._assistant(r, "in_progress")})
            self.send({"type": "response.content_part.added", **self._where(r),
                       "part": {"type": "audio", "transcript": ""}})
        return r

    def _function_call(self, session: Session, turn: int, ev: ToolCall) -> None:
        """The LM called one of the client's functions: an output item of its own."""
        r = self._response(session, turn)
        args = json.dumps(ev.arguments, ensure_ascii=False)
        call = {"id": new_id("item"), "type": "function_call", "object": "realtime.item", "status": "completed",
                "call_id": ev.id, "name": ev.name, "arguments": args}
        index = len(r["calls"]) + (r["item"] is not None)
        r["calls"].append(call)
        self.calls[ev.id] = ev.name
        where = {"response_id": r["id"], "item_id": call["id"], "output_index": index, "call_id": ev.id}
        self.send({"type": "response.output_item.added", "response_id": r["id"], "output_index": index,
                   "item": {**call, "status": "in_progress", "arguments": ""}})
        self.send({"type": "response.function_call_arguments.delta", **where, "delta": args})
        self.send({"type": "response.function_call_arguments.done", **where, "name": ev.name, "arguments": args})
        self.send({"type": "response.output_item.done", "response_id": r["id"], "output_index": index, "item": call})
        self.send({"type": "conversation.item.done", "previous_item_id": self.last_item, "item": call})
        self.last_item = call["id"]

    def _assistant(self, r: dict, status: str) -> dict:
        """The spoken message item; `status` is the response's (cancelled: the item is incomplete)."""
        content = [{"type": "output_audio" if not self.beta else "audio", "transcript": r["transcript"]}] \
            if status != "in_progress" else []
        status = {"cancelled": "incomplete"}.get(status, status)
        return {"id": r["item"], "type": "message", "object": "realtime.item", "role": "assistant", "status": status,
                "content": content}

    def _response_object(self, r: dict, status: str, details: dict | None = None) -> dict:
        output = [] if status == "in_progress" else r["calls"] + ([self._assistant(r, status)] if r["item"] else [])
        return {"id": r["id"], "object": "realtime.response", "status": status, "status_details": details,
                "output": output, "conversation_id": self.id, "output_modalities": ["audio"],
                "max_output_tokens": "inf", "usage": None, "metadata": None,
                "audio": {"output": {"format": {"type": self.settings["output"]}, "voice": self.settings["voice"]}}}

    def _finish(self, r: dict, done: ReplyDone) -> None:
        status = "cancelled" if done.interrupted else "completed"
        if r["item"] is not None:
            where = self._where(r)
            self.send({"type": "response.output_audio.done", **where})
            self.send({"type": "response.output_audio_transcript.done", **where, "transcript": r["transcript"]})
            self.send({"type": "response.content_part.done", **where,
                       "part": {"type": "audio", "transcript": r["transcript"]}})
            item = self._assistant(r, status)
            self.send({"type": "response.output_item.done", "response_id": r["id"], "output_index": r["index"],
                       "item": item})
            self.send({"type": "conversation.item.done", "previous_item_id": self.last_item, "item": item})
            self.last_item = r["item"]
        details = {"type": "cancelled", "reason": "turn_detected"} if done.interrupted else None
        self.send({"type": "response.done", "response": self._response_object(r, status, details)})

# event type -> (its schema, its handler, which takes the validated event)
HANDLERS: dict[str, tuple[type[BaseModel], Callable[[Connection, Any], Awaitable[None]]]] = {
    "session.update": (SessionUpdate, Connection.on_session_update),
    "input_audio_buffer.append": (AudioAppend, Connection.on_append),
    "input_audio_buffer.commit": (NoFields, Connection.on_commit),
    "input_audio_buffer.clear": (NoFields, Connection.on_clear),
    "conversation.item.create": (ItemCreate, Connection.on_item_create),
    "response.create": (ResponseCreate, Connection.on_response_create),
    "response.cancel": (ResponseCancel, Connection.on_response_cancel),
    "conversation.item.truncate": (ItemTruncate, Connection.on_truncate)}


async def handle(ws: WebSocket, stages: Stages, auth: Auth | None = None) -> None:
    await run_admitted(ws, stages, auth, lambda principal: _serve(ws, stages, principal))


async def _serve(ws: WebSocket, stages: Stages, principal: str) -> None:
    beta = "realtime=v1" in ws.headers.get("openai-beta", "")
    conn = Connection(ws, stages, principal, beta, ws.query_params.get("model", "diffusion-voice"))
    tasks: list[asyncio.Task] = []
    try:
        await ws.accept()
        conn.send({"type": "session.created", "session": conn.session_object()})
        tasks = [asyncio.create_task(conn.pump()), asyncio.create_task(conn.relay()),
                 asyncio.create_task(conn.closer())]
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                break
            if msg.get("text") is not None:
                await conn.handle(msg["text"])
            else:
                conn.error(RealtimeError("binary frames are not part of this protocol: send audio as "
                                         "input_audio_buffer.append", "invalid_event"))
    except (WebSocketDisconnect, RuntimeError):  # RuntimeError: received after our close
        pass
    finally:
        await finish(conn.session, "disconnect", tasks)
