"""TOML -> typed dataclasses. Defaults live in the dataclasses; configs/default.toml documents them."""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
FULL_WINDOW_S = 30  # Whisper's encoder window, what it was trained on; it accepts no more


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    web_dir: str = ""  # empty: the repository's web/ folder
    agent_port: int = 0  # HAProxy's agent-check: a TCP port answering the capacity left (service/server.py); 0 = none


@dataclass
class VadConfig:
    aggressiveness: int = 2  # 0 (keeps most audio as speech) .. 3 (strictest)
    frame_ms: int = 20  # webrtcvad accepts 10, 20 or 30 ms frames
    start_ms: int = 60  # consecutive voiced audio that declares speech started
    hangover_ms: int = 400  # consecutive unvoiced audio after speech that declares it stopped
    warmup_ms: int = 120  # audio at stream start that cannot start speech (webrtcvad adapting)
    # A voiced frame is the user's only when it is loud like them: floor_margin_db above the room's floor,
    # or within user_margin_db of their speech level and room_margin_db above the floor (voice/pipeline/vad.py's
    # Levels; BENCHMARKS.md "Heard in a room"); once they speak, a room the detector hears as silence lets
    # its voiced frames hold them (clean speech stays whole). false: every voiced frame is the user's
    follow_user: bool = True
    floor_margin_db: float = 10.0
    user_margin_db: float = 9.0
    room_margin_db: float = 4.0
    echo_margin_db: float = 5.0  # while a reply plays, the user's voice is this far above the loudest of its echo

    def __post_init__(self) -> None:
        if self.aggressiveness not in (0, 1, 2, 3):
            raise ValueError(f"vad aggressiveness must be 0..3, got {self.aggressiveness}")
        if self.frame_ms not in (10, 20, 30):
            raise ValueError(f"vad frame_ms must be 10, 20 or 30, got {self.frame_ms}")
        if self.start_ms <= 0:
            raise ValueError(f"vad start_ms must be positive, got {self.start_ms}")
        if self.hangover_ms <= 0:
            raise ValueError(f"vad hangover_ms must be positive, got {self.hangover_ms}")
        if self.warmup_ms < 0:
            raise ValueError(f"vad warmup_ms must not be negative, got {self.warmup_ms}")


TURN_POLICIES = ("fixed", "smart_turn", "lm", "combined", "shape")


