"""A phone agent's tools (voice/conversation/calltools.py): end_call and transfer_call against real peers.

SIPp plays the caller's phone (it presses keys by SIP INFO; the scripted LM then calls the tool): the
goodbye played, then our BYE; a REFER it accepts (202, NOTIFY 100 then 200: our BYE), one it refuses
(603), one whose new call fails (NOTIFY 503): the caller stays and the LM is told. Twilio: the
media-stream client of tests/test_twilio.py and a stand-in of Twilio's REST API that checks the request
as Twilio documents it. The models are the instant stand-ins of tests/fakes.py: what is tested is the
telephony around them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from urllib.parse import parse_qs

import numpy as np
import pytest
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fakes import FakeLM, fake_instance, make_config
from liveserver import serving
from test_sip import SIPP_DIAL, SIPP_KEY, free_even_udp_ports, free_udp_port, wait_until
from test_sip import Phone as RawPhone
from test_twilio import FakeTwilio, record_for
from voice.audio import ulaw_encode
from voice.conversation.calltools import CALL_GATES, call_gate, call_prompt, call_tools
from voice.conversation.session import Session
from voice.config import TelephonyConfig
from voice.service.records import read_sessions
from voice.service.server import build_app
from voice.pipeline.lm import LocalChat
from voice.pipeline.tools import ToolError
from voice.transports.telephony import calls

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]

DESK = "sip:desk@127.0.0.1:5099"
GOODBYE = ("Goodbye,", " thanks for calling.")
ACCOUNT, TOKEN = "AC" + "0" * 32, "twilio-test-token"


def tool_call(name: str, **args) -> list[dict]:
    return [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]


class TwilioRest:
    """Twilio's REST API as published (POST /2010-04-01/Accounts/{AccountSid}/Calls/{CallSid}.json,
    form-encoded, HTTP Basic AccountSid:AuthToken), answering as Twilio does; it keeps what it was sent."""

    def __init__(self) -> None:
        self.updates: list[dict] = []
        self.refuse = False
        self.app = Starlette(routes=[Route("/2010-04-01/Accounts/{account}/Calls/{call}.json", self.update,
                                           methods=["POST"])])

    async def update(self, request: Request) -> JSONResponse:
        account, call = request.path_params["account"], request.path_params["call"]
        expected = "Basic " + base64.b64encode(f"{ACCOUNT}:{TOKEN}".encode()).decode()
        if request.headers.get("authorization") != expected or account != ACCOUNT:
            return JSONResponse({"code": 20003, "message": "Authenticate", "status": 401}, 401)
        if request.headers.get("content-type") != "application/x-www-form-urlencoded":
            return JSONResponse({"code": 20001, "message": "not form-encoded", "status": 400}, 400)
        form = {k: v[0] for k, v in parse_qs((await request.body()).decode(), strict_parsing=True).items()}
        self.updates.append({"call": call, **form})
        if self.refuse:
            return JSONResponse({"code": 21220, "message": "Invalid call state for redirection", "status": 400}, 400)
        return JSONResponse({"sid": call, "account_sid": account, "status": form.get("Status", "in-progress")})


@pytest.fixture(scope="module")
def rest():
    stand_in = TwilioRest()
    with serving(stand_in.app) as port:
        stand_in.base = f"http://127.0.0.1:{port}"
        yield stand_in


@pytest.fixture(scope="module")
def service(rest, tmp_path_factory):
    config = make_config(telephony={"tools": ["end_call", "transfer_call", "read_keypad"], "keypad_timeout_s": 5.0,
                                    "transfer_targets": {"desk": DESK, "sales": "+14155550100"},
                                    "transfer_timeout_s": 10.0, "twilio_api_base": rest.base})
    config.records.path = str(tmp_path_factory.mktemp("records") / "records.sqlite3")
    config.sip.port = free_udp_port()
    config.sip.rtp_port_min = free_even_udp_ports(20)
    config.sip.rtp_port_max = config.sip.rtp_port_min + 19
    lm = FakeLM(GOODBYE)
    app = build_app(config, fake_instance(config, lm=lm))
    mp = pytest.MonkeyPatch()
    with serving(app) as port:
        # the REST API's credential, read when a call is updated; set once the app runs, so that its websocket
        # does not ask for Twilio's signature too (test_auth.py tests that)
        mp.setenv("TWILIO_AUTH_TOKEN", TOKEN)
        yield type("Service", (), {"config": config, "lm": lm, "port": port, "sip_port": config.sip.port})
    mp.undo()


@pytest.fixture(autouse=True)
def fresh_lm(service, rest):
    service.lm.asked.clear()
    service.lm.tool_calls = []
    rest.updates.clear()
    rest.refuse = False
    yield


# --- the executor --------------------------------------------------------------------------------------


class Phone:
    def __init__(self) -> None:
        self.transfers: list[tuple[str, str]] = []

    async def transfer(self, name: str, target: str) -> str | None:
        self.transfers.append((name, target))
        return None


async def no_keys(prompt: str) -> str | None:
    return None


def test_transfer_targets_are_an_enum_and_nothing_else_is_dialled():
    config = TelephonyConfig(tools=["end_call", "transfer_call"], transfer_targets={"desk": DESK, "sales": "+1415"})
    phone, ended = Phone(), []
    tools = call_tools(config, phone, ended.append, no_keys)
    assert tools["transfer_call"].parameters["properties"]["target"]["enum"] == ["desk", "sales"]

    async def run(args: dict) -> str:
        return await tools["transfer_call"].run(args, None)  # type: ignore[arg-type]  # (no timers used)

    for bad in ({"target": "+15551234567"}, {"target": DESK}, {"target": ["desk"]}, {}):
        with pytest.raises(ToolError, match="not a transfer target"):
            asyncio.run(run(bad))
    assert phone.transfers == [], "nothing outside the configuration was dialled"
    assert asyncio.run(run({"target": "desk"})) == "the caller is transferred to desk"
    assert phone.transfers == [("desk", DESK)]
    asyncio.run(tools["end_call"].run({}, None))  # type: ignore[arg-type]
    assert ended == ["end_call"]
    assert call_tools(TelephonyConfig(), phone, ended.append, no_keys) == {}, "none unless configured"


def test_telephony_config_is_checked():
    for bad in ({"tools": ["hang_up"]}, {"tools": ["transfer_call"]},
                {"transfer_targets": {"desk": "http://x"}}, {"transfer_targets": {"a b": "+1415"}},
                {"twilio_account_sid": "AC123"}, {"twilio_account_sid": "CA" + "0" * 32}):
        with pytest.raises(ValueError, match="telephony"):
            TelephonyConfig(**bad)


# --- SIP: SIPp calls in, presses 1 #, the LM calls the tool ----------------------------------------------

UAC = SIPP_DIAL + """{keys}{then}
</scenario>
"""
OK = """  <send>
    <![CDATA[
      SIP/2.0 {status}
      [last_Via:]
      [last_From:]
      [last_To:]
      [last_Call-ID:]
      [last_CSeq:]
      Contact: <sip:sipp@[local_ip]:[local_port]>
      Content-Length: 0
    ]]>
  </send>
