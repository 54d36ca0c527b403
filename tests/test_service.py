"""The voice service end to end: a real uvicorn server, real websockets, the real default models.

One server (and one copy of the models) serves the whole module. Clients stream real speech
from tests/speech in 20 ms PCM16 frames like a microphone: a clip, then silence for as
long as the connection is open (the VAD needs trailing silence to find the end of speech).
Where timing matters (latency, barge-in) the "microphone" runs in real time; elsewhere it runs
faster than real time, which the VAD and ASR do not mind.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import time
import urllib.request

import pytest
from liveserver import serving
import websockets

from voice.audio import float_to_pcm16, pcm16_to_float, read_wav, resample, rms_dbfs
from voice.clients.bench import normalise
from voice.config import Config
from voice.conversation.latency import STAGES
from voice.service.server import build_app
from fakes import REAL_REPLY_TOKENS
from fakes import SPEECH

EVERY_TURN = set(STAGES) - {"tool"}  # the tool stage is only in turns that call tools

RATE = 16000
FRAME = RATE * 20 // 1000  # samples in a 20 ms frame
SILENCE = bytes(2 * FRAME)
TIMEOUT = 90.0  # generous: two shared CPU cores run ASR, LM and TTS for every session

pytestmark = [
    pytest.mark.slow,
    # uvicorn warns that its legacy `websockets` implementation (the one `voice serve` uses) is deprecated
    pytest.mark.filterwarnings("ignore::uvicorn.config.UvicornDeprecationWarning"),
    pytest.mark.filterwarnings("ignore:websockets.legacy is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:remove second argument of ws_handler:DeprecationWarning"),
]


# --- the server ---------------------------------------------------------------------------------


class Service:
    def __init__(self, config: Config, port: int):
        self.config, self.port = config, port
        self.url = f"ws://127.0.0.1:{port}/ws"

    def get(self, path: str) -> tuple[int, str, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return r.status, r.headers.get("content-type", ""), r.read().decode()

    def metric(self, line_start: str) -> float | None:
        """The value of the first /metrics sample line starting with `line_start`."""
        for line in self.get("/metrics")[2].splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
        return None


@pytest.fixture(scope="module")
def service(real_instance):
    config = Config()
    config.lm.max_new_tokens = REAL_REPLY_TOKENS
    with serving(build_app(config, real_instance(config))) as port:
        yield Service(config, port)


# --- the client ---------------------------------------------------------------------------------


def clip(name: str) -> bytes:
    audio, rate = read_wav(SPEECH / name)
    return float_to_pcm16(resample(audio, rate, RATE))


def start_message(**fields) -> str:
    return json.dumps({"type": "start", "version": 1, "sample_rate": RATE, "output_sample_rate": RATE,
                       "encoding": "pcm_s16le", **fields})


def event(kind: str, **fields):
    """Predicate: a JSON event of type `kind` whose fields equal `fields`."""
    return lambda m: isinstance(m, dict) and m.get("type") == kind and all(m.get(k) == v for k, v in fields.items())


def is_audio(m) -> bool:
    return isinstance(m, bytes)


class Client:
    """A websocket session that records everything the server sends, in order."""

    def __init__(self, ws):
        self.ws = ws
        self.log: list[dict | bytes] = []
        self.times: list[float] = []  # time.monotonic() each message arrived
        self.reader = asyncio.create_task(self._read())
        self.mic: asyncio.Task | None = None
        self.frames: collections.deque[bytes] = collections.deque()

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                self.times.append(time.monotonic())
                self.log.append(msg if isinstance(msg, bytes) else json.loads(msg))
        except websockets.ConnectionClosed:
            pass

    async def start(self, **fields) -> dict:
        since = len(self.log)
        await self.ws.send(start_message(**fields))
        ready = self.log[await self.wait_for(lambda m: True, 30, since)]
        assert ready.get("type") == "ready", ready
        return ready

    def listen(self, speed: float = 1.0) -> None:
        """Start the microphone: queued speech, else silence, `speed` x real time, until closed."""

        async def run():
            t0, sent = time.monotonic(), 0
            try:
                while True:
                    await self.ws.send(self.frames.popleft() if self.frames else SILENCE)
                    sent += 1
                    await asyncio.sleep(max(0.0, t0 + sent * 0.02 / speed - time.monotonic()))
            except websockets.ConnectionClosed:
                pass

        self.mic = asyncio.create_task(run())

    def say(self, pcm: bytes) -> None:
        self.frames.extend(pcm[i:i + 2 * FRAME] for i in range(0, len(pcm), 2 * FRAME))

    async def close(self) -> None:
        if self.mic is not None:
            self.mic.cancel()
        await self.ws.close()
        await self.reader

    async def wait_for(self, pred, timeout: float = TIMEOUT, since: int = 0) -> int:
        """Index in `log` of the first message from `since` on that satisfies `pred`."""
        deadline, i = time.monotonic() + timeout, since
        while True:
            while i < len(self.log):
                if pred(self.log[i]):
                    return i
                i += 1
            if self.reader.done():
                raise AssertionError(f"connection closed while waiting; received {self.summary()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s; received {self.summary()}")
            await asyncio.sleep(0.01)

    def playback_end(self) -> float:
        """When a client playing reply audio as it arrives (never ahead of time) would be done."""
        end = 0.0
        for t, m in zip(self.times, self.log):
            if isinstance(m, bytes):
                end = max(end, t) + len(m) / 2 / RATE
        return end

    def events(self, kind: str | None = None, lo: int = 0, hi: int | None = None) -> list[dict]:
        return [m for m in self.log[lo:hi] if isinstance(m, dict) and (kind is None or m["type"] == kind)]

    def audio(self, lo: int = 0, hi: int | None = None) -> bytes:
        return b"".join(m for m in self.log[lo:hi] if isinstance(m, bytes))

    def summary(self) -> list:
        out: list = []
        for m in self.log:
            if isinstance(m, bytes):
                if out and isinstance(out[-1], int):
                    out[-1] += len(m)
                else:
                    out.append(len(m))
            else:
                out.append({k: v for k, v in m.items() if k != "marks_ms"})
        return out


def connect(service: Service):
    return websockets.connect(service.url, max_size=None, open_timeout=30)


def assert_audible(pcm: bytes) -> None:
    assert pcm and len(pcm) % 2 == 0
    assert len(pcm) / 2 / RATE > 0.1, f"only {len(pcm)} bytes of reply audio"
    assert rms_dbfs(pcm16_to_float(pcm)) > -40.0


def words(text: str) -> list[str]:
    return text.split()


LATENCIES: list[dict] = []  # stages_ms of the turns below, printed for the record (pytest -s)


# --- 1. a whole turn --------------------------------------------------------------------------


def test_end_to_end_turn(service):
    async def scenario():
        async with connect(service) as ws:
            c = Client(ws)
            ready = await c.start()
            assert ready["version"] == 1 and ready["sample_rate"] == RATE and ready["encoding"] == "pcm_s16le"
            assert isinstance(ready["session_id"], str) and ready["session_id"]
            c.listen(speed=1.0)  # real time: the latency numbers mean something
            c.say(clip("005.wav"))
            await c.wait_for(event("latency"))
            await c.close()
            return c

    c = asyncio.run(scenario())
    kinds = [m["type"] for m in c.events()]
    order = ["ready", "speech_started", "speech_stopped", "reply", "reply_done", "latency"]
    assert [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order), kinds
    assert not c.events("error"), c.events("error")
    assert all(m.get("turn") == 1 for m in c.events()[1:]), c.summary()

    transcripts = c.events("transcript")
    finals = [t for t in transcripts if t["final"]]
    assert len(finals) == 1 and transcripts[-1] is finals[0], transcripts  # partials (if any) come first
    final = finals[0]["text"].lower()
    assert "spades" in final and "hearts" in final, final
    assert c.log.index(finals[0]) > c.log.index(c.events("speech_stopped")[0])

    replies = c.events("reply")
    assert [r["block"] for r in replies] == list(range(1, len(replies) + 1))
    assert all(isinstance(r["text"], str) and r["tokens"] >= 0 and r["steps"] >= 0 for r in replies)
    tokens = [r["tokens"] for r in replies]
    assert tokens == sorted(tokens)
    done = c.events("reply_done")
    assert len(done) == 1 and done[0]["interrupted"] is False
    assert done[0]["text"] == "".join(r["text"] for r in replies).strip()
    assert done[0]["heard"] == done[0]["text"]  # played to the end: everything was heard

    i_reply = c.log.index(replies[0])
    i_done = c.log.index(done[0])
    assert not c.audio(0, i_reply), "reply audio before any reply text"
    assert_audible(c.audio(i_reply, i_done))
    assert not c.audio(i_done), "reply audio after reply_done"
    assert c.times[i_done] > c.playback_end() - 0.1, "reply_done before the reply finished playing"

    latency = c.events("latency")[0]
    stages = latency["stages_ms"]
    assert EVERY_TURN <= set(stages), stages
    assert all(isinstance(v, (int, float)) and v >= 0 for v in stages.values()), stages
    assert latency["voice_to_voice_ms"] == stages["voice_to_voice"]
    parts = sum(stages[s] for s in ("endpoint", "asr", "lm_first_block", "tts_first_audio", "send"))
    assert abs(parts - stages["voice_to_voice"]) < 1.0  # the stages tile end of speech -> first audio
    assert latency["marks_ms"]["speech_end"] == 0 and isinstance(latency["marks_ms"]["lm_blocks"], list)
    assert set(latency["over_budget"]) <= set(STAGES)
    LATENCIES.append({"test": "end_to_end", **stages})
    print(f"\nend-to-end: heard {finals[0]['text']!r}, replied {done[0]['text']!r} in {len(replies)} blocks; "
          f"latency (ms) {stages}; over budget: {latency['over_budget']}")


# --- 2. barge-in --------------------------------------------------------------------------------


def test_keys_pressed_are_a_turn(service):
    """`dtmf` 3 then #: one turn, answered like a transcript; the latency report starts at the #."""
    async def scenario():
        async with connect(service) as ws:
            c = Client(ws)
            await c.start()
            for key in "3#":
                await ws.send(json.dumps({"type": "dtmf", "digit": key}))
            await c.wait_for(event("latency"))
            await c.close()
            return c

    c = asyncio.run(scenario())
    assert not c.events("error"), c.events("error")
    assert [t["text"] for t in c.events("transcript")] == ["(keypad) The caller pressed 3."]
    assert c.events("reply_done")[0]["text"]
    marks = c.events("latency")[0]["marks_ms"]
    assert marks["final_transcript"] == 0 and marks["work"]["lm_asked"] < 100, marks


