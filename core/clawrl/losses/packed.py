"""Helpers for packed batches: many variable-length sequences laid end to end in one flat tensor.

A packed batch of ``S`` sequences and ``T`` tokens is described by ``cu_seqlens`` (int64, shape
``[S + 1]``): sequence ``i`` owns tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``. Empty sequences
(equal neighbours) are allowed, so a sequence whose tokens were all dropped keeps its slot.
Everything here is exact integer/boolean bookkeeping, so it gives identical answers on any device.
"""
from __future__ import annotations

import torch


def check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    """Raise ``ValueError`` unless ``cu_seqlens`` is a valid boundary vector for ``num_tokens`` tokens.

    Losses silently misattribute tokens to the wrong sequence if boundaries are off by one, so bad
    packing is refused loudly here instead of producing a plausible-looking wrong number.
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise ValueError("cu_seqlens must be a 1-D integer tensor of shape [num_seqs + 1]")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must hold at least one boundary (0)")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[0]}")
    if any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError("cu_seqlens must be non-decreasing")
    if bounds[-1] != num_tokens:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the packed tensor has {num_tokens} tokens")


def seq_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Tokens per sequence, ``[S]`` int64."""
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def broadcast_to_tokens(per_seq: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Repeat one value per sequence onto each of that sequence's tokens: ``[S] -> [T]``.

    Used to turn per-sample advantages (GRPO, baseline) into the per-token advantages the policy
    loss takes, so sequence-level and token-level advantage sources (e.g. OPD) share one interface.
    """
    if per_seq.dim() != 1 or per_seq.numel() != cu_seqlens.numel() - 1:
        raise ValueError(
            f"expected one value per sequence ({cu_seqlens.numel() - 1}), got shape {tuple(per_seq.shape)}")
    check_cu_seqlens(cu_seqlens, int(cu_seqlens[-1]))
    return torch.repeat_interleave(per_seq, seq_lengths(cu_seqlens).to(per_seq.device))


def per_seq_sum(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` within each sequence, ``[T] -> [S]``, computed in float64.

    A float64 prefix sum differenced at the boundaries: deterministic on every device (no atomics)
    and exact for 0/1 masks, which is what it is used for (trained-token counts per sequence).
    """
    prefix = torch.cat([values.new_zeros(1, dtype=torch.float64), values.to(torch.float64).cumsum(0)])
    idx = cu_seqlens.to(values.device).long()
    return prefix[idx[1:]] - prefix[idx[:-1]]
