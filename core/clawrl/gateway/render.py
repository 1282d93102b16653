"""Chat messages -> prompt token ids, with tool_choice and optional history truncation.

The model's own chat template renders the prompt (``clawrl.engines.chat_template.render_chat``), so the
gateway never guesses a format; a template that drops ``tools`` gets clawrl's Hermes-style tool prompt. ``tool_choice`` is honoured by prompting, not by constrained decoding:

- ``none``: the tools are not rendered at all, and output is not parsed for tool calls;
- ``auto``: tools rendered, the model decides;
- ``required``: the assistant turn is prefilled with ``<tool_call>\\n{"name": "`` so the model's
  first tokens must complete a call to some tool;
- a named function: the prefill also carries the name, ``<tool_call>\\n{"name": "get_weather``.

The prefill is part of the prompt ids (the model did not sample it; the trainer must not train on
it), and the response parser starts from it so the client sees a complete tool call.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from clawrl.engines.chat_template import TOOL_OPEN, render_chat
from clawrl.gateway.protocol import ApiError, ChatRequest, bad_request

log = logging.getLogger(__name__)


@dataclass
class RenderedPrompt:
    ids: list[int]
    prefill: str  # assistant text placed in the prompt (forced tool calls)
    tool_names: set[str]  # tools the output may call; empty: output is plain content
    dropped_messages: int  # messages removed by truncate_history


def tool_prefill(req: ChatRequest) -> str:
    if req.tool_choice.mode == "required":
        return TOOL_OPEN + '\n{"name": "'
    if req.tool_choice.mode == "function":
        return TOOL_OPEN + '\n{"name": "' + req.tool_choice.name
    return ""


def _encode(tokenizer, messages: list[dict], tools: list[dict] | None, prefill: str) -> list[int]:
    try:
        text = render_chat(tokenizer, messages, tools)
    except Exception as e:  # a template's raise_exception() (e.g. "roles must alternate") is the client's error
        raise bad_request(f"the model's chat template rejected these messages: {str(e).splitlines()[0]}",
                          param="messages") from None
    return tokenizer.encode(text + prefill, add_special_tokens=False)


def _units(messages: list[dict]) -> list[tuple[int, int]]:
    """[start, end) spans that truncation keeps or drops whole: an assistant message that calls
    tools together with the tool results answering it; every other message alone."""
    spans, i = [], 0
    while i < len(messages):
        j = i + 1
        if messages[i]["role"] == "assistant" and messages[i].get("tool_calls"):
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
        spans.append((i, j))
        i = j
    return spans


def context_error(prompt_tokens: int, max_context: int) -> ApiError:
    return bad_request(
        f"This model's maximum context length is {max_context} tokens, but the messages take {prompt_tokens} "
        "tokens (set server.truncate_history=true to drop the oldest turns instead)",
        param="messages", code="context_length_exceeded",
    )


def render_prompt(tokenizer, req: ChatRequest, max_context: int, truncate: bool) -> RenderedPrompt:
    """Render ``req`` for the model; the prompt leaves room for at least one generated token.

    Over-long: 400 ``context_length_exceeded``, or with ``truncate`` the leading system messages
    plus the latest turns that fit, cut only where a user message starts (so an assistant's tool
    call is never separated from its results).
    """
    tools = req.tools if req.tool_choice.mode != "none" else None
    names = {t["function"]["name"] for t in tools or ()}
    prefill = tool_prefill(req)
    msgs = req.messages
    ids = _encode(tokenizer, msgs, tools, prefill)
    if len(ids) < max_context:
        return RenderedPrompt(ids, prefill, names, 0)
    if not truncate:
        raise context_error(len(ids), max_context)

    n_sys = next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))
    system, rest = msgs[:n_sys], msgs[n_sys:]
    # Candidate cut points: starts of user messages (a turn), latest last; keep at least the last one.
    cuts = [s for s, _ in _units(rest) if rest[s]["role"] == "user"] or [s for s, _ in _units(rest)]
    lo, hi, best = 0, len(cuts) - 1, None  # binary search for the earliest cut that fits
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = _encode(tokenizer, system + rest[cuts[mid]:], tools, prefill)
        if len(cand) < max_context:
            best, hi = (cuts[mid], cand), mid - 1
        else:
            lo = mid + 1
    if best is None:
        shortest = _encode(tokenizer, system + rest[cuts[-1]:], tools, prefill)
        raise context_error(len(shortest), max_context)
    cut, ids = best
    log.info("truncate_history: dropped the %d oldest message(s) to fit %d of %d context tokens",
             cut, len(ids), max_context)
    return RenderedPrompt(ids, prefill, names, cut)
