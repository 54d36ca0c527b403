"""`voice eot-eval`: how often each end-of-turn policy cuts a user off, and how long it waits.

The set (built on the fly, nothing big in the repo): the real recordings of tests/speech whole,
and again with a pause of PAUSES_S inserted between two of their words; sentences Piper speaks
(SYNTHETIC: phone numbers, lists, "um", a question with more words after it, short answers),
whole and with pauses at the marked words, labelled synthetic. Word boundaries come from
faster-whisper's word timestamps, the ASR's model's and Whisper base's (the `asr-base` extra): a pause goes
at the quieter place of the two (`pause_at_s`), between two words, and is filled with the recording's own
quietest audio.
Each item is labelled with where speech really ends (`true_end_s`); items split into calibration
and held-out by a hash of their utterance (`split_of`).

Each item is streamed in VAD frames as the service hears it (voice.pipeline.vad.Endpointer, pre-roll
included). Every silence that reaches `turn.min_silence_ms` asks the policy's signals once, as
the service would: Smart Turn on the utterance so far, and the LM on Whisper's transcript of it.
Since every policy asks at the same moments, the signals are recorded once and each policy's
verdict follows from them (`wait_for`), which lets thresholds be calibrated without running the
models again. A policy that says "done" in a silence after which the user speaks again has cut them off;
otherwise its wait is the silence from `true_end_s` to its decision. The signals' own time is
reported beside it (it adds to the wait only when the policy ends the turn as soon as it asks).
The fixed and shape policies are scored again with `turn.hold_ms` (a reply to words that trail off is
voiced only after that much silence: a turn ended in a pause the user goes on from within it cost
nothing), and fixed again with every reply voiced no sooner than VOICE_AFTER_MS (`turn.voice_after_ms`), with
the 0.6 s pauses kept whole and the complete utterances' wait until they may hear a reply.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from voice.audio import read_wav, resample, ulaw_decode, ulaw_encode
from voice.config import Config, VadConfig
from voice.pipeline.endofturn import EndOfTurn, SmartTurn, hold_for, reads_finished, unfinished, wait_for

if TYPE_CHECKING:
    from faster_whisper import WhisperModel
    from piper import PiperVoice

    from voice.pipeline.lm import Chat

log = logging.getLogger("voice.eot_eval")
SAMPLE_RATE = 16000
SPEECH = Path(__file__).resolve().parents[2] / "tests" / "speech"
PRE_ROLL_S = 0.3  # as voice.conversation.turns: audio from before the VAD's start goes with the utterance
TAIL_S = 2.0  # silence after the last word: past any ceiling
PAUSES_S = (0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.2, 1.5)  # inserted mid-sentence, taken in turn
# Calibration: the fewest cut-offs among thresholds that answer at least this much sooner (p50) than
# the fixed hangover (the goal for voice-to-voice latency)
FASTER_BY_MS = 150

# Piper sentences: the words after which a pause is inserted (1-based word counts), none = complete only
SYNTHETIC: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("Yes.", ()),
    ("No.", ()),
    ("Stop.", ()),
    ("Okay, thanks.", ()),
    ("What time is it?", ()),
    ("Turn off the lights.", ()),
    ("My number is five five five, zero one four two, eight eight seven six.", (5, 9)),
    ("The code is four seven one nine.", (3, 5)),
    ("I need eggs, milk, bread, and some butter.", (4, 5)),
    ("Add apples, oranges, and bananas to my shopping list.", (3,)),
    ("I'd like to book a table for, um, four people tonight.", (7, 8)),
    ("Set a timer for, uh, twenty minutes.", (4, 5)),
    ("Play some music by, hmm, the Beatles.", (5,)),
    ("What's the weather like? In Paris, I mean, tomorrow.", (4,)),
    ("Can you remind me to call my mother at six?", (6,)),
    ("How far is it from Berlin to Munich by train?", (6,)),
    ("Tell me a joke about cats.", (4,)),
    ("So I was thinking, maybe we could go to the beach on Saturday.", (4, 6)),
)


@dataclass
class Item:
    id: str
    source: str  # the recording or sentence it was made from (the split follows it)
    kind: str  # real | synthetic
    text: str
    audio: np.ndarray = field(repr=False)
    true_end_s: float  # where the user really finished
    pauses: list[tuple[float, float]]  # inserted (start s, length s)

    @property
    def split(self) -> str:
        return split_of(self.id)


def split_of(item_id: str) -> str:
    """calibration | heldout, by a hash of the item's utterance: a whole recording, or one place a pause
    went in (its two pause lengths stay together). Seven real recordings split whole would leave
    the two halves too unlike each other."""
    key = re.sub(r"/[0-9.]+s$", "", item_id)
    return "calibration" if hashlib.sha1(key.encode()).digest()[0] % 2 == 0 else "heldout"


@dataclass
class Ask:
    """One silence that reached min_silence_ms, and what the signals said there."""

    silence_start_s: float  # audio time the VAD's silence began
    silence_s: float  # how long it lasted before speech resumed (or the item ended)
    audio: float | None
    text: float | None
    transcript: str
    smart_turn_ms: float  # wall time
    smart_turn_cpu_ms: float  # its thread's CPU time (onnxruntime runs on it with one intra-op thread)
    asr_ms: float
    lm_ms: float  # wall time of the LM's forward (on the engine's thread, queued with nothing else)


@dataclass
class Record:
    id: str
    source: str
    kind: str
    split: str
    text: str
    true_end_s: float
    pauses: list[tuple[float, float]]
    silences: list[tuple[float, float]]  # every VAD silence run in speech: (start s, length s)
    asks: list[Ask]


# --- the set ------------------------------------------------------------------------------------

def _frames_rms(audio: np.ndarray, frame: int = 160) -> np.ndarray:
    n = len(audio) // frame
    return np.sqrt(np.mean(np.square(audio[:n * frame].reshape(n, frame), dtype=np.float64), axis=1))


def speech_end_s(audio: np.ndarray) -> float:
    """Where the last speech ends: the last 10 ms frame well above the noise floor."""
    rms = _frames_rms(audio)
    loud = np.nonzero(rms > loud_level(rms))[0]
    return float((loud[-1] + 1) * 0.01) if len(loud) else 0.0


def loud_level(rms: np.ndarray) -> float:
    """The 10 ms frame level from which a recording is speech: well above its noise floor, or near its peak."""
    return max(4 * float(np.percentile(rms, 10)), 0.02 * float(rms.max()))


QUIET_MAX = 0.0005  # -66 dBFS: the loudest room noise a pause gets (webrtcvad hears louder white noise as speech)


def quiet_fill(audio: np.ndarray, seconds: float) -> np.ndarray:
    """`seconds` of noise at the recording's noise floor (its quietest 10 ms frames), at most QUIET_MAX:
    a pause in the same room (a quiet stretch of it repeated clicks at every join, which webrtcvad
    hears, and some recordings are cut too tight to hold one)."""
    level = min(float(np.percentile(_frames_rms(audio), 10)), QUIET_MAX)
    rng = np.random.default_rng(len(audio))
    return (rng.standard_normal(int(seconds * SAMPLE_RATE)) * level).astype(np.float32)


def boundary_s(audio: np.ndarray, end_s: float, next_start_s: float) -> float:
    """The quietest 10 ms between one word's end and the next word's start (Whisper's times are rough)."""
    lo, hi = max(end_s - 0.05, 0.0), max(next_start_s + 0.05, end_s)
    rms = _frames_rms(audio[int(lo * SAMPLE_RATE):int(hi * SAMPLE_RATE)])
    return lo + (int(np.argmin(rms)) * 0.01 if len(rms) else 0.0)


def pause_at_s(audio: np.ndarray, k: int, timings: list[list[tuple[float, float]]]) -> float:
    """Where the pause after word `k` (1-based) goes: the quieter of `boundary_s` by each model's word times
    (those that count the same words). tiny.en's run late (150 ms at "ten of | clubs": the quietest 10 ms near
    them lay after "clu"), base's early (up to ~300 ms at "four | queen"); the quieter place is between the words
    more often than either's (15 dB or more under the speech level at 36 of the 42 boundaries, 30 by tiny.en's
    alone), though a stop's closure inside a word can still be the quieter ("eight of | s-pades").
    bench/eot_pause_cuts.py, BENCHMARKS.md "Heard in a room"."""
    words = timings[0]
    places = [boundary_s(audio, times[k - 1][1], times[k][0]) for times in timings if len(times) == len(words)]
    rms = _frames_rms(audio)
    return min(places, key=lambda at: float(rms[min(int(round(at * 100)), len(rms) - 1)]))


def with_pause(audio: np.ndarray, at_s: float, pause_s: float) -> np.ndarray:
    cut = int(at_s * SAMPLE_RATE)
    return np.concatenate([audio[:cut], quiet_fill(audio, pause_s), audio[cut:]])


def _items_from(source: str, kind: str, text: str, audio: np.ndarray, timings: list[list[tuple[float, float]]],
                after: tuple[int, ...], counter: list[int]) -> list[Item]:
    """The whole utterance, and one copy per (boundary, pause) with the pause inserted (`pause_at_s`; the words
    counted by the first model's `timings`)."""
    audio = np.concatenate([audio, quiet_fill(audio, TAIL_S)])
    out = [Item(f"{source}/whole", source, kind, text, audio, speech_end_s(audio), [])]
    for k in after:
        if not 0 < k < len(timings[0]):
            continue
        at = pause_at_s(audio, k, timings)
        for _ in range(2):
            pause = PAUSES_S[counter[0] % len(PAUSES_S)]
            counter[0] += 1
            paused = with_pause(audio, at, pause)
            out.append(Item(f"{source}/after{k}/{pause:.2f}s", source, kind, text, paused,
                            speech_end_s(paused), [(at, pause)]))
    return out


@dataclass
class Source:
    """A recording or Piper sentence the items are made from, at 16 kHz, and after which of its words (1-based
    counts) a pause goes in; None: after each."""

    name: str
    kind: str  # real | synthetic
    text: str
    audio: np.ndarray = field(repr=False)
    after: tuple[int, ...] | None


def sources(piper_voice: PiperVoice | None) -> list[Source]:
    """tests/speech's recordings and SYNTHETIC spoken by Piper."""
    out: list[Source] = []
    transcripts = dict(line.split("\t", 1) for line in (SPEECH / "transcripts.tsv").read_text().splitlines()[1:])
    for name in sorted(transcripts):
        audio, rate = read_wav(SPEECH / name)
        out.append(Source(f"real/{name}", "real", transcripts[name].strip(), resample(audio, rate, SAMPLE_RATE), None))
    if piper_voice is not None:
        from piper import SynthesisConfig
        steady = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)  # Piper samples noise: the same audio every run
        for text, after in SYNTHETIC:
            chunks = list(piper_voice.synthesize(text, syn_config=steady))
            audio = resample(np.concatenate([c.audio_float_array for c in chunks]),
                             piper_voice.config.sample_rate, SAMPLE_RATE)
            audio = np.concatenate([np.zeros(int(0.3 * SAMPLE_RATE), np.float32), audio])
            slug = re.sub(r"[^a-z]+", "-", text.lower()).strip("-")[:40]
            out.append(Source(f"piper/{slug}", "synthetic", text, audio, after))
    return out


