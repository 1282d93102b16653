"""Weight sync across processes on one GPU (``python benchmarks/gpu_suite.py --part sync``).

A sender process holds the model's HF-named weights on the GPU, as a megatron trainer rank on the
engine's GPU does, and streams them with ``BucketSender``; the receiving process stages them with
``BucketReceiver``, as the engine's ``BroadcastWeightSync`` does (the engine's swap itself is the
in-process figure, timed by the decode suite's engine). Timed: ``ipc`` (the payload through CUDA
IPC, device to device) against ``gloo`` (through host memory, what the megatron backend used on one
GPU before), and a raw device-to-device copy of the same bytes in one process as the floor. Every
run checks that the staged tensors equal the sent ones bit for bit (a sum of their bytes per tensor,
computed on each side). On a CPU only gloo runs (at the tiny size), so the script cannot rot.

In process (``in_process_ms``): ``InProcessWeightSync`` pushes new weights (every tensor changed,
exported as copies, as the torch trainer exports them) into a started ``TorchEngine`` serving the
model, the path a torch-backend run takes after each step. Each run's result is checked: the
engine's greedy tokens and their logprobs are those of a separate HF model holding the same
weights (teacher-forced, within bf16 tolerance).
"""
from __future__ import annotations

import asyncio
import statistics
import time

import torch
import torch.multiprocessing as mp

BUCKET_MB = 512


def weights(shapes: dict, seed: int, device: str) -> dict[str, torch.Tensor]:
    """Seeded per run, bf16 on a GPU (fp32 on CPU), drawn on the device: 1.7 B numbers drawn on the
    host took seconds a run. The receiver compares checksums sent with the result, not a copy."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return {k: torch.randn(v, generator=g, device=device).to(dtype) for k, v in shapes.items()}


def checksums(named: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: int(v.contiguous().view(-1).view(torch.uint8).to(torch.int64).sum()) for k, v in named.items()}


def _sender(endpoint_q, done_q, shapes, device, runs):
    from clawrl.weight_transport import BucketSender

    if device == "cuda":
        torch.cuda.set_device(0)
    sums = None
    for run in range(runs):
        endpoint = endpoint_q.get()
        named = weights(shapes, run, device)
        sums = checksums(named) if run == 0 else sums
        sender = BucketSender(endpoint)
        try:
            sender.send(run + 1, iter(named.items()))
            done_q.put(("ok", checksums(named)))
        except Exception as e:  # the receiver reports too; this says why the sender stopped
            done_q.put(("error", f"{type(e).__name__}: {e}"))
        finally:
            sender.close()


def cross_process(shapes: dict, device: str, backend: str, runs: int) -> list[float]:
    """Milliseconds per sync (sender start of stream to receiver staged), ``runs`` times."""
    from clawrl.weight_transport import BucketReceiver, ServedWeights, SyncEndpoint, host_store

    ctx = mp.get_context("spawn")
    endpoint_q, done_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_sender, args=(endpoint_q, done_q, shapes, device, runs), daemon=True)
    proc.start()
    store = host_store("127.0.0.1", 0, 120)
    served = ServedWeights({k: tuple(v) for k, v in shapes.items()}, frozenset(shapes))
    times = []
    try:
        for run in range(runs):
            endpoint = SyncEndpoint("127.0.0.1", store.port, run, 2, backend, 120.0, BUCKET_MB << 20)
            endpoint_q.put(endpoint)
            receiver = BucketReceiver(endpoint, 1, store, torch.device(device) if backend != "gloo" else None)
            started = time.perf_counter()
            staged = receiver.receive(run + 1, served)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - started) * 1000.0)
            status, sent = done_q.get(timeout=120)
            assert status == "ok", sent
            got = checksums(staged)
            assert got == sent, f"{backend}: staged weights differ from the sent ones"
            receiver.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return times


def raw_copy_ms(shapes: dict, device: str, runs: int) -> float:
    named = weights(shapes, 0, device)
    out = []
    for _ in range(runs):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        _ = {k: v.clone() for k, v in named.items()}
        if device == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1000.0)
    return statistics.median(out)


class NewWeights:
    """A trainer's side of an in-process sync after a step: ``export_weights`` returns copies, as
    ``TorchTrainer.export_weights`` does, of weights unlike the served ones."""

    def __init__(self, named: dict[str, torch.Tensor]):
        self.named = named

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.named.items()}


def matches_reference(model, prompt: list[int], served, tol: float) -> bool:
    """The served greedy tokens are the reference's argmax (or within ``tol`` of it: bf16 near-ties)
    at every position, teacher-forced, and their logprobs are the reference's within ``tol``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + served.token_ids], device=model.device)).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    picked = lp[torch.arange(len(served.token_ids)), torch.tensor(served.token_ids, device=lp.device)]
    return bool((lp.max(-1).values - picked).max() <= tol
                and (picked.cpu() - torch.tensor(served.logprobs)).abs().max() <= tol)


