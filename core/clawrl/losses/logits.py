"""Vocabulary-level quantities: per-token log-probabilities and entropies from logits.

These are the only functions here that see the vocabulary dimension. Everything downstream works
on ``[T]`` per-token tensors, so a tensor-parallel trainer can swap these two for vocab-parallel
versions (a max/sum all-reduce across vocab shards) and reuse every loss unchanged.

Both compute in at least float32 (bf16 logsumexp over 150k logits loses ~2 digits) and scale the
logits by ``1 / temperature`` first, so the logprobs match the distribution the engine sampled
from. ``chunk_size`` bounds the float32 copy of the logits to ``chunk_size x V`` at a time; that
bounds peak memory under ``torch.no_grad()`` (old/ref logprob recomputation). With autograd on,
each chunk's copy is kept for backward -- except in ``token_logprobs`` of lower-precision logits
(bf16 on a GPU), which keeps no float32 copy at all: its backward recomputes each chunk's softmax
from the bf16 logits and the saved logsumexp (``_ChunkedTokenLogprobs``), so a step over 16k
tokens of a 150k vocabulary does not hold 10 GB of float32 logits for the backward pass.

``fused=True`` (the trainers pass ``train.compile``'s decision) runs the same formulas as
torch.compile'd functions over all rows at once (``_row_stats``, ``_row_grad``): inductor turns each
into reductions and one elementwise pass that read the low-precision logits and cast as they go, so
no float32 chunk is ever written. Eagerly, every chunk is cast, exponentiated, masked and reduced by
a separate kernel, each a full pass over ``chunk x V`` float32 values, forward and backward again.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch


def _check_args(logits: torch.Tensor, temperature: float, chunk_size: int | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _scaled_chunks(logits: torch.Tensor, temperature: float, chunk_size: int | None):
    _check_args(logits, temperature, chunk_size)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    step = chunk_size or max(logits.shape[0], 1)
    for start in range(0, logits.shape[0], step):
        z = logits[start:start + step].to(dtype)
        yield start, (z if temperature == 1.0 else z / temperature)


def _per_token(logits: torch.Tensor, temperature: float, chunk_size: int | None,
               fn: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    parts = [fn(start, z, torch.logsumexp(z, dim=-1)) for start, z in _scaled_chunks(logits, temperature, chunk_size)]
    if not parts:
        return logits.new_zeros(0, dtype=torch.promote_types(logits.dtype, torch.float32))
    return torch.cat(parts)


DEFAULT_CHUNK = 4096  # rows of float32 working copy at a time in the chunked autograd path


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """``z[t, target] - logsumexp(z[t])`` with ``z = logits / temperature`` computed in float32 a
    chunk of rows at a time; saves the (low-precision) logits, targets and logsumexp only. The
    gradient ``(onehot(target) - softmax(z)) / temperature`` is rebuilt chunk by chunk in backward.
    With ``entropy``, each chunk's entropy is taken from the same float32 copy (a metric: no
    gradient), so a step that logs it reads the logits once, not twice."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, chunk: int, entropy: bool, fused: bool = False):
        ctx.temperature, ctx.chunk, ctx.fused = temperature, chunk, fused
        if fused:
            out, lse, ent = _fused(_row_stats)(logits, targets, temperature, entropy)
            ctx.save_for_backward(logits, targets, lse)
            if entropy:
                ctx.mark_non_differentiable(ent)
                return out, ent
            return out
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse, ent = torch.empty_like(out), torch.empty_like(out) if entropy else None
        for start in range(0, logits.shape[0], chunk):
            end = start + chunk
            z = _scaled32(logits[start:end], temperature)
            lse[start:end] = torch.logsumexp(z, dim=-1)
            out[start:end] = z.gather(-1, targets[start:end, None]).squeeze(-1) - lse[start:end]
            if entropy:
                ent[start:end] = _entropy(z, lse[start:end])
        ctx.save_for_backward(logits, targets, lse)
        if entropy:
            ctx.mark_non_differentiable(ent)
            return out, ent
        return out

    @staticmethod
    def backward(ctx, grad_out, grad_entropy=None):
        logits, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        if ctx.fused:
            return _fused(_row_grad)(logits, targets, lse, grad_out, t), None, None, None, None, None
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk):
            end = start + chunk
            z = _scaled32(logits[start:end], t)
            g = torch.exp(z - lse[start:end, None]).mul_(-grad_out[start:end, None])
            g.scatter_add_(-1, targets[start:end, None], grad_out[start:end, None])
            grad[start:end] = g / t if t != 1.0 else g
        return grad, None, None, None, None, None


def _scaled32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in float32: what every pass of ``_ChunkedTokenLogprobs`` works on."""
    z = logits.to(torch.float32)
    return z if temperature == 1.0 else z / temperature


def _row_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
               entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per row of ``logits / temperature`` in float32: the target's logprob, the logsumexp and (with
    ``entropy``) the entropy: ``_ChunkedTokenLogprobs``' forward over all rows at once, written for inductor."""
    z = _scaled32(logits, temperature)
    lse = torch.logsumexp(z, dim=-1)
    return z.gather(-1, targets[:, None]).squeeze(-1) - lse, lse, _entropy(z, lse) if entropy else None


