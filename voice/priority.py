"""Who goes first on the shared CPU: the work a silent user is waiting for.

From the moment a user stops talking until the first phrase of their reply is synthesised,
they hear nothing, and that gap is the latency we sell. Later work for a reply that is
already playing has the audio queued before it as slack, until that runs low; partial
transcripts are best effort. Sessions say when they start and stop waiting; the background
work of every stage then defers to them, each job for at most `MAX_DEFER_S`, so it is
delayed, never starved.
"""

import threading
import time

# How long a background job may be held back. A reply's first phrase is at least four words,
# more than a second of audio, so holding its later phrases this long costs no gap.
MAX_DEFER_S = 0.3
# A playing reply's work is urgent again once less audio than this is left to play: the LM
# needs several forwards for the next phrase's text, synthesis one call for its audio.
LM_HORIZON_S = 2.0
TTS_HORIZON_S = 1.0


class Waiting:
    """The sessions waiting for their reply's first audio, counted across threads."""

    def __init__(self) -> None:
        self._waiting: set[object] = set()
        self._lock = threading.Lock()

    def start(self, who: object) -> None:
        with self._lock:
            self._waiting.add(who)

    def stop(self, who: object) -> None:
        with self._lock:
            self._waiting.discard(who)

    def busy(self) -> bool:
        """Is anyone waiting in silence?"""
        return bool(self._waiting)

    def defer(self, since: float) -> bool:
        """Should a background job that has been ready since `since` (monotonic) wait longer?"""
        return self.busy() and time.monotonic() - since < MAX_DEFER_S


WAITING = Waiting()
