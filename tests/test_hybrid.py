"""Hybrid linear-attention models (Qwen3-Next, Qwen3.5 text) in the built-in engine, on tiny
random-weight directories (hybrid_testing.py), CPU fp32 against HF's own forward."""
from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from clawrl.config import EngineConfig
from clawrl.engines import delta_rule
from clawrl.engines.base import SamplingParams
from clawrl.engines.hybrid import HybridForward, is_hybrid, unsupported_reason
from clawrl.engines.loading import load_model
from clawrl.engines.ragged import Segment
from clawrl.engines.torch_engine import TorchEngine
from hybrid_testing import HYBRID_ARCHS, make_hybrid_dir

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_models")
    return {a: make_hybrid_dir(root / a, a) for a in HYBRID_ARCHS} | {
        "qwen3_next_b": make_hybrid_dir(root / "b", "qwen3_next", seed=1),
        "qwen3_next_moe": make_hybrid_dir(root / "moe", "qwen3_next", seed=2, moe=True),
        "qwen3_5_moe": make_hybrid_dir(root / "q35moe", "qwen3_5_moe", seed=3)}


@pytest.fixture(scope="module")
def loaded(dirs):
    return {k: load_model(str(d), device="cpu") for k, d in dirs.items()}


def ids_of(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


def engine_run(lm, fn, engine: dict | None = None, **cfg):
    """``fn(engine)`` on a started TorchEngine (pure-torch kernels; ``engine``: its other arguments)."""
    async def main():
        eng = TorchEngine(lm, EngineConfig(**cfg), linear_attention="torch", **(engine or {}))
        await eng.start()
        try:
            return await fn(eng)
        finally:
            await eng.shutdown()
    return asyncio.run(main())


@pytest.mark.parametrize("arch", [*HYBRID_ARCHS, "qwen3_next_moe", "qwen3_5_moe"])
def test_a_hybrid_directory_loads_and_its_ragged_forward_matches_hf(loaded, arch):
    lm = loaded[arch]
    assert lm.architecture == {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}.get(
        arch, "Qwen3NextForCausalLM")
    assert is_hybrid(lm.model) and unsupported_reason(lm.model) is None
    runner = HybridForward(lm.model, "torch")
    vocab = lm.model.config.vocab_size
    a, b = ids_of(150, vocab), ids_of(40, vocab, seed=1)  # 150 tokens: three 64-token chunks, one partial
    ref_a, ref_b = hf_logits(lm.model, a), hf_logits(lm.model, b)
    with torch.no_grad():
        sa, sb = runner.new_kv(64, 400), runner.new_kv(64, 400)
        runner.forward([Segment(sb, b[:39], [])])
        out = runner.forward([Segment(sa, a, list(range(150))), Segment(sb, b[39:], [0])])
    assert (out[:150] - ref_a).abs().max() < 1e-4  # a prefill beside a decode, each from its own state
    assert (out[150] - ref_b[39]).abs().max() < 1e-4


def test_chunked_prefill_carries_the_state_across_chunks(loaded):
    lm = loaded["qwen3_5"]
    runner = HybridForward(lm.model, "torch")
    ids = ids_of(150, lm.model.config.vocab_size, seed=3)
    ref = hf_logits(lm.model, ids)
    st = runner.new_kv(8, 400)  # also grows its attention K/V on the way
    with torch.no_grad():
        outs = [runner.forward([Segment(st, c, list(range(len(c))))])
                for c in (ids[:70], ids[70:71], ids[71:149], ids[149:])]
    out = torch.cat(outs)
    # other chunk boundaries sum in another order: fp32 rounding, amplified by the wide random weights
    assert (out - ref).abs().max() < 1e-3
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_batched_greedy_equals_solo_and_hf_with_chunked_prefill(loaded, arch):
    lm = loaded[arch]
    vocab = lm.model.config.vocab_size
    prompts = [ids_of(n, vocab, seed=10 + n) for n in (5, 23, 70, 9)]

    async def batched(eng):
        return await asyncio.gather(*(eng.generate(p, GREEDY) for p in prompts))

    async def solo(eng):
        return [await eng.generate(p, GREEDY) for p in prompts]

    together = engine_run(lm, batched, prefill_chunk_tokens=16, prefix_cache_tokens=0)
    alone = engine_run(lm, solo, prefill_chunk_tokens=4096, prefix_cache_tokens=0)
    for t, s, p in zip(together, alone, prompts):
        assert t.token_ids == s.token_ids == hf_greedy(lm.model, p, GREEDY.max_new_tokens)
        assert max(abs(x - y) for x, y in zip(t.logprobs, s.logprobs)) < 1e-3
        ref = torch.log_softmax(hf_logits(lm.model, p + s.token_ids[:-1])[len(p) - 1:], -1)
        exact = ref.gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert max(abs(x - y) for x, y in zip(s.logprobs, exact.tolist())) < 1e-4


def test_score_logprobs_are_hf_log_softmax(loaded):
    lm = loaded["qwen3_next"]
    vocab = lm.model.config.vocab_size
    prompt, resp = ids_of(30, vocab, seed=5), ids_of(12, vocab, seed=6)
    res = engine_run(lm, lambda eng: eng.score(prompt, resp, top_k=2), prefill_chunk_tokens=8)
    ref = torch.log_softmax(hf_logits(lm.model, prompt + resp)[len(prompt) - 1: -1], -1)
    exact = ref.gather(1, torch.tensor(resp)[:, None])[:, 0]
    assert max(abs(x - y) for x, y in zip(res.logprobs, exact.tolist())) < 1e-4


def test_the_prefix_cache_resumes_only_a_whole_cached_sequence(loaded, caplog):
    lm = loaded["qwen3_next"]
    vocab = lm.model.config.vocab_size
    first = ids_of(40, vocab, seed=7)

    async def turns(eng):
        a = await eng.generate(first, GREEDY)
        # the next turn extends the first request's whole sequence (its last token was never fed)
        history = first + a.token_ids[:-1]
        b = await eng.generate(history + [a.token_ids[-1]] + ids_of(6, vocab, seed=8), GREEDY)
        c = await eng.generate(first[:30] + ids_of(10, vocab, seed=9), GREEDY)  # shares only 30 tokens
        return a, b, c

    with caplog.at_level(logging.INFO, logger="clawrl.engines.torch_engine"):
        a, b, c = engine_run(lm, turns, prefix_cache_tokens=4096)
    assert any("prefix cache resumes" in r.getMessage() for r in caplog.records)
    assert b.cached_prompt_tokens == len(first) + len(a.token_ids) - 1
    assert c.cached_prompt_tokens == 0
    for r in (b, c):
        assert r.token_ids == hf_greedy(lm.model, r.prompt_ids, GREEDY.max_new_tokens)


def test_a_weight_swap_between_requests_serves_the_new_weights(loaded):
    lm, other = loaded["qwen3_next"], loaded["qwen3_next_b"]
    prompt = ids_of(20, lm.model.config.vocab_size, seed=11)
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}

    async def swap(eng):
        a = await eng.generate(prompt, GREEDY)
        await eng.update_weights(other.model.state_dict(), 1)
        b = await eng.generate(prompt, GREEDY)
        await eng.update_weights(before, 2)
        return a, b

    a, b = engine_run(lm, swap)
    assert a.token_ids == hf_greedy(lm.model, prompt, 10)
    assert b.token_ids == hf_greedy(other.model, prompt, 10) and b.weight_versions == [1] * 10


