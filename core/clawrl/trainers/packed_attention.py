"""Attention over packed sequences, one sequence at a time: document masking without a mask.

A micro-batch is one row of several sequences end to end (``clawrl.trainers.batching``). Handing
the model a dense ``[L, L]`` block-diagonal mask is correct but costs twice over: attention runs
over the whole row (O(L^2) in the *total* length, so eight 2048-token samples cost as much as one
16k-token one), and a mask rules out SDPA's flash and cuDNN kernels. Here the model is switched to
an attention function registered with transformers (``AttentionInterface``) that receives the
sequences' bounds as a keyword the model passes down to every attention call, and runs SDPA with
``is_causal=True`` on each sequence's slice -- exactly what each sequence would compute alone, with
the fast kernels and no mask. On a GPU in half precision, and inside any compiled layer, that is
one operator, ``clawrl::causal_within``: torch's variable-length flash kernels forward and backward
on a GPU, and to dynamo a single node, so a layer compiled whole stays one graph.

Models whose attention is not dispatched through ``AttentionInterface`` (old remote code) never
call it; ``enable`` then says so and the trainer keeps the dense mask. Called without the bounds
(the model used directly, say by a test or an evaluation), a row is one sequence, as for ``sdpa``;
``Bounds`` counts such calls, so that the trainer notices a model that does not pass the keyword
down to its attention and goes back to the mask rather than attend across sequences.
"""
from __future__ import annotations

import itertools
import logging
import threading

import torch

log = logging.getLogger(__name__)

NAME = "clawrl_packed"
SEGMENTS = "clawrl_segments"  # the keyword: the sequences' cumulative token offsets (``bounds_arg``)


_calls = threading.local()  # bare: attention calls without the bounds, on this thread


def bare_calls() -> int:
    """Attention calls on this thread that came without the bounds, so far."""
    return getattr(_calls, "bare", 0)


def bounds_arg(bounds) -> torch.Tensor:
    """The keyword's value for ``bounds`` (``(start, end)`` pairs that tile the row from 0): the
    sequences' cumulative offsets ``[0, e0, e1, ...]``, an int32 CPU tensor. A tensor, not a tuple,
    because a decoder layer compiled whole (``train.compile_scope=layer``) passes it through its graph
    to ``causal_within``: dynamo would guard on a tuple's values and compile again for every new set
    of sample lengths, while a tensor is a graph input of symbolic size. On the CPU, so that reading
    it back costs no device sync."""
    return torch.tensor([0, *(end for _, end in bounds)], dtype=torch.int32)


def packed_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers' attention signature: ``query`` ``[1, H, L, D]``, ``key``/``value`` ``[1, Hkv,
    L, D]``; returns ``([1, L, H, D], None)`` like ``sdpa_attention_forward``, which runs each slice."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    offsets = kwargs.pop(SEGMENTS, None)
    if offsets is None:
        _calls.bare = bare_calls() + 1
    elif not isinstance(offsets, torch.Tensor):
        offsets = bounds_arg(offsets)
    if offsets is None or offsets.shape[0] == 2:  # one sequence: the model's causal attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if not dropout and (_flash_ok(query) or torch.compiler.is_compiling()):
        out = causal_within(*(t[0].transpose(0, 1) for t in (query, key, value)), offsets, scaling)
        return out.unsqueeze(0), None
    lengths = offsets.diff().tolist()
    # split, not slice: split's backward is one concatenation, a slice's a zero-filled full copy each
    outs = [sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True,
                                   **kwargs)[0]
            for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))]
    return torch.cat(outs, dim=1), None


