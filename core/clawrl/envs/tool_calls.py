"""Reading a model's reply as tool calls or a final answer.

A reply of a tool-using agent does one of two things: it calls a tool, or it answers. Calls come in
the format the chat template teaches, Qwen/Hermes style (``clawrl.embedded.tokenizer``)::

    <tool_call>
    {"name": "python", "arguments": {"code": "print(2**100)"}}
    </tool_call>

Three spellings are accepted, because all three reach an environment in practice:

- the tagged call above;
- the same JSON object without its tags: ``<tool_call>`` is a special token, and text decoded with
  ``skip_special_tokens=True`` arrives without it (``clawrl.envs.rollout`` keeps it; other callers
  and serving stacks may not);
- a fenced ```` ```python ```` block, which models trained on notebooks and chat write unasked.

A final answer is the last ``\\boxed{...}`` outside any call (braces may nest: ``\\boxed{\\frac{1}{2}}``).
A reply that calls a tool is not final even if it also boxes something: it has not seen the
result yet (ReTool stops generation at the call, so nothing after it would exist).

Anything half-written (a call whose JSON does not parse, an unclosed tag, fence or box, an unknown
tool) makes the reply malformed, with a one-line reason the agent is shown.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

from clawrl.engines.chat_template import tool_call_text

TOOL_NAME = "python"
_TAGGED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN_TAG = "<tool_call>"
_BARE = re.compile(r"\{\s*\"name\"\s*:")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n", re.IGNORECASE)
_BOXED = "\\boxed{"


@dataclass(frozen=True)
class Reply:
    """What one reply asks for: ``calls`` (the code of each python call, in order), else a final
    ``answer`` (the content of the last box), or an ``error`` saying why it is neither."""

    calls: list[str] = field(default_factory=list)
    answer: Optional[str] = None
    error: Optional[str] = None


def format_tool_call(code: str) -> str:
    """A python call exactly as the chat template renders an assistant's ``tool_calls``."""
    return tool_call_text(TOOL_NAME, {"code": code})


def parse_reply(reply: str) -> Reply:
    """Read ``reply`` (see the module docstring)."""
    spans: list[tuple[int, int, str]] = []  # (start, end, code) of each call
    masked = reply  # the reply with every call blanked out, so later searches skip them
    for m in _TAGGED.finditer(reply):
        code, error = _call_code(m.group(1).strip(), tagged=True)
        if error:
            return Reply(error=error)
        spans.append((m.start(), m.end(), code))
        masked = _blank(masked, m.start(), m.end())
    if _OPEN_TAG in masked:
        return Reply(error="a <tool_call> tag is never closed with </tool_call>")
    for m in _FENCE.finditer(masked):
        spans.append((m.start(), m.end(), m.group(1)))
        masked = _blank(masked, m.start(), m.end())
    if _OPEN_FENCE.search(masked):
        return Reply(error="a ```python block is never closed with ```")
    for m in _BARE.finditer(masked):
        if masked[m.start()] != "{":  # blanked by an earlier bare call
            continue
        try:
            obj, end = json.JSONDecoder().raw_decode(masked, m.start())
        except ValueError as e:
            return Reply(error=f"the tool call is not valid JSON ({e})")
        code, error = _call_code(obj, tagged=False)
        if error:
            return Reply(error=error)
        spans.append((m.start(), end, code))
        masked = _blank(masked, m.start(), end)
    calls = [code for _, _, code in sorted(spans)]
    if any(not code.strip() for code in calls):
        return Reply(error="a python call has no code")
    if calls:
        return Reply(calls=calls)
    answer, error = last_boxed(masked)
    if error:
        return Reply(error=error)
    if answer is None:
        return Reply(error="the reply neither calls the python tool nor gives a final answer in \\boxed{}")
    if not answer.strip():
        return Reply(error="the \\boxed{} answer is empty")
    return Reply(answer=answer.strip())


def last_boxed(text: str) -> tuple[Optional[str], Optional[str]]:
    """(content of the last ``\\boxed{...}``, None), (None, None) without one, or (None, reason)
    when the last box is never closed."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None, None
    depth, i = 1, start + len(_BOXED)
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOXED):i], None
        i += 1
    return None, "the \\boxed{ answer is never closed with }"


def _blank(text: str, start: int, end: int) -> str:
    return text[:start] + " " * (end - start) + text[end:]


def _call_code(call, tagged: bool) -> tuple[str, Optional[str]]:
    """(code, None) for a well-formed python call (a JSON string inside tags, or a parsed object),
    else ("", what is wrong with it)."""
    if tagged:
        try:
            call = json.loads(call)
        except ValueError as e:
            return "", f"the text inside <tool_call> is not valid JSON ({e})"
    if not isinstance(call, dict) or "name" not in call:
        return "", 'a tool call is a JSON object {"name": "python", "arguments": {"code": "..."}}'
    if call["name"] != TOOL_NAME:
        return "", f"there is no tool {call['name']!r}; the only tool is {TOOL_NAME!r}"
    args = call.get("arguments", call.get("parameters"))
    if isinstance(args, str):  # OpenAI's wire format sends the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError as e:
            return "", f"the call's arguments are not valid JSON ({e})"
    if not isinstance(args, dict) or not isinstance(args.get("code"), str):
        return "", 'the python call needs "arguments": {"code": "<python source>"}'
    return args["code"], None
