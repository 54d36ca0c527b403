
import numpy as np
import pytest

from voice.audio import (
    alaw_decode,
    alaw_encode,
    float_to_pcm16,
    pcm16_to_float,
    read_wav,
    resample,
    rms_dbfs,
    ulaw_decode,
    ulaw_encode,
)
from fakes import SPEECH

ALL_CODES = bytes(range(256))
ALL_INT16 = np.arange(-32768, 32768, dtype=np.int16)
# Reference values from the ITU-T G.711 reference implementation (as in CPython's audioop).
SAMPLES = np.array([-32768, -1000, -1, 0, 1, 1000, 32767], dtype=np.int16)


def test_pcm16_float_round_trip_is_exact():
    pcm = ALL_INT16.astype("<i2").tobytes()
    x = pcm16_to_float(pcm)
    assert x.dtype == np.float32
    assert x.min() == -1.0 and x.max() < 1.0
    assert float_to_pcm16(x) == pcm


def test_float_to_pcm16_clips():
    pcm = float_to_pcm16(np.array([-2.0, 2.0], dtype=np.float32))
    assert np.frombuffer(pcm, dtype="<i2").tolist() == [-32768, 32767]


def test_ulaw_known_values():
    assert ulaw_decode(b"\xff").tolist() == [0]
    assert ulaw_encode(np.zeros(1, dtype=np.int16)) == b"\xff"
    assert ulaw_decode(bytes([0x00, 0x80, 0x7F, 0x9C])).tolist() == [-32124, 32124, 0, 9852]
    assert ulaw_encode(SAMPLES).hex() == "004e7effffce80"


def test_alaw_known_values():
    assert alaw_decode(b"\xd5").tolist() == [8]
    assert alaw_decode(bytes([0x55, 0x2A, 0xAA])).tolist() == [-8, -32256, 32256]
    assert alaw_encode(SAMPLES).hex() == "2a7a55d5d5faaa"


@pytest.mark.parametrize(
    "decode, encode", [(ulaw_decode, ulaw_encode), (alaw_decode, alaw_encode)]
)
def test_g711_round_trips(decode, encode):
    levels = decode(ALL_CODES)
    assert levels.dtype == np.int16
    assert np.array_equal(decode(encode(levels)), levels)  # every level is a fixed point
    # Companding error stays within a few percent of the signal (plus a small floor).
    error = np.abs(decode(encode(ALL_INT16)).astype(np.int32) - ALL_INT16)
    assert np.all(error <= np.abs(ALL_INT16.astype(np.int32)) * 0.07 + 40)


def test_resample_keeps_duration_and_tone():
    t = np.arange(16000) / 16000
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    assert resample(tone, 16000, 16000) is tone
    down = resample(tone, 16000, 8000)
    assert down.dtype == np.float32 and len(down) == 8000
    assert abs(rms_dbfs(down) - rms_dbfs(tone)) < 0.5


def test_rms_dbfs():
    assert rms_dbfs(np.zeros(100, dtype=np.float32)) == float("-inf")
    assert rms_dbfs(np.array([], dtype=np.float32)) == float("-inf")
    assert rms_dbfs(np.ones(100, dtype=np.float32)) == pytest.approx(0.0)
    assert rms_dbfs(np.full(100, 0.1, dtype=np.float32)) == pytest.approx(-20.0)


def test_read_wav():
    samples, rate = read_wav(SPEECH / "001.wav")
    assert rate == 16000
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert len(samples) / rate == pytest.approx(1.095, abs=0.01)
    assert rms_dbfs(samples) > -40
