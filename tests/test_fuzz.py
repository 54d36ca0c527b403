"""Fuzzing every parser on the wire with hypothesis (no models, no network).

Each parser may only fail with its documented exception type (ProtocolError, SipError,
SdpError, RtpError, APIError), never anything else, and never hang: every example runs under
a SIGALRM watchdog. The stateful handlers (a Twilio call, the SIP endpoint) are driven with
sequences of malformed and half-valid messages around the fake models of tests/fakes.py and
must swallow all of it. The live-server versions (the server keeps serving afterwards) are in
tests/test_reliability.py. How many inputs each parser saw is printed after the module (pytest -s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import fake_instance, make_config
from strategies import INVITE, SDP, json_scalar, json_value, sdp_texts, sip_datagrams, start_messages, twilio_messages
from voice.audio import RATES
from voice.config import SipConfig
from voice.transports import native, rtp, sdp, twilio
from voice.transports.sip import SipEndpoint
from voice.transports.sipmsg import SipError, SipMessage, response, response_destination, uri_hostport

PURE = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
STATEFUL = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
HANG_S = 5.0  # one example taking longer than this is a hang
FUZZ_COUNTS: dict[str, int] = {}


@pytest.fixture(scope="module", autouse=True)
def fuzz_report():
    yield
    print("\nfuzz inputs tried:", json.dumps(FUZZ_COUNTS, indent=1), "total", sum(FUZZ_COUNTS.values()))


@contextlib.contextmanager
def no_hang(what: str, seconds: float = HANG_S):
    def alarm(signum, frame):
        raise TimeoutError(f"{what} hung for more than {seconds} s")

    FUZZ_COUNTS[what] = FUZZ_COUNTS.get(what, 0) + 1
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# --- native protocol ---------------------------------------------------------------------------

@PURE
@given(start_messages())
def test_parse_start_only_raises_protocol_errors(text):
    with no_hang("native parse_start"):
        try:
            start = native.parse_start(text)
        except native.ProtocolError as err:
            assert err.code in {"bad_json", "expected_start", "unsupported_version", "bad_sample_rate",
                                "bad_encoding", "bad_session"}
            return
    # accepted: exactly the documented shape, with integer rates from the list
    assert type(start["in_rate"]) is int and start["in_rate"] in RATES
    assert type(start["out_rate"]) is int and start["out_rate"] in RATES
    assert start["lm_mode"] in (None, "ar", "diffusion")
    assert start["system_prompt"] is None or isinstance(start["system_prompt"], str)


def test_parse_start_rejects_float_and_bool_rates():
    for bad in ({"sample_rate": 16000.0}, {"sample_rate": 16000, "output_sample_rate": 24000.0},
                {"sample_rate": 16000, "version": True}):
        with pytest.raises(native.ProtocolError):
            native.parse_start(json.dumps({"type": "start", **bad}))


class _ErrorSink:
    def __init__(self):
        self.errors: list[str] = []

    def error(self, code: str, message: str) -> None:
        assert isinstance(message, str) and len(message) < 500
        self.errors.append(code)


@PURE
@given(st.one_of(start_messages(), st.text(max_size=300)))
def test_control_messages_after_start_are_answered_with_one_error(text):
    sink = _ErrorSink()
    with no_hang("native control message"):
        native._control(sink, text)
    assert len(sink.errors) == 1 and sink.errors[0] in {"bad_json", "already_started", "unknown_message",
                                                         "bad_dtmf"}


# --- Twilio Media Streams ---------------------------------------------------------------------

class FakeWebSocket:
    client = None

    def __init__(self):
        self.sent: list[str] = []
        self.closed = False

    async def send_text(self, text: str) -> None:
        self.sent.append(text)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed = True


@pytest.fixture(scope="module")
def instance():
    return fake_instance(make_config())


@STATEFUL
@given(st.lists(twilio_messages(), min_size=1, max_size=12))
def test_twilio_messages_are_dropped_or_handled_never_raised(instance, messages):
    async def scenario():
        call = twilio.TwilioCall(FakeWebSocket(), instance)
        try:
            for text in messages:
                result = await call.handle(text)
                assert result in (None, "stop")
                if result == "stop":
                    break
        finally:
            await call.end("test")
        return call

    with no_hang("twilio message sequence"):
        call = asyncio.run(scenario())
    assert call.session is None or call.session.closed
    assert not instance.live, "a session outlived its call"


# --- SIP, SDP, RTP ----------------------------------------------------------------------------

@PURE
@given(sip_datagrams())
def test_sip_message_parse_only_raises_sip_errors(data):
    with no_hang("SipMessage.parse"):
        try:
            msg = SipMessage.parse(data)
        except SipError:
            return
        # anything that parses can be answered and serialised
        assert msg.call_id is not None and msg.cseq[1]
        if msg.is_request:
            resp = response(msg, 400, ("127.0.0.1", 5099), "tag")
            SipMessage.parse(resp.to_bytes())
            response_destination(msg, ("127.0.0.1", 5099))
        for value in msg.all("contact") + msg.all("route"):
            with contextlib.suppress(SipError):
                uri_hostport(value.strip("<>"))


@PURE
@given(sdp_texts())
def test_sdp_parse_only_raises_sdp_errors_and_answers_are_well_formed(text):
    with no_hang("sdp.parse"):
        try:
            offer = sdp.parse(text)
        except sdp.SdpError:
            return
        answer = sdp.negotiate(offer, ["PCMU", "PCMA"])
        if answer is None:
            return
        assert 0 <= answer.remote[1] <= 65535 and 0 <= answer.payload_type < 128
        body = sdp.answer_sdp(answer, "127.0.0.1", 20000, 1, 1)
        assert sdp.parse(body).media[answer.index].port == 20000


def test_sdp_refuses_host_names_and_bad_ports():
    for bad in ("c=IN IP4 evil.example.com", "m=audio 70000 RTP/AVP 0", "m=audio -5 RTP/AVP 0",
                "m=audio \u0663 RTP/AVP 0"):
        with pytest.raises(sdp.SdpError):
            sdp.parse(SDP.replace("c=IN IP4 127.0.0.1", bad) if bad.startswith("c=") else
                      SDP.replace("m=audio 40000 RTP/AVP 0 8 101", bad))


@PURE
@given(st.one_of(st.binary(max_size=300),
                 st.builds(lambda head, rest: bytes([0x80 | head[0] & 0x3F]) + head[1:] + rest,
                           st.binary(min_size=12, max_size=12), st.binary(max_size=200))))
def test_rtp_parse_only_raises_rtp_errors(data):
    with no_hang("RtpPacket.parse"):
        try:
            pkt = rtp.RtpPacket.parse(data)
        except rtp.RtpError:
            return
        assert 0 <= pkt.payload_type < 128 and len(pkt.payload) <= len(data)
        with contextlib.suppress(rtp.RtpError):
            rtp.TelephoneEvent.parse(pkt.payload)
        with contextlib.suppress(rtp.RtpError):
            rtp.DtmfReceiver().push(pkt.timestamp, pkt.payload)


@PURE
@given(st.lists(st.tuples(st.integers(0, 0xFFFF), st.binary(min_size=1, max_size=4)), max_size=80))
def test_jitter_buffer_stays_bounded(packets):
    jb = rtp.JitterBuffer()
    with no_hang("JitterBuffer"):
        for seq, payload in packets:
            out = jb.push(seq, payload)
            assert len(out) <= jb.max_gap + jb.depth + 1
            assert len(jb.held) <= jb.depth


@STATEFUL
@given(st.lists(sip_datagrams(), min_size=1, max_size=6))
def test_sip_endpoint_survives_any_datagrams(instance, datagrams):
    class Transport:
        def __init__(self):
            self.sent: list[tuple[bytes, tuple]] = []

        def sendto(self, data, addr):
            self.sent.append((data, addr))

        def close(self):
            pass

    async def scenario():
        ep = SipEndpoint(instance, SipConfig(port=0, rtp_port_min=41000, rtp_port_max=41099))
        ep.transport = Transport()
        try:
            for data in datagrams:
                ep.datagram(data, ("127.0.0.1", 5099))  # raising here would be a bug (the socket layer logs it)
                for _ in range(3):
                    await asyncio.sleep(0)
            for _ in range(5):
                await asyncio.sleep(0.01)  # answering a call binds RTP and opens a session
        finally:
            await ep.stop()
        for data, _ in ep.transport.sent:  # everything we sent is a parseable SIP message
            SipMessage.parse(data)

    with no_hang("SIP endpoint datagram sequence", 15.0):
        asyncio.run(scenario())
    assert not instance.live


def test_sip_allow_list_drops_other_sources_silently(instance):
    class Transport:
        sent: list = []

        def sendto(self, data, addr):
            self.sent.append(addr)

    ep = SipEndpoint(instance, SipConfig(port=0, allow=["10.1.0.0/16", "192.0.2.7"]))
    ep.transport = Transport()
    options = INVITE.format(length=0, body="").replace("INVITE", "OPTIONS").replace("application/sdp", "x")
    ep.datagram(options.encode(), ("198.51.100.9", 5060))
    assert Transport.sent == []  # not even an answer
    ep.datagram(options.encode(), ("192.0.2.7", 5060))
    ep.datagram(options.encode(), ("10.1.200.3", 5060))
    assert [a[0] for a in Transport.sent] == ["192.0.2.7", "10.1.200.3"]
    assert ep.allowed("::ffff:192.0.2.7") and not ep.allowed("not-an-ip")


# --- engine serve ------------------------------------------------------------------------------

@PURE
@given(st.one_of(json_value, st.fixed_dictionaries({"messages": st.one_of(json_value, st.lists(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), json_scalar),
                           "content": st.one_of(st.text(max_size=40), json_value)}), max_size=3))},
    optional={k: json_value for k in ("max_tokens", "temperature", "stream", "mode", "rule", "block_size", "seed",
                                      "stream_options", "stop", "n", "threshold", "top_p")})))
def test_engine_parse_request_only_raises_api_errors(body):
    from engine.decode import DecodeConfig
    from engine.api.requests import APIError, parse_request
    with no_hang("engine parse_request"):
        try:
            messages, cfg, opts = parse_request(body, DecodeConfig(), 2048)
        except APIError as err:
            assert 400 <= err.status < 500 and err.message
            return
    assert messages and all(isinstance(m["content"], str) for m in messages)
    assert 1 <= cfg.max_new_tokens <= 2048 and isinstance(opts.stream, bool)

