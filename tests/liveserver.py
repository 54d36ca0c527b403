"""Run an ASGI app under uvicorn in a background thread on a free loopback port (test helper)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import urllib.request

import uvicorn


@contextlib.contextmanager
def serving(app, start_timeout_s: float = 60.0):
    """Yield the port `app` is served on; stop the server afterwards."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # handed to uvicorn still bound: no race for the port
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, ws="websockets",
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


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
