"""A session's outgoing events, bounded so a client that reads slowly cannot grow our memory.

Reply audio beyond `[limits] outbox_audio_s` of queued speech is dropped (and counted); once
`outbox_max_events` events wait, the outbox is `stalled` and the session ends (`slow_client`).
Events can be held back (`holding`) while a turn's record is committed, then `release`d.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from prometheus_client import Counter

from voice.config import LimitsConfig
from voice.events import Event, TtsAudio

log = logging.getLogger("voice.outbox")


class Outbox(asyncio.Queue):
    def __init__(self, limits: LimitsConfig, dropped_seconds: Counter | None = None, session_id: str = ""):
        super().__init__()
        self.limits, self.dropped_seconds, self.session_id = limits, dropped_seconds, session_id
        self._held: list[Event] | None = None

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self.audio_s = 0.0  # seconds of reply audio queued

    def _put(self, item: Event) -> None:
        super()._put(item)
        if isinstance(item, TtsAudio):
            self.audio_s += item.seconds

    def _get(self) -> Event:
        item = super()._get()
        if isinstance(item, TtsAudio):
            self.audio_s = max(self.audio_s - item.seconds, 0.0)
        return item

    @property
    def stalled(self) -> bool:
        """The client stopped reading long ago."""
        return self.qsize() >= self.limits.outbox_max_events

    def offer(self, ev: Event) -> bool:
        """Queue `ev` (or hold it); False if it was not: reply audio over the limit, or a stalled outbox."""
        if self._held is not None:
            self._held.append(ev)
            return True
        if self.stalled or isinstance(ev, TtsAudio) and self.audio_s > 0 and \
                self.audio_s + ev.seconds > self.limits.outbox_audio_s:
            if isinstance(ev, TtsAudio):
                self._drop(ev)
            return False
        self.put_nowait(ev)
        return True

    @contextlib.contextmanager
    def holding(self) -> Iterator[list[Event]]:
        """Events offered inside the block are collected in the yielded list instead of queued."""
        held: list[Event] = []
        self._held = held
        try:
            yield held
        finally:
            self._held = None

    def release(self, held: list[Event]) -> None:
        for ev in held:
            self.put_nowait(ev)

    def _drop(self, ev: TtsAudio) -> None:
        if self.dropped_seconds is not None:
            self.dropped_seconds.inc(ev.seconds)
        log.warning("session=%s turn=%d client reads too slowly: %.1f s of reply audio queued, %.1f s dropped",
                    self.session_id, ev.turn, self.audio_s, ev.seconds)
