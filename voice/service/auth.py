"""Who may connect: API keys, short-lived browser tokens, Origins, Twilio signatures (docs/SECURITY.md).

* API keys come from an environment variable and/or a file (`[auth]`), each `key` or
  `name:key`; the name (or a short hash of the key) is the principal that per-key limits,
  logs and call records use. Keys themselves are never logged or stored.
* Clients that can set headers send `Authorization: Bearer KEY`. Browsers can't on a
  websocket, so they exchange a key for a token (`POST /token`) and connect with
  `/ws?token=...`: `v1.<principal>.<expiry>.<HMAC-SHA256>` under a server secret.
* With no key configured auth is off, which `voice serve` only accepts on a loopback host.
* Twilio can't send a key either: with a Twilio auth token configured, `/twilio` requires
  `X-Twilio-Signature` (HMAC-SHA1 of the URL, then the POST parameters sorted by name).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from engine.common.keys import ConfigError, is_loopback, load_keys
from engine.common.redact import RedactSecrets  # noqa: F401 - the one log filter, re-exported for voice
from engine.common.redact import install_redaction as _install_redaction
from voice.config import AuthConfig, Config

log = logging.getLogger("voice.auth")
TOKEN_VERSION = "v1"


class AuthError(Exception):
    """Refused: `code` is the error code sent to the client."""

    def __init__(self, code: str, message: str, status: int = 401):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


def source_allowed(host: str, networks: list) -> bool:
    """Is `host` (an address) inside one of `networks` (ip_network objects)? An empty list allows
    anyone; an IPv4-mapped IPv6 address counts as its IPv4 address."""
    if not networks:
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return any(addr.version == net.version and addr in net for net in networks)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass
class Auth:
    """The server's view of [auth], with the secrets read from the environment at start-up."""

    keys: dict[str, str] = field(default_factory=dict)  # name -> key
    secret: bytes = b""
    token_ttl_s: float = 300.0
    origins: list[str] = field(default_factory=list)
    twilio_token: str = ""
    twilio_url: str = ""
    secret_is_random: bool = True

    @classmethod
    def from_config(cls, cfg: AuthConfig) -> "Auth":
        keys = load_keys(os.environ, cfg.api_keys_env, cfg.api_keys_file)
        secret = os.environ.get(cfg.token_secret_env, "") if cfg.token_secret_env else ""
        twilio = os.environ.get(cfg.twilio_auth_token_env, "") if cfg.twilio_auth_token_env else ""
        if secret and len(secret) < 16:
            raise ConfigError(f"${cfg.token_secret_env} must be at least 16 characters")
        return cls(keys=keys, secret=secret.encode() if secret else secrets.token_bytes(32),
                   token_ttl_s=cfg.token_ttl_s, origins=[o.rstrip("/") for o in cfg.origins],
                   twilio_token=twilio.strip(), twilio_url=cfg.twilio_url, secret_is_random=not secret)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def describe(self) -> str:
        """For the start-up log: what is on, never a secret."""
        parts = [f"API keys: {len(self.keys)} ({', '.join(sorted(self.keys))})" if self.keys else "auth off"]
        if self.origins:
            parts.append(f"origins: {', '.join(self.origins)}")
        if self.twilio_token:
            parts.append("Twilio signatures required")
        return "; ".join(parts)

    # --- keys and tokens ------------------------------------------------------------------------

    def check_key(self, key: str) -> str | None:
        """The principal of `key`, or None. Compares in constant time against every key."""
        found = None
        digest = hashlib.sha256(key.encode()).digest()
        for name, k in self.keys.items():
            if hmac.compare_digest(digest, hashlib.sha256(k.encode()).digest()):
                found = name
        return found

    def issue_token(self, principal: str, now: float | None = None) -> tuple[str, int]:
        expiry = int((now if now is not None else time.time()) + self.token_ttl_s)
        body = f"{TOKEN_VERSION}.{_b64(principal.encode())}.{expiry}"
        return f"{body}.{self._sign(body)}", expiry

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self.secret, body.encode(), hashlib.sha256).digest())

    def check_token(self, token: str, now: float | None = None) -> str:
        """The principal of a valid, unexpired token; AuthError otherwise."""
        parts = token.split(".")
        # Tokens are ASCII by construction; hmac.compare_digest refuses non-ASCII str (TypeError)
        if len(token) > 512 or not token.isascii() or len(parts) != 4 or parts[0] != TOKEN_VERSION:
            raise AuthError("bad_token", "the token is malformed")
        body, sig = ".".join(parts[:3]), parts[3]
        if not hmac.compare_digest(self._sign(body).encode(), sig.encode()):
            raise AuthError("bad_token", "the token's signature is not valid (or the server restarted)")
        try:
            principal = _unb64(parts[1]).decode()
            expiry = int(parts[2])
        except (ValueError, UnicodeDecodeError) as err:
            raise AuthError("bad_token", "the token is malformed") from err
        if expiry < (now if now is not None else time.time()):
            raise AuthError("token_expired", "the token has expired; get a new one from POST /token")
        if principal not in self.keys:
            raise AuthError("bad_token", "the token's key has been revoked")
        return principal

    def principal(self, headers: Mapping[str, str], query: Mapping[str, str]) -> str:
        """Who is calling: a Bearer key or a ?token=. 'anonymous' when auth is off."""
        if not self.enabled:
            return "anonymous"
        authz = headers.get("authorization", "")
        if authz:
            scheme, _, key = authz.partition(" ")
            if scheme.lower() != "bearer" or not key.strip():
                raise AuthError("unauthorized", "the Authorization header must be 'Bearer <API key>'")
            name = self.check_key(key.strip())
            if name is None:
                raise AuthError("unauthorized", "the API key is not valid")
            return name
        token = query.get("token")
        if token:
            return self.check_token(token)
        raise AuthError("unauthorized", "authentication required: send 'Authorization: Bearer <API key>', or "
                                        "connect with ?token= from POST /token")

    def check_origin(self, headers: Mapping[str, str]) -> None:
        """Browsers send Origin on websockets; with an allow-list, only those origins may connect."""
        origin = headers.get("origin")
        if self.origins and origin is not None and origin.rstrip("/") not in self.origins:
            raise AuthError("forbidden_origin", f"the Origin {origin[:100]!r} is not allowed to connect", 403)

    # --- Twilio ---------------------------------------------------------------------------------

    def check_twilio(self, headers: Mapping[str, str], url: str) -> None:
        """X-Twilio-Signature over the URL of the websocket upgrade (no POST parameters)."""
        signature = headers.get("x-twilio-signature", "")
        if not signature:
            raise AuthError("unauthorized", "X-Twilio-Signature is missing")
        for candidate in url_variants(self.twilio_url_for(url)):
            if valid_twilio_signature(self.twilio_token, candidate, {}, signature):
                return
        raise AuthError("unauthorized", "X-Twilio-Signature is not valid for this URL (check auth.twilio_url)")

    def twilio_url_for(self, url: str) -> str:
        """The URL Twilio signed: `twilio_url` with the request's query string, or the request's own URL."""
        if not self.twilio_url:
            return url
        query = urlsplit(url).query
        base = urlsplit(self.twilio_url)
        return urlunsplit((base.scheme, base.netloc, base.path, query or base.query, ""))


