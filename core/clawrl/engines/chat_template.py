"""The model's chat template, rendered the same way by every caller, with a tool prompt where it has none.

Some chat templates ignore ``tools`` (SmolLM2's renders the same prompt with or without them), so
the model would never see the tools it is offered. Once per tokenizer (and template), a probe
conversation is rendered with a probe tool: when the tool's name is not in the prompt, the
template drops tools, and clawrl renders them itself in the Hermes/Qwen2.5 format that the
gateway's parser reads back (``clawrl.gateway.toolcalls``)::

    # Tools ... <tools>
    {"type": "function", "function": {...}}
    </tools> ... <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

That tool prompt ends the first system message (one is prepended if there is none); an assistant
message's ``tool_calls`` become ``<tool_call>`` blocks after its content, and a run of ``tool``
messages becomes one user message of ``<tool_response>`` blocks, since such a template reads only
``content``. The gateway, the agent loop, the OPD teacher, the judges and ``clawrl chat`` all
render through ``render_chat``, so a stored turn re-renders to the ids it was served with.
"""
from __future__ import annotations

import json
import logging
import threading
import weakref

log = logging.getLogger(__name__)

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
_PROBE_NAME = "clawrl_probe_tool"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
_PROBE_MESSAGES = [{"role": "user", "content": "probe"}]
_probed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> (template, renders tools)
_probe_lock = threading.Lock()


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template puts ``tools`` in the prompt (probed once per template;
    the first probe that finds it drops them logs one line)."""
    template = str(tokenizer.chat_template)
    with _probe_lock:
        known = _probed.get(tokenizer)
        if known is None or known[0] != template:
            known = (template, _probe(tokenizer))
            _probed[tokenizer] = known
    return known[1]


def _probe(tokenizer) -> bool:
    try:
        prompt = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=[_PROBE_TOOL], add_generation_prompt=True,
                                               tokenize=False)
    except Exception as e:  # a template that refuses tools cannot render them either
        why = f"raises when given tools ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    else:
        if _PROBE_NAME in prompt:
            return True
        why = "leaves a probe tool out of the prompt"
    log.info("the chat template of %s %s: clawrl injects a Hermes-style tool prompt (tools as JSON in <tools>, "
             "calls as <tool_call> JSON) and renders tool calls and results as text",
             getattr(tokenizer, "name_or_path", "") or "the model", why)
    return False


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages`` (and ``tools``), as the model is served it."""
    if not renders_tools(tokenizer):
        messages, tools = with_tool_prompt(messages, tools), None
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)


def tool_prompt(tools: list[dict]) -> str:
    """Qwen2.5's tool section: the tools as JSON lines in ``<tools>`` and how to call one."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{TOOL_OPEN}{TOOL_CLOSE} XML tags:\n{TOOL_OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + TOOL_CLOSE)


def tool_call_text(name: str, arguments) -> str:
    """One call as the model writes it; ``arguments`` a dict or JSON text (OpenAI's wire format)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # not JSON: shown as the string it is
    return f"{TOOL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{TOOL_CLOSE}"


def with_tool_prompt(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` for a template that reads only roles and content (module docstring)."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            response = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if i and messages[i - 1].get("role") == "tool":  # one user turn answers all the calls
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            fns = [c.get("function") or c for c in m["tool_calls"]]  # OpenAI's shape, or the store's flat one
            calls = [tool_call_text(fn["name"], fn.get("arguments", {})) for fn in fns]
            content = _text(m.get("content"))
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        else:
            out.append(m)
    if not tools:
        return out
    if out and out[0].get("role") == "system":
        return [{**out[0], "content": f"{_text(out[0].get('content'))}\n\n{tool_prompt(tools)}"}, *out[1:]]
    return [{"role": "system", "content": tool_prompt(tools)}, *out]


def _text(content) -> str:
    """A message's content as text: a string, or the text of its content parts."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""
