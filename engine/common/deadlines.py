"""Read deadlines for uvicorn's HTTP connections (`voice serve` and `engine serve`).

uvicorn times out only idle keep-alive connections, and only after a first response: a client
that connects and never finishes its request head (slowloris), or stops sending a body it
announced, holds a connection, a file descriptor and a buffer forever. No ASGI middleware can
help, since the app is called only once the head is complete, so the guard sits in the protocol:
`guarded_http()` is uvicorn's own HTTP protocol class (httptools or h11, as `http="auto"` would
pick) with two deadlines per request, armed when a connection opens and whenever a new request
starts on a kept-alive one:

* the head (request line and headers) must be in within `head_s` (10 s);
* then the body within `body_s` (30 s) of the head.

A connection past its deadline is answered `408 Request Timeout` when nothing was answered yet and
closed; the app sees a disconnect (`http.disconnect`). Websocket upgrades leave the guard once
upgraded. Measured (tests/test_adversarial.py): 300 connections that never finish their heads
hold 300 fds without the guard and none once the deadline has passed with it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("engine.deadlines")

HEAD_S = 10.0
BODY_S = 30.0
TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 26\r\n" \
                   b"connection: close\r\n\r\nthe request took too long"


def _auto_protocol() -> type:
    try:
        import httptools  # noqa: F401 - what uvicorn's http="auto" checks
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol


def guarded_http(head_s: float = HEAD_S, body_s: float = BODY_S, base: type | None = None) -> type:
    """uvicorn's HTTP protocol class (`base`, default what http="auto" picks) with the read deadlines;
    give it to `uvicorn.Config(http=...)`."""
    parent: Any = base or _auto_protocol()

    class Guarded(parent):
        _deadline: asyncio.TimerHandle | None = None
        _watched: Any = None  # the request cycle current when the deadline was armed
        _phase = "head"

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._arm("head", head_s)

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._arm("head", head_s)  # a new request on a kept-alive connection
            super().data_received(data)
            self._follow()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _follow(self) -> None:
            """After bytes came in: move from head to body to done as the request does."""
            if self._deadline is None:
                return
            if self.transport.is_closing() or self.transport.get_protocol() is not self:
                self._disarm()  # closed, or upgraded to a websocket: not ours any more
                return
            cycle = self.cycle
            if cycle is None or cycle is self._watched:
                return  # still in the head (or in the body already watched)
            if cycle.more_body:
                if self._phase == "head":
                    self._arm("body", body_s, cycle)
            else:
                self._disarm()  # the whole request is in

        def _arm(self, phase: str, seconds: float, cycle: Any = None) -> None:
            self._disarm()
            self._phase, self._watched = phase, cycle if phase == "body" else self.cycle
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            transport = self.transport
            if transport.is_closing() or transport.get_protocol() is not self:
                return
            cycle = self.cycle
            if self._phase == "body" and (cycle is not self._watched or not cycle.more_body):
                return
            client = self.client
            log.info("%s: closed a connection whose request %s was not in within %.0f s",
                     f"{client[0]}:{client[1]}" if client else "-", self._phase,
                     head_s if self._phase == "head" else body_s)
            if cycle is None or cycle.response_complete or not cycle.response_started:
                transport.write(TIMEOUT_RESPONSE)
                if cycle is not None and not cycle.response_complete:
                    cycle.disconnected = True  # the app hears http.disconnect; what it still sends goes nowhere
            transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{parent.__name__}"
    return Guarded
