"""RTP (RFC 3550) packets, a small reordering jitter buffer, and RFC 4733 telephone-events."""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

import numpy as np

from voice.audio import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode

HEADER = struct.Struct("!BBHII")
# static payload types (RFC 3551) of the codecs we speak
STATIC_PT = {"PCMU": 0, "PCMA": 8}
DECODE = {"PCMU": ulaw_decode, "PCMA": alaw_decode}
ENCODE = {"PCMU": ulaw_encode, "PCMA": alaw_encode}
DTMF_EVENTS = "0123456789*#ABCD"
# Largest RTP datagram accepted. G.711 at 20 ms is 172 bytes (12 of header + 160); 2,048 leaves room
# for 120 ms packets (972), CSRCs and header extensions. Bigger ones are dropped (`rtp_too_large`).
MAX_PACKET = 2048


class RtpError(ValueError):
    pass


@dataclass
class RtpPacket:
    payload_type: int
    seq: int
    timestamp: int
    ssrc: int
    payload: bytes
    marker: bool = False

    @classmethod
    def parse(cls, data: bytes) -> "RtpPacket":
        if len(data) < HEADER.size:
            raise RtpError("shorter than an RTP header")
        b0, b1, seq, ts, ssrc = HEADER.unpack_from(data)
        if b0 >> 6 != 2:
            raise RtpError(f"RTP version {b0 >> 6}")
        offset = HEADER.size + 4 * (b0 & 0x0F)  # CSRC list
        if b0 & 0x10:  # header extension: 16-bit profile, 16-bit length in words
            if len(data) < offset + 4:
                raise RtpError("truncated header extension")
            offset += 4 + 4 * struct.unpack_from("!H", data, offset + 2)[0]
        end = len(data)
        if b0 & 0x20:  # padding: the last byte says how much
            if end <= offset or data[-1] == 0 or data[-1] > end - offset:
                raise RtpError("bad padding")
            end -= data[-1]
        if offset > end:
            raise RtpError("truncated packet")
        return cls(b1 & 0x7F, seq, ts, ssrc, bytes(data[offset:end]), bool(b1 & 0x80))

    def build(self) -> bytes:
        return HEADER.pack(0x80, (0x80 if self.marker else 0) | self.payload_type, self.seq & 0xFFFF,
                           self.timestamp & 0xFFFFFFFF, self.ssrc) + self.payload


class RtpSender:
    """Sequence numbers, timestamps and SSRC of our outgoing stream (random starts, RFC 3550 5.1)."""

    def __init__(self, payload_type: int, rate: int = 8000, rng: random.Random | None = None):
        rng = rng or random.SystemRandom()
        self.payload_type, self.rate = payload_type, rate
        self.ssrc = rng.getrandbits(32)
        self.seq = rng.getrandbits(16)
        self.ts0 = rng.getrandbits(32)
        self.clock0: float | None = None  # monotonic time of timestamp ts0
        self.next_ts = self.ts0  # the next packet's

    def packet(self, payload: bytes, samples: int, marker: bool, now: float) -> bytes:
        if self.clock0 is None:
            self.clock0, self.next_ts = now, self.ts0
        elif marker:  # after a silent gap the timestamp follows the wall clock (the sampling instant)
            self.next_ts = max(self.next_ts, self.ts0 + round((now - self.clock0) * self.rate))
        pkt = RtpPacket(self.payload_type, self.seq, self.next_ts, self.ssrc, payload, marker).build()
        self.seq = (self.seq + 1) & 0xFFFF
        self.next_ts += samples
        return pkt


def seq_delta(a: int, b: int) -> int:
    """a - b in 16-bit sequence space, in [-32768, 32767]."""
    return ((a - b + 0x8000) & 0xFFFF) - 0x8000


class JitterBuffer:
    """Reorder by sequence number; drop duplicates and packets that come after their turn.

    Up to `depth` packets wait for a missing one; then it is declared lost and skipped (the
    caller gets a `None` in its place, to fill with silence).
    """

    def __init__(self, depth: int = 3, max_gap: int = 50):
        self.depth, self.max_gap = depth, max_gap
        self.next: int | None = None
        self.held: dict[int, bytes] = {}
        self.late = self.duplicate = self.lost = 0

    def reset(self) -> None:
        self.next, self.held = None, {}

    def push(self, seq: int, payload: bytes) -> list[bytes | None]:
        if self.next is None:
            self.next = seq
        d = seq_delta(seq, self.next)
        if d < 0:
            self.late += 1
            return []
        if seq in self.held:
            self.duplicate += 1
            return []
        if d > self.max_gap + self.depth:  # a jump (peer restarted its sequence): start over from here
            self.lost += len(self.held)
            self.held, self.next = {}, seq
        self.held[seq] = payload
        out: list[bytes | None] = []
        while self.held:
            if self.next in self.held:
                out.append(self.held.pop(self.next))
                self.next = (self.next + 1) & 0xFFFF
            elif len(self.held) > self.depth:
                gap = min(seq_delta(s, self.next) for s in self.held)
                self.lost += gap
                out += [None] * min(gap, self.max_gap)
                self.next = (self.next + gap) & 0xFFFF
            else:
                break
        return out


@dataclass
class TelephoneEvent:
    event: int
    end: bool
    volume: int
    duration: int

    @property
    def digit(self) -> str:
        return DTMF_EVENTS[self.event] if self.event < len(DTMF_EVENTS) else f"event-{self.event}"

    @classmethod
    def parse(cls, payload: bytes) -> "TelephoneEvent":
        """RFC 4733 section 2.3: event, E|R|volume, duration."""
        if len(payload) < 4:
            raise RtpError("telephone-event payload shorter than 4 bytes")
        event, flags, duration = struct.unpack_from("!BBH", payload)
        return cls(event, bool(flags & 0x80), flags & 0x3F, duration)


class DtmfReceiver:
    """One digit per event: RFC 4733 repeats packets (same timestamp) for the same key press."""

    def __init__(self) -> None:
        self.last_ts: int | None = None

    def push(self, timestamp: int, payload: bytes) -> str | None:
        ev = TelephoneEvent.parse(payload)
        if timestamp == self.last_ts:
            return None
        self.last_ts = timestamp
        return ev.digit


def decode(codec: str, payload: bytes) -> np.ndarray:
    return DECODE[codec](payload)


def encode(codec: str, pcm: np.ndarray) -> bytes:
    return ENCODE[codec](pcm)
