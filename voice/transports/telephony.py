"""What the telephone transports (Twilio Media Streams, SIP/RTP) share.

* `CallSummary` / `calls`: one summary per call in memory (transcripts, replies, what was heard,
  latency reports, DTMF, counters), kept while the call is up and for a while after. Operators
  read it in the logs; tests read it directly. (The call records proper, on disk, are
  voice/conversation/calllog.py's: every session's, a call's too.)
* `PacedOutput`: a call's output on the conversation runner (voice/transports/common.py): reply
  audio as 20 ms frames of 8 kHz PCM, paced in real time, whatever is queued dropped on barge-in.
  The transport only says how one frame goes on the wire (a µ-law media message, an RTP packet).
* `count_drop`: bad input is dropped, counted per call and in /metrics.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry, Counter

from voice.events import Error, Event, LatencyReport, ReplyDone, Transcript, TtsAudio
from voice.conversation.session import Session
from voice.transports.common import DISCONNECTED

log = logging.getLogger("voice.telephony")
RATE = 8000  # G.711 narrowband
FRAME_MS = 20
FRAME_SAMPLES = RATE * FRAME_MS // 1000  # 160


MAX_DTMF = 1000  # keys remembered per call; more are dropped (`dtmf_overflow`)


@dataclass
class CallSummary:
    id: str  # Twilio streamSid / SIP Call-ID
    transport: str
    session_id: str = ""
    peer: str = ""
    codec: str = "PCMU"
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    answered: float | None = None  # monotonic: our 200 OK went out (SIP) / Twilio's `start` came (the call is up)
    first_audio: float | None = None  # monotonic: our first audio frame went out
    end_reason: str = ""
    transcripts: list[str] = field(default_factory=list)  # final transcripts of the caller
    replies: list[str] = field(default_factory=list)  # what the assistant said (ReplyDone.text)
    heard: list[str] = field(default_factory=list)  # phrases confirmed played (Twilio marks) or sent (RTP)
    latency: list[dict] = field(default_factory=list)  # LatencyReport.stages_ms per turn
    marks: list[dict] = field(default_factory=list)  # LatencyReport.marks_ms per turn (its timeline, `work` too)
    dtmf: list[str] = field(default_factory=list)
    counters: collections.Counter = field(default_factory=collections.Counter)
    meta: dict = field(default_factory=dict)  # transport extras (Twilio callSid, customParameters...)


class CallRegistry:
    """Calls in progress and the last `keep` finished ones."""

    def __init__(self, keep: int = 100):
        self.active: dict[str, CallSummary] = {}
        self.finished: collections.deque[CallSummary] = collections.deque(maxlen=keep)

    def open(self, record: CallSummary) -> CallSummary:
        self.active[record.id] = record
        return record

    def close(self, record: CallSummary, reason: str) -> None:
        if self.active.pop(record.id, None) is None:
            return
        record.ended, record.end_reason = time.monotonic(), reason
        self.finished.append(record)
        log.info("%s call=%s session=%s ended (%s) after %.1f s: turns=%d counters=%s", record.transport,
                 record.id, record.session_id, reason, record.ended - record.started, len(record.transcripts),
                 dict(record.counters))

    def find(self, transport: str | None = None) -> list[CallSummary]:
        """Active and finished calls, oldest first."""
        every = list(self.finished) + list(self.active.values())
        return [r for r in every if transport is None or r.transport == transport]


calls = CallRegistry()

_unattached_drops: collections.Counter = collections.Counter()  # drops outside any call (log rate limit)
_drop_counters: weakref.WeakKeyDictionary[CollectorRegistry, Counter] = weakref.WeakKeyDictionary()


def count_drop(registry: CollectorRegistry | None, record: CallSummary | None, transport: str, reason: str,
               detail: str = "") -> None:
    """Bad input that was dropped: counted per call, in /metrics, and logged (rate-limited per call)."""
    if registry is not None:
        counter = _drop_counters.get(registry)
        if counter is None:
            counter = _drop_counters[registry] = Counter(
                "voice_telephony_dropped", "Telephony input dropped as malformed or unexpected",
                ["transport", "reason"], registry=registry)
        counter.labels(transport, reason).inc()
    counters = record.counters if record is not None else _unattached_drops
    counters[f"dropped_{reason}"] += 1
    n = counters[f"dropped_{reason}"]
    if n <= 3 or n % 100 == 0:
        log.warning("%s call=%s dropped input (%s, #%d)%s", transport, record.id if record else "-", reason, n,
                    f": {detail}" if detail else "")


@dataclass
class _Frame:
    turn: int
    text: str
    pcm: np.ndarray  # FRAME_SAMPLES int16
    heard: Callable[[], None] | None  # on the phrase's first frame: the runner's report that it reached the wire
    last: bool


class PacedOutput:
    """A call's side of `AudioOutput` (voice/transports/common.py): reply audio played in real time,
    20 ms at a time, the other events kept in the call's record.

    `send_frame(frame, talkspurt_start)` puts one frame (160 int16 samples) on the wire.
    `phrase_end(turn, text)` runs after a phrase's last frame (Twilio sends a mark there).
    `cleared()` runs on barge-in after the queue was dropped (Twilio sends `clear`).
    `hang_up(code, reason)` closes the call when the server ends it (a websocket close, a BYE).
    `lead_s` lets the pacer run that far ahead of real time (a peer that buffers, like
    Twilio, then never underruns); RTP goes out exactly on time (lead 0).
    """

    def __init__(self, session: Session, record: CallSummary, send_frame: Callable[[np.ndarray, bool], object],
                 hang_up: Callable[[int, str], Awaitable[None]], phrase_end: Callable[[int, str], object] | None = None,
                 cleared: Callable[[], object] | None = None, lead_s: float = 0.0):
        self.session, self.record, self.send_frame, self.hang_up = session, record, send_frame, hang_up
        self.phrase_end, self.cleared, self.lead_s = phrase_end, cleared, lead_s
        self.frames: collections.deque[_Frame] = collections.deque()
        self.more = asyncio.Event()  # frames were queued
        self.clock: float | None = None  # monotonic time of frame 0 of the current talkspurt
        self.sent = 0  # frames sent in the current talkspurt
        self.frame_s = FRAME_MS / 1000
        self.stopping = False
        self.pacer = asyncio.create_task(self._pace())

    async def play(self, audio: TtsAudio, heard: Callable[[], None]) -> None:
        """Queue the phrase's frames for the pacer (which reports it heard when its first frame goes)."""
        if not self.session.is_current(audio.turn):
            return
        pcm = np.frombuffer(audio.pcm, dtype="<i2")
        if audio.rate != RATE:  # sessions are opened at 8 kHz; this only guards against misuse
            from voice.audio import float_to_int16, resample
            pcm = float_to_int16(resample(pcm / 32768.0, audio.rate, RATE))
        n = -(-len(pcm) // FRAME_SAMPLES)
        padded = np.zeros(n * FRAME_SAMPLES, np.int16)
        padded[:len(pcm)] = pcm
        for i in range(n):
            self.frames.append(_Frame(audio.turn, audio.text, padded[i * FRAME_SAMPLES:(i + 1) * FRAME_SAMPLES],
                                      heard if i == 0 else None, i == n - 1))
        self.more.set()
        self.record.counters["phrases_out"] += 1

    async def clear(self) -> None:
        s, r = self.session, self.record
        dropped = len(self.frames)
        self.frames.clear()
        r.counters["clears"] += 1
        log.info("%s call=%s session=%s barge-in: dropped %d queued frames", r.transport, r.id, s.id, dropped)
        if self.cleared is not None:
            await _maybe_await(self.cleared())

    async def send(self, ev: Event) -> None:
        """A call has no wire form for the other events: the call's record keeps what they say."""
        s, r = self.session, self.record
        if isinstance(ev, Transcript):
            if ev.final:
                r.transcripts.append(ev.text)
                log.info("%s call=%s session=%s turn=%d caller said: %r", r.transport, r.id, s.id, ev.turn, ev.text)
        elif isinstance(ev, ReplyDone):
            r.replies.append(ev.text)
            log.info("%s call=%s session=%s turn=%d reply%s: %r", r.transport, r.id, s.id, ev.turn,
                     " (interrupted)" if ev.interrupted else "", ev.heard if ev.interrupted else ev.text)
        elif isinstance(ev, LatencyReport):
            r.latency.append(dict(ev.stages_ms))
            r.marks.append(dict(ev.marks_ms))
        elif isinstance(ev, Error):
            r.counters[f"error_{ev.code}"] += 1

    async def close(self, code: int, reason: str) -> None:
        """The frame being sent finishes, the rest of the reply is not played out; then hang up."""
        self.frames.clear()
        self.stopping = True
        self.more.set()
        await asyncio.wait({self.pacer}, timeout=1.0)
        await self.hang_up(code, reason)

    async def _pace(self) -> None:
        try:
            await self._pace_frames()
        except DISCONNECTED as err:  # the socket went away mid-send
            log.info("%s call=%s sender stopped: %s", self.record.transport, self.record.id, err)
        except Exception:
            log.exception("%s call=%s sender failed", self.record.transport, self.record.id)

    async def _pace_frames(self) -> None:
        idle, marker = True, False  # idle: the queue ran dry since the last frame
        while not self.stopping:
            if not self.frames:
                idle = True
                self.more.clear()
                await self.more.wait()
                continue
            now = time.monotonic()
            if idle:
                idle = False
                if self.clock is None or now > self.clock + self.sent * self.frame_s:
                    self.clock, self.sent, marker = now, 0, True  # a gap in the audio: a new talkspurt
            else:
                assert self.clock is not None  # set when this talkspurt began
                if now > self.clock + self.sent * self.frame_s + 0.1:
                    self.clock = now - self.sent * self.frame_s  # fell behind (busy CPU): resync, don't burst
            due = self.clock + self.sent * self.frame_s - self.lead_s
            if due > now:
                await asyncio.sleep(due - now)
                continue  # look at the queue again (a barge-in may have dropped it) before sending
            frame = self.frames.popleft()
            if not self.session.is_current(frame.turn):
                continue
            await _maybe_await(self.send_frame(frame.pcm, marker))
            if self.record.first_audio is None:
                self.record.first_audio = time.monotonic()
                if self.record.answered is not None:
                    log.info("%s call=%s first audio %.0f ms after the answer", self.record.transport,
                             self.record.id, (self.record.first_audio - self.record.answered) * 1000)
            marker = False
            self.sent += 1
            self.record.counters["frames_out"] += 1
            if float(np.sqrt(np.mean(np.square(frame.pcm, dtype=np.float64)))) > 32768 * 0.01:  # > -40 dBFS
                self.record.counters["frames_out_voiced"] += 1
            if frame.heard is not None:
                frame.heard()
            if frame.last and self.phrase_end is not None:
                await _maybe_await(self.phrase_end(frame.turn, frame.text))


async def _maybe_await(value: object) -> None:
    if asyncio.iscoroutine(value):
        await value
