"""The tool-call environment: replies read as calls or answers, a persistent sandboxed interpreter,
and ReTool's reward (+1 for a correct boxed answer, -1 for anything else, no answer included).

Replies are checked in every spelling a model's turn reaches the environment in: the template's
tagged ``<tool_call>``, the same JSON with its tags gone (decoded with skip_special_tokens), and a
fenced python block. The sandboxed tests run the real interpreter under bubblewrap."""
from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from clawrl.config import SandboxConfig, compose
from clawrl.embedded.tokenizer import render_chat
from clawrl.engines.base import GenerateResult, SamplingParams
from clawrl.envs import EnvError, Task, env_class
from clawrl.envs.answers import answers_match, expected_answer
from clawrl.envs.rollout import run_episode
from clawrl.envs.scripted import NOP, ORACLE, play
from clawrl.envs.task_formats.rows import read_split
from clawrl.envs.tool_calls import format_tool_call, parse_reply
from clawrl.envs.toolcall import INSTRUCTIONS, PYTHON_TOOL, ToolCallEnv, task_fields
from tests.required_tools import skip_unless_available

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "toolcall-rl"
TASK = Task("t-1", {"question": "What is 4821 * 397?", "answer": "1913937"})


# ----- reading replies -----

def test_a_tagged_call_as_the_template_renders_it_is_a_call():
    code = 'x = 4821 * 397\nprint(f"{x}")'
    reply = parse_reply("Let me compute.\n" + format_tool_call(code))
    assert reply.calls == [code] and reply.answer is None and reply.error is None


def test_the_call_format_is_the_one_the_chat_template_renders_for_tool_calls():
    code = "print(2 ** 100)"
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]}
    rendered = render_chat([{"role": "user", "content": "q"}, message])
    assert format_tool_call(code) + "<|im_end|>" in rendered


def test_a_call_whose_tags_were_dropped_by_decoding_is_still_a_call():
    # <tool_call> is a special token: decode(..., skip_special_tokens=True) leaves the JSON alone.
    reply = parse_reply('\n{"name": "python", "arguments": {"code": "print(1 + 1)"}}\n')
    assert reply.calls == ["print(1 + 1)"]


def test_a_fenced_python_block_is_a_call_and_arguments_may_be_a_json_string():
    assert parse_reply("Compute:\n```python\nprint(3 ** 40)\n```").calls == ["print(3 ** 40)\n"]
    wire = {"name": "python", "arguments": json.dumps({"code": "print(7)"})}
    assert parse_reply(f"<tool_call>\n{json.dumps(wire)}\n</tool_call>").calls == ["print(7)"]


def test_a_dict_with_a_name_key_inside_code_is_code_not_a_call():
    code = 'person = {"name": "Ada", "born": 1815}\nprint(2024 - person["born"])\n'
    assert parse_reply(f"```python\n{code}```").calls == [code]
    assert parse_reply(format_tool_call(code)).calls == [code]


def test_several_calls_run_in_the_order_written():
    reply = parse_reply("```python\na = 1\n```\n" + format_tool_call("b = 2") + "\n```py\nprint(a + b)\n```")
    assert reply.calls == ["a = 1\n", "b = 2", "print(a + b)\n"]


def test_a_boxed_answer_is_final_and_braces_nest():
    assert parse_reply("The result is \\boxed{1913937}.").answer == "1913937"
    assert parse_reply("so \\boxed{\\frac{1}{2}}").answer == "\\frac{1}{2}"
    assert parse_reply("first \\boxed{1}, then \\boxed{2}").answer == "2"


def test_a_reply_that_calls_the_tool_is_not_final_even_with_a_box():
    reply = parse_reply(format_tool_call("print(4821 * 397)") + "\n\\boxed{1913937}")
    assert reply.calls == ["print(4821 * 397)"] and reply.answer is None


def test_code_that_prints_a_box_is_still_a_call():
    reply = parse_reply(format_tool_call('print("\\\\boxed{5}")'))
    assert reply.calls == ['print("\\\\boxed{5}")'] and reply.answer is None


