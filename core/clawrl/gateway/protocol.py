"""The OpenAI chat-completions request, validated by hand, and OpenAI's error JSON.

Validation is explicit rather than a pydantic model because the errors are part of the API: a
client that sends a parameter we do not implement must hear *which* one (``param``), not get a
silently different behaviour. So every key of the body is either implemented, accepted only at
its neutral value (clients that always send ``presence_penalty: 0``), or refused by name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from clawrl.gateway import json_limits
from clawrl.gateway.json_limits import UnsafeJson


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# Implemented parameters. ``session_id`` is clawrl's own (read by ``SessionHints``; the
# X-Session-Id header wins over it). ``top_k`` is the common extension (vLLM, SGLang).
# ``store`` is accepted for client compatibility only: clawrl stores every turn, its purpose.
SUPPORTED = {
    "model", "messages", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "stop",
    "n", "seed", "tools", "tool_choice", "logprobs", "top_logprobs", "stream", "stream_options",
    "user", "session_id", "parallel_tool_calls", "store",
}
# Accepted only at the value that changes nothing; any other value is refused by name.
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0}
CONTENT_PART_UNSUPPORTED = {"image_url": "image", "input_audio": "audio", "file": "file"}
ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_N = 16
MAX_STOP = 4
# Every integer the engine puts in an int64 tensor stays inside it: choice i samples with seed + i
# (so seed < 2**63 - n), and a top_k or max_tokens past any vocabulary or context means "no limit".
INT64_MAX = 2**63 - 1
MAX_TOKENS = 2**31 - 1


@dataclass
class ToolChoice:
    """``mode`` is auto | none | required | function (then ``name`` is the forced function)."""

    mode: str = "auto"
    name: str | None = None


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]  # normalised: string content, developer -> system, parsed tool-call arguments
    temperature: float | None = None  # None (not sent): the model's default (``Gateway.sampling``)
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    tools: list[dict] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    user: str | None = None


def unsafe_json_error(e: UnsafeJson) -> ApiError:
    return bad_request(str(e), param=e.path or None, code=e.code)


def parse_json_body(raw: bytes) -> dict:
    """The body as a JSON object, nested at most ``json_limits.MAX_DEPTH`` deep and with valid
    unicode text only, so nothing after this point meets a RecursionError or unencodable text."""
    try:
        body = json_limits.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    except UnsafeJson as e:
        raise unsafe_json_error(e) from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad_request(f"'{key}' must be a number between {lo} and {hi}", param=key)
    return float(v)


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise bad_request(f"'{key}' must be an integer {rng}", param=key)
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean", param=key)
    return v


def _str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"'{key}' must be a string", param=key)
    return v


def _text_content(content: Any, param: str, allow_none: bool = False) -> str | None:
    """A message's content as one string: text parts joined by newlines; other parts refused."""
    if content is None:
        if allow_none:
            return None
        raise bad_request(f"'{param}' is required", param=param)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or a list of content parts", param=param)
    texts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind in CONTENT_PART_UNSUPPORTED:  # a list "type" is not hashable
            raise bad_request(
                f"{CONTENT_PART_UNSUPPORTED[kind]} content parts ('{kind}') are not supported: this model reads text only",
                param=p, code="unsupported_content",
            )
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"'{p}' must be a text part {{'type': 'text', 'text': ...}}", param=p)
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, param: str) -> list[dict]:
    if not isinstance(calls, list) or not calls:
        raise bad_request(f"'{param}' must be a non-empty list", param=param)
    out = []
    for k, call in enumerate(calls):
        p = f"{param}[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"'{p}' must have function.name", param=p)
        args = fn.get("arguments", "{}")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise bad_request(f"'{p}.id' must be a string", param=f"{p}.id")
        if not isinstance(args, str):  # OpenAI sends (and requires) JSON text, never an object
            raise bad_request(f"'{p}.function.arguments' must be a string of JSON text",
                              param=f"{p}.function.arguments")
        try:  # chat templates render a dict as JSON; keep the string if it is not JSON
            args = json_limits.loads(args, f"{p}.function.arguments") if args.strip() else {}
        except json.JSONDecodeError:
            pass
        except UnsafeJson as e:
            raise unsafe_json_error(e) from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _tool_result(m: dict, p: str, answerable: set | None) -> dict:
    """A ``tool`` message, which must answer a call of the assistant message just before it (or
    before the run of tool messages it belongs to), as OpenAI requires: a result for no call, or
    for a call that was never made, has no place in the prompt and no meaning in a session."""
    if answerable is None:
        raise bad_request(f"'{p}' has role 'tool' but does not follow an assistant message with 'tool_calls'",
                          param=f"{p}.role")
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"'{p}.tool_call_id' is required (a string naming the call it answers)",
                          param=f"{p}.tool_call_id")
    if call_id not in answerable:
        raise bad_request(f"'{p}.tool_call_id' '{call_id}' matches none of the 'tool_calls' of the preceding "
                          "assistant message", param=f"{p}.tool_call_id")
    return {"role": "tool", "content": _text_content(m.get("content"), f"{p}.content"), "tool_call_id": call_id}


