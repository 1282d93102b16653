"""Error paths against a live server: overload (429), engine failures, client disconnects,
history truncation and idle-session closing. The engine is the real TorchEngine subclassed only
to make these paths deterministic (hold streams at a gate, force a long output, fail on demand)."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from clawrl.config import compose
from clawrl.engines.base import EngineError
from clawrl.gateway.app import create_app
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

from gateway_support import (PLAIN_ANSWER, ServerThread, build_tiny_model, load_tiny, make_controlled_engine,
                             model_cache_dir)

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_model(model_cache_dir())
    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose([f"run_dir={run_dir}", "engine.max_batch_size=1", "server.max_queue=1",
                   "server.truncate_history=true", "engine.max_context=160", "sessions.idle_timeout_s=0.4",
                   "engine.threads=1"])
    engine = make_controlled_engine(load_tiny(path), cfg.engine)
    store = TurnStore(run_dir)
    app = create_app(cfg, engine, SessionLinker(store, cfg.sessions.idle_timeout_s))
    with ServerThread(app) as srv:
        srv.store, srv.engine = store, engine
        yield srv


@pytest.fixture(autouse=True)
def reset_engine(server):
    e = server.engine
    e.released.set()
    e.force_long, e.step_delay, e.fail_on_open, e.fail_mid_stream = False, 0.0, None, None
    yield
    e.released.set()


def post(server, body, **kw):
    return httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": HI, **body},
                      timeout=60, **kw)


def wait_for(predicate, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def status(server) -> dict:
    return httpx.get(server.url + "/admin/status", timeout=30).json()


def engine_idle(server) -> bool:
    engine = status(server)["engine"]
    return engine["running"] == 0 and engine["waiting"] == 0


def session_turns(server, sid):
    s = server.store.get_session(sid)
    return s["turns"] if s else []


def test_full_queue_answers_429_with_retry_after(server):
    import concurrent.futures as cf

    server.engine.released.clear()  # the running request holds the only slot until released
    with cf.ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, server, {"temperature": 0})
        wait_for(lambda: status(server)["queue"]["free_slots"] == 0)  # it has the slot, held at the gate
        queued = pool.submit(post, server, {"temperature": 0})
        wait_for(lambda: status(server)["queue"]["waiting"] == 1)
        r = post(server, {"temperature": 0})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        server.engine.released.set()
        assert running.result(60).status_code == 200 and queued.result(60).status_code == 200
    # the openai client sees the same answer as a RateLimitError
    server.engine.released.clear()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with cf.ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(post, server, {}) for _ in range(2)]
        wait_for(lambda: status(server)["queue"]["waiting"] == 1)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="tiny", messages=HI)
        server.engine.released.set()
        assert [f.result(60).status_code for f in futs] == [200, 200]


def test_engine_exception_on_open_is_a_clean_json_error(server):
    server.engine.fail_on_open = RuntimeError("CUDA fell off the bus")
    r = post(server, {})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    assert "CUDA" not in err["message"]  # internals are logged, not sent
    server.engine.fail_on_open = EngineError("engine is shut down")
    r = post(server, {})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
    server.engine.fail_on_open = None
    assert post(server, {"temperature": 0}).status_code == 200  # and the slot was given back


def test_engine_failure_mid_stream_is_an_sse_error_and_an_error_turn(server):
    server.engine.fail_mid_stream = EngineError("decode step failed")
    r = post(server, {"stream": True}, headers={"X-Session-Id": "midfail"})
    events = [l[6:] for l in r.text.split("\n\n") if l.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_error"
    assert session_turns(server, "midfail")[0]["status"] == "error"
    server.engine.fail_mid_stream = EngineError("decode step failed")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.chat.completions.create(model="tiny", messages=HI, stream=True):
            pass


def test_engine_failure_mid_request_is_503_and_an_error_turn(server):
    server.engine.fail_mid_stream = EngineError("decode step failed")
    r = post(server, {}, headers={"X-Session-Id": "midfail-nonstream"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
    assert session_turns(server, "midfail-nonstream")[0]["status"] == "error"


def test_client_disconnect_mid_stream_aborts_and_stores_an_aborted_turn(server):
    server.engine.force_long, server.engine.step_delay = True, 0.02  # ~3 s for 150 tokens
    before = len(server.engine.aborted)
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      headers={"X-Session-Id": "gone-away"},
                      json={"model": "tiny", "messages": HI, "stream": True, "max_tokens": 150}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(8)]  # a few chunks in, the client hangs up
    assert any(l.startswith("data: ") for l in got)
    turn = wait_for(lambda: session_turns(server, "gone-away"))[0]
    assert turn["status"] == "aborted" and turn["trainable"] is False
    assert 0 < turn["response_tokens"] < 150
    assert len(server.engine.aborted) > before
    assert wait_for(lambda: engine_idle(server))  # the engine request is gone
    assert server.store.get_turn(turn["turn_id"])["untrainable_reason"] == "aborted"


def test_client_disconnect_during_a_non_streaming_request_is_stored_aborted(server):
    server.engine.released.clear()  # generation stalls until the client has given up
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/chat/completions", timeout=0.6, headers={"X-Session-Id": "gone-nonstream"},
                   json={"model": "tiny", "messages": HI, "max_tokens": 150})
    turn = wait_for(lambda: session_turns(server, "gone-nonstream"))[0]
    assert turn["status"] == "aborted" and turn["response_tokens"] < 150
    assert wait_for(lambda: engine_idle(server))


def test_truncate_history_drops_old_turns_to_fit(server):
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(8):
        msgs += [{"role": "user", "content": f"old question {i} about cats and dogs"},
                 {"role": "assistant", "content": f"old answer {i} about cats"}]
    msgs.append({"role": "user", "content": "Hi"})
    r = post(server, {"messages": msgs, "temperature": 0, "max_tokens": 4})
    assert r.status_code == 200, r.text
    turn = server.store.get_turn(int(r.headers["x-turn-ids"]))
    prompt = server.engine.tokenizer.decode(turn["prompt_ids"])
    assert len(turn["prompt_ids"]) < 160
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert "old question 0 " not in prompt and "old answer 7" in prompt
    assert prompt.endswith("Hi<|im_end|>\n<|im_start|>assistant\n")
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_idle_sessions_are_closed_in_the_background(server):
    r = post(server, {"temperature": 0}, headers={"X-Session-Id": "idle-one"})
    assert r.json()["choices"][0]["message"]["content"] == PLAIN_ANSWER
    turn = wait_for(lambda: [t for t in session_turns(server, "idle-one") if t["close_reason"] == "idle_timeout"])
    assert turn[0]["next_state"] is None


# --- hostile bodies: each once answered 503 (or 200) and is now a 400 naming what is wrong -----

def tool_turn(args='{"city": "Paris"}', answer_id="c1") -> list[dict]:
    return [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": answer_id, "content": "sunny"}]


def body_bytes(messages) -> bytes:
    return json.dumps({"model": "tiny", "max_tokens": 4, "messages": messages}).encode()


HOSTILE = {  # name: (raw body, status, param, code, words in the message)
    # json.loads recursed once per level and raised RecursionError
    "deeply nested JSON": (b'{"model": "tiny", "messages": ' + b'{"messages": [' * 2000, 400, None,
                           "json_too_deep", "nests deeper than 100 levels"),
    # valid JSON, but the tokenizer cannot encode "\ud800" and SQLite cannot store it as UTF-8
    "lone surrogate in content": (b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi \\ud800"}]}',
                                  400, "messages[0].content", "invalid_unicode", "lone UTF-16 surrogate"),
    "lone surrogate in arguments": (body_bytes(tool_turn(args="X")).replace(b'"X"', b'"\\ud800"'), 400,
                                    "messages[1].tool_calls[0].function.arguments", "invalid_unicode", "surrogate"),
    "lone surrogate inside the arguments' JSON": (body_bytes(tool_turn(args='{"city": "\\ud800"}')), 400,
                                                  "messages[1].tool_calls[0].function.arguments.city",
                                                  "invalid_unicode", "surrogate"),
    # Python's int() refused 5000 digits with a ValueError from inside the decoder
    "a 5000-digit integer": (b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "seed": '
                             + b"9" * 5000 + b"}", 400, None, "number_too_long", "more than 1000 digits"),
    "arguments nested past the limit": (body_bytes(tool_turn(args="[" * 3000)), 400,
                                        "messages[1].tool_calls[0].function.arguments", "json_too_deep", "deeper"),
    # these were answered 200; OpenAI refuses them
    "tool message without a preceding call": (body_bytes([{"role": "user", "content": "Hi"},
                                                          {"role": "tool", "tool_call_id": "c1", "content": "x"}]),
                                              400, "messages[1].role", None, "does not follow"),
    "tool message answering no call": (body_bytes(tool_turn(answer_id="c9")), 400, "messages[2].tool_call_id", None,
                                       "'c9' matches none"),
    "arguments as an object": (body_bytes(tool_turn(args={"city": "Paris"})), 400,
                               "messages[1].tool_calls[0].function.arguments", None, "must be a string"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_bodies_are_a_400_in_openai_format_and_store_nothing(server, name):
    raw, code_status, param, code, words = HOSTILE[name]
    before = status(server)["turns"]
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == code_status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert (err["param"], err["code"]) == (param, code) and words in err["message"], err
    assert status(server)["turns"] == before


def test_a_surrogate_pair_is_text_and_the_stored_turn_is_valid_utf8(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, headers={"Content-Type": "application/json"},
                   content=b'{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": '
                           b'"Hi \\ud83d\\ude42"}]}')
    assert r.status_code == 200, r.text
    turn = server.store.get_turn(int(r.headers["x-turn-ids"]))
    assert "Hi \U0001F642" in server.engine.tokenizer.decode(turn["prompt_ids"])


@pytest.mark.parametrize("target,fault", [
    ("clawrl.gateway.app.render_prompt", RuntimeError("renderer bug")),
    ("clawrl.gateway.app.render_prompt", RecursionError("a recursion bug of ours")),
    ("clawrl.gateway.json_limits.check", RuntimeError("checker bug")),
])
def test_an_internal_fault_is_still_a_5xx_in_openai_format(server, monkeypatch, target, fault):
    """The fixes above refuse specific bad input; they do not turn the server's own faults into 400s."""
    def broken(*a, **kw):
        raise fault
    monkeypatch.setattr(target, broken)
    r = post(server, {"max_tokens": 4})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("server_error", "internal_error") and "bug" not in err["message"]
    monkeypatch.undo()
    assert post(server, {"max_tokens": 4}).status_code == 200


def test_admin_ids_past_sqlite_integers_are_404_or_400_not_503(server):
    # SQLite's INTEGER is 64-bit: a longer id overflowed inside the store; "²" passes str.isdigit
    for turn_id in ("9" * 30, "%C2%B2", "%D9%A1"):
        r = httpx.patch(f"{server.url}/admin/turns/{turn_id}", json={"label": "side"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "turn_not_found", (turn_id, r.text)
    r = httpx.get(f"{server.url}/admin/sessions?offset={10 ** 30}", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text
