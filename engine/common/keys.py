"""API key lists, shared by `engine serve` and the voice service (docs/SECURITY.md).

Entries are `key` or `name:key`, separated by commas or newlines; `#` starts a comment. The
name (or, for an unnamed key, a short hash of it) is the principal that logs and limits use;
keys themselves are never logged.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


class ConfigError(Exception):
    """The configuration is unsafe or unusable; the server must not start."""


def key_id(key: str) -> str:
    """A name for an unnamed key that says nothing about it."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def parse_keys(text: str, where: str) -> dict[str, str]:
    """`key` or `name:key` entries -> {name: key}; `where` names the source in errors."""
    keys: dict[str, str] = {}
    for raw in re.split(r"[,\n]", text):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        name, sep, key = entry.partition(":")
        if not sep:
            name, key = key_id(entry), entry
        name, key = name.strip(), key.strip()
        if not _NAME.match(name):
            raise ConfigError(f"{where}: bad key name {name[:20]!r} (letters, digits, _ . @ - only)")
        if len(key) < 16:
            raise ConfigError(f"{where}: the key named {name!r} is shorter than 16 characters")
        if name in keys and keys[name] != key:
            raise ConfigError(f"{where}: two different keys are named {name!r}")
        keys[name] = key
    return keys


def load_keys(env: Mapping[str, str], env_var: str, file: str) -> dict[str, str]:
    """Keys from the environment variable `env_var` and from `file` (either may be empty)."""
    keys: dict[str, str] = {}
    if env_var and env.get(env_var, "").strip():
        keys.update(parse_keys(env[env_var], f"${env_var}"))
    if file:
        path = Path(file).expanduser()
        try:
            text = path.read_text()
        except OSError as err:
            raise ConfigError(f"cannot read the API key file {path}: {err}") from err
        keys.update(parse_keys(text, str(path)))
    return keys


def is_loopback(host: str) -> bool:
    """Is `host` reachable from this machine only? (Without keys, both servers listen only there.)"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # "", "0.0.0.0" and hostnames: assume reachable from elsewhere
