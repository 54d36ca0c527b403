"""Run an ASGI app under uvicorn in a background thread on a free loopback port (test helper)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

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
