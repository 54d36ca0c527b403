"""The adversarial pass over every front, re-run (issue 41): malformed and hostile inputs, counted.

    python bench/hostile_pass.py [--slowloris-s 65] [--json bench/results/hostile_pass.json]

Starts its own `voice serve` (a TOML config that sets `[lm] model = "small"` and turns capacity
admission off, `[limits] max_load = 0`; with SIP and Wyoming on, call records under /tmp) and its
own `engine serve --model small`, then throws generated inputs at every front: /ws (native),
/v1/realtime, /twilio, Wyoming (TCP), SIP (UDP), the voice service's HTTP routes and engine
serve's OpenAI API. Every input class mutates a valid
message: each field set to each of a list of junk JSON values (wrong types, huge and endless
numbers, NaN, lone surrogates, unicode junk, oversized strings, deep nesting), each field dropped,
raw text that is not JSON, truncations, unknown event types, odd-length audio, oversized frames,
out-of-order events, bad auth shapes, pathological JSON schemas and tool_choice. Per front and
class it counts the inputs, the connections the server closed because of one (some protocols say
they must: noted), HTTP 5xx answers, server faults the protocol reports (Realtime `server_error`,
Wyoming `internal_error`, SIP 500), and whether a well-formed request on a fresh connection works
afterwards. Then slowloris (heads and bodies never finished) on every TCP front; fds and RSS of
both services at baseline, with the slowloris held, and after every client left; "Traceback"
counted in their logs (under /tmp). A table is printed and the figures written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psutil
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS, free_port, machine  # noqa: E402

HOST = "127.0.0.1"
SENTINEL = "@@JUNK@@"

# --- the junk: raw JSON texts put in place of a field ----------------------------------------------------
JUNK: list[tuple[str, str]] = [
    ("null", "null"), ("true", "true"), ("false", "false"), ("zero", "0"), ("minus_one", "-1"),
    ("float", "1.5"), ("max_double", "1e308"), ("neg_double", "-1e308"), ("tiny", "5e-324"),
    ("overflow", "1e999"), ("nan", "NaN"), ("inf", "Infinity"), ("neg_inf", "-Infinity"),
    ("bigint", "9" * 30), ("endless_number", "1" * 70), ("neg_bigint", "-" + "9" * 25),
    ("empty_str", '""'), ("str", '"x"'), ("numeric_str", '"16000"'), ("nul_char", '"\\u0000"'),
    ("rtl_bom", json.dumps("\u202e\ufeff\u200b\uffff")), ("emoji", json.dumps("\U0001f600" * 500)),
    ("combining", json.dumps("e\u0301" * 2000)), ("lone_surrogate", '"\\ud800"'),
    ("reversed_pair", '"\\udc00\\ud800"'), ("long_str", json.dumps("a" * 70000)),
    ("empty_list", "[]"), ("list", "[1, 2, 3]"), ("empty_obj", "{}"), ("obj", '{"a": {"b": 1}}'),
    ("deep_ok", "[" * 20 + "]" * 20), ("deep_40", "[" * 40 + "]" * 40), ("deep_obj", '{"a":' * 40 + "1" + "}" * 40),
]

INVALID_TEXT: list[str] = [
    "", " ", "\n", "{", "}", "[", "]", "{\"type\":", "{'type': 'start'}", "null", "true", "1", "\"start\"", "[]",
    "{}", "[{\"type\": \"start\"}]", "{\"type\": NaN}", "{\"a\": 1e999}", "{\"a\": " + "1" * 100 + "}",
    "\ufeff{\"type\": \"x\"}", "{\"type\": \"x\",}", "{\"type\": \"x\"} trailing", "{\"type\": \"x\"}{\"type\": \"x\"}",
    "{\"type\": \"st\nart\"}", "// comment\n{}", "{\"type\": \"\\ud800\"}", "{\"type\": \"\\x41\"}",
    "[" * 5000, "{\"a\":" * 5000, "\x00\x01\x02", "\u202e{}", "{\"type\": undefined}", "{type: 1}",
    "{\"type\": \"x\", \"type\": \"y\"}", "{\"a\": \"" + "b" * 70000 + "\"}", "{\"a\": 0x10}", "{\"a\": 01}",
    "{\"a\": .5}", "{\"a\": +1}", "{\"a\": 1.}", "{\"a\": -}", "\"\\u12\"", "{\"a\": \"\t\"}",
]


def put(obj, path: tuple, value):
    """A deep copy of `obj` with the field at `path` set to `value` (a missing parent dict is made)."""
    out = copy.deepcopy(obj)
    cur = out
    for key in path[:-1]:
        cur = cur[key]
    cur[path[-1]] = value
    return out


def drop(obj, path: tuple):
    out = copy.deepcopy(obj)
    cur = out
    for key in path[:-1]:
        cur = cur[key]
    del cur[path[-1]]
    return out


def paths(obj, prefix: tuple = ()) -> list[tuple]:
    """Every field (dict key, first list item) of a JSON value, outermost first."""
    out: list[tuple] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append(prefix + (k,))
            out.extend(paths(v, prefix + (k,)))
    elif isinstance(obj, list) and obj:
        out.append(prefix + (0,))
        out.extend(paths(obj[0], prefix + (0,)))
    return out


def with_raw(obj, path: tuple, raw: str) -> str:
    return json.dumps(put(obj, path, SENTINEL)).replace(json.dumps(SENTINEL), raw, 1)


def mutations(template: dict, keep: tuple = ("type",), skip: tuple = ()) -> list[tuple[str, str]]:
    """(label, text): each field of `template` set to each junk value, each dropped, an unknown field added.
    Paths in `keep` (their first key) are mutated too, but only with junk, never dropped twice."""
    out = []
    for path in paths(template):
        if path[0] in skip:
            continue
        for name, raw in JUNK:
            out.append((f"{'.'.join(map(str, path))}={name}", with_raw(template, path, raw)))
        out.append((f"drop {'.'.join(map(str, path))}", json.dumps(drop(template, path))))
    for name, raw in JUNK[:12]:
        out.append((f"unknown_field={name}", with_raw(put(template, ("zz_unknown",), 0), ("zz_unknown",), raw)))
    return out


def truncations(text: str, step: int = 5) -> list[tuple[str, str]]:
    return [(f"truncated@{i}", text[:i]) for i in range(1, len(text), step)]


def short(s, n: int = 160) -> str:
    r = repr(s)
    return r if len(r) <= n else r[:n] + f"...({len(s)} chars)"


# --- tallies ---------------------------------------------------------------------------------------------
class Tally:
    def __init__(self, front: str, klass: str, closes_expected: str = "no"):
        self.front, self.klass, self.closes_expected = front, klass, closes_expected
        self.sent = self.closed = self.http_5xx = self.faults = self.timeouts = self.no_answer = 0
        self.statuses: Counter = Counter()
        self.codes: Counter = Counter()
        self.close_codes: Counter = Counter()
        self.healthy: bool | None = None
        self.defects: list[dict] = []

    def defect(self, kind: str, label: str, payload, detail: str = "") -> None:
        if len(self.defects) < 12:
            self.defects.append({"kind": kind, "input": label, "payload": short(payload, 400), "detail": detail[:300]})

    def row(self) -> dict:
        return {"front": self.front, "class": self.klass, "inputs": self.sent, "closed_by_server": self.closed,
                "closes_expected": self.closes_expected, "http_5xx": self.http_5xx, "server_faults": self.faults,
                "timeouts": self.timeouts, "no_answer": self.no_answer, "healthy_after": self.healthy,
                "statuses": dict(self.statuses), "error_codes": dict(self.codes.most_common(15)),
                "close_codes": dict(self.close_codes), "defects": self.defects}


TALLIES: list[Tally] = []


def tally(front: str, klass: str, closes_expected: str = "no") -> Tally:
    t = Tally(front, klass, closes_expected)
    TALLIES.append(t)
    return t


# --- services --------------------------------------------------------------------------------------------
class Service:
    def __init__(self, name: str, argv: list[str], log: Path, health_url: str):
        self.name, self.argv, self.log_path, self.health_url = name, argv, log, health_url
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - open for the service's lifetime
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.proc.returncode}); see {self.log_path}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise SystemExit(f"{self.name} not ready in {timeout:.0f} s; see {self.log_path}")

    def usage(self) -> dict:
        assert self.proc is not None
        try:
            p = psutil.Process(self.proc.pid)
            kinds: Counter = Counter()
            for fd in os.listdir(f"/proc/{p.pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{p.pid}/fd/{fd}")
                    kinds[target.split(":")[0] if ":" in target else "file"] += 1
                except OSError:
                    pass
            return {"fds": p.num_fds(), "rss_mb": round(p.memory_info().rss / 2**20, 1),
                    "connections": len(p.net_connections(kind="tcp")), "fd_kinds": dict(kinds)}
        except psutil.Error as err:
            return {"error": repr(err)}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # only our own process, by its PID
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()

    def tracebacks(self) -> int:
        return self.log_path.read_text(errors="replace").count("Traceback")


# --- HTTP over raw sockets -------------------------------------------------------------------------------
async def http_raw(port: int, data: bytes, timeout: float = 30.0) -> tuple[int | None, bytes, str]:
    """Send `data`, read to EOF: (status or None, body, how it ended: answered | closed | reset | timeout)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 5)
    except (OSError, TimeoutError):
        return None, b"", "refused"
    got = b""
    how = "answered"
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout):
            while True:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                got += chunk
                if _complete(got):
                    break
    except TimeoutError:
        how = "timeout"
    except (ConnectionResetError, BrokenPipeError):
        how = "reset"
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
    m = re.match(rb"HTTP/1\.[01] (\d{3})", got)
    if m is None:
        return None, got, how if how != "answered" else "closed"
    return int(m.group(1)), got.split(b"\r\n\r\n", 1)[-1], how


