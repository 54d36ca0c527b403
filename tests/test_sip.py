"""The SIP/RTP endpoint against real peers on loopback: SIPp, baresip, and a raw UDP phone.

One service (real models, SIP on a free UDP port, started by the app's lifespan) serves the
module. SIPp and baresip are the system packages .ci/run installs (sip-tester, baresip-core):
missing, their tests skip locally and fail under VOICE_CI=1. The raw phone is a few sockets
in this file, for what real phones won't do on purpose (bad input, CANCEL, stray RTP).
"""

from __future__ import annotations

import asyncio
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import time
import urllib.request
import uuid
import wave
from pathlib import Path

import numpy as np
import pytest

from voice.pipeline.asr import StreamingTranscriber
from voice.config import AsrConfig
from voice.audio import float_to_int16, pcm16_to_float, read_wav, resample, rms_dbfs, ulaw_encode
from voice.config import Config
from voice.service.server import build_app
from voice.service.instance import Instance
from voice.transports import rtp, sdp, sip
from voice.transports.telephony import calls
from fakes import REAL_REPLY_TOKENS
from liveserver import serving
from fakes import SPEECH

pytestmark = [pytest.mark.slow, pytest.mark.live]

TIMEOUT = 90.0  # two shared CPU cores run ASR, LM and TTS
MEDIA_TIMEOUT_S = 4.0

# --- helpers ----------------------------------------------------------------------------------