def test_barge_in_interrupts_reply_and_next_turn_proceeds(service):
    async def scenario():
        async with connect(service) as ws:
            c = Client(ws)
            # AR mode: a sensible, several-second reply, so there is something to interrupt
            await c.start(session={"lm_mode": "ar"})
            c.listen(speed=1.0)  # real time: "still playing" is judged against the wall clock
            c.say(clip("001.wav"))
            first_audio = await c.wait_for(is_audio)
            c.say(clip("goforward.wav"))  # the user talks over the reply at once
            clear = await c.wait_for(event("clear"), since=first_audio)
            interrupted = await c.wait_for(event("reply_done", turn=1))
            final2 = await c.wait_for(event("transcript", turn=2, final=True), since=clear)
            reply2 = await c.wait_for(event("reply", turn=2), since=final2)
            await c.wait_for(is_audio, since=reply2)
            await asyncio.sleep(0.5)  # a little more of the second reply's audio
            await c.close()
            return c, first_audio, clear, interrupted, final2, reply2

    c, first_audio, clear, interrupted, final2, reply2 = asyncio.run(scenario())
    assert not c.events("error"), c.events("error")
    # "ten of clubs" ("clubs" is heard "cloves" on AVX2's kernels and "close" on AVX-512's)
    heard1 = [t for t in c.events("transcript") if t["final"] and t["turn"] == 1][0]["text"]
    assert normalise(heard1).startswith("ten of"), heard1

    assert c.log[clear]["turn"] == 1
    started2 = c.log.index(next(e for e in c.events("speech_started") if e["turn"] == 2))
    assert first_audio < started2 < clear  # the barge-in is the second utterance, once it is speech

    done = c.log[interrupted]
    assert done["interrupted"] is True, done
    heard, text = words(done["heard"]), words(done["text"])
    assert text and heard == text[:len(heard)], done  # heard: a word-wise prefix of what the LM said
    assert len(c.events("reply_done", 0, final2)) == 1  # one reply_done per turn

    # `clear` is final: no more audio of turn 1 after it, and turn 2 gets its own
    assert not c.audio(clear, reply2), "turn-1 audio after clear"
    assert "forward" in c.log[final2]["text"].lower()
    assert c.log[reply2]["block"] == 1
    assert_audible(c.audio(reply2))
    assert service.metric("voice_barge_ins_total") >= 1


