"""`voice soak`: hold N sessions replaying speech for M minutes and watch the server for leaks.

Each session streams the WAVs of a folder in real time, one utterance per turn (then silence
until the turn's `reply_done`, then a short pause), over and over, like a patient user. A
sampler reads the server process's resident memory and open file descriptors from /proc (the
server must run on this machine: `--pid`, or the pid /healthz gives loopback clients) and the
turns' voice-to-voice latency, per interval. The report says how many sessions stayed up,
turns done and lost (no `reply_done` within the turn timeout, or the connection dropped
mid-turn), errors by code, RSS and fd growth, and p95 latency per interval.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from voice.audio import float_to_pcm16, read_wav, resample
from voice.events import Error, Event, LatencyReport, Ready, Transcript, from_wire

MAX_SESSIONS = 64
MAX_MINUTES = 24 * 60
FRAME_MS = 20
PAUSE_S = 1.0  # silence between a reply_done and the next utterance


@dataclass
class Stats:
    turns: int = 0
    lost_turns: int = 0
    no_reply: int = 0  # nothing recognised (empty final transcript)
    apologies: int = 0
    errors: collections.Counter = field(default_factory=collections.Counter)
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (monotonic, voice_to_voice ms)
    connects: int = 0
    disconnects: int = 0  # sessions that ended before the deadline
    close_codes: collections.Counter = field(default_factory=collections.Counter)


def process_sample(pid: int) -> dict:
    """Resident memory (MiB) and open file descriptors of `pid`, from /proc."""
    out: dict = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_mb"] = round(int(line.split()[1]) / 1024, 1)
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        pass
    return out


def http_base(ws_url: str) -> str:
    parts = urlsplit(ws_url)
    return urlunsplit(("https" if parts.scheme == "wss" else "http", parts.netloc, "", "", ""))


def healthz(ws_url: str) -> dict:
    with urllib.request.urlopen(http_base(ws_url) + "/healthz", timeout=10) as r:
        return json.loads(r.read())


def load_clips(folder: Path, rate: int) -> list[bytes]:
    clips = []
    for wav in sorted(folder.glob("*.wav")):
        audio, r = read_wav(wav)
        if len(audio) / r < 0.3:
            continue
        clips.append(float_to_pcm16(resample(audio, r, rate)))
    if not clips:
        raise SystemExit(f"voice soak: no usable WAVs in {folder}")
    return clips


def p95(values: list[float]) -> float | None:
    return round(float(np.percentile(values, 95)), 1) if values else None


async def _session(index: int, url: str, clips: list[bytes], rate: int, deadline: float, stats: Stats,
                   turn_timeout_s: float) -> None:
    import websockets
    frame_bytes = 2 * rate * FRAME_MS // 1000
    silence = bytes(frame_bytes)
    try:
        ws = await asyncio.wait_for(websockets.connect(url, max_size=None, open_timeout=30), 40)
    except (OSError, asyncio.TimeoutError, websockets.WebSocketException) as err:
        stats.errors[f"connect: {type(err).__name__}"] += 1
        return
    stats.connects += 1
    events: asyncio.Queue = asyncio.Queue()
    frames: collections.deque[bytes] = collections.deque()
    said = asyncio.Event()

    async def read() -> None:
        try:
            async for msg in ws:
                if isinstance(msg, str):
                    try:
                        events.put_nowait(from_wire(json.loads(msg)))
                    except ValueError as err:  # JSONDecodeError included: count it, keep reading
                        stats.errors[f"bad event: {err}"[:80]] += 1
        except websockets.ConnectionClosed:
            pass
        finally:
            events.put_nowait(None)

    async def mic() -> None:
        t0, sent = time.monotonic(), 0
        while True:
            if frames:
                await ws.send(frames.popleft())
                if not frames:
                    said.set()
            else:
                await ws.send(silence)
            sent += 1
            await asyncio.sleep(max(0.0, t0 + sent * FRAME_MS / 1000 - time.monotonic()))

    async def next_event(until: float) -> Event:
        ev = await asyncio.wait_for(events.get(), max(until - time.monotonic(), 0.01))
        if ev is None:
            raise ConnectionError("the server closed the connection")
        if isinstance(ev, Error):
            stats.errors[ev.code] += 1
            if ev.apology:
                stats.apologies += 1
        return ev

    reader = asyncio.create_task(read())
    sender: asyncio.Task | None = None
    try:
        await ws.send(json.dumps({"type": "start", "version": 1, "sample_rate": rate, "output_sample_rate": rate,
                                  "encoding": "pcm_s16le"}))
        ready = await next_event(time.monotonic() + 30)
        if not isinstance(ready, Ready):
            raise ConnectionError(f"no ready: {ready}")
        sender = asyncio.create_task(mic())
        n = index
        while time.monotonic() < deadline:
            clip = clips[n % len(clips)]
            n += 1
            said.clear()
            frames.extend(clip[i:i + frame_bytes] for i in range(0, len(clip), frame_bytes))
            until = time.monotonic() + len(clip) / 2 / rate + turn_timeout_s
            outcome = None
            try:
                while outcome is None:
                    ev = await next_event(until)
                    if isinstance(ev, Transcript) and ev.final and not ev.text:
                        outcome = "no_reply"
                    elif isinstance(ev, LatencyReport):
                        outcome = "done"
                        if ev.voice_to_voice_ms is not None:
                            stats.latencies.append((time.monotonic(), ev.voice_to_voice_ms))
            except asyncio.TimeoutError:
                stats.lost_turns += 1
                await asyncio.sleep(PAUSE_S)
                continue
            if outcome == "no_reply":
                stats.no_reply += 1
            else:
                stats.turns += 1
            await asyncio.wait_for(said.wait(), len(clip) / 2 / rate + 30)  # the clip is out
            await asyncio.sleep(PAUSE_S)
    except ConnectionError:
        stats.disconnects += 1
        stats.close_codes[str(ws.close_code)] += 1
        if frames or not said.is_set():
            stats.lost_turns += 1  # it was mid-turn
    except (asyncio.TimeoutError, websockets.ConnectionClosed) as err:
        stats.disconnects += 1
        stats.errors[f"client: {type(err).__name__}"] += 1
    finally:
        if sender is not None:
            sender.cancel()
        try:
            await asyncio.wait_for(ws.close(), 10)
        except (asyncio.TimeoutError, OSError, websockets.WebSocketException):
            pass
        reader.cancel()


async def _run(url: str, clips: list[bytes], sessions: int, seconds: float, pid: int, rate: int,
               turn_timeout_s: float, interval_s: float, say: Callable[[str], object]) -> dict:
    stats = Stats()
    start = time.monotonic()
    deadline = start + seconds
    samples: list[dict] = []

    def sample() -> dict:
        now = time.monotonic()
        s = {"t_s": round(now - start, 1), **(process_sample(pid) if pid else {})}
        since = samples[-1]["_mono"] if samples else start
        window = [ms for t, ms in stats.latencies if since < t <= now]
        s.update(turns=stats.turns, lost_turns=stats.lost_turns, errors=sum(stats.errors.values()),
                 p95_voice_to_voice_ms=p95(window), turns_in_interval=len(window), _mono=now)
        samples.append(s)
        say(f"soak t={s['t_s']:.0f}s rss={s.get('rss_mb')}MiB fds={s.get('fds')} turns={s['turns']} "
            f"lost={s['lost_turns']} errors={s['errors']} p95={s['p95_voice_to_voice_ms']}ms")
        return s

    async def sampler() -> None:
        while True:
            await asyncio.sleep(interval_s)
            sample()

    sample()
    watcher = asyncio.create_task(sampler())
    workers = [asyncio.create_task(_session(i, url, clips, rate, deadline, stats, turn_timeout_s))
               for i in range(sessions)]
    try:  # bounded: each worker ends by the deadline plus one turn timeout
        await asyncio.wait(workers, timeout=seconds + turn_timeout_s + 120)
    finally:
        for w in workers:
            w.cancel()
        watcher.cancel()
    await asyncio.sleep(1.0)  # let the server close the sessions before the last sample
    last = sample()
    for s in samples:
        s.pop("_mono", None)
    rss = [s["rss_mb"] for s in samples if "rss_mb" in s]
    fds = [s["fds"] for s in samples if "fds" in s]
    warm = rss[len(rss) // 4] if rss else None  # after the first quarter: allocator and caches warmed up
    return {
        "url": url, "sessions": sessions, "minutes": round(seconds / 60, 2), "pid": pid or None,
        "sessions_connected": stats.connects, "sessions_held": stats.connects - stats.disconnects,
        "sessions_dropped": stats.disconnects, "close_codes": dict(stats.close_codes),
        "turns": stats.turns, "lost_turns": stats.lost_turns, "no_reply_turns": stats.no_reply,
        "apologies": stats.apologies, "errors": sum(stats.errors.values()), "error_codes": dict(stats.errors),
        "p95_voice_to_voice_ms": p95([ms for _, ms in stats.latencies]),
        "rss_mb": {"start": rss[0], "warm": warm, "end": rss[-1], "max": max(rss),
                   "growth_after_warmup": round(rss[-1] - warm, 1)} if rss else None,
        "fds": {"start": fds[0], "end": fds[-1], "max": max(fds)} if fds else None,
        "server_sessions_after": last.get("sessions"),
        "samples": samples,
    }


def soak(url: str, audio: Path, sessions: int, minutes: float, pid: int = 0, rate: int = 16000,
         json_path: str | None = None, token: str = "", turn_timeout_s: float = 120.0,
         interval_s: float | None = None, say: Callable[[str], object] = print) -> dict:
    if not 1 <= sessions <= MAX_SESSIONS:
        raise SystemExit(f"voice soak: --sessions must be 1..{MAX_SESSIONS}")
    if not 0 < minutes <= MAX_MINUTES:
        raise SystemExit(f"voice soak: --minutes must be in (0, {MAX_MINUTES}]")
    if token:
        url += ("&" if "?" in url else "?") + "token=" + token
    if not pid:
        try:
            pid = int(healthz(url).get("pid") or 0)
        except (OSError, ValueError):
            pid = 0
        if not pid:
            say("voice soak: no server pid (not on this machine?): memory and descriptors are not watched")
    clips = load_clips(audio, rate)
    seconds = minutes * 60
    interval = interval_s or min(max(seconds / 20, 5.0), 60.0)
    report = asyncio.run(_run(url, clips, sessions, seconds, pid, rate, turn_timeout_s, interval, say))
    try:
        report["server_sessions_after"] = healthz(url).get("sessions")
    except (OSError, ValueError):
        pass
    summary = {k: v for k, v in report.items() if k != "samples"}
    say(json.dumps(summary, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    return report
