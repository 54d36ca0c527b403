"""TOML -> typed dataclasses. Defaults live in the dataclasses; configs/default.toml documents them."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from voice.asr import AsrConfig
from voice.tts import TtsConfig
from voice.vad import VadConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    web_dir: str = ""  # empty: the repository's web/ folder


@dataclass
class LmConfig:
    backend: str = "local"  # local (in-process engine) | openai (any OpenAI-compatible endpoint)
    model: str = "default"  # local: engine model name/path; openai: the model id to request
    adapter: str = ""  # local: an extra adapter to merge
    url: str = "http://127.0.0.1:8001/v1"  # openai backend base URL
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the endpoint's key
    system_prompt: str = ("You are a friendly voice assistant. Answer in one or two short spoken sentences, "
                          "without lists or markdown.")
    mode: str = "diffusion"  # diffusion | ar
    max_new_tokens: int = 48
    block_size: int = 0  # 0: the model's
    first_block_size: int = 0  # 0: same as block_size
    threshold: float = 0.9
    history_turns: int = 6  # earlier user/assistant pairs kept in the prompt
    threads: int = 1  # local: torch CPU threads (ASR and TTS run beside it on the same cores)
    max_batch: int = 8  # local: conversations whose decoding steps share one batched forward (1: none)

    def __post_init__(self) -> None:
        if self.backend not in ("local", "openai"):
            raise ValueError(f"lm.backend must be 'local' or 'openai', not {self.backend!r}")
        if self.mode not in ("diffusion", "ar"):
            raise ValueError(f"lm.mode must be 'diffusion' or 'ar', not {self.mode!r}")


@dataclass
class BudgetConfig:
    """Per-stage latency budgets in ms; a turn over any of them is flagged."""

    endpoint: float = 450.0  # end of user speech -> end of speech detected (mostly VAD hangover)
    asr: float = 400.0  # end of speech detected -> final transcript
    lm_first_block: float = 300.0  # final transcript -> first committed block
    tts_first_audio: float = 300.0  # first block -> first synthesised audio
    send: float = 50.0  # first audio -> first audio frame on the wire
    voice_to_voice: float = 1500.0  # end of user speech -> first audio frame on the wire


@dataclass
class SessionConfig:
    max_frame_bytes: int = 64000  # one binary frame (1 s of 32 kHz PCM16); larger frames are rejected
    start_timeout_s: float = 10.0  # time a client has to send `start`
    audio_frame_ms: int = 100  # reply audio is sent in frames of this length


@dataclass
class SipConfig:
    """The SIP/RTP telephony endpoint (docs/TELEPHONY.md); off unless `port` is set."""

    port: int = 0  # UDP port for SIP; 0 = off
    host: str = "127.0.0.1"  # interface for SIP and RTP
    advertise: str = ""  # address put in Contact and SDP; "" = host
    codecs: list[str] = field(default_factory=lambda: ["PCMU", "PCMA"])  # accepted; the caller's order picks
    rtp_port_min: int = 20000  # RTP on even ports of this range, RTCP on the odd port above
    rtp_port_max: int = 20199
    ring_ms: int = 0  # 180 Ringing this long before answering
    media_timeout_s: float = 60.0  # no RTP from the caller for this long: hang up; 0 = never
    max_calls: int = 16  # more concurrent calls get 486 Busy Here

    def __post_init__(self) -> None:
        bad = [c for c in self.codecs if c not in ("PCMU", "PCMA")]
        if bad or not self.codecs:
            raise ValueError(f"sip.codecs must be a non-empty list of 'PCMU' and 'PCMA', not {self.codecs!r}")
        if not 0 < self.rtp_port_min < self.rtp_port_max <= 65535:
            raise ValueError("sip.rtp_port_min must be below sip.rtp_port_max (both 1-65535)")


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    vad: VadConfig = field(default_factory=VadConfig)
    asr: AsrConfig = field(default_factory=AsrConfig)
    lm: LmConfig = field(default_factory=LmConfig)
    tts: TtsConfig = field(default_factory=TtsConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    session: SessionConfig = field(default_factory=SessionConfig)
    sip: SipConfig = field(default_factory=SipConfig)


def _build(cls, values: dict, where: str):
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(known)
    if unknown:
        raise ValueError(f"unknown option(s) in [{where}]: {', '.join(sorted(unknown))}")
    kwargs = {}
    for name, value in values.items():
        f = known[name]
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            kwargs[name] = _build(f.default_factory, value, name)
        else:
            kwargs[name] = value
    return cls(**kwargs)


def load_config(path: str | Path | None = None) -> Config:
    """Defaults, overridden by the TOML file at `path` (if any)."""
    if path is None:
        return Config()
    with open(path, "rb") as f:
        return _build(Config, tomllib.load(f), "top level")
