"""Training throughput: the megatron backend against the torch backend, on the same batch, same run.

Writes a random-weight model from an HF config (``--preset``: ``tiny`` for CPU smoke runs,
``qwen3-0.6b`` or ``qwen3-1.7b`` shapes for a GPU), builds one batch of synthetic samples, and
times ``--steps`` train steps of each backend after one warm-up step. The megatron side runs as
one local rank (``torch.distributed`` world of 1: NCCL on a GPU, gloo on CPU) with
``cluster.tp=1``; the torch side is the built-in trainer (bf16 autocast on a GPU). Prints
tokens/s for each and the ratio megatron / torch.

    python benchmarks/bench_trainers.py --preset qwen3-0.6b --samples 16 --prompt 512 --response 256
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

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


def batch(vocab: int, n: int, prompt: int, response: int):
    from clawrl.trainers.megatron.parity import synthetic_batch

    samples = synthetic_batch(vocab, n=n, seed=0, max_len=8, pad_id=0)
    import random

    rng = random.Random(1)
    for s in samples:
        s.prompt_ids = [rng.randrange(1, vocab) for _ in range(prompt)]
        s.response_ids = [rng.randrange(1, vocab) for _ in range(response)]
        s.rollout_logprobs = [-1.0] * response
        s.weight_versions = [0] * response
        s.extra = {}
    return samples


def timed(step, samples, steps: int) -> float:
    step(samples)  # warm-up: allocations, kernels
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step(samples)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def _megatron_rank(rank: int, cfg, model_dir: str, samples, steps: int, out: str, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from clawrl.trainers.megatron.ranks import MegatronRanks

    ranks = MegatronRanks(cfg, model_dir)

    def step(batch_):
        result = ranks.train_step(batch_, ranks.step)
        assert result["ok"], result
    seconds = timed(step, samples, steps)
    mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    Path(out).write_text(json.dumps({"seconds": seconds, "max_mem_gib": mem}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    args = ap.parse_args()

    import torch.multiprocessing as mp

    from clawrl.config import compose
    from clawrl.trainers.megatron.parity import free_port
    from clawrl.trainers.torch_trainer import TorchTrainer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_model(Path(tmp) / "model", args.preset))
        cfg = compose([f"model.path={model_dir}", f"model.device={device}",
                       f"train.micro_batch_tokens={args.micro_batch_tokens}", "train.lr=1e-6", "train.tis_cap=null"])
        samples = batch(PRESETS[args.preset]["vocab_size"], args.samples, args.prompt, args.response)
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)

        out = Path(tmp) / "megatron.json"
        mp.start_processes(_megatron_rank, args=(cfg, model_dir, samples, args.steps, str(out), free_port()),
                           nprocs=1, join=True, start_method="spawn")
        meg = json.loads(out.read_text())

        trainer = TorchTrainer(cfg, model_dir)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()

        def torch_step(batch_):
            result = trainer.train_step(batch_, trainer.step)
            assert result.ok, result
        torch_s = timed(torch_step, samples, args.steps)
        torch_mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0

    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"{args.preset} on {name}: {args.samples} samples x ({args.prompt} + {args.response}) tokens = "
          f"{tokens} tokens per step, {args.steps} timed steps")
    print(f"torch backend:    {tokens / torch_s:10.0f} tokens/s  ({torch_s:.3f} s/step, peak {torch_mem:.1f} GiB)")
    print(f"megatron backend: {tokens / meg['seconds']:10.0f} tokens/s  ({meg['seconds']:.3f} s/step, "
          f"peak {meg['max_mem_gib']:.1f} GiB)")
    print(f"ratio megatron / torch: {torch_s / meg['seconds']:.2f}")


if __name__ == "__main__":
    main()
