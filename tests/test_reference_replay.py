"""train.replay_coef, the reference replay (small random Qwen3 and Qwen3-Next, CPU): the frozen reference's
own reply to each distinct prompt of a step is packed as a sequence of its own and trained with token NLL,
or with train.replay_topk the forward KL to its top-k (no gradient while the policy is the reference),
under rl, opd and combine, with full fine-tuning and LoRA; greedy replies decoded together equal each
decoded alone; the coefficient scales it and 0 turns it off; the megatron backend refuses it with a
one-line reason."""
from __future__ import annotations

import pytest
import torch

from clawrl.config import ConfigError, compose
from clawrl.samples import ReferenceReply, Sample, TeacherSignal
from clawrl.trainers.batching import build_micro_batch, pack, trained_mask
from clawrl.trainers.replay import batched_greedy_replies, reference_reply
from test_trainer import make_samples, model_dir, on_policy, trainer_for  # noqa: F401 (fixture)

MAX = 5  # train.replay_max_tokens: a random model seldom says eos


def probe(s: Sample, ids: list[int]) -> Sample:
    """``ids`` as a sample of its own under ``s``'s prompt, to read their logprobs."""
    return Sample(sample_id=99, turn_id=99, group_id="probe", prompt_ids=s.prompt_ids, response_ids=ids,
                  rollout_logprobs=[0.0] * len(ids), weight_versions=[0] * len(ids), reward=0.0, advantage=0.0)


def greedy(trainer, s: Sample) -> list[int]:
    """The trainer's current policy's greedy reply to ``s``'s prompt, as the replay decodes it."""
    model = trainer.model.eval()
    return reference_reply(model, s.prompt_ids, trainer.eos_ids, MAX, 0.0, torch.Generator()).ids


def test_the_replay_is_its_own_sequence_after_the_samples_and_their_hinted_replies():
    [a, b] = make_samples(50, n=2, advantage=1.0)
    a.teacher = TeacherSignal(teacher_logprobs=[0.0] * len(a.response_ids), hinted_ids=[7, 8], hinted_weight=0.5)
    a.replay, b.replay = ReferenceReply([11, 12, 13]), None
    mb = build_micro_batch([a, b], torch.device("cpu"))
    na, nb = len(a.response_ids), len(b.response_ids)
    assert mb.num_samples == 2 and len(mb.bounds) == 4  # a, b, a's hinted reply, a's replay
    assert mb.targets.tolist() == a.response_ids + b.response_ids + [7, 8] + [11, 12, 13]
    start, end = mb.bounds[3]
    assert mb.input_ids[0, start:end].tolist() == a.prompt_ids + [11, 12, 13]  # under the sample's own prompt
    assert mb.replay_mask.tolist() == [0.0] * (na + nb + 2) + [1.0] * 3
    assert mb.hinted_weight.tolist() == [0.0] * (na + nb) + [0.5] * 2 + [0.0] * 3
    assert mb.loss_mask.tolist() == [1.0] * (na + nb) + [0.0] * 5  # no policy gradient on either
    assert not bool(mb.has_rl[na + nb:].any()) and not bool(mb.has_opd[na + nb:].any())
    assert trained_mask(mb).tolist() == [1.0] * (na + nb + 5)  # both count in the step's denominator
    # pack budgets the replay's tokens beside its sample
    size = len(a.prompt_ids) * 3 + na + 2 + 3
    assert pack([a], size) == [[0]] and pack([a, b], size) == [[0], [1]]
    assert build_micro_batch([b], torch.device("cpu")).replay_mask is None


def opd_ready(s: Sample) -> Sample:
    """A sample as OPD trains it, with a teacher that agrees with the student (A_opd = 0)."""
    s.rl_signal = False
    s.teacher = TeacherSignal(teacher_logprobs=list(s.rollout_logprobs), hint="be brief")
    return s


@pytest.mark.parametrize("method", ["rl", "opd", "combine"])
def test_a_step_raises_the_frozen_references_own_reply(model_dir, method):
    trainer = trainer_for(model_dir, f"method={method}", "train.replay_coef=1", "train.replay_topk=0",
                          f"train.replay_max_tokens={MAX}", "train.lr=3e-3")
    samples = on_policy(trainer, make_samples(trainer.vocab_size, n=2, advantage=0.0))
    if method != "rl":
        samples = [opd_ready(s) for s in samples]
    expected = [greedy(trainer, s) for s in samples]  # the reference is the policy as it starts
    before = [sum(trainer.logprobs([probe(s, e)])[0]) for s, e in zip(samples, expected)]
    result = trainer.train_step(samples, weight_version=0)
    assert result.ok, result.skipped_reason
    assert [s.replay.ids for s in samples] == expected  # token ids as decoded: greedy, at most MAX
    m = result.metrics
    assert m["replay_tokens"] == sum(len(e) for e in expected) and m["replay_seconds"] > 0
    assert m["replay_nll"] == pytest.approx(-sum(before) / m["replay_tokens"], rel=1e-3)
    after = [sum(trainer.logprobs([probe(s, e)])[0]) for s, e in zip(samples, expected)]
    assert all(x > y + 0.3 for x, y in zip(after, before)), (before, after)
    # a second step replays the *reference's* reply, not the moved policy's
    trainer.train_step(samples, weight_version=1)
    assert [s.replay.ids for s in samples] == expected


