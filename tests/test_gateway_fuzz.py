"""Fuzzing the gateway (issue 20, item 3): schemathesis from the served ``/openapi.json``, and
hypothesis strategies for what a schema cannot generate (lone surrogates as raw JSON escapes,
deep nesting, thousands of messages, tool-call histories whose ids match or not).

Every answer must be a 200 or a 4xx in OpenAI's error format, never a 5xx, and the server must
still answer afterwards. Runs are bounded and deterministic (``derandomize``, no example database:
CI has an empty HOME), so a failure here reproduces on the next run. The engine is the real
TorchEngine on the tiny test model, with a short context and few default tokens so a generated
request that reaches it costs milliseconds.
"""
from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from clawrl.config import compose
from clawrl.gateway.app import create_app
from clawrl.orchestration.learner import attach_learning
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

from gateway_support import (ServerThread, build_tiny_model, load_tiny, make_controlled_engine,
                             model_cache_dir)

MODEL = "tiny"
ERROR_KEYS = {"message", "type", "param", "code"}


def fuzz_settings(max_examples: int):
    """Deterministic and bounded: the same examples every run, none remembered between runs."""
    return settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)


def make_app(run_dir, *overrides):
    path = build_tiny_model(model_cache_dir())
    cfg = compose([f"run_dir={run_dir}", "train.enabled=false", "engine.threads=1", "engine.max_context=256",
                   "engine.max_batch_size=4", "server.default_max_tokens=8", *overrides])
    engine = make_controlled_engine(load_tiny(path), cfg.engine)
    store = TurnStore(run_dir)
    app = create_app(cfg, engine, SessionLinker(store, cfg.sessions.idle_timeout_s))
    assert attach_learning(app, cfg, engine, store) is None  # the learner's /admin routes too (409: no training)
    return app, engine, store


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    app, engine, store = make_app(tmp_path_factory.mktemp("run"))
    with ServerThread(app) as srv:
        srv.engine, srv.store = engine, store
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def assert_clean(r: httpx.Response) -> None:
    """200, or a 4xx whose body is exactly OpenAI's error object."""
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS, err
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        assert err["param"] is None or isinstance(err["param"], str)
        assert err["code"] is None or isinstance(err["code"], str)


def assert_alive(client) -> None:
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                  "temperature": 0, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert client.get("/healthz").json()["ok"] is True


def post_raw(client, raw: bytes, **headers) -> httpx.Response:
    return client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json", **headers})


# ---- the OpenAPI document


def test_openapi_describes_the_raw_body_routes(client):
    doc = client.get("/openapi.json").json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    request = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages", "tools", "tool_choice", "stream", "n", "temperature"} <= set(request["properties"])
    roles = {r for m in doc["components"]["schemas"]["ChatMessage"]["oneOf"]
             for r in m["properties"]["role"].get("enum", [m["properties"]["role"].get("const")])}
    assert roles == {"system", "developer", "user", "assistant", "tool"}
    assert chat["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    relabel = doc["paths"]["/admin/turns/{turn_id}"]["patch"]
    assert relabel["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/RelabelTurn")
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert "422" not in op["responses"], (method, path)  # the gateway answers 400, never 422
            assert op["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")


# ---- schemathesis, from the live server's own document


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.update(base_url=server.url)
    return schema


def operations(schema):
    return [result.ok() for result in schema.get_all_operations()]


def served_model_mostly(strategy):
    """Three bodies in four name the served model, so generated requests reach rendering and the
    engine instead of stopping at 404 model_not_found (the fourth keeps the generated name)."""
    def pick(pair):
        case, keep = pair
        if not keep and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL
        return case
    return st.tuples(strategy, st.sampled_from([False, False, False, True])).map(pick)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_schemathesis_finds_no_5xx_and_no_response_off_schema(api_schema, client, mode):
    ops = operations(api_schema)
    assert {op.label for op in ops} >= {"POST /v1/chat/completions", "PATCH /admin/turns/{turn_id}", "GET /v1/models"}
    if mode == GenerationMode.NEGATIVE:  # only a body or a typed query can be made invalid
        ops = [op for op in ops if op.body or len(op.query)]
        assert {op.label for op in ops} >= {"POST /v1/chat/completions", "PATCH /admin/turns/{turn_id}"}
    statuses: Counter = Counter()
    for op in ops:
        chat = op.path == "/v1/chat/completions"
        strategy = op.as_strategy(generation_mode=mode)

        @fuzz_settings(100 if chat else 15)
        @given(case=served_model_mostly(strategy) if chat else strategy)
        def run(case):
            response = case.call_and_validate(checks=[not_a_server_error, response_schema_conformance], timeout=60)
            statuses[op.label, response.status_code] += 1

        run()
    print(f"schemathesis {mode.value}: {sum(statuses.values())} requests;", dict(sorted(statuses.items())))
    assert sum(statuses.values()) >= 100
    if mode == GenerationMode.POSITIVE:  # valid bodies do get generated, and answered
        assert statuses["POST /v1/chat/completions", 200] >= 10
    assert_alive(client)
