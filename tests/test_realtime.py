"""/v1/realtime with the official `openai` SDK's realtime client, on the real app with stand-in
models (tests/fakes.py); the real models are in tests/test_realtime_live.py.

Every server event the client receives is validated against the SDK's own pydantic types of
the protocol (`openai.types.realtime.RealtimeServerEvent` for the GA names, the beta module's
for `OpenAI-Beta: realtime=v1`), so a field missing or misnamed fails here.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import openai
import pydantic
import pytest
import websockets
from openai.types.beta.realtime import RealtimeServerEvent as BetaServerEvent
from openai.types.realtime import RealtimeServerEvent

from fakes import LiveServer, fake_instance, make_config, speech
from engine.runtime import ContextOverflow
from voice.audio import float_to_pcm16, pcm16_to_float, resample, ulaw_decode, ulaw_encode
from voice.service.records import read_sessions

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]
GA = pydantic.TypeAdapter(RealtimeServerEvent)
BETA = pydantic.TypeAdapter(BetaServerEvent)


def at_24k(name: str = "001.wav") -> bytes:
    return float_to_pcm16(resample(pcm16_to_float(speech(name)), 16000, 24000))


class Talk:
    """One Realtime connection through the SDK: sends events, validates and keeps every server event."""

    def __init__(self, conn, beta: bool = False):
        self.conn, self.beta, self.events = conn, beta, []
        self.reader = asyncio.create_task(self._read())
        self.mic: asyncio.Task | None = None

    async def _read(self):
        try:
            while True:
                raw = json.loads(await self.conn.recv_bytes())
                (BETA if self.beta else GA).validate_python(raw)
                raw["_at"] = time.monotonic()
                self.events.append(raw)
        except (openai.WebSocketConnectionClosedError, websockets.ConnectionClosed):  # the SDK raises either
            pass

    async def ask(self, part: dict) -> None:
        """A user message of one content part (input_text or input_audio), then response.create."""
        await self.conn.conversation.item.create(item={"type": "message", "role": "user", "content": [part]})
        await self.conn.response.create()

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    async def wait(self, kind: str, n: int = 1, timeout: float = 20) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.of(kind)) >= n:
                return self.of(kind)[n - 1]
            assert not self.reader.done(), (self.reader, [e["type"] for e in self.events])
            await asyncio.sleep(0.01)
        raise AssertionError(f"no {kind} (#{n}); got {[e['type'] for e in self.events]}")

    def stream(self, pcm: bytes, rate: int = 24000, then_silence: bool = True, encode=None):
        """Append `pcm` in 100 ms pieces in real time (a microphone), then silence."""
        async def run():
            step = rate * 2 // 10
            i = 0
            while i < len(pcm) or then_silence:
                chunk = pcm[i:i + step] if i < len(pcm) else bytes(step)
                await self.conn.input_audio_buffer.append(audio=base64.b64encode(encode(chunk) if encode else chunk)
                                                          .decode())
                i += step
                await asyncio.sleep(0.1 / 3)  # 3x real time: the VAD and the stand-ins don't mind
        self.mic = asyncio.create_task(run())


def connect(srv, beta: bool = False, **kw):
    """GA: the base URL is all a client changes. The SDK's beta client always says wss:// unless
    given `websocket_base_url`."""
    client = openai.AsyncOpenAI(base_url=srv.http + "/v1", api_key="none",
                                websocket_base_url=srv.ws + "/v1" if beta else None)
    return (client.beta if beta else client).realtime.connect(model="diffusion-voice", **kw)


@pytest.fixture
def served(tmp_path):
    config = make_config(records={"path": str(tmp_path / "records.sqlite3")})
    instance = fake_instance(config)
    with LiveServer(config, instance) as srv:
        yield srv


def test_a_spoken_turn_through_the_sdk_gets_a_transcript_and_audio(served):
    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            await conn.session.update(session={"type": "realtime", "instructions": "Answer briefly."})
            await talk.wait("session.updated")
            talk.stream(at_24k())
            await talk.wait("response.done")
            await conn.close()
            return talk
    talk = asyncio.run(go())
    kinds = [e["type"] for e in talk.events]
    order = ["session.created", "session.updated", "input_audio_buffer.speech_started",
             "input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "conversation.item.added",
             "conversation.item.input_audio_transcription.completed", "response.created",
             "response.output_item.added", "response.content_part.added", "response.output_audio_transcript.delta",
             "response.output_audio.delta", "response.output_audio.done", "response.output_audio_transcript.done",
             "response.content_part.done", "response.output_item.done", "response.done"]
    assert set(order) <= set(kinds), set(order) - set(kinds)
    firsts = [kinds.index(k) for k in order]  # text and audio deltas interleave (the LM decodes while TTS speaks)
    assert firsts == sorted(firsts), kinds
    last_delta = max(i for i, k in enumerate(kinds) if k.startswith("response.output_audio") and k.endswith(".delta"))
    assert last_delta < kinds.index("response.output_audio.done"), kinds
    assert talk.of("conversation.item.input_audio_transcription.completed")[0]["transcript"] == "eight of spades"
    user_item = talk.of("input_audio_buffer.committed")[0]["item_id"]
    assert talk.of("conversation.item.input_audio_transcription.completed")[0]["item_id"] == user_item
    done = talk.of("response.done")[0]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["transcript"] == \
        "Sure, here is a short reply."
    audio = b"".join(base64.b64decode(e["delta"]) for e in talk.of("response.output_audio.delta"))
    tone = pcm16_to_float(audio)
    assert len(audio) > 24000 and np.abs(tone).max() > 0.1  # pcm16 at 24 kHz: FakeSynth's tone, 60 ms a character
    assert abs(len(audio) / 2 / 24000 - 0.06 * sum(map(len, ["Sure, here is", "a short reply."]))) < 0.2
    assert talk.of("rate_limits.updated")
    session = read_sessions(served.config.records.path)[-1]
    assert session["transport"] == "realtime" and session["turns"][0]["reply"] == "Sure, here is a short reply."


def ask_text(served, text: str) -> Talk:
    """One typed question and its response, on a new connection."""
    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            await talk.ask({"type": "input_text", "text": text})
            await talk.wait("response.done")
            await conn.close()
            return talk
    return asyncio.run(go())


def test_text_in_audio_out(served):
    talk = ask_text(served, "Hello there")
    assert talk.of("conversation.item.added")[0]["item"]["content"][0]["text"] == "Hello there"
    assert served.instance.lm.asked[-1][0][-1] == {"role": "user", "content": "Hello there"}
    assert talk.of("response.output_audio.delta") and talk.of("response.done")[0]["response"]["status"] == "completed"
    assert not talk.of("input_audio_buffer.speech_started")


@pytest.mark.parametrize("failure, code, kind", [
    (ContextOverflow("the prompt's 1645 new tokens would take about 45 s to read"), "context_length_exceeded",
     "invalid_request_error"),
    (RuntimeError("injected LM failure"), "reply_failed", "server_error")])
def test_a_reply_the_lm_cannot_give_is_a_failed_response(served, failure, code, kind):
    """The LM refuses the conversation (too long to read before the first block's timeout) or
    breaks: an `error` of the client's or the server's type, then response.done `failed` with
    that error (not `cancelled`: the apology that follows is not the reply)."""
    served.instance.lm.fail_at, served.instance.lm.failure = 0, failure
    talk = ask_text(served, "Hello there")
    assert [(e["error"]["type"], e["error"]["code"]) for e in talk.of("error")] == [(kind, code)]
    response = talk.of("response.done")[0]["response"]
    assert response["status"] == "failed"
    assert response["status_details"] == {"type": "failed", "error": {"type": kind, "code": code}}


def test_response_cancel_mid_reply(served):
    served.instance.lm.delay_s = 0.3  # a block every 0.3 s

    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            await talk.ask({"type": "input_text", "text": "Go on"})
            await talk.wait("response.output_audio_transcript.delta")
            await conn.response.cancel()
            await talk.wait("response.done")
            await conn.close()
            return talk
    talk = asyncio.run(go())
    done = talk.of("response.done")[0]["response"]
    assert done["status"] == "cancelled", done
    assert len(talk.of("response.output_audio_transcript.delta")) < 4


def test_truncate_keeps_only_what_was_heard_for_the_next_turn(served):
    served.instance.lm.blocks = ["One two three four five six seven eight nine ten."]

    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            for n, text in enumerate(["Count", "And then?"], 1):
                await talk.ask({"type": "input_text", "text": text})
                await talk.wait("response.done", n, timeout=30)
                if n == 1:
                    item = talk.of("response.output_item.done")[0]["item"]["id"]
                    await conn.conversation.item.truncate(item_id=item, content_index=0, audio_end_ms=1500)
                    await talk.wait("conversation.item.truncated")
            await conn.close()
            return talk
    talk = asyncio.run(go())
    truncated = talk.of("conversation.item.truncated")[0]
    assert truncated["audio_end_ms"] == 1500
    history = served.instance.lm.asked[-1][0]
    # the phrase is 50 characters, 3 s of FakeSynth audio: 1.5 s is half of its ten words
    assert history[-2] == {"role": "assistant", "content": "One two three four five"}, history


def test_beta_clients_get_the_beta_event_names(served):
    async def go():
        async with connect(served, beta=True) as conn:
            talk = Talk(conn, beta=True)
            await conn.session.update(session={"input_audio_format": "pcm16", "output_audio_format": "pcm16"})
            talk.stream(at_24k())
            await talk.wait("response.done")
            await conn.close()
            return talk
    talk = asyncio.run(go())
    kinds = {e["type"] for e in talk.events}
    assert {"response.audio.delta", "response.audio.done", "response.audio_transcript.delta",
            "response.audio_transcript.done", "conversation.item.created"} <= kinds, kinds
    assert not kinds & {"response.output_audio.delta", "conversation.item.added", "conversation.item.done"}
    assert talk.of("session.updated")[0]["session"]["input_audio_format"] == "pcm16"


def test_g711_in_and_out(served):
    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            await conn.session.update(session={"type": "realtime", "audio": {
                "input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {"type": "audio/pcmu"}}}})
            await talk.wait("session.updated")
            clip = float_to_pcm16(resample(pcm16_to_float(speech("001.wav")), 16000, 8000))
            talk.stream(clip, rate=8000, encode=lambda chunk: ulaw_encode(np.frombuffer(chunk, "<i2")))
            await talk.wait("response.done")
            await conn.close()
            return talk
    talk = asyncio.run(go())
    assert talk.of("conversation.item.input_audio_transcription.completed")[0]["transcript"] == "eight of spades"
    audio = ulaw_decode(b"".join(base64.b64decode(e["delta"]) for e in talk.of("response.output_audio.delta")))
    assert abs(len(audio) / 8000 - 0.06 * len("Sure, here is a short reply.")) < 0.2 and np.abs(audio).max() > 3000


def test_without_turn_detection_commit_ends_the_turn(served):
    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            await talk.wait("session.updated")
            talk.stream(at_24k() + bytes(24000 * 2), then_silence=False)  # a clip and 1 s of silence
            await talk.wait("input_audio_buffer.speech_started")
            await talk.mic
            await asyncio.sleep(0.3)
            assert not talk.of("input_audio_buffer.speech_stopped")  # the VAD does not end the turn
            await conn.input_audio_buffer.commit()
            await talk.wait("response.done")
            await conn.input_audio_buffer.commit()  # nothing left to commit
            await talk.wait("error")
            await conn.close()
            return talk
    talk = asyncio.run(go())
    assert talk.of("conversation.item.input_audio_transcription.completed")[0]["transcript"] == "eight of spades"
    assert talk.of("error")[0]["error"]["code"] == "input_audio_buffer_commit_empty"


@pytest.mark.parametrize("detection, policy", [({"type": "semantic_vad", "eagerness": "high"}, "combined"),
                                               ({"type": "semantic_vad", "eagerness": "low"}, "combined"),
                                               ({"type": "server_vad", "silence_duration_ms": 600}, "fixed")])
def test_semantic_vad_runs_the_end_of_turn_policy_and_server_vad_the_plain_endpointer(served, detection, policy):
    """semantic_vad's eagerness maps onto our end-of-turn policy (voice/pipeline/endofturn.py: `high` a lower
    threshold and a shorter ceiling than `low`); server_vad stays the VAD, its silence the hangover."""
    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": detection}}})
            updated = await talk.wait("session.updated")
            talk.stream(at_24k())
            await talk.wait("response.done")
            (session,) = served.instance.live
            turn = session.end_of_turn.config
            await conn.close()
            return updated, turn, session.config.vad.hangover_ms
    updated, turn, hangover_ms = asyncio.run(go())
    shown = updated["session"]["audio"]["input"]["turn_detection"]
    assert {k: shown[k] for k in detection} == detection
    assert turn.policy == policy
    default = served.config.turn
    if detection.get("eagerness") == "high":
        assert turn.ceiling_ms < default.ceiling_ms
    elif detection.get("eagerness") == "low":
        assert turn.ceiling_ms > default.ceiling_ms
    else:
        assert hangover_ms == 600


def bad_events(limit: int) -> list[str]:
    """Malformed or out-of-place client events, as raw text (written flat: CPython 3.11.7 fails to
    compile pytest's rewrite of deeply nested literals here)."""
    big = base64.b64encode(bytes(limit + 2)).decode()
    return ['{not json', '[1, 2]', '{"type": "flying.saucer"}', '{"type": "input_audio_buffer.append", "audio": "***"}',
            '{"type": "input_audio_buffer.append", "audio": "AQ=="}',
            '{"type": "input_audio_buffer.append", "event_id": "big", "audio": "' + big + '"}',
            '{"type": "session.update", "session": {"audio": {"output": {"format": {"type": "audio/pcm", '
            '"rate": 16000}}}}}',
            '{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": '
            '[{"type": "input_image"}]}}',
            '{"type": "response.create"}', '{"type": "response.cancel"}',
            '{"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0, "audio_end_ms": 5}',
            '{"type": "session.update", "session": {"tools": [{"type": "mcp", "server_label": "x"}]}}',
            '{"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "nope", '
            '"output": "x"}}']


def test_bad_events_get_error_events_and_the_session_goes_on(served):
    limit = served.config.session.max_frame_bytes

    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            bad = bad_events(limit)
            for text in bad:
                await conn.send_raw(text)  # the SDK's own way to send what its types would not let through
            await talk.wait("error", len(bad))
            await talk.ask({"type": "input_text", "text": "Still there?"})
            await talk.wait("response.done")
            await conn.close()
            return talk
    talk = asyncio.run(go())
    codes = [e["error"]["code"] for e in talk.of("error")]
    assert codes == ["invalid_json", "invalid_event", "unknown_event", "invalid_value", "bad_frame",
                     "frame_too_large", "invalid_value", "invalid_value", "no_input", "response_cancel_not_active",
                     "item_truncate_invalid_item_id", "invalid_value", "invalid_value"], codes
    assert talk.of("error")[5]["error"]["event_id"] == "big"
    assert all(e["error"]["message"] and e["error"]["type"] == "invalid_request_error" for e in talk.of("error"))
    assert talk.of("response.done")[0]["response"]["status"] == "completed"


def test_function_calling_round_trip(served):
    """The client declares a function; the LM calls it; the client answers with its output and
    asks again: the spoken answer is made from it."""
    weather = {"type": "function", "name": "get_weather", "description": "Today's weather in a city.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    served.instance.lm.tool_calls = [{"id": "call_7", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]

    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            await conn.session.update(session={"type": "realtime", "tools": [weather]})
            await talk.wait("session.updated")
            await talk.ask({"type": "input_text", "text": "What's the weather in Paris?"})
            await talk.wait("response.done")
            served.instance.lm.tool_calls = []  # the answer speaks
            call = talk.of("response.function_call_arguments.done")[0]
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                                      "output": "Sunny, 21 degrees"})
            await conn.response.create()
            await talk.wait("response.done", 2)
            await conn.close()
            return talk
    talk = asyncio.run(go())
    assert talk.of("session.updated")[0]["session"]["tools"][0]["name"] == "get_weather"
    offered = served.instance.lm.asked[0][1]
    assert offered == [{"type": "function", "function": {k: weather[k] for k in ("name", "description", "parameters")}}]
    call = talk.of("response.function_call_arguments.done")[0]
    assert ((call["name"], json.loads(call["arguments"]), call["call_id"])
            == ("get_weather", {"city": "Paris"}, "call_7"))
    first, second = talk.of("response.done")
    assert [o["type"] for o in first["response"]["output"]] == ["function_call"]
    assert not [e for e in talk.events if e["type"] == "response.output_audio.delta" and e["_at"] < talk.of(
        "response.done")[0]["_at"]]  # the call is not spoken
    asked = served.instance.lm.asked[-1][0][-1]["content"]
    assert asked == "What's the weather in Paris?\n\n(Result of get_weather: Sunny, 21 degrees)", asked
    assert [o["type"] for o in second["response"]["output"]] == ["message"]
    assert second["response"]["output"][0]["content"][0]["transcript"] == "Sure, here is a short reply."
    history = [m for m in served.instance.lm.asked[-1][0] if m["role"] == "user"]
    assert len(history) == 1, history  # the question is asked again with the output, not twice


