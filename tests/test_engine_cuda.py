"""The engine on CUDA (skipped without a GPU): the ragged forward matches HF in fp32, and in bf16
batched decoding, seeded sampling and score-vs-generate logprobs stay consistent."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from clawrl.config import EngineConfig
from clawrl.engines.base import SamplingParams
from clawrl.engines.loading import load_model
from clawrl.engines.ragged import RaggedForward, Segment
from clawrl.engines.static_decode import StaticDecoder
from clawrl.engines.torch_engine import TorchEngine
from engine_testing import make_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("cuda") / "m", "qwen3")


def test_ragged_forward_matches_hf_on_cuda_fp32(model_dir):
    lm = load_model(str(model_dir), device="cuda", dtype="float32")
    rf = RaggedForward(lm.model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, lm.model.config.vocab_size, (n,), generator=g).tolist() for n in (40, 9)]
    with torch.no_grad():
        ref = [lm.model(torch.tensor([s], device="cuda")).logits[0].float() for s in seqs]
        kvs = [rf.new_kv(8, 64) for _ in seqs]
        a = rf.forward([Segment(kvs[0], seqs[0][:25], list(range(25))), Segment(kvs[1], seqs[1][:8], [7])])
        b = rf.forward([Segment(kvs[0], seqs[0][25:], list(range(15))), Segment(kvs[1], seqs[1][8:], [0])])
    torch.testing.assert_close(a[:25], ref[0][:25], atol=1e-3, rtol=0)
    torch.testing.assert_close(a[25], ref[1][7], atol=1e-3, rtol=0)
    torch.testing.assert_close(b[:15], ref[0][25:], atol=1e-3, rtol=0)
    torch.testing.assert_close(b[15], ref[1][8], atol=1e-3, rtol=0)


def test_engine_serves_bf16_on_cuda_consistently(model_dir):
    lm = load_model(str(model_dir), device="cuda")
    assert lm.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, lm.model.config.vocab_size, (n,), generator=g).tolist() for n in (12, 30, 7, 19)]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)

    async def go():
        eng = TorchEngine(lm, EngineConfig(prefill_chunk_tokens=16))
        await eng.start()
        try:
            solo = [await eng.generate(p, greedy) for p in prompts]
            batched = await asyncio.gather(*(eng.generate(p, greedy) for p in prompts))
            s1 = await eng.generate(prompts[0], seeded)
            s2 = (await asyncio.gather(eng.generate(prompts[0], seeded), eng.generate(prompts[1], greedy)))[0]
            await eng.flush_cache()
            sc = await eng.score(prompts[0], s1.token_ids)
            return solo, batched, s1, s2, sc
        finally:
            await eng.shutdown()

    solo, batched, s1, s2, sc = asyncio.run(go())
    same = sum(a.token_ids == b.token_ids for a, b in zip(solo, batched))
    print(f"cuda bf16: {same} of {len(solo)} prompts decode identically batched and solo")
    assert same >= len(solo) - 1  # bf16 near-ties may flip one
    assert s1.token_ids == s2.token_ids
    assert sc.logprobs == pytest.approx(s1.logprobs, abs=5e-2)  # bf16 KV: prefill vs decode rounding


def test_graph_decode_matches_eager_and_hf_fp32(model_dir):
    """The captured decode step gives the eager step's logits (and HF's) at several batch and
    width buckets, and a weight copied in place is read by the replayed graph."""
    lm = load_model(str(model_dir), device="cuda", dtype="float32")
    rf = RaggedForward(lm.model)
    g = torch.Generator().manual_seed(2)
    vocab = lm.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (250, 9, 30)]
    graphed = StaticDecoder(rf, slots=4, capacity=512, graphs=True)
    eager = StaticDecoder(rf, slots=4, capacity=512, graphs=False)
    with torch.no_grad():
        for dec in (graphed, eager):
            kvs = [rf.new_kv(8, 512) for _ in prompts]
            rf.forward([Segment(kv, p, []) for kv, p in zip(kvs, prompts)])
            for p, kv in zip(prompts, kvs):
                dec.admit(p, kv)
        seqs = [list(p) for p in prompts]
        for step in range(10):  # crosses the 256-wide bucket to 512 for the first prompt
            nxt = [int(torch.randint(3, vocab, (1,), generator=g)) for _ in seqs]
            a, b = graphed.step(nxt).clone(), eager.step(nxt).clone()
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
            for s, t in zip(seqs, nxt):
                s.append(t)
        ref = torch.stack([lm.model(torch.tensor([s], device="cuda")).logits[0, -1].float() for s in seqs])
        torch.testing.assert_close(a, ref, atol=1e-3, rtol=0)
        assert graphed.captures >= 2
        graphed.release(prompts[1])  # 2 members now: a smaller batch bucket
        eager.release(prompts[1])
        torch.testing.assert_close(graphed.step([5, 6]).clone(), eager.step([5, 6]).clone(), atol=1e-4, rtol=0)
        w = lm.model.model.norm.weight
        w.copy_(w * 0.5)  # in place, as TorchEngine._update_weights does
        torch.testing.assert_close(graphed.step([7, 8]).clone(), eager.step([7, 8]).clone(), atol=1e-4, rtol=0)


def test_graphs_are_captured_while_another_thread_trains_on_the_gpu(model_dir):
    """A trainer sharing the GPU from another thread allocates (cudaMalloc) while the engine captures
    decode graphs: neither fails (under the default "global" capture mode both did, and the train
    step's samples were lost)."""
    lm = load_model(str(model_dir), device="cuda", dtype="float32")
    rf = RaggedForward(lm.model)
    vocab = lm.model.config.vocab_size
    errors, stop = [], threading.Event()

    def train():
        n = 1
        try:
            while not stop.is_set():
                n = n % 64 + 1  # new sizes: the caching allocator keeps asking the driver for memory
                # no random numbers: the CUDA generator belongs to the capture while one runs (a trainer
                # with dropout would still fail then; clawrl's trainers run without it by default)
                w = torch.linspace(-1, 1, 256 * n * 256, device="cuda").view(256 * n, 256).requires_grad_()
                (w @ w.T).square().mean().backward()
                float(w.grad.sum())  # a host sync, as a train step's loss.item()
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(f"{type(e).__name__}: {e}")

    worker = threading.Thread(target=train)
    worker.start()
    try:
        dec = StaticDecoder(rf, slots=8, capacity=1024, graphs=True)
        with torch.no_grad():
            for n in range(1, 9):  # a new batch bucket (a capture) for each admitted prompt
                kv = rf.new_kv(8, 1024)
                prompt = [3 + n] * (20 * n)
                rf.forward([Segment(kv, prompt, [])])
                dec.admit(prompt, kv)
                dec.step([5] * n)
    finally:
        stop.set()
        worker.join()
    assert not errors, errors[:1]
    assert dec.captures >= 4 and all(g is not None for g in dec._graphs.values()), dec._graphs


def test_engine_graph_decode_greedy_batched_equals_solo_fp32(model_dir):
    lm = load_model(str(model_dir), device="cuda", dtype="float32")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, lm.model.config.vocab_size, (n,), generator=g).tolist() for n in (12, 30, 7, 19, 50)]
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)

    async def go():
        eng = TorchEngine(lm, EngineConfig(prefill_chunk_tokens=32, max_batch_size=8))
        await eng.start()
        try:
            solo = [await eng.generate(p, greedy) for p in prompts]
            batched = await asyncio.gather(*(eng.generate(p, greedy) for p in prompts))
            return solo, batched, await eng.health()
        finally:
            await eng.shutdown()

    solo, batched, health = asyncio.run(go())
    assert health["static_decode"]["graphs"] and health["static_decode"]["captures"] >= 2
    assert [r.token_ids for r in solo] == [r.token_ids for r in batched]


