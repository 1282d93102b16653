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



def test_the_attention_operator_compiled_equals_the_eager_per_sequence_path():
    """``causal_within`` inside a compiled function (one operator to dynamo, with the varlen flash
    kernels forward and backward behind it) gives the eager per-sequence SDPA path's outputs and
    gradients; other lengths and another sequence count reuse the graph."""
    torch.manual_seed(1)
    heads, kv, d = 16, 8, 128
    compiled = torch.compile(lambda q, k, v, offsets: packed_attention.causal_within(q * 1, k, v, offsets, None),
                             dynamic=True)
    for n, bounds in enumerate((((0, 700), (700, 701), (701, 2048)), ((0, 1000), (1000, 1900)))):
        L = bounds[-1][1]
        q, k, v = (torch.randn(L, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for h in (heads, kv, kv))
        grad = torch.randn(L, heads, d, device="cuda", dtype=torch.bfloat16)
        offsets = packed_attention.bounds_arg(bounds)
        with torch._dynamo.config.patch(error_on_recompile=n > 0):
            out = compiled(q, k, v, offsets)
        assert packed_attention._varlen_ok[0]  # flash ran, and did not fall back
        results = [(out.detach(), *torch.autograd.grad(out, (q, k, v), grad))]
        packed_attention._varlen_ok[0] = False  # eager: one SDPA call per sequence
        out = packed_attention.causal_within(q, k, v, offsets, None)
        results.append((out.detach(), *torch.autograd.grad(out, (q, k, v), grad)))
        packed_attention._varlen_ok[0] = True
        for a, b in zip(*results):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
