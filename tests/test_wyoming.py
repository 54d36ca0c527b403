"""The Wyoming server (voice/transports/wyoming.py) with the official `wyoming` client, around the
fake models of tests/fakes.py: every event type, the call records, and bad input. The real models
and `wyoming-bench` against the server are in tests/test_wyoming_live.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request

import numpy as np
import psutil
import pytest
from wyoming.asr import Transcribe, Transcript, TranscriptChunk
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.handle import Handled, HandledChunk, HandledStart, NotHandled
from wyoming.info import Describe, Info
from wyoming.ping import Ping, Pong
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeVoice

from fakes import FakeLM, FakeWhisper, LiveServer, fake_instance, make_config, speech
from liveserver import free_port, healthz, wyoming_exchange
from voice.service import records as rec


@pytest.fixture
def server(tmp_path):
    config = make_config(wyoming={"port": free_port(), "conversations": 2},
                         records={"path": str(tmp_path / "records.sqlite3")})
    lm = FakeLM(blocks=("The time", " is noon."))
    with LiveServer(config, fake_instance(config, FakeWhisper("what time is it"), lm=lm)) as srv:
        srv.lm = lm
        yield srv


def talk(srv, *events: Event, until: str) -> list[Event]:
    return wyoming_exchange(srv.config.wyoming.port, *events, until=until)


def types(events: list[Event]) -> list[str]:
    return [e.type for e in events if e.type != "audio-chunk"]


def test_describe_lists_the_three_programs(server):
    got = talk(server, Describe().event(), until="info")
    info = Info.from_event(got[-1])
    assert [p.name for p in info.asr] == ["diffusion-voice-asr"] and info.asr[0].supports_transcript_streaming
    assert info.asr[0].models[0].name == "tiny.en" and info.asr[0].models[0].languages == ["en"]
    assert info.tts[0].voices[0].name == "en_US-joe-medium" and info.tts[0].supports_synthesize_streaming
    assert info.handle[0].name == "diffusion-voice-assistant" and info.handle[0].models[0].name == "qwen2.5-1.5b"
    # Home Assistant is told how the LM decodes as the engine decided it, not a fixed claim
    said = {"ar": "autoregressive decoding", "diffusion": "drafted blocks verified losslessly"}[server.lm.mode]
    assert info.handle[0].description == f"a conversational assistant (qwen2.5-1.5b, {said})"
    assert talk(server, Ping(text="hi").event(), until="pong")[-1].data == Pong(text="hi").event().data


def test_home_assistant_is_told_what_decodes_an_endpoints_replies():
    """An LM elsewhere (`[lm] backend = "openai"`) decides its own decoding: Home Assistant is told
    so, not the mode asked of it (before: "drafted blocks verified losslessly" for any endpoint,
    llama.cpp's server included)."""
    from voice.transports.wyoming import info

    class EndpointLM(FakeLM):
        def describe(self):
            return None  # as RemoteLM: /healthz shows no `decoding` either

    described = info(fake_instance(make_config(), lm=EndpointLM())).handle[0].description
    assert described.endswith(", decoded by its endpoint)"), described


def test_speech_to_text(server):
    pcm = speech("001.wav")
    chunks = [AudioChunk(rate=16000, width=2, channels=1, audio=pcm[i:i + 2048]).event()
              for i in range(0, len(pcm), 2048)]
    got = talk(server, Transcribe(language="en").event(), AudioStart(rate=16000, width=2, channels=1).event(),
               *chunks, AudioStop().event(), until="transcript-stop")
    assert types(got)[0] == "transcript-start" and types(got)[-2:] == ["transcript", "transcript-stop"]
    assert Transcript.from_event(got[-2]).text == "what time is it"
    streamed = "".join(TranscriptChunk.from_event(e).text for e in got if e.type == "transcript-chunk")
    assert "what time is it".startswith(streamed)


def test_stereo_44k_audio_is_mixed_and_resampled(server):
    mono = np.frombuffer(speech("001.wav", 44100), dtype="<i2")
    stereo = np.repeat(mono, 2).tobytes()
    got = talk(server, AudioChunk(rate=44100, width=2, channels=2, audio=stereo[:400_000]).event(),
               AudioStop().event(), until="transcript-stop")  # no audio-start: the chunk says its format
    assert Transcript.from_event(got[-2]).text == "what time is it"


def test_text_to_speech_starts_with_the_first_phrase(server):
    text = "Sure, the kitchen lights are on now and the door is locked."
    got = talk(server, Synthesize(text=text).event(), until="audio-stop")
    assert types(got) == ["audio-start", "audio-stop"]
    start = AudioStart.from_event(got[0])
    audio = b"".join(AudioChunk.from_event(e).audio for e in got if e.type == "audio-chunk")
    assert (start.rate, start.width, start.channels) == (22050, 2, 1)
    # FakeSynth: 60 ms per character, phrase by phrase (its length tells the phrases were all spoken)
    assert len(audio) / 2 / 22050 == pytest.approx(0.06 * (len(text) - text.count(" ") + 1), abs=0.7)


def test_streamed_text_to_speech(server):
    parts = ["Sure, the kitchen ", "lights are on ", "now.", " And the door is locked."]
    got = talk(server, SynthesizeStart(voice=SynthesizeVoice(name="en_US-joe-medium")).event(),
               *[SynthesizeChunk(text=p).event() for p in parts], Synthesize(text="".join(parts)).event(),
               SynthesizeStop().event(), until="synthesize-stopped")
    assert types(got) == ["audio-start", "audio-stop", "synthesize-stopped"]
    assert sum(1 for e in got if e.type == "audio-chunk") > 10


def test_the_assistant_keeps_each_conversation(server):
    first = talk(server, Transcript(text="what time is it").event(), until="handled-stop")
    assert types(first) == ["handled-start", "handled-chunk", "handled-chunk", "handled", "handled-stop"]
    assert "".join(HandledChunk.from_event(e).text for e in first if e.type == "handled-chunk") == "The time is noon."
    handled = Handled.from_event(first[-2])
    assert handled.text == "The time is noon."
    conversation = handled.context["conversation_id"]
    again = talk(server, Transcript(text="and tomorrow?", context={"conversation_id": conversation}).event(),
                 until="handled-stop")
    assert Handled.from_event(again[-2]).context == {"conversation_id": conversation}
    assert HandledStart.from_event(again[0]).context == {"conversation_id": conversation}
    kept = server.app.state.wyoming.conversations.kept
    assert [m["content"] for m in kept[conversation][0]] == ["what time is it", "The time is noon.", "and tomorrow?",
                                                             "The time is noon."]
    for other in ("a", "b"):  # two more conversations: the first is forgotten, its chat closed
        talk(server, Transcript(text="hi", context={"conversation_id": other}).event(), until="handled-stop")
    assert list(kept) == ["a", "b"] and server.lm.closed == 1


def test_a_failing_lm_answers_not_handled_and_the_connection_goes_on(server):
    server.lm.fail_at = 0
    got = talk(server, Transcript(text="hello").event(), Describe().event(), until="info")
    assert types(got) == ["handled-start", "not-handled", "info"]
    assert NotHandled.from_event(got[1]).text


def test_a_failing_stage_under_wyoming_is_reported_in_healthz_as_under_ws(server):
    """The LM, the TTS and the ASR failing or overrunning their timeouts under Wyoming are stage faults
    (/healthz "degraded", `voice_stage_faults`), classified as /ws's are (voice/conversation/faults.py)."""
    assert healthz(server)["status"] == "ok"
    server.lm.fail_at = 0
    assert types(talk(server, Transcript(text="hello").event(), until="not-handled")) == ["handled-start",
                                                                                           "not-handled"]
    health = healthz(server)
    assert health["status"] == "degraded" and health["faults"] == {"lm": "error"}
    server.lm.fail_at, server.lm.hang_at = None, 1
    server.config.faults.lm_block_timeout_s = 0.3
    talk(server, Transcript(text="hello").event(), until="not-handled")
    server.lm.hang_at = None
    server.instance.synthesizer.fail = RuntimeError("injected TTS failure")
    got = talk(server, Synthesize(text="Hello there.").event(), until="error")
    assert Error.from_event(got[-1]).code == "tts_failed"
    server.instance.whisper.fail = RuntimeError("injected ASR failure")
    chunks = [AudioChunk(rate=16000, width=2, channels=1, audio=speech("001.wav")[:32000]).event()]
    got = talk(server, Transcribe().event(), AudioStart(rate=16000, width=2, channels=1).event(), *chunks,
               AudioStop().event(), until="error")
    assert Error.from_event(got[-1]).code == "asr_failed"
    assert healthz(server)["faults"] == {"lm": "timeout", "tts": "error", "asr": "error"}
    with urllib.request.urlopen(server.http + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    for stage, kind in (("lm", "error"), ("lm", "timeout"), ("tts", "error"), ("asr", "error")):
        assert f'voice_stage_faults_total{{kind="{kind}",stage="{stage}"}} 1.0' in metrics


def test_a_conversation_the_lm_cannot_take_is_no_fault_under_wyoming(server):
    """An LM failure this client caused (its conversation does not fit the context) answers
    not-handled, but the service is not degraded: the same classification as /ws's."""
    class ContextOverflow(Exception):
        pass

    async def overflowing(messages, mode=None, runs_out=None, tools=None):
        raise ContextOverflow("the conversation does not fit the context")
        yield

    server.lm.chat = lambda: type("Chat", (), {"reply": staticmethod(overflowing), "close": lambda self: None})()
    got = talk(server, Transcript(text="hello", context={"conversation_id": "long"}).event(), until="not-handled")
    assert types(got) == ["handled-start", "not-handled"]
    assert healthz(server)["status"] == "ok"


def test_requests_are_call_records(server):
    talk(server, Synthesize(text="Hello there.").event(), until="audio-stop")
    talk(server, Transcript(text="what time is it").event(), until="handled-stop")
    talk(server, Describe().event(), until="info")  # Home Assistant's polling is no session
    server.stop()
    sessions = rec.read_sessions(server.config.records.path)
    assert [s["transport"] for s in sessions] == ["wyoming", "wyoming"]
    turns = [s["turns"][0] for s in sessions]
    assert turns[0]["reply"] == "Hello there." and "tts_first_audio" in turns[0]["latency"]["stages"]
    assert (turns[1]["transcript"], turns[1]["reply"]) == ("what time is it", "The time is noon.")
    assert "lm_first_block" in turns[1]["latency"]["stages"]


@pytest.mark.parametrize("raw, code", [
    (b"this is not json\n", "bad_event"),
    (b'{"type": "audio-chunk", "data": {"rate": 16000, "width": 2, "channels": 1}, "payload_length": 99999999}\n',
     "event_too_large"),
    (b"{" + b" " * 70000 + b"}\n", "event_too_large"),
    (b'{"type": "synthesize", "data": {}}\n', "bad_event"),
    (b'{"type": "audio-stop"}\n', "bad_event"),
    (b'{"type": "audio-chunk", "data": {"rate": 16000, "width": 1, "channels": 1}, "payload_length": 2}\nab',
     "unsupported_audio"),
    (b'{"type": "synthesize", "data": {"text": "hi", "voice": {"name": "en_GB-alan-low"}}}\n', "unknown_voice"),
    (b'{"type": "transcribe", "data": {"language": "de"}}\n{"type": "audio-start", "data": '
     b'{"rate": 16000, "width": 2, "channels": 1}}\n', "unsupported_language"),
    # numbers, nesting, strings and types that only a bounded, typed reader refuses
    (b'{"type": "ping", "data_length": 1e999}\n', "bad_event"),
    (b'{"type": "ping", "data_length": true}\n', "bad_event"),
    (b'{"type": "ping", "payload_length": "12"}\n', "bad_event"),
    (b'{"type": "ping", "data_length": -1}\n', "bad_event"),
    (b'{"type": "ping", "payload_length": 1.5}\n', "bad_event"),
    (b'{"type": "ping", "data": {"text": NaN}}\n', "bad_event"),
    (b'{"type": "ping", "data": ' + b"[" * 5000 + b"]" * 5000 + b"}\n", "bad_event"),
    (b'{"type": "ping", "data_length": 10000}\n' + b"[" * 5000 + b"]" * 5000, "bad_event"),
    (b'{"type": "ping", "data_length": 2}\n[]', "bad_event"),
    (b'{"type": "ping", "data": []}\n', "bad_event"),
    (b'{"type": "ping", "data": {"text": "\xff"}}\n', "bad_event"),
    (b'{"type": "synthesize", "data": {"text": "\\ud800 hello"}}\n', "bad_event"),
    (b'{"type": "synthesize", "data": {"text": 5}}\n', "bad_event"),
    (b'{"type": "synthesize-start"}\n{"type": "synthesize-chunk", "data": {"text": ["hi"]}}\n', "bad_event"),
    (b'{"type": "transcript", "data": {"text": {"a": 1}}}\n', "bad_event"),
    (b'{"type": "audio-chunk", "data": {"rate": 16000.5, "width": 2, "channels": 1}, "payload_length": 2}\nab',
     "unsupported_audio"),
    (b'{"type": "synthesize", "data": {"text": "' + b"la " * 1700 + b'"}}\n', "text_too_long"),
    (b'{"type": "synthesize-start"}\n' + (b'{"type": "synthesize-chunk", "data": {"text": "' + b"la " * 600
                                          + b'"}}\n') * 3, "text_too_long"),
    (b'{"type": "transcript", "data": {"text": "' + b"la " * 1700 + b'"}}\n', "text_too_long"),
], ids=lambda value: value[:48].decode("latin-1") if isinstance(value, bytes) else value)
def test_a_bad_event_gets_an_error_and_closes_only_its_connection(server, raw, code):
    async def scenario():
        bad_reader, bad_writer = await asyncio.open_connection("127.0.0.1", server.config.wyoming.port)
        good = AsyncTcpClient("127.0.0.1", server.config.wyoming.port)
        await good.connect()
        bad_writer.write(raw)
        await bad_writer.drain()
        rest = await asyncio.wait_for(bad_reader.read(), 10)  # everything until the server closes
        await good.write_event(Describe().event())
        info = await asyncio.wait_for(good.read_event(), 10)
        await good.disconnect()
        bad_writer.close()
        return rest, info

    rest, info = asyncio.run(scenario())
    sent = parse_events(rest)
    assert sent[-1]["type"] == "error" and sent[-1]["data"]["code"] == code, sent
    assert info.type == "info"


def parse_events(raw: bytes) -> list[dict]:
    """Wyoming events from raw bytes: a JSON line, then its data and payload blocks."""
    found = []
    while raw:
        line, raw = raw.split(b"\n", 1)
        header = json.loads(line)
        n = header.get("data_length") or 0
        header["data"] = {**(header.get("data") or {}), **(json.loads(raw[:n]) if n else {})}
        raw = raw[n + (header.get("payload_length") or 0):]
        found.append(header)
    return found


def test_unknown_events_are_dropped(server):
    got = talk(server, Event("run-satellite", {}), Event("detect", {"names": ["ok_nabu"]}), Describe().event(),
               until="info")
    assert types(got) == ["info"]
    assert not [e for e in got if Error.is_type(e.type)]


def test_only_allowed_addresses_are_served():
    config = make_config(wyoming={"port": free_port(), "allow": ["10.0.0.0/8"]})
    with LiveServer(config, fake_instance(config)) as srv:
        async def scenario():
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.config.wyoming.port)
            writer.write(json.dumps({"type": "describe"}).encode() + b"\n")
            got = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return got
        assert asyncio.run(scenario()) == b""  # closed without an answer


def test_serving_wyoming_to_anyone_off_loopback_is_refused():
    from voice.service.auth import Auth, ConfigError, check_exposure
    config = make_config(wyoming={"port": 10300, "host": "0.0.0.0"})
    with pytest.raises(ConfigError, match="wyoming.allow"):
        check_exposure(config, Auth(keys={"k": "x" * 32}, secret=b"s" * 32))
    config.wyoming.allow = ["192.168.1.10"]
    check_exposure(config, Auth(keys={"k": "x" * 32}, secret=b"s" * 32))
    with pytest.raises(ValueError, match="wyoming.allow"):
        make_config(wyoming={"allow": ["kitchen"]}).wyoming.__post_init__()


def test_a_long_text_without_a_sentence_break_is_spoken_in_bounded_phrases(server):
    """5,000 characters without punctuation once became one phrase, and Piper's memory grew by a GB."""
    synth, phrases = server.instance.synthesizer, []
    speak = synth.synthesize

    async def recording(text, rate, urgent=lambda: False):
        phrases.append(text)
        return await speak(text, rate, urgent)

    synth.synthesize = recording
    text = " ".join(["word"] * 990) + " " + "x" * 600  # 5,550 characters, one "word" longer than a phrase
    server.config.wyoming.max_text_chars = len(text)
    got = talk(server, Synthesize(text=text).event(), until="audio-stop")
    assert types(got) == ["audio-start", "audio-stop"]
    limit = server.config.tts.max_phrase_chars
    assert max(map(len, phrases)) <= limit and len(phrases) > len(text) // limit, [len(p) for p in phrases]
    assert "".join(phrases).replace(" ", "") == text.replace(" ", "")  # nothing lost, nothing repeated


def server_sockets(port: int) -> int:
    """This process's open sockets on the server's side of `port`."""
    return sum(1 for c in psutil.Process().net_connections("tcp") if c.laddr and c.laddr.port == port and c.raddr)


def test_every_connection_has_a_read_deadline_and_gives_its_socket_back():
    """A header that never ends, a data block that never comes, a client that never reads what it
    asked for: each is cut after `idle_timeout_s`, and the server holds no socket once the clients
    are gone (open file descriptors back to the baseline)."""
    config = make_config(wyoming={"port": free_port(), "idle_timeout_s": 0.5})
    with LiveServer(config, fake_instance(config)) as srv:
        port = srv.config.wyoming.port
        talk(srv, Describe().event(), until="info")
        baseline = psutil.Process().num_fds()

        async def scenario():
            async def connect(first: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(first)
                await writer.drain()
                return reader, writer

            silent = await connect(b"")
            endless = await connect(b'{"type": "describe"')  # then a byte at a time, never a line break
            dataless = await connect(b'{"type": "ping", "data_length": 100}\n{"text"')
            deaf = await connect(json.dumps({"type": "synthesize", "data": {"text": "la " * 1600}}).encode() + b"\n")
            deaf[1].transport.pause_reading()  # never reads the audio it asked for
            reading, started = asyncio.create_task(endless[0].read()), time.monotonic()
            with contextlib.suppress(ConnectionError):  # the server cuts it off half way
                while not reading.done() and time.monotonic() - started < 5:
                    endless[1].write(b" ")
                    await endless[1].drain()
                    await asyncio.sleep(0.1)
            trickled_s = time.monotonic() - started
            await asyncio.wait([reading])
            cut = [await asyncio.wait_for(reader.read(), 5) for reader, _ in (silent, dataless)]
            for _ in range(50):  # the deaf one is cut too, though its client still holds its end
                if server_sockets(port) == 0:
                    break
                await asyncio.sleep(0.1)
            held = server_sockets(port)
            for _, writer in (silent, endless, dataless, deaf):
                writer.close()
            return cut, trickled_s, held

        cut, trickled_s, held = asyncio.run(scenario())
        for raw in cut:
            assert parse_events(raw)[-1]["data"]["code"] == "idle_timeout", raw
        assert trickled_s < 2, trickled_s
        assert held == 0
        assert talk(srv, Describe().event(), until="info")[-1].type == "info"  # the server goes on serving
        deadline = time.monotonic() + 5
        while psutil.Process().num_fds() > baseline and time.monotonic() < deadline:
            time.sleep(0.05)  # the server closes its end of the last connection
        assert psutil.Process().num_fds() <= baseline  # (an fd of an earlier test may close meanwhile)


def test_a_transcription_is_a_session_turn_like_a_ws_one(server):
    """Wyoming runs on the session: a transcription's row has the transcript, status ok and the
    latency report a /ws turn has (stages_ms, with the asr stage), beside Wyoming's `stages`."""
    pcm = speech("001.wav")
    chunks = [AudioChunk(rate=16000, width=2, channels=1, audio=pcm[i:i + 2048]).event()
              for i in range(0, len(pcm), 2048)]
    talk(server, AudioStart(rate=16000, width=2, channels=1).event(), *chunks, AudioStop().event(),
         until="transcript-stop")
    server.stop()
    [session] = rec.read_sessions(server.config.records.path)
    [turn] = session["turns"]
    assert (turn["status"], turn["transcript"]) == ("ok", "what time is it")
    assert "asr" in turn["latency"]["stages_ms"] and turn["latency"]["stages"] == turn["latency"]["stages_ms"]


def test_an_answer_runs_in_the_callers_conversation_and_leaves_the_sessions_alone():
    """Home Assistant's conversation agent: the answer's turn reads and extends the history the
    caller keeps, through its chat; the session's own history and chat are never swapped out, not
    even while the answer is made (before, they were, for the length of the call)."""
    from voice.conversation.history import History
    from voice.conversation.session import Session

    lm = FakeLM()
    lm.delay_s = 0.05  # a reply that takes a while: the session is looked at while it is made
    instance = fake_instance(make_config(), lm=lm)

    async def scenario() -> tuple[list[dict], list[dict], bool]:
        session = Session(instance, 16000, instance.synthesizer.voice_rate, "wyoming", requests=True)
        own_history, own_chat = session.history, session.replies.chat
        history, chat = History("Be brief.", 8), lm.chat()
        answer = asyncio.create_task(session.answer_in("what time is it", history, chat))
        await asyncio.sleep(0.1)  # the reply is being made
        untouched = session.history is own_history and session.replies.chat is own_chat and not answer.done()
        await answer
        await session.close()
        return list(history), list(own_history), untouched

    theirs, own, untouched = asyncio.run(scenario())
    assert untouched
    assert [m["role"] for m in theirs] == ["user", "assistant"] and theirs[0]["content"] == "what time is it"
    assert theirs[1]["content"] == "Sure, here is a short reply."
    assert own == []


def test_a_request_past_capacity_gets_too_many_sessions_with_when_to_retry(server):
    """Issue 59: at the instance's measured capacity a Wyoming request (its session opens with it)
    gets the `too_many_sessions` error saying when to try again."""
    class Full:  # a measured capacity with no room left
        retry_after_s, load, cores = 7, 1.9, 2

        def admits(self, sessions: int) -> bool:
            return False
    server.instance.admission.capacity = Full()
    got = talk(server, Synthesize(text="Hello there.").event(), until="error")
    refused = Error.from_event(got[-1])
    assert refused.code == "too_many_sessions" and "try again in 7 s" in refused.text, refused
