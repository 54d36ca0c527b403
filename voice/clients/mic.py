"""`voice mic`: talk to a running service from this machine's microphone, hear the replies.

Full duplex over the native protocol: the input stream's callback hands 20 ms frames of
16 kHz PCM16 to the websocket, and the output stream's callback plays reply audio from a
queue that a `clear` (barge-in) empties at once.

On a speakerphone or laptop the reply comes back through the microphone. `EchoCanceller` runs
WebRTC's echo canceller (AEC3, bundled in the `livekit` wheel): every block the output stream
plays, silence included, is its reference at the moment it is played, and every microphone
frame leaves with that echo removed before it is sent. `--no-aec` turns it off for headphones.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import soxr
import websockets

from voice.audio import RATES
from voice.events import (WIRE_TYPES, Clear, Error, Event, LatencyReport, Ready, ReplyDone, SpeechStarted,
                          SpeechStopped, Transcript, from_wire)

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

RATE = 16000  # what we stream to the server
FRAME_MS = 20
FRAME_BYTES = RATE * 2 * FRAME_MS // 1000
AEC_MS = 10  # WebRTC's audio processing takes exactly 10 ms frames
# PortAudio's "high" output latency on ALSA's pulse plugin is 35 ms: with two busy processes on 2 cores it
# underran 7-54 times in 12 s and lost up to half the reply; 100 ms underran 0 times in the same trials.
SPEAKER_BUFFER_S = 0.1


def _sounddevice() -> ModuleType:
    try:
        import sounddevice
    except ImportError:
        raise SystemExit("voice mic needs the [mic] extra: pip install 'diffusion-voice[mic]'") from None
    except OSError as err:  # the Python package is there but the PortAudio library is not
        raise SystemExit(f"voice mic needs the PortAudio library (e.g. apt-get install libportaudio2): {err}") from None
    return sounddevice


class EchoCanceller:
    """WebRTC's AEC3 between the speaker and the microphone.

    `played` runs on the output stream's thread with what the speaker is given now, `heard` on the
    event loop with what the microphone caught; a lock keeps the two calls into the module apart.
    The stream delay is a hint (the output plus input latencies PortAudio reports); AEC3 finds
    the echo's real delay itself.
    """

    def __init__(self, play_rate: int) -> None:
        try:
            from livekit import rtc
        except ImportError:
            raise SystemExit("echo cancellation needs the [mic] extra (pip install 'diffusion-voice[mic]'); "
                             "with headphones, --no-aec") from None
        self._rtc = rtc
        self._apm = rtc.AudioProcessingModule(echo_cancellation=True)
        self._lock = threading.Lock()
        self.play_rate = play_rate
        self._play_bytes = play_rate * 2 * AEC_MS // 1000
        self._played = bytearray()
        self.delay_ms = 0

    def played(self, pcm: bytes) -> None:
        self._played += pcm
        while len(self._played) >= self._play_bytes:
            frame = self._rtc.AudioFrame(bytes(self._played[:self._play_bytes]), self.play_rate, 1,
                                         self._play_bytes // 2)
            del self._played[:self._play_bytes]
            with self._lock:
                self._apm.process_reverse_stream(frame)

    def heard(self, frame: bytes) -> bytes:
        """One 20 ms frame of 16 kHz PCM16 from the microphone -> the same with the echo removed."""
        step = RATE * 2 * AEC_MS // 1000
        out = bytearray()
        for i in range(0, len(frame), step):
            chunk = self._rtc.AudioFrame(frame[i:i + step], RATE, 1, step // 2)
            with self._lock:
                self._apm.set_stream_delay_ms(self.delay_ms)
                self._apm.process_stream(chunk)
            out += chunk.data.cast("B")
        return bytes(out)


def parse_device(value: str | None) -> int | str | None:
    """A device index, or a (part of a) device name as sounddevice matches it; None: the default."""
    if value is None or value == "":
        return None
    return int(value) if value.isdigit() else value


def list_devices() -> str:
    return str(_sounddevice().query_devices())


class Player:
    """Reply audio waiting to be played; the output stream's callback drains it."""

    def __init__(self, echo: EchoCanceller | None = None) -> None:
        self._lock = threading.Lock()
        self._buf = bytearray()
        self.echo = echo  # told every block as it is played, so that it can cancel it from the mic
        self.played = 0  # bytes handed to the output device
        self.dropped = 0  # bytes dropped by `clear`

    def push(self, pcm: bytes) -> None:
        with self._lock:
            self._buf += pcm

    def clear(self) -> int:
        with self._lock:
            n = len(self._buf)
            self._buf.clear()
            self.dropped += n
            return n

    @property
    def pending(self) -> int:
        return len(self._buf)

    def callback(self, outdata: Any, frames: int, time_info: Any, status: Any) -> None:  # PortAudio thread
        # outdata: a cffi buffer; time_info: a cffi struct; status: sounddevice.CallbackFlags (no stubs)
        n = len(outdata)
        with self._lock:
            take = min(n, len(self._buf))
            outdata[:take] = bytes(self._buf[:take])
            del self._buf[:take]
            self.played += take
        if take < n:
            outdata[take:] = b"\x00" * (n - take)
        if self.echo is not None:
            self.echo.played(bytes(outdata))


