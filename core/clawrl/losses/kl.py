"""Per-token KL estimators between the policy and a frozen reference (Schulman, "Approximating KL
Divergence", 2020), from sampled-token logprobs only (no vocabulary sums).

With tokens sampled from the policy ``pi`` and ``log_ratio = log pi - log pi_ref``:

* ``k1 = log_ratio``: unbiased for KL(pi || ref), high variance, can be negative per token. Its
  gradient as a loss is ``grad log pi``, zero in expectation, so use k1 as a *reward penalty*
  (fold ``-kl_coef * k1`` into the reward/advantage), not as a loss term.
* ``k2 = log_ratio^2 / 2``: biased but low variance, always >= 0; as a loss its on-policy
  gradient ``E[log_ratio * grad log pi]`` is exactly the gradient of KL(pi || ref).
* ``k3 = (exp(-log_ratio) - 1) + log_ratio``: unbiased, low variance, always >= 0 (GRPO's
  choice); as a loss its on-policy gradient is that of the *forward* KL(ref || pi).

The result is per-token ``[T]``: add ``kl_coef * kl`` to the per-token loss, or detach it and
subtract it from per-token rewards.
"""
from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
# k3 contains exp(-log_ratio); clamping log_ratio here keeps it finite in float32 (e^20 ~ 5e8).
MAX_KL_LOG_RATIO = 20.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3",
               k3_max: float | None = 10.0) -> torch.Tensor:
    """Per-token KL estimate ``[T]`` of the policy from the reference; see the module docstring.

    ``k3_max`` clamps k3 from above (verl's "low_var_kl" uses 10). A token whose reference
    probability is far above the policy's (``log_ratio`` very negative) gives ``k3 ~ e^|log_ratio|``,
    so one such token would otherwise swamp the batch loss and gradient. Past the clamp the token
    contributes ``k3_max`` and no gradient; tokens that far off are better handled by the clip.
    ``None`` disables the clamp (the log-ratio itself is always clamped to +-20 to stay finite).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ")
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio * log_ratio
    log_ratio = log_ratio.clamp(-MAX_KL_LOG_RATIO, MAX_KL_LOG_RATIO)
    k3 = torch.expm1(-log_ratio) + log_ratio
    return k3 if k3_max is None else k3.clamp(max=k3_max)
