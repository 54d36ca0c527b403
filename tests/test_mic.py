"""`voice mic` against a real audio server: PulseAudio with null sinks.

The "mic" sink's monitor is the microphone (paplay plays 005.wav into it), the "speaker" sink
is the output (parec records its monitor). `voice mic` reaches them the way it would reach
hardware: sounddevice -> PortAudio -> ALSA -> ALSA's pulse plugin -> PulseAudio.
A room with an echo: what is played into "room_out" comes back, 60 ms later through a
loopback, into "room", whose monitor is that room's microphone.
"""

from __future__ import annotations

import ctypes.util
import glob
import asyncio
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soxr
import websockets
from websockets.asyncio.server import serve

from fakes import SPEECH, padded_speech, speech
from voice.clients.mic import FRAME_BYTES, Console, EchoCanceller, Framer, MicClient, Player

pytestmark = [pytest.mark.slow, pytest.mark.live]

PULSE_CONFIG = """\
load-module module-null-sink sink_name=mic rate=16000 channels=1 sink_properties=device.description=mic
load-module module-null-sink sink_name=speaker rate=16000 channels=1 sink_properties=device.description=speaker
load-module module-null-sink sink_name=room rate=16000 channels=1 sink_properties=device.description=room
load-module module-null-sink sink_name=room_out rate=16000 channels=1 sink_properties=device.description=room_out
load-module module-loopback source=room_out.monitor sink=room latency_msec=60
load-module module-native-protocol-unix auth-anonymous=1 socket={socket}
set-default-source mic.monitor
set-default-sink speaker
"""
# ALSA's own pulse.conf hook only routes to PulseAudio when it finds it running; be explicit
ASOUNDRC = """\
pcm.!default { type pulse }
ctl.!default { type pulse }
pcm.pulse { type pulse }
ctl.pulse { type pulse }
"""


