"""`voice spoken-eval`: everyday questions asked by voice, and whether the whole loop answers them.

Typed accuracy (`engine eval --answers`) is not what a voice user gets: the question first goes
through speech recognition, and the LM answers whatever it heard. Here each question is spoken
by a voice that is not the service's own (espeak-ng voices and variants), streamed in real time
over /ws to a running `voice serve` with `voice bench`'s client (voice/clients/bench.py), once at
16 kHz and once through 8 kHz G.711 µ-law as the phone fronts hear it, and the reply is checked
against the question's accepted answers (a regular expression). Per configuration: transcript
WER, answers right, voice-to-voice p50/p95 and the `asr` stage p50; the JSON has every turn.

`--asr-only` skips the service: it loads Whisper with `--config`'s [asr] (and any `--asr KEY=VALUE`
overrides), once per `--variant` (its own overrides), and transcribes the same clips as the service
would at the end of a turn, the variants in turn clip by clip, timing each decode: speech recognition
options compared on one machine at one time, without a running service.

The questions are our own, written for this evaluation (not the held-out lists of engine/prompts).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import wave
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jiwer
import numpy as np
import websockets

from voice.audio import float_to_int16, float_to_pcm16, read_wav, resample, ulaw_decode, ulaw_encode
from voice.clients.bench import Turn, normalise, pct, run_turn
from voice.events import Ready, from_wire

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

    from voice.config import AsrConfig

# (question, accepted answer: a case-insensitive regular expression searched in the reply)
QUESTIONS: list[tuple[str, str]] = [
    ("How many legs does a spider have?", r"\b(8|eight)\b"),
    ("What is the capital of France?", r"paris"),
    ("What animal says moo?", r"\bcows?\b|cattle"),
    ("What do you call frozen water?", r"\bice\b"),
    ("How many seconds are in a minute?", r"\b(60|sixty)\b"),
    ("Which planet do we live on?", r"earth"),
    ("What is the largest ocean on Earth?", r"pacific"),
    ("Who painted the Mona Lisa?", r"leonardo|da vinci"),
    ("How many weeks are in a year?", r"\b(52|fifty[- ]two)\b"),
    ("What is the opposite of hot?", r"\bcold"),
    ("Which fruit is wine made from?", r"grape"),
    ("What is the capital of Japan?", r"tokyo"),
    ("How many sides does a triangle have?", r"\b(3|three)\b"),
    ("Which star does the Earth go around?", r"\bsun\b"),
    ("What do you call a baby dog?", r"pupp(y|ies)"),
    ("Which bird is a symbol of peace?", r"\bdoves?\b|pigeon"),
    ("Who was the first person to walk on the moon?", r"armstrong"),
    ("What language do people speak in Spain?", r"spanish|castilian"),
    ("How many wheels does a car usually have?", r"\b(4|four)\b"),
    ("What is the tallest animal in the world?", r"giraffe"),
    ("What does a caterpillar turn into?", r"butterfl|moth"),
    ("What is the capital of Egypt?", r"cairo"),
    ("How many continents are there?", r"\b(7|seven)\b"),
    ("What is seven plus six?", r"\b(13|thirteen)\b"),
    ("What colour do you get when you mix blue and yellow?", r"green"),
    ("Which animal is called the king of the jungle?", r"\blions?\b"),
    ("Which instrument does a drummer play?", r"drum"),
    ("Which season comes after winter?", r"spring"),
    ("Which planet is called the red planet?", r"mars"),
    ("In which country is the Taj Mahal?", r"india"),
    ("What is guacamole mainly made of?", r"avocado"),
    ("How many players does a soccer team have on the field?", r"\b(11|eleven)\b"),
    ("Who wrote the Harry Potter books?", r"rowling"),
    ("What is the capital of Australia?", r"canberra"),
    ("What is ten times ten?", r"\b(100|one hundred|a hundred)\b"),
    ("Which organ do we breathe with?", r"lung"),
    ("What do bees collect from flowers?", r"nectar|pollen"),
    ("How many hours are there in two days?", r"\b(48|forty[- ]eight)\b"),
    ("What do you call the meal we eat in the morning?", r"breakfast"),
    ("Which is the closest planet to the sun?", r"mercury"),
]

# espeak-ng voices and variants: accents and pitches unlike the service's own Piper voice
VOICES = ("en-us", "en-gb+f3", "en-gb-scotland+m3", "en-029+f2")
PHONE_RATE = 8000
RATE = 16000
LEAD_S = 0.4  # silence before each question, as a caller's pause before speaking


@dataclass
class Clip:
    index: int
    question: str
    answer: str
    voice: str
    path: Path  # at the rate it is streamed at
    rate: int
    config: str  # "16k" or "g711"


def espeak_available() -> bool:
    return shutil.which("espeak-ng") is not None


def speak(text: str, voice: str, rate: int = RATE) -> np.ndarray:
    """`text` spoken by espeak-ng's `voice`, float32 at `rate`, behind LEAD_S of silence."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "q.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", "155", "-w", str(out), text], check=True,
                       capture_output=True)
        audio, file_rate = read_wav(out)
    audio = resample(audio, file_rate, rate)
    return np.concatenate([np.zeros(int(LEAD_S * rate), dtype=np.float32), audio]).astype(np.float32)