class Framer:
    """Microphone blocks at the device's rate -> 20 ms frames of 16 kHz PCM16 (resampled if needed)."""

    def __init__(self, device_rate: int) -> None:
        self.resampler = soxr.ResampleStream(device_rate, RATE, 1, dtype="int16") if device_rate != RATE else None
        self.pending = bytearray()

    def push(self, pcm: bytes) -> list[bytes]:
        if self.resampler is not None:
            pcm = self.resampler.resample_chunk(np.frombuffer(pcm, dtype="<i2")).astype("<i2").tobytes()
        self.pending += pcm
        frames = []
        while len(self.pending) >= FRAME_BYTES:
            frames.append(bytes(self.pending[:FRAME_BYTES]))
            del self.pending[:FRAME_BYTES]
        return frames


class Console:
    """Event lines, plus a live one-line status redrawn in place when stdout is a terminal."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.status = ""

    def line(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K")
        self.stream.write(text + "\n")
        if self.tty and self.status:
            self.stream.write(self.status)
        self.stream.flush()

    def set_status(self, text: str) -> None:
        if text == self.status:
            return
        self.status = text
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()

    def close(self) -> None:
        if self.tty and self.status:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()


class MicClient:
    def __init__(self, url: str, input_device: int | str | None = None, output_device: int | str | None = None,
                 console: Console | None = None, aec: bool = True) -> None:
        self.url, self.input_device, self.output_device = url, input_device, output_device
        self.aec = aec
        self.console = console or Console()
        self.player = Player()
        self.state = "connecting"
        self.partial = ""
        self.last_v2v: float | None = None
        self.reply_open = False  # a reply is being generated or sent
        self.turn_played_from = 0  # player.played when the current reply started
        self.turn_reported = True

    # --- audio devices -----------------------------------------------------------------------

    def _input_rate(self, sd: ModuleType) -> int:
        try:
            sd.check_input_settings(self.input_device, channels=1, dtype="int16", samplerate=RATE)
            return RATE
        except Exception:  # noqa: BLE001 - PortAudio refuses a rate in many ways: use the device's own
            return int(sd.query_devices(self.input_device, "input")["default_samplerate"])

    def _output_rate(self, sd: ModuleType) -> int:
        rate = int(sd.query_devices(self.output_device, "output")["default_samplerate"])
        if rate not in RATES:
            rate = RATE
        sd.check_output_settings(self.output_device, channels=1, dtype="int16", samplerate=rate)
        return rate

    # --- main loop -----------------------------------------------------------------------------

    async def run(self) -> int:
        sd = _sounddevice()
        try:
            in_rate, out_rate = self._input_rate(sd), self._output_rate(sd)
        except (ValueError, sd.PortAudioError) as err:
            self.console.line(f"error: audio device: {err} (see `voice mic --list-devices`)")
            return 2
        loop = asyncio.get_running_loop()
        frames: asyncio.Queue[bytes] = asyncio.Queue(maxsize=200)
        framer = Framer(in_rate)
        echo = EchoCanceller(out_rate) if self.aec else None
        self.player.echo = echo

        def on_input(indata: Any, n: int, time_info: Any, status: Any) -> None:  # PortAudio thread (cffi objects)
            loop.call_soon_threadsafe(_enqueue, bytes(indata))

        def _enqueue(pcm: bytes) -> None:
            for frame in framer.push(pcm):
                if echo is not None:
                    frame = echo.heard(frame)
                if frames.full():
                    frames.get_nowait()  # the socket is stuck; keep the newest audio
                frames.put_nowait(frame)

        try:
            ws = await websockets.connect(self.url, max_size=None, open_timeout=10)
        except (OSError, asyncio.TimeoutError, websockets.InvalidURI, websockets.InvalidHandshake) as err:
            self.console.line(f"error: cannot reach the voice server at {self.url}: {err}")
            return 1
        try:
            await ws.send(json.dumps({"type": "start", "version": 1, "sample_rate": RATE,
                                      "output_sample_rate": out_rate, "encoding": "pcm_s16le"}))
            with sd.RawInputStream(samplerate=in_rate, blocksize=in_rate * FRAME_MS // 1000, channels=1,
                                   dtype="int16", device=self.input_device, callback=on_input,
                                   latency="high") as mic_stream, \
                 sd.RawOutputStream(samplerate=out_rate, blocksize=out_rate * FRAME_MS // 1000, channels=1,
                                    dtype="int16", device=self.output_device, callback=self.player.callback,
                                    latency=SPEAKER_BUFFER_S) as speaker_stream:
                if echo is not None:
                    echo.delay_ms = round((mic_stream.latency + speaker_stream.latency) * 1000)
                aec = f"echo cancellation on (delay hint {echo.delay_ms} ms)" if echo else "no echo cancellation"
                self.console.line(f"connected to {self.url}; talk (Ctrl-C to quit). "
                                  f"mic {in_rate} Hz -> {RATE} Hz, speaker {out_rate} Hz, {aec}")
                tasks = [asyncio.create_task(self._send(ws, frames)), asyncio.create_task(self._status())]
                try:
                    return await self._receive(ws)
                finally:
                    for task in tasks:
                        task.cancel()
        except sd.PortAudioError as err:
            self.console.line(f"error: audio device: {err} (see `voice mic --list-devices`)")
            return 2
        finally:
            await ws.close()
            self.console.close()

    async def _send(self, ws: ClientConnection, frames: asyncio.Queue[bytes]) -> None:
        try:
            while True:
                await ws.send(await frames.get())
        except websockets.ConnectionClosed:
            return

    async def _receive(self, ws: ClientConnection) -> int:
        try:
            async for msg in ws:
                if isinstance(msg, bytes):
                    self._audio(msg)
                else:
                    self._event(msg)
        except websockets.ConnectionClosed:
            pass
        code, reason = ws.close_code, ws.close_reason
        self.console.line(f"the server closed the connection (code {code}{': ' + reason if reason else ''})")
        return 1

    def _audio(self, pcm: bytes) -> None:
        if len(pcm) % 2:
            self.console.line(f"error: dropped a reply audio frame of odd length ({len(pcm)} bytes)")
            return
        self.player.push(pcm)

    def _event(self, text: str) -> None:
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            self.console.line(f"error: the server sent malformed JSON (ignored): {text[:60]!r}")
            return
        try:
            ev = from_wire(body)
        except ValueError as err:
            kind = body.get("type") if isinstance(body, dict) else None
            if kind in WIRE_TYPES:
                self.console.line(f"error: malformed {kind} event (ignored): {err}")
            else:
                self.console.line(f"error: unknown event {kind!r} from the server (ignored)")
            return
        try:
            self._handle(ev)
        except (TypeError, ValueError) as err:  # e.g. a latency figure that is not a number
            self.console.line(f"error: malformed {ev.type} event (ignored): {err!r}")

    def _handle(self, ev: Event) -> None:
        if isinstance(ev, Ready):
            self.state = "listening"
        elif isinstance(ev, SpeechStarted):
            self.state, self.partial = "hearing you", ""
        elif isinstance(ev, SpeechStopped):
            self.state = "thinking"
        elif isinstance(ev, Transcript):
            if not ev.final:
                self.partial = ev.text
                return
            self.partial = ""
            if ev.text:
                self.console.line(f"you: {ev.text}")
                self.reply_open, self.turn_reported = True, False
                self.turn_played_from = self.player.played + self.player.pending
            else:
                self.state = "listening"
                self.console.line("(didn't catch that)")
        elif isinstance(ev, ReplyDone):
            self.reply_open = False
            text = " ".join(ev.text.split())  # one line, even when the LM wrote several
            if ev.interrupted:
                text += f"  [interrupted; heard: {' '.join(ev.heard.split())!r}]"
            self.console.line(f"bot: {text}")
        elif isinstance(ev, Clear):
            dropped = self.player.clear()
            self.console.line(f"(interrupted: dropped {dropped} bytes of queued reply audio)")
        elif isinstance(ev, LatencyReport):
            self.last_v2v = ev.voice_to_voice_ms
            stages = " ".join(f"{k}={v:.0f}" for k, v in ev.stages_ms.items() if k != "voice_to_voice")
            over = f"  over budget: {', '.join(ev.over_budget)}" if ev.over_budget else ""
            v2v = f"{self.last_v2v:.0f} ms" if self.last_v2v is not None else "-"
            self.console.line(f"turn {ev.turn}: voice-to-voice {v2v} ({stages} ms){over}")
        elif isinstance(ev, Error):
            self.console.line(f"server error: {ev.code}: {ev.message}")
        # reply deltas: the full text arrives with reply_done; the status line shows progress

    async def _status(self) -> None:
        while True:
            speaking = self.player.pending > 0
            if speaking:
                self.state = "speaking"
            elif self.state == "speaking":
                self.state = "thinking" if self.reply_open else "listening"
            shown = f"{self.state}: {self.partial}" if self.state == "hearing you" and self.partial else self.state
            v2v = f"{self.last_v2v:.0f} ms" if self.last_v2v is not None else "-"
            self.console.set_status(f"[{shown}]  last voice-to-voice {v2v}")
            if not speaking and not self.reply_open and not self.turn_reported:
                self.turn_reported = True
                played = self.player.played - self.turn_played_from
                self.console.line(f"played {played} bytes of reply audio (total {self.player.played})")
            await asyncio.sleep(0.1)


def mic(url: str, input_device: str | None = None, output_device: str | None = None, aec: bool = True) -> int:
    """Run until Ctrl-C (exit 0) or until the connection fails (exit 1) or a device fails (exit 2)."""
    client = MicClient(url, parse_device(input_device), parse_device(output_device), aec=aec)
    # A process started in the background by a non-interactive shell inherits SIGINT ignored,
    # and Python then never raises KeyboardInterrupt: make Ctrl-C / SIGINT quit in any case.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return asyncio.run(client.run())
    except KeyboardInterrupt:
        client.console.close()
        print(f"bye (played {client.player.played} bytes of reply audio)")
        return 0
