"""The gateway end to end: the official ``openai`` client against a live uvicorn server running
the real TorchEngine on a tiny Qwen3 that has memorised two answers (plain text without tools, a
get_weather call with tools), so every assertion is about what the real stack returns."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from clawrl.config import compose
from clawrl.engines.base import SamplingParams
from clawrl.engines.torch_engine import TorchEngine
from clawrl.gateway.app import create_app
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

from gateway_support import (PLAIN_ANSWER, WEATHER_TOOL, ServerThread, build_tiny_model, load_tiny,
                             model_cache_dir)

KEY_A, KEY_B, ADMIN = "key-alpha-123", "key-beta-456", "admin-secret-789"
HI = [{"role": "user", "content": "Hi"}]
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_model(model_cache_dir())
    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose([f"run_dir={run_dir}", f"server.api_key='{KEY_A},{KEY_B}'", f"server.admin_key={ADMIN}",
                   "server.max_body_bytes=20000", "engine.threads=1"])
    engine = TorchEngine(load_tiny(path), cfg.engine)
    store = TurnStore(run_dir)
    app = create_app(cfg, engine, SessionLinker(store, cfg.sessions.idle_timeout_s))
    with ServerThread(app) as srv:
        srv.store, srv.engine = store, engine
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", **{"messages": HI, "temperature": 0, **kw})


def raw_post(server, body, key=KEY_A, headers=None, **kw):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers={**h, **(headers or {})},
                      timeout=60, **kw)


def admin_get(server, path):
    r = httpx.get(server.url + path, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# --- non-streaming ----------------------------------------------------------------------------


def test_plain_completion_returns_the_models_answer_and_usage(client):
    r = chat(client)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == PLAIN_ANSWER
    assert c.finish_reason == "stop" and c.message.tool_calls is None
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_a_repeated_prompt_is_served_from_the_prefix_cache(client):
    """The engine keeps a finished request's KV; the same prompt again reuses all of it but the last
    prompt token, whose logits start the reply (``engines/torch_engine.py``, ``first_logit``)."""
    chat(client, max_tokens=4)
    again = chat(client, max_tokens=4).usage
    assert again.prompt_tokens > 1
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens - 1


def test_stored_turn_holds_the_engines_exact_tokens(server, client):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", temperature=0, messages=[{"role": "user", "content": "Tell me a story about a cat."}])
    turn_id = int(raw.headers["x-turn-ids"])
    turn = server.store.get_turn(turn_id)

    async def direct():  # the same prompt through the engine, greedy: the same ids and logprobs
        return await server.engine.generate(turn["prompt_ids"], SamplingParams(max_new_tokens=64, temperature=0))

    ref = asyncio.run(direct())
    assert turn["response_ids"] == ref.token_ids
    assert turn["logprobs"] == pytest.approx(ref.logprobs, abs=1e-5)
    assert turn["weight_versions"] == [0] * len(ref.token_ids)
    assert turn["response_text"] == raw.parse().choices[0].message.content == PLAIN_ANSWER
    assert turn["status"] == "complete" and turn["finish_reason"] == "stop"


def test_stored_turn_records_the_temperature_its_logprobs_were_taken_at(server, client):
    """The trainer recomputes logprobs at this temperature; greedy turns' logprobs are at 1."""
    for sent, stored in ((0.7, 0.7), (0, 1.0)):
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=HI, temperature=sent,
                                                               max_tokens=4)
        turn = server.store.get_turn(int(raw.headers["x-turn-ids"]))
        assert turn["temperature"] == pytest.approx(stored)


def test_n_choices_each_get_an_index_and_a_stored_turn(server, client):
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=HI, n=3, temperature=1.0,
                                                           seed=7, max_tokens=8)
    r = raw.parse()
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    turns = [server.store.get_turn(int(t)) for t in raw.headers["x-turn-ids"].split(",")]
    assert [t["response_text"] for t in turns] == [c.message.content for c in r.choices]
    assert r.usage.completion_tokens == sum(len(t["response_ids"]) for t in turns)


def test_same_seed_gives_the_same_sample(client):
    odd = [{"role": "user", "content": "zebra quantum 42 !! ??"}]  # unseen: a flatter distribution
    samples = [chat(client, messages=odd, temperature=2.0, seed=s, max_tokens=12).choices[0].message.content
               for s in (1, 1, 2, 3, 4)]
    assert samples[0] == samples[1]
    assert len(set(samples)) > 1