def build_items(whisper_model: WhisperModel, piper_voice: PiperVoice | None, phone: bool = False) -> list[Item]:
    """The evaluation set (see the module's docstring); `phone`: every item through 8 kHz G.711 µ-law. Word
    times from `whisper_model` and from Whisper base (`pause_at_s`)."""
    base = timing_model()
    counter = [0]
    items: list[Item] = []
    for source in sources(piper_voice):
        timings = [_word_times(model, source.audio) for model in (whisper_model, base)]
        after = tuple(range(1, len(timings[0]))) if source.after is None else source.after
        items += _items_from(source.name, source.kind, source.text, source.audio, timings, after, counter)
    if phone:
        items = [replace(item, audio=telephone(item.audio)) for item in items]
    return items


def timing_model() -> WhisperModel:
    """The packaged Whisper base (the `asr-base` extra), a second opinion on where words begin and end."""
    from faster_whisper import WhisperModel

    from voice.pipeline.asr import model_folder
    return WhisperModel(model_folder("base"), device="cpu", compute_type="int8", cpu_threads=1)


def telephone(audio: np.ndarray) -> np.ndarray:
    """What a phone call delivers: 8 kHz G.711 µ-law, upsampled back to 16 kHz as the service does."""
    narrow = np.clip(resample(audio, SAMPLE_RATE, 8000) * 32768, -32768, 32767).astype(np.int16)
    return resample(ulaw_decode(ulaw_encode(narrow)).astype(np.float32) / 32768, 8000, SAMPLE_RATE)


