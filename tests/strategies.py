"""Hypothesis strategies for what arrives on the wire (tests/test_fuzz.py, tests/test_reliability.py)."""

from __future__ import annotations

import base64
import json
import string

from hypothesis import strategies as st

# --- JSON and the native start message ---------------------------------------------------------

json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=30))
json_value = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=12)
rate_like = st.one_of(st.sampled_from([8000, 16000, 22050, 24000, 32000, 44100, 48000]), json_scalar,
                      st.sampled_from([16000.0, True, "16000", -16000, 0]))


@st.composite
def start_messages(draw) -> str:
    """Mostly start-shaped objects with random values, sometimes anything at all."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.text(max_size=200))
    if kind == 1:
        return json.dumps(draw(json_value))
    if kind == 2:  # deep nesting
        depth = draw(st.integers(100, 100000))
        return "[" * depth + "]" * draw(st.integers(0, depth))
    msg = {"type": draw(st.one_of(st.just("start"), json_scalar))}
    for key, values in (("version", st.one_of(st.just(1), json_scalar)), ("sample_rate", rate_like),
                        ("output_sample_rate", rate_like), ("encoding", st.one_of(st.just("pcm_s16le"), json_scalar)),
                        ("session", st.one_of(st.dictionaries(
                            st.sampled_from(["system_prompt", "lm_mode", "x"]),
                            st.one_of(st.sampled_from(["ar", "diffusion", ""]), json_value), max_size=3),
                            json_value))):
        if draw(st.booleans()):
            msg[key] = draw(values)
    return json.dumps(msg)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@st.composite
def twilio_messages(draw) -> str:
    kind = draw(st.integers(0, 11))
    if kind == 0:
        return draw(st.text(max_size=200))
    if kind == 1:
        return json.dumps(draw(json_value))
    sid = draw(st.one_of(st.just("MZ1"), json_scalar))
    if kind in (2, 3):
        fmt = draw(st.one_of(st.just({"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}), json_value))
        start = draw(st.one_of(st.just({"streamSid": "MZ1", "callSid": "CA1", "mediaFormat": fmt}), json_value))
        return json.dumps({"event": "start", "streamSid": sid, "start": start})
    if kind in (4, 5, 6):
        payload = draw(st.one_of(st.binary(max_size=400).map(_b64), st.text(max_size=50), json_scalar,
                                 st.binary(min_size=8001, max_size=9000).map(_b64)))
        media = draw(st.one_of(st.fixed_dictionaries({"payload": st.just(payload)}, optional={
            "track": st.sampled_from(["inbound", "outbound", "x"]), "chunk": st.one_of(st.text(max_size=5),
                                                                                      json_scalar)}), json_value))
        return json.dumps({"event": "media", "streamSid": sid, "media": media})
    event = draw(st.one_of(st.sampled_from(["connected", "mark", "dtmf", "stop", "clear"]), st.text(max_size=10)))
    body = draw(st.one_of(st.fixed_dictionaries({"name": st.one_of(st.text(max_size=20), json_scalar)}),
                          st.fixed_dictionaries({"digit": st.one_of(st.text(max_size=2), json_scalar)}), json_value))
    return json.dumps({"event": event, "streamSid": sid, "mark": body, "dtmf": body})



# --- SIP / SDP ---

INVITE = (
    "INVITE sip:bot@127.0.0.1:5060 SIP/2.0\r\n"
    "Via: SIP/2.0/UDP 127.0.0.1:5099;branch=z9hG4bKfuzz1;rport\r\n"
    "Max-Forwards: 70\r\n"
    "From: <sip:fuzz@127.0.0.1>;tag=abc\r\n"
    "To: <sip:bot@127.0.0.1>\r\n"
    "Call-ID: fuzz-call-1\r\n"
    "CSeq: 1 INVITE\r\n"
    "Contact: <sip:fuzz@127.0.0.1:5099>\r\n"
    "Content-Type: application/sdp\r\n"
    "Content-Length: {length}\r\n\r\n{body}")
SDP = ("v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
       "m=audio 40000 RTP/AVP 0 8 101\r\na=rtpmap:101 telephone-event/8000\r\na=ptime:20\r\na=sendrecv\r\n")
SIP_CHARS = string.printable + "é\u0663\u00b2\x00"


@st.composite
def mutated(draw, template: str) -> str:
    """`template` with a few lines dropped, duplicated, truncated or replaced by junk."""
    lines = template.split("\r\n")
    for _ in range(draw(st.integers(0, 4))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.integers(0, 4))
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(i, lines[i])
        elif op == 2:
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
        elif op == 3:
            name = lines[i].split(":", 1)[0] if ":" in lines[i] else lines[i][:2]
            lines[i] = name + ":" + draw(st.text(SIP_CHARS, max_size=40))
        else:
            lines[i] = draw(st.text(SIP_CHARS, max_size=60))
    return "\r\n".join(lines)


@st.composite
def sdp_texts(draw) -> str:
    return draw(st.one_of(mutated(SDP), st.text(SIP_CHARS, max_size=300)))


@st.composite
def sip_datagrams(draw) -> bytes:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.binary(max_size=600))
    if kind == 1:
        return draw(st.text(SIP_CHARS, max_size=400)).encode("utf-8", "replace")
    body = draw(sdp_texts())
    text = INVITE.format(length=len(body.encode()), body=body)
    if kind == 2:  # other methods on the same headers
        method = draw(st.sampled_from(["BYE", "CANCEL", "OPTIONS", "INFO", "ACK", "REGISTER", "FOO"]))
        text = text.replace("INVITE", method)
    return draw(mutated(text)).encode("utf-8", "replace")


# --- hostile JSON (tests/test_wire.py) ----------------------------------------------------------
# Raw JSON *text* fragments, spliced into otherwise well-formed messages: most of them can't be
# produced by json.dumps at all (a 4,400-digit integer, NaN, a lone surrogate escape, 100,000
# levels of nesting).

_surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
UNICODE_DIGITS = ["²", "³", "¹", "٣", "١٦٠٠٠", "１６０００", "߀", "፩", "𝟙𝟞𝟘𝟘𝟘", "Ⅻ", "½", "16000", "0x3e80", "+16000",
                  " 16000", "16_000", "1e4"]
BROKEN = ['{"type": "start"', '{"a": 1}}', '\ufeff{"type": "start"}', '{"a": "\\x"}', '{"a": "\\u12"}', "", " ",
          "[1,]", "{'a': 1}", '{"a": 1} x', '{"a" 1}', '{"a": 01}', '{"a": .5}', '{"a": -}', '{"a": "\x00"}',
          '{"a": "\n"}', "nul", "tru", '{"a": 1e}', '"\\ud800', '{"\\ud800": 1}', "]", "}", "[" * 20]


@st.composite
def _nested(draw) -> str:
    depth = draw(st.one_of(st.integers(20, 80), st.integers(80, 3000), st.sampled_from([100_000, 30_000])))
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return "[" * depth + "]" * depth
    if kind == 1:
        return '{"a":' * depth + "1" + "}" * depth
    return "[" * depth  # never closed


poison = st.one_of(
    st.integers(4290, 6000).flatmap(lambda n: st.sampled_from(
        ["9" * n, "-" + "9" * n, "1" * n + ".5", "0." + "1" * n])),
    st.integers(65, 400).map(lambda n: "1" * n),  # over the 64-character number bound, under Python's limit
    st.sampled_from(["1e999", "-1e999", "1E400", "NaN", "Infinity", "-Infinity", "1e-999", "9" * 40, "2e308"]),
    st.lists(_surrogate, min_size=1, max_size=3).map(lambda cs: json.dumps("x" + "".join(cs))),
    st.sampled_from(['"\\ud800"', '"\\udfff x"', '"a\\ud83d"', '"\\ude00\\ud83d"', '"\\ud83d\\ude00"']),
    _nested(),
    st.sampled_from(UNICODE_DIGITS).map(json.dumps),
    st.sampled_from(["16000.0", "true", "false", "[]", "{}", "null", "-16000", "0", '""', "[16000]",
                     '{"sample_rate": 16000}', "1" * 30]),
    json_value.map(json.dumps),
    st.text(max_size=30).map(json.dumps),
)


def splice(template: str, fragment: str) -> str:
    return template.replace("@", fragment, 1)


NATIVE_STARTS = [
    '{"type": "start", "sample_rate": @}', '{"type": "start", "sample_rate": 16000, "output_sample_rate": @}',
    '{"type": @, "sample_rate": 16000}', '{"type": "start", "version": @, "sample_rate": 16000}',
    '{"type": "start", "sample_rate": 16000, "encoding": @}', '{"type": "start", "sample_rate": 16000, "session": @}',
    '{"type": "start", "sample_rate": 16000, "session": {"system_prompt": @}}',
    '{"type": "start", "sample_rate": 16000, "session": {"lm_mode": @}}',
    '{"type": "start", "sample_rate": 16000, "x": @}', '{"type": "start", "sample_rate": 16000, @: 1}', "@",
    '[{"type": "start", "sample_rate": 16000}, @]',
]
NATIVE_CONTROLS = ['{"type": @}', "@", '{"type": "start", "sample_rate": @}', '{"type": "ping", "v": @}',
                   '{"v": @}', '[@]']
TWILIO_MESSAGES = [
    '{"event": "media", "streamSid": "MZf", "media": {"payload": "/w==", "chunk": @}}',
    '{"event": "media", "streamSid": "MZf", "media": {"payload": @, "chunk": "3"}}',
    '{"event": "media", "streamSid": "MZf", "media": {"payload": "/w==", "track": @}}',
    '{"event": "media", "streamSid": "MZf", "media": @}', '{"event": "mark", "streamSid": "MZf", "mark": {"name": @}}',
    '{"event": "dtmf", "streamSid": "MZf", "dtmf": {"digit": @}}', '{"event": @, "streamSid": "MZf"}', "@",
    '{"event": "start", "streamSid": "MZf", "start": {"streamSid": "MZf", "mediaFormat": {"encoding": '
    '"audio/x-mulaw", "sampleRate": @, "channels": 1}}}',
    '{"event": "start", "streamSid": "MZf", "start": {"streamSid": "MZf", "callSid": @, "customParameters": @, '
    '"mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}',
    '{"event": "media", "sequenceNumber": @, "streamSid": "MZf", "media": {"payload": "/w==", "timestamp": @}}',
]
ENGINE_BODIES = [
    '{"messages": [{"role": "user", "content": @}]}', '{"messages": @}', "@",
    '{"messages": [{"role": @, "content": "hi"}]}', '{"messages": [@]}',
    '{"messages": [{"role": "user", "content": [{"type": "text", "text": @}]}]}',
    '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": @}',
    '{"messages": [{"role": "user", "content": "hi"}], "temperature": @}',
    '{"messages": [{"role": "user", "content": "hi"}], "seed": @}',
    '{"messages": [{"role": "user", "content": "hi"}], "stream": @}',
    '{"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": @}',
    '{"messages": [{"role": "user", "content": "hi"}], "mode": @, "rule": @, "block_size": @}',
    '{"model": @, "messages": [{"role": "user", "content": "hi"}]}',
    '{"messages": [{"role": "user", "content": "hi"}], "response_format": @, "tool_choice": @, "logit_bias": @}',
    '{"messages": [{"role": "user", "content": "hi"}], @: 1}',
]


@st.composite
def hostile_json(draw, templates: list[str]) -> str:
    """A message shaped by one of `templates` with hostile fragments at its holes, or broken JSON."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(BROKEN))
    text = draw(st.sampled_from(templates))
    while "@" in text:
        text = splice(text, draw(poison))
    return text
