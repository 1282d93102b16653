"""Vocab-parallel logprobs, entropies and top-k logprobs, for a trainer whose output layer is split
over a tensor-parallel group.

Each rank holds the logits for the vocabulary slice ``[vocab_start, vocab_start + V/tp)``. The
functions return, on every rank, the same ``[T]`` / ``[T, K]`` numbers that ``token_logprobs``,
``token_entropy`` and ``topk_logprobs`` give on the full ``[T, V]`` logits, so every token-level
loss downstream runs unchanged. A max all-reduce keeps the logsumexp stable; one sum all-reduce
gives the exp-sum (and, for the entropy, the softmax-weighted shifted-logit sum); another collects
the target logits, each gathered by the rank that owns it and zero elsewhere. ``-inf`` logits
(banned tokens, or a padded vocabulary masked by the trainer) are handled as ``token_entropy`` does.

Gradients. Every rank computes the same loss from the all-reduced values, so the gradient of a
rank's local partial sum is the gradient of the global sum: the all-reduce's backward is the
identity (Megatron's ``reduce_from_tensor_model_parallel_region``), not a second all-reduce,
which would scale every gradient by ``tp``. Backward therefore needs no communication.

Memory. Logits arrive already divided by the temperature. The logsumexp and the entropy are
autograd Functions that save only the logits shard and ``[T]`` vectors, and work ``chunk_size``
rows at a time in forward and in backward (recomputing the softmax), so float32 working copies are
bounded by ``chunk_size x V/tp`` in training as under ``no_grad`` -- unlike ``token_logprobs`` and
``token_entropy``, whose autograd keeps every chunk's copy until backward.

With ``group`` None or of size 1 the single-device functions run, so the results are theirs exactly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from clawrl.losses.distill import topk_logprobs
from clawrl.losses.logits import token_entropy, token_logprobs


def _tp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _check_shard(logits_shard: torch.Tensor, chunk_size: int, group, vocab_start: int | None = None) -> None:
    if logits_shard.dim() != 2 or logits_shard.shape[-1] == 0:
        raise ValueError(f"logits_shard must be [T, V/tp] with V/tp > 0, got shape {tuple(logits_shard.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    # Shards are equal (megatron pads the vocabulary to a multiple of tp); a wrong start would
    # silently count some target logits twice and others never.
    expected = (0 if group is None else dist.get_rank(group)) * logits_shard.shape[-1]
    if vocab_start is not None and vocab_start != expected:
        raise ValueError(f"vocab_start must be group rank x shard width = {expected}, got {vocab_start}")


def _check_ids(ids: torch.Tensor, vocab_size: int, name: str) -> None:
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name} must lie in [0, {vocab_size}) (the full vocabulary)")


class _ReduceFromVocabShards(torch.autograd.Function):
    """Sum all-reduce whose backward is the identity: each rank's term enters the loss once."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return grad_out, None


def _exp_sums(logits_shard: torch.Tensor, group, chunk: int, with_mean: bool):
    """Over the whole vocabulary, in float32+: the row max ``m``, ``log S = log sum exp(z - m)``
    and, if asked, ``E_p[z - m]`` (``-inf`` logits count as 0); each ``[T]``.

    Two collectives whatever the chunking: a max all-reduce, then one sum all-reduce of ``S`` and of
    ``sum exp(z - m) * (z - m)``. The entropy is ``log S - E_p[z - m]``, a sum of two non-negative
    terms; ``lse - E_p[z]`` would cancel two numbers of size ``lse`` and lose float32 digits.
    """
    dtype = torch.promote_types(logits_shard.dtype, torch.float32)
    t = logits_shard.shape[0]
    m = logits_shard.amax(dim=-1).to(dtype)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    # As torch.logsumexp: a row that is all -inf keeps max 0, so z - m never is -inf - -inf.
    m = m.masked_fill(torch.isinf(m), 0.0)
    sums = torch.zeros(2 if with_mean else 1, t, dtype=dtype, device=logits_shard.device)
    for s in range(0, t, chunk):
        shifted = logits_shard[s:s + chunk].to(dtype) - m[s:s + chunk, None]
        e = torch.exp(shifted)
        sums[0, s:s + chunk] = e.sum(-1)
        if with_mean:
            # Banned tokens (logit -inf) have e = 0; 0 * -inf would be NaN.
            sums[1, s:s + chunk] = (e * shifted.masked_fill(torch.isneginf(shifted), 0.0)).sum(-1)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return m, torch.log(sums[0]), (sums[1] / sums[0] if with_mean else None)