def test_a_connection_that_never_starts_a_session_is_closed_when_idle():
    config = make_config(limits={"idle_timeout_s": 1.0})
    instance = fake_instance(config)
    with LiveServer(config, instance) as srv:
        async def go():
            async with connect(srv) as conn:
                talk = Talk(conn)
                await conn.session.update(session={"type": "realtime", "instructions": "Hi."})
                await asyncio.wait_for(talk.reader, 10)
                return talk
        talk = asyncio.run(go())
        deadline = time.monotonic() + 5
        while instance.admission.total and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not instance.admission.total and not instance.live  # its admission ticket is given back
    assert talk.of("error")[-1]["error"]["code"] == "idle_timeout"


def test_an_audio_item_is_transcribed_and_answered(served):
    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            await talk.ask({"type": "input_audio", "audio": base64.b64encode(at_24k()).decode()})
            await talk.wait("response.done")
            await conn.close()
            return talk
    talk = asyncio.run(go())
    item = talk.of("conversation.item.added")[0]["item"]
    assert item["content"] == [{"type": "input_audio", "transcript": "eight of spades"}], item
    assert talk.of("conversation.item.input_audio_transcription.completed")[0]["transcript"] == "eight of spades"
    assert served.instance.lm.asked[-1][0][-1] == {"role": "user", "content": "eight of spades"}
    assert talk.of("response.done")[0]["response"]["status"] == "completed"


