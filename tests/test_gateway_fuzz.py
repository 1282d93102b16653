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

import asyncio
import json
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
from clawrl.gateway.json_limits import MAX_DEPTH
from clawrl.orchestration.learner import attach_learning
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

from gateway_support import (WEATHER_TOOL, ServerThread, build_tiny_model, load_tiny, make_controlled_engine,
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
    schema.config.seed = 20  # with derandomize, the same cases each run
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


# ---- hypothesis: what a schema does not generate

TEXT = st.text(max_size=40)  # any code point but lone surrogates (st.text cannot make those)
IDS = st.sampled_from(["call_1", "call_2", "", "x" * 64]) | st.text(max_size=8)
JSON_SCALAR = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TEXT
CONTENT = st.one_of(TEXT, st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                              max_size=3),
                    st.lists(st.dictionaries(st.sampled_from(["type", "text", "image_url"]),
                                             JSON_SCALAR | st.lists(JSON_SCALAR, max_size=2)), max_size=2),
                    JSON_SCALAR)
TOOL_CALL = st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "nope"]) | TEXT},
                                       optional={"arguments": st.sampled_from(['{"city": "Paris"}', "{}", "", "[1",
                                                                               '"s"']) | TEXT | JSON_SCALAR})},
    optional={"id": IDS | JSON_SCALAR, "type": st.just("function") | TEXT})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", ""]) | TEXT
     | JSON_SCALAR | st.lists(JSON_SCALAR, max_size=2)},  # a list role once raised TypeError (503)
    optional={"content": CONTENT, "tool_calls": st.lists(TOOL_CALL, max_size=3) | JSON_SCALAR,
              "tool_call_id": IDS | JSON_SCALAR, "name": TEXT})


@st.composite
def tool_histories(draw):
    """A user turn, then assistant calls and tool results whose ids match or do not: the shape
    real agents send, where a wrong id or a result with no call must be a 400."""
    msgs = [{"role": "user", "content": draw(TEXT)}]
    for _ in range(draw(st.integers(1, 3))):
        ids = draw(st.lists(IDS, min_size=1, max_size=3))
        msgs.append({"role": "assistant", "content": draw(st.none() | TEXT),
                     "tool_calls": [{"id": i, "type": "function",
                                     "function": {"name": "get_weather", "arguments": draw(st.sampled_from(
                                         ['{"city": "Paris"}', "{}", "not json"]))}} for i in ids]})
        for i in draw(st.lists(st.sampled_from(ids) | IDS, max_size=3)):
            msgs.append({"role": "tool", "tool_call_id": i, "content": draw(TEXT)})
    msgs.append(draw(MESSAGE) if draw(st.booleans()) else {"role": "user", "content": "Hi"})
    return msgs


SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": JSON_SCALAR | st.floats(0, 2), "top_p": JSON_SCALAR | st.floats(0, 1),
    "top_k": JSON_SCALAR | st.integers(0, 1000), "max_tokens": JSON_SCALAR | st.integers(-1, 32),
    "max_completion_tokens": st.integers(-1, 64), "n": st.integers(-1, 20) | JSON_SCALAR,
    "seed": st.integers(-(2**64), 2**64) | JSON_SCALAR, "stop": st.lists(TEXT, max_size=5) | TEXT | JSON_SCALAR,
    "logprobs": st.booleans() | JSON_SCALAR, "top_logprobs": st.integers(-1, 25) | JSON_SCALAR,
    "stream": st.booleans(), "stream_options": st.just({"include_usage": True}) | JSON_SCALAR,
    "tools": st.just([WEATHER_TOOL]) | st.lists(st.dictionaries(TEXT, JSON_SCALAR), max_size=2) | JSON_SCALAR,
    "tool_choice": st.sampled_from(["auto", "none", "required",
                                    {"type": "function", "function": {"name": "get_weather"}}]) | JSON_SCALAR,
    "parallel_tool_calls": st.booleans() | JSON_SCALAR, "frequency_penalty": st.just(0) | JSON_SCALAR,
    "user": TEXT | JSON_SCALAR, "session_id": TEXT | JSON_SCALAR, "store": st.booleans() | JSON_SCALAR,
})


def test_random_roles_contents_tool_calls_and_ids(client):
    seen: Counter = Counter()

    @fuzz_settings(80)
    @given(messages=st.lists(MESSAGE, min_size=0, max_size=6) | tool_histories())
    def run(messages):
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4})
        assert_clean(r)
        seen[r.status_code] += 1

    run()
    print("random messages:", dict(seen))
    assert seen[200] and seen[400] and sum(seen.values()) >= 60  # both outcomes are reached


def test_random_sampling_parameters(client):
    seen: Counter = Counter()

    @fuzz_settings(60)
    @given(params=SAMPLING, messages=st.just([{"role": "user", "content": "Hi"}]) | tool_histories())
    def run(params, messages):
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **params})
        assert_clean(r)
        seen[r.status_code] += 1
        if r.status_code == 200 and not params.get("stream"):
            assert r.json()["object"] == "chat.completion"

    run()
    print("random sampling:", dict(seen))
    assert seen[200] and seen[400] and sum(seen.values()) >= 40
    assert_alive(client)


