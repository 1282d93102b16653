"""A real model on the GPU (``gpu_suite.py --part real --model-dir DIR``): clawrl's engine against
HF ``generate`` on the same weights, and real text streamed through the gateway.

The directory is loaded the way ``clawrl serve`` loads ``model.path`` (``engines.loading``: bf16 on
the GPU, its own tokenizer, chat template and end-of-turn ids). Decode: 1, 8 and 64 streams of
512-token chat prompts (a user message over a slice of the OpenClaw system prompt, rendered with the
model's template, cut to one length so HF needs no padding), 256 sampled tokens, EOS ignored on both
sides. Serving: 8 and 64 such chats, greedy, through uvicorn + SSE + the turn store against the
engine directly; each reply ends where the model ends it, so both paths stream the same text.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch
import uvicorn

from clawrl.config import EngineConfig
from clawrl.engines.base import SamplingParams
from clawrl.engines.loading import load_model
from clawrl.engines.torch_engine import TorchEngine

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "openclaw-2026.9.6" / "chat_turn1.json"
MARK = "@@PROMPT@@"


def chat_prompts(tok):
    """``prompts(n, length)``: ``n`` chat prompts of exactly ``length`` ids each, the message's text
    between the template's own head and tail (encoded once each)."""
    words = json.loads(FIXTURE.read_text())["body"]["messages"][0]["content"].split()
    head, tail = tok.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False,
                                         add_generation_prompt=True).split(MARK)
    head_ids, tail_ids = (tok.encode(x, add_special_tokens=False) for x in (head, tail))

    def prompts(n: int, length: int) -> list[list[int]]:
        out = []
        for i in range(n):
            start = (i * 101) % len(words)
            text = f"Request {i}. Summarise this:\n" + " ".join(words[start:] + words[:start])
            body = tok.encode(text, add_special_tokens=False)[: length - len(head_ids) - len(tail_ids)]
            out.append(head_ids + body + tail_ids)
        return out
    return prompts


async def greedy_sample(lm, prompt: list[int]) -> str:
    """One greedy reply, as text: the figures are of a model that says something."""
    eng = TorchEngine(lm, EngineConfig())
    await eng.start()
    try:
        r = await eng.generate(prompt, SamplingParams(max_new_tokens=64, temperature=0.0))
    finally:
        await eng.shutdown()
    return lm.tokenizer.decode(r.token_ids, skip_special_tokens=True)


def run_real(args, run_decode, run_serving) -> dict:
    if not args.model_dir:
        raise SystemExit("--part real needs --model-dir (an HF model directory)")
    lm = load_model(args.model_dir, device="cuda" if torch.cuda.is_available() else "cpu")
    model = lm.model
    prompts = chat_prompts(lm.tokenizer)
    cpu = lm.device.type == "cpu"  # the script's own check, at a size a CPU runs in seconds
    streams, prompt_len, new, chats = ((1, 2), 64, 8, (2,)) if cpu else ((1, 8, 64), 512, 256, (8, 64))
    out = {"model": lm.name, "path": lm.path, "architecture": lm.architecture, "dtype": str(lm.dtype),
           "parameters": sum(p.numel() for p in model.parameters()), "eos_token_ids": lm.eos_token_ids,
           "device": torch.cuda.get_device_name(0) if not cpu else "cpu", "prompt_tokens": prompt_len,
           "new_tokens": new}
    out["greedy_sample"] = asyncio.run(greedy_sample(lm, prompts(1, prompt_len)[0]))
    print(f"{lm.name}: {out['parameters'] / 1e6:.1f} M parameters, {lm.dtype}; greedy: {out['greedy_sample']!r}",
          flush=True)
    dec = asyncio.run(run_decode(model, lm, args, streams, prompt_len, new, args.repeat, prompts_for=prompts))
    out["static_decode"] = dec.pop("engine")
    out["decode"] = dec
    with asyncio.Runner(loop_factory=uvicorn.Config(None).get_loop_factory()) as runner:
        out["serving"] = runner.run(run_serving(model, lm, args, chats, prompt_len, new, args.repeat,
                                                temperature=0.0))
    return out


def real_table(real: dict) -> list[str]:
    lines = ["", f"| {real['model']} ({real['parameters'] / 1e6:.0f} M, {real['dtype']}) | clawrl | HF generate "
                 "| clawrl / HF |", "|---|---:|---:|---:|"]
    for key, d in real["decode"].items():
        lines.append(f"| decode, {key[8:]} stream(s), tok/s | {d['clawrl_tok_s']:.0f} | {d['hf_tok_s']:.0f} "
                     f"| {d['ratio']:.2f} |")
    lines += ["", "| real text, concurrent chats | gateway tok/s | engine direct tok/s | gateway / direct "
                  "| TTFT p50 gateway / direct, ms |", "|---|---:|---:|---:|---:|"]
    for key, d in ((k, d) for k, d in real["serving"].items() if k.startswith("chats_")):
        lines.append(f"| {key[6:]} | {d['gateway_tok_s']:.0f} | {d['engine_tok_s']:.0f} | {d['ratio']:.2f} "
                     f"| {d['gateway_ttft_p50_ms']:.0f} / {d['engine_ttft_p50_ms']:.0f} |")
    return lines