def _word_times(whisper_model: WhisperModel, audio: np.ndarray) -> list[tuple[float, float]]:
    segments, _ = whisper_model.transcribe(audio, language="en", word_timestamps=True, vad_filter=False,
                                           condition_on_previous_text=False)
    return [(w.start, w.end) for s in segments for w in (s.words or [])]


# --- streaming the items ------------------------------------------------------------------------

def speech_frames(audio: np.ndarray, vad: VadConfig, frame_ms: int = 20) -> Iterator[tuple[int, float, int]]:
    """Stream `audio` through the service's VAD a frame at a time, its speech never ended by a hangover: for each
    frame from the first speech on, (where the frame ends, in samples; where the utterance starts, in s, its
    pre-roll included; the silence so far, in ms)."""
    from voice.audio import float_to_pcm16
    from voice.pipeline.vad import Endpointer, VoiceStart
    endpointer = Endpointer(replace(vad, hangover_ms=60_000), SAMPLE_RATE)
    frame = SAMPLE_RATE * frame_ms // 1000
    start_s: float | None = None
    for offset in range(0, len(audio) - frame + 1, frame):
        for event in endpointer.push(float_to_pcm16(audio[offset:offset + frame])):
            if isinstance(event, VoiceStart) and start_s is None:
                start_s = max(event.t_audio_s - PRE_ROLL_S - vad.start_ms / 1000, 0.0)
        if start_s is not None and endpointer.in_speech:
            yield offset + frame, start_s, endpointer.silence_ms


