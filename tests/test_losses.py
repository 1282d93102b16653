"""RL losses on packed tensors: hand-computed values, clipping rules, mismatch correction, and
micro-batch invariance of every aggregation mode."""
import math

import pytest
import torch

from clawrl.losses import (
    PolicyLossConfig, RunningBaseline, aggregate, aggregation_denominator, baseline_advantage,
    broadcast_to_tokens, group_advantages, icepop_mask, kl_penalty, mismatch_weights, policy_loss,
    ppo_clip_loss, tis_weights, token_entropy, token_logprobs, weighted_nll,
)

D = torch.float64
LN2, LN3 = math.log(2.0), math.log(3.0)


def t(values, dtype=D):
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=D), torch.as_tensor(expected, dtype=D),
                               atol=atol, rtol=0)


# ---- advantages -------------------------------------------------------------------------------

def test_grpo_normalises_by_sample_std_within_each_group():
    # groups by id, not position: id 7 = {1, 2, 6}, id 3 = {0, 1}, id 5 = {2, 2}
    rewards = t([1.0, 0.0, 2.0, 1.0, 2.0, 2.0, 6.0])
    groups = torch.tensor([7, 3, 7, 3, 5, 5, 7])
    adv = group_advantages(rewards, groups, mode="grpo")
    # id 7: mean 3, deviations -2,-1,3, sample var 14/2 = 7, std 2.6457513
    # id 3: mean 0.5, deviations -+0.5, sample std 0.7071068 -> -+0.7071068
    # id 5: equal rewards -> 0
    close(adv, [-0.7559289, -0.7071068, -0.3779645, 0.7071068, 0.0, 0.0, 1.1338934], atol=1e-5)


def test_dr_grpo_only_centres():
    rewards = t([1.0, 0.0, 2.0, 1.0, 2.0, 2.0, 6.0])
    groups = torch.tensor([7, 3, 7, 3, 5, 5, 7])
    close(group_advantages(rewards, groups, mode="dr_grpo"), [-2.0, -0.5, -1.0, 0.5, 0.0, 0.0, 3.0])


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
def test_group_of_one_keeps_its_reward_instead_of_zero(mode):
    rewards = t([5.0, 1.0, 0.0])
    groups = torch.tensor([0, 1, 1])
    adv = group_advantages(rewards, groups, mode=mode)
    assert adv[0].item() == 5.0
    assert group_advantages(rewards, groups, mode=mode, singleton_baseline=1.5)[0].item() == 3.5


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="mode"):
        group_advantages(t([1.0]), torch.tensor([0]), mode="ppo")
    with pytest.raises(ValueError, match="finite"):
        group_advantages(t([float("nan")]), torch.tensor([0]))
    with pytest.raises(ValueError, match="shape|\\[N\\]"):
        group_advantages(t([1.0, 2.0]), torch.tensor([0]))


def test_running_baseline_uses_the_value_before_each_batch_and_survives_restart():
    rb = RunningBaseline(decay=0.5)
    close(rb.advantages(t([2.0])), [2.0])          # baseline 0 before the first reward; value -> 2
    close(rb.advantages(t([4.0, 0.0])), [2.0, -2.0])  # value -> 0.5*2+0.5*4 = 3 -> 0.5*3+0 = 1.5
    assert rb.value == 1.5 and rb.count == 3
    restored = RunningBaseline()
    restored.load_state_dict(rb.state_dict())
    close(restored.advantages(t([1.0])), [-0.5])
    assert restored.decay == 0.5
    close(baseline_advantage(t([1.0, 3.0]), 2.0), [-1.0, 1.0])
    with pytest.raises(ValueError, match="missing"):
        restored.load_state_dict({"value": 1.0})


