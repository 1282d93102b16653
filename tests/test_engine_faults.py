"""Engine faults (issue 40, item 1): sampling fields out of their real range are a 400 naming the
field, and an exception inside an engine step fails only that step's requests (OpenAI's error
format, an SSE error event when streamed) while the engine thread goes on serving.

The engine is the real TorchEngine on the tiny test model, served by a live uvicorn thread."""
from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clawrl.config import compose
from clawrl.engines import torch_engine
from clawrl.gateway.app import create_app
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

from gateway_support import ServerThread, build_tiny_model, load_tiny, make_controlled_engine, model_cache_dir

MODEL = "tiny"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose([f"run_dir={run_dir}", "train.enabled=false", "engine.threads=1", "engine.max_context=256",
                   "engine.max_batch_size=8", "server.default_max_tokens=8"])
    engine = make_controlled_engine(load_tiny(build_tiny_model(model_cache_dir())), cfg.engine)
    app = create_app(cfg, engine, SessionLinker(TurnStore(run_dir), cfg.sessions.idle_timeout_s))
    with ServerThread(app) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def chat(client, **fields) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 4, **fields})


def assert_alive(client) -> None:
    assert client.get("/healthz").status_code == 200
    r = chat(client, temperature=0)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fields,param", [
    ({"seed": 2**63 - 1, "n": 2}, "seed"),  # seed + 1 for the second choice overflowed int64
    ({"seed": 2**63 - 2, "n": 3}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 17}, "n"),
    ({"top_p": 0}, "top_p"),
    ({"temperature": 3}, "temperature"),
    ({"max_tokens": 5, "max_completion_tokens": 2**40}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -2}, "frequency_penalty"),
])
def test_out_of_range_sampling_field_is_a_400_naming_it(client, fields, param):
    r = chat(client, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert_alive(client)


def test_largest_safe_seed_with_n_choices_is_served(client):
    r = chat(client, seed=2**63 - 3, n=3, temperature=1.0)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    assert_alive(client)


# ---- the second line of defence: a fault inside a step


FAULTS = {111: ValueError("Overflow when unpacking long"),
          222: RuntimeError("CUDA error: an illegal memory access was encountered")}


@pytest.fixture
def faulty_sampling(monkeypatch):
    """``sample_rows`` raises whenever a row of a marker seed is among those it samples."""
    real, fired = torch_engine.sample_rows, set()
    lock = threading.Lock()

    def sample_rows(logits, params, seeds, counters):
        with lock:
            for seed in seeds:
                if seed in FAULTS:
                    fired.add(seed)
                    raise FAULTS[seed]
        return real(logits, params, seeds, counters)

    monkeypatch.setattr(torch_engine, "sample_rows", sample_rows)
    return fired


def _stream(client, seed: int, max_tokens: int = 24) -> tuple[int, list[dict]]:
    events = []
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": MODEL, "messages": HI, "max_tokens": max_tokens, "seed": seed,
                             "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return r.status_code, events


def test_a_faulting_step_fails_only_its_request(server, client, faulty_sampling, caplog):
    server.engine.force_long = True  # the good streams run while the faults happen
    try:
        results: dict[int, tuple] = {}

        def run(seed):
            results[seed] = _stream(client, seed)

        threads = [threading.Thread(target=run, args=(s,)) for s in (1, 2, 111, 3, 222)]
        with caplog.at_level(logging.WARNING, logger="clawrl"):
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        for seed in (1, 2, 3):
            status, events = results[seed]
            assert status == 200 and not any("error" in e for e in events), events[-1:]
            assert events[-1]["choices"][-1]["finish_reason"] == "length"
        for seed in FAULTS:
            status, events = results[seed]
            errors = [e["error"] for e in events if "error" in e]
            assert errors and errors[0]["type"] == "server_error" and set(errors[0]) >= {"message", "code"}, events
        assert faulty_sampling == set(FAULTS)
        lines = [r for r in caplog.records if "engine step failed" in r.getMessage()]
        assert len(lines) == 2 and not any(r.exc_info for r in lines)  # one line each, no traceback
    finally:
        server.engine.force_long = False
    assert_alive(client)


def test_a_faulting_step_of_a_non_streamed_request_is_an_openai_error(client, faulty_sampling):
    r = chat(client, seed=111)
    assert r.status_code >= 500 and r.json()["error"]["type"] == "server_error", r.text
    assert_alive(client)


# ---- property-based: hostile values for every field of the chat request

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
EDGES = [-1, 0, 1, 2**31, 2**63 - 17, 2**63 - 3, 2**63 - 2, 2**63 - 1, 2**63, 2**64]  # int64's edges
INTS = st.sampled_from(EDGES) | st.integers(min_value=-(2**70), max_value=2**70)
FIELDS = {
    "temperature": st.floats(allow_nan=False, allow_infinity=False, min_value=-5, max_value=5) | JUNK,
    "top_p": st.floats(allow_nan=False, allow_infinity=False, min_value=-1, max_value=2) | JUNK,
    "top_k": INTS | JUNK, "n": st.sampled_from([1, 2, 3, 16, 17]) | st.integers(-2, 20) | JUNK, "seed": INTS | JUNK,
    "max_tokens": st.integers(-2, 6) | st.sampled_from([2**31, 2**63]) | JUNK,  # 2**31: clamped to the context
    "max_completion_tokens": st.integers(-2, 6) | JUNK,
    "logprobs": st.booleans() | JUNK, "top_logprobs": st.integers(-2, 25) | JUNK,
    "presence_penalty": st.floats(allow_nan=False, allow_infinity=False) | JUNK,
    "frequency_penalty": st.floats(allow_nan=False, allow_infinity=False) | JUNK,
    "stop": JUNK, "stream": st.booleans() | JUNK, "user": JUNK, "tools": JUNK, "tool_choice": JUNK,
    "model": st.sampled_from([MODEL] * 3) | JUNK,
    "messages": st.just(HI) | st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"]),
                                                             "content": st.text(max_size=12) | JUNK}), max_size=2)
    | JUNK,
}
# each value fits its field alone; seed with n may not (2**63 - 1 and n=2 overflowed int64 in the engine)
VALID = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 700),
         "n": st.integers(1, 4), "seed": st.integers(0, 2**63 - 1), "max_tokens": st.integers(1, 4),
         "logprobs": st.booleans(), "stream": st.booleans(), "user": st.text(max_size=8)}


@st.composite
def requests(draw) -> dict:
    """A valid request with up to three fields made hostile, or one of nothing but hostile fields
    (missing model or messages included): a check that is missing shows as the engine failing."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.fixed_dictionaries({}, optional=FIELDS))
    body = {"model": MODEL, "messages": HI, "max_tokens": 4, **draw(st.fixed_dictionaries({}, optional=VALID))}
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
        body[key] = draw(FIELDS[key])
    return body



@settings(max_examples=200, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck), print_blob=False)
@given(body=requests())
def test_hostile_chat_requests_never_5xx(client, body):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code < 500, (body, r.status_code, r.text[:300])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert client.get("/healthz").status_code == 200
