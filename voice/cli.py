"""`voice serve | bench | mic | records | soak | eot-eval | room-eval | spoken-eval`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from voice.config import load_config


def cmd_serve(a: argparse.Namespace) -> int:
    from voice.service.server import serve
    config = load_config(a.config)
    if a.host:
        config.server.host = a.host
    if a.port:
        config.server.port = a.port
    if a.lm_mode:
        config.lm.mode = a.lm_mode
    if a.sip_port:
        config.sip.port = a.sip_port
    if a.wyoming_port:
        config.wyoming.port = a.wyoming_port
    if a.records is not None:  # a postgresql:// URL, else the SQLite path ("" = off)
        postgres = a.records.startswith(("postgresql://", "postgres://"))
        config.records.url, config.records.path = (a.records, "") if postgres else ("", a.records)
    from voice.service.auth import ConfigError
    try:
        serve(config)
    except ConfigError as err:
        print(f"voice serve: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: uvicorn shut down gracefully, then raised it again
        return 130
    return 0


def cmd_records(a: argparse.Namespace) -> int:
    import json

    from voice.service import records
    if a.url and not a.url.startswith(("postgresql://", "postgres://")):
        print(f"voice records: --url must be a postgresql:// URL, not {a.url!r}", file=sys.stderr)
        return 2
    database = a.url or a.db or load_config(a.config).records.database
    if not database:
        print("voice records: call records are off (records.path and records.url are empty); pass --db or --url",
              file=sys.stderr)
        return 2
    try:
        sessions = records.read_sessions(database, a.session, a.limit)
    except records.RecordsError as err:
        print(f"voice records: {err}", file=sys.stderr)
        return 1
    if a.format == "csv":
        sys.stdout.write(records.to_csv(sessions))
    else:
        json.dump(sessions, sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
    return 0


def cmd_soak(a: argparse.Namespace) -> int:
    from voice.clients.soak import soak
    report = soak(a.url, Path(a.audio), a.sessions, a.minutes, pid=a.pid, rate=a.rate, json_path=a.json or None,
                  token=a.token, turn_timeout_s=a.turn_timeout)
    return 0 if report["lost_turns"] == 0 and report["errors"] == 0 else 1


def cmd_bench(a: argparse.Namespace) -> int:
    from voice.clients.bench import bench
    sessions = [int(n) for n in a.sessions.split(",")] if a.sessions else None
    bench(a.url, Path(a.audio), Path(a.json) if a.json else None, a.rate, a.lm_mode, a.repeat, sessions,
          a.budget_ms)
    return 0


def cmd_eot_eval(a: argparse.Namespace) -> int:
    import json

    from voice.evals.eot_eval import load_records, run, summarise, table
    config = load_config(a.config)
    if a.records:
        report = summarise(load_records(Path(a.records)), config, a.phone)
    else:
        report = run(config, Path(a.json) if a.json else None, phone=a.phone, synthetic=not a.no_synthetic,
                     use_lm=not a.no_lm)
    print(table(report))
    print(json.dumps({k: v for k, v in report.items() if k != "policies"}))
    return 0


def cmd_room_eval(a: argparse.Namespace) -> int:
    from voice.evals import room_eval
    try:
        rooms = [room_eval.Room.parse(r) for r in (a.rooms.split(",") if a.rooms else room_eval.ROOMS)]
    except ValueError as err:
        print(f"voice room-eval: {err}", file=sys.stderr)
        return 2
    files = sorted(Path(a.audio).glob("*.wav"))[: a.limit or None]
    if not files:
        print(f"voice room-eval: no .wav files in {a.audio}", file=sys.stderr)
        return 2
    if a.offline:
        import dataclasses
        import json
        config = load_config(a.config)
        try:
            vad = room_eval.vad_options(config.vad, a.vad)
        except ValueError as err:
            print(f"voice room-eval: {err}", file=sys.stderr)
            return 2
        results = room_eval.offline(rooms, files, vad, a.alone_s, a.seed, config.turn.barge_in_ms)
        print(room_eval.offline_table(results))
        if a.json:
            Path(a.json).write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
        return 0
    report = room_eval.run(a.url, rooms, files, a.alone_s, Path(a.json) if a.json else None, a.seed, a.timeout)
    print(room_eval.table(report))
    return 0


def cmd_spoken_eval(a: argparse.Namespace) -> int:
    import shlex

    from voice.evals import spoken_eval
    if not spoken_eval.espeak_available():
        print("voice spoken-eval: espeak-ng is not installed (apt-get install espeak-ng)", file=sys.stderr)
        return 2
    config = load_config(a.config)
    voices = tuple(a.voices.split(",")) if a.voices else spoken_eval.VOICES
    configs = tuple(a.configs.split(","))
    if not set(configs) <= {"16k", "g711"}:
        print("voice spoken-eval: --configs takes 16k and/or g711", file=sys.stderr)
        return 2
    variants = None
    if a.asr_only:
        base = spoken_eval.asr_overrides(config.asr, a.asr)
        specs = [shlex.split(v) for v in a.variant] or [["asr"]]
        variants = {spec[0]: spoken_eval.asr_overrides(base, spec[1:]) for spec in specs}
    named = [u.split("=", 1) if "=" in u.split("://")[0] else [f"s{i}", u]
             for i, u in enumerate(a.url or ["ws://127.0.0.1:8000/ws"])]
    url: str | list[spoken_eval.Target] = named[0][1]
    if len(named) > 1 or a.prompt:  # several services and/or prompts: each clip asked of each in turn
        prompts = [p.split("=", 1) for p in a.prompt] or [["", a.system_prompt]]
        url = [spoken_eval.Target("/".join(filter(None, (name if len(named) > 1 else "", pname))) or name,
                                  address, prompt or None)
               for name, address in named for pname, prompt in prompts]
    result = spoken_eval.run(url, Path(a.clips), Path(a.json) if a.json else None, configs, voices,
                             a.every_voice, a.limit, a.system_prompt, a.lm_mode, variants,
                             one_session=a.one_session)
    print(spoken_eval.table(result))
    if a.as_questions and variants:
        for path in spoken_eval.write_transcripts_as_questions(result, Path(a.as_questions)):
            print(f"wrote {path} (engine eval --answers {path})")
    return 0


def cmd_mic(a: argparse.Namespace) -> int:
    from voice.clients import mic
    if a.list_devices:
        print(mic.list_devices())
        return 0
    return mic.mic(a.url, a.input, a.output, aec=not a.no_aec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voice",
                                     description="Real-time voice assistant: speech in, an LM's reply spoken as it "
                                                 "is written.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve",
                       help="run the service: /ws, /twilio, /healthz, /metrics, the web page (and SIP, Wyoming)",
                       description="Start the voice service on the embedded models (or those in --config).")
    p.add_argument("--config", default=None, help="TOML config (default: built-in defaults, see configs/default.toml)")
    p.add_argument("--host", default="", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 8000)")
    p.add_argument("--lm-mode", choices=["diffusion", "ar"], default="", help="override lm.mode")
    p.add_argument("--sip-port", type=int, default=0,
                   help="also answer SIP calls on this UDP port (sip.port; default off, see docs/TELEPHONY.md)")
    p.add_argument("--wyoming-port", type=int, default=0,
                   help="also serve Home Assistant over Wyoming on this TCP port (wyoming.port, e.g. 10300; "
                        "speech-to-text, text-to-speech and the assistant; see docs/HOME_ASSISTANT.md)")
    p.add_argument("--records", default=None, metavar="PATH|URL",
                   help="call records: an SQLite file (records.path; \"\" = off; default runs/records.sqlite3) "
                        "or a postgresql:// URL (records.url)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="stream WAV files to a running service in real time and time each turn",
                       description="Voice-to-voice latency, per-stage latency and WER against DIR/transcripts.tsv.")
    p.add_argument("--url", default="ws://127.0.0.1:8000/ws")
    p.add_argument("--audio", required=True, help="folder of 16-bit mono WAVs (+ transcripts.tsv: file<TAB>text)")
    p.add_argument("--json", default="", help="write summary and per-turn results here")
    p.add_argument("--rate", type=int, default=16000, help="sample rate to stream at")
    p.add_argument("--lm-mode", choices=["diffusion", "ar"], default=None, help="ask the session for this LM mode")
    p.add_argument("--repeat", type=int, default=1, help="play the folder this many times")
    p.add_argument("--sessions", default="", help="comma-separated numbers of simultaneous sessions to sweep, "
                                                  "e.g. 1,2,4 (default: one session)")
    p.add_argument("--budget-ms", type=float, default=1500.0,
                   help="voice-to-voice p95 budget for the --sessions sweep (the CPU profile's)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("eot-eval", help="end-of-turn policies: false cut-offs and wait after the end of speech",
                       description="Builds the end-of-turn set (tests/speech whole and with pauses inserted between "
                                   "words placed by Whisper's and Whisper base's word times: the asr-base extra; Piper "
                                   "sentences), streams it through the VAD, Smart Turn and the LM's signal, "
                                   "calibrates each policy on one split and reports the held-out one "
                                   "(voice/evals/eot_eval.py; BENCHMARKS.md \"End of turn\").")
    p.add_argument("--config", default=None, help="TOML config ([turn], [vad], [asr], [lm], [tts])")
    p.add_argument("--json", default="", help="write the report and every item's signals here")
    p.add_argument("--phone", action="store_true", help="every item through 8 kHz G.711 µ-law first, as Twilio/SIP")
    p.add_argument("--no-synthetic", action="store_true", help="only the real recordings (no Piper)")
    p.add_argument("--no-lm", action="store_true", help="without the LM's signal (no LM loaded)")
    p.add_argument("--records", default="", help="score the policies again on the signals a run wrote with --json "
                                                 "(no models loaded)")
    p.set_defaults(func=cmd_eot_eval)

    p = sub.add_parser("room-eval", help="the user heard in a room: noise, background talk, the reply's echo",
                       description="Streams tests/speech inside rooms (pink noise, background talk of several voices, "
                                   "the reply's own echo) to a running service, and each room alone; reports turns "
                                   "answered, WER, voice-to-voice, turns the room started, replies it cut "
                                   "(voice/evals/room_eval.py; BENCHMARKS.md \"Heard in a room\").")
    p.add_argument("--url", default="ws://127.0.0.1:8000/ws")
    p.add_argument("--audio", default=str(Path(__file__).resolve().parent.parent / "tests" / "speech"),
                   help="folder of 16-bit mono WAVs (+ transcripts.tsv); its other clips make the background talk")
    p.add_argument("--rooms", default="", help="comma-separated: quiet, pink:DB, babble:DB, echo:DB (DB below the "
                                               "speaker; default quiet,pink:20,pink:10,babble:25,babble:20,"
                                               "babble:15,babble:10,echo:10)")
    p.add_argument("--alone-s", type=float, default=60.0, help="seconds of each noisy room alone (0: none)")
    p.add_argument("--limit", type=int, default=0, help="only the first N clips")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for a reply after a clip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the report and every turn here")
    p.add_argument("--offline", action="store_true", help="no service: the same mixes through the endpointer alone "
                                                           "(--config's [vad]): where each clip's speech ends, starts, "
                                                           "the room alone, the echo")
    p.add_argument("--config", default=None, help="TOML config, for --offline's [vad] and [turn]")
    p.add_argument("--vad", action="append", default=[], metavar="KEY=VALUE",
                   help="--offline: a [vad] option over the config, e.g. follow_user=false (the gate off)")
    p.set_defaults(func=cmd_room_eval)

    p = sub.add_parser("spoken-eval", help="everyday questions spoken by other voices: WER, answers right, latency",
                       description="40 questions spoken by espeak-ng voices, at 16 kHz and through 8 kHz G.711, "
                                   "streamed in real time to a running service; reports transcript WER, answers "
                                   "right, voice-to-voice p50/p95 and the asr stage per configuration "
                                   "(voice/evals/spoken_eval.py; BENCHMARKS.md \"Asked by voice\").")
    p.add_argument("--url", action="append", default=[], metavar="[NAME=]URL",
                   help="the service's /ws (default ws://127.0.0.1:8000/ws); repeat to compare services, each clip "
                        "asked of each in turn")
    p.add_argument("--json", default="", help="write the report and every turn here")
    p.add_argument("--clips", default="runs/spoken-eval", help="folder for the synthesized questions (reused)")
    p.add_argument("--configs", default="16k,g711", help="16k and/or g711 (8 kHz G.711 µ-law, as Twilio/SIP)")
    p.add_argument("--voices", default="", help="comma-separated espeak-ng voices (default: "
                                                "en-us,en-gb+f3,en-gb-scotland+m3,en-029+f2)")
    p.add_argument("--every-voice", action="store_true",
                   help="every question by every voice (default: the voices take the questions in turn)")
    p.add_argument("--limit", type=int, default=0, help="only the first N questions")
    p.add_argument("--system-prompt", default=None, help="ask the session for this system prompt "
                                                         "(default: the service's [lm] system_prompt)")
    p.add_argument("--prompt", action="append", default=[], metavar="NAME=TEXT",
                   help="a system prompt for the sessions to ask for, compared clip by clip with the other --prompt "
                        "(repeatable; NAME= with no text: the service's own)")
    p.add_argument("--lm-mode", choices=["diffusion", "ar"], default=None, help="ask the session for this LM mode")
    p.add_argument("--one-session", action="store_true",
                   help="every question of a configuration in one conversation (default: a session per question, "
                        "so a misheard question does not colour the next replies through the history)")
    p.add_argument("--asr-only", action="store_true",
                   help="no service: transcribe the clips with --config's [asr] here and time each final decode")
    p.add_argument("--config", default=None, help="--asr-only: TOML config whose [asr] to load")
    p.add_argument("--asr", action="append", default=[], metavar="KEY=VALUE",
                   help="--asr-only: override an [asr] option (repeatable), e.g. --asr model=base")
    p.add_argument("--variant", action="append", default=[], metavar="'NAME KEY=VALUE ...'",
                   help="--asr-only: one more [asr] variant to compare, clip by clip with the others (repeatable), "
                        "e.g. --variant 'beam5 beam_size=5'")
    p.add_argument("--as-questions", default="", metavar="DIR",
                   help="--asr-only: also write each variant's transcripts as DIR/VARIANT.jsonl, questions for "
                        "`engine eval --answers` (the LM's answers to what was heard)")
    p.set_defaults(func=cmd_spoken_eval)

    p = sub.add_parser("mic", help="talk to a running service from this machine's microphone",
                       description="Full duplex: stream the microphone to the service, play its replies, show a "
                                   "live status line and each turn's latency. Ctrl-C quits.")
    p.add_argument("--url", default="ws://127.0.0.1:8000/ws")
    p.add_argument("--input", default=None, help="input device: index or part of its name (default: the system's)")
    p.add_argument("--output", default=None, help="output device: index or part of its name (default: the system's)")
    p.add_argument("--no-aec", action="store_true",
                   help="no echo cancellation (headphones: nothing the speaker plays reaches the microphone)")
    p.add_argument("--list-devices", action="store_true", help="list audio devices and exit")
    p.set_defaults(func=cmd_mic)

    p = sub.add_parser("records", help="list or export call records (transcripts, replies, latency, errors)",
                       description="Sessions and their turns from the call records database, newest last.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--db", default="", help="SQLite database (default: records.url or records.path of --config, "
                                                "runs/records.sqlite3)")
    where.add_argument("--url", default="", help="PostgreSQL database: postgresql://user@host:port/dbname")
    p.add_argument("--config", default=None, help="TOML config whose records.url or records.path to read")
    p.add_argument("--session", default="", help="only this session (its id, e.g. s7, or its uid)")
    p.add_argument("--format", choices=["json", "csv"], default="json",
                   help="json: sessions with nested turns and errors; csv: one row per turn")
    p.add_argument("--limit", type=int, default=20, help="the N most recent sessions (default 20)")
    p.set_defaults(func=cmd_records)

    p = sub.add_parser("soak", help="hold N sessions replaying speech for M minutes; report leaks and latency",
                       description="N concurrent sessions each replay the WAVs of --audio in real time, turn after "
                                   "turn, for --minutes. Reports the server's RSS and open file descriptors over "
                                   "time (same machine: --pid, or the pid /healthz gives loopback clients), "
                                   "errors, lost turns and p95 voice-to-voice latency per interval.")
    p.add_argument("--url", default="ws://127.0.0.1:8000/ws")
    p.add_argument("--audio", required=True, help="folder of 16-bit mono WAVs")
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions (1-64)")
    p.add_argument("--minutes", type=float, default=5.0, help="how long (at most 24 h)")
    p.add_argument("--pid", type=int, default=0, help="server process to watch (default: from /healthz)")
    p.add_argument("--rate", type=int, default=16000, help="sample rate to stream at")
    p.add_argument("--token", default="", help="append ?token= (from POST /token) to the URL")
    p.add_argument("--turn-timeout", type=float, default=120.0, help="a turn without reply_done after this "
                                                                       "many seconds is lost")
    p.add_argument("--json", default="", help="write the report here")
    p.set_defaults(func=cmd_soak)

    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
