"""OPD and Combine in the torch trainer (small random Qwen3, CPU): a step raises the tokens the hinted
teacher prefers and lowers those it rejects, forward top-k distillation raises the teacher's top token
even where the student never sampled it, and Combine trains each sample on the signals it has --
both, one, or (dropped from the loss) none -- also with LoRA."""
from __future__ import annotations

import math

import pytest

from clawrl.config import ConfigError
from clawrl.samples import Sample, TeacherSignal
from test_trainer import make_samples, model_dir, on_policy, trainer_for  # noqa: F401 (fixture)


def with_teacher(s: Sample, gaps: list[float], topk=None) -> Sample:
    """``Sample.teacher`` as ``OpdStore.attach`` fills it: teacher = rollout logprob + gap per token."""
    s.teacher = TeacherSignal(teacher_logprobs=[lp + g for lp, g in zip(s.rollout_logprobs, gaps)],
                              topk_ids=topk[0] if topk else None, topk_logprobs=topk[1] if topk else None,
                              hint="be brief")
    return s


def test_opd_step_raises_tokens_the_hinted_teacher_prefers_and_lowers_the_rest(model_dir):
    trainer = trainer_for(model_dir, "method=opd", "train.lr=3e-3")
    samples = on_policy(trainer, make_samples(trainer.vocab_size, n=2, advantage=0.0))
    for s in samples:
        s.rl_signal = False  # under opd no reward judge ran
        n = len(s.response_ids)
        with_teacher(s, [2.0] * (n // 2) + [-2.0] * (n - n // 2))
    before = trainer.logprobs(samples)
    result = trainer.train_step(samples, weight_version=0)
    assert result.ok, result.skipped_reason
    m = result.metrics
    assert m["samples_opd_only"] == 2 and m["samples_rl_only"] == 0 and m["samples_both"] == 0
    assert m["opd_tokens"] == sum(len(s.response_ids) for s in samples)
    after = trainer.logprobs(samples)
    for s, b, a in zip(samples, before, after):
        n = len(s.response_ids)
        preferred = sum(a[:n // 2]) - sum(b[:n // 2])
        rejected = sum(a[n // 2:]) - sum(b[n // 2:])
        assert preferred > 0.02 and rejected < -0.02, (preferred, rejected)


def test_opd_advantage_is_clipped_and_a_missing_teacher_token_gives_no_signal(model_dir):
    trainer = trainer_for(model_dir, "method=opd", "opd.adv_clip=1.5")
    [s] = on_policy(trainer, make_samples(trainer.vocab_size, n=1, advantage=0.0))
    n = len(s.response_ids)
    with_teacher(s, [30.0] + [-math.inf] + [0.0] * (n - 2))
    result = trainer.train_step([s], weight_version=0)
    assert result.ok
    assert result.metrics["opd_advantage_mean"] == pytest.approx(1.5 / n, rel=1e-4)


def test_forward_topk_distillation_raises_the_teachers_top_token_the_student_never_sampled(model_dir):
    trainer = trainer_for(model_dir, "method=opd", "opd.topk=2", "opd.topk_kl=forward", "train.lr=1e-2")
    [s] = on_policy(trainer, make_samples(trainer.vocab_size, n=1, advantage=0.0))
    n = len(s.response_ids)
    wanted = next(t for t in range(3, trainer.vocab_size) if t != s.response_ids[0])
    other = next(t for t in range(3, trainer.vocab_size) if t not in (wanted, s.response_ids[0]))
    ids = [[wanted, other]] * n
    lps = [[math.log(0.9), math.log(0.05)]] * n
    with_teacher(s, [0.0] * n, topk=(ids, lps))  # A_opd = 0: only the distillation term moves anything
    probe = Sample(sample_id=9, turn_id=9, group_id="p", prompt_ids=s.prompt_ids, response_ids=[wanted],
                   rollout_logprobs=[0.0], weight_versions=[0], reward=0.0, advantage=0.0)
    before = trainer.logprobs([probe])[0][0]
    result = trainer.train_step([s], weight_version=0)
    assert result.ok and result.metrics["topk_kl"] > 0
    assert trainer.logprobs([probe])[0][0] > before + 0.05


def test_topk_of_another_k_is_not_used_and_a_bad_direction_is_refused(model_dir):
    trainer = trainer_for(model_dir, "method=opd", "opd.topk=4")
    [s] = on_policy(trainer, make_samples(trainer.vocab_size, n=1, advantage=0.0))
    n = len(s.response_ids)
    with_teacher(s, [0.5] * n, topk=([[3, 4]] * n, [[-0.1, -3.0]] * n))  # stored with K=2
    result = trainer.train_step([s], weight_version=0)
    assert result.ok and "topk_kl" not in result.metrics
    with pytest.raises(ConfigError, match="opd.topk_kl='sideways'"):
        trainer_for(model_dir, "method=opd", "opd.topk_kl=sideways")


def combine_batch(trainer):
    """Four samples: reward + hint, reward only, hint only, neither."""
    samples = on_policy(trainer, make_samples(trainer.vocab_size, n=4, advantage=1.0))
    both, rl_only, opd_only, neither = samples
    rl_only.advantage = rl_only.reward = -1.0
    for s in (opd_only, neither):
        s.rl_signal = False
        s.advantage = s.reward = 0.0
    for s in (both, opd_only):
        with_teacher(s, [1.0] * len(s.response_ids))
    return samples


@pytest.mark.parametrize("lora", [False, True])
def test_combine_trains_each_sample_on_the_signals_it_has(model_dir, lora):
    trainer = trainer_for(model_dir, "method=combine", "combine.w_rl=1.0", "combine.w_opd=0.5",
                          f"train.lora.enabled={str(lora).lower()}", "train.lr=3e-3")
    samples = combine_batch(trainer)
    both, rl_only, opd_only, neither = samples
    before = trainer.logprobs(samples)
    result = trainer.train_step(samples, weight_version=0)
    assert result.ok
    m = result.metrics
    assert (m["samples_both"], m["samples_rl_only"], m["samples_opd_only"]) == (1, 1, 1)
    # the sample with neither signal is out of the loss, not a zero-advantage dilution
    assert m["trained_tokens"] == sum(len(s.response_ids) for s in (both, rl_only, opd_only))
    assert m["opd_advantage_mean"] == pytest.approx(1.0)
    after = trainer.logprobs(samples)
    moved = [sum(a) - sum(b) for a, b in zip(after, before)]
    assert moved[0] > 0.02 and moved[1] < -0.02 and moved[2] > 0.02  # +1 & hint, -1, hint only


def test_combine_with_a_zero_weight_drops_that_signal(model_dir):
    trainer = trainer_for(model_dir, "method=combine", "combine.w_opd=0")
    samples = combine_batch(trainer)
    result = trainer.train_step(samples, weight_version=0)
    m = result.metrics
    assert (m["samples_both"], m["samples_rl_only"], m["samples_opd_only"]) == (0, 2, 0)
    assert m["trained_tokens"] == sum(len(s.response_ids) for s in samples[:2])


def test_rl_method_ignores_teacher_signal(model_dir):
    trainer = trainer_for(model_dir, "method=rl")
    samples = combine_batch(trainer)[:2]
    result = trainer.train_step(samples, weight_version=0)
    assert result.metrics["samples_rl_only"] == 2 and result.metrics["opd_tokens"] == 0


def hinted_probe(s: Sample, ids: list[int]) -> Sample:
    """The hinted reply as a sample of its own under ``s``'s prompt, to read its logprobs."""
    return Sample(sample_id=99, turn_id=99, group_id="probe", prompt_ids=s.prompt_ids, response_ids=ids,
                  rollout_logprobs=[0.0] * len(ids), weight_versions=[0] * len(ids), reward=0.0, advantage=0.0)


@pytest.mark.parametrize("method", ["opd", "combine"])
def test_hinted_sample_raises_a_reply_the_student_does_not_sample_under_its_own_prompt(model_dir, method):
    # opd.hinted_sample: the teacher's own reply under the hint trains with token NLL under the student's
    # prompt -- the student's logprob of that reply rises, though no advantage of its own tokens says so
    trainer = trainer_for(model_dir, f"method={method}", "opd.hinted_sample=true", "train.lr=3e-3")
    [s] = on_policy(trainer, make_samples(trainer.vocab_size, n=1, advantage=0.0))
    s.rl_signal = False
    n = len(s.response_ids)
    hinted = [t for t in range(3, 3 + 6) if t not in s.response_ids][:4]
    with_teacher(s, [0.0] * n)  # A_opd = 0: only the hinted NLL moves the hinted reply
    s.teacher = TeacherSignal(**{**s.teacher.__dict__, "hinted_ids": hinted, "hinted_weight": 1.0})
    probe = hinted_probe(s, hinted)
    before = sum(trainer.logprobs([probe])[0])
    own_before = trainer.logprobs([s])[0]
    result = trainer.train_step([s], weight_version=0)
    assert result.ok, result.skipped_reason
    m = result.metrics
    assert m["hinted_tokens"] == len(hinted) and m["hinted_nll"] == pytest.approx(-before / len(hinted), rel=1e-3)
    assert m["trained_tokens"] == n  # the hinted reply is not in the policy loss
    assert sum(trainer.logprobs([probe])[0]) > before + 0.5
    assert len(trainer.logprobs([s])[0]) == len(own_before)  # logprobs are the samples' own, not the hinted reply's


def test_hinted_weight_scales_the_nll_and_a_zero_coef_or_no_hinted_reply_leaves_it_alone(model_dir):
    moved = {}
    for name, overrides, weight in (("full", [], 1.0), ("half", [], 0.5), ("coef0", ["opd.hinted_coef=0"], 1.0),
                                    ("weight0", [], 0.0)):
        trainer = trainer_for(model_dir, "method=opd", "opd.hinted_sample=true", "train.lr=1e-3", *overrides)
        [s] = on_policy(trainer, make_samples(trainer.vocab_size, n=1, advantage=0.0, seed=3))
        s.rl_signal = False
        with_teacher(s, [0.0] * len(s.response_ids))
        hinted = [t for t in range(3, 9) if t not in s.response_ids][:3]
        s.teacher = TeacherSignal(**{**s.teacher.__dict__, "hinted_ids": hinted, "hinted_weight": weight})
        probe = hinted_probe(s, hinted)
        before = sum(trainer.logprobs([probe])[0])
        result = trainer.train_step([s], weight_version=0)
        assert result.ok
        moved[name] = (sum(trainer.logprobs([probe])[0]) - before, result.metrics.get("hinted_tokens", 0.0))
    assert moved["full"][0] > 0.05 and moved["half"][0] > 0.02
    assert moved["full"][1] == moved["half"][1] == 3
    assert abs(moved["coef0"][0]) < 0.02 and abs(moved["weight0"][0]) < 0.02  # only A_opd = 0 trained
    assert moved["weight0"][1] == 0.0


def test_combine_with_both_weights_zero_trains_the_hinted_replies_alone(model_dir):
    with pytest.raises(ConfigError, match="or opd.hinted_sample=true"):
        trainer_for(model_dir, "method=combine", "combine.w_rl=0", "combine.w_opd=0")
    trainer = trainer_for(model_dir, "method=combine", "combine.w_rl=0", "combine.w_opd=0",
                          "opd.hinted_sample=true", "train.lr=3e-3")
    [s] = on_policy(trainer, make_samples(trainer.vocab_size, n=1, advantage=1.0))
    with_teacher(s, [1.0] * len(s.response_ids))
    hinted = [t for t in range(3, 9) if t not in s.response_ids][:3]
    s.teacher = TeacherSignal(**{**s.teacher.__dict__, "hinted_ids": hinted, "hinted_weight": 1.0})
    before = sum(trainer.logprobs([hinted_probe(s, hinted)])[0])
    result = trainer.train_step([s], weight_version=0)
    assert result.ok, result.skipped_reason  # no policy-loss token, yet the step trains
    assert result.metrics["trained_tokens"] == 0 and result.metrics["hinted_tokens"] == 3
    assert sum(trainer.logprobs([hinted_probe(s, hinted)])[0]) > before + 0.5
