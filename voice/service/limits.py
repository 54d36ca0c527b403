"""Limits: how many sessions may run, by the instance's measured capacity (voice/service/capacity.py), in
all and per API key, and whether we are draining (admission); how long one session may last and
stay silent (`watch_session`).

Every transport asks for a `Ticket` before it opens a session (a websocket right after it is
authenticated, a SIP call at its INVITE) and releases it when the connection ends.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import logging
import threading
import time
from typing import TYPE_CHECKING, Protocol

from voice.config import Config, LimitsConfig

if TYPE_CHECKING:
    from voice.service.capacity import Capacity
    from voice.conversation.latency import Metrics

log = logging.getLogger("voice.limits")

_malloc_trim = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
_trim_lock = threading.Lock()
_trim = {"running": False, "again": False}
TRIM_AFTER_S = 1.0  # what a closed connection held is freed as its tasks finish, just after it ends


def trim_heap() -> None:
    """Give the C heap's free pages back to the system now (blocking; see give_back_freed_memory)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def give_back_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`), in a thread (~20 ms
    per 200 MB, never on the event loop). A session's buffers (long prompts, Piper's and ONNX
    Runtime's runs) leave holes between blocks still in use, which glibc otherwise keeps for good:
    without this, RSS after a flood of sessions stayed ~100-300 MB above where it started. Called
    when a connection ends, it trims TRIM_AFTER_S later; a call during a trim runs one more after
    it. A no-op on C libraries without `malloc_trim`."""
    if _malloc_trim is None:
        return
    with _trim_lock:
        if _trim["running"]:
            _trim["again"] = True
            return
        _trim["running"] = True

    def run() -> None:
        while True:
            time.sleep(TRIM_AFTER_S)
            trim_heap()
            with _trim_lock:
                if not _trim["again"]:
                    _trim["running"] = False
                    return
                _trim["again"] = False
    threading.Thread(target=run, name="malloc-trim", daemon=True).start()


class LimitError(Exception):
    """Refused: `code` is the error code for the client, `close_code` the websocket close code;
    `retry_after_s`, when the same request may succeed later (each front says it its own way)."""

    def __init__(self, code: str, message: str, close_code: int = 1008, retry_after_s: int | None = None):
        super().__init__(message)
        self.code, self.message, self.close_code = code, message, close_code
        self.retry_after_s = retry_after_s


class Ticket:
    def __init__(self, admission: "Admission", principal: str):
        self.admission, self.principal = admission, principal
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission._release(self.principal)


class Admission:
    def __init__(self, limits: LimitsConfig, metrics: Metrics | None = None, capacity: Capacity | None = None):
        """`capacity`: admit by measured capacity too (the real stages; None: by the counts only)."""
        self.limits, self.metrics, self.capacity = limits, metrics, capacity
        self.active: collections.Counter[str] = collections.Counter()
        self.total = 0
        self.draining = False

    def full(self) -> LimitError | None:
        """Why one more session would be refused for the instance's load (None: it fits), before
        anything about the session is known: websockets are refused with it before the upgrade."""
        if self.draining:
            return LimitError("shutting_down", "the server is shutting down; try again in a moment", 1001, 1)
        capacity = self.capacity
        if capacity is not None and not capacity.admits(self.total):
            return LimitError("too_many_sessions", f"the server is at its capacity ({self.total} sessions, "
                                                   f"{capacity.load:.1f} of {capacity.cores} cores busy); try again "
                                                   f"in {capacity.retry_after_s} s", 1013, capacity.retry_after_s)
        return None

    def acquire(self, principal: str, per_key: bool = True) -> Ticket:
        """A ticket for one more session of `principal`; LimitError when there is no room.

        `per_key`: whether `max_sessions_per_key` applies (only to authenticated principals)."""
        lim = self.limits
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        if self.total >= lim.max_sessions:
            self._refuse("max_sessions")
            raise LimitError("too_many_sessions", f"the server is at its limit of {lim.max_sessions} concurrent "
                                                  "sessions; try again later", 1013)
        if per_key and lim.max_sessions_per_key and self.active[principal] >= lim.max_sessions_per_key:
            self._refuse("max_sessions_per_key")
            raise LimitError("too_many_sessions", f"this API key already has {self.active[principal]} sessions "
                                                  f"open (the limit is {lim.max_sessions_per_key})", 1013)
        self.total += 1
        self.active[principal] += 1
        return Ticket(self, principal)

    def refusal(self) -> LimitError | None:
        """`full()`, counted and logged as a refusal when it refuses."""
        refusal = self.full()
        if refusal is not None:
            self._refuse("capacity" if refusal.code == "too_many_sessions" else refusal.code)
        return refusal

    def _release(self, principal: str) -> None:
        self.total -= 1
        self.active[principal] -= 1
        if self.active[principal] <= 0:
            del self.active[principal]
        give_back_freed_memory()

    def _refuse(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.refused.labels(reason).inc()
        log.warning("session refused: %s (%d open)", reason, self.total)


class Watched(Protocol):
    """What `watch_session` reads of a session (voice/conversation/session.py), and how it ends one."""

    config: Config
    closed: bool
    ending: asyncio.Event
    opened: float
    last_audio: float

    def terminate(self, code: str, message: str, close_code: int = 1008) -> None: ...


async def watch_session(session: Watched) -> None:
    """A session's own limits, checked while it lasts: its total duration and audio idleness.
    Past either, the session is `terminate`d (the transport then closes the connection)."""
    lim = session.config.limits
    period = min([1.0] + [x / 4 for x in (lim.max_session_s, lim.idle_timeout_s) if x])
    while not session.closed and not session.ending.is_set():
        await asyncio.sleep(period)
        now = time.monotonic()
        if lim.max_session_s and now - session.opened > lim.max_session_s:
            session.terminate("session_too_long", f"sessions are limited to {lim.max_session_s:g} s")
        elif lim.idle_timeout_s and now - session.last_audio > lim.idle_timeout_s:
            session.terminate("idle_timeout", f"no audio for {lim.idle_timeout_s:g} s")
