"""`voice room-eval`: is the user heard in a room that is never quiet?

The repo's recordings (tests/speech) are streamed in real time over /ws to a running `voice serve`, as
`voice bench` does, but inside a room: 1.5 s of the room first, the sentence over it, then the room going
on (never digital silence) until the reply is done or `timeout_s`. Rooms (`Room`): quiet; steady pink
noise; background talk (`babble`: several voices made of the other recordings, never the user's own clip,
each at a speed of its own so they sound like different people); `echo`: a quiet room where the reply's
own audio comes back into the microphone 50 ms after it plays, as on a speakerphone. A room's level is
given in dB below the speaker's, every clip played at SPEAKER_DB (active levels: the mean power of the
20 ms frames within 30 dB of the loudest). Each room is also streamed alone (`alone_s`, in a session of
its own, before anyone spoke).

Per room: turns answered, WER of the final transcripts, voice-to-voice (first reply audio - end of the
sentence), turns the room started (speech_started beyond the user's one), replies the room cut (a
`clear` after the user had finished), and for the room alone: turns started, replies spoken.
BENCHMARKS.md, "Heard in a room".
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jiwer
import numpy as np
import websockets

from voice.audio import float_to_pcm16, pcm16_to_float, read_wav, resample
from voice.clients.bench import normalise, pct, read_references, speech_end_s
from voice.config import VadConfig
from voice.events import Clear, Ready, ReplyDone, SpeechStarted, Transcript, from_wire
from voice.pipeline.vad import Endpointer, VoiceEnd, VoiceStart

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

RATE = 16000
FRAME_MS = 20
FRAME = RATE * FRAME_MS // 1000
SPEECH = Path(__file__).resolve().parents[2] / "tests" / "speech"
LEAD_S = 1.5  # the room before the user speaks
ECHO_DELAY_S = 0.05  # the reply comes back into the microphone this long after it plays
HEARD_S = 5.0  # a clip is over once its reply is done, or has been heard this long
ACTIVE_RANGE_DB = 30.0  # frames within this of the loudest count towards a signal's active level
SPEAKER_DB = -26.0  # every clip is played at this active level (one user, one microphone), the room under it
BABBLE_VOICES = 4
ROOMS = ("quiet", "pink:20", "pink:10", "babble:25", "babble:20", "babble:15", "babble:10", "echo:10")


@dataclass(frozen=True)
class Room:
    """`kind` (quiet | pink | babble | echo) at `below_db` under the speaker (echo: the reply's level)."""

    kind: str
    below_db: float = 0.0

    @property
    def name(self) -> str:
        return self.kind if self.kind == "quiet" else f"{self.kind}:{self.below_db:g}"

    @staticmethod
    def parse(text: str) -> Room:
        kind, _, below = text.partition(":")
        if kind not in ("quiet", "pink", "babble", "echo") or (kind != "quiet") != bool(below):
            raise ValueError(f"a room is quiet, pink:DB, babble:DB or echo:DB (dB below the speaker), not {text!r}")
        return Room(kind, float(below or 0))


def frame_levels_db(audio: np.ndarray) -> np.ndarray:
    """Each 20 ms frame's power in dB (full scale 0)."""
    frames = audio[: len(audio) // FRAME * FRAME].reshape(-1, FRAME).astype(np.float64)
    return 10 * np.log10(np.maximum((frames ** 2).mean(axis=1), 1e-12))


def active_level_db(audio: np.ndarray) -> float:
    """The mean power of the frames within ACTIVE_RANGE_DB of the loudest, in dB (a rough active speech level)."""
    levels = frame_levels_db(audio)
    if not len(levels):
        return -120.0
    active = levels[levels > levels.max() - ACTIVE_RANGE_DB]
    return float(10 * np.log10(np.mean(10 ** (active / 10))))


def at_level(audio: np.ndarray, level_db: float) -> np.ndarray:
    return (audio * 10 ** ((level_db - active_level_db(audio)) / 20)).astype(np.float32)


def pink_noise(n: int, rng: np.random.Generator) -> np.ndarray:
    """Steady noise with 1/f power (a fan, traffic, a room's hum), by shaping white noise's spectrum."""
    spectrum = np.fft.rfft(rng.standard_normal(n))
    f = np.fft.rfftfreq(n, 1 / RATE)
    spectrum[f >= 20] /= np.sqrt(f[f >= 20])
    spectrum[f < 20] = 0  # what a room's air and a microphone carry
    return np.fft.irfft(spectrum, n).astype(np.float32)


def recordings(exclude: str = "") -> list[np.ndarray]:
    """The repo's recordings at 16 kHz, each at the same active level, without `exclude` (the user's clip)."""
    clips = []
    for path in sorted(SPEECH.glob("*.wav")):
        if path.name != exclude:
            audio, rate = read_wav(path)
            clips.append(at_level(resample(audio, rate, RATE), SPEAKER_DB))
    return clips


def babble(n: int, rng: np.random.Generator, exclude: str = "", voices: int = BABBLE_VOICES) -> np.ndarray:
    """Background talk: `voices` people at once, each the other recordings back to back (short gaps) at
    a speed of their own (0.8-1.25x: another pitch and pace), starting at random points."""
    clips, out = recordings(exclude), np.zeros(n, dtype=np.float32)
    for _ in range(voices):
        speed = rng.uniform(0.8, 1.25)
        stream: list[np.ndarray] = []
        while sum(len(a) for a in stream) < n + 10 * RATE:
            clip = clips[rng.integers(len(clips))]
            stream += [resample(clip, round(RATE * speed), RATE), np.zeros(int(rng.uniform(0.05, 0.4) * RATE),
                                                                           dtype=np.float32)]
        talk = np.concatenate(stream)
        start = int(rng.integers(0, 10 * RATE))
        out += talk[start:start + n] * 10 ** (rng.uniform(-3, 3) / 20)
    return out


def room_audio(room: Room, n: int, rng: np.random.Generator, level_db: float, exclude: str = "") -> np.ndarray:
    """`n` samples of `room` (its noise; echo's and quiet's are silence) at active level `level_db`."""
    if room.kind == "pink":
        return at_level(pink_noise(n, rng), level_db)
    if room.kind == "babble":
        return at_level(babble(n, rng, exclude), level_db)
    return np.zeros(n, dtype=np.float32)


class Echo:
    """The reply's audio as it plays and comes back into the microphone, ECHO_DELAY_S later, with its
    active level `below_db` under the speaker's. Positions count samples sent since the session began."""

    def __init__(self, below_db: float | None, speaker_db: float):
        self.below_db, self.speaker_db = below_db, speaker_db
        self.line = np.zeros(0, dtype=np.float32)  # what plays, from sample `self.offset` on
        self.plays_until = 0  # where the audio received so far ends playing

    def received(self, audio: np.ndarray, now: int) -> None:
        """Reply audio arrived when `now` samples had been sent: it plays after what came before."""
        start = max(now, self.plays_until)
        self.plays_until = start + len(audio)
        if len(self.line) < self.plays_until:
            self.line = np.concatenate([self.line, np.zeros(self.plays_until - len(self.line), dtype=np.float32)])
        self.line[start:self.plays_until] = audio

    def cleared(self, now: int) -> None:
        """A barge-in: what has not played yet is dropped."""
        self.line[now:] = 0
        self.plays_until = min(self.plays_until, now)

    def playing(self, now: int) -> bool:
        return now < self.plays_until

    def picked_up(self, now: int, n: int) -> np.ndarray:
        """What the microphone picks up of it over samples [now, now + n)."""
        if self.below_db is None:
            return np.zeros(n, dtype=np.float32)
        start = now - int(ECHO_DELAY_S * RATE)
        heard = np.zeros(n, dtype=np.float32)
        lo, hi = max(start, 0), min(start + n, len(self.line))
        if hi > lo:
            heard[lo - start:hi - start] = self.line[lo:hi]
        played = self.line[:max(hi, 0)]
        if not heard.any() or not len(played):
            return heard
        gain_db = self.speaker_db - self.below_db - active_level_db(played[-10 * RATE:])
        return heard * 10 ** (gain_db / 20)


@dataclass
class RoomTurn:
    room: str
    file: str
    reference: str
    transcript: str = ""  # the final transcript of the user's last turn in the clip (a resumed turn holds all)
    started: int = 0  # speech_started while the clip was on
    v2v_ms: float | None = None
    cut: int = 0  # replies to this clip cleared after the user had finished (the room talked over them)
    reply: str = ""
    error: str = ""
    trace: list[str] = field(default_factory=list)  # "seconds after the clip began: event turn", audio as "audio"


@dataclass
class Alone:
    room: str
    seconds: float
    started: int = 0  # speech_started
    heard: list[str] = field(default_factory=list)  # non-empty final transcripts
    replies: int = 0  # replies whose audio arrived


class Stream:
    """One session's microphone: the room (and the echo) always, the user's clip over it when given;
    the server's events and reply audio read beside it."""

    def __init__(self, ws: ClientConnection, echo: Echo):
        self.ws, self.echo = ws, echo
        self.sent = 0  # samples sent
        self.events: list[tuple[int, object]] = []  # (samples sent when it arrived, event)
        self.audio_at: list[int] = []  # samples sent when each reply audio chunk arrived
        self.wall: list[float] = []  # perf_counter when each reply audio chunk arrived
        self.news = asyncio.Event()

    async def receive(self) -> None:
        async for msg in self.ws:
            if isinstance(msg, bytes):
                self.audio_at.append(self.sent)
                self.wall.append(time.perf_counter())
                self.echo.received(pcm16_to_float(msg), self.sent)
            else:
                ev = from_wire(json.loads(msg))
                self.events.append((self.sent, ev))
                if isinstance(ev, Clear):
                    self.echo.cleared(self.sent)
            self.news.set()

    async def play(self, signal: np.ndarray, until: Callable[[], bool]) -> None:
        """Send `signal` (the room, and the user in it) frame by frame in real time, with the echo,
        until `until()` or its end."""
        start, i = time.perf_counter(), 0
        while i < len(signal) and not until():
            chunk = np.zeros(FRAME, dtype=np.float32)
            chunk[:len(signal[i:i + FRAME])] = signal[i:i + FRAME]
            await self.ws.send(float_to_pcm16(chunk + self.echo.picked_up(self.sent, FRAME)))
            self.sent += FRAME
            i += FRAME
            await asyncio.sleep(max(0.0, start + i / RATE - time.perf_counter()))


async def _session(url: str) -> ClientConnection:
    for _ in range(100):  # the last room's session may still be closing (a service at capacity answers 503)
        try:
            ws = await websockets.connect(url, max_size=None)
            break
        except websockets.InvalidStatus:
            await asyncio.sleep(0.2)
    else:
        raise RuntimeError(f"{url} refused the session for 20 s")
    await ws.send(json.dumps({"type": "start", "version": 1, "sample_rate": RATE, "encoding": "pcm_s16le"}))
    ready = from_wire(json.loads(await ws.recv()))
    if not isinstance(ready, Ready):
        raise RuntimeError(f"server refused the session: {ready}")
    return ws


async def run_room(url: str, room: Room, files: list[Path], refs: dict[str, str], seed: int = 0,
                   timeout_s: float = 20.0, log: Callable[[str], object] = print) -> list[RoomTurn]:
    """Each clip in the room, one session, one after the other."""
    rng = np.random.default_rng(seed)
    ws = await _session(url)
    stream = Stream(ws, Echo(room.below_db if room.kind == "echo" else None, SPEAKER_DB))
    receiver = asyncio.create_task(stream.receive())
    turns = []
    try:
        for path in files:
            audio, rate = read_wav(path)
            user = at_level(resample(audio, rate, RATE), SPEAKER_DB)
            signal = room_audio(room, int((LEAD_S + timeout_s) * RATE) + len(user), rng, SPEAKER_DB - room.below_db,
                                exclude=path.name)
            signal[int(LEAD_S * RATE):int(LEAD_S * RATE) + len(user)] += user
            turn = await _clip(stream, signal, int(LEAD_S * RATE + speech_end_s(user, RATE) * RATE),
                               RoomTurn(room.name, path.name, refs.get(path.name, "")))
            log(f"{room.name:10s} {turn.file:14s} v2v {turn.v2v_ms or float('nan'):6.0f} ms  started {turn.started}"
                f"  cut {turn.cut}  heard {turn.transcript!r}  {turn.error}")
            turns.append(turn)
    finally:
        receiver.cancel()
        await ws.close()
    return turns


async def _clip(stream: Stream, signal: np.ndarray, speech_end: int, turn: RoomTurn) -> RoomTurn:
    """Play `signal` (the room with the user's clip in it, whose voice ends at sample `speech_end`) until
    the reply to it is done and heard, or the signal ends; what happened, in `turn`."""
    first_event, first_audio, begin = len(stream.events), len(stream.audio_at), stream.sent
    end_at, end_wall = begin + speech_end, time.perf_counter() + speech_end / RATE

    def done() -> bool:
        """The reply is done and heard, or has been heard for HEARD_S (on a loaded machine a whole reply
        takes long, and the room's effect on it shows by then)."""
        if stream.sent < end_at:
            return False
        events = stream.events[first_event:]
        users = min((ev.turn for _, ev in events if isinstance(ev, SpeechStarted)), default=None)
        replied = users is not None and any(isinstance(ev, ReplyDone) and ev.text and not ev.interrupted
                                            and ev.turn >= users for _, ev in events)
        heard = [at for at in stream.audio_at[first_audio:] if at >= end_at - RATE]
        return (replied and not stream.echo.playing(stream.sent - RATE // 2)
                or bool(heard) and stream.sent - heard[0] >= HEARD_S * RATE)
    await stream.play(signal, done)
    if not done():
        turn.error = "timed out waiting for the reply"
    events = stream.events[first_event:]
    moments = [(at, f"{getattr(ev, 'type', '?')} {getattr(ev, 'turn', '')}") for at, ev in events]
    moments += [(at, "audio") for at in stream.audio_at[first_audio:]]
    turn.trace = [f"{(at - begin) / RATE:.2f} {what}" for at, what in sorted(moments, key=lambda m: m[0])]
    users = min((ev.turn for _, ev in events if isinstance(ev, SpeechStarted)), default=None)
    # the final of the user's last turn: one resumed holds the words of those before it
    last = max((ev.turn for at, ev in events if isinstance(ev, SpeechStarted) and at <= end_at), default=users)
    for at, ev in events:
        if isinstance(ev, SpeechStarted):
            turn.started += 1
        elif isinstance(ev, Transcript) and ev.final and ev.text and ev.turn == last:
            turn.transcript = ev.text
        elif isinstance(ev, Clear) and at >= end_at and users is not None and ev.turn >= users:
            turn.cut += 1  # (a reply to an earlier clip, still under way on a loaded machine, is the user's to cut)
        elif isinstance(ev, ReplyDone) and ev.text:
            turn.reply = ev.text
    # the reply to the user's last turn (which may end before `end_at`: a room can hide a quiet last syllable)
    last_start = max((at for at, ev in events if isinstance(ev, SpeechStarted) and at <= end_at), default=end_at)
    answered = [wall for at, wall in zip(stream.audio_at[first_audio:], stream.wall[first_audio:], strict=True)
                if at > last_start]
    turn.v2v_ms = (answered[0] - end_wall) * 1000 if answered else None
    return turn


async def run_alone(url: str, room: Room, seconds: float, seed: int = 0) -> Alone:
    """The room by itself for `seconds`, in a session nobody has spoken in."""
    rng = np.random.default_rng(seed + 1)
    signal = room_audio(room, int(seconds * RATE), rng, SPEAKER_DB - room.below_db)
    ws = await _session(url)
    stream = Stream(ws, Echo(None, SPEAKER_DB))
    receiver = asyncio.create_task(stream.receive())
    try:
        await stream.play(signal, lambda: False)
        await asyncio.sleep(1.0)  # a turn the room's last words started gets its final
    finally:
        receiver.cancel()
        await ws.close()
    alone = Alone(room.name, seconds)
    alone.started = sum(isinstance(ev, SpeechStarted) for _, ev in stream.events)
    alone.heard = [ev.text for _, ev in stream.events if isinstance(ev, Transcript) and ev.final and ev.text]
    alone.replies = len({ev.turn for _, ev in stream.events if isinstance(ev, ReplyDone) and ev.text})
    return alone


def summarise(room: str, turns: list[RoomTurn], alone: Alone | None) -> dict:
    v2v = [t.v2v_ms for t in turns if t.v2v_ms is not None]
    refs = [normalise(t.reference) for t in turns if t.reference]
    hyps = [normalise(t.transcript) for t in turns if t.reference]
    return {
        "room": room, "turns": len(turns), "answered": len(v2v),
        "wer": jiwer.wer(refs, hyps) if refs else None,
        "v2v_ms_p50": pct(v2v, 50), "v2v_ms_p95": pct(v2v, 95),
        "room_started": sum(max(t.started - 1, 0) for t in turns),  # speech_started beyond the user's own
        "cut": sum(t.cut for t in turns),
        "alone_s": alone.seconds if alone else None,
        "alone_started": alone.started if alone else None,
        "alone_replies": alone.replies if alone else None,
    }


def table(report: dict) -> str:
    def f(v: float | None, spec: str = ".0f") -> str:
        return "-" if v is None else format(v, spec)
    def echo(r: Endpoints) -> str:
        return "" if r.echo_starts is None else f"{r.echo_starts:>11d} {r.echo_talking:>7d}  {r.barge_in_ms}"
    lines = [f"{'room':10s} {'answered':>8s} {'WER':>6s} {'v2v p50':>8s} {'p95':>6s} {'room started':>12s} "
             f"{'cut':>4s}   alone: {'started':>7s} {'replies':>7s}"]
    for s in report["rooms"]:
        lines.append(f"{s['room']:10s} {s['answered']:>3d}/{s['turns']:<4d} {f(s['wer'], '.3f'):>6s} "
                     f"{f(s['v2v_ms_p50']):>8s} {f(s['v2v_ms_p95']):>6s} {s['room_started']:>12d} {s['cut']:>4d}"
                     f"   {'':6s} {f(s['alone_started']):>7s} {f(s['alone_replies']):>7s}")
    return "\n".join(lines)


def run(url: str, rooms: list[Room], files: list[Path], alone_s: float = 60.0, json_out: Path | None = None,
        seed: int = 0, timeout_s: float = 20.0, log: Callable[[str], object] = print) -> dict:
    """Every room: its clips, then the room alone (not for quiet and echo, whose room is silence)."""
    refs = read_references(files[0].parent) if files else {}
    summaries, per_turn, per_alone = [], [], []
    for room in rooms:
        turns = asyncio.run(run_room(url, room, files, refs, seed, timeout_s, log))
        alone = None
        if alone_s and room.kind in ("pink", "babble"):
            alone = asyncio.run(run_alone(url, room, alone_s, seed))
            log(f"{room.name:10s} alone {alone_s:g} s: {alone.started} turns started, {alone.replies} replies, "
                f"heard {alone.heard}")
            per_alone.append(asdict(alone))
        summaries.append(summarise(room.name, turns, alone))
        per_turn += [asdict(t) for t in turns]
    report = {"rooms": summaries, "per_turn": per_turn, "alone": per_alone}
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1))
    return report


@dataclass
class Endpoints:
    """The endpointer alone on a room's mixes (`offline`): no service, no load, the same every run."""

    room: str
    ends_ms: list[float | None] = field(default_factory=list)  # per clip: speech end -> VoiceEnd (None: none)
    starts: list[int] = field(default_factory=list)  # per clip: VoiceStarts
    alone_starts: int | None = None  # in the room alone
    echo_starts: int | None = None  # echo: starts while the reply played
    echo_talking: int | None = None  # echo: replies under which Talking's voiced audio (turn.barge_in_ms) was reached
    barge_in_ms: list[float] = field(default_factory=list)  # echo: the user over the reply, their start -> VoiceStart


def offline(rooms: list[Room], files: list[Path], vad: VadConfig, alone_s: float = 60.0, seed: int = 0,
            barge_in_ms: int = 600) -> list[Endpoints]:
    """Each room's mixes through voice.pipeline.vad.Endpointer as a session hears them (one stream per room, 1.5 s
    of room, the clip, 3 s of room); echo rooms: after each clip, the other clips back to back as the reply,
    `below_db` under the speaker and 50 ms late, with `playing` set while it plays, and the user talking
    over its second half."""
    out = []
    for room in rooms:
        rng, result = np.random.default_rng(seed), Endpoints(room.name)
        endpointer = Endpointer(vad, RATE)
        lead = int(LEAD_S * RATE)
        for path in files:
            audio, rate = read_wav(path)
            user = at_level(resample(audio, rate, RATE), SPEAKER_DB)
            mix = room_audio(room, lead + len(user) + 3 * RATE, rng, SPEAKER_DB - room.below_db, exclude=path.name)
            mix[lead:lead + len(user)] += user
            begin = endpointer.seconds_heard
            events = endpointer.push(float_to_pcm16(mix))
            end = LEAD_S + speech_end_s(user, RATE)
            ends = [ev.t_audio_s - begin - end for ev in events if isinstance(ev, VoiceEnd)]
            result.starts.append(sum(isinstance(ev, VoiceStart) for ev in events))
            result.ends_ms.append(round(ends[-1] * 1000) if ends and ends[-1] > -0.3 else None)
            endpointer.force_stop(suppress=False)
            if room.kind == "echo":
                _echo(endpointer, user, path.name, room.below_db, result, barge_in_ms)
        if alone_s and room.kind in ("pink", "babble"):
            alone = room_audio(room, int(alone_s * RATE), np.random.default_rng(seed + 1), SPEAKER_DB - room.below_db)
            result.alone_starts = sum(isinstance(ev, VoiceStart)
                                      for ev in Endpointer(vad, RATE).push(float_to_pcm16(alone)))
        out.append(result)
    return out


def _echo(endpointer: Endpointer, user: np.ndarray, clip: str, below_db: float, result: Endpoints,
          barge_in_ms: int) -> None:
    """A reply (the other clips) plays after `user`'s turn, its echo `below_db` under the speaker; the
    user talks over its second half."""
    reply = at_level(np.concatenate(recordings(exclude=clip)[:3]), SPEAKER_DB - below_db)
    delay, tail = int(ECHO_DELAY_S * RATE), int(0.3 * RATE)
    heard = np.zeros(delay + len(reply) + tail + len(user) + RATE, dtype=np.float32)
    heard[delay:delay + len(reply)] = reply
    over = len(reply) // 2
    heard[over:over + len(user)] += user
    result.echo_starts, result.echo_talking = result.echo_starts or 0, result.echo_talking or 0
    talked, started = False, None
    for i in range(0, len(heard) - FRAME + 1, FRAME):
        events = endpointer.push(float_to_pcm16(heard[i:i + FRAME]), playing=i < delay + len(reply) + tail)
        if i < over:
            result.echo_starts += sum(isinstance(ev, VoiceStart) for ev in events)
            talked = talked or endpointer.voiced_ms >= barge_in_ms
        elif started is None and any(isinstance(ev, VoiceStart) for ev in events):
            started = (i + FRAME - over) / RATE * 1000
    result.echo_talking += talked
    if started is not None:
        result.barge_in_ms.append(round(started))
    endpointer.force_stop(suppress=False)


def vad_options(vad: VadConfig, pairs: list[str]) -> VadConfig:
    """`vad` with KEY=VALUE options over it (true/false, numbers), as --vad gives them."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        if not hasattr(vad, key):
            raise ValueError(f"[vad] has no option {key!r}")
        kind = type(getattr(vad, key))
        options[key] = text.lower() == "true" if kind is bool else kind(text)
    return replace(vad, **options)


def offline_table(results: list[Endpoints]) -> str:
    def echo(r: Endpoints) -> str:
        return "" if r.echo_starts is None else f"{r.echo_starts:>11d} {r.echo_talking:>7d}  {r.barge_in_ms}"
    lines = [f"{'room':10s} {'ends p50':>8s} {'max':>5s} {'no end':>6s} {'starts':>6s} {'alone':>5s}   echo: starts "
             "talking  barge-in ms"]
    for r in results:
        ends = [e for e in r.ends_ms if e is not None]
        p50 = pct(ends, 50)
        lines.append(f"{r.room:10s} {float('nan') if p50 is None else p50:8.0f} {max(ends, default=float('nan')):5.0f} "
                     f"{r.ends_ms.count(None):>3d}/{len(r.ends_ms):<2d} {sum(r.starts) - len(r.starts):+6d} "
                     f"{'-' if r.alone_starts is None else r.alone_starts:>5}   "
                     f"{echo(r)}")
    return "\n".join(lines)
