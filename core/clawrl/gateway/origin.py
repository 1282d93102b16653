"""The Host and Origin checks: what keeps a web page the user opens from using a keyless server.

A server on loopback without a key trusts whoever reaches it, and the user's browser reaches it
for any page it opens:

- **DNS rebinding.** A page at evil.example re-resolves its own name to 127.0.0.1; the browser
  then takes the server for evil.example's origin and lets the page read its answers
  (``/admin/sessions``). The Host header still names evil.example, so only the names in
  ``server.allowed_hosts`` are served. Others get 421 Misdirected Request: the request is well
  formed but meant for a server this is not (a 400 would blame the request's syntax).
- **Cross-site requests.** Any page may send a POST without a preflight (a form, a ``fetch`` of
  ``text/plain``); it cannot read the answer, but the request acts (plants a chat to train on,
  pauses training). Browsers name the page in ``Origin``: one that is neither the server's own
  (the request's scheme and Host) nor listed in ``server.allowed_origins`` gets 403, on every
  route. Clients that are not browsers (curl, the openai client, OpenClaw) send no Origin.
  Bodies must be ``application/json`` as well (``app.read_json``), which no form can send.

CORS is answered for ``server.allowed_origins`` only (``app.create_app``); by default for none.
"""
from __future__ import annotations

import logging
import re

from clawrl.config import HOST_NAME, ORIGIN, ServerConfig
from clawrl.gateway.auth import is_loopback
from clawrl.gateway.protocol import ApiError

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_HOST_HEADER = re.compile(rf"({HOST_NAME})(?::[0-9]{{1,5}})?")
_ORIGIN = re.compile(ORIGIN)
_DEFAULT_PORTS = {"http": 80, "https": 443}


def host_name(header: str | None) -> str | None:
    """The host of a Host header: lower-cased, without the port, an IPv6 address without brackets;
    None: no header or a malformed one."""
    m = _HOST_HEADER.fullmatch(header or "")
    return _bare(m.group(1)) if m else None


def canonical_origin(origin: str) -> str | None:
    """``scheme://host[:port]`` lower-cased and without the scheme's default port, as browsers send
    it; None: not an origin (``null``, a path, a bad port)."""
    m = _ORIGIN.fullmatch(origin)
    if m is None:
        return None
    scheme, host, port = m.group(1).lower(), _bare(m.group(2)), m.group(3)
    if port is not None and int(port) > 65535:
        return None
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}" + (f":{int(port)}" if port and int(port) != _DEFAULT_PORTS.get(scheme) else "")


def _bare(host: str) -> str:
    return host.strip().strip("[]").lower()


class BrowserPolicy:
    """The Host allow-list and the Origin check, built once from ``server``."""

    def __init__(self, server: ServerConfig):
        self.hosts = _allowed_hosts(server)
        self.origins = frozenset(canonical_origin(o) for o in server.allowed_origins)

    def check(self, scheme: str, host: str | None, origin: str | None) -> None:
        """Raise the 421 or the 403 for a request with this scheme and these Host and Origin headers."""
        if self.hosts is not None and host_name(host) not in self.hosts:
            log.info("refused a request for Host %r: not in server.allowed_hosts (a DNS rebinding page's "
                     "requests name its own host)", host)
            raise ApiError(421, f"this server does not answer to the host {host!r}; add the name to "
                           "server.allowed_hosts if it is one of this server's", code="host_not_allowed")
        if origin is None:
            return
        given = canonical_origin(origin)
        own = canonical_origin(f"{scheme}://{host}") if host is not None else None
        if given is None or (given not in self.origins and given != own):
            log.info("refused a request from a web page of origin %r: not the server's own and not in "
                     "server.allowed_origins", origin)
            raise ApiError(403, f"requests from web pages of origin {origin!r} are refused; list it in "
                           "server.allowed_origins to allow them", code="origin_not_allowed")


def _allowed_hosts(server: ServerConfig) -> frozenset[str] | None:
    """The host names served; None: any."""
    if server.allowed_hosts is not None:
        names = server.allowed_hosts
    elif is_loopback(server.host):
        names = [server.host, *LOOPBACK_NAMES]
    else:
        log.info("server.host=%s is not loopback and server.allowed_hosts is null: any Host is served (that "
                 "bind requires server.api_key, which a rebinding page does not have)", server.host)
        return None
    return None if "*" in names else frozenset(map(_bare, names))
