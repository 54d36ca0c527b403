"""Wyoming, Home Assistant's protocol for local voice services, served with the `wyoming` library.

One TCP server offers three programs on every connection (`describe` lists them):
- speech-to-text: [transcribe] audio-start audio-chunk* audio-stop -> transcript-start,
  transcript-chunk* (partials, as soon as two decodes agree on them), transcript, transcript-stop.
  Two things make it answer sooner than a plain Whisper server: the encoder window is sized to
  the audio (voice/asr.py), and once the speaker has been quiet `asr.early_final_ms` the final
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
socket back on every way out. Each connection with a request is a session in the call records
(transport "wyoming"), each request a turn, and its stage times go to /metrics like any
session's (docs/HOME_ASSISTANT.md).
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import itertools
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable
from contextlib import aclosing
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

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
from voice import events, vad
from voice.auth import source_allowed
from voice.asr import SAMPLE_RATE, StreamingTranscriber
from voice.audio import StreamResampler, float_to_pcm16, pcm16_to_float
from voice.calllog import CallLog
from voice.config import TtsConfig, WyomingConfig
from voice.faults import StageFailure, blocks_within, synthesis_within, transcript_within
from voice.history import History
from voice.latency import observe_stages
from voice.limits import LimitError, Ticket, give_back_freed_memory
from voice.lm import Chat
from voice.stages import Stages
from voice.tts import PhraseSplitter
from voice.turns import EarlyFinal

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


def info(stages: Stages) -> Info:
    cfg = stages.config
    ours = version("diffusion-voice")
    voice = voice_name(cfg.tts)
    language = cfg.asr.language or "en"
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
                              version=ours, description="a conversational assistant on a block-diffusion LM",
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


class Dictation:
    """One transcription, audio-start to audio-stop, as 16 kHz audio into a StreamingTranscriber.
    The VAD only decides when the final may be decoded early (voice/turns.py's EarlyFinal, as for
    /ws); every sample is transcribed."""

    def __init__(self, stages: Stages):
        cfg = stages.config
        self.transcriber = StreamingTranscriber(stages.whisper, cfg.asr)
        self.endpointer = vad.Endpointer(cfg.vad, SAMPLE_RATE)
        self.early = EarlyFinal(self.transcriber, cfg.asr.early_final_ms)
        self.resampler = StreamResampler(SAMPLE_RATE)
        self.max_s = cfg.limits.max_utterance_s
        self.seconds = 0.0
        self.streamed = ""  # partial text sent as transcript-chunks

    def push(self, chunk: AudioChunk) -> None:
        if any(type(n) is not int for n in (chunk.width, chunk.channels, chunk.rate)) or chunk.width != 2 \
                or not 1 <= chunk.channels <= 8 or not 8000 <= chunk.rate <= 192000:
            raise RequestFailed("unsupported_audio", "audio must be 16-bit PCM, 1-8 channels, 8-192 kHz; got "
                                                     f"width {chunk.width}, {chunk.channels} channels, {chunk.rate} Hz")
        if len(chunk.audio) % (2 * chunk.channels):
            raise RequestFailed("bad_audio", "an audio-chunk must hold whole samples")
        if self.max_s and self.seconds >= self.max_s:
            return  # past the utterance limit: the rest is not transcribed
        audio = pcm16_to_float(chunk.audio).reshape(-1, chunk.channels).mean(axis=1, dtype=np.float32)
        audio = self.resampler.push(audio, chunk.rate)
        if not len(audio):
            return
        self.seconds += len(audio) / SAMPLE_RATE
        self.transcriber.insert_audio_chunk(audio)
        if any(isinstance(ev, vad.VoiceStart) for ev in self.endpointer.push(float_to_pcm16(audio))):
            self.early.drop()
        if self.endpointer.in_speech:
            if self.early.quiet(self.endpointer.silence_ms):
                self.early.take()
            else:
                self.early.drop()  # (still) speaking

    def finish(self) -> Awaitable[str]:
        """The final transcript: the early one when nothing but silence came after it."""
        return self.early.final()

    def cancel(self) -> None:
        """The dictation is dropped: nothing of it is decoded any more."""
        self.early.drop()
        self.transcriber.reset()


class Conversations:
    """The assistant's conversations by id: their history and LM chat (which keeps the LM's cache),
    the `size` most recent ones; a forgotten one gives its cache back."""

    def __init__(self, stages: Stages, size: int):
        self.stages, self.size = stages, size
        self.kept: collections.OrderedDict[str, tuple[History, Chat]] = collections.OrderedDict()

    def get(self, conversation_id: str) -> tuple[History, Chat]:
        if conversation_id in self.kept:
            self.kept.move_to_end(conversation_id)
            return self.kept[conversation_id]
        lm = self.stages.config.lm
        self.kept[conversation_id] = found = (History(lm.system_prompt, lm.history_turns), self.stages.lm.chat())
        while len(self.kept) > self.size:
            _, (_, chat) = self.kept.popitem(last=False)
            chat.close()
        return found


class Connection:
    """One client connection: its events in, in order; what it asked for out."""

    def __init__(self, server: "WyomingServer", reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.server, self.stages, self.reader, self.writer = server, server.stages, reader, writer
        self.id = f"w{next(_connection_ids)}"
        peer = writer.get_extra_info("peername") or ("", 0)
        self.peer = f"{peer[0]}:{peer[1]}" if len(peer) >= 2 else str(peer)
        self.calls: CallLog | None = None  # opened with the first request (Home Assistant polls `describe`)
        self.ticket: Ticket | None = None  # acquired with `calls`
        self.turn = 0
        self.dictation: Dictation | None = None
        self.partial_task: asyncio.Task | None = None
        self.speech: tuple[asyncio.Queue, asyncio.Task, float] | None = None  # a streamed synthesis
        self.speech_chars = 0  # the streamed synthesis's text so far
        self.language = ""
        self.config = server.config

    async def run(self) -> None:
        try:
            while (event := await self.next_event()) is not None:
                try:
                    await self.handle(event)
                except (KeyError, TypeError, ValueError, AttributeError) as err:  # a field missing or mistyped
                    raise RequestFailed("bad_event", f"bad {event.type} event: {err!r}") from None
        except RequestFailed as failure:
            await self.fail(failure)
        except Stalled as stalled:
            self.error("slow_client", str(stalled))
            self.writer.transport.abort()  # what it has not read is dropped with it
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception:  # a bug of ours: this connection ends, the server goes on
            log.exception("wyoming=%s failed", self.id)
            await self.fail(RequestFailed("internal_error", "the server failed to serve this request"))
        finally:
            await self.close()

    async def next_event(self) -> Event | None:
        """The next event, which must come whole within `idle_timeout_s` (a header that never ends holds
        nothing)."""
        try:
            async with asyncio.timeout(self.config.idle_timeout_s):
                return await read_event(self.reader, self.config)
        except TimeoutError:
            raise RequestFailed("idle_timeout", f"no whole event within {self.config.idle_timeout_s:g} s") from None

    async def write(self, event: Event) -> None:
        try:
            async with asyncio.timeout(self.config.idle_timeout_s):
                await async_write_event(event, self.writer)
        except TimeoutError:
            raise Stalled(f"the client read nothing for {self.config.idle_timeout_s:g} s") from None

    def error(self, code: str, message: str) -> None:
        """Count, log and record an error (in the records once this connection is a session)."""
        if self.calls is not None:
            self.calls.error(events.Error(self.turn, time.monotonic(), code, message))
        else:
            self.stages.metrics.errors.labels(code).inc()
            log.warning("wyoming=%s %s: %s", self.id, code, message)

    async def fail(self, failure: RequestFailed) -> None:
        """Stop what this connection was doing, then say why (the error is the last event sent)."""
        await self.stop_work()
        self.error(failure.code, failure.message)
        if self.calls is not None and self.turn in self.calls.open_turns:
            self.calls.unreplied(self.turn, "", failure.code)
        try:
            await self.write(Error(text=failure.message, code=failure.code).event())
        except ConnectionError:
            pass

    async def handle(self, event: Event) -> None:
        kind = event.type
        if Describe.is_type(kind):
            await self.write(info(self.stages).event())
        elif Ping.is_type(kind):
            await self.write(Pong(text=Ping.from_event(event).text).event())
        elif Transcribe.is_type(kind):
            self.language = Transcribe.from_event(event).language or ""
        elif AudioStart.is_type(kind):
            await self.start_dictation()
        elif AudioChunk.is_type(kind):
            if self.dictation is None:  # audio without audio-start: its chunks carry their format
                await self.start_dictation()
            assert self.dictation is not None  # started
            self.dictation.push(AudioChunk.from_event(event))
            if self.partial_task is None or self.partial_task.done():
                self.partial_task = asyncio.create_task(self.partial(self.dictation))
        elif AudioStop.is_type(kind):
            await self.transcribe()
        elif Synthesize.is_type(kind):
            if self.speech is None:  # inside a stream it is only the text again, for older servers
                text = text_of(event, self.config.max_text_chars)
                self.check_voice(Synthesize.from_event(event).voice)
                await self.synthesize(text)
        elif SynthesizeStart.is_type(kind):
            self.check_voice(SynthesizeStart.from_event(event).voice)
            await self.start_speech()
        elif SynthesizeChunk.is_type(kind):
            if self.speech is None:
                raise RequestFailed("bad_event", "synthesize-chunk outside synthesize-start .. synthesize-stop")
            text = text_of(event, self.config.max_text_chars, self.speech_chars)
            self.speech_chars += len(text)
            self.speech[0].put_nowait(text)
        elif SynthesizeStop.is_type(kind):
            await self.finish_speech()
        elif Transcript.is_type(kind):
            text_of(event, self.config.max_text_chars)
            await self.answer(Transcript.from_event(event))
        else:
            log.debug("wyoming=%s dropped a %s event", self.id, kind)

    def begin(self) -> float:
        """A new request (a turn of this connection's session); the time it began."""
        if self.calls is None:
            try:
                self.ticket = self.stages.admission.acquire("wyoming", per_key=False)
            except LimitError as err:
                raise RequestFailed(err.code, err.message) from None
            self.calls = CallLog(self.stages.records, secrets.token_hex(8), self.id, self.stages.metrics.errors)
            self.calls.opened("wyoming", "wyoming", self.peer, {})
            self.stages.metrics.sessions.labels("wyoming").inc()
            log.info("wyoming=%s session from %s", self.id, self.peer)
        self.turn += 1
        self.calls.started(self.turn)
        return time.monotonic()

    async def done(self, status: str, transcript: str, reply: str, stages: dict[str, float]) -> None:
        stages = {name: round(ms, 1) for name, ms in stages.items()}
        observe_stages(self.stages.metrics, self.stages.config.budget, stages, self.id, self.turn)
        assert self.calls is not None  # opened as the request began
        await self.calls.replied(self.turn, status, transcript, reply, "", False, False, {"stages": stages})

    def failed(self, failure: StageFailure) -> RequestFailed:
        """A stage failed this request: a fault for /healthz and `voice_stage_faults`, as /ws's are;
        the request's `error` to raise."""
        self.stages.fault(failure)
        code = failure.code if failure.stage in ("asr", "lm") else \
            f"{failure.stage}_{'timeout' if failure.kind == 'timeout' else 'failed'}"
        return RequestFailed(code, failure.message)

    # --- speech to text -------------------------------------------------------------------------

    async def start_dictation(self) -> None:
        asr = self.stages.config.asr
        if self.language and asr.language and self.language.split("-")[0] != asr.language:
            raise RequestFailed("unsupported_language", f"this server transcribes {asr.language!r}, not "
                                                        f"{self.language!r}")
        if self.dictation is not None:  # a second audio-start: the first dictation is dropped
            assert self.calls is not None  # the first dictation began a request
            self.dictation.cancel()
            self.calls.unreplied(self.turn, "", "superseded")
        self.begin()
        self.dictation = Dictation(self.stages)
        await self.write(TranscriptStart(language=asr.language or None).event())

    async def partial(self, dictation: Dictation) -> None:
        text = await dictation.transcriber.process_iter()
        if text and dictation is self.dictation and text.startswith(dictation.streamed):
            delta, dictation.streamed = text[len(dictation.streamed):], text
            await self.write(TranscriptChunk(text=delta).event())

    async def transcribe(self) -> None:
        dictation, self.dictation = self.dictation, None
        if dictation is None:
            raise RequestFailed("bad_event", "audio-stop without audio")
        if self.partial_task is not None:
            self.partial_task.cancel()
        stopped = time.monotonic()
        scheduler = self.stages.scheduler
        scheduler.start_waiting(self)
        try:
            text = await transcript_within(dictation.finish(), self.stages.config.faults)
        except StageFailure as failure:
            raise self.failed(failure) from None
        finally:
            scheduler.stop_waiting(self)
        asr_ms = (time.monotonic() - stopped) * 1000
        if text.startswith(dictation.streamed) and len(text) > len(dictation.streamed):
            await self.write(TranscriptChunk(text=text[len(dictation.streamed):]).event())
        await self.write(Transcript(text=text, language=self.stages.config.asr.language or None).event())
        await self.write(TranscriptStop().event())
        await self.done("ok", text, "", {"asr": asr_ms})

    # --- text to speech -------------------------------------------------------------------------

    def check_voice(self, voice: SynthesizeVoice | None) -> None:
        ours = voice_name(self.stages.config.tts)
        if voice is not None and voice.name is not None and voice.name != ours:
            raise RequestFailed("unknown_voice", f"this server speaks with {ours!r}, not {voice.name!r}")

    async def synthesize(self, text: str) -> None:
        """One text, spoken phrase by phrase: audio-start, the audio as each phrase is ready, audio-stop."""
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(text)
        queue.put_nowait(None)
        await self.speak(queue, self.begin(), text)
        await self.write(AudioStop().event())

    async def start_speech(self) -> None:
        if self.speech is not None:
            raise RequestFailed("bad_event", "synthesize-start inside another synthesize-start")
        queue: asyncio.Queue = asyncio.Queue()
        started = self.begin()
        self.speech, self.speech_chars = (queue, asyncio.create_task(self.speak(queue, started)), started), 0

    async def finish_speech(self) -> None:
        if self.speech is None:
            raise RequestFailed("bad_event", "synthesize-stop without synthesize-start")
        (queue, speaker, _), self.speech = self.speech, None
        queue.put_nowait(None)
        await speaker
        await self.write(AudioStop().event())
        await self.write(SynthesizeStopped().event())

    async def speak(self, texts: asyncio.Queue, started: float, whole: str = "") -> None:
        """Texts from `texts` (None ends them) -> phrases -> audio-start and audio-chunks."""
        cfg, synth, scheduler = self.stages.config, self.stages.synthesizer, self.stages.scheduler
        splitter = PhraseSplitter(cfg.tts.min_chars, cfg.tts.first_words, cfg.tts.max_phrase_chars)
        rate, first_ms, spoken = synth.voice_rate, None, ""
        await self.write(AudioStart(rate=rate, width=2, channels=1).event())
        scheduler.start_waiting(self)
        try:
            while True:
                text = await texts.get()
                phrases = splitter.push(text) if text is not None else [splitter.flush()]
                for phrase in phrases:
                    if not phrase.strip():
                        continue
                    if self.writer.is_closing():  # the client has gone: its phrases would only wait for others'
                        raise ConnectionResetError("the client has gone")
                    try:  # (asked while this phrase waits for the worker: first_ms is current then)
                        pcm = await synthesis_within(synth, phrase, rate, cfg.faults,
                                                     urgent=lambda: first_ms is None)  # noqa: B023
                    except StageFailure as failure:
                        raise self.failed(failure) from None
                    for i in range(0, len(pcm), AUDIO_CHUNK_SAMPLES):
                        await self.write(AudioChunk(rate=rate, width=2, channels=1,
                                                    audio=pcm[i:i + AUDIO_CHUNK_SAMPLES].tobytes()).event())
                        if first_ms is None:
                            first_ms = (time.monotonic() - started) * 1000
                            scheduler.stop_waiting(self)
                    spoken += phrase + " "
                if text is None:
                    break
        finally:
            scheduler.stop_waiting(self)
        await self.done("ok", "", whole or spoken.strip(), {"tts_first_audio": first_ms or 0.0})

    # --- the assistant --------------------------------------------------------------------------

    async def answer(self, transcript: Transcript) -> None:
        """The LM's reply to a transcript, in the conversation its context names."""
        context = transcript.context if isinstance(transcript.context, dict) else {}
        conversation_id = context.get("conversation_id")
        if not isinstance(conversation_id, str) or not conversation_id:
            conversation_id = uuid.uuid4().hex
        context = {"conversation_id": conversation_id}
        history, chat = self.server.conversations.get(conversation_id)
        started, first_ms, reply = self.begin(), None, ""
        await self.write(HandledStart(context=context).event())
        scheduler = self.stages.scheduler
        scheduler.start_waiting(self)
        stream = chat.reply(history.messages(transcript.text), urgent=lambda: first_ms is None)
        try:
            async with aclosing(blocks_within(stream, self.stages.config.faults)) as blocks:
                async for block in blocks:
                    if first_ms is None:
                        first_ms = (time.monotonic() - started) * 1000
                        scheduler.stop_waiting(self)
                    reply += block.text
                    await self.write(HandledChunk(text=block.text).event())
                    if len(reply) >= self.stages.config.limits.max_reply_chars:
                        break
        except StageFailure as failure:
            self.error(self.failed(failure).code, failure.message)
            await self.write(NotHandled(text="Sorry, I could not answer that.", context=context).event())
            assert self.calls is not None  # opened by `begin` above
            self.calls.unreplied(self.turn, transcript.text, "failed")
            return
        finally:
            scheduler.stop_waiting(self)
        reply = reply.strip()
        history.add(transcript.text, reply)
        await self.write(Handled(text=reply, context=context).event())
        await self.write(HandledStop().event())
        await self.done("ok", transcript.text, reply, {"lm_first_block": first_ms or 0.0})

    async def stop_work(self) -> None:
        """Cancel the transcription and synthesis in flight, and let them stop (CLOSE_GRACE_S at most)."""
        tasks = [task for task in (self.partial_task, self.speech[1] if self.speech else None) if task is not None]
        self.partial_task, self.speech = None, None
        for task in tasks:
            task.cancel()
        if tasks:
            done, _ = await asyncio.wait(tasks, timeout=CLOSE_GRACE_S)
            for task in done:
                if not task.cancelled():
                    task.exception()  # what it failed with ends with this connection: nothing to report
        if self.dictation is not None:
            self.dictation.cancel()
            self.dictation = None

    async def close(self) -> None:
        """Give everything back, the socket last and whatever else fails: a client that reads nothing
        is cut off after CLOSE_GRACE_S instead of holding the socket until it reads."""
        try:
            await self.stop_work()
            self.stages.scheduler.stop_waiting(self)
            if self.calls is not None:
                self.calls.closed("closed", self.turn)
                self.stages.metrics.sessions.labels("wyoming").dec()
                assert self.ticket is not None  # acquired with `calls`
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
    """The TCP server, started and stopped with the voice app (voice/server.py)."""

    def __init__(self, stages: Stages, config: WyomingConfig):
        self.stages, self.config = stages, config
        self.conversations = Conversations(stages, config.conversations)
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
