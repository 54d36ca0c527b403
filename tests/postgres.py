"""A throwaway PostgreSQL for tests and benchmarks: Debian's `postgresql` package (initdb, then the
`postgres` server as our own child process) in a fresh temporary directory, on a free loopback
port, trust authentication, removed when stopped.

initdb refuses to run as root, so as root (CI) both run as the `postgres` user the Debian package
creates (else `nobody`), in a directory under /tmp that user owns. Tests get it through
conftest's fixtures: `postgres_server` (one per test session) and `postgres_url` (a new, empty
database in it per test); `PostgresServer` can also be used on its own (`with PostgresServer() as
pg: pg.url()`), e.g. by a benchmark or a test that stops and restarts its server.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

SUPERUSER = "voice"


def binaries() -> Path | None:
    """The folder of initdb and postgres: on PATH, else the newest of Debian's /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("postgres"):
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """`durable=False` (tests): fsync off, which only matters if the machine itself crashes; commits
    are still commits. `durable=True` (benchmarks): the server's defaults, every commit flushed."""

    def __init__(self, durable: bool = False):
        bindir = binaries()
        if bindir is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        self.bindir, self.durable = bindir, durable
        self.user = None
        if os.geteuid() == 0:
            names = {p.pw_name for p in pwd.getpwall()}
            self.user = pwd.getpwnam("postgres" if "postgres" in names else "nobody")
        self.dir = Path(tempfile.mkdtemp(prefix="voice-pg-"))  # /tmp itself: pytest's folders are root-only
        self.data = self.dir / "data"
        self.log_path = self.dir / "server.log"
        if self.user is not None:
            os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None
        self._run([str(self.bindir / "initdb"), "-D", str(self.data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8",
                   "--locale=C", "--no-sync", "--no-instructions"])

    def _as_user(self) -> dict:
        if self.user is None:
            return {}
        return {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}

    def _run(self, cmd: list[str]) -> None:
        out = subprocess.run(cmd, cwd=self.dir, capture_output=True, text=True, timeout=120, **self._as_user())
        if out.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed ({out.returncode}): {out.stderr[-2000:]}")

    def start(self, timeout_s: float = 30.0) -> PostgresServer:
        """Start the server (again, after `stop`, on the same data and port) and wait until it answers."""
        import psycopg
        settings = ["listen_addresses=127.0.0.1", f"unix_socket_directories={self.dir}", "max_connections=200"]
        if not self.durable:
            settings += ["fsync=off", "full_page_writes=off"]
        cmd = [str(self.bindir / "postgres"), "-D", str(self.data), "-p", str(self.port)]
        for setting in settings:
            cmd += ["-c", setting]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.dir, stdout=log, stderr=subprocess.STDOUT, **self._as_user())
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited ({self.proc.returncode}): {self.log()[-2000:]}")
            try:
                psycopg.connect(self.url(), connect_timeout=2).close()
                return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not come up in {timeout_s} s: {self.log()[-2000:]}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Fast shutdown (clients are disconnected, the data stays for a `start`)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str = "") -> str:
        """A new, empty database; returns its URL."""
        import psycopg
        from psycopg import sql
        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
