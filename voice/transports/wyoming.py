"""Wyoming, Home Assistant's protocol for local voice services, served with the `wyoming` library.

One TCP server offers three programs on every connection (`describe` lists them):
- speech-to-text: [transcribe] audio-start audio-chunk* audio-stop -> transcript-start,
  transcript-chunk* (partials, as soon as two decodes agree on them), transcript, transcript-stop.
  Two things make it answer sooner than a plain Whisper server: the encoder window is sized to
  the audio (voice/pipeline/asr.py), and once the speaker has been quiet `asr.early_final_ms` the final
  is decoded speculatively, while the client's own VAD still waits out its silence.
- text-to-speech: synthesize -> audio-start audio-chunk* audio-stop; streamed text
  (synthesize-start, synthesize-chunk*, synthesize-stop) is spoken phrase by phrase as it comes,
  then synthesize-stopped. Either way the first phrase ends after `tts.first_words` words, so
  audio starts before the sentence is synthesised.
- the assistant (handle): transcript -> handled-start, handled-chunk* (LM blocks), handled,
  handled-stop. Home Assistant reads only `handled`; streaming clients get the chunks first. Each
  `context.conversation_id` keeps its history (and the LM's cache of it); a new id is returned.

A request that fails gets an `error` and its connection is closed (Home Assistant's ASR and
TTS clients have no timeout of their own: a closed connection fails, an error alone would hang);
the assistant answers `not-handled` instead, which Home Assistant treats as the end. Events this
server does not know are dropped, as the protocol asks. Whatever a client sends is bounded
([wyoming]): each event is read by `read_event` (engine/common/wire.py's JSON, sizes and types checked)
within `idle_timeout_s`, each write must be read within it too, and a connection gives its
socket back on every way out.

This file is only the codec: Wyoming's events and its request model (one request at a time, each
answered before the next event is read). The work is a `Session` that serves requests (its
`dictate`, `recite` and `answer_in`: conversation/session.py and oneshot.py) on the conversation runner
every front uses (voice/transports/common.py): admission, the call records (transport "wyoming", a connection
with a request is a session, each request a turn), latency and /metrics, stage faults, the
scheduler and the end of each turn are the session's, as for /ws (docs/HOME_ASSISTANT.md).
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from wyoming.asr import Transcribe, Transcript, TranscriptChunk, TranscriptStart, TranscriptStop
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.handle import Handled, HandledChunk, HandledStart, HandledStop, NotHandled
from wyoming.info import (AsrModel, AsrProgram, Attribution, Describe, HandleModel, HandleProgram, Info, TtsProgram,
                          TtsVoice)
from wyoming.ping import Ping, Pong
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice

from engine.common.wire import WireError, decode_json
from voice import events
from voice.pipeline.asr import SAMPLE_RATE
from voice.audio import StreamResampler, float_to_pcm16, pcm16_to_float
from voice.service.auth import source_allowed
from voice.config import TtsConfig, WyomingConfig
from voice.conversation.history import History
from voice.service.limits import LimitError, Ticket, give_back_freed_memory
from voice.pipeline.lm import Chat
from voice.conversation.session import Session
from voice.service.instance import Instance
from voice.transports.common import FLUSH_S, ConversationRunner, acquire

if TYPE_CHECKING:
    from wyoming.zeroconf import HomeAssistantZeroconf

log = logging.getLogger("voice.wyoming")
CLOSE_GRACE_S = 5.0  # a closing connection's last events get this long to be read; then it is cut off
AUDIO_CHUNK_SAMPLES = 1024  # per audio-chunk we send, as wyoming-piper does
ATTRIBUTION = Attribution(name="diffusion-voice", url="https://github.com/diffusion-voice/diffusion-voice")
_connection_ids = itertools.count(1)


class RequestFailed(Exception):
    """A request cannot be served: an `error` event with `code`, then the connection closes."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Stalled(ConnectionError):
    """The client read nothing of what we sent for `idle_timeout_s`: it is cut off without a word
    (it would not read one)."""