# --- hostile input (issue 33): odd types, cancel before the first text, floods -----------------------------

ODD_SESSIONS = [{"audio": {"input": [1]}}, {"audio": {"input": "x"}}, {"audio": {"output": True}},
                {"audio": {"input": {"format": []}}}, {"input_audio_format": []}, {"output_audio_format": ["x"]},
                {"audio": {"input": {"format": {"type": {}}}}}, {"audio": {"output": {"format": {"rate": "x"}}}},
                {"audio": []}, {"audio": {"input": {"turn_detection": {"type": []}}}},
                {"turn_detection": {"type": "server_vad", "silence_duration_ms": "500"}},
                {"turn_detection": [1]}, {"instructions": 5}, {"instructions": ["x"]}, {"tools": {"a": 1}},
                {"tools": [{"type": "function", "name": {"x": 1}}]}, {"tools": [{"name": "f", "parameters": []}]},
                {"tool_choice": {"type": "function"}}, {"tool_choice": []}, {"voice": []},
                {"audio": {"output": {"voice": {}}}}, []]
ODD_OUTPUTS = [{"call_id": ["x"], "output": "x"}, {"call_id": {"a": 1}, "output": "x"}, {"call_id": 7, "output": "x"},
               {"call_id": "call_1", "output": ["x"]}, {"call_id": "call_1", "output": {"a": 1}},
               {"call_id": "call_1", "output": None}, {"call_id": "call_1"}, {"call_id": "call_1", "output": "x",
                                                                              "id": ["x"]}]