@pytest.mark.parametrize("text, why", [
    ("<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(1)\"\n</tool_call>", "not valid JSON"),
    ("<tool_call>\n{\"name\": \"python\", \"arguments\": {\"code\": \"print(1)\"}}", "never closed"),
    ('<tool_call>\n{"name": "bash", "arguments": {"code": "ls"}}\n</tool_call>', "no tool 'bash'"),
    ('<tool_call>\n{"name": "python", "arguments": {"cmd": "ls"}}\n</tool_call>', '"code"'),
    ('{"name": "python", "arguments": {"code": "print(1)"', "not valid JSON"),
    ("```python\nprint(1)\n", "never closed"),
    ("```python\n   \n```", "no code"),
    ("the answer is \\boxed{12", "never closed"),
    ("\\boxed{ }", "empty"),
    ("I think it is 1913937.", "neither calls the python tool nor gives a final answer"),
    ("", "neither"),
])
def test_a_malformed_reply_says_what_is_wrong(text, why):
    reply = parse_reply(text)
    assert reply.calls == [] and reply.answer is None and why in reply.error


# ----- judging answers -----

@pytest.mark.parametrize("given, expected", [
    ("1913937", "1913937"), ("1,913,937", "1913937"), ("1913937.0", "1913937"), ("$1913937$", "1913937"),
    ("\\text{1913937}", "1913937"), ("60.35 kilometres", "60.35"), ("60.3456", "60.35"), ("60.345", "60.35"),
    ("-12.5", "-12.50"), ("\u221212.5", "-12.50"), ("\\frac{3}{4}", "0.75"), ("12.5\\%", "12.5"),
    ("2031-7-4", "2031-07-04"),
    ("9:05", "09:05"), ("paris.", "Paris"),
])
def test_answers_match_in_canonical_form(given, expected):
    assert answers_match(given, expected)


@pytest.mark.parametrize("given, expected", [
    ("1913938", "1913937"), ("1913937.4", "1913937"), ("60.36", "60.35"), ("60.3", "60.35"), ("", "5"),
    ("five", "5"), ("2031-07-05", "2031-07-04"), ("09:50", "09:05"), ("1913937 or 1913938", "1913937"),
])
def test_wrong_answers_do_not_match(given, expected):
    assert not answers_match(given, expected)


def test_gsm8k_and_rllm_rows_give_their_answer():
    assert expected_answer("Natalia sold 48/2 = 24 clips in May.\n#### 72") == "72"
    assert task_fields(Task("g", {"problem": "How many?", "ground_truth": 72})) == ("How many?", "72")
    with pytest.raises(EnvError, match="task g has no answer"):
        task_fields(Task("g", {"question": "How many?"}))
    with pytest.raises(EnvError, match="task g has no question"):
        task_fields(Task("g", {"answer": "1"}))


