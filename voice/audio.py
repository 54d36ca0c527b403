"""PCM conversions, resampling and G.711 codecs shared by the voice stages.

Float32 in [-1, 1] is the working format; int16 PCM and G.711 bytes are the wire formats.
"""

import wave
from pathlib import Path

import numpy as np
import soxr

RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)  # audio rates a client may use

_INT16_SCALE = 32768.0


def pcm16_to_float(b: bytes) -> np.ndarray:
    """Little-endian int16 PCM bytes to float32 samples in [-1, 1)."""
    return np.frombuffer(b, dtype="<i2").astype(np.float32) / _INT16_SCALE


def float_to_int16(x: np.ndarray) -> np.ndarray:
    """Float samples to int16, clipping so overshoot saturates instead of wrapping."""
    return np.clip(np.rint(x * _INT16_SCALE), -32768, 32767).astype(np.int16)


def float_to_pcm16(x: np.ndarray) -> bytes:
    """Float samples to little-endian int16 PCM bytes (clipped)."""
    return float_to_int16(x).astype("<i2").tobytes()


def resample(x: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Resample float audio with soxr; a no-op when the rates already match."""
    if from_rate == to_rate:
        return x
    return soxr.resample(np.asarray(x, dtype=np.float32), from_rate, to_rate)


class StreamResampler:
    """A stream of float audio to `out_rate`, chunk by chunk without clicks at the joins (soxr's
    stream); the input rate may change between chunks (a new stream starts then)."""

    def __init__(self, out_rate: int):
        self.out_rate, self.in_rate = out_rate, out_rate
        self.stream: soxr.ResampleStream | None = None

    def push(self, audio: np.ndarray, rate: int) -> np.ndarray:
        if rate != self.in_rate:
            self.in_rate = rate
            self.stream = (soxr.ResampleStream(rate, self.out_rate, 1, dtype="float32") if rate != self.out_rate
                           else None)
        return self.stream.resample_chunk(audio) if self.stream is not None else audio


def trim_silence(x: np.ndarray, rate: int, lead_ms: float, tail_ms: float | None,
                 below_peak_db: float = 40.0) -> np.ndarray:
    """Float audio with its leading silence cut to `lead_ms` and, unless `tail_ms` is None, its
    trailing silence to `tail_ms` (silence: quieter than `below_peak_db` under the clip's peak);
    the cut edges fade over 5 ms, so nothing clicks."""
    loud = np.flatnonzero(np.abs(x) > np.abs(x).max(initial=0.0) * 10 ** (-below_peak_db / 20))
    if not loud.size:
        return x
    start = max(int(loud[0] - lead_ms * rate / 1000), 0)
    end = len(x) if tail_ms is None else min(int(loud[-1] + 1 + tail_ms * rate / 1000), len(x))
    out = np.array(x[start:end], dtype=np.float32)
    fade = min(int(0.005 * rate), len(out))
    if start > 0:
        out[:fade] *= np.linspace(0.0, 1.0, fade, dtype=np.float32)
    if end < len(x):
        out[len(out) - fade:] *= np.linspace(1.0, 0.0, fade, dtype=np.float32)
    return out


def rms_dbfs(x: np.ndarray) -> float:
    """RMS level of float audio relative to full scale; -inf for empty or digital silence."""
    if x.size == 0:
        return float("-inf")
    rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))
    return 20.0 * np.log10(rms) if rms > 0 else float("-inf")


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Read a 16-bit PCM WAV as float32 mono (channels averaged) and its sample rate."""
    with wave.open(str(path), "rb") as wav:
        if wav.getsampwidth() != 2:
            raise ValueError(f"{path}: expected 16-bit PCM, got {8 * wav.getsampwidth()}-bit")
        channels, rate = wav.getnchannels(), wav.getframerate()
        samples = pcm16_to_float(wav.readframes(wav.getnframes()))
    return samples.reshape(-1, channels).mean(axis=1, dtype=np.float32), rate


# G.711 (telephony) codecs. Each direction is one lookup table built at import:
# 256 entries to decode a byte, 65536 entries (indexed by the int16 bit pattern) to encode.

_ALL_BYTES = np.arange(256, dtype=np.int32)
_ALL_INT16 = np.arange(-32768, 32768, dtype=np.int32)


def _bit_length(v: np.ndarray) -> np.ndarray:
    """Bit length of positive integers (frexp's exponent is exact for these sizes)."""
    return np.frexp(v.astype(np.float64))[1]


def _build_ulaw_decode() -> np.ndarray:
    code = ~_ALL_BYTES & 0xFF
    exponent, mantissa = (code >> 4) & 0x07, code & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(code & 0x80, -magnitude, magnitude).astype(np.int16)


def _build_ulaw_encode() -> np.ndarray:
    value = _ALL_INT16 >> 2  # µ-law codes 14-bit magnitudes
    # 8158 + 0x21 = 0x1FFF, the top of the last segment, so loud samples saturate.
    biased = np.minimum(np.abs(value), 8158) + 0x21
    segment = _bit_length(biased) - 6
    mantissa = (biased >> (segment + 1)) & 0x0F
    mask = np.where(value < 0, 0x7F, 0xFF)
    return (((segment << 4) | mantissa) ^ mask).astype(np.uint8)


def _build_alaw_decode() -> np.ndarray:
    code = _ALL_BYTES ^ 0x55
    exponent, mantissa = (code >> 4) & 0x07, code & 0x0F
    magnitude = (mantissa << 4) + 8
    shift = np.maximum(exponent - 1, 0)
    magnitude = np.where(exponent > 0, (magnitude + 0x100) << shift, magnitude)
    return np.where(code & 0x80, magnitude, -magnitude).astype(np.int16)


def _build_alaw_encode() -> np.ndarray:
    value = _ALL_INT16 >> 3
    negative = value < 0
    magnitude = np.where(negative, -value - 1, value)
    segment = np.maximum(_bit_length(magnitude) - 5, 0)
    mantissa = np.where(segment < 2, magnitude >> 1, magnitude >> segment) & 0x0F
    mask = np.where(negative, 0x55, 0xD5)
    return (((segment << 4) | mantissa) ^ mask).astype(np.uint8)


_ULAW_DECODE = _build_ulaw_decode()
_ULAW_ENCODE = _build_ulaw_encode()
_ALAW_DECODE = _build_alaw_decode()
_ALAW_ENCODE = _build_alaw_encode()


def _table_index(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.int16).astype(np.int32) + 32768


def ulaw_decode(b: bytes) -> np.ndarray:
    """G.711 µ-law bytes to int16 samples."""
    return _ULAW_DECODE[np.frombuffer(b, dtype=np.uint8)]


def ulaw_encode(x: np.ndarray) -> bytes:
    """int16 samples to G.711 µ-law bytes."""
    return _ULAW_ENCODE[_table_index(x)].tobytes()


def alaw_decode(b: bytes) -> np.ndarray:
    """G.711 A-law bytes to int16 samples."""
    return _ALAW_DECODE[np.frombuffer(b, dtype=np.uint8)]


def alaw_encode(x: np.ndarray) -> bytes:
    """int16 samples to G.711 A-law bytes."""
    return _ALAW_ENCODE[_table_index(x)].tobytes()
