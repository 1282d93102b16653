"""Rollout/trainer mismatch correction.

The inference engine (bf16 kernels, different batching, possibly stale weights) samples from a
distribution ``pi_rollout`` that differs slightly from what the trainer computes for the same
weights, ``pi_old``. PPO's ratio is taken against ``pi_old``, so the samples are off-policy by
``rho = pi_old / pi_rollout`` per token. Both corrections below look at
``rho = exp(old_logprobs - rollout_logprobs)`` and return *detached* per-token weights that
multiply the policy-gradient term; they never push gradient into the old/rollout logprobs.
"""
from __future__ import annotations

import math

import torch

MAX_MISMATCH_LOG_RATIO = 20.0  # keeps rho finite in float32 for absurd mismatches


def _mismatch_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    if old_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(f"old_logprobs {tuple(old_logprobs.shape)} and rollout_logprobs "
                         f"{tuple(rollout_logprobs.shape)} differ")
    log_rho = (old_logprobs - rollout_logprobs).detach()
    return torch.exp(log_rho.clamp(-MAX_MISMATCH_LOG_RATIO, MAX_MISMATCH_LOG_RATIO))


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: ``w = min(rho, cap)``, detached.

    Reweights each token back to the trainer's distribution; truncating at ``cap`` (e.g. 2) trades
    a little bias for bounded variance, since a token the engine rarely samples would otherwise get
    an enormous weight.
    """
    if not cap > 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    return _mismatch_ratio(old_logprobs, rollout_logprobs).clamp(max=cap)


def icepop_mask(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                low: float, high: float) -> torch.Tensor:
    """IcePop's acceptance region: ``True`` where ``low <= rho <= high`` (bool ``[T]``).

    Tokens outside the band are ones the two engines disagree on badly; IcePop (Ring-1T) drops
    them from the update entirely rather than reweighting them, because for such tokens the
    importance weight itself is unreliable.
    """
    if not (0.0 < low <= 1.0 <= high) or not math.isfinite(high):
        raise ValueError(f"IcePop band must satisfy 0 < low <= 1 <= high < inf, got [{low}, {high}]")
    rho = _mismatch_ratio(old_logprobs, rollout_logprobs)
    return (rho >= low) & (rho <= high)


def mismatch_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     tis_cap: float | None, icepop_band: tuple[float, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token detached weight for the policy-gradient term, and IcePop's accepted-token mask.

    The exact rule (``rho = pi_old / pi_rollout``):

    * neither set: ``w = 1`` (no correction; all tokens accepted);
    * ``tis_cap`` only: ``w = min(rho, tis_cap)`` (TIS);
    * ``icepop_band=(a, b)`` only: ``w = rho`` if ``a <= rho <= b`` else ``0``: IcePop's
      ``M(rho) = rho * 1[a <= rho <= b]``, which calibrates accepted tokens by their importance
      weight and zeroes the gradient of rejected ones;
    * both: ``w = min(rho, tis_cap) * 1[a <= rho <= b]``.

    Rejected tokens stay in the aggregation denominator (their weight is 0, not removed), so the
    normaliser is known before the forward pass and micro-batch invariance holds.
    """
    if icepop_band is None:
        accepted = torch.ones_like(old_logprobs, dtype=torch.bool)
    else:
        accepted = icepop_mask(old_logprobs, rollout_logprobs, *icepop_band)
    if tis_cap is not None:
        weights = tis_weights(old_logprobs, rollout_logprobs, tis_cap)
    elif icepop_band is not None:
        weights = _mismatch_ratio(old_logprobs, rollout_logprobs)
    else:
        weights = torch.ones_like(old_logprobs).detach()
    return weights * accepted, accepted