def _complete(got: bytes) -> bool:
    head, sep, body = got.partition(b"\r\n\r\n")
    if not sep:
        return False
    m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    if m:
        return len(body) >= int(m.group(1))
    return b"transfer-encoding: chunked" in head.lower() and body.endswith(b"0\r\n\r\n")


def request(method: str, path: str, body: bytes | None = None, headers: list[tuple[str, str]] | None = None,
            ctype: str = "application/json") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}", "Connection: close"]
    if body is not None:
        lines += [f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers or []]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + (body or b"")


async def count_http(t: Tally, port: int, label: str, data: bytes, timeout: float = 30.0,
                     over_limit: bool = False) -> int | None:
    """One request; `over_limit`: a body over the server's cap, which it may answer (413) and close while the
    client still sends: the reset that follows is TCP's, not a defect (the server's log shows the 413)."""
    t.sent += 1
    status, body, how = await http_raw(port, data, timeout)
    if over_limit and status is None and how == "reset":
        t.statuses["reset while uploading over the cap"] += 1
        return None
    t.statuses[status if status is not None else how] += 1
    if status == 503 and b"too_many_sessions" in body:
        t.statuses["503 too_many_sessions (a refusal at capacity, not a fault)"] += 1
    elif status is not None and status >= 500:
        t.http_5xx += 1
        t.defect("http_5xx", label, data, body[:300].decode("utf-8", "replace"))
    if status is None:
        if how == "timeout":
            t.timeouts += 1
            t.defect("no_answer_in_time", label, data)
        else:
            t.closed += 1
            t.defect(f"closed_without_answer({how})", label, data)
    return status


# --- /ws (native) ----------------------------------------------------------------------------------------
START = {"type": "start", "version": 1, "sample_rate": 16000, "output_sample_rate": 16000, "encoding": "pcm_s16le",
         "session": {"system_prompt": "Be brief.", "lm_mode": "ar"}}


async def ws_open(url: str, **kw):
    return await connect(url, max_size=None, open_timeout=10, ping_interval=None, close_timeout=2,
                         compression=None, **kw)


async def drain(ws, quiet: float = 0.5, most: float = 5.0) -> tuple[list, int | None]:
    """Messages until `quiet` s pass without one; and the close code if the server closed."""
    got: list = []
    deadline = time.monotonic() + most
    try:
        while time.monotonic() < deadline:
            try:
                got.append(await asyncio.wait_for(ws.recv(), quiet))
            except TimeoutError:
                break
    except ConnectionClosed as err:
        return got, (err.rcvd.code if err.rcvd else 1006)
    return got, None


def codes_of(msgs: list) -> list[str]:
    out = []
    for m in msgs:
        if isinstance(m, str):
            try:
                obj = json.loads(m)
            except ValueError:
                out.append("<not json>")
                continue
            if isinstance(obj, dict) and obj.get("type") == "error":
                err = obj.get("error") if isinstance(obj.get("error"), dict) else obj
                out.append(str(err.get("code") or err.get("type")))
    return out


async def _answers(url: str, expected: str, first: dict | None = None) -> bool:
    """Does a fresh connection to `url` (sent `first`, if any) get a first message of type `expected`?"""
    try:
        ws = await ws_open(url)
        if first is not None:
            await ws.send(json.dumps(first))
        msg = json.loads(await asyncio.wait_for(ws.recv(), 10))
        await ws.close()
        return msg.get("type") == expected
    except (OSError, TimeoutError, ConnectionClosed, InvalidHandshake, ValueError):
        return False


async def native_health(port: int) -> bool:
    return await _answers(f"ws://{HOST}:{port}/ws", "ready", START)


async def native_first_frames(port: int) -> None:
    """Each bad `start` on its own connection: the protocol says error + close 1008."""
    t = tally("ws", "bad_start (first frame)", "yes: error + close 1008 (PROTOCOL.md)")
    inputs = mutations(START) + [(f"invalid_json {i}", s) for i, s in enumerate(INVALID_TEXT)] \
        + truncations(json.dumps(START), 9) + [("unknown_type", json.dumps({"type": "stop"})),
                                              ("start_as_bytes", json.dumps(START).encode())]
    for label, text in inputs:
        t.sent += 1
        try:
            ws = await ws_open(f"ws://{HOST}:{port}/ws")
        except (OSError, TimeoutError, InvalidHandshake) as err:
            t.no_answer += 1
            t.defect("connect_failed", label, text, repr(err))
            continue
        try:
            await ws.send(text)
        except ConnectionClosed:
            pass
        msgs, code = await drain(ws, 1.0, 4.0)
        t.codes.update(codes_of(msgs))
        if code is not None:
            t.closed += 1
            t.close_codes[code] += 1
        types = [json.loads(m).get("type") for m in msgs if isinstance(m, str)]
        if code is None and "ready" not in types and not isinstance(text, bytes):
            t.no_answer += 1  # neither ready nor refused
            t.defect("bad_start_neither_ready_nor_closed", label, text, str(msgs[:2]))
        if code is not None and code not in (1008, 1009):
            t.defect(f"unexpected_close_{code}", label, text)
        await ws.close()
    t.healthy = await native_health(port)


async def native_after_start(port: int) -> None:
    """After a valid start: junk text frames, odd/oversized binary frames, a second start. None closes."""
    t = tally("ws", "after start: text junk")
    texts = [(f"invalid_json {i}", s) for i, s in enumerate(INVALID_TEXT)] + mutations(START) \
        + [(f"unknown_type={k}", json.dumps({"type": k})) for k in ("stop", "commit", "ping", "response.create",
                                                                      "", "\u202e", "a" * 1000, "START")]
    await _native_batch(t, port, [(label, s) for label, s in texts])
    t = tally("ws", "after start: binary frames")
    rng = random.Random(1)
    frames = [(f"odd_{n}", bytes(rng.randrange(256) for _ in range(n))) for n in list(range(1, 400, 2)) + [63999]]
    frames += [(f"oversized_{n}", b"\x01" * n) for n in (64001, 64002, 100000, 500000, 1048000)]
    frames += [("empty", b""), ("two_bytes_max", b"\xff\x7f" * 320), ("two_bytes_min", b"\x00\x80" * 320)]
    await _native_batch(t, port, frames)
    t = tally("ws", "over ws_max_size (1 MiB)", "yes: 1009 by the websocket layer (PROTOCOL.md)")
    for _label, frame in [("binary_2MiB", b"\x00" * (2 << 20)), ("text_2MiB", json.dumps({"type": "x" * (2 << 20)}))]:
        t.sent += 1
        ws = await ws_open(f"ws://{HOST}:{port}/ws")
        await ws.send(json.dumps(START))
        await drain(ws, 1.0)
        try:
            await ws.send(frame)
        except ConnectionClosed:
            pass
        _, code = await drain(ws, 2.0)
        if code is not None:
            t.closed += 1
            t.close_codes[code] += 1
        await ws.close()
    t.healthy = await native_health(port)


async def _send_each(t: Tally, ws, inputs: list, count, wait: tuple[float, float] = (0.05, 0.3),
                     late: tuple[float, float] = (1.0, 10.0)) -> tuple | None:
    """Send each input, reading the answers after it (`count(label, payload, msgs)`); then wait for
    late answers. Where the server closed the connection: (label, payload, close code); else None."""
    for label, payload in inputs:
        t.sent += 1
        try:
            await ws.send(payload)
        except ConnectionClosed as err:
            return label, payload, err.rcvd.code if err.rcvd else 1006
        msgs, code = await drain(ws, *wait)
        count(label, payload, msgs)
        if code is not None:
            return label, payload, code
    msgs, code = await drain(ws, *late)
    count("(late answers)", "", msgs)
    return None if code is None else ("(after the batch)", "", code)


