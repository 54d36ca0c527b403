"""The transport contract, and the one conversation runner every front is a wire codec over.

A front (/ws, Realtime, Twilio, SIP) only translates: its wire into a session's input, the
session's events into its wire. Everything between is here, once:

    AudioInput    receive(): read the wire until the peer goes, its audio into `session.push_audio`
    AudioOutput   play(audio, heard), clear(), send(event), close(code, reason): the wire out
    admit / run_admitted / acquire   authenticate and admit (a websocket; SIP admits a dialog)
    ConversationRunner   the flow of one conversation: `open` a Session, the one drain of its outbox onto
                  the output, each phrase reported heard when its first frame is on the wire,
                  and when the session is `ending` (a limit, shutdown): stop reading, flush, close;
                  however it ends, `finish`: cancel its tasks, `session.close`, release.

What differs by front is its codec and the flush grace (`FLUSH_S`). Wyoming's connections run
here too, their session one that serves requests (its dictate, recite, answer_in: voice/conversation/oneshot.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from starlette.websockets import WebSocket, WebSocketDisconnect

from voice.service.auth import Auth, AuthError
from voice.events import Clear, Event, TtsAudio
from voice.service.limits import LimitError, Ticket
from voice.conversation.session import Session
from voice.service.instance import Instance

log = logging.getLogger("voice.native")  # the name the refusals and closes were always logged under
CLOSE_TIMEOUT_S = 2.0  # a websocket close the peer does not answer is given up after this

DISCONNECTED = (WebSocketDisconnect, RuntimeError, OSError)  # the peer went (RuntimeError: used after a close)

# When the server ends a session, the drain gets this long to send what is queued before the end
# mark (the final `error` is last); only an upper bound against a peer that does not read.
FLUSH_S = {
    "native": 2.0,
    "realtime": 0.5,
    # Twilio: reply audio is paced in real time and the final error has no Twilio form: the frame
    # being sent finishes (the output's close waits for it), the rest of the reply is not played out.
    "twilio": 0.2,
    # SIP: a BYE at once; the error has no SIP form and RTP frames go out with a synchronous sendto.
    "sip": 0.0,
    # Wyoming: a request's last event, or the error that ends it, is written by the drain itself;
    # what is left (latency reports) has no Wyoming form.
    "wyoming": 0.5,
}


# --- the contract ----------------------------------------------------------------------------

class AudioInput(Protocol):
    async def receive(self) -> str | None:
        """Read the peer until it goes: its audio frames into `session.push_audio` (opening the
        session with `ConversationRunner.open` once it can), anything else to the front's codec. Returns
        why the conversation ended (None: the peer went)."""


class AudioOutput(Protocol):
    async def play(self, audio: TtsAudio, heard: Callable[[], None]) -> None:
        """Put a phrase of reply audio on the wire while `session.is_current(audio.turn)`; call
        `heard()` once, the moment its first frame is there (a paced output: when that frame goes)."""

    async def clear(self) -> None:
        """Barge-in: drop any reply audio still held on our side of the wire."""

    async def send(self, event: Event) -> None:
        """Any other session event, in the front's wire form (or nowhere, if it has none)."""

    async def close(self, code: int, reason: str) -> None:
        """The server ends the conversation: close the connection (a websocket close, a BYE)."""


# --- admission -------------------------------------------------------------------------------

def acquire(instance: Instance, principal: str, per_key: bool) -> Ticket:
    """An admission ticket for one more session; LimitError when there is no room."""
    return instance.admission.acquire(principal, per_key)


async def admit(ws: WebSocket, instance: Instance, auth: Auth | None,
                twilio: bool = False) -> tuple[str, Ticket | None] | None:
    """Authenticate and admit a websocket before accepting it: (principal, ticket), or
    accept, send the error, close and return None."""
    try:
        principal = "anonymous"
        if auth is not None:
            auth.check_origin(ws.headers)
            if twilio and auth.twilio_token:
                from voice.service.auth import request_url
                auth.check_twilio(ws.headers, request_url(ws.scope, ws.headers))
                principal = "twilio"
            else:
                principal = auth.principal(ws.headers, ws.query_params)
        per_key = auth is not None and auth.enabled and principal != "twilio"
        return principal, acquire(instance, principal, per_key)
    except (AuthError, LimitError) as err:
        client = ws.client.host if ws.client else "-"
        log.warning("refused %s from %s: %s: %s", ws.url.path, client, err.code, err.message)
        await ws.accept()
        close_code = err.close_code if isinstance(err, LimitError) else 1008
        if twilio:  # Twilio's side has no error message: only the close reason
            await close_ws(ws, close_code, err.code)
        else:
            await fail(ws, err.code, err.message, close_code)
        return None


async def run_admitted(ws: WebSocket, instance: Instance, auth: Auth | None,
                       serve: Callable[[str], Awaitable[None]], twilio: bool = False) -> None:
    """Admit the websocket, `serve(principal)` it, and give the admission back however that ends."""
    admitted = await admit(ws, instance, auth, twilio)
    if admitted is None:
        return
    principal, ticket = admitted
    try:
        await serve(principal)
    finally:
        if ticket is not None:
            ticket.release()


