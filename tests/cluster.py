"""The scale-out topology of docs/SCALING.md as child processes, for tests/test_scale_out.py and
bench/scale_out.py: the LM on one `engine serve`, `voice serve` instances, and HAProxy (Debian's
`haproxy`) running configs/haproxy.cfg as shipped. PostgreSQL is tests/postgres.py.

Each piece is a `Child`: a process we started, its log file and a readiness check. `terminate()`
is SIGTERM (a voice instance drains), `kill()` SIGKILL; `close()` ends it whatever state it is in.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HAPROXY_CFG = ROOT / "configs" / "haproxy.cfg"


def free_port() -> int:
    """A TCP port free on loopback right now (for servers that bind it themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    """(status, JSON body) of a GET, whatever the status; (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
    except (OSError, ValueError):
        return 0, {}


class Child:
    """A process we started, logging to `log_path`; `ready()` says when it serves."""

    def __init__(self, name: str, args: list[str], log_path: Path, ready: Callable[[], bool],
                 env: dict[str, str] | None = None):
        self.name, self.args, self.log_path, self.ready = name, args, log_path, ready
        self.env = env
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(self.args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        """Seconds until `ready()`; RuntimeError (with the log's tail) if it exits or takes too long."""
        t0 = time.monotonic()
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log()[-3000:]}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s: {self.log()[-3000:]}")
            time.sleep(0.2)
        return time.monotonic() - t0

    def restart(self) -> None:
        """Start it again, with the same command (after it exited)."""
        assert self.proc.poll() is not None, f"{self.name} is still running"
        self.proc = self._spawn()

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.proc.kill()

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def healthy(url: str) -> Callable[[], bool]:
    """Ready when GET `url` answers 200 with status "ok"."""
    def check() -> bool:
        status, body = http_get(url, timeout=2)
        return status == 200 and body.get("status") == "ok"
    return check


def engine_serve(port: int, log_dir: Path, model: str, threads: int = 1, max_new_tokens: int = 96) -> Child:
    """Our OpenAI-compatible LM server (`engine serve`) on loopback `port`."""
    args = [sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--model", model,
            "--threads", str(threads), "--max-new-tokens", str(max_new_tokens)]
    return Child(f"engine serve :{port}", args, log_dir / f"engine-{port}.log",
                 healthy(f"http://127.0.0.1:{port}/healthz"))


def voice_config(path: Path, sections: dict[str, dict]) -> Path:
    """A `voice serve` TOML with only `sections` differing from the defaults (configs/default.toml)."""
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def voice_serve(port: int, config: Path, log_dir: Path, env: dict[str, str] | None = None) -> Child:
    """`voice serve --config CONFIG --port PORT` on loopback; `env` replaces the environment (keys)."""
    args = [sys.executable, "-m", "voice.cli", "serve", "--config", str(config), "--port", str(port)]
    return Child(f"voice serve :{port}", args, log_dir / f"voice-{port}.log",
                 healthy(f"http://127.0.0.1:{port}/healthz"), env)


def haproxy_binary() -> str | None:
    """Debian installs it in /usr/sbin, which a user's PATH may lack."""
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")


class HAProxy(Child):
    """HAProxy with configs/haproxy.cfg in front of two voice instances on loopback `backends`,
    clients on loopback `port`; `servers()` reads its runtime API."""

    def __init__(self, port: int, backends: tuple[int, int], log_dir: Path, agents: tuple[int, int] | None = None):
        """`agents`: the instances' `[server] agent_port`s (None: ports nobody answers, so unweighed)."""
        binary = haproxy_binary()
        if binary is None:
            raise RuntimeError("HAProxy is not installed (apt-get install haproxy)")
        self.port, self.socket_path = port, str(log_dir / "haproxy.sock")
        env = {**os.environ, "VOICE_LB_BIND": f"127.0.0.1:{port}", "VOICE_LB_SOCKET": self.socket_path,
               "VOICE_1": f"127.0.0.1:{backends[0]}", "VOICE_2": f"127.0.0.1:{backends[1]}"}
        agents = agents or (free_port(), free_port())
        env |= {"VOICE_1_AGENT": str(agents[0]), "VOICE_2_AGENT": str(agents[1])}
        check = subprocess.run([binary, "-c", "-q", "-f", str(HAPROXY_CFG)], env=env, capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"configs/haproxy.cfg does not check: {check.stdout}{check.stderr}")
        super().__init__(f"haproxy :{port}", [binary, "-db", "-f", str(HAPROXY_CFG)], log_dir / "haproxy.log",
                         lambda: all(s["status"] == "UP" for s in self._servers_or_none().values()), env)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def command(self, line: str) -> str:
        """One command on the runtime API (management.txt), its answer."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(self.socket_path)
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def servers(self) -> dict[str, dict[str, str]]:
        """`show stat` of the voice backend's servers, by name: status (UP, DOWN, "UP 1/2"...),
        scur (sessions now), stot, wretr (retries), wredis (redispatches), check_status..."""
        rows = csv.DictReader(io.StringIO(self.command("show stat").lstrip("# ")))
        return {row["svname"]: row for row in rows if row["pxname"] == "voice" and
                row["svname"] not in ("FRONTEND", "BACKEND")}

    def _servers_or_none(self) -> dict[str, dict[str, str]]:
        try:
            return self.servers() or {"-": {"status": "none yet"}}
        except OSError:
            return {"-": {"status": "not listening yet"}}

    def wait_status(self, server: str, status: str, timeout_s: float = 30.0) -> dict[str, str]:
        """Wait until `server`'s status is `status` (UP, DOWN); its `show stat` row."""
        deadline = time.monotonic() + timeout_s
        while (row := self.servers()[server])["status"] != status:
            assert time.monotonic() < deadline, f"{server} still {row['status']} after {timeout_s} s"
            time.sleep(0.1)
        return row
