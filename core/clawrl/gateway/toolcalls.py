"""Hermes-style tool calls in model output: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The extractor works on a text stream so that streaming and non-streaming responses share one
parser: text outside tool-call blocks is content; a complete block with valid JSON naming a known
tool becomes a ``ToolCall``; anything else (bad JSON, unknown tool, a block cut off by
``max_tokens``) goes back to the client as plain content, and the reason is kept in ``errors`` so
it is stored with the turn (a trainer can learn from malformed calls only if it sees them).
"""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass

from clawrl.engines.chat_template import TOOL_CLOSE, TOOL_OPEN
from clawrl.gateway import json_limits

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def held_suffix_len(text: str, markers) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a marker.

    That much must be held back while streaming: the next tokens may complete the marker.
    """
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends function.arguments

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Content:
    text: str


def parse_call(body: str, tool_names: set[str]) -> ToolCall:
    """Parse the inside of one ``<tool_call>`` block; ``ValueError`` says why it is malformed.

    The model's text is valid unicode, but it may *write* an escape such as ``\\ud800`` or nest
    without end: ``json_limits`` refuses such a call with its ``UnsafeJson`` (a ``ValueError``), so
    it is malformed like any other, not a crash when the turn is stored.
    """
    try:
        obj = json_limits.loads(body, "tool_call")
    except json.JSONDecodeError as e:
        raise ValueError(f"tool call is not valid JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("tool call JSON has no string 'name'")
    if obj["name"] not in tool_names:
        raise ValueError(f"tool call names unknown tool '{obj['name']}'")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json_limits.loads(args, "tool_call.arguments")
        except json.JSONDecodeError:
            raise ValueError("tool call 'arguments' is a string that is not JSON") from None
    if not isinstance(args, dict):
        raise ValueError("tool call 'arguments' is not a JSON object")
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallExtractor:
    """Split streamed text into ``Content`` and ``ToolCall`` events.

    ``tool_names`` empty disables parsing (no tools offered, or tool_choice "none"): then every
    byte is content. ``single`` keeps only the first call (``parallel_tool_calls: false``).
    """

    def __init__(self, tool_names: set[str], single: bool = False):
        self.tool_names = tool_names
        self.single = single
        self.calls: list[ToolCall] = []
        self.errors: list[str] = []
        self._buf = ""  # text not yet emitted
        self._in_call = False
        self._after_call = False  # whitespace between/after calls is not content

    def feed(self, text: str) -> list[Content | ToolCall]:
        if not self.tool_names:
            return [Content(text)] if text else []
        self._buf += text
        events: list[Content | ToolCall] = []
        while True:
            if self._in_call:
                end = self._buf.find(TOOL_CLOSE)
                if end < 0:
                    return events
                block = self._buf[: end + len(TOOL_CLOSE)]
                self._buf = self._buf[end + len(TOOL_CLOSE):]
                self._in_call = False
                events += self._close_block(block)
                continue
            start = self._buf.find(TOOL_OPEN)
            if start >= 0:
                events += self._content(self._buf[:start])
                self._buf = self._buf[start:]
                self._in_call = True
                continue
            cut = len(self._buf) - held_suffix_len(self._buf, (TOOL_OPEN,))
            if self._after_call and not self._buf[:cut].strip():
                return events  # whitespace after a call: content only if more text follows
            events += self._content(self._buf[:cut])
            self._buf = self._buf[cut:]
            return events

    def finish(self) -> list[Content | ToolCall]:
        """End of output: an unterminated block is malformed and becomes content."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            self.errors.append("tool call not terminated by </tool_call> before the output ended")
            return [Content(rest)]
        return self._content(rest)

    def _close_block(self, block: str) -> list[Content | ToolCall]:
        body = block[len(TOOL_OPEN): -len(TOOL_CLOSE)]
        try:
            call = parse_call(body, self.tool_names)
        except ValueError as e:
            self.errors.append(str(e))
            self._after_call = False
            return [Content(block)]
        self._after_call = True
        if self.single and self.calls:
            self.errors.append("extra tool call dropped: parallel_tool_calls is false")
            return []
        self.calls.append(call)
        return [call]

    def _content(self, text: str) -> list[Content]:
        if not text or (self._after_call and not text.strip()):
            return []  # whitespace between or after tool calls is layout, not content
        self._after_call = False
        return [Content(text)]
