"""How many sessions this instance carries, measured while it runs rather than configured.

Every stage of every session runs on this process's threads, so what those threads ask of the
cores per wall second is the work it is doing, in cores: the time they ran plus the time they sat
runnable waiting for a core (Linux's per-thread schedstat; `time.process_time` where there is
none). The waiting counts because it is demand the cores did not meet, whether our own threads
crowd each other or another tenant of the machine takes the cores (on this shared 2-core VM, under
three benchmarks, the instance's threads waited 2.2 s for every second they ran). The cores it may
use (`os.sched_getaffinity`) times `limits.max_load` is what it can give without replies falling
behind their audio. What one open session costs is learned from the same samples (the load over
the sessions open), quick to rise and slow to fall, so a lull of silent sessions does not invite a
crowd that then all talks at once. Until a session has been measured, `limits.session_cores`
stands in for it.

Admission (`voice.service.limits.Admission`) asks `admits(open)`: a session is let in while both the
sessions already open, at their measured cost, and the load measured now leave room for one more.
`report()` is what /healthz shows, for a load balancer's agent (voice.service.server) and for operators.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable

from voice.config import LimitsConfig

SAMPLE_S = 1.0  # the load is sampled this often (voice.service.server's loop; /healthz and admission sample too)
LOAD_WINDOW_S = 5.0  # the load is averaged over about this long
STRAINED = 0.75  # past this share of the usable cores, best-effort work (partial transcripts) backs off
RISE, FALL = 0.3, 0.02  # per sample: how fast the cost of a session follows a higher / a lower measurement


class ThreadDemand:
    """Seconds this process's threads have run or waited runnable for a core since it was made,
    summed over its threads (schedstat), counting each thread's growth since it was last seen, so a
    thread that ends takes nothing back; without schedstat, the process's CPU time alone."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.total_ns = 0

    def __call__(self) -> float:
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return time.process_time()
        now: dict[str, int] = {}
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    ran, waited = f.read().split()[:2]
            except (OSError, ValueError):
                continue  # a thread that ended meanwhile
            now[tid] = int(ran) + int(waited)
            self.total_ns += now[tid] - self.seen.get(tid, 0)
        if not now:
            return time.process_time()
        self.seen = now
        return self.total_ns / 1e9


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Capacity:
    def __init__(self, limits: LimitsConfig, cores: int | None = None,
                 cpu: Callable[[], float] | None = None, clock: Callable[[], float] = time.monotonic):
        self.cores = cores or usable_cores()
        self.max_load, self.retry_after_s = limits.max_load, limits.retry_after_s
        self.cpu, self.clock = cpu or ThreadDemand(), clock
        self.load = 0.0  # cores' worth of this process's work (run + waited for), averaged over LOAD_WINDOW_S
        self.session_cores = limits.session_cores  # what one open session costs, in cores (learned)
        self.measured = False  # session_cores is still the configured guess
        self._lock = threading.Lock()
        self._last = (clock(), self.cpu())

    def reset(self) -> None:
        """Measure from now (the models' loading is not the sessions' work)."""
        with self._lock:
            self._last, self.load = (self.clock(), self.cpu()), 0.0

    @property
    def usable(self) -> float:
        """The cores' time the sessions may take: what the cores give, less room for bursts (all of
        it with max_load 0, where admission goes by the counts only and this is for /healthz)."""
        return self.cores * (self.max_load or 1.0)

    def sample(self, sessions: int) -> None:
        """Take the process's CPU time since the last sample (at most one per SAMPLE_S / 2)."""
        with self._lock:
            now, used = self.clock(), self.cpu()
            wall = now - self._last[0]
            if wall < SAMPLE_S / 2:
                return
            busy = max(used - self._last[1], 0.0) / wall
            self._last = (now, used)
            weight = 1.0 - math.exp(-wall / LOAD_WINDOW_S)
            self.load += (busy - self.load) * weight
            if sessions > 0:
                per_session = self.load / sessions
                if not self.measured:
                    self.session_cores, self.measured = max(per_session, self.session_cores), True
                else:
                    rate = RISE if per_session > self.session_cores else FALL
                    self.session_cores += (per_session - self.session_cores) * rate

    def strained(self) -> bool:
        """Is the load near what the cores give? (Best-effort work backs off: voice.service.scheduler.)"""
        return self.load > self.usable * STRAINED

    def sessions_max(self) -> int:
        """How many sessions fit at what each costs (at least one: an instance that admits nobody
        serves nobody)."""
        return max(1, int(self.usable / max(self.session_cores, 1e-3)))

    def admits(self, sessions: int) -> bool:
        """Room for one more beside `sessions` open: by their cost, and by the load measured now
        (a load already past what the cores give says the estimate is low, whatever it is)."""
        self.sample(sessions)
        if sessions == 0 or not self.max_load:
            return True
        return sessions + 1 <= self.sessions_max() and self.load < self.usable

    def headroom(self, sessions: int) -> float:
        """The share of the usable cores left: 1 idle, 0 full (the larger of the measured load and
        the open sessions at their cost counts)."""
        taken = max(self.load, sessions * self.session_cores)
        return max(0.0, 1.0 - taken / self.usable)

    def report(self, sessions: int) -> dict:
        self.sample(sessions)
        return {"headroom": round(self.headroom(sessions), 3), "admitting": self.admits(sessions),
                "sessions_max": self.sessions_max(), "load_cores": round(self.load, 2), "cores": self.cores,
                "max_load": self.max_load, "session_cores": round(self.session_cores, 3),
                "measured": self.measured}