@dataclass
class TurnConfig:
    """When the user's turn is over (voice/pipeline/endofturn.py): after `min_silence_ms` of silence the policy
    weighs how likely the turn is over and waits for more silence the less likely it is, up to
    `ceiling_ms`, where it is over regardless. `fixed`: the VAD's hangover alone (vad.hangover_ms)."""

    policy: str = "fixed"  # fixed | smart_turn (the audio) | lm (the transcript) | combined (the lower of both)
    # | shape (the transcript reads finished: the hangover, else the ceiling)
    min_silence_ms: int = 200  # silence before the policy is first asked
    ceiling_ms: int = 1000  # silence after which the turn is over whatever the policy thinks
    threshold: float | None = None  # done at min_silence_ms from this probability on; None: the policy's calibrated
    threads: int = 1  # Smart Turn's CPU threads (it shares the cores with ASR, LM and TTS)
    # Speech that resumes this soon after the turn ended, before its reply is heard, continues that
    # turn: the new transcript holds both halves, the reply to the first is dropped (0: never)
    resume_ms: int = 2000
    # Speech over a reply stops it once it holds words (a transcript that is not Whisper's near-silence
    # "you") or this much voiced audio, whichever comes first: a VAD blip (a click, a breath, a browser's
    # microphone settling) leaves the reply playing
    barge_in_ms: int = 600
    # A reply to words that trail off ("Set a timer for.": voice/pipeline/endofturn.py's unfinished) is prepared
    # (LM and TTS) as any, but its first audio waits until the user has been quiet this long: if they go
    # on meanwhile (a pause mid-sentence), it is dropped unheard and their turn resumes (0: never held)
    hold_ms: int = 1000
    # (a list not closed only when Smart Turn does not hear it finished), and a reply to words that only lack an
    # end mark ("7 of clubs": Whisper writes complete clips that way as often as cut ones) this long, at most hold_ms
    hold_unmarked_ms: int = 650
    # Any spoken reply the user may still resume is voiced no sooner than this much silence after their last
    # word (0: as soon as it is ready): a 0.6 s pause mid-sentence is 0.46-0.56 s of silence, and words that read
    # finished ("Eight of spades, four of close.") are no sign it is over, so 550 keeps 10 of 11 such pauses
    # whole (650: 11; `voice eot-eval`); the reply is made meanwhile, so only one ready sooner waits (Zen 4,
    # quiet: 13 of 28 turns waited 10-155 ms, v2v p50 no worse; BENCHMARKS.md "Heard in a room")
    voice_after_ms: int = 550

    def __post_init__(self) -> None:
        if self.policy not in TURN_POLICIES:
            raise ValueError(f"turn.policy must be one of {', '.join(TURN_POLICIES)}, not {self.policy!r}")
        if not 0 < self.min_silence_ms <= self.ceiling_ms:
            raise ValueError(f"turn.min_silence_ms must be positive and at most turn.ceiling_ms, got "
                             f"{self.min_silence_ms} and {self.ceiling_ms}")
        if self.threshold is not None and not 0 < self.threshold <= 1:
            raise ValueError(f"turn.threshold must be within (0, 1], got {self.threshold}")
        if self.threads < 1:
            raise ValueError(f"turn.threads must be at least 1, got {self.threads}")
        if self.resume_ms < 0:
            raise ValueError(f"turn.resume_ms must not be negative, got {self.resume_ms}")
        if self.barge_in_ms < 0:
            raise ValueError(f"turn.barge_in_ms must not be negative, got {self.barge_in_ms}")
        if self.hold_ms < 0:
            raise ValueError(f"turn.hold_ms must not be negative, got {self.hold_ms}")
        if self.hold_unmarked_ms < 0:
            raise ValueError(f"turn.hold_unmarked_ms must not be negative, got {self.hold_unmarked_ms}")
        if self.voice_after_ms < 0:
            raise ValueError(f"turn.voice_after_ms must not be negative, got {self.voice_after_ms}")


@dataclass
class AsrConfig:
    model: str = "tiny.en"  # packaged tiny.en | packaged base (multilingual) | a CTranslate2 folder | a size name
    device: str = "cpu"
    compute_type: str = "int8"
    beam_size: int = 5  # 1 = greedy; 5 hears espeak-ng voices better for +3% decode time (BENCHMARKS, "Asked by voice")
    language: str = "en"  # "" = let Whisper detect it
    partial_interval_ms: int = 500  # new audio needed before the next partial decode (x people talking at once)
    cpu_threads: int = 1  # 0 = CTranslate2's default (slower for tiny.en on 2 cores: BENCHMARKS.md)
    early_final_ms: int = 100  # silence after which the final is decoded speculatively (0: off)
    min_window_s: float = 16.0  # shortest encoder window (the audio + 1 s, at least this); 30 = always full
    initial_prompt: str = ""  # text Whisper reads as what came before every utterance (primes vocabulary)
    # end-of-turn re-decode when the fast final looks unsure (None: never): its average token log-probability
    # is under redecode_log_prob, or its no-speech probability over redecode_no_speech
    redecode_log_prob: float | None = None
    redecode_no_speech: float = 1.0
    redecode_model: str = ""  # the re-decode's model ("": asr.model, its encoding reused)
    redecode_beam_size: int = 5

    def __post_init__(self) -> None:
        if not self.model.strip():
            raise ValueError("asr model must name one: tiny.en, base, a CTranslate2 folder or a size name")
        if self.beam_size < 1:
            raise ValueError(f"asr beam_size must be at least 1, got {self.beam_size}")
        if self.early_final_ms < 0:
            raise ValueError(f"asr early_final_ms must not be negative, got {self.early_final_ms}")
        if self.partial_interval_ms <= 0:
            interval = self.partial_interval_ms
            raise ValueError(f"asr partial_interval_ms must be positive, got {interval}")
        if self.redecode_beam_size < 1:
            raise ValueError(f"asr redecode_beam_size must be at least 1, got {self.redecode_beam_size}")
        if not 1 <= self.min_window_s <= FULL_WINDOW_S:
            window = self.min_window_s
            raise ValueError(f"asr min_window_s must be within 1..{FULL_WINDOW_S}, got {window}")


