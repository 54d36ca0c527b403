"""The one way JSON from the network is decoded, by every front of both servers.

`decode_json` is used for every JSON text that arrives from outside: the native websocket
protocol's messages (`voice/transports/native.py`), Twilio Media Streams messages
(`voice/transports/twilio.py`) and `engine serve` request bodies (`engine/api/server.py`). It lives
here, at the bottom, because `engine/` never imports `voice/` while `voice/` may import this
small, dependency-free module (as it does `engine/common/keys.py`).

What it accepts is I-JSON (RFC 7493) with bounds, so that nothing hostile gets past it:

* at most `max_bytes` of UTF-8 (bytes must be valid UTF-8);
* nesting at most `max_depth` arrays/objects deep (Python's decoder would recurse and raise
  RecursionError on deep input);
* numbers at most `max_number_chars` characters long (an integer of 4,300+ digits makes
  Python's `int()` raise ValueError) and finite (`1e999`, `NaN` and `Infinity` are refused);
* strings (keys included) without lone surrogates (`"\\ud800"`: they can't be encoded, so
  they would fail later, in a tokenizer, a database or a websocket send).

It raises `WireError` and nothing else: a `ValueError` with `.reason` (what was wrong, for
counters and logs) and `.message` (a short sentence, safe to send back: it never quotes the
input at length). Each front turns it into its own protocol error: `bad_json` on `/ws`, a
`bad_json` drop on `/twilio`, 400 `invalid_json` from `engine serve`.

`ascii_int` is the same rule for numbers that arrive as text (headers, Twilio's `chunk`):
`"²".isdigit()` is true but `int("²")` raises, and `int("٣")` is 3.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_BYTES = 65536  # one control message; engine serve passes its body limit
MAX_DEPTH = 32
MAX_NUMBER_CHARS = 64  # 2**128 has 39 digits; a 64-bit seed 20
REASONS = ("not_text", "too_large", "not_utf8", "syntax", "too_deep", "bad_number", "bad_string")

_SURROGATE = re.compile("[\ud800-\udfff]")
_decoder_cache: dict[int, json.JSONDecoder] = {}


class WireError(ValueError):
    """Input that is not acceptable JSON; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


def _decoder(max_number_chars: int) -> json.JSONDecoder:
    decoder = _decoder_cache.get(max_number_chars)
    if decoder is None:
        def parse_int(text: str) -> int:
            if len(text) > max_number_chars:
                raise WireError("bad_number", f"a number of {len(text)} digits is too long (at most "
                                              f"{max_number_chars} characters)")
            return int(text)

        def parse_float(text: str) -> float:
            if len(text) > max_number_chars:
                raise WireError("bad_number", f"a number of {len(text)} characters is too long (at most "
                                              f"{max_number_chars})")
            value = float(text)
            if not math.isfinite(value):
                raise WireError("bad_number", "a number is out of range")
            return value

        def parse_constant(text: str) -> Any:
            raise WireError("syntax", f"{text} is not JSON")

        decoder = _decoder_cache[max_number_chars] = json.JSONDecoder(
            parse_int=parse_int, parse_float=parse_float, parse_constant=parse_constant)
    return decoder


def decode_json(data: str | bytes | bytearray | memoryview, *, max_bytes: int = MAX_BYTES,
                max_depth: int = MAX_DEPTH, max_number_chars: int = MAX_NUMBER_CHARS) -> Any:
    """The value of the JSON text `data`; raises WireError (only) when it is not acceptable."""
    try:
        return _decode(data, max_bytes, max_depth, max_number_chars)
    except WireError:
        raise
    except RecursionError:
        raise WireError("too_deep", f"nested more than {max_depth} levels deep") from None
    except json.JSONDecodeError as err:
        raise WireError("syntax", f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except Exception as err:  # noqa: BLE001 - the promise is: WireError and nothing else
        raise WireError("syntax", f"not valid JSON ({type(err).__name__})") from None


def _decode(data: Any, max_bytes: int, max_depth: int, max_number_chars: int) -> Any:
    if isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) > max_bytes:
            raise WireError("too_large", f"{len(data)} bytes is too large (at most {max_bytes})")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as err:
            raise WireError("not_utf8", f"not valid UTF-8 (byte {err.start})") from None
    elif isinstance(data, str):
        text = data
        if len(text) > max_bytes or (len(text) * 4 > max_bytes and
                                     len(text.encode("utf-8", "surrogatepass")) > max_bytes):
            raise WireError("too_large", f"the text is too large (at most {max_bytes} bytes)")
    else:
        raise WireError("not_text", f"expected JSON text, not {type(data).__name__}")
    decoder = _decoder(max_number_chars)
    value, end = decoder.raw_decode(text, _skip_ws(text, 0))
    if _skip_ws(text, end) != len(text):
        raise WireError("syntax", f"not valid JSON: extra data at character {end}")
    _check(value, max_depth)
    return value


_WS = re.compile(r"[ \t\n\r]*")


def _skip_ws(text: str, pos: int) -> int:
    m = _WS.match(text, pos)
    assert m is not None  # `*`: it always matches, if only the empty string
    return m.end()


def _check(value: Any, max_depth: int) -> None:
    """Depth and strings, without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise WireError("bad_string", "a string holds a lone surrogate (\\ud800-\\udfff), which is not "
                                              "valid Unicode")
        elif isinstance(item, (list, dict)):
            if depth > max_depth:
                raise WireError("too_deep", f"nested more than {max_depth} levels deep")
            if isinstance(item, dict):
                for key, member in item.items():
                    if _SURROGATE.search(key):
                        raise WireError("bad_string", "a key holds a lone surrogate (\\ud800-\\udfff), which is "
                                                      "not valid Unicode")
                    if isinstance(member, (str, list, dict)):
                        stack.append((member, depth + 1))
            else:
                stack.extend((member, depth + 1) for member in item if isinstance(member, (str, list, dict)))


def ascii_int(text: Any, max_digits: int = 18) -> int | None:
    """`text` as a non-negative integer if it is 1 to `max_digits` ASCII digits, else None."""
    if isinstance(text, str) and 0 < len(text) <= max_digits and text.isascii() and text.isdigit():
        return int(text)
    return None