class _VocabParallelLogSumExp(torch.autograd.Function):
    """Global ``logsumexp(z, -1)`` from a vocab shard; grad on the shard is ``softmax(z) * g``."""

    @staticmethod
    def forward(ctx, logits_shard: torch.Tensor, group, chunk: int) -> torch.Tensor:
        m, log_s, _ = _exp_sums(logits_shard, group, chunk, with_mean=False)
        lse = log_s + m
        ctx.save_for_backward(logits_shard, lse)
        ctx.chunk = chunk
        return lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            p = torch.exp(logits[s:s + ctx.chunk].to(lse.dtype) - lse[s:s + ctx.chunk, None])
            grad[s:s + ctx.chunk] = (p * grad_out[s:s + ctx.chunk, None]).to(grad.dtype)
        return grad, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    """Global entropy ``H = log S - E_p[z - m]`` from a vocab shard; ``dH/dz_v = -p_v (z_v - E_p[z])``."""

    @staticmethod
    def forward(ctx, logits_shard: torch.Tensor, group, chunk: int) -> torch.Tensor:
        m, log_s, mean_shifted = _exp_sums(logits_shard, group, chunk, with_mean=True)
        ctx.save_for_backward(logits_shard, m, log_s, mean_shifted)
        ctx.chunk = chunk
        return log_s - mean_shifted

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, m, log_s, mean_shifted = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            rows = slice(s, s + ctx.chunk)
            shifted = logits[rows].to(m.dtype) - m[rows, None]
            p = torch.exp(shifted - log_s[rows, None])
            # p = 0 at -inf logits; zeroing z - m there keeps the product 0 instead of NaN.
            centred = shifted.masked_fill(torch.isneginf(shifted), 0.0) - mean_shifted[rows, None]
            grad[rows] = (-p * centred * grad_out[rows, None]).to(grad.dtype)
        return grad, None, None


def _owned_logits(logits_shard: torch.Tensor, ids: torch.Tensor, vocab_start: int, group,
                  dtype: torch.dtype) -> torch.Tensor:
    """``z[t, ids[t, k]]`` for global ids: the owning rank gathers it, the others add 0."""
    local = ids - vocab_start
    owned = (local >= 0) & (local < logits_shard.shape[-1])
    picked = logits_shard.gather(-1, local.clamp(0, logits_shard.shape[-1] - 1)).to(dtype)
    return _ReduceFromVocabShards.apply(picked.masked_fill(~owned, 0.0), group)


def vocab_parallel_token_logprobs(logits_shard: torch.Tensor, target_ids: torch.Tensor, vocab_start: int,
                                  group=None, chunk_size: int = 1024) -> torch.Tensor:
    """``token_logprobs`` over vocab shards: ``[T, V/tp], [T] (global ids) -> [T]`` (float32+).

    ``logits_shard`` holds this rank's columns ``[vocab_start, vocab_start + V/tp)`` of the
    temperature-scaled logits; every rank of ``group`` gets the same full-vocabulary logprobs.
    """
    _check_shard(logits_shard, chunk_size, group, vocab_start)
    if _tp_size(group) == 1:
        return token_logprobs(logits_shard, target_ids, chunk_size=chunk_size)
    if target_ids.shape != logits_shard.shape[:1]:
        raise ValueError(f"target_ids must be [T]={logits_shard.shape[0]}, got shape {tuple(target_ids.shape)}")
    targets = target_ids.long()
    _check_ids(targets, logits_shard.shape[-1] * _tp_size(group), "target_ids")
    lse = _VocabParallelLogSumExp.apply(logits_shard, group, chunk_size)
    picked = _owned_logits(logits_shard, targets.unsqueeze(-1), vocab_start, group, lse.dtype).squeeze(-1)
    return picked - lse


def vocab_parallel_token_entropy(logits_shard: torch.Tensor, group=None, chunk_size: int = 1024) -> torch.Tensor:
    """``token_entropy`` over vocab shards: ``[T, V/tp] -> [T]`` (float32+), the same on every rank.

    ``-inf`` logits (banned or padded vocabulary entries) contribute nothing, as in ``token_entropy``.
    """
    _check_shard(logits_shard, chunk_size, group)
    if _tp_size(group) == 1:
        return token_entropy(logits_shard, chunk_size=chunk_size)
    return _VocabParallelEntropy.apply(logits_shard, group, chunk_size)


def vocab_parallel_topk_logprobs(logits_shard: torch.Tensor, topk_ids: torch.Tensor, vocab_start: int,
                                 group=None, chunk_size: int = 1024) -> torch.Tensor:
    """``topk_logprobs`` over vocab shards: ``[T, V/tp], [T, K] (global ids) -> [T, K]`` (float32+).

    Feed the result to ``topk_reverse_kl`` / ``topk_forward_kl`` as on one device.
    """
    _check_shard(logits_shard, chunk_size, group, vocab_start)
    if _tp_size(group) == 1:
        return topk_logprobs(logits_shard, topk_ids, chunk_size=chunk_size)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != logits_shard.shape[0]:
        raise ValueError(f"topk_ids must be [T={logits_shard.shape[0]}, K], got shape {tuple(topk_ids.shape)}")
    ids = topk_ids.long()
    _check_ids(ids, logits_shard.shape[-1] * _tp_size(group), "topk_ids")
    lse = _VocabParallelLogSumExp.apply(logits_shard, group, chunk_size)
    return _owned_logits(logits_shard, ids, vocab_start, group, lse.dtype) - lse.unsqueeze(-1)
