"""Token-level policy-gradient terms: the PPO clipped surrogate (clip-higher, dual clip) and the
entropy bonus. All inputs and outputs are per-token ``[T]`` tensors; aggregation is separate."""
from __future__ import annotations

from typing import NamedTuple

import torch

# exp(20) ~ 5e8: far beyond any clip bound, yet finite in float32, so a wildly off-policy token
# yields a large-but-finite ratio instead of inf * 0 = NaN in the clipped branches.
MAX_LOG_RATIO = 20.0


class ClipOutput(NamedTuple):
    loss: torch.Tensor          # [T] per-token surrogate loss (to minimise)
    ratio: torch.Tensor         # [T] pi_new / pi_old, detached
    clipped: torch.Tensor       # [T] bool: the ratio clip bound is active (no gradient through ratio)
    dual_clipped: torch.Tensor  # [T] bool: the dual-clip cap -c * A is active (negative advantage)


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  eps_clip_low: float = 0.2, eps_clip_high: float = 0.2,
                  dual_clip_c: float | None = None) -> ClipOutput:
    """PPO clipped surrogate per token, with asymmetric bounds and optional dual clip.

    With ``r = exp(logprobs - old_logprobs)`` and advantage ``A``:

        L = max(-A * r, -A * clip(r, 1 - eps_clip_low, 1 + eps_clip_high))

    The max (a pessimistic bound) stops a step from moving a token's probability far past the
    trust region in the direction its advantage rewards. ``eps_clip_high > eps_clip_low`` is
    DAPO's "clip-higher": low-probability tokens with positive advantage may grow more, which
    keeps entropy from collapsing.

    Dual clip (Ye et al., 2020), for ``A < 0`` only: ``L = min(L, -dual_clip_c * A)``. When the
    ratio is huge (the token became much likelier since sampling) and the advantage is negative,
    the plain surrogate ``-A * r`` is unbounded and one stale token can dominate the batch; the
    cap bounds it at ``c * |A|`` and zeroes its gradient. ``c > 1`` (commonly 3), so the cap only
    bites for ``r > c``, far outside the trust region, and never for ordinary tokens.

    ``clipped`` marks tokens where the clip bound is the active branch (the ratio gets no
    gradient); ``dual_clipped`` marks tokens capped by the dual clip. Their masked means are the
    clip-fraction metrics.
    """
    if not (logprobs.shape == old_logprobs.shape == advantages.shape) or logprobs.dim() != 1:
        raise ValueError("logprobs, old_logprobs and advantages must all be [T] with equal shapes; got "
                         f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(advantages.shape)}")
    if not (0.0 <= eps_clip_low < 1.0) or eps_clip_high < 0.0:
        raise ValueError(f"need 0 <= eps_clip_low < 1 and eps_clip_high >= 0; got {eps_clip_low}, {eps_clip_high}")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (it caps the loss at c * |A|), got {dual_clip_c}")
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip_c is None:
        dual_clipped = torch.zeros_like(clipped)
    else:
        cap = -dual_clip_c * advantages
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
    return ClipOutput(loss, ratio.detach(), clipped, dual_clipped)


def entropy_bonus(entropy: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token loss term ``-coef * H``: minimising it raises entropy, against premature collapse
    of the policy onto a few tokens. Add it to the per-token loss before aggregation."""
    return -coef * entropy
