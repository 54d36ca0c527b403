"""webrtcvad against Silero VAD for "is this the user speaking?": cost per 20 ms frame, and accuracy on
`voice room-eval`'s rooms (issue 55), each detector alone and behind the endpointer's level gate.

The rooms are mixed offline as the evaluation mixes them (voice/evals/room_eval.py: every clip of tests/speech
at the speaker's level, the room under it, 1.5 s before and 2 s after). A frame is the user's where the
clip alone is within 20 dB of its active level; "user" is the share of those frames a detector calls
speech, "room" the share of the others (the room alone, and the clip's silences) it calls speech.
Silero's ONNX comes from the `silero-vad` wheel (not a dependency: `pip download silero-vad --no-deps`,
unzip, pass `--silero-onnx .../silero_vad/data/silero_vad.onnx`); it reads 32 ms windows, each given to
the 20 ms frames it covers, threshold 0.5.

    PYTHONPATH=. .venv/bin/python bench/vad_compare.py --silero-onnx /tmp/silero_vad.onnx
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import onnxruntime
import webrtcvad

from voice.evals import room_eval
from voice.audio import float_to_pcm16, read_wav, resample
from voice.config import VadConfig
from voice.evals.room_eval import FRAME, RATE, SPEAKER_DB, Room
from voice.pipeline.vad import Levels

SILERO_WINDOW, SILERO_CONTEXT = 512, 64


class Silero:
    """Silero VAD v5's ONNX, streaming: a speech probability per 32 ms window."""

    def __init__(self, path: Path):
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.state = np.zeros((2, 1, 128), dtype=np.float32)
        self.context = np.zeros(SILERO_CONTEXT, dtype=np.float32)

    def probability(self, window: np.ndarray) -> float:
        x = np.concatenate([self.context, window]).astype(np.float32)[np.newaxis]
        out, self.state = self.session.run(None, {"input": x, "state": self.state, "sr": np.array(RATE)})
        self.context = window[-SILERO_CONTEXT:]
        return float(np.asarray(out).ravel()[0])

    def frames(self, audio: np.ndarray) -> np.ndarray:
        """Speech or not per 20 ms frame of `audio`."""
        n = len(audio) // FRAME
        speech = np.zeros(n, dtype=bool)
        for start in range(0, len(audio) - SILERO_WINDOW + 1, SILERO_WINDOW):
            if self.probability(audio[start:start + SILERO_WINDOW]) >= 0.5:
                speech[start // FRAME:min((start + SILERO_WINDOW) // FRAME + 1, n)] = True
        return speech


def webrtc_frames(audio: np.ndarray, aggressiveness: int = 2) -> np.ndarray:
    vad, pcm = webrtcvad.Vad(aggressiveness), float_to_pcm16(audio)
    return np.array([vad.is_speech(pcm[2 * i * FRAME:2 * (i + 1) * FRAME], RATE) for i in range(len(audio) // FRAME)])


def gated(audio: np.ndarray, voiced: np.ndarray) -> np.ndarray:
    """The level gate (voice/pipeline/vad.py's Levels) over a detector's decisions, with the endpointer's warm-up,
    start (3 frames) and hangover (20 frames) deciding when the user is in speech."""
    config = VadConfig()
    levels, pcm, out = Levels(config), float_to_pcm16(audio), []
    in_speech, run = False, 0
    for i, v in enumerate(voiced):
        warming_up = i < config.warmup_ms // config.frame_ms
        users = levels.hear(pcm[2 * i * FRAME:2 * (i + 1) * FRAME], bool(v) and not warming_up, in_speech)
        run = run + 1 if users != in_speech else 0
        if run >= (config.start_ms if not in_speech else config.hangover_ms) // config.frame_ms:
            in_speech, run = not in_speech, 0
        out.append(users)
    return np.array(out)


def mixes(room: Room, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(the mix, which frames are the user's) for each clip in `room`."""
    rng, out = np.random.default_rng(seed), []
    for path in sorted(room_eval.SPEECH.glob("*.wav")):
        audio, rate = read_wav(path)
        user = room_eval.at_level(resample(audio, rate, RATE), SPEAKER_DB)
        lead = int(room_eval.LEAD_S * RATE)
        clean = np.zeros(lead + len(user) + 2 * RATE, dtype=np.float32)
        clean[lead:lead + len(user)] = user
        mix = clean + room_audio(room, len(clean), rng, path.name)
        out.append((mix, room_eval.frame_levels_db(clean) > room_eval.active_level_db(user) - 20))
    return out


def room_audio(room: Room, n: int, rng: np.random.Generator, exclude: str) -> np.ndarray:
    return room_eval.room_audio(room, n, rng, SPEAKER_DB - room.below_db, exclude=exclude)


def cost_ms_per_frame(silero: Silero | None, seconds: float = 20.0) -> dict[str, float]:
    """Wall ms per 20 ms of audio, one thread, on the babble:15 room (interleaved: webrtcvad, then Silero)."""
    audio = room_audio(Room("babble", 15), int(seconds * RATE), np.random.default_rng(3), "")
    frames = len(audio) // FRAME
    out = {}
    start = time.perf_counter()
    webrtc_frames(audio)
    out["webrtcvad"] = (time.perf_counter() - start) * 1000 / frames
    if silero is not None:
        start = time.perf_counter()
        silero.frames(audio)
        out["silero"] = (time.perf_counter() - start) * 1000 / frames
    start = time.perf_counter()
    gated(audio, np.ones(frames, dtype=bool))
    out["level gate"] = (time.perf_counter() - start) * 1000 / frames
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--silero-onnx", default="", help="silero_vad.onnx from the silero-vad wheel")
    parser.add_argument("--rooms", default="quiet,pink:10,babble:25,babble:15,babble:10")
    a = parser.parse_args()
    onnx = Path(a.silero_onnx) if a.silero_onnx else None
    cost = cost_ms_per_frame(Silero(onnx) if onnx else None)
    print("ms per 20 ms frame, one thread: " + "  ".join(f"{k} {v:.3f}" for k, v in cost.items()))
    print(f"{'room':10s} {'detector':18s} {'user':>6s} {'room':>6s}")
    for room in (Room.parse(r) for r in a.rooms.split(",")):
        rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        for mix, user in mixes(room):
            detectors = {"webrtcvad": webrtc_frames(mix)}
            if onnx:
                detectors["silero"] = Silero(onnx).frames(mix)
            for name, voiced in list(detectors.items()):
                detectors[f"{name}+gate"] = gated(mix, voiced)
            for name, voiced in detectors.items():
                rows.setdefault(name, []).append((voiced[:len(user)], user[:len(voiced)]))
        for name, pairs in rows.items():
            voiced, user = np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])
            print(f"{room.name:10s} {name:18s} {voiced[user].mean():6.2f} {voiced[~user].mean():6.2f}")


if __name__ == "__main__":
    main()
