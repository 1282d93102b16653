"""clawrl's RL losses: pure torch functions on packed ``[T]`` token tensors.

Vocabulary-level work (``token_logprobs``, ``token_entropy``, ``topk_logprobs``) is kept apart from
the token-level losses so a tensor-parallel trainer can replace just those three, with their
``vocab_parallel_*`` versions. Aggregation takes the global
denominator explicitly, so gradient accumulation gives the same update however a batch is split.
"""
from clawrl.losses.advantages import GROUP_MODES, RunningBaseline, baseline_advantage, group_advantages
from clawrl.losses.aggregate import (AGGREGATION_MODES, aggregate, aggregation_denominator, masked_mean,
                                     token_weights)
from clawrl.losses.correction import icepop_mask, mismatch_weights, tis_weights
from clawrl.losses.distill import (topk_distill_loss, topk_forward_kl, topk_logprobs, topk_reverse_kl,
                                   weighted_nll)
from clawrl.losses.kl import KL_ESTIMATORS, kl_penalty
from clawrl.losses.logits import token_entropy, token_logprobs
from clawrl.losses.opd import combine_advantages, opd_advantages
from clawrl.losses.packed import broadcast_to_tokens, check_cu_seqlens, per_seq_sum, seq_lengths
from clawrl.losses.policy import PolicyLossConfig, policy_loss
from clawrl.losses.surrogate import ClipOutput, entropy_bonus, ppo_clip_loss
from clawrl.losses.vocab_parallel import (vocab_parallel_token_entropy, vocab_parallel_token_logprobs,
                                          vocab_parallel_topk_logprobs)

__all__ = [
    "AGGREGATION_MODES", "ClipOutput", "GROUP_MODES", "KL_ESTIMATORS", "PolicyLossConfig", "RunningBaseline",
    "aggregate", "aggregation_denominator", "baseline_advantage", "broadcast_to_tokens", "check_cu_seqlens",
    "combine_advantages", "entropy_bonus", "group_advantages", "icepop_mask", "kl_penalty", "masked_mean",
    "mismatch_weights", "opd_advantages", "per_seq_sum", "policy_loss", "ppo_clip_loss", "seq_lengths",
    "tis_weights", "token_entropy", "token_logprobs", "token_weights", "topk_distill_loss",
    "topk_forward_kl", "topk_logprobs", "topk_reverse_kl", "vocab_parallel_token_entropy",
    "vocab_parallel_token_logprobs", "vocab_parallel_topk_logprobs", "weighted_nll",
]
