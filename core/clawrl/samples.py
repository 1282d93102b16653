"""The training sample: what the rollout buffer hands the trainer.

One sample is one assistant turn as it was served, or an environment's episode or one of its model
turns (token-in, token-out): the exact prompt ids,
the sampled response ids, the logprob of each response token under the policy that sampled it,
and the weight version of each token. The buffer fills in the reward and the advantage, and a
method (``clawrl.methods``) its own typed signal, such as OPD's teacher scores; the trainer
recomputes logprobs and never re-tokenises text.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TeacherSignal:
    """The OPD teacher's view of a sample's sampled tokens under the hinted prompt
    (``clawrl.methods.opd``): what the OPD advantage and the top-k distillation term train on."""

    teacher_logprobs: list[float]  # one per response token
    topk_ids: list[list[int]] | None = None  # [T][K] the teacher's top-k ids (opd.topk > 0)
    topk_logprobs: list[list[float]] | None = None  # [T][K] their logprobs, at temperature 1
    hint: str = ""  # the hint the teacher was given
    teacher: str = "policy"  # opd.teacher when it scored: policy or a model path
    weight_version: int = 0  # the teacher's weight version when it scored
    # opd.hinted_sample: the teacher's own reply sampled under the hinted prompt (token ids as sampled),
    # which the student trains on under its original prompt with token NLL times ``hinted_weight`` (the
    # hint judge's acceptance: the share of its votes that accepted); None without one
    hinted_ids: list[int] | None = None
    hinted_weight: float = 0.0


@dataclass(frozen=True)
class ReferenceReply:
    """The frozen reference's own reply to a sample's prompt (``train.replay_coef``): the token ids as it
    decoded them and, with ``train.replay_topk`` K > 0, its top-K ids and logprobs (temperature 1) at
    each of their positions, what the replay term trains toward."""

    ids: list[int]
    topk_ids: list[list[int]] | None = None  # [T][K]
    topk_logprobs: list[list[float]] | None = None  # [T][K]


# Where a sample comes from: a served chat turn, a whole episode (env.sample_mode=trajectory) or one
# model turn of an episode (per_turn); ``Sample.source_id`` is the turn's, episode's or step's id.
TURN, EPISODE, STEP = "turn", "episode", "step"


@dataclass
class Sample:
    sample_id: int
    turn_id: int  # the served turn (source turn); 0 for environment samples
    group_id: str  # samples of one prompt share it (GRPO groups); a live-chat turn is a group of one
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # per response token, from the engine
    weight_versions: list[int]  # per response token
    reward: float
    advantage: float  # per-sample scalar, broadcast over response tokens by the trainer
    # 1 where a response token trains; None: every response token trains
    loss_mask: list[int] | None = None
    # False when no judged reward stands behind ``reward`` (under OPD no reward judge runs, or it saw no
    # signal): the sample then trains only on what else it has, never on a made-up reward of 0
    rl_signal: bool = True
    # OPD: the teacher's scores of the response tokens; None when the turn had no scored hint
    teacher: TeacherSignal | None = None
    # bookkeeping the buffer adds (weight_lag, judge_kind, temperature, opd_state); trainers read temperature
    extra: dict = field(default_factory=dict)
    source: str = TURN
    source_id: int = 0  # the id of the source row; 0 for a sample that was never stored
    # train.replay_coef: the frozen reference's own reply to ``prompt_ids``, which the torch trainer writes
    # just before the step and trains on (clawrl.trainers.replay); None: no replay
    replay: ReferenceReply | None = None

    @property
    def origin(self) -> str:
        """Where it came from, for logs: "turn 12", "episode 3", "step 40"."""
        return f"{self.source} {self.source_id or self.turn_id}"

    @property
    def oldest_version(self) -> int:
        return min(self.weight_versions) if self.weight_versions else 0
