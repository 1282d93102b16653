"""Gateway pieces that need no server: request validation, auth, tool-call parsing, stop trimming,
incremental decoding, rendering and truncation."""
from __future__ import annotations

import json

import pytest

from clawrl.config import ServerConfig
from clawrl.gateway import json_limits
from clawrl.gateway.auth import AuthConfigError, KeyRing, check_server_auth
from clawrl.gateway.protocol import ApiError, parse_chat_request, parse_json_body
from clawrl.gateway.render import render_prompt
from clawrl.gateway.text import ChoiceDecoder, IncrementalDecoder, StopTrimmer, token_bytes
from clawrl.gateway.toolcalls import Content, ToolCall, ToolCallExtractor, held_suffix_len

from gateway_support import TOOL_ANSWER, WEATHER_TOOL, build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def body(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def err(fn, *a) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*a)
    return e.value


# --- protocol ---------------------------------------------------------------------------------


@pytest.mark.parametrize("param", ["response_format", "logit_bias", "functions", "function_call", "audio",
                                   "modalities", "prediction", "no_such_thing"])
def test_unsupported_parameter_is_refused_by_name(param):
    e = err(parse_chat_request, body(**{param: {"type": "json_object"}}))
    assert (e.status, e.param, e.code) == (400, param, "unsupported_parameter")
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_neutral_penalties_are_accepted_and_others_refused():
    parse_chat_request(body(presence_penalty=0, frequency_penalty=0.0))
    assert err(parse_chat_request, body(presence_penalty=0.5)).param == "presence_penalty"


def test_image_part_is_refused_naming_the_part():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    e = err(parse_chat_request, body(messages=msgs))
    assert e.param == "messages[0].content[1]" and "image" in e.message


def test_text_parts_developer_role_and_tool_history_are_normalised():
    msgs = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    req = parse_chat_request(body(messages=msgs))
    assert req.messages[0] == {"role": "system", "content": "be brief"}
    assert req.messages[1]["content"] == "a\nb"
    assert req.messages[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert req.messages[3]["tool_call_id"] == "c1"


def tool_history(call_id="c1", args='{"city": "Paris"}', answer_id="c1", between=()):
    return [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            *between,
            {"role": "tool", "tool_call_id": answer_id, "content": "sunny"}]


@pytest.mark.parametrize("msgs,param,words", [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "x"}],
     "messages[1].role", "does not follow an assistant message with 'tool_calls'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no calls"},
      {"role": "tool", "tool_call_id": "c1", "content": "x"}], "messages[2].role", "does not follow"),
    (tool_history(answer_id="c2"), "messages[2].tool_call_id", "'c2' matches none of the 'tool_calls'"),
    (tool_history(between=[{"role": "user", "content": "and?"}]), "messages[3].role", "does not follow"),
    (tool_history(answer_id=None), "messages[2].tool_call_id", "is required"),
    (tool_history(answer_id=7), "messages[2].tool_call_id", "is required"),
    (tool_history(call_id=7), "messages[1].tool_calls[0].id", "must be a string"),
    (tool_history(args={"city": "Paris"}), "messages[1].tool_calls[0].function.arguments", "must be a string"),
])
def test_tool_results_must_answer_a_call_of_the_preceding_assistant_message(msgs, param, words):
    e = err(parse_chat_request, body(messages=msgs))
    assert (e.status, e.param, e.type) == (400, param, "invalid_request_error") and words in e.message


def test_several_tool_results_answer_the_calls_of_one_assistant_message():
    msgs = tool_history()
    msgs[1]["tool_calls"].append({"id": "c2", "type": "function",
                                  "function": {"name": "get_weather", "arguments": ""}})
    msgs.append({"role": "tool", "tool_call_id": "c2", "content": "rainy"})
    req = parse_chat_request(body(messages=msgs))
    assert [m.get("tool_call_id") for m in req.messages] == [None, None, "c1", "c2"]
    assert req.messages[1]["tool_calls"][1]["function"]["arguments"] == {}


