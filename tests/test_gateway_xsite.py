"""What a web page the user opens cannot do to a keyless loopback server (issue 40, item 2): plant
chats with a ``text/plain`` or form body (415), pause training from a foreign Origin (403), read
/admin through DNS rebinding (421 for a Host that is not the server's). Clients that are not
browsers send no Origin and pass; a listed origin is answered with CORS.

Also: a client that goes away mid-body is one INFO line, not an ERROR with a traceback, and a
session id holding '/' is reachable under /admin/sessions/."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import openai
import pytest

from clawrl.config import ConfigError, compose
from clawrl.engines import make_engine
from clawrl.gateway.app import create_app
from clawrl.orchestration.learner import attach_learning
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

from gateway_support import ServerThread, build_tiny_model, model_cache_dir

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def model_dir():
    return build_tiny_model(model_cache_dir())


def make_app(model_dir, run_dir, *overrides):
    """The app `clawrl serve` runs: the gateway with a learner beside it (default batch: nothing trains here)."""
    cfg = compose([f"model.path={model_dir}", "model.name=tiny", f"run_dir={run_dir}", "engine.threads=1",
                   "logging.wandb.mode=disabled", *overrides])
    engine = make_engine(cfg)
    store = TurnStore(cfg.run_dir)
    app = create_app(cfg, engine, SessionLinker(store, idle_timeout_s=cfg.sessions.idle_timeout_s))
    return app, attach_learning(app, cfg, engine, store), store


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    app, learner, store = make_app(model_dir, tmp_path_factory.mktemp("run"))
    with ServerThread(app) as srv:
        srv.learner, srv.store = learner, store
        yield srv


def assert_refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                  "param": None, "code": code}}
    assert "access-control-allow-origin" not in r.headers


def in_process(app, method, path, client_host="127.0.0.1", **kw):
    async def go():
        transport = httpx.ASGITransport(app=app, client=(client_host, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:30000") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


def test_a_chat_posted_as_text_plain_or_a_form_is_415_and_nothing_is_stored(server):
    before = server.store.status_counts()
    for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/json-seq", "application/json; charset=latin-1",
                         None):
        headers = {"Content-Type": content_type} if content_type else {}
        r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(CHAT), headers=headers, timeout=60)
        assert_refused(r, 415, "unsupported_media_type")
    assert server.store.status_counts() == before
    for content_type in ("application/json", "Application/JSON; charset=utf-8", 'application/json;charset="UTF-8"'):
        r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(CHAT),
                       headers={"Content-Type": content_type}, timeout=60)
        assert r.status_code == 200, (content_type, r.text)
    # the openai client (as OpenClaw's) sends application/json and no Origin
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    assert client.chat.completions.create(**CHAT).choices[0].message.content is not None


def test_a_relabel_posted_as_a_form_is_415(server):
    r = httpx.patch(server.url + "/admin/turns/1", content=b'{"label": "side"}',
                    headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert_refused(r, 415, "unsupported_media_type")


def test_a_foreign_origin_cannot_pause_training(server):
    own = server.url
    other_local_site = f"http://127.0.0.1:{server.port + 1}"
    for origin in (EVIL, "null", other_local_site, f"https://127.0.0.1:{server.port}", "http://localhost"):
        r = httpx.post(server.url + "/admin/pause", headers={"Origin": origin})
        assert_refused(r, 403, "origin_not_allowed")
        assert server.learner.paused_reason is None, origin
    chat = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"Origin": EVIL}, timeout=60)
    assert_refused(chat, 403, "origin_not_allowed")
    # a preflight is not answered either: CORS is off by default
    r = httpx.options(server.url + "/admin/pause", headers={"Origin": EVIL, "Access-Control-Request-Method": "POST"})
    assert_refused(r, 403, "origin_not_allowed")
    # the server's own origin (a page it served) and clients without Origin pass
    r = httpx.post(server.url + "/admin/pause", headers={"Origin": own})
    assert r.status_code == 200 and r.json()["paused"] is True and server.learner.paused_reason is not None
    assert "access-control-allow-origin" not in r.headers
    assert httpx.post(server.url + "/admin/resume").json()["paused"] is False


def test_dns_rebinding_cannot_read_admin_sessions(server):
    httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60, headers={"X-Session-Id": "private"})
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.nip.io", "localhost.evil.example"):
        for path in ("/admin/sessions", "/admin/status", "/v1/models", "/healthz"):
            r = httpx.get(server.url + path, headers={"Host": host})
            assert_refused(r, 421, "host_not_allowed")
            assert "private" not in r.text
    # the loopback names, with or without the port, are the server's
    for host in (f"127.0.0.1:{server.port}", "localhost", f"LOCALHOST:{server.port}", f"[::1]:{server.port}"):
        r = httpx.get(server.url + "/admin/sessions", headers={"Host": host})
        assert r.status_code == 200 and "private" in r.text, host


def test_a_listed_origin_is_answered_with_cors_and_no_other(model_dir, tmp_path):
    app, _, _ = make_app(model_dir, tmp_path, "train.enabled=false",
                         "server.allowed_origins=[http://localhost:5173,HTTPS://UI.example.com:443]")
    for origin in ("http://localhost:5173", "https://ui.example.com"):
        pre = in_process(app, "OPTIONS", "/admin/sessions", headers={
            "Origin": origin, "Access-Control-Request-Method": "GET", "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
        r = in_process(app, "GET", "/admin/sessions", headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert "X-Session-Id" in r.headers["access-control-expose-headers"]
    r = in_process(app, "GET", "/admin/sessions", headers={"Origin": "http://localhost:5174"})
    assert_refused(r, 403, "origin_not_allowed")
    pre = in_process(app, "OPTIONS", "/v1/models", headers={"Origin": EVIL, "Access-Control-Request-Method": "GET"})
    assert_refused(pre, 403, "origin_not_allowed")


def test_hosts_on_a_non_loopback_bind_and_the_keyless_admin(model_dir, tmp_path):
    """Bound to every interface (a key is then required), any Host is served by default; /admin
    without an admin key still wants a loopback name, which a rebinding page never sends."""
    app, _, _ = make_app(model_dir, tmp_path, "train.enabled=false", "server.host=0.0.0.0", "server.api_key=k")
    r = in_process(app, "GET", "/v1/models", headers={"Host": "my-box.lan", "Authorization": "Bearer k"})
    assert r.status_code == 200
    r = in_process(app, "GET", "/admin/sessions", headers={"Host": "evil.example:30000"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert in_process(app, "GET", "/admin/sessions", headers={"Host": "localhost:30000"}).status_code == 200
    # an explicit list replaces the default; '*' serves any host
    app, _, _ = make_app(model_dir, tmp_path / "b", "train.enabled=false", "server.allowed_hosts=[my-box.lan,'[::1]']")
    assert in_process(app, "GET", "/v1/models", headers={"Host": "MY-BOX.lan:30000"}).status_code == 200
    assert in_process(app, "GET", "/v1/models", headers={"Host": "[::1]"}).status_code == 200
    assert_refused(in_process(app, "GET", "/v1/models", headers={"Host": "127.0.0.1"}), 421, "host_not_allowed")
    app, _, _ = make_app(model_dir, tmp_path / "c", "train.enabled=false", "server.allowed_hosts=['*']")
    assert in_process(app, "GET", "/v1/models", headers={"Host": "anything.example"}).status_code == 200


@pytest.mark.parametrize("override", [
    "server.allowed_hosts=[http://localhost]", "server.allowed_hosts=[localhost:8080]",
    "server.allowed_origins=['*']", "server.allowed_origins=['null']", "server.allowed_origins=[http://x.example/app]",
    "server.allowed_origins=[localhost:5173]", "server.allowed_origins=[http://x.example:99999]",
])
def test_hosts_and_origins_that_are_not_one_are_refused_by_name(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        compose([override])


def test_a_client_gone_mid_body_is_one_info_line(server, caplog):
    caplog.set_level(logging.INFO)
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(0.2)
    deadline = time.time() + 10
    while not any("went away" in r.getMessage() for r in caplog.records) and time.time() < deadline:
        time.sleep(0.05)
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO and gone[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_session_id_with_a_slash_is_reachable_under_admin(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60, headers={"X-Session-Id": "team/alice"})
    assert r.status_code == 200 and r.headers["x-session-id"] == "team/alice"
    for path in ("/admin/sessions/team/alice", "/admin/sessions/team%2Falice"):
        got = httpx.get(server.url + path)
        assert got.status_code == 200 and got.json()["session_id"] == "team/alice", got.text
    assert httpx.get(server.url + "/admin/sessions/team/bob").status_code == 404
