"""Hybrid linear-attention models on CUDA with flash-linear-attention (skipped without a GPU or
without fla, ``pip install 'clawrl[fla]'``): fla's Triton kernels agree with the pure-torch delta
rule (chunked, variable-length with per-sequence states, recurrent), the engine's ragged forward
on fla matches its torch path and HF's forward, a fla engine's batched greedy equals its solo
greedy (both in the CUDA-graph static decoder) and the ragged path's, the static decoder's captured
step (fla's recurrent kernel inside the graph) replays its eager step, and the trainer takes a step
on the GPU (on fla, or on torch where fla refuses its backward)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from clawrl.config import EngineConfig
from clawrl.engines import delta_rule
from clawrl.engines.base import SamplingParams
from clawrl.engines.hybrid import HybridForward
from clawrl.engines.loading import load_model
from clawrl.engines.ragged import Segment
from clawrl.engines.static_decode import StaticDecoder
from clawrl.engines.torch_engine import TorchEngine
from hybrid_testing import HYBRID_ARCHS, make_hybrid_dir

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(delta_rule.fla_available() is not None,
                       reason=f"flash-linear-attention does not import: {delta_rule.fla_available()}"),
]


def inputs(T: int, H: int = 4, K: int = 64, V: int = 64, dtype=torch.float32, seed: int = 0):
    g_ = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", generator=g_)
    q = delta_rule.l2norm(torch.randn(T, H, K, **kw)).to(dtype)
    k = delta_rule.l2norm(torch.randn(T, H, K, **kw)).to(dtype)
    v = torch.randn(T, H, V, **kw).to(dtype)
    g = -torch.rand(T, H, **kw) * 0.5  # log decays, fp32 as the model makes them
    beta = torch.rand(T, H, **kw).to(dtype)
    return q, k, v, g, beta


# fla may use TF32 in its fp32 dots and keeps bf16 intermediates for bf16 inputs; a wrong layout
# (heads, states, sequence bounds) would be off by O(1), far outside these tolerances
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 5e-2)])
def test_fla_kernels_agree_with_the_pure_torch_delta_rule(dtype, tol):
    fla, ref = delta_rule.resolve("fla", torch.device("cuda")), delta_rule.TorchDeltaRule()
    assert fla.name == "fla"
    q, k, v, g, beta = inputs(300, dtype=dtype)
    s0 = torch.randn(4, 64, 64, device="cuda") * 0.1
    o_f, s_f = fla.chunk(q, k, v, g, beta, s0)
    o_t, s_t = ref.chunk(q, k, v, g, beta, s0)
    torch.testing.assert_close(o_f, o_t, atol=tol, rtol=tol)
    torch.testing.assert_close(s_f, s_t, atol=tol, rtol=tol)
    lens = [100, 1, 199]  # three sequences in one launch, each from its own state (one from zeros)
    states = [s0, None, s0 * -1]
    o_f, f_f = fla.varlen(q, k, v, g, beta, lens, states)
    o_t, f_t = ref.varlen(q, k, v, g, beta, lens, states)
    torch.testing.assert_close(o_f, o_t, atol=tol, rtol=tol)
    for a, b in zip(f_f, f_t):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    # one decode token of 5 sequences
    B = torch.stack([s0] * 5) + 0.01 * torch.arange(5, device="cuda")[:, None, None, None]
    o_f, s_f = fla.recurrent(q[:5], k[:5], v[:5], g[:5], beta[:5], B)
    o_t, s_t = ref.recurrent(q[:5], k[:5], v[:5], g[:5], beta[:5], B)
    torch.testing.assert_close(o_f, o_t, atol=tol, rtol=tol)
    torch.testing.assert_close(s_f.float(), s_t, atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_cuda")
    # std 0.1 for the logit comparisons (smaller logits, so an absolute tolerance means more); the
    # greedy test's model has engine_testing's wider 0.25, so its next tokens are no near-ties
    return {a: make_hybrid_dir(root / a, a, std=0.1) for a in HYBRID_ARCHS} | {
        "peaked": make_hybrid_dir(root / "peaked", "qwen3_next", std=0.25)}


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_the_ragged_forward_on_fla_matches_torch_and_hf_in_fp32(dirs, arch):
    lm = load_model(str(dirs[arch]), device="cuda", dtype="float32")
    on_fla, on_torch = HybridForward(lm.model, "fla"), HybridForward(lm.model, "torch")
    g_ = torch.Generator().manual_seed(1)
    a, b = (torch.randint(3, lm.model.config.vocab_size, (n,), generator=g_).tolist() for n in (150, 40))
    with torch.no_grad():
        ref_a = lm.model(torch.tensor([a], device="cuda")).logits[0].float()
        outs = {}
        for name, r in (("fla", on_fla), ("torch", on_torch)):
            sa, sb = r.new_kv(64, 400), r.new_kv(64, 400)
            first = r.forward([Segment(sa, a[:100], list(range(100))), Segment(sb, b[:39], [])])
            second = r.forward([Segment(sa, a[100:], list(range(50))), Segment(sb, b[39:], [0])])
            outs[name] = torch.cat([first, second[:50]])
    torch.testing.assert_close(outs["fla"], outs["torch"], atol=1e-2, rtol=0)
    torch.testing.assert_close(outs["fla"], ref_a, atol=1e-2, rtol=0)  # HF's forward runs fla too, unchunked


def test_a_fla_engine_greedy_is_the_same_batched_or_alone(dirs):
    lm = load_model(str(dirs["peaked"]), device="cuda", dtype="float32")
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    g_ = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, lm.model.config.vocab_size, (n,), generator=g_).tolist() for n in (7, 90, 33)]

    health = {}

    async def main(batched: bool, static: bool = True):
        eng = TorchEngine(lm, EngineConfig(prefill_chunk_tokens=32 if batched else 4096), linear_attention="fla",
                          static_decode=static)
        await eng.start()
        try:
            if batched:
                return await asyncio.gather(*(eng.generate(p, params) for p in prompts))
            return [await eng.generate(p, params) for p in prompts]
        finally:
            health[(batched, static)] = (await eng.health())["static_decode"]
            await eng.shutdown()
    together, alone, ragged = asyncio.run(main(True)), asyncio.run(main(False)), asyncio.run(main(False, False))
    for t, s, r in zip(together, alone, ragged):
        assert t.token_ids == s.token_ids == r.token_ids
    # the static decoder, its step captured as CUDA graphs, decoded the first two; the ragged path the third
    assert health[(True, True)]["graphs"] and health[(True, True)]["captures"] >= 1
    assert health[(False, False)] is None


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_the_hybrid_decode_graph_replays_the_eager_step_fp32(dirs, arch):
    """Captured (graphs=True) against eager (graphs=False) static decoders over the same states: the
    same logits at several batch and width buckets, after a slot leaves, and after a weight copied in
    place; every graph captured (none left to run eagerly), fla's recurrent kernel inside it."""
    lm = load_model(str(dirs[arch]), device="cuda", dtype="float32")
    runner = HybridForward(lm.model, "fla")
    vocab = lm.model.config.vocab_size
    g_ = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, vocab, (n,), generator=g_).tolist() for n in (120, 9, 30)]
    owners = [object() for _ in prompts]  # matched by identity
    graphed = StaticDecoder(runner, slots=4, capacity=512, graphs=True)
    eager = StaticDecoder(runner, slots=4, capacity=512, graphs=False)
    with torch.no_grad():
        for dec in (graphed, eager):
            states = [runner.new_kv(64, 512) for _ in prompts]
            runner.forward([Segment(s, p, []) for s, p in zip(states, prompts)])
            for owner, s in zip(owners, states):
                dec.admit(owner, s)
        for step in range(12):  # 3 live (bucket 4, a padding row); the first prompt crosses width 128 to 256
            nxt = torch.randint(3, vocab, (3,), generator=g_).tolist()
            torch.testing.assert_close(graphed.step(nxt).clone(), eager.step(nxt).clone(), atol=1e-4, rtol=0)
        graphed.release(owners[1])  # the third moves into the second's slot; 2 members: bucket 2
        eager.release(owners[1])
        for nxt in ([5, 6], [7, 8]):
            torch.testing.assert_close(graphed.step(nxt).clone(), eager.step(nxt).clone(), atol=1e-4, rtol=0)
        w = lm.model.model.norm.weight
        w.copy_(w * 0.5)  # in place, as TorchEngine._update_weights does
        graphed.check_weights()
        eager.check_weights()
        torch.testing.assert_close(graphed.step([9, 10]).clone(), eager.step([9, 10]).clone(), atol=1e-4, rtol=0)
    assert graphed.captures >= 3 and all(graph is not None for graph in graphed._graphs.values()), graphed._graphs


