"""Where one train step of the torch trainer spends its GPU time (the figures behind BENCHMARKS.md's
"GPU training" breakdown): the train part's model and samples (``gpu_train.py``), one profiled step
after warm-up, kernels grouped into matmuls, attention, the optimizer and the rest, and the 20
costliest kernels, for each setting given (``parts`` and ``layer``: ``train.compile=on`` with that
``train.compile_scope``).

    python benchmarks/gpu_train_profile.py [--shape qwen3-1.7b] [--compile off parts layer]
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).resolve().parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def group(name: str) -> str:
    """A kernel's coarse kind, by the names cuBLAS, cuDNN, flash attention and inductor give them."""
    n = name.lower()
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "ampere_bf16", "cublas")):
        return "matmul"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "adam" in n or "multi_tensor" in n:
        return "optimizer"
    if n.startswith("triton_") or "triton" in n:
        return "inductor (fused)"
    return "other elementwise / copies / reductions"


def profile_step(trainer, batch: list) -> list[tuple[str, float, int]]:
    for _ in range(2):  # warm-up: allocations, compilation
        assert trainer.train_step(batch, trainer.step).ok
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        assert trainer.train_step(batch, trainer.step).ok
        torch.cuda.synchronize()
    return [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages() if e.device_time_total > 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--compile", nargs="+", default=["off", "layer"], choices=("off", "parts", "layer"))
    args = ap.parse_args()
    suite, train = _load("gpu_suite"), _load("gpu_train")
    from clawrl.config import compose
    from clawrl.embedded.tokenizer import save_tokenizer, train_tokenizer
    from clawrl.trainers.torch_trainer import TorchTrainer

    batch_n, seq, _ = train.TRAIN_SIZES[args.shape]
    model = suite.build_model(args.shape, "cuda")
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        save_tokenizer(train_tokenizer(["the model has random weights"] * 8, vocab_size=300), Path(tmp), 8192)
        del model
        torch.cuda.empty_cache()
        batch = train.samples(vocab, batch_n, seq)
        for mode in args.compile:
            setting = ["train.compile=off"] if mode == "off" else ["train.compile=on", f"train.compile_scope={mode}"]
            trainer = TorchTrainer(compose([f"model.path={tmp}", "model.device=cuda", "train.lr=1e-6", *setting]), tmp)
            kernels = profile_step(trainer, batch)
            del trainer
            torch.cuda.empty_cache()
            total = sum(ms for _, ms, _ in kernels)
            groups = collections.Counter()
            for name, ms, _ in kernels:
                groups[group(name)] += ms
            print(f"\n== {' '.join(setting)}: {total:.0f} ms of GPU time in one step ({args.shape}, "
                  f"{batch_n} x {seq} tokens)")
            for kind, ms in groups.most_common():
                print(f"  {kind:<42} {ms:7.1f} ms  {ms / total:5.1%}")
            print("  costliest kernels:")
            for name, ms, count in sorted(kernels, key=lambda k: -k[1])[:20]:
                print(f"    {ms:7.1f} ms  x{count:<5} {name[:110]}")


if __name__ == "__main__":
    main()
