"""The transport contract, and the lifecycle every connection-per-session front shares.

The contract (voice/session.py draws the line): a transport opens one `Session` per
conversation, feeds it the caller's audio with `push_audio`, drains its `outbox` onto the wire,
reports what reached the wire with `audio_sent` (so the session knows what was heard), and when
`session.ending` is set (a limit, shutdown) it lets what is queued go out and closes the
connection. Whatever way the connection ends, its tasks are cancelled, the session is closed and
the admission ticket is given back.

Here that lifecycle is written once, as plain functions that native (/ws), Realtime, Twilio and
SIP call; each front keeps its own wire format, its own reading loop and (SIP) its own dialogs:

    admit / run_admitted   authenticate and admit a websocket; refuse it with an error and a close
    acquire                the admission ticket itself (SIP admits a dialog, not a websocket)
    close_when_ending      the ending watcher: wait for `ending`, then flush_then_close
    flush_then_close       give what is queued its grace, then close (a websocket close, or a BYE)
    finish                 cancel the connection's tasks, `session.close`, release the ticket

The flush grace is the one thing that differs by front, and each passes it explicitly
(`FLUSH_S` below). Wyoming is not on this lifecycle: it opens no `Session` per connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from starlette.websockets import WebSocket, WebSocketDisconnect

from voice.auth import Auth, AuthError
from voice.limits import LimitError, Ticket
from voice.session import Session
from voice.stages import Stages

log = logging.getLogger("voice.native")  # the name the refusals and closes were always logged under
CLOSE_TIMEOUT_S = 2.0  # a websocket close the peer does not answer is given up after this

# When the server ends a session: how long what is queued gets to reach the wire before the close.
FLUSH_S = {
    # /ws: the sender drains the outbox up to an end mark (the final `error` is last), so this is only
    # an upper bound against a client that does not read; normally the close follows at once.
    "native": 2.0,
    # Realtime: events pass through two queues (the outbox, then the translated server events) with
    # no end mark through both, so a plain wait for the final `error` to be translated and sent.
    "realtime": 0.5,
    # Twilio: audio is paced in real time and the final error has no Twilio form; only the media
    # frame being sent needs to finish (draining would play out the rest of the reply).
    "twilio": 0.2,
    # SIP: a BYE at once; the error has no SIP form and RTP frames go out with a synchronous sendto.
    "sip": 0.0,
}


# --- admission -------------------------------------------------------------------------------

def acquire(stages: Stages, principal: str, per_key: bool) -> Ticket | None:
    """An admission ticket for one more session (None where the service admits without limits);
    LimitError when there is no room."""
    admission = getattr(stages, "admission", None)
    return admission.acquire(principal, per_key) if admission is not None else None


async def admit(ws: WebSocket, stages: Stages, auth: Auth | None,
                twilio: bool = False) -> tuple[str, Ticket | None] | None:
    """Authenticate and admit a websocket before accepting it: (principal, ticket), or
    accept, send the error, close and return None."""
    try:
        principal = "anonymous"
        if auth is not None:
            auth.check_origin(ws.headers)
            if twilio and auth.twilio_token:
                from voice.auth import request_url
                auth.check_twilio(ws.headers, request_url(ws.scope, ws.headers))
                principal = "twilio"
            else:
                principal = auth.principal(ws.headers, ws.query_params)
        per_key = auth is not None and auth.enabled and principal != "twilio"
        return principal, acquire(stages, principal, per_key)
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


async def run_admitted(ws: WebSocket, stages: Stages, auth: Auth | None,
                       serve: Callable[[str], Awaitable[None]], twilio: bool = False) -> None:
    """Admit the websocket, `serve(principal)` it, and give the admission back however that ends."""
    admitted = await admit(ws, stages, auth, twilio)
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


async def flush_then_close(session: Session, close: Callable[[], Awaitable[None]], grace_s: float,
                           sender: asyncio.Task | None = None) -> None:
    """What is queued gets `grace_s` to reach the wire, then `close()`. With the `sender` task (one that
    returns at the outbox's end mark, None), the mark is queued and the wait ends when the sender has
    sent all before it; the sender is then cancelled. Without it, a plain wait."""
    if sender is not None:
        session.outbox.put_nowait(None)
        await asyncio.wait({sender}, timeout=grace_s)
        sender.cancel()
    elif grace_s:
        await asyncio.sleep(grace_s)
    await close()


async def close_when_ending(session: Session, close: Callable[[], Awaitable[None]], grace_s: float,
                            sender: asyncio.Task | None = None) -> None:
    """The ending watcher (a task of its own): when the server ends the session, flush, then close."""
    await session.ending.wait()
    await flush_then_close(session, close, grace_s, sender)


async def finish(session: Session | None, reason: str, tasks: Iterable[asyncio.Task | None] = (),
                 ticket: Ticket | None = None) -> None:
    """The end of every connection: cancel its tasks (not the one running this), close the session
    (`reason`, unless the server ended it with its own), give the admission ticket back."""
    current = asyncio.current_task()
    for task in tasks:
        if task is not None and task is not current:
            task.cancel()
    try:
        if session is not None:
            await session.close(reason)
    finally:
        if ticket is not None:
            ticket.release()
