"""Latency budget tracker: watches a session's events, times every stage of every turn.

It is told about events and never asked anything by the stages. At the end of a turn it
emits a `LatencyReport` (sent to the client like any other event), logs turns that broke a
budget, and feeds the per-stage histograms served at /metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from voice.config import BudgetConfig
from voice.events import (AudioSent, Event, LatencyReport, ReplyDone, ReplyText, SpeechStopped, ToolCall, ToolResult,
                          Transcript, TtsAudio, Work)

log = logging.getLogger("voice.latency")

# stage name -> (from mark, to mark)
STAGES = {
    "endpoint": ("speech_end", "eos_detected"),
    "asr": ("eos_detected", "final_transcript"),
    "lm_first_block": ("final_transcript", "lm_first_block"),
    "tts_first_audio": ("lm_first_block", "tts_first_audio"),
    "send": ("tts_first_audio", "first_audio_sent"),
    "tool": ("tool_call", "tool_result"),
    "voice_to_voice": ("speech_end", "first_audio_sent"),
}


class Metrics:
    """Prometheus series for the whole server (one registry per app, so tests can run several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        buckets = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
        self.stage_seconds = Histogram("voice_stage_seconds", "Time spent per pipeline stage per turn",
                                       ["stage"], buckets=buckets, registry=self.registry)
        self.turns = Counter("voice_turns", "Turns completed", registry=self.registry)
        self.over_budget = Counter("voice_budget_violations", "Turns over a stage budget", ["stage"],
                                   registry=self.registry)
        self.sessions = Gauge("voice_sessions_active", "Open sessions", ["transport"], registry=self.registry)
        self.errors = Counter("voice_errors", "Errors reported to clients", ["code"], registry=self.registry)
        self.barge_ins = Counter("voice_barge_ins", "Replies interrupted by the user", registry=self.registry)
        self.refused = Counter("voice_sessions_refused", "Connections refused before a session opened",
                               ["reason"], registry=self.registry)
        self.ended = Counter("voice_sessions_terminated", "Sessions closed by the server (limits, shutdown)",
                             ["reason"], registry=self.registry)
        self.audio_dropped = Counter("voice_audio_dropped_seconds", "Reply audio dropped for clients that read "
                                     "too slowly", ["transport"], registry=self.registry)
        self.stage_faults = Counter("voice_stage_faults", "Stage failures and timeouts (each ends a turn with "
                                    "an apology)", ["stage", "kind"], registry=self.registry)
        self.records_failed = Counter("voice_records_failed", "Call record writes that failed or timed out",
                                      registry=self.registry)


@dataclass
class _Turn:
    marks: dict[str, float] = field(default_factory=dict)
    blocks: list[float] = field(default_factory=list)
    work: dict[str, float] = field(default_factory=dict)


def observe_stages(metrics: Metrics, budgets: BudgetConfig, stages: dict[str, float], session_id: str,
                   turn: int) -> list[str]:
    """One turn's stage times (ms, names of STAGES) into /metrics and the log; returns those over budget.
    The tracker calls it at the end of a turn; a transport that times its requests itself (Wyoming)
    calls it directly."""
    over = [name for name, ms in stages.items() if ms > getattr(budgets, name)]
    for name, ms in stages.items():
        metrics.stage_seconds.labels(name).observe(ms / 1000)
    for name in over:
        metrics.over_budget.labels(name).inc()
    metrics.turns.inc()
    if over:
        log.warning("session=%s turn=%d over budget: %s", session_id, turn,
                    ", ".join(f"{n} {stages[n]:.0f}ms > {getattr(budgets, n):.0f}ms" for n in over))
    log.info("session=%s turn=%d latency %s", session_id, turn, " ".join(f"{n}={ms:.0f}ms" for n, ms in stages.items()))
    return over


class LatencyTracker:
    def __init__(self, budgets: BudgetConfig, metrics: Metrics, emit: Callable[[Event], object], session_id: str):
        self.budgets, self.metrics, self.emit, self.session_id = budgets, metrics, emit, session_id
        self.turns: dict[int, _Turn] = {}

    def observe(self, ev: Event) -> None:
        if not isinstance(ev, (SpeechStopped, Transcript, ReplyText, ToolCall, ToolResult, TtsAudio, AudioSent,
                               ReplyDone, Work)):
            return
        if ev.turn not in self.turns and len(self.turns) >= 64:  # turns that never got a reply: forget the oldest
            self.turns.pop(next(iter(self.turns)))
        turn = self.turns.setdefault(ev.turn, _Turn())
        first = turn.marks.setdefault
        if isinstance(ev, SpeechStopped):
            first("speech_end", ev.speech_end)
            first("eos_detected", ev.t)
        elif isinstance(ev, Transcript) and ev.final:
            first("final_transcript", ev.t)
        elif isinstance(ev, ReplyText):
            first("lm_first_block", ev.t)
            turn.blocks.append(ev.t)
        elif isinstance(ev, ToolCall):  # a reply that calls tools: the call is the LM's first output
            first("lm_first_block", ev.t)
            first("tool_call", ev.t)
        elif isinstance(ev, ToolResult):
            turn.marks["tool_result"] = max(ev.t, turn.marks.get("tool_result", ev.t))
        elif isinstance(ev, TtsAudio):
            first("tts_first_audio", ev.t)
        elif isinstance(ev, Work):
            turn.work = ev.marks
        elif isinstance(ev, AudioSent):
            first("first_audio_sent", ev.t)
        elif isinstance(ev, ReplyDone):
            first("reply_done", ev.t)
            self._report(ev.turn, ev.t)

    def forget(self, turn_no: int) -> None:
        """A turn that ended without a reply (nothing was recognised)."""
        self.turns.pop(turn_no, None)

    def _report(self, turn_no: int, now: float) -> None:
        turn = self.turns.pop(turn_no)
        marks = turn.marks
        stages = {name: (marks[b] - marks[a]) * 1000 for name, (a, b) in STAGES.items() if a in marks and b in marks}
        origin = marks.get("speech_end", min(marks.values()))
        since = lambda t: round((t - origin) * 1000, 1)  # noqa: E731
        rel: dict[str, float | list[float] | dict[str, float]] = {name: since(t) for name, t in marks.items()}
        rel["lm_blocks"] = [since(t) for t in turn.blocks]
        rel["work"] = {name: since(t) for name, t in turn.work.items()}
        over = observe_stages(self.metrics, self.budgets, stages, self.session_id, turn_no)
        self.emit(LatencyReport(turn_no, now, {k: round(v, 1) for k, v in stages.items()}, rel, over,
                                round(stages["voice_to_voice"], 1) if "voice_to_voice" in stages else None))
