"""Who may use /admin: only a caller bearing ``server.admin_key``; with none set, only loopback
clients. The API key, which every chat client holds, never opens /admin, and the rule covers the
routes the learner adds under /admin (pause, resume) as well as the gateway's own.

Requests are sent in process through httpx's ASGI transport, which lets a test choose the
client's address (a real non-loopback peer would need a second machine)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from clawrl.config import ServerConfig, compose
from clawrl.gateway.app import create_app
from clawrl.gateway.auth import AdminGuard, KeyRing, key_rings
from clawrl.gateway.protocol import ApiError
from clawrl.orchestration.learner import attach_learning
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

from gateway_support import build_tiny_model, load_tiny, make_controlled_engine, model_cache_dir

REMOTE, LOOPBACK = "203.0.113.7", "127.0.0.1"


@pytest.fixture(scope="module")
def loaded():
    return load_tiny(build_tiny_model(model_cache_dir()))


def make_app(loaded, run_dir, *overrides):
    """The gateway with the learner's admin routes (training off: pause answers 409 once admitted)."""
    cfg = compose([f"run_dir={run_dir}", "train.enabled=false", "engine.threads=1", *overrides])
    engine = make_controlled_engine(loaded, cfg.engine)
    app = create_app(cfg, engine, SessionLinker(TurnStore(run_dir), cfg.sessions.idle_timeout_s))
    assert attach_learning(app, cfg, engine, TurnStore(run_dir)) is None
    return app


def call(app, client_host, method, path, key=None, **kw):
    async def go():
        transport = httpx.ASGITransport(app=app, client=(client_host, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return await client.request(method, path, headers=headers, **kw)
    return asyncio.run(go())


def assert_openai_error(r, status, code):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    return err


ADMIN_ROUTES = [("GET", "/admin/status"), ("GET", "/admin/sessions"), ("GET", "/admin/sessions/s1"),
                ("PATCH", "/admin/turns/1"), ("POST", "/admin/pause"), ("POST", "/admin/resume"),
                ("GET", "/admin/no-such-route")]


def test_without_an_admin_key_admin_refuses_other_machines_even_with_the_api_key(loaded, tmp_path):
    app = make_app(loaded, tmp_path, "server.api_key=chat-key")
    for method, path in ADMIN_ROUTES:
        for key in (None, "chat-key"):
            err = assert_openai_error(call(app, REMOTE, method, path, key, json={"label": "side"}), 403,
                                      "admin_key_required")
            assert "server.admin_key" in err["message"]
    # from loopback the learner's route is reached: training is off, so pause is a 409
    r = call(app, LOOPBACK, "POST", "/admin/pause")
    assert_openai_error(r, 409, "training_disabled")
    assert call(app, "::1", "POST", "/admin/resume").status_code == 409
    # the chat API itself is untouched by the admin rule
    assert call(app, REMOTE, "GET", "/v1/models", "chat-key").status_code == 200


def test_with_an_admin_key_only_that_key_opens_admin_from_anywhere(loaded, tmp_path):
    app = make_app(loaded, tmp_path, "server.api_key=chat-key", "server.admin_key=admin-key")
    for host in (REMOTE, LOOPBACK):  # loopback is no exception once a key is set
        for method, path in ADMIN_ROUTES:
            for key in (None, "chat-key", "admin-keyy", "admin-ke"):
                assert_openai_error(call(app, host, method, path, key, json={"label": "side"}), 401,
                                    "invalid_api_key")
        assert_openai_error(call(app, host, "POST", "/admin/pause", "admin-key"), 409, "training_disabled")
    assert_openai_error(call(app, REMOTE, "GET", "/v1/models", "admin-key"), 401, "invalid_api_key")


def test_the_admin_ring_never_holds_the_api_keys():
    api, admin = key_rings(ServerConfig(api_key="a1,a2"))
    assert api.keys == ["a1", "a2"] and admin.keys == []
    guard = AdminGuard(admin)
    guard.check(None, "127.0.0.1", "127.0.0.1")
    guard.check("Bearer a1", "::1", "localhost")
    with pytest.raises(ApiError) as e:
        guard.check("Bearer a1", "10.1.2.3", "127.0.0.1")
    assert e.value.status == 403
    guard.check(None, "::ffff:127.0.0.1", "::1")  # an IPv4 client of a dual-stack socket
    for peer in (None, "::ffff:10.0.0.1", "localhost.evil.example", "0.0.0.0"):  # None: an unknown peer
        with pytest.raises(ApiError) as e:
            guard.check(None, peer, "127.0.0.1")
        assert e.value.status == 403, peer
    for name in (None, "evil.example", "my-box.lan"):  # a rebinding page's own name reaches loopback too
        with pytest.raises(ApiError) as e:
            guard.check(None, "127.0.0.1", name)
        assert e.value.status == 403 and e.value.code == "admin_key_required", name
    api, admin = key_rings(ServerConfig(api_key="a1", admin_key="root,ops"))
    guard = AdminGuard(admin)
    guard.check("Bearer ops", "10.1.2.3", "evil.example")  # the key opens /admin whatever the host's name
    for bad in ("Bearer a1", None, "Bearer roo", "Bearer rootroot"):
        with pytest.raises(ApiError) as e:
            guard.check(bad, "127.0.0.1", "127.0.0.1")
        assert e.value.status == 401


def test_keys_are_compared_as_equal_length_digests():
    # compare_digest's time depends on the operands' length: digests hide how long the key is
    ring = KeyRing(["short", "a-much-longer-key-" * 8], "/v1")
    assert {len(d) for d in ring._digests} == {32}
    assert ring.check("Bearer " + "a-much-longer-key-" * 8) == "a-much-longer-key-" * 8
