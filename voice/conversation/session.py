"""One conversation: audio in -> VAD -> ASR -> LM -> TTS -> audio out, with barge-in and history.

    runner --push_audio--> TurnTaker (VAD, ASR, end of turn)    voice/conversation/turns.py
           <--its turn events, dispatched in `_on_turn`
           --final transcript--> Floor -> ReplyRunner (LM -> TTS)  voice/conversation/reply.py
           <--outbox-- events; audio_sent --> Playback ledger   voice/conversation/playback.py

The conversation runner (voice/transports/common.py) feeds `push_audio`, drains `outbox` and reports with `audio_sent`
what reached the wire: what the user heard. Beside the line: the call log writes each turn's row before its
`reply_done` is sent; the history is what the LM sees; `watch_session` (service/limits.py) sets `ending` past a limit; a
failed stage ends the turn with an `error` and a spoken apology (docs/RELIABILITY.md). From the end of the user's
speech to their reply's first audio the session waits with the `Scheduler`: other sessions' background work yields.

A front asks the session only through its public methods (`push_audio`, `audio_sent`, `text_turn`, `press`,
`instruct`, `offer_tools`, `cancel_reply`, `heard_only`, ...; Wyoming's `dictate`, `recite`, `answer_in`; a phone
call's `greet`, `hang_up`, and its `phone` given at the start for the call's tools, calltools.py); its parts
get their collaborators, never the Session, and return their events to it (tests/test_architecture.py holds both).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from typing import assert_never

import numpy as np

from voice.conversation import oneshot
from voice.conversation.calllog import CallLog
from voice.conversation.calltools import Phone, call_gate, call_prompt, call_tools
from voice.audio import pcm16_to_float, resample
from voice.config import Config
from voice.events import AudioSent, Error, Event, SpeechStarted, SpeechStopped, Transcript
from voice.conversation.faults import StageFailure, transcript_within
from voice.conversation.history import History
from voice.conversation.keypad import KEYS, Keypad, keypad_text
from voice.conversation.latency import LatencyTracker
from voice.service.limits import watch_session
from voice.pipeline.lm import Chat, LocalChat
from voice.conversation.outbox import Outbox
from voice.conversation.playback import ECHO_RATE, Playback
from voice.conversation.reply import Floor, Reply, ReplyRunner
from voice.service.instance import Instance
from voice.pipeline.tools import Timers
from voice.conversation.turns import Final, Partial, Pause, SpeculationDropped, Talking, TooLong, TurnEvent, TurnTaker

log = logging.getLogger("voice.session")
STOP_WAIT_S = 5.0  # a request stopped by its client's error gets this long to record itself
MAX_PRESSED = 1000  # keys a session's record keeps (the telephony transports drop more: dtmf_overflow)
CLOSE_WAIT_S = 1.0  # on close: time the cancelled replies get to record themselves before the rest is "abandoned"
_session_ids = itertools.count(1)


class Session:
    def __init__(self, instance: Instance, in_rate: int, out_rate: int, transport: str = "native",
                 system_prompt: str | None = None, lm_mode: str | None = None, principal: str = "anonymous",
                 peer: str = "", meta: dict | None = None, config: Config | None = None, requests: bool = False,
                 phone: Phone | None = None):
        cfg = config or instance.config  # a transport may adjust its own copy (Realtime turn detection)
        self.id = f"s{next(_session_ids)}"
        self.uid = secrets.token_hex(8)  # unique across processes (ids restart at s1): the call records' key
        self.instance, self.config, self.in_rate, self.out_rate = instance, cfg, in_rate, out_rate
        self.transport = transport
        self.outbox = Outbox(cfg.limits, instance.metrics.audio_dropped.labels(transport), self.id)
        self.call_log = CallLog(instance.records, self.uid, self.id, instance.metrics.errors)
        self.tracker = LatencyTracker(cfg.budget, instance.metrics, self.emit, self.id)
        self.history = History(system_prompt if system_prompt is not None else cfg.lm.system_prompt,
                               cfg.lm.history_turns, cfg.lm.max_prompt_chars, instance.lm.fits)
        self.requests = requests  # it serves requests, turn by turn (Wyoming's programs: voice/conversation/oneshot.py)
        self.turns = (oneshot.Dictation if requests else TurnTaker)(cfg, instance.whisper, in_rate, self.id)
        self.end_of_turn = instance.end_of_turn(cfg)
        self.judge_task: asyncio.Task | None = None  # the end-of-turn policy deciding about the current pause
        # the assistant's side: the reply being made or heard (voice/conversation/reply.py)
        self.floor = Floor(self.id, self.turns, self.history, self.outbox, self.call_log, instance.scheduler, self.emit,
                           instance.fault, instance.metrics.barge_ins, self.end_of_turn)
        self.timers = Timers(self._announce, instance.tools.zone)
        self.replies = self.floor.replies = ReplyRunner(
            cfg, oneshot.NoChat() if requests else instance.lm.chat(), instance.synthesizer, out_rate, lm_mode,
            None if requests else instance.apology.get(out_rate), self.floor, self.id, instance.tools, self.timers,
            requests)
        if phone is not None and cfg.telephony.tools:  # a phone call's own tools (voice/conversation/calltools.py)
            self.replies.tools = instance.tools.with_tools(call_tools(cfg.telephony, phone, self._end_after_reply,
                                                                    self._read_keys))
            self.history.system_prompt = call_prompt(self.history.system_prompt, cfg.telephony)
            if isinstance(self.replies.chat, LocalChat):
                self.replies.chat.tool_call_log_odds = call_gate(cfg.telephony, cfg.lm.model,
                                                                 list(self.replies.tools.tools))
        self.final_task: asyncio.Task | None = None  # handles the latest final transcript (then its reply)
        self.partial_tasks: set[asyncio.Task] = set()  # partial transcripts on their way to the client
        self.read_ahead: asyncio.Task | None = None  # the LM reading the latest partial transcript
        self.keypad = Keypad(cfg.session.keypad_max_digits)  # keys pressed, on their way to a turn
        self.keypad_pause: asyncio.TimerHandle | None = None  # ends the sequence when no key follows
        self.pressed = ""  # every key pressed, for the call records (the first MAX_PRESSED)
        self.keys_wanted: asyncio.Future[str] | None = None  # a tool waits for the next sequence (read_keypad)
        self.closed = False
        self.opened = self.last_audio = time.monotonic()
        self.ending = asyncio.Event()  # set when the session must end; the transport closes the connection
        self.end_reason = ""  # the error code that ended it
        self.close_code = 1000
        instance.metrics.sessions.labels(transport).inc()
        instance.live.add(self)
        self.call_log.opened(transport, principal, peer, {
            "in_rate": in_rate, "out_rate": out_rate, "lm_mode": lm_mode,
            "custom_system_prompt": system_prompt is not None, **(meta or {})})
        try:
            self.watchdog: asyncio.Task | None = asyncio.get_running_loop().create_task(watch_session(self))
        except RuntimeError:  # no event loop (a unit test building a bare session)
            self.watchdog = None
        else:
            self.floor.spawn(self.replies.prepare(self.history.messages("")))
        log.info("session=%s open transport=%s in_rate=%d out_rate=%d principal=%s uid=%s", self.id, transport,
                 in_rate, out_rate, principal, self.uid)

    # --- the pipeline ---------------------------------------------------------------------------

    async def push_audio(self, pcm16: bytes) -> None:
        """PCM16LE mono at the session's input rate, any length: on to VAD and ASR."""
        self.last_audio = now = time.monotonic()
        self._on_turn(self.turns.push(pcm16, now, self.floor.playing(now)))

    def _on_turn(self, events: list[TurnEvent]) -> None:
        """What the session does at each point of the user's turn (the TurnTaker's events, in order)."""
        for ev in events:
            match ev:
                case SpeechStarted(turn, now, resumes):  # the user started talking, maybe over a reply
                    self._send(self.floor.speech_started(turn, now, resumes))
                    self.call_log.started(turn)
                    self.emit(ev)
                case Talking(turn, now):  # speech, not a blip: a reply it talks over stops, unless it is its echo
                    if self.floor.echo_heard(turn, self.turns.heard_lately(), now):
                        self.turns.not_talking_yet()
                    else:
                        self._send(self.floor.talked_over(turn, now))
                case Partial(turn, text):
                    task = asyncio.create_task(self._partial(turn, text))
                    self.partial_tasks.add(task)
                    task.add_done_callback(self.partial_tasks.discard)
                case Pause():  # quiet a while: is the turn over? The end-of-turn policy says
                    if self.judge_task is not None:
                        self.judge_task.cancel()
                    self.judge_task = asyncio.create_task(self._judged(ev))
                case SpeculationDropped():  # the user went on talking: the final and its reply are void
                    assert self.final_task is not None  # the speculative final's
                    self.final_task.cancel()
                    self._drop_speculation()
                case SpeechStopped():
                    self.emit(ev)
                case Final(turn, transcript, ended, resumes):
                    self.instance.scheduler.start_waiting(self.id)  # until the first audio, this user hears nothing
                    if self.read_ahead is not None:  # it would compete with the reply for the cores
                        self.read_ahead.cancel()
                    heard = (self.turns.heard_lately(), self.last_audio)  # (its audio, for the echo test)
                    self.final_task = asyncio.create_task(self._finalise(turn, transcript, ended, resumes, heard))
                case TooLong(limit):
                    self.error("utterance_too_long", f"speech longer than {limit:g} s is cut off here; the rest of "
                                                     "it is ignored until you pause")
                case _:
                    assert_never(ev)

    async def _judged(self, pause: Pause) -> None:
        self._on_turn(await self.turns.judge(pause, self.end_of_turn, self._end_signal))

    async def _end_signal(self, text: str) -> float | None:
        """The LM's probability that the user's turn ends after `text` (voice/pipeline/endofturn.py)."""
        replies = self.replies
        tools = (replies.tools.openai() + replies.client_tools) or None
        return await replies.chat.end_of_turn_probability(self.history.messages(text)[:-1], text, tools)

    async def _partial(self, turn: int, text: Awaitable[str | None]) -> None:
        said = await text
        if said and self.turns.listening(turn) and self._heard_words(turn, said):
            self.emit(Transcript(turn, time.monotonic(), said, False))
            if not self.replying():  # the LM reads the words so far: the reply prefills only what follows
                self.read_ahead = self.floor.spawn(self.replies.prepare(self.history.messages(said)))

    async def _finalise(self, turn: int, transcript: Awaitable[str], ended: asyncio.Event, resumes: int,
                        heard: tuple[np.ndarray, float] | None = None) -> None:
        """The final transcript, then the reply. Speculatively (during the hangover, `ended` not
        set yet) the reply starts as soon as the transcript is known, held back until `ended`.
        A turn superseded meanwhile (the user went on) still gets its one final, and no reply.
        `heard`: the utterance's last audio when its final was taken, and when it came (`_heard_words`)."""
        try:
            text = await transcript_within(transcript, self.config.faults)
        except StageFailure as failure:
            log.warning("session=%s turn=%d %s", self.id, turn, failure.message)
            await ended.wait()
            if turn == self.turn:
                await self.floor.asr_failed(turn, failure)
            else:  # the user has spoken again since: no apology
                self.instance.fault(failure)
                self.unreplied(turn, "", "asr_failed")
            return
        if turn != self.turn:
            self._superseded(turn, text, ended, resumes)
            return
        text = text if self._heard_words(turn, text, final=True, heard=heard) else ""  # else a blip or echo
        reply = None
        if text and not self.requests and (self.config.session.speculative_reply or ended.is_set()):
            reply = self.floor.start(turn, text, spoken=True)
        await ended.wait()
        if turn != self.turn:  # the user spoke again in the same breath: a barge-in dropped the reply
            self._superseded(turn, text, ended, resumes)
            return
        if not text:  # a turn that resumed an unheard reply's utterance with no words of its own: the room's
            resumes = self.floor.not_resumed(turn, resumes)
        self.emit(Transcript(turn, time.monotonic(), text, True, resumes))
        self.call_log.transcript(turn, text)
        if self.requests:  # listen only: the transcript was asked for, not a reply
            await self.floor.listened(turn, text)
            return
        if text and reply is None:
            reply = self.floor.start(turn, text, spoken=True)
        if reply is not None:
            reply.released.set()
        else:
            self.unreplied(turn, "", "no_speech")

    def _heard_words(self, turn: int, text: str, final: bool = False,
                     heard: tuple[np.ndarray, float] | None = None) -> bool:
        """Is `turn`'s transcript so far a turn to answer (voice/conversation/reply.py's `Floor.heard_words`), and
        not words Whisper heard in the reply's own echo (`Floor.echo_heard` on `heard`: the audio they came from
        and when its last sample came; None: the last LATELY_S, now)? If so, and it began over a reply, that reply
        stops."""
        if not self.floor.heard_words(turn, text, final):
            return False
        audio, at = heard or (self.turns.heard_lately(), self.last_audio)
        if self.floor.echo_heard(turn, audio, at):
            return False
        self._send(self.floor.talked_over(turn, time.monotonic()))
        return True

    def _send(self, events: list[Event]) -> None:
        """The floor's events: a `Clear` to the client, an `AudioSent` to the latency tracker only."""
        for ev in events:
            self.emit(ev, wire=not isinstance(ev, AudioSent))

    async def _announce(self, text: str) -> None:
        """A timer that is due speaks up between turns: once nobody is speaking or being answered."""
        while not self.closed and (self.busy or self.floor.playing(time.monotonic(), echo_tail_s=0.0)):
            await asyncio.sleep(0.2)
        if not self.closed:
            await self.floor.announce(text)

    def _superseded(self, turn: int, text: str, ended: asyncio.Event, resumes: int) -> None:
        """A later turn began before this one's final was out: the final still goes out (one per
        turn, after its speech_stopped); the later turn answers (and resumes it, if it does)."""
        if ended.is_set():  # (its speech_stopped went out)
            self.emit(Transcript(turn, time.monotonic(), text, True, resumes))
        self.unreplied(turn, text, "superseded")

    def unreplied(self, turn: int, transcript: str, status: str) -> None:
        """A turn that ends without a reply_done: recorded without waiting."""
        self.instance.scheduler.stop_waiting(self.id)
        self.tracker.forget(turn)
        self.call_log.unreplied(turn, transcript, status)

    def _drop_speculation(self) -> None:
        self.instance.scheduler.stop_waiting(self.id)
        reply = self.floor.reply
        if reply is not None and not reply.released.is_set():
            assert reply.task is not None  # started with the reply
            reply.task.cancel()
            self.floor.reply = None

    # --- what a front may ask of the session (nothing else of it is theirs to touch) ---------------

    def text_turn(self, text: str) -> int:
        """A turn typed instead of spoken: it is answered like a transcript. Its number."""
        return self._typed_turn(text).turn

    def _typed_turn(self, text: str, history: History | None = None, chat: Chat | None = None) -> Reply:
        now = time.monotonic()
        self._send(self.floor.barge_in(now))
        turn = self.turns.new_turn()
        self.call_log.started(turn)
        self.call_log.transcript(turn, text)
        self.emit(Transcript(turn, now, text, True))
        self.instance.scheduler.start_waiting(self.id)
        reply = self.floor.start(turn, text, history, chat)
        reply.released.set()
        return reply

    def press(self, key: str) -> int | None:
        """A key pressed on the keypad (DTMF; one of voice/conversation/keypad.py's KEYS). It stops a reply as speech
        does; the sequence it ends (`#`, `session.keypad_max_digits` keys) is the user's turn, answered
        like a transcript, as is the one a pause of `session.keypad_pause_s` ends. That turn's number."""
        if self.closed:
            return None
        key = key.upper()
        if len(key) != 1 or key not in KEYS:
            self.error("bad_dtmf", f"a key is one of 0-9, *, #, A-D, not {key[:8]!r}")
            return None
        if self.keypad_pause is not None:
            self.keypad_pause.cancel()
            self.keypad_pause = None
        if len(self.pressed) < MAX_PRESSED:
            self.pressed += key
        if self.replying() and self.keys_wanted is None:  # (keys a tool waits for are its answer, not a barge-in)
            self._send(self.floor.barge_in(time.monotonic()))
        if (keys := self.keypad.press(key)) is not None:
            return self._keys_done(keys)
        self.keypad_pause = asyncio.get_running_loop().call_later(self.config.session.keypad_pause_s, self._keys_paused)
        return None

    def _keys_paused(self) -> None:
        self.keypad_pause = None
        if (keys := self.keypad.pause()) is not None and not self.closed:
            self._keys_done(keys)

    def _keys_done(self, keys: str) -> int | None:
        """A finished sequence: the result of the tool that waits for one, else the user's turn (its number)."""
        if self.keys_wanted is not None and not self.keys_wanted.done():
            self.keys_wanted.set_result(keys)
            return None
        return self.text_turn(keypad_text(keys))

    async def _read_keys(self, prompt: str) -> str | None:
        """read_keypad (calltools.py): `prompt` is said as part of the reply that called it, and the next key
        sequence, from now on, is the call's result; None if none ends within `telephony.keypad_timeout_s`."""
        reply = self.floor.reply
        if self.keys_wanted is not None or reply is None:
            return None
        self.keys_wanted = wanted = asyncio.get_running_loop().create_future()
        saying = asyncio.ensure_future(self.replies.announce(reply, prompt.strip() + " ")) if prompt.strip() else None
        try:
            async with asyncio.timeout(self.config.telephony.keypad_timeout_s):
                return await wanted
        except TimeoutError:
            return None
        finally:
            self.keys_wanted = None
            if saying is not None and not saying.done():
                saying.cancel()

    def greet(self, text: str) -> int:
        """The assistant speaks first (a phone call's greeting): `text` as a turn of its own, no LM, barged in
        on like any reply; as much of it as was heard becomes the history's first words, the assistant's,
        so the LM knows it greeted. Its turn."""
        self.history.greeted(text)  # at once: a key pressed over it starts a reply before the greeting has ended
        turn = self.recite(_once(text))
        reply = self.floor.reply
        assert reply is not None and reply.task is not None  # recite's
        self.floor.spawn(self._greeted(reply))
        return turn

    async def _greeted(self, reply: Reply) -> None:
        assert reply.task is not None  # recite's
        await asyncio.wait({reply.task})
        self.history.greeted(reply.text.strip() if reply.finished else reply.playback.heard(time.monotonic()))
        await self.replies.prepare(self.history.messages(""))  # the first turn's prompt starts with it

    def instruct(self, system_prompt: str) -> None:
        """The LM's instructions from the next reply on (Realtime's `instructions`, a system item)."""
        self.history.system_prompt = system_prompt

    def offer_tools(self, tools: list[dict]) -> None:
        """Functions the client runs itself (Realtime's `session.tools`, chat-completions shape),
        offered to the LM from the next reply on: a call of one ends the reply."""
        self.replies.client_tools = tools

    def cancel_reply(self) -> bool:
        """Stop the reply being made or played, as the user talking over it would (Realtime's
        `response.cancel`); False if there is none."""
        if self.floor.reply is None:
            return False
        self._send(self.floor.barge_in(time.monotonic()))
        return True

    def heard_only(self, text: str) -> None:
        """Only `text` of the last reply was heard (Realtime's `conversation.item.truncate`): the
        LM sees only that from now on."""
        self.history.heard_only(text)

    def take_unanswered(self) -> str:
        """The user's last words that got no answer yet (a reply that called the client's
        functions), taken out of the history: the next turn asks them again with the outputs."""
        return self.history.take_unanswered()

    def reply_playback(self) -> Playback | None:
        """What of the current reply is on the wire and heard (None: no reply has the floor)."""
        return self.floor.reply.playback if self.floor.reply is not None else None

    # --- requests: Wyoming's programs (a session opened with requests=True, voice/conversation/oneshot.py) -------

    def dictate(self) -> int:
        """Start a dictation (one in flight is dropped, unanswered: `superseded`). Its turn."""
        self._forget_answered_reply()
        assert isinstance(self.turns, oneshot.Dictation), "a session that serves requests (requests=True)"
        before, dropped = self.turn, self.turns.dictating
        self._on_turn(self.turns.start(time.monotonic()))
        if dropped and before in self.call_log.open_turns:
            self.unreplied(before, "", "superseded")
        return self.turn

    def recite(self, texts: AsyncIterator[str]) -> int:
        """A turn that speaks `texts` as they come (no LM). Its turn."""
        self._forget_answered_reply()
        turn = self.turns.new_turn()
        self.call_log.started(turn)
        self.instance.scheduler.start_waiting(self.id)  # until its first audio, the client waits
        self.floor.recite(turn, texts)
        return turn

    async def answer_in(self, text: str, history: History, chat: Chat) -> int:
        """A typed turn in the conversation `history` and `chat` hold (the caller keeps them; the
        session's own is untouched), answered as text only; returns once its turn is recorded."""
        self._forget_answered_reply()
        reply = self._typed_turn(text, history, chat)
        assert reply.task is not None  # started with the reply
        await asyncio.wait({reply.task})
        return reply.turn

    async def drop_request(self) -> None:
        """The client's request failed: drop what is in flight (a dictation, its final transcript, a
        reply), and let a cancelled reply record itself."""
        self.clear_speech()
        reply = self.floor.reply
        tasks = [t for t in (reply.task if reply else None, self.final_task, *self.partial_tasks)
                 if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_WAIT_S)
        self.instance.scheduler.stop_waiting(self.id)

    def _forget_answered_reply(self) -> None:
        """The last request is answered: its reply (audio the client has, not plays) is no barge-in's."""
        reply = self.floor.reply
        if reply is not None and (reply.task is None or reply.task.done()):
            self.floor.reply = None

    def end_speech(self) -> bool:
        """The client says the user stopped talking; False if nobody was."""
        events = self.turns.end_now(time.monotonic())
        self._on_turn(events)
        return bool(events)

    def clear_speech(self) -> None:
        """The client drops what the user said so far in this utterance."""
        self._on_turn(self.turns.clear(time.monotonic()))

    def audio_sent(self, turn: int, text: str, seconds: float, pcm: bytes = b"", rate: int = 0) -> None:
        """The runner put a phrase's first audio on the wire: heard from now (voice/conversation/reply.py's Floor).
        `pcm` (PCM16LE at `rate`): the phrase's audio, what its echo would be (Floor.echo_heard)."""
        audio = resample(pcm16_to_float(pcm), rate, ECHO_RATE) if pcm and rate else None
        self._send(self.floor.audio_sent(turn, text, seconds, audio))

    def is_current(self, turn: int) -> bool:
        """Is audio of `turn` still wanted (not cleared by a barge-in)?"""
        return self.floor.is_current(turn)

    # --- events and the session's end ---------------------------------------------------------

    def emit(self, ev: Event, wire: bool = True, track: bool = True) -> bool:
        """Send `ev` to the client (if `wire`) and show it to the latency tracker (if `track`).
        False if it was not queued: the session is closed, or the outbox refused it."""
        # Queued before the tracker sees it: a turn's latency report follows its reply_done.
        queued = wire and not self.closed and self.outbox.offer(ev)
        if wire and not queued and self.outbox.stalled:
            self.terminate("slow_client", f"the client is not reading: {self.outbox.qsize()} messages are "
                                          "waiting to be sent")
        if track:
            self.tracker.observe(ev)
        if isinstance(ev, Error):
            self.call_log.error(ev)
        return queued

    def error(self, code: str, message: str) -> None:
        self.emit(Error(self.turn, time.monotonic(), code, message))

    def hang_up(self, reason: str) -> None:
        """End the call from our side as the conversation meant to (end_call, a transfer): no error; the
        transport hangs up (SIP BYE, Twilio's stream closed) and `reason` is the session's end."""
        if self.ending.is_set() or self.closed:
            return
        self.end_reason, self.close_code = reason, 1000
        self.ending.set()

    def _end_after_reply(self, reason: str) -> None:
        """`hang_up` once the reply that has the floor is heard to the end (a goodbye); not if the user talks
        over it (they have more to say)."""
        reply = self.floor.reply
        if reply is not None and reply.task is not None:
            self.floor.spawn(self._hang_up_when_heard(reply, reason))

    async def _hang_up_when_heard(self, reply: Reply, reason: str) -> None:
        assert reply.task is not None  # its reply's
        await asyncio.wait({reply.task})
        if reply.finished:
            self.hang_up(reason)
        else:
            log.info("session=%s turn=%d the goodbye was interrupted: the call goes on", self.id, reply.turn)

    def terminate(self, code: str, message: str, close_code: int = 1008) -> None:
        """End the session from our side: an `error` with `code`, then the transport closes the
        connection (websocket close `close_code`, reason `code`; SIP BYE)."""
        if self.ending.is_set() or self.closed:
            return
        self.end_reason, self.close_code = code, close_code
        self.ending.set()
        self.instance.metrics.ended.labels(code).inc()
        self.emit(Error(self.turn, time.monotonic(), code, message))

    @property
    def turn(self) -> int:
        return self.turns.turn

    def replying(self) -> bool:
        """A reply is being made or played."""
        return self.floor.replying()

    @property
    def busy(self) -> bool:
        """A turn is in flight: the user is speaking, or their turn is not done yet."""
        return (self.turns.speaking or (self.final_task is not None and not self.final_task.done())
                or self.replying())

    async def close(self, reason: str = "closed") -> None:
        if self.closed:
            return
        self.closed = True
        self.instance.scheduler.stop_waiting(self.id)
        cancelled = []
        self.timers.cancel_all()
        if self.keypad_pause is not None:
            self.keypad_pause.cancel()
        for task in (*self.turns.close(), *self.partial_tasks, self.final_task, self.judge_task, self.watchdog,
                     *self.floor.close()):
            if task is not None and not task.done() and task is not asyncio.current_task():
                task.cancel()
                cancelled.append(task)
        self.instance.metrics.sessions.labels(self.transport).dec()
        self.instance.live.discard(self)
        reason = self.end_reason or reason
        try:
            if cancelled and self.call_log.open_turns:  # a cancelled reply records its own turn (interrupted) first
                await asyncio.wait(cancelled, timeout=CLOSE_WAIT_S)
        finally:
            self.replies.chat.close()  # nobody continues the conversation: its LM cache goes back
            self.call_log.closed(reason, self.turn, self.pressed)
            log.info("session=%s closed (%s) after %d turns", self.id, reason, self.turn)


async def _once(text: str) -> AsyncIterator[str]:
    yield text
