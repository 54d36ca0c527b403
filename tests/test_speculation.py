"""The reply is prepared during the VAD hangover on the speculative transcript, and sent only
once the hangover confirms the turn ended; if the user goes on talking it is dropped unseen.

Session level, with real webrtcvad on real speech and stand-in models (tests/fakes.py) that
note when they are called.
"""

import asyncio
import math
import time

import pytest

from fakes import FakeLM, FakeSynth, FakeWhisper, fake_instance, make_config, speech
from voice.events import LatencyReport, ReplyDone, ReplyText, SpeechStopped, Transcript, TtsAudio
from voice.conversation.session import Session
from voice.service.scheduler import LM_HORIZON_S

FRAME = 640  # 20 ms of 16 kHz PCM16


class LengthWhisper(FakeWhisper):
    """Says how much audio it was given, so a transcript shows which audio it came from."""

    def transcribe(self, audio, prefix=""):
        self.text = f"{len(audio) / 16000:.1f} seconds"
        return super().transcribe(audio, prefix)


class TimedLM(FakeLM):
    """Notes when each reply was asked for."""

    def __init__(self):
        super().__init__()
        self.asked_at: list[float] = []

    def chat(self):
        chat = super().chat()
        inner = chat.reply

        def reply(messages, mode=None, runs_out=None, tools=None):
            self.asked_at.append(time.monotonic())
            return inner(messages, mode, runs_out, tools)
        chat.reply = reply
        return chat


def instance_for(speculative: bool, synthesizer=None):
    return fake_instance(make_config(session={"speculative_reply": speculative}), LengthWhisper(), synthesizer,
                         TimedLM())


async def push(session: Session, pcm: bytes, realtime: bool = False) -> None:
    for i in range(0, len(pcm), FRAME):
        await session.push_audio(pcm[i:i + FRAME])
        await asyncio.sleep(0.02 if realtime else 0)


def drain(session: Session, seen: list) -> asyncio.Task:
    """What a transport does: take the events, and say when reply audio went out."""
    async def run():
        while True:
            seen.append(ev := await session.outbox.get())
            if isinstance(ev, TtsAudio):
                session.audio_sent(ev.turn, ev.text, ev.seconds)
    return asyncio.create_task(run())