@dataclass
class LmConfig:
    backend: str = "local"  # local (in-process engine) | openai (any OpenAI-compatible endpoint)
    # local: engine model name/path (qwen2.5-1.5b: the most accurate packaged model within the voice
    # budget on a 2-core AVX2 CPU, BENCHMARKS.md "Choosing the default model"); openai: the model id
    model: str = "qwen2.5-1.5b"
    adapter: str = ""  # local: a LoRA adapter to merge ("default": the shipped one), for the lossy rules only
    url: str = "http://127.0.0.1:8001/v1"  # openai backend base URL
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the endpoint's key
    system_prompt: str = ("You are a friendly voice assistant. Answer in one or two short spoken sentences, "
                          "without lists or markdown.")
    mode: str = "diffusion"  # diffusion (the draft head's blocks, verified) | ar; quantize gguf decodes AR only
    max_new_tokens: int = 48
    rule: str = "verify"  # verify: lossless (replies are the AR replies, fewer forwards) | threshold | topk (lossy)
    block_size: int = 0  # 0: the drafter's / model's
    first_block_size: int = 0  # 0: same as block_size (threshold/topk)
    threshold: float = 0.9
    draft_threshold: float = 0.5  # verify: the drafted prefix sent is at least this likely all right
    history_turns: int = 6  # earlier user/assistant pairs kept in the prompt
    # the prompt's characters (~4 a token; the default model's context is 2,048 tokens): the oldest turns are
    # forgotten to stay within it; the system prompt and the question are kept whole
    max_prompt_chars: int = 6000
    threads: int = 1  # local: CPU threads while speech recognition or synthesis has work (they share the cores)
    idle_threads: int = 0  # local, quantize gguf: CPU threads while they have none (0: every core)
    device: str = "cpu"  # local: cpu | cuda (bf16 weights; fp16 where bf16 is missing) | auto (cuda if present)
    max_batch: int = 8  # local: conversations whose decoding steps share one batched forward (1: none)
    # local: auto = fp16 for a model with its draft head where PyTorch runs AVX-512, else gguf (the 1.5B default:
    # gguf on every CPU class; bf16 on a GPU) | gguf = the packaged GGUF on
    # llama.cpp's kernels (CPU, AR only) | fp16 | int8 | none = PyTorch linear layers (verify; BENCHMARKS.md)
    quantize: str = "auto"
    # local, with [tools]: a reply calls a tool only when the model puts e**this times more probability
    # on starting a call than on speaking (docs/TOOLS.md); None: the gate calibrated for the model
    # (engine.loading.TOOL_CALL_LOG_ODDS: the 0.5B +1.2, the 1.5B -2.6)
    tool_call_log_odds: float | None = None
    retries: int = 2  # openai: failed connections retried this often before the first block, with backoff
    retry_backoff_s: float = 0.5  # openai: first retry after this long, doubling
    probe_interval_s: float = 10.0  # openai: /healthz probes the endpoint this often (0 = only real calls)

    def __post_init__(self) -> None:
        if self.backend not in ("local", "openai"):
            raise ValueError(f"lm.backend must be 'local' or 'openai', not {self.backend!r}")
        if self.mode not in ("diffusion", "ar"):
            raise ValueError(f"lm.mode must be 'diffusion' or 'ar', not {self.mode!r}")
        if self.rule not in ("verify", "threshold", "topk"):
            raise ValueError(f"lm.rule must be 'verify', 'threshold' or 'topk', not {self.rule!r}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"lm.device must be 'cpu', 'cuda' or 'auto', not {self.device!r}")
        if self.quantize not in ("auto", "gguf", "fp16", "int8", "none"):
            raise ValueError(f"lm.quantize must be 'auto', 'gguf', 'fp16', 'int8' or 'none', not {self.quantize!r}")
        if self.threads < 0 or self.idle_threads < 0:
            raise ValueError("lm.threads and lm.idle_threads must not be negative")
        if self.retries < 0 or self.retry_backoff_s < 0 or self.probe_interval_s < 0:
            raise ValueError("lm.retries, lm.retry_backoff_s and lm.probe_interval_s must not be negative")


@dataclass
class TtsConfig:
    voice: str = ""  # "" = the packaged en_US joe voice; else a .onnx path (config beside it)
    length_scale: float = 1.0  # > 1 speaks slower
    min_chars: int = 12  # shorter phrases wait for more text unless flushed
    first_words: int = 2  # the reply's first phrase may end after this many words (0: wait for punctuation)
    max_phrase_chars: int = 250  # a longer phrase (no punctuation) is cut at a word: Piper's time and memory grow

    def __post_init__(self) -> None:
        if self.length_scale <= 0:
            raise ValueError(f"tts length_scale must be positive, got {self.length_scale}")
        if self.min_chars < 0:
            raise ValueError(f"tts min_chars must not be negative, got {self.min_chars}")
        if self.first_words < 0:
            raise ValueError(f"tts first_words must not be negative, got {self.first_words}")
        if self.max_phrase_chars < 20:
            raise ValueError(f"tts max_phrase_chars must be at least 20, got {self.max_phrase_chars}")


@dataclass
class BudgetConfig:
    """Per-stage latency budgets in ms; a turn over any of them is flagged."""

    endpoint: float = 450.0  # end of user speech -> end of speech detected (mostly VAD hangover)
    asr: float = 400.0  # end of speech detected -> final transcript
    lm_first_block: float = 300.0  # final transcript -> first committed block
    tts_first_audio: float = 300.0  # first block -> first synthesised audio
    send: float = 50.0  # first audio -> first audio frame on the wire
    voice_to_voice: float = 1500.0  # end of user speech -> first audio frame on the wire
    tool: float = 500.0  # a turn's tool calls: the first call -> the last result


@dataclass
class SessionConfig:
    max_frame_bytes: int = 64000  # one binary frame (1 s of 32 kHz PCM16); larger frames are rejected
    start_timeout_s: float = 10.0  # time a client has to send `start`
    audio_frame_ms: int = 100  # reply audio is sent in frames of this length
    # From asr.early_final_ms of silence on, prepare the reply (LM + TTS) on the speculative
    # transcript; it is sent once the hangover confirms the turn ended, dropped if the user goes on.
    speculative_reply: bool = True
    max_system_prompt_chars: int = 4000  # a client's `session.system_prompt` (Realtime: instructions, system
    # items included); longer is refused (bad_session)
    max_text_bytes: int = 65536  # one JSON text frame (/ws, /twilio); larger is refused (bad_json)
    # Realtime: conversation items waiting for a response, and their characters together (one question
    # to the LM); more are refused (conversation_full)
    max_items: int = 32
    max_items_chars: int = 4000
    max_tools: int = 64  # Realtime: the client's functions, declared to the LM with every turn...
    max_tools_chars: int = 8000  # ...and their characters of JSON together (too_many_tools beyond either)
    # keys pressed (DTMF, the native `dtmf` event) make one turn: ended by `#`, this pause, or this many keys
    keypad_pause_s: float = 2.0
    keypad_max_digits: int = 16

    def __post_init__(self) -> None:
        if not 0 < self.keypad_pause_s <= 60 or not 1 <= self.keypad_max_digits <= 64:
            raise ValueError("session.keypad_pause_s must be in (0, 60] and session.keypad_max_digits in 1-64")
        if self.max_system_prompt_chars < 0 or self.max_text_bytes < 1024:
            raise ValueError("session.max_system_prompt_chars must not be negative and session.max_text_bytes "
                             "must be at least 1024")
        if min(self.max_items, self.max_items_chars, self.max_tools_chars) < 1 or self.max_tools < 0:
            raise ValueError("session.max_items, max_items_chars and max_tools_chars must be positive, "
                             "max_tools not negative")


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
    # source addresses (IP or CIDR) allowed to call; [] = any, which is only accepted on a loopback host
    allow: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        bad = [c for c in self.codecs if c not in ("PCMU", "PCMA")]
        if bad or not self.codecs:
            raise ValueError(f"sip.codecs must be a non-empty list of 'PCMU' and 'PCMA', not {self.codecs!r}")
        if not 0 < self.rtp_port_min < self.rtp_port_max <= 65535:
            raise ValueError("sip.rtp_port_min must be below sip.rtp_port_max (both 1-65535)")
        for net in self.allow:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError as err:
                raise ValueError(f"sip.allow: {net!r} is not an IP address or network: {err}") from err


@dataclass
class TelephonyConfig:
    """What a phone call (Twilio, SIP) has that other sessions don't (docs/TELEPHONY.md)."""

    # Spoken by TTS as soon as an inbound call is answered; "" = the assistant waits for the caller. A fixed
    # text: the LM does not write it (that would put an LM turn before the first audio); it goes into the
    # history as the assistant's first words (as far as the caller heard them), so the LM knows it greeted.
    greeting: str = ""
    # The call's own tools, offered to the LM on phone calls only (conversation/calltools.py): end_call (the goodbye is
    # spoken to the end, then the call ends), transfer_call (to one of transfer_targets, by name)
    tools: list = field(default_factory=list)
    # added to the system prompt when end_call is offered: without it the default 1.5B answers every goodbye in
    # words (0/24 end_call); with it 7/24, and no false end in 24 questions (BENCHMARKS.md, "ends the call"); "" = none
    call_prompt: str = ("You are answering a phone call. If the caller's message is a goodbye (bye, that's all, "
                        "thanks, have a nice day), your reply must be the end_call function call, not text; the "
                        "goodbye is spoken after it.")
    # the first-token gate of tool calls on a call that offers end_call ([lm] tool_call_log_odds, a call's own): unset =
    # the one measured for the model and the tools offered (conversation/calltools.py CALL_GATES: the 1.5B with only
    # end_call, -3.3 against its -2.6: 17/32 held-out goodbyes end the call instead of 8/32, 0/190 other turns;
    # BENCHMARKS.md "ends the call, held out"), else the LM's own
    tool_call_log_odds: float | None = None
    transfer_targets: dict = field(default_factory=dict)  # name -> "sip:desk@pbx.example.com" or "+14155550100"
    # a transfer the caller's phone accepted (SIP: the REFER's 2xx; its own transaction ends by Timer F, 32 s) but whose
    # new call is not answered by then has failed; the caller stays
    transfer_timeout_s: float = 30.0
    keypad_timeout_s: float = 15.0  # read_keypad: no key sequence by then (after its prompt began) is its result
    twilio_api_base: str = "https://api.twilio.com"  # Twilio's REST API (end and transfer a Twilio call)
    # "AC" + 32 hex: only this account's media streams are taken on /twilio (another `start.accountSid` is refused:
    # the socket closes, 1008), and only its calls are ended or transferred; "" = the stream's own accountSid
    twilio_account_sid: str = ""

    def __post_init__(self) -> None:
        if len(self.greeting) > 500 or len(self.call_prompt) > 500:
            raise ValueError("telephony.greeting and telephony.call_prompt must be at most 500 characters")
        unknown = set(self.tools) - {"end_call", "transfer_call", "read_keypad"}
        if unknown:
            raise ValueError(f"telephony.tools: unknown tool(s) {', '.join(sorted(unknown))}; "
                             "choose from end_call, transfer_call, read_keypad")
        if "transfer_call" in self.tools and not self.transfer_targets:
            raise ValueError("telephony.tools: transfer_call needs telephony.transfer_targets")
        for name, target in self.transfer_targets.items():
            if not TOOL_NAME.match(name) or not isinstance(target, str) or \
                    not re.match(r"^(sips?:[^\s<>\"]+|\+?[0-9]{3,15})$", target):
                raise ValueError(f"telephony.transfer_targets: {name!r} = {target!r}: a name of letters, digits, "
                                 "'_' or '-', and a sip: URI or a phone number")
        if self.twilio_account_sid and not re.match(r"^AC[0-9a-f]{32}$", self.twilio_account_sid):
            raise ValueError("telephony.twilio_account_sid must be \"AC\" and 32 hex digits, as Twilio writes it")
        if not 0 < self.keypad_timeout_s <= 300:
            raise ValueError("telephony.keypad_timeout_s must be in (0, 300]")
        if self.transfer_timeout_s <= 0 or not self.twilio_api_base.startswith(("https://", "http://")):
            raise ValueError("telephony.transfer_timeout_s must be positive and twilio_api_base an http(s) URL")


@dataclass
class RecordsConfig:
    """Call records: every turn (transcript, reply, what was heard, latency, errors) in SQLite, or in
    PostgreSQL when `url` is set (docs/SCALING.md)."""

    path: str = "runs/records.sqlite3"  # "" = off; a relative path is relative to the working directory
    url: str = ""  # postgresql://user@host:port/dbname: PostgreSQL instead of `path` (password: PGPASSWORD/.pgpass)
    queue: int = 1000  # writes waiting for the writer thread; a full queue makes turns wait for it
    timeout_s: float = 5.0  # longest a turn's reply_done waits for its record to commit

    def __post_init__(self) -> None:
        if self.queue < 1 or self.timeout_s <= 0:
            raise ValueError("records.queue must be at least 1 and records.timeout_s positive")
        if self.url and not self.url.startswith(("postgresql://", "postgres://")):
            raise ValueError("records.url must be a postgresql:// URL (or \"\" for the SQLite file of records.path)")

    @property
    def database(self) -> str:
        """Where the records go: the PostgreSQL URL, else the SQLite path; "" = records off."""
        return self.url or self.path


@dataclass
class AuthConfig:
    """Who may connect (docs/SECURITY.md). Secrets come from the environment or files, never from here."""

    api_keys_env: str = "VOICE_API_KEYS"  # env var: comma-separated keys, each `key` or `name:key`
    api_keys_file: str = ""  # file: one `key` or `name:key` per line, # comments; "" = none
    token_secret_env: str = "VOICE_TOKEN_SECRET"  # env var: HMAC secret for browser tokens; unset = random
    token_ttl_s: float = 300.0  # lifetime of a token from POST /token
    origins: list[str] = field(default_factory=list)  # browser Origins allowed on /ws; [] = any
    twilio_auth_token_env: str = "TWILIO_AUTH_TOKEN"  # env var: set = /twilio requires X-Twilio-Signature
    twilio_url: str = ""  # the wss:// URL Twilio connects to, for signatures; "" = rebuilt from the request
    allow_unauthenticated: bool = False  # true: a non-loopback host may run without keys (auth done elsewhere)

    def __post_init__(self) -> None:
        if self.token_ttl_s <= 0:
            raise ValueError("auth.token_ttl_s must be positive")


@dataclass
class WyomingConfig:
    """The Wyoming server for Home Assistant (docs/HOME_ASSISTANT.md); off unless `port` is set."""

    port: int = 0  # TCP port (Wyoming's usual: 10300 speech-to-text, 10200 text-to-speech); 0 = off
    host: str = "127.0.0.1"  # interface; Home Assistant on another machine needs "0.0.0.0"
    zeroconf: str = ""  # announce the server over mDNS under this name (needs the zeroconf package); "" = off
    conversations: int = 8  # assistant conversations whose history (and LM cache) are kept; the oldest go
    # client addresses (IP or CIDR) allowed to connect; [] = any, which is only accepted on a loopback host
    allow: list[str] = field(default_factory=list)
    idle_timeout_s: float = 60.0  # a connection that sends no whole event, or reads nothing, this long is closed
    max_event_bytes: int = 65536  # one event's JSON header line, and its data block (event_too_large beyond)
    max_payload_bytes: int = 1048576  # one event's payload: an audio chunk is a few kB (event_too_large beyond)
    max_text_chars: int = 5000  # text to speak (one synthesize or a whole stream) or to answer (text_too_long)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"wyoming.port must be 0-65535, got {self.port}")
        if self.idle_timeout_s <= 0 or self.max_event_bytes < 1024 or self.max_payload_bytes < 1024 \
                or self.max_text_chars < 1:
            raise ValueError("wyoming.idle_timeout_s and max_text_chars must be positive, max_event_bytes and "
                             "max_payload_bytes at least 1024")
        if self.conversations < 1:
            raise ValueError(f"wyoming.conversations must be at least 1, got {self.conversations}")
        for net in self.allow:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError as err:
                raise ValueError(f"wyoming.allow: {net!r} is not an IP address or network: {err}") from err


BUILTIN_TOOLS = ("time", "timer", "calculator")


def _url_parts(url: str, what: str) -> tuple[str, str, int, list[str]]:
    """(scheme, host, port, path segments) of an http(s) URL, normalised (lower-case scheme and host,
    the default port made explicit, segments percent-decoded); ValueError for anything a client
    could read differently from us: whitespace or control characters, a backslash, `user@`, a port
    that is not a number, `.`/`..` or empty segments, an encoded `/`."""
    from urllib.parse import unquote, urlsplit
    if not url.isascii() or re.search(r"[\x00-\x20\x7f\\]", url):
        raise ValueError(f"{what}: {url!r} has spaces, control characters, a backslash or non-ASCII characters")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"{what}: {url!r} must be http:// or https://")
    if "@" in parts.netloc:
        raise ValueError(f"{what}: {url!r} has a user part (user@host)")
    if "#" in url:
        raise ValueError(f"{what}: {url!r} has a fragment (#...), which no request sends")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"{what}: {url!r} has a port that is not a number from 0 to 65535") from None
    host = (parts.hostname or "").lower().rstrip(".")
    if not host or not re.fullmatch(r"[a-z0-9.:_\[\]-]+", parts.netloc.lower()):
        raise ValueError(f"{what}: {url!r} has no usable host")
    segments = parts.path.split("/")[1:] if parts.path else []
    if segments and segments[-1] == "":
        segments.pop()  # `/api/` is `/api`'s inside
    decoded = [unquote(segment) for segment in segments]
    if any(seg in ("", ".", "..") or "/" in seg or "\\" in seg for seg in decoded):
        raise ValueError(f"{what}: {url!r} has an empty, '.' or '..' path segment or an encoded '/'")
    return scheme, host, port, decoded


