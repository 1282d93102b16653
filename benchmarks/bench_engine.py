"""Benchmark the built-in TorchEngine against HF ``generate`` on the same model, in the same run.

1. Decode throughput at 1, 8 and 32 concurrent requests (greedy, same new-token count, EOS
   ignored) vs HF ``generate`` on the same prompts batched and left-padded.
2. Prefill of an OpenClaw-sized prompt (the real captured request, ~40 KB system prompt plus 12
   tools) cold vs a prefix-cache hit: the same system prompt with a new user message.

Each figure is the median of ``--repeat`` runs, engine and HF interleaved, because the dev box is
shared and noisy. Prints ratios; asserts nothing about timings.

    python benchmarks/bench_engine.py [--model DIR] [--threads N] [--new-tokens 64] [--repeat 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from clawrl.config import EngineConfig, compose
from clawrl.embedded.build import resolve_model
from clawrl.engines.base import SamplingParams
from clawrl.engines.loading import load_model
from clawrl.engines.torch_engine import TorchEngine

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "openclaw-2026.9.6" / "chat_turn1.json"


def decode_prompts(tok, n: int) -> list[list[int]]:
    topics = ["the weather in Paris", "a python bug", "7+5", "the capital of Germany", "a shopping list",
              "unit tests", "a haiku", "git rebase"]
    msgs = [[{"role": "user", "content": f"Tell me about {topics[i % len(topics)]} (request {i})."}] for i in range(n)]
    return [tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                add_special_tokens=False)["input_ids"] for m in msgs]


async def engine_decode(eng: TorchEngine, prompts, new_tokens: int) -> float:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    await eng.flush_cache()
    t0 = time.perf_counter()
    results = await asyncio.gather(*(eng.generate(p, params) for p in prompts))
    dt = time.perf_counter() - t0
    assert all(len(r.token_ids) == new_tokens for r in results)
    return len(prompts) * new_tokens / dt


def hf_decode(model, tok, prompts, new_tokens: int) -> float:
    width = max(map(len, prompts))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    dt = time.perf_counter() - t0
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / dt


def openclaw_prompts(tok) -> tuple[list[int], list[int], str]:
    """Turn-1 and a next-turn prompt sharing OpenClaw's system prompt and tools."""
    if FIXTURE.exists():
        body = json.loads(FIXTURE.read_text())["body"]
        messages, tools, source = body["messages"], body.get("tools"), f"{FIXTURE.name}"
    else:  # a synthetic stand-in of the same size
        system = ("You are a personal agent. Tools: read, write, exec, browse. Follow the rules. " * 500)[:40000]
        messages, tools, source = [{"role": "system", "content": system}], None, "synthetic 40 KB"
        messages.append({"role": "user", "content": "Say hello in one line."})

    def render(msgs):
        text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    first = render(messages)
    nxt = render([m for m in messages if m["role"] == "system"]
                 + [{"role": "user", "content": "Too long. One line, and no rhymes please."}])
    return first, nxt, source


def hf_prefill(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt], device=model.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, logits_to_keep=1)
    return time.perf_counter() - t0


async def prefill(eng: TorchEngine, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = await eng.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0.0))
    return time.perf_counter() - t0, r.cached_prompt_tokens


async def main_async(args) -> None:
    model = resolve_model(compose([f"model.path={args.model}"] if args.model else [])).model
    lm = load_model(model.path, name=model.name)
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = lm.tokenizer
    print(f"model {lm.name} ({lm.architecture}, {sum(p.numel() for p in lm.model.parameters()) / 1e6:.2f}M params) "
          f"on {lm.device}/{lm.dtype}; torch threads {torch.get_num_threads()}; {platform.processor() or platform.machine()}")
    eng = TorchEngine(lm, EngineConfig(threads=args.threads, max_batch_size=64))
    await eng.start()
    try:
        print(f"\ndecode, {args.new_tokens} new tokens per request (tokens/s, higher is better)")
        print(f"{'concurrent':>10} {'engine':>10} {'hf generate':>12} {'ratio':>7}")
        for n in args.concurrency:
            prompts = decode_prompts(tok, n)
            await engine_decode(eng, prompts[:1], 4)  # warm-up
            es, hs = [], []
            for _ in range(args.repeat):
                es.append(await engine_decode(eng, prompts, args.new_tokens))
                hs.append(hf_decode(lm.model, tok, prompts, args.new_tokens))
            e, h = statistics.median(es), statistics.median(hs)
            print(f"{n:>10} {e:>10.1f} {h:>12.1f} {e / h:>6.2f}x")

        first, nxt, source = openclaw_prompts(tok)
        common = next((i for i, (a, b) in enumerate(zip(first, nxt)) if a != b), min(len(first), len(nxt)))
        print(f"\nprefill of the OpenClaw prompt ({source}): {len(nxt)} tokens, {common} shared with the previous turn")
        colds, hits = [], []
        for _ in range(args.repeat):
            await eng.flush_cache()
            cold, cached_cold = await prefill(eng, nxt)
            await eng.flush_cache()
            await prefill(eng, first)
            hit, cached_hit = await prefill(eng, nxt)
            colds.append(cold)
            hits.append(hit)
        cold, hit = statistics.median(colds), statistics.median(hits)
        hf = statistics.median(hf_prefill(lm.model, nxt) for _ in range(args.repeat))
        print(f"cold {cold * 1000:.0f} ms (cached {cached_cold}); prefix-cache hit {hit * 1000:.0f} ms "
              f"(cached {cached_hit}); hit/cold = {hit / cold:.1%} (target <= 20%)")
        print(f"HF forward of the whole prompt in one call: {hf * 1000:.0f} ms (engine cold / HF = {cold / hf:.2f}x)")
    finally:
        await eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: the embedded clawrl-tiny)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure; the median is printed")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