def test_the_tool_reaches_the_model_through_the_chat_templates_own_tool_section(tmp_path):
    # The first observation names the tool; the rollout renders it with tools=, so the model reads
    # the tool section in its own template's words and the system message holds only the instructions.
    first = asyncio.run(_env(tmp_path).reset(TASK))
    assert first.tools == [PYTHON_TOOL] and first.messages[0] == {"role": "system", "content": INSTRUCTIONS}
    rendered = render_chat(first.messages, tools=first.tools, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n" + INSTRUCTIONS + "\n\n# Tools\n")
    assert json.dumps(PYTHON_TOOL["function"], ensure_ascii=False) in rendered


def test_the_environment_loads_by_path_and_takes_the_sandbox_settings_from_the_config(tmp_path):
    cls = env_class(f"{REPO / 'core/clawrl/envs/toolcall.py'}:ToolCallEnv")
    assert cls.__name__ == "ToolCallEnv" and cls.from_config is not None
    env = ToolCallEnv.from_config(compose([f"sandbox.root={tmp_path}", "sandbox.exec_timeout_s=3"]))
    assert env.sandbox_cfg.root == str(tmp_path) and env.cell_timeout_s == 3


# ----- episodes (no sandbox needed: no call is made) -----

def _env(tmp_path, timeout_s: float = 15.0) -> ToolCallEnv:
    return ToolCallEnv(SandboxConfig(backend="bwrap", root=str(tmp_path)), cell_timeout_s=timeout_s)


def test_a_right_answer_earns_plus_one_and_ends_the_episode(tmp_path):
    async def go():
        env = _env(tmp_path)
        first = await env.reset(TASK)
        assert [m["role"] for m in first.messages] == ["system", "user"]
        assert first.messages[1]["content"] == "What is 4821 * 397?"
        out = await env.step("It is \\boxed{1,913,937}.")
        assert (out.reward, out.done, out.observation, out.info["success"]) == (1.0, True, None, True)
        with pytest.raises(EnvError, match="over"):
            await env.step("\\boxed{1}")
        assert env.sandbox is None  # no call, no sandbox
        await env.close()
    asyncio.run(go())


def test_a_wrong_answer_earns_minus_one(tmp_path):
    async def go():
        env = _env(tmp_path)
        await env.reset(TASK)
        out = await env.step("\\boxed{1913938}")
        assert (out.reward, out.done, out.info["success"], out.info["answer"]) == (-1.0, True, False, "1913938")
    asyncio.run(go())


def test_no_answer_before_the_turn_limit_earns_minus_one(tmp_path):
    report = asyncio.run(play(_env(tmp_path), TASK, NOP, max_turns=3))
    assert (report.reward, report.success, report.truncated, report.reason) == (-1.0, False, True, "max_turns")
    malformed = [m for m in report.transcript if m["role"] == "user"][1:]
    assert len(malformed) == 3 and all("malformed" in m["content"] for m in malformed)


def test_a_malformed_reply_is_told_what_was_wrong_and_the_episode_goes_on(tmp_path):
    async def go():
        env = _env(tmp_path)
        await env.reset(TASK)
        out = await env.step('<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>')
        assert out.reward is None and not out.done and out.info["malformed"]
        [message] = out.observation.messages
        assert message["role"] == "user" and "there is no tool 'calculator'" in message["content"]
        final = await env.finish()
        assert (final.reward, final.truncated, final.info["malformed_replies"]) == (-1.0, True, 1)
    asyncio.run(go())


# ----- the interpreter (bubblewrap) -----

def test_state_persists_across_calls_and_earlier_output_is_not_repeated(tmp_path):
    skip_unless_available("bwrap")

    async def go():
        env = _env(tmp_path)
        await env.reset(TASK)
        steps = [
            "```python\nx = 4821\ndef times(a, b):\n    return a * b\nprint('defined')\n```",
            format_tool_call("y = 397\nprint('second')"),
            '{"name": "python", "arguments": {"code": "times(x, y)"}}',
        ]
        outs = [await env.step(s) for s in steps]
        texts = [o.observation.messages[0]["content"] for o in outs]
        assert texts == ["defined", "second", "1913937"]  # replayed cells print nothing again
        assert all(o.observation.messages[0]["role"] == "tool" for o in outs)
        final = await env.step("\\boxed{1913937}")
        assert final.reward == 1.0 and final.info["tool_calls"] == 3 and final.info["tool_errors"] == 0
        await env.close()
    asyncio.run(go())


def test_a_failing_cell_shows_its_traceback_and_leaves_no_state(tmp_path):
    skip_unless_available("bwrap")

    async def go():
        env = _env(tmp_path)
        await env.reset(TASK)
        bad = await env.step(format_tool_call("z = 5\n1 / 0"))
        text = bad.observation.messages[0]["content"]
        assert "ZeroDivisionError" in text and 'File "<cell 1>", line 2' in text
        assert '"<string>"' not in text  # the runner's own frames are not the agent's business
        after = await env.step(format_tool_call("print('z' in globals())"))
        assert after.observation.messages[0]["content"] == "False"
        assert after.info["tool_errors"] == 1
        await env.close()
    asyncio.run(go())


def test_a_cell_past_its_time_limit_is_killed_and_the_interpreter_goes_on(tmp_path):
    skip_unless_available("bwrap")

    async def go():
        env = _env(tmp_path, timeout_s=2)
        await env.reset(TASK)
        await env.step(format_tool_call("kept = 42"))
        slow = await env.step(format_tool_call("print('started')\nwhile True:\n    pass"))
        text = slow.observation.messages[0]["content"]
        assert text.startswith("started") and "ran past its 2 s limit" in text
        after = await env.step(format_tool_call("kept"))
        assert after.observation.messages[0]["content"] == "42"
        await env.close()
        assert not list(tmp_path.iterdir())  # the sandbox's tree is gone
    asyncio.run(go())


def test_a_reply_runs_at_most_four_calls_and_long_output_keeps_its_tail(tmp_path):
    skip_unless_available("bwrap")

    async def go():
        env = _env(tmp_path)
        await env.reset(TASK)
        calls = "\n".join(format_tool_call(f"n = {k}\nprint(n)") for k in range(6))
        out = await env.step(calls)
        texts = [m["content"] for m in out.observation.messages]
        assert texts[:3] == ["0", "1", "2"] and texts[3].startswith("3\n[2 more calls were not run")
        assert out.info["tool_calls"] == 4
        long = await env.step(format_tool_call("for i in range(5000):\n    print(f'line {i}')"))
        text = long.observation.messages[0]["content"]
        assert text.startswith("[... ") and text.endswith("line 4999") and len(text) < 2100
        await env.close()
    asyncio.run(go())


def test_tool_results_render_as_tool_responses_after_the_reply(tmp_path):
    skip_unless_available("bwrap")

    async def go():
        env = _env(tmp_path)
        first = await env.reset(TASK)
        call = format_tool_call("print(4821 * 397)")
        out = await env.step(call)
        await env.close()
        history = first.messages + [{"role": "assistant", "content": call}]
        before = render_chat(history)
        after = render_chat(history + out.observation.messages, add_generation_prompt=True)
        assert after.startswith(before)  # what the rollout appends is a clean suffix
        assert after[len(before):] == ("<|im_start|>user\n<tool_response>\n1913937\n</tool_response><|im_end|>\n"
                                       "<|im_start|>assistant\n")
    asyncio.run(go())


def _sample_of_suite(per_template: int = 2) -> list[Task]:
    by_template = defaultdict(list)
    for split in ("train", "test"):
        for task in read_split(SUITE, split):
            by_template[task.data["template"]].append(task)
    rng = random.Random(0)
    return [t for tasks in by_template.values() for t in rng.sample(tasks, per_template)]


def test_the_oracle_solves_a_sample_of_every_template_and_the_nop_fails_it(tmp_path):
    skip_unless_available("bwrap")
    sample = _sample_of_suite()

    async def one(task: Task):
        oracle = await play(_env(tmp_path), task, ORACLE, max_turns=4)
        nop = await play(_env(tmp_path), task, NOP, max_turns=4)
        return task, oracle, nop

    async def go():
        gate = asyncio.Semaphore(4)

        async def gated(task):
            async with gate:
                return await one(task)
        return await asyncio.gather(*(gated(t) for t in sample))

    for task, oracle, nop in asyncio.run(go()):
        assert (oracle.reward, oracle.success, oracle.turns) == (1.0, True, 2), task.task_id
        # The sandboxed tool itself computed the answer the oracle boxes.
        tool_output = next(m["content"] for m in oracle.transcript if m["role"] == "tool")
        assert answers_match(tool_output, task.data["answer"]), (task.task_id, tool_output)
        assert (nop.reward, nop.success) == (-1.0, False), task.task_id


# ----- in the token loop (the embedded tokenizer, bubblewrap) -----

class ScriptedReplies:
    """An engine that 'samples' fixed replies, tokenised as a model would emit them (ending in
    <|im_end|>), and keeps the prompts it was given."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.prompts = tokenizer, []
        self.replies = [tokenizer(r + "<|im_end|>", add_special_tokens=False)["input_ids"] for r in replies]

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        ids = self.replies[len(self.prompts) - 1]
        return GenerateResult(request_id="r", prompt_ids=list(prompt_ids), token_ids=ids, logprobs=[0.0] * len(ids),
                              weight_versions=[0] * len(ids), finish_reason="stop")


def test_the_special_token_tags_survive_the_rollout_and_the_tool_answers_in_context(tiny_model_dir, tmp_path):
    skip_unless_available("bwrap")
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    call = format_tool_call("print(4821 * 397)")
    assert tok.decode(tok(call, add_special_tokens=False)["input_ids"], skip_special_tokens=True) != call
    engine = ScriptedReplies(tok, ["I will compute it.\n" + call, "The tool says so: \\boxed{1913937}"])
    episode = asyncio.run(run_episode(engine, tok, _env(tmp_path), TASK, SamplingParams(max_new_tokens=64), 4))
    assert (episode.reward, episode.turns, episode.done, episode.truncated) == (1.0, 2, True, False)
    assert episode.info["tool_calls"] == 1 and episode.info["tool_errors"] == 0
    # the second prompt is the first, the sampled call, and the tool's answer rendered as Qwen does
    second = engine.prompts[1]
    assert second[:len(engine.prompts[0])] == engine.prompts[0]
    assert second[len(engine.prompts[0]):][:len(engine.replies[0])] == engine.replies[0]
    assert tok.decode(second[len(engine.prompts[0]) + len(engine.replies[0]):]) == (
        "\n<|im_start|>user\n<tool_response>\n1913937\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