def test_barge_in_after_the_whole_reply_was_sent_while_it_still_plays(service):
    """The client holds the whole reply and is still playing it: that is still an interruption."""

    async def scenario():
        async with connect(service) as ws:
            c = Client(ws)
            await c.start(session={"lm_mode": "ar"})
            c.listen(speed=1.0)
            c.say(clip("005.wav"))  # its AR reply ends in a long phrase: seconds to interrupt
            await c.wait_for(is_audio)
            while True:  # until nothing more arrives (all of the reply is here) while it still plays
                n = len(c.log)
                await asyncio.sleep(0.4)
                left = c.playback_end() - time.monotonic()
                if len(c.log) == n and left > 0.7:
                    break
                if c.events("reply_done") and left <= 0.7:
                    await c.close()
                    pytest.skip("this machine took about as long to make the reply's audio as to play it")
            talk = len(c.log)
            c.say(clip("goforward.wav"))
            clear = await c.wait_for(event("clear"), since=talk)
            done = await c.wait_for(event("reply_done", turn=1))
            await c.close()
            return c, talk, clear, done, left

    c, talk, clear, done, left = asyncio.run(scenario())
    print(f"\nlate barge-in with {left:.1f} s of the reply still to play")
    assert not c.events("error"), c.events("error")
    assert not c.events("reply_done", 0, talk), "reply_done before the reply finished playing"
    assert talk <= clear < done and c.log[clear]["turn"] == 1
    ev = c.log[done]
    heard, text = words(ev["heard"]), words(ev["text"])
    assert ev["interrupted"] is True, ev
    assert len(heard) < len(text) and heard == text[:len(heard)], ev  # cut off mid-playback