def twilio_signature(token: str, url: str, params: Mapping[str, str | list[str]] | None = None) -> str:
    """Twilio's request signature: base64(HMAC-SHA1(auth token, URL + each param name+value, sorted by name))."""
    data = url
    params = params or {}
    for name in sorted(params):
        values = params[name]
        for value in sorted(set(values)) if isinstance(values, list) else [values]:  # as Twilio: distinct, sorted
            data += name + value
    return base64.b64encode(hmac.new(token.encode(), data.encode(), hashlib.sha1).digest()).decode()


def valid_twilio_signature(token: str, url: str, params: Mapping[str, str | list[str]] | None,
                           signature: str) -> bool:
    if not token or not signature:
        return False
    return hmac.compare_digest(twilio_signature(token, url, params).encode(), signature.strip().encode())


def url_variants(url: str) -> list[str]:
    """The URL as is, without its default port and with it (Twilio's helpers try all three)."""
    parts = urlsplit(url)
    default = {"https": 443, "wss": 443, "http": 80, "ws": 80}.get(parts.scheme)
    out = [url]
    if default is None or not parts.hostname:
        return out
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    if parts.port == default:
        out.append(urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment)))
    elif parts.port is None:
        out.append(urlunsplit((parts.scheme, f"{host}:{default}", parts.path, parts.query, parts.fragment)))
    return out


def request_url(scope: Mapping, headers: Mapping[str, str]) -> str:
    """The URL a websocket client connected to, as it saw it (behind a proxy: X-Forwarded-Proto/Host)."""
    proto = headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    secure = proto in ("https", "wss") or scope.get("scheme") in ("wss", "https")
    host = headers.get("x-forwarded-host", "").split(",")[0].strip() or headers.get("host", "")
    query = scope.get("query_string", b"").decode("latin-1")
    return f"{'wss' if secure else 'ws'}://{host}{scope.get('path', '')}" + (f"?{query}" if query else "")


# --- start-up checks -----------------------------------------------------------------------------

def check_exposure(config: Config, auth: Auth) -> None:
    """Refuse to run reachable from other machines without authentication."""
    host = config.server.host
    if not is_loopback(host) and not auth.enabled and not config.auth.allow_unauthenticated:
        raise ConfigError(
            f"refusing to listen on {host or 'all interfaces'} without authentication: anyone who can reach it "
            f"could use the service. Set API keys in ${config.auth.api_keys_env} (or auth.api_keys_file), "
            f"listen on 127.0.0.1, or, if a proxy in front authenticates, set auth.allow_unauthenticated = true.")
    if config.sip.port and not is_loopback(config.sip.host) and not config.sip.allow:
        raise ConfigError(
            f"refusing to answer SIP on {config.sip.host or 'all interfaces'} from anyone: list the addresses "
            f"of your PBX/trunk in sip.allow (e.g. allow = [\"203.0.113.7\", \"10.0.0.0/8\"]).")
    if config.wyoming.port and not is_loopback(config.wyoming.host) and not config.wyoming.allow:
        raise ConfigError(
            f"refusing to serve Wyoming on {config.wyoming.host or 'all interfaces'} to anyone (the protocol has no "
            f"authentication): list your Home Assistant's address in wyoming.allow (e.g. allow = [\"192.168.1.10\"]).")


def install_redaction(auth: Auth | None = None) -> None:
    """The one log filter (`engine.common.redact`) on every log line, knowing this server's secrets:
    the API keys, the token secret (when it is configured) and the Twilio auth token."""
    secrets: list[str] = []
    if auth is not None:
        secrets += list(auth.keys.values()) + [auth.twilio_token]
        if not auth.secret_is_random:
            secrets.append(auth.secret.decode("utf-8", "replace"))
    _install_redaction(secrets)