def refusals(talk: Talk, events: list[dict]) -> list[dict]:
    """The error events answering `events` (each sent with its own event_id), by event_id."""
    ids = {e["event_id"] for e in events}
    return [e["error"] for e in talk.of("error") if e["error"]["event_id"] in ids]


async def send_refused(conn, events: list[dict]) -> Talk:
    """Send `events` as they are, and wait until each has been answered with an error."""
    talk = Talk(conn)
    for event in events:
        await conn.send_raw(json.dumps(event))
    await talk.wait("error", len(events))
    return talk


async def still_answers(talk: Talk, n: int = 1) -> None:
    await talk.ask({"type": "input_text", "text": "Still there?"})
    await talk.wait("response.done", n)


def test_wrongly_typed_session_updates_get_errors_and_the_connection_stays_open(served):
    """Regression: a session.update with a list, string or bool where an object was expected killed
    the connection (close 1006, AttributeError / TypeError in the app)."""
    events = [{"type": "session.update", "event_id": f"odd_{i}", "session": s} for i, s in enumerate(ODD_SESSIONS)]

    async def go():
        async with connect(served) as conn:
            talk = await send_refused(conn, events)
            assert not talk.of("session.updated")
            await conn.send_raw(json.dumps({"type": "session.update", "session": {"turn_detection": {
                "type": "server_vad", "silence_duration_ms": None}}}))  # null: the default
            await talk.wait("session.updated")
            await still_answers(talk)
            await conn.close()
            return talk
    talk = asyncio.run(go())
    errors = refusals(talk, events)
    assert len(errors) == len(events) == len(talk.of("error")), errors
    assert {e["type"] for e in errors} == {"invalid_request_error"}
    for error in errors:
        assert error["param"] and error["param"].startswith("session") and error["param"] in error["message"], error
    by_id = {e["event_id"]: e for e in errors}
    assert by_id["odd_0"]["param"] == "session.audio.input" and by_id["odd_4"]["param"] == "session.input_audio_format"
    assert talk.of("response.done")[0]["response"]["status"] == "completed"