class Lines:
    """Collects a child's output lines in a thread; `wait_for` blocks until one matches."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                left = deadline - time.monotonic()
                assert left > 0, f"no line matching {pattern!r} in {timeout:.0f} s; output:\n" + "\n".join(self.lines)
                self._cond.wait(left)

    def text(self) -> str:
        self._thread.join(timeout=5)
        return "\n".join(self.lines)


def _alsa_pulse_plugin() -> bool:
    return bool(glob.glob("/usr/lib/*/alsa-lib/libasound_module_pcm_pulse.so")
                or glob.glob("/usr/lib/alsa-lib/libasound_module_pcm_pulse.so"))


@pytest.fixture(scope="module")
def pulse(require_system, tmp_path_factory):
    """A private PulseAudio daemon; yields the environment that points clients at it."""
    tools = ("pulseaudio", "pactl", "paplay", "parec")
    missing = [t for t in tools if not shutil.which(t)]
    require_system(not missing, f"missing {', '.join(missing)} (apt-get install pulseaudio)")
    require_system(ctypes.util.find_library("portaudio"),
                   "the PortAudio library is missing (apt-get install libportaudio2)")
    require_system(_alsa_pulse_plugin(), "ALSA's pulse plugin is missing (apt-get install libasound2-plugins)")
    root = tmp_path_factory.mktemp("pulse")
    home, runtime = root / "home", root / "run"
    home.mkdir()
    runtime.mkdir(mode=0o700)
    (home / ".asoundrc").write_text(ASOUNDRC)
    sock = root / "native.sock"
    (root / "default.pa").write_text(PULSE_CONFIG.format(socket=sock))
    env = {**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime), "PULSE_RUNTIME_PATH": str(runtime),
           "PULSE_SERVER": f"unix:{sock}", "PYTHONUNBUFFERED": "1"}
    env.pop("PULSE_SINK", None), env.pop("PULSE_SOURCE", None)
    log = open(root / "pulseaudio.log", "w")
    daemon = subprocess.Popen(["pulseaudio", "--daemonize=no", "--exit-idle-time=-1", "--system=false", "-n",
                               "--use-pid-file=no", "--disallow-exit", "--disallow-module-loading",
                               "-F", str(root / "default.pa"), "--log-target=stderr"],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while subprocess.run(["pactl", "info"], env=env, capture_output=True).returncode != 0:
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            log.close()
            pytest.fail("PulseAudio did not start:\n" + (root / "pulseaudio.log").read_text()[-3000:])
        time.sleep(0.1)
    yield env
    daemon.terminate()
    daemon.wait(timeout=10)
    log.close()


def voice_mic(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "voice.cli", "mic", *args], env={**env, "PYTHONFAULTHANDLER": "1"},
                            text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])


def test_list_devices(pulse):
    out = subprocess.run([sys.executable, "-m", "voice.cli", "mic", "--list-devices"], env=pulse,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pulse" in out.stdout


def test_conversation_over_pulseaudio(pulse, live_voice_server, tmp_path):
    speech = padded_speech(SPEECH / "005.wav", tmp_path / "speech.wav", 0.5, 2.5)
    recorded = tmp_path / "speaker.raw"
    url = live_voice_server.replace("http://", "ws://") + "/ws"
    with open(recorded, "wb") as rec_file:
        recorder = subprocess.Popen(["parec", "--device=speaker.monitor", "--format=s16le", "--rate=16000",
                                     "--channels=1", "--latency-msec=50"], env=pulse, stdout=rec_file)
        client = voice_mic(pulse, "--url", url, "--input", "pulse", "--output", "pulse")
        out, err = Lines(client.stdout), Lines(client.stderr)
        try:
            out.wait_for(r"^connected to ", timeout=60)
            subprocess.run(["paplay", "--device=mic", str(speech)], env=pulse, check=True, timeout=60)
            heard = out.wait_for(r"^you: (.*)", timeout=120).group(1)
            played = int(out.wait_for(r"^played (\d+) bytes of reply audio", timeout=120).group(1))
            out.wait_for(r"^turn 1: voice-to-voice", timeout=60)  # the turn's report comes once it was heard
            client.send_signal(signal.SIGINT)  # Ctrl-C
            try:
                rc = client.wait(timeout=20)
            except subprocess.TimeoutExpired:
                client.kill()
                pytest.fail("voice mic did not exit within 20 s of Ctrl-C; its output:\n" + out.text() + "\n" +
                            err.text())
        finally:
            if client.poll() is None:
                client.kill()
            recorder.terminate()
            recorder.wait(timeout=10)
    stdout, stderr = out.text(), err.text()
    assert rc == 0, (rc, stdout, stderr)
    assert "Traceback" not in stderr, stderr
    assert "spades" in heard.lower(), stdout
    bot = re.search(r"^bot: (.+)", stdout, re.M)
    assert bot and bot.group(1).strip(), stdout
    assert re.search(r"^turn 1: voice-to-voice \d+ ms \(endpoint=\d+ asr=\d+ ", stdout, re.M), stdout
    assert played > 0, stdout
    assert re.search(r"^bye \(played \d+ bytes", stdout, re.M), stdout
    assert not re.search(r"^(server )?error", stdout, re.M), stdout
    # The reply really came out of the "speaker": its monitor holds non-silent audio.
    audio = np.frombuffer(recorded.read_bytes()[: recorded.stat().st_size // 2 * 2], dtype="<i2").astype(np.float32)
    frames = audio[: len(audio) // 320 * 320].reshape(-1, 320) / 32768
    loud = np.sqrt((frames ** 2).mean(axis=1)) > 10 ** (-40 / 20)  # 20 ms windows above -40 dBFS
    assert loud.sum() * 0.02 > 0.3, f"only {loud.sum() * 0.02:.2f} s of reply audio reached the speaker"


class ReplyPeer:
    """A websocket peer in a thread: on `start` it sends `reply` (16 kHz) as reply audio; it keeps what it is sent."""

    def __init__(self, reply: bytes) -> None:
        self.reply, self.heard = reply, bytearray()
        self.ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)
        self._thread.start()
        assert self.ready.wait(10)

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with serve(self._session, "127.0.0.1", 0) as server:
            self.url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/ws"
            self.ready.set()
            await self._stop.wait()

    async def _session(self, ws) -> None:
        start = json.loads(await ws.recv())
        pcm = np.frombuffer(self.reply, dtype="<i2")  # 16 kHz -> the rate the client asked for, as a server does
        reply = soxr.resample(pcm, 16000, start["output_sample_rate"]).astype("<i2").tobytes()
        for i in range(0, len(reply), 3200):
            await ws.send(reply[i:i + 3200])
        try:
            async for msg in ws:
                if isinstance(msg, bytes):
                    self.heard += msg
        except websockets.ConnectionClosed:
            pass

    def close(self) -> np.ndarray:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)
        return np.frombuffer(bytes(self.heard), dtype="<i2").astype(np.float32)


def _db(x: np.ndarray) -> float:
    return float(10 * np.log10((x ** 2).mean() + 1e-9))


def _talk_over_a_reply(pulse: dict, *args: str) -> tuple[np.ndarray, np.ndarray]:
    """`voice mic` in the echoing room: a 14 s reply plays, the user talks over it 8 s in; what the client sent."""
    reply = b"".join(speech(name) for name in ("005.wav", "001.wav", "002.wav", "004.wav", "forever.wav",
                                                "goforward.wav"))
    peer = ReplyPeer(reply)
    env = {**pulse, "PULSE_SINK": "room_out", "PULSE_SOURCE": "room.monitor"}
    client = voice_mic(env, "--url", peer.url, "--input", "pulse", "--output", "pulse", *args)
    out, err = Lines(client.stdout), Lines(client.stderr)  # both read as they come: a full pipe would block it
    try:
        out.wait_for(r"^connected to ", timeout=60)
        time.sleep(8)
        subprocess.run(["paplay", "--device=room", str(SPEECH / "003.wav")], env=pulse, check=True, timeout=60)
        time.sleep(1)
        client.send_signal(signal.SIGINT)
        try:
            client.wait(timeout=20)
        except subprocess.TimeoutExpired:
            client.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack to stderr
            client.wait(timeout=10)
            pytest.fail("voice mic did not exit within 20 s of Ctrl-C; its output:\n" + out.text() + "\n" +
                        err.text())
    finally:
        if client.poll() is None:
            client.kill()
        sent = peer.close()
    assert client.returncode == 0, out.text() + err.text()
    return sent, np.frombuffer(speech("003.wav"), dtype="<i2").astype(np.float32)


def _levels(sent: np.ndarray, voice: np.ndarray) -> tuple[float, float, float]:
    """(the echo alone from 3 s to just before the user, the user's speech over the echo, the user's clip) in dB."""
    at = _find(sent, voice)
    return _db(sent[3 * 16000:at - 3200]), _db(sent[at:at + len(voice)]), _db(voice)


def _find(sent: np.ndarray, voice: np.ndarray) -> int:
    """Where the user's clip starts in what was sent (cross-correlation via FFT)."""
    n = len(sent) + len(voice)
    corr = np.fft.irfft(np.fft.rfft(sent, n) * np.conj(np.fft.rfft(voice, n)), n)[: len(sent) - len(voice)]
    return int(np.argmax(corr))


