"""The examples docs/architecture.md walks through run as written: a new method and a new sample
source, each one file loaded by path, each training a step."""
from __future__ import annotations

import asyncio
from pathlib import Path

from clawrl.config import compose
from clawrl.engines import make_engine
from clawrl.envs.source import make_env_source
from clawrl.methods.registry import method_class
from clawrl.trainers.backends import make_trainer
from test_trainer import make_samples, model_dir, on_policy  # noqa: F401 (fixture)

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def test_the_method_example_halves_negative_advantages(model_dir):
    spec = f"{EXAMPLES / 'confident_rl.py'}:ConfidentRL"
    assert method_class(spec).__name__ == "ConfidentRL"
    losses = {}
    for method in ("rl", spec):
        cfg = compose([f"model.path={model_dir}", f"method={method}", "train.lr=1e-3", "logging.wandb.mode=disabled"])
        trainer = make_trainer(cfg, str(model_dir))
        try:
            samples = on_policy(trainer, make_samples(trainer.vocab_size, n=4, advantage=-1.0))
            result = trainer.train_step(samples, weight_version=0)
            assert result.ok, result.skipped_reason
            losses[method] = result.metrics["loss"]
            assert result.metrics.get("negative_weight") == (0.5 if method == spec else None)
        finally:
            trainer.close()
    # on policy the loss is -A per token: halving the negative advantages halves the loss
    assert abs(losses[spec] - losses["rl"] / 2) < 1e-6 and losses["rl"] != 0


def test_the_environment_example_rolls_out_a_group_and_trains_a_step(tiny_model_dir):
    cfg = compose([f"model.path={tiny_model_dir}", "method=rl", "train.lr=1e-3", "engine.threads=1",
                   "logging.wandb.mode=disabled", f"env.name={EXAMPLES / 'echo_env.py'}:EchoWord",
                   "env.group_size=2", "env.max_turns=2", "env.max_tokens_per_turn=8"])
    engine = make_engine(cfg)
    source = make_env_source(cfg, engine)
    # a group whose rollouts all score the same teaches nothing and yields no samples: roll on to one that differs
    # (the embedded model often repeats the word in both tries, or misses it in both: allow many groups)
    groups = roll_groups_until_kept(engine, source, 8 * len(source.tasks))
    for episodes, samples in groups:
        assert len({e.task.task_id for e in episodes}) == 1 and len(episodes) == 2
        assert bool(samples) != (episodes[0].reward == episodes[1].reward)
    episodes, samples = groups[-1]
    assert source.counters["groups_filtered_equal"] == source.counters["groups"] - 1
    assert len(samples) == 2 and len({s.group_id for s in samples}) == 1
    assert all(0.0 <= s.reward <= 1.0 for s in samples) and samples[0].reward != samples[1].reward
    trainer = make_trainer(cfg, str(tiny_model_dir))
    try:
        assert trainer.train_step(samples, weight_version=0).ok
    finally:
        trainer.close()


def roll_groups_until_kept(engine, source, most: int) -> list:
    """Start the engine, roll out groups of ``source`` until one yields samples (at most ``most``),
    stop the engine; every group rolled out, in order."""
    async def roll():
        await engine.start()
        groups = []
        try:
            while len(groups) < most and not (groups and groups[-1][1]):
                groups.append(await source.next_group())
            return groups
        finally:
            await engine.shutdown()

    return asyncio.run(roll())


def test_the_code_shown_in_architecture_md_is_the_code_that_runs():
    import re

    doc = (EXAMPLES.parent / "architecture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(blocks) == 2
    for block, name in zip(blocks, ("confident_rl.py", "echo_env.py")):
        assert block.strip() in (EXAMPLES / name).read_text(), name