# --- 3. concurrent sessions --------------------------------------------------------------------


def test_two_concurrent_sessions_keep_their_own_turns(service):
    async def session(name: str):
        async with connect(service) as ws:
            c = Client(ws)
            ready = await c.start()
            c.listen(speed=2.0)
            c.say(clip(name))
            await c.wait_for(event("reply_done"))
            await c.close()
            return ready["session_id"], c

    async def both():
        return await asyncio.gather(session("005.wav"), session("goforward.wav"))

    (id_a, a), (id_b, b) = asyncio.run(both())
    assert id_a != id_b
    for c in (a, b):
        assert not c.events("error"), c.events("error")
        assert len([t for t in c.events("transcript") if t["final"]]) == 1, c.summary()
        done = c.events("reply_done")[0]
        assert done["text"] == "".join(r["text"] for r in c.events("reply")).strip()
        assert_audible(c.audio(c.log.index(c.events("reply")[0])))
    final_a = next(t for t in a.events("transcript") if t["final"])["text"].lower()
    final_b = next(t for t in b.events("transcript") if t["final"])["text"].lower()
    assert "spades" in final_a, final_a
    assert "forward" in final_b and "spades" not in final_b, final_b


# --- 4. malformed input -------------------------------------------------------------------------


async def _still_transcribes(c: Client, since: int) -> int:
    """Say 'ten of clubs' (the microphone must be on); the index of its final transcript."""
    c.say(clip("001.wav"))
    return await c.wait_for(event("transcript", final=True), since=since)