def test_wrongly_typed_function_outputs_get_errors_and_the_connection_stays_open(served):
    """Regression: a function_call_output item whose call_id was a list or an object closed the connection."""
    events = [{"type": "conversation.item.create", "event_id": f"out_{i}",
               "item": {"type": "function_call_output", **item}} for i, item in enumerate(ODD_OUTPUTS)]

    async def go():
        async with connect(served) as conn:
            talk = await send_refused(conn, events)
            await still_answers(talk)
            await conn.close()
            return talk
    talk = asyncio.run(go())
    errors = refusals(talk, events)
    assert len(errors) == len(events), errors
    assert all(e["param"] and e["param"].startswith("item") for e in errors), errors
    assert talk.of("response.done")[0]["response"]["status"] == "completed"


def test_a_response_cancelled_before_its_first_text_is_created_and_done(served):
    """Regression: response.cancel right after response.create left the response unanswered: no
    response.created, no response.done."""
    served.instance.lm.delay_s = 0.5

    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            await talk.ask({"type": "input_text", "text": "Go on"})
            await conn.response.cancel()
            await talk.wait("response.done")
            served.instance.lm.delay_s = 0.0
            await still_answers(talk, 2)
            await conn.close()
            return talk
    talk = asyncio.run(go())
    first, second = talk.of("response.done")
    assert first["response"]["status"] == "cancelled" and second["response"]["status"] == "completed"
    assert [e["response"]["id"] for e in talk.of("response.created")] == [first["response"]["id"],
                                                                          second["response"]["id"]]
    assert all(e["response_id"] == second["response"]["id"] for e in talk.of("response.output_audio_transcript.delta"))


