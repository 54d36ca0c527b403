"""The one log filter that keeps secrets out of every log line, for both servers.

`voice serve` and `engine serve` (and any app built by their `build_app`) call
`install_redaction(secrets)`. `RedactSecrets` (a `logging.Filter`) rewrites a record in place:

* query-string and form parameters that carry credentials, whatever the case and separator:
  `token=`, `api_key=`, `api-key=`, `apikey=`, `key=`, `access_token=`, `auth=`, `password=`,
  `secret=`, `signature=`, `sig=` ... -> `name=REDACTED` (uvicorn logs request paths with their
  query string);
* `Authorization: Bearer|Basic ...` and `X-Twilio-Signature: ...` values -> `REDACTED`;
* browser tokens (`v1.<principal>.<expiry>.<signature>`) anywhere -> the signature redacted;
* every secret value the servers know (API keys, the token secret, the Twilio auth token),
  wherever it appears, exactly -> `REDACTED`.

It is installed on the root logger and uvicorn's loggers and on all their handlers, and in the
log-record factory, so records of *any* logger are rewritten when they are created, before a
handler (even one added later) formats them: a filter on a logger alone sees only the records
logged on that very logger, not those propagated from its children. A line with a secret is
formatted and stored redacted (`msg`, no `args`); tracebacks (`exc_info`) are formatted once
and redacted too. uvicorn's access formatter unpacks `record.args`, so for `uvicorn.access`
the arguments are redacted one by one and keep their positions.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable
from typing import Any

MARK = "REDACTED"
MIN_SECRET_CHARS = 8  # shorter "secrets" would redact ordinary words

_PARAM = re.compile(
    r"(?i)(?<![\w-])((?:api[_-]?key|x[_-]?api[_-]?key|apikey|key|token|access[_-]?token|id[_-]?token|"
    r"refresh[_-]?token|auth[_-]?token|session[_-]?token|auth|authorization|password|passwd|pwd|secret|"
    r"client[_-]?secret|signature|sig|x[_-]twilio[_-]signature)=)[^&\s\"'#;,<>]+")
_HEADER = re.compile(r"(?i)((?:authorization|x-twilio-signature|x-api-key|api-key)[\"']?\s*[:=]\s*[\"']?"
                     r"(?:(?:bearer|basic|token)\s+)?)[^\s\"',;}]+")
_SCHEME = re.compile(r"(?i)(\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=-]{8,}")
_TOKEN = re.compile(r"\b(v1\.[A-Za-z0-9_-]+\.\d+\.)[A-Za-z0-9_-]{16,}")
_PATTERNS = ((_PARAM, r"\1" + MARK), (_HEADER, r"\1" + MARK), (_SCHEME, r"\1" + MARK), (_TOKEN, r"\1" + MARK))

_lock = threading.Lock()
_secrets: set[str] = set()
_secret_re: re.Pattern | None = None
_installed = False


def add_secrets(values: Iterable[str]) -> None:
    """Exact values to redact wherever they appear (API keys, token secret, Twilio auth token)."""
    global _secret_re
    new = {v for v in values if isinstance(v, str) and len(v) >= MIN_SECRET_CHARS}
    with _lock:
        if new <= _secrets:
            return
        _secrets.update(new)
        ordered = sorted(_secrets, key=len, reverse=True)  # longest first: a key containing another
        _secret_re = re.compile("|".join(re.escape(s) for s in ordered))


def redact(text: str) -> str:
    """`text` with every secret replaced by REDACTED."""
    if not text:
        return text
    secret_re = _secret_re
    if secret_re is not None:
        text = secret_re.sub(MARK, text)
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


class RedactSecrets(logging.Filter):
    """Rewrites a record so that no secret reaches any handler (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_redacted", False):
            return True
        try:
            self._rewrite(record)
        except Exception:  # noqa: BLE001 - a log line must never fail because of redaction
            pass
        record._redacted = True
        return True

    @staticmethod
    def _rewrite(record: logging.LogRecord) -> None:
        args = record.args
        if not args:
            record.msg = _text(record.msg)
        elif record.name == "uvicorn.access":  # its formatter unpacks args: keep them, one by one
            if isinstance(args, tuple):
                record.args = tuple(_text(a) for a in args)
            elif isinstance(args, dict):
                record.args = {k: _text(v) for k, v in args.items()}
        else:  # the whole line, so that a secret split between the format and its args is caught too
            try:
                whole = record.getMessage()
            except Exception:  # noqa: BLE001 - a bad format string: logging reports it itself
                whole = None
            if whole is not None:
                clean = redact(whole)
                if clean != whole:
                    record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)


def _text(value: object) -> object:
    """A message or argument with secrets redacted; unchanged (same object) when there are none."""
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    text = str(value)
    clean = redact(text)
    return value if clean == text else clean


FILTER = RedactSecrets()
LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


def install_redaction(secrets: Iterable[str] = ()) -> None:
    """Redact `secrets` (and the patterns above) in every log line of this process. Idempotent;
    call it again after logging is (re)configured, e.g. once uvicorn has set up its handlers."""
    global _installed
    add_secrets(secrets)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for target in [logger, *logger.handlers]:
            if not any(isinstance(f, RedactSecrets) for f in target.filters):
                target.addFilter(FILTER)
    with _lock:
        if _installed:
            return
        _installed = True
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            FILTER.filter(record)
            return record

        logging.setLogRecordFactory(factory)
