"""The chat methods' per-token advantage: a judged reward, a teacher's hint, or both.

Binary RL, OPD and Combine are three weightings of one rule (OpenClaw-RL's combination),
``A = w_rl * A_rl + w_opd * A_opd`` per token: rl is (1, 0), opd is (0, 1), combine is
(``combine.w_rl``, ``combine.w_opd``).

- ``A_rl`` is the sample's scalar advantage from the buffer (its judged reward, group-normalised or
  against a baseline), on every response token, where the sample has a judged reward
  (``Sample.rl_signal``).
- ``A_opd = clamp(teacher_logprobs - rollout_logprobs, +-opd.adv_clip)`` per token, where the sample has
  a teacher signal (``Sample.teacher``). The student side is the *rollout* logprobs, not the trainer's
  recomputed pi_old: both sides then come from the same engine and numerics (bf16 serving vs fp32
  training on GPU), so the gap is the hint's effect alone; the rollout/trainer mismatch is the PPO
  ratio's business (TIS/IcePop), as for RL. The teacher scores at temperature 1, so the gap is exact
  for turns served at temperature 1 (the OpenAI default).

A sample with a reward contributes the RL term, one with teacher logprobs the OPD term, one with both,
both; tokens with neither are dropped from the loss mask (no zero-advantage dilution). The result goes
through the same PPO clip as RL advantages.
"""
from __future__ import annotations

from clawrl.losses import combine_advantages, opd_advantages
from clawrl.trainers.batching import MicroBatch


def mix_advantages(batches: list[MicroBatch], w_rl: float, w_opd: float, opd_clip: float | None) -> dict[str, float]:
    """``A = w_rl * A_rl + w_opd * A_opd`` in place (module docstring); ``loss_mask`` drops tokens of
    samples with no signal of positive weight. Returns how many samples trained on which signal and
    the mean OPD advantage over the tokens it trained."""
    counts = {"rl": 0, "opd": 0, "both": 0}
    opd_sum, opd_tokens = 0.0, 0.0
    for mb in batches:
        has_rl, has_opd = mb.has_rl & (w_rl > 0), mb.has_opd & (w_opd > 0)
        a_opd = opd_advantages(mb.teacher_logprobs, mb.rollout_logprobs, mb.loss_mask, clip=opd_clip)
        mb.advantages, trained = combine_advantages(mb.advantages, a_opd, w_rl, w_opd, has_rl, has_opd)
        mb.loss_mask = mb.loss_mask * trained.to(mb.loss_mask.dtype)
        opd_mask = mb.loss_mask * has_opd.to(mb.loss_mask.dtype)
        opd_sum += float((a_opd * opd_mask).sum())
        opd_tokens += float(opd_mask.sum())
        first = mb.cu_seqlens[:-1]  # one token per sequence (responses are never empty)
        for rl, opd in zip(has_rl[first].tolist(), has_opd[first].tolist()):
            if rl or opd:
                counts["both" if rl and opd else "rl" if rl else "opd"] += 1
    return {"samples_rl_only": counts["rl"], "samples_opd_only": counts["opd"], "samples_both": counts["both"],
            "opd_advantage_mean": opd_sum / opd_tokens if opd_tokens else 0.0, "opd_tokens": opd_tokens}
