"""What of a reply reached the wire, and when the client plays it.

The transport reports each phrase it puts on the wire (`Session.audio_sent`); the client plays a
phrase when it arrives or when the previous one ends, whichever is later. From that the ledger
knows what the user has heard by now (barge-in keeps only that in the history), whether the
audio is about to run dry (the reply's next work is urgent again), and when playback ends.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field


@dataclass
class Playback:
    # (text, start, seconds) per phrase on the wire
    phrases: list[tuple[str, float, float]] = field(default_factory=list)
    pending: int = 0  # phrases handed to the transport but not on the wire yet
    emitted: int = 0  # phrases handed to the transport
    started: float | None = None  # when the reply's first phrase went on the wire
    apology_at: int | None = None  # phrases from this index on are the apology, not the reply
    _all_sent: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._all_sent.set()

    def handed_over(self) -> None:
        """A phrase was queued for the transport."""
        self.pending += 1
        self.emitted += 1
        self._all_sent.clear()

    def sent(self, text: str, now: float, seconds: float) -> None:
        """The transport put a phrase on the wire."""
        end = self.end()
        self.pending -= 1
        if not self.pending:
            self._all_sent.set()
        self.phrases.append((text, now if end is None else max(end, now), seconds))

    def apology_started(self) -> bool:
        return self.apology_at is not None and len(self.phrases) >= self.apology_at

    def end(self) -> float | None:
        if not self.phrases:
            return None
        _, start, seconds = self.phrases[-1]
        return start + seconds

    def runs_dry(self, now: float, horizon_s: float) -> bool:
        """Is the audio on the wire about to run out (less than `horizon_s` left to play)?"""
        end = self.end()
        return end is not None and end - now < horizon_s

    def runs_out(self) -> float:
        """When the listener's audio runs out, for the scheduler's deadline: -inf before the first
        phrase is handed over (they hear silence now), inf while phrases are handed over but not
        yet on the wire (audio is coming)."""
        if not self.emitted:
            return -math.inf
        end = self.end()
        return math.inf if end is None else end

    def playing(self, now: float) -> bool:
        end = self.end()
        return end is not None and now < end

    def heard(self, now: float) -> str:
        """Text the user heard by `now`, assuming each phrase plays in real time."""
        words: list[str] = []
        for text, start, seconds in self.phrases[:self.apology_at]:
            parts = text.split()
            if now >= start + seconds:
                words += parts
            else:
                words += parts[: int(len(parts) * max(now - start, 0) / seconds)]
                break
        return " ".join(words)

    def heard_within(self, audio_s: float) -> str:
        """Text within the first `audio_s` seconds of the reply's audio (a client that says how
        far it played, as a Realtime truncate does)."""
        words: list[str] = []
        for text, _, seconds in self.phrases[:self.apology_at]:
            parts = text.split()
            if audio_s >= seconds:
                words += parts
                audio_s -= seconds
            else:
                words += parts[: int(len(parts) * max(audio_s, 0) / seconds)]
                break
        return " ".join(words)

    async def on_wire(self) -> None:
        """Until the transport has sent every phrase handed to it."""
        await self._all_sent.wait()

    async def played(self) -> None:
        """Until the transport has sent every phrase and the client has played them."""
        while True:
            await self._all_sent.wait()
            now = time.monotonic()
            if not self.playing(now):
                return
            end = self.end()
            assert end is not None  # playing
            await asyncio.sleep(end - now)  # then look again: a phrase sent meanwhile plays after
