"""OpenAI's response shapes: ``chat.completion`` objects and ``chat.completion.chunk`` SSE events,
plus the ASGI response that streams them while watching for the client to go away.

Chunk order per request (what the ``openai`` client's stream parser expects): a role delta per
choice; content and ``tool_calls`` deltas (a call's first delta carries ``index``, ``id``,
``type`` and ``function.name``, the next its ``function.arguments``); one chunk per choice with
``finish_reason``; with ``stream_options.include_usage`` a last chunk with empty ``choices`` and
the usage; then ``data: [DONE]``.
"""
from __future__ import annotations

import json
from typing import Awaitable, Callable

import anyio
from starlette.responses import Response

from clawrl.gateway.toolcalls import ToolCall

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ChunkMaker:
    """Builds the ``chat.completion.chunk`` objects of one streamed response (shared id/created/model)."""

    def __init__(self, response_id: str, created: int, model: str, fingerprint: str, include_usage: bool):
        self.head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                     "system_fingerprint": fingerprint}
        self.include_usage = include_usage

    def chunk(self, index: int, delta: dict, finish_reason: str | None = None, logprobs: list | None = None) -> bytes:
        choice = {"index": index, "delta": delta,
                  "logprobs": {"content": logprobs} if logprobs is not None else None,
                  "finish_reason": finish_reason}
        obj = {**self.head, "choices": [choice]}
        if self.include_usage:
            obj["usage"] = None  # as OpenAI: every chunk but the last carries usage: null
        return sse(obj)

    def role(self, index: int) -> bytes:
        return self.chunk(index, {"role": "assistant", "content": ""})

    def content(self, index: int, text: str, logprobs: list | None = None) -> bytes:
        return self.chunk(index, {"content": text}, logprobs=logprobs)

    def tool_call(self, index: int, call_index: int, call: ToolCall) -> list[bytes]:
        first = {"index": call_index, "id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": ""}}
        args = {"index": call_index, "function": {"arguments": call.arguments}}
        return [self.chunk(index, {"tool_calls": [first]}), self.chunk(index, {"tool_calls": [args]})]

    def finish(self, index: int, reason: str) -> bytes:
        return self.chunk(index, {}, finish_reason=reason)

    def usage(self, usage_obj: dict) -> bytes:
        return sse({**self.head, "choices": [], "usage": usage_obj})


def error_event(error_body: dict) -> bytes:
    """An error after the 200 headers went out: OpenAI sends it as an SSE event; clients raise it."""
    return sse(error_body)


Emit = Callable[[bytes], Awaitable[None]]


async def until_disconnect(receive, work) -> bool:
    """Run ``work()`` unless the client disconnects first (then it is cancelled); True if it did.
    An exception from ``work`` is re-raised as itself, not wrapped in an exception group."""
    gone, error = False, None
    async with anyio.create_task_group() as tg:
        async def run() -> None:
            nonlocal error
            try:
                await work()
            except Exception as e:
                error = e
            finally:
                tg.cancel_scope.cancel()

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(watch)
    if error is not None:
        raise error
    return gone


class SSEResponse(Response):
    """Runs ``produce(emit)`` while listening for ``http.disconnect``.

    Starlette's StreamingResponse only notices a vanished client when a write fails, and leaves
    its generator to the garbage collector; generation must stop at once instead, and the turn
    must be stored as aborted. Here a disconnect cancels ``produce``, whose cancellation handler
    aborts the engine request and records the partial turn.
    """

    media_type = "text/event-stream"

    def __init__(self, produce: Callable[[Emit], Awaitable[None]], headers: dict[str, str] | None = None):
        # Not Response.__init__: it would declare Content-Length: 0 for the empty initial body.
        self.status_code, self.background, self.produce = 200, None, produce
        self.init_headers({"Cache-Control": "no-cache", **(headers or {})})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        closed = False

        async def emit(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        async def produce() -> None:
            nonlocal closed
            try:
                await self.produce(emit)
            except OSError:  # a write found the socket closed before the disconnect message came
                closed = True

        gone = await until_disconnect(receive, produce) or closed
        if not gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