"""
BYE_FROM_US = '  <recv request="BYE" timeout="20000"/>\n' + OK.replace("{status}", "200 OK")
HANG_UP = """  <pause milliseconds="3000"/>
  <send retrans="500">
    <![CDATA[
      BYE [next_url] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:bot@[remote_ip]:[remote_port]>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: 9 BYE
      Max-Forwards: 70
      Content-Length: 0
    ]]>
  </send>
  <recv response="200"/>
"""
REFER = """  <recv request="REFER" timeout="20000">
    <action><ereg regexp="Refer-To: &lt;{target}&gt;" search_in="msg" check_it="true" assign_to="1"/></action>
  </recv>
  <Reference variables="1"/>
"""
NOTIFY = """  <send retrans="500">
    <![CDATA[
      NOTIFY [next_url] SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
      To: <sip:bot@[remote_ip]:[remote_port]>[peer_tag_param]
      Call-ID: [call_id]
      CSeq: {cseq} NOTIFY
      Contact: <sip:sipp@[local_ip]:[local_port]>
      Event: refer
      Subscription-State: {state}
      Max-Forwards: 70
      Content-Type: message/sipfrag;version=2.0
      Content-Length: [len]

      SIP/2.0 {status}
    ]]>
  </send>
  <recv response="200"/>
