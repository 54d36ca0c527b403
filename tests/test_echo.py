"""The reply's echo after `voice mic`'s echo canceller does not barge in; the user over the reply still does (issue 55).

With `voice mic`'s AEC a long reply was cut once in 22 by its own echo (bench/mic_echo_live.py): 600 ms of gated
speech with no words. An echo canceller that has converged leaves a residue some 60 dB under the echo, and the level
gate (voice/pipeline/vad.py's Levels) learns that as the echo; when the echo's path changes (a delay, a volume)
WebRTC's AEC3 lets about a second of it through at full level while it adapts again, and the gate takes it for the
user. Here the canceller is the client's own (`EchoCanceller`, AEC3), the reply is two replies of recorded speech
whose echo comes back 10 dB under, 60 ms late for the first and 200 ms late for the second, and the server's parts
are real: the TurnTaker (webrtcvad, the gate), the Floor and its Playback ledger, on a simulated clock.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np

from fakes import SPEECH, FakeWhisper, make_config
from voice.audio import float_to_pcm16, read_wav, resample
from voice.clients.mic import EchoCanceller
from voice.conversation.reply import Floor, Reply
from voice.conversation.turns import Talking, TurnTaker
from voice.events import Clear, SpeechStarted, SpeechStopped
from voice.pipeline.asr import SAMPLE_RATE as RATE


FRAME = RATE // 50  # 20 ms


def clip(*names: str) -> np.ndarray:
    return np.concatenate([resample(*read_wav(SPEECH / name), RATE) for name in names]).astype(np.float32)


QUESTION, USER = clip("003.wav"), clip("002.wav")
FIRST, SECOND = clip("005.wav", "001.wav"), clip("004.wav", "forever.wav")  # the replies


def room(user_at_s: float | None = None, aec: bool = True) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """The question, then two replies with 2 s between: (what the client played, what it sent, through its
    canceller if `aec`, where each reply plays, in samples). The echo comes back 10 dB under, 60 ms late, then
    200 ms (its path changed); the user, if `user_at_s`, talks over the first reply from then on."""
    gap = np.zeros(2 * RATE, np.float32)
    parts = [np.zeros(RATE, np.float32), np.zeros(len(QUESTION), np.float32), gap, FIRST, gap, SECOND, gap]
    played = np.concatenate(parts)
    starts = np.cumsum([0, *map(len, parts)])
    spans = [(int(starts[3]), int(starts[4])), (int(starts[5]), int(starts[6]))]
    heard = np.zeros_like(played)
    heard[RATE:RATE + len(QUESTION)] = QUESTION
    for (a, b), delay_ms in zip(spans, (60, 200)):
        at = a + RATE * delay_ms // 1000
        heard[at:at + b - a] += played[a:b] * 10 ** (-10 / 20)
    if user_at_s is not None:
        at = spans[0][0] + int(user_at_s * RATE)
        heard[at:at + len(USER)] += USER
    if not aec:
        return played, heard, spans
    canceller = EchoCanceller(RATE)
    sent = []
    for i in range(0, len(played) - FRAME + 1, FRAME):  # as the streams run: 20 ms played, 20 ms heard
        canceller.played(float_to_pcm16(played[i:i + FRAME]))
        sent.append(canceller.heard(float_to_pcm16(heard[i:i + FRAME])))
    return played, np.frombuffer(b"".join(sent), "<i2").astype(np.float32) / 32768, spans


def converse(played: np.ndarray, sent: np.ndarray, spans: list[tuple[int, int]], check_echo: bool = True
             ) -> tuple[list[float], list[float], list[bool]]:
    """The server hears `sent` while the replies play (each on the wire as it starts, as one phrase): when the
    contender's speech was Talking, and when a reply was cut (seconds of the stream), as voice/conversation/
    session.py's `_on_turn` does it; and for each speech over a reply that ended, would its final "I'm sure."
    (Whisper's, for the echo's "I'm sorry") have cut it (`_heard_words`)? `check_echo` False: as before the
    echo was heard: Talking cuts the reply."""

    async def run() -> tuple[list[float], list[float], list[bool]]:
        taker = TurnTaker(make_config(), FakeWhisper(), RATE, "t")
        floor = Floor("t", taker, None, None, None, None, None, None,  # type: ignore[arg-type]
                      SimpleNamespace(inc=lambda: None))
        t0, talking, cuts, words_cut = time.monotonic(), [], [], []
        pending = [*spans]
        for i in range(0, len(sent) - FRAME + 1, FRAME):
            now = t0 + i / RATE
            if pending and i >= pending[0][0]:  # the reply to the question goes on the wire
                a, b = pending.pop(0)
                floor.reply = Reply(taker.turn, text="a reply", task=asyncio.create_task(asyncio.sleep(60)))
                floor.reply.playback.handed_over()
                floor.reply.playback.sent("a reply", now, (b - a) / RATE, played[a:b])
                taker.heard()  # (as Floor.audio_sent: speech from now on is a new utterance)
            for ev in taker.push(float_to_pcm16(sent[i:i + FRAME]), now, floor.playing(now)):
                if isinstance(ev, SpeechStopped) and floor.contender == ev.turn and floor.reply is not None:
                    words_cut.append(floor.heard_words(ev.turn, "I'm sure.", final=True)
                                     and not floor.echo_heard(ev.turn, taker.heard_lately(), now))
                if isinstance(ev, SpeechStarted):
                    floor.speech_started(ev.turn, now, ev.resumes)
                elif isinstance(ev, Talking):
                    talking.append(i / RATE)
                    if check_echo and floor.echo_heard(ev.turn, taker.heard_lately(), now):
                        taker.not_talking_yet()
                    else:
                        cuts += [i / RATE for e in floor.talked_over(ev.turn, now) if isinstance(e, Clear)]
            await asyncio.sleep(0)
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()
        return talking, cuts, words_cut

    return asyncio.run(run())


def test_an_echo_cancellers_residue_while_it_adapts_does_not_cut_the_reply():
    played, sent, spans = room()
    second = spans[1][0] / RATE
    talking, cuts, _ = converse(played, sent, spans, check_echo=False)
    assert any(second <= t < second + 1.5 for t in talking), talking  # the residue passes the gate: 600 ms of speech
    assert cuts, "before the echo was heard, the residue cut the reply"
    talking, cuts, words_cut = converse(played, sent, spans)
    assert cuts == [], cuts
    assert words_cut and not any(words_cut), words_cut  # nor do words Whisper hears in it


def test_the_user_over_the_reply_still_cuts_it_at_once():
    for aec, user_at_s in ((True, 1.0), (True, 3.0), (False, 2.0)):  # with no canceller: the full echo, 10 dB under
        played, sent, spans = room(user_at_s, aec)
        user_at = spans[0][0] / RATE + user_at_s
        _, before, _ = converse(played, sent, spans, check_echo=False)
        _, after, _ = converse(played, sent, spans)
        assert before and after[:1] == before[:1], (aec, before, after)  # at the same frame as before
        assert after[0] - user_at < (1.0 if aec else 1.2), (aec, after)  # (over the full echo the gate takes longer)
        assert after[1:] == [], after  # and the canceller's residue over the second reply cuts nothing