@pytest.mark.parametrize("raw,param,code", [
    (b'{"model": "m", "messages": ' + b'{"messages": [' * 2000, None, "json_too_deep"),  # the decoder's own limit
    (b'{"model": "m", "messages": ' + b"[" * 150 + b"]" * 150 + b"}", "messages" + "[0]" * 99, "json_too_deep"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content",
     "invalid_unicode"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content",
     "invalid_unicode"),
    # UTF-8 bytes of an encoded surrogate: Python's decoder lets them through as a lone surrogate
    (b'{"model": "m", "messages": [{"role": "user", "content": "a\xed\xa0\x80"}]}', "messages[0].content",
     "invalid_unicode"),
    (b'{"model": "m", "\\ud800": 1}', None, "invalid_unicode"),
    # Python's decoder raised a plain ValueError past 4300 digits; NaN is Python's, not JSON's
    (b'{"model": "m", "seed": ' + b"7" * 5000 + b"}", None, "number_too_long"),
    (b'{"model": "m", "seed": -' + b"7" * 1001 + b"}", None, "number_too_long"),
    (b'{"model": "m", "temperature": NaN}', None, "invalid_json"),
])
def test_json_bodies_too_deep_or_with_lone_surrogates_are_400_naming_where(raw, param, code):
    e = err(parse_json_body, raw)
    assert (e.status, e.param, e.code) == (400, param, code)
    json.dumps(e.body(), ensure_ascii=False).encode("utf-8")  # the error itself is sendable UTF-8


def test_a_thousand_digits_are_an_integer():
    assert parse_json_body(b'{"n": -' + b"9" * 1000 + b"}")["n"] == -(10 ** 1000 - 1)


def test_surrogate_pairs_and_a_hundred_levels_are_fine():
    body_ = parse_json_body(b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert body_["messages"][0]["content"] == "\U0001F600"
    json_limits.check(json.loads("[" * 100 + "]" * 100))
    with pytest.raises(json_limits.UnsafeJson):
        json_limits.check(json.loads("[" * 101 + "]" * 101))


@pytest.mark.parametrize("args,param,code", [
    ('{"city": "\\ud800"}', "messages[1].tool_calls[0].function.arguments.city", "invalid_unicode"),
    ("[" * 3000, "messages[1].tool_calls[0].function.arguments", "json_too_deep"),
    ('{"a": ' + "[" * 120 + "]" * 120 + "}", "messages[1].tool_calls[0].function.arguments.a" + "[0]" * 99,
     "json_too_deep"),
])
def test_tool_call_arguments_are_held_to_the_same_limits(args, param, code):
    e = err(parse_chat_request, body(messages=tool_history(args=args)))
    assert (e.status, e.param, e.code) == (400, param, code)


@pytest.mark.parametrize("kw,param", [
    ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"stop": [1]}, "stop"), ({"stop": ["a"] * 5}, "stop"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": None}, "model"), ({"seed": "x"}, "seed"),
])
def test_schema_errors_name_the_param(kw, param):
    e = err(parse_chat_request, body(**kw))
    assert (e.status, e.param) == (400, param)


def test_invalid_json_and_non_object_bodies_are_400():
    assert err(parse_json_body, b"{nope").code == "invalid_json"
    assert err(parse_json_body, b"[1, 2]").status == 400


def test_max_completion_tokens_wins_and_stop_string_becomes_a_tuple():
    req = parse_chat_request(body(max_tokens=5, max_completion_tokens=7, stop="END"))
    assert req.max_tokens == 7 and req.stop == ("END",)


# --- auth -------------------------------------------------------------------------------------


def test_key_ring_accepts_each_listed_key_and_refuses_others():
    ring = KeyRing(["alpha", "beta"], "/v1")
    assert ring.check("Bearer beta") == "beta"
    assert ring.check("bearer alpha") == "alpha"
    for bad in (None, "", "Bearer", "Basic alpha", "Bearer alph", "Bearer alphaa"):
        with pytest.raises(ApiError) as e:
            ring.check(bad)
        assert e.value.status == 401 and "alph" not in e.value.message


def test_no_key_on_loopback_allows_and_non_loopback_requires_a_key():
    assert KeyRing([], "/v1").check(None) is None
    check_server_auth(ServerConfig(host="127.0.0.1"))
    check_server_auth(ServerConfig(host="::1"))
    with pytest.raises(AuthConfigError):
        check_server_auth(ServerConfig(host="0.0.0.0"))
    check_server_auth(ServerConfig(host="0.0.0.0", api_key="k"))