async def measure(item: Item, vad: VadConfig, min_silence_ms: int, smart_turn: SmartTurn | None,
                  transcribe: Callable[[np.ndarray], str] | None, chat_factory: Callable[[], Chat] | None,
                  system_prompt: str, frame_ms: int = 20) -> Record:
    """Stream `item` in VAD frames; ask the signals once per silence that reaches `min_silence_ms`."""
    silences: list[tuple[float, float]] = []
    asks: list[Ask] = []
    asked = False
    chat = chat_factory() if chat_factory else None
    messages = [{"role": "system", "content": system_prompt}]
    if chat is not None:
        await chat.prepare(messages)  # as a session does while its user speaks: the system prompt is cached
    for end, start_s, silence_ms in speech_frames(item.audio, vad, frame_ms):
        now = end / SAMPLE_RATE
        if silence_ms == 0:
            asked = False
            continue
        if silence_ms == frame_ms:
            silences.append((now - frame_ms / 1000, 0.0))
        silences[-1] = (silences[-1][0], now - silences[-1][0])
        if silence_ms >= min_silence_ms and not asked:
            asked = True
            utterance = item.audio[int(start_s * SAMPLE_RATE):end]
            asks.append(await _ask(utterance, silences[-1][0], smart_turn, transcribe, chat, messages))
    for ask in asks:  # how long each asked silence lasted
        ask.silence_s = next(length for begin, length in silences if begin == ask.silence_start_s)
    if chat is not None:
        chat.close()
    return Record(item.id, item.source, item.kind, item.split, item.text, item.true_end_s, item.pauses,
                  silences, asks)


