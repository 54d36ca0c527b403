"""SIP messages (RFC 3261 section 7): parse a datagram, build responses and in-dialog requests."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

from engine.common.wire import ascii_int

SIP_VERSION = "SIP/2.0"
AGENT = "diffusion-voice"
# compact header forms (RFC 3261 section 7.3.3 and the extensions we may see)
COMPACT = {"v": "via", "f": "from", "t": "to", "i": "call-id", "m": "contact", "l": "content-length",
           "c": "content-type", "k": "supported", "s": "subject", "e": "content-encoding", "o": "event",
           "u": "allow-events", "r": "refer-to", "x": "session-expires"}
# headers whose comma-separated values are separate entries (RFC 3261 section 7.3.1)
MULTI = {"via", "route", "record-route", "contact"}
REASONS = {100: "Trying", 180: "Ringing", 200: "OK", 400: "Bad Request", 403: "Forbidden", 405: "Method Not Allowed",
           415: "Unsupported Media Type", 420: "Bad Extension", 481: "Call/Transaction Does Not Exist",
           482: "Loop Detected", 486: "Busy Here", 487: "Request Terminated", 488: "Not Acceptable Here",
           500: "Server Internal Error", 503: "Service Unavailable"}
_TOKEN = re.compile(r"^[A-Za-z0-9.!%*_+`'~-]+$")
_CANONICAL = {"call-id": "Call-ID", "cseq": "CSeq", "www-authenticate": "WWW-Authenticate"}


class SipError(ValueError):
    pass


def canonical(name: str) -> str:
    return _CANONICAL.get(name, "-".join(p.capitalize() for p in name.split("-")))


def split_commas(value: str) -> list[str]:
    """Split a header value on commas outside quotes and <...>."""
    out, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(value):
        if ch == '"' and (i == 0 or value[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and ch == "<":
            depth += 1
        elif not quoted and ch == ">":
            depth -= 1
        elif not quoted and depth == 0 and ch == ",":
            out.append(value[start:i].strip())
            start = i + 1
    out.append(value[start:].strip())
    return [v for v in out if v]


def params(value: str) -> dict[str, str]:
    """Header parameters (;tag=..., ;branch=...) after the address, lower-cased names."""
    if ">" in value:  # name-addr: parameters follow the <URI>
        value = value[value.rindex(">") + 1:]
    # else a Via (parameters follow sent-by) or a bare addr-spec, which can't carry URI parameters
    result = {}
    for part in value.split(";")[1:]:
        name, _, v = part.strip().partition("=")
        if name:
            result[name.lower()] = v.strip()
    return result


def address_uri(value: str) -> str:
    """The URI inside a name-addr (<sip:...>) or an addr-spec."""
    if "<" in value and ">" in value:
        return value[value.index("<") + 1:value.index(">")]
    return value.split(";")[0].strip()


def uri_hostport(uri: str) -> tuple[str, int]:
    """Host and port of a sip: URI (default port 5060)."""
    m = re.match(r"^sips?:(?:[^@]*@)?(\[[^\]]+\]|[^:;?>]+)(?::(\d+))?", uri.strip(), re.I)
    if not m:
        raise SipError(f"not a SIP URI: {uri!r}")
    return m.group(1).strip("[]"), int(m.group(2) or 5060)


def sent_by(via: str) -> tuple[str, int | None]:
    """Host and port of a Via value's sent-by ("SIP/2.0/UDP host:port;branch=...")."""
    words = via.split(";")[0].split()
    value = words[-1] if words else ""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest[1:]
    elif value.count(":") == 1:
        host, port = value.split(":")
    else:
        host, port = value, ""
    return host, ascii_int(port, 5)  # "²".isdigit() is true, and int("²") raises


def valid_via(via: str) -> bool:
    """A Via we can answer: "SIP/2.0/UDP host[:port]" (then parameters)."""
    words = via.split(";")[0].split()
    return len(words) == 2 and words[0].upper().startswith("SIP/2.0/") and bool(sent_by(via)[0])


def new_tag() -> str:
    return secrets.token_hex(6)


def new_branch() -> str:
    return "z9hG4bK" + secrets.token_hex(8)