def free_udp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_even_udp_ports(n: int) -> int:
    """An even port p with p .. p+n-1 all free (for RTP/RTCP pairs)."""
    for _ in range(200):
        p = random.randrange(30000, 60000 - n, 2)
        socks = []
        try:
            for q in range(p, p + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free UDP port range")


def wait_until(pred, timeout: float = TIMEOUT, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.05)


def sip_record(call_id: str):
    found = [r for r in calls.find("sip") if r.id == call_id]
    return found[-1] if found else None


def speech_8k(name: str) -> np.ndarray:
    audio, rate = read_wav(SPEECH / name)
    return float_to_int16(resample(audio, rate, 8000))


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z']+", text.lower()))


class Service:
    def __init__(self, config: Config, http_port: int, instance: Instance, app):
        self.config, self.http_port, self.instance, self.app = config, http_port, instance, app
        self.sip_port = config.sip.port

    def metric(self, line_start: str) -> float | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(line_start):
                    return float(line.rsplit(" ", 1)[1])
        return None

    def active_sip_sessions(self) -> float | None:
        return self.metric('voice_sessions_active{transport="sip"}')


@pytest.fixture(scope="module")
def service(real_instance):
    config = Config()
    config.lm.max_new_tokens = REAL_REPLY_TOKENS
    config.sip.port = free_udp_port()
    config.sip.ring_ms = 300  # long enough to CANCEL a ringing call
    config.sip.media_timeout_s = MEDIA_TIMEOUT_S
    config.sip.rtp_port_min = free_even_udp_ports(40)
    config.sip.rtp_port_max = config.sip.rtp_port_min + 39
    instance = real_instance(config)
    app = build_app(config, instance)
    with serving(app) as port:
        assert app.state.sip is not None and app.state.sip.port == config.sip.port
        yield Service(config, port, instance, app)


@pytest.fixture(autouse=True)
def no_leaked_sessions(service):
    yield
    wait_until(lambda: not calls.find("sip") or all(r.ended for r in calls.find("sip")), 15, "calls to end")
    assert service.active_sip_sessions() in (None, 0.0)
    assert not service.app.state.sip.calls


# --- a raw phone --------------------------------------------------------------------------------


class Response:
    def __init__(self, data: bytes):
        head, _, self.body = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        self.start = lines[0]
        self.headers: dict[str, list[str]] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers.setdefault(name.strip().lower(), []).append(value.strip())
        m = re.match(r"SIP/2\.0 (\d{3}) ", self.start + " ")
        self.status = int(m.group(1)) if m else None
        self.method = None if m else self.start.split(" ")[0]

    def h(self, name: str) -> str:
        return self.headers.get(name, [""])[0]

    @property
    def to_tag(self) -> str:
        m = re.search(r";tag=([^;>\s]+)", self.h("to"))
        return m.group(1) if m else ""

    def __repr__(self) -> str:
        return f"<{self.start}>"


class Phone:
    """A SIP phone in a few lines: one UDP socket for SIP, one for RTP."""

    def __init__(self, service: Service, host: str = "127.0.0.1"):
        self.service, self.host = service, host
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.rtp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.rtp.bind((host, 0))
        self.rtp_port = self.rtp.getsockname()[1]
        self.call_id = f"{uuid.uuid4().hex}@pytest"
        self.tag = uuid.uuid4().hex[:8]
        self.to_tag = ""
        self.cseq = 0
        self.invite_branch = ""
        self.ssrc, self.seq, self.ts = random.getrandbits(32), random.getrandbits(16), random.getrandbits(32)
        self.server = ("127.0.0.1", service.sip_port)

    def close(self) -> None:
        self.sock.close()
        self.rtp.close()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendto(data, self.server)

    def request(self, method: str, body: str = "", branch: str = "", cseq: int | None = None,
                ctype: str = "application/sdp") -> str:
        if cseq is None:
            self.cseq += 1
            cseq = self.cseq
        branch = branch or f"z9hG4bK{uuid.uuid4().hex[:16]}"
        uri = f"sip:bot@127.0.0.1:{self.server[1]}"
        to_tag = f";tag={self.to_tag}" if self.to_tag and method != "CANCEL" else ""
        lines = [f"{method} {uri} SIP/2.0", f"Via: SIP/2.0/UDP {self.host}:{self.port};branch={branch};rport",
                 "Max-Forwards: 70", f"From: \"pytest\" <sip:phone@{self.host}>;tag={self.tag}",
                 f"To: <{uri}>{to_tag}", f"Call-ID: {self.call_id}", f"CSeq: {cseq} {method}",
                 f"Contact: <sip:phone@{self.host}:{self.port}>"]
        if body:
            lines.append(f"Content-Type: {ctype}")
        lines.append(f"Content-Length: {len(body.encode())}")
        self.send_raw(("\r\n".join(lines) + "\r\n\r\n" + body).encode())
        return branch

    def recv(self, timeout: float = 5.0) -> Response:
        self.sock.settimeout(timeout)
        data, _ = self.sock.recvfrom(65535)
        return Response(data)

    def nothing(self, timeout: float = 0.5) -> bool:
        try:
            self.recv(timeout)
        except TimeoutError:
            return True
        return False

    def final(self, timeout: float = 10.0) -> tuple[list[Response], Response]:
        """Responses until a final one: (provisionals, final)."""
        provisional = []
        while True:
            r = self.recv(timeout)
            if r.status is not None and r.status >= 200:
                return provisional, r
            provisional.append(r)

    def offer(self, formats: str, rtpmap: list[str], extra_media: str = "") -> str:
        return "\r\n".join(["v=0", f"o=pytest 1 1 IN IP4 {self.host}", "s=pytest", f"c=IN IP4 {self.host}", "t=0 0",
                            f"m=audio {self.rtp_port} RTP/AVP {formats}"] + [f"a=rtpmap:{m}" for m in rtpmap]
                           + ["a=ptime:20"] + ([extra_media] if extra_media else [])) + "\r\n"

    def call(self, formats: str = "0 101", rtpmap=("0 PCMU/8000", "101 telephone-event/8000")) -> Response:
        """INVITE, wait for the 200, ACK; returns the 200."""
        self.invite_branch = self.request("INVITE", self.offer(formats, list(rtpmap)))
        _, ok = self.final()
        assert ok.status == 200, ok
        self.to_tag = ok.to_tag
        self.request("ACK", cseq=1)
        return ok

    def rtp_send(self, dest: tuple[str, int], payload: bytes, pt: int = 0, seq: int | None = None,
                 ts: int | None = None, marker: bool = False, sock: socket.socket | None = None) -> None:
        seq = self.seq if seq is None else seq
        ts = self.ts if ts is None else ts
        pkt = struct.pack("!BBHII", 0x80, (0x80 if marker else 0) | pt, seq & 0xFFFF, ts & 0xFFFFFFFF, self.ssrc)
        (sock or self.rtp).sendto(pkt + payload, dest)
        if seq == self.seq:
            self.seq = (self.seq + 1) & 0xFFFF
            self.ts = (self.ts + len(payload)) & 0xFFFFFFFF


def answer_media(resp: Response) -> tuple[tuple[str, int], str]:
    body = resp.body.decode()
    ip = re.search(r"^c=IN IP4 (\S+)", body, re.M).group(1)
    port = int(re.search(r"^m=audio (\d+) RTP/AVP", body, re.M).group(1))
    return (ip, port), body


# --- pure units (no models needed, but the module's fixture is autouse) ---------------------------


def test_jitter_buffer_reorders_and_drops():
    jb = rtp.JitterBuffer(depth=3)
    assert jb.push(65534, b"a") == [b"a"]
    assert jb.push(0, b"c") == []  # 65535 missing: wait
    assert jb.push(65535, b"b") == [b"b", b"c"]  # arrives late but in time, across the wrap
    assert jb.push(65535, b"b") == [] and jb.late == 1  # already played: late
    assert jb.push(2, b"e") == []
    assert jb.push(2, b"e") == [] and jb.duplicate == 1
    assert jb.push(3, b"f") == [] and jb.push(4, b"g") == []
    assert jb.push(5, b"h") == [None, b"e", b"f", b"g", b"h"]  # 1 declared lost after depth packets
    assert jb.lost == 1
    assert jb.push(1, b"d") == [] and jb.late == 2


def test_rtp_packets_and_telephone_events():
    sender = rtp.RtpSender(8, rng=random.Random(1))
    first = rtp.RtpPacket.parse(sender.packet(b"\xd5" * 160, 160, True, 100.0))
    second = rtp.RtpPacket.parse(sender.packet(b"\xd5" * 160, 160, False, 100.02))
    assert first.marker and not second.marker and first.payload_type == 8 and first.ssrc == second.ssrc
    assert second.seq == (first.seq + 1) & 0xFFFF and second.timestamp == (first.timestamp + 160) & 0xFFFFFFFF
    later = rtp.RtpPacket.parse(sender.packet(b"\xd5" * 160, 160, True, 102.0))  # after a 2 s gap
    assert later.marker and (later.timestamp - first.timestamp) & 0xFFFFFFFF == 16000
    # CSRCs, header extension and padding are skipped
    raw = struct.pack("!BBHII", 0x80 | 0x20 | 0x10 | 1, 0, 7, 8, 9) + b"CSRC" + struct.pack("!HH", 0xBEDE, 1) \
        + b"EXT!" + b"pay" + b"\x00\x02"
    assert rtp.RtpPacket.parse(raw).payload == b"pay"
    with pytest.raises(rtp.RtpError):
        rtp.RtpPacket.parse(b"\x40" + b"\x00" * 11)  # version 1
    ev = rtp.TelephoneEvent.parse(bytes([11, 0x80 | 10, 0x03, 0x20]))
    assert (ev.digit, ev.end, ev.volume, ev.duration) == ("#", True, 10, 800)
    signals = ("5", "*", "#", "b", "10", "11", "16")  # SIP INFO dtmf-relay: keys, or RFC 4733 event numbers
    assert [sip.info_key(v) for v in signals] == ["5", "*", "#", "B", "*", "#", "event-16"]
    dtmf = rtp.DtmfReceiver()
    assert [dtmf.push(ts, bytes([5, 0, 0, 160])) for ts in (1000, 1000, 1000, 2000)] == ["5", None, None, "5"]


def test_offer_answer():
    text = ("v=0\r\no=x 1 1 IN IP4 10.0.0.1\r\ns=-\r\nc=IN IP4 10.0.0.1\r\nt=0 0\r\n"
            "m=audio 4000 RTP/AVP 18 8 0 96\r\na=rtpmap:18 G729/8000\r\na=rtpmap:96 telephone-event/8000\r\n"
            "m=video 4002 RTP/AVP 97\r\na=rtpmap:97 H264/90000\r\n")
    answer = sdp.negotiate(sdp.parse(text), ["PCMU", "PCMA"])
    assert (answer.codec, answer.payload_type, answer.dtmf_pt, answer.remote) == ("PCMA", 8, 96, ("10.0.0.1", 4000))
    body = sdp.answer_sdp(answer, "127.0.0.1", 20000, 5, 6)
    assert "m=audio 20000 RTP/AVP 8 96\r\n" in body and "a=rtpmap:8 PCMA/8000" in body
    assert "m=video 0 RTP/AVP 97" in body  # refused, same position (RFC 3264 section 6)
    assert sdp.negotiate(sdp.parse(text), ["PCMU"]).codec == "PCMU"
    only_g729 = text.replace(" 18 8 0 96", " 18")
    assert sdp.negotiate(sdp.parse(only_g729), ["PCMU", "PCMA"]) is None
    dynamic = text.replace(" 18 8 0 96", " 101").replace("a=rtpmap:18 G729/8000", "a=rtpmap:101 pcmu/8000")
    assert sdp.negotiate(sdp.parse(dynamic), ["PCMU"]).payload_type == 101


# --- signalling -------------------------------------------------------------------------------


def test_malformed_datagrams_then_options(service):
    phone = Phone(service)
    dropped = 'voice_telephony_dropped_total{reason="sip_malformed",transport="sip"}'
    before = service.metric(dropped) or 0.0
    try:
        phone.send_raw(b"\x00\xff\xfe garbage, not SIP at all")
        assert phone.nothing(), "unparseable datagrams are dropped"
        bad_cseq = (f"INVITE sip:bot@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{phone.port};branch=z9hG4bKbad\r\n"
                    f"From: <sip:phone@127.0.0.1>;tag=1\r\nTo: <sip:bot@127.0.0.1>\r\nCall-ID: bad@pytest\r\n"
                    f"CSeq: one INVITE\r\nContent-Length: 0\r\n\r\n")
        phone.send_raw(bad_cseq.encode())
        r = phone.recv()
        assert r.status == 400 and r.h("call-id") == "bad@pytest" and "branch=z9hG4bKbad" in r.h("via")
        phone.send_raw(bad_cseq.replace("CSeq: one INVITE", "CSeq: 1 INVITE").replace(
            "Content-Length: 0", "Content-Length: 500").encode())  # longer than the datagram
        assert phone.recv().status == 400

        branch = phone.request("OPTIONS")
        r = phone.recv()
        assert r.status == 200, r
        allow = {m.strip() for m in r.h("allow").split(",")}
        assert {"INVITE", "ACK", "BYE", "CANCEL", "OPTIONS"} <= allow
        assert r.h("call-id") == phone.call_id and r.h("cseq") == "1 OPTIONS"
        assert f"branch={branch}" in r.h("via") and f"rport={phone.port}" in r.h("via")
        assert f"tag={phone.tag}" in r.h("from") and r.to_tag
        phone.request("REGISTER")
        r = phone.recv()
        assert r.status == 405 and "INVITE" in r.h("allow")
        assert service.metric(dropped) == before + 3
    finally:
        phone.close()


def test_offer_without_g711_gets_488(service):
    phone = Phone(service)
    try:
        branch = phone.request("INVITE", phone.offer("18", ["18 G729/8000"]))
        _, r = phone.final()
        assert r.status == 488 and r.to_tag and "305" in r.h("warning")
        phone.request("INVITE", phone.offer("18", ["18 G729/8000"]), branch=branch, cseq=1)  # retransmission
        _, again = phone.final()
        assert again.status == 488 and again.to_tag == r.to_tag
        phone.to_tag = r.to_tag
        phone.request("ACK", branch=branch, cseq=1)
        assert phone.nothing()
        assert sip_record(phone.call_id) is None, "no call, no session"
    finally:
        phone.close()


def test_cancel_while_ringing(service):
    phone = Phone(service)
    try:
        branch = phone.request("INVITE", phone.offer("0", ["0 PCMU/8000"]))
        assert phone.recv().status == 100
        ringing = phone.recv()
        assert ringing.status == 180 and ringing.to_tag
        phone.request("CANCEL", branch=branch, cseq=1)
        got = {r.status: r for r in (phone.recv(), phone.recv())}
        assert set(got) == {200, 487}
        assert got[200].h("cseq") == "1 CANCEL" and got[487].h("cseq") == "1 INVITE"
        assert got[487].to_tag == ringing.to_tag
        phone.to_tag = ringing.to_tag
        phone.request("ACK", branch=branch, cseq=1)
        record = wait_until(lambda: (r := sip_record(phone.call_id)) and r.ended and r, 5, "the call to end")
        assert record.end_reason == "cancel" and record.session_id == ""  # never answered: no session
        phone.request("CANCEL", branch=branch, cseq=1)  # too late: the transaction is over
        assert phone.recv().status == 481
    finally:
        phone.close()


def test_rtp_checks_dtmf_and_a_second_call_unaffected(service):
    """Call A (PCMA + telephone-event): stray RTP, reordering, duplicates, DTMF, BYE.
    Call B (PCMU) runs alongside, is untouched by A's trouble, and is hung up by the
    server when its RTP stops (media timeout: our BYE, its 200)."""
    a, b = Phone(service), Phone(service)
    stray = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stray.bind(("127.0.0.2", 0))  # another loopback host: not the SDP address
    try:
        ok_a = a.call("8 0 101", ["8 PCMA/8000", "0 PCMU/8000", "101 telephone-event/8000"])
        (ip_a, port_a), body_a = answer_media(ok_a)
        assert ip_a == "127.0.0.1" and re.search(r"^m=audio \d+ RTP/AVP 8 101\r$", body_a, re.M)
        assert ok_a.h("content-type") == "application/sdp" and ok_a.h("contact").startswith("<sip:bot@127.0.0.1:")
        ok_b = b.call("0", ["0 PCMU/8000"])
        (ip_b, port_b), body_b = answer_media(ok_b)
        assert port_b != port_a and re.search(r"^m=audio \d+ RTP/AVP 0\r$", body_b, re.M)
        rec_a, rec_b = sip_record(a.call_id), sip_record(b.call_id)
        assert rec_a.codec == "PCMA" and rec_b.codec == "PCMU" and rec_a.session_id != rec_b.session_id
        assert service.active_sip_sessions() == 2.0

        quiet_alaw, quiet_ulaw = b"\xd5" * 160, b"\xff" * 160
        for _ in range(3):
            a.rtp_send((ip_a, port_a), quiet_alaw, pt=8, sock=stray)
        s = a.seq
        for seq in (s, s + 2, s + 2, s + 1, s + 3, s - 1):  # reordered, a duplicate, one too late
            a.rtp_send((ip_a, port_a), quiet_alaw, pt=8, seq=seq, ts=seq * 160)
        a.seq = s + 4
        a.rtp.sendto(b"\x40" + b"\x00" * 20, (ip_a, port_a))  # not RTP version 2
        a.rtp_send((ip_a, port_a), quiet_ulaw, pt=0)  # offered but not the negotiated codec
        for event, ts in ((5, 777000), (11, 778600)):  # keys 5 and #
            for i in range(4):  # RFC 4733: a key press is several packets with one timestamp, then repeated ends
                a.rtp_send((ip_a, port_a), struct.pack("!BBH", event, 0x80 if i >= 2 else 0, 160 * (i + 1)), pt=101,
                           seq=a.seq, ts=ts, marker=i == 0)
        for _ in range(20):  # call B: plain audio all along
            b.rtp_send((ip_b, port_b), quiet_ulaw)
            time.sleep(0.005)
        wait_until(lambda: len(rec_a.dtmf) == 2 and rec_a.counters["packets_in"] >= 5
                   and rec_b.counters["packets_in"] >= 20, 5, "RTP to arrive")
        c = rec_a.counters
        assert c["dropped_rtp_unknown_source"] == 3
        assert c["packets_in"] == 6 and c["dropped_rtp_duplicate"] == 1 and c["dropped_rtp_late"] == 1
        assert c["dropped_rtp_malformed"] == 1 and c["dropped_rtp_payload_type"] == 1
        assert rec_a.dtmf == ["5", "#"]
        wait_until(lambda: rec_a.transcripts, 5, "the keys to be a turn")
        assert rec_a.transcripts == ["(keypad) The caller pressed 5."]
        assert not [k for k in rec_b.counters if k.startswith("dropped_")]
        unknown = service.metric('voice_telephony_dropped_total{reason="rtp_unknown_source",transport="sip"}')
        assert unknown >= 3

        a.request("BYE")
        r = a.recv()
        assert r.status == 200 and r.h("cseq").endswith("BYE")
        wait_until(lambda: rec_a.ended, 5, "call A to end")
        assert rec_a.end_reason == "caller_hangup" and not rec_b.ended
        assert service.active_sip_sessions() == 1.0

        # B puts us on hold with a re-INVITE (sendonly: we must not send), then sends a SIP INFO digit
        b.request("INVITE", b.offer("0", ["0 PCMU/8000"]) + "a=sendonly\r\n")
        _, held = b.final()
        assert held.status == 200 and held.to_tag == b.to_tag and "a=recvonly" in held.body.decode()
        b.request("ACK", cseq=b.cseq)
        for signal in ("7", "11"):  # 11: `#` as its RFC 4733 event number, as some phones send it
            b.request("INFO", f"Signal={signal}\r\nDuration=160\r\n", ctype="application/dtmf-relay")
            assert b.recv().status == 200
        assert rec_b.dtmf == ["7", "#"] and rec_b.counters["reinvites"] == 1

        # B goes quiet: after MEDIA_TIMEOUT_S the server hangs up with its own BYE
        bye = b.recv(MEDIA_TIMEOUT_S + 5)
        assert bye.method == "BYE" and bye.h("call-id") == b.call_id
        assert f"tag={b.tag}" in bye.h("to") and f"tag={b.to_tag}" in bye.h("from")
        b.sock.sendto(f"SIP/2.0 200 OK\r\nVia: {bye.h('via')}\r\nFrom: {bye.h('from')}\r\nTo: {bye.h('to')}\r\n"
                      f"Call-ID: {bye.h('call-id')}\r\nCSeq: {bye.h('cseq')}\r\nContent-Length: 0\r\n\r\n".encode(),
                      b.server)
        wait_until(lambda: rec_b.ended, 5, "call B to end")
        assert rec_b.end_reason == "media_timeout"
        b.request("BYE")  # the dialog is gone
        assert b.recv().status == 481
    finally:
        stray.close()
        a.close()
        b.close()


# --- real peers -------------------------------------------------------------------------------

# SIPp dials, offers PCMU and telephone-event, acknowledges the answer and streams {audio}:
# every SIPp call here (and tests/test_phone_agent.py's) starts so
SIPP_DIAL = """<?xml version="1.0" encoding="ISO-8859-1" ?>
<scenario name="call the voice assistant">
  <send retrans="500">
    <![CDATA[
      INVITE sip:bot@[remote_ip]:[remote_port] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:bot@[remote_ip]:[remote_port]>
      Call-ID: [call_id]
      CSeq: 1 INVITE
      Contact: <sip:sipp@[local_ip]:[local_port]>
      Max-Forwards: 70
      Content-Type: application/sdp
      Content-Length: [len]

      v=0
      o=sipp 53655765 2353687637 IN IP[local_ip_type] [local_ip]
      s=-
      c=IN IP[media_ip_type] [media_ip]
      t=0 0
      m=audio [media_port] RTP/AVP 0 101
      a=rtpmap:0 PCMU/8000
      a=rtpmap:101 telephone-event/8000
      a=fmtp:101 0-15
      a=ptime:20
    ]]>
  </send>
  <recv response="100" optional="true"/>
  <recv response="180" optional="true"/>
  <recv response="200" rtd="true" rrs="true"/>
  <send>
    <![CDATA[
      ACK [next_url] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:bot@[remote_ip]:[remote_port]>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 1 ACK
      Contact: <sip:sipp@[local_ip]:[local_port]>
      Max-Forwards: 70
      Content-Length: 0
    ]]>
  </send>
  <nop><action><exec rtp_stream="{audio},1,0"/></action></nop>
"""
SIPP_SCENARIO = SIPP_DIAL + """\
  <!-- The caller hangs up once the test says the reply is out (an INFO in the dialog), whatever the CPU's
       speed; at the latest after {wait_ms} ms. -->
  <recv request="INFO" timeout="{wait_ms}" ontimeout="hang_up"/>
  <send>
    <![CDATA[
      SIP/2.0 200 OK
      [last_Via:]
      [last_From:]
      [last_To:]
      [last_Call-ID:]
      [last_CSeq:]
      Content-Length: 0
    ]]>
  </send>
  <label id="hang_up"/>
  <send retrans="500">
    <![CDATA[
      BYE [next_url] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:bot@[remote_ip]:[remote_port]>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 2 BYE
      Contact: <sip:sipp@[local_ip]:[local_port]>
      Max-Forwards: 70
      Content-Length: 0
    ]]>
  </send>
  <recv response="200" crlf="true"/>
</scenario>
"""


# sipp presses keys by SIP INFO (its play_dtmf, RFC 4733 from a pcap, sent payload types other than the
# one its SDP offered: 96 or 97 for 101); the RFC 4733 path is test_rtp_checks_dtmf_and_a_second_call_unaffected's
SIPP_KEY = """  <send retrans="500">
    <![CDATA[
      INFO [next_url] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:bot@[remote_ip]:[remote_port]>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: {cseq} INFO
      Contact: <sip:sipp@[local_ip]:[local_port]>
      Max-Forwards: 70
      Content-Type: application/dtmf-relay
      Content-Length: [len]

      Signal={key}
      Duration=160
    ]]>
  </send>
  <recv response="200"/>
  <pause milliseconds="300"/>
"""
SIPP_KEYPAD = ('  <nop><action><exec rtp_stream="{audio},1,0"/></action></nop>\n'
               + "".join(SIPP_KEY.replace("{cseq}", str(n)).replace("{key}", key) for n, key in enumerate("42#", 2)))


def sipp_call(service, tmp_path, scenario: str, pcm: np.ndarray, wait_s: float):
    """sipp runs `scenario` against the service, sending `pcm` (then silence, `wait_s` long) as its RTP;
    the test tells it to hang up (an INFO in the dialog) once the call's record has a reply. The record,
    and when the caller hung up (the clock of record.started)."""
    sipp = shutil.which("sipp")
    assert sipp is not None
    audio = tmp_path / "caller.ulaw"
    audio.write_bytes(ulaw_encode(np.concatenate([pcm, np.zeros(int(8000 * wait_s), np.int16)])))
    (tmp_path / "uac.xml").write_text(scenario.replace("{audio}", str(audio))
                                      .replace("{wait_ms}", str(int(wait_s * 1000))))
    media_port, sipp_port = free_even_udp_ports(4), free_udp_port()
    before = {r.id for r in calls.find("sip")}
    proc = subprocess.Popen([sipp, f"127.0.0.1:{service.sip_port}", "-sf", str(tmp_path / "uac.xml"), "-m", "1",
                             "-i", "127.0.0.1", "-p", str(sipp_port), "-mi", "127.0.0.1", "-mp", str(media_port),
                             "-nostdin", "-timeout", str(int(wait_s + 30)), "-timeout_error",
                             "-trace_err", "-error_file", str(tmp_path / "errors.log")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def new_call():
            new = [r for r in calls.find("sip") if r.id not in before]
            return new[0] if new else None

        record = wait_until(new_call, 20, "sipp's INVITE")
        wait_until(lambda: record.replies or record.ended, TIMEOUT, "the reply to go out")
        assert not record.ended, f"the call ended early: {record.end_reason}"
        time.sleep(0.5)  # the reply's last frames
        hung_up = time.monotonic()
        info = (f"INFO sip:sipp@127.0.0.1:{sipp_port} SIP/2.0\r\n"
                f"Via: SIP/2.0/UDP 127.0.0.1:{sipp_port};branch=z9hG4bK{uuid.uuid4().hex}\r\n"
                f"From: {record.meta['to']};tag=test\r\nTo: {record.meta['from']}\r\nCall-ID: {record.id}\r\n"
                "CSeq: 1 INFO\r\nMax-Forwards: 70\r\nContent-Length: 0\r\n\r\n")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(info.encode(), ("127.0.0.1", sipp_port))
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    errors = (tmp_path / "errors.log").read_text() if (tmp_path / "errors.log").exists() else ""
    assert proc.returncode == 0, f"sipp failed ({proc.returncode}):\n{out[-3000:]}\n{errors[-3000:]}"
    wait_until(lambda: record.ended, 10, "the BYE")
    assert record.end_reason == "caller_hangup"
    return record, hung_up


def test_sipp_calls_in_with_pcmu(service, require_system, tmp_path):
    """sipp calls in with PCMU, says a card list, and hangs up (BYE) once the reply has gone out: the
    test tells it so by an INFO in the dialog when the call's record has the reply, as the baresip
    test hangs up on it. (A fixed 20 s call was too short for a loaded 2-core AVX2 box: the reply
    started 11 s after the speech and the BYE cut it off, so the record had no reply.)"""
    require_system(shutil.which("sipp"), "sipp is not installed (apt-get install sip-tester)")
    # the RTP file keeps sending silence until the BYE (at the latest after TIMEOUT)
    record, hung_up = sipp_call(service, tmp_path, SIPP_SCENARIO,
                                np.concatenate([np.zeros(4000, np.int16), speech_8k("005.wav")]), TIMEOUT)
    assert record.codec == "PCMU"
    assert record.transcripts and {"spades", "hearts"} <= words(record.transcripts[0])
    c = record.counters
    assert c["packets_in"] > (hung_up - record.started) * 50 * 0.9 and c["packets_lost"] == 0  # 20 ms packets
    assert c["packets_out"] == c["frames_out"] > 25, "our reply went out as RTP"
    assert c["frames_out_voiced"] > 10, "the reply is not silence"
    assert record.replies and record.heard
    assert record.latency and record.latency[0]["voice_to_voice"] > 0
    print(f"\nsipp call latency (ms): {record.latency[0]}")


def test_sipp_presses_keys_by_sip_info(service, require_system, tmp_path):
    """sipp presses 4, 2 and # (SIP INFO, application/dtmf-relay): one turn, which reaches the LM
    within 100 ms of the # and is answered."""
    require_system(shutil.which("sipp"), "sipp is not installed (apt-get install sip-tester)")
    scenario = SIPP_SCENARIO.replace('  <nop><action><exec rtp_stream="{audio},1,0"/></action></nop>\n', SIPP_KEYPAD)
    record, _ = sipp_call(service, tmp_path, scenario.replace("CSeq: 2 BYE", "CSeq: 5 BYE"),
                          np.zeros(4000, np.int16), TIMEOUT)
    assert record.dtmf == ["4", "2", "#"]
    assert record.transcripts[0] == "(keypad) The caller pressed 4 2."
    assert record.replies[0].strip() and record.counters["frames_out_voiced"] > 10
    asked = record.marks[0]["work"]["lm_asked"]
    print(f"\nsipp keypad: the LM was asked {asked} ms after the #; latency (ms): {record.latency[0]}")
    assert asked < 100


GREETING = "Hello, thanks for calling. How can I help?"


@pytest.fixture
def greeting(service):
    """The service greets the calls of this test (`[telephony] greeting`, read when a call is answered)."""
    service.config.telephony.greeting = GREETING
    yield GREETING
    service.config.telephony.greeting = ""


def test_sipp_is_greeted_first(service, greeting, require_system, tmp_path):
    """Answered, the call hears the greeting at once (goal: first audio within 500 ms of our 200 OK); it is
    the call's first reply, recorded as a turn without a transcript, and the LM's history starts with it."""
    require_system(shutil.which("sipp"), "sipp is not installed (apt-get install sip-tester)")
    record, _ = sipp_call(service, tmp_path, SIPP_SCENARIO, np.zeros(4000, np.int16), TIMEOUT)
    assert record.answered is not None and record.first_audio is not None
    greeting_ms = (record.first_audio - record.answered) * 1000
    print(f"\nsipp greeting: first audio {greeting_ms:.0f} ms after the 200 OK")
    assert record.replies[0] == greeting and not record.transcripts
    assert record.counters["frames_out_voiced"] > 10
    assert greeting_ms < 1500  # the goal is 500 (BENCHMARKS.md); a loaded shared box gets some slack


BARESIP_CONFIG = """poll_method		epoll
net_interface		127.0.0.1
sip_listen		127.0.0.1:{sip_port}
call_local_timeout	120
audio_source		aufile,{wav}
audio_level		no
rtp_ports		{rtp_lo}-{rtp_hi}
jitter_buffer_delay	5-10
module_path		/usr/lib/baresip/modules
module			g711.so
module			aufile.so
module			sndfile.so
module			menu.so
module_app		account.so
snd_path		{out}
"""


def baresip_call(service, require_system, tmp_path, pcm: np.ndarray, done) -> tuple:
    """baresip calls the service with `pcm` as its microphone (8 kHz WAV; silence after it) and records what
    it hears; it hangs up (SIGTERM: BYE) once `done(record)`. The call's record and baresip's recording."""
    baresip = shutil.which("baresip")
    require_system(baresip, "baresip is not installed (apt-get install baresip-core)")
    modules = Path("/usr/lib/baresip/modules")
    require_system(all((modules / m).exists() for m in ("g711.so", "aufile.so", "sndfile.so", "menu.so")),
                   f"baresip modules missing in {modules}")
    wav = tmp_path / "caller.wav"  # baresip's aufile wants the codec's rate: 8 kHz mono S16LE
    pcm = np.concatenate([pcm, np.zeros(8000 * 120, np.int16)])
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(pcm.tobytes())
    rtp_lo = free_even_udp_ports(20)
    (tmp_path / "config").write_text(BARESIP_CONFIG.format(sip_port=free_udp_port(), wav=wav, rtp_lo=rtp_lo,
                                                           rtp_hi=rtp_lo + 19, out=tmp_path))
    # A-law first: the endpoint must take the caller's first supported codec
    (tmp_path / "accounts").write_text("<sip:caller@127.0.0.1>;regint=0;audio_codecs=PCMA,PCMU\n")
    before = {r.id for r in calls.find("sip")}
    log = open(tmp_path / "baresip.log", "wb")
    proc = subprocess.Popen([baresip, "-f", str(tmp_path), "-e", f"/dial sip:bot@127.0.0.1:{service.sip_port}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path)
    try:
        def new_call():
            new = [r for r in calls.find("sip") if r.id not in before]
            return new[0] if new else None

        record = wait_until(new_call, 20, "baresip's INVITE")
        wait_until(lambda: done(record) or record.ended, TIMEOUT, "the reply to be played")
        assert not record.ended, f"the call ended early: {record.end_reason}"
        time.sleep(0.5)  # the last packets through baresip's jitter buffer
        proc.send_signal(signal.SIGTERM)  # baresip hangs up (BYE) and exits
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    wait_until(lambda: record.ended, 10, "the BYE")
    assert record.end_reason == "caller_hangup"
    assert record.codec == "PCMA"
    dumps = sorted(tmp_path.glob("dump-*-dec.wav"))
    assert dumps, f"baresip recorded nothing; log:\n{(tmp_path / 'baresip.log').read_bytes()[-3000:]!r}"
    with wave.open(str(dumps[-1])) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (8000, 1, 2)
        heard = pcm16_to_float(w.readframes(w.getnframes()))
    return record, heard


def transcribed(service, heard: np.ndarray) -> str:
    async def transcribe() -> str:
        transcriber = StreamingTranscriber(service.instance.whisper, AsrConfig())
        transcriber.insert_audio_chunk(resample(heard, 8000, 16000))
        return await transcriber.finish()

    return asyncio.run(transcribe())


def test_baresip_calls_in_and_hears_the_reply(service, require_system, tmp_path):
    record, heard = baresip_call(service, require_system, tmp_path,
                                 np.concatenate([np.zeros(4000, np.int16), speech_8k("005.wav")]),
                                 lambda record: record.replies)
    assert record.transcripts and {"spades", "hearts"} <= words(record.transcripts[0])
    assert record.counters["packets_lost"] == 0 and record.counters["frames_out"] > 25
    assert len(heard) / 8000 > 0.5, f"baresip heard only {len(heard) / 8000:.2f} s"
    assert rms_dbfs(heard) > -40.0, "what baresip heard is silence"
    text = transcribed(service, heard)
    reply = " ".join(record.replies)
    print(f"\nbaresip heard: {text!r}; the server said: {reply!r}; latency (ms): {record.latency[0]}")
    assert words(text), "the reply baresip recorded has no words in it"
    assert words(text) & words(reply), f"heard {text!r}, but the server said {reply!r}"


def test_baresip_hears_the_greeting(service, greeting, require_system, tmp_path):
    """baresip calls and says nothing: what it records begins with the greeting (voiced within its first
    second), and the words are the greeting's."""
    record, heard = baresip_call(service, require_system, tmp_path, np.zeros(800, np.int16),  # played out:
                                 lambda record: record.replies and time.monotonic() - record.first_audio > 4.0)
    frames = heard[:len(heard) // 160 * 160].reshape(-1, 160)
    voiced = np.flatnonzero(np.sqrt(np.mean(frames ** 2, axis=1)) > 0.01)  # > -40 dBFS
    assert voiced.size, "baresip heard nothing"
    first_s = voiced[0] * 0.02
    text = transcribed(service, heard)
    print(f"\nbaresip: the greeting starts {first_s:.2f} s into its recording; heard {text!r}")
    assert first_s < 1.0
    assert len(words(text) & words(greeting)) >= 5, f"heard {text!r}"


def test_invite_past_capacity_gets_503_with_retry_after(service):
    """Issue 59: at the instance's measured capacity an INVITE is answered 503 with when to try
    again (a proxy tries another server), where a count limit is 486 Busy Here."""
    class Full:  # a measured capacity with no room left
        retry_after_s, load, cores = 7, 1.9, 2

        def admits(self, sessions: int) -> bool:
            return False
    admission = service.instance.admission
    admission.capacity = Full()
    phone = Phone(service)
    try:
        branch = phone.request("INVITE", phone.offer("0", ["0 PCMU/8000"]))
        _, r = phone.final()
        assert (r.status, r.h("retry-after")) == (503, "7") and "capacity" in r.h("warning"), r
        phone.to_tag = r.to_tag
        phone.request("ACK", branch=branch, cseq=1)
        assert sip_record(phone.call_id) is None, "no call, no session"
    finally:
        admission.capacity = None
        phone.close()
