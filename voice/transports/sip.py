"""A small SIP user agent server over UDP: phones and PBXs call the assistant directly.

RFC 3261 (UAS side, UDP), 3264 offer/answer with G.711 (PCMU/PCMA), 3550 RTP, 4733 DTMF;
docs/TELEPHONY.md lists exactly what is and isn't implemented. Each call gets its own RTP
port pair and its own `Session` (8 kHz in and out), on the conversation runner
(voice/transports/common.py); `telephony.PacedOutput` plays the replies.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any, cast

import numpy as np
from prometheus_client import CollectorRegistry

from voice.service.auth import source_allowed
from voice.config import SipConfig
from voice.service.limits import LimitError, Ticket
from voice.conversation.session import Session
from voice.service.instance import Instance
from voice.transports import rtp, sdp
from voice.transports.common import FLUSH_S, ConversationRunner, acquire
from voice.transports.sipmsg import (AGENT, COMPACT, SipError, SipMessage, address_uri, new_branch, new_tag, response,
                                     response_destination, uri_hostport, valid_via)
from voice.transports.telephony import FRAME_SAMPLES, MAX_DTMF, RATE, CallSummary, PacedOutput, calls, count_drop

log = logging.getLogger("voice.sip")
ALLOW = "INVITE, ACK, BYE, CANCEL, OPTIONS, INFO, NOTIFY"
T1, T2 = 0.5, 4.0  # RFC 3261 timer values
SILENCE = np.zeros(FRAME_SAMPLES, np.int16)
AUDIO_QUEUE = 500  # decoded RTP packets (10 s) waiting for the session; more are dropped
REFER_PROGRESS = 4  # a transfer's final statuses (the REFER's, the NOTIFYs') not yet read; more are dropped


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, handler: Callable[[bytes, Any], None]) -> None:
        self.handler = handler
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)  # create_datagram_endpoint's

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            self.handler(data, addr)
        except Exception:  # one bad datagram must never take the endpoint down
            log.exception("error handling a datagram from %s", addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("udp error: %s", exc)


class Call:
    """One dialog: signalling state, the RTP port pair, the session and its player."""

    def __init__(self, ep: "SipEndpoint", invite: SipMessage, source: tuple[str, int], answer: sdp.Answer):
        self.ep, self.invite, self.source, self.answer = ep, invite, source, answer
        self.id = invite.call_id
        self.local_tag, self.remote_tag = new_tag(), invite.from_tag
        self.state = "ringing"  # ringing -> answered (200 sent) -> confirmed (ACK) -> ended
        self.record = calls.open(CallSummary(self.id, "sip", peer=f"{source[0]}:{source[1]}", codec=answer.codec))
        self.record.meta.update({"from": invite.get("from"), "to": invite.get("to")})
        contact = invite.get("contact")
        self.remote_target = address_uri(contact) if contact else address_uri(invite.get("from") or "")
        self.route_set = invite.all("record-route")
        self.local_cseq = random.randint(1, 10000)
        self.last_final: bytes | None = None  # for INVITE retransmissions
        self.last_provisional: bytes | None = None
        self.sdp_version = random.randint(1, 1 << 30)
        self.sdp_id = self.sdp_version
        self.rtp_port = 0
        self.rtp_sock: asyncio.DatagramTransport | None = None
        self.rtcp_sock: asyncio.DatagramTransport | None = None
        self.session: Session | None = None
        self.runner = ConversationRunner(FLUSH_S["sip"])  # the session is fed from `audio_in` by `_feed`
        self.audio_in: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=AUDIO_QUEUE)
        self.jitter = rtp.JitterBuffer()
        self.dtmf = rtp.DtmfReceiver()
        self.sender = rtp.RtpSender(answer.payload_type)
        self.remote_ssrc: int | None = None
        self.last_rtp = time.monotonic()
        self.ticket: Ticket | None = None  # admission (voice.service.limits), released when the call ends
        # a transfer in progress (transfer_call): the REFER's final response, then the NOTIFYs' sipfrag statuses
        self.refer_cseq: int | None = None
        self.refer_status: int | None = None  # the REFER's latest response (None: none yet; it is resent)
        self.refer_progress: asyncio.Queue[int] | None = None

    # --- media ------------------------------------------------------------------------------

    def rtp_in(self, data: bytes, addr: tuple[str, int]) -> None:
        r = self.record
        if self.state == "ended":
            return
        if addr[0] not in (self.answer.remote[0], self.source[0]):  # SDP c= address, or where the INVITE came from
            count_drop(self.ep.registry, r, "sip", "rtp_unknown_source", f"{addr[0]}:{addr[1]}")
            return
        if len(data) > rtp.MAX_PACKET:
            count_drop(self.ep.registry, r, "sip", "rtp_too_large", f"{len(data)} bytes (at most {rtp.MAX_PACKET})")
            return
        try:
            pkt = rtp.RtpPacket.parse(data)
        except rtp.RtpError as err:
            count_drop(self.ep.registry, r, "sip", "rtp_malformed", str(err))
            return
        self.last_rtp = time.monotonic()
        if pkt.payload_type == self.answer.dtmf_pt and self.answer.dtmf_pt is not None:
            try:
                digit = self.dtmf.push(pkt.timestamp, pkt.payload)
            except rtp.RtpError as err:
                count_drop(self.ep.registry, r, "sip", "rtp_malformed", str(err))
                return
            if digit is not None:
                self._dtmf(digit, "rfc4733")
            return
        if pkt.payload_type != self.answer.payload_type:
            count_drop(self.ep.registry, r, "sip", "rtp_payload_type", f"payload type {pkt.payload_type}")
            return
        if pkt.ssrc != self.remote_ssrc:
            if self.remote_ssrc is not None:
                log.info("sip call=%s new remote SSRC %08x", self.id, pkt.ssrc)
            self.remote_ssrc = pkt.ssrc
            self.jitter.reset()
        r.counters["packets_in"] += 1
        before = (self.jitter.late, self.jitter.duplicate, self.jitter.lost)
        payloads = self.jitter.push(pkt.seq, pkt.payload)
        late, dup, lost = (a - b for a, b in zip((self.jitter.late, self.jitter.duplicate, self.jitter.lost), before))
        if late:
            count_drop(self.ep.registry, r, "sip", "rtp_late", f"seq {pkt.seq}")
        if dup:
            count_drop(self.ep.registry, r, "sip", "rtp_duplicate", f"seq {pkt.seq}")
        r.counters["packets_lost"] += lost
        for payload in payloads:
            pcm = SILENCE if payload is None else rtp.decode(self.answer.codec, payload)
            try:
                self.audio_in.put_nowait(pcm.astype("<i2").tobytes())
            except asyncio.QueueFull:  # far faster than real time: a flood, not a phone
                count_drop(self.ep.registry, r, "sip", "rtp_overflow", f"seq {pkt.seq}")

    def _dtmf(self, digit: str, how: str) -> None:
        if len(self.record.dtmf) >= MAX_DTMF:
            count_drop(self.ep.registry, self.record, "sip", "dtmf_overflow", f"over {MAX_DTMF} keys in one call")
            return
        self.record.dtmf.append(digit)
        self.record.counters["dtmf"] += 1
        log.info("sip call=%s session=%s DTMF %r (%s)", self.id, self.session.id if self.session else "-", digit, how)
        if self.session is not None:
            self.session.press(digit)

    async def _feed(self) -> None:
        assert self.session is not None  # opened before this task
        while (pcm := await self.audio_in.get()) is not None:
            await self.session.push_audio(pcm)

    def _send_frame(self, pcm: np.ndarray, marker: bool) -> None:
        if self.rtp_sock is None or self.answer.media.direction in ("sendonly", "inactive"):
            return  # the caller doesn't want our audio (on hold)
        pkt = self.sender.packet(rtp.encode(self.answer.codec, pcm), len(pcm), marker, time.monotonic())
        try:
            self.rtp_sock.sendto(pkt, self.answer.remote)
        except (OSError, OverflowError, ValueError, TypeError) as err:
            count_drop(self.ep.registry, self.record, "sip", "rtp_unsendable", str(err))
            return
        self.record.counters["packets_out"] += 1

    def _phrase_sent(self, turn: int, text: str) -> None:
        self.record.heard.append(text)

    def rtcp_in(self, data: bytes, addr: tuple[str, int]) -> None:
        self.record.counters["rtcp_in"] += 1  # receiver reports are not used

    async def start_media(self) -> None:
        """Bind the RTP/RTCP pair, open the session and start playing its replies."""
        self.rtp_port, self.rtp_sock, self.rtcp_sock = await self.ep.bind_rtp(self)
        self.session = Session(self.ep.instance, RATE, RATE, "sip", principal=f"sip:{self.source[0]}",
                               peer=f"{self.source[0]}:{self.source[1]}",
                               meta={"call_id": self.id, "from": self.invite.get("from"), "codec": self.answer.codec},
                               phone=self)
        self.record.session_id = self.session.id
        out = PacedOutput(self.session, self.record, self._send_frame, self._hang_up, phrase_end=self._phrase_sent)
        self.runner.tasks += [out.pacer, asyncio.create_task(self._feed()),
                                    asyncio.create_task(self._watch_media())]
        self.runner.open(self.session, out)
        if greeting := self.ep.instance.config.telephony.greeting.strip():
            self.session.greet(greeting)  # synthesised once the 200 OK is out (no await before it)
        self.last_rtp = time.monotonic()
        log.info("sip call=%s session=%s answered: %s/%d, RTP %s:%d <-> %s:%d", self.id, self.session.id,
                 self.answer.codec, self.answer.payload_type, self.ep.advertise(self.invite), self.rtp_port,
                 *self.answer.remote)

    async def _watch_media(self) -> None:
        timeout = self.ep.config.media_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            if timeout and time.monotonic() - self.last_rtp > timeout and self.state in ("answered", "confirmed"):
                log.warning("sip call=%s no RTP for %.0f s: hanging up", self.id, timeout)
                self.ep.send_bye(self)
                self.ep.spawn(self.end("media_timeout"))
                return

    async def _hang_up(self, code: int, reason: str) -> None:
        """The server ended the session (a limit, shutdown): hang up."""
        assert self.session is not None  # opened before the watcher
        log.info("sip call=%s session=%s ended by the server (%s): hanging up", self.id, self.session.id, reason)
        if self.state in ("answered", "confirmed"):
            self.ep.send_bye(self)
        self.ep.spawn(self.end(reason))

    async def transfer(self, name: str, target: str) -> str | None:
        """transfer_call (voice/conversation/calltools.py): a REFER (RFC 3515) to `target` (a phone number goes as
        sip:NUMBER@ the caller's host), then its NOTIFYs until a final status: 2xx = done, we hang up (BYE);
        a REFER refused or unanswered (its transaction ends by Timer F, 64*T1), a failure, or no final NOTIFY
        within `telephony.transfer_timeout_s` of the REFER's acceptance: the caller stays."""
        if self.state != "confirmed" or self.refer_progress is not None:
            return "the call cannot be transferred now"
        uri = target if target.startswith("sip") else f"sip:{target}@{uri_hostport(self.remote_target)[0]}"
        progress: asyncio.Queue[int] = asyncio.Queue(maxsize=REFER_PROGRESS)
        self.refer_progress = progress
        self.refer_cseq, refer, dest = self.ep.request(self, "REFER", [("refer-to", f"<{uri}>"),
                                                                      ("referred-by", self.ep.contact(self.invite))])
        self.refer_status = None
        self.ep.send(refer, dest)
        retransmits = self.ep.spawn(self._retransmit_refer(refer, dest))
        log.info("sip call=%s transfer to %s (%s): REFER sent", self.id, name, uri)
        try:
            async with asyncio.timeout(2 * 64 * T1):  # (a bound on its own: Timer F puts a 408 at 64*T1)
                status = await progress.get()  # the REFER's final response (Timer F: 408, none came)
            if self.refer_status is None or self.refer_status < 200:
                return "the caller's phone did not answer the REFER"
            if status >= 300:
                return f"the caller's phone refused it: SIP {status}"
            async with asyncio.timeout(self.ep.instance.config.telephony.transfer_timeout_s):
                status = await progress.get()  # the new call's final status, in a NOTIFY
        except TimeoutError:
            return "it was not completed in time"
        finally:
            retransmits.cancel()
            self.refer_progress = self.refer_cseq = None
        if status >= 300:
            return f"{name} did not answer: SIP {status}"
        log.info("sip call=%s transferred to %s: hanging up", self.id, name)
        self.record.counters["transfers"] += 1
        if self.session is not None:
            self.session.hang_up(f"transfer:{name}")
        return None

    async def _retransmit_refer(self, refer: bytes, dest: tuple[str, int]) -> None:
        """The REFER's transaction (`SipEndpoint.retransmit`); none of its responses final by Timer F ends the
        transfer as a 408 (Request Timeout)."""
        if not await self.ep.retransmit(refer, dest, lambda: self.refer_status, self.record, "refer_retransmits"):
            _progress(self, 408)

    async def end(self, reason: str) -> None:
        if self.state == "ended":
            return
        self.state = "ended"
        self.ep.calls.pop(self.id, None)
        for sock in (self.rtp_sock, self.rtcp_sock):
            if sock is not None:
                sock.close()
        self.ep.release_rtp(self.rtp_port)
        await self.runner.finish(reason, self.ticket)
        calls.close(self.record, reason)


def _progress(call: Call, status: int) -> None:
    """A final status of the call's transfer, for `Call.transfer` (a flood of them is dropped)."""
    assert call.refer_progress is not None  # a transfer in progress
    try:
        call.refer_progress.put_nowait(status)
    except asyncio.QueueFull:
        count_drop(call.ep.registry, call.record, "sip", "notify_overflow", f"status {status}")


def info_key(signal: str) -> str:
    """A dtmf-relay `Signal=` value: the key itself (`5`, `*`, `#`), or, as some phones send it, its
    RFC 4733 event number (`10` is `*`, `11` is `#`)."""
    if signal.isdigit() and len(signal) <= 2:
        return rtp.DTMF_EVENTS[int(signal)] if int(signal) < len(rtp.DTMF_EVENTS) else f"event-{int(signal)}"
    return signal[:1].upper()


class SipEndpoint:
    def __init__(self, instance: Instance, config: SipConfig, registry: CollectorRegistry | None = None):
        self.instance, self.config = instance, config
        self.registry = registry if registry is not None else instance.metrics.registry
        self.calls: dict[str, Call] = {}
        self.completed: collections.OrderedDict[tuple[str, str], bytes] = collections.OrderedDict()  # non-2xx finals
        self.transport: asyncio.DatagramTransport | None = None
        # our BYEs not answered finally yet, (Call-ID, CSeq) -> their latest response: one a call, 64*T1 at most
        self.bye_status: dict[tuple[str, int], int | None] = {}
        self.port = config.port
        self.rtp_used: set[int] = set()
        self._next_rtp = config.rtp_port_min
        self.tasks: set[asyncio.Task] = set()
        self.allow = [ipaddress.ip_network(net, strict=False) for net in config.allow]

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.transport, _ = await loop.create_datagram_endpoint(lambda: _Udp(self.datagram),
                                                                local_addr=(self.config.host, self.config.port))
        self.port = self.transport.get_extra_info("sockname")[1]
        log.info("SIP endpoint listening on udp %s:%d (codecs %s, RTP ports %d-%d)", self.config.host, self.port,
                 ",".join(self.config.codecs), self.config.rtp_port_min, self.config.rtp_port_max)

    async def stop(self) -> None:
        for call in list(self.calls.values()):
            if call.state in ("answered", "confirmed"):
                self.send_bye(call)
            await call.end("shutdown")
        for task in list(self.tasks):
            task.cancel()
        if self.transport is not None:
            self.transport.close()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # --- RTP ports ----------------------------------------------------------------------------

    async def bind_rtp(self, call: Call) -> tuple[int, asyncio.DatagramTransport, asyncio.DatagramTransport]:
        loop = asyncio.get_running_loop()
        lo, hi = self.config.rtp_port_min + self.config.rtp_port_min % 2, self.config.rtp_port_max
        count = max((hi - lo) // 2, 1)
        for _ in range(count):
            port = self._next_rtp if lo <= self._next_rtp < hi else lo
            self._next_rtp = port + 2  # rotate, so a port isn't reused at once (stale packets)
            if port in self.rtp_used:
                continue
            try:
                rtp_sock, _ = await loop.create_datagram_endpoint(lambda: _Udp(call.rtp_in),
                                                                  local_addr=(self.config.host, port))
            except OSError:
                continue
            try:
                rtcp_sock, _ = await loop.create_datagram_endpoint(lambda: _Udp(call.rtcp_in),
                                                                   local_addr=(self.config.host, port + 1))
            except OSError:
                rtp_sock.close()
                continue
            self.rtp_used.add(port)
            return port, rtp_sock, rtcp_sock
        raise OSError(f"no free RTP port pair in {lo}-{hi}")

    def release_rtp(self, port: int) -> None:
        self.rtp_used.discard(port)

    # --- signalling ---------------------------------------------------------------------------

    def advertise(self, req: SipMessage | None = None) -> str:
        """The address put in Contact and SDP."""
        if self.config.advertise:
            return self.config.advertise
        if self.config.host not in ("", "0.0.0.0", "::"):
            return self.config.host
        if req is not None:
            try:
                host = uri_hostport(req.uri or "")[0]
                ipaddress.ip_address(host)
                return host
            except (SipError, ValueError):
                pass
        return "127.0.0.1"

    def contact(self, req: SipMessage | None = None) -> str:
        host = self.advertise(req)
        host = f"[{host}]" if ":" in host else host
        return f"<sip:bot@{host}:{self.port}>"

    def send(self, data: bytes, dest: tuple[str, int]) -> None:
        if self.transport is not None:
            try:
                self.transport.sendto(data, dest)
            except (OSError, OverflowError, ValueError, TypeError) as err:  # an address a peer made up
                count_drop(self.registry, None, "sip", "unsendable", f"to {dest!r}: {err}")

    def reply(self, req: SipMessage, source: tuple[str, int], status: int, to_tag: str = "",
              extra: list[tuple[str, str]] | None = None, body: bytes = b"",
              content_type: str = "") -> bytes:
        data = response(req, status, source, to_tag, extra, body, content_type).to_bytes()
        self.send(data, response_destination(req, source))
        return data

    def allowed(self, host: str) -> bool:
        """sip.allow: only these source addresses may talk to us ([] = anyone)."""
        return source_allowed(host, self.allow)

    def datagram(self, data: bytes, source: tuple[str, int]) -> None:
        if not self.allowed(source[0]):  # silently: scanners learn nothing
            count_drop(self.registry, None, "sip", "forbidden_source", f"from {source[0]}:{source[1]}")
            return
        if not data.strip():
            return  # keep-alive (RFC 5626 CRLF)
        try:
            msg = SipMessage.parse(data)
        except (SipError, ValueError) as err:
            self._malformed(data, source, str(err))
            return
        if not msg.is_request:
            self._response(msg)
            return
        assert msg.method is not None  # a request's
        handler = {"INVITE": self._invite, "ACK": self._ack, "BYE": self._bye, "CANCEL": self._cancel,
                   "OPTIONS": self._options, "INFO": self._info, "NOTIFY": self._notify}.get(msg.method)
        if handler is None:
            self.reply(msg, source, 405, new_tag(), [("allow", ALLOW)])
            return
        handler(msg, source)

    def _malformed(self, data: bytes, source: tuple[str, int], why: str) -> None:
        """400 if the request is readable enough to answer (it has a Via, Call-ID, CSeq...), else drop."""
        count_drop(self.registry, None, "sip", "sip_malformed", f"from {source[0]}:{source[1]}: {why}")
        text = data.decode("utf-8", "replace").replace("\r\n", "\n")
        lines = text.split("\n\n")[0].split("\n")
        first = lines[0].split(" ")
        if len(first) != 3 or first[2].strip() != "SIP/2.0" or first[0].upper() == "ACK":
            return
        req = SipMessage(method=first[0].upper(), uri=first[1])
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if colon:
                name = name.strip().lower()
                req.headers.append((COMPACT.get(name, name), value.strip()))
        via = req.get("via")
        if not via or not all(req.get(h) for h in ("from", "to", "call-id", "cseq")) or not valid_via(via):
            return  # no usable Via: we could not even tell where to send the answer
        resp = response(req, 400, source, new_tag(), [("warning", f'399 {AGENT} "{why[:100]}"')])
        self.send(resp.to_bytes(), response_destination(req, source))

    def _options(self, req: SipMessage, source: tuple[str, int]) -> None:
        self.reply(req, source, 200, new_tag(), [("allow", ALLOW), ("accept", "application/sdp"),
                                                 ("contact", self.contact(req))])

    def _info(self, req: SipMessage, source: tuple[str, int]) -> None:
        call = self._dialog(req)
        if call is None:
            self.reply(req, source, 481, new_tag())
            return
        self.reply(req, source, 200)
        ctype = (req.get("content-type") or "").lower()
        if ctype.startswith("application/dtmf-relay"):  # Signal=5\r\nDuration=160
            for line in req.body.decode("utf-8", "replace").splitlines():
                name, _, value = line.partition("=")
                if name.strip().lower() == "signal" and (value := value.strip()):
                    call._dtmf(info_key(value), "sip-info")
        elif ctype.startswith("application/dtmf") and req.body.strip():
            call._dtmf(req.body.decode("utf-8", "replace").strip()[:1].upper(), "sip-info")

    def _response(self, resp: SipMessage) -> None:
        """A response to our request: a REFER's final status goes to its transfer, a BYE's ends its transaction."""
        call = self.calls.get(resp.call_id)
        try:
            cseq = resp.cseq
        except ValueError:
            return
        if cseq[1] == "BYE" and (resp.call_id, cseq[0]) in self.bye_status and resp.status is not None:
            self.bye_status[(resp.call_id, cseq[0])] = resp.status
        if call is not None and call.refer_progress is not None and cseq == (call.refer_cseq, "REFER") \
                and resp.status is not None:
            final = call.refer_status is not None and call.refer_status >= 200
            call.refer_status = resp.status if not final else call.refer_status
            if resp.status >= 200 and not final:  # (a retransmitted REFER's final comes again: taken once)
                _progress(call, resp.status)

    def _notify(self, req: SipMessage, source: tuple[str, int]) -> None:
        """A NOTIFY of our REFER's subscription (RFC 3515): its message/sipfrag body's status line tells how
        the caller's new call goes."""
        call = self._dialog(req)
        if call is None or call.refer_progress is None or \
                not (req.get("event") or "").lower().startswith("refer"):
            self.reply(req, source, 481, new_tag())
            return
        self.reply(req, source, 200)
        frag = req.body.decode("utf-8", "replace").strip().split("\n")[0].split()
        if len(frag) >= 2 and frag[0].upper() == "SIP/2.0" and frag[1].isascii() and frag[1].isdigit() \
                and len(frag[1]) == 3:
            if int(frag[1]) >= 200:  # (1xx: the new call is under way; only its end matters)
                _progress(call, int(frag[1]))
        else:
            count_drop(self.registry, call.record, "sip", "bad_sipfrag", repr(req.body[:60]))

    def _dialog(self, req: SipMessage) -> Call | None:
        call = self.calls.get(req.call_id)
        if call is None or req.to_tag != call.local_tag or req.from_tag != call.remote_tag:
            return None
        return call

    def _invite(self, req: SipMessage, source: tuple[str, int]) -> None:
        if req.to_tag:  # in-dialog: a re-INVITE
            self._reinvite(req, source)
            return
        key = (req.call_id, req.branch)
        if key in self.completed:  # retransmission of an INVITE we rejected
            self.send(self.completed[key], response_destination(req, source))
            return
        call = self.calls.get(req.call_id)
        if call is not None:  # retransmission of an INVITE in progress
            if call.invite.branch == req.branch:
                again = call.last_final or call.last_provisional
                if again:
                    self.send(again, response_destination(req, source))
            else:
                self.reply(req, source, 482, new_tag())  # merged request (section 8.2.2.2)
            return
        status, extra, answer = self._check_offer(req)
        if status:
            self._reject(req, source, status, extra)
            return
        assert answer is not None  # status 0: an answer
        if len(self.calls) >= self.config.max_calls:
            self._reject(req, source, 486, [])
            return
        try:
            ticket = acquire(self.instance, f"sip:{source[0]}", per_key=False)
        except LimitError as err:
            # draining or at capacity: 503 with when to try again (RFC 3261 21.5.4); a count limit: busy
            status = 503 if err.retry_after_s else 486
            retry = str(30 if err.code == "shutting_down" else err.retry_after_s)
            self._reject(req, source, status, [("warning", f'399 {AGENT} "{err.message[:80]}"')] +
                         ([("retry-after", retry)] if status == 503 else []))
            return
        call = Call(self, req, source, answer)
        call.ticket = ticket
        self.calls[call.id] = call
        self.reply(req, source, 100)
        call.last_provisional = self.reply(req, source, 180, call.local_tag, [("contact", self.contact(req))])
        call.runner.tasks.append(asyncio.create_task(self._answer(call, source)))

    def _check_offer(self, req: SipMessage) -> tuple[int, list, sdp.Answer | None]:
        if req.get("require"):
            return 420, [("unsupported", req.get("require"))], None
        ctype = (req.get("content-type") or "").split(";")[0].strip().lower()
        if not req.body.strip():
            # A delayed offer (offer in our 200, answer in the ACK) is not implemented.
            return 488, [("warning", f'399 {AGENT} "an SDP offer is required in the INVITE"')], None
        if ctype != "application/sdp":
            return 415, [("accept", "application/sdp")], None
        try:
            offer = sdp.parse(req.body.decode("utf-8"))
        except (sdp.SdpError, UnicodeDecodeError) as err:
            return 400, [("warning", f'399 {AGENT} "bad SDP: {str(err)[:80]}"')], None
        answer = sdp.negotiate(offer, self.config.codecs)
        if answer is None:
            return 488, [("warning", f'305 {AGENT} "Incompatible media format: we speak '
                                     f'{"/".join(self.config.codecs)} over RTP/AVP"'),
                         ("accept", "application/sdp")], None
        return 0, [], answer

    def _reject(self, req: SipMessage, source: tuple[str, int], status: int, extra: list[tuple[str, str]]) -> None:
        log.info("sip call=%s from %s:%d rejected: %d", req.call_id, *source, status)
        data = self.reply(req, source, status, new_tag(), extra)
        self.completed[(req.call_id, req.branch)] = data
        while len(self.completed) > 256:
            self.completed.popitem(last=False)

    async def _answer(self, call: Call, source: tuple[str, int]) -> None:
        try:
            if self.config.ring_ms:
                await asyncio.sleep(self.config.ring_ms / 1000)
            if call.state != "ringing":
                return
            await call.start_media()
        except OSError as err:
            log.error("sip call=%s cannot answer: %s", call.id, err)
            call.last_final = self.reply(call.invite, source, 500, call.local_tag)
            await call.end("no_rtp_port")
            return
        call.state = "answered"
        call.last_final = self._ok(call, call.invite, source)
        call.record.answered = time.monotonic()
        await self._retransmit_ok(call, source)

    def _ok(self, call: Call, req: SipMessage, source: tuple[str, int]) -> bytes:
        body = sdp.answer_sdp(call.answer, self.advertise(call.invite), call.rtp_port, call.sdp_id,
                              call.sdp_version).encode()
        return self.reply(req, source, 200, call.local_tag,
                          [("contact", self.contact(call.invite)), ("allow", ALLOW)],
                          body, "application/sdp")

    async def _retransmit_ok(self, call: Call, source: tuple[str, int]) -> None:
        """Timer G/H for the 2xx (RFC 3261 section 13.3.1.4): resend until the ACK, give up after 64*T1."""
        interval, waited = T1, 0.0
        dest = response_destination(call.invite, source)
        while waited < 64 * T1:
            await asyncio.sleep(interval)
            waited += interval
            if call.state != "answered":
                return
            assert call.last_final is not None  # the 200 OK being retransmitted
            self.send(call.last_final, dest)
            call.record.counters["ok_retransmits"] += 1
            interval = min(interval * 2, T2)
        log.warning("sip call=%s no ACK for the 200 OK: hanging up", call.id)
        self.send_bye(call)
        await call.end("no_ack")

    def _reinvite(self, req: SipMessage, source: tuple[str, int]) -> None:
        call = self._dialog(req)
        if call is None:
            self.reply(req, source, 481, new_tag())
            return
        if req.body.strip():
            status, extra, answer = self._check_offer(req)
            if status:
                self.reply(req, source, status, call.local_tag, extra)
                return
            assert answer is not None  # status 0: an answer
            if answer.codec != call.answer.codec or answer.payload_type != call.answer.payload_type:
                call.sender.payload_type = answer.payload_type
            call.answer = answer
            call.record.codec = answer.codec
        call.sdp_version += 1
        call.last_final = self._ok(call, req, source)
        call.record.counters["reinvites"] += 1

    def _ack(self, req: SipMessage, source: tuple[str, int]) -> None:
        call = self._dialog(req)
        if call is not None and call.state == "answered":
            call.state = "confirmed"
            log.info("sip call=%s confirmed (ACK)", call.id)
        # ACKs for rejected INVITEs (or retransmitted ACKs) just end their transaction

    def _bye(self, req: SipMessage, source: tuple[str, int]) -> None:
        call = self._dialog(req)
        if call is None:
            self.reply(req, source, 481, new_tag())
            return
        self.reply(req, source, 200)
        self.spawn(call.end("caller_hangup"))

    def _cancel(self, req: SipMessage, source: tuple[str, int]) -> None:
        call = self.calls.get(req.call_id)
        if call is None or call.invite.branch != req.branch or call.invite.cseq[0] != req.cseq[0]:
            self.reply(req, source, 481, new_tag())
            return
        self.reply(req, source, 200, call.local_tag)
        if call.state == "ringing":  # not answered yet: the INVITE ends with 487
            data = self.reply(call.invite, call.source, 487, call.local_tag)
            self.completed[(call.id, call.invite.branch)] = data
            self.spawn(call.end("cancel"))

    def send_bye(self, call: Call) -> None:
        """Hang up from our side (RFC 3261 section 15.1.1): the BYE is sent again until its final response, as
        the REFER is (`retransmit`), so that one lost datagram does not leave the caller's phone in the call."""
        cseq, data, dest = self.request(call, "BYE")
        self.send(data, dest)
        self.bye_status[(call.id, cseq)] = None
        self.spawn(self._retransmit_bye(call, cseq, data, dest))

    async def _retransmit_bye(self, call: Call, cseq: int, data: bytes, dest: tuple[str, int]) -> None:
        try:
            if not await self.retransmit(data, dest, lambda: self.bye_status.get((call.id, cseq)), call.record,
                                         "bye_retransmits"):
                log.info("sip call=%s our BYE had no final response within 64*T1", call.id)
        finally:
            self.bye_status.pop((call.id, cseq), None)

    async def retransmit(self, data: bytes, dest: tuple[str, int], status: Callable[[], int | None],
                         record: CallSummary, counter: str) -> bool:
        """Timers E and F (RFC 3261 section 17.1.2.2, a non-INVITE client transaction over UDP): the request
        `data`, already sent once, is sent again T1, 2*T1, ... apart, at most T2 (T2 apart once `status()`, its
        latest response, is provisional), until that is final (True); none within 64*T1: False."""
        interval, waited = T1, 0.0
        while True:
            pause = min(interval, 64 * T1 - waited)
            await asyncio.sleep(pause)
            waited += pause
            if (latest := status()) is not None and latest >= 200:
                return True
            if waited >= 64 * T1:
                return False
            self.send(data, dest)
            record.counters[counter] += 1
            interval = T2 if latest is not None else min(2 * interval, T2)

    def request(self, call: Call, method: str, extra: list[tuple[str, str]] | None = None
                ) -> tuple[int, bytes, tuple[str, int]]:
        """A request in the call's dialog (RFC 3261 section 12.2.1.1): its CSeq number, bytes and destination."""
        call.local_cseq += 1
        host = self.advertise(call.invite)
        host = f"[{host}]" if ":" in host else host
        req = SipMessage(method=method, uri=call.remote_target)
        req.headers += [("via", f"SIP/2.0/UDP {host}:{self.port};branch={new_branch()};rport"),
                        ("max-forwards", "70")]
        req.headers += [("route", r) for r in call.route_set]
        to = call.invite.get("to") or ""
        req.headers += [("from", f"{to};tag={call.local_tag}" if "tag=" not in to else to),
                        ("to", call.invite.get("from") or ""), ("call-id", call.id),
                        ("cseq", f"{call.local_cseq} {method}"), ("contact", self.contact(call.invite)),
                        ("user-agent", AGENT)] + (extra or [])
        target = address_uri(call.route_set[0]) if call.route_set and ";lr" in call.route_set[0] else call.remote_target
        try:
            dest = uri_hostport(target)
        except SipError:
            dest = call.source
        return call.local_cseq, req.to_bytes(), dest
