
import numpy as np
import pytest

from voice.audio import float_to_pcm16, read_wav
from voice.config import VadConfig
from voice.pipeline.vad import Endpointer, VoiceEnd as SpeechStopped, VoiceStart as SpeechStarted
from fakes import SPEECH

RATE = 16000
LEAD_S = 0.5


@pytest.fixture(scope="module")
def speech_005() -> tuple[bytes, float]:
    """005.wav between 0.5 s of silence and 1 s of silence, and where its speech ends."""
    speech, rate = read_wav(SPEECH / "005.wav")
    assert rate == RATE
    audio = np.concatenate([np.zeros(int(LEAD_S * RATE)), speech, np.zeros(RATE)])
    return float_to_pcm16(audio), LEAD_S + len(speech) / RATE


def push_in_chunks(endpointer: Endpointer, pcm: bytes, sizes: list[int]) -> list:
    events, offset, i = [], 0, 0
    while offset < len(pcm):
        size = sizes[i % len(sizes)]
        events += endpointer.push(pcm[offset : offset + size])
        offset, i = offset + size, i + 1
    return events


def test_one_utterance_gives_one_start_then_one_stop(speech_005):
    pcm, speech_end_s = speech_005
    endpointer = Endpointer(VadConfig())
    events = endpointer.push(pcm)
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]
    started, stopped = events
    assert LEAD_S <= started.t_audio_s < LEAD_S + 0.5
    assert abs(stopped.speech_end_s - speech_end_s) < 0.5
    assert stopped.t_audio_s - stopped.speech_end_s == pytest.approx(0.4)
    assert not endpointer.in_speech


def test_speech_at_stream_start_is_found_after_warm_up():
    speech, _ = read_wav(SPEECH / "001.wav")
    events = Endpointer(VadConfig()).push(float_to_pcm16(np.concatenate([speech, np.zeros(RATE)])))
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]
    assert 0.18 <= events[0].t_audio_s < 0.3  # 120 ms warm-up + 60 ms start, at the earliest


def test_in_speech_tracks_state(speech_005):
    pcm, _ = speech_005
    endpointer = Endpointer(VadConfig())
    endpointer.push(pcm[: int(2.0 * RATE) * 2])
    assert endpointer.in_speech
    endpointer.reset()
    assert not endpointer.in_speech


def test_silence_and_noise_give_no_events():
    noise = np.random.default_rng(0).normal(0, 0.01, 3 * RATE)  # -40 dBFS hiss
    for audio in (np.zeros(3 * RATE), noise):
        endpointer = Endpointer(VadConfig())
        assert endpointer.push(float_to_pcm16(audio)) == []
        assert not endpointer.in_speech


def test_chunking_does_not_change_events(speech_005):
    pcm, _ = speech_005
    whole = Endpointer(VadConfig()).push(pcm)
    chunked = push_in_chunks(Endpointer(VadConfig()), pcm, [1, 333, 640, 7, 1001, 2])
    assert chunked == whole


def test_reset_restarts_stream_time(speech_005):
    pcm, _ = speech_005
    endpointer = Endpointer(VadConfig())
    first = endpointer.push(pcm)
    endpointer.reset()
    assert endpointer.push(pcm) == first


@pytest.mark.parametrize(
    "fields",
    [
        {"aggressiveness": 4},
        {"frame_ms": 25},
        {"start_ms": 0},
        {"hangover_ms": -1},
        {"warmup_ms": -1},
    ],
)
def test_config_rejects_bad_values(fields):
    with pytest.raises(ValueError):
        VadConfig(**fields)


def test_rejects_unsupported_sample_rate():
    with pytest.raises(ValueError, match="sample rate"):
        Endpointer(VadConfig(), sample_rate=22050)