def test_broadcast_to_tokens_follows_cu_seqlens_including_empty_sequences():
    out = broadcast_to_tokens(t([1.0, 2.0, 3.0]), torch.tensor([0, 2, 2, 5]))
    close(out, [1.0, 1.0, 3.0, 3.0, 3.0])
    with pytest.raises(ValueError, match="one value per sequence"):
        broadcast_to_tokens(t([1.0, 2.0]), torch.tensor([0, 2, 2, 5]))
    with pytest.raises(ValueError, match="non-decreasing"):
        broadcast_to_tokens(t([1.0, 2.0]), torch.tensor([0, 3, 2]))


# ---- logprobs / entropy from logits -----------------------------------------------------------

def test_token_logprobs_hand_values_and_temperature():
    logits = t([[0.0, 0.0, LN2], [0.0, 0.0, LN2]])  # probs 1/4, 1/4, 1/2
    close(token_logprobs(logits, torch.tensor([2, 0])), [math.log(0.5), math.log(0.25)])
    # T=2: z = [0, 0, ln2/2] -> p(2) = sqrt2 / (2 + sqrt2) = 1 / (1 + sqrt2)
    close(token_logprobs(logits, torch.tensor([2, 0]), temperature=2.0),
          [-math.log(1 + math.sqrt(2)), math.log(1 / (2 + math.sqrt(2)))])


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 100])
def test_token_logprobs_matches_log_softmax_gather_and_its_gradient(chunk_size):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 11, generator=gen) * 3).requires_grad_()
    targets = torch.randint(0, 11, (7,), generator=gen)
    ref_logits = logits.detach().clone().requires_grad_()
    ours = token_logprobs(logits, targets, temperature=0.7, chunk_size=chunk_size)
    ref = torch.log_softmax(ref_logits / 0.7, dim=-1)[torch.arange(7), targets]
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    ours.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-5, rtol=0)


def test_token_logprobs_upcasts_bf16_logits_to_fp32():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    targets = torch.tensor([0, 5, 10, 49])
    out = token_logprobs(logits, targets)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1)[torch.arange(4), targets]
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="target_ids must lie"):
        token_logprobs(logits, torch.tensor([0, 5, 10, 50]))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, temperature=0.0)


def test_token_entropy_hand_values_and_banned_tokens():
    logits = t([[0.0, 0.0, LN2], [1.0, 1.0, 1.0], [0.0, 0.0, float("-inf")]]).requires_grad_()
    # -(2 * 1/4 ln 1/4 + 1/2 ln 1/2) = 1.0397208; uniform over 3 = ln 3; uniform over 2 = ln 2
    h = token_entropy(logits, chunk_size=2)
    close(h, [1.0397208, LN3, LN2])
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    # T=2 on the first row: probs of [0, 0, ln2/2]
    p = torch.tensor([1.0, 1.0, math.sqrt(2)], dtype=D) / (2 + math.sqrt(2))
    close(token_entropy(logits.detach()[:1], temperature=2.0), [-(p * p.log()).sum().item()])


# ---- PPO surrogate ----------------------------------------------------------------------------

def ratios_to_logprobs(ratios):
    return t([math.log(r) for r in ratios]).requires_grad_(), torch.zeros(len(ratios), dtype=D)


