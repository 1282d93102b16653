"""Attention over packed sequences, one sequence at a time: document masking without a mask.

A micro-batch is one row of several sequences end to end (``clawrl.trainers.batching``). Handing
the model a dense ``[L, L]`` block-diagonal mask is correct but costs twice over: attention runs
over the whole row (O(L^2) in the *total* length, so eight 2048-token samples cost as much as one
16k-token one), and a mask rules out SDPA's flash and cuDNN kernels. Here the model is switched to
an attention function registered with transformers (``AttentionInterface``) that receives the
sequences' bounds as a keyword the model passes down to every attention call, and runs SDPA with
``is_causal=True`` on each sequence's slice -- exactly what each sequence would compute alone, with
the fast kernels and no mask.

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
SEGMENTS = "clawrl_segments"  # the keyword: the sequences' (start, end) token offsets (``bounds_arg``)


_calls = threading.local()  # bare: attention calls without the bounds, on this thread


def bare_calls() -> int:
    """Attention calls on this thread that came without the bounds, so far."""
    return getattr(_calls, "bare", 0)


def bounds_arg(bounds) -> torch.Tensor:
    """The keyword's value for ``bounds`` (``(start, end)`` pairs): an int64 ``[n, 2]`` tensor on the
    CPU. A tensor, not a tuple, because a decoder layer compiled whole (``train.compile_scope=layer``)
    passes it through its graph: dynamo would guard on a tuple's values and compile again for every
    new set of sample lengths, while a tensor is a graph input of symbolic size. On the CPU, so that
    reading it back costs no device sync."""
    return torch.tensor(list(bounds), dtype=torch.int64).reshape(-1, 2)


@torch.compiler.disable  # opaque to a compiled layer: runs eagerly, between its graphs
def packed_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers' attention signature: ``query`` ``[1, H, L, D]``, ``key``/``value`` ``[1, Hkv,
    L, D]``; returns ``([1, L, H, D], None)`` like ``sdpa_attention_forward``, which runs each slice."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments = kwargs.pop(SEGMENTS, None)
    if segments is None:
        _calls.bare = bare_calls() + 1
    elif isinstance(segments, torch.Tensor):
        segments = segments.tolist()
    if segments is None or len(segments) == 1:  # one sequence: the model's causal attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    lengths = [b - a for a, b in segments]
    out = None if dropout else _try_varlen(query, key, value, lengths, scaling)
    if out is not None:
        return out, None
    # split, not slice: split's backward is one concatenation, a slice's a zero-filled full copy each
    outs = [sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True,
                                   **kwargs)[0]
            for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))]
    return torch.cat(outs, dim=1), None


_varlen_ok = [True]  # until the kernel is found missing in this process


def _try_varlen(query, key, value, lengths: list[int], scaling: float | None) -> torch.Tensor | None:
    """``_flash_varlen`` on a GPU in half precision; None where it cannot run (then this process stops
    trying once the kernel is found missing or refuses the shapes), for the per-sequence path."""
    if not (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen_ok[0]):
        return None
    try:
        return _flash_varlen(query, key, value, lengths, scaling)
    except (RuntimeError, AttributeError) as e:  # no such kernel in this build, or it refused the shapes
        _varlen_ok[0] = False
        log.info("varlen flash attention unavailable (%s): one SDPA call per sequence",
                 str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def causal_within(query, key, value, lengths: list[int], scaling: float | None) -> torch.Tensor:
    """Causal attention within each of the consecutive sequences of ``lengths``, for callers that
    are not transformers models (the megatron backend's core attention): ``query`` ``[1, H, L, D]``,
    ``key``/``value`` ``[1, Hkv, L, D]`` (grouped-query: each key/value head serves a contiguous group
    of query heads, read in place, never repeated into a copy), ``[1, L, H, D]`` out. One varlen flash
    call on a GPU in half precision, else one SDPA ``is_causal`` call per sequence."""
    out = _try_varlen(query, key, value, lengths, scaling)
    if out is not None:
        return out
    gqa = key.shape[1] != query.shape[1]
    outs = [torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
            for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))]
    return torch.cat(outs, dim=2).transpose(1, 2)


def _flash_varlen(query, key, value, lengths: list[int], scaling: float | None) -> torch.Tensor:
    """All sequences in one call of torch's own variable-length flash attention (FlashAttention-2,
    GQA native; its backward is registered with autograd), so a micro-batch of many sequences costs
    one kernel per layer, not one (and its host overhead) per sequence. ``[1, L, H, D]`` out."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [L, heads, D]
    cu = _cu_seqlens(lengths, q.device)
    longest = max(lengths)
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True, False,
                                                  scale=scaling)[0]
    return out.unsqueeze(0)


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