def test_replay_coef_scales_the_update_and_zero_turns_it_off(model_dir):
    # beside a policy-gradient signal on the sample's own reply (A = -1), so that AdamW's step (about the same
    # size whatever the scale of a lone gradient) shows how much of the gradient the replay's NLL is
    moved = {}
    for coef in (0.0, 0.5, 4.0):
        trainer = trainer_for(model_dir, f"train.replay_coef={coef}", "train.replay_topk=0",
                              f"train.replay_max_tokens={MAX}", "train.lr=1e-3", dtype=torch.float64)
        [s] = on_policy(trainer, make_samples(trainer.vocab_size, n=1, advantage=-1.0, seed=3))
        reply = greedy(trainer, s)
        before = sum(trainer.logprobs([probe(s, reply)])[0])
        result = trainer.train_step([s], weight_version=0)
        assert result.ok
        moved[coef] = (sum(trainer.logprobs([probe(s, reply)])[0]) - before, result.metrics.get("replay_tokens"),
                       s.replay and s.replay.ids)
    assert moved[0.0][1:] == (None, None)  # off: no reply decoded, no replay term
    assert moved[0.5][2] == moved[4.0][2] == reply and moved[0.5][1] == moved[4.0][1] == len(reply)
    assert moved[4.0][0] > moved[0.5][0] + 0.05 and moved[0.5][0] > moved[0.0][0], moved


def test_a_repeated_prompt_is_replayed_once_and_sampled_replies_repeat_with_the_seed(model_dir):
    trainer = trainer_for(model_dir, "train.replay_coef=1", f"train.replay_max_tokens={MAX}",
                          "train.replay_temperature=1", "train.lr=1e-3")
    a, b = make_samples(trainer.vocab_size, n=2, seed=5)
    b.prompt_ids = list(a.prompt_ids)  # a GRPO group of two
    on_policy(trainer, [a, b])
    result = trainer.train_step([a, b], weight_version=0)
    assert result.ok and a.replay.ids and b.replay is None
    assert result.metrics["replay_tokens"] == len(a.replay.ids)
    again = trainer_for(model_dir, "train.replay_coef=1", f"train.replay_max_tokens={MAX}",
                        "train.replay_temperature=1", "train.lr=1e-3")
    c, d = make_samples(again.vocab_size, n=2, seed=5)
    d.prompt_ids = list(c.prompt_ids)
    again.train_step(on_policy(again, [c, d]), weight_version=0)
    assert c.replay.ids == a.replay.ids  # seeded by the run's seed and the step


def test_with_lora_the_reference_is_the_base_without_the_adapter(model_dir):
    trainer = trainer_for(model_dir, "train.lora.enabled=true", "train.lora.r=4", "train.lr=5e-2",
                          "train.replay_coef=1", f"train.replay_max_tokens={MAX}")
    samples = on_policy(trainer, make_samples(trainer.vocab_size, n=2, advantage=1.0, seed=7))
    with trainer.model.disable_adapter():
        expected = [greedy(trainer, s) for s in samples]
    for version in range(3):  # the adapter moves; the replayed replies stay the base's
        result = trainer.train_step(on_policy(trainer, samples), weight_version=version)
        assert result.ok and [s.replay.ids for s in samples] == expected


def test_replay_topk_packs_the_references_distribution_on_the_replays_rows_only():
    [a, b] = make_samples(50, n=2)
    a.replay = ReferenceReply([11, 12], topk_ids=[[11, 4], [12, 5]], topk_logprobs=[[-0.1, -3.0], [-0.2, -2.0]])
    mb = build_micro_batch([a, b], torch.device("cpu"))
    n = len(a.response_ids) + len(b.response_ids)
    assert mb.replay_topk_ids.tolist() == [[0, 0]] * n + [[11, 4], [12, 5]]
    assert mb.replay_topk_logprobs[n:].flatten().tolist() == pytest.approx([-0.1, -3.0, -0.2, -2.0])
    b.replay = ReferenceReply([7], topk_ids=[[7, 8, 9]], topk_logprobs=[[-1.0, -2.0, -3.0]])
    with pytest.raises(ValueError, match="top-k is not 1 rows of 2"):
        build_micro_batch([a, b], torch.device("cpu"))