def voice_name(tts: TtsConfig) -> str:
    """The Piper voice's name: the packaged one, or the .onnx file's stem."""
    return Path(tts.voice).stem if tts.voice else "en_US-joe-medium"


def info(instance: Instance) -> Info:
    cfg = instance.config
    ours = version("diffusion-voice")
    voice = voice_name(cfg.tts)
    language = cfg.asr.language or "en"
    decoding = instance.lm.describe()  # what runs, as /healthz says it; None: an endpoint elsewhere decides
    decodes = ("decoded by its endpoint" if decoding is None else "drafted blocks verified losslessly"
               if decoding["mode"] == "diffusion" else "autoregressive decoding")
    return Info(
        asr=[AsrProgram(name="diffusion-voice-asr", attribution=ATTRIBUTION, installed=True, version=ours,
                        description=f"faster-whisper {cfg.asr.model}: encoder window sized to the audio, "
                                    "final decoded while the speaker is still quiet",
                        models=[AsrModel(name=cfg.asr.model, attribution=ATTRIBUTION, installed=True, version=None,
                                         description=f"Whisper {cfg.asr.model}", languages=[language])],
                        supports_transcript_streaming=True)],
        tts=[TtsProgram(name="diffusion-voice-tts", attribution=ATTRIBUTION, installed=True, version=ours,
                        description="Piper, spoken phrase by phrase (the first after a few words)",
                        voices=[TtsVoice(name=voice, attribution=ATTRIBUTION, installed=True, version=None,
                                         description=f"Piper {voice}", languages=[voice.split("-")[0]])],
                        supports_synthesize_streaming=True)],
        handle=[HandleProgram(name="diffusion-voice-assistant", attribution=ATTRIBUTION, installed=True,
                              version=ours, description=f"a conversational assistant ({cfg.lm.model}, {decodes})",
                              models=[HandleModel(name=cfg.lm.model, attribution=ATTRIBUTION, installed=True,
                                                  version=None, description=f"LM {cfg.lm.model}",
                                                  languages=[language])],
                              supports_handled_streaming=True)])


async def read_event(reader: asyncio.StreamReader, config: WyomingConfig) -> Event | None:
    """The next event, or None at the end of the stream. Unlike the library's reader this bounds
    each part of an event (the JSON line, its data block, its payload), decodes the JSON with
    engine/common/wire.py (no deep nesting, no infinite or endless number) and checks the header's types:
    whatever is wrong is a RequestFailed, never another exception."""
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as err:
        if not err.partial.strip():
            return None
        raise RequestFailed("bad_event", "the connection ended in the middle of an event") from None
    except asyncio.LimitOverrunError:
        raise RequestFailed("event_too_large", f"an event header longer than {config.max_event_bytes} "
                                               "bytes") from None
    header = json_object(line, config.max_event_bytes, "header")
    kind, data = header.get("type"), header.get("data")
    if not isinstance(kind, str) or not kind:
        raise RequestFailed("bad_event", "an event's type must be a string")
    if data is not None and not isinstance(data, dict):
        raise RequestFailed("bad_event", "an event's data must be a JSON object")
    data = data or {}
    data_length = block_length(header, "data_length", config.max_event_bytes)
    payload_length = block_length(header, "payload_length", config.max_payload_bytes)
    try:
        if data_length:
            data.update(json_object(await reader.readexactly(data_length), config.max_event_bytes, "data"))
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError:
        raise RequestFailed("bad_event", "the connection ended in the middle of an event") from None
    return Event(kind, data, payload)


