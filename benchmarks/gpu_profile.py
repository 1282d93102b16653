"""Where a GPU decode step and a long prefill spend their time (the figures behind BENCHMARKS.md's
"Where the time goes" for issue 15). Needs a CUDA GPU; builds the model as gpu_suite.py does.

1. Prefill of the OpenClaw request: HF's single forward, the ragged forward in 2048-token chunks and
   in one, the GPU time of each chunk, and the host time to queue one chunk.
2. Decode floor: a StaticDecoder's captured step replayed alone, and launched back to back with
   its sampling, at 1, 8 and 64 sequences of 600 tokens, with the Triton split-K decode attention
   and with SDPA.
3. Decode attention at 1 and 64 sequences through SDPA's backends, a plain matmul-softmax-matmul
   and the Triton split-K kernel (``clawrl.engines.decode_attention``).
4. How many kernels one 1-sequence decode step launches, and which.

    python benchmarks/gpu_profile.py [--shape qwen3-1.7b] [--tokenizer DIR]
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from clawrl.engines import decode_attention
from clawrl.engines.ragged import RaggedForward, Segment
from clawrl.engines.static_decode import StaticDecoder

_spec = importlib.util.spec_from_file_location("gpu_suite", Path(__file__).with_name("gpu_suite.py"))
suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite)


def median_ms(fn, n: int = 3) -> tuple[float, list[float]]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(round((time.perf_counter() - t) * 1000, 2))
    return statistics.median(out), out


def prefill(model, rf: RaggedForward, prompt: list[int]) -> None:
    ids = torch.tensor([prompt], device="cuda")
    print("HF single forward ms (median, runs):", median_ms(lambda: model(input_ids=ids, logits_to_keep=1), 4))

    def chunks(size: int, events=None):
        kv = rf.new_kv(len(prompt), len(prompt) + 8)
        for s in range(0, len(prompt), size):
            part = prompt[s: s + size]
            if events is not None:
                events.append(torch.cuda.Event(enable_timing=True))
                events[-1].record()
            rf.forward([Segment(kv, part, [len(part) - 1] if s + size >= len(prompt) else [])])
        if events is not None:
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()

    for size in (2048, 16384):
        print(f"ragged forward in {size}-token chunks ms:", median_ms(lambda: chunks(size)))
    events: list = []
    chunks(2048, events)
    torch.cuda.synchronize()
    print("GPU ms per 2048-token chunk:", [round(a.elapsed_time(b), 1) for a, b in zip(events, events[1:])])
    kv = rf.new_kv(len(prompt), len(prompt) + 8)
    torch.cuda.synchronize()
    t = time.perf_counter()
    rf.forward([Segment(kv, prompt[:2048], [])])
    queued = time.perf_counter() - t
    torch.cuda.synchronize()
    print(f"host time to queue one 2048-token chunk {queued * 1000:.1f} ms, "
          f"with its GPU work {(time.perf_counter() - t) * 1000:.1f} ms")


def decode_floor(rf: RaggedForward, vocab: int) -> None:
    for attention, b in [(a, b) for a in ("triton", "sdpa") for b in (1, 8, 64)]:
        dec = StaticDecoder(rf, slots=64, capacity=1024, graphs=True, attention=attention)
        for i in range(b):
            kv = rf.new_kv(600, 1024)
            rf.forward([Segment(kv, torch.randint(0, vocab, (600,)).tolist(), [])])
            dec.admit(i, kv, 5)
        dec.launch().read()
        dec.launch().read()  # captured by now
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            last = dec.launch()
        last.read()
        per_step = (time.perf_counter() - t) / 50
        graph = next(g for g in dec._graphs.values() if g is not None)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        replay = (time.perf_counter() - t) / 50
        print(f"{attention}: {b} sequences: launch() back to back {per_step * 1000:.2f} ms/step ({b / per_step:.0f} tok/s); "
              f"graph replay alone {replay * 1000:.2f} ms")


def attention_backends(kv_heads: int, group: int, dim: int) -> None:
    for b in (1, 64):
        width = 768
        k = torch.randn(b, kv_heads, 1024, dim, device="cuda", dtype=torch.bfloat16)[:, :, :width]
        v = torch.randn(b, kv_heads, 1024, dim, device="cuda", dtype=torch.bfloat16)[:, :, :width]
        q = torch.randn(b, kv_heads, group, dim, device="cuda", dtype=torch.bfloat16)
        visible = torch.arange(width, device="cuda")[None] <= torch.full((b,), 700, device="cuda")[:, None]
        mask = torch.zeros(b, 1, 1, width, device="cuda", dtype=torch.bfloat16).masked_fill_(
            ~visible[:, None, None, :], float("-inf"))

        def manual():
            s = torch.matmul(q, k.transpose(-1, -2)).float() * dim ** -0.5 + mask
            return torch.matmul(torch.softmax(s, -1).to(q.dtype), v)

        def backend(be):
            def run():
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return run

        ref = manual()
        pos = torch.full((b,), 700, device="cuda")
        for name, fn in [("triton split-K (live 701 positions)",
                          lambda: decode_attention.decode_attention(q, k, v, pos, dim ** -0.5, width)),
                         ("default", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
                         ("efficient", backend(SDPBackend.EFFICIENT_ATTENTION)),
                         ("cudnn", backend(SDPBackend.CUDNN_ATTENTION)), ("matmul-softmax-matmul", manual)]:
            try:
                err = float((fn().float() - ref.float()).abs().max())
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(28):
                        fn()
                g.replay()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(20):
                    g.replay()
                torch.cuda.synchronize()
                print(f"attention, {b} sequences x {width}, {name}: "
                      f"{(time.perf_counter() - t) / 20 / 28 * 1e6:.1f} us per layer (max diff {err:.1e})")
            except RuntimeError as e:
                print(f"attention, {b} sequences, {name}: not available ({str(e)[:100]})")


def kernel_count(rf: RaggedForward) -> None:
    """The kernels of one eager decode step at 1 sequence (how many, which) and at 64 (GPU time by
    kernel: what the captured step spends its time on)."""
    for b in (1, 64):
        dec = StaticDecoder(rf, slots=64, capacity=1024, graphs=False)
        kv = rf.new_kv(600, 1024)
        rf.forward([Segment(kv, list(range(600)), [])])
        for i in range(b):
            dec.admit(i, kv, 5)
        dec._forward(b, 768)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec._forward(b, 768)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"kernels in one {b}-sequence decode step ({dec.attention} attention): {len(kernels)}")
        print(collections.Counter(e.name[:60] for e in kernels).most_common(12))
        by_name = collections.Counter()
        for e in kernels:
            by_name[e.name[:70]] += e.device_time_total
        print(f"GPU time of that step by kernel, us (total {sum(by_name.values()):.0f}):",
              [(n, round(t)) for n, t in by_name.most_common(10)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(suite.SHAPES), default="qwen3-1.7b")
    ap.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: the embedded model's)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    model = suite.build_model(args.shape, "cuda")
    rf = RaggedForward(model)
    _, prompt = suite.openclaw_prompts(args.tokenizer, 0)
    cfg = model.config
    with torch.inference_mode():
        prefill(model, rf, prompt)
        decode_floor(rf, cfg.vocab_size)
        attention_backends(cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads,
                           cfg.head_dim)
        kernel_count(rf)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
