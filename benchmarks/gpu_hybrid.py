"""Hybrid linear-attention model against an attention-only one of the same size, in the same run
(``python benchmarks/gpu_suite.py --part hybrid``): decode, prefill and training throughput.

The attention-only model is the suite's Qwen3 shape (``qwen3-1.7b``: 1.72 B parameters, tied
embeddings). The hybrid is Qwen3-Next's layout scaled to that size (1.73 B): 28 layers, three
Gated DeltaNet layers to one gated full-attention layer, linear attention with 16 key and 16 value
heads of 128, full attention with 16 query and 2 KV heads of 128, partial rotary (a quarter of each
head), dense MLP (no experts; an MoE would change the comparison's parameter count), same hidden
size and vocabulary. Both have random weights (``torch.manual_seed(0)``), bf16 on a GPU.

- Decode: 1, 8 and 64 concurrent streams, a 512-token random prompt each and 128 new tokens
  (temperature 1, EOS ignored), through the engine (``TorchEngine``, default config); HF's
  ``generate`` on the same model beside it, once (a side figure; HF's eager hybrid decode is slow
  enough that ``--repeat`` runs of it would not fit the suite's 8-minute budget). Both models decode
  in the CUDA-graph static decoder (``static_decode`` says so; the hybrid's slots hold its conv and
  recurrent states), the hybrid with flash-linear-attention when it imports (``hybrid.kernels``).
- Prefill: one cold 4096-token prompt, prefix cache flushed.
- Train: the torch trainer's default settings with ``train.gradient_checkpointing=true`` on 8 samples
  of 16 prompt + 2032 response tokens (gpu_train.py's batch; 4 on a card under 100 GiB): tok/s and
  peak memory. Recomputation because the hybrid trains its linear layers on HF's pure-torch delta
  rule on Hopper (fla refuses its backward there, trainers/linear_attention.py), whose saved
  intermediates ran an 80 GB card out of memory at 4 x 2048 tokens; both models get it, so the
  ratio compares like with like.
  The attention model packs them into one row with per-sequence attention; the hybrid trains one
  row per sequence (torch_trainer.py says why).

Every figure is the median of ``--repeat`` runs. ``--shape tiny`` runs it all on a CPU in seconds
(a 4-layer hybrid against the suite's 2-layer tiny Qwen3), so the part cannot rot.
"""
from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpu_models import hf_decode, random_model, served, sync

# Qwen3-Next's layout at about the size of each attention-only shape of the suite.
HYBRID_SHAPES = {
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=2, head_dim=128, linear_num_key_heads=16,
                       linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128),
    "tiny": dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16),
}
# Per shape: decode streams, prompt tokens, new tokens, prefill tokens, (train sequences, tokens each, steps).
HYBRID_SIZES = {
    "qwen3-1.7b": ((1, 8, 64), 512, 128, 4096, (8, 2048, 5)),
    "tiny": ((1, 4), 32, 8, 200, (2, 64, 1)),
}


def build_hybrid(shape: str, device: str):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    layers = HYBRID_SHAPES[shape]["num_hidden_layers"]
    cfg = Qwen3NextConfig(**HYBRID_SHAPES[shape], num_experts=0, max_position_embeddings=8192, tie_word_embeddings=True,
                          layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.25},
                          attn_implementation="sdpa")
    return random_model(Qwen3NextForCausalLM, cfg, device)


async def engine_figures(model, name: str, streams, prompt_len: int, new: int, prefill: int, repeat: int) -> dict:
    """Decode tok/s per stream count (engine and HF generate) and cold prefill ms, for one model."""
    from clawrl.config import EngineConfig
    from clawrl.engines.base import SamplingParams
    from clawrl.engines.torch_engine import TorchEngine

    vocab = model.config.vocab_size
    dev = next(model.parameters()).device
    eng = TorchEngine(served(model, name), EngineConfig(max_batch_size=max(streams)))
    await eng.start()
    params = SamplingParams(max_new_tokens=new, temperature=1.0, top_k=0, top_p=1.0, ignore_eos=True)
    out = {"kernels": getattr(getattr(eng.runner, "kernels", None), "name", None),
           "static_decode": eng.decoder is not None}
    try:
        for n in streams:
            prompt = torch.randint(0, vocab, (n, prompt_len), device=dev)
            ids = prompt.tolist()

            async def decode() -> float:
                await eng.flush_cache()
                sync()
                t = time.perf_counter()
                res = await asyncio.gather(*(eng.generate(p, params) for p in ids))
                sync()
                assert all(len(r.token_ids) == new for r in res)
                return n * new / (time.perf_counter() - t)
            await decode()  # warm-up (graph captures, kernel autotuning)
            hf_decode(model, prompt[:, :8], 4)
            runs = [await decode() for _ in range(repeat)]
            hf = [hf_decode(model, prompt, new)]  # a side figure: one run keeps the part within its budget
            out[f"streams_{n}"] = {"tok_s": round(statistics.median(runs), 1),
                                   "hf_tok_s": round(statistics.median(hf), 1),
                                   "runs": [round(x, 1) for x in runs], "hf_runs": [round(x, 1) for x in hf]}
            print(f"hybrid part, {name:>9} decode {n:>3} streams: engine {out[f'streams_{n}']['tok_s']:9.1f} tok/s, "
                  f"HF generate {out[f'streams_{n}']['hf_tok_s']:9.1f}", flush=True)
        long = torch.randint(0, vocab, (prefill,)).tolist()
        one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        times = []
        for _ in range(repeat + 1):  # the first is a warm-up
            await eng.flush_cache()
            sync()
            t = time.perf_counter()
            await eng.generate(long, one)
            sync()
            times.append((time.perf_counter() - t) * 1000)
        out["prefill_ms"] = round(statistics.median(times[1:]), 2)
        out["prefill_runs_ms"] = [round(x, 2) for x in times[1:]]
        print(f"hybrid part, {name:>9} cold prefill of {prefill} tokens: {out['prefill_ms']:.1f} ms", flush=True)
    finally:
        await eng.shutdown()
    return out


