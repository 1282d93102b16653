"""The HTTP side of ``gpu_suite.py --part serving``: N concurrent streamed chat completions.

It runs in its own process, as a real client does (it must not share the server's event loop or
GIL), and needs only httpx. Every conversation of the JSON file goes out at once as a streamed
``/v1/chat/completions`` request; per request it times the first content delta (TTFT) and the
``[DONE]`` (latency), and counts the completion tokens the usage chunk reports. One untimed
request first, so the process's own warm-up (imports, the first connection) is not billed to the
gateway. Prints one JSON line: the per-request rows and the wall time of the whole burst.

    python benchmarks/gpu_serving_client.py URL MODEL CONVERSATIONS.json MAX_TOKENS [TEMPERATURE]
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx


async def one(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
              temperature: float = 1.0) -> list:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"error event: {event['error']}")
            if first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return [first, time.perf_counter() - t0, tokens]


async def burst(url: str, model: str, convs: list[list[dict]], max_tokens: int, temperature: float) -> dict:
    limits = httpx.Limits(max_connections=len(convs) + 4, max_keepalive_connections=len(convs) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one(client, url, model, [{"role": "user", "content": "warm-up"}], 2)  # untimed
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one(client, url, model, m, max_tokens, temperature) for m in convs))
        return {"wall_s": time.perf_counter() - t0, "rows": rows}


def main(argv: list[str]) -> int:
    if len(argv) not in (4, 5):
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    url, model, path, max_tokens, temperature = [*argv, "1.0"][:5]
    with open(path) as f:
        convs = json.load(f)
    print(json.dumps(asyncio.run(burst(url, model, convs, int(max_tokens), float(temperature)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