def test_the_torch_delta_rule_equals_hfs_reference_functions():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    g_ = torch.Generator().manual_seed(0)
    T, H, K, V = 150, 3, 16, 8
    q, k = torch.randn(T, H, K, generator=g_), torch.randn(T, H, K, generator=g_)
    v, s0 = torch.randn(T, H, V, generator=g_), torch.randn(H, K, V, generator=g_)
    g, beta = -torch.rand(T, H, generator=g_), torch.rand(T, H, generator=g_)
    ref, ref_s = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=s0[None],
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    kern = delta_rule.TorchDeltaRule()
    qn, kn = delta_rule.l2norm(q), delta_rule.l2norm(k)
    o, s = kern.chunk(qn, kn, v, g, beta, s0)
    assert (o - ref[0]).abs().max() < 1e-5 and (s - ref_s[0]).abs().max() < 1e-5
    state, outs = s0[None], []
    for t in range(T):  # the recurrent form, token by token, lands on the same outputs and state
        ot, state = kern.recurrent(qn[t:t + 1], kn[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        outs.append(ot)
    assert (torch.cat(outs) - ref[0]).abs().max() < 1e-5 and (state[0] - ref_s[0]).abs().max() < 1e-5
    ov, finals = kern.varlen(qn, kn, v, g, beta, [100, 50], [s0, None])
    assert (ov[:100] - o[:100]).abs().max() < 1e-5 and len(finals) == 2


def test_fla_asked_for_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(delta_rule.DeltaRuleUnavailable, match="CUDA device"):
        delta_rule.resolve("fla", torch.device("cpu"))
    assert delta_rule.resolve("auto", torch.device("cpu")).name == "torch"


def test_the_fla_adapter_passes_fla_its_layout(monkeypatch):
    """FlaDeltaRule against stand-ins with fla's signatures (HF's reference functions behind them), so
    the layout it hands the Triton kernels -- one row with ``cu_seqlens``, a state per sequence, one
    dtype for q/k/v/beta, fp32 decays -- is checked here; the kernels themselves in test_hybrid_cuda."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    def chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu):
        assert q.shape[0] == 1 and initial_state.shape[0] == len(cu_seqlens) - 1 and output_final_state
        assert q.dtype == k.dtype == v.dtype == beta.dtype and g.dtype == torch.float32
        assert scale == q.shape[-1] ** -0.5 and cu_seqlens_cpu.tolist() == cu_seqlens.tolist()
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(cu_seqlens_cpu[:-1].tolist(), cu_seqlens_cpu[1:].tolist())):
            o, f = hf.torch_chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                                   initial_state=initial_state[i: i + 1], output_final_state=True)
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, 1), torch.cat(finals)

    def recurrent(q, k, v, g, beta, scale, initial_state, output_final_state):
        assert q.shape[1] == 1 and q.dtype == v.dtype and g.dtype == torch.float32
        return hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                   output_final_state=output_final_state)

    fla = delta_rule.FlaDeltaRule.__new__(delta_rule.FlaDeltaRule)
    fla._chunk, fla._recurrent = chunk, recurrent
    ref = delta_rule.TorchDeltaRule()
    g_ = torch.Generator().manual_seed(4)
    T, H, K, V = 90, 2, 16, 8
    q, k = delta_rule.l2norm(torch.randn(T, H, K, generator=g_)), delta_rule.l2norm(torch.randn(T, H, K, generator=g_))
    v, s0 = torch.randn(T, H, V, generator=g_), torch.randn(H, K, V, generator=g_)
    g, beta = -torch.rand(T, H, generator=g_), torch.rand(T, H, generator=g_)
    a, fa = fla.varlen(q, k, v, g, beta, [30, 1, 59], [s0, None, -s0])
    b, fb = ref.varlen(q, k, v, g, beta, [30, 1, 59], [s0, None, -s0])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for x, y in zip(fa, fb):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    states = torch.stack([s0, -s0, s0 * 0.5])
    a, fa = fla.recurrent(q[:3], k[:3], v[:3], g[:3], beta[:3], states)
    b, fb = ref.recurrent(q[:3], k[:3], v[:3], g[:3], beta[:3], states)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(fa, fb, atol=1e-5, rtol=0)


def test_snapshots_taken_across_prefill_chunks_equal_a_fresh_prefill(loaded):
    lm = loaded["qwen3_5"]
    runner = HybridForward(lm.model, "torch", snapshot_tokens=32)
    ids = ids_of(100, lm.model.config.vocab_size, seed=12)
    st = runner.new_kv(64, 200)
    with torch.no_grad():
        for a, b in ((0, 40), (40, 64), (64, 100)):  # cuts at 32 (inside a chunk) and 64 (a chunk's end)
            runner.forward([Segment(st, ids[a:b], [])])
        assert sorted(st.snapshots) == [32, 64, 96]
        for at in (32, 64):
            fresh = runner.new_kv(64, 200)
            runner.forward([Segment(fresh, ids[:at], [])])
            torch.testing.assert_close(st.snapshots[at][0], fresh.conv, atol=1e-5, rtol=0)
            torch.testing.assert_close(st.snapshots[at][1], fresh.ssm, atol=1e-4, rtol=0)
        resumed = runner.new_kv(64, 200)
        resumed.copy_prefix_from(runner.cache_view(st), 70)  # 70 shared tokens: resume from 64
        assert resumed.length == 64 and sorted(resumed.snapshots) == [32, 64]
        out = runner.forward([Segment(resumed, ids[64:80], list(range(16)))])
    torch.testing.assert_close(out, hf_logits(lm.model, ids[:80])[64:], atol=1e-3, rtol=0)


def test_a_new_conversation_resumes_from_the_last_snapshot_of_a_shared_prefix(loaded, monkeypatch):
    from clawrl.engines import torch_engine

    monkeypatch.setattr(torch_engine, "SNAPSHOT_TOKENS", 32)
    lm = loaded["qwen3_next"]
    vocab = lm.model.config.vocab_size
    system = ids_of(70, vocab, seed=13)  # the same system prompt, then different users

    async def two(eng):
        a = await eng.generate(system + ids_of(20, vocab, seed=14), GREEDY)
        b = await eng.generate(system + ids_of(15, vocab, seed=15), GREEDY)
        return a, b

    a, b = engine_run(lm, two, prefix_cache_tokens=4096, prefill_chunk_tokens=48)
    assert a.cached_prompt_tokens == 0 and b.cached_prompt_tokens == 64
    for r in (a, b):
        assert r.token_ids == hf_greedy(lm.model, r.prompt_ids, GREEDY.max_new_tokens)


def test_the_cli_refuses_fla_on_cpu_in_one_line(dirs, capsys):
    from clawrl.cli import main

    assert main(["chat", "--local", "hi", f"model.path={dirs['qwen3_next']}", "model.linear_attention=fla"]) == 2
    err = capsys.readouterr().err
    assert "clawrl: linear-attention kernels 'fla' need a CUDA device" in err and "Traceback" not in err


def test_model_build_arch_hybrid_builds_a_servable_hybrid_chat_model(tmp_path, capsys):
    from clawrl import embedded_hybrid
    from clawrl.cli import main
    from clawrl.embedded import build

    assert main(["model", "build", "arch=hybrid", "--steps", "2", "--out", str(tmp_path / "h")]) == 0
    assert "clawrl-tiny-hybrid, seed 0, 2 steps" in capsys.readouterr().out
    lm = load_model(str(tmp_path / "h"), device="cpu")
    assert lm.architecture == "Qwen3NextForCausalLM" and is_hybrid(lm.model) and lm.tokenizer.chat_template
    # its cache name hashes the default recipe and its own code, and differs from the default model's
    assert embedded_hybrid.recipe_hash() != build.recipe_hash()
    assert embedded_hybrid.cache_dir(0, build.DEFAULT_STEPS).name.startswith("clawrl-tiny-hybrid-seed0-")
    assert main(["model", "build", "arch=mamba"]) == 2
    assert "arch=mamba: one of qwen3, hybrid" in capsys.readouterr().err
