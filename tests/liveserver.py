"""Serving an ASGI app under uvicorn in a background thread on a free loopback port, and small clients of it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import urllib.request

import uvicorn

from voice.service.server import WEBSOCKETS


class Served:
    """`app` under uvicorn on a free loopback port, in a thread: the one way tests serve an app.
    A context manager; `stop()` ends it early (a graceful-shutdown test times it)."""

    def __init__(self, app, server_cls=uvicorn.Server, start_timeout_s: float = 60.0, **options):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))  # handed to uvicorn still bound: no race for the port
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, ws=WEBSOCKETS, log_level="warning",
                                **options)
        self.server = server_cls(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.start_timeout_s = start_timeout_s

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def __enter__(self) -> "Served":
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)
        self.sock.close()

    def __exit__(self, *exc) -> None:
        self.stop()


def free_port() -> int:
    """A TCP port free on loopback right now (for servers that bind it themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app, **options):
    """Yield the port `app` is served on (see `Served`); stop the server afterwards."""
    with Served(app, **{"access_log": False, **options}) as served:
        yield served.port


def healthz(srv) -> dict:
    """The service's /healthz document."""
    with urllib.request.urlopen(srv.http + "/healthz", timeout=10) as r:
        return json.loads(r.read())


async def next_json(ws, pred=lambda m: True, timeout: float = 10.0) -> dict:
    """The next JSON event on `ws` for which `pred` holds (binary frames skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = await asyncio.wait_for(ws.recv(), max(deadline - time.monotonic(), 0.01))
        if isinstance(msg, str):
            ev = json.loads(msg)
            if pred(ev):
                return ev


def wyoming_exchange(port: int, *events, until: str, timeout: float = 60.0) -> list:
    """Connect to the Wyoming server on `port` with the `wyoming` client, send `events`, and return
    the events that come back, up to the first of type `until` (or until the server closes)."""
    from wyoming.client import AsyncTcpClient

    async def scenario():
        client = AsyncTcpClient("127.0.0.1", port)
        await client.connect()
        try:
            for event in events:
                await client.write_event(event)
            got = []
            while (event := await asyncio.wait_for(client.read_event(), timeout)) is not None:
                got.append(event)
                if event.type == until:
                    break
            return got
        finally:
            await client.disconnect()
    return asyncio.run(scenario())


def wait_for(pred, timeout: float, what: str):
    """`pred()`'s first true value, polled every 50 ms; an assertion error saying `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return value
