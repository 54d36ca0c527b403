"""Heard in a room (issue 55): `voice room-eval` over the wire, one clip per room, around fake models
(the turn-taking is the real VAD and turn code; the ASR says "Eight of spades." for any audio, so a turn
the room starts is a reply the room gets, and the TTS is a tone); and the endpointer's level gate on its
own, on the same rooms, the endpointer before it beside it (`vad.follow_user = false`, the gate off)."""

from __future__ import annotations

import numpy as np
import pytest

from fakes import FakeWhisper, LiveServer, fake_instance, make_config
from voice.evals import room_eval
from voice.pipeline.asr import backchannel, echoes, goes_on
from voice.audio import float_to_pcm16, read_wav, resample
from voice.clients.bench import normalise, speech_end_s
from voice.config import VadConfig
from voice.evals.room_eval import RATE, Room
from voice.pipeline.vad import Endpointer, VoiceEnd, VoiceStart

CLIP = room_eval.SPEECH / "forever.wav"  # one breath: "feels like these days go on forever"


@pytest.fixture(scope="module")
def server():
    config = make_config()  # the gate is on by default
    # A finished sentence, written as Whisper writes one: words that trail off would hold each reply for
    # `turn.hold_ms` (voice/conversation/reply.py's Floor.voiced), and a room start in that second resumes the turn
    with LiveServer(config, fake_instance(config, FakeWhisper("Eight of spades."))) as srv:
        yield srv


def test_rooms_parse_and_name_themselves():
    assert Room.parse("babble:15") == Room("babble", 15.0) and Room.parse("babble:15").name == "babble:15"
    assert Room.parse("quiet").name == "quiet"
    for bad in ("babble", "quiet:3", "music:10", "pink:x"):
        with pytest.raises(ValueError):
            Room.parse(bad)


def test_a_room_is_mixed_at_its_level_below_the_speaker_and_never_holds_the_users_clip():
    rng = np.random.default_rng(0)
    for kind in ("pink", "babble"):
        audio = room_eval.room_audio(Room(kind, 15), 5 * room_eval.RATE, rng, -41.0, exclude=CLIP.name)
        assert room_eval.active_level_db(audio) == pytest.approx(-41.0, abs=0.01)
    assert len(room_eval.recordings(exclude=CLIP.name)) == len(room_eval.recordings()) - 1


@pytest.mark.parametrize("room", ["quiet", "pink:10", "babble:15", "babble:10", "echo:10"])
def test_one_clip_per_room_is_answered_once_and_the_room_alone_starts_nothing(server, room):
    report = room_eval.run(server.ws + "/ws", [Room.parse(room)], [CLIP], alone_s=8, timeout_s=6, log=lambda _: None)
    (summary,) = report["rooms"]
    assert summary["answered"] == 1, report["per_turn"]
    assert summary["room_started"] == 0 and summary["cut"] == 0, report["per_turn"]
    assert summary["v2v_ms_p50"] < 1500  # the fake models answer at once: this is the endpoint
    if summary["alone_started"] is not None:
        assert summary["alone_started"] == 0 and summary["alone_replies"] == 0, report["alone"]



# --- the endpointer follows the user (voice/pipeline/vad.py's Levels), at the VAD itself ------------------------

def in_room(kind: str, below_db: float, clip: str = CLIP.name, lead_s: float = 1.5, tail_s: float = 3.0,
            seed: int = 1):
    """`clip` at the speaker's level inside a room `below_db` under it: (the audio, where its speech ends)."""
    audio, rate = read_wav(room_eval.SPEECH / clip)
    user = room_eval.at_level(resample(audio, rate, RATE), room_eval.SPEAKER_DB)
    lead = int(lead_s * RATE)
    mix = room_eval.room_audio(Room(kind, below_db), lead + len(user) + int(tail_s * RATE), np.random.default_rng(seed),
                               room_eval.SPEAKER_DB - below_db, exclude=clip)
    mix[lead:lead + len(user)] += user
    return mix, lead_s + speech_end_s(user, RATE)


@pytest.mark.parametrize("below_db", [25, 15, 10])
def test_background_talk_below_the_user_does_not_hold_their_turn_open(below_db):
    """Issue 55: webrtcvad calls the talk speech, so the turn never ended (follow_user off: before the gate)."""
    mix, speech_end = in_room("babble", below_db)
    for follow_user in (True, False):
        events = Endpointer(VadConfig(follow_user=follow_user)).push(float_to_pcm16(mix))
        starts = [e for e in events if isinstance(e, VoiceStart)]
        ends = [e.t_audio_s for e in events if isinstance(e, VoiceEnd)]
        if follow_user:
            assert len(starts) == 1 and starts[0].t_audio_s > 1.5, events  # not before the user spoke
            assert len(ends) == 1 and speech_end - 0.3 < ends[0] < speech_end + 0.6, (ends, speech_end)
        else:
            assert not ends  # the talk held it open