def _escape(text: str) -> str:
    """``text`` as a JSON string literal, every non-ASCII code point (lone surrogates too) a \\u escape."""
    out = []
    for ch in text:
        c = ord(ch)
        if c > 0xFFFF:
            c -= 0x10000
            out.append("\\u%04x\\u%04x" % (0xD800 + (c >> 10), 0xDC00 + (c & 0x3FF)))
        elif c < 0x20 or c > 0x7E or ch in '"\\':
            out.append("\\u%04x" % c)
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


# st.text cannot hold a lone surrogate; these code points, escaped into the JSON by hand, can
SURROGATE_TEXT = st.lists(st.integers(0xD800, 0xDFFF).map(chr) | st.characters(), min_size=1, max_size=12).map("".join)


@fuzz_settings(60)
@given(text=SURROGATE_TEXT, where=st.sampled_from(["content", "arguments", "tool_id", "key", "model", "session_id",
                                                   "stop", "tool_name"]))
def test_random_unicode_with_lone_surrogates_as_raw_json(client, text, where):
    lit = _escape(text)
    content = lit if where == "content" else '"Hi"'
    args = lit if where == "arguments" else '"{}"'
    call_id = lit if where == "tool_id" else '"c1"'
    key = lit if where == "key" else '"extra"'
    raw = ('{"model": %s, "session_id": %s, "stop": %s, "max_tokens": 4, "messages": ['
           '{"role": "user", "content": %s, %s: 1},'
           '{"role": "assistant", "tool_calls": [{"id": %s, "function": {"name": %s, "arguments": %s}}]},'
           '{"role": "tool", "tool_call_id": %s, "content": "ok"}]}' % (
               lit if where == "model" else '"tiny"', lit if where == "session_id" else '"s"',
               lit if where == "stop" else "null", content, key, call_id,
               lit if where == "tool_name" else '"get_weather"', args, call_id))
    r = post_raw(client, raw.encode())
    assert_clean(r)
    if any(0xD800 <= ord(c) <= 0xDFFF for c in text) and where != "key":
        assert r.status_code == 400  # lone surrogates are refused where they enter, by name
        assert r.json()["error"]["code"] == "invalid_unicode" or where == "model"


@fuzz_settings(25)
@given(depth=st.integers(MAX_DEPTH - 3, 3000), opener=st.sampled_from(["[", '{"a":', '{"messages": [']),
       where=st.sampled_from(["body", "content", "arguments", "tool_parameters"]), closed=st.booleans())
def test_deeply_nested_bodies(client, depth, opener, where, closed):
    closer = {"[": "]", '{"a":': "}", '{"messages": [': "]}"}[opener]
    nested = opener * depth + "1" + (closer * depth if closed else "")
    if where == "body":
        raw = nested
    elif where == "content":
        raw = '{"model": "tiny", "messages": [{"role": "user", "content": %s}]}' % nested
    elif where == "arguments":
        raw = ('{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", '
               '"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": %s}}]}]}' % json.dumps(nested))
    else:
        raw = ('{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", '
               '"function": {"name": "f", "parameters": %s}}]}' % nested)
    r = post_raw(client, raw.encode())
    assert_clean(r)
    assert r.status_code == 400


@fuzz_settings(8)
@given(count=st.integers(1000, 6000), truncate=st.booleans(), size=st.integers(0, 200))
def test_thousands_of_messages(client, count, truncate, size):
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": "x" * size} for i in range(count)] + [{"role": "user", "content": "Hi"}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert_clean(r)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_huge_bodies_are_413_or_clean(tmp_path):
    """Bodies past server.max_body_bytes, declared or streamed (in process: quick and exact)."""
    app, _, _ = make_app(tmp_path, "server.max_body_bytes=200000")

    async def go():
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as c:
            big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300_000}]}
            r1 = await c.post("/v1/chat/completions", json=big)

            async def chunks():
                for _ in range(100):
                    yield b"[" * 4096
            r2 = await c.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
            r3 = await c.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [' + b"1," * 90_000 + b"1]}",
                              headers={"content-type": "application/json"})
            return r1, r2, r3
    for r in asyncio.run(go()):
        assert_clean(r)
        assert r.status_code in (400, 413)


def test_a_session_id_no_header_can_carry_is_a_400_before_anything_is_stored(server, client):
    """Found by the unicode fuzzing: a body session_id outside Latin-1 was stored, then failed as
    the X-Session-Id response header: a 503 for a turn the client never saw."""
    before = server.store.status_counts()
    for sid in ("\u0100", "東京", "🙂"):
        r = client.post("/v1/chat/completions", json={"model": MODEL, "session_id": sid, "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session", r.text
    assert server.store.status_counts() == before
    r = client.post("/v1/chat/completions", json={"model": MODEL, "session_id": "café", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.headers["x-session-id"] == "café"


def test_unhashable_role_or_part_type_is_a_400(client):
    """Found by schemathesis' negative run: a list where a string is looked up in a set raised
    TypeError, answered 503."""
    for message, param in (({"role": ["user"], "content": "Hi"}, "messages[0].role"),
                           ({"role": "user", "content": [{"type": ["text"], "text": "Hi"}]}, "messages[0].content[0]")):
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [message]})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
