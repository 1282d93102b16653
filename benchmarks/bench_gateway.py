"""What the gateway adds on top of the engine: latency and throughput of N concurrent streams
through HTTP (uvicorn + FastAPI + SSE + session linking + a durable SQLite turn per request)
vs the same prompts through ``engine.stream`` directly, in the same run, on the same engine.

Both sides decode greedily with the same prompt ids and ``max_new_tokens``, so they generate
the same tokens; the difference is the gateway. The HTTP client (httpx, raw SSE) runs in a
separate process on the same cores, as a co-located agent would. Prints ratios; asserts no timings.

    python benchmarks/bench_gateway.py [--model DIR] [--streams 1 32] [--max-tokens 64] [--rounds 2] [--threads N]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import torch

from clawrl.config import compose
from clawrl.embedded.build import resolve_model
from clawrl.engines.base import SamplingParams
from clawrl.engines.loading import load_model
from clawrl.engines.torch_engine import TorchEngine
from clawrl.gateway.app import create_app
from clawrl.gateway.protocol import parse_chat_request
from clawrl.gateway.render import render_prompt
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

TOPICS = ["the weather in Paris", "a python bug", "7+5", "the capital of Germany", "a shopping list",
          "unit tests", "a haiku", "git rebase"]


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} (request {i})."}]
            for i in range(n)]


async def direct(engine: TorchEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Each prompt through engine.stream, all at once: first-token and total latency, tokens."""
    async def one(ids):
        t0 = time.perf_counter()
        first, n = None, 0
        async for chunk in engine.stream(ids, params):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - t0
            n += len(chunk.token_ids)
        return first, time.perf_counter() - t0, n

    await engine.flush_cache()
    t0 = time.perf_counter()
    rows = await asyncio.gather(*(one(p) for p in prompts))
    return summarise(rows, time.perf_counter() - t0)


async def through_gateway(url: str, model: str, convs: list[list[dict]], max_tokens: int) -> dict:
    """The same conversations as streamed chat completions: first content delta and [DONE]."""
    async def one(client: httpx.AsyncClient, messages):
        body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first, n = None, 0
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - t0
                if event.get("usage"):
                    n = event["usage"]["completion_tokens"]
        return first, time.perf_counter() - t0, n

    limits = httpx.Limits(max_connections=len(convs) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one(client, m) for m in convs))
    return summarise(rows, time.perf_counter() - t0)


def summarise(rows, wall: float) -> dict:
    firsts = [f for f, _, _ in rows if f is not None]
    return {"wall_s": wall, "tokens": sum(n for _, _, n in rows), "tok_per_s": sum(n for _, _, n in rows) / wall,
            "ttft_p50_ms": 1000 * statistics.median(firsts) if firsts else float("nan"),
            "latency_p50_ms": 1000 * statistics.median(t for _, t, _ in rows),
            "latency_max_ms": 1000 * max(t for _, t, _ in rows)}


def client_main(url: str, model: str, streams: int, max_tokens: int) -> int:
    """The HTTP side, in its own process: a real client does not share the server's GIL. One
    untimed request first, so a fresh process's lazy imports are not billed to the gateway."""
    async def run():
        await through_gateway(url, model, [[{"role": "user", "content": "warm-up"}]], max_tokens)
        return await through_gateway(url, model, conversations(streams), max_tokens)

    print(json.dumps(asyncio.run(run())))
    return 0


def run_client(url: str, model: str, streams: int, max_tokens: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--client", url, "--model-name", model, "--streams", str(streams),
                          "--max-tokens", str(max_tokens)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-name", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="HF model dir (default: the embedded tiny model)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32], help="concurrency levels")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="alternating direct/gateway rounds; best of each")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.client:
        return client_main(args.client, args.model_name, args.streams[0], args.max_tokens)
    import uvicorn

    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = tempfile.mkdtemp(prefix="bench-gateway-")
    cfg = resolve_model(compose([f"run_dir={run_dir}", f"engine.max_batch_size={max(32, *args.streams)}",
                                 f"server.max_queue={max(args.streams)}",
                                 *([f"model.path={args.model}"] if args.model else [])]))
    loaded = load_model(cfg.model.path, device="cpu", name=cfg.model.name)
    engine = TorchEngine(loaded, cfg.engine)
    store = TurnStore(run_dir)
    app = create_app(cfg, engine, SessionLinker(store, cfg.sessions.idle_timeout_s))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"

    name = engine.model_info().name
    print(f"# bench_gateway: {name}, max_tokens {args.max_tokens}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0.0)
    all_convs = conversations(max(args.streams))
    all_prompts = [render_prompt(engine.tokenizer, parse_chat_request({"model": name, "messages": m}),
                                 engine.max_context, False).ids for m in all_convs]
    asyncio.run(direct(engine, all_prompts[:2], params))  # warm-up
    print("\n| streams | path | tokens | wall s | tok/s | TTFT p50 ms | latency p50 ms | latency max ms |")
    print("|---|---|---|---|---|---|---|---|")
    summary = []
    for n in args.streams:
        best_d, best_g = None, None
        for _ in range(args.rounds):  # alternate, keep the best of each: the box is shared and noisy
            d = asyncio.run(direct(engine, all_prompts[:n], params))
            asyncio.run(engine.flush_cache())
            g = run_client(url, name, n, args.max_tokens)
            best_d = d if best_d is None or d["tok_per_s"] > best_d["tok_per_s"] else best_d
            best_g = g if best_g is None or g["tok_per_s"] > best_g["tok_per_s"] else best_g
        assert best_d["tokens"] == best_g["tokens"], (best_d["tokens"], best_g["tokens"])
        for label, m in (("engine.stream direct", best_d), ("gateway (HTTP+SSE+store)", best_g)):
            print(f"| {n} | {label} | {m['tokens']} | {m['wall_s']:.2f} | {m['tok_per_s']:.0f} | "
                  f"{m['ttft_p50_ms']:.0f} | {m['latency_p50_ms']:.0f} | {m['latency_max_ms']:.0f} |", flush=True)
        summary.append(
            f"{n} stream(s): throughput gateway/direct {best_g['tok_per_s'] / best_d['tok_per_s']:.2f}; "
            f"added latency p50 {best_g['latency_p50_ms'] - best_d['latency_p50_ms']:.0f} ms "
            f"(x{best_g['latency_p50_ms'] / best_d['latency_p50_ms']:.2f}); "
            f"added TTFT p50 {best_g['ttft_p50_ms'] - best_d['ttft_p50_ms']:.0f} ms")
    print()
    print("\n".join(summary))
    print(f"turns stored: {store.status_counts()['turns']}")
    server.should_exit = True
    thread.join(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
