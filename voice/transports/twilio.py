"""Twilio Media Streams (bidirectional, `<Connect><Stream url="wss://host/twilio"/>`).

Twilio sends JSON text frames: `connected`, `start`, `media` (base64 µ-law 8 kHz, 20 ms),
`dtmf`, `mark` (our marks, echoed once the audio before them has played) and `stop`. We send
`media` (20 ms of µ-law, paced in real time), a `mark` after each reply phrase, and `clear`
on barge-in. Anything malformed or out of place is dropped, counted and logged; the call
goes on. See docs/TELEPHONY.md.

With a Twilio auth token configured, the upgrade must carry a valid `X-Twilio-Signature`
(docs/SECURITY.md); otherwise `/twilio` takes the same API keys as `/ws`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import os
import re
import time
from xml.sax.saxutils import escape

import numpy as np
from starlette.websockets import WebSocket

from engine.common.wire import WireError, ascii_int, decode_json
from voice.audio import ulaw_decode, ulaw_encode
from voice.service.auth import Auth
from voice.conversation.session import Session
from voice.service.instance import Instance
from voice.transports.common import FLUSH_S, ConversationRunner, close_ws, run_admitted
from voice.transports.telephony import MAX_DTMF, RATE, CallSummary, PacedOutput, calls, count_drop

log = logging.getLogger("voice.twilio")
LEAD_S = 0.1  # Twilio buffers what we send; staying this far ahead of real time avoids gaps
MAX_PAYLOAD = 8000  # bytes of µ-law in one inbound media message (1 s); Twilio sends 160
MAX_MARKS = 1000  # marks sent and not yet echoed that we remember
DTMF_DIGITS = "0123456789*#ABCD"
SID = re.compile(r"^[A-Z]{2}[0-9a-f]{32}$")  # Twilio's resource ids: AC... an account, CA... a call
REST_TIMEOUT_S = 10.0


class TwilioCall:
    def __init__(self, ws: WebSocket, instance: Instance, principal: str = "twilio"):
        self.ws, self.instance, self.principal = ws, instance, principal
        self.runner = ConversationRunner(FLUSH_S["twilio"], self)
        self.registry = instance.metrics.registry
        self.session: Session | None = None
        self.record: CallSummary | None = None
        self.stream_sid = ""
        self.marks: dict[str, tuple[int, str]] = {}  # mark name -> (turn, phrase) not yet echoed
        self.cleared_marks: set[str] = set()
        self.mark_no = 0
        self.send_lock = asyncio.Lock()

    def drop(self, reason: str, detail: str = "") -> None:
        count_drop(self.registry, self.record, "twilio", reason, detail)

    async def run(self) -> None:
        await self.ws.accept()
        reason = "disconnect"
        try:
            reason = await self.runner.serve()
        finally:
            await self.end(reason)

    async def receive(self) -> str | None:
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                return None
            if msg.get("text") is None:
                self.drop("binary_frame", "Media Streams messages are JSON text frames")
                continue
            done = await self.handle(msg["text"])
            if done == "stop":
                return "caller_hangup"  # (or the call ended otherwise: a transfer's ends with our reason)
            if done is not None:  # a stream refused at its start
                await close_ws(self.ws, 1008, done)
                return done

    async def handle(self, text: str) -> str | None:
        try:
            # the one decoder of every front (engine.common.wire)
            msg = decode_json(text, max_bytes=self.instance.config.session.max_text_bytes)
        except WireError as err:
            self.drop("bad_json", err.message[:100])
            return None
        if not isinstance(msg, dict) or not isinstance(msg.get("event"), str):
            self.drop("bad_message", "not an object with an event")
            return None
        event = msg["event"]
        if event == "connected":
            log.info("twilio websocket connected: protocol=%s version=%s", msg.get("protocol"), msg.get("version"))
        elif event == "start":
            return self.start(msg)
        elif self.session is None:
            self.drop("before_start", f"{event!r} before start")
        elif event == "media":
            await self.media(msg)
        elif event == "mark":
            self.mark(msg)
        elif event == "dtmf":
            self.dtmf(msg)
        elif event == "stop":
            assert self.record is not None  # opened with the session
            self.record.meta["stopped"] = True
            log.info("twilio call=%s stop", self.stream_sid)
            return "stop"
        else:
            self.drop("unknown_event", repr(event)[:40])
        return None

    def start(self, msg: dict) -> str | None:
        """The stream's start: its session opens. "wrong_account" if it is another Twilio account's than
        `telephony.twilio_account_sid` (the stream is then refused: with an API key alone, a client could
        otherwise name any account's callSid for end_call and transfer_call to update)."""
        if self.session is not None:
            self.drop("duplicate_start")
            return None
        start = msg.get("start")
        sid = msg.get("streamSid") or (start.get("streamSid") if isinstance(start, dict) else None)
        if not isinstance(start, dict) or not isinstance(sid, str) or not sid:
            self.drop("bad_start", "start without start{} or streamSid")
            return None
        account = self.instance.config.telephony.twilio_account_sid
        if account and start.get("accountSid") != account:
            self.drop("wrong_account", f"accountSid {str(start.get('accountSid'))[:40]!r}")
            return "wrong_account"
        fmt = start.get("mediaFormat") or {}
        if not isinstance(fmt, dict) or \
                (fmt.get("encoding"), fmt.get("sampleRate"), fmt.get("channels", 1)) != ("audio/x-mulaw", RATE, 1):
            self.drop("bad_start", f"unsupported mediaFormat {fmt!r}"[:120])
            return None
        self.stream_sid = sid
        peer = f"{self.ws.client.host}:{self.ws.client.port}" if self.ws.client else ""
        self.session = Session(self.instance, RATE, RATE, "twilio", principal=self.principal, peer=peer,
                               meta={"streamSid": sid, "callSid": start.get("callSid"),
                                     "customParameters": start.get("customParameters") or {}}, phone=self)
        self.record = calls.open(CallSummary(sid, "twilio", self.session.id, peer=str(start.get("callSid", ""))))
        self.record.meta.update(callSid=start.get("callSid"), accountSid=start.get("accountSid"),
                                tracks=start.get("tracks"), customParameters=start.get("customParameters") or {})
        out = PacedOutput(self.session, self.record, self.send_media, self._close, phrase_end=self.send_mark,
                          cleared=self.send_clear, lead_s=LEAD_S)
        self.runner.tasks.append(out.pacer)
        self.runner.open(self.session, out)
        self.record.answered = time.monotonic()  # the stream starts once the call is answered
        if greeting := self.instance.config.telephony.greeting.strip():
            self.session.greet(greeting)
        log.info("twilio call=%s session=%s start: callSid=%s tracks=%s customParameters=%s", sid, self.session.id,
                 start.get("callSid"), start.get("tracks"), start.get("customParameters"))
        return None

    async def _close(self, code: int, reason: str) -> None:
        """The server ended the session (a limit, shutdown, end_call, a transfer): close the socket; Twilio
        then ends the stream. After end_call the call itself ends too (closing the stream alone would go on to
        the TwiML after `<Connect>`)."""
        assert self.session is not None  # made before the watcher
        log.info("twilio call=%s session=%s ended by the server: %s", self.stream_sid, self.session.id, reason)
        if reason == "end_call" and (why := await self.update_call({"Status": "completed"})) is not None:
            log.warning("twilio call=%s could not end the call: %s", self.stream_sid, why)
        await close_ws(self.ws, code, reason)

    async def transfer(self, name: str, target: str) -> str | None:
        """transfer_call (conversation/calltools.py): the call's TwiML becomes a `<Dial>` of `target` (Twilio's REST
        API); once Twilio took it, the stream ends here."""
        dial = f"<Sip>{escape(target)}</Sip>" if target.startswith("sip") else escape(target)
        if (why := await self.update_call({"Twiml": f"<Response><Dial>{dial}</Dial></Response>"})) is not None:
            return why
        assert self.session is not None and self.record is not None  # tools run in a session
        self.record.counters["transfers"] += 1
        self.session.hang_up(f"transfer:{name}")
        return None

    async def update_call(self, form: dict[str, str]) -> str | None:
        """Update this call through Twilio's REST API, as Twilio publishes it: POST form-encoded to
        {telephony.twilio_api_base}/2010-04-01/Accounts/{AccountSid}/Calls/{CallSid}.json, Basic auth
        AccountSid:AuthToken. None if Twilio took it, else why not, in words."""
        import httpx2
        assert self.record is not None  # after start
        config = self.instance.config
        account, call_sid = self.record.meta.get("accountSid"), self.record.meta.get("callSid")
        if not (isinstance(account, str) and SID.match(account) and account.startswith("AC")
                and isinstance(call_sid, str) and SID.match(call_sid) and call_sid.startswith("CA")):
            return "this stream did not say which Twilio call it is"
        env = config.auth.twilio_auth_token_env
        token = os.environ.get(env, "").strip() if env else ""
        if not token:
            return f"the server has no Twilio auth token (${env})"
        url = f"{config.telephony.twilio_api_base.rstrip('/')}/2010-04-01/Accounts/{account}/Calls/{call_sid}.json"
        try:
            async with httpx2.AsyncClient(timeout=REST_TIMEOUT_S, follow_redirects=False) as client:
                response = await client.post(url, data=form, auth=(account, token))
        except httpx2.HTTPError as err:
            return f"Twilio could not be reached ({type(err).__name__})"
        log.info("twilio call=%s REST %s -> HTTP %d", self.stream_sid, sorted(form), response.status_code)
        return None if response.status_code < 300 else f"Twilio answered HTTP {response.status_code}"

    async def media(self, msg: dict) -> None:
        assert self.session is not None and self.record is not None  # `handle` checked: after start
        media = msg.get("media")
        if not isinstance(media, dict) or not isinstance(media.get("payload"), str):
            self.drop("bad_media", "media without media.payload")
            return
        if media.get("track", "inbound") not in ("inbound", "inbound_track"):
            self.drop("wrong_track", f"track {media.get('track')!r}")
            return
        try:
            ulaw = base64.b64decode(media["payload"], validate=True)
        except (binascii.Error, ValueError) as err:
            self.drop("bad_base64", str(err))
            return
        if not ulaw or len(ulaw) > MAX_PAYLOAD:
            self.drop("bad_media", f"payload of {len(ulaw)} bytes")
            return
        self.record.counters["media_in"] += 1
        chunk = ascii_int(media.get("chunk"))  # "²".isdigit() is true, and int("²") raises
        if chunk is not None:
            last = self.record.meta.get("last_chunk")
            if last is not None and chunk != last + 1:
                self.record.counters["chunk_gaps"] += 1
            self.record.meta["last_chunk"] = chunk
        await self.session.push_audio(ulaw_decode(ulaw).astype("<i2").tobytes())

    def mark(self, msg: dict) -> None:
        assert self.record is not None  # `handle` checked: after start
        name = (msg.get("mark") or {}).get("name") if isinstance(msg.get("mark"), dict) else None
        if not isinstance(name, str):
            self.drop("bad_mark", "mark without mark.name")
            return
        entry = self.marks.pop(name, None)
        if entry is None:
            self.drop("unknown_mark", name[:40])
            return
        if name in self.cleared_marks:  # Twilio returns the marks of audio that `clear` dropped
            self.cleared_marks.discard(name)
            self.record.counters["marks_cleared"] += 1
            return
        self.record.counters["marks_played"] += 1
        self.record.heard.append(entry[1])

    def dtmf(self, msg: dict) -> None:
        dtmf = msg.get("dtmf")
        digit = dtmf.get("digit") if isinstance(dtmf, dict) else None
        if not isinstance(dtmf, dict) or not isinstance(digit, str) or len(digit) != 1 \
                or digit.upper() not in DTMF_DIGITS:
            self.drop("bad_dtmf", "dtmf without a dtmf.digit (0-9, *, #, A-D)")
            return
        assert self.session is not None and self.record is not None  # `handle` checked: after start
        if len(self.record.dtmf) >= MAX_DTMF:
            self.drop("dtmf_overflow", f"more than {MAX_DTMF} digits in one call")
            return
        self.record.dtmf.append(digit)
        self.record.counters["dtmf"] += 1
        log.info("twilio call=%s session=%s DTMF %r (track %s)", self.stream_sid, self.session.id, digit,
                 dtmf.get("track"))
        self.session.press(digit)

    # --- to Twilio -------------------------------------------------------------------------

    async def _send(self, obj: dict) -> None:
        async with self.send_lock:
            await self.ws.send_text(json.dumps(obj, separators=(",", ":")))

    async def send_media(self, pcm: np.ndarray, talkspurt: bool) -> None:
        payload = base64.b64encode(ulaw_encode(pcm)).decode("ascii")
        await self._send({"event": "media", "streamSid": self.stream_sid, "media": {"payload": payload}})

    async def send_mark(self, turn: int, text: str) -> None:
        assert self.session is not None and self.record is not None  # phrases play after start
        self.mark_no += 1
        name = f"{self.session.id}-t{turn}-p{self.mark_no}"
        self.marks[name] = (turn, text)
        while len(self.marks) > MAX_MARKS:  # a peer that never echoes marks must not make us hoard them
            oldest = next(iter(self.marks))
            del self.marks[oldest]
            self.cleared_marks.discard(oldest)
        self.record.counters["marks_sent"] += 1
        await self._send({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})

    async def send_clear(self) -> None:
        self.cleared_marks |= set(self.marks)
        await self._send({"event": "clear", "streamSid": self.stream_sid})

    async def end(self, reason: str) -> None:
        if self.session is not None:
            reason = self.session.end_reason or reason
        await self.runner.finish(reason)
        if self.record is not None:
            calls.close(self.record, reason)
        if reason == "caller_hangup":  # Twilio's `stop`: we close the socket
            await close_ws(self.ws)


async def handle(ws: WebSocket, instance: Instance, auth: Auth | None = None) -> None:
    await run_admitted(ws, instance, auth,
                       lambda principal: TwilioCall(ws, instance, principal if principal != "anonymous"
                                                    else "twilio").run(), twilio=True)
