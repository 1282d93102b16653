"""The training sample: what the rollout buffer hands the trainer.

One sample is one assistant turn as it was served (token-in, token-out): the exact prompt ids,
the sampled response ids, the logprob of each response token under the policy that sampled it,
and the weight version of each token. The buffer fills in the reward and the advantage; the
trainer recomputes logprobs and never re-tokenises text.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    sample_id: int
    turn_id: int
    group_id: str  # samples of one prompt share it (GRPO groups); a live-chat turn is a group of one
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # per response token, from the engine
    weight_versions: list[int]  # per response token
    reward: float
    advantage: float  # per-sample scalar, broadcast over response tokens by the trainer
    # 1 where a response token trains; None: every response token trains
    loss_mask: list[int] | None = None
    # extra per-sample data a method adds (e.g. OPD teacher logprobs); the torch trainer ignores unknown keys
    extra: dict = field(default_factory=dict)

    @property
    def oldest_version(self) -> int:
        return min(self.weight_versions) if self.weight_versions else 0
