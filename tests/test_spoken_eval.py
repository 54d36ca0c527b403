"""`voice spoken-eval`: its questions and answer checks, the phone path, and (slow, live) a few questions
spoken by espeak-ng, asked of the real service over /ws and answered right."""

import re

import numpy as np
import pytest

from voice.evals import spoken_eval
from voice.evals.spoken_eval import QUESTIONS, answered_right, summarise, through_g711


def test_forty_distinct_questions_each_with_an_answer_check_that_compiles():
    assert len(QUESTIONS) == 40
    assert len({q for q, _ in QUESTIONS}) == 40
    for _, answer in QUESTIONS:
        re.compile(answer)


def test_an_answer_is_right_when_the_reply_says_it_in_words_or_digits():
    spider = dict(QUESTIONS)["How many legs does a spider have?"]
    assert answered_right("A spider has eight legs.", spider)
    assert answered_right("Spiders have 8 legs.", spider)
    assert not answered_right("A spider has six legs.", spider)
    assert not answered_right("I do not know, could you say that again?", spider)


def test_the_phone_path_is_8_khz_mu_law_and_keeps_the_speech():
    rate = spoken_eval.RATE
    t = np.arange(rate) / rate
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    phone = through_g711(tone)
    assert phone.dtype == np.float32 and len(phone) == pytest.approx(spoken_eval.PHONE_RATE, abs=2)
    assert np.sqrt(np.mean(phone ** 2)) == pytest.approx(0.3 / np.sqrt(2), rel=0.05)


def test_the_summary_counts_answers_wer_and_latency_per_turn():
    rows = [{"question": "What is the capital of Egypt?", "transcript": "What is the capital of Egypt?",
             "right": True, "v2v_ms": 900.0, "stages_ms": {"asr": 100.0}, "error": ""},
            {"question": "What is the capital of Egypt?", "transcript": "What is the capital of eject",
             "right": False, "v2v_ms": 1100.0, "stages_ms": {"asr": 300.0}, "error": ""}]
    s = summarise(rows)
    assert s["right"] == 1 and s["heard_exactly"] == 1 and s["turns"] == 2
    assert s["wer"] == pytest.approx(1 / 12)
    assert s["v2v_ms_p50"] == pytest.approx(1000.0) and s["asr_ms_p50"] == pytest.approx(200.0)


@pytest.mark.slow
@pytest.mark.live
def test_questions_spoken_by_another_voice_are_heard_and_answered_by_the_real_service(
        live_voice_server, require_system, tmp_path):
    """Four questions spoken by espeak-ng's American English voice, at 16 kHz and through G.711, streamed in
    real time to the real service, each in a session of its own: at 16 kHz most are heard and answered right
    (tiny.en hears "What animal says moo?" as "Well, Tandy will say, woo."), through G.711 most words are
    heard, and every turn is timed."""
    require_system(spoken_eval.espeak_available(), "espeak-ng is not installed (apt-get install espeak-ng)")
    url = live_voice_server.replace("http://", "ws://") + "/ws"
    # a generous wait per reply: this checks what is heard and answered, not how fast (a shared machine)
    result = spoken_eval.run(url, tmp_path / "clips", tmp_path / "eval.json", voices=("en-us",), limit=4,
                             log=lambda _: None, turn_timeout_s=120.0)
    turns = result["per_turn"]
    assert len(turns) == 8 and (tmp_path / "eval.json").exists()
    wide, phone = result["by_config"]["16k"], result["by_config"]["g711"]
    assert wide["errors"] == 0 and phone["errors"] == 0, turns
    assert wide["right"] >= 3, turns
    assert wide["wer"] < 0.4 and phone["wer"] < 0.6, turns  # the phone path broken hears next to nothing (WER ~1)
    assert all(row["v2v_ms"] is not None and "asr" in row["stages_ms"] for row in turns)
