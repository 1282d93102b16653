"""Bearer-key checks for /v1 and /admin, and the rule that a non-loopback bind needs a key.

``server.api_key`` may list several keys separated by commas: each key is a separate caller
(sessions of different callers never merge), which is how several people share one server.
Keys are compared as SHA-256 digests with ``hmac.compare_digest`` against every configured key
(no early exit), so timing says nothing about which key matched, how much of it, or its length.
Keys are never logged.

/admin opens only with ``server.admin_key``, never with the API key: the API key is handed to
every chat client, and /admin relabels turns and pauses training. Without an admin key, /admin
answers loopback clients only, and only under a loopback host name (``AdminGuard``).
"""
from __future__ import annotations

import hashlib
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
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # a dual-stack socket shows 127.0.0.1 as ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def check_server_auth(server: ServerConfig) -> None:
    """Refuse to listen beyond this machine without a key: the endpoint runs a model and stores chats."""
    if not parse_keys(server.api_key) and not is_loopback(server.host):
        raise AuthConfigError(
            f"server.host={server.host} is not loopback, so server.api_key is required "
            "(set server.api_key=... or bind server.host=127.0.0.1)"
        )
    if server.admin_key is not None and not parse_keys(server.admin_key):
        raise AuthConfigError("server.admin_key is empty; leave it unset to allow /admin from loopback only")


class KeyRing:
    """The keys that open one route group; no keys: open (the /v1 ring only on a loopback bind,
    the /admin ring only behind ``AdminGuard``, which then admits loopback clients only)."""

    def __init__(self, keys: list[str], realm: str):
        self.keys = keys
        self._digests = [_digest(k.encode()) for k in keys]
        self.realm = realm

    def check(self, authorization: str | None) -> str | None:
        """The matching key (the caller's identity), None when no key is configured; else 401."""
        if not self.keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, f"missing API key for {self.realm}: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        given = _digest(token.strip().encode())
        match = None
        for key, digest in zip(self.keys, self._digests):
            if hmac.compare_digest(given, digest):
                match = key
        if match is None:
            raise ApiError(401, f"incorrect API key for {self.realm}", code="invalid_api_key")
        return match


def _digest(key: bytes) -> bytes:
    """Equal-length digests, so that compare_digest's time does not depend on the key's length."""
    return hashlib.sha256(key).digest()


class AdminGuard:
    """Who may use /admin: a caller bearing ``server.admin_key``; with none set, loopback clients.

    ``check`` takes the client's address as well as its key, so the gateway runs it on every path
    under /admin (``app.AdminGate``): a route that a layer above adds there (the learner's
    pause/resume) is guarded without asking for it.
    """

    def __init__(self, ring: KeyRing):
        self.ring = ring

    def check(self, authorization: str | None, client_host: str | None, server_name: str | None) -> None:
        """``server_name``: the host the request names (its Host header's). Without a key it must be
        a loopback name too: a DNS-rebinding page reaches loopback under a name of its own."""
        if self.ring.keys:
            self.ring.check(authorization)
            return
        if client_host is None or not is_loopback(client_host):
            raise ApiError(403, "/admin answers only loopback clients while server.admin_key is unset; "
                           "set server.admin_key to use it from another machine", code="admin_key_required")
        if server_name is None or not is_loopback(server_name):
            raise ApiError(403, f"/admin answers a request for the host {server_name!r} only with server.admin_key; "
                           "without it, address the server as localhost, 127.0.0.1 or [::1]",
                           code="admin_key_required")


def key_rings(server: ServerConfig) -> tuple[KeyRing, KeyRing]:
    """(api, admin) key rings. The admin ring holds ``server.admin_key`` only (never the API
    keys); it is empty when that is unset, and then ``AdminGuard`` admits loopback clients only."""
    api = parse_keys(server.api_key)
    admin = parse_keys(server.admin_key) if server.admin_key is not None else []
    return KeyRing(api, "/v1"), KeyRing(admin, "/admin")
