"""One instance of the voice service: the models and the state every session on it shares (its
scheduler, metrics, admission, records, open sessions and recent faults).

Built from its parts, so tests can pass fakes; `Instance.load(config)` loads the real models. Each
stage queues its own work on a worker of the one `voice.service.scheduler.Scheduler`.
"""

from __future__ import annotations

import logging
import time

from voice.service import records as rec
from voice.pipeline.asr import Transcriber, Whisper
from voice.audio import RATES, float_to_int16, resample
from voice.service.capacity import Capacity
from voice.config import Config
from voice.pipeline.endofturn import EndOfTurn, SmartTurn
from voice.conversation.latency import Metrics
from voice.service.limits import Admission
from voice.pipeline.lm import LanguageModel, load_lm
from voice.conversation.faults import StageFailure
from voice.service.scheduler import Scheduler
from voice.pipeline.tools import Toolbox
from voice.pipeline.tts import SpeechSynthesizer, Synthesizer, load_voice

log = logging.getLogger("voice.session")
FAULT_WINDOW_S = 60.0  # /healthz says "degraded" for this long after a stage failed or timed out


class Instance:
    def __init__(self, config: Config, whisper: Transcriber, synthesizer: SpeechSynthesizer, lm: LanguageModel,
                 scheduler: Scheduler | None = None, capacity: Capacity | None = None):
        """`capacity`: admit by measured capacity (the real models: `load`); None, by the counts only."""
        self.config = config
        self.whisper, self.synthesizer, self.lm = whisper, synthesizer, lm
        self.scheduler = scheduler or Scheduler()
        self.metrics = Metrics()
        self.apology = apologies(synthesizer, config.faults.apology)
        self.capacity = capacity
        if capacity is not None:
            self.scheduler.load_high = capacity.strained
        self.admission = Admission(config.limits, self.metrics, capacity)
        self.records: rec.Records | None = None  # the app opens them (voice.service.server)
        self.live: set = set()  # open sessions
        self.faults: dict[str, tuple[float, str]] = {}  # stage -> (monotonic time, what) of its last fault
        self.tools = Toolbox(config.tools)
        # the end-of-turn model, loaded when a policy first needs it (`load`: with the hold too)
        self.smart_turn: SmartTurn | None = None
        self.end_of_turn_worker = self.scheduler.worker("endofturn")

    @classmethod
    def load(cls, config: Config) -> "Instance":
        t = time.perf_counter()
        scheduler = Scheduler()
        whisper = Whisper(config.asr, scheduler.worker("asr"))
        synthesizer = Synthesizer(load_voice(config.tts), config.tts, scheduler.worker("tts"))
        lm = load_lm(config.lm, scheduler)  # LocalLM for backend "local"
        instance = cls(config, whisper, synthesizer, lm, scheduler, Capacity(config.limits))
        if config.turn.hold_ms:  # Smart Turn hears whether a list said is finished (reply.py's Floor.voiced)
            instance.smart_turn = SmartTurn(threads=config.turn.threads)
        instance.end_of_turn(config)  # Smart Turn loaded now if the policy needs it, not at the first session
        lm.serve(config.faults.lm_first_block_timeout_s, instance.tools.openai() if instance.tools else [])
        log.info("models loaded in %.1f s (lm backend=%s model=%s mode=%s: %s)", time.perf_counter() - t,
                 config.lm.backend, config.lm.model, lm.mode, lm.describe() or "decided by the endpoint")
        return instance

    def end_of_turn(self, config: Config) -> EndOfTurn:
        """A session's end-of-turn policy (its own config: Realtime's semantic_vad), on the shared
        Smart Turn model and worker."""
        if config.turn.policy in ("smart_turn", "combined") and self.smart_turn is None:
            self.smart_turn = SmartTurn(threads=config.turn.threads)
        return EndOfTurn(config.turn, config.vad, self.end_of_turn_worker, self.smart_turn)

    def fault(self, failure: StageFailure) -> None:
        """Note a stage's failure for /healthz and /metrics (unless this client's input caused it)."""
        if failure.kind == "client":
            return
        self.metrics.stage_faults.labels(failure.stage, failure.kind).inc()
        self.faults[failure.stage] = (time.monotonic(), failure.kind)

    def recent_faults(self, window_s: float = FAULT_WINDOW_S) -> dict[str, str]:
        now = time.monotonic()
        return {stage: what for stage, (t, what) in self.faults.items() if now - t < window_s}


def apologies(synthesizer: SpeechSynthesizer, text: str) -> dict[int, bytes]:
    """The apology as PCM16 at every rate a client may ask for: synthesised once, resampled per rate."""
    if not text.strip():
        return {}
    pcm = synthesizer.render(text, synthesizer.voice_rate)
    audio = pcm.astype("float32") / 32768.0
    return {rate: float_to_int16(resample(audio, synthesizer.voice_rate, rate)).astype("<i2").tobytes()
            for rate in RATES}
