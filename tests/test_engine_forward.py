"""The ragged forward (chunked prefill at offsets, several sequences per step) computes the same
logits as HF's own forward, for each Llama-family variant it claims; other architectures serve
through the generic HF path."""
from __future__ import annotations

import asyncio

import pytest
import torch

from clawrl.config import EngineConfig
from clawrl.engines.base import SamplingParams
from clawrl.engines.loading import load_model
from clawrl.engines.ragged import RaggedForward, Segment, unsupported_reason
from clawrl.engines.torch_engine import TorchEngine
from engine_testing import make_model_dir


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "mistral"])
def test_ragged_forward_matches_hf_logits(tmp_path, arch):
    lm = load_model(str(make_model_dir(tmp_path / arch, arch)), device="cpu")
    model = lm.model
    assert unsupported_reason(model) is None
    rf = RaggedForward(model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (37, 5, 20)]
    with torch.no_grad():
        ref = [model(torch.tensor([s])).logits[0].float() for s in seqs]
        kvs = [rf.new_kv(4, 64) for _ in seqs]  # tiny capacity: buffers must grow mid-sequence
        step1 = rf.forward([Segment(kvs[0], seqs[0][:10], list(range(10))),
                            Segment(kvs[1], seqs[1], list(range(5))),
                            Segment(kvs[2], seqs[2][:7], [6])])
        step2 = rf.forward([Segment(kvs[0], seqs[0][10:30], list(range(20))),
                            Segment(kvs[2], seqs[2][7:], list(range(13)))])
        step3 = rf.forward([Segment(kvs[0], [t], [0]) for t in seqs[0][30:31]]
                           + [Segment(kvs[1], [seqs[0][0]], [0])])
    tol = dict(atol=1e-4, rtol=0)
    torch.testing.assert_close(step1[:10], ref[0][:10], **tol)
    torch.testing.assert_close(step1[10:15], ref[1], **tol)
    torch.testing.assert_close(step1[15], ref[2][6], **tol)
    torch.testing.assert_close(step2[:20], ref[0][10:30], **tol)
    torch.testing.assert_close(step2[20:], ref[2][7:], **tol)
    torch.testing.assert_close(step3[0], ref[0][30], **tol)
    with torch.no_grad():
        extended = model(torch.tensor([seqs[1] + [seqs[0][0]]])).logits[0, -1].float()
    torch.testing.assert_close(step3[1], extended, **tol)
    assert [kv.length for kv in kvs] == [31, 6, 20]


def test_unsupported_architecture_serves_through_generic_hf_path(tmp_path):
    lm = load_model(str(make_model_dir(tmp_path / "gpt2", "gpt2")), device="cpu")
    assert "gpt2" in unsupported_reason(lm.model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, lm.model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 14)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)

    async def go():
        eng = TorchEngine(lm, EngineConfig(prefill_chunk_tokens=4))
        await eng.start()
        try:
            return eng, await asyncio.gather(*(eng.generate(p, params) for p in prompts))
        finally:
            await eng.shutdown()

    eng, results = asyncio.run(go())
    assert not eng.model_info().extra["ragged"]
    for p, r in zip(prompts, results):
        ids = list(p)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(lm.model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert r.token_ids == ids[len(p):]


def test_sliding_window_models_take_the_generic_path():
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=64, max_position_embeddings=8192)
    windowed = AutoModelForCausalLM.from_config(MistralConfig(sliding_window=1024, **small))
    assert "sliding-window" in unsupported_reason(windowed)
    unreachable = AutoModelForCausalLM.from_config(MistralConfig(sliding_window=8192, **small))
    assert unsupported_reason(unreachable) is None  # the window never binds within the context
    qwen2 = AutoModelForCausalLM.from_config(Qwen2Config(use_sliding_window=True, sliding_window=512,
                                                         max_window_layers=1, **small))
    assert "sliding-window" in unsupported_reason(qwen2)


def test_batched_decode_writes_back_every_sequences_own_kv(tmp_path):
    lm = load_model(str(make_model_dir(tmp_path / "q", "qwen3")), device="cpu")
    rf = RaggedForward(lm.model)
    g = torch.Generator().manual_seed(2)
    vocab = lm.model.config.vocab_size
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (11, 4, 7)]
    steps = [torch.randint(0, vocab, (3,), generator=g).tolist() for _ in range(6)]
    with torch.no_grad():
        kvs = [rf.new_kv(8, 64) for _ in seqs]
        rf.forward([Segment(kv, s, []) for kv, s in zip(kvs, seqs)])
        for toks in steps:  # one token each: the padded decode batch
            rf.forward([Segment(kv, [t], [0]) for kv, t in zip(kvs, toks)])
        rf.sync()
        reference = RaggedForward(lm.model)  # its own decode batch: rf's stays untouched
        for i, (kv, s) in enumerate(zip(kvs, seqs)):
            full = s + [toks[i] for toks in steps]
            fresh = reference.new_kv(64, 64)
            reference.forward([Segment(fresh, full, [])])
            assert kv.length == fresh.length == len(full)
            for (k, v), (fk, fv) in zip(kv.layers, fresh.layers):
                torch.testing.assert_close(k[: len(full)], fk[: len(full)], atol=1e-4, rtol=0)
                torch.testing.assert_close(v[: len(full)], fv[: len(full)], atol=1e-4, rtol=0)
