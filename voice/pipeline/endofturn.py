"""Is the user's turn over? Asked once they have been quiet a short while (`turn.min_silence_ms`).

A fixed VAD hangover is both too long for a finished "Yes." and too short for someone pausing in
the middle of a phone number. Two signals say which it is: Smart Turn v3.2 (Pipecat's ~8M-parameter
audio model, BSD-2) hears whether the speech so far sounds finished, and the LM reads whether the
transcript so far is (the probability of its end-of-turn token right after the user's words,
`voice.pipeline.lm.Chat.end_of_turn_probability`). The less likely the turn is over, the longer the policy
waits in silence: done at `min_silence_ms` from the policy's threshold on, then a threshold falling
linearly to 0 at `ceiling_ms`, where the turn is over whatever the signals say. If the user speaks
again before then, it was a pause, and the next silence asks again.

`EndOfTurn.decide` runs Smart Turn on the scheduler's "endofturn" worker as work someone waits for,
beside the LM's forward on the engine's own thread, never on the event loop. Figures (cut-offs,
waits, CPU per decision): `voice eot-eval`, BENCHMARKS.md "End of turn".
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.metadata
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import re

import numpy as np
import onnxruntime
from faster_whisper.feature_extractor import FeatureExtractor

from engine.common.packages import MissingPackageError
from voice.config import TurnConfig, VadConfig
from voice.service.scheduler import Scheduler, Worker

SAMPLE_RATE = 16000

# Smart Turn v3.2, int8 ONNX, as shipped in the pipecat-ai wheel (./dev installs it --no-deps)
SMART_TURN_PACKAGE, SMART_TURN_VERSION = "pipecat-ai", "1.14.0"
SMART_TURN_FILE = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
SMART_TURN_SIZE = 8_679_182
SMART_TURN_SHA256 = "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"
SMART_TURN_WINDOW_S = 8  # it hears the last 8 s, zero-padded in front when shorter

# Probability from which a policy says "done" at min_silence_ms, calibrated on the calibration split of
# `voice eot-eval` (BENCHMARKS.md, "End of turn"); `turn.threshold` overrides it.
THRESHOLDS = {"smart_turn": 0.9, "lm": 0.7, "combined": 0.45}

# OpenAI Realtime's semantic_vad eagerness: how soon to answer. (threshold scale, ceiling scale)
EAGERNESS = {"low": (1.5, 1.5), "medium": (1.0, 1.0), "auto": (1.0, 1.0), "high": (0.5, 0.6)}

TextSignal = Callable[[str], Awaitable[float | None]]  # transcript -> the LM's probability (None: no signal)


def reads_finished(text: str) -> bool:
    """Does Whisper's transcript end a sentence (., ? or !, not a trailing "...")? It writes "Feels like..."
    and "Can you remind me to call my" for speech cut mid-sentence, but "10 of close." too: the `shape`
    policy's signal, free, and right for 6 of 11 of `voice eot-eval`'s 0.6 s pauses (BENCHMARKS.md)."""
    text = text.strip()
    return bool(re.search(r"[.?!]$", text)) and not text.endswith("...")


# Words a finished English sentence rarely ends on: conjunctions, prepositions, articles and
# possessives, fillers. Whisper writes "Set a timer for." and "Feels like these days go on." for
# speech cut mid-sentence; a reply to such words is prepared but not voiced yet (`unfinished`).
TRAILING_WORDS = frozenset(
    "and or but so because if that than then when while where which who whose "
    "of for to in on at by with from about into like as "
    "a an the my your our their his her its this these those some any "
    "um uh hmm er erm".split())


def unfinished(text: str) -> str | None:
    """Why the words so far may be unfinished, the surest first: "trails" (a trailing "...", or a statement
    ending on one of TRAILING_WORDS: "Set a timer for.", "Can you remind me to call my"), "open_list" (a
    list not closed: `open_list`), "unmarked" (no end mark, the words otherwise whole: Whisper writes "7 of
    clubs" and "5, 5" for complete clips as often as "My number is 555-0142" for one cut in a pause); None
    when they read finished; a question ends a turn whatever its last word ("What is it made of?"). How long
    each holds a reply: `hold_for`; BENCHMARKS.md "Heard in a room"."""
    text = text.strip()
    if not text:
        return None
    words = re.findall(r"[a-z']+", text.lower())
    statement = not text.endswith("?")
    if text.endswith("...") or (statement and bool(words) and words[-1] in TRAILING_WORDS):
        return "trails"
    if statement and open_list(text):
        return "open_list"
    return None if reads_finished(text) else "unmarked"


LIST_SOUNDS_FINISHED = 0.5  # Smart Turn's probability from which a list not closed is heard as finished


def hold_for(why: str | None, sounds_finished: float | None, hold_ms: int, unmarked_ms: int) -> int:
    """How long after the user's last word a reply to words `unfinished` calls `why` may first be heard
    (`turn.hold_ms`, `turn.hold_unmarked_ms`). A list not closed is held only when Smart Turn
    (`sounds_finished`, None: not heard) does not hear the audio as finished: "Eight of spades, four of clubs,
    seven of hearts." said whole scored 0.99, "I need eggs, milk, bread" cut at its pause 0.04. Words that only
    lack an end mark wait `unmarked_ms` (at most `hold_ms`): enough for a 0.6 s pause (0.46-0.56 s of VAD
    silence, the user heard again 60 ms into their next word), and on a 2-core box no longer than the reply
    takes to make."""
    if why == "trails" or (why == "open_list" and (sounds_finished is None or sounds_finished < LIST_SOUNDS_FINISHED)):
        return hold_ms
    return min(hold_ms, unmarked_ms) if why == "unmarked" else 0


def open_list(text: str) -> bool:
    """Is `text` a list of three or more items with no "and"/"or" before the last ("I need eggs, milk,
    bread.")? People close a list they have finished; Whisper writes a full stop at a pause in one."""
    items = [item for item in re.split(r",\s*", text.strip().rstrip(".!")) if item.strip()]
    last = re.findall(r"[a-z']+", items[-1].lower()) if items else []
    return len(items) >= 3 and bool(last) and last[0] not in ("and", "or")


def smart_turn_path() -> Path:
    """Smart Turn's ONNX inside the installed pipecat-ai, checked by size and SHA-256."""
    try:
        dist = importlib.metadata.distribution(SMART_TURN_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is None or dist.version != SMART_TURN_VERSION:
        found = f"version {dist.version} is installed" if dist else "it is not installed"
        raise MissingPackageError(f"Smart Turn needs {SMART_TURN_PACKAGE}=={SMART_TURN_VERSION} ({found}): "
                                  f"pip install --no-deps {SMART_TURN_PACKAGE}=={SMART_TURN_VERSION} (./dev setup)")
    return checked(Path(str(dist.locate_file(SMART_TURN_FILE))), SMART_TURN_SIZE, SMART_TURN_SHA256)


def checked(path: Path, size: int, sha256: str) -> Path:
    """`path` if it is the file of that size and SHA-256, else MissingPackageError saying how to mend it."""
    if not path.is_file():
        raise MissingPackageError(f"{path} is missing: reinstall {SMART_TURN_PACKAGE}=={SMART_TURN_VERSION}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if path.stat().st_size != size or digest != sha256:
        raise MissingPackageError(f"{path} is not the file we checked ({path.stat().st_size} bytes, SHA-256 "
                                  f"{digest}; expected {size}, {sha256}): pip install --force-reinstall --no-deps "
                                  f"{SMART_TURN_PACKAGE}=={SMART_TURN_VERSION}")
    return path


class SmartTurn:
    """Smart Turn v3.2: the probability that speech ending where the audio ends is a finished turn.

    Its input is Whisper's 80-bin log-mel spectrogram of the last 8 s (zero-mean, unit-variance
    samples first), which faster-whisper's own feature extractor computes (checked against Pipecat's:
    within 5e-6). Thread-safe: onnxruntime sessions may run concurrently."""

    def __init__(self, path: Path | None = None, threads: int = 1) -> None:
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        # The int8 model's u8 x s8 products summed in pairs saturate at int16 in ONNX Runtime's AVX2
        # (and AVX-512 without VNNI) kernels: on such CPUs (Zen 3) a cut "four" scored 0.89 instead of
        # 0.42. u8 x u8 instead, as exact as VNNI's kernels (which this option leaves as they are).
        options.add_session_config_entry("session.x64quantprecision", "1")
        self.session = onnxruntime.InferenceSession(str(path or smart_turn_path()), options,
                                                    providers=["CPUExecutionProvider"])
        self.features = FeatureExtractor(feature_size=80, sampling_rate=SAMPLE_RATE, chunk_length=SMART_TURN_WINDOW_S)
        # ONNX Runtime sets itself up on the first run (1.3 s against 0.17 s after, on a shared Zen 4): here, not
        # in someone's turn
        self.probability(np.zeros(SAMPLE_RATE, dtype=np.float32))

    def probability(self, audio: np.ndarray) -> float:
        """`audio`: 16 kHz mono float in [-1, 1], the utterance so far with its trailing silence."""
        window = np.zeros(SMART_TURN_WINDOW_S * SAMPLE_RATE, dtype=np.float32)
        tail = np.asarray(audio, dtype=np.float32)[-len(window):]
        if len(tail):
            window[-len(tail):] = tail
        window = (window - window.mean()) / np.sqrt(window.var() + 1e-7)
        mel = self.features(window, padding=0)  # (80, 800): 10 ms hops over 8 s
        (out,) = self.session.run(None, {"input_features": mel[np.newaxis].astype(np.float32)})
        return float(np.asarray(out).ravel()[0])


@dataclass(frozen=True)
class Verdict:
    """The policy's answer at `silence_ms` of silence."""

    done: bool  # the turn is over now
    wait_ms: int  # the silence at which it is over if the user stays quiet (<= silence_ms when done)
    probability: float | None = None  # the combined probability that the turn is over (None: not asked)
    audio: float | None = None  # Smart Turn's probability
    text: float | None = None  # the LM's probability
    spent_ms: float = 0.0  # wall time the signals took (they run at once)

    def __str__(self) -> str:  # as each verdict is logged
        def p(probability: float | None) -> str:
            return "-" if probability is None else f"{probability:.2f}"
        return (f"{'done' if self.done else 'not yet'} (p {p(self.probability)}: audio {p(self.audio)}, "
                f"text {p(self.text)}), wait {self.wait_ms} ms, decided in {self.spent_ms:.0f} ms")


def wait_for(probability: float, threshold: float, min_silence_ms: int, ceiling_ms: int) -> int:
    """The silence after which the turn is over: `min_silence_ms` from `threshold` on, then longer as
    the probability falls, up to `ceiling_ms` at 0."""
    short = min(probability / threshold, 1.0) if threshold > 0 else 1.0
    return round(ceiling_ms - short * (ceiling_ms - min_silence_ms))


def for_eagerness(config: TurnConfig, eagerness: str) -> TurnConfig:
    """The Realtime API's `semantic_vad` eagerness on our policy: `low` waits for more certainty and
    longer (up to 1.5x the ceiling), `high` answers sooner (half the threshold, 0.6x the ceiling);
    `medium` and `auto` are the configuration as it is."""
    if eagerness not in EAGERNESS:
        raise ValueError(f"eagerness must be one of {', '.join(EAGERNESS)}, not {eagerness!r}")
    scale_threshold, scale_ceiling = EAGERNESS[eagerness]
    policy = config.policy if config.policy in THRESHOLDS else "combined"  # semantic_vad asks for a probability
    threshold = config.threshold if config.threshold is not None else THRESHOLDS[policy]
    ceiling = max(round(config.ceiling_ms * scale_ceiling), config.min_silence_ms)
    return dataclasses.replace(config, policy=policy, threshold=min(threshold * scale_threshold, 1.0),
                               ceiling_ms=ceiling)


class EndOfTurn:
    """A session's policy (its own TurnConfig: Realtime's semantic_vad eagerness adjusts it) on the
    shared Smart Turn model. `decide` is the one question."""

    def __init__(self, config: TurnConfig, vad: VadConfig, worker: Worker | None = None,
                 smart_turn: SmartTurn | None = None) -> None:
        """`worker`: where Smart Turn runs (the stages' "endofturn" worker, shared by the sessions);
        `smart_turn`: the loaded model, shared too (loaded here when the policy needs it and none is given)."""
        self.config, self.vad = config, vad
        needs_audio = config.policy in ("smart_turn", "combined")
        self.smart_turn = (smart_turn or SmartTurn(threads=config.threads)) if needs_audio else smart_turn
        self.worker = worker or Scheduler().worker("endofturn")

    @property
    def reads_text(self) -> bool:
        """Does the policy read the transcript (so it is worth waiting for)?"""
        return self.config.policy in ("lm", "combined", "shape")

    @property
    def threshold(self) -> float:
        policy = self.config.policy
        return self.config.threshold if self.config.threshold is not None else THRESHOLDS.get(policy, 1.0)

    async def decide(self, audio: np.ndarray, silence_ms: int, text: str | None,
                     text_signal: TextSignal | None = None) -> Verdict:
        """Is the turn over, `silence_ms` into a silence after `audio` (the utterance so far, 16 kHz
        float, its silence included) in which the user said `text` (a transcript, None if there is
        none yet)? `text_signal`: the session's LM (`chat.end_of_turn_probability` with the
        conversation bound). Not done: it is once silence reaches `wait_ms`, unless the user speaks."""
        cfg = self.config
        if cfg.policy == "fixed":
            return Verdict(silence_ms >= self.vad.hangover_ms, self.vad.hangover_ms)
        if silence_ms < cfg.min_silence_ms:
            return Verdict(False, cfg.min_silence_ms)
        if silence_ms >= cfg.ceiling_ms:
            return Verdict(True, cfg.ceiling_ms)
        if cfg.policy == "shape":  # a transcript that reads finished ends at the hangover, any other at the ceiling
            wait = self.vad.hangover_ms if text is None or reads_finished(text) else cfg.ceiling_ms
            return Verdict(silence_ms >= wait, wait)
        start = time.perf_counter()
        audio_p, text_p = await asyncio.gather(self._audio(audio), self._text(text, text_signal))
        spent = (time.perf_counter() - start) * 1000
        probability = self.combine(audio_p, text_p)
        if probability is None:  # no signal at all (the LM alone, without a transcript): the VAD's hangover
            wait = min(max(self.vad.hangover_ms, cfg.min_silence_ms), cfg.ceiling_ms)
        else:
            wait = wait_for(probability, self.threshold, cfg.min_silence_ms, cfg.ceiling_ms)
        return Verdict(silence_ms >= wait, wait, probability, audio_p, text_p, spent)

    @staticmethod
    def combine(audio: float | None, text: float | None) -> float | None:
        """The policy's probability from the signals it has: the lower of the two, so the turn ends at
        once only when the speech sounds finished and the words read finished (Smart Turn alone calls
        most pauses in a list or a number finished); one alone when the other is missing."""
        if audio is None or text is None:
            return audio if text is None else text
        return min(audio, text)

    async def sounds_finished(self, audio: np.ndarray) -> float | None:
        """Smart Turn's probability that `audio` (the utterance with its silence) is a finished turn, on the
        shared worker; None without the model (an instance that did not load it) or audio."""
        if self.smart_turn is None or not len(audio):
            return None
        return await asyncio.wrap_future(self.worker.submit(self.smart_turn.probability, audio))

    async def _audio(self, audio: np.ndarray) -> float | None:
        if self.config.policy not in ("smart_turn", "combined"):
            return None
        return await self.sounds_finished(audio)

    async def _text(self, text: str | None, signal: TextSignal | None) -> float | None:
        if not self.reads_text or signal is None or not text or not text.strip():
            return None
        return await signal(text.strip())
