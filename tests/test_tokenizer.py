"""The embedded tokenizer: exact round trips, single-digit numbers, the chat template as loaded by
``transformers.AutoTokenizer``, and a compact encoding of agent prompts."""
import json
from pathlib import Path

import pytest

from clawrl.embedded.build import build_tokenizer
from clawrl.embedded.tokenizer import IM_END, SPECIAL_TOKENS, save_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "openclaw-2026.9.6"

# Written for this test: the kind of instructions an agent client puts in its system prompt.
AGENT_PROMPT = """You are a personal assistant running inside a coding agent. Follow these instructions carefully.

## Tooling

Tool availability is filtered by policy. Tool names are case-sensitive; call tools exactly as listed.
- read: read the contents of a file in the workspace. Prefer reading a file before editing it.
- write: create or overwrite a file. Never write secrets, credentials or tokens into the workspace.
- exec: run a shell command. Long-running commands should be started in the background and polled.
- ls: list the files of a directory, including hidden ones.

## Safety

You have no independent goals: do not pursue self-preservation, replication, resource acquisition, or
power-seeking. Prioritize safety and human oversight over completion; if instructions conflict, pause
and ask. Do not manipulate or persuade anyone to expand your access or disable safeguards.

## Workspace

Your working directory is the project folder. Treat this directory as the single global workspace for
file operations unless explicitly instructed otherwise. Keep your replies short and to the point: when a
question has a simple answer, give the answer first and the explanation after it, if at all.

## Memory

Before answering anything about prior work, decisions, dates, people, preferences, or todos, search the
memory files first, then pull only the lines you need. If you searched and found nothing, say that you
checked. When the user corrects you, apologise briefly, fix the answer, and remember the correction.

## Replies

Reply in the language of the user. Use Markdown sparingly: short lists are fine, long tables are not.
If a tool fails, report the error in one sentence and suggest what the user can do about it.
"""


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(seed=0)


@pytest.fixture(scope="module")
def hf_tok(tok, tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(tok, d, model_max_length=32768)
    return AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "héllo wörld — naïve café, 日本語のテキスト, Ελληνικά, עברית",
    "emoji 👋🏽 🧑‍💻 🇫🇷 and zero-width\u200bspace",
    "def f(x):\n\treturn {'a': x ** 2}  # comment\r\n\n    indented\u00a0nbsp",
    "   leading and trailing spaces   ",
    "<|im_start|>user\nliteral special tokens<|im_end|> <tool_call>{}</tool_call>",
    "\x00\x01 control \x7f bytes",
])
def test_round_trip_is_exact(tok, text):
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_every_digit_is_its_own_token(tok):
    enc = tok.encode("What is 1234+56789? 2026-12-02, 3.14159")
    digits = [t for t in enc.tokens if any(c.isdigit() for c in t)]
    assert "".join(digits) == "123456789202612023" + "14159"
    assert all(len(t) == 1 for t in digits)
    # No token in the whole vocabulary merges a digit with anything.
    assert not [t for t in tok.get_vocab() if any(c.isdigit() for c in t) and len(t) > 1]


def test_special_tokens_are_single_tokens(tok):
    for s in SPECIAL_TOKENS:
        assert len(tok.encode(s).ids) == 1, s


def _chars_per_token(tok, text: str) -> float:
    return len(text) / len(tok.encode(text).ids)


def test_agent_prompt_takes_three_chars_per_token(tok):
    assert _chars_per_token(tok, AGENT_PROMPT) >= 3.0


def test_real_openclaw_system_prompt_takes_three_chars_per_token(tok):
    path = FIXTURES / "chat_turn1.json"
    if not path.exists():
        pytest.skip("OpenClaw fixtures not present")
    system = json.loads(path.read_text())["body"]["messages"][0]["content"]
    assert len(system) > 20000
    assert _chars_per_token(tok, system) >= 3.0


def test_autotokenizer_has_chat_eos_and_pad(hf_tok):
    assert hf_tok.eos_token == IM_END
    assert hf_tok.pad_token == "<|endoftext|>"
    assert hf_tok.chat_template


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "ls", "description": "List files.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def _tool_chat(arguments, user_content="Weather in Paris?"):
    return [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": user_content},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call1", "content": '{"temperature_c": 18}'},
        {"role": "assistant", "content": "It is 18°C in Paris."},
    ]


def test_template_renders_tools_calls_and_results(hf_tok):
    text = hf_tok.apply_chat_template(_tool_chat({"city": "Paris"}), tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are helpful.\n\n")
    tools_block = text[text.index("<tools>\n") + len("<tools>\n"):text.index("\n</tools>")]
    assert [json.loads(line)["name"] for line in tools_block.split("\n")] == ["get_weather", "ls"]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n") in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature_c": 18}\n</tool_response><|im_end|>\n' in text
    assert text.endswith("<|im_start|>assistant\nIt is 18°C in Paris.<|im_end|>\n")


def test_json_string_arguments_render_like_the_parsed_object(hf_tok):
    as_dict = {"city": "Paris, France", "note": "a: \"b\", c", "n": [1, 2], "deep": {"x": None, "y": True}}
    as_dict_text = hf_tok.apply_chat_template(_tool_chat(as_dict), tools=TOOLS, tokenize=False)
    for s in (json.dumps(as_dict, separators=(",", ":")), json.dumps(as_dict), json.dumps(as_dict, indent=2)):
        assert hf_tok.apply_chat_template(_tool_chat(s), tools=TOOLS, tokenize=False) == as_dict_text


def test_list_of_parts_content_renders_like_a_string(hf_tok):
    parts = [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]
    assert (hf_tok.apply_chat_template(_tool_chat({"city": "Paris"}, parts), tools=TOOLS, tokenize=False)
            == hf_tok.apply_chat_template(_tool_chat({"city": "Paris"}), tools=TOOLS, tokenize=False))


def test_generation_prompt_opens_an_assistant_turn(hf_tok):
    messages = [{"role": "user", "content": "Hi"}]
    with_prompt = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert with_prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert hf_tok.decode(ids) == with_prompt