def test_generate_logprobs_match_a_forward_pass_bf16(model_dir):
    """bf16, graphs on: each sampled token's logprob is the one a trainer's forward over prompt +
    response gives (within 1e-3)."""
    lm = load_model(str(model_dir), device="cuda")
    assert lm.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, lm.model.config.vocab_size, (n,), generator=g).tolist() for n in (40, 17, 64)]
    params = SamplingParams(max_new_tokens=32, temperature=1.0, seed=3, ignore_eos=True)

    async def go():
        eng = TorchEngine(lm, EngineConfig())
        await eng.start()
        try:
            return await asyncio.gather(*(eng.generate(p, params) for p in prompts))
        finally:
            await eng.shutdown()

    worst = 0.0
    with torch.no_grad():
        for p, r in zip(prompts, asyncio.run(go())):
            logits = lm.model(torch.tensor([p + r.token_ids], device="cuda")).logits[0].float()
            lp = torch.log_softmax(logits[len(p) - 1: -1], dim=-1)
            ref = lp.gather(1, torch.tensor(r.token_ids, device="cuda")[:, None])[:, 0]
            worst = max(worst, float((ref - torch.tensor(r.logprobs, device="cuda")).abs().max()))
    print(f"bf16 generate vs forward logprobs: max abs diff {worst:.2e}")
    assert worst <= 1e-3
