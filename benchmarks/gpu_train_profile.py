"""Where one train step spends its GPU time (the figures behind BENCHMARKS.md's "GPU training"
breakdown): the train part's model and samples (``gpu_train.py``), one profiled step after
warm-up, kernels grouped into matmuls, attention, the optimizer and the rest, the 20 costliest
kernels, the step's wall time against the GPU's busy time (a step that waits on the host shows a
gap), and the host calls that block on the device, for each setting given:

- ``off``, ``parts``, ``layer``: the torch trainer, ``train.compile=off``, or ``on`` with that
  ``train.compile_scope``;
- ``megatron``, ``megatron_eager``: the megatron backend (one rank, tp=pp=1, in a spawned process as
  ``clawrl serve`` runs it) with its default ``train.compile`` or ``off``.

    python benchmarks/gpu_train_profile.py [--shape qwen3-1.7b] [--setting off parts layer megatron]
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_models import sync

HERE = Path(__file__).resolve().parent
TORCH_SETTINGS = {"off": ["train.compile=off"], "parts": ["train.compile=on", "train.compile_scope=parts"],
                  "layer": ["train.compile=on", "train.compile_scope=layer"]}
MEGATRON_SETTINGS = {"megatron": [], "megatron_eager": ["train.compile=off"]}
# host calls that wait for the device: each one is a bubble in the GPU's queue
BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize", "aten::item",
            "aten::_local_scalar_dense", "aten::nonzero")


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


def _is_kernel(event) -> bool:
    """A device event that is work: not an annotation the profiler mirrors onto the device's timeline
    (``Optimizer.step#AdamW.step`` spans the whole step and would count its kernels twice)."""
    return event.device_type == torch.autograd.DeviceType.CUDA and "#" not in event.key and \
        not event.key.startswith("ProfilerStep")


def sync_sites(step) -> list[tuple[str, int]]:
    """Where ``step()`` makes the host wait for the device: CUDA's sync debug mode warns at every
    synchronizing call, and the hook keeps the innermost three Python frames of each (the line that
    asked, and who called it), counted by site. Empty without CUDA."""
    if not torch.cuda.is_available():
        return []
    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith(("warnings.py", __file__))]
        sites[" <- ".join(f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno}" for f in frames[::-1][:3])] += 1
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            sync()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites.most_common(15)


def idle_gaps(prof, wall_ms: float) -> dict:
    """When the device sat idle during the profiled step: before its first kernel (host work that
    launches nothing), between kernels, and after the last; the longest gaps between kernels with the
    host's top-level ops that overlap each (the host's doing while the device waited)."""
    events = prof.events()
    device = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                    if _is_kernel(e) and e.time_range.end > e.time_range.start)
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None]
    if not device or not host:
        return {}
    origin = min(e.time_range.start for e in host)
    gaps, busy_until = [], device[0][1]
    for start, end, name in device[1:]:
        if start - busy_until > 100:  # microseconds
            gaps.append((busy_until, start, name))
        busy_until = max(busy_until, end)
    longest = []
    for a, b, name in sorted(gaps, key=lambda g: g[0] - g[1])[:8]:
        over = sorted({e.name for e in host if e.time_range.start < b and e.time_range.end > a})
        longest.append(((b - a) / 1e3, (a - origin) / 1e3, name[:60], over[:4]))
    return {"before_first_ms": (device[0][0] - origin) / 1e3, "between_ms": sum(b - a for a, b, _ in gaps) / 1e3,
            "gaps": len(gaps), "after_last_ms": wall_ms - (busy_until - origin) / 1e3, "longest": longest}


def profile_step(step) -> dict:
    """``step()`` twice to warm up (allocations, compilation), then once under the profiler, then
    once more to find where it synchronizes."""
    for _ in range(2):
        step()
    sync()
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        started = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    # kernels are the device's own events (an op such as aten::mm also carries its kernels' time, and
    # counting both doubled the total); on CPU (a smoke run) the ops' self time stands in
    if cuda:
        kernels = [(e.key, e.device_time_total / 1e3, e.count) for e in events
                   if _is_kernel(e) and e.device_time_total > 0]
        kernels = kernels or [(e.key, e.self_device_time_total / 1e3, e.count) for e in events
                              if e.self_device_time_total > 0 and not e.key.startswith("aten::") and "#" not in e.key]
    else:
        kernels = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in events
                   if e.self_cpu_time_total > 0 and e.key.startswith("aten::")]
    blocking = [(e.key, e.cpu_time_total / 1e3, e.count) for e in events if any(b in e.key for b in BLOCKING)]
    # which ops own the kernels' time (a kernel's name seldom says: "multi_tensor_apply_kernel")
    ops = [(e.key, e.self_device_time_total / 1e3, e.count) for e in events
           if e.key.startswith("aten::") and e.self_device_time_total > 0]
    try:
        gaps = idle_gaps(prof, wall * 1e3) if cuda else {}
    except Exception as exc:  # a profiler API that moved must not lose the rest of the report
        gaps = {"error": repr(exc)}
    try:
        sites = sync_sites(step)
    except Exception as exc:
        sites = [(f"not read ({exc!r})", 0)]
    return {"wall_ms": wall * 1e3, "kernels": kernels, "blocking": blocking, "ops": ops, "gaps": gaps,
            "sync_sites": sites}


