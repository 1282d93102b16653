"""Per-sample advantages from scalar rewards: GRPO group normalisation and a running baseline.

Advantages are plain tensors; ``broadcast_to_tokens`` (in ``packed``) spreads them onto tokens,
so other per-token advantage sources (on-policy distillation, critics) plug into the same loss.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

GROUP_MODES = ("grpo", "dr_grpo")


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, mode: str = "grpo",
                     eps: float = 1e-6, singleton_baseline: float = 0.0) -> torch.Tensor:
    """Advantage of each sample relative to the other samples drawn for the same prompt.

    ``mode="grpo"``: ``A_i = (r_i - mean_g) / (std_g + eps)`` (DeepSeekMath GRPO). ``std_g`` is the
    *sample* standard deviation (Bessel, divide by ``n - 1``), as in GRPO's reference implementations,
    so a pair of rewards {0, 1} gives advantages of about +-0.707, not +-1.
    ``mode="dr_grpo"``: ``A_i = r_i - mean_g`` (Dr. GRPO). Dividing by the std up-weights prompts
    whose rewards barely differ (too easy / too hard), a difficulty bias Dr. GRPO removes.

    Groups of one (live chat yields one reply per prompt) have no peers to compare with; the group
    rule would give exactly 0 and throw away the only signal, so they get
    ``A_i = r_i - singleton_baseline`` instead (pass ``RunningBaseline.value`` to centre them).
    A group whose rewards are all equal gets 0: no sample in it was better than another.

    Statistics are computed in float64 on the CPU (rewards are small, ``[N]``) so the result is
    bit-identical however the trainer is sharded; the result has ``rewards``' dtype and device.
    """
    if mode not in GROUP_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; expected one of {GROUP_MODES}")
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be [N]; got {tuple(rewards.shape)} "
                         f"and {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point:
        raise ValueError("group_ids must be integers (one id per prompt)")
    r = rewards.detach().to("cpu", torch.float64)
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite")
    _, inverse = torch.unique(group_ids.detach().cpu(), return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, r) / count
    centred = r - mean[inverse]
    if mode == "grpo":
        sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inverse, centred * centred)
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std[inverse] + eps)
    advantages = torch.where(count[inverse] == 1, r - singleton_baseline, centred)
    return advantages.to(device=rewards.device, dtype=rewards.dtype)


def baseline_advantage(rewards: torch.Tensor, baseline: float | torch.Tensor) -> torch.Tensor:
    """``A_i = r_i - b``: REINFORCE with a baseline, for one sample per prompt.

    Subtracting a baseline leaves the policy gradient unbiased (``E[grad log pi] = 0``) while
    cutting its variance, so a reply that is merely average stops being reinforced.
    """
    return rewards - baseline


class RunningBaseline:
    """Exponential moving average of rewards, a baseline for single-sample (live chat) advantages.

    ``value <- decay * value + (1 - decay) * r`` per reward, in arrival order; the first reward
    sets ``value`` directly, so early advantages are not pulled towards an arbitrary 0 start.
    State is two floats and a count (``state_dict``), so it survives trainer restarts.
    """

    def __init__(self, decay: float = 0.9):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        self.value = 0.0
        self.count = 0

    def update(self, rewards: Iterable[float]) -> None:
        for r in rewards:
            r = float(r)
            if not math.isfinite(r):
                raise ValueError(f"reward must be finite, got {r}")
            self.value = r if self.count == 0 else self.decay * self.value + (1.0 - self.decay) * r
            self.count += 1

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Advantages against the baseline *before* this batch, then fold the batch in.

        Using the old value keeps each sample out of its own baseline (which would bias the
        gradient towards zero for small batches).
        """
        adv = baseline_advantage(rewards, self.value)
        self.update(rewards.detach().reshape(-1).tolist())
        return adv

    def state_dict(self) -> dict:
        return {"decay": self.decay, "value": self.value, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        missing = {"decay", "value", "count"} - set(state)
        if missing:
            raise ValueError(f"RunningBaseline state is missing {sorted(missing)}")
        if not 0.0 <= float(state["decay"]) < 1.0 or int(state["count"]) < 0:
            raise ValueError(f"invalid RunningBaseline state {state}")
        self.decay, self.value, self.count = float(state["decay"]), float(state["value"]), int(state["count"])
