"""What of a reply reached the wire, and when the client plays it.

The transport reports each phrase it puts on the wire (`Session.audio_sent`); the client plays a
phrase when it arrives or when the previous one ends, whichever is later. From that the ledger
knows what the user has heard by now (barge-in keeps only that in the history), whether the
audio is about to run dry (the reply's next work is urgent again), and when playback ends. It keeps the
phrases' audio too, so that what the microphone hears while the reply plays can be compared with it
(`echo_of`): on a speakerphone the reply comes back, and an echo canceller may let some of it through.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import numpy as np

ECHO_RATE = 16000  # the rate what the microphone hears is compared at (voice/conversation/turns.py's)
MAX_LAG_S = 1.0  # the longest a reply's echo takes to come back (the client's buffers, the room, the way back)
ECHO_BAND_HZ = (200.0, 4000.0)  # the voice's band, where an echo's phase follows the reply's
ECHO_SEGMENT = 512  # samples: the spectra `echo_of` averages over a second or so


@dataclass
class Playback:
    # (text, start, seconds) per phrase on the wire
    phrases: list[tuple[str, float, float]] = field(default_factory=list)
    pending: int = 0  # phrases handed to the transport but not on the wire yet
    emitted: int = 0  # phrases handed to the transport
    started: float | None = None  # when the reply's first phrase went on the wire
    apology_at: int | None = None  # phrases from this index on are the apology, not the reply
    audio: list[np.ndarray] = field(default_factory=list)  # per phrase on the wire: its audio at ECHO_RATE
    _all_sent: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._all_sent.set()

    def handed_over(self) -> None:
        """A phrase was queued for the transport."""
        self.pending += 1
        self.emitted += 1
        self._all_sent.clear()

    def sent(self, text: str, now: float, seconds: float, audio: np.ndarray | None = None) -> None:
        """The transport put a phrase on the wire; `audio`: its samples at ECHO_RATE (None: not known)."""
        end = self.end()
        self.pending -= 1
        if not self.pending:
            self._all_sent.set()
        self.phrases.append((text, now if end is None else max(end, now), seconds))
        self.audio.append(np.zeros(0, np.float32) if audio is None else audio)

    def audio_from(self, start: float, samples: int) -> np.ndarray:
        """The reply's audio as it plays from `start` (time.monotonic()), `samples` of it at ECHO_RATE: zeros
        where nothing plays (or a phrase's audio is not known)."""
        out = np.zeros(samples, np.float32)
        for (_, begin, _), audio in zip(self.phrases, self.audio):
            offset = round((begin - start) * ECHO_RATE)
            lo, hi = max(offset, 0), min(offset + len(audio), samples)
            if lo < hi:
                out[lo:hi] = audio[lo - offset:hi - offset]
        return out

    def echo_of(self, heard: np.ndarray, end: float) -> float:
        """How much of `heard` (ECHO_RATE audio whose last sample came at `end`, time.monotonic()) is the reply's
        echo: the share of its power in ECHO_BAND_HZ that the reply, as it played up to MAX_LAG_S earlier,
        explains linearly (per frequency, the magnitude-squared coherence of the two weighted by the heard power).
        The echo's delay is where their phase-transform cross-correlation (GCC-PHAT) peaks: phase alone, so an
        echo canceller's suppression does not hide it. An echo alone, whatever the room's colour, is mostly
        explained (a canceller adapting again: 0.5-0.9); the user talking over the reply is not, nor over its
        full echo 10 dB under them (under 0.12; bench/echo_residue.py)."""
        lag = round(MAX_LAG_S * ECHO_RATE)
        played = self.audio_from(end - (len(heard) + lag) / ECHO_RATE, len(heard) + lag)
        if len(heard) < ECHO_SEGMENT * 4 or not played.any() or not heard.any():
            return 0.0
        size = 1 << (len(heard) + len(played) - 1).bit_length()
        cross = np.fft.rfft(heard, size) * np.conj(np.fft.rfft(played, size))
        band = _band(size)
        correlation = np.fft.irfft(np.where(band, cross / (np.abs(cross) + 1e-20), 0), size)
        # heard[i] echoes played[i + lag - d] after a delay of d samples: the correlation at index d - lag
        delay = int(np.argmax(correlation[np.arange(-lag, 1) % size]))
        echo = played[lag - delay:lag - delay + len(heard)]
        starts = np.arange(0, len(heard) - ECHO_SEGMENT + 1, ECHO_SEGMENT // 2)
        window = np.hanning(ECHO_SEGMENT)
        segments = starts[:, None] + np.arange(ECHO_SEGMENT)
        band = _band(ECHO_SEGMENT)
        near = np.fft.rfft(heard[segments] * window, axis=1)[:, band]
        far = np.fft.rfft(echo[segments] * window, axis=1)[:, band]
        near_power, far_power = (np.abs(near) ** 2).mean(axis=0), (np.abs(far) ** 2).mean(axis=0)
        explained = np.abs((near * np.conj(far)).mean(axis=0)) ** 2 / (far_power + 1e-20)
        return float(explained.sum() / (near_power.sum() + 1e-20))

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


def _band(size: int) -> np.ndarray:
    """Which bins of a real FFT of `size` samples at ECHO_RATE are in ECHO_BAND_HZ."""
    freqs = np.fft.rfftfreq(size, 1 / ECHO_RATE)
    return (freqs >= ECHO_BAND_HZ[0]) & (freqs <= ECHO_BAND_HZ[1])
