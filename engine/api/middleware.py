"""What wraps every request of `engine serve`: the API-key check on /v1/* (`BearerAuth`, keys from
the environment by `load_api_keys`) and one log line per request (`RequestLog`, with what the
handler noted under LOG_KEY in the ASGI scope; never a key: engine.common.redact)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.api.requests import APIError
from engine.common.keys import ConfigError, load_keys

log = logging.getLogger("engine.server")

LOG_KEY = "engine.request_log"  # per-request details the handlers leave in the ASGI scope for RequestLog


class BearerAuth:
    """`Authorization: Bearer KEY` on /v1/* when keys are configured (constant-time comparison)."""

    def __init__(self, app: ASGIApp, keys: dict[str, str]) -> None:
        self.app = app
        self.digests = {name: hashlib.sha256(key.encode()).digest() for name, key in keys.items()}

    def principal(self, scope: Scope) -> str | None:
        headers = dict((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", []))
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        digest = hashlib.sha256(key.strip().encode()).digest()
        found = None
        for name, d in self.digests.items():
            if hmac.compare_digest(digest, d):
                found = name
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.digests or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        name = self.principal(scope)
        if name is None:
            has = any(k.lower() == b"authorization" for k, _ in scope.get("headers", []))
            err = APIError(401, "Incorrect API key provided." if has else
                           "You didn't provide an API key: send 'Authorization: Bearer <key>'.", None,
                           "invalid_api_key", "invalid_request_error")
            scope.setdefault(LOG_KEY, {})["error"] = "invalid_api_key"
            response = err.response()
            response.headers["www-authenticate"] = "Bearer"
            return await response(scope, receive, send)
        scope.setdefault(LOG_KEY, {})["principal"] = name  # the key's name, never the key
        return await self.app(scope, receive, send)


def load_api_keys(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """$ENGINE_API_KEYS and the file named by $ENGINE_API_KEYS_FILE (`engine.common.keys` format)."""
    env = os.environ if env is None else env
    try:
        return load_keys(env, "ENGINE_API_KEYS", env.get("ENGINE_API_KEYS_FILE", ""))
    except ConfigError as err:
        raise SystemExit(f"engine serve: {err}") from err


class RequestLog:
    """One log line per request: method, path, status, time, and what the handler noted."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]
        info = scope.setdefault(LOG_KEY, {})

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            client = scope.get("client") or ("-", 0)
            extra = " ".join(f"{k}={round(v, 1) if isinstance(v, float) else v}" for k, v in info.items())
            log.info("%s %s %s %d %.0fms %s", client[0], scope["method"], scope["path"], status[0],
                     (time.perf_counter() - start) * 1000, extra)