async def _ask(utterance: np.ndarray, silence_start_s: float, smart_turn: SmartTurn | None,
               transcribe: Callable[[np.ndarray], str] | None, chat: Chat | None, messages: list[dict]) -> Ask:
    audio_p, st_ms, st_cpu_ms = None, 0.0, 0.0
    if smart_turn is not None:
        t = time.perf_counter()
        audio_p, st_cpu_ms = await asyncio.to_thread(_timed, smart_turn.probability, utterance)
        st_ms = (time.perf_counter() - t) * 1000
    transcript, text_p, asr_ms, lm_ms = "", None, 0.0, 0.0
    if transcribe is not None:
        t = time.perf_counter()
        transcript = await asyncio.to_thread(transcribe, utterance)
        asr_ms = (time.perf_counter() - t) * 1000
        if chat is not None and transcript.strip():
            t = time.perf_counter()
            text_p = await chat.end_of_turn_probability(messages, transcript.strip())
            lm_ms = (time.perf_counter() - t) * 1000
    return Ask(silence_start_s, 0.0, audio_p, text_p, transcript, st_ms, st_cpu_ms, asr_ms, lm_ms)


def _timed(fn: Callable[..., float], *args: Any) -> tuple[float, float]:
    """fn(*args) and the CPU time this thread spent on it (ms)."""
    start = time.thread_time()
    result = fn(*args)
    return result, (time.thread_time() - start) * 1000


# --- policies on the recorded signals -----------------------------------------------------------

@dataclass(frozen=True)
class Policy:
    name: str
    threshold: float = 0.5
    hangover_ms: int = 400  # fixed only
    hold_ms: int = 0  # `turn.hold_ms`: a reply to words that trail off is voiced after this much silence
    hold_unmarked_ms: int = 0  # `turn.hold_unmarked_ms`: ... to words that only lack an end mark, after this much
    voice_after_ms: int = 0  # `turn.voice_after_ms`: any reply is voiced after this much silence at the soonest

    @property
    def label(self) -> str:
        hold = f" + hold {self.hold_ms} ms" if self.hold_ms else ""
        if self.hold_ms and self.hold_unmarked_ms < self.hold_ms:
            hold += f" (no end mark {self.hold_unmarked_ms} ms)"
        return self.name + hold + (f" + voice after {self.voice_after_ms} ms" if self.voice_after_ms else "")


@dataclass
class Outcome:
    cut: bool
    wait_ms: float | None  # of silence after the true end, when not cut
    spent_ms: float = 0.0  # the signals' time, when the policy ended the turn as soon as it asked them
    endpoint_ms: float | None = None  # the silence the VAD heard before the turn ended (`voice bench`'s endpoint)
    voiced_ms: float | None = None  # the silence before the reply may be heard (the endpoint, or the hold)
    held: int = 0  # turns it ended in a pause whose reply was held, and dropped unheard as the user went on


