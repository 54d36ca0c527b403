"""`engine serve`: API keys on /v1/*, body and message-size limits, refusal to run exposed without keys.

The app is engine/api/server.py's real one around a stand-in engine (no model is loaded: these
tests are about the HTTP layer), driven by the official `openai` client and raw HTTP.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from engine.decode import DecodeConfig
from engine.api.middleware import load_api_keys
from engine.api.server import build_app
from liveserver import serving
from fakes import StandInEngine

ROOT = Path(__file__).resolve().parents[1]
KEY = "engine-test-key-0123456789"


@pytest.fixture(scope="module")
def port():
    app = build_app(StandInEngine(), DecodeConfig(max_new_tokens=8), api_keys={"ops": KEY}, max_input_chars=1000,
                    max_body_bytes=20000)
    with serving(app) as port:
        yield port


def raw(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}"), dict(r.getheaders())
    finally:
        conn.close()


def client(port: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30)


def test_v1_needs_the_key_healthz_does_not(port):
    msgs = [{"role": "user", "content": "hi"}]
    reply = client(port, KEY).chat.completions.create(model="stand-in", messages=msgs)
    assert reply.choices[0].message.content == "Hello there."
    with pytest.raises(openai.AuthenticationError) as err:
        client(port, "wrong-key-0123456789").chat.completions.create(model="stand-in", messages=msgs)
    assert err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(port, "wrong-key-0123456789").models.list()
    status, body, headers = raw(port, "GET", "/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and "didn't provide" in body["error"]["message"]
    assert headers.get("www-authenticate") == "Bearer"
    assert raw(port, "GET", "/healthz")[0] == 200
    # the stream is protected too
    chunks = list(client(port, KEY).chat.completions.create(model="stand-in", messages=msgs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there."


def test_message_text_and_body_size_are_limited(port):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 1001}]}).encode()
    status, err, _ = raw(port, "POST", "/v1/chat/completions", body, auth)
    assert status == 400 and err["error"]["code"] == "string_above_max_length" and "1000" in err["error"]["message"]
    status, err, _ = raw(port, "POST", "/v1/chat/completions", b"{" + b" " * 30000 + b"}", auth)
    assert status == 413 and err["error"]["code"] == "request_too_large"
    ok = json.dumps({"messages": [{"role": "user", "content": "x" * 900}]}).encode()
    assert raw(port, "POST", "/v1/chat/completions", ok, auth)[0] == 200


def test_keys_come_from_env_and_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# ops\nops:{KEY}\n")
    keys = load_api_keys({"ENGINE_API_KEYS": "voice:voice-key-0123456789abc", "ENGINE_API_KEYS_FILE": str(f)})
    assert keys == {"voice": "voice-key-0123456789abc", "ops": KEY}
    assert load_api_keys({}) == {}
    with pytest.raises(SystemExit, match="shorter than 16"):
        load_api_keys({"ENGINE_API_KEYS": "tiny"})


def test_engine_serve_refuses_a_public_host_without_keys():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINE_")}
    out = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--host", "0.0.0.0", "--port", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "refusing to listen on 0.0.0.0 without API keys" in out.stderr, out