def test_the_top_k_replay_has_no_gradient_at_the_reference_and_pulls_back_what_moved(model_dir):
    trainer = trainer_for(model_dir, "train.replay_coef=1", "train.replay_topk=8", f"train.replay_max_tokens={MAX}",
                          "train.lr=3e-3", "train.replay_temperature=1", dtype=torch.float64)
    [s] = on_policy(trainer, make_samples(trainer.vocab_size, n=1, advantage=0.0, seed=2))
    first = trainer.train_step([s], weight_version=0)  # A = 0: the replay alone, and the policy is the reference
    assert first.ok and first.metrics["replay_kl"] == pytest.approx(0.0, abs=1e-9)
    assert first.metrics["grad_norm"] < 1e-6
    assert len(s.replay.topk_ids) == len(s.replay.ids) and all(len(row) == 8 for row in s.replay.topk_ids)
    # move the policy away with a policy-gradient signal alone, then replay: the KL has grown, and falls again
    off = trainer_for(model_dir, "train.lr=3e-3", dtype=torch.float64)
    trainer.model.load_state_dict(off.model.state_dict())
    [s] = on_policy(trainer, make_samples(trainer.vocab_size, n=1, advantage=1.0, seed=2))
    trainer.objective.replay_coef = 0.0  # this step: the policy gradient only (the replay still decodes)
    assert trainer.train_step([s], weight_version=1).ok
    trainer.objective.replay_coef = 1.0
    kls = []
    for version in (2, 3, 4):
        s.advantage = 0.0
        result = trainer.train_step(on_policy(trainer, [s]), weight_version=version)
        assert result.ok
        kls.append(result.metrics["replay_kl"])
    assert kls[0] > 1e-4 and kls[-1] < kls[0], kls


def test_greedy_replies_decoded_together_equal_each_decoded_alone(model_dir):
    trainer = trainer_for(model_dir)
    model = trainer.model.eval()
    prompts = [s.prompt_ids for s in make_samples(trainer.vocab_size, n=5, seed=11)]  # 4 to 11 tokens: padded
    eos = frozenset({prompts[0][0]})  # a token some reply may say, so that rows end at different steps
    alone = [reference_reply(model, p, eos, 7, 0.0, torch.Generator(), topk=4) for p in prompts]
    together = batched_greedy_replies(model, prompts, eos, [7, 7, 3, 7, 7], topk=4)
    for i, (a, b) in enumerate(zip(alone, together)):
        n = 3 if i == 2 else len(a.ids)
        assert b.ids == a.ids[:n] and b.topk_ids == a.topk_ids[:n]
        assert [x for row in b.topk_logprobs for x in row] == pytest.approx(
            [x for row in a.topk_logprobs[:n] for x in row], abs=1e-4)


def test_a_hybrid_linear_attention_model_replays_one_prompt_at_a_time(tmp_path):
    # no padded batch for a recurrent layer: its replies are decoded alone, and equal the greedy decode
    from hybrid_testing import make_hybrid_dir

    trainer = trainer_for(make_hybrid_dir(tmp_path / "q3n", "qwen3_next", std=0.1), "train.replay_coef=1",
                          "train.replay_topk=4", f"train.replay_max_tokens={MAX}", "train.lr=1e-3")
    assert trainer.hybrid
    samples = on_policy(trainer, make_samples(trainer.vocab_size, n=2, advantage=1.0, seed=4))
    expected = [greedy(trainer, s) for s in samples]
    result = trainer.train_step(samples, weight_version=0)
    assert result.ok and [s.replay.ids for s in samples] == expected
    assert result.metrics["replay_tokens"] == sum(len(e) for e in expected)
    assert result.metrics["replay_kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is still the reference


def test_config_refuses_a_negative_coefficient_and_megatron():
    with pytest.raises(ConfigError, match=r"train.replay_coef=-1.0: must be >= 0"):
        compose(["train.replay_coef=-1"])
    with pytest.raises(ConfigError, match=r"train.replay_coef=0.5 with trainer.backend=megatron: the reference "
                                          r"replay runs in the torch trainer only"):
        compose(["train.replay_coef=0.5", "trainer.backend=megatron"])
    assert compose(["trainer.backend=megatron"]).train.replay_coef == 0  # off unless asked for