def outcome(policy: Policy, record: Record, min_silence_ms: int, ceiling_ms: int, start_ms: int = 60) -> Outcome:
    """When `policy` ends the turn, on the signals recorded for the item. With a hold (`Policy.hold_ms`), a
    turn ended in a pause whose transcript may be unfinished (`endofturn.hold_for`, with the Smart Turn recorded)
    is no cut-off if the user resumes (`start_ms` of voice) before the hold is over: its reply, prepared, is
    dropped unheard (voice/conversation/reply.py's Floor.voiced). The transcript is the one taken at
    `min_silence_ms` (the service's early final comes at `asr.early_final_ms`)."""
    asks = {a.silence_start_s: a for a in record.asks}
    held = 0
    for n, (begin, length) in enumerate(record.silences):
        ask = asks.get(begin)
        if policy.name == "fixed":
            wait_ms, spent = float(policy.hangover_ms), 0.0
        elif policy.name == "shape" and ask is not None:  # the transcript reads finished: the hangover
            wait_ms, spent = float(policy.hangover_ms if reads_finished(ask.transcript) else ceiling_ms), 0.0
        elif ask is None:
            continue  # shorter than min_silence_ms: nobody asked
        else:
            probability = _probability(policy, ask)
            wait_ms = ceiling_ms if probability is None else wait_for(probability, policy.threshold,
                                                                     min_silence_ms, ceiling_ms)
            spent = _spent(policy, ask) if wait_ms <= min_silence_ms else 0.0  # decided at once: its time shows
        if length * 1000 >= wait_ms:
            hold_ms = 0 if ask is None else hold_for(unfinished(ask.transcript), ask.audio, policy.hold_ms,
                                                     policy.hold_unmarked_ms)
            voiced = max(wait_ms, float(hold_ms), float(policy.voice_after_ms))
            if n < len(record.silences) - 1:  # the user spoke again after it: a pause
                if voiced > wait_ms and length * 1000 + start_ms < voiced:
                    held += 1  # ... before its reply was voiced: their turn resumes, nothing lost
                    continue
                return Outcome(True, None, held=held)
            return Outcome(False, (begin + wait_ms / 1000 - record.true_end_s) * 1000, spent, wait_ms, voiced, held)
    return Outcome(False, None, held=held)  # never decided (speech to the end of the item): counted as undecided


def _probability(policy: Policy, ask: Ask) -> float | None:
    if policy.name == "smart_turn":
        return ask.audio
    if policy.name == "lm":
        return ask.text
    return EndOfTurn.combine(ask.audio, ask.text)


def _spent(policy: Policy, ask: Ask) -> float:
    """The signals' time on the critical path when the policy decides at once: they run side by side,
    the LM after the transcript (which the service decodes at early_final_ms anyway)."""
    audio = ask.smart_turn_ms if policy.name in ("smart_turn", "combined") else 0.0
    text = ask.lm_ms if policy.name in ("lm", "combined") else 0.0
    return max(audio, text)


def score(policy: Policy, records: list[Record], min_silence_ms: int, ceiling_ms: int, start_ms: int = 60) -> dict:
    outcomes = [outcome(policy, r, min_silence_ms, ceiling_ms, start_ms) for r in records]
    waits = [o.wait_ms for o in outcomes if o.wait_ms is not None]
    spent = [o.spent_ms for o in outcomes if o.wait_ms is not None and o.spent_ms]
    whole = [o.endpoint_ms for o, r in zip(outcomes, records) if not r.pauses and o.endpoint_ms is not None]
    voiced = [o.voiced_ms for o, r in zip(outcomes, records) if not r.pauses and o.voiced_ms is not None]
    paused = [o for o, r in zip(outcomes, records) if r.pauses]
    pause_06 = [o for o, r in zip(outcomes, records) if r.pauses and abs(r.pauses[0][1] - 0.6) < 1e-6]
    return {"items": len(records), "cut": sum(o.cut for o in outcomes),
            "undecided": sum(not o.cut and o.wait_ms is None for o in outcomes),
            "cut_rate": sum(o.cut for o in outcomes) / max(len(records), 1),
            "cut_rate_paused": sum(o.cut for o in paused) / max(len(paused), 1),
            "wait_p50_ms": float(np.percentile(waits, 50)) if waits else None,
            "wait_p95_ms": float(np.percentile(waits, 95)) if waits else None,
            "at_once": len(spent), "at_once_spent_p50_ms": float(np.percentile(spent, 50)) if spent else None,
            "whole_endpoint_p50_ms": float(np.percentile(whole, 50)) if whole else None,
            # complete utterances: the silence before the reply may be heard, and how many waited for the hold
            "whole_voiced_p50_ms": float(np.percentile(voiced, 50)) if voiced else None,
            "whole_voiced_mean_ms": float(np.mean(voiced)) if voiced else None,
            "whole_held": sum(v > e for v, e in zip(voiced, whole)), "whole": len(whole),
            # 0.6 s pauses mid-sentence (issue 55's goal): one answer, nothing voiced in the pause
            "pause_06_whole": sum(not o.cut for o in pause_06), "pause_06": len(pause_06),
            "held": sum(o.held for o in outcomes)}