# --- closing ---------------------------------------------------------------------------------

async def fail(ws: WebSocket, code: str, message: str, close_code: int | None = None) -> None:
    """An `error` event (the native protocol's shape), then the close with the code as reason."""
    log.warning("closing websocket: %s: %s", code, message)
    try:
        await ws.send_json({"type": "error", "code": code, "message": message})
    except (WebSocketDisconnect, RuntimeError, OSError):
        return
    await close_ws(ws, close_code or (1008 if code != "start_timeout" else 1001), code)


async def close_ws(ws: WebSocket, code: int = 1000, reason: str | None = None) -> None:
    """Close a websocket; one already gone, or a peer that does not answer, is not an error."""
    try:
        await asyncio.wait_for(ws.close(code=code, reason=reason), CLOSE_TIMEOUT_S)
    except (WebSocketDisconnect, RuntimeError, OSError, asyncio.TimeoutError):
        pass




# --- the runner ------------------------------------------------------------------------------

class ConversationRunner:
    """One conversation on one front: the session, the one drain of its outbox, its end. (Not
    engine/serving/caches.py's `ConversationCache`: a conversation's LM cache.)"""

    def __init__(self, flush_s: float, input: AudioInput | None = None):
        self.flush_s, self.input = flush_s, input  # (SIP feeds its session from its own task: no input)
        self.session: Session | None = None
        self.output: AudioOutput | None = None
        self.reader: asyncio.Task | None = None
        self.drain: asyncio.Task | None = None
        self.watcher: asyncio.Task | None = None
        self.tasks: list[asyncio.Task] = []  # the front's own (a pacer, a media watchdog): cancelled at the end

    def open(self, session: Session, output: AudioOutput) -> Session:
        """The session is built: its outbox flows to `output`, and its end is watched."""
        self.session, self.output = session, output
        self.drain = asyncio.create_task(self._drain())
        self.watcher = asyncio.create_task(self._close_when_ending())
        return session

    async def serve(self) -> str:
        """Read the peer until it goes, or until the server ends the session (the watcher then stops
        the reading, flushes and closes); then `finish`. The reason it ended."""
        reason = "disconnect"
        assert self.input is not None  # a front that reads its peer
        self.reader = asyncio.create_task(self.input.receive())
        try:
            await asyncio.wait({self.reader})
            if not self.reader.cancelled():
                err = self.reader.exception()
                if err is None:
                    reason = self.reader.result() or reason
                elif not isinstance(err, DISCONNECTED):
                    log.error("session=%s receive failed: %r", self.session.id if self.session else "-", err)
                    reason = "error"
            if self.watcher is not None and self.session is not None and self.session.ending.is_set():
                await asyncio.wait({self.watcher})  # the flush and the close
        finally:
            await self.finish(reason)
        return self.session.end_reason or reason if self.session is not None else reason

    async def _drain(self) -> None:
        """The one place a session's outbox is read, in order, up to the end mark (None)."""
        session, out = self.session, self.output
        assert session is not None and out is not None  # opened
        try:
            while (ev := await session.outbox.get()) is not None:
                if isinstance(ev, TtsAudio):
                    await out.play(ev, functools.partial(self.heard, ev))
                elif isinstance(ev, Clear):
                    await out.clear()
                    await out.send(ev)
                else:
                    await out.send(ev)
        except DISCONNECTED as err:  # the wire went away mid-send: stop reading it too
            log.info("session=%s sending stopped: %r", session.id, err)
            self._stop_reading()
        except Exception:
            log.exception("session=%s sending failed", session.id)
            self._stop_reading()

    def heard(self, audio: TtsAudio) -> None:
        """The one place a phrase counts as heard: its first frame reached the wire."""
        assert self.session is not None  # opened
        self.session.audio_sent(audio.turn, audio.text, audio.seconds, audio.pcm, audio.rate)

    async def _close_when_ending(self) -> None:
        """When the server ends the session: stop reading, let the queue reach the wire, close."""
        session = self.session
        assert session is not None  # opened
        await session.ending.wait()
        self._stop_reading()
        await self.flush_then_close()

    async def flush_then_close(self) -> None:
        """The end mark goes into the outbox; once the drain has sent all before it (or after
        `flush_s`), the output closes."""
        assert self.session is not None and self.drain is not None and self.output is not None  # opened
        self.session.outbox.put_nowait(None)
        await asyncio.wait({self.drain}, timeout=self.flush_s)
        self.drain.cancel()
        await self.output.close(self.session.close_code, self.session.end_reason)

    def _stop_reading(self) -> None:
        if self.reader is not None and self.reader is not asyncio.current_task():
            self.reader.cancel()

    async def finish(self, reason: str, ticket: Ticket | None = None) -> None:
        """The end of every conversation: cancel its tasks (not the one running this), close the
        session (`reason`, unless the server ended it with its own), give the admission ticket back."""
        current = asyncio.current_task()
        for task in (self.reader, self.drain, self.watcher, *self.tasks):
            if task is not None and task is not current:
                task.cancel()
        try:
            if self.session is not None:
                await self.session.close(reason)
        finally:
            if ticket is not None:
                ticket.release()
