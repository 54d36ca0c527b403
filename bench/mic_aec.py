"""`voice mic`'s echo canceller (WebRTC AEC3 from the livekit wheel) offline: cost per 10 ms frame,
echo return loss enhancement (ERLE), and the user's level when they talk over the reply.

The reply is six clips of tests/speech (14 s) played at the output rate; the microphone hears it
`--echo-db` under its own level after `--delay-ms`, through a short room response, and the user's clip
(003.wav) over it from 8 s on. `voice.clients.mic.EchoCanceller` gets both as `voice mic` feeds it:
the played blocks (20 ms, split in 10 ms) as its reference, the microphone's 20 ms frames at 16 kHz.
ERLE is the echo alone from 3 s to the user's start, before against after; "user" compares the
output where the user talks (over the echo) with the user's clip alone. The live check is
tests/test_mic.py::test_echo_is_cancelled_and_the_user_still_heard (PulseAudio, a loopback echo).

    PYTHONPATH=. .venv/bin/python bench/mic_aec.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from voice.audio import float_to_int16, read_wav, resample
from voice.clients.mic import FRAME_MS, RATE, EchoCanceller

SPEECH = Path(__file__).resolve().parents[1] / "tests" / "speech"
REPLY = ("005.wav", "001.wav", "002.wav", "004.wav", "forever.wav", "goforward.wav")
USER_AT_S = 8.0


def clip(name: str, rate: int = RATE) -> np.ndarray:
    audio, r = read_wav(SPEECH / name)
    return resample(audio, r, rate)


def db(x: np.ndarray) -> float:
    return float(10 * np.log10((np.asarray(x, np.float64) ** 2).mean() + 1e-12))


def run(play_rate: int, echo_db: float, delay_ms: int) -> dict[str, float]:
    reply = np.concatenate([clip(n) for n in REPLY])
    user = clip("003.wav")
    n = len(reply) + RATE
    echo = np.zeros(n, np.float32)
    d = RATE * delay_ms // 1000
    echo[d:d + len(reply)] = reply * 10 ** (echo_db / 20)
    echo = np.convolve(echo, [1.0, 0.5, 0.25, -0.1, 0.05])[:n].astype(np.float32)  # a short room response
    at = int(USER_AT_S * RATE)
    near = np.zeros(n, np.float32)
    near[at:at + len(user)] = user
    mic = float_to_int16(echo + near)
    played = float_to_int16(resample(np.concatenate([reply, np.zeros(n - len(reply), np.float32)]), RATE, play_rate))

    aec = EchoCanceller(play_rate)
    aec.delay_ms = delay_ms
    step_in, step_out = RATE * FRAME_MS // 1000, play_rate * FRAME_MS // 1000
    out, spent = [], 0.0
    for i in range(n // step_in):
        t0 = time.perf_counter()
        aec.played(played[i * step_out:(i + 1) * step_out].astype("<i2").tobytes())
        out.append(aec.heard(mic[i * step_in:(i + 1) * step_in].astype("<i2").tobytes()))
        spent += time.perf_counter() - t0
    cleaned = np.frombuffer(b"".join(out), dtype="<i2").astype(np.float32)
    mic_f = mic.astype(np.float32)
    echo_only = slice(3 * RATE, at - RATE // 5)
    talk = slice(at, at + len(user))
    return {"ms_per_10ms": 1000 * spent / (2 * (n // step_in)),
            "erle_db": db(mic_f[echo_only]) - db(cleaned[echo_only]),
            "user_over_echo_db": db(cleaned[talk]) - db(near[talk] * 32768)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--play-rates", default="16000,24000,48000", help="output stream rates to try")
    parser.add_argument("--echo-db", type=float, default=-10.0, help="the echo's level against the reply's")
    parser.add_argument("--delay-ms", type=int, default=50)
    a = parser.parse_args()
    for rate in (int(r) for r in a.play_rates.split(",")):
        r = run(rate, a.echo_db, a.delay_ms)
        print(f"speaker {rate} Hz: {r['ms_per_10ms']:.3f} ms per 10 ms frame (reference + microphone), "
              f"ERLE {r['erle_db']:.1f} dB, the user over the echo {r['user_over_echo_db']:+.1f} dB against alone")


if __name__ == "__main__":
    main()
