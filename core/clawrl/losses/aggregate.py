"""Reduce a per-token loss ``[T]`` over a packed batch to the scalar that is back-propagated.

Micro-batch invariance: the trainer splits a global batch into micro-batches (gradient
accumulation, data-parallel ranks) and sums their losses. Every mode here is written as

    loss = sum_t loss_t * weight_t / global_denominator

where ``weight_t`` depends only on the token's own sequence (its mask and that sequence's trained
token count), and ``global_denominator`` is a number for the *whole* global batch, passed in by the
caller. Splitting the batch at sequence boundaries therefore only regroups the sum: the micro-batch
losses add up to the full-batch loss, and so do their gradients, however the split falls. Computing
the denominator per micro-batch instead (a mean of means) would weight tokens in small
micro-batches more, and change the update when packing changes.

Sequences must not be split across micro-batches (packing always cuts at sequence boundaries).
"""
from __future__ import annotations

import torch

from clawrl.losses.packed import broadcast_to_tokens, check_cu_seqlens, per_seq_sum

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _check(per_token: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: str) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}")
    if per_token.dim() != 1 or loss_mask.shape != per_token.shape:
        raise ValueError(f"per-token loss and loss_mask must both be [T]; got {tuple(per_token.shape)} "
                         f"and {tuple(loss_mask.shape)}")
    check_cu_seqlens(cu_seqlens, per_token.shape[0])


def aggregation_denominator(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: str) -> float:
    """This batch's share of the global denominator; sum it over all micro-batches (and all-reduce
    it over data-parallel ranks) *before* computing any loss, and pass the total to ``aggregate``.

    ``token-mean``: the number of trained tokens (``sum(loss_mask)``).
    ``seq-mean-*``: the number of sequences with at least one trained token. Fully masked
    sequences (filtered or truncated samples) are not counted, so they do not dilute the others.
    """
    _check(loss_mask, loss_mask, cu_seqlens, mode)
    mask = loss_mask.detach()
    if mode == "token-mean":
        return float(mask.to(torch.float64).sum())
    return float((per_seq_sum(mask, cu_seqlens) > 0).sum())


def token_weights(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: str,
                  token_sum_norm: float | None = None) -> torch.Tensor:
    """Per-token weight ``w_t`` such that ``loss = sum_t loss_t * w_t / global_denominator``.

    ``token-mean``: ``w_t = m_t``; every trained token in the global batch counts equally, so
    long answers weigh more (DAPO's token-level loss).
    ``seq-mean-token-mean``: ``w_t = m_t / n_s`` (``n_s`` = trained tokens of the token's sequence):
    mean over each sequence, then over sequences (original GRPO); a sequence's weight does not
    depend on its length, which favours short correct answers and long wrong ones.
    ``seq-mean-token-sum``: ``w_t = m_t / token_sum_norm`` (default 1): sum over each sequence, mean
    over sequences. With ``token_sum_norm`` = a constant such as the max response length this is
    Dr. GRPO's unbiased normaliser: no length-dependent factor at all.
    """
    mask = loss_mask.detach()
    dtype = mask.dtype if mask.dtype.is_floating_point else torch.float32
    mask = mask.to(dtype)
    if mode == "token-mean":
        return mask
    if mode == "seq-mean-token-mean":
        counts = per_seq_sum(mask, cu_seqlens)
        counts = torch.where(counts > 0, counts, torch.ones_like(counts)).to(dtype)
        return mask / broadcast_to_tokens(counts, cu_seqlens)
    if token_sum_norm is not None and not token_sum_norm > 0:
        raise ValueError(f"token_sum_norm must be > 0, got {token_sum_norm}")
    return mask if token_sum_norm is None else mask / token_sum_norm


def aggregate(per_token_loss: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor,
              mode: str = "token-mean", global_denominator: float | torch.Tensor | None = None,
              token_sum_norm: float | None = None) -> torch.Tensor:
    """Scalar loss ``sum_t per_token_loss_t * w_t / global_denominator`` (``w_t``: ``token_weights``).

    ``global_denominator``: ``aggregation_denominator`` summed over the whole global batch. Leave it
    ``None`` only when this call sees the whole batch; it then uses this batch's own denominator
    (clamped to >= 1 so an all-masked batch gives 0, not NaN). ``token_sum_norm`` applies to
    ``seq-mean-token-sum`` only.
    """
    _check(per_token_loss, loss_mask, cu_seqlens, mode)
    if token_sum_norm is not None and mode != "seq-mean-token-sum":
        raise ValueError(f"token_sum_norm only applies to seq-mean-token-sum, not {mode}")
    if global_denominator is None:
        global_denominator = max(aggregation_denominator(loss_mask, cu_seqlens, mode), 1.0)
    elif not float(global_denominator) > 0:
        raise ValueError(f"global_denominator must be > 0, got {float(global_denominator)}")
    weights = token_weights(loss_mask, cu_seqlens, mode, token_sum_norm).to(per_token_loss.dtype)
    # where(), not multiply: a masked-out token's loss may be inf/NaN (e.g. padding) and must not leak.
    weighted = torch.where(weights != 0, per_token_loss * weights, torch.zeros_like(per_token_loss))
    return weighted.sum() / global_denominator


def masked_mean(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Detached mean of ``values`` over this batch's trained tokens (0 if none); for metrics."""
    mask = loss_mask.detach().to(torch.float64)
    values = values.detach().to(torch.float64)
    total = torch.where(mask != 0, values * mask, torch.zeros_like(values)).sum()
    return (total / mask.sum().clamp(min=1.0)).to(torch.float32)
