"""Rendering through ``clawrl.engines.chat_template``: a template that drops ``tools`` (SmolLM2's)
gets clawrl's Hermes-style tool prompt, tool calls and results as text, and the gateway's parser
reads that format back; a template that renders tools itself is left alone."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest
from transformers import AutoTokenizer

from clawrl.engines.base import SamplingParams
from clawrl.engines.chat_template import render_chat, renders_tools, tool_call_text
from clawrl.envs.rollout import run_episode
from clawrl.envs.tool_calls import format_tool_call
from clawrl.envs.toolcall import PYTHON_TOOL
from clawrl.gateway.toolcalls import ToolCall, ToolCallExtractor
from test_toolcall_env import TASK, ScriptedReplies, _env
from tests.required_tools import skip_unless_available

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def smollm2_tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture
def tiny_tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_smollm2_drops_tools_so_the_tool_prompt_is_injected_and_logged_once(smollm2_tok, caplog):
    assert smollm2_tok.apply_chat_template(ASK, tools=[WEATHER], tokenize=False) == \
        smollm2_tok.apply_chat_template(ASK, tokenize=False)
    caplog.set_level(logging.INFO, "clawrl.engines.chat_template")
    prompt = render_chat(smollm2_tok, ASK, [WEATHER])
    assert not renders_tools(smollm2_tok)
    assert prompt.startswith("<|im_start|>system\n# Tools\n")  # prepended, in place of the default system
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt and prompt.count("<|im_start|>system") == 1
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
    render_chat(smollm2_tok, ASK, [WEATHER])
    [line] = [r.getMessage() for r in caplog.records]
    assert "leaves a probe tool out of the prompt" in line and "injects a Hermes-style tool prompt" in line
    merged = render_chat(smollm2_tok, [{"role": "system", "content": "Be brief."}] + ASK, [WEATHER])
    assert merged.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and merged.count("<|im_start|>") == 3
    assert render_chat(smollm2_tok, ASK) == smollm2_tok.apply_chat_template(ASK, add_generation_prompt=True,
                                                                            tokenize=False)


def test_smollm2_renders_assistant_tool_calls_and_tool_results_as_text(smollm2_tok):
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
             {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": calls},
                      {"role": "tool", "tool_call_id": "a", "content": "18C"},
                      {"role": "tool", "tool_call_id": "b", "content": "25C"}]
    with pytest.raises(Exception, match="content"):  # the template itself reads only content, here None
        smollm2_tok.apply_chat_template(messages, tokenize=False)
    prompt = render_chat(smollm2_tok, messages, [WEATHER])
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n25C\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in prompt


def test_the_injected_call_format_is_what_the_gateway_parses_and_the_environment_writes():
    extractor = ToolCallExtractor({"get_weather"})
    [call] = extractor.feed("Let me look.\n" + tool_call_text("get_weather", {"city": "Paris"}))[1:]
    assert isinstance(call, ToolCall) and (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert format_tool_call("print(1)") == tool_call_text("python", {"code": "print(1)"})


def test_a_template_that_renders_tools_is_left_alone_and_a_new_template_is_probed_again(tiny_tok, smollm2_tok):
    assert renders_tools(tiny_tok)
    assert render_chat(tiny_tok, ASK, [WEATHER]) == tiny_tok.apply_chat_template(
        ASK, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert "# Tools\n\nYou may call one or more functions to assist" not in render_chat(tiny_tok, ASK, [WEATHER])
    tiny_tok.chat_template = smollm2_tok.chat_template
    assert not renders_tools(tiny_tok)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in render_chat(tiny_tok, ASK, [WEATHER])


def test_toolcall_env_observations_carry_the_tools_and_the_tool_result_on_smollm2(smollm2_tok, tmp_path):
    skip_unless_available("bwrap")
    call = format_tool_call("print(4821 * 397)")
    engine = ScriptedReplies(smollm2_tok, [call, "\\boxed{1913937}"])
    episode = asyncio.run(run_episode(engine, smollm2_tok, _env(tmp_path), TASK, SamplingParams(max_new_tokens=64), 4))
    assert (episode.reward, episode.turns, episode.info["tool_calls"]) == (1.0, 2, 1)
    first = smollm2_tok.decode(engine.prompts[0])
    assert "<tools>\n" + json.dumps(PYTHON_TOOL) + "\n</tools>" in first and first.count("<|im_start|>system") == 1
    second = engine.prompts[1]
    assert second[:len(engine.prompts[0]) + len(engine.replies[0])] == engine.prompts[0] + engine.replies[0]
    assert smollm2_tok.decode(second[len(engine.prompts[0]) + len(engine.replies[0]):]) == (
        "\n<|im_start|>user\n<tool_response>\n1913937\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
