"""The Wyoming server on the real models, with real peers: the `wyoming` client for speech-to-text
(real recordings), text-to-speech and the assistant, and `wyoming-bench` (PyPI) run against it."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jiwer
import pytest
from wyoming.asr import Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.handle import Handled
from wyoming.tts import Synthesize

from fakes import REAL_REPLY_TOKENS, SPEECH, LiveServer, speech
from liveserver import free_port, wyoming_exchange
from voice.audio import float_to_int16, pcm16_to_float, resample
from voice.clients.bench import normalise
from voice.config import Config

pytestmark = [pytest.mark.slow, pytest.mark.live]

CHUNK = 2048  # bytes of 16 kHz PCM16 per audio-chunk: 64 ms, as a satellite sends


@pytest.fixture(scope="module")
def server(real_instance, tmp_path_factory):
    config = Config()
    config.lm.max_new_tokens = REAL_REPLY_TOKENS
    config.wyoming.port = free_port()
    config.records.path = str(tmp_path_factory.mktemp("records") / "r.sqlite3")
    with LiveServer(config, real_instance(config)) as srv:
        yield srv


def references() -> dict[str, str]:
    with open(SPEECH / "transcripts.tsv", newline="") as f:
        return {row["file"]: row["text"] for row in csv.DictReader(f, delimiter="\t")}


def exchange(port: int, *events, until: str) -> list:
    got = wyoming_exchange(port, *events, until=until, timeout=120.0)
    assert got and got[-1].type == until, f"the server closed before {until}: {[e.type for e in got]}"
    return got


def transcribe(port: int, pcm: bytes) -> str:
    chunks = [AudioChunk(rate=16000, width=2, channels=1, audio=pcm[i:i + CHUNK]).event()
              for i in range(0, len(pcm), CHUNK)]
    got = exchange(port, AudioStart(rate=16000, width=2, channels=1).event(), *chunks, AudioStop().event(),
                   until="transcript-stop")
    return Transcript.from_event(next(e for e in got if e.type == "transcript")).text


def test_speech_to_text_of_real_recordings(server):
    refs = references()
    hyps = [transcribe(server.config.wyoming.port, speech(name)) for name in refs]
    wer = jiwer.wer([normalise(r) for r in refs.values()], [normalise(h) for h in hyps])
    print(f"\nWyoming speech-to-text WER on tests/speech: {wer:.3f}")
    assert wer < 0.25, list(zip(refs.values(), hyps))


def test_text_to_speech_is_understood_by_our_own_ear(server):
    """Synthesised speech, resampled, goes back through the speech-to-text program."""
    text = "The front door is locked and the kitchen lights are off."
    got = exchange(server.config.wyoming.port, Synthesize(text=text).event(), until="audio-stop")
    start = AudioStart.from_event(got[0])
    audio = b"".join(AudioChunk.from_event(e).audio for e in got if e.type == "audio-chunk")
    assert start.rate == 22050 and len(audio) / 2 / start.rate > 2.0
    pcm16k = float_to_int16(resample(pcm16_to_float(audio), start.rate, 16000)).astype("<i2").tobytes()
    heard = transcribe(server.config.wyoming.port, pcm16k)
    assert jiwer.wer(normalise(text), normalise(heard)) < 0.3, heard


def test_the_assistant_answers_with_the_real_lm(server):
    got = exchange(server.config.wyoming.port, Transcript(text="What is the capital of France?").event(),
                   until="handled-stop")
    handled = Handled.from_event(next(e for e in got if e.type == "handled"))
    assert "paris" in handled.text.lower(), handled.text
    assert handled.context["conversation_id"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """tests/speech as wyoming-bench wants it: each WAV beside a .txt of its transcript."""
    folder = tmp_path_factory.mktemp("corpus")
    for name, text in references().items():
        shutil.copyfile(SPEECH / name, folder / name)
        (folder / name).with_suffix(".txt").write_text(text + "\n")
    return folder


def wyoming_bench(*args: str) -> str:
    run = subprocess.run([str(Path(sys.executable).parent / "wyoming-bench"), *args], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout + run.stderr


def test_wyoming_bench_against_our_server(server, corpus):
    address = f"127.0.0.1:{server.config.wyoming.port}"
    info = wyoming_bench("info", address)
    assert "diffusion-voice-asr" in info and "diffusion-voice-tts" in info, info
    stt = wyoming_bench("stt", address, "--corpus", str(corpus), "--rounds", "1", "--warmup", "0")
    print("\n" + stt)
    n = len(references())  # every recording transcribed, in both modes (its WER counts "10" against "ten")
    assert re.findall(r"\[(\w+)\] ok=(\d+) fail=(\d+)", stt) == [("non_streaming", str(n), "0"),
                                                                ("streaming", str(n), "0")], stt
    tts = wyoming_bench("tts", address, "--rounds", "1", "--warmup", "0", "--texts", "Turn on the kitchen lights.")
    print("\n" + tts)
    assert re.findall(r"\[(\w+)\] ok=(\d+) fail=(\d+)", tts) == [("non_streaming", "1", "0"),
                                                                ("streaming", "1", "0")], tts
