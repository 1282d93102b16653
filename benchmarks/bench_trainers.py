"""Training throughput: the megatron backend against the torch backend, on the same batch, same run.

Writes a random-weight model from an HF config (``--preset``: ``tiny`` for CPU smoke runs,
``qwen3-0.6b`` or ``qwen3-1.7b`` shapes for a GPU), builds one batch of synthetic samples, and
times ``--steps`` train steps of each backend after one warm-up step. The megatron side runs as
one local rank (``torch.distributed`` world of 1: NCCL on a GPU, gloo on CPU) with
``cluster.tp=1``; the torch side is the built-in trainer with its defaults (both through gpu_train.py). Prints
tokens/s for each and the ratio megatron / torch.

    python benchmarks/bench_trainers.py --preset qwen3-0.6b --samples 16 --prompt 512 --response 256
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_train, beside this file

PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
}


def write_model(out: Path, preset: str) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    # the real Qwen3-0.6B and -1.7B tie their embeddings (1.72 B parameters for the 1.7B shape, not 2.03 B)
    cfg = Qwen3Config(**PRESETS[preset], max_position_embeddings=8192, tie_word_embeddings=True,
                      rope_theta=1_000_000.0, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    # the trainers load a tokenizer with the model; a small trained one serves (ids are synthetic)
    from clawrl.embedded.tokenizer import save_tokenizer, train_tokenizer

    save_tokenizer(train_tokenizer(["hello world, the model has random weights"] * 8, vocab_size=300), out, 8192)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    args = ap.parse_args()

    from gpu_train import clawrl_steps, megatron_steps, samples as rl_samples

    device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = [f"train.micro_batch_tokens={args.micro_batch_tokens}", "train.tis_cap=null"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model(Path(tmp) / "model", args.preset))
        samples = rl_samples(PRESETS[args.preset]["vocab_size"], args.samples, args.prompt + args.response, args.prompt)
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        meg = megatron_steps(model_dir, device, samples, args.steps, tuple(overrides))
        if "skipped" in meg:
            raise SystemExit(f"megatron backend: {meg['skipped']}")
        meg_s = statistics.median(meg["runs_s"])
        times, info = clawrl_steps(model_dir, device, samples, args.steps, overrides)
        torch_s = statistics.median(times)

    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"{args.preset} on {name}: {args.samples} samples x ({args.prompt} + {args.response}) tokens = "
          f"{tokens} tokens per step, {args.steps} timed steps")
    print(f"torch backend:    {tokens / torch_s:10.0f} tokens/s  ({torch_s:.3f} s/step, "
          f"peak {info['peak_mem_gib']:.1f} GiB)")
    print(f"megatron backend: {tokens / meg_s:10.0f} tokens/s  ({meg_s:.3f} s/step, peak {meg['peak_mem_gib']:.1f} GiB)")
    print(f"ratio megatron / torch: {torch_s / meg_s:.2f}")


if __name__ == "__main__":
    main()