def test_the_trainer_steps_a_hybrid_model_on_the_gpu(dirs):
    """On fla where fla trains on this GPU; on HF's torch delta rule where fla refuses its gated
    chunk backward (Hopper with Triton 3.4-3.7.0, fla issue #640: the H100/H200 images' case),
    where asking for fla is refused up front instead of crashing in the first backward."""
    from clawrl.config import compose
    from clawrl.samples import Sample
    from clawrl.trainers.linear_attention import fla_backward_refusal
    from clawrl.trainers.torch_trainer import TorchTrainer

    refusal = fla_backward_refusal()
    if refusal is not None:
        with pytest.raises(delta_rule.DeltaRuleUnavailable, match="cannot train here"):
            TorchTrainer(compose(["model.device=cuda", "model.linear_attention=fla"]), str(dirs["qwen3_5"]))
    trainer = TorchTrainer(compose(["model.device=cuda", "train.lr=1e-3"]), str(dirs["qwen3_5"]))
    assert trainer.linear_kernels == ("fla" if refusal is None else "torch")
    g_ = torch.Generator().manual_seed(3)
    samples = []
    for i, (p, r) in enumerate(((20, 80), (9, 140))):
        ids = torch.randint(3, trainer.vocab_size, (p + r,), generator=g_).tolist()
        samples.append(Sample(sample_id=i, turn_id=i, group_id="g", prompt_ids=ids[:p], response_ids=ids[p:],
                              rollout_logprobs=[0.0] * r, weight_versions=[0] * r, reward=1.0, advantage=1.0))
    for s, lps in zip(samples, trainer.logprobs(samples)):
        s.rollout_logprobs = lps
    before = [sum(x) for x in trainer.logprobs(samples)]
    result = trainer.train_step(samples, 0)
    assert result.ok
    after = [sum(x) for x in trainer.logprobs(samples)]
    assert all(a > b for a, b in zip(after, before))
