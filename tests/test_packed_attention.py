"""``packed_attention.causal_within`` and its operator on the CPU: attention within each packed
sequence, forward and backward, equal to attention over each sequence alone; one node to dynamo (no
graph break, and other lengths reuse the graph); autocast's dtype as SDPA would take it. The flash
path behind the operator is checked on a GPU (``test_packed_attention_cuda.py``)."""
from __future__ import annotations

import torch

from clawrl.trainers import packed_attention

BOUNDS = ((0, 37), (37, 200), (200, 201), (201, 330))


def _alone(q, k, v, bounds):
    """Softmax attention over each sequence alone, written out: key/value heads repeated per group."""
    out = []
    for a, b in bounds:
        qh, kh, vh = (t[a:b].transpose(0, 1) for t in (q, k, v))
        kh, vh = (t.repeat_interleave(q.shape[1] // k.shape[1], 0) for t in (kh, vh))
        scores = (qh @ kh.transpose(1, 2)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
        out.append((scores.softmax(-1) @ vh).transpose(0, 1))
    return torch.cat(out)


def _inputs(heads=8, kv=4, d=16, length=330, dtype=torch.float64):
    torch.manual_seed(0)
    return [torch.randn(length, h, d, dtype=dtype, requires_grad=True) for h in (heads, kv, kv)]


def test_the_operator_and_the_eager_path_equal_attention_over_each_sequence_alone():
    q, k, v = _inputs()
    offsets = packed_attention.bounds_arg(BOUNDS)
    assert offsets.tolist() == [0, 37, 200, 201, 330] and offsets.device.type == "cpu"
    expected = _alone(q, k, v, BOUNDS)
    grad = torch.randn_like(expected)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    eager = packed_attention.causal_within(q, k, v, offsets, None)  # SDPA per sequence, autograd through it
    # the operator: its log-sum-exp is each row's, and its backward is written out from it
    op, lse = packed_attention._causal_within(q, k, v, offsets, q.shape[-1] ** -0.5)
    scores = torch.cat([(q[a:b].transpose(0, 1) @ k[a:b].transpose(0, 1).repeat_interleave(2, 0).transpose(1, 2))
                        .mul(16 ** -0.5).masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
                        .logsumexp(-1) for a, b in BOUNDS], 1)
    torch.testing.assert_close(lse, scores)
    for out in (eager, op):
        torch.testing.assert_close(out, expected)
        for got, ref in zip(torch.autograd.grad(out, (q, k, v), grad), want):
            torch.testing.assert_close(got, ref)
    torch.library.opcheck(packed_attention._causal_within, (q.detach(), k.detach(), v.detach(), offsets, 0.25))


def test_compiled_it_is_one_node_and_other_lengths_reuse_the_graph():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fn = torch.compile(lambda q, k, v, offsets: packed_attention.causal_within(q * 2, k, v, offsets, None) + 1,
                       backend="aot_eager", dynamic=True)
    for n, bounds in enumerate((BOUNDS, ((0, 100), (100, 330)))):
        q, k, v = _inputs()
        with torch._dynamo.config.patch(error_on_recompile=n > 0):
            out = fn(q, k, v, packed_attention.bounds_arg(bounds))
        expected = _alone(q * 2, k, v, bounds) + 1
        torch.testing.assert_close(out, expected)
        grad = torch.randn_like(out)
        for got, ref in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
            torch.testing.assert_close(got, ref)
    assert not torch._dynamo.utils.counters["graph_break"]


def test_under_autocast_all_three_take_its_dtype_as_sdpa_would():
    """A compiled layer under autocast can hand over float32 queries and keys (its norms' outputs) with
    bf16 values: the operator gets all three in autocast's dtype, as eager SDPA casts them."""
    q, k, _ = _inputs(dtype=torch.float32, length=60)
    v = torch.randn(60, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    offsets = packed_attention.bounds_arg(((0, 20), (20, 60)))
    fn = lambda q, k, v: packed_attention.causal_within(q, k, v, offsets, None)  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = fn(q, k, v)
        compiled = torch.compile(fn, backend="aot_eager", dynamic=True)(q, k, v)
    assert eager.dtype == compiled.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager)
    compiled.float().sum().backward()
    assert q.grad.dtype == torch.float32 and v.grad.dtype == torch.bfloat16
