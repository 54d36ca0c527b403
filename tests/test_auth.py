"""Authentication: API keys, browser tokens, Origins, Twilio signatures, per-key limits, start-up refusal.

The unit tests check voice/service/auth.py against Twilio's published signature vectors and the token
rules; the live tests run the real app (tests/fakes.py: no models) on loopback with auth on and
check what each endpoint lets through, and how refusals look on the wire.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import websockets

from fakes import LiveServer, fake_instance, make_config
from engine.common.keys import parse_keys
from voice.service.auth import (Auth, AuthError, ConfigError, RedactSecrets, check_exposure, twilio_signature,
                        url_variants, valid_twilio_signature)
from voice.config import Config

ROOT = Path(__file__).resolve().parents[1]
KEY_A = "alice-0123456789abcdef"
KEY_B = "bob-fedcba9876543210xx"

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]


# --- units ------------------------------------------------------------------------------------

def test_keys_from_text_are_named_and_checked():
    keys = parse_keys(f"alice:{KEY_A}, # a comment\n{KEY_B}\n\n", "test")
    assert keys["alice"] == KEY_A and len(keys) == 2
    unnamed = next(n for n in keys if n != "alice")
    assert unnamed.startswith("key-") and KEY_B not in unnamed  # the name says nothing about the key
    with pytest.raises(ConfigError, match="shorter than 16"):
        parse_keys("x:short", "test")
    with pytest.raises(ConfigError, match="bad key name"):
        parse_keys(f"bad name!:{KEY_A}", "test")
    auth = Auth(keys=keys, secret=b"s" * 32)
    assert auth.check_key(KEY_A) == "alice" and auth.check_key(KEY_B) == unnamed
    assert auth.check_key("alice-0123456789abcdeX") is None and auth.check_key("") is None


def test_keys_from_env_and_file(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text(f"# keys\nbob:{KEY_B}\n")
    monkeypatch.setenv("TEST_VOICE_KEYS", f"alice:{KEY_A}")
    cfg = Config().auth
    cfg.api_keys_env, cfg.api_keys_file = "TEST_VOICE_KEYS", str(f)
    assert Auth.from_config(cfg).keys == {"alice": KEY_A, "bob": KEY_B}
    cfg.api_keys_file = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="cannot read"):
        Auth.from_config(cfg)


def test_tokens_expire_and_cannot_be_forged():
    auth = Auth(keys={"alice": KEY_A}, secret=b"k" * 32, token_ttl_s=60)
    token, expiry = auth.issue_token("alice", now=1000.0)
    assert expiry == 1060 and KEY_A not in token
    assert auth.check_token(token, now=1059.0) == "alice"
    with pytest.raises(AuthError) as err:
        auth.check_token(token, now=1061.0)
    assert err.value.code == "token_expired"
    head, principal, exp, sig = token.split(".")
    for forged in (f"{head}.{principal}.{int(exp) + 3600}.{sig}",  # extended expiry
                   f"{head}.Ym9i.{exp}.{sig}",  # another principal
                   token[:-2] + ("AA" if not token.endswith("AA") else "BB"), "v1.a.b", "", "x" * 600):
        with pytest.raises(AuthError) as err:
            auth.check_token(forged, now=1000.0)
        assert err.value.code == "bad_token"
    other = Auth(keys={"alice": KEY_A}, secret=b"z" * 32)  # another server (or a restart with a random secret)
    with pytest.raises(AuthError):
        other.check_token(token, now=1000.0)
    revoked = Auth(keys={"bob": KEY_B}, secret=b"k" * 32)
    with pytest.raises(AuthError, match="revoked"):
        revoked.check_token(token, now=1000.0)


def test_principal_from_header_or_token():
    auth = Auth(keys={"alice": KEY_A}, secret=b"k" * 32)
    assert auth.principal({"authorization": f"Bearer {KEY_A}"}, {}) == "alice"
    assert auth.principal({}, {"token": auth.issue_token("alice")[0]}) == "alice"
    for headers, query in (({}, {}), ({"authorization": f"Basic {KEY_A}"}, {}), ({"authorization": "Bearer nope"}, {}),
                           ({}, {"key": KEY_A})):  # keys never travel in URLs
        with pytest.raises(AuthError) as err:
            auth.principal(headers, query)
        assert err.value.code in ("unauthorized", "bad_token")
    assert Auth().principal({}, {}) == "anonymous"  # no keys: auth is off


def test_origin_allow_list():
    auth = Auth(origins=["https://voice.example.com"])
    auth.check_origin({"origin": "https://voice.example.com"})
    auth.check_origin({})  # not a browser
    with pytest.raises(AuthError) as err:
        auth.check_origin({"origin": "https://evil.example.com"})
    assert err.value.code == "forbidden_origin"
    Auth().check_origin({"origin": "https://anything.example"})  # no list: any origin


def test_twilio_signature_matches_twilios_published_vectors():
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    params = {"CallSid": "CA1234567890ABCDE", "Caller": "+14158675309", "Digits": "1234", "From": "+14158675309",
              "To": "+18005551212"}
    assert twilio_signature("12345", url, params) == "RSOYDt4T1cUTdK1PDd93/VVr8B8="
    assert valid_twilio_signature("12345", url, params, "RSOYDt4T1cUTdK1PDd93/VVr8B8=")
    assert not valid_twilio_signature("12345", url, {**params, "Digits": "9999"}, "RSOYDt4T1cUTdK1PDd93/VVr8B8=")
    assert not valid_twilio_signature("12345", url + "&x=1", params, "RSOYDt4T1cUTdK1PDd93/VVr8B8=")
    assert not valid_twilio_signature("", url, params, "RSOYDt4T1cUTdK1PDd93/VVr8B8=")
    repeated = {"Sid": "CA123", "SidAccount": "AC123", "Digits": ["5678", "1234", "1234"]}
    assert twilio_signature("12345", url, repeated) == "IK+Dwps556ElfBT0I3Rgjkr1wJU="
    assert url_variants("wss://a.example/twilio") == ["wss://a.example/twilio", "wss://a.example:443/twilio"]
    assert url_variants("https://a.example:443/x?y=1") == ["https://a.example:443/x?y=1", "https://a.example/x?y=1"]


def test_non_loopback_without_auth_refuses_to_start():
    config = Config()
    config.server.host = "0.0.0.0"
    with pytest.raises(ConfigError, match="without authentication"):
        check_exposure(config, Auth())
    check_exposure(config, Auth(keys={"alice": KEY_A}))
    config.auth.allow_unauthenticated = True
    check_exposure(config, Auth())
    config.server.host, config.sip.port, config.sip.host = "127.0.0.1", 5060, "0.0.0.0"
    with pytest.raises(ConfigError, match="sip.allow"):
        check_exposure(config, Auth(keys={"alice": KEY_A}))
    config.sip.allow = ["10.0.0.0/8"]
    check_exposure(config, Auth(keys={"alice": KEY_A}))
    for host in ("127.0.0.1", "::1", "localhost"):
        config.server.host = host
        config.auth.allow_unauthenticated = False
        check_exposure(config, Auth())


def test_voice_serve_refuses_a_public_host_without_keys():
    env = {k: v for k, v in os.environ.items() if k not in ("VOICE_API_KEYS",)}
    out = subprocess.run([sys.executable, "-m", "voice.cli", "serve", "--host", "0.0.0.0", "--port", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert "refusing to listen on 0.0.0.0 without authentication" in out.stderr
    assert "VOICE_API_KEYS" in out.stderr


def test_log_redaction_hides_tokens():
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, '%s - "WebSocket %s" [accepted]',
                               ("127.0.0.1:5", "/ws?token=v1.YWxpY2U.123.c2ln&x=1"), None)
    RedactSecrets().filter(record)
    assert "c2ln" not in record.getMessage() and "token=REDACTED&x=1" in record.getMessage()


# --- live -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    config = make_config(limits={"max_sessions": 3, "max_sessions_per_key": 1})
    auth = Auth(keys={"alice": KEY_A, "bob": KEY_B}, secret=b"t" * 32, token_ttl_s=60,
                origins=["https://voice.example.com"])
    with LiveServer(config, fake_instance(config), auth) as srv:
        yield srv


def http(srv, method: str, path: str, key: str | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(srv.http + path, method=method, data=b"" if method == "POST" else None)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, body = r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read().decode()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


async def attempt(url: str, headers: dict | None = None, start: bool = True, hold: float = 0.0) -> dict:
    """Connect; returns {"events": [...], "close": (code, reason) or None, "ws": websocket if held open}."""
    out: dict = {"events": [], "close": None}
    ws = await websockets.connect(url, additional_headers=headers or {}, open_timeout=10)
    try:
        if start:
            try:
                await ws.send(json.dumps({"type": "start", "sample_rate": 16000}))
            except websockets.ConnectionClosed:  # refused before we got to say anything
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                msg = await asyncio.wait_for(ws.recv(), max(deadline - time.monotonic(), 0.01))
            except asyncio.TimeoutError:
                break
            except websockets.ConnectionClosed:
                out["close"] = (ws.close_code, ws.close_reason)
                break
            if isinstance(msg, str):
                out["events"].append(json.loads(msg))
                if out["events"][-1]["type"] == "ready":
                    break
        if hold:
            await asyncio.sleep(hold)
    finally:
        if not hold:
            await ws.close()
    out["ws"] = ws
    return out


def refused(result: dict, code: str, close: int) -> None:
    assert [e["type"] for e in result["events"]] == ["error"], result
    assert result["events"][0]["code"] == code and result["events"][0]["message"], result
    assert result["close"] == (close, code), result


def test_ws_requires_a_key_or_token(server):
    url = server.ws + "/ws"

    async def scenario():
        results = {"none": await attempt(url), "bad": await attempt(url, {"Authorization": "Bearer wrong-key-123456"}),
                   "header": await attempt(url, {"Authorization": f"Bearer {KEY_A}"})}
        status, body = http(server, "POST", "/token", KEY_B)
        assert status == 200 and body["expires_in"] == 60 and body["expires_at"] > time.time(), body
        results["token"] = await attempt(f"{url}?token={body['token']}")
        results["forged"] = await attempt(f"{url}?token={body['token'][:-3]}xyz")
        results["key_in_url"] = await attempt(f"{url}?token={KEY_A}")
        return results

    r = asyncio.run(scenario())
    refused(r["none"], "unauthorized", 1008)
    refused(r["bad"], "unauthorized", 1008)
    refused(r["forged"], "bad_token", 1008)
    refused(r["key_in_url"], "bad_token", 1008)
    assert r["header"]["events"][0]["type"] == "ready"
    assert r["token"]["events"][0]["type"] == "ready"


def test_token_endpoint_and_metrics_need_a_key_healthz_does_not(server):
    assert http(server, "POST", "/token")[0] == 401
    status, body = http(server, "POST", "/token", "not-a-key-at-all-xx")
    assert status == 401 and body["error"]["code"] == "unauthorized"
    assert http(server, "GET", "/token", KEY_A)[0] in (404, 405)  # POST only (GET falls through to the web page)
    assert http(server, "GET", "/metrics")[0] == 401
    status, body = http(server, "GET", "/metrics", KEY_A)
    assert status == 200 and "voice_sessions_refused_total" in body
    status, body = http(server, "GET", "/healthz")
    assert status == 200 and body["status"] == "ok" and body["auth"] is True


def test_origin_allow_list_on_browser_connections(server):
    url = server.ws + "/ws"
    auth = {"Authorization": f"Bearer {KEY_A}"}

    async def scenario():
        return (await attempt(url, {**auth, "Origin": "https://evil.example.com"}),
                await attempt(url, {**auth, "Origin": "https://voice.example.com"}))

    evil, good = asyncio.run(scenario())
    refused(evil, "forbidden_origin", 1008)
    assert good["events"][0]["type"] == "ready"


def wait_no_tickets(server, timeout: float = 10) -> None:
    """Sessions of earlier tests release their admission when their handler ends: wait for that."""
    deadline = time.monotonic() + timeout
    while server.instance.admission.total:
        assert time.monotonic() < deadline, server.instance.admission.active
        time.sleep(0.05)


def test_sessions_per_key_and_in_all_are_limited(server):
    url = server.ws + "/ws"
    wait_no_tickets(server)

    async def scenario():
        a1 = await attempt(url, {"Authorization": f"Bearer {KEY_A}"}, hold=0.1)
        a2 = await attempt(url, {"Authorization": f"Bearer {KEY_A}"})  # alice's second: over her limit of 1
        b1 = await attempt(url, {"Authorization": f"Bearer {KEY_B}"}, hold=0.1)  # bob may
        await a1["ws"].close()
        await asyncio.sleep(0.3)
        a3 = await attempt(url, {"Authorization": f"Bearer {KEY_A}"})  # alice's first is gone: room again
        await b1["ws"].close()
        return a1, a2, b1, a3

    a1, a2, b1, a3 = asyncio.run(scenario())
    assert a1["events"][0]["type"] == "ready", a1
    refused(a2, "too_many_sessions", 1013)
    assert "limit is 1" in a2["events"][0]["message"]
    assert b1["events"][0]["type"] == "ready" and a3["events"][0]["type"] == "ready"
    wait_no_tickets(server)


def test_global_session_limit():
    config = make_config(limits={"max_sessions": 2})
    with LiveServer(config, fake_instance(config)) as srv:  # auth off (loopback)
        async def scenario():
            held = [await attempt(srv.ws + "/ws", hold=0.05) for _ in range(2)]
            third = await attempt(srv.ws + "/ws")
            twilio = await attempt(srv.ws + "/twilio", start=False)
            for h in held:
                await h["ws"].close()
            return held, third, twilio

        held, third, twilio = asyncio.run(scenario())
    assert all(h["events"][0]["type"] == "ready" for h in held)
    refused(third, "too_many_sessions", 1013)
    assert twilio["close"] == (1013, "too_many_sessions")


def test_twilio_signature_is_required_when_a_twilio_token_is_set():
    config = make_config()
    token = "twilio-auth-token-for-tests"
    auth = Auth(twilio_token=token)
    with LiveServer(config, fake_instance(config), auth) as srv:
        url = srv.ws + "/twilio?caller=x"
        own = twilio_signature(token, f"ws://127.0.0.1:{srv.port}/twilio?caller=x")

        async def twilio_call(headers: dict) -> tuple:
            ws = await websockets.connect(url, additional_headers=headers, open_timeout=10)
            try:
                await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
                await ws.send(json.dumps({"event": "start", "streamSid": "MZsig", "start": {
                    "streamSid": "MZsig", "callSid": "CAsig",
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}))
                await asyncio.sleep(0.3)
                opened = len(srv.instance.live)
                await ws.send(json.dumps({"event": "stop", "streamSid": "MZsig"}))
                await asyncio.wait_for(ws.wait_closed(), 5)
            except websockets.ConnectionClosed:
                opened = 0
            return opened, (ws.close_code, ws.close_reason)

        async def scenario():
            return (await twilio_call({}), await twilio_call({"X-Twilio-Signature": "bm9wZQ=="}),
                    await twilio_call({"X-Twilio-Signature": own}))

        missing, wrong, good = asyncio.run(scenario())
        assert missing == (0, (1008, "unauthorized")) and wrong == (0, (1008, "unauthorized"))
        assert good[0] == 1, good  # the call opened a session

        # behind a TLS proxy: the URL Twilio signs is the public one (auth.twilio_url)
        auth.twilio_url = "wss://voice.example.com/twilio"
        public = twilio_signature(token, "wss://voice.example.com/twilio?caller=x")
        assert asyncio.run(twilio_call({"X-Twilio-Signature": public}))[0] == 1
        assert asyncio.run(twilio_call({"X-Twilio-Signature": own}))[0] == 0


def test_token_endpoint_says_when_auth_is_off():
    config = make_config()
    with LiveServer(config, fake_instance(config)) as srv:
        status, body = http(srv, "POST", "/token", KEY_A)
        assert status == 404 and body["error"]["code"] == "auth_off"
        assert http(srv, "GET", "/metrics")[0] == 200  # no keys: open, like before
