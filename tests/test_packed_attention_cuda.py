"""Packed attention on CUDA (skipped without a GPU): the one-call variable-length flash path gives the
per-sequence SDPA path's outputs and gradients within bf16 rounding, sequences of unequal lengths, GQA."""
from __future__ import annotations

import pytest
import torch

from clawrl.trainers import packed_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Attn(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def test_varlen_flash_equals_one_sdpa_call_per_sequence():
    torch.manual_seed(0)
    bounds = ((0, 37), (37, 200), (200, 201), (201, 330))
    L, heads, kv, d = 330, 8, 4, 64
    q, k, v = (torch.randn(1, h, L, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (heads, kv, kv))
    grad = torch.randn(1, L, heads, d, device="cuda", dtype=torch.bfloat16)
    results = {}
    for varlen in (True, False):
        packed_attention._varlen_ok[0] = varlen
        out, _ = packed_attention.packed_attention_forward(Attn(), q, k, v, None, scaling=d ** -0.5,
                                                           clawrl_segments=bounds)
        assert packed_attention._varlen_ok[0] == varlen  # the varlen kernel ran, and did not fall back
        q.grad = k.grad = v.grad = None
        out.backward(grad)
        results[varlen] = (out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
    packed_attention._varlen_ok[0] = True
    for a, b in zip(results[True], results[False]):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