VOICE_AFTER_MS = (500, 550, 600, 650, 700)  # `turn.voice_after_ms` scored (0.6 s pauses are 0.46-0.56 s of VAD silence)
THRESHOLD_GRID = (*(round(t, 2) for t in np.arange(0.05, 0.951, 0.05)), 0.97, 0.98, 0.99)


def calibrate(name: str, records: list[Record], min_silence_ms: int, ceiling_ms: int, max_p50_ms: float) -> Policy:
    """The policy's threshold with the fewest cut-offs on `records` among those whose p50 wait is at
    most `max_p50_ms` (the fixed hangover's less FASTER_BY_MS), the shorter wait on a tie; if none
    is that fast, the fastest."""
    scored = []
    for threshold in THRESHOLD_GRID:
        s = score(Policy(name, threshold), records, min_silence_ms, ceiling_ms)
        if s["wait_p50_ms"] is not None:
            scored.append((s["wait_p50_ms"] > max_p50_ms, s["cut_rate"] if s["wait_p50_ms"] <= max_p50_ms else 0.0,
                           s["wait_p50_ms"], threshold))
    return Policy(name, min(scored)[3] if scored else THRESHOLD_GRID[0])


# --- the command ---------------------------------------------------------------------------------

def run(config: Config, out: Path | None, phone: bool = False, synthetic: bool = True, use_lm: bool = True) -> dict:
    """Build the set, record the signals, calibrate on one split, report on the other."""
    from voice.pipeline.asr import Whisper
    from voice.pipeline.lm import LocalLM
    from voice.pipeline.tts import load_voice
    turn = config.turn
    load_before = os.getloadavg()
    whisper = Whisper(config.asr)
    voice = load_voice(config.tts) if synthetic else None
    t0 = time.perf_counter()
    items = build_items(whisper.model, voice, phone)
    log.info("%d items built in %.1f s", len(items), time.perf_counter() - t0)
    smart_turn = SmartTurn(threads=turn.threads)
    lm = LocalLM(config.lm) if use_lm else None
    records: list[Record] = []

    async def stream_all() -> None:
        for item in items:
            records.append(await measure(item, config.vad, turn.min_silence_ms, smart_turn, whisper.transcribe,
                                         lm.chat if lm else None, config.lm.system_prompt, config.vad.frame_ms))

    asyncio.run(stream_all())
    report = {**summarise(records, config, phone), "load_average": {"before": load_before, "after": os.getloadavg()}}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**report, "records": [asdict(r) for r in records]}, indent=1))
    return report


def load_records(path: Path) -> list[Record]:
    """The records a previous run wrote with --json (to score the policies again without the models)."""
    records = json.loads(path.read_text())["records"]
    return [Record(**{**r, "pauses": [tuple(p) for p in r["pauses"]], "silences": [tuple(s) for s in r["silences"]],
                      "asks": [Ask(**a) for a in r["asks"]]}) for r in records]


