"""/twilio end to end: a client that speaks Twilio Media Streams message for message.

It behaves like Twilio's side of a bidirectional `<Connect><Stream>`: `connected`, `start`, a
`media` message of 20 ms of base64 µ-law every 20 ms (with chunk and timestamp), `dtmf`,
`stop`; it "plays" the media the server sends in real time and echoes each `mark` once the
audio queued before it has played, and on `clear` drops its queue and returns the pending
marks at once (as Twilio does). The server is the real service with the real models.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
import urllib.request

import numpy as np
import pytest
from liveserver import serving
import websockets

from voice.audio import read_wav, resample, ulaw_decode, ulaw_encode, float_to_int16
from voice.clients.bench import normalise
from voice.config import Config
from voice.service.server import build_app
from voice.transports.telephony import calls
from fakes import REAL_REPLY_TOKENS
from fakes import SPEECH

RATE = 8000
FRAME = 160  # 20 ms of 8 kHz µ-law
SILENCE = b"\xff" * FRAME  # µ-law zero
TIMEOUT = 90.0  # two shared CPU cores run ASR, LM and TTS

pytestmark = [
    pytest.mark.slow,
    # uvicorn warns that its legacy `websockets` implementation (the one `voice serve` uses) is deprecated
    pytest.mark.filterwarnings("ignore::uvicorn.config.UvicornDeprecationWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


class Service:
    def __init__(self, port: int):
        self.port = port
        self.url = f"ws://127.0.0.1:{port}/twilio"

    def metric(self, line_start: str) -> float | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(line_start):
                    return float(line.rsplit(" ", 1)[1])
        return None


@pytest.fixture(scope="module")
def service(real_instance):
    config = Config()
    config.lm.max_new_tokens = REAL_REPLY_TOKENS
    with serving(build_app(config, real_instance(config))) as port:
        yield Service(port)


def ulaw_clip(name: str) -> bytes:
    audio, rate = read_wav(SPEECH / name)
    return ulaw_encode(float_to_int16(resample(audio, rate, RATE)))


def record_for(sid: str):
    found = [r for r in calls.find("twilio") if r.id == sid]
    return found[-1] if found else None


class FakeTwilio:
    """Twilio's end of one Media Stream."""

    def __init__(self, ws, sid: str):
        self.ws, self.sid = ws, sid
        self.call_sid = "CA" + sid[2:]
        self.seq = 0
        self.received: list[tuple[float, dict]] = []  # (arrival, message)
        self.mic: list[bytes] = []  # queued µ-law frames to "say"
        self.chunk = 0
        self.t0 = 0.0
        self.play_end = 0.0  # when the audio queued so far will have played
        self.pending_marks: list[tuple[float, str]] = []  # (due, name)
        self.tasks: list[asyncio.Task] = []

    async def send(self, event: str, **body) -> None:
        self.seq += 1
        msg = {"event": event, "sequenceNumber": str(self.seq), **body}
        if event != "connected":
            msg["streamSid"] = self.sid
        await self.ws.send(json.dumps(msg))

    async def start(self) -> None:
        await self.ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await self.send("start", start={
            "accountSid": "AC" + "0" * 32, "streamSid": self.sid, "callSid": self.call_sid, "tracks": ["inbound"],
            "customParameters": {"caller": "pytest"},
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": RATE, "channels": 1}})
        self.t0 = time.monotonic()
        self.tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._mic()),
                      asyncio.create_task(self._marks())]

    def say(self, ulaw: bytes) -> None:
        self.mic += [ulaw[i:i + FRAME].ljust(FRAME, b"\xff") for i in range(0, len(ulaw), FRAME)]

    async def _mic(self) -> None:
        """A media message every 20 ms: queued speech, else silence."""
        try:
            while True:
                payload = self.mic.pop(0) if self.mic else SILENCE
                self.chunk += 1
                await self.send("media", media={"track": "inbound", "chunk": str(self.chunk),
                                                "timestamp": str((self.chunk - 1) * 20),
                                                "payload": base64.b64encode(payload).decode()})
                await asyncio.sleep(max(0.0, self.t0 + self.chunk * 0.02 - time.monotonic()))
        except websockets.ConnectionClosed:
            pass

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                now = time.monotonic()
                msg = json.loads(raw)
                self.received.append((now, msg))
                if msg["event"] == "media":
                    self.play_end = max(self.play_end, now) + 0.02
                elif msg["event"] == "mark":
                    self.pending_marks.append((max(self.play_end, now), msg["mark"]["name"]))
                elif msg["event"] == "clear":
                    self.play_end = now
                    self.pending_marks = [(now, name) for _, name in self.pending_marks]
        except websockets.ConnectionClosed:
            pass

    async def _marks(self) -> None:
        """Echo each mark when the audio before it has played."""
        try:
            while True:
                now = time.monotonic()
                due = [m for m in self.pending_marks if m[0] <= now]
                self.pending_marks = [m for m in self.pending_marks if m[0] > now]
                for _, name in due:
                    await self.send("mark", mark={"name": name})
                await asyncio.sleep(0.01)
        except websockets.ConnectionClosed:
            pass

    def events(self, kind: str) -> list[tuple[float, dict]]:
        return [(t, m) for t, m in self.received if m["event"] == kind]

    async def wait(self, pred, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"timed out; received {[m['event'] for _, m in self.received][-20:]}"
            assert not self.tasks[0].done(), "the server closed the socket"
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        await self.send("stop", stop={"accountSid": "AC" + "0" * 32, "callSid": self.call_sid})
        self.tasks[1].cancel()
        self.tasks[2].cancel()
        await asyncio.wait_for(self.tasks[0], 10)  # the server closes the socket after `stop`


def connect(service: Service):
    return websockets.connect(service.url, max_size=None, open_timeout=30)


def check_media_shape(msg: dict, sid: str) -> bytes:
    assert set(msg) == {"event", "streamSid", "media"} and msg["streamSid"] == sid
    assert set(msg["media"]) == {"payload"}
    ulaw = base64.b64decode(msg["media"]["payload"], validate=True)
    assert len(ulaw) == FRAME, "outbound media must be 20 ms frames"
    return ulaw


def test_call_is_answered_with_paced_audio_and_marks(service):
    sid = "MZ" + "1" * 32

    async def call():
        async with connect(service) as ws:
            twilio = FakeTwilio(ws, sid)
            await twilio.start()
            twilio.say(ulaw_clip("005.wav"))
            # the reply is over when the server has recorded it and every mark it sent came back
            await twilio.wait(lambda: (r := record_for(sid)) is not None and r.replies
                              and twilio.events("mark") and not twilio.pending_marks)
            await asyncio.sleep(0.3)
            assert service.metric('voice_sessions_active{transport="twilio"}') == 1.0
            await twilio.stop()
            return twilio

    twilio = asyncio.run(call())
    media = twilio.events("media")
    marks = twilio.events("mark")
    assert media and marks
    audio = b"".join(check_media_shape(m, sid) for _, m in media)
    pcm = ulaw_decode(audio).astype(np.float32) / 32768
    assert float(np.sqrt(np.mean(pcm ** 2))) > 0.01, "the reply audio is silent"
    # real-time pacing: the frames arrive over (about) as long as they play, not in a burst
    span = media[-1][0] - media[0][0]
    assert span > 0.8 * (len(media) * 0.02 - 0.2), f"{len(media)} frames arrived in {span:.2f} s"
    for _, m in marks:
        assert set(m) == {"event", "streamSid", "mark"} and m["streamSid"] == sid
        assert re.fullmatch(r"s\d+-t\d+-p\d+", m["mark"]["name"])
    assert marks[-1][0] >= media[-1][0] - 0.001, "a mark follows the audio it marks"
    assert not twilio.events("clear")

    record = record_for(sid)
    assert record.ended is not None and record.end_reason == "caller_hangup"
    assert "spades" in record.transcripts[0].lower() and "hearts" in record.transcripts[0].lower()
    assert record.replies[0].strip()
    assert record.heard, "echoed marks are recorded as heard phrases"
    reply = " ".join(record.replies[0].split())
    assert all(" ".join(phrase.split()) in reply for phrase in record.heard)
    assert record.meta["customParameters"] == {"caller": "pytest"}
    assert record.counters["marks_played"] == record.counters["marks_sent"] == len(marks)
    assert record.counters["frames_out"] == len(media)
    assert not [k for k in record.counters if k.startswith("dropped_")]
    assert record.latency and record.latency[0]["voice_to_voice"] > 0
    print(f"\ntwilio latency: {record.latency[0]}")
    assert service.metric('voice_sessions_active{transport="twilio"}') == 0.0



def test_keys_pressed_are_a_turn_and_a_key_stops_the_reply(service):
    """`1 2 #` is one turn that reaches the LM at once (its `lm_asked` mark: since the `#`); a key
    pressed while the reply plays clears it, and on its own becomes a turn after the pause."""
    sid = "MZ" + "6" * 32

    async def call():
        async with connect(service) as ws:
            twilio = FakeTwilio(ws, sid)
            await twilio.start()
            for key in "12#":
                await twilio.send("dtmf", dtmf={"track": "inbound_track", "digit": key})
            await twilio.wait(lambda: (r := record_for(sid)) is not None and r.transcripts)
            await twilio.wait(lambda: twilio.events("media"))  # the reply plays
            pressed = time.monotonic()
            await twilio.send("dtmf", dtmf={"track": "inbound_track", "digit": "9"})
            await twilio.wait(lambda: twilio.events("clear"))
            cleared = twilio.events("clear")[0][0] - pressed
            await twilio.wait(lambda: len(record_for(sid).transcripts) == 2)
            paused = time.monotonic() - pressed
            await twilio.wait(lambda: len(record_for(sid).replies) == 2 and not twilio.pending_marks)
            await twilio.stop()
            return cleared, paused

    cleared, paused = asyncio.run(call())
    record = record_for(sid)
    assert record.dtmf == ["1", "2", "#", "9"]
    assert record.transcripts == ["(keypad) The caller pressed 1 2.", "(keypad) The caller pressed 9."]
    asked = [m["work"]["lm_asked"] for m in record.marks]
    print(f"\nkeypad: LM asked {asked} ms after the sequence ended; a key cleared the reply in {cleared * 1000:.0f} ms"
          f" (from the client); the lone key was a turn {paused:.2f} s after it")
    assert all(ms < 100 for ms in asked), asked
    assert cleared < 0.5
    assert 2.0 <= paused < 3.0  # session.keypad_pause_s

def test_barge_in_sends_clear(service):
    sid = "MZ" + "2" * 32

    async def call():
        async with connect(service) as ws:
            twilio = FakeTwilio(ws, sid)
            await twilio.start()
            twilio.say(ulaw_clip("005.wav"))
            await twilio.wait(lambda: twilio.events("media"))
            heard_at_barge_in = time.monotonic()
            twilio.say(ulaw_clip("forever.wav"))  # the caller talks over the reply
            await twilio.wait(lambda: twilio.events("clear"))
            # the second utterance is answered too
            await twilio.wait(lambda: len(record_for(sid).transcripts) >= 2 and len(record_for(sid).replies) >= 2)
            await twilio.stop()
            return twilio, heard_at_barge_in

    twilio, barge_in = asyncio.run(call())
    (t_clear, clear), = twilio.events("clear")[:1]
    assert clear == {"event": "clear", "streamSid": sid}
    assert t_clear > barge_in
    first_media = twilio.events("media")[0][0]
    assert first_media < t_clear
    record = record_for(sid)
    assert record.counters["clears"] >= 1
    assert "forever" in record.transcripts[1].lower() or "days" in record.transcripts[1].lower()
    # marks for audio that `clear` dropped come back but are not counted as heard
    assert record.counters["marks_played"] + record.counters["marks_cleared"] <= record.counters["marks_sent"]


def test_bad_input_is_dropped_and_the_call_goes_on(service):
    sid = "MZ" + "3" * 32
    dropped = 'voice_telephony_dropped_total{reason="%s",transport="twilio"}'
    before = service.metric(dropped % "before_start") or 0.0

    async def call():
        async with connect(service) as ws:
            good = base64.b64encode(SILENCE).decode()
            await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            await ws.send(json.dumps({"event": "media", "sequenceNumber": "1", "streamSid": sid,
                                      "media": {"track": "inbound", "chunk": "1", "timestamp": "0", "payload": good}}))
            twilio = FakeTwilio(ws, sid)
            await twilio.start()
            for bad in ["{not json", json.dumps(["a", "list"]), json.dumps({"event": "bogus", "streamSid": sid}),
                        json.dumps({"event": "media", "streamSid": sid, "media": {"payload": "!!not base64!!"}}),
                        json.dumps({"event": "media", "streamSid": sid, "media": {"chunk": "9"}}),
                        json.dumps({"event": "mark", "streamSid": sid, "mark": {"name": "never-sent"}}),
                        json.dumps({"event": "dtmf", "streamSid": sid, "dtmf": {}})]:
                await ws.send(bad)
            await ws.send(b"\x00\x01binary")
            twilio.say(ulaw_clip("001.wav"))
            await twilio.wait(lambda: (r := record_for(sid)) is not None and r.replies and twilio.events("media"))
            await twilio.stop()
            return twilio

    asyncio.run(call())
    record = record_for(sid)
    c = record.counters
    assert record.end_reason == "caller_hangup"
    assert (c["dropped_bad_json"], c["dropped_bad_message"], c["dropped_unknown_event"], c["dropped_bad_base64"],
            c["dropped_bad_media"], c["dropped_unknown_mark"], c["dropped_bad_dtmf"], c["dropped_binary_frame"]) \
        == (1, 1, 1, 1, 1, 1, 1, 1)
    # "ten of clubs" ("clubs" may be heard "cloves" or "close", by CPU class)
    assert record.transcripts and normalise(record.transcripts[0]).startswith("ten of"), record.transcripts
    assert c["media_in"] > 50
    assert service.metric(dropped % "before_start") == before + 1
    assert service.metric(dropped % "bad_base64") >= 1
    assert service.metric('voice_sessions_active{transport="twilio"}') == 0.0