def url_allowed(url: str, allow: list[str], what: str = "url") -> None:
    """Raise ValueError unless `url` is at or under one of `allow`: the same scheme, host and port,
    and the allowed path's segments a prefix of its segments (`/api` allows `/api/x`, never
    `/api-private` or `/api/../admin`). Compared parsed and normalised, never as strings."""
    scheme, host, port, path = _url_parts(url, what)
    for prefix in allow:
        p_scheme, p_host, p_port, p_path = _url_parts(prefix, "tools.webhook_allow")
        if (scheme, host, port) == (p_scheme, p_host, p_port) and path[:len(p_path)] == p_path:
            return
    raise ValueError(f"{what}: {url} is not under any of tools.webhook_allow ({', '.join(allow) or 'empty'})")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class WebhookConfig:
    """A user tool: the model's JSON arguments are POSTed to `url`; the response body is the result."""

    name: str = ""
    description: str = ""
    url: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})  # a JSON schema
    headers_env: dict = field(default_factory=dict)  # header name -> environment variable holding its value
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not TOOL_NAME.match(self.name) or self.name in ("get_time", "set_timer", "calculate"):
            raise ValueError(f"tools.webhooks: name {self.name!r} must be 1-64 letters, digits, '_' or '-' and "
                             "not a built-in tool's")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"tools.webhooks.{self.name}: url must be http:// or https://, got {self.url!r}")
        if not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise ValueError(f"tools.webhooks.{self.name}: parameters must be a JSON schema of type object")
        if self.timeout_s <= 0:
            raise ValueError(f"tools.webhooks.{self.name}: timeout_s must be positive")


