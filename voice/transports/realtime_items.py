"""A Realtime conversation's items, as its client sees them: the bookkeeping behind /v1/realtime.

voice/transports/realtime.py translates between the session and the wire; what it says about
items comes from here: the user's spoken and typed items, each turn's response with its spoken
message and function calls, the order of items (`previous_item_id`), and what waits for the
next `response.create` (typed messages, the client's function outputs), bounded by `[session]`.
Every method returns the server events it makes, with their GA names, for the front to send.
"""

from __future__ import annotations

import itertools
import json
import secrets
from typing import Any

from voice.config import SessionConfig
from voice.events import ReplyDone, ToolCall
from voice.conversation.playback import Playback
from voice.pipeline.tools import ToolRun

Events = list[dict[str, Any]]
_ids = itertools.count(1)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}{next(_ids)}"


class RealtimeError(ValueError):
    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.code, self.param, self.kind = message, code, param, kind


class Items:
    """The items of one conversation (`id`); `settings` are the connection's (output format, voice)."""

    def __init__(self, conversation_id: str, beta: bool, settings: dict[str, Any], limits: SessionConfig,
                 max_tokens: int):
        self.id, self.beta, self.settings, self.limits, self.max_tokens = (conversation_id, beta, settings, limits,
                                                                             max_tokens)
        self.user_items: dict[int, str] = {}  # turn -> the user item's id
        self.before: dict[str, str | None] = {}  # a spoken user item -> the item before it (its previous_item_id)
        self.responses: dict[int, dict] = {}  # turn -> {id, item, transcript, playback}
        self.failures: dict[int, dict] = {}  # turn -> why its response failed ({type, code}), until its response.done
        self.pending_text: list[str] = []  # typed user messages not answered yet
        self.pending_items: list[str] = []  # ... their items' ids
        self.typed: dict[int, list[str]] = {}  # turn -> the ids of the typed user items it answers
        self.pending_outputs: list[ToolRun] = []  # the client's function outputs not answered yet
        self.calls: dict[str, str] = {}  # call_id -> function name, of the calls the LM made
        self.last_item: str | None = None

    # --- the user's items -----------------------------------------------------------------------

    def speech_started(self, turn: int, audio_ms: float) -> Events:
        self.user_items[turn] = new_id("item")
        return [{"type": "input_audio_buffer.speech_started", "audio_start_ms": int(audio_ms),
                 "item_id": self.user_items[turn]}]

    def speech_stopped(self, turn: int, audio_ms: float) -> Events:
        item = self.user_items.setdefault(turn, new_id("item"))
        self.before[item] = self.last_item
        while len(self.before) > 64:
            self.before.pop(next(iter(self.before)))
        out: Events = [{"type": "input_audio_buffer.speech_stopped", "audio_end_ms": int(audio_ms), "item_id": item},
               {"type": "input_audio_buffer.committed", "previous_item_id": self.last_item, "item_id": item},
               {"type": "conversation.item.added", "previous_item_id": self.last_item, "item": _user(item)}]
        self.last_item = item
        return out

    def transcribed(self, turn: int, text: str, audio_ms: float, resumes: int = 0) -> Events:
        """`turn`'s final transcript. `resumes` (the final's): the earlier turn whose words it holds too, the
        user having gone on after a pause; that turn's item is deleted now (`conversation.item.deleted`) and
        gets no events after it. Not at `speech_started`: until the final, speech in the pause may be the
        room's, and then the earlier item and its response stand (voice/conversation/reply.py, `not_resumed`)."""
        spoken = self.user_items.get(turn)
        if spoken is None:  # a typed turn (its item was announced when it was created), or a deleted one
            return []
        out = self._supersede(resumes) if resumes else []
        return [*out, {"type": "conversation.item.input_audio_transcription.completed", "item_id": spoken,
                       "content_index": 0, "transcript": text,
                       "usage": {"type": "duration", "seconds": round(audio_ms / 1000, 3)}},
                {"type": "conversation.item.done", "previous_item_id": None, "item": _user(spoken, text)}]

    def _supersede(self, resumes: int) -> Events:
        superseded = self.user_items.pop(resumes, None)
        if superseded is None:
            return []
        earlier = self.before.pop(superseded, None)
        for item, previous in self.before.items():  # the items after it now follow the one before it
            if previous == superseded:
                self.before[item] = earlier
        if self.last_item == superseded:
            self.last_item = earlier
        return [{"type": "conversation.item.deleted", "item_id": superseded}]

    def message(self, item_id: str, role: str, parts: list[tuple[str, str, float]]) -> Events:
        """A message the client added: its parts as (type, text or transcript, seconds of audio). A
        user's waits for the next response; a system one's text was joined to the instructions."""
        text = " ".join(t for _, t, _ in parts if t)
        if role != "system" and text:
            self.check_room(len(text))
            self.pending_text.append(text)
            self.pending_items.append(item_id)
        added = {"id": item_id, "type": "message", "object": "realtime.item", "status": "completed", "role": role,
                 "content": [{"type": "input_text", "text": t} if kind == "input_text" else
                             {"type": "input_audio", "transcript": t} for kind, t, _ in parts]}
        out: Events = [{"type": "conversation.item.added", "previous_item_id": self.last_item, "item": added}]
        out += [{"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id,
                 "content_index": i, "transcript": t, "usage": {"type": "duration", "seconds": round(seconds, 3)}}
                for i, (kind, t, seconds) in enumerate(parts) if kind == "input_audio"]
        out.append({"type": "conversation.item.done", "previous_item_id": self.last_item, "item": added})
        self.before[item_id] = self.last_item
        while len(self.before) > 64:
            self.before.pop(next(iter(self.before)))
        self.last_item = item_id
        return out

    def answered_by(self, turn: int) -> None:
        """`turn` answers the typed messages waiting: they are its items now."""
        self.typed[turn], self.pending_items, self.pending_text = self.pending_items, [], []
        while len(self.typed) > 64:
            self.typed.pop(next(iter(self.typed)))

    def refused(self, turn: int) -> Events:
        """The LM refused `turn` for what its user items hold (too long for its context): they are
        not in the conversation the LM sees any more (voice/conversation/reply.py), so they are deleted here too,
        and the next message is answered without them."""
        gone = [i for i in [self.user_items.pop(turn, None), *self.typed.pop(turn, [])] if i is not None]
        while self.last_item in gone:
            self.last_item = self.before.get(self.last_item)
        return [{"type": "conversation.item.deleted", "item_id": item} for item in gone]

    def function_output(self, item_id: str | None, call_id: str, output: str) -> Events:
        if call_id not in self.calls:
            raise RealtimeError(f"no function call {call_id[:60]!r} in this conversation", param="item.call_id")
        if len(output) > self.limits.max_system_prompt_chars:
            raise RealtimeError("output must be a string of at most "
                                f"{self.limits.max_system_prompt_chars} characters", param="item.output")
        self.check_room(len(output))
        self.pending_outputs.append(ToolRun(call_id, self.calls[call_id], {}, output, "ok"))
        added = {"id": item_id or new_id("item"), "type": "function_call_output", "object": "realtime.item",
                 "status": "completed", "call_id": call_id, "output": output}
        out: Events = [{"type": "conversation.item.added", "previous_item_id": self.last_item, "item": added},
                       {"type": "conversation.item.done", "previous_item_id": self.last_item, "item": added}]
        self.last_item = added["id"]
        return out

    def check_room(self, chars: int) -> None:
        """Items waiting for a response are kept here and go to the LM as one question: their number
        and size are bounded (`session.max_items`, `session.max_items_chars`)."""
        limits = self.limits
        waiting = self.pending_text + [run.result for run in self.pending_outputs]
        held = sum(map(len, waiting))
        if len(waiting) >= limits.max_items or held + chars > limits.max_items_chars:
            raise RealtimeError(f"the conversation already holds {len(waiting)} items of {held} characters waiting "
                                f"for a response (at most {limits.max_items} items of {limits.max_items_chars} "
                                "characters together): send response.create first", "conversation_full", "item")

    # --- the responses --------------------------------------------------------------------------

    def response(self, turn: int, playback: Playback | None) -> tuple[dict, Events]:
        """This turn's response (announced, with the events that do it, on its first output)."""
        r = self.responses.get(turn)
        if r is not None:
            return r, []
        r = self.responses[turn] = {"id": new_id("resp"), "item": None, "index": 0, "transcript": "", "calls": [],
                                    "playback": playback}
        while len(self.responses) > 64:
            self.responses.pop(next(iter(self.responses)))
        tokens = self.max_tokens
        return r, [{"type": "rate_limits.updated", "rate_limits": [
                       {"name": "tokens", "limit": tokens, "remaining": tokens, "reset_seconds": 0.0}]},
                   {"type": "response.created", "response": self._response_object(r, "in_progress")}]

    def spoken(self, turn: int, playback: Playback | None) -> tuple[dict, Events]:
        """The response, with its spoken message item (added on the first text or audio)."""
        r, out = self.response(turn, playback)
        if r["item"] is None:
            r["item"], r["index"] = new_id("item"), len(r["calls"])
            out += [{"type": "response.output_item.added", "response_id": r["id"], "output_index": r["index"],
                     "item": self._assistant(r, "in_progress")},
                    {"type": "response.content_part.added", **where(r), "part": {"type": "audio", "transcript": ""}}]
        return r, out

    def reply_text(self, turn: int, text: str, playback: Playback | None) -> Events:
        r, out = self.spoken(turn, playback)
        r["transcript"] += text
        return out + [{"type": "response.output_audio_transcript.delta", **where(r), "delta": text}]

    def function_call(self, turn: int, ev: ToolCall, playback: Playback | None) -> Events:
        """The LM called one of the client's functions: an output item of its own."""
        r, out = self.response(turn, playback)
        args = json.dumps(ev.arguments, ensure_ascii=False)
        call = {"id": new_id("item"), "type": "function_call", "object": "realtime.item", "status": "completed",
                "call_id": ev.id, "name": ev.name, "arguments": args}
        index = len(r["calls"]) + (r["item"] is not None)
        r["calls"].append(call)
        self.calls[ev.id] = ev.name
        at = {"response_id": r["id"], "item_id": call["id"], "output_index": index, "call_id": ev.id}
        out += [{"type": "response.output_item.added", "response_id": r["id"], "output_index": index,
                 "item": {**call, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", **at, "delta": args},
                {"type": "response.function_call_arguments.done", **at, "name": ev.name, "arguments": args},
                {"type": "response.output_item.done", "response_id": r["id"], "output_index": index, "item": call},
                {"type": "conversation.item.done", "previous_item_id": self.last_item, "item": call}]
        self.last_item = call["id"]
        return out

    def done(self, turn: int, done: ReplyDone, playback: Playback | None) -> Events:
        """The reply is over (a reply cancelled before its first output is a response too)."""
        r, out = self.response(turn, playback)
        status = "cancelled" if done.interrupted else "completed"
        details: dict[str, Any] | None = {"type": "cancelled", "reason": "turn_detected"} if done.interrupted else None
        if (error := self.failures.pop(turn, None)) is not None:  # the turn failed: its apology is not the reply
            status, details = "failed", {"type": "failed", "error": error}
        if r["item"] is not None:
            at = where(r)
            item = self._assistant(r, status)
            out += [{"type": "response.output_audio.done", **at},
                    {"type": "response.output_audio_transcript.done", **at, "transcript": r["transcript"]},
                    {"type": "response.content_part.done", **at,
                     "part": {"type": "audio", "transcript": r["transcript"]}},
                    {"type": "response.output_item.done", "response_id": r["id"], "output_index": r["index"],
                     "item": item},
                    {"type": "conversation.item.done", "previous_item_id": self.last_item, "item": item}]
            self.last_item = r["item"]
        return out + [{"type": "response.done", "response": self._response_object(r, status, details)}]

    def failed(self, turn: int, kind: str, code: str) -> None:
        """The turn's reply failed (its `error` event is out): its response.done says so."""
        self.failures[turn] = {"type": kind, "code": code}

    def truncate(self, item_id: str, audio_end_ms: int) -> tuple[str, Events]:
        """The client played only `audio_end_ms` of an assistant item: what of it was heard."""
        found = next((r for r in self.responses.values() if r["item"] == item_id), None)
        if found is None:
            raise RealtimeError(f"no assistant audio item {item_id[:60]!r}", "item_truncate_invalid_item_id", "item_id")
        heard = found["playback"].heard_within(audio_end_ms / 1000) if found["playback"] else ""
        found["heard"] = heard
        return heard, [{"type": "conversation.item.truncated", "item_id": item_id, "content_index": 0,
                        "audio_end_ms": audio_end_ms}]

    def _assistant(self, r: dict, status: str) -> dict:
        """The spoken message item; `status` is the response's (cancelled: the item is incomplete)."""
        content = [{"type": "output_audio" if not self.beta else "audio", "transcript": r["transcript"]}] \
            if status != "in_progress" else []
        status = {"cancelled": "incomplete", "failed": "incomplete"}.get(status, status)
        return {"id": r["item"], "type": "message", "object": "realtime.item", "role": "assistant", "status": status,
                "content": content}

    def _response_object(self, r: dict, status: str, details: dict | None = None) -> dict:
        output = [] if status == "in_progress" else r["calls"] + ([self._assistant(r, status)] if r["item"] else [])
        return {"id": r["id"], "object": "realtime.response", "status": status, "status_details": details,
                "output": output, "conversation_id": self.id, "output_modalities": ["audio"],
                "max_output_tokens": "inf", "usage": None, "metadata": None,
                "audio": {"output": {"format": {"type": self.settings["output"]}, "voice": self.settings["voice"]}}}


def where(r: dict) -> dict:
    """Where a response's spoken content is: response, item, output and content index."""
    return {"response_id": r["id"], "item_id": r["item"], "output_index": r["index"], "content_index": 0}


def _user(item: str, transcript: str | None = None) -> dict:
    return {"id": item, "type": "message", "object": "realtime.item", "role": "user",
            "status": "completed", "content": [{"type": "input_audio", "transcript": transcript}]}