# --- tool calls and text ----------------------------------------------------------------------


def run_extractor(pieces, names={"get_weather"}, single=False):
    ex = ToolCallExtractor(set(names), single=single)
    events = []
    for p in pieces:
        events += ex.feed(p)
    events += ex.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = [e for e in events if isinstance(e, ToolCall)]
    return content, calls, ex.errors


def test_held_suffix_len_finds_partial_markers():
    assert held_suffix_len("abc<tool", ["<tool_call>"]) == 5
    assert held_suffix_len("abc", ["<tool_call>"]) == 0
    assert held_suffix_len("x\nST", ["STOP", "\n\n"]) == 2


@pytest.mark.parametrize("split", [1, 2, 3, 7, 1000])
def test_tool_call_parses_the_same_however_the_text_is_split(split):
    text = "Let me check.\n" + TOOL_ANSWER + "\n" + TOOL_ANSWER.replace("Paris", "Oslo")
    pieces = [text[i:i + split] for i in range(0, len(text), split)]
    content, calls, errors = run_extractor(pieces)
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_weather", {"city": "Oslo"})]
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in calls) and calls[0].id != calls[1].id
    assert errors == []


@pytest.mark.parametrize("text,reason", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', "not valid JSON"),
    ('<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>', "unknown tool"),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', "no string 'name'"),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "not terminated"),
])
def test_malformed_tool_call_comes_back_as_content_with_the_reason(text, reason):
    content, calls, errors = run_extractor([text])
    assert calls == [] and content == text
    assert len(errors) == 1 and reason in errors[0]


@pytest.mark.parametrize("text,reason", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud800"}}\n</tool_call>', "surrogate"),
    ('<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"\\\\udc00\\"}"}\n</tool_call>',
     "surrogate"),
    ('<tool_call>\n{"name": "get_weather", "arguments": ' + "[" * 2000 + "\n</tool_call>", "deeper than"),
])
def test_a_model_written_call_with_a_lone_surrogate_or_endless_nesting_is_malformed(text, reason):
    # the model's text is valid unicode, but it can write an escape that decodes to invalid text
    content, calls, errors = run_extractor([text])
    assert calls == [] and content == text and len(errors) == 1 and reason in errors[0]
    content.encode("utf-8")  # what is stored and shown stays valid UTF-8


def test_without_tools_tool_call_markup_is_plain_content():
    content, calls, errors = run_extractor([TOOL_ANSWER], names=set())
    assert (content, calls, errors) == (TOOL_ANSWER, [], [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    _, calls, errors = run_extractor([TOOL_ANSWER + "\n" + TOOL_ANSWER], single=True)
    assert len(calls) == 1 and "parallel_tool_calls" in errors[0]


def test_stop_trimmer_cuts_at_the_first_stop_and_holds_back_partial_stops():
    t = StopTrimmer(("END", "\n\n"))
    assert t.feed("hello E") == "hello "  # "E" could begin END
    assert t.feed("N") == ""
    assert t.feed("Dless") == ""  # END matched: nothing after it is shown
    assert t.stopped == "END" and t.finish() == ""
    t = StopTrimmer(("END",))
    assert t.feed("hello EN") == "hello " and t.finish() == "EN"


def test_incremental_decoder_matches_full_decode_on_multibyte_text(tok):
    text = "café naïve 東京 ✓ emoji 🙂 done"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDecoder(tok)
    out = "".join(d.push([i]) for i in ids) + d.flush()
    assert out == text
    assert all("\ufffd" not in d.push([]) for _ in range(2))


def test_token_bytes_concatenate_to_the_utf8_text(tok):
    text = "naïve 🙂 <tool_call>"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()


def test_choice_decoder_trims_stop_then_parses_prefilled_tool_call(tok):
    prefill = '<tool_call>\n{"name": "get_weather'
    rest = '", "arguments": {"city": "Paris"}}\n</tool_call>'
    dec = ChoiceDecoder(tok, ("STOP",), {"get_weather"}, False, prefill)
    events = []
    for i in tok.encode(rest + "STOP trailing", add_special_tokens=False):
        events += dec.push([i])
    events += dec.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert dec.stopped and dec.content == "" and [c.name for c in calls] == ["get_weather"]


# --- rendering --------------------------------------------------------------------------------


def test_tool_choice_none_hides_tools_and_required_prefills_a_call(tok):
    base = body(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL])
    auto = render_prompt(tok, parse_chat_request(base), 4096, False)
    none = render_prompt(tok, parse_chat_request({**base, "tool_choice": "none"}), 4096, False)
    named = render_prompt(tok, parse_chat_request(
        {**base, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}), 4096, False)
    assert "get_weather" in tok.decode(auto.ids) and auto.tool_names == {"get_weather"}
    assert "get_weather" not in tok.decode(none.ids) and none.tool_names == set()
    assert tok.decode(named.ids).endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather')


def long_chat():
    msgs = [{"role": "system", "content": "SYSTEM PROMPT"}]
    for i in range(12):
        msgs += [{"role": "user", "content": f"question {i} " + "word " * 20},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i} " + "data " * 20},
                 {"role": "assistant", "content": f"answer {i}"}]
    msgs.append({"role": "user", "content": "final question"})
    return msgs


