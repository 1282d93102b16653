"""Environments through the sample-source seam: a multi-turn guess-the-number environment loaded by
path, rolled out in groups of two with the embedded model, trained one step with the rl method.
Groups form, loss masks cover the model's tokens only, and no sampled id is ever changed."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from clawrl.config import ConfigError, compose
from clawrl.engines import make_engine
from clawrl.envs import EnvError, env_class
from clawrl.envs.source import make_env_source
from clawrl.envs.tasks import load_tasks
from clawrl.trainers.backends import make_trainer

ENV = str(Path(__file__).with_name("guess_number_env.py")) + ":GuessNumber"


class RecordingEngine:
    """The engine, with every prompt it was asked to continue kept for inspection."""

    def __init__(self, engine):
        self.engine, self.prompts = engine, {}  # per sampling seed (one per rollout): the prompts in order

    async def generate(self, prompt_ids, params):
        self.prompts.setdefault(params.seed, []).append(list(prompt_ids))
        return await self.engine.generate(prompt_ids, params)


def roll_one_group(engine, source):
    """Start the engine, roll out one group of ``source``, stop the engine."""
    async def roll():
        await engine.start()
        try:
            return await source.next_group()
        finally:
            await engine.shutdown()

    return asyncio.run(roll())


def test_a_guess_number_group_trains_one_step_with_exact_tokens(tiny_model_dir):
    cfg = compose([f"model.path={tiny_model_dir}", "method=rl", "train.lr=1e-3", "engine.threads=1",
                   "logging.wandb.mode=disabled", f"env.name={ENV}", "env.group_size=2", "env.max_turns=3",
                   "env.max_tokens_per_turn=6", "seed=3"])
    engine = make_engine(cfg)
    source = make_env_source(cfg, engine)
    recorder = source.engine = RecordingEngine(engine)
    episodes, samples = roll_one_group(engine, source)
    # the group: two rollouts of one task, advantages relative to each other
    assert len(samples) == 2 and samples[0].group_id == samples[1].group_id
    assert all(e.task.task_id == "guess-7" for e in episodes)
    rewards = [s.reward for s in samples]
    if rewards[0] != rewards[1]:
        assert samples[0].advantage == pytest.approx(-samples[1].advantage) and samples[0].advantage != 0
    tok = engine.tokenizer
    for e, s in zip(episodes, samples):
        assert e.turns >= 1 and e.turns == len(e.sampled) and (e.done or e.truncated)
        assert s.loss_mask[-1] == 1  # an episode ends with the model's reply, never an unanswered observation
        # the loss mask covers exactly the sampled ids, which appear unchanged and in order
        trained = [t for t, m in zip(s.response_ids, s.loss_mask) if m]
        assert trained == [t for turn in e.sampled for t in turn]
        assert len(s.loss_mask) == len(s.response_ids) == len(s.rollout_logprobs) == len(s.weight_versions)
        untrained = tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if not m])
        if e.turns > 1:  # the environment's answers sit between turns, masked out
            assert any(w in untrained for w in ("higher", "lower", "not a number"))
        assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if not m)
    # each turn's prompt is the previous prompt plus exactly the ids sampled there (and what came between)
    seeds = sorted(recorder.prompts)
    assert len(seeds) == 2
    for e, seed in zip(episodes, seeds):
        prompts = recorder.prompts[seed]
        assert len(prompts) == e.turns and prompts[0] == e.prompt_ids
        context = e.prompt_ids + e.response_ids
        for k in range(1, e.turns):
            previous = prompts[k - 1]
            assert prompts[k][:len(previous)] == previous
            assert prompts[k][len(previous):len(previous) + len(e.sampled[k - 1])] == e.sampled[k - 1]
            assert prompts[k] == context[:len(prompts[k])]

    trainer = make_trainer(cfg, str(tiny_model_dir))
    try:
        before = trainer.logprobs(samples)
        result = trainer.train_step(samples, 0)
        assert result.ok, result.skipped_reason
        after = trainer.logprobs(samples)
        assert any(abs(a - b) > 1e-6 for x, y in zip(before, after) for a, b in zip(x, y))
    finally:
        trainer.close()


def test_env_name_by_path_and_tasks_by_split_refuse_bad_input_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        env_class(str(tmp_path / "missing.py") + ":Env")
    with pytest.raises(ConfigError, match="defines no 'Nope'"):
        env_class(ENV.replace(":GuessNumber", ":Nope"))
    with pytest.raises(ConfigError, match="unknown env.name 'bogus'"):
        env_class("bogus")
    data = tmp_path / "set" / "data"
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text(json.dumps({"id": "a", "target": 5}) + "\n" + json.dumps({"target": 9}) + "\n")
    cls = env_class(ENV)
    tasks = load_tasks(str(tmp_path / "set"), "train", cls)
    assert [(t.task_id, t.data) for t in tasks] == [("a", {"target": 5}), ("train-2", {"target": 9})]
    with pytest.raises(EnvError, match="has no test split .*splits: train"):
        load_tasks(str(tmp_path / "set"), "test", cls)
    assert [t.task_id for t in load_tasks(None, "test", cls)] == ["guess-18", "guess-91"]
