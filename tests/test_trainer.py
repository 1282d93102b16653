"""The torch trainer on small random Qwen3 models (CPU): the update goes the right way, does not
depend on micro-batching, LoRA trains only adapters and exports merged weights, bad steps skip and
pause, and the trainer's logprobs agree with what the engine sampled."""
from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch

from clawrl.config import compose
from clawrl.engines.base import SamplingParams
from clawrl.engines.loading import load_model
from clawrl.engines.torch_engine import TorchEngine
from clawrl.samples import Sample
from clawrl.trainers.backends import make_trainer
from clawrl.trainers.base import TrainerError
from clawrl.trainers.torch_trainer import TorchTrainer, pack
from engine_testing import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("trainer_model") / "q3", "qwen3", seed=0)


def make_samples(vocab: int, n: int = 4, advantage: float = 1.0, seed: int = 0) -> list[Sample]:
    g = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [g.randrange(3, vocab) for _ in range(g.randrange(4, 12))]
        response = [g.randrange(3, vocab) for _ in range(g.randrange(3, 9))]
        out.append(Sample(sample_id=i, turn_id=i, group_id=f"g{i}", prompt_ids=prompt, response_ids=response,
                          rollout_logprobs=[0.0] * len(response), weight_versions=[0] * len(response),
                          reward=advantage, advantage=advantage))
    return out


def on_policy(trainer, samples: list[Sample]) -> list[Sample]:
    """Give samples the trainer's own logprobs as rollout logprobs (a perfectly matched engine)."""
    for s, lps in zip(samples, trainer.logprobs(samples)):
        s.rollout_logprobs = lps
    return samples


def trainer_for(model_dir, *overrides, dtype=None) -> TorchTrainer:
    cfg = compose(["model.device=cpu", *overrides])
    return TorchTrainer(cfg, str(model_dir), dtype=dtype)


def total_logprob(trainer, samples) -> list[float]:
    return [sum(lps) for lps in trainer.logprobs(samples)]


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_step_moves_response_logprobs_in_the_direction_of_the_advantage(model_dir, advantage):
    trainer = trainer_for(model_dir, "train.lr=3e-3")
    samples = on_policy(trainer, make_samples(trainer.vocab_size, advantage=advantage))
    before = total_logprob(trainer, samples)
    result = trainer.train_step(samples, weight_version=0)
    assert result.ok and result.skipped_reason is None
    assert result.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # pi_old is recomputed: ratio 1
    assert result.metrics["rollout_logprob_gap_max"] < 1e-5
    assert trainer.step == 1
    after = total_logprob(trainer, samples)
    for b, a in zip(before, after):
        assert (a - b) * advantage > 0.05


def test_micro_batch_split_does_not_change_the_update(model_dir):
    samples = make_samples(400, n=6, seed=3)
    params = {}
    for budget in (10_000, 24):
        trainer = trainer_for(model_dir, f"train.micro_batch_tokens={budget}", "train.lr=1e-3",
                              "train.aggregation=seq-mean-token-mean", dtype=torch.float64)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        on_policy(trainer, samples)
        result = trainer.train_step(samples, weight_version=0)
        assert result.ok
        assert result.metrics["micro_batches"] == (1 if budget == 10_000 else len(pack(samples, 24)))
        params[budget] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        moved = max(float((params[budget][n] - before[n]).abs().max()) for n in before)
        assert moved > 1e-4
    assert len(pack(samples, 24)) >= 3
    for name, p in params[10_000].items():
        torch.testing.assert_close(params[24][name], p, atol=1e-6, rtol=0, msg=name)