def test_over_long_prompt_is_context_length_exceeded(tok):
    req = parse_chat_request(body(messages=long_chat()))
    full = len(render_prompt(tok, req, 100000, False).ids)
    e = err(render_prompt, tok, req, full - 10, False)
    assert (e.status, e.code, e.param) == (400, "context_length_exceeded", "messages")


def test_truncate_history_keeps_system_and_latest_turns_whole(tok):
    req = parse_chat_request(body(messages=long_chat()))
    full = len(render_prompt(tok, req, 100000, False).ids)
    out = render_prompt(tok, req, full // 2, True)
    text = tok.decode(out.ids)
    assert len(out.ids) < full // 2 and out.dropped_messages > 0
    assert text.startswith("<|im_start|>system\nSYSTEM PROMPT") and "final question" in text
    assert "question 0 " not in text and "answer 11" in text
    kept = req.messages[1 + out.dropped_messages:]
    assert kept[0]["role"] == "user"  # the cut falls at a turn start: no call is split from its result
    # nothing fits but the system prompt and the last message: still an error, not a broken prompt
    assert err(render_prompt, tok, req, 10, True).code == "context_length_exceeded"


@pytest.mark.parametrize("name", ["chat_turn1", "chat_turn2", "tool_turn1", "tool_turn2"])
def test_real_openclaw_requests_validate(name):
    from pathlib import Path

    body = json.loads((Path(__file__).parent / "fixtures" / "openclaw-2026.9.6" / f"{name}.json").read_text())["body"]
    req = parse_chat_request(body)
    assert req.stream and req.include_usage and req.max_tokens == 512 and len(req.tools) == 12
    assert all(isinstance(m["content"], str) for m in req.messages if m["role"] != "assistant")


def test_admission_queues_fifo_refuses_past_the_queue_and_survives_cancelled_waiters():
    import asyncio

    from clawrl.gateway.app import Admission

    async def scenario():
        adm = Admission(capacity=2, max_queue=2)
        await adm.acquire(2)  # both slots busy
        order = []

        async def waiter(name, n):
            await adm.acquire(n)
            order.append(name)

        a = asyncio.create_task(waiter("a", 1))
        b = asyncio.create_task(waiter("b", 1))
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as e:  # two already waiting: the third is refused
            await adm.acquire(1)
        assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
        a.cancel()  # a waiter that gives up leaves the queue
        await asyncio.sleep(0)
        assert adm.waiting == 1
        adm.release(2)
        await b
        assert order == ["b"] and adm.free == 1
        adm.release(1)
        assert adm.free == 2

    asyncio.run(scenario())


def test_tool_call_tags_survive_decoding_when_the_tokenizer_marks_them_special(tiny_model_dir):
    """The embedded tokenizer (like some HF ones) marks <tool_call> special; the parser still sees it."""
    from transformers import AutoTokenizer

    from clawrl.gateway.text import IncrementalDecoder

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert tok.added_tokens_decoder[tok.convert_tokens_to_ids("<tool_call>")].special
    ids = tok.encode('<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call><|im_end|>')
    dec = IncrementalDecoder(tok)
    text = "".join(dec.push([i]) for i in ids) + dec.flush()
    assert text == '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'  # <|im_end|> hidden