def _count_closed(t: Tally, closed_at: tuple | None, expected: bool = False) -> None:
    if closed_at is None:
        return
    t.closed += 1
    t.close_codes[closed_at[2]] += 1
    if not expected:
        t.defect(f"closed_{closed_at[2]}", closed_at[0], closed_at[1])


async def _native_batch(t: Tally, port: int, inputs: list[tuple[str, object]]) -> None:
    ws = await ws_open(f"ws://{HOST}:{port}/ws")
    await ws.send(json.dumps(START))
    await drain(ws, 1.0)
    closed_at = await _send_each(t, ws, inputs, lambda label, payload, msgs: t.codes.update(codes_of(msgs)))
    if closed_at is None:
        try:
            await asyncio.wait_for(await ws.ping(), 5)
        except (TimeoutError, ConnectionClosed):
            closed_at = ("(after the batch)", "", 1006)
    _count_closed(t, closed_at)
    await ws.close()
    t.healthy = await native_health(port)


# --- /v1/realtime ----------------------------------------------------------------------------------------
PCM_B64 = base64.b64encode(b"\x00\x00" * 480).decode()
REALTIME_TEMPLATES: list[dict] = [
    {"type": "session.update", "event_id": "e1", "session": {
        "type": "realtime", "instructions": "Be brief.",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}},
                  "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"}},
        "tools": [{"type": "function", "name": "f", "description": "d",
                   "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}],
        "tool_choice": "auto"}},
    {"type": "input_audio_buffer.append", "event_id": "e2", "audio": PCM_B64},
    {"type": "input_audio_buffer.commit", "event_id": "e3"},
    {"type": "input_audio_buffer.clear", "event_id": "e4"},
    {"type": "conversation.item.create", "event_id": "e5", "previous_item_id": None,
     "item": {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Hi."}]}},
    {"type": "conversation.item.create", "event_id": "e6",
     "item": {"type": "function_call_output", "call_id": "call_x", "output": "{}"}},
    {"type": "conversation.item.truncate", "event_id": "e7", "item_id": "item_x", "content_index": 0,
     "audio_end_ms": 100},
    {"type": "response.cancel", "event_id": "e8", "response_id": "resp_x"},
]


async def realtime_health(port: int) -> bool:
    return await _answers(f"ws://{HOST}:{port}/v1/realtime?model=x", "session.created")


async def realtime_pass(port: int) -> None:
    for template in REALTIME_TEMPLATES:
        t = tally("realtime", f"{template['type']} mutations" + (" (fn output)" if template["event_id"] == "e6"
                                                                 else ""))
        await _realtime_batch(t, port, mutations(template))
    t = tally("realtime", "invalid json / unknown / binary / out of order")
    junk: list[tuple[str, object]] = [(f"invalid_json {i}", s) for i, s in enumerate(INVALID_TEXT)]
    junk += [(f"unknown_type {k}", json.dumps({"type": k})) for k in (
        "conversation.item.delete", "conversation.item.retrieve", "output_audio_buffer.clear",
        "transcription_session.update", "response.done", "session.created", "", "x" * 5000, "\ud83d\ude00")]
    junk += [(f"binary_{n}", b"\x01" * n) for n in (1, 3, 641, 64001)]
    junk += [("commit_empty", json.dumps({"type": "input_audio_buffer.commit"})),
             ("truncate_unknown_item", json.dumps({"type": "conversation.item.truncate", "item_id": "nope",
                                                    "content_index": 0, "audio_end_ms": 10 ** 12})),
             ("cancel_nothing", json.dumps({"type": "response.cancel"})),
             ("odd_audio", json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01" * 3)
                                       .decode()})),
             ("bad_b64", json.dumps({"type": "input_audio_buffer.append", "audio": "@@@not base64"})),
             ("b64_padding", json.dumps({"type": "input_audio_buffer.append", "audio": "AAA"})),
             ("append_too_big", json.dumps({"type": "input_audio_buffer.append",
                                            "audio": base64.b64encode(b"\x00" * 64002).decode()})),
             ("format_after_audio", json.dumps({"type": "session.update", "session": {
                 "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}}})),
             ("beta_shape_on_ga", json.dumps({"type": "session.update", "session": {"input_audio_format": "pcm16"}})),
             ("too_many_tools", json.dumps({"type": "session.update", "session": {"type": "realtime", "tools": [
                 {"type": "function", "name": f"f{i}", "parameters": {"type": "object"}} for i in range(200)]}})),
             ("mcp_tool", json.dumps({"type": "session.update", "session": {"type": "realtime",
                                                                           "tools": [{"type": "mcp"}]}}))]
    await _realtime_batch(t, port, junk)


async def _realtime_batch(t: Tally, port: int, inputs: list[tuple[str, object]]) -> None:
    ws = await ws_open(f"ws://{HOST}:{port}/v1/realtime?model=x")
    await drain(ws, 0.5)
    _count_closed(t, await _send_each(t, ws, inputs, lambda label, payload, msgs:
                                      _realtime_count(t, label, payload, msgs)))
    await ws.close()
    t.healthy = await realtime_health(port)


def _realtime_count(t: Tally, label: str, payload, msgs: list) -> None:
    for m in msgs:
        try:
            obj = json.loads(m) if isinstance(m, str) else {}
        except ValueError:
            continue
        if obj.get("type") == "error":
            err = obj.get("error") or {}
            t.codes[str(err.get("code") or err.get("type"))] += 1
            if err.get("type") == "server_error" or err.get("code") == "server_error":
                t.faults += 1
                t.defect("server_error", label, payload, str(err.get("message")))


# --- /twilio ---------------------------------------------------------------------------------------------
TW_START = {"event": "start", "sequenceNumber": "1", "streamSid": "MZ1", "start": {
    "streamSid": "MZ1", "accountSid": "AC1", "callSid": "CA1", "tracks": ["inbound"],
    "customParameters": {"a": "b"}, "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}
TW_MEDIA = {"event": "media", "sequenceNumber": "2", "streamSid": "MZ1",
            "media": {"track": "inbound", "chunk": "1", "timestamp": "5", "payload": base64.b64encode(b"\xff" * 160)
                      .decode()}}
TW_MARK = {"event": "mark", "streamSid": "MZ1", "mark": {"name": "m1"}}
TW_DTMF = {"event": "dtmf", "streamSid": "MZ1", "dtmf": {"track": "inbound_track", "digit": "5"}}


async def twilio_health(port: int) -> bool:
    try:
        ws = await ws_open(f"ws://{HOST}:{port}/twilio")
        await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await ws.send(json.dumps(TW_START))
        await ws.send(json.dumps(TW_MEDIA))
        _, code = await drain(ws, 0.5, 1.0)
        await ws.send(json.dumps({"event": "stop", "streamSid": "MZ1"}))
        await ws.close()
        return code is None
    except (OSError, TimeoutError, ConnectionClosed, InvalidHandshake):
        return False


async def twilio_pass(port: int) -> None:
    t = tally("twilio", "before start (junk, out of order)")
    before = [(f"invalid_json {i}", s) for i, s in enumerate(INVALID_TEXT)] + mutations(TW_MEDIA) \
        + mutations(TW_MARK)[:60] + [("media_before_start", json.dumps(TW_MEDIA))]
    await _twilio_batch(t, port, before, started=False)
    t = tally("twilio", "start mutations")
    await _twilio_batch(t, port, mutations(TW_START), started=False)
    for name, template in (("media", TW_MEDIA), ("mark", TW_MARK)):
        t = tally("twilio", f"{name} mutations after start")
        extra: list[tuple[str, object]] = []
        if name == "media":
            extra = [(f"odd_ulaw_{n}", json.dumps(put(TW_MEDIA, ("media", "payload"), base64.b64encode(b"\x7f" * n)
                                                      .decode()))) for n in (1, 3, 159, 161, 7999, 8000, 8001, 60000)]
            extra += [("bad_b64", json.dumps(put(TW_MEDIA, ("media", "payload"), "!!!"))),
                      ("binary_frame", b"\xff" * 161), ("second_start", json.dumps(TW_START)),
                      ("chunk_superscript", json.dumps(put(TW_MEDIA, ("media", "chunk"), "\u00b2")))]
        await _twilio_batch(t, port, mutations(template) + extra, started=True)
    # A `dtmf` whose digit is still a key is a key pressed, a caller's turn (keys are turns): junk
    # around a valid key is counted apart from junk keys, as the turns it starts, with their audio.
    junk_keys = mutations(TW_DTMF)
    t = tally("twilio", "dtmf mutations after start (no key pressed)")
    await _twilio_batch(t, port, [m for m in junk_keys if not _key_pressed(m[1])], started=True)
    t = tally("twilio", "dtmf mutations after start that still press a key (turns)")
    pound = ("pound ends the sequence", json.dumps(put(TW_DTMF, ("dtmf", "digit"), "#")))
    await _twilio_batch(t, port, [m for m in junk_keys if _key_pressed(m[1])] + [pound], started=True,
                        count=lambda label, payload, msgs: t.codes.update(
                            "audio answer (media)" for m in msgs if _event_of(m) == "media"), late=(5.0, 20.0))
    t = tally("twilio", "stop mutations (each on its own call)", "yes when event is still 'stop' (the call ends)")
    for label, text in mutations({"event": "stop", "streamSid": "MZ1", "stop": {"accountSid": "AC1",
                                                                                "callSid": "CA1"}})[:120]:
        await _twilio_batch(t, port, [(label, text)], started=True, stop_ok=True)


def _key_pressed(payload) -> bool:
    """Does the Twilio front take this message as a key pressed (`dtmf` with a digit 0-9, *, #, A-D)?"""
    def refuse(value: str) -> float:
        raise ValueError(value)  # NaN, Infinity and numbers out of range: the server's decoder refuses them too
    try:
        msg = json.loads(payload, parse_constant=refuse,
                         parse_float=lambda v: float(v) if math.isfinite(float(v)) else refuse(v))
    except (ValueError, TypeError, RecursionError):
        return False
    dtmf = msg.get("dtmf") if isinstance(msg, dict) else None
    digit = dtmf.get("digit") if isinstance(dtmf, dict) else None
    return msg.get("event") == "dtmf" and isinstance(digit, str) and len(digit) == 1 and \
        digit.upper() in "0123456789*#ABCD"


def _event_of(payload) -> object:
    try:
        msg = json.loads(payload)
    except (ValueError, TypeError):
        return None
    return msg.get("event") if isinstance(msg, dict) else None


async def _twilio_batch(t: Tally, port: int, inputs: list, started: bool, stop_ok: bool = False,
                        count=lambda label, payload, msgs: None, late: tuple[float, float] = (0.5, 2.0)) -> None:
    ws = await ws_open(f"ws://{HOST}:{port}/twilio")
    await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
    if started:
        await ws.send(json.dumps(TW_START))
    closed_at = await _send_each(t, ws, inputs, count, (0.02, 0.1), late)
    after_stop = closed_at is not None and stop_ok and _event_of(
        inputs[-1][1] if closed_at[0] == "(after the batch)" else closed_at[1]) == "stop"
    _count_closed(t, closed_at, expected=after_stop)
    if closed_at is not None:
        t.codes["closed after a stop (expected)" if after_stop else "closed, not after a stop"] += 1
    await ws.close()
    t.healthy = await twilio_health(port)


# --- Wyoming (TCP, JSON lines) ---------------------------------------------------------------------------
def wy_event(kind: str, data: dict | None = None, payload: bytes | None = None) -> bytes:
    header: dict = {"type": kind, "version": "1.5.2"}
    body = b""
    if data:
        body = json.dumps(data).encode()
        header["data_length"] = len(body)
    if payload is not None:
        header["payload_length"] = len(payload)
    return json.dumps(header).encode() + b"\n" + body + (payload or b"")


async def wy_exchange(port: int, data: bytes, follow_ping: bool = True, timeout: float = 30.0) -> dict:
    """Send raw bytes (then a ping): the events read back, whether the server closed, whether the ping got its pong."""
    reader, writer = await asyncio.open_connection(HOST, port, limit=1 << 22)
    events: list[dict] = []
    closed = pong = False
    try:
        writer.write(data + (wy_event("ping", {"text": "hp"}) if follow_ping else b""))
        await writer.drain()
        async with asyncio.timeout(timeout):
            while True:
                line = await reader.readline()
                if not line:
                    closed = True
                    break
                head = json.loads(line)
                dl, pl = head.get("data_length") or 0, head.get("payload_length") or 0
                if dl:
                    head.setdefault("data", {}).update(json.loads(await reader.readexactly(dl)))
                if pl:
                    await reader.readexactly(pl)
                events.append(head)
                if head.get("type") == "pong":
                    pong = True
                    break
                if head.get("type") == "error" or (not follow_ping and head.get("type") in (
                        "transcript", "audio-stop", "handled", "not-handled", "info", "synthesize-stopped")):
                    if not follow_ping:
                        break
    except TimeoutError:
        return {"events": events, "closed": False, "pong": False, "timeout": True}
    except (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError):
        closed = True
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
    return {"events": events, "closed": closed, "pong": pong, "timeout": False}


async def wyoming_health(port: int) -> bool:
    try:
        r = await wy_exchange(port, wy_event("describe"), follow_ping=False, timeout=10)
        return any(e.get("type") == "info" for e in r["events"])
    except (OSError, ValueError):
        return False


def _wy_count(t: Tally, label: str, payload: bytes, r: dict) -> None:
    t.sent += 1
    for e in r["events"]:
        if e.get("type") == "error":
            code = (e.get("data") or {}).get("code")
            t.codes[str(code)] += 1
            if code == "internal_error":
                t.faults += 1
                t.defect("internal_error", label, payload, str(e.get("data")))
    if r["closed"]:
        t.closed += 1
        if not any(e.get("type") == "error" for e in r["events"]):
            t.defect("closed_without_error", label, payload)
    if r["timeout"]:
        t.timeouts += 1
        t.defect("no_answer_in_time", label, payload, str(r["events"][-3:]))


async def wyoming_pass(port: int) -> None:
    rng = random.Random(2)
    templates = {
        "ping": {"text": "x"}, "transcribe": {"name": "tiny.en", "language": "en"},
        "audio-start": {"rate": 16000, "width": 2, "channels": 1, "timestamp": 0},
        "audio-chunk": {"rate": 16000, "width": 2, "channels": 1, "timestamp": 0},
        "synthesize": {"text": "Hi.", "voice": {"name": "en_US-joe-medium", "language": "en_US"}},
        "synthesize-chunk": {"text": "Hi."},
        "transcript": {"text": "Hi.", "context": {"conversation_id": "c1"}, "language": "en"},
    }
    for kind, data in templates.items():
        t = tally("wyoming", f"{kind} data mutations", "yes: a failed request gets error + close (wyoming.py)")
        for label, text in mutations(data, skip=("text",) if kind in ("transcript", "synthesize") else ()):
            body = text.encode("utf-8", "surrogatepass")
            head = json.dumps({"type": kind, "data_length": len(body), "payload_length": 640 if kind ==
                               "audio-chunk" else None}).encode().replace(b', "payload_length": null', b"")
            pre = wy_event("synthesize-start") if kind == "synthesize-chunk" else b""
            payload = pre + head + b"\n" + body + (bytes(640) if kind == "audio-chunk" else b"")
            r = await wy_exchange(port, payload)
            _wy_count(t, label, payload, r)
        if kind in ("transcript", "synthesize"):  # text junk: these are real requests (LM, TTS): a few only
            for name, raw in JUNK:
                if name in ("emoji", "combining", "long_str") or name.startswith("deep"):
                    body = with_raw(data, ("text",), raw).encode()
                    payload = wy_event(kind, None) .replace(b"}\n", f', "data_length": {len(body)}}}\n'.encode()) \
                        + body
                    r = await wy_exchange(port, payload, timeout=60)
                    _wy_count(t, f"text={name}", payload, r)
        t.healthy = await wyoming_health(port)
    t = tally("wyoming", "headers: invalid json / lengths / truncation", "yes: error + close (wyoming.py)")
    heads: list[tuple[str, bytes]] = [(f"invalid_json {i}", s.encode("utf-8", "surrogatepass") + b"\n")
                                      for i, s in enumerate(INVALID_TEXT) if "\n" not in s]
    for field in ("type", "data", "data_length", "payload_length"):
        for name, raw in JUNK:
            heads.append((f"{field}={name}", with_raw({"type": "ping", "data": {"text": "x"}}, (field,), raw)
                          .encode() + b"\n"))
    heads += [("data_length_beyond_eof", b'{"type": "ping", "data_length": 50}\n{"text"'),
              ("payload_length_beyond_eof", b'{"type": "audio-chunk", "payload_length": 5000}\n\x00\x00'),
              ("header_no_newline_eof", b'{"type": "ping"'),
              ("header_over_limit", b'{"type": "ping", "x": "' + b"a" * 70000 + b'"}\n'),
              ("payload_over_limit", b'{"type": "audio-chunk", "payload_length": 2000000}\n'),
              ("data_not_object", b'{"type": "ping", "data_length": 3}\n[1]'),
              ("data_invalid_json", b'{"type": "ping", "data_length": 3}\n{{{'),
              ("binary_junk", bytes(rng.randrange(256) for _ in range(300)) + b"\n"),
              ("crlf_only", b"\r\n" * 100), ("nul_line", b"\x00\n")]
    for label, payload in heads:
        close_only = label in ("data_length_beyond_eof", "payload_length_beyond_eof", "header_no_newline_eof")
        r = await wy_exchange(port, payload, follow_ping=not close_only, timeout=2 if close_only else 20)
        if close_only:  # the client hangs up mid-event (the server waits for the rest): nothing to answer
            r["closed"] = r["timeout"] = False
        _wy_count(t, label, payload, r)
    t.healthy = await wyoming_health(port)
    t = tally("wyoming", "audio: odd bytes, bad formats, out of order", "yes: error + close (wyoming.py)")
    seqs: list[tuple[str, bytes]] = []
    fmt = {"rate": 16000, "width": 2, "channels": 1}
    for n in (1, 3, 5, 321, 641, 1023):
        seqs.append((f"odd_chunk_{n}", wy_event("audio-start", fmt) + wy_event("audio-chunk", fmt, b"\x01" * n)
                     + wy_event("audio-stop")))
    for rate, width, channels in [(0, 2, 1), (1, 2, 1), (16000, 0, 1), (16000, 1, 1), (16000, 3, 1), (16000, 4, 1),
                                  (16000, 2, 0), (16000, 2, 3), (16000, 2, 255), (10 ** 9, 2, 1), (-16000, 2, 1),
                                  (8000, 2, 2), (48000, 2, 1), (16000, 8, 1), (7, 2, 1)]:
        f = {"rate": rate, "width": width, "channels": channels}
        seqs.append((f"format_{rate}_{width}_{channels}", wy_event("audio-start", f) + wy_event("audio-chunk", f,
                                                                                                    bytes(1920))
                     + wy_event("audio-stop")))
        seqs.append((f"chunk_format_{rate}_{width}_{channels}", wy_event("audio-chunk", f, bytes(1920))
                     + wy_event("audio-stop")))
    seqs += [("stop_without_audio", wy_event("audio-stop")), ("chunk_without_payload", wy_event("audio-start", fmt)
                                                               + wy_event("audio-chunk", fmt) + wy_event("audio-stop")),
             ("start_twice", wy_event("audio-start", fmt) * 2 + wy_event("audio-stop")),
             ("synth_stop_without_start", wy_event("synthesize-stop")),
             ("synth_chunk_outside", wy_event("synthesize-chunk", {"text": "x"})),
             ("synth_start_twice", wy_event("synthesize-start") * 2),
             ("audio_inside_synth", wy_event("synthesize-start") + wy_event("audio-chunk", fmt, bytes(640))),
             ("unknown_event", wy_event("zz-unknown", {"a": 1})), ("unknown_event_payload",
                                                                   wy_event("zz", None, b"\x00" * 1000)),
             ("chunk_rate_changes", wy_event("audio-start", fmt) + wy_event("audio-chunk", fmt, bytes(640))
              + wy_event("audio-chunk", {"rate": 8000, "width": 2, "channels": 1}, bytes(640))
              + wy_event("audio-stop"))]
    for label, payload in seqs:
        r = await wy_exchange(port, payload, timeout=60)
        _wy_count(t, label, payload, r)
    t.healthy = await wyoming_health(port)


# --- SIP (UDP) -------------------------------------------------------------------------------------------
SDP = ("v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\nm=audio 40000 RTP/AVP 0 8\r\n"
       "a=rtpmap:0 PCMU/8000\r\na=rtpmap:8 PCMA/8000\r\na=sendrecv\r\n")
SIP_JUNK = ["", " ", "\x00", "\u202e\ufeff", "\U0001f600" * 50, "a" * 5000, "-1", "99999999999999999999", "\u00b2",
            "<sip:>", "<>", ";;;;", "sip:@", "\"unterminated", "<sip:x@127.0.0.1", "1 2 3", "%00", "\r", "::"]


class SipClient(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.got: asyncio.Queue = asyncio.Queue()

    def datagram_received(self, data: bytes, addr) -> None:
        self.got.put_nowait(data)


def sip_msg(method: str, port: int, my_port: int, cid: str, headers: dict | None = None, body: str = "",
            request_line: str | None = None) -> str:
    h = {"Via": f"SIP/2.0/UDP 127.0.0.1:{my_port};branch=z9hG4bK{cid}", "Max-Forwards": "70",
         "From": f"<sip:hostile@127.0.0.1>;tag=t{cid}", "To": f"<sip:voice@127.0.0.1:{port}>", "Call-ID": cid,
         "CSeq": f"1 {method}", "Contact": f"<sip:hostile@127.0.0.1:{my_port}>"}
    if body:
        h["Content-Type"] = "application/sdp"
    h.update(headers or {})
    h = {k: v for k, v in h.items() if v is not None}
    h.setdefault("Content-Length", str(len(body.encode("utf-8", "surrogatepass"))))
    line = request_line or f"{method} sip:voice@127.0.0.1:{port} SIP/2.0"
    return line + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n" + body


async def sip_pass(port: int) -> None:
    loop = asyncio.get_running_loop()
    transport, client = await loop.create_datagram_endpoint(SipClient, local_addr=(HOST, 0))
    my_port = transport.get_extra_info("sockname")[1]
    n = 0

    def cid() -> str:
        nonlocal n
        n += 1
        return f"hostile{n}"

    async def send(t: Tally, label: str, data: bytes, wait: float = 0.4) -> list[bytes]:
        t.sent += 1
        transport.sendto(data, (HOST, port))
        answers = []
        try:
            while True:
                answers.append(await asyncio.wait_for(client.got.get(), wait))
                wait = 0.1
        except TimeoutError:
            pass
        for a in answers:
            m = re.match(rb"SIP/2\.0 (\d{3})", a)
            status = int(m.group(1)) if m else "not_sip"
            t.statuses[status] += 1
            if isinstance(status, int) and status >= 500 and status != 503:
                t.faults += 1
                t.defect(f"sip_{status}", label, data, a[:200].decode("utf-8", "replace"))
            if status == 200 and b"INVITE" in data[:6]:  # a call got set up: hang it up
                to = re.search(rb"(?im)^(?:to|t): *(.*)$", a)
                c = re.search(rb"(?im)^(?:call-id|i): *(.*)$", a)
                if to and c:
                    for meth, seq in (("ACK", 1), ("BYE", 2)):
                        bye = sip_msg(meth, port, my_port, c.group(1).decode().strip(),
                                      {"To": to.group(1).decode().strip(), "CSeq": f"{seq} {meth}"})
                        transport.sendto(bye.encode(), (HOST, port))
                    await asyncio.sleep(0.2)
                    while not client.got.empty():
                        client.got.get_nowait()
        if not answers:
            t.statuses["no_answer"] += 1
        return answers

    async def health() -> bool:
        for _ in range(3):
            answers = await SipHealth.ask(transport, client, port, my_port, cid())
            if any(a.startswith(b"SIP/2.0 200") for a in answers):
                return True
        return False

    t = tally("sip", "OPTIONS header mutations")
    names = ["Via", "Max-Forwards", "From", "To", "Call-ID", "CSeq", "Contact", "Content-Length"]
    for name in names:
        for junk in SIP_JUNK:
            c = cid()
            await send(t, f"{name}={short(junk, 40)}", sip_msg("OPTIONS", port, my_port, c, {name: junk})
                       .encode("utf-8", "surrogatepass"))
        c = cid()
        await send(t, f"drop {name}", sip_msg("OPTIONS", port, my_port, c, {name: None}).encode())
    for line in ["OPTIONS", "OPTIONS sip:x SIP/3.0", "OPTIONS  SIP/2.0", "FOO sip:x SIP/2.0", "SIP/2.0 200 OK",
                 "SIP/2.0 999", "SIP/2.0 abc x", "options sip:x SIP/2.0", "\x00 \x00 \x00",
                 "OPTIONS sip:x SIP/2.0 extra",
                 "INVITE", "BYE sip:x SIP/2.0", "CANCEL sip:x SIP/2.0", "ACK sip:x SIP/2.0", "INFO sip:x SIP/2.0",
                 "REGISTER sip:x SIP/2.0", "\U0001f600 sip:x SIP/2.0"]:
        await send(t, f"request_line={short(line, 40)}", sip_msg("OPTIONS", port, my_port, cid(), request_line=line)
                   .encode("utf-8", "surrogatepass"))
    t.healthy = await health()
    t = tally("sip", "raw datagrams: junk, truncation, oversized")
    rng = random.Random(3)
    good = sip_msg("OPTIONS", port, my_port, "trunc").encode()
    for i in range(1, len(good), 7):
        await send(t, f"truncated@{i}", good[:i], 0.15)
    for size in (0, 1, 2, 100, 1400, 9000, 65000):
        await send(t, f"random_{size}", bytes(rng.randrange(256) for _ in range(size)), 0.15)
    await send(t, "header_folding", good.replace(b"\r\nCSeq", b"\r\n CSeq"))
    await send(t, "lf_only", good.replace(b"\r\n", b"\n"))
    await send(t, "no_blank_line", good.rstrip(b"\r\n"))
    await send(t, "content_length_beyond", sip_msg("OPTIONS", port, my_port, cid(), {"Content-Length": "5000"})
               .encode())
    await send(t, "many_headers", sip_msg("OPTIONS", port, my_port, cid(), {f"X-{i}": "y" for i in range(2000)})
               .encode()[:65000])
    await send(t, "many_vias", sip_msg("OPTIONS", port, my_port, cid(), {"Via": ",".join(
        [f"SIP/2.0/UDP 127.0.0.1:{my_port};branch=z9hG4bK{i}" for i in range(500)])}).encode())
    t.healthy = await health()
    t = tally("sip", "INVITE: SDP and header mutations")
    lines = SDP.split("\r\n")[:-1]
    for i, _ in enumerate(lines):
        for junk in SIP_JUNK[:12] + ["m=audio 0 RTP/AVP 0", "m=audio 99999 RTP/AVP 0", "m=video 4000 RTP/AVP 31",
                                    "c=IN IP6 ::1", "m=audio 4000 RTP/AVP " + " ".join(["0"] * 500)]:
            body = "\r\n".join(lines[:i] + [junk] + lines[i + 1:]) + "\r\n"
            await send(t, f"sdp_line{i}={short(junk, 30)}", sip_msg("INVITE", port, my_port, cid(), body=body)
                       .encode("utf-8", "surrogatepass"))
    for name, value in [("Content-Type", "text/plain"), ("Content-Type", ""), ("Require", "100rel, foo"),
                        ("Content-Encoding", "gzip"), ("CSeq", "1 BYE"), ("CSeq", "-5 INVITE"), ("Max-Forwards", "0")]:
        await send(t, f"invite {name}={value}", sip_msg("INVITE", port, my_port, cid(), {name: value}, SDP).encode())
    for meth in ("BYE", "CANCEL", "ACK", "INFO"):  # in-dialog requests for dialogs that do not exist
        await send(t, f"{meth}_no_dialog", sip_msg(meth, port, my_port, cid(), {"To": "<sip:v@x>;tag=nope"}).encode())
    t.healthy = await health()
    transport.close()


class SipHealth:
    @staticmethod
    async def ask(transport, client: SipClient, port: int, my_port: int, call_id: str) -> list[bytes]:
        while not client.got.empty():
            client.got.get_nowait()
        transport.sendto(sip_msg("OPTIONS", port, my_port, call_id).encode(), (HOST, port))
        try:
            return [await asyncio.wait_for(client.got.get(), 3)]
        except TimeoutError:
            return []


# --- voice HTTP routes -----------------------------------------------------------------------------------
async def voice_http_pass(port: int) -> None:
    t = tally("voice-http", "methods x paths, heads, bodies, auth shapes")
    routes = ["/healthz", "/metrics", "/token", "/", "/index.html", "/ws", "/twilio", "/v1/realtime",
              "/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/%00", "/%ff%fe", "/" + "a" * 8000, "/\u202e",
              "/healthz?" + "a=1&" * 2000, "//healthz", "/healthz/", "*"]
    for method in ("GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH", "FOO", "G\u00c9T"):
        for path in routes:
            body = b"{}" if method in ("POST", "PUT", "PATCH") else None
            await count_http(t, port, f"{method} {short(path, 40)}", request(method, path, body))
    auths = ["Bearer", "Bearer ", "Bearer " + "k" * 10000, "Basic Zm9vOmJhcg==", "bearer x", "Bearer \u202e",
             "Bearer a b c", "\x00", "Token x", "Bearer x, Bearer y", "" ]
    for a in auths:
        for path in ("/token", "/metrics", "/healthz"):
            await count_http(t, port, f"auth {short(a, 30)} {path}", request("POST" if path == "/token" else "GET",
                                                                           path, headers=[("Authorization", a)]))
    for label, raw in [
        ("no_host", b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"),
        ("http_0.9", b"GET /healthz\r\n\r\n"), ("http_9.9", b"GET /healthz HTTP/9.9\r\n\r\n"),
        ("lowercase_version", b"GET /healthz http/1.1\r\nHost: x\r\n\r\n"),
        ("neg_content_length", b"POST /token HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"),
        ("two_content_lengths", b"POST /token HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 7\r\n\r\n{}"),
        ("huge_content_length", b"POST /token HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 40 + b"\r\n\r\n{}"),
        ("cl_and_te", b"POST /token HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"0\r\n\r\n"),
        ("bad_chunked", b"POST /token HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"),
        ("te_junk", b"POST /token HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked, junk\r\n\r\n0\r\n\r\n"),
        ("header_100k", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100000 + b"\r\n\r\n"),
        ("headers_5000", b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(5000))
         + b"\r\n"),
        ("header_no_colon", b"GET /healthz HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n"),
        ("header_nul", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: \x00\x01\r\n\r\n"),
        ("header_name_space", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX A: b\r\n\r\n"),
        ("header_utf8", "GET /healthz HTTP/1.1\r\nHost: x\r\nX-\u00e9: \U0001f600\r\n\r\n".encode()),
        ("bare_lf", b"GET /healthz HTTP/1.1\nHost: x\n\n"), ("random_bytes", bytes(range(256)) * 4 + b"\r\n\r\n"),
        ("tls_hello", bytes.fromhex("16030100a5010000a10303") + bytes(200)),
        ("body_50MB_declared", b"POST /token HTTP/1.1\r\nHost: x\r\nContent-Length: 50000000\r\n\r\n" + b"a" * 100000),
        ("ws_bad_key", request("GET", "/ws", headers=[("Upgrade", "websocket"), ("Connection", "Upgrade"),
                                                      ("Sec-WebSocket-Key", "???"), ("Sec-WebSocket-Version", "13")])),
        ("ws_bad_version", request("GET", "/ws", headers=[("Upgrade", "websocket"), ("Connection", "Upgrade"),
                                                          ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
                                                          ("Sec-WebSocket-Version", "999")])),
        ("ws_no_key", request("GET", "/v1/realtime", headers=[("Upgrade", "websocket"), ("Connection", "Upgrade")])),
        *[(f"ws_utf8_header {path}", request("GET", path, headers=[
            ("Upgrade", "websocket"), ("Connection", "Upgrade"), ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ("Sec-WebSocket-Version", "13"), ("X-Junk", "\u00e9")])) for path in ("/ws", "/v1/realtime", "/twilio")],
        ("ws_token_junk", request("GET", "/ws?token=%00%ff" + "x" * 5000, headers=[
            ("Upgrade", "websocket"), ("Connection", "Upgrade"), ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ("Sec-WebSocket-Version", "13"), ("Origin", "http://\u202eevil")])),
    ]:
        await count_http(t, port, label, raw, timeout=40, over_limit=label.startswith("body_"))
    t.healthy = (await http_raw(port, request("GET", "/healthz")))[0] == 200


# --- engine serve ----------------------------------------------------------------------------------------
CHAT = {"model": "small", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}


def schema_nest(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


PATHOLOGICAL_SCHEMAS: list[tuple[str, object]] = [
    ("nest_10", schema_nest(10)), ("nest_60", schema_nest(60)), ("nest_240", schema_nest(240)),
    ("self_ref", {"$ref": "#"}), ("ref_loop", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                              "$ref": "#/$defs/a"}),
    ("ref_nowhere", {"$ref": "#/$defs/nope"}), ("ref_remote", {"$ref": "http://example.com/s.json"}),
    ("enum_10k", {"enum": [f"v{i}" for i in range(10000)]}), ("enum_empty", {"enum": []}),
    ("catastrophic_pattern", {"type": "string", "pattern": "^(a+)+$"}), ("bad_pattern", {"type": "string",
                                                                                         "pattern": "(((["}),
    ("min_len_huge", {"type": "string", "minLength": 10 ** 9}), ("max_lt_min", {"type": "string", "minLength": 5,
                                                                             "maxLength": 1}),
    ("min_items_huge", {"type": "array", "minItems": 10 ** 12}), ("type_number", {"type": 123}),
    ("type_unknown", {"type": "quaternion"}), ("type_list_empty", {"type": []}),
    ("all_of_conflict", {"allOf": [{"type": "string"}, {"type": "integer"}]}),
    ("any_of_1000", {"anyOf": [{"const": i} for i in range(1000)]}), ("props_2000", {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)},
        "required": [f"p{i}" for i in range(2000)]}),
    ("required_missing_prop", {"type": "object", "required": ["nope"], "properties": {},
                               "additionalProperties": False}),
    ("false_schema", False), ("true_schema", True), ("not_object", [1, 2]), ("string_schema", "object"),
    ("long_prop_name", {"type": "object", "properties": {"k" * 50000: {"type": "string"}}}),
    ("format_junk", {"type": "string", "format": "\u202e"}), ("multiple_of_zero", {"type": "number", "multipleOf": 0}),
    ("int_range_empty", {"type": "integer", "minimum": 5, "maximum": 1}), ("nan_bound", {"type": "number",
                                                                                         "minimum": "NaN"}),
    ("unicode_props", {"type": "object", "properties": {"\ud83d\ude00\u202e": {"type": "string"}}}),
    ("deep_array", {"type": "array", "items": {"type": "array", "items": {"type": "array", "items": schema_nest(30)}}}),
]


async def engine_pass(port: int) -> None:
    url = "/v1/chat/completions"

    def post(body: bytes, headers=None, ctype="application/json") -> bytes:
        return request("POST", url, body, headers, ctype)

    t = tally("engine", "chat body field mutations")
    template = dict(CHAT, stream=False, seed=1, top_p=1.0, stream_options=None, mode="ar", rule="verify",
                    parallel_tool_calls=True)
    for label, text in mutations(template):
        await count_http(t, port, label, post(text.encode("utf-8", "surrogatepass")), timeout=90)
    t.healthy = await engine_health(port)
    t = tally("engine", "raw bodies, heads, content types")
    for i, s in enumerate(INVALID_TEXT):
        await count_http(t, port, f"invalid_json {i}", post(s.encode("utf-8", "surrogatepass")))
    for label, raw in [("text_plain", post(json.dumps(CHAT).encode(), ctype="text/plain")),
                       ("form", post(b"a=1&b=2", ctype="application/x-www-form-urlencoded")),
                       ("latin1", post(json.dumps(CHAT).encode("utf-16"))),
                       ("body_8MB", post(json.dumps(dict(CHAT, pad="a" * (8 << 20))).encode())),
                       ("body_50MB_declared", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                        b"50000000\r\n\r\n" + b"{" * 100000),
                       ("neg_content_length", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n"
                        b"\r\n"),
                       ("bad_chunked", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                        b"\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"),
                       ("get_completions", request("GET", url)), ("models_junk", request("GET", "/v1/models/%00%ff")),
                       ("models_long", request("GET", "/v1/models/" + "m" * 8000)),
                       ("models_traversal", request("GET", "/v1/models/../../etc/passwd")),
                       ("auth_junk", post(json.dumps(CHAT).encode(),
                                          [("Authorization", "Bearer \u202e" + "x" * 9000)])),
                       ("header_100k", post(json.dumps(CHAT).encode(), [("X-Big", "a" * 100000)]))]:
        await count_http(t, port, label, raw, timeout=60, over_limit=label.startswith("body_"))
    t.healthy = await engine_health(port)
    msg_cases: list[tuple[str, object]] = [
        ("messages_empty", []), ("role_tool_no_id", [{"role": "tool", "content": "x"}]),
        ("assistant_bad_tool_calls", [{"role": "assistant", "tool_calls": [{"id": 1, "function": {
            "name": None, "arguments": "{"}}]}, {"role": "user", "content": "x"}]),
        ("content_parts_junk", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        ("content_parts_nested", [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]),
        ("many_messages", [{"role": "user", "content": "x"}] * 5000),
        ("huge_content", [{"role": "user", "content": "word " * 200000}]),
        ("only_system", [{"role": "system", "content": "x"}]), ("role_unknown", [{"role": "root", "content": "x"}]),
        ("name_junk", [{"role": "user", "content": "x", "name": "\u0000" * 100}]),
        ("tool_after_nothing", [{"role": "tool", "tool_call_id": "nope", "content": "x"},
                                {"role": "user", "content": "x"}]),
    ]
    t = tally("engine", "messages shapes")
    for label, messages in msg_cases:
        await count_http(t, port, label, post(json.dumps(dict(CHAT, messages=messages)).encode()), timeout=120)
    t.healthy = await engine_health(port)
    t = tally("engine", "pathological json_schema / tools / tool_choice")
    for label, schema in PATHOLOGICAL_SCHEMAS:
        for strict in (True, False):
            body = dict(CHAT, response_format={"type": "json_schema", "json_schema": {"name": "s", "strict": strict,
                                                                                     "schema": schema}})
            await count_http(t, port, f"schema {label} strict={strict}", post(json.dumps(body).encode()), timeout=120)
        body = dict(CHAT, tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                    tool_choice="required")
        await count_http(t, port, f"tool params {label}", post(json.dumps(body).encode()), timeout=120)
    tool = {"type": "function", "function": {"name": "get_time", "description": "time",
                                             "parameters": {"type": "object", "properties": {}}}}
    for label, choice in [("none", "none"), ("auto", "auto"), ("required", "required"), ("unknown_str", "sometimes"),
                          ("named_missing", {"type": "function", "function": {"name": "nope"}}),
                          ("named_no_fn", {"type": "function"}), ("named_fn_null", {"type": "function",
                                                                                   "function": None}),
                          ("named_name_int", {"type": "function", "function": {"name": 5}}), ("int", 1),
                          ("list", ["auto"]), ("allowed_tools", {"type": "allowed_tools", "mode": "auto", "tools": []}),
                          ("custom", {"type": "custom", "custom": {"name": "x"}}), ("empty_obj", {}),
                          ("nan", float("nan"))]:
        for tools in ([tool], [], None, [tool, tool]):
            body = dict(CHAT, tool_choice=choice) if tools is None else dict(CHAT, tools=tools, tool_choice=choice)
            await count_http(t, port, f"tool_choice {label} tools={len(tools) if tools is not None else None}",
                             post(json.dumps(body).encode()), timeout=120)
    for label, tools in [("name_empty", [{"type": "function", "function": {"name": ""}}]),
                         ("name_unicode", [{"type": "function", "function": {"name": "\u202e\ud83d\ude00"}}]),
                         ("name_long", [{"type": "function", "function": {"name": "n" * 10000}}]),
                         ("no_function", [{"type": "function"}]), ("type_junk", [{"type": "retrieval"}]),
                         ("tools_obj", {"a": 1}), ("tools_1000", [dict(tool, function=dict(tool["function"],
                                                                                          name=f"f{i}"))
                                                                 for i in range(1000)]),
                         ("params_not_obj", [{"type": "function", "function": {"name": "f", "parameters": "x"}}])]:
        await count_http(t, port, f"tools {label}", post(json.dumps(dict(CHAT, tools=tools,
                                                                          tool_choice="auto")).encode()), timeout=120)
    for label, fmt in [("json_object", {"type": "json_object"}), ("unknown", {"type": "yaml"}), ("str", "json"),
                       ("schema_missing", {"type": "json_schema"}), ("schema_null", {"type": "json_schema",
                                                                                    "json_schema": None}),
                       ("schema_and_tools", {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}})]:
        body = dict(CHAT, response_format=fmt, tools=[tool]) if label == "schema_and_tools" else \
            dict(CHAT, response_format=fmt)
        await count_http(t, port, f"response_format {label}", post(json.dumps(body).encode(), ), timeout=120)
    t.healthy = await engine_health(port)


async def engine_health(port: int) -> bool:
    status, _, _ = await http_raw(port, request("POST", "/v1/chat/completions", json.dumps(CHAT).encode()), 120)
    return status == 200


# --- slowloris -------------------------------------------------------------------------------------------
async def slowloris(fronts: dict[str, tuple[int, bytes]], per_front: int, hold_s: float,
                    services: dict[str, Service]) -> dict:
    """`per_front` connections per front sending an unfinished head or body, a byte every few seconds; after
    `hold_s`, how many the server closed (and when)."""
    opened: dict[str, list] = {}
    closed_at: dict[str, list[float]] = {k: [] for k in fronts}
    t0 = time.monotonic()

    async def one(front: str, port: int, partial: bytes) -> None:
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
        except OSError:
            closed_at[front].append(-1.0)
            return
        opened.setdefault(front, []).append(writer)
        try:
            writer.write(partial)
            await writer.drain()
            while time.monotonic() - t0 < hold_s:
                try:
                    data = await asyncio.wait_for(reader.read(4096), 4.0)
                    if not data:
                        closed_at[front].append(round(time.monotonic() - t0, 1))
                        return
                except TimeoutError:
                    writer.write(b"a")  # one more byte: never the end
                    await writer.drain()
        except (ConnectionResetError, BrokenPipeError):
            closed_at[front].append(round(time.monotonic() - t0, 1))

    tasks = [asyncio.create_task(one(f, port, partial)) for f, (port, partial) in fronts.items()
             for _ in range(per_front)]
    await asyncio.sleep(3.0)
    peak = {name: s.usage() for name, s in services.items()}
    await asyncio.gather(*tasks)
    after = {name: s.usage() for name, s in services.items()}
    for writers in opened.values():
        for w in writers:
            w.close()
    return {"per_front": per_front, "hold_s": hold_s, "usage_while_held_3s": peak, "usage_after_hold": after,
            "closed_by_server": {f: len(v) for f, v in closed_at.items()},
            "close_times_s": {f: sorted(v)[:3] + (["..."] if len(v) > 3 else []) + sorted(v)[-1:] for f, v in
                              closed_at.items() if v}}


# --- main ------------------------------------------------------------------------------------------------
async def run(args, voice: Service, engine: Service, ports: dict) -> dict:
    services = {"voice": voice, "engine": engine}
    out: dict = {"usage": {"baseline": {n: s.usage() for n, s in services.items()}}}
    stages = [("ws", native_first_frames, ports["http"]), ("ws", native_after_start, ports["http"]),
              ("realtime", realtime_pass, ports["http"]), ("twilio", twilio_pass, ports["http"]),
              ("wyoming", wyoming_pass, ports["wyoming"]), ("sip", sip_pass, ports["sip"]),
              ("voice-http", voice_http_pass, ports["http"]), ("engine", engine_pass, ports["engine"])]
    timings = {}
    for name, fn, port in stages:
        if args.only and name not in args.only:
            continue
        t = time.monotonic()
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {fn.__name__}", flush=True)
        try:
            await fn(port)
        except Exception as err:  # noqa: BLE001 - a front the pass could not finish: reported, the rest goes on
            print(f"  {fn.__name__} stopped: {err!r}", flush=True)
            tally(name, f"{fn.__name__} (pass aborted)").defect("pass_aborted", fn.__name__, "", repr(err))
        timings[fn.__name__] = round(time.monotonic() - t, 1)
        if not voice.alive() or not engine.alive():
            print("  a service died!", flush=True)
            break
    out["seconds"] = timings
    out["usage"]["after_inputs"] = {n: s.usage() for n, s in services.items()}
    if args.slowloris_s > 0:
        print(f"[{time.strftime('%H:%M:%S')}] slowloris: {args.slowloris_conns} per front for {args.slowloris_s:.0f} s",
              flush=True)
        fronts = {"voice-http head": (ports["http"], b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-a: "),
                  "voice-http body": (ports["http"], b"POST /token HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n"
                                                     b"\r\n{"),
                  "voice ws upgrade head": (ports["http"], b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"),
                  "engine head": (ports["engine"], b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-a: "),
                  "engine body": (ports["engine"], b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                                   b"Content-Length: 100000\r\n\r\n{\"messages\": ["),
                  "wyoming header line": (ports["wyoming"], b'{"type": "ping", "x": "'),
                  "wyoming data block": (ports["wyoming"], b'{"type": "ping", "data_length": 60000}\n{"text": "')}
        out["slowloris"] = await slowloris(fronts, args.slowloris_conns, args.slowloris_s, services)
        out["usage"]["after_slowloris"] = out["slowloris"]["usage_after_hold"]
    await asyncio.sleep(5.0)
    out["usage"]["after_clients_left"] = {n: s.usage() for n, s in services.items()}
    out["health_at_end"] = {"ws": await native_health(ports["http"]), "realtime": await realtime_health(ports["http"]),
                            "twilio": await twilio_health(ports["http"]),
                            "wyoming": await wyoming_health(ports["wyoming"]),
                            "voice-http": (await http_raw(ports["http"], request("GET", "/healthz")))[0] == 200,
                            "engine": await engine_health(ports["engine"])}
    return out


def table(rows: list[dict]) -> str:
    head = f"{'front':<11} {'class':<48} {'inputs':>6} {'closed':>6} {'exp?':>4} {'5xx':>4} {'fault':>5} " \
           f"{'t/o':>4} {'health':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['front']:<11} {r['class'][:48]:<48} {r['inputs']:>6} {r['closed_by_server']:>6} "
                     f"{'yes' if r['closes_expected'] != 'no' else 'no':>4} {r['http_5xx']:>4} {r['server_faults']:>5} "
                     f"{r['timeouts']:>4} {str(r['healthy_after']):>6}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slowloris-s", type=float, default=65.0, help="how long the slowloris holds its connections "
                    "(HTTP head deadline 10 s, body 30 s; Wyoming idle_timeout_s 60 s); 0 = skip")
    ap.add_argument("--slowloris-conns", type=int, default=30, help="connections per slowloris front")
    ap.add_argument("--only", nargs="*", help="fronts to run: ws realtime twilio wyoming sip voice-http engine")
    ap.add_argument("--engine-max-new-tokens", type=int, default=8, help="engine serve --max-new-tokens (keeps the "
                    "inputs that are valid requests cheap)")
    ap.add_argument("--json", type=Path, default=RESULTS / "hostile_pass.json")
    ap.add_argument("--logs", type=Path, default=None, help="folder for the services' logs (default: a new /tmp one)")
    args = ap.parse_args()

    logs = args.logs or Path(tempfile.mkdtemp(prefix="hostile_pass_", dir="/tmp"))
    logs.mkdir(parents=True, exist_ok=True)
    cfg = logs / "voice.toml"
    # Capacity admission off: the pass opens its calls one after another, and a call refused with
    # 503 `too_many_sessions` while the one before still answers (keys are turns) would stop it.
    cfg.write_text('[lm]\nmodel = "small"\n\n[limits]\nmax_load = 0\n')
    ports = {"http": free_port(), "wyoming": free_port(), "engine": free_port()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        ports["sip"] = s.getsockname()[1]
    bin_dir = REPO / ".venv" / "bin"
    voice = Service("voice serve", [str(bin_dir / "voice"), "serve", "--config", str(cfg), "--port", str(ports["http"]),
                                    "--wyoming-port", str(ports["wyoming"]), "--sip-port", str(ports["sip"]),
                                    "--records", str(logs / "records.sqlite3")],
                    logs / "voice.log", f"http://{HOST}:{ports['http']}/healthz")
    engine = Service("engine serve", [str(bin_dir / "engine"), "serve", "--model", "small", "--port",
                                      str(ports["engine"]), "--threads", "1", "--max-new-tokens",
                                      str(args.engine_max_new_tokens)],
                     logs / "engine.log", f"http://{HOST}:{ports['engine']}/healthz")
    print(f"logs: {logs}; ports: {ports}", flush=True)
    t0 = time.monotonic()
    voice.start()
    engine.start()
    try:
        voice.wait_ready(600)
        engine.wait_ready(600)
        print(f"services ready in {time.monotonic() - t0:.0f} s (voice pid {voice.proc.pid}, engine pid "
              f"{engine.proc.pid})", flush=True)
        out = asyncio.run(run(args, voice, engine, ports))
        out["alive_at_end"] = {"voice": voice.alive(), "engine": engine.alive()}
    finally:
        voice.stop()
        engine.stop()
    rows = [t.row() for t in TALLIES]
    out["tracebacks"] = {"voice": voice.tracebacks(), "engine": engine.tracebacks()}
    out["log_errors"] = {name: len(re.findall(r"(?m)^.*\b(ERROR|CRITICAL)\b", s.log_path.read_text(errors="replace")))
                         for name, s in (("voice", voice), ("engine", engine))}
    result = {"bench": "hostile_pass", "issue": 41, "machine": machine(), "ports": ports, "logs": str(logs),
              "config": cfg.read_text(), "engine_argv": engine.argv[1:], "rows": rows, **out,
              "totals": {"inputs": sum(r["inputs"] for r in rows),
                         "closed_unexpected": sum(r["closed_by_server"] for r in rows if r["closes_expected"] == "no"),
                         "http_5xx": sum(r["http_5xx"] for r in rows),
                         "server_faults": sum(r["server_faults"] for r in rows),
                         "timeouts": sum(r["timeouts"] for r in rows)}}
    print(table(rows))
    print("usage (fds, rss MB):")
    for when, u in result["usage"].items():
        print(f"  {when:<20} " + "  ".join(f"{n}: fds {v.get('fds')} rss {v.get('rss_mb')} tcp {v.get('connections')}"
                                           for n, v in u.items()))
    if "slowloris" in result:
        held = result["slowloris"]["usage_while_held_3s"]
        print("  while slowloris held  " + "  ".join(f"{n}: fds {v.get('fds')} rss {v.get('rss_mb')} tcp "
                                                     f"{v.get('connections')}" for n, v in held.items()))
        print(f"slowloris closed by server: {result['slowloris']['closed_by_server']}")
        print(f"slowloris close times (s): {result['slowloris']['close_times_s']}")
    print(f"tracebacks in logs: {result['tracebacks']}; ERROR lines: {result['log_errors']}")
    print(f"totals: {result['totals']}; health at end: {result.get('health_at_end')}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.json}")
    os.sync()


if __name__ == "__main__":
    main()
