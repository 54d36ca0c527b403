"""Stand-ins for the models, and a live server around them, for tests that are about the service's
plumbing (auth, limits, records, shutdown, fuzzing) rather than about speech.

`fake_stages(config)` is a real `voice.service.instance.Instance` (metrics, admission, records, apology
cache) whose models are replaced: webrtcvad still runs on the audio (so real speech clips make
real turns), the "ASR" returns a fixed transcript, the "LM" a scripted reply, and the "TTS" a
tone 60 ms per character. `LiveServer` runs `build_app` under uvicorn in a thread on a free
loopback port, optionally as `VoiceServer` (graceful shutdown).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import wave
import weakref
from pathlib import Path

import numpy as np
import websockets

from liveserver import Served
from voice.audio import float_to_int16, read_wav, resample
from voice.config import Config
from voice.pipeline.lm import Piece
from voice.service.scheduler import Scheduler
from voice.service.instance import Instance

SPEECH = Path(__file__).resolve().parent / "speech"  # real recordings (README there), in the repo
FRAME = 640  # 20 ms of 16 kHz PCM16


class FakeWhisper:
    """voice.pipeline.asr.Whisper's shape; `fail` / `delay_s` simulate a broken or slow ASR."""

    def __init__(self, text: str = "eight of spades"):
        self.text, self.fail, self.delay_s = text, None, 0.0
        self.worker = Scheduler().worker("asr")  # as Whisper's
        self.speaking: weakref.WeakSet = weakref.WeakSet()

    def transcribe(self, audio, prefix=""):
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        return self.text

    def transcribe_final(self, audio):
        return self.transcribe(audio)


class FakeChat:
    def __init__(self, lm: "FakeLM"):
        self.lm = lm

    async def reply(self, messages, mode=None, runs_out=None, tools=None):
        self.lm.calls += 1
        self.lm.asked.append((messages, tools))
        if tools and self.lm.tool_calls:  # scripted: this reply calls tools instead of speaking
            yield Piece("", calls=self.lm.tool_calls)
            return
        for i, text in enumerate(self.lm.blocks):
            if self.lm.delay_s:
                await asyncio.sleep(self.lm.delay_s)
            if self.lm.fail_at is not None and i == self.lm.fail_at:
                raise self.lm.failure
            if self.lm.hang_at is not None and i == self.lm.hang_at:
                await asyncio.sleep(3600)
            yield Piece(text, i + 1, 1)

    async def prepare(self, messages, tools=None, aside=False):
        (self.lm.prepared_aside if aside else self.lm.prepared).append((messages, tools))

    async def end_of_turn_probability(self, messages, text, tools=None) -> float | None:
        """`FakeLM.end_of_turn` when scripted, else 0.9 after a sentence's closing punctuation, 0.1 elsewhere."""
        self.lm.end_of_turn_asked.append(text)
        if self.lm.end_of_turn is not None:
            return self.lm.end_of_turn
        return 0.9 if text.rstrip().endswith((".", "?", "!")) else 0.1

    def close(self) -> None:
        self.lm.closed += 1


class FakeLM:
    mode = "diffusion"

    def __init__(self, blocks=("Sure,", " here is", " a short", " reply.")) -> None:
        self.blocks = list(blocks)
        self.delay_s = 0.0
        self.fail_at: int | None = None
        self.failure: Exception = RuntimeError("injected LM failure")  # raised at block `fail_at`
        self.hang_at: int | None = None
        self.calls = 0
        self.closed = 0  # chats closed
        self.tool_calls: list[dict] = []  # when set, a reply offered tools calls these (OpenAI-shaped)
        self.asked: list[tuple] = []  # (messages, tools) of every reply
        self.prepared: list[tuple] = []  # (messages, tools) of every `prepare`
        self.prepared_aside: list[tuple] = []  # and of every `prepare(aside=True)`
        self.end_of_turn: float | None = None  # scripted end_of_turn_probability (None: from the punctuation)
        self.end_of_turn_asked: list[str] = []  # the texts it was asked about

    def chat(self) -> FakeChat:
        return FakeChat(self)

    def fits(self, messages) -> bool:
        return True

    def serve(self, max_prefill_s, tools) -> None:
        return None

    def describe(self) -> dict[str, str] | None:
        return {"mode": self.mode, "why": "scripted replies", "kernels": "none (a test's fake)"}

    def health(self) -> dict | None:
        return None