def summarise(records: list[Record], config: Config, phone: bool = False) -> dict:
    turn = config.turn
    calibration = [r for r in records if split_of(r.id) == "calibration"]
    heldout = [r for r in records if split_of(r.id) == "heldout"]
    fixed = Policy("fixed", hangover_ms=config.vad.hangover_ms)
    budget = score(fixed, calibration, turn.min_silence_ms, turn.ceiling_ms)["wait_p50_ms"] - FASTER_BY_MS
    policies = [fixed] + [calibrate(name, calibration, turn.min_silence_ms, turn.ceiling_ms, budget)
                          for name in ("smart_turn", "lm", "combined")]
    policies.append(Policy("shape", hangover_ms=config.vad.hangover_ms))
    if turn.hold_ms:  # the free policies again with the hold (fixed is the service's default)
        policies += [replace(p, hold_ms=turn.hold_ms, hold_unmarked_ms=turn.hold_unmarked_ms)
                     for p in policies if p.name in ("fixed", "shape")]
    for after in VOICE_AFTER_MS:  # and with every reply voiced no sooner than that
        policies.append(replace(fixed, hold_ms=turn.hold_ms, hold_unmarked_ms=turn.hold_unmarked_ms,
                                voice_after_ms=after))
    asks = [a for r in records for a in r.asks]
    cost = {name: _stats([getattr(a, name) for a in asks if getattr(a, name)])
            for name in ("smart_turn_ms", "smart_turn_cpu_ms", "asr_ms", "lm_ms")}
    rows = []
    for policy in policies:
        threshold = policy.threshold if policy.name not in ("fixed", "shape") else None
        start_ms = config.vad.start_ms
        rows.append({"policy": policy.label, "threshold": threshold,
                     "calibration": score(policy, calibration, turn.min_silence_ms, turn.ceiling_ms, start_ms),
                     "heldout": score(policy, heldout, turn.min_silence_ms, turn.ceiling_ms, start_ms),
                     "all": score(policy, records, turn.min_silence_ms, turn.ceiling_ms, start_ms)})
    return {"min_silence_ms": turn.min_silence_ms, "ceiling_ms": turn.ceiling_ms, "phone": phone,
            "items": {"calibration": len(calibration), "heldout": len(heldout),
                      "real": sum(r.kind == "real" for r in records),
                      "synthetic": sum(r.kind == "synthetic" for r in records),
                      "with_pause": sum(bool(r.pauses) for r in records)},
            "decisions": len(asks), "cost_ms": cost, "policies": rows}


def _stats(values: list[float]) -> dict:
    if not values:
        return {}
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95)), "n": len(values)}


def table(report: dict) -> str:
    """The held-out figures as a Markdown table, and the 0.6 s pauses and complete utterances of all items."""
    lines = ["| policy | threshold | cut-offs (held-out) | with a pause | wait p50 | wait p95 | endpoint p50, whole "
             "utterances | ended at once, signals' time p50 | 0.6 s pauses kept whole (all) | whole utterances "
             "(all): voiced p50 / mean, held |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["policies"]:
        h, every = row["heldout"], row.get("all")
        threshold = "" if row["threshold"] is None else f"{row['threshold']:.2f}"
        p50 = "-" if h["wait_p50_ms"] is None else f"{h['wait_p50_ms']:.0f} ms"
        p95 = "-" if h["wait_p95_ms"] is None else f"{h['wait_p95_ms']:.0f} ms"
        at_once = "-" if not h["at_once"] else f"{h['at_once']} turns, {h['at_once_spent_p50_ms']:.0f} ms"
        endpoint = "-" if h["whole_endpoint_p50_ms"] is None else f"{h['whole_endpoint_p50_ms']:.0f} ms"
        kept = voiced = "-"
        if every is not None and every.get("whole_voiced_p50_ms") is not None:
            kept = f"{every['pause_06_whole']}/{every['pause_06']}"
            voiced = (f"{every['whole_voiced_p50_ms']:.0f} / {every['whole_voiced_mean_ms']:.0f} ms, "
                      f"{every['whole_held']}/{every['whole']}")
        lines.append(f"| {row['policy']} | {threshold} | {h['cut']}/{h['items']} ({100 * h['cut_rate']:.0f}%) "
                     f"| {100 * h['cut_rate_paused']:.0f}% | {p50} | {p95} | {endpoint} | {at_once} | {kept} "
                     f"| {voiced} |")
    cost = report["cost_ms"]
    parts = [f"{name.removesuffix('_ms')} p50 {c['p50']:.0f} ms / p95 {c['p95']:.0f} ms"
             for name, c in cost.items() if c]
    lines.append("")
    lines.append(f"Per decision ({report['decisions']} decisions): " + ", ".join(parts))
    return "\n".join(lines)
