"""/v1/realtime on the real models, with the official `openai` SDK's realtime client: a real
recording streamed in real time is transcribed and answered with speech our own ASR understands."""

from __future__ import annotations

import asyncio
import base64
import csv
import json

import jiwer
import numpy as np
import openai
import pytest

from fakes import REAL_REPLY_TOKENS, SPEECH, LiveServer, speech
from voice.audio import float_to_pcm16, pcm16_to_float, resample
from voice.clients.bench import normalise
from voice.config import Config

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def server(real_instance, tmp_path_factory):
    config = Config()
    config.lm.max_new_tokens = REAL_REPLY_TOKENS
    config.records.path = str(tmp_path_factory.mktemp("records") / "r.sqlite3")
    with LiveServer(config, real_instance(config)) as srv:
        yield srv


def reference(name: str) -> str:
    with open(SPEECH / "transcripts.tsv", newline="") as f:
        return next(row["text"] for row in csv.DictReader(f, delimiter="\t") if row["file"] == name)


async def spoken_turn(url: str, pcm24: bytes) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=url, api_key="none")
    events: list[dict] = []
    async with client.realtime.connect(model="diffusion-voice") as conn:
        async def mic():
            step = 24000 * 2 // 10  # 100 ms, in real time, then silence
            i = 0
            while True:
                chunk = pcm24[i:i + step] if i < len(pcm24) else bytes(step)
                await conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
                i += step
                await asyncio.sleep(0.1)
        sender = asyncio.create_task(mic())
        try:
            while not events or events[-1]["type"] != "response.done":
                events.append(json.loads(await asyncio.wait_for(conn.recv_bytes(), 120)))
        finally:
            sender.cancel()
    return events


def test_a_real_recording_through_the_sdk_is_transcribed_and_answered_in_speech(server):
    name = "goforward.wav"
    pcm24 = float_to_pcm16(resample(pcm16_to_float(speech(name)), 16000, 24000))
    events = asyncio.run(spoken_turn(server.http + "/v1", pcm24))
    kinds = [e["type"] for e in events]
    transcript = next(e["transcript"] for e in events if e["type"] ==
                      "conversation.item.input_audio_transcription.completed")
    assert jiwer.wer(normalise(reference(name)), normalise(transcript)) < 0.35, transcript
    done = events[-1]["response"]
    said = done["output"][0]["content"][0]["transcript"]
    assert done["status"] == "completed" and len(said.split()) >= 3, done
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta") == said
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    assert len(audio) / 2 / 24000 > 0.5, kinds
    # the reply's audio is speech that says the reply: our own ASR hears the same words
    heard = server.instance.whisper.transcribe(resample(pcm16_to_float(audio), 24000, 16000).astype(np.float32))
    assert jiwer.wer(normalise(said), normalise(heard)) < 0.5, (said, heard)
