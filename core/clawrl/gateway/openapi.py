"""The gateway's OpenAPI document: request and response schemas for routes that read raw bodies.

Why this module exists: the chat route reads its body by hand (``protocol.parse_chat_request``),
because its errors are part of the API (OpenAI's ``{"error": {...}}`` naming the ``param``), which
a pydantic body model would turn into FastAPI's 422s. FastAPI therefore sees no body and
``/openapi.json`` would describe none, so schema-driven tools (schemathesis, client generators)
could not test or call the routes. The schemas here are attached with ``openapi_extra`` and only
*describe* what ``protocol`` accepts: nothing is parsed or validated with them, ``protocol`` stays
the one source of truth, and ``tests/test_gateway_fuzz.py`` holds the two to each other (every
body generated from these schemas is answered 200 or a 4xx, never a 5xx).

What JSON Schema cannot say is written in descriptions: a ``tool`` message must answer a call of
the assistant message before it, ``top_logprobs`` needs ``logprobs``, ``stream_options`` needs
``stream``, a forced ``tool_choice`` needs ``tools``. Every error any route answers has the same
shape (``ERROR``), documented as each operation's ``default`` response; FastAPI's 422 is removed,
as the gateway answers validation errors with 400 in that shape.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from clawrl.gateway.protocol import INT64_MAX, MAX_N, MAX_STOP, MAX_TOKENS, NEUTRAL, ROLES

_REF = "#/components/schemas/"


def _ref(name: str) -> dict:
    return {"$ref": _REF + name}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


ERROR = {
    "type": "object",
    "description": "OpenAI's error format; every 4xx and 5xx of this server has it.",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "additionalProperties": False,
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string", "description": "invalid_request_error, rate_limit_error, server_error, ..."},
            "param": {"type": ["string", "null"], "description": "the request field at fault, if any"},
            "code": {"type": ["string", "null"], "description": "a stable machine-readable reason"},
        },
    }},
}

TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
CONTENT = {
    "description": "A string, or text parts joined by newlines (image, audio and file parts are refused: "
                   "the model reads text only).",
    "anyOf": [{"type": "string"}, {"type": "array", "items": _ref("TextPart")}],
}
TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": ["string", "null"]},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "arguments": {"type": "string", "description": "JSON text (never an object), as OpenAI sends it"},
            },
        },
    },
}
_TOOL_CALLS = {"type": "array", "minItems": 1, "items": _ref("ToolCall")}
MESSAGE = {
    "description": "One message. A 'tool' message must answer (by tool_call_id) a call of the assistant "
                   "message just before it or its run of tool messages; 'developer' is treated as 'system'.",
    "oneOf": [
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {"role": {"enum": sorted(ROLES - {"assistant", "tool"})}, "content": _ref("Content"),
                           "name": {"type": "string"}},
        },
        {
            "type": "object",
            "required": ["role"],
            "description": "Needs content, or a non-empty tool_calls.",
            "properties": {"role": {"const": "assistant"}, "content": _nullable(_ref("Content")),
                           "tool_calls": _TOOL_CALLS, "name": {"type": "string"}},
            "anyOf": [{"required": ["content"], "properties": {"content": _ref("Content")}},
                      {"required": ["tool_calls"]}],
        },
        {
            "type": "object",
            "required": ["role", "content", "tool_call_id"],
            "properties": {"role": {"const": "tool"}, "content": _ref("Content"),
                           "tool_call_id": {"type": "string", "minLength": 1}},
        },
    ],
}
TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                           "parameters": {"type": "object", "description": "a JSON schema of the arguments"}},
        },
    },
}
_NAMED_FUNCTION = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {"type": {"const": "function"},
                   "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}},
}


def _number(lo: float, hi: float) -> dict:
    return {"type": ["number", "null"], "minimum": lo, "maximum": hi}


def _integer(lo: int, hi: int | None = None) -> dict:
    out: dict[str, Any] = {"type": ["integer", "null"], "minimum": lo}
    if hi is not None:
        out["maximum"] = hi
    return out


_BOOL = {"type": ["boolean", "null"]}
_STRING = {"type": ["string", "null"]}

CHAT_REQUEST = {
    "type": "object",
    "description": "OpenAI's chat-completions request. Keys not listed are refused by name (400 "
                   "unsupported_parameter). Null means the default for every optional key.",
    "required": ["model", "messages"],
    "additionalProperties": False,
    "properties": {
        "model": {"type": "string", "minLength": 1, "description": "must name the served model (else 404)"},
        "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
        "temperature": _number(0.0, 2.0),
        "top_p": _number(1e-6, 1.0),
        "top_k": _integer(0, MAX_TOKENS),
        "max_tokens": _integer(1, MAX_TOKENS),
        "max_completion_tokens": _integer(1, MAX_TOKENS),
        "stop": {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1}},
                           {"type": "null"}]},
        "n": _integer(1, MAX_N),
        "seed": {**_integer(0, INT64_MAX - 1), "description": "below 2**63 - n: choice i samples with seed + i"},
        "tools": _nullable({"type": "array", "items": _ref("Tool")}),
        "tool_choice": {"description": "'required' and a named function need 'tools' (and the name among them)",
                        "anyOf": [{"enum": ["auto", "none", "required"]}, _NAMED_FUNCTION, {"type": "null"}]},
        "parallel_tool_calls": _BOOL,
        "logprobs": _BOOL,
        "top_logprobs": {**_integer(0, 20), "description": "above 0 needs logprobs: true"},
        "stream": _BOOL,
        "stream_options": _nullable({"type": "object", "additionalProperties": False,
                                     "description": "needs stream: true",
                                     "properties": {"include_usage": _BOOL}}),
        "user": _STRING,
        "session_id": {**_STRING, "description": "clawrl's session hint; the X-Session-Id header wins"},
        "store": {**_BOOL, "description": "accepted for compatibility: every turn is stored"},
        **{k: {"enum": [v, None], "description": "accepted only at its neutral value"} for k, v in NEUTRAL.items()},
    },
}

_TOP_LOGPROB = {
    "type": "object",
    "required": ["token", "logprob", "bytes"],
    "properties": {"token": {"type": "string"}, "logprob": {"type": "number"},
                   "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}},
}
LOGPROBS = {
    "type": "object",
    "required": ["content"],
    "properties": {"content": {"type": "array", "items": {
        **_TOP_LOGPROB,
        "required": [*_TOP_LOGPROB["required"], "top_logprobs"],
        "properties": {**_TOP_LOGPROB["properties"], "top_logprobs": {"type": "array", "items": _TOP_LOGPROB}},
    }}},
}
USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}},
    },
}
_FINISH = {"enum": ["stop", "length", "tool_calls"]}
_HEAD = {"id": {"type": "string"}, "created": {"type": "integer"}, "model": {"type": "string"},
         "system_fingerprint": {"type": "string"}}
CHAT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        **_HEAD,
        "object": {"const": "chat.completion"},
        "choices": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["index", "message", "finish_reason"],
            "properties": {
                "index": {"type": "integer", "minimum": 0},
                "message": {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {
                        "role": {"const": "assistant"},
                        "content": {"type": ["string", "null"]},
                        "tool_calls": {"type": "array", "items": {
                            "type": "object", "required": ["id", "type", "function"],
                            "properties": {"id": {"type": "string"}, "type": {"const": "function"}, "function": {
                                "type": "object", "required": ["name", "arguments"],
                                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}},
                    },
                },
                "logprobs": _nullable(_ref("Logprobs")),
                "finish_reason": _FINISH,
            },
        }},
        "usage": _ref("Usage"),
    },
}
CHAT_COMPLETION_CHUNK = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        **_HEAD,
        "object": {"const": "chat.completion.chunk"},
        "choices": {"type": "array", "items": {
            "type": "object",
            "required": ["index", "delta", "finish_reason"],
            "properties": {
                "index": {"type": "integer", "minimum": 0},
                "delta": {"type": "object", "properties": {
                    "role": {"const": "assistant"},
                    "content": {"type": "string"},
                    "tool_calls": {"type": "array", "items": {
                        "type": "object", "required": ["index", "function"],
                        "properties": {"index": {"type": "integer", "minimum": 0}, "id": {"type": "string"},
                                       "type": {"const": "function"},
                                       "function": {"type": "object", "properties": {
                                           "name": {"type": "string"}, "arguments": {"type": "string"}}}}}},
                }},
                "logprobs": _nullable(_ref("Logprobs")),
                "finish_reason": _nullable(_FINISH),
            },
        }},
        "usage": _nullable(_ref("Usage")),
    },
}
# One server-sent event (Open API 3.1 reads an event-stream schema as one event's): a chunk, an
# error that came after the 200 headers, or the closing [DONE].
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json",
         "contentSchema": {"anyOf": [_ref("ChatCompletionChunk"), _ref("Error")]}},
    ]}},
}
MODEL = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                   "owned_by": {"type": "string"}, "context_window": {"type": "integer"}},
}
RELABEL = {
    "type": "object",
    "required": ["label"],
    "additionalProperties": False,
    "properties": {"label": {"enum": ["main", "side", "excluded"]}},
}

COMPONENTS = {
    "Error": ERROR, "TextPart": TEXT_PART, "Content": CONTENT, "ToolCall": TOOL_CALL, "ChatMessage": MESSAGE,
    "Tool": TOOL, "ChatCompletionRequest": CHAT_REQUEST, "Usage": USAGE, "Logprobs": LOGPROBS,
    "ChatCompletion": CHAT_COMPLETION, "ChatCompletionChunk": CHAT_COMPLETION_CHUNK, "Model": MODEL,
    "RelabelTurn": RELABEL,
}


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


# ``openapi_extra`` of each route, merged by FastAPI into its operation.
CHAT_COMPLETIONS = {
    "requestBody": {"required": True, **_json(_ref("ChatCompletionRequest"))},
    "responses": {"200": {
        "description": "A chat.completion object; with stream: true, server-sent chat.completion.chunk "
                       "events ending in 'data: [DONE]' (an error after the headers is an error event).",
        "content": {"application/json": {"schema": _ref("ChatCompletion")},
                    "text/event-stream": {"schema": SSE_EVENT}},
    }},
}
MODELS = {"responses": {"200": {"description": "The served model", **_json({
    "type": "object", "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}})}}}
MODEL_CARD = {"responses": {"200": {"description": "The served model", **_json(_ref("Model"))}}}
RELABEL_TURN = {"requestBody": {"required": True, **_json(_ref("RelabelTurn"))}}


def install(app: FastAPI) -> None:
    """Serve the document with the schemas above, every error as ``Error``, and no 422s (the
    gateway answers bad input with 400 in OpenAI's format). Built once, on first request."""

    def document() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, openapi_version=app.openapi_version,
                              routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            schemas.update(COMPONENTS)
            for item in doc.get("paths", {}).values():
                for operation in item.values():
                    responses = operation.setdefault("responses", {})
                    responses.pop("422", None)
                    responses["default"] = {"description": "An error, in OpenAI's format", **_json(_ref("Error"))}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = document