"""


def notify(cseq: int, status: str, final: bool) -> str:
    return NOTIFY.replace("{cseq}", str(cseq)).replace("{status}", status).replace(
        "{state}", "terminated;reason=noresource" if final else "active;expires=60")


def sipp(service, tmp_path, then: str):
    """SIPp calls, presses 1 and # by SIP INFO, then plays `then`; the call's record once it ended."""
    sipp = shutil.which("sipp")
    assert sipp is not None
    audio = tmp_path / "silence.ulaw"
    audio.write_bytes(ulaw_encode(np.zeros(8000 * 30, np.int16)))
    keys = "".join(SIPP_KEY.replace("{cseq}", str(n)).replace("{key}", key) for n, key in enumerate("1#", 2))
    keys = keys[:keys.rindex("  <pause")]  # after the #, the answer comes at once (instant stand-in models)
    (tmp_path / "uac.xml").write_text(UAC.replace("{audio}", str(audio)).replace("{keys}", keys)
                                      .replace("{then}", then))
    before = {r.id for r in calls.find("sip")}
    proc = subprocess.run([sipp, f"127.0.0.1:{service.sip_port}", "-sf", str(tmp_path / "uac.xml"), "-m", "1",
                           "-i", "127.0.0.1", "-p", str(free_udp_port()), "-mi", "127.0.0.1",
                           "-mp", str(free_even_udp_ports(4)), "-nostdin", "-timeout", "40", "-timeout_error",
                           "-trace_err", "-error_file", str(tmp_path / "errors.log")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    errors = (tmp_path / "errors.log").read_text() if (tmp_path / "errors.log").exists() else ""
    assert proc.returncode == 0, f"sipp failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{errors[-3000:]}"
    record = wait_until(lambda: next((r for r in calls.find("sip") if r.id not in before and r.ended), None), 10,
                        "the call to end")
    return record


def told(service) -> str:
    """What the LM was told last (the tools' results are folded into the user's message)."""
    return service.lm.asked[-1][0][-1]["content"]


def test_sipp_end_call_says_goodbye_then_bye(service, require_system, tmp_path):
    require_system(shutil.which("sipp"), "sipp is not installed (apt-get install sip-tester)")
    service.lm.tool_calls = tool_call("end_call")
    record = sipp(service, tmp_path, BYE_FROM_US)
    assert record.end_reason == "end_call"
    assert record.replies == ["Goodbye, thanks for calling."]
    played_s = record.counters["frames_out"] * 0.02
    assert record.counters["frames_out_voiced"] > 10 and played_s > 1.0
    assert record.first_audio is not None and record.ended - record.first_audio >= played_s - 0.1, \
        "the BYE came before the goodbye had played"
    assert "Result of end_call" in told(service)


def test_sipp_accepts_the_refer_and_we_hang_up(service, require_system, tmp_path):
    require_system(shutil.which("sipp"), "sipp is not installed (apt-get install sip-tester)")
    service.lm.tool_calls = tool_call("transfer_call", target="desk")
    then = (REFER.replace("{target}", DESK) + OK.replace("{status}", "202 Accepted")
            + notify(4, "100 Trying", False) + notify(5, "200 OK", True) + BYE_FROM_US)
    record = sipp(service, tmp_path, then)
    assert record.end_reason == "transfer:desk" and record.counters["transfers"] == 1
    [row] = wait_until(lambda: [s for s in read_sessions(service.config.records.path, limit=100)
                                if s["meta"].get("call_id") == record.id and s["ended"]], 10, "the record")
    assert (row["end_reason"], row["dtmf"]) == ("transfer:desk", "1#")


@pytest.mark.parametrize("refusal", ["603", "notify-503"])
def test_a_refused_transfer_keeps_the_caller(service, require_system, tmp_path, refusal):
    """The caller's phone declines the REFER (603), or takes it and the new call fails (NOTIFY 503): the
    call goes on (SIPp hangs up itself later: a BYE of ours would fail its scenario), the LM is told."""
    require_system(shutil.which("sipp"), "sipp is not installed (apt-get install sip-tester)")
    service.lm.tool_calls = tool_call("transfer_call", target="desk")
    then = REFER.replace("{target}", DESK) + (
        OK.replace("{status}", "603 Decline") if refusal == "603"
        else OK.replace("{status}", "202 Accepted") + notify(4, "503 Service Unavailable", True)) + HANG_UP
    record = sipp(service, tmp_path, then)
    assert record.end_reason == "caller_hangup" and not record.counters["transfers"]
    assert "transfer_call failed: the transfer to desk failed" in told(service)
    assert ("SIP 603" if refusal == "603" else "SIP 503") in told(service)
    assert record.replies == ["Goodbye, thanks for calling."], "the assistant spoke after the failure"


def test_sipp_an_invented_target_is_refused_without_a_refer(service, require_system, tmp_path):
    """The LM (scripted: the grammar would not let the real one write it) asks for a number the caller said:
    no REFER goes out (SIPp's scenario would fail on one), the call goes on, the LM is told the targets."""
    require_system(shutil.which("sipp"), "sipp is not installed (apt-get install sip-tester)")
    service.lm.tool_calls = tool_call("transfer_call", target="+15551234567")
    record = sipp(service, tmp_path, HANG_UP)
    assert record.end_reason == "caller_hangup" and not record.counters["transfers"]
    assert "'+15551234567' is not a transfer target; the targets are desk, sales" in told(service)


def raw_notify(phone: RawPhone, status: str, final: bool = False, event: str = "refer") -> None:
    phone.cseq += 1
    body = f"SIP/2.0 {status}\r\n"
    uri = f"sip:bot@127.0.0.1:{phone.server[1]}"
    phone.send_raw("\r\n".join([
        f"NOTIFY {uri} SIP/2.0", f"Via: SIP/2.0/UDP 127.0.0.1:{phone.port};branch=z9hG4bK{phone.cseq}n;rport",
        "Max-Forwards: 70", f"From: <sip:phone@127.0.0.1>;tag={phone.tag}", f"To: <{uri}>;tag={phone.to_tag}",
        f"Call-ID: {phone.call_id}", f"CSeq: {phone.cseq} NOTIFY", f"Event: {event}",
        f"Subscription-State: {'terminated' if final else 'active;expires=60'}",
        "Content-Type: message/sipfrag", f"Content-Length: {len(body)}", "", body]).encode())


def response_to(request, status: str) -> bytes:
    """The phone's response to our request ("202 Accepted" to a REFER: RFC 3515)."""
    echoed = [f"{name}: {request.h(name)}" for name in ("via", "from", "to", "call-id", "cseq")]
    return "\r\n".join([f"SIP/2.0 {status}", *echoed, "Content-Length: 0", "", ""]).encode()


def the_caller_stays_then_hangs_up(phone: RawPhone) -> None:
    """After a failed transfer the call is up and no transfer counted; the caller's BYE ends it, and the record
    says they hung up."""
    record = next(r for r in calls.find("sip") if r.id == phone.call_id)
    assert not record.ended and not record.counters["transfers"]
    caller_hangs_up(phone)
    wait_until(lambda: record.ended, 10, "the call to end")
    assert record.end_reason == "caller_hangup"


@contextlib.contextmanager
def a_call_keying_for(service, tool_calls) -> Iterator[RawPhone]:
    """A raw phone's call, µ-law, in which the caller keys 1 # for the stand-in LM's `tool_calls`; hung up after."""
    service.lm.tool_calls = tool_calls
    phone = RawPhone(service)
    try:
        phone.call(formats="0", rtpmap=("0 PCMU/8000",))
        press_for_the_tool(phone)
        yield phone
    finally:
        phone.close()


def press_for_the_tool(phone: RawPhone) -> None:
    """The caller keys 1 # over SIP INFO: the turn on which the stand-in LM calls its tool."""
    for key in "1#":
        phone.request("INFO", f"Signal={key}\r\nDuration=160\r\n", ctype="application/dtmf-relay")


def requests_from_us(phone: RawPhone, method: str, count: int, timeout_s: float) -> list:
    """Our next `count` requests of `method` to the phone, each with when it came (every other message a 200)."""
    got = []
    while len(got) < count:
        message = phone.recv(timeout_s)
        if message.method == method:
            got.append((time.monotonic(), message))
        else:
            assert message.status == 200, message
    return got


def caller_hangs_up(phone: RawPhone) -> None:
    phone.request("BYE")
    while phone.recv().status != 200:
        pass


def test_stray_and_flooded_notifies_change_nothing(service):
    """A NOTIFY outside a transfer is 481 and the call goes on; during one, NOTIFYs of progress are taken
    and change nothing, and a final 486 in one fails the transfer: the caller stays. (Finals are queued,
    bounded: a flood of them is dropped and counted.)"""
    service.lm.tool_calls = tool_call("transfer_call", target="sales")
    phone = RawPhone(service)
    try:
        phone.call(formats="0", rtpmap=("0 PCMU/8000",))
        raw_notify(phone, "200 OK", final=True)
        assert phone.recv().status == 481
        press_for_the_tool(phone)
        while (refer := phone.recv(10)).method != "REFER":
            assert refer.status == 200, refer
        assert refer.h("refer-to") == "<sip:+14155550100@127.0.0.1>", refer.h("refer-to")
        phone.send_raw(response_to(refer, "202 Accepted"))
        for _ in range(50):
            raw_notify(phone, "180 Ringing")
        assert [phone.recv().status for _ in range(50)] == [200] * 50
        raw_notify(phone, "486 Busy Here", final=True)
        assert phone.recv().status == 200
        wait_until(lambda: service.lm.asked and "SIP 486" in told(service), 10, "the LM to be told")
        the_caller_stays_then_hangs_up(phone)
    finally:
        phone.close()


def test_a_lost_refer_is_sent_again_t1_then_2t1_later(service):
    """Over UDP our REFER is a non-INVITE client transaction (RFC 3261 17.1.2.2): the phone drops the first two
    (as a lossy network would); the same REFER comes again 0.5 s, then 1 s later (Timer E from T1 doubling), and
    the transfer answered then completes; the phone's 202, sent twice, is taken once."""
    with a_call_keying_for(service, tool_call("transfer_call", target="desk")) as phone:
        (t0, first), (t1, second), (t2, refer) = requests_from_us(phone, "REFER", 3, 10)
        same = [(m.start, m.headers, m.body) for m in (first, second, refer)]
        assert same[0] == same[1] == same[2]  # the same request: its branch and CSeq too
        assert 0.35 < t1 - t0 < 0.9 and 0.8 < t2 - t1 < 1.5, (t1 - t0, t2 - t1)
        phone.send_raw(response_to(refer, "202 Accepted"))
        phone.send_raw(response_to(refer, "202 Accepted"))
        assert phone.nothing(1.2), "a REFER answered is not sent again"
        raw_notify(phone, "200 OK", final=True)
        assert phone.recv().status == 200
        assert phone.recv(10).method == "BYE"
    record = next(r for r in calls.find("sip") if r.id == phone.call_id)
    wait_until(lambda: record.ended, 10, "the call to end")
    assert record.end_reason == "transfer:desk" and record.counters["refer_retransmits"] == 2, record.counters


def test_a_refer_never_answered_times_out_and_the_caller_stays(service, monkeypatch):
    """No response to the REFER at all: after 64*T1 (Timer F; T1 shortened here) the transfer has failed,
    the REFER was sent 11 times (RFC 3261's figure), the LM is told, and the call goes on. A
    `transfer_timeout_s` shorter than Timer F does not cut the REFER's transaction short: it bounds the wait
    for the new call once the REFER is accepted."""
    import voice.transports.sip as sip
    monkeypatch.setattr(sip, "T1", 0.05)
    monkeypatch.setattr(sip, "T2", 0.4)
    monkeypatch.setattr(service.config.telephony, "transfer_timeout_s", 1.0)
    with a_call_keying_for(service, tool_call("transfer_call", target="desk")) as phone:
        wait_until(lambda: service.lm.asked and "did not answer the REFER" in told(service), 10, "the LM to be told")
        record = next(r for r in calls.find("sip") if r.id == phone.call_id)
        # sent again at 0.05, 0.15, 0.35, 0.75, then T2 apart to 3.15 s; Timer F at 64*T1 = 3.2 s
        assert record.counters["refer_retransmits"] == 10, record.counters
        the_caller_stays_then_hangs_up(phone)


def test_an_accepted_refer_without_a_final_notify_fails_after_transfer_timeout_s(service, monkeypatch):
    """The phone accepts the REFER (202) and its NOTIFYs never say how the new call ended: after
    `transfer_timeout_s` from the acceptance the transfer has failed, the LM is told, and the caller stays."""
    monkeypatch.setattr(service.config.telephony, "transfer_timeout_s", 1.0)
    with a_call_keying_for(service, tool_call("transfer_call", target="desk")) as phone:
        while (refer := phone.recv(10)).method != "REFER":
            assert refer.status == 200, refer
        phone.send_raw(response_to(refer, "202 Accepted"))
        accepted_at = time.monotonic()
        raw_notify(phone, "100 Trying")
        assert phone.recv().status == 200
        wait_until(lambda: service.lm.asked and "not completed in time" in told(service), 10, "the LM to be told")
        assert 0.9 < time.monotonic() - accepted_at < 3.0
        the_caller_stays_then_hangs_up(phone)


def test_a_lost_bye_is_sent_again_until_answered(service):
    """Our BYE after end_call is a non-INVITE client transaction over UDP as the REFER is: the phone drops the
    first (as a lossy network would), the same BYE comes again T1 (0.5 s) later, and once answered it is not
    sent again."""
    with a_call_keying_for(service, tool_call("end_call")) as phone:
        (t0, first), (t1, bye) = requests_from_us(phone, "BYE", 2, 15)
        assert (first.start, first.headers) == (bye.start, bye.headers)  # the same request: its branch and CSeq
        assert 0.35 < t1 - t0 < 0.9, t1 - t0
        phone.send_raw(response_to(bye, "200 OK"))
        assert phone.nothing(1.5), "a BYE answered is not sent again"
    record = next(r for r in calls.find("sip") if r.id == phone.call_id)
    assert record.end_reason == "end_call" and record.counters["bye_retransmits"] == 1, record.counters


# --- Twilio: the media stream and the REST stand-in ------------------------------------------------------


async def pressing(ws, sid: str, keys: str) -> FakeTwilio:
    """A Twilio media stream started on `ws` that presses `keys`."""
    twilio = FakeTwilio(ws, sid)
    await twilio.start()
    await asyncio.sleep(0.1)
    for key in keys:
        await twilio.send("dtmf", dtmf={"track": "inbound_track", "digit": key})
    return twilio


def twilio_call(service, sid: str, ended: bool = True):
    """A Twilio stream presses 1 #; the record, and what the client received, once the server closed it."""
    async def call():
        async with websockets.connect(f"ws://127.0.0.1:{service.port}/twilio", open_timeout=30) as ws:
            twilio = await pressing(ws, sid, "1#")
            if ended:
                await asyncio.wait_for(twilio.tasks[0], 20)  # the server closes the stream
            else:
                await twilio.wait(lambda: (r := record_for(sid)) is not None and r.replies, 20)
                await asyncio.sleep(0.5)
                await twilio.stop()
            for task in twilio.tasks:
                task.cancel()
            return twilio

    twilio = asyncio.run(call())
    return wait_until(lambda: (r := record_for(sid)) is not None and r.ended and r, 10, "the call to end"), twilio


def test_twilio_end_call_completes_the_call_through_the_rest_api(service, rest):
    service.lm.tool_calls = tool_call("end_call")
    sid = "MZ" + "a" * 32
    record, twilio = twilio_call(service, sid)
    assert record.end_reason == "end_call" and record.replies == ["Goodbye, thanks for calling."]
    assert len(twilio.events("media")) > 50, "the goodbye was sent before the stream closed"
    assert rest.updates == [{"call": "CA" + "a" * 32, "Status": "completed"}]
    [row] = wait_until(lambda: [s for s in read_sessions(service.config.records.path, limit=100)
                                if s["meta"].get("callSid") == "CA" + "a" * 32 and s["ended"]], 10, "the record")
    assert (row["end_reason"], row["dtmf"]) == ("end_call", "1#"), "the call records say how it ended, and the keys"
    assert [t["tools"][0]["name"] for t in row["turns"]] == ["end_call"]
    system = service.lm.asked[0][0][0]["content"]
    assert system == f"{service.config.lm.system_prompt} {service.config.telephony.call_prompt}", system


def test_the_call_prompt_is_added_only_with_end_call():
    assert call_prompt("Be brief.", TelephonyConfig(tools=["end_call"])) == \
        f"Be brief. {TelephonyConfig().call_prompt}"
    for config in (TelephonyConfig(), TelephonyConfig(tools=["read_keypad"]), TelephonyConfig(tools=["end_call"],
                                                                                                call_prompt="")):
        assert call_prompt("Be brief.", config) == "Be brief."


def test_a_call_offering_end_call_gates_tool_calls_at_the_models_phone_gate():
    """The 1.5B's replies on a call offering only end_call start a call at log-odds -3.3 (CALL_GATES), not its own
    -2.6, which ends 8/32 held-out goodbyes where -3.3 ends 17/32 (bench/call_end.py); the configured gate comes
    first; a call without end_call, with tools the gate was not measured with, another model, or a session that is
    no call keep the LM's own gate."""
    config = TelephonyConfig(tools=["end_call"])
    assert call_gate(config, "qwen2.5-1.5b", ["end_call"]) == CALL_GATES["qwen2.5-1.5b", ("end_call",)] == -3.3
    assert call_gate(TelephonyConfig(tools=["end_call"], tool_call_log_odds=-3.0), "qwen2.5-1.5b", ["end_call"]) == -3.0
    assert call_gate(config, "qwen2.5-1.5b", ["get_time", "end_call"]) is None
    assert call_gate(config, "qwen2.5-1.5b", ["transfer_call"]) is None
    assert call_gate(config, "qwen2.5-0.5b", ["end_call"]) is None

    class LocalFakeLM(FakeLM):  # the conversation the voice default has (no model loaded: no reply is made here)
        def chat(self):
            return LocalChat(self)
    config = make_config(telephony={"tools": ["end_call"]})
    config.lm.model = "qwen2.5-1.5b"
    instance = fake_instance(config, lm=LocalFakeLM())
    assert Session(instance, 8000, 8000, "sip", phone=Phone()).replies.chat.tool_call_log_odds == -3.3
    assert Session(instance, 16000, 16000).replies.chat.tool_call_log_odds is None
    config.tools.builtin = ["time"]  # a tool the gate was not measured with
    instance = fake_instance(config, lm=LocalFakeLM())
    assert Session(instance, 8000, 8000, "sip", phone=Phone()).replies.chat.tool_call_log_odds is None


def test_twilio_stream_of_another_account_is_refused(service, rest, monkeypatch):
    """With `telephony.twilio_account_sid` set, a stream whose start names another account is refused (the
    socket closes 1008 wrong_account: no session, so no tool can update that account's call); the configured
    account's stream is served and its end_call reaches the REST API."""
    monkeypatch.setattr(service.config.telephony, "twilio_account_sid", "AC" + "1" * 32)
    service.lm.tool_calls = tool_call("end_call")

    async def refused():
        async with websockets.connect(f"ws://127.0.0.1:{service.port}/twilio", open_timeout=30) as ws:
            twilio = FakeTwilio(ws, "MZ" + "c" * 32)
            await twilio.start()
            await asyncio.wait_for(twilio.tasks[0], 10)
            for task in twilio.tasks:
                task.cancel()
            return ws.close_code, ws.close_reason
    assert asyncio.run(refused()) == (1008, "wrong_account")
    assert record_for("MZ" + "c" * 32) is None and not service.lm.asked and not rest.updates
    monkeypatch.setattr(service.config.telephony, "twilio_account_sid", ACCOUNT)
    record, _ = twilio_call(service, "MZ" + "d" * 32)
    assert record.end_reason == "end_call" and rest.updates == [{"call": "CA" + "d" * 32, "Status": "completed"}]


ASK = "Please type your account number, then the pound key."


def keypad_call(service, sid: str, keys: str):
    """A Twilio stream presses 1 #: the LM calls read_keypad; once the prompt is heard, it presses `keys`;
    the record once the caller hung up."""
    async def call():
        async with websockets.connect(f"ws://127.0.0.1:{service.port}/twilio", open_timeout=30) as ws:
            twilio = await pressing(ws, sid, "1#")
            await twilio.wait(lambda: len(twilio.events("media")) > 20, 10)  # the prompt is being said
            service.lm.tool_calls = []
            for key in keys:
                await twilio.send("dtmf", dtmf={"track": "inbound_track", "digit": key})
            await twilio.wait(lambda: (r := record_for(sid)) is not None and r.replies, 20)
            await asyncio.sleep(0.3)
            await twilio.stop()
            return twilio
    asyncio.run(call())
    return wait_until(lambda: (r := record_for(sid)) is not None and r.ended and r, 10, "the call to end")


def test_read_keypad_keys_are_the_tools_result_not_a_turn(service):
    """read_keypad: its prompt is said (no filler), the keys pressed over it do not stop the reply, and the
    sequence they make (4 2 #) is the tool's result: the LM is asked once more, with it, and no turn of the
    caller's is made of those keys."""
    service.lm.tool_calls = tool_call("read_keypad", prompt=ASK)
    record = keypad_call(service, "MZ" + "e" * 32, "42#")
    assert len(service.lm.asked) == 2, [m[-1]["content"] for m, _ in service.lm.asked]
    assert "the caller pressed 4 2" in told(service), told(service)
    assert record.replies == [ASK + " Goodbye, thanks for calling."], record.replies
    [row] = wait_until(lambda: [s for s in read_sessions(service.config.records.path, limit=100)
                                if s["meta"].get("callSid") == "CA" + "e" * 32 and s["ended"]], 10, "the record")
    [turn] = row["turns"]
    assert turn["tools"][0]["name"] == "read_keypad" and turn["tools"][0]["result"] == "the caller pressed 4 2"
    assert row["dtmf"] == "1#42#"


def test_read_keypad_without_keys_says_so_in_time(service, monkeypatch):
    """No keys after read_keypad's prompt: after `telephony.keypad_timeout_s` the tool's result says so, and
    keys pressed later are the caller's turn again."""
    monkeypatch.setattr(service.config.telephony, "keypad_timeout_s", 1.0)
    service.lm.tool_calls = tool_call("read_keypad", prompt=ASK)
    record = keypad_call(service, "MZ" + "f" * 32, "")
    assert "the caller pressed no keys within 1 seconds" in told(service), told(service)
    assert record.replies == [ASK + " Goodbye, thanks for calling."], record.replies


def test_twilio_transfer_dials_the_target(service, rest):
    service.lm.tool_calls = tool_call("transfer_call", target="sales")
    record, _ = twilio_call(service, "MZ" + "b" * 32)
    assert record.end_reason == "transfer:sales"
    assert rest.updates == [{"call": "CA" + "b" * 32, "Twiml": "<Response><Dial>+14155550100</Dial></Response>"}]


def test_twilio_refused_transfer_keeps_the_caller(service, rest):
    service.lm.tool_calls = tool_call("transfer_call", target="desk")
    rest.refuse = True
    record, _ = twilio_call(service, "MZ" + "c" * 32, ended=False)
    assert rest.updates == [{"call": "CA" + "c" * 32,
                             "Twiml": f"<Response><Dial><Sip>{DESK}</Sip></Dial></Response>"}]
    assert record.end_reason == "caller_hangup"
    assert "the transfer to desk failed (Twilio answered HTTP 400)" in told(service)


# --- the greeting --------------------------------------------------------------------------------------


def test_twilio_greeting_is_barged_in_on_and_the_lm_knows_what_was_heard(service):
    """The call hears the greeting first; a key pressed while it plays stops it (`clear`), and the LM's
    conversation starts with the greeting, as the assistant's: from the next turn on, with what the caller
    heard of it (the reply to the key started before the greeting had ended)."""
    greeting = "Hello, thanks for calling the demo line. How can I help you today?"
    service.config.telephony.greeting = greeting
    sid = "MZ" + "d" * 32
    try:
        async def call():
            async with websockets.connect(f"ws://127.0.0.1:{service.port}/twilio", open_timeout=30) as ws:
                twilio = FakeTwilio(ws, sid)
                await twilio.start()
                await twilio.wait(lambda: len(twilio.events("media")) > 40, 10)  # 0.8 s of it was sent
                await twilio.send("dtmf", dtmf={"track": "inbound_track", "digit": "#"})
                await twilio.wait(lambda: twilio.events("clear") and len(record_for(sid).replies) >= 2, 10)
                await twilio.send("dtmf", dtmf={"track": "inbound_track", "digit": "#"})
                await twilio.wait(lambda: len(record_for(sid).replies) >= 3, 10)
                await twilio.stop()
                return twilio

        twilio = asyncio.run(call())
    finally:
        service.config.telephony.greeting = ""
    record = record_for(sid)
    assert record.first_audio - record.answered < 0.5, "the greeting is the call's first audio, at once"
    assert record.replies[0] == greeting and twilio.events("clear")
    first, second = service.lm.asked[-2][0], service.lm.asked[-1][0]
    assert [m["role"] for m in first] == ["system", "assistant", "user"] and first[1]["content"] == greeting
    assert first[-1]["content"] == "(keypad) The caller pressed #."
    heard = second[1]["content"]
    assert second[1]["role"] == "assistant" and heard and greeting.startswith(heard) and heard != greeting, second
    assert [m["role"] for m in second] == ["system", "assistant", "user", "assistant", "user"]