def test_echo_is_cancelled_and_the_user_still_heard(pulse):
    sent, voice = _talk_over_a_reply(pulse)
    echo_db, user_db, clip_db = _levels(sent, voice)
    raw, _ = _talk_over_a_reply(pulse, "--no-aec")
    raw_echo_db, _, _ = _levels(raw, voice)
    print(f"echo without AEC {raw_echo_db:.1f} dB, with {echo_db:.1f} dB (ERLE {raw_echo_db - echo_db:.1f} dB); "
          f"user over the echo {user_db:.1f} dB, the clip alone {clip_db:.1f} dB")
    assert raw_echo_db > clip_db - 10, "without AEC the reply should come back into the microphone"
    assert raw_echo_db - echo_db >= 15
    assert user_db - echo_db >= 30, "the user should stand far above what is left of the echo"
    assert abs(user_db - clip_db) <= 10, "double talk: AEC3's suppressor may take a few dB off the user, not more"


def test_unreachable_server(pulse):
    client = voice_mic(pulse, "--url", "ws://127.0.0.1:9/ws")
    stdout, stderr = client.communicate(timeout=60)
    assert client.returncode == 1, (stdout, stderr)
    assert "cannot reach the voice server" in stdout
    assert "Traceback" not in stderr, stderr


# --- pieces that need no audio devices -------------------------------------------------------------