def json_object(raw: bytes, max_bytes: int, part: str) -> dict:
    """An event's header or data block: a JSON object within the bounds of engine/common/wire.py."""
    try:
        value = decode_json(raw, max_bytes=max_bytes)
    except WireError as err:
        code = "event_too_large" if err.reason == "too_large" else "bad_event"
        raise RequestFailed(code, f"the event's {part}: {err.message}") from None
    if not isinstance(value, dict):
        raise RequestFailed("bad_event", f"the event's {part} must be a JSON object")
    return value


def block_length(header: dict, key: str, most: int) -> int:
    """The header's `data_length` or `payload_length`: a whole number of bytes up to `most`."""
    length = header.get(key)
    if length is None:
        return 0
    if type(length) is not int or length < 0:
        raise RequestFailed("bad_event", f"{key} must be a whole number of bytes")
    if length > most:
        raise RequestFailed("event_too_large", f"{key} must be at most {most} bytes")
    return length


def text_of(event: Event, most: int, before: int = 0) -> str:
    """The event's `text`: a string that, after `before` characters of the same request, makes at
    most `most`."""
    text = event.data.get("text")
    if not isinstance(text, str):
        raise RequestFailed("bad_event", f"the text of a {event.type} event must be a string")
    if before + len(text) > most:
        raise RequestFailed("text_too_long", f"at most {most} characters per request")
    return text


class Conversations:
    """The assistant's conversations by id: their history and LM chat (which keeps the LM's cache),
    the `size` most recent ones; a forgotten one gives its cache back."""

    def __init__(self, instance: Instance, size: int):
        self.instance, self.size = instance, size
        self.kept: collections.OrderedDict[str, tuple[History, Chat]] = collections.OrderedDict()

    def get(self, conversation_id: str) -> tuple[History, Chat]:
        if conversation_id in self.kept:
            self.kept.move_to_end(conversation_id)
            return self.kept[conversation_id]
        lm = self.instance.config.lm
        history = History(lm.system_prompt, lm.history_turns, lm.max_prompt_chars,
                          self.instance.lm.fits)
        self.kept[conversation_id] = found = (history, self.instance.lm.chat())
        while len(self.kept) > self.size:
            _, (_, chat) = self.kept.popitem(last=False)
            chat.close()
        return found


@dataclass
class Request:
    """The request being served: which program, its turn of the session, and when it is answered."""

    program: str  # listen | speak | answer
    turn: int
    done: asyncio.Future[None]
    streamed: bool = False  # speak: synthesize-start .. synthesize-stop
    said: str = ""  # listen: the partial text sent as transcript-chunks
    context: dict | None = None  # answer: its conversation

    def finish(self) -> None:
        """Its last event is written: the connection may read the next request."""
        if not self.done.done():
            self.done.set_result(None)


class Reported(Exception):
    """The request failed and its client was told (an `error`): the connection closes."""

    def __init__(self, code: str):
        super().__init__(code)
        self.code = code