def test_ppo_clip_asymmetric_bounds():
    ratios = [1.5, 1.25, 1.2, 0.5, 0.5, 0.75, 1.25]
    adv = t([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    lp, old = ratios_to_logprobs(ratios)
    out = ppo_clip_loss(lp, old, adv, eps_clip_low=0.2, eps_clip_high=0.28)
    # 1.5,A+ -> capped at 1.28; 1.25,A+ inside [0.8, 1.28] (would clip at symmetric 0.2);
    # 0.5,A+ pessimistic branch is unclipped; 0.5,A- -> 0.8; 0.75,A- -> 0.8; 1.25,A- unclipped
    close(out.loss, [-1.28, -1.25, -1.2, -0.5, 0.8, 0.8, 1.25])
    assert out.clipped.tolist() == [True, False, False, False, True, True, False]
    out.loss.sum().backward()
    close(lp.grad, [0.0, -1.25, -1.2, -0.5, 0.0, 0.0, 1.25])  # d(-A r)/d logp = -A r where unclipped
    symmetric = ppo_clip_loss(lp.detach(), old, adv, eps_clip_low=0.2, eps_clip_high=0.2)
    close(symmetric.loss[1], -1.2)


def test_dual_clip_caps_negative_advantage_with_huge_ratio():
    lp, old = ratios_to_logprobs([10.0, 10.0, 2.0])
    adv = t([-2.0, 2.0, -1.0])
    plain = ppo_clip_loss(lp, old, adv, 0.2, 0.28)
    close(plain.loss, [20.0, -2.56, 2.0])  # unbounded -A r for the negative advantage
    dual = ppo_clip_loss(lp, old, adv, 0.2, 0.28, dual_clip_c=3.0)
    close(dual.loss, [6.0, -2.56, 2.0])  # capped at c * |A| = 6; positive A and r < c untouched
    assert dual.dual_clipped.tolist() == [True, False, False]
    assert dual.clipped.tolist() == [False, True, False]
    dual.loss.sum().backward()
    close(lp.grad, [0.0, 0.0, 2.0])
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_clip_loss(lp, old, adv, dual_clip_c=0.9)


# ---- KL -------------------------------------------------------------------------------------

def test_kl_estimators_hand_values():
    ref = t([0.0, 0.0, 0.0])
    lp = t([LN2, -LN2, 0.0])  # log(pi / ref) = ln2, -ln2, 0
    close(kl_penalty(lp, ref, "k1"), [LN2, -LN2, 0.0])
    close(kl_penalty(lp, ref, "k2"), [0.2402265, 0.2402265, 0.0])
    # k3 = ref/pi - 1 + log(pi/ref): 1/2 - 1 + ln2, 2 - 1 - ln2
    close(kl_penalty(lp, ref, "k3"), [0.1931472, 0.3068528, 0.0])


def test_k3_is_clamped_and_k2_gradient_is_the_log_ratio():
    lp = t([-5.0, 0.5]).requires_grad_()
    ref = t([0.0, 0.0])
    close(kl_penalty(lp, ref, "k3"), [10.0, math.exp(-0.5) - 1 + 0.5])
    close(kl_penalty(lp, ref, "k3", k3_max=None), [math.exp(5) - 1 - 5, math.exp(-0.5) - 1 + 0.5])
    kl_penalty(lp, ref, "k2").sum().backward()
    close(lp.grad, [-5.0, 0.5])
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(lp, ref, "k4")


# ---- rollout/trainer mismatch -----------------------------------------------------------------

def test_tis_weight_is_truncated_and_detached():
    old = t([math.log(0.5), math.log(1.5), math.log(4.0)]).requires_grad_()
    rollout = t([0.0, 0.0, 0.0]).requires_grad_()
    w = tis_weights(old, rollout, cap=2.0)
    close(w, [0.5, 1.5, 2.0])
    assert not w.requires_grad


def test_icepop_zeroes_tokens_outside_the_band():
    rho = [0.4, 0.6, 1.0, 1.9, 3.0]
    old, rollout = t([math.log(r) for r in rho]), t([0.0] * 5)
    assert icepop_mask(old, rollout, 0.5, 2.0).tolist() == [False, True, True, True, False]
    w, accepted = mismatch_weights(old, rollout, None, (0.5, 2.0))
    close(w, [0.0, 0.6, 1.0, 1.9, 0.0])  # M(rho) = rho inside the band, 0 outside
    w, _ = mismatch_weights(old, rollout, 1.5, (0.5, 2.0))
    close(w, [0.0, 0.6, 1.0, 1.5, 0.0])  # with TIS: truncated inside the band
    w, accepted = mismatch_weights(old, rollout, None, None)
    close(w, [1.0] * 5)
    assert accepted.all()
    with pytest.raises(ValueError, match="band"):
        icepop_mask(old, rollout, 1.5, 2.0)


# ---- aggregation ------------------------------------------------------------------------------

# seqs: s0 = tokens 0-2 (loss 1,2,3; token 2 not trained), s1 = token 3, s2 = tokens 4-5,
# s3 = tokens 6-7 fully masked with garbage losses that must not leak.
AGG_LOSS = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0, float("nan")])
AGG_MASK = t([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
AGG_CU = torch.tensor([0, 3, 4, 6, 8])


@pytest.mark.parametrize("mode,expected,denominator", [
    ("token-mean", 18 / 5, 5.0),              # (1+2+4+5+6) / 5 trained tokens
    ("seq-mean-token-mean", 11 / 3, 3.0),     # (1.5 + 4 + 5.5) / 3 sequences with trained tokens
    ("seq-mean-token-sum", 6.0, 3.0),         # (3 + 4 + 11) / 3
])
def test_each_aggregation_mode_hand_values(mode, expected, denominator):
    close(aggregate(AGG_LOSS, AGG_MASK, AGG_CU, mode), expected)
    assert aggregation_denominator(AGG_MASK, AGG_CU, mode) == denominator
    close(aggregate(AGG_LOSS, AGG_MASK, AGG_CU, mode, global_denominator=10.0), expected * denominator / 10)


def test_seq_mean_token_sum_constant_normaliser():
    close(aggregate(AGG_LOSS, AGG_MASK, AGG_CU, "seq-mean-token-sum", token_sum_norm=4.0), 18 / 4 / 3)
    with pytest.raises(ValueError, match="token_sum_norm"):
        aggregate(AGG_LOSS, AGG_MASK, AGG_CU, "token-mean", token_sum_norm=4.0)


def test_aggregate_rejects_bad_packing():
    with pytest.raises(ValueError, match="ends at 7"):
        aggregate(AGG_LOSS, AGG_MASK, torch.tensor([0, 3, 7]), "token-mean")
    with pytest.raises(ValueError, match="start at 0"):
        aggregate(AGG_LOSS, AGG_MASK, torch.tensor([1, 8]), "token-mean")
    with pytest.raises(ValueError, match="integer"):
        aggregate(AGG_LOSS, AGG_MASK, torch.tensor([0.0, 8.0]), "token-mean")
    with pytest.raises(ValueError, match="aggregation mode"):
        aggregate(AGG_LOSS, AGG_MASK, AGG_CU, "sum")


def test_all_masked_batch_gives_zero_not_nan():
    mask = torch.zeros(8, dtype=D)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert aggregate(AGG_LOSS, mask, AGG_CU, mode).item() == 0.0


# ---- composed policy loss ---------------------------------------------------------------------

def composed_inputs():
    """Ratios 1.5, 1, 0.5, 10 (last token untrained); A = 1, 1, -1, -2; pi_old/pi_rollout = 1, 3,
    0.5, 1; log(pi/ref) = 0.1, 0.2, 0.3, 5; entropy 1, 2, 3, 9."""
    lp = t([-1.0, -1.0, -1.0, -1.0]).requires_grad_()
    old = lp.detach() - t([math.log(1.5), 0.0, -LN2, math.log(10.0)])
    rollout = old - t([0.0, LN3, -LN2, 0.0])
    ref = lp.detach() - t([0.1, 0.2, 0.3, 5.0])
    return dict(logprobs=lp, old_logprobs=old, advantages=t([1.0, 1.0, -1.0, -2.0]),
                loss_mask=t([1.0, 1.0, 1.0, 0.0]), cu_seqlens=torch.tensor([0, 2, 4]),
                rollout_logprobs=rollout, ref_logprobs=ref, entropy=t([1.0, 2.0, 3.0, 9.0]))


def test_policy_loss_composes_terms_and_reports_metrics():
    cfg = PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28, dual_clip_c=3.0, kl_coef=0.5,
                           kl_estimator="k1", entropy_coef=0.1, tis_cap=2.0)
    inputs = composed_inputs()
    loss, m = policy_loss(config=cfg, **inputs)
    # pg: [-1.28, -1.0, 0.8] x TIS [1, 2, 0.5] = [-1.28, -2.0, 0.4]
    # + 0.5 * k1 [0.1, 0.2, 0.3] - 0.1 * H [1, 2, 3] = [-1.33, -2.1, 0.25] -> mean -1.06
    close(loss, -1.06)
    close(m["pg_loss"], -2.88 / 3, atol=1e-6)
    close(m["clip_fraction"], 2 / 3)
    close(m["dual_clip_fraction"], 0.0)
    close(m["ratio_mean"], 1.0)
    close(m["kl_mean"], 0.2)
    close(m["entropy_mean"], 2.0)
    close(m["tis_weight_mean"], 3.5 / 3)
    close(m["icepop_masked_fraction"], 0.0)
    close(m["rollout_logprob_abs_gap"], (LN3 + LN2) / 3)
    close(m["trained_tokens"], 3.0)
    assert all(not v.requires_grad for v in m.values())
    loss.backward()
    # clipped tokens 0 and 2 keep only the k1 gradient 0.5/3; token 1: (-A r w + 0.5) / 3 = -1.5/3
    close(inputs["logprobs"].grad, [0.5 / 3, -1.5 / 3, 0.5 / 3, 0.0])


def test_policy_loss_icepop_drops_mismatched_tokens():
    cfg = PolicyLossConfig(dual_clip_c=None, icepop_band=(0.6, 2.5))
    inputs = composed_inputs()
    loss, m = policy_loss(config=cfg, **inputs)
    close(loss, -1.28 / 3)  # rho 3 and 0.5 are outside [0.6, 2.5]; they still count in the mean
    close(m["icepop_masked_fraction"], 2 / 3)
    close(m["tis_weight_mean"], 1 / 3)


def test_policy_loss_needs_the_inputs_its_config_uses():
    inputs = composed_inputs()
    for cfg, missing in [(PolicyLossConfig(kl_coef=0.1), "ref_logprobs"),
                         (PolicyLossConfig(entropy_coef=0.1), "entropy"),
                         (PolicyLossConfig(tis_cap=2.0), "rollout_logprobs")]:
        with pytest.raises(ValueError, match=missing):
            policy_loss(config=cfg, **{**inputs, missing: None})
    with pytest.raises(ValueError, match="shape"):
        policy_loss(config=PolicyLossConfig(), **{**inputs, "advantages": t([1.0])})
    for bad in [dict(aggregation="mean"), dict(kl_estimator="k9"), dict(dual_clip_c=1.0),
                dict(icepop_band=(2.0, 3.0)), dict(token_sum_norm=10.0)]:
        with pytest.raises(ValueError):
            PolicyLossConfig(**bad)


# ---- micro-batch invariance -------------------------------------------------------------------

SEQ_LENS = [3, 5, 0, 4, 2, 6]   # includes an empty sequence
SPLITS = [[6], [2, 4], [1, 2, 1, 2], [3, 3]]  # sequences per micro-batch, always whole sequences


def packed_batch():
    gen = torch.Generator().manual_seed(3)
    T, V = sum(SEQ_LENS), 13
    mask = (torch.rand(T, generator=gen) > 0.3).to(D)
    mask[3 + 5 + 4:3 + 5 + 4 + 2] = 0.0  # sequence 4 fully untrained
    rewards = torch.randn(len(SEQ_LENS), generator=gen, dtype=D)
    cu = torch.tensor([0] + SEQ_LENS).cumsum(0)
    return dict(
        logits=torch.randn(T, V, generator=gen, dtype=D) * 2,
        targets=torch.randint(0, V, (T,), generator=gen),
        old=-torch.rand(T, generator=gen, dtype=D) * 3,
        rollout_shift=torch.randn(T, generator=gen, dtype=D) * 0.3,
        ref_shift=torch.randn(T, generator=gen, dtype=D) * 0.3,
        adv=broadcast_to_tokens(group_advantages(rewards, torch.tensor([0, 0, 1, 1, 2, 2])), cu),
        mask=mask, cu=cu)


def run_micro_batches(batch, cfg, split, use_global_denominator=True):
    logits = batch["logits"].clone().requires_grad_()
    bounds = batch["cu"].tolist()
    pieces, seq = [], 0
    for n in split:
        pieces.append((bounds[seq], bounds[seq + n], torch.tensor(bounds[seq:seq + n + 1]) - bounds[seq]))
        seq += n
    assert seq == len(SEQ_LENS)
    denominator = sum(aggregation_denominator(batch["mask"][a:b], cu, cfg.aggregation) for a, b, cu in pieces)
    total = 0.0
    for a, b, cu in pieces:
        lp = token_logprobs(logits[a:b], batch["targets"][a:b], temperature=0.8)
        old = batch["old"][a:b]
        loss, _ = policy_loss(
            lp, old, batch["adv"][a:b], batch["mask"][a:b], cu, cfg,
            rollout_logprobs=old + batch["rollout_shift"][a:b], ref_logprobs=old + batch["ref_shift"][a:b],
            entropy=token_entropy(logits[a:b], temperature=0.8),
            global_denominator=denominator if use_global_denominator else None)
        loss.backward()
        total = total + loss.detach()
    return total, logits.grad


@pytest.mark.parametrize("aggregation,norm", [("token-mean", None), ("seq-mean-token-mean", None),
                                              ("seq-mean-token-sum", None), ("seq-mean-token-sum", 8.0)])
def test_micro_batch_split_gives_identical_loss_and_gradients(aggregation, norm):
    cfg = PolicyLossConfig(eps_clip_low=0.2, eps_clip_high=0.28, dual_clip_c=3.0, kl_coef=0.05,
                           entropy_coef=0.01, tis_cap=2.0, icepop_band=(0.5, 2.0),
                           aggregation=aggregation, token_sum_norm=norm)
    batch = packed_batch()
    full_loss, full_grad = run_micro_batches(batch, cfg, SPLITS[0])
    assert full_grad.abs().sum() > 0
    for split in SPLITS[1:]:
        loss, grad = run_micro_batches(batch, cfg, split)
        torch.testing.assert_close(loss, full_loss, atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, full_grad, atol=1e-6, rtol=0)
    # the same split with per-micro-batch denominators (a mean of means) is not the full-batch loss
    local_loss, _ = run_micro_batches(batch, cfg, SPLITS[2], use_global_denominator=False)
    assert abs(local_loss - full_loss) > 1e-3


def test_weighted_nll_gradient_is_minus_weight_over_denominator_even_for_a_near_impossible_token():
    # opd.hinted_sample's term: no importance weight, so a token at logprob -12 gets the full gradient
    lp = torch.tensor([-12.0, -0.5, -3.0, float("-inf")], requires_grad=True)
    weights = torch.tensor([1.0, 0.5, 0.0, 0.0])  # the last two take no part (an -inf one must not leak)
    cu = torch.tensor([0, 2, 4])
    loss, nll = weighted_nll(lp, weights, cu, "token-mean", global_denominator=4.0)
    assert float(loss) == pytest.approx((12.0 + 0.25) / 4.0)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-0.25, -0.125, 0.0, 0.0])
    assert nll[:3].tolist() == pytest.approx([12.0, 0.5, 3.0])
    own, _ = weighted_nll(lp.detach(), weights, cu, "token-mean")  # its own denominator: 2 tokens take part
    assert float(own) == pytest.approx(12.25 / 2)
    with pytest.raises(ValueError, match=">= 0"):
        weighted_nll(lp.detach(), -weights, cu)
    with pytest.raises(ValueError, match=r"\[T\]"):
        weighted_nll(lp.detach(), weights[:3], cu)