def prompt_chars(messages: list[dict]) -> int:
    return sum(len(m["content"]) for m in messages)


def test_an_item_flood_is_refused_and_the_prompt_stays_within_the_window(served):
    """Regression: 1,500 user items of 4,000 characters were all kept and sent to the LM as one
    question (every later response failed, ~1 GB of RSS). Items past the limits get an error, the
    session still answers, and what the LM sees stays within `lm.max_prompt_chars`."""
    limits = served.config.session
    text = "word " * 200  # 1,000 characters

    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            for rounds in range(1, 4):
                for _ in range(limits.max_items + 8):
                    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                              "content": [{"type": "input_text", "text": text}]})
                await conn.response.create()
                await talk.wait("response.done", rounds)
            for _ in range(limits.max_items + 8):  # short ones: the count is bounded too
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": "hi"}]})
            await conn.response.create()
            await talk.wait("response.done", 4)
            await conn.close()
            return talk
    talk = asyncio.run(go())
    full = [e["error"] for e in talk.of("error")]
    accepted = limits.max_items_chars // len(text)
    assert len(full) == 3 * (limits.max_items + 8 - accepted) + 8, len(full)
    assert {e["code"] for e in full} == {"conversation_full"} and all("item" in e["message"] for e in full)
    assert [e["response"]["status"] for e in talk.of("response.done")] == ["completed"] * 4
    for messages, _ in served.instance.lm.asked:
        assert prompt_chars(messages) <= served.config.lm.max_prompt_chars, prompt_chars(messages)
        assert messages[0]["role"] == "system"
    last = served.instance.lm.asked[-1][0]
    assert last[-1]["content"] == " ".join(["hi"] * limits.max_items)