@dataclass
class ToolsConfig:
    """Tools the assistant may call in a voice turn (voice/pipeline/tools.py)."""

    builtin: list = field(default_factory=list)  # any of time, timer, calculator; off by default (docs/TOOLS.md)
    time_zone: str = ""  # IANA name for the time tool, e.g. "Europe/Paris"; "" = the host's
    filler: str = "One moment."  # spoken when a tool's result takes longer than filler_ms ("" = never)
    filler_ms: int = 300
    webhook_allow: list = field(default_factory=list)  # URLs webhooks may call at or under (parsed: url_allowed)
    webhooks: list = field(default_factory=list)  # [[tools.webhooks]] tables (WebhookConfig)
    max_result_chars: int = 1000  # of a result given to the model; a webhook's body is read only that far

    def __post_init__(self) -> None:
        unknown = set(self.builtin) - set(BUILTIN_TOOLS)
        if unknown:
            raise ValueError(f"tools.builtin: unknown tool(s) {', '.join(sorted(unknown))}; "
                             f"choose from {', '.join(BUILTIN_TOOLS)}")
        if self.time_zone:
            import zoneinfo
            try:
                zoneinfo.ZoneInfo(self.time_zone)
            except (zoneinfo.ZoneInfoNotFoundError, ValueError) as err:
                raise ValueError(f"tools.time_zone: {self.time_zone!r} is not a known time zone") from err
        if self.filler_ms < 0:
            raise ValueError(f"tools.filler_ms must not be negative, got {self.filler_ms}")
        if self.max_result_chars < 100:
            raise ValueError(f"tools.max_result_chars must be at least 100, got {self.max_result_chars}")
        self.webhooks = [w if isinstance(w, WebhookConfig) else _build(WebhookConfig, w, "tools.webhooks")
                         for w in self.webhooks]
        names = [w.name for w in self.webhooks]
        if len(set(names)) != len(names):
            raise ValueError("tools.webhooks: two webhooks have the same name")
        for prefix in self.webhook_allow:
            _url_parts(prefix, "tools.webhook_allow")
        for hook in self.webhooks:  # parsed and normalised URLs, never string prefixes
            url_allowed(hook.url, self.webhook_allow, f"tools.webhooks.{hook.name}")


