"""One session's rows in the call records (voice/service/records.py): every turn gets exactly one row.

A turn's row is written when it ends: `replied` (awaited, so its reply_done follows the commit),
`unreplied` (no reply: superseded, no speech, ASR failed), or at close `abandoned` (the session
ended mid-turn). Errors are counted, logged and recorded, sparingly when a client repeats one.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter

from voice.service import records as rec
from voice.events import Error, Event, LatencyReport

log = logging.getLogger("voice.session")
MAX_TURN_ERRORS = 20  # errors kept in one turn's row


class CallLog:
    def __init__(self, records: rec.Records | None, uid: str, session_id: str, error_count: Counter | None = None):
        self.records, self.uid, self.session_id, self.error_count = records, uid, session_id, error_count
        self.open_turns: dict[int, dict] = {}  # turn -> started (unix time), transcript, errors
        self.error_counts: dict[str, int] = {}
        self.stages_key = False  # the latency's stage times also as `stages` (Wyoming's rows always had them so)

    def _write(self, ops: list[rec.Op]) -> None:
        if self.records is not None:
            self.records.write_nowait(ops)

    def opened(self, transport: str, principal: str, peer: str, meta: dict) -> None:
        self._write(rec.session_opened(self.uid, self.session_id, transport, principal, peer, time.time(), meta))

    def started(self, turn: int) -> None:
        self.open_turns[turn] = {"started": time.time()}

    def transcript(self, turn: int, text: str) -> None:
        self.open_turns.setdefault(turn, {})["transcript"] = text

    def error(self, ev: Error) -> None:
        if self.error_count is not None:
            self.error_count.labels(ev.code).inc()
        n = self.error_counts[ev.code] = self.error_counts.get(ev.code, 0) + 1
        if n > 10 and n % 100:
            return
        log.warning("session=%s turn=%d error %s (#%d): %s", self.session_id, ev.turn, ev.code, n, ev.message)
        turn = self.open_turns.get(ev.turn)
        if turn is not None and len(turn.setdefault("errors", [])) < MAX_TURN_ERRORS:
            turn["errors"].append({"code": ev.code, "message": ev.message})
        self._write(rec.error(self.uid, ev.turn, time.time(), ev.code, ev.message))

    def unreplied(self, turn: int, transcript: str, status: str) -> None:
        meta = self.open_turns.pop(turn, {})
        self._write(rec.turn_done(self.uid, turn, meta.get("started"), time.time(), status, transcript, "", "",
                                  False, False, None, meta.get("errors", [])))

    async def replied(self, turn: int, status: str, transcript: str, reply: str, heard: str, interrupted: bool,
                      apologised: bool, latency: dict | None, tools: list[dict] | None = None) -> bool:
        """Write the turn's row and wait for the commit; False if it could not be written."""
        meta = self.open_turns.pop(turn, {})
        if self.records is None:
            return True
        return await self.records.write(rec.turn_done(
            self.uid, turn, meta.get("started"), time.time(), status, transcript, reply, heard, interrupted,
            apologised, latency, meta.get("errors", []), tools))

    async def reply_done(self, turn: int, status: str, transcript: str, reply: str, heard: str, interrupted: bool,
                         apologised: bool, tools: list[dict], held: list[Event]) -> bool:
        """`replied` for a session's reply; its latency report is among the events `held` back for it."""
        latency = next((e.to_wire() for e in held if isinstance(e, LatencyReport)), None)
        if latency is not None:
            latency.pop("type", None)
            latency.pop("turn", None)
            if self.stages_key:
                latency["stages"] = latency["stages_ms"]
        return await self.replied(turn, status, transcript, reply, heard, interrupted, apologised, latency, tools)

    def closed(self, reason: str, turns: int, dtmf: str = "") -> None:
        """The session ended: turns still open (the user was speaking, the final transcript was
        pending) are recorded as `abandoned`, then the session's own row (how it ended, the keys pressed)."""
        for turn in sorted(self.open_turns):
            meta = self.open_turns.pop(turn)
            errors = meta.get("errors", []) + [{"code": "abandoned",
                                                "message": f"the session ended ({reason}) before the turn did"}]
            self._write(rec.turn_done(self.uid, turn, meta.get("started"), time.time(), "abandoned",
                                      meta.get("transcript", ""), "", "", False, False, None,
                                      errors[-MAX_TURN_ERRORS:]))
        self._write(rec.session_closed(self.uid, time.time(), reason, turns, dtmf))