def _row_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
              temperature: float) -> torch.Tensor:
    """``_ChunkedTokenLogprobs``' backward for all rows, in the logits' dtype: ``grad_out * (onehot -
    softmax(z)) / temperature``, the one-hot as a comparison (a scatter would not fuse)."""
    z = _scaled32(logits, temperature)
    onehot = torch.arange(z.shape[-1], device=z.device) == targets[:, None]
    g = grad_out[:, None] * (onehot.to(z.dtype) - torch.exp(z - lse[:, None]))
    return (g / temperature if temperature != 1.0 else g).to(logits.dtype)


@functools.cache
def _fused(fn):
    """``fn`` compiled once per process (dynamic token count: one compilation serves every step)."""
    return torch.compile(fn, dynamic=True)


def _checked_targets(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    if target_ids.shape != logits.shape[:1]:
        raise ValueError(f"target_ids must be [T]={logits.shape[0]}, got shape {tuple(target_ids.shape)}")
    targets = target_ids.long()
    if targets.numel() and (targets.min() < 0 or targets.max() >= logits.shape[-1]):
        raise ValueError(f"target_ids must lie in [0, {logits.shape[-1]})")
    return targets


def token_logprobs_and_entropy(logits: torch.Tensor, target_ids: torch.Tensor, chunk_size: int = 4096,
                               fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs`` (with its gradient) and the detached ``token_entropy`` of the same
    logits, in one pass over bf16 ones."""
    if logits.requires_grad and torch.is_grad_enabled() and logits.dtype in (torch.bfloat16, torch.float16):
        _check_args(logits, 1.0, chunk_size)
        return _ChunkedTokenLogprobs.apply(logits, _checked_targets(logits, target_ids), 1.0, chunk_size, True,
                                           fused)
    if fused and not (logits.requires_grad and torch.is_grad_enabled()):  # both from one compiled pass
        _check_args(logits, 1.0, chunk_size)
        lp, _, entropy = _fused(_row_stats)(logits, _checked_targets(logits, target_ids), 1.0, True)
        return lp, entropy
    with torch.no_grad():
        entropy = token_entropy(logits.detach(), chunk_size=chunk_size, fused=fused)
    return token_logprobs(logits, target_ids, fused=fused), entropy


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0,
                   chunk_size: int | None = None, fused: bool = False) -> torch.Tensor:
    """``log softmax(logits / temperature)[t, target_ids[t]]`` for each token, ``[T, V] -> [T]``.

    Computed as ``z[target] - logsumexp(z)``: one gather and one reduction, never the full
    ``[T, V]`` log-softmax tensor. ``logits[t]`` must be the prediction for ``target_ids[t]``
    (the caller shifts by one).
    """
    targets = _checked_targets(logits, target_ids)
    grad = logits.requires_grad and torch.is_grad_enabled()
    if grad and logits.dtype in (torch.bfloat16, torch.float16):
        _check_args(logits, temperature, chunk_size)
        return _ChunkedTokenLogprobs.apply(logits, targets, float(temperature), chunk_size or DEFAULT_CHUNK, False,
                                           fused)
    if fused and not grad:
        _check_args(logits, temperature, chunk_size)
        return _fused(_row_stats)(logits, targets, float(temperature), False)[0]

    def chunk(start: int, z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        t = targets[start:start + z.shape[0]].unsqueeze(-1)
        return z.gather(-1, t).squeeze(-1) - lse

    return _per_token(logits, temperature, chunk_size, chunk)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None,
                  fused: bool = False) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per token, ``[T, V] -> [T]``.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``, which avoids ``log p`` of tiny probabilities
    (``0 * log 0`` would be NaN), tolerates ``-inf`` logits, and needs one chunk's softmax at a time.
    ``fused`` (where no gradient is wanted): all rows in one compiled pass.
    """
    if fused and not (logits.requires_grad and torch.is_grad_enabled()):
        _check_args(logits, temperature, chunk_size)
        return _fused(_row_stats)(logits, logits.new_zeros(logits.shape[0], dtype=torch.long), float(temperature),
                                  True)[2]
    return _per_token(logits, temperature, chunk_size, lambda start, z, lse: _entropy(z, lse))


def _entropy(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``token_entropy``'s formula on one chunk of scaled logits ``z`` and their logsumexp. Not in
    place: ``z`` may be the caller's own float32 logits."""
    p = torch.exp(z - lse.unsqueeze(-1))
    # Banned tokens (logit -inf) have p = 0; 0 * -inf would be NaN in the value and the gradient.
    finite_z = z.masked_fill(torch.isneginf(z), 0.0)
    return lse - (p * finite_z).sum(-1)