@functools.cache
def _speech_head() -> bytes:
    """The first 1.5 s of 005.wav ("eight of spades...")."""
    return clip("005.wav")[: 2 * RATE * 3 // 2]


# each: what to send once the session is started, and the error it must get
NON_FATAL = {
    "bad_json": lambda cfg: "this is not json",
    "unknown_message": lambda cfg: json.dumps({"type": "pause"}),
    "unknown_message(not an object)": lambda cfg: "[1, 2, 3]",
    "already_started": lambda cfg: start_message(),
    "bad_dtmf": lambda cfg: json.dumps({"type": "dtmf"}),
    "bad_dtmf(not a key)": lambda cfg: json.dumps({"type": "dtmf", "digit": "x"}),
    # real speech in both, so a frame that was not dropped would show up in the next transcript
    "frame_too_large": lambda cfg: clip("005.wav")[: cfg.session.max_frame_bytes + 2],
    "bad_frame": lambda cfg: _speech_head() + b"\x00",
}


@pytest.mark.parametrize("case", list(NON_FATAL))
def test_bad_input_is_reported_and_the_session_continues(service, case):
    code = case.split("(")[0]
    bad = NON_FATAL[case](service.config)
    if isinstance(bad, bytes):
        assert len(bad) > service.config.session.max_frame_bytes or len(bad) % 2

    async def scenario():
        async with connect(service) as ws:
            c = Client(ws)
            await c.start()
            await ws.send(bad)
            err = await c.wait_for(event("error"))
            c.listen(speed=3.0)
            final = await _still_transcribes(c, err)
            await c.close()
            return c, err, final

    c, err, final = asyncio.run(scenario())
    assert c.log[err]["code"] == code and c.log[err]["message"], c.log[err]
    assert len(c.events("error")) == 1, c.events("error")
    text = c.log[final]["text"].lower()
    assert normalise(text).startswith("ten of") and "spades" not in text, text  # "clubs" may be "cloves", "close"


FATAL = {
    "bad_sample_rate": start_message(sample_rate=12345),
    "bad_sample_rate(output)": start_message(output_sample_rate=11025),
    "unsupported_version": start_message(version=2),
    "bad_encoding": start_message(encoding="opus"),
    "bad_session": start_message(session={"lm_mode": "fast"}),
    "bad_json": "{not json",
    "expected_start": json.dumps({"type": "hello"}),
}


@pytest.mark.parametrize("case", list(FATAL))
def test_bad_start_is_reported_and_closes_the_socket(service, case):
    async def scenario():
        async with connect(service) as ws:
            c = Client(ws)
            await ws.send(FATAL[case])
            await asyncio.wait_for(c.reader, 10)  # the server closes the socket
            close = (ws.close_code, ws.close_reason)
        async with connect(service) as ws:  # and serves the next client
            ready = await Client(ws).start()
        return c, close, ready

    c, close, ready = asyncio.run(scenario())
    code = case.split("(")[0]
    assert [m.get("type") for m in c.log] == ["error"] and c.log[0]["code"] == code, c.log
    assert close == (1008, code)
    assert ready["type"] == "ready"
    assert service.get("/healthz")[0] == 200


def test_audio_before_start_is_dropped_and_a_later_start_works(service):
    async def scenario():
        async with connect(service) as ws:
            c = Client(ws)
            await ws.send(_speech_head())  # speech, to show it is not kept for later
            await c.wait_for(event("error", code="expected_start"))
            await c.start()
            c.listen(speed=3.0)
            final = await _still_transcribes(c, 0)
            await c.close()
            return c, final

    c, final = asyncio.run(scenario())
    assert [m["type"] for m in c.events()][:2] == ["error", "ready"]
    assert len(c.events("error")) == 1
    text = c.log[final]["text"].lower()
    assert normalise(text).startswith("ten of") and "spades" not in text, text  # "clubs" may be "cloves", "close"


def test_abrupt_disconnects_mid_turn_leave_the_server_serving(service):
    pcm = clip("005.wav")

    async def scenario():
        # 1. half an utterance, then the TCP connection just drops (no close handshake)
        async with connect(service) as ws:
            c = Client(ws)
            await c.start()
            half = pcm[: len(pcm) // 2 // (2 * FRAME) * (2 * FRAME)]
            for i in range(0, len(half), 2 * FRAME):
                await ws.send(half[i:i + 2 * FRAME])
            await c.wait_for(event("speech_started"))
            ws.transport.abort()
        # 2. gone right after the final transcript, while the reply is being generated
        async with connect(service) as ws:
            c = Client(ws)
            await c.start()
            c.listen(speed=3.0)
            await _still_transcribes(c, 0)
            await c.close()
        # 3. a new session still gets a whole turn
        async with connect(service) as ws:
            c = Client(ws)
            await c.start()
            c.listen(speed=3.0)
            c.say(pcm)
            await c.wait_for(event("reply_done"))
            await c.close()
            return c

    c = asyncio.run(scenario())
    assert not c.events("error")
    assert "spades" in next(t for t in c.events("transcript") if t["final"])["text"].lower()
    assert_audible(c.audio())
    deadline = time.monotonic() + 10
    while service.metric('voice_sessions_active{transport="native"}') != 0:
        assert time.monotonic() < deadline, service.get("/metrics")[2]
        time.sleep(0.1)


# --- 5. health and metrics ---------------------------------------------------------------------


def test_healthz_and_metrics(service):
    status, ctype, body = service.get("/healthz")
    assert status == 200 and ctype.startswith("application/json")
    health = json.loads(body)
    # auto: lossless verify on PyTorch's AVX-512 kernels, else AR on llama.cpp's
    from engine.loading import resolve_quantize
    on_llamacpp = resolve_quantize(service.config.lm.quantize, "cpu", service.config.lm.model) == "gguf"
    assert health["status"] == "ok" and health["lm"] == "local"
    assert health["mode"] == ("ar" if on_llamacpp else "diffusion")
    decoding = health["decoding"]  # what runs, and why, as the engine decided at load
    assert decoding["mode"] == health["mode"] and decoding["why"]
    assert decoding["kernels"].startswith("llama.cpp, CPU variant" if on_llamacpp else "PyTorch")
    assert decoding["kernels"].endswith(".gguf") == on_llamacpp  # the weights file that runs

    async def turn():  # make sure at least one turn has been timed, whatever ran before
        async with connect(service) as ws:
            c = Client(ws)
            await c.start()
            c.listen(speed=3.0)
            c.say(clip("001.wav"))
            await c.wait_for(event("latency"))
            await c.close()
            return c

    c = asyncio.run(turn())
    LATENCIES.append({"test": "metrics (3x speed)", **c.events("latency")[0]["stages_ms"]})
    status, ctype, body = service.get("/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    assert "# TYPE voice_stage_seconds histogram" in body
    for stage in EVERY_TURN:
        count = service.metric(f'voice_stage_seconds_count{{stage="{stage}"}}')
        assert count is not None and count >= 1, stage
    assert service.metric("voice_turns_total") >= 1
    print("\nlatencies (ms):", *LATENCIES, sep="\n  ")