def test_max_tokens_ends_with_length(client):
    r = chat(client, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = chat(client, max_completion_tokens=2)
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("stop", ["sea", ["blue", "xyz"]])
def test_stop_string_is_trimmed(client, stop):
    r = chat(client, stop=stop)
    first = stop if isinstance(stop, str) else stop[0]
    assert r.choices[0].message.content == PLAIN_ANSWER[: PLAIN_ANSWER.index(first)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs_have_openai_shape(client):
    r = chat(client, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    text = b"".join(bytes(e.bytes) for e in content).decode()
    assert text.startswith(PLAIN_ANSWER)  # the last token is the end-of-turn marker
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert e.token == bytes(e.bytes).decode()


def test_text_content_parts_and_developer_role_are_accepted(client):
    r = chat(client, messages=[{"role": "developer", "content": "You are a helpful assistant."},
                               {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert r.choices[0].message.content == PLAIN_ANSWER


# --- tools ------------------------------------------------------------------------------------


def test_tool_call_round_trip(server, client):
    r = chat(client, messages=PARIS, tools=[WEATHER_TOOL])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the client runs the tool and sends the result back: it links as the next state of that turn
    follow = client.chat.completions.with_raw_response.create(
        model="tiny", temperature=0, tools=[WEATHER_TOOL],
        messages=PARIS + [c.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    assert follow.status_code == 200
    session = admin_get(server, f"/admin/sessions/{follow.headers['x-session-id']}")
    first, second = session["turns"][-2:]
    assert first["tool_calls"][0]["function"]["name"] == "get_weather"
    assert second["parent_turn_id"] == first["turn_id"] and second["link_rule"] == "prefix"
    assert first["next_state"] and first["next_state"][0]["role"] == "tool"


def test_streamed_tool_call_parses_with_the_openai_stream_api(client):
    with client.chat.completions.stream(model="tiny", temperature=0, messages=PARIS, tools=[WEATHER_TOOL]) as s:
        for _ in s:
            pass
        final = s.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert final.choices[0].finish_reason == "tool_calls"


def test_streamed_tool_call_deltas_have_openai_shape(server):
    r = raw_post(server, {"model": "tiny", "temperature": 0, "messages": PARIS, "tools": [WEATHER_TOOL],
                          "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(r.text)]
    tc = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert tc[0]["index"] == 0 and tc[0]["id"].startswith("call_") and tc[0]["type"] == "function"
    assert tc[0]["function"]["name"] == "get_weather"
    assert all("id" not in t and "name" not in t["function"] for t in tc[1:])
    assert json.loads("".join(t["function"]["arguments"] for t in tc)) == {"city": "Paris"}
    assert not any(d.get("content") for d in deltas)  # no <tool_call> markup leaks as content


def test_tool_choice_none_answers_in_text(client):
    r = chat(client, messages=PARIS, tools=[WEATHER_TOOL], tool_choice="none")
    assert r.choices[0].message.content == PLAIN_ANSWER and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_makes_the_model_call(client, choice):
    # "Hi" without forcing gets plain text (see above); the prefill makes the model complete a call
    r = chat(client, messages=HI, tools=[WEATHER_TOOL], tool_choice=choice)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"


def test_malformed_tool_call_is_content_and_its_parse_error_is_stored(server, client):
    # cut the call short with a stop string: the block never closes, so it is returned as text
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", temperature=0, messages=PARIS, tools=[WEATHER_TOOL], stop=["Paris"])
    c = raw.parse().choices[0]
    assert c.message.tool_calls is None and c.message.content.startswith("<tool_call>")
    turn = server.store.get_turn(int(raw.headers["x-turn-ids"]))
    assert "not terminated" in turn["tool_parse_error"]


# --- streaming --------------------------------------------------------------------------------


def test_stream_chunks_role_first_then_content_finish_usage_done(server):
    r = raw_post(server, {"model": "tiny", "temperature": 0, "messages": HI, "stream": True,
                          "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = events[-2]["choices"][0]
    assert finish["finish_reason"] == "stop" and finish["delta"] == {}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    assert all(e["usage"] is None for e in events[:-1])
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:-2])
    assert text == PLAIN_ANSWER


def test_stream_with_n_and_stop_holds_back_partial_stop(server):
    r = raw_post(server, {"model": "tiny", "temperature": 0, "messages": HI, "stream": True, "n": 2,
                          "stop": ["calm."]})
    texts, finishes = {0: "", 1: ""}, {}
    for e in sse_events(r.text):
        ch = e["choices"][0]
        texts[ch["index"]] += ch["delta"].get("content") or ""
        if ch["finish_reason"]:
            finishes[ch["index"]] = ch["finish_reason"]
    expected = PLAIN_ANSWER[: PLAIN_ANSWER.index("calm.")]
    assert texts == {0: expected, 1: expected} and finishes == {0: "stop", 1: "stop"}


def test_streamed_logprobs_cover_every_token(client):
    stream = chat(client, stream=True, logprobs=True, stream_options={"include_usage": True})
    entries, usage = [], None
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            entries += (c.logprobs.content or []) if c.logprobs else []
    assert len(entries) == usage.completion_tokens


# --- errors -----------------------------------------------------------------------------------


def test_missing_and_wrong_key_are_401(server):
    for key in (None, "wrong-key"):
        r = raw_post(server, {"model": "tiny", "messages": HI}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=HI)
    assert e.value.code == "model_not_found"


def test_unsupported_parameter_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "json_object"})
    assert e.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, logit_bias={"1": 5})
    assert e.value.param == "logit_bias"


def test_image_part_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert e.value.param == "messages[0].content[0]"


def test_invalid_json_is_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_body_over_the_limit_is_413_by_header_and_by_stream(server):
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 30000}]}
    assert raw_post(server, big).status_code == 413

    def chunks():  # no Content-Length: the size is only known while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 4096):
            yield data[i:i + 4096]

    r = httpx.post(server.url + "/v1/chat/completions", content=chunks(),
                   headers={"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_prompt_longer_than_context_is_400_context_length_exceeded(server, client):
    n = server.engine.model_info().max_context
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=[{"role": "user", "content": "cat " * n}])
    assert e.value.code == "context_length_exceeded"


def test_invalid_turn_type_header_is_400(server):
    r = raw_post(server, {"model": "tiny", "messages": HI}, headers={"X-Turn-Type": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Turn-Type"


def test_unknown_route_and_method_are_openai_errors(server):
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


# --- models, health, sessions, admin ----------------------------------------------------------


def test_models_and_healthz(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    h = httpx.get(server.url + "/healthz").json()
    assert h["ok"] is True and h["model"] == "tiny"


def test_identical_openings_from_two_callers_stay_apart(server):
    opening = {"model": "tiny", "temperature": 0, "messages": [{"role": "user", "content": "Hi there, caller"}]}
    a = raw_post(server, opening, key=KEY_A).headers["x-session-id"]
    b = raw_post(server, opening, key=KEY_B).headers["x-session-id"]
    c = raw_post(server, {**opening, "user": "someone-else"}, key=KEY_A).headers["x-session-id"]
    assert len({a, b, c}) == 3


def test_session_headers_name_the_session_and_turn_type(server):
    r = raw_post(server, {"model": "tiny", "temperature": 0, "messages": HI},
                 headers={"X-Session-Id": "my-session-1", "X-Turn-Type": "side"})
    assert r.headers["x-session-id"] == "my-session-1"
    turn = admin_get(server, "/admin/sessions/my-session-1")["turns"][0]
    assert (turn["turn_type"], turn["type_rule"]) == ("side", "header")
    assert turn["response_text"] == PLAIN_ANSWER


def test_turn_is_stored_before_the_finish_chunk_is_sent(server):
    body = {"model": "tiny", "temperature": 0, "messages": HI, "stream": True}
    headers = {"Authorization": f"Bearer {KEY_A}", "X-Session-Id": "durable-first"}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["finish_reason"]:
                # the client has not read [DONE] yet, and the turn is already committed
                (turn,) = server.store.get_session("durable-first")["turns"]
                assert turn["status"] == "complete" and turn["response_text"] == PLAIN_ANSWER
                break
        else:
            raise AssertionError("no finish chunk")


def test_body_session_id_and_session_done_header(server):
    r = raw_post(server, {"model": "tiny", "temperature": 0, "messages": HI, "session_id": "from-body"},
                 headers={"X-Session-Done": "1"})
    assert r.headers["x-session-id"] == "from-body"
    (turn,) = admin_get(server, "/admin/sessions/from-body")["turns"]
    assert turn["close_reason"] == "session_done"


def test_admin_api_status_sessions_and_relabel(server):
    r = raw_post(server, {"model": "tiny", "temperature": 0, "messages": HI}, headers={"X-Session-Id": "adm-1"})
    turn_id = int(r.headers["x-turn-ids"])
    status = admin_get(server, "/admin/status")
    assert status["weight_version"] == 0 and status["turns"] >= 1 and status["sessions"] >= 1
    assert {"main_turns", "turns_with_next_state"} <= set(status)
    assert any(s["session_id"] == "adm-1" for s in admin_get(server, "/admin/sessions")["data"])
    h = {"Authorization": f"Bearer {ADMIN}"}
    ok = httpx.patch(f"{server.url}/admin/turns/{turn_id}", json={"label": "excluded"}, headers=h)
    assert ok.status_code == 200 and ok.json()["new_label"] == "excluded"
    assert server.store.get_turn(turn_id)["trainable"] is False
    assert httpx.patch(f"{server.url}/admin/turns/99999999", json={"label": "main"}, headers=h).status_code == 404
    bad = httpx.patch(f"{server.url}/admin/turns/{turn_id}", json={"label": "great"}, headers=h)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "label"
    assert httpx.get(server.url + "/admin/sessions/none-such", headers=h).status_code == 404


def test_admin_needs_the_admin_key(server):
    assert httpx.get(server.url + "/admin/status").status_code == 401
    r = httpx.get(server.url + "/admin/status", headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
