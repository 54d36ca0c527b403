"""Faults, live fuzzing and a short soak against the real service (real models, one server).

* Fault injection: the live server's Instance get thin wrappers around the real LM, ASR and
  TTS that raise, hang or slow down on demand. Each faulty turn must end with an `error`
  naming the stage (and `apology: true`), the cached spoken apology as reply audio, a
  `reply_done` with `interrupted: true`; the failure is logged with the session id, /healthz
  says "degraded", and the next turn in the same session is normal.
* Live fuzzing (~30 examples per transport): hypothesis-generated start messages and binary
  frames on /ws, Twilio message sequences on /twilio, datagrams on the SIP port; afterwards
  the server still serves a well-formed session of each kind, and a full native turn.
* `voice soak` for about 45 s with 2 sessions: no lost turns, no errors, no leaked sessions
  or descriptors; the report is printed (pytest -s).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request

import pytest
import websockets
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import REAL_REPLY_TOKENS
from liveserver import serving
from fakes import SPEECH, speech
from strategies import INVITE, sip_datagrams, start_messages, twilio_messages
from voice.audio import pcm16_to_float, rms_dbfs
from voice.config import Config
from voice.service.server import build_app
from voice.service.instance import Instance

RATE = 16000
FRAME = 640
TIMEOUT = 90.0
LIVE = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
FIGURES: dict = {"faults_survived": 0, "fuzz_inputs": 0}

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


# --- fault wrappers around the real stages -------------------------------------------------------

class Faults:
    """What to break next: one of None, "lm_raise", "lm_hang", "lm_slow", "lm_slow_mid", "asr_raise",
    "asr_hang", "tts_raise", "tts_hang"."""
    mode: str | None = None


class FaultyLM:
    def __init__(self, real):
        self.real = real
        self.mode = real.mode

    def chat(self):
        return FaultyChat(self.real.chat())

    def fits(self, messages):
        return self.real.fits(messages)

    def serve(self, max_prefill_s, tools):
        self.real.serve(max_prefill_s, tools)

    def describe(self):
        return self.real.describe()

    def health(self):
        return self.real.health()


class FaultyChat:
    def __init__(self, real):
        self.real = real

    def close(self):
        self.real.close()

    async def prepare(self, messages, tools=None, aside=False):
        await self.real.prepare(messages, tools)

    async def reply(self, messages, mode=None, runs_out=None, tools=None):
        m = Faults.mode
        if m == "lm_raise":
            raise RuntimeError("injected LM failure")
        if m == "lm_hang":
            await asyncio.sleep(3600)
        n = 0
        async for block in self.real.reply(messages, mode, runs_out, tools):
            n += 1
            if m == "lm_slow" or (m == "lm_slow_mid" and n == 2):
                await asyncio.sleep(0.4 if m == "lm_slow" else 30)
            yield block


class FaultyWhisper:
    def __init__(self, real):
        self.real = real
        self.worker, self.speaking = real.worker, real.speaking  # the real one's queue

    def transcribe(self, audio, prefix=""):
        if Faults.mode == "asr_raise":
            raise RuntimeError("injected ASR failure")
        if Faults.mode == "asr_hang" and not prefix:
            time.sleep(4.0)  # a stuck decode (it does end: the ASR worker is shared)
        return self.real.transcribe(audio, prefix)

    def transcribe_final(self, audio):
        return self.transcribe(audio)  # (the faults, on the real one's fast decode)


class FaultySynth:
    def __init__(self, real):
        self.real = real
        self.voice_rate = real.voice_rate

    async def synthesize(self, text, out_rate, urgent=lambda: False):
        if Faults.mode == "tts_raise":
            raise RuntimeError("injected TTS failure")
        if Faults.mode == "tts_hang":
            await asyncio.sleep(3600)
        return await self.real.synthesize(text, out_rate, urgent)


# --- the server --------------------------------------------------------------------------------

def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, config: Config, instance: Instance, port: int):
        self.config, self.instance, self.port = config, instance, port
        self.url = f"ws://127.0.0.1:{port}"

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def wait_no_sessions(self, timeout: float = 15, sip: bool = False) -> None:
        """No sessions left (SIP calls set up by the fuzzer end on their own: no ACK -> BYE after 32 s)."""
        deadline = time.monotonic() + timeout
        while [s for s in self.instance.live if sip or s.transport != "sip"]:
            assert time.monotonic() < deadline, f"sessions left open: {[s.transport for s in self.instance.live]}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def service(tmp_path_factory, real_instance):
    config = Config()
    config.lm.max_new_tokens = REAL_REPLY_TOKENS
    config.records.path = str(tmp_path_factory.mktemp("records") / "r.sqlite3")
    config.sip.port = free_udp_port()
    config.sip.rtp_port_min, config.sip.rtp_port_max = 42000, 42099
    instance = real_instance(config)
    instance.lm, instance.whisper, instance.synthesizer = (FaultyLM(instance.lm), FaultyWhisper(instance.whisper),
                                                     FaultySynth(instance.synthesizer))
    with serving(build_app(config, instance)) as port:
        yield Service(config, instance, port)
    print("\nreliability figures:", json.dumps(FIGURES, indent=1))


class Client:
    def __init__(self, ws):
        self.ws = ws
        self.log: list = []
        self.frames: list[bytes] = []
        self.reader = asyncio.create_task(self._read())
        self.mic = asyncio.create_task(self._mic())

    async def _read(self):
        try:
            async for msg in self.ws:
                self.log.append(msg if isinstance(msg, bytes) else json.loads(msg))
        except websockets.ConnectionClosed:
            pass

    async def _mic(self):
        t0, n = time.monotonic(), 0
        try:
            while True:
                await self.ws.send(self.frames.pop(0) if self.frames else bytes(FRAME))
                n += 1
                await asyncio.sleep(max(0.0, t0 + n * 0.02 / 2 - time.monotonic()))  # 2x real time
        except websockets.ConnectionClosed:
            pass

    def say(self, name: str):
        pcm = speech(name)
        self.frames += [pcm[i:i + FRAME] for i in range(0, len(pcm), FRAME)]

    async def wait(self, pred, since: int = 0, timeout: float = TIMEOUT) -> int:
        deadline, i = time.monotonic() + timeout, since
        while time.monotonic() < deadline:
            while i < len(self.log):
                if isinstance(self.log[i], dict) and pred(self.log[i]):
                    return i
                i += 1
            assert not self.reader.done(), f"closed; got {self.summary()}"
            await asyncio.sleep(0.01)
        raise AssertionError(f"timed out; got {self.summary()}")

    def summary(self):
        return [m if isinstance(m, dict) else len(m) for m in self.log]

    def audio(self, lo: int, hi: int) -> bytes:
        return b"".join(m for m in self.log[lo:hi] if isinstance(m, bytes))

    async def close(self):
        self.mic.cancel()
        await self.ws.close()
        await self.reader


def kind(k, **fields):
    return lambda m: m.get("type") == k and all(m.get(a) == b for a, b in fields.items())


# --- 1. faults ---------------------------------------------------------------------------------

FAULTS = {  # mode: (expected code, stage, timeouts to shorten)
    "lm_raise": ("reply_failed", "lm", {}),
    "lm_hang": ("reply_timeout", "lm", {"lm_first_block_timeout_s": 3.0}),
    "lm_slow_mid": ("reply_timeout", "lm", {"lm_block_timeout_s": 3.0}),
    "asr_raise": ("asr_failed", "asr", {}),
    "asr_hang": ("asr_timeout", "asr", {"asr_timeout_s": 2.0}),
    "tts_raise": ("reply_failed", "tts", {}),
    "tts_hang": ("reply_timeout", "tts", {"tts_timeout_s": 3.0}),
}


@pytest.mark.parametrize("mode", list(FAULTS))
def test_a_failing_stage_ends_the_turn_with_an_apology_and_the_session_goes_on(service, mode, caplog):
    code, stage, timeouts = FAULTS[mode]
    faults = service.config.faults
    saved = {k: getattr(faults, k) for k in timeouts}
    apology = service.instance.apology[RATE]

    async def scenario():
        async with websockets.connect(service.url + "/ws", max_size=None, open_timeout=30) as ws:
            c = Client(ws)
            await ws.send(json.dumps({"type": "start", "sample_rate": RATE}))
            ready = c.log[await c.wait(kind("ready"), timeout=30)]
            Faults.mode = mode
            for k, v in timeouts.items():
                setattr(faults, k, v)
            c.say("001.wav")
            err = await c.wait(kind("error"))
            done = await c.wait(kind("reply_done"), err)
            lat = await c.wait(kind("latency"), done)
            Faults.mode = None
            for k, v in saved.items():
                setattr(faults, k, v)
            health = json.loads(service.get("/healthz")[1])
            await asyncio.sleep(0.5)
            c.say("goforward.wav")  # the next turn, no fault
            final2 = await c.wait(kind("transcript", final=True, turn=2), lat)
            done2 = await c.wait(kind("reply_done", turn=2), final2)
            await c.wait(kind("latency", turn=2), done2)
            await c.close()
            return c, ready, err, done, health, final2, done2

    try:
        c, ready, err, done, health, final2, done2 = asyncio.run(scenario())
    finally:
        Faults.mode = None
        for k, v in saved.items():
            setattr(faults, k, v)
    e = c.log[err]
    assert (e["code"], e["stage"], e["apology"], e["turn"]) == (code, stage, True, 1), e
    assert e["message"]
    tail = c.audio(err, done)
    assert tail.endswith(apology), f"{len(tail)} bytes after the error; the apology is {len(apology)}"
    assert rms_dbfs(pcm16_to_float(apology)) > -40
    d = c.log[done]
    assert d["interrupted"] is True and d["turn"] == 1
    assert "Sorry" not in d["heard"]  # the apology is not part of what the assistant "said"
    if stage == "asr":
        assert not [m for m in c.log[:done] if isinstance(m, dict) and m["type"] == "transcript" and m["final"]]
        assert d["text"] == "" and d["heard"] == ""
    assert health["status"] == "degraded" and health["faults"][stage] in ("error", "timeout"), health
    # the failure is logged with the session id
    sid = ready["session_id"]
    assert any(f"session={sid}" in r.getMessage() and code in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records][-10:]
    # and the session goes on: the next turn is normal
    assert "forward" in c.log[final2]["text"].lower()
    d2 = c.log[done2]
    assert d2["interrupted"] is False and d2["text"], d2
    assert len(c.audio(final2, done2)) > RATE * 2 * 0.1
    assert [m["code"] for m in c.log if isinstance(m, dict) and m["type"] == "error"] == [code]
    FIGURES["faults_survived"] += 1
    service.wait_no_sessions()


def test_a_slow_lm_under_its_timeout_is_only_late(service):
    async def scenario():
        async with websockets.connect(service.url + "/ws", max_size=None, open_timeout=30) as ws:
            c = Client(ws)
            await ws.send(json.dumps({"type": "start", "sample_rate": RATE}))
            await c.wait(kind("ready"), timeout=30)
            Faults.mode = "lm_slow"
            c.say("001.wav")
            lat = await c.wait(kind("latency"))
            await c.close()
            return c, lat

    try:
        c, lat = asyncio.run(scenario())
    finally:
        Faults.mode = None
    assert not [m for m in c.log if isinstance(m, dict) and m["type"] == "error"]
    done = next(m for m in c.log if isinstance(m, dict) and m["type"] == "reply_done")
    assert done["interrupted"] is False
    assert c.log[lat]["stages_ms"]["lm_first_block"] >= 400


def test_faults_are_counted_in_metrics(service):
    body = service.get("/metrics")[1]
    for stage in ("lm", "asr", "tts"):
        assert f'voice_stage_faults_total{{kind="error",stage="{stage}"}}' in body, stage
        assert f'voice_stage_faults_total{{kind="timeout",stage="{stage}"}}' in body, stage


# --- 2. live fuzzing ---------------------------------------------------------------------------

async def _native_once(url: str, text: str, frames: list[bytes]) -> list:
    got = []
    async with websockets.connect(url, max_size=None, open_timeout=30) as ws:
        await ws.send(text)
        try:
            first = json.loads(await asyncio.wait_for(ws.recv(), 15))
            got.append(first)
            if first["type"] == "ready":
                for f in frames:
                    await ws.send(f)
                await ws.send(json.dumps({"type": "pause"}))
                end = time.monotonic() + 2
                while time.monotonic() < end:  # every bad frame is answered; the session stays up
                    msg = await asyncio.wait_for(ws.recv(), 5)
                    if isinstance(msg, str):
                        got.append(json.loads(msg))
                        if got[-1].get("code") == "unknown_message":
                            break
            else:
                await asyncio.wait_for(ws.wait_closed(), 10)
                got.append(("closed", ws.close_code, ws.close_reason))
        except websockets.ConnectionClosed:
            got.append(("closed", ws.close_code, ws.close_reason))
    return got


@LIVE
@given(start_messages(), st.lists(st.one_of(st.binary(max_size=300), st.binary(min_size=64001, max_size=64003)),
                                  max_size=4))
def test_live_fuzz_native(service, text, frames):
    FIGURES["fuzz_inputs"] += 1 + len(frames)
    got = asyncio.run(asyncio.wait_for(_native_once(service.url + "/ws", text, frames), 60))
    first = got[0]
    if first["type"] == "ready":
        assert got[-1].get("code") == "unknown_message", got  # still answering after the frames
        for ev in got[1:-1]:
            assert ev["type"] == "error" and ev["code"] in ("bad_frame", "frame_too_large"), ev
    else:
        assert first["type"] == "error" and got[-1][1] == 1008 and got[-1][2] == first["code"], got


@LIVE
@given(st.lists(twilio_messages(), min_size=1, max_size=8))
def test_live_fuzz_twilio(service, messages):
    FIGURES["fuzz_inputs"] += len(messages)

    async def scenario():
        async with websockets.connect(service.url + "/twilio", max_size=None, open_timeout=30) as ws:
            for m in messages:
                await ws.send(m)
            await asyncio.sleep(0.05)

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert_still_serving(service)


@LIVE
@given(st.lists(sip_datagrams(), min_size=1, max_size=5))
def test_live_fuzz_sip(service, datagrams):
    FIGURES["fuzz_inputs"] += len(datagrams)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        for d in datagrams:
            s.sendto(d, ("127.0.0.1", service.config.sip.port))
        # anything answered comes back to us; drain it so nothing piles up
        s.settimeout(0.05)
        try:
            while True:
                s.recv(65536)
        except OSError:
            pass
    assert_still_serving(service)


def assert_still_serving(service) -> None:
    """After a fuzz example: HTTP answers and the SIP endpoint answers an OPTIONS."""
    status, _ = service.get("/healthz")
    assert status in (200, 503)  # 503: degraded by an earlier injected fault, still answering
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        options = INVITE.format(length=0, body="").replace("INVITE", "OPTIONS").replace("5099", str(port))
        options = options.replace("fuzz-call-1", "after-fuzz").replace("Content-Type: application/sdp\r\n", "")
        s.settimeout(10)
        s.sendto(options.encode(), ("127.0.0.1", service.config.sip.port))
        assert s.recv(65536).startswith(b"SIP/2.0 200 OK")


def test_after_fuzzing_every_transport_still_serves(service):
    assert_still_serving(service)

    async def twilio_call():
        async with websockets.connect(service.url + "/twilio", open_timeout=30) as ws:
            await ws.send(json.dumps({"event": "start", "streamSid": "MZafter", "start": {
                "streamSid": "MZafter", "callSid": "CA1",
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}))
            await asyncio.sleep(0.5)
            opened = any(s.transport == "twilio" for s in service.instance.live)
            await ws.send(json.dumps({"event": "stop", "streamSid": "MZafter"}))
            await asyncio.wait_for(ws.wait_closed(), 10)
            return opened

    assert asyncio.run(twilio_call())

    async def native_turn():
        async with websockets.connect(service.url + "/ws", max_size=None, open_timeout=30) as ws:
            c = Client(ws)
            await ws.send(json.dumps({"type": "start", "sample_rate": RATE}))
            await c.wait(kind("ready"), timeout=30)
            c.say("005.wav")
            await c.wait(kind("latency"))
            await c.close()
            return c

    c = asyncio.run(native_turn())
    final = next(m for m in c.log if isinstance(m, dict) and m["type"] == "transcript" and m["final"])
    assert "spades" in final["text"].lower()
    assert not [m for m in c.log if isinstance(m, dict) and m["type"] == "error"]
    service.wait_no_sessions()
    status, body = service.get("/healthz")
    assert status == 200 and json.loads(body)["records"]["failed"] == 0


# --- 3. soak -----------------------------------------------------------------------------------

def test_short_soak(service):
    from voice.clients.soak import soak
    lines: list[str] = []
    report = soak(service.url + "/ws", SPEECH, sessions=2, minutes=0.75, turn_timeout_s=TIMEOUT, interval_s=10,
                  say=lines.append)
    print("\n".join(lines[:-1]))
    FIGURES["soak"] = {k: report[k] for k in ("sessions_held", "turns", "lost_turns", "errors", "rss_mb", "fds",
                                              "p95_voice_to_voice_ms")}
    assert report["sessions_held"] == 2 and report["sessions_dropped"] == 0, report["close_codes"]
    assert report["turns"] >= 2 and report["lost_turns"] == 0, report
    assert report["errors"] == 0, report["error_codes"]
    assert report["fds"]["end"] <= report["fds"]["start"] + 8, report["fds"]
    service.wait_no_sessions(timeout=40, sip=True)  # by now the fuzzer's SIP calls have hung up too
    FIGURES["records_failed"] = json.loads(service.get("/healthz")[1])["records"]["failed"]
    assert FIGURES["records_failed"] == 0
