"""CPU prefill of a real model: the engine vs a plain torch forward vs what the box's matmuls allow.

Three figures for one ~2k-token chat prompt (``--tokens``), in the same run, interleaved, each the
median of ``--repeat`` runs (the box is shared: a neighbour's job moves any single run by 2-3x):

1. the engine: ``TorchEngine.generate`` with ``max_new_tokens=1``, prefix cache off, a distinct
   prompt each run (the first token's latency is the prefill);
2. a plain forward: ``model(input_ids, logits_to_keep=1)`` under ``inference_mode`` (only the last
   position's logits, as the engine computes);
3. the matmul bound: the forward's FLOPs (2 x non-embedding params x tokens, plus causal
   attention's 2 x layers x tokens^2 x heads x head_dim) over the box's sgemm GFLOP/s, measured on
   the model's own projection shapes. The brief's cruder 2 x all params x tokens is printed too.

``--profile`` adds a torch.profiler table of one engine prefill (where its time goes).

    python benchmarks/cpu_prefill.py [--model DIR] [--tokens 2048] [--repeat 5] [--profile]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from clawrl.config import EngineConfig
from clawrl.engines.base import SamplingParams
from clawrl.engines.loading import load_model
from clawrl.engines.torch_engine import TorchEngine

DEFAULT_MODEL = os.environ.get("CLAWRL_TEST_SMOLLM2", "/work/models/smollm2-135m-instruct")
TEXT = ("The river rose through the night, and by morning the old mill stood in water to its windows. "
        "Nobody in the village remembered a flood like it, though the baker's mother said her own mother "
        "had told of one, long before the railway came. ")


def chat_prompt(tok, tokens: int, salt: int) -> list[int]:
    """A chat prompt of about ``tokens`` ids; ``salt`` changes its first user words (no cache reuse)."""
    body = f"Note {salt}. " + TEXT * (tokens // 40 + 1)
    messages = [{"role": "user", "content": body}]
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    return ids[: tokens - 8] + ids[-8:]  # keep the template's closing and the assistant opening


async def engine_prefill(eng: TorchEngine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    await eng.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0.0))
    return len(prompt) / (time.perf_counter() - t0)


def plain_prefill(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        return len(prompt) / (time.perf_counter() - t0)


def sgemm_gflops(model, tokens: int) -> float:
    """GFLOP/s of fp32 ``F.linear`` on the model's projection shapes at ``tokens`` rows."""
    cfg = model.config
    d, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * getattr(cfg, "head_dim", d // cfg.num_attention_heads)
    x, h = torch.randn(tokens, d), torch.randn(tokens, inter)
    ws = [(x, torch.randn(qkv, d)), (x, torch.randn(2 * inter, d)), (h, torch.randn(d, inter))]
    flops = sum(2 * a.shape[0] * a.shape[1] * w.shape[0] for a, w in ws)
    for a, w in ws:
        F.linear(a, w)
    t0 = time.perf_counter()
    for a, w in ws:
        F.linear(a, w)
    return flops / (time.perf_counter() - t0) / 1e9


def forward_flops(model, tokens: int) -> tuple[float, float]:
    """(FLOPs of a prefill forward: projections + causal attention, brief's 2 x params x tokens)."""
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    head_dim = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    attention = 2 * cfg.num_hidden_layers * tokens * tokens * cfg.num_attention_heads * head_dim  # QK^T + PV, causal
    return 2 * (total - embed) * tokens + attention, 2 * total * tokens


def profile_engine(eng: TorchEngine, prompt: list[int]) -> str:
    """The engine's prefill forward (its runner, as the scheduler thread calls it) under
    torch.profiler, here in the main thread: the profiler does not see the scheduler thread."""
    from torch.profiler import ProfilerActivity, profile

    from clawrl.engines.ragged import Segment

    kv = eng.runner.new_kv(len(prompt), len(prompt) + 1)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.runner.forward([Segment(kv, prompt, [len(prompt) - 1])])
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=None, help="engine.prefill_chunk_tokens (default: the config's)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()

    loaded = load_model(args.model, device="cpu", dtype="float32")
    cfg = EngineConfig(prefix_cache_tokens=0, **({"prefill_chunk_tokens": args.chunk} if args.chunk else {}))
    eng = TorchEngine(loaded, cfg)
    tok, model = loaded.tokenizer, loaded.model
    prompts = [chat_prompt(tok, args.tokens, i) for i in range(2 * args.repeat + 2)]
    n = len(prompts[0])
    print(f"{loaded.name}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; prompt {n} tokens, "
          f"prefill_chunk_tokens {cfg.prefill_chunk_tokens}")

    asyncio.run(engine_prefill(eng, prompts[-1]))  # warm-up: first-touch of buffers, MKL init
    plain_prefill(model, prompts[-2])
    runs = {"engine": [], "plain": [], "sgemm": []}
    for i in range(args.repeat):
        runs["engine"].append(asyncio.run(engine_prefill(eng, prompts[i])))
        runs["plain"].append(plain_prefill(model, prompts[args.repeat + i]))
        runs["sgemm"].append(sgemm_gflops(model, n))
    med = {k: statistics.median(v) for k, v in runs.items()}
    flops, crude = forward_flops(model, n)
    bound = med["sgemm"] * 1e9 / (flops / n)
    crude_bound = med["sgemm"] * 1e9 / (crude / n)
    print(f"engine prefill : {med['engine']:7.0f} tok/s  (runs {', '.join(f'{x:.0f}' for x in runs['engine'])})")
    print(f"plain forward  : {med['plain']:7.0f} tok/s  (runs {', '.join(f'{x:.0f}' for x in runs['plain'])})")
    print(f"matmul bound   : {bound:7.0f} tok/s  ({flops / 1e9:.0f} GFLOP at {med['sgemm']:.0f} GFLOP/s sgemm; "
          f"2 x params x tokens: {crude_bound:.0f} tok/s)")
    print(f"engine / plain : {med['engine'] / med['plain']:.2f}    engine / bound : {med['engine'] / bound:.2f}")
    if args.profile:
        print(profile_engine(eng, prompts[-3]))
    asyncio.run(eng.shutdown())


if __name__ == "__main__":
    main()
