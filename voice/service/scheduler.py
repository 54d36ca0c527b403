"""Who goes first on the shared CPU: the work a silent user is waiting for.

From the moment a user stops talking until the first phrase of their reply is synthesised,
they hear nothing, and that gap is the latency we sell. Later work for a reply that is
already playing has the audio queued before it as slack, until that runs low; partial
transcripts are best effort.

One `Scheduler` per service (`voice.service.instance.Instance` owns it and hands it to every stage):
sessions tell it when they start and stop waiting in silence, and each stage runs its jobs on
one `Worker` thread of it, urgent jobs first, the earliest playback deadline first among them
(`Due`: the phrase whose audio runs out first). A job nobody waits for is held back while anyone
waits, each for at most `max_defer_s`, so it is delayed, never starved. Workers sleep on a
condition: a new job, the last waiting session's first audio, or a held job's deadline wakes
them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

# How long a background job may be held back. A reply's first phrase is at least two words,
# about half a second of audio, so holding its later phrases this long costs no gap.
MAX_DEFER_S = 0.3
# A playing reply's work is urgent again once less audio than this is left to play: the LM
# needs several forwards for the next phrase's text, synthesis one call for its audio.
LM_HORIZON_S = 2.0
TTS_HORIZON_S = 1.0


def always() -> bool:
    return True


@dataclass(frozen=True)
class Due:
    """A job's urgency by its listener's playback deadline: urgent once the audio queued for them
    runs out within `horizon_s` of now. `runs_out()` is that moment (monotonic; -inf: they hear
    silence already, waiting for the first phrase; inf: not urgent). Among urgent jobs a worker
    runs the one whose audio runs out first, so the phrase about to run dry is synthesised before
    one with audio still queued ahead of it."""

    runs_out: Callable[[], float]
    horizon_s: float

    def __call__(self) -> bool:
        return self.runs_out() - time.monotonic() < self.horizon_s


def deadline(urgent: Callable[[], bool]) -> float:
    """When an urgent job's listener runs out of audio (-inf: someone waits for it now, as for a
    final transcript)."""
    return urgent.runs_out() if isinstance(urgent, Due) else -math.inf


@dataclass
class _Job:
    since: float  # monotonic time it was submitted
    urgent: Callable[[], bool]  # asked each time the worker picks its next job
    future: Future
    fn: Callable
    args: tuple = field(default=())
    waited: bool = False  # picked as urgent: someone waits for it while it runs


class Scheduler:
    def __init__(self, max_defer_s: float = MAX_DEFER_S) -> None:
        self.max_defer_s = max_defer_s
        self._lock = threading.Lock()
        self._waiting: set[object] = set()
        self._workers: list[Worker] = []
        # told (on the stage's thread) when a stage starts a job someone waits for: the LM stops a
        # long prompt's chunk under way rather than share the cores with it (Engine.interrupt_long_prompts)
        self.on_waited_job: list[Callable[[], None]] = []
        self.load_high: Callable[[], bool] = lambda: False  # see strained()

    def start_waiting(self, who: object) -> None:
        """`who` (a session) waits in silence for its reply's first audio."""
        with self._lock:
            self._waiting.add(who)

    def stop_waiting(self, who: object) -> None:
        with self._lock:
            was_waiting = bool(self._waiting)
            self._waiting.discard(who)
            released = was_waiting and not self._waiting
        if released:  # held-back jobs may go now
            for worker in self._workers:
                worker.wake()

    def strained(self) -> bool:
        """Is the instance near its capacity? Then best-effort work (partial transcripts) backs off
        before anything a listener hears does. Set by the service's capacity (voice.service.instance)."""
        return self.load_high()

    def busy(self) -> bool:
        """Is anyone waiting in silence?"""
        return bool(self._waiting)

    def stages_busy(self) -> bool:
        """Has any stage's worker (speech recognition, synthesis) a job running or queued?"""
        return any(worker.busy for worker in self._workers)

    def stage_waited(self) -> bool:
        """Is a stage running a job someone waits for now (a final transcript, a first phrase)?"""
        return any(worker.waited for worker in self._workers)

    def hold_s(self, since: float) -> float:
        """How much longer a job nobody waits for, ready since `since`, should be held (0: run it)."""
        if not self.busy():
            return 0.0
        return max(self.max_defer_s - (time.monotonic() - since), 0.0)

    def worker(self, name: str) -> Worker:
        """A new job thread for one stage (started on its first job)."""
        worker = Worker(self, name)
        with self._lock:
            self._workers.append(worker)
        return worker


class Worker:
    """One thread that runs a stage's jobs for every session, so sessions take turns on the
    cores instead of slowing each other down. `urgent()` is asked each time the thread picks a
    job: urgent jobs go first (the earliest deadline, then the oldest), the others by arrival, held
    while anyone waits."""

    def __init__(self, scheduler: Scheduler, name: str) -> None:
        self.scheduler, self.name = scheduler, name
        self._jobs: list[_Job] = []
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = 0
        self._urgent_running = 0  # of those, picked as urgent

    @property
    def busy(self) -> bool:
        """A job is running or queued."""
        return bool(self._running or self._jobs)

    @property
    def waited(self) -> bool:
        """A job someone waits for is running."""
        return bool(self._urgent_running)

    def submit(self, fn: Callable, *args: Any, urgent: Callable[[], bool] = always) -> Future:
        future: Future = Future()
        with self._ready:
            self._jobs.append(_Job(time.monotonic(), urgent, future, fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._ready.notify()
        return future

    def wake(self) -> None:
        with self._ready:
            self._ready.notify()

    def _next(self) -> _Job:
        with self._ready:
            while True:
                self._jobs = [job for job in self._jobs if not job.future.cancelled()]  # dropped by barge-in
                if not self._jobs:
                    self._ready.wait()
                    continue
                urgent = [job for job in self._jobs if job.urgent()]
                # the earliest deadline first (a listener already in silence, then the audio about to run
                # out), the oldest first among equals
                job = min(urgent, key=lambda job: (deadline(job.urgent), job.since)) if urgent else None
                waited = job is not None
                hold = 0.0 if job else self.scheduler.hold_s(self._jobs[0].since)
                if job is None and hold == 0.0:
                    job = self._jobs[0]
                if job is not None:
                    self._jobs.remove(job)
                    job.waited = waited
                    self._running += 1
                    self._urgent_running += waited
                    for tell in self.scheduler.on_waited_job if waited else ():
                        tell()
                    return job
                self._ready.wait(hold)

    def _run(self) -> None:
        while True:
            job = self._next()
            if not job.future.set_running_or_notify_cancel():  # cancelled between pick and start
                self._running -= 1
                self._urgent_running -= job.waited
                continue
            try:
                result, error = job.fn(*job.args), None
            except BaseException as err:  # noqa: BLE001 - handed to whoever awaits the future
                result, error = None, err
            self._running -= 1  # before the result: its awaiter may look at `busy` at once
            self._urgent_running -= job.waited
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)