def test_in_background_talk_the_early_final_waits_for_the_users_last_quiet_sound():
    """The level gate ends speech in background talk before a quiet last sound under the talk's level (the
    "s" of "hearts", 15 dB over it): the early final taken 100 ms into that silence lost it ("seven of heart",
    `voice room-eval`'s WER at 15 dB under); taken at twice that in a room the detector voices, it holds it. In
    a quiet room and pink noise the early final is taken at 100 ms as before. Real tiny.en, real VAD."""
    import asyncio
    import time

    from voice.config import Config
    from voice.conversation.turns import Final, TurnTaker
    from voice.pipeline.asr import Whisper

    config = Config()
    whisper = Whisper(config.asr)

    async def finals(mix: np.ndarray) -> tuple[list[str], list[float]]:
        taker, out, taken_at = TurnTaker(config, whisper, RATE, "t"), [], []
        for offset in range(0, len(mix), 320):
            for ev in taker.push(float_to_pcm16(mix[offset:offset + 320]), time.monotonic()):
                if isinstance(ev, Final):
                    out.append(ev)
                    taken_at.append(taker.endpointer.silence_ms)
            await asyncio.sleep(0)
        return [await f.transcript for f in out if f.ended.is_set()], taken_at

    texts, taken_at = asyncio.run(finals(in_room("babble", 15, "005.wav", seed=3)[0]))
    assert normalise(texts[-1]).endswith("seven of hearts") and taken_at[-1] == 2 * config.asr.early_final_ms, texts
    for kind, below_db in (("quiet", 0), ("pink", 10)):
        texts, taken_at = asyncio.run(finals(in_room(kind, below_db, "005.wav", seed=3)[0]))
        assert set(taken_at) == {config.asr.early_final_ms}, (kind, texts, taken_at)


@pytest.mark.parametrize("kind", ["babble", "pink"])
def test_a_room_alone_starts_no_speech(kind):
    rng = np.random.default_rng(2)
    room = room_eval.room_audio(Room(kind, 10), 30 * RATE, rng, room_eval.SPEAKER_DB - 10)
    assert Endpointer(VadConfig(follow_user=True)).push(float_to_pcm16(room)) == []


def test_the_replys_echo_is_not_speech_while_it_plays_the_user_over_it_is():
    """Another voice 10 dB under the user, heard while the reply plays (its echo), is never voiced long
    enough to barge in; the user talking over it at their own level starts speech within 0.3 s."""
    user, _ = in_room("quiet", 0, tail_s=0.6)
    echo = room_eval.at_level(np.concatenate(room_eval.recordings(exclude=CLIP.name)), room_eval.SPEAKER_DB - 10)
    for follow_user in (True, False):
        endpointer = Endpointer(VadConfig(follow_user=follow_user))
        endpointer.push(float_to_pcm16(user))  # the user's question: the endpointer learns their level
        endpointer.force_stop(suppress=False)
        pcm, voiced_ms = float_to_pcm16(echo), 0
        for i in range(0, len(pcm), 640):  # as the reply plays: a barge-in is turn.barge_in_ms (600) voiced
            endpointer.push(pcm[i:i + 640], playing=True)
            voiced_ms = max(voiced_ms, endpointer.voiced_ms)
        assert (voiced_ms < 600) == bool(follow_user), voiced_ms  # without the gate the echo barges in
        endpointer.force_stop(suppress=False)
        over = echo[:len(user)] + user
        start = next(e for e in endpointer.push(float_to_pcm16(over), playing=True) if isinstance(e, VoiceStart))
        assert start.t_audio_s - (len(user) + len(echo)) / RATE < 1.5 + 0.3  # within 0.3 s of the user's start


def clean(name: str) -> bytes:
    """A clean recording of tests/speech as the session gets it (its own noise floor, no room added)."""
    audio, rate = read_wav(room_eval.SPEECH / name)
    return float_to_pcm16(resample(audio, rate, RATE))