async def _in_process(build_model, serve, shape: str, device: str, runs: int) -> tuple[list[float], list[bool]]:
    from clawrl.config import compose
    from clawrl.engines.base import SamplingParams
    from clawrl.engines.torch_engine import TorchEngine
    from clawrl.weight_sync import InProcessWeightSync

    engine = TorchEngine(serve(build_model(shape, device)), compose([]).engine)
    reference = build_model(shape, device)
    shapes = {k: tuple(v.shape) for k, v in reference.state_dict().items()
              if k != "lm_head.weight" or not reference.config.tie_word_embeddings}
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [11, 12, 13, 14, 15]
    await engine.start()
    times, checks = [], []
    try:
        sync = InProcessWeightSync(engine)
        for run in range(runs):
            # unlike the served ones (and each run's predecessor), at the scale of HF's initialisation
            named = {k: v * 0.02 for k, v in weights(shapes, 100 + run, device).items()}
            times.append(await sync.push(NewWeights(named), sync.version + 1))
            reference.load_state_dict(named, strict=False)
            served = await engine.generate(prompt, greedy)
            checks.append(matches_reference(reference, prompt, served, 0.05 if device == "cuda" else 1e-4))
    finally:
        await engine.shutdown()
    return times, checks


def run_sync(build_model, shape: str, device: str, runs: int = 3, serve=None) -> dict:
    model = build_model(shape, "meta")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"
              or not model.config.tie_word_embeddings}
    nbytes = sum(torch.Size(s).numel() for s in shapes.values()) * (2 if device == "cuda" else 4)
    out = {"bytes": nbytes, "tensors": len(shapes), "bucket_mb": BUCKET_MB,
           "raw_copy_ms": raw_copy_ms(shapes, device, runs)}
    for backend in (("ipc", "gloo") if device == "cuda" else ("gloo",)):
        # On a GPU gloo is the old path, kept as the baseline: one run of it (seconds each) is enough.
        times = cross_process(shapes, device, backend, 1 if backend == "gloo" and device == "cuda" else runs)
        out[backend] = {"ms": statistics.median(times), "runs_ms": times}
        print(f"sync over {backend}: {statistics.median(times):.0f} ms for {nbytes / 2**30:.2f} GiB "
              f"(runs {[round(t) for t in times]}); raw copy {out['raw_copy_ms']:.1f} ms", flush=True)
    out["cross_process_ms"] = out["ipc" if device == "cuda" else "gloo"]["ms"]
    if serve is not None:
        times, checks = asyncio.run(_in_process(build_model, serve, shape, device, runs))
        out["in_process"] = {"ms": statistics.median(times), "runs_ms": times, "served_equals_reference": checks}
        out["in_process_ms"] = out["in_process"]["ms"]
        print(f"sync in process (InProcessWeightSync into a started TorchEngine): {out['in_process_ms']:.0f} ms "
              f"(runs {[round(t) for t in times]}); served greedy tokens and logprobs equal the reference's: "
              f"{checks}", flush=True)
        if not all(checks):
            raise RuntimeError("after an in-process sync the engine's output differs from the reference model's")
    return out
