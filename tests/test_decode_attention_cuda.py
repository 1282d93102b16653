"""The split-K Triton decode attention (skipped without a GPU and Triton): it equals a masked SDPA
over each sequence's live positions, in fp32 exactly (no TF32) and in bf16 within rounding, for
one and many splits, GQA groups and ragged lengths; a StaticDecoder step through it equals one
through SDPA, eager and replayed from a CUDA graph; and the engine with
``engine.decode_attention=triton`` decodes greedily the same batched as solo and as with SDPA."""
from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from clawrl.config import EngineConfig
from clawrl.engines import decode_attention
from clawrl.engines.base import SamplingParams
from clawrl.engines.loading import load_model
from clawrl.engines.ragged import RaggedForward, Segment
from clawrl.engines.static_decode import StaticDecoder
from clawrl.engines.torch_engine import TorchEngine
from engine_testing import make_model_dir

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and decode_attention.triton is not None),
                                reason="needs a CUDA GPU and Triton")


def reference(q, k, v, pos, scale):
    w = k.shape[2]
    visible = torch.arange(w, device=q.device)[None, :] <= pos[:, None]
    mask = torch.zeros(q.shape[0], 1, 1, w, device=q.device).masked_fill_(~visible[:, None, None, :], float("-inf"))
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale)


@pytest.mark.parametrize("b,hkv,group,d,width", [(1, 8, 2, 128, 768), (64, 8, 2, 128, 896), (5, 2, 4, 32, 200),
                                                 (3, 4, 1, 16, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_masked_sdpa(b, hkv, group, d, width, dtype):
    g = torch.Generator(device="cuda").manual_seed(b * 7 + width)
    cap = width + 100  # views of a wider arena, as the decoder passes them
    k = torch.randn(b + 1, hkv, cap, d, device="cuda", generator=g).to(dtype)[:b]
    v = torch.randn(b + 1, hkv, cap, d, device="cuda", generator=g).to(dtype)[:b]
    q = torch.randn(b, hkv, group, d, device="cuda", generator=g).to(dtype)
    pos = torch.randint(0, width, (b,), device="cuda", generator=g)
    pos[0] = width - 1  # one sequence fills the width; the others stop short (splits past them read nothing)
    pos[-1] = 0 if b > 1 else pos[-1]  # and one has a single position
    out = decode_attention.decode_attention(q, k, v, pos, d ** -0.5, width)
    assert out.shape == q.shape and out.dtype == dtype
    ref = reference(q, k[:, :, :width], v[:, :, :width], pos, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)


def test_refuses_shapes_it_cannot_run():
    q = torch.zeros(2, 2, 2, 12, device="cuda")
    kv = torch.zeros(2, 2, 64, 12, device="cuda")
    with pytest.raises(ValueError, match="power-of-two head dim"):
        decode_attention.decode_attention(q, kv, kv, torch.zeros(2, dtype=torch.long, device="cuda"), 1.0, 64)
    with pytest.raises(ValueError, match="do not fit"):
        decode_attention.decode_attention(torch.zeros(3, 2, 2, 16, device="cuda"), kv[..., :16].contiguous(),
                                          kv[..., :16].contiguous(), torch.zeros(3, dtype=torch.long), 1.0, 64)


def test_splits_cover_the_width_in_whole_blocks():
    for b, hkv, w in [(1, 8, 128), (1, 8, 5632), (8, 8, 896), (64, 8, 896), (64, 8, 64), (4, 2, 300)]:
        splits, chunk = decode_attention.splits_for(b, hkv, w)
        assert chunk % decode_attention.BLOCK_N == 0 and splits * chunk >= w > (splits - 1) * chunk
    assert decode_attention.splits_for(1, 8, 5632)[0] > decode_attention.splits_for(64, 8, 5632)[0]


def test_static_decoder_step_through_triton_equals_sdpa_fp32():
    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).cuda().eval()
    rf = RaggedForward(model)
    steps = {}
    with torch.no_grad():
        for attention, graphs in (("sdpa", False), ("triton", False), ("triton", True)):
            dec = StaticDecoder(rf, slots=8, capacity=600, graphs=graphs, attention=attention)
            assert dec.attention == attention
            for i, n in enumerate((40, 300, 9)):
                kv = rf.new_kv(n, 600)
                rf.forward([Segment(kv, [(7 * j + i) % 500 + 1 for j in range(n)], [])])
                dec.admit(i, kv, 5)
            steps[(attention, graphs)] = [dec.step([3, 4, 5]).clone() for _ in range(4)]
    for a, b, c in zip(*steps.values()):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
        torch.testing.assert_close(c, a, atol=1e-4, rtol=0)


def test_engine_with_triton_attention_greedy_batched_equals_solo_and_sdpa_fp32(tmp_path):
    lm = load_model(str(make_model_dir(tmp_path / "m", "qwen3")), device="cuda", dtype="float32")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, lm.model.config.vocab_size, (n,), generator=g).tolist() for n in (12, 30, 7, 19, 50)]
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)

    async def go(attention):
        eng = TorchEngine(lm, EngineConfig(prefill_chunk_tokens=32, max_batch_size=8, decode_attention=attention))
        await eng.start()
        try:
            assert eng.decoder.attention == attention
            solo = [await eng.generate(p, greedy) for p in prompts]
            batched = await asyncio.gather(*(eng.generate(p, greedy) for p in prompts))
            return [r.token_ids for r in solo], [r.token_ids for r in batched]
        finally:
            await eng.shutdown()

    solo, batched = asyncio.run(go("triton"))
    assert solo == batched
    assert asyncio.run(go("sdpa"))[1] == batched