def test_a_clean_utterances_quiet_syllables_hold_the_turn():
    """The gate once dropped 001.wav's fading last syllable (voiced, only 2-6 dB above the recording's
    floor, far under the user's level), so a 300 ms pause before 002.wav ended the turn (415 ms "silence"
    against a 400 ms hangover): once the user is speaking, voiced audio above the room's loudest holds it."""
    pause = bytes(2 * RATE * 3 // 10)  # 300 ms of digital silence
    events = Endpointer(VadConfig(follow_user=True)).push(clean("001.wav") + pause + clean("002.wav") + bytes(2 * RATE))
    assert [type(e) for e in events] == [VoiceStart, VoiceEnd], events


def test_a_monologue_cut_at_the_limit_starts_no_new_speech_until_it_pauses():
    """After `force_stop` the rest of 005.wav, a reply to its first part playing meanwhile (whose echo is
    not known yet), must not start speech: its quieter words are still the user (tests/test_limits.py)."""
    endpointer, pcm = Endpointer(VadConfig(follow_user=True)), clean("005.wav")
    assert [type(e) for e in endpointer.push(pcm[:2 * RATE])] == [VoiceStart]
    assert endpointer.force_stop() is not None
    assert endpointer.push(pcm[2 * RATE:], playing=True) == []
    assert endpointer.push(bytes(RATE), playing=True) == []
    assert [type(e) for e in endpointer.push(clean("001.wav"))] == [VoiceStart]  # after the pause: a new turn


def test_a_transcript_of_the_replys_own_words_is_its_echo():
    said = "The capital of France is Paris, a city on the Seine."
    assert echoes("the capital of France is Paris", said)
    assert echoes("France is Paris, a city", said)
    assert not echoes("no stop, what about Berlin", said)
    assert not echoes("", said)
    # a short final is the user's: a one-word answer to the reply's question is not lost as its echo
    question = "Would you like coffee or tea?"
    assert echoes("tea", question) and not echoes("tea", question, final=True)
    assert echoes("coffee or tea", question, final=True)
    assert not echoes("tea please", question, final=True) and not echoes("tea coffee", question, final=True)
    # ...but two of the reply's words in its order are its echo: "You had" ended a turn and cut the reply
    assert echoes("You had.", "You had eight of spades, four of clubs.", final=True)


def test_a_backchannel_or_an_echo_cancellers_residue_over_a_reply_leaves_it_playing():
    """With `voice mic`'s AEC the reply's residual echo started turns Whisper wrote as "Yeah.", "or.",
    "That's..." and "I'm sorry." (over the apology), and each cut the reply (bench/mic_echo_live.py)."""
    import asyncio
    import time
    from types import SimpleNamespace

    from voice.config import Config
    from voice.conversation.faults import StageFailure
    from voice.conversation.reply import Floor, Reply

    for text in ("Yeah.", "or.", "That's...", "Okay.", "Mm-hmm.", "uh-huh", "Yeah, right."):
        assert backchannel(text), text
    for text in ("Stop.", "No.", "Wait.", "Tea.", "Yeah, but what about Berlin?", "", "Yes."):
        assert not backchannel(text), text

    async def scenario() -> None:
        turns = SimpleNamespace(config=Config())  # the session's config: the apology's words
        floor = Floor("s", turns, None, None, None, None, None, None,  # type: ignore[arg-type]
                      SimpleNamespace(inc=lambda: None))
        floor.reply = Reply(1, text="There are four queens in a pack of cards.",
                            task=asyncio.create_task(asyncio.sleep(10)))  # a reply still being made
        floor.speech_started(2, time.monotonic(), 0)
        for text in ("Yeah.", "or.", "That's...", "There are."):  # a backchannel, residue, its own words
            assert not floor.heard_words(2, text, final=True), text
        for text in ("Stop.", "No.", "Wait, how many kings?"):
            assert floor.heard_words(2, text, final=True), text
        floor.reply.failure = StageFailure("lm_timeout", "the LM took too long", "lm", "timeout")
        assert not floor.heard_words(2, "Sorry, something went wrong.", final=True)  # the apology's own echo
        assert floor.heard_words(2, "I'm hungry.", final=True)

    asyncio.run(scenario())


def test_a_resumed_transcript_goes_on_only_with_words_beyond_the_utterances():
    said = "I need eggs, milk,"
    assert goes_on("I need eggs, milk, bread.", said) and goes_on("I need eggs milk and bread", said)
    assert not goes_on("I need eggs, milk.", said) and not goes_on("I need eggs.", said)  # the room: the same words
    assert not goes_on("I need eggs, milk, you", said)  # Whisper's near-silence "you" is no word of theirs
    assert not goes_on("", said)


def test_the_offline_evaluation_runs_the_endpointer_on_every_room():
    results = room_eval.offline([Room.parse("babble:15"), Room.parse("echo:10")], [CLIP], VadConfig(follow_user=True),
                              alone_s=5)
    babble, echo = results
    assert babble.ends_ms[0] is not None and babble.starts == [1] and babble.alone_starts == 0
    assert echo.echo_starts == 0 and echo.echo_talking == 0 and len(echo.barge_in_ms) == 1
    assert room_eval.vad_options(VadConfig(), ["follow_user=false", "user_margin_db=6"]) == VadConfig(
        follow_user=False, user_margin_db=6.0)