# Both models train with these (the module docstring says why).
TRAIN_OVERRIDES = ["train.gradient_checkpointing=true"]


def train_figures(model_dir: str, device: str, batch, seq: int, steps: int) -> dict:
    from gpu_train import clawrl_steps, samples
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    data = samples(cfg.vocab_size, batch, seq)
    times, info = clawrl_steps(model_dir, device, data, steps, TRAIN_OVERRIDES)
    s = statistics.median(times)
    return {"tok_s": round(batch * seq / s, 1), "step_s": s, "runs_s": times, **info}


def run_hybrid(build_attention, shape: str, device: str, repeat: int, save_tokenizer) -> dict:
    """The hybrid part's figures: ``build_attention(shape, device)`` makes the suite's attention-only
    model; ``save_tokenizer(dir)`` writes a tokenizer beside saved weights (the trainer loads one)."""
    from gpu_train import sequences_that_fit

    streams, prompt_len, new, prefill, (batch, seq, steps) = HYBRID_SIZES[shape]
    batch = sequences_that_fit(batch, device)
    out = {"hybrid_shape": HYBRID_SHAPES[shape], "streams": list(streams), "prompt_tokens": prompt_len,
           "new_tokens": new, "prefill_tokens": prefill, "train_sequences": batch, "train_seq_len": seq,
           "train_overrides": TRAIN_OVERRIDES}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for name, build in (("attention", build_attention), ("hybrid", build_hybrid)):
            model = build(shape, device)
            out[f"{name}_params"] = sum(p.numel() for p in model.parameters())
            out[name] = asyncio.run(engine_figures(model, name, streams, prompt_len, new, prefill, repeat))
            dirs[name] = Path(tmp) / name
            model.save_pretrained(dirs[name])
            save_tokenizer(dirs[name])
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
        for name in ("attention", "hybrid"):
            try:
                out[name]["train"] = train_figures(str(dirs[name]), device, batch, seq, steps)
            except RuntimeError as e:  # recorded, so the decode figures a GPU call paid for still land
                out[name]["train"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
                print(f"hybrid part, {name:>9} train FAILED: {out[name]['train']['error']}", flush=True)
                continue
            print(f"hybrid part, {name:>9} train: {out[name]['train']['tok_s']:9.1f} tok/s, "
                  f"peak {out[name]['train']['peak_mem_gib']:.1f} GiB, linear attention on "
                  f"{out[name]['train']['linear_kernels']}", flush=True)
    out["kernels"] = out["hybrid"]["kernels"]
    for n in streams:
        key = f"streams_{n}"
        out[f"decode_ratio_{key}"] = round(out["hybrid"][key]["tok_s"] / out["attention"][key]["tok_s"], 3)
    out["prefill_ratio"] = round(out["attention"]["prefill_ms"] / out["hybrid"]["prefill_ms"], 3)
    trained = all("tok_s" in out[name]["train"] for name in ("attention", "hybrid"))
    out["train_ratio"] = round(out["hybrid"]["train"]["tok_s"] / out["attention"]["train"]["tok_s"], 3) \
        if trained else None
    return out


def hybrid_table(h: dict) -> list[str]:
    """Rows for gpu_suite's printed table (ratios: hybrid over attention-only, higher is faster)."""
    lines = ["", f"| hybrid ({h['kernels']} kernels) vs attention-only, same size | hybrid | attention-only "
                 "| hybrid / attention |", "|---|---:|---:|---:|"]
    for n in h["streams"]:
        key = f"streams_{n}"
        lines.append(f"| decode, {n} stream(s), engine tok/s (HF generate: {h['hybrid'][key]['hf_tok_s']:.0f} / "
                     f"{h['attention'][key]['hf_tok_s']:.0f}) | {h['hybrid'][key]['tok_s']:.0f} "
                     f"| {h['attention'][key]['tok_s']:.0f} | {h[f'decode_ratio_{key}']:.2f} |")
    lines.append(f"| cold prefill, {h['prefill_tokens']} tokens, ms | {h['hybrid']['prefill_ms']:.0f} "
                 f"| {h['attention']['prefill_ms']:.0f} | {h['prefill_ratio']:.2f} (speed) |")
    train = [f"{h[name]['train']['tok_s']:.0f}" if "tok_s" in h[name]["train"] else "failed" for name in
             ("hybrid", "attention")]
    ratio = f"{h['train_ratio']:.2f}" if h["train_ratio"] is not None else "-"
    lines.append(f"| train, {h['train_sequences']} x {h['train_seq_len']} tokens ({' '.join(h['train_overrides'])}), "
                 f"tok/s | {train[0]} | {train[1]} | {ratio} |")
    return lines