def test_a_system_item_flood_keeps_the_instructions_bounded(served):
    """Regression: system items were appended to the instructions without end (8 MB)."""
    limit = served.config.session.max_system_prompt_chars
    text = "Be brief. " * 100  # 1,000 characters

    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            for _ in range(2 * limit // len(text)):
                await conn.conversation.item.create(item={"type": "message", "role": "system",
                                                          "content": [{"type": "input_text", "text": text}]})
            await conn.session.update(session={"type": "realtime"})
            await talk.wait("session.updated")
            await still_answers(talk)
            await conn.close()
            return talk
    talk = asyncio.run(go())
    instructions = talk.of("session.updated")[0]["session"]["instructions"]
    assert limit - len(text) <= len(instructions) <= limit, len(instructions)
    assert talk.of("error") and {e["error"]["code"] for e in talk.of("error")} == {"string_above_max_length"}
    assert served.instance.lm.asked[-1][0][0] == {"role": "system", "content": instructions}


def test_tool_lists_are_bounded(served):
    limits = served.config.session
    tool = {"type": "function", "name": "f", "description": "d" * 100, "parameters": {"type": "object"}}
    many = [{**tool, "name": f"f{i}"} for i in range(limits.max_tools + 1)]
    wordy = [{**tool, "description": "d" * limits.max_tools_chars}]

    async def go():
        async with connect(served) as conn:
            talk = Talk(conn)
            for tools in (many, wordy):
                await conn.send_raw(json.dumps({"type": "session.update", "session": {"tools": tools}}))
            await talk.wait("error", 2)
            await conn.session.update(session={"type": "realtime", "tools": [tool]})
            await talk.wait("session.updated")
            await conn.close()
            return talk
    talk = asyncio.run(go())
    assert [e["error"]["param"] for e in talk.of("error")] == ["session.tools", "session.tools"]
    assert talk.of("session.updated")[0]["session"]["tools"][0]["name"] == "f"


@pytest.mark.parametrize("beta", [False, True])
def test_the_rooms_talk_in_a_pause_deletes_no_item_and_cancels_no_response(beta):
    """Issue 55: a burst of another voice inside `turn.resume_ms` starts a turn that may go on with the last
    user item. It holds no words beyond that item's (the fake ASR writes one sentence for any audio), so it
    is the room's: the earlier item stays (it was deleted at `speech_started` before) and its response
    completes; the burst's item ends with an empty transcript."""
    from fakes import FakeLM, FakeWhisper
    config = make_config(turn={"policy": "fixed", "resume_ms": 3000})
    lm = FakeLM(blocks=("A slow", " reply."))
    lm.delay_s = 1.0  # not heard before the burst
    burst = float_to_pcm16(resample(pcm16_to_float(speech("002.wav")[16000:25600]), 16000, 24000))  # 0.3 s
    with LiveServer(config, fake_instance(config, FakeWhisper("Eight of spades."), lm=lm)) as srv:
        async def go():
            async with connect(srv, beta) as conn:
                talk = Talk(conn, beta)
                talk.stream(at_24k() + bytes(int(24000 * 0.8) * 2) + burst + bytes(24000 * 3 * 2))
                deadline = time.monotonic() + 30
                while not talk.of("response.done"):
                    assert time.monotonic() < deadline, [e["type"] for e in talk.events]
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
                await conn.close()
                return talk
        talk = asyncio.run(go())
    kinds = [e["type"] for e in talk.events]
    started = [e["item_id"] for e in talk.of("input_audio_buffer.speech_started")]
    assert len(started) == 2 and not talk.of("conversation.item.deleted"), kinds
    assert [e["response"]["status"] for e in talk.of("response.done")] == ["completed"], kinds
    transcripts = {e["item_id"]: e["transcript"]
                   for e in talk.of("conversation.item.input_audio_transcription.completed")}
    assert transcripts == {started[0]: "Eight of spades.", started[1]: ""}, transcripts


class WordsWhisper:
    """A stand-in ASR that hears one word per half second of audio, numbered from the utterance's
    start ("w0 w1 w2 ..."), so a transcript that repeats an earlier one's words shows it."""

    def __init__(self):
        from fakes import FakeWhisper
        base = FakeWhisper()
        self.worker, self.speaking = base.worker, base.speaking

    def transcribe(self, audio, prefix=""):
        return " ".join(f"w{i}" for i in range(round(len(audio) / 8000)))

    def transcribe_final(self, audio):
        return self.transcribe(audio)


@pytest.mark.parametrize("beta", [False, True])
def test_a_resumed_turn_deletes_the_item_it_supersedes_so_no_transcript_repeats(tmp_path, beta):
    """Issue 41, item 2: going on within `turn.resume_ms` of a pause continues the utterance, so the
    new user item's transcript holds the earlier item's words too; both items stayed in the
    conversation, and the words were there twice. The superseded item is now deleted with the
    protocol's own `conversation.item.deleted` once the resuming item's transcript says the user went on
    (just before it): the items left hold each word once, and nothing is said about a deleted item after."""
    from fakes import FakeLM
    config = make_config(records={"path": str(tmp_path / "records.sqlite3")}, turn={"resume_ms": 3000})
    lm = FakeLM(blocks=("Ok.",))
    lm.delay_s = 2.0  # no reply is heard before the user goes on
    with LiveServer(config, fake_instance(config, WordsWhisper(), lm=lm)) as srv:
        async def go():
            async with connect(srv, beta) as conn:
                talk = Talk(conn, beta)
                talk.stream((at_24k() + bytes(int(24000 * 0.7) * 2)) * 3)  # three halves, 0.7 s pauses
                deadline = time.monotonic() + 30
                while not [e for e in talk.of("response.done") if e["response"]["status"] == "completed"]:
                    assert time.monotonic() < deadline, [e["type"] for e in talk.events]
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)
                await conn.close()
                return talk
        talk = asyncio.run(go())
    kinds = [e["type"] for e in talk.events]
    started = [e["item_id"] for e in talk.of("input_audio_buffer.speech_started")]
    deleted = [e["item_id"] for e in talk.of("conversation.item.deleted")]
    assert len(started) == 3 and deleted == started[:2], kinds  # each pause resumed, its item superseded
    for n, item in enumerate(deleted):  # deleted just before the transcript of the item going on with it
        at = next(i for i, e in enumerate(talk.events) if e["type"] == "conversation.item.deleted"
                  and e["item_id"] == item)
        after = talk.events[at + 1]
        assert after["type"] == "conversation.item.input_audio_transcription.completed", kinds
        assert after["item_id"] == started[n + 1], kinds
        assert not [e for e in talk.events[at + 1:] if item in (e.get("item_id"), (e.get("item") or {}).get("id"),
                                                                e.get("previous_item_id"))]
    left = [e for e in talk.of("conversation.item.input_audio_transcription.completed") if e["item_id"] not in deleted]
    words = [w for e in left for w in e["transcript"].split()]
    assert len(words) > 4 and len(words) == len(set(words)), left  # every word once
    assert [e["response"]["status"] for e in talk.of("response.done")][-1] == "completed"