def test_bad_events_are_error_lines_not_crashes():
    buf = io.StringIO()
    client = MicClient("ws://x", console=Console(buf))
    client._event("not json")
    client._event('{"type": "surprise"}')
    client._event('["a list"]')
    client._event('{"type": "transcript", "turn": 1}')  # no text / final
    client._event('{"type": "error", "turn": 1, "code": "bad_frame", "message": "oops"}')
    client._audio(b"\x00\x01\x02")
    client._event('{"type": "transcript", "turn": 1, "text": "hello", "final": true}')
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("error: the server sent malformed JSON")
    assert lines[1] == "error: unknown event 'surprise' from the server (ignored)"
    assert lines[2] == "error: unknown event None from the server (ignored)"
    assert lines[3].startswith("error: malformed transcript event")
    assert lines[4] == "server error: bad_frame: oops"
    assert lines[5].startswith("error: dropped a reply audio frame of odd length")
    assert lines[6] == "you: hello"


def test_player_plays_in_order_and_clear_drops():
    player = Player()
    player.push(b"\x01\x00" * 3)
    out = bytearray(4)
    player.callback(out, 2, None, None)
    assert bytes(out) == b"\x01\x00\x01\x00" and player.pending == 2
    player.push(b"\x02\x00" * 10)
    assert player.clear() == 22 and player.pending == 0
    player.callback(out, 2, None, None)
    assert bytes(out) == b"\x00" * 4  # silence when empty
    assert player.played == 4 and player.dropped == 22


@pytest.mark.parametrize("rate", [16000, 44100, 48000])
def test_framer_makes_20ms_frames_at_16k(rate):
    framer = Framer(rate)
    t = np.arange(rate) / rate  # one second of a 440 Hz tone, in 10 ms blocks
    tone = (np.sin(2 * np.pi * 440 * t) * 10000).astype("<i2")
    frames = [f for i in range(0, rate, rate // 100) for f in framer.push(tone[i:i + rate // 100].tobytes())]
    assert all(len(f) == FRAME_BYTES for f in frames)
    assert 48 <= len(frames) <= 50  # 1 s, less what the resampler still holds
    out = np.frombuffer(b"".join(frames), dtype="<i2").astype(np.float32)
    spectrum = np.abs(np.fft.rfft(out[1600:]))
    assert abs(np.argmax(spectrum) * 16000 / len(out[1600:]) - 440) < 5


def test_echo_canceller_removes_what_was_played_and_keeps_the_user():
    """The played reply comes back 10 dB under after 50 ms; the user talks over it from 6 s on."""
    reply = np.concatenate([np.frombuffer(speech(n), dtype="<i2") for n in ("005.wav", "002.wav", "goforward.wav")])
    user = np.frombuffer(speech("003.wav"), dtype="<i2").astype(np.float32)
    n, at = len(reply) + 16000, 6 * 16000
    heard = np.zeros(n, np.float32)
    heard[800:800 + len(reply)] = reply * 10 ** (-10 / 20)
    heard[at:at + len(user)] += user
    played = np.concatenate([reply, np.zeros(n - len(reply), "<i2")])
    echo = EchoCanceller(48000)
    out = []
    for i in range(0, n - 319, 320):  # as the streams run: 20 ms played (at 48 kHz), 20 ms heard
        echo.played(soxr.resample(played[i:i + 320], 16000, 48000).astype("<i2").tobytes())
        out.append(echo.heard(np.clip(heard[i:i + 320], -32768, 32767).astype("<i2").tobytes()))
    sent = np.frombuffer(b"".join(out), dtype="<i2").astype(np.float32)
    erle = _db(heard[3 * 16000:at]) - _db(sent[3 * 16000:at])
    assert erle >= 15, f"ERLE {erle:.1f} dB"
    assert abs(_db(sent[at:at + len(user)]) - _db(user)) <= 4