@dataclass
class LimitsConfig:
    """Maxima with clear errors (PROTOCOL.md); 0 = no limit where it says so."""

    max_sessions: int = 32  # concurrent sessions over all transports, whatever the capacity; more are refused
    # Capacity (voice/service/capacity.py): a session is admitted while the open ones, at their measured cost, and the
    # measured load leave room for one more within max_load of the cores; 0 = admit by max_sessions only.
    max_load: float = 0.9  # the share of the cores' time the sessions may take
    session_cores: float = 0.8  # what one session costs (cores) until one is measured: 2 cores hold 2 at a cold start
    retry_after_s: int = 5  # the retry hint a session refused for capacity gets (Retry-After)
    max_sessions_per_key: int = 8  # concurrent sessions per API key (auth on only); 0 = no limit
    max_session_s: float = 3600.0  # a session is closed after this long (session_too_long); 0 = never
    idle_timeout_s: float = 60.0  # no audio at all for this long closes the session (idle_timeout); 0 = never
    max_utterance_s: float = 30.0  # speech longer than this is cut: end of speech is forced (utterance_too_long)
    max_reply_chars: int = 2000  # a reply is cut here even if the LM goes on (a remote LM ignoring max_tokens)
    outbox_audio_s: float = 30.0  # reply audio queued for a client that reads too slowly; more is dropped
    outbox_max_events: int = 2000  # queued messages for such a client; past this it is closed (slow_client)
    shutdown_grace_s: float = 10.0  # on shutdown, turns in flight get this long to finish

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.outbox_max_events < 10:
            raise ValueError("limits.max_sessions must be at least 1 and limits.outbox_max_events at least 10")
        if not 0 <= self.max_load <= 1 or self.session_cores <= 0 or self.retry_after_s < 1:
            raise ValueError("limits.max_load must be within 0-1, limits.session_cores positive and "
                             "limits.retry_after_s at least 1")