async def until_reply_done(seen: list, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(isinstance(e, ReplyDone) for e in seen):
        assert time.monotonic() < deadline, [type(e).__name__ for e in seen]
        await asyncio.sleep(0.02)


def silence(ms: int) -> bytes:
    return bytes(32 * ms)


async def one_turn(instance, clip: str, realtime: bool = False) -> list:
    """A session hears `clip` (in real time if `realtime`) and a second of silence: what it sent."""
    s = Session(instance, 16000, 16000)
    seen: list = []
    reader = drain(s, seen)
    await push(s, speech(clip), realtime=realtime)
    await push(s, silence(1000), realtime=True)
    await until_reply_done(seen)
    reader.cancel()
    await s.close()
    return seen


@pytest.mark.parametrize("speculative", [True, False])
def test_the_reply_waits_for_the_end_of_the_turn(speculative):
    """Speculative: the LM is asked during the hangover, before the VAD declares the end of
    speech, yet nothing of the reply is sent before the final transcript. Without: it is asked
    only after the end of speech."""
    instance = instance_for(speculative)
    seen = asyncio.run(one_turn(instance, "001.wav"))
    stopped = next(e for e in seen if isinstance(e, SpeechStopped))
    assert len(instance.lm.asked_at) == 1
    assert (instance.lm.asked_at[0] < stopped.t) == speculative
    kinds = [type(e) for e in seen]
    final = next(i for i, e in enumerate(seen) if isinstance(e, Transcript) and e.final)
    assert kinds.index(SpeechStopped) < final < kinds.index(ReplyText) < kinds.index(TtsAudio)
    assert not next(e for e in seen if isinstance(e, ReplyDone)).interrupted
    # the latency report's timeline says when the work happened, released or not yet
    report = next(e for e in seen if isinstance(e, LatencyReport))
    work = report.marks_ms["work"]
    order = ["reply_start", "lm_first_block", "first_phrase", "tts_asked", "tts_first_audio"]
    assert [work[name] for name in order] == sorted(work[name] for name in order)
    assert (work["reply_start"] < report.marks_ms["eos_detected"]) == speculative
    assert work["tts_first_audio"] <= report.marks_ms["tts_first_audio"]


def test_a_speculation_is_dropped_unseen_when_the_user_goes_on():
    """A pause longer than early_final_ms but shorter than the hangover starts a speculative
    reply; speech after it drops that reply (never sent, not in the history) and the turn's one
    reply answers the whole utterance."""
    config_instance = instance_for(True)
    cfg = config_instance.config
    pause = (cfg.asr.early_final_ms + cfg.vad.hangover_ms) // 2

    async def scenario():
        s = Session(config_instance, 16000, 16000)
        seen: list = []
        reader = drain(s, seen)
        await push(s, speech("001.wav"))
        await push(s, silence(pause), realtime=True)
        await asyncio.sleep(0.3)  # the speculative reply is generated and synthesised meanwhile
        prepared = len(config_instance.lm.asked_at)
        before = list(seen)
        await push(s, speech("002.wav"))
        await push(s, silence(1000), realtime=True)
        await until_reply_done(seen)
        reader.cancel()
        history = list(s.history)
        await s.close()
        return prepared, before, seen, history

    prepared, before, seen, history = asyncio.run(scenario())
    assert prepared == 1, "no reply was prepared during the pause"
    assert not [e for e in before if isinstance(e, (ReplyText, TtsAudio, ReplyDone)) or
                isinstance(e, Transcript) and e.final]
    assert len(config_instance.lm.asked_at) == 2
    finals = [e for e in seen if isinstance(e, Transcript) and e.final]
    dones = [e for e in seen if isinstance(e, ReplyDone)]
    assert len(finals) == 1 and len(dones) == 1 and len([e for e in seen if isinstance(e, SpeechStopped)]) == 1
    spoken = float(finals[0].text.split()[0])
    both = (len(speech("001.wav")) + len(speech("002.wav"))) / 32000
    assert spoken > both - 0.5, (finals[0].text, both)  # the transcript covers both stretches of speech
    assert [m["role"] for m in history] == ["user", "assistant"] and history[0]["content"] == finals[0].text


class WaitingProbe(FakeSynth):
    """Notes, for each phrase, whether anyone was listed as waiting for first audio."""

    def __init__(self):
        super().__init__()
        self.waiting: list[bool] = []
        self.scheduler = None  # the instance's scheduler, set by the test

    async def synthesize(self, text: str, out_rate: int, urgent=lambda: False):
        self.waiting.append(self.scheduler.busy())
        return await super().synthesize(text, out_rate, urgent)


@pytest.mark.parametrize("speculative", [True, False])
def test_the_session_waits_from_end_of_speech_to_its_first_audio(speculative):
    """Other sessions' background work yields while this one is listed as waiting: from its
    (speculative) final transcript until its first phrase is synthesised, and no longer."""
    instance = instance_for(speculative, WaitingProbe())
    instance.synthesizer.scheduler = instance.scheduler

    async def scenario():
        s = Session(instance, 16000, 16000)
        seen: list = []
        reader = drain(s, seen)
        await push(s, speech("001.wav"))
        during_speech = instance.scheduler.busy()
        await push(s, silence(1000), realtime=True)
        await until_reply_done(seen)
        after_reply = instance.scheduler.busy()
        reader.cancel()
        await s.close()
        return during_speech, after_reply

    during_speech, after_reply = asyncio.run(scenario())
    probe = instance.synthesizer.waiting
    assert not during_speech and not after_reply
    assert len(probe) >= 2 and probe[0] and not any(probe[1:])



def test_the_next_turn_is_prepared_while_the_reply_is_spoken():
    """Once a reply is decoded the LM prefills the conversation the next turn starts from, the
    history's oldest turns already forgotten when its window is full: the next turn's prompt
    then differs only by the user's new words, even on the turn the window slides. The turns the
    window keeps when it slides are read aside a turn earlier (`History.kept`)."""
    instance = fake_instance(make_config(lm={"history_turns": 3}), LengthWhisper(), None, TimedLM())

    async def scenario():
        s = Session(instance, 16000, 16000)
        seen: list = []
        reader = drain(s, seen)
        asked: list[list[dict]] = []
        for _ in range(4):
            await push(s, speech("001.wav"))
            await push(s, silence(1000), realtime=True)
            await until_reply_done(seen)
            asked.append(s.history.messages("")[:-1])  # what the next turn's prompt starts with
            seen.clear()
        reader.cancel()
        await s.close()
        return asked

    asked = asyncio.run(scenario())
    prepared = [messages[:-1] for messages, _ in instance.lm.prepared]  # each without its empty question
    assert len(prepared) == 5  # the session's start, then once per reply
    assert prepared[1:] == asked
    assert [m["role"] for m in asked[3]] == ["system", "user", "assistant", "user", "assistant"]  # turns 1, 2 forgotten
    aside = [messages for messages, _ in instance.lm.prepared_aside]
    assert aside == [asked[2][:1] + asked[2][-2:]]  # after turn 3: the system prompt and turn 3
    assert asked[3][:3] == aside[0]


def test_the_lm_reads_the_partial_transcripts_while_the_user_speaks():
    """Each partial transcript is read by the LM as it comes (prefilled into the conversation's
    cache), so the reply to the final transcript prefills only the words after them."""
    instance = fake_instance(make_config(), FakeWhisper("eight of spades"), None, TimedLM())
    seen = asyncio.run(one_turn(instance, "005.wav", realtime=True))
    partials = [e.text for e in seen if isinstance(e, Transcript) and not e.final]
    read = [messages[-1]["content"] for messages, _ in instance.lm.prepared[1:]]  # after the session's start
    assert partials and read[:len(partials)] == partials


def test_the_lm_yields_to_the_first_phrase_s_synthesis_as_soon_as_it_has_decoded_it():
    """The engine asks when a reply's listener runs out of audio with the text it has decoded, before
    that text reaches the reply: now (-inf) until it holds the first phrase, then never while that
    phrase is synthesised (its next forwards would share the cores with it), then when the audio
    sent runs out (the engine waits for the reply again within `LM_HORIZON_S` of that)."""
    instance = instance_for(True)
    instance.lm.blocks = ["There ", "are ", "10 ", "close ", "things."]
    instance.lm.delay_s = 0.3  # the last block comes after the first phrase is on the wire
    answers: list[tuple[float, float, float]] = []
    chat = instance.lm.chat
    played: list = []

    def chat_asking_urgency():
        made = chat()
        inner = made.reply

        async def reply(messages, mode=None, runs_out=None, tools=None):
            async for block in inner(messages, mode, runs_out, tools):
                answers.append((runs_out("There"), runs_out("There are 10"), time.monotonic()))
                yield block
        made.reply = reply
        return made
    instance.lm.chat = chat_asking_urgency

    async def scenario():
        s = Session(instance, 16000, 16000)
        seen: list = []
        reader = drain(s, seen)
        await push(s, speech("001.wav"))
        await push(s, silence(1000), realtime=True)
        await until_reply_done(seen)
        played.extend(e for e in seen if isinstance(e, TtsAudio))
        reader.cancel()
        await s.close()

    asyncio.run(scenario())
    assert answers[0][:2] == (-math.inf, math.inf)  # nothing spoken yet: only the text that holds a phrase yields
    ends, asked = answers[-1][:2], answers[-1][2]
    # the first phrase's audio (about a second) is on the wire: its end is the deadline, within the horizon
    assert ends[0] == ends[1] and math.isfinite(ends[0]) and ends[0] - asked < LM_HORIZON_S
    assert played and played[0].text == "There are"  # tts.first_words = 2


def test_a_reply_about_to_fall_silent_speaks_the_words_it_has():
    """A long clause decoded slower than the first phrase plays: once its audio is about to run out
    the reply speaks the complete words it has instead of waiting for punctuation; nothing is lost."""
    instance = instance_for(True)
    instance.lm.blocks = ["There ", "are ", "many ", "kinds ", "of ", "queens ", "in ", "old ", "card ", "games ",
                        "played ", "today."]
    instance.lm.delay_s = 0.12  # "There are" (0.54 s of FakeSynth audio) is out before "in" is decoded
    seen = asyncio.run(one_turn(instance, "001.wav"))
    played = [e.text for e in seen if isinstance(e, TtsAudio)]
    assert played[0] == "There are"
    assert len(played) >= 3 and len(played[1].split()) >= 3 and not played[1].endswith(".")
    assert " ".join(played) == "There are many kinds of queens in old card games played today."


def test_a_reply_cuts_its_next_phrase_in_time_for_a_slow_synthesis():
    """Where synthesis is slow (two other talkers' replies on the same cores), a reply about to run dry
    cuts its next phrase while what is left to play still covers synthesising it, as long as the first
    phrase's synthesis took: no silence between them. With a fixed 0.15 s margin the cut came when that
    little was left, and the listener heard 0.3 s of silence before the 0.4 s synthesis was done."""
    synthesizer = FakeSynth()
    synthesizer.delay_s = 0.4
    instance = instance_for(True, synthesizer)
    instance.lm.blocks = ["There ", "are ", "many ", "kinds ", "of ", "queens ", "in ", "old ", "card ", "games ",
                          "played ", "today."]
    instance.lm.delay_s = 0.12
    seen = asyncio.run(one_turn(instance, "001.wav"))
    audio = [e for e in seen if isinstance(e, TtsAudio)]
    assert " ".join(e.text for e in audio) == "There are many kinds of queens in old card games played today."
    first, second = audio[0], audio[1]
    assert first.text == "There are"
    assert second.t - (first.t + first.seconds) < 0.15  # it arrived before (or as) "There are" ended
