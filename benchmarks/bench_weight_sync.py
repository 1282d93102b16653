"""Weight sync from megatron trainer ranks into the serving engine, against the in-process copy.

Writes a random-weight model (``--preset``, as in bench_trainers.py), starts the megatron trainer
ranks the way ``clawrl serve`` does (torchrun, ``cluster.tp``), trains one step, and pushes the
weights into a TorchEngine in this process through ``BroadcastWeightSync`` (gloo through host
memory when the trainer and the engine share a GPU, NCCL when the engine has its own); then checks
that the engine's greedy output equals an HF model loaded with the trainer's weights. The
baseline, measured in the same run, is the torch trainer's ``InProcessWeightSync`` of the same
model. Prints both times and their ratio.

    python benchmarks/bench_weight_sync.py --preset qwen3-0.6b [--tp 1] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


async def median_push(sync, trainer, repeats: int) -> float:
    """Median seconds of ``repeats`` pushes of ``trainer``'s weights, each as the next version."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        await sync.push(trainer, sync.version + 1)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def measure(args, model_dir: str) -> dict:
    from clawrl.config import compose
    from clawrl.engines.base import SamplingParams
    from clawrl.engines.loading import load_model
    from clawrl.engines.torch_engine import TorchEngine
    from clawrl.trainers.backends import make_trainer
    from clawrl.trainers.megatron.parity import synthetic_batch
    from clawrl.weight_sync import InProcessWeightSync

    device = "cuda" if torch.cuda.is_available() else "cpu"
    common = [f"model.device={device}", "train.lr=1e-4", "train.micro_batch_tokens=256", f"run_dir={args.run_dir}",
              f"cluster.tp={args.tp}", f"cluster.procs_per_node={args.tp}", "cluster.timeout_s=600"]
    engine = TorchEngine(load_model(model_dir, device=device, dtype="bfloat16" if device == "cuda" else "float32"),
                         compose(common).engine)
    await engine.start()
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [11, 12, 13, 14, 15]
    vocab = engine.model_info().vocab_size
    samples = synthetic_batch(vocab, n=4, pad_id=0)
    out = {}
    try:
        meg = make_trainer(compose(["trainer.backend=megatron", *common]), model_dir)
        try:
            sync = meg.weight_sync(engine)
            assert (await asyncio.to_thread(meg.train_step, samples, 0)).ok
            out["megatron_s"] = await median_push(sync, meg, args.repeats)
            out["megatron_backend"] = sync.endpoint.backend
            served = (await engine.generate(prompt, greedy)).token_ids
            out["greedy_matches"] = served == hf_greedy(model_dir, meg.export_weights(), prompt, 8)
            sync.close()
        finally:
            meg.close()
        torch_trainer = make_trainer(compose(common), model_dir)
        out["torch_s"] = await median_push(InProcessWeightSync(engine), torch_trainer, args.repeats)
    finally:
        await engine.shutdown()
    return out


def hf_greedy(model_dir: str, state: dict, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by an HF model holding ``state``, in the engine's serving dtype."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from bench_trainers import PRESETS, write_model

    if args.preset not in PRESETS:
        raise SystemExit(f"--preset must be one of {', '.join(sorted(PRESETS))}")
    with tempfile.TemporaryDirectory() as tmp:
        args.run_dir = str(Path(tmp) / "run")
        model_dir = str(write_model(Path(tmp) / "model", args.preset))
        params = sum(p.numel() for p in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
            str(Path(model_dir) / "model.safetensors")).values())
        out = asyncio.run(measure(args, model_dir))
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"{args.preset} ({params / 1e6:.0f}M parameters) on {name}, megatron tp={args.tp}")
    print(f"megatron ranks -> engine ({out['megatron_backend']}): {out['megatron_s'] * 1000:8.0f} ms per sync, "
          f"greedy output matches the trainer's weights: {out['greedy_matches']}")
    print(f"torch trainer in-process copy:        {out['torch_s'] * 1000:8.0f} ms per sync")
    print(f"ratio megatron / in-process: {out['megatron_s'] / out['torch_s']:.2f}")


if __name__ == "__main__":
    main()