@dataclass
class FaultsConfig:
    """A stage that fails or takes longer than its timeout ends the turn with a spoken apology."""

    asr_timeout_s: float = 20.0  # end of speech -> final transcript
    lm_first_block_timeout_s: float = 20.0  # final transcript -> first committed LM block
    lm_block_timeout_s: float = 20.0  # between two LM blocks
    tts_timeout_s: float = 20.0  # one phrase's synthesis
    apology: str = "Sorry, something went wrong on my side. Could you say that again?"

    def __post_init__(self) -> None:
        if min(self.asr_timeout_s, self.lm_first_block_timeout_s, self.lm_block_timeout_s, self.tts_timeout_s) <= 0:
            raise ValueError("faults timeouts must be positive")


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    vad: VadConfig = field(default_factory=VadConfig)
    turn: TurnConfig = field(default_factory=TurnConfig)
    asr: AsrConfig = field(default_factory=AsrConfig)
    lm: LmConfig = field(default_factory=LmConfig)
    tts: TtsConfig = field(default_factory=TtsConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    session: SessionConfig = field(default_factory=SessionConfig)
    sip: SipConfig = field(default_factory=SipConfig)
    telephony: TelephonyConfig = field(default_factory=TelephonyConfig)
    wyoming: WyomingConfig = field(default_factory=WyomingConfig)
    records: RecordsConfig = field(default_factory=RecordsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)


def _build(cls: Any, values: dict, where: str) -> Any:  # cls: a config dataclass; values: its TOML table
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(known)
    if unknown:
        raise ValueError(f"unknown option(s) in [{where}]: {', '.join(sorted(unknown))}")
    kwargs: dict[str, Any] = {}
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