def _messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out = []
    answerable: set | None = None  # ids of the tool calls the next tool message may answer
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{p}' must be an object", param=p)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list role is not hashable
            raise bad_request(f"'{p}.role' must be one of {sorted(ROLES)}", param=f"{p}.role")
        if role == "assistant":
            msg = {"role": "assistant", "content": _text_content(m.get("content"), f"{p}.content", allow_none=True)}
            answerable = None
            if m.get("tool_calls"):
                msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{p}.tool_calls")
                answerable = {c["id"] for c in msg["tool_calls"] if isinstance(c["id"], str)}
            elif msg["content"] is None:
                raise bad_request(f"'{p}' needs content or tool_calls", param=f"{p}.content")
        elif role == "tool":
            msg = _tool_result(m, p, answerable)
        else:  # developer is OpenAI's newer name for system; chat templates know only system
            answerable = None
            msg = {"role": "system" if role == "developer" else role,
                   "content": _text_content(m.get("content"), f"{p}.content")}
        out.append(msg)
    return out


def _tools(raw: Any) -> list[dict] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list", param="tools")
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise bad_request(f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name': ...}}}}",
                              param=f"tools[{i}]")
    return raw or None


def _tool_choice(raw: Any, tools: list[dict] | None) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto")
    if raw in ("auto", "none", "required"):
        choice = ToolChoice(raw)
    elif isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("function"), dict) \
            and isinstance(raw["function"].get("name"), str):
        choice = ToolChoice("function", raw["function"]["name"])
    else:
        raise bad_request("'tool_choice' must be auto, none, required or {'type': 'function', ...}",
                          param="tool_choice")
    names = {t["function"]["name"] for t in tools or ()}
    if choice.mode in ("required", "function") and not tools:
        raise bad_request(f"tool_choice '{choice.mode}' needs 'tools'", param="tool_choice")
    if choice.mode == "function" and choice.name not in names:
        raise bad_request(f"tool_choice names '{choice.name}', which is not in 'tools'", param="tool_choice")
    return choice


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise bad_request(f"'stop' must be a non-empty string or a list of up to {MAX_STOP} of them", param="stop")
    return tuple(stops)


def parse_chat_request(body: dict) -> ChatRequest:
    """Validate a chat-completions body; raises ``ApiError`` (400) naming the offending ``param``.
    A sampling field left out stays None: the gateway fills in the model's defaults."""
    for key, value in body.items():
        if key in SUPPORTED:
            continue
        if key in NEUTRAL and (value is None or value == NEUTRAL[key]):
            continue
        raise bad_request(f"parameter '{key}' is not supported by this server", param=key,
                          code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required", param="model")
    messages = _messages(body.get("messages"))
    max_tokens = _int(body, "max_tokens", 1, MAX_TOKENS)  # checked even where the newer name wins
    max_tokens = _int(body, "max_completion_tokens", 1, MAX_TOKENS) or max_tokens
    n = _int(body, "n", 1, MAX_N) or 1
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _int(body, "top_logprobs", 0, 20) or 0
    if top_logprobs and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise bad_request("'stream_options' supports only include_usage", param="stream_options")
    if opts is not None and not stream:
        raise bad_request("'stream_options' needs 'stream': true", param="stream_options")
    tools = _tools(body.get("tools"))
    _bool(body, "store", False)
    return ChatRequest(
        model=model,
        messages=messages,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 1e-6, 1.0),
        top_k=_int(body, "top_k", 0, MAX_TOKENS),
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        n=n,
        seed=_int(body, "seed", 0, INT64_MAX + 1 - n),  # the last choice samples with seed + n - 1
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stream=stream,
        include_usage=bool(opts and _bool(opts, "include_usage", False)),
        user=_str(body, "user"),
    )
