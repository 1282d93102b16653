"""Bearer-key checks for /v1 and /admin, and the rule that a non-loopback bind needs a key.

``server.api_key`` may list several keys separated by commas: each key is a separate caller
(sessions of different callers never merge), which is how several people share one server.
Keys are compared with ``hmac.compare_digest`` against every configured key (no early exit), so
timing says nothing about which key or how much of it matched. Keys are never logged.
"""
from __future__ import annotations

import hmac
import ipaddress

from clawrl.config import ServerConfig
from clawrl.gateway.protocol import ApiError


class AuthConfigError(ValueError):
    """The server's key settings are unsafe or malformed; one line for the user."""


def parse_keys(value: str | None) -> list[str]:
    return [k.strip() for k in (value or "").split(",") if k.strip()]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_server_auth(server: ServerConfig) -> None:
    """Refuse to listen beyond this machine without a key: the endpoint runs a model and stores chats."""
    if not parse_keys(server.api_key) and not is_loopback(server.host):
        raise AuthConfigError(
            f"server.host={server.host} is not loopback, so server.api_key is required "
            "(set server.api_key=... or bind server.host=127.0.0.1)"
        )
    if server.admin_key is not None and not parse_keys(server.admin_key):
        raise AuthConfigError("server.admin_key is empty; leave it unset to use server.api_key")


class KeyRing:
    """The keys that open one route group; no keys: open (only allowed on loopback)."""

    def __init__(self, keys: list[str], realm: str):
        self.keys = [k.encode() for k in keys]
        self.realm = realm

    def check(self, authorization: str | None) -> str | None:
        """The matching key (the caller's identity), None when no key is configured; else 401."""
        if not self.keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, f"missing API key for {self.realm}: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        given = token.strip().encode()
        match = None
        for key in self.keys:
            if hmac.compare_digest(given, key):
                match = key
        if match is None:
            raise ApiError(401, f"incorrect API key for {self.realm}", code="invalid_api_key")
        return match.decode()


def key_rings(server: ServerConfig) -> tuple[KeyRing, KeyRing]:
    """(api, admin) key rings; the admin key defaults to the API key(s)."""
    api = parse_keys(server.api_key)
    admin = parse_keys(server.admin_key) if server.admin_key is not None else api
    return KeyRing(api, "/v1"), KeyRing(admin, "/admin")