def report(title: str, result: dict) -> None:
    kernels = result["kernels"]
    total = sum(ms for _, ms, _ in kernels)
    groups = collections.Counter()
    for name, ms, _ in kernels:
        groups[group(name)] += ms
    print(f"\n== {title}: {result['wall_ms']:.0f} ms wall (under the profiler), {total:.0f} ms of GPU kernels "
          f"({total / result['wall_ms']:.0%} busy)", flush=True)
    for kind, ms in groups.most_common():
        print(f"  {kind:<42} {ms:7.1f} ms  {ms / total:5.1%}")
    print("  costliest kernels:")
    for name, ms, count in sorted(kernels, key=lambda k: -k[1])[:25]:
        print(f"    {ms:7.1f} ms  x{count:<5} {name[:110]}")
    if result["blocking"]:
        print("  host calls that wait on the device:")
        for name, ms, count in sorted(result["blocking"], key=lambda k: -k[1])[:8]:
            print(f"    {ms:7.1f} ms  x{count:<5} {name}")
    if result.get("ops"):
        print("  ops that own the device time:")
        for name, ms, count in sorted(result["ops"], key=lambda k: -k[1])[:12]:
            print(f"    {ms:7.1f} ms  x{count:<5} {name}")
    gaps = result.get("gaps") or {}
    if "error" in gaps:
        print(f"  idle gaps: not read ({gaps['error']})")
    elif gaps:
        print(f"  device idle: {gaps['before_first_ms']:.1f} ms before the first kernel, {gaps['between_ms']:.1f} ms "
              f"in {gaps['gaps']} gaps over 0.1 ms between kernels, {gaps['after_last_ms']:.1f} ms after the last")
        for ms, at, name, over in gaps["longest"]:
            print(f"    {ms:6.2f} ms at {at:6.1f} ms, before {name}; host: {', '.join(over)[:150]}")
    if result.get("sync_sites"):
        print("  where the host synchronizes (one more step under CUDA's sync debug mode):")
        for site, count in result["sync_sites"]:
            print(f"    x{count:<4} {site[:160]}")
    print(flush=True)


def _megatron_rank(rank: int, overrides: list[str], device: str, model_dir: str, batch: list, out: str,
                   port: int) -> None:
    import torch.distributed as dist
    from clawrl.config import compose
    from clawrl.trainers.megatron.ranks import MegatronRanks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    ranks = MegatronRanks(compose([f"model.path={model_dir}", f"model.device={device}", "train.lr=1e-6",
                                   "trainer.backend=megatron", *overrides]), model_dir)

    def step():
        assert ranks.train_step(batch, ranks.step)["ok"]
    Path(out).write_text(json.dumps(profile_step(step)))
    dist.destroy_process_group()


def profile_megatron(overrides: list[str], device: str, model_dir: str, batch: list) -> dict:
    import torch.multiprocessing as mp
    from clawrl.trainers.megatron.parity import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        mp.start_processes(_megatron_rank, args=(overrides, device, model_dir, batch, str(out), free_port()), nprocs=1,
                           join=True, start_method="spawn")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--setting", nargs="+", default=["off", "layer"], choices=(*TORCH_SETTINGS, *MEGATRON_SETTINGS))
    args = ap.parse_args()
    suite, train = _load("gpu_suite"), _load("gpu_train")
    from clawrl.config import compose
    from clawrl.embedded.tokenizer import save_tokenizer, train_tokenizer
    from clawrl.trainers.torch_trainer import TorchTrainer

    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run (--shape tiny)
    batch_n, seq, _ = train.TRAIN_SIZES[args.shape]
    batch_n = train.sequences_that_fit(batch_n, device)
    model = suite.build_model(args.shape, device)
    vocab = model.config.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        save_tokenizer(train_tokenizer(["the model has random weights"] * 8, vocab_size=300), Path(tmp), 8192)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        batch = train.samples(vocab, batch_n, seq)
        for setting in args.setting:
            if setting in MEGATRON_SETTINGS:
                overrides = MEGATRON_SETTINGS[setting]
                result = profile_megatron(overrides, device, tmp, batch)
            else:
                overrides = TORCH_SETTINGS[setting]
                trainer = TorchTrainer(compose([f"model.path={tmp}", f"model.device={device}", "train.lr=1e-6",
                                                *overrides]), tmp)

                def step():
                    assert trainer.train_step(batch, trainer.step).ok
                result = profile_step(step)
                del trainer, step
                if device == "cuda":
                    torch.cuda.empty_cache()
            report(f"{setting} ({' '.join(overrides) or 'defaults'}; {args.shape}, {batch_n} x {seq} tokens)", result)


if __name__ == "__main__":
    main()