class Connection:
    """One client connection, a wire codec over a session that serves requests (voice/conversation/oneshot.py) on
    the conversation runner (voice/transports/common.py): its events are read in order, a request
    at a time (`receive`); what the session says comes through the runner's one drain (`play`,
    `send`) and is written in Wyoming's events. The session opens with the first request."""

    def __init__(self, server: "WyomingServer", reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.server, self.instance, self.reader, self.writer = server, server.instance, reader, writer
        self.id = f"w{next(_connection_ids)}"
        peer = writer.get_extra_info("peername") or ("", 0)
        self.peer = f"{peer[0]}:{peer[1]}" if len(peer) >= 2 else str(peer)
        self.runner = ConversationRunner(FLUSH_S["wyoming"], self)
        self.session: Session | None = None  # opened with the first request (Home Assistant polls `describe`)
        self.ticket: Ticket | None = None  # acquired with the session
        self.request: Request | None = None
        self.resampler = StreamResampler(SAMPLE_RATE)  # a dictation's audio, any rate, to 16 kHz
        self.texts: asyncio.Queue[str | None] | None = None  # a streamed synthesis's text so far
        self.speech_chars = 0  # the streamed synthesis's text so far
        self.language = ""
        self.ended = False  # an error went out (or the session ended): nothing more is written
        self.config = server.config

    async def run(self) -> None:
        try:
            await self.runner.serve()
        finally:
            await self.release()

    # --- the wire in (AudioInput) ---------------------------------------------------------------

    async def receive(self) -> str | None:
        """Events in, each request answered before the next event is read; why it ended."""
        try:
            while (event := await self.next_event()) is not None:
                if self.session is not None:
                    self.session.last_audio = time.monotonic()  # (the session's idle limit: any event counts)
                try:
                    await self.handle(event)
                except (KeyError, TypeError, ValueError, AttributeError) as err:  # a field missing or mistyped
                    raise RequestFailed("bad_event", f"bad {event.type} event: {err!r}") from None
        except RequestFailed as failure:
            await self.fail(failure)
            return failure.code
        except Reported as reported:
            return reported.code
        except (ConnectionError, asyncio.IncompleteReadError):  # (a write that stalled was cut off)
            pass
        except Exception:  # a bug of ours: this connection ends, the server goes on
            log.exception("wyoming=%s failed", self.id)
            await self.fail(RequestFailed("internal_error", "the server failed to serve this request"))
            return "error"
        return None

    async def next_event(self) -> Event | None:
        """The next event, which must come whole within `idle_timeout_s` (a header that never ends holds
        nothing)."""
        try:
            async with asyncio.timeout(self.config.idle_timeout_s):
                return await read_event(self.reader, self.config)
        except TimeoutError:
            raise RequestFailed("idle_timeout", f"no whole event within {self.config.idle_timeout_s:g} s") from None

    async def handle(self, event: Event) -> None:
        kind = event.type
        if Describe.is_type(kind):
            await self.write(info(self.instance).event())
        elif Ping.is_type(kind):
            await self.write(Pong(text=Ping.from_event(event).text).event())
        elif Transcribe.is_type(kind):
            self.language = Transcribe.from_event(event).language or ""
        elif AudioStart.is_type(kind):
            await self.listen()
        elif AudioChunk.is_type(kind):
            if not self.dictating():  # audio without audio-start: its chunks carry their format
                await self.listen()
            await self.hear(AudioChunk.from_event(event))
        elif AudioStop.is_type(kind):
            if not self.dictating():
                raise RequestFailed("bad_event", "audio-stop without audio")
            assert self.session is not None  # dictating
            self.session.end_speech()
            await self.request_finished()
        elif Synthesize.is_type(kind):
            if self.texts is None:  # inside a stream it is only the text again, for older servers
                text = text_of(event, self.config.max_text_chars)
                self.check_voice(Synthesize.from_event(event).voice)
                await self.speak([text])
                await self.request_finished()
        elif SynthesizeStart.is_type(kind):
            self.check_voice(SynthesizeStart.from_event(event).voice)
            if self.texts is not None:
                raise RequestFailed("bad_event", "synthesize-start inside another synthesize-start")
            self.texts, self.speech_chars = asyncio.Queue(), 0
            await self.speak(None)
        elif SynthesizeChunk.is_type(kind):
            if self.texts is None:
                raise RequestFailed("bad_event", "synthesize-chunk outside synthesize-start .. synthesize-stop")
            text = text_of(event, self.config.max_text_chars, self.speech_chars)
            self.speech_chars += len(text)
            self.texts.put_nowait(text)
        elif SynthesizeStop.is_type(kind):
            if self.texts is None:
                raise RequestFailed("bad_event", "synthesize-stop without synthesize-start")
            self.texts.put_nowait(None)
            self.texts = None
            await self.request_finished()
        elif Transcript.is_type(kind):
            text_of(event, self.config.max_text_chars)
            await self.answer(Transcript.from_event(event))
        else:
            log.debug("wyoming=%s dropped a %s event", self.id, kind)

    def open(self) -> Session:
        """The connection's session, opened with its first request (admitted then)."""
        if self.session is None:
            try:
                self.ticket = acquire(self.instance, "wyoming", per_key=False)
            except LimitError as err:
                raise RequestFailed(err.code, err.message) from None
            session = Session(self.instance, SAMPLE_RATE, self.instance.synthesizer.voice_rate, "wyoming",
                              principal="wyoming", peer=self.peer, requests=True)
            session.call_log.stages_key = True
            self.session = self.runner.open(session, self)
        return self.session

    def begin(self, program: str, turn: int, **details: Any) -> Request:
        self.request = Request(program, turn, asyncio.get_running_loop().create_future(), **details)
        return self.request

    async def request_finished(self) -> None:
        """Until the request's last event is written (a stage that failed: its `error` was)."""
        assert self.request is not None  # begun
        await self.request.done

    # --- the three programs ---------------------------------------------------------------------

    def dictating(self) -> bool:
        return self.session is not None and self.session.turns.speaking

    async def listen(self) -> None:
        asr = self.instance.config.asr
        if self.language and asr.language and self.language.split("-")[0] != asr.language:
            raise RequestFailed("unsupported_language", f"this server transcribes {asr.language!r}, not "
                                                        f"{self.language!r}")
        session = self.open()
        self.begin("listen", session.dictate())
        self.resampler = StreamResampler(SAMPLE_RATE)
        await self.write(TranscriptStart(language=asr.language or None).event())

    async def hear(self, chunk: AudioChunk) -> None:
        """An audio-chunk of the dictation: mixed to mono, resampled to 16 kHz, into the session."""
        if any(type(n) is not int for n in (chunk.width, chunk.channels, chunk.rate)) or chunk.width != 2 \
                or not 1 <= chunk.channels <= 8 or not 8000 <= chunk.rate <= 192000:
            raise RequestFailed("unsupported_audio", "audio must be 16-bit PCM, 1-8 channels, 8-192 kHz; got "
                                                     f"width {chunk.width}, {chunk.channels} channels, {chunk.rate} Hz")
        if len(chunk.audio) % (2 * chunk.channels):
            raise RequestFailed("bad_audio", "an audio-chunk must hold whole samples")
        audio = pcm16_to_float(chunk.audio).reshape(-1, chunk.channels).mean(axis=1, dtype=np.float32)
        audio = self.resampler.push(audio, chunk.rate)
        if len(audio):
            assert self.session is not None  # dictating
            await self.session.push_audio(float_to_pcm16(audio))

    def check_voice(self, voice: SynthesizeVoice | None) -> None:
        ours = voice_name(self.instance.config.tts)
        if voice is not None and voice.name is not None and voice.name != ours:
            raise RequestFailed("unknown_voice", f"this server speaks with {ours!r}, not {voice.name!r}")

    async def speak(self, texts: list[str] | None) -> None:
        """Text (`texts`, or the stream's as it comes) spoken phrase by phrase: audio-start, then the
        audio as each phrase is ready; audio-stop once its turn is done."""
        session = self.open()
        queue = self.texts

        async def stream() -> AsyncIterator[str]:
            if texts is not None:
                for text in texts:
                    yield text
                return
            assert queue is not None  # synthesize-start's
            while (more := await queue.get()) is not None:
                yield more

        await self.write(AudioStart(rate=session.out_rate, width=2, channels=1).event())
        self.begin("speak", session.recite(stream()), streamed=texts is None)

    async def answer(self, transcript: Transcript) -> None:
        """The LM's reply to a transcript, in the conversation its context names."""
        context = transcript.context if isinstance(transcript.context, dict) else {}
        conversation_id = context.get("conversation_id")
        if not isinstance(conversation_id, str) or not conversation_id:
            conversation_id = uuid.uuid4().hex
        context = {"conversation_id": conversation_id}
        history, chat = self.server.conversations.get(conversation_id)
        session = self.open()
        await self.write(HandledStart(context=context).event())
        self.begin("answer", session.turn + 1, context=context)
        await session.answer_in(transcript.text, history, chat)
        await self.request_finished()

    # --- the wire out (AudioOutput) -------------------------------------------------------------

    async def play(self, audio: events.TtsAudio, heard: Callable[[], None]) -> None:
        """A phrase of a synthesis, in audio-chunks of AUDIO_CHUNK_SAMPLES; heard once the first is written."""
        assert self.session is not None  # (its outbox is drained)
        pcm = np.frombuffer(audio.pcm, dtype="<i2")
        for i in range(0, len(pcm), AUDIO_CHUNK_SAMPLES):
            if self.ended or not self.session.is_current(audio.turn):
                return
            await self.write(AudioChunk(rate=audio.rate, width=2, channels=1,
                                        audio=pcm[i:i + AUDIO_CHUNK_SAMPLES].tobytes()).event())
            if not i:
                heard()

    async def clear(self) -> None:
        return None  # (a request is never talked over: the next one is read once this one is answered)

    async def send(self, ev: events.Event) -> None:
        """The session's events in Wyoming's: each request's own, and how it ends."""
        request = self.request
        if self.ended:
            return
        if isinstance(ev, events.Error):  # (the session counted and recorded it)
            if ev.stage and request is not None and ev.turn == request.turn and not request.done.done():
                await self.stage_failed(request, ev)
            elif self.session is not None and self.session.ending.is_set():
                await self.end(ev.code, ev.message)  # the session ends (a limit, shutdown): the last word
            return
        if request is None or ev.turn != request.turn:
            return
        if isinstance(ev, events.Transcript) and request.program == "listen":
            await self.transcribed(request, ev)
        elif isinstance(ev, events.ReplyText) and request.program == "answer":
            await self.write(HandledChunk(text=ev.text).event())
        elif isinstance(ev, events.ReplyDone) and request.program == "speak":
            await self.write(AudioStop().event())
            if request.streamed:
                await self.write(SynthesizeStopped().event())
            request.finish()
        elif isinstance(ev, events.ReplyDone) and request.program == "answer" and not request.done.done():
            await self.write(Handled(text=ev.text, context=request.context).event())
            await self.write(HandledStop().event())
            request.finish()

    async def transcribed(self, request: Request, ev: events.Transcript) -> None:
        """A partial transcript: its new words as a transcript-chunk; the final: the rest, transcript
        and transcript-stop."""
        text = ev.text
        if text.startswith(request.said) and len(text) > len(request.said):
            delta, request.said = text[len(request.said):], text
            await self.write(TranscriptChunk(text=delta).event())
        if ev.final:
            await self.write(Transcript(text=text, language=self.instance.config.asr.language or None).event())
            await self.write(TranscriptStop().event())
            request.finish()

    async def stage_failed(self, request: Request, ev: events.Error) -> None:
        """The assistant answers not-handled (Home Assistant's end of it); speech to text or text to
        speech ends with an `error` and the connection closes (HA's clients have no timeout)."""
        if request.program == "answer":
            await self.write(NotHandled(text="Sorry, I could not answer that.", context=request.context).event())
            request.finish()
        else:
            kind = "timeout" if ev.code.endswith("timeout") else "failed"
            await self.end(ev.code if ev.stage in ("asr", "lm") else f"{ev.stage}_{kind}", ev.message)

    async def end(self, code: str, message: str) -> None:
        """The last event of this connection: an `error`; the request waiting for it ends the reading."""
        self.ended = True
        try:
            await self.write(Error(text=message, code=code).event())
        finally:
            if self.request is not None and not self.request.done.done():
                self.request.done.set_exception(Reported(code))

    async def close(self, code: int, reason: str) -> None:
        """The session ended (its `error` went out last): nothing more is written; `release` closes."""
        self.ended = True

    async def write(self, event: Event) -> None:
        """One event, which the client must read within `idle_timeout_s`: else it is cut off without a
        word (it would not read one), and `Stalled` says so."""
        try:
            async with asyncio.timeout(self.config.idle_timeout_s):
                await async_write_event(event, self.writer)
        except TimeoutError:
            message = f"the client read nothing for {self.config.idle_timeout_s:g} s"
            self.error("slow_client", message)
            self.ended = True
            self.writer.transport.abort()  # what it has not read is dropped with it
            raise Stalled(message) from None

    # --- errors and the end ---------------------------------------------------------------------

    def error(self, code: str, message: str) -> None:
        """Count, log and record an error (in the records once this connection is a session)."""
        if self.session is not None:
            self.session.emit(events.Error(self.session.turn, time.monotonic(), code, message), wire=False)
        else:
            self.instance.metrics.errors.labels(code).inc()
            log.warning("wyoming=%s %s: %s", self.id, code, message)

    async def fail(self, failure: RequestFailed) -> None:
        """Stop what this connection was doing, then say why (the error is the last event sent)."""
        self.ended = True
        drain = self.runner.drain
        if drain is not None:
            drain.cancel()
            await asyncio.wait({drain})
        self.error(failure.code, failure.message)
        session = self.session
        if session is not None:
            await session.drop_request()
            if session.turn in session.call_log.open_turns:
                session.unreplied(session.turn, "", failure.code)
        try:
            await self.write(Error(text=failure.message, code=failure.code).event())
        except ConnectionError:
            pass

    async def release(self) -> None:
        """Give everything back, the socket last and whatever else fails: a client that reads nothing
        is cut off after CLOSE_GRACE_S instead of holding the socket until it reads."""
        try:
            if self.ticket is not None:
                self.ticket.release()
        finally:
            self.writer.close()
            try:
                async with asyncio.timeout(CLOSE_GRACE_S):
                    await self.writer.wait_closed()
            except (TimeoutError, ConnectionError):
                self.writer.transport.abort()
            give_back_freed_memory()  # a connection that made no request held no ticket



class WyomingServer:
    """The TCP server, started and stopped with the voice app (voice/service/server.py)."""

    def __init__(self, instance: Instance, config: WyomingConfig):
        self.instance, self.config = instance, config
        self.conversations = Conversations(instance, config.conversations)
        self.allow = [ipaddress.ip_network(net, strict=False) for net in config.allow]
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.Task] = set()
        self.zeroconf: HomeAssistantZeroconf | None = None

    @property
    def port(self) -> int:
        return self.server.sockets[0].getsockname()[1] if self.server else self.config.port

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._connected, self.config.host, self.config.port,
                                                 limit=self.config.max_event_bytes)
        log.info("Wyoming server on tcp://%s:%d (speech-to-text, text-to-speech, assistant)", self.config.host,
                 self.port)
        if self.config.zeroconf:
            from wyoming.zeroconf import HomeAssistantZeroconf
            host = None if self.config.host in ("0.0.0.0", "") else self.config.host
            self.zeroconf = HomeAssistantZeroconf(self.port, self.config.zeroconf, host)
            await self.zeroconf.register_server()

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("",)
        if not source_allowed(peer[0], self.allow):  # closed without a word: scanners learn nothing
            log.warning("wyoming: refused a connection from %s (not in wyoming.allow)", peer[0])
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None  # a connection runs as a task of its own
        self.connections.add(task)
        try:
            await Connection(self, reader, writer).run()
        except asyncio.CancelledError:  # the server stops (the connection closed itself on the way out)
            pass
        finally:
            self.connections.discard(task)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.connections):
            task.cancel()
        if self.connections:
            await asyncio.wait(self.connections, timeout=5)
        for _, chat in self.conversations.kept.values():
            chat.close()
