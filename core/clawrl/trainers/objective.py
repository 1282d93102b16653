"""The training objective of one step, shared by the torch and megatron backends.

Both backends call the same code for everything after the logits, so they can only differ in how
the logits are computed and where the vocabulary lives. ``VocabOps`` is that difference: full
logits on one device (``FullLogits``) or a tensor-parallel vocabulary shard (the megatron
backend's ``ShardLogits``). Everything else -- the policy loss with TIS/IcePop, KL and entropy, the
top-k distillation term, the global aggregation denominator, and the step's metrics -- lives here
once. The per-token advantages it trains with come from the run's method
(``clawrl.methods``: ``Method.advantages``), which also says whether the top-k term applies.
"""
from __future__ import annotations

from typing import Protocol

import torch

from clawrl.config import ClawrlConfig
from clawrl.losses import (PolicyLossConfig, aggregate, kl_penalty, policy_loss, token_entropy, token_logprobs,
                           topk_forward_kl, topk_logprobs, topk_reverse_kl, weighted_nll)
from clawrl.losses.logits import DEFAULT_CHUNK, token_logprobs_and_entropy
from clawrl.trainers.base import TrainerError
from clawrl.trainers.batching import MicroBatch

TOPK_KL = ("reverse", "forward")


class VocabOps(Protocol):
    """The vocabulary-level quantities of one micro-batch's logits (already divided by the
    per-token sampling temperature)."""

    def logprobs(self, targets: torch.Tensor) -> torch.Tensor: ...  # [T]

    def entropy(self) -> torch.Tensor: ...  # [T]

    def logprobs_and_entropy(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...  # [T], [T]

    def topk_logprobs_t1(self, ids: torch.Tensor) -> torch.Tensor: ...  # [T, K] at temperature 1


class FullLogits:
    """``VocabOps`` over full ``[T, V]`` logits on one device; ``fused``: the vocabulary passes as
    compiled kernels (``clawrl.losses.logits``; the trainers pass ``train.compile``'s decision)."""

    def __init__(self, logits: torch.Tensor, temperature: torch.Tensor, fused: bool = False):
        self.logits, self.temperature, self.fused = logits, temperature, fused
        self._memo: tuple[torch.Tensor, torch.Tensor] | None = None  # (targets, their logprobs)

    def logprobs(self, targets: torch.Tensor) -> torch.Tensor:
        """Memoised per ``targets``: pi_old taken from the loss's forward and the loss itself read the
        same tensor, and the pass over the ``[T, V]`` logits runs once."""
        if self._memo is None or self._memo[0] is not targets:
            self._memo = (targets, token_logprobs(self.logits, targets, chunk_size=DEFAULT_CHUNK,
                                                       fused=self.fused))
        return self._memo[1]

    def entropy(self) -> torch.Tensor:
        return token_entropy(self.logits, chunk_size=DEFAULT_CHUNK, fused=self.fused)

    def logprobs_and_entropy(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``logprobs(targets)`` (memoised, with its gradient) and the detached entropy from one pass
        over the ``[T, V]`` logits where the logprobs are not known yet: a second pass at 16k tokens of
        a 150k vocabulary is milliseconds and gigabytes of chunk buffers."""
        if self._memo is not None and self._memo[0] is targets:
            with torch.no_grad():
                return self._memo[1], self.entropy()
        lp, entropy = token_logprobs_and_entropy(self.logits, targets, DEFAULT_CHUNK, self.fused)
        self._memo = (targets, lp)
        return lp, entropy

    def topk_logprobs_t1(self, ids: torch.Tensor) -> torch.Tensor:
        # the teacher's top-k is at temperature 1: undo the sample's temperature
        return topk_logprobs(self.logits * self.temperature.to(self.logits.dtype)[:, None], ids)


def pi_old(ops: VocabOps, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pi_old's logprobs of ``mb``'s response tokens (detached), the sum of the trained tokens'
    entropies, and the largest gap to the rollout's logprobs (both device scalars, read once per
    step), from one pass over the logits: what both trainers take before the loss, from a no-grad
    forward or the loss's own."""
    lp, entropy = ops.logprobs_and_entropy(mb.targets)
    old = lp.detach()
    return old, (entropy.detach() * mb.loss_mask).sum(), ((old - mb.rollout_logprobs).abs() * mb.loss_mask).max()


class Objective:
    """One run's objective, from ``cfg.train`` and ``cfg.opd``'s top-k settings. ``topk``: K of the
    teacher's top-k the micro-batches carry (``Method.topk``; 0: no top-k distillation term)."""

    def __init__(self, cfg: ClawrlConfig, topk: int):
        train_cfg = cfg.train
        self.train_cfg = train_cfg
        band = tuple(train_cfg.icepop_band) if train_cfg.icepop_band is not None else None
        # kl_in_reward: the KL is folded into the advantage instead of being a loss term.
        self.loss_cfg = PolicyLossConfig(
            eps_clip_low=train_cfg.eps_clip_low, eps_clip_high=train_cfg.eps_clip_high,
            dual_clip_c=train_cfg.dual_clip_c, kl_coef=0.0 if train_cfg.kl_in_reward else train_cfg.kl_coef,
            kl_estimator=train_cfg.kl_estimator, entropy_coef=train_cfg.entropy_coef, tis_cap=train_cfg.tis_cap,
            icepop_band=band, aggregation=train_cfg.aggregation)
        opd_cfg = cfg.opd
        self.topk, self.topk_coef = topk, opd_cfg.topk_coef
        if opd_cfg.topk_kl not in TOPK_KL:
            raise TrainerError(f"opd.topk_kl must be one of {', '.join(TOPK_KL)}, not {opd_cfg.topk_kl!r}")
        self.topk_kl = opd_cfg.topk_kl
        self.hinted_coef = opd_cfg.hinted_coef  # opd.hinted_sample's NLL term (MicroBatch.hinted_weight)
        self.replay_coef = train_cfg.replay_coef  # the reference replay's NLL term (MicroBatch.replay_mask)

    @property
    def needs_reference(self) -> bool:
        return self.train_cfg.kl_coef > 0

    def loss(self, ops: VocabOps, mb: MicroBatch, old: torch.Tensor, ref: torch.Tensor | None,
             denominator: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the step loss, and its metric sums (``StepStats.add``) as device
        scalars: reading each here would make the host wait for the forward before the backward is
        queued, once per metric."""
        train_cfg, mode = self.train_cfg, self.loss_cfg.aggregation
        lp = ops.logprobs(mb.targets)
        entropy = ops.entropy() if train_cfg.entropy_coef != 0 else None
        advantages = mb.advantages
        if train_cfg.kl_in_reward and ref is not None:
            advantages = advantages - train_cfg.kl_coef * kl_penalty(old, ref, train_cfg.kl_estimator)
        loss, m = policy_loss(lp, old, advantages, mb.loss_mask, mb.cu_seqlens, self.loss_cfg,
                              rollout_logprobs=mb.rollout_logprobs, ref_logprobs=ref, entropy=entropy,
                              global_denominator=denominator)
        sums: dict[str, torch.Tensor] = {}
        if mb.topk_mask is not None and bool((mb.topk_mask * mb.loss_mask).any()):
            distill_mask = mb.topk_mask * mb.loss_mask
            student = ops.topk_logprobs_t1(mb.topk_ids)
            kl = (topk_reverse_kl if self.topk_kl == "reverse" else topk_forward_kl)(student, mb.topk_logprobs)
            loss = loss + self.topk_coef * aggregate(kl, distill_mask, mb.cu_seqlens, mode,
                                                     global_denominator=denominator)
            sums["topk_kl_sum"] = (kl.detach() * distill_mask).sum()
            sums["topk_tokens"] = distill_mask.sum()
        if mb.hinted_weight is not None and self.hinted_coef > 0:
            # a teacher's reply under the hinted prompt, trained under the student's prompt (opd.hinted_sample);
            # same denominator as the policy loss, so the term weighs per token like the rest of the step
            nll_loss, nll = weighted_nll(lp, mb.hinted_weight, mb.cu_seqlens, mode, global_denominator=denominator)
            loss = loss + self.hinted_coef * nll_loss
            hinted_mask = (mb.hinted_weight > 0).to(nll.dtype)
            sums["hinted_nll_sum"] = (nll.detach() * hinted_mask).sum()
            sums["hinted_tokens"] = hinted_mask.sum()
        if mb.replay_mask is not None and self.replay_coef > 0:
            # the frozen reference's own reply to the sample's prompt (train.replay_coef): pulls what the
            # feedback does not judge back toward the start, on the reference's tokens rather than the
            # policy's (the KL above acts only on tokens the drifting policy sampled); with the reference's
            # top-k (train.replay_topk) the forward KL to its distribution there, else the NLL of its ids
            nll_loss, nll = weighted_nll(lp, mb.replay_mask, mb.cu_seqlens, mode, global_denominator=denominator)
            if mb.replay_topk_ids is not None:
                # on the replay's rows only: the other rows carry no distribution (their placeholder would
                # give NaN, and NaN times a zero mask is NaN)
                rows = mb.replay_mask.nonzero().squeeze(-1)
                student = ops.topk_logprobs_t1(mb.replay_topk_ids)[rows]
                kl = torch.zeros_like(lp, dtype=student.dtype).index_put(
                    (rows,), topk_forward_kl(student, mb.replay_topk_logprobs[rows]))
                loss = loss + self.replay_coef * aggregate(kl, mb.replay_mask, mb.cu_seqlens, mode,
                                                           global_denominator=denominator)
                sums["replay_kl_sum"] = (kl.detach() * mb.replay_mask).sum()
            else:
                loss = loss + self.replay_coef * nll_loss
            sums["replay_nll_sum"] = (nll.detach() * mb.replay_mask).sum()
            sums["replay_tokens"] = mb.replay_mask.sum()
        weight = m["trained_tokens"]
        for k, v in m.items():
            if k == "pg_loss":
                sums[k] = v.detach()
            elif k != "trained_tokens":
                sums[k] = v.detach() * weight
        return loss, sums


def host_floats(values: list) -> list[float]:
    """``values`` (floats and device scalars) as floats, the scalars read in one transfer."""
    scalars = [v.detach().float().reshape(()) for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack(scalars).tolist() if scalars else ())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


class StepStats:
    """Adds up per-micro-batch metric sums (from ``Objective.loss``) into the step's metrics. The sums
    stay on the device until ``read`` brings them all over in one transfer."""

    def __init__(self):
        self.sums: dict[str, float | torch.Tensor] = {}
        self.loss: float | torch.Tensor = 0.0

    def add(self, loss: float | torch.Tensor, sums: dict[str, float | torch.Tensor]) -> None:
        self.loss = self.loss + (loss.detach() if isinstance(loss, torch.Tensor) else loss)
        for k, v in sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def merge(self, other: "StepStats") -> None:
        self.add(other.loss, other.sums)

    def read(self) -> "StepStats":
        """Make every sum a float, with one wait on the device for all of them."""
        keys = list(self.sums)
        values = host_floats([self.loss, *(self.sums[k] for k in keys)])
        self.loss, self.sums = values[0], dict(zip(keys, values[1:]))
        return self

    def metrics(self, trained: float) -> dict[str, float]:
        sums = dict(self.read().sums)
        out: dict[str, float] = {}
        topk_kl, topk_tokens = sums.pop("topk_kl_sum", None), sums.pop("topk_tokens", 0.0)
        hinted_nll, hinted_tokens = sums.pop("hinted_nll_sum", None), sums.pop("hinted_tokens", 0.0)
        replay_nll, replay_tokens = sums.pop("replay_nll_sum", None), sums.pop("replay_tokens", 0.0)
        replay_kl = sums.pop("replay_kl_sum", None)
        for k, v in sums.items():
            out[k] = v if k == "pg_loss" else v / max(trained, 1.0)
        if topk_kl is not None:
            out["topk_kl"] = topk_kl / max(topk_tokens, 1.0)
        if hinted_nll is not None:  # mean NLL of the hinted replies' tokens (opd.hinted_sample)
            out["hinted_nll"] = hinted_nll / max(hinted_tokens, 1.0)
            out["hinted_tokens"] = hinted_tokens
        if replay_nll is not None:  # mean NLL of the reference's replayed replies (train.replay_coef)
            out["replay_nll"] = replay_nll / max(replay_tokens, 1.0)
            out["replay_tokens"] = replay_tokens
        if replay_kl is not None:  # mean forward KL from the reference's top-k there (train.replay_topk)
            out["replay_kl"] = replay_kl / max(replay_tokens, 1.0)
        if "rollout_logprob_abs_gap" in out:
            out["rollout_logprob_gap_mean"] = out.pop("rollout_logprob_abs_gap")
        out["loss"] = self.loss
        return out