class FakeSynth:
    """A 300 Hz tone, 60 ms per character, at the rate asked for."""

    voice_rate = 22050

    def __init__(self) -> None:
        self.fail: Exception | None = None
        self.delay_s = 0.0

    def render(self, text: str, out_rate: int) -> np.ndarray:
        n = int(out_rate * 0.06 * max(len(text), 1))
        return (np.sin(np.arange(n) * 2 * np.pi * 300 / out_rate) * 8000).astype(np.int16)

    async def synthesize(self, text: str, out_rate: int, urgent=lambda: False) -> np.ndarray:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        return self.render(text, out_rate)


def fake_instance(config: Config | None = None, whisper=None, synthesizer=None, lm=None) -> Instance:
    """Instance of instant stand-ins (or the parts given), for tests of everything around the models."""
    return Instance(config or Config(), whisper or FakeWhisper(), synthesizer or FakeSynth(), lm or FakeLM())


REAL_REPLY_TOKENS = 24  # the real LM's replies in tests (conftest's real_stages): short, so the suite stays quick


def make_config(**sections) -> Config:
    """A Config with short replies and records off, plus overrides: make_config(limits={"max_sessions": 2})."""
    config = Config()
    config.lm.max_new_tokens = 16
    config.records.path = ""
    for name, values in sections.items():
        section = getattr(config, name)
        for key, value in values.items():
            assert hasattr(section, key), f"{name}.{key}"
            setattr(section, key, value)
    return config


class LiveServer(Served):
    """The voice app, `build_app(config, instance, auth)`, served (`graceful`: with the service's own
    draining shutdown, voice.service.server.VoiceServer)."""

    def __init__(self, config: Config, instance, auth=None, graceful: bool = False):
        import uvicorn

        from voice.service.server import VoiceServer, build_app
        self.config, self.instance = config, instance
        self.app = build_app(config, instance, auth)
        server_cls = (lambda uv: VoiceServer(uv, self.app)) if graceful else uvicorn.Server
        super().__init__(self.app, server_cls, timeout_graceful_shutdown=5)


def speech(name: str = "005.wav", rate: int = 16000) -> bytes:
    audio, r = read_wav(SPEECH / name)
    return float_to_int16(resample(audio, r, rate)).astype("<i2").tobytes()


def write_wav(path: Path, pcm: bytes, rate: int = 16000) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return path


