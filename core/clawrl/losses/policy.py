"""The composed policy loss: PPO surrogate x mismatch correction + KL + entropy, aggregated.

One call per micro-batch. Every input is a packed per-token ``[T]`` tensor, so the advantage can
come from anywhere (GRPO, a running baseline, later a teacher-student logprob gap for on-policy
distillation) and extra per-token terms slot in before aggregation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from clawrl.losses.aggregate import AGGREGATION_MODES, aggregate, masked_mean
from clawrl.losses.correction import mismatch_weights
from clawrl.losses.kl import KL_ESTIMATORS, kl_penalty
from clawrl.losses.surrogate import entropy_bonus, ppo_clip_loss


@dataclass(frozen=True)
class PolicyLossConfig:
    """Knobs of ``policy_loss``; frozen so one config describes one run's objective."""

    eps_clip_low: float = 0.2              # ratio may fall to 1 - eps_clip_low before clipping
    eps_clip_high: float = 0.28            # ratio may rise to 1 + eps_clip_high (DAPO clip-higher)
    dual_clip_c: float | None = 3.0        # cap -c*A for A < 0; None disables dual clip
    kl_coef: float = 0.0                   # weight of the per-token KL-to-reference loss term; 0: off
    kl_estimator: str = "k3"               # k1 | k2 | k3 (see clawrl.losses.kl)
    entropy_coef: float = 0.0              # weight of the entropy bonus; 0: off
    tis_cap: float | None = None           # truncated importance sampling cap on pi_old/pi_rollout
    icepop_band: tuple[float, float] | None = None  # accept tokens with pi_old/pi_rollout in [a, b]
    aggregation: str = "token-mean"        # token-mean | seq-mean-token-mean | seq-mean-token-sum
    token_sum_norm: float | None = None    # constant divisor for seq-mean-token-sum (Dr. GRPO)

    def __post_init__(self) -> None:
        if not (0.0 <= self.eps_clip_low < 1.0) or self.eps_clip_high < 0.0:
            raise ValueError(f"need 0 <= eps_clip_low < 1 and eps_clip_high >= 0, got "
                             f"{self.eps_clip_low}, {self.eps_clip_high}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must be > 1 or None, got {self.dual_clip_c}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_coef < 0 or not math.isfinite(self.kl_coef):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if not math.isfinite(self.entropy_coef):
            raise ValueError(f"entropy_coef must be finite, got {self.entropy_coef}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0 or None, got {self.tis_cap}")
        if self.icepop_band is not None:
            if len(self.icepop_band) != 2:
                raise ValueError(f"icepop_band must be (low, high), got {self.icepop_band}")
            low, high = self.icepop_band
            if not (0.0 < low <= 1.0 <= high) or not math.isfinite(high):
                raise ValueError(f"icepop_band needs 0 < low <= 1 <= high < inf, got {self.icepop_band}")
        if self.aggregation not in AGGREGATION_MODES:
            raise ValueError(f"aggregation must be one of {AGGREGATION_MODES}, got {self.aggregation!r}")
        if self.token_sum_norm is not None and (self.aggregation != "seq-mean-token-sum" or not self.token_sum_norm > 0):
            raise ValueError("token_sum_norm must be > 0 and needs aggregation='seq-mean-token-sum'")


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, config: PolicyLossConfig,
                rollout_logprobs: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None,
                global_denominator: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss for one (micro-)batch and its detached metrics.

    Per token: ``l_t = w_t * ppo_clip_loss_t + kl_coef * kl_t - entropy_coef * H_t``, where ``w_t``
    is the rollout/trainer mismatch weight (TIS / IcePop, see ``mismatch_weights``; 1 without
    ``rollout_logprobs``). The weight multiplies only the policy-gradient term, the part built on
    samples from the rollout engine; KL and entropy are properties of the current policy at those
    tokens. Then ``loss = aggregate(l, loss_mask, cu_seqlens, config.aggregation,
    global_denominator)``; pass ``global_denominator`` when accumulating micro-batches (see
    ``clawrl.losses.aggregate``).

    ``logprobs`` (and ``entropy``, if the bonus is on) carry gradient; ``old_logprobs``,
    ``rollout_logprobs`` and ``ref_logprobs`` are treated as constants. Metrics are masked means
    over this call's trained tokens, detached float32 scalars: ``clip_fraction``,
    ``dual_clip_fraction``, ``ratio_mean``, ``pg_loss`` (aggregated like the loss), ``trained_tokens``
    (weight for averaging metrics over micro-batches), plus ``kl_mean`` with ``ref_logprobs``,
    ``entropy_mean`` with ``entropy``, and with ``rollout_logprobs``: ``rollout_logprob_abs_gap``
    (mean |old - rollout|), ``tis_weight_mean`` (mean correction weight) and
    ``icepop_masked_fraction``.
    """
    shape = logprobs.shape
    named = {"old_logprobs": old_logprobs, "advantages": advantages, "loss_mask": loss_mask,
             "rollout_logprobs": rollout_logprobs, "ref_logprobs": ref_logprobs, "entropy": entropy}
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} like logprobs")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if config.entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")
    if (config.tis_cap is not None or config.icepop_band is not None) and rollout_logprobs is None:
        raise ValueError("tis_cap / icepop_band need rollout_logprobs")

    old_logprobs, advantages = old_logprobs.detach(), advantages.detach()
    clip = ppo_clip_loss(logprobs, old_logprobs, advantages, config.eps_clip_low, config.eps_clip_high,
                         config.dual_clip_c)
    pg = clip.loss
    metrics: dict[str, torch.Tensor] = {
        "clip_fraction": masked_mean(clip.clipped, loss_mask),
        "dual_clip_fraction": masked_mean(clip.dual_clipped, loss_mask),
        "ratio_mean": masked_mean(clip.ratio, loss_mask),
        "trained_tokens": loss_mask.detach().to(torch.float64).sum().to(torch.float32),
    }
    if rollout_logprobs is not None:
        rollout_logprobs = rollout_logprobs.detach()
        weights, accepted = mismatch_weights(old_logprobs, rollout_logprobs, config.tis_cap, config.icepop_band)
        pg = pg * weights.to(pg.dtype)
        metrics["rollout_logprob_abs_gap"] = masked_mean((old_logprobs - rollout_logprobs).abs(), loss_mask)
        metrics["tis_weight_mean"] = masked_mean(weights, loss_mask)
        metrics["icepop_masked_fraction"] = masked_mean(~accepted, loss_mask)
    total = pg
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs.detach(), config.kl_estimator)
        metrics["kl_mean"] = masked_mean(kl, loss_mask)
        if config.kl_coef > 0:
            total = total + config.kl_coef * kl
    if entropy is not None:
        metrics["entropy_mean"] = masked_mean(entropy, loss_mask)
        if config.entropy_coef != 0:
            total = total + entropy_bonus(entropy, config.entropy_coef)

    def reduce(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate(per_token, loss_mask, cu_seqlens, config.aggregation, global_denominator,
                         config.token_sum_norm)

    loss = reduce(total)
    metrics["pg_loss"] = reduce(pg.detach()).to(torch.float32)
    return loss, metrics