def causal_within(query, key, value, offsets: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Causal attention within each of the consecutive sequences that ``offsets`` (``bounds_arg``)
    delimits: ``query`` ``[L, H, D]``, ``key``/``value`` ``[L, Hkv, D]`` (grouped-query: each key/value
    head serves a contiguous group of query heads, read in place, never repeated into a copy),
    ``[L, H, D]`` out. One varlen flash call on a GPU in half precision, else one SDPA ``is_causal``
    call per sequence. The flash path, and any path under ``torch.compile``, is one operator
    (``clawrl::causal_within``) to dynamo, so a layer compiled whole keeps attention inside its graph
    instead of breaking around it; eager elsewhere, autograd runs through SDPA itself."""
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    if torch.is_autocast_enabled(query.device.type):  # what autocast does for SDPA: all three in its dtype
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    if _flash_ok(query) or torch.compiler.is_compiling():
        return _causal_within(query.contiguous(), key.contiguous(), value.contiguous(), offsets, scale)[0]
    return _per_sequence(query, key, value, offsets.diff().tolist(), scale)


_varlen_ok = [True]  # until the kernel is found missing in this process


def _flash_ok(query: torch.Tensor) -> bool:
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen_ok[0]


def _flash_failed(e: Exception) -> None:
    """The kernel is missing from this build or refused the shapes: per-sequence SDPA from now on."""
    _varlen_ok[0] = False
    log.info("varlen flash attention unavailable (%s): one SDPA call per sequence",
             str(e).splitlines()[0] if str(e) else type(e).__name__)


@torch.library.custom_op("clawrl::causal_within", mutates_args=())
def _causal_within(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_within``'s operator: the output ``[L, H, D]`` and each row's log-sum-exp ``[H, L]``
    (float32 for half-precision inputs), which the backward reads. All sequences in one call of
    torch's own variable-length flash attention (FlashAttention-2, GQA native), so a micro-batch of
    many sequences costs one kernel per layer, not one (and its host overhead) per sequence. The
    offsets are read on the host, inside the operator, where a compiled graph never sees their values."""
    lengths = offsets.diff().tolist()
    if _flash_ok(query):
        try:
            cu, longest = _cu_seqlens(lengths, query.device), max(lengths)
            out, lse = torch.ops.aten._flash_attention_forward(query, key, value, cu, cu, longest, longest, 0.0,
                                                               True, False, scale=scale)[:2]
            return out.contiguous(), lse
        except (RuntimeError, AttributeError) as e:
            _flash_failed(e)
    out = _per_sequence(query, key, value, lengths, scale)
    lse = torch.cat([_row_logsumexp(q, k, scale) for q, k in zip(query.split(lengths), key.split(lengths))], 1)
    return out, lse


@_causal_within.register_fake
def _(query, key, value, offsets, scale):
    return query.new_empty(query.shape), query.new_empty((query.shape[1], query.shape[0]), dtype=_wide(query))


@torch.library.custom_op("clawrl::causal_within_backward", mutates_args=())
def _causal_within_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, offsets: torch.Tensor,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``query``, ``key`` and ``value``: flash's varlen backward from the forward's
    output and log-sum-exp, or (no flash: a compiled layer on the CPU or in float32) attention's
    backward written out per sequence from the same two."""
    lengths = offsets.diff().tolist()
    if _flash_ok(query):
        try:
            cu, longest = _cu_seqlens(lengths, query.device), max(lengths)
            unused = torch.empty(0, dtype=torch.int64, device=query.device)  # the RNG state: read with dropout only
            grads = torch.ops.aten._flash_attention_backward(grad, query, key, value, out, lse, cu, cu, longest,
                                                             longest, 0.0, True, unused, unused, scale=scale)
            return tuple(g.contiguous() for g in grads)
        except (RuntimeError, AttributeError) as e:
            _flash_failed(e)
    return _math_backward(grad, query, key, value, out, lse, lengths, scale)


@_causal_within_backward.register_fake
def _(grad, query, key, value, out, lse, offsets, scale):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, offsets, scale = inputs
    ctx.save_for_backward(query, key, value, output[0], output[1], offsets)
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse):  # the log-sum-exp is an internal output, never differentiated
    query, key, value, out, lse, offsets = ctx.saved_tensors
    return (*_causal_within_backward(grad_out.contiguous(), query, key, value, out, lse, offsets, ctx.scale),
            None, None)


_causal_within.register_autograd(_backward, setup_context=_setup_context)


def _per_sequence(query, key, value, lengths: list[int], scale: float) -> torch.Tensor:
    """One SDPA ``is_causal`` call per sequence, ``[L, H, D]`` in and out."""
    gqa = key.shape[1] != query.shape[1]
    outs = [torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                             v.transpose(0, 1), is_causal=True, scale=scale,
                                                             enable_gqa=gqa).transpose(0, 1)
            for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths))]
    return torch.cat(outs).contiguous()


def _wide(t: torch.Tensor) -> torch.dtype:
    """The dtype the math path computes in: float32, or float64 for float64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(query, key, scale: float) -> torch.Tensor:
    """``[H, l, l]``: one sequence's causal attention scores (``-inf`` above the diagonal) in ``_wide``
    precision, each key/value head repeated for its group of query heads."""
    q, k = query.transpose(0, 1).to(_wide(query)), key.transpose(0, 1).to(_wide(query))  # [H, l, D], [Hkv, l, D]
    scores = (q @ k.repeat_interleave(q.shape[0] // k.shape[0], 0).transpose(1, 2)) * scale
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~causal, float("-inf"))


def _row_logsumexp(query, key, scale: float) -> torch.Tensor:
    """``[H, l]``: the log-sum-exp of each query row's causal scores within one sequence."""
    return _scores(query, key, scale).logsumexp(-1)


def _math_backward(grad, query, key, value, out, lse, lengths: list[int], scale: float):
    """Attention's backward per sequence, in ``_wide`` precision: ``P = exp(S - lse)``, ``dV = P^T dO``,
    ``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = dS K scale``, ``dK = dS^T Q scale``; a key/value
    head's gradients summed over its group of query heads."""
    groups = query.shape[1] // key.shape[1]
    dqs, dks, dvs = [], [], []
    for q, k, v, o, g, m in zip(query.split(lengths), key.split(lengths), value.split(lengths), out.split(lengths),
                                grad.split(lengths), lse.split(lengths, 1)):
        p = (_scores(q, k, scale) - m[..., None]).exp()  # [H, l, l]
        gh, oh, qh = (t.transpose(0, 1).to(p.dtype) for t in (g, o, q))  # [H, l, D]
        kh, vh = (t.transpose(0, 1).to(p.dtype).repeat_interleave(groups, 0) for t in (k, v))
        ds = p * (gh @ vh.transpose(1, 2) - (gh * oh).sum(-1, keepdim=True))
        dqs.append((ds @ kh * scale).transpose(0, 1))
        dks.append((ds.transpose(1, 2) @ qh * scale).unflatten(0, (-1, groups)).sum(1).transpose(0, 1))
        dvs.append((p.transpose(1, 2) @ gh).unflatten(0, (-1, groups)).sum(1).transpose(0, 1))
    return tuple(torch.cat(d).to(t.dtype).contiguous() for d, t in ((dqs, query), (dks, key), (dvs, value)))


_cu_cache: dict[tuple, torch.Tensor] = {}  # (lengths, device) -> their cumulative offsets on the device


def _cu_seqlens(lengths: list[int], device: torch.device) -> torch.Tensor:
    """The sequences' offsets ``[0, l0, l0+l1, ...]`` (int32) on ``device``, made once per micro-batch
    shape and reused by every layer, forward and backward. Each layer building its own from a Python
    list was a copy from pageable host memory, which waits for the device: one sync per layer, each
    leaving the GPU idle until the host had queued the next kernels (28 a step at the Qwen3-1.7B
    shape). Made here from pinned memory without waiting, and only for a new shape."""
    key = (tuple(lengths), device)
    cu = _cu_cache.get(key)
    if cu is None:
        if len(_cu_cache) >= 64:  # shapes of old steps
            _cu_cache.clear()
        host = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        cu = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
        _cu_cache[key] = cu
    return cu


def enable(model) -> bool:
    """Switch ``model`` (an HF ``PreTrainedModel``, or a peft model around one) to the packed
    attention. False, with the reason logged, when the model cannot dispatch to it."""
    try:
        from transformers import AttentionInterface
    except ImportError:  # transformers too old to have the interface
        log.info("packed attention unavailable (transformers has no AttentionInterface): dense block masks")
        return False
    AttentionInterface.register(NAME, packed_attention_forward)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        base.set_attn_implementation(NAME)
    except (AttributeError, ValueError, ImportError) as e:
        log.info("packed attention unavailable for %s (%s): dense block masks", type(base).__name__,
                 str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False
    return getattr(base.config, "_attn_implementation", None) == NAME


def disable(model, previous: str = "sdpa") -> None:
    """Back to ``previous`` (the trainer's fallback when the model never passes the bounds down)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(previous)