def test_lora_step_changes_only_adapters_and_export_serves_the_merged_model(model_dir):
    trainer = trainer_for(model_dir, "train.lora.enabled=true", "train.lora.r=4", "train.lr=1e-2",
                          "train.kl_coef=0.1")
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert lora_before and all(p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" in n)
    samples = on_policy(trainer, make_samples(trainer.vocab_size))
    first = trainer.train_step(samples, 0)
    assert first.ok and first.metrics["kl_mean"] == pytest.approx(0.0, abs=1e-7)  # B = 0: policy == base
    second = trainer.train_step(samples, 1)
    assert second.ok and second.metrics["kl_mean"] > 0  # the reference is the base with the adapter off
    for n, p in trainer.model.named_parameters():
        if "lora_" in n:
            continue
        assert torch.equal(p, base_before[n]), f"base weight {n} changed"
    assert any(not torch.equal(p, lora_before[n]) for n, p in trainer.model.named_parameters() if "lora_" in n)

    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    exported = trainer.export_weights()
    assert not any("lora_" in k or "base_layer" in k for k in exported)
    served = load_model(str(model_dir), device="cpu").model
    assert set(exported) == set(served.state_dict())
    served.load_state_dict(exported)
    ids = torch.tensor([samples[0].prompt_ids + samples[0].response_ids])
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, trainer.model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    for n, p in trainer.model.named_parameters():  # exporting did not merge into the trainable adapter
        if "lora_" in n:
            assert torch.equal(p, adapters[n])
        else:
            assert torch.equal(p, base_before[n])


def test_nonfinite_loss_skips_the_step_and_pauses_after_max_bad_steps(model_dir):
    trainer = trainer_for(model_dir, "train.max_bad_steps=2")
    good = on_policy(trainer, make_samples(trainer.vocab_size))
    bad = on_policy(trainer, make_samples(trainer.vocab_size, advantage=float("nan")))
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    first = trainer.train_step(bad, 0)
    assert not first.ok and first.skipped_reason == "nonfinite_loss" and trainer.paused_reason is None
    assert all(torch.equal(p, weights[n]) for n, p in trainer.model.named_parameters())
    assert trainer.step == 0
    assert trainer.train_step(good, 0).ok  # a good step resets the count
    trainer.train_step(bad, 1)
    second = trainer.train_step(bad, 1)
    assert second.skipped_reason == "nonfinite_loss"
    assert trainer.paused_reason and "train.max_bad_steps=2" in trainer.paused_reason
    assert trainer.train_step(good, 1).skipped_reason == "paused"
    trainer.clear_pause()
    assert trainer.train_step(good, 1).ok


def test_trainer_logprobs_match_the_engine_rollout_logprobs(model_dir):
    trainer = trainer_for(model_dir)
    engine = TorchEngine(load_model(str(model_dir), device="cpu"), compose(["model.device=cpu"]).engine)

    async def sample_all():
        await engine.start()
        try:
            g = random.Random(1)
            prompts = [[g.randrange(3, trainer.vocab_size) for _ in range(g.randrange(5, 20))] for _ in range(4)]
            params = SamplingParams(max_new_tokens=12, temperature=0.7, seed=5, ignore_eos=True)
            return await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        finally:
            await engine.shutdown()

    results = asyncio.run(sample_all())
    samples = [Sample(i, i, str(i), r.prompt_ids, r.token_ids, r.logprobs, r.weight_versions, 1.0, 1.0,
                      extra={"temperature": 0.7}) for i, r in enumerate(results)]
    recomputed = trainer.logprobs(samples)
    gap = max(abs(a - b) for s, lps in zip(samples, recomputed) for a, b in zip(s.rollout_logprobs, lps))
    assert gap < 1e-4
    result = trainer.train_step(samples, weight_version=0)
    assert result.ok and result.metrics["rollout_logprob_gap_max"] < 1e-4


def test_loss_mask_excludes_tokens_from_the_update(model_dir):
    trainer = trainer_for(model_dir, "train.lr=1e-2")
    samples = on_policy(trainer, make_samples(trainer.vocab_size, n=2))
    for s in samples:
        s.loss_mask = [0] * len(s.response_ids)
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train_step(samples, 0)
    assert not result.ok and result.skipped_reason == "no_trainable_tokens"
    assert all(torch.equal(p, weights[n]) for n, p in trainer.model.named_parameters())


def test_malformed_sample_is_refused_by_name(model_dir):
    trainer = trainer_for(model_dir)
    s = make_samples(trainer.vocab_size, n=1)[0]
    s.rollout_logprobs = s.rollout_logprobs[:-1]
    with pytest.raises(ValueError, match="sample 0: .* rollout logprobs"):
        trainer.train_step([s], 0)


def test_megatron_layout_that_does_not_divide_the_model_is_refused_before_any_rank_starts(model_dir, tmp_path):
    cfg = compose(["trainer.backend=megatron", "cluster.tp=3", f"run_dir={tmp_path}"])
    with pytest.raises(TrainerError, match="cluster.tp=3 does not divide the 4 attention heads"):
        make_trainer(cfg, str(model_dir))
    assert not (tmp_path / "cluster").exists()  # no torchrun agent was started
    lora = compose(["trainer.backend=megatron", "train.lora.enabled=true", f"run_dir={tmp_path}"])
    with pytest.raises(TrainerError, match="train.lora.enabled=true needs trainer.backend=torch"):
        make_trainer(lora, str(model_dir))


def test_staleness_and_reward_metrics_describe_the_batch(model_dir):
    trainer = trainer_for(model_dir)
    samples = on_policy(trainer, make_samples(trainer.vocab_size, n=2))
    samples[0].weight_versions = [3] * len(samples[0].response_ids)
    samples[1].weight_versions = [5] * len(samples[1].response_ids)
    samples[1].reward = -1.0
    m = trainer.train_step(samples, weight_version=6).metrics
    assert m["staleness_max"] == 3 and m["staleness_mean"] == 2
    assert m["reward_mean"] == 0.0 and m["samples"] == 2
    assert math.isfinite(m["loss"]) and m["entropy"] > 0


def test_gradient_checkpointing_gives_the_same_update(model_dir):
    samples = make_samples(400, n=3, seed=5)
    updated = []
    for flag in ("false", "true"):
        trainer = trainer_for(model_dir, f"train.gradient_checkpointing={flag}", "train.lr=1e-3", dtype=torch.float64)
        assert trainer.model.is_activation_checkpointing == (flag == "true")
        assert trainer.train_step(on_policy(trainer, samples), 0).ok
        updated.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    for name, p in updated[0].items():
        torch.testing.assert_close(updated[1][name], p, atol=1e-9, rtol=0, msg=name)


def test_kl_in_reward_folds_the_penalty_into_the_advantage(model_dir):
    """After one step the policy differs from the frozen reference; with kl_in_reward the KL lowers
    the advantage instead of adding a loss term, so the policy loss reflects it."""
    losses = {}
    for in_reward in ("false", "true"):
        trainer = trainer_for(model_dir, "train.kl_coef=0.5", f"train.kl_in_reward={in_reward}", "train.lr=1e-2",
                              "train.kl_estimator=k1")
        samples = on_policy(trainer, make_samples(trainer.vocab_size, seed=9))
        assert trainer.train_step(samples, 0).ok
        result = trainer.train_step(on_policy(trainer, samples), 1)
        assert result.metrics["kl_mean"] > 0.01
        losses[in_reward] = result.metrics
    # k1 as a loss term has zero value at ratio 1 beyond pg; in the reward it shifts pg_loss by +kl_coef * KL.
    assert losses["true"]["pg_loss"] == pytest.approx(losses["false"]["pg_loss"] + 0.5 * losses["true"]["kl_mean"],
                                                      rel=1e-4)
    assert losses["false"]["loss"] == pytest.approx(losses["false"]["pg_loss"] + 0.5 * losses["false"]["kl_mean"],
                                                    rel=1e-4)