class RawWebSocket:
    """A minimal blocking websocket client over a plain socket, for a peer that never reads:
    after the handshake it only sends (masked frames), so the server's writes pile up."""

    def __init__(self, host: str, port: int, path: str, rcvbuf: int = 4096):
        import base64
        import os
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(10)
        self.sock.connect((host, port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                           ).encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError("closed during the handshake")
            head += chunk
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise ConnectionError(head.decode(errors="replace"))

    def send(self, data: bytes | str) -> None:
        import os
        import struct
        opcode = 0x1 if isinstance(data, str) else 0x2
        payload = data.encode() if isinstance(data, str) else data
        n = len(payload)
        header = bytes([0x80 | opcode]) + (bytes([0x80 | n]) if n < 126 else
                                             bytes([0x80 | 126]) + struct.pack("!H", n) if n < 65536 else
                                             bytes([0x80 | 127]) + struct.pack("!Q", n))
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(header + mask + masked)

    def abort(self) -> None:
        self.sock.close()


class Client:
    """A /ws session (16 kHz): streams audio (a clip, then silence) and records what comes back, until closed."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.log: list = []
        self.frames: list[bytes] = []
        self.close: tuple | None = None
        self.reader = asyncio.create_task(self._read())
        self.mic: asyncio.Task | None = None

    @classmethod
    async def open(cls, url: str, start: bool = True, **connect) -> "Client":
        c = cls(await websockets.connect(url, max_size=None, open_timeout=10, **connect))
        if start:
            await c.ws.send(json.dumps({"type": "start", "sample_rate": 16000}))
            await c.wait(lambda m: m.get("type") == "ready", 10)
        return c

    async def _read(self):
        try:
            async for msg in self.ws:
                self.log.append(msg if isinstance(msg, bytes) else json.loads(msg))
        except websockets.ConnectionClosed:
            pass
        self.close = (self.ws.close_code, self.ws.close_reason)

    def listen(self, speed: float = 2.0, silence: bool = True):
        async def run():
            t0, n = time.monotonic(), 0
            try:
                while True:
                    if self.frames:
                        await self.ws.send(self.frames.pop(0))
                    elif silence:
                        await self.ws.send(bytes(FRAME))
                    n += 1
                    await asyncio.sleep(max(0.0, t0 + n * 0.02 / speed - time.monotonic()))
            except websockets.ConnectionClosed:
                pass
        self.mic = asyncio.create_task(run())

    def say(self, pcm: bytes):
        self.frames += [pcm[i:i + FRAME] for i in range(0, len(pcm), FRAME)]

    def events(self, kind: str | None = None) -> list[dict]:
        return [m for m in self.log if isinstance(m, dict) and (kind is None or m["type"] == kind)]

    async def wait(self, pred, timeout: float = 20) -> dict:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for m in self.log[seen:]:
                if isinstance(m, dict) and pred(m):
                    return m
            seen = len(self.log)
            if self.reader.done():
                break
            await asyncio.sleep(0.01)
        raise AssertionError(f"not seen; got {[m if isinstance(m, dict) else len(m) for m in self.log]} "
                             f"close={self.close}")

    async def closed(self, timeout: float = 20) -> tuple:
        await asyncio.wait_for(asyncio.shield(self.reader), timeout)
        if self.mic:
            self.mic.cancel()
        assert self.close is not None  # set as the reader ended
        return self.close

    async def shut(self):
        if self.mic:
            self.mic.cancel()
        await self.ws.close()
        await self.reader


class StandInEngine:
    """engine.stream.Engine's shape for engine/api/server.py: always replies "Hello there."."""

    name = "stand-in"
    max_seq_len = 2048

    def resolve(self, cfg):  # Engine.resolve: this stand-in runs whatever mode is asked
        return cfg

    def prompt_ids(self, messages, tools=None):
        return list(range(sum(len(m["content"]) for m in messages) // 4 + 1))

    async def stream(self, messages, cfg, conversation, constraint=None, tools=None, deadline=None):
        from engine import stream  # the engine's pieces (this module's `Piece` is the LM stage's)
        for i, word in enumerate(["Hello", " there."]):
            yield stream.Piece(word, [i], 1, i + 1, i + 1, 1.0, 2.0, i == 1, "stop" if i == 1 else None, 3, 3)

    def abandon(self, conversation):
        """Nothing to give back: the stand-in keeps no caches."""

    class admission:
        """Where the server hands its kept caches' `release` (the stand-in never needs the room)."""

        release_idle = None

    class grammars:
        """It has no tokenizer to hold a reply to a grammar with: JSON output is refused (a 400)."""

        @staticmethod
        def json(schema):
            from engine.grammar import GrammarError
            raise GrammarError("the stand-in engine cannot constrain its output")

        lark = json


class EncodingEngine(StandInEngine):
    """The stand-in engine, but its "tokenizer" encodes the text, as a real one does."""

    def prompt_ids(self, messages, tools=None):
        return list("".join(m["content"] for m in messages).encode("utf-8"))


def padded_speech(src: Path, dst: Path, lead_s: float, tail_s: float) -> Path:
    """Write `src` (16-bit mono WAV) with `lead_s` / `tail_s` seconds of silence around it."""
    with wave.open(str(src), "rb") as w:
        rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
        assert (width, channels) == (2, 1), f"{src} must be 16-bit mono"
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    out = np.concatenate([np.zeros(int(lead_s * rate), "<i2"), pcm, np.zeros(int(tail_s * rate), "<i2")])
    with wave.open(str(dst), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(out.tobytes())
    return dst
