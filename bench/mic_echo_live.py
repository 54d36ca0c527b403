"""The echo goal of issue 55, live, in one run: `voice mic` (its AEC on) in a room where what it plays comes back
into its microphone, against a running `voice serve`; the user's clips asked one after another until `--replies`
replies were heard, then the user talking over `--barge-ins` replies.

The room is a private PulseAudio (as tests/test_mic.py builds it): `voice mic` plays into the null sink
"room_out", whose monitor comes back 60 ms later through a loopback, `--echo-db` (default -10) under, into
"room", whose monitor is the microphone; the user's clips are played into "room" too (paplay). Reported:
self-interruptions (a `clear` while no clip was playing), replies heard, and for each barge-in the time from the
clip's first sample to the client's "(interrupted" line (the reply's audio detected on room_out's monitor first).

    PYTHONPATH=. .venv/bin/python bench/mic_echo_live.py --url ws://127.0.0.1:8000/ws --replies 20
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SPEECH = Path(__file__).resolve().parents[1] / "tests" / "speech"
PULSE_CONFIG = """\
load-module module-null-sink sink_name=room rate=16000 channels=1
load-module module-null-sink sink_name=room_out rate=16000 channels=1
load-module module-loopback source=room_out.monitor sink=room latency_msec=60
load-module module-native-protocol-unix auth-anonymous=1 socket={socket}
"""
ASOUNDRC = "".join(f"{kind} {{ type pulse }}\n" for kind in ("pcm.!default", "ctl.!default", "pcm.pulse", "ctl.pulse"))


class Lines:
    """A child's output lines, read in a thread, each with when it came."""

    def __init__(self, stream) -> None:
        self.lines: list[tuple[float, str]] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self.cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self.cond.notify_all()

    def wait_for(self, pattern: str, timeout: float, since: int = 0) -> tuple[int, float, re.Match] | None:
        """The first line from index `since` on matching `pattern`: (its index, when, the match); None on timeout."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for i in range(since, len(self.lines)):
                    if m := re.search(pattern, self.lines[i][1]):
                        return i, self.lines[i][0], m
                if (left := deadline - time.monotonic()) <= 0:
                    return None
                self.cond.wait(left)


class Level:
    """parec on room_out's monitor: when the reply last sounded (20 ms windows over -45 dBFS)."""

    def __init__(self, env: dict) -> None:
        self.proc = subprocess.Popen(["parec", "--device=room_out.monitor", "--format=s16le", "--rate=16000",
                                      "--channels=1", "--latency-msec=20"], env=env, stdout=subprocess.PIPE)
        self.loud_at = 0.0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read(640):
            x = np.frombuffer(chunk[:len(chunk) // 2 * 2], dtype="<i2").astype(np.float32) / 32768
            if len(x) and 10 * np.log10(float((x ** 2).mean()) + 1e-12) > -45:
                self.loud_at = time.monotonic()

    def playing(self) -> bool:
        return time.monotonic() - self.loud_at < 0.3


def start_pulse(root: Path, echo_db: float) -> tuple[subprocess.Popen, dict]:
    home, runtime = root / "home", root / "run"
    home.mkdir()
    runtime.mkdir(mode=0o700)
    (home / ".asoundrc").write_text(ASOUNDRC)
    socket = root / "native.sock"
    (root / "default.pa").write_text(PULSE_CONFIG.format(socket=socket))
    env = {**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime), "PULSE_RUNTIME_PATH": str(runtime),
           "PULSE_SERVER": f"unix:{socket}", "PYTHONUNBUFFERED": "1"}
    daemon = subprocess.Popen(["pulseaudio", "--daemonize=no", "--exit-idle-time=-1", "--system=false", "-n",
                               "--use-pid-file=no", "--disallow-exit", "-F", str(root / "default.pa")],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while subprocess.run(["pactl", "info"], env=env, capture_output=True).returncode != 0:
        if daemon.poll() is not None or time.monotonic() > deadline:
            sys.exit("PulseAudio did not start")
        time.sleep(0.1)
    inputs = subprocess.run(["pactl", "list", "short", "sink-inputs"], env=env, capture_output=True, text=True).stdout
    for line in inputs.splitlines():  # the loopback's: the echo's level
        subprocess.run(["pactl", "set-sink-input-volume", line.split()[0], f"{echo_db}dB"], env=env, check=True)
    return daemon, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--replies", type=int, default=20)
    parser.add_argument("--barge-ins", type=int, default=2)
    parser.add_argument("--echo-db", type=float, default=-10.0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each reply")
    parser.add_argument("--log", help="write `voice mic`'s lines and the clips' times here (seconds from the start)")
    args = parser.parse_args()
    clips = sorted(SPEECH.glob("*.wav"))
    with tempfile.TemporaryDirectory() as tmp:
        daemon, env = start_pulse(Path(tmp), args.echo_db)
        level = Level(env)
        room = {**env, "PULSE_SINK": "room_out", "PULSE_SOURCE": "room.monitor"}
        client = subprocess.Popen([sys.executable, "-m", "voice.cli", "mic", "--url", args.url, "--input", "pulse",
                                   "--output", "pulse"], env=room, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1])
        out = Lines(client.stdout)
        speaking: list[tuple[float, float]] = []  # when the user's clips played (monotonic)

        def say(clip: Path) -> None:
            t0 = time.monotonic()
            subprocess.run(["paplay", "--device=room", str(clip)], env=env, check=True, timeout=60)
            speaking.append((t0, time.monotonic()))

        try:
            assert out.wait_for(r"^connected to ", 60), "voice mic did not connect"
            heard, timeouts = 0, 0
            for n in range(args.replies):
                since = len(out.lines)
                say(clips[n % len(clips)])
                done = out.wait_for(r"^played \d+ bytes of reply audio", args.timeout, since)
                heard += done is not None
                timeouts += done is None
                print(f"reply {n + 1}: {'heard' if done else 'timed out'}", flush=True)
                time.sleep(1.0)
            barge_ms = []
            for n in range(args.barge_ins):
                since = len(out.lines)
                say(clips[n])
                deadline = time.monotonic() + args.timeout
                while not level.playing() and time.monotonic() < deadline:
                    time.sleep(0.02)
                time.sleep(1.0)  # a second into the reply
                t0, since = time.monotonic(), len(out.lines)
                threading.Thread(target=say, args=(clips[-1 - n],), daemon=True).start()
                cut = out.wait_for(r"^\(interrupted", 10, since)
                barge_ms.append(None if cut is None else round((cut[1] - t0) * 1000))
                print(f"barge-in {n + 1}: {barge_ms[-1]} ms", flush=True)
                out.wait_for(r"^played \d+ bytes of reply audio", args.timeout, since)
                time.sleep(1.0)
            time.sleep(4)  # the last clip's paplay
        finally:
            client.terminate()
            client.wait(timeout=20)
            level.proc.terminate()
            daemon.terminate()
            daemon.wait(timeout=10)
        if args.log:
            begin = out.lines[0][0] if out.lines else 0.0
            Path(args.log).write_text("".join(f"{at - begin:8.2f} {line}\n" for at, line in out.lines)
                                      + "".join(f"{a - begin:8.2f} [clip {b - a:.1f} s]\n" for a, b in speaking))
        clears = [at for at, line in out.lines if line.startswith("(interrupted")]
        speaking_at = [(a, b + 1.0) for a, b in speaking]  # (the last syllable's recognition may come a second late)
        selfish = [at for at in clears if not any(a <= at <= b for a, b in speaking_at)]
        print(f"replies heard {heard}/{args.replies} (timed out {timeouts}); clears {len(clears)}, "
              f"self-interruptions (no clip playing) {len(selfish)}; barge-ins: clear after {barge_ms} ms")


if __name__ == "__main__":
    main()