def through_g711(audio: np.ndarray, rate: int = RATE) -> np.ndarray:
    """What a phone front receives of 16 kHz speech: 8 kHz, µ-law coded and decoded (float at 8 kHz)."""
    coded = ulaw_encode(float_to_int16(resample(audio, rate, PHONE_RATE)))
    return ulaw_decode(coded).astype(np.float32) / 32768.0


def write_wav(path: Path, audio: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(float_to_pcm16(audio))


def build_clips(folder: Path, questions: list[tuple[str, str]] = QUESTIONS, voices: tuple[str, ...] = VOICES,
                every_voice: bool = False, configs: tuple[str, ...] = ("16k", "g711")) -> list[Clip]:
    """Each question spoken by one voice in turn (or by every voice), as 16 kHz and G.711 WAVs in `folder`
    (kept there: a clip already synthesized is reused)."""
    folder.mkdir(parents=True, exist_ok=True)
    clips = []
    for i, (question, answer) in enumerate(questions):
        for voice in (voices if every_voice else (voices[i % len(voices)],)):
            key = hashlib.sha1(f"{voice}|{question}".encode()).hexdigest()[:10]
            wide = folder / f"q{i:02d}-{key}-16k.wav"
            phone = folder / f"q{i:02d}-{key}-g711.wav"
            if not wide.exists() or not phone.exists():
                audio = speak(question, voice)
                write_wav(wide, audio, RATE)
                write_wav(phone, through_g711(audio), PHONE_RATE)
            for config in configs:
                path, rate = (wide, RATE) if config == "16k" else (phone, PHONE_RATE)
                clips.append(Clip(i, question, answer, voice, path, rate, config))
    return clips


def answered_right(reply: str, answer: str) -> bool:
    return re.search(answer, reply, re.IGNORECASE) is not None


def turn_wer(reference: str, transcript: str) -> float:
    ref = normalise(reference)
    return jiwer.wer(ref, normalise(transcript) or "<nothing>") if ref else 0.0


def summarise(rows: list[dict]) -> dict:
    """WER over all the configuration's words, answers right, voice-to-voice and the asr stage."""
    v2v = [r["v2v_ms"] for r in rows if r.get("v2v_ms") is not None]
    asr = [r["stages_ms"]["asr"] for r in rows if "asr" in r.get("stages_ms", {})]
    decode = [r["decode_ms"] for r in rows if r.get("decode_ms") is not None]
    refs = [normalise(r["question"]) for r in rows]
    hyps = [normalise(r["transcript"]) or "<nothing>" for r in rows]
    out: dict[str, Any] = {
        "turns": len(rows),
        "wer": jiwer.wer(refs, hyps) if rows else None,
        "heard_exactly": sum(1 for ref, hyp in zip(refs, hyps) if ref == hyp),
        "errors": sum(1 for r in rows if r.get("error")),
    }
    if any("right" in r for r in rows):
        out |= {"right": sum(1 for r in rows if r.get("right")),
                "v2v_ms_p50": pct(v2v, 50), "v2v_ms_p95": pct(v2v, 95), "asr_ms_p50": pct(asr, 50)}
    if decode:
        out |= {"decode_ms_p50": pct(decode, 50), "decode_ms_p95": pct(decode, 95)}
    return out


def report(rows: list[dict], meta: dict) -> dict:
    configs = sorted({r["config"] for r in rows})
    voices = sorted({r["voice"] for r in rows})
    return meta | {
        "summary": summarise(rows),
        "by_config": {c: summarise([r for r in rows if r["config"] == c]) for c in configs},
        "by_voice": {v: summarise([r for r in rows if r["voice"] == v]) for v in voices},
        "per_turn": rows,
    }


def _row(clip: Clip) -> dict:
    return {"index": clip.index, "question": clip.question, "answer": clip.answer, "voice": clip.voice,
            "config": clip.config, "file": clip.path.name}


@dataclass
class Target:
    """A service to ask (its /ws URL) and the system prompt its sessions ask for (None: the service's)."""

    name: str
    url: str
    system_prompt: str | None = None


async def _session(target: Target, rate: int, lm_mode: str | None) -> ClientConnection:
    start: dict[str, Any] = {"type": "start", "version": 1, "sample_rate": rate, "encoding": "pcm_s16le"}
    session: dict[str, Any] = {}
    if target.system_prompt is not None:
        session["system_prompt"] = target.system_prompt
    if lm_mode:
        session["lm_mode"] = lm_mode
    if session:
        start["session"] = session
    ws = await websockets.connect(target.url, max_size=None)
    await ws.send(json.dumps(start))
    ready = from_wire(json.loads(await ws.recv()))
    if not isinstance(ready, Ready):
        raise RuntimeError(f"{target.name}: the server refused the session: {ready}")
    return ws


async def _ask(targets: list[Target], clips: list[Clip], lm_mode: str | None, log: Callable[[str], object],
               turn_timeout_s: float = 30.0, one_session: bool = False) -> dict[str, list[dict]]:
    """Each question in a session of its own (a question misheard earlier would otherwise colour the
    next replies through the conversation's history), or with `one_session` all the clips of a
    configuration (its sample rate) as turns of one conversation; with several targets each clip is
    asked of each in turn, so a busy moment falls on all of them alike."""
    rows: dict[str, list[dict]] = {t.name: [] for t in targets}
    for config in dict.fromkeys(c.config for c in clips):
        group = [c for c in clips if c.config == config]
        batches = [group] if one_session else [[clip] for clip in group]
        for batch in batches:
            sockets = [await _session(target, batch[0].rate, lm_mode) for target in targets]
            try:
                for clip in batch:
                    for target, ws in zip(targets, sockets):
                        turn: Turn = await run_turn(ws, clip.path, clip.question, clip.rate, turn_timeout_s)
                        row = _row(clip) | {
                            "transcript": turn.transcript, "reply": turn.reply, "v2v_ms": turn.v2v_ms,
                            "stages_ms": turn.stages_ms, "error": turn.error,
                            "right": answered_right(turn.reply, clip.answer),
                            "wer": turn_wer(clip.question, turn.transcript)}
                        log(f"{target.name + ' ' if len(targets) > 1 else ''}{config:4s} {clip.voice:18s} "
                            f"{'RIGHT' if row['right'] else 'wrong'} v2v {turn.v2v_ms or float('nan'):5.0f} ms  "
                            f"heard {turn.transcript!r}  reply {turn.reply[:70]!r}")
                        rows[target.name].append(row)
            finally:
                for ws in sockets:
                    await ws.close()
    return rows


def asr_overrides(asr: AsrConfig, pairs: list[str]) -> AsrConfig:
    """`asr` (an AsrConfig) with KEY=VALUE overrides, each VALUE read as the field's type."""
    changes: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        fields = {f.name: f for f in dataclasses.fields(asr)}
        if key not in fields:
            raise SystemExit(f"--asr: no [asr] option {key!r}")
        kind = str(fields[key].type)
        if value.lower() in ("none", "") and "None" in kind:
            changes[key] = None
        else:
            changes[key] = next((cast(value) for name, cast in (("int", int), ("float", float)) if name in kind),
                                value)
    return dataclasses.replace(asr, **changes)


def transcribe_only(clips: list[Clip], variants: dict[str, AsrConfig], log: Callable[[str], object]
                    ) -> dict[str, tuple[list[dict], int]]:
    """The end-of-turn transcript of every clip as the service decodes it, by each [asr] variant in turn
    (clip by clip, so a busy moment of a shared machine falls on all of them alike), how long each decode
    took, and how many finals each decoded again (asr.redecode_log_prob)."""
    from voice.pipeline.asr import StreamingTranscriber, Whisper
    models = {name: Whisper(asr) for name, asr in variants.items()}
    rows: dict[str, list[dict]] = {name: [] for name in variants}

    async def final(whisper: Whisper, asr: AsrConfig, audio: np.ndarray) -> str:
        transcriber = StreamingTranscriber(whisper, asr)
        transcriber.insert_audio_chunk(audio)
        return await transcriber.finish()

    for clip in clips:
        audio, rate = read_wav(clip.path)
        audio = resample(audio, rate, RATE)
        for name, whisper in models.items():
            started = time.perf_counter()
            text = asyncio.run(final(whisper, variants[name], audio)).strip()
            decode_ms = (time.perf_counter() - started) * 1000
            rows[name].append(_row(clip) | {"transcript": text, "decode_ms": decode_ms,
                                            "wer": turn_wer(clip.question, text)})
            log(f"{name:12s} {clip.config:4s} {clip.voice:18s} {decode_ms:5.0f} ms  heard {text!r}")
    return {name: (rows[name], models[name].redecodes) for name in variants}


def write_transcripts_as_questions(result: dict, folder: Path) -> list[Path]:
    """Each --asr-only variant's transcripts as `engine eval --answers` questions ({"prompt", "answer"} lines,
    FOLDER/VARIANT.jsonl): the LM's answers to what was heard, without the service's timing."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, part in result["variants"].items():
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": row["transcript"] or "...", "answer": row["answer"],
                                            "question": row["question"], "config": row["config"]}) + "\n"
                                for row in part["per_turn"]))
        paths.append(path)
    return paths


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(url: str | list[Target], folder: Path, json_out: Path | None = None,
        configs: tuple[str, ...] = ("16k", "g711"), voices: tuple[str, ...] = VOICES, every_voice: bool = False,
        limit: int = 0, system_prompt: str | None = None, lm_mode: str | None = None,
        asr_variants: dict[str, AsrConfig] | None = None, log: Callable[[str], object] = print,
        turn_timeout_s: float = 30.0,
        one_session: bool = False) -> dict:
    """Ask the running service at `url` (or several targets, clip by clip in turn); with `asr_variants`
    ({name: AsrConfig}), transcribe here instead. A reply not done `turn_timeout_s` after its question is
    an error."""
    questions = QUESTIONS[:limit] if limit else QUESTIONS
    clips = build_clips(folder, questions, voices, every_voice, configs)
    meta: dict[str, Any] = {"load_average_before": load_average(), "voices": list(voices),
                            "every_voice": every_voice, "questions": len(questions), "one_session": one_session}
    if asr_variants:
        decoded = transcribe_only(clips, asr_variants, log)
        meta["load_average_after"] = load_average()
        result = meta | {"variants": {
            name: report(rows, {"asr": dataclasses.asdict(asr_variants[name]), "redecodes": redecodes})
            for name, (rows, redecodes) in decoded.items()}}
    elif isinstance(url, str):
        meta |= {"url": url, "system_prompt": system_prompt, "lm_mode": lm_mode}
        service = Target("service", url, system_prompt)
        rows = asyncio.run(_ask([service], clips, lm_mode, log, turn_timeout_s, one_session))["service"]
        meta["load_average_after"] = load_average()
        result = report(rows, meta)
    else:
        meta["lm_mode"] = lm_mode
        asked = asyncio.run(_ask(url, clips, lm_mode, log, turn_timeout_s, one_session))
        meta["load_average_after"] = load_average()
        result = meta | {"variants": {t.name: report(asked[t.name], {"url": t.url, "system_prompt": t.system_prompt})
                                      for t in url}}
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=1))
    return result


def table(result: dict) -> str:
    f = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    lines = []
    for variant, part in (result["variants"].items() if "variants" in result else [("", result)]):
        for name, s in list(part["by_config"].items()) + [("all", part["summary"])]:
            line = f"{variant + ' ' if variant else ''}{name:5s} turns {s['turns']:3d}  WER {s['wer']:.3f}  " \
                   f"heard exactly {s['heard_exactly']}"
            if "right" in s:
                line += (f"  right {s['right']}/{s['turns']} ({100 * s['right'] / max(s['turns'], 1):.0f}%)"
                         f"  v2v p50 {f(s['v2v_ms_p50'])} p95 {f(s['v2v_ms_p95'])} ms"
                         f"  asr p50 {f(s['asr_ms_p50'])} ms")
            if "decode_ms_p50" in s:
                line += f"  decode p50 {f(s['decode_ms_p50'])} p95 {f(s['decode_ms_p95'])} ms"
            lines.append(line)
        if "redecodes" in part:
            lines.append(f"{variant} finals decoded again: {part['redecodes']}")
    lines.append(f"load average before {result['load_average_before']} after {result['load_average_after']}")
    return "\n".join(lines)