@dataclass
class SipMessage:
    method: str | None = None  # requests
    uri: str | None = None
    status: int | None = None  # responses
    reason: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)  # (lower-case full name, value), in order
    body: bytes = b""

    @property
    def is_request(self) -> bool:
        return self.method is not None

    def get(self, name: str) -> str | None:
        vals = self.all(name)
        return vals[0] if vals else None

    def all(self, name: str) -> list[str]:
        out = []
        for n, v in self.headers:
            if n == name:
                out += split_commas(v) if n in MULTI else [v]
        return out

    @property
    def call_id(self) -> str:
        return self.get("call-id") or ""

    @property
    def cseq(self) -> tuple[int, str]:
        num, _, method = (self.get("cseq") or "").partition(" ")
        return int(num), method.strip().upper()

    @property
    def branch(self) -> str:
        return params(self.get("via") or "").get("branch", "")

    @property
    def from_tag(self) -> str:
        return params(self.get("from") or "").get("tag", "")

    @property
    def to_tag(self) -> str:
        return params(self.get("to") or "").get("tag", "")

    @classmethod
    def parse(cls, data: bytes) -> "SipMessage":
        """Parse one datagram; `SipError` says what is wrong (missing mandatory headers included)."""
        head, sep, body = data.partition(b"\r\n\r\n")
        if not sep:
            head, sep, body = data.partition(b"\n\n")
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as err:
            raise SipError("headers are not UTF-8") from err
        lines = text.lstrip("\r\n").replace("\r\n", "\n").split("\n")
        first = lines[0].split(" ", 2)
        msg = cls()
        if first[0] == SIP_VERSION:
            if len(first) < 2 or ascii_int(first[1], 3) is None or len(first[1]) != 3:
                raise SipError(f"bad status line {lines[0][:60]!r}")
            msg.status, msg.reason = int(first[1]), first[2] if len(first) > 2 else ""
        else:
            if len(first) != 3 or first[2] != SIP_VERSION or not _TOKEN.match(first[0]) or ":" not in first[1]:
                raise SipError(f"bad request line {lines[0][:60]!r}")
            msg.method, msg.uri = first[0].upper(), first[1]
        for line in lines[1:]:
            if line[:1] in (" ", "\t") and msg.headers:  # folded continuation
                name, value = msg.headers[-1]
                msg.headers[-1] = (name, value + " " + line.strip())
                continue
            name, colon, value = line.partition(":")
            name = name.strip().lower()
            if not colon or not name or not _TOKEN.match(name):
                raise SipError(f"bad header line {line[:60]!r}")
            msg.headers.append((COMPACT.get(name, name), value.strip()))
        length = msg.get("content-length")
        if length is not None:
            if ascii_int(length, 10) is None or int(length) > len(body):
                raise SipError(f"Content-Length {length!r} does not match the {len(body)}-byte body")
            body = body[:int(length)]
        msg.body = body
        for required in ("via", "from", "to", "call-id", "cseq"):
            if msg.get(required) is None:
                raise SipError(f"missing {canonical(required)} header")
        if not valid_via(msg.get("via") or ""):
            raise SipError(f"bad Via {(msg.get('via') or '')[:60]!r}")
        num, _, method = (msg.get("cseq") or "").partition(" ")
        if ascii_int(num.strip(), 10) is None or not method.strip():
            raise SipError(f"bad CSeq {msg.get('cseq')!r}")
        if msg.is_request and method.strip().upper() != msg.method:
            raise SipError("CSeq method does not match the request method")
        return msg

    def to_bytes(self) -> bytes:
        start = f"{self.method} {self.uri} {SIP_VERSION}" if self.is_request else \
            f"{SIP_VERSION} {self.status} {self.reason}"
        lines = [start] + [f"{canonical(n)}: {v}" for n, v in self.headers if n != "content-length"]
        lines.append(f"Content-Length: {len(self.body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + self.body


def response(req: SipMessage, status: int, source: tuple[str, int], to_tag: str = "",
             extra: list[tuple[str, str]] | None = None, body: bytes = b"", content_type: str = "") -> SipMessage:
    """A response to `req` (RFC 3261 section 8.2.6): Vias, From, To (+ our tag), Call-ID, CSeq copied."""
    resp = SipMessage(status=status, reason=REASONS.get(status, "Unknown"))
    for i, via in enumerate(req.all("via")):
        if i == 0:  # section 18.2.1 and RFC 3581: say where the request really came from
            host, _ = sent_by(via)
            parts = [p.strip() for p in via.split(";")]
            kept = [parts[0]] + [p for p in parts[1:] if p.split("=")[0].lower() not in ("received", "rport")]
            if host != source[0]:
                kept.append(f"received={source[0]}")
            if any(p.split("=")[0].lower() == "rport" for p in parts[1:]):
                kept.append(f"rport={source[1]}")
                if host == source[0]:
                    kept.append(f"received={source[0]}")
            via = ";".join(kept)
        resp.headers.append(("via", via))
    resp.headers.append(("from", req.get("from") or ""))
    to = req.get("to") or ""
    if to_tag and status != 100 and "tag" not in params(to):
        to += f";tag={to_tag}"
    resp.headers.append(("to", to))
    resp.headers.append(("call-id", req.call_id))
    resp.headers.append(("cseq", req.get("cseq") or ""))
    if req.method == "INVITE" and 100 < status < 300:  # dialog-creating: copy Record-Route (section 12.1.1)
        resp.headers += [("record-route", rr) for rr in req.all("record-route")]
    resp.headers.append(("server", AGENT))
    resp.headers += extra or []
    if body:
        resp.headers.append(("content-type", content_type))
    resp.body = body
    return resp


def response_destination(req: SipMessage, source: tuple[str, int]) -> tuple[str, int]:
    """Where a response goes (section 18.2.2, RFC 3581): the source address; its port if rport."""
    via = req.get("via") or ""
    if "rport" in params(via):
        return source
    _, port = sent_by(via)
    return source[0], port or 5060
