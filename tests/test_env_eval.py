"""``clawrl env eval``: the success rate of a run's weights on a held-out split.

A run directory gets real checkpoints written by the torch trainer from the embedded tiny model,
with weights moved away from the base, and a held run lock as a live server holds it. The command
runs in-process (``clawrl.cli.main``) on a few tasks of toolcall-rl's test split with tiny turns;
the weights it evaluates are checked against the trainer's own logprobs."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from clawrl.checkpoints import CheckpointStore
from clawrl.cli import main
from clawrl.config import compose
from clawrl.embedded.build import resolve_model
from clawrl.engines import make_engine
from clawrl.engines.base import EngineError
from clawrl.envs import Task
from clawrl.envs.task_formats import TaskRecord
from clawrl.errors import CliError
from clawrl.orchestration.env_commands import resolve, split_records
from clawrl.orchestration import evaluation
from clawrl.orchestration.evaluation import (concurrency_beside_rollouts, default_concurrency, evaluate,
                                             newest_complete_checkpoint, open_eval_engine)
from clawrl.run_lock import RunDirBusy, RunDirLock
from clawrl.samples import Sample
from clawrl.trainers.torch_trainer import TorchTrainer
from checkpoint_support import MegatronShards
from engine_testing import make_model_dir
from tests.required_tools import skip_unless_available

SMALL = ["env.max_tokens_per_turn=8", "env.max_turns=2", "engine.threads=1"]
EVAL = ["env", "eval", "toolcall-rl", "--limit", "2"]


@pytest.fixture(autouse=True)
def _isolating_sandbox():
    skip_unless_available("bwrap", "bubblewrap is not installed: a python tool call opens a sandbox")


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    trainer = TorchTrainer(compose(["model.device=cpu"]), str(tiny_model_dir))
    with torch.no_grad():  # far enough from the base that every logprob moves
        gen = torch.Generator().manual_seed(0)
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return trainer


def save(trainer, run_dir: Path, step: int, version: int) -> Path:
    trainer.step = step
    return CheckpointStore(run_dir, compose(["train.keep_last=10"]).train).save(trainer, version)


def tree(root: Path) -> dict:
    """Every path under ``root`` with its size and modification time: what 'nothing written' means."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_eval_reads_the_newest_checkpoint_beside_a_live_server_without_writing(trainer, tmp_path, capsys):
    run = tmp_path / "run"
    save(trainer, run, 1, 2)
    save(trainer, run, 2, 5)
    with RunDirLock(run):  # a live server holds the run
        before = tree(run)
        assert main([*EVAL, "--run-dir", str(run), *SMALL]) == 0
        out, err = capsys.readouterr()
        assert tree(run) == before
        with pytest.raises(RunDirBusy):
            RunDirLock(run).acquire()  # still the server's
    result = last_json(out)
    assert list(result)[:4] == ["success_rate", "mean_reward", "episodes", "weight_version"]
    assert (result["episodes"], result["weight_version"], result["failed"]) == (2, 5, 0)
    assert -1.0 <= result["mean_reward"] <= 1.0 and 0.0 <= result["success_rate"] <= 1.0
    assert f"evaluating {run / 'checkpoints' / 'step_2'} (weight version 5)" in err
    assert len(out.strip().splitlines()) == 1  # the console is the JSON line; progress went to stderr


def _sample(trainer) -> Sample:
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, trainer.vocab_size, (12,), generator=gen).tolist()
    response = torch.randint(3, trainer.vocab_size, (8,), generator=gen).tolist()
    return Sample(0, 0, "0", prompt, response, [0.0] * 8, [0] * 8, 1.0, 1.0)


async def _scores(cfg, run_dir, sample: Sample) -> tuple[list[float], int]:
    engine, _ = await open_eval_engine(cfg, run_dir)
    try:
        scored = await engine.score(sample.prompt_ids, sample.response_ids)
        return scored.logprobs, engine.model_info().weight_version
    finally:
        await engine.shutdown()


def test_the_checkpoints_weights_are_the_ones_evaluated(trainer, tmp_path):
    run = tmp_path / "run"
    save(trainer, run, 1, 3)
    cfg = compose(SMALL)
    sample = _sample(trainer)
    expected = trainer.logprobs([sample])[0]  # the checkpoint's weights, computed by the trainer
    evaluated, version = asyncio.run(_scores(cfg, run, sample))
    base, base_version = asyncio.run(_scores(cfg, None, sample))
    assert (version, base_version) == (3, 0)
    torch.testing.assert_close(torch.tensor(evaluated), torch.tensor(expected), atol=2e-4, rtol=0)
    assert max(abs(a - b) for a, b in zip(base, expected)) > 1e-2  # the base model would have scored otherwise


def test_a_lora_checkpoint_is_evaluated_merged_as_the_trainer_serves_it(tiny_model_dir, tmp_path):
    lora = TorchTrainer(compose(["model.device=cpu", "train.lora.enabled=true"]), str(tiny_model_dir))
    with torch.no_grad():  # peft starts B at zero, a no-op adapter: move it
        gen = torch.Generator().manual_seed(2)
        for name, p in lora.model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    run = tmp_path / "run"
    assert (save(lora, run, 1, 7) / "adapter.safetensors").is_file()
    sample = _sample(lora)
    expected = lora.logprobs([sample])[0]
    evaluated, version = asyncio.run(_scores(compose(SMALL), run, sample))  # the run's LoRA settings: the defaults
    assert version == 7
    torch.testing.assert_close(torch.tensor(evaluated), torch.tensor(expected), atol=2e-4, rtol=0)
    with pytest.raises(CliError, match="holds a LoRA adapter that does not fit .*shape"):
        asyncio.run(_scores(compose([*SMALL, "train.lora.r=4"]), run, sample))  # not the run's rank


def test_a_corrupt_or_incomplete_newest_checkpoint_falls_back_to_the_newest_complete_one(trainer, tmp_path, capsys):
    run = tmp_path / "run"
    save(trainer, run, 1, 1)
    corrupt = save(trainer, run, 2, 2)
    with open(corrupt / "weights.safetensors", "r+b") as f:  # a flipped byte: the checksum fails
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    incomplete = save(trainer, run, 3, 3)
    (incomplete / "manifest.json").unlink()
    (run / "checkpoints" / f".tmp-step_4-{os.getpid()}").mkdir()  # a save in flight: not a checkpoint yet

    weights, notes = newest_complete_checkpoint(run, resolve_model(compose([])))
    assert (weights.weight_version, weights.checkpoint.name) == (1, "step_1")
    assert [n.split(" ")[1] for n in notes] == ["step_3", "step_2"]

    assert main([*EVAL, "--limit", "1", "--run-dir", str(run), *SMALL]) == 0
    out, err = capsys.readouterr()
    assert last_json(out)["weight_version"] == 1
    assert "checkpoint step_3 is incomplete or corrupt" in err and "checkpoint step_2 is incomplete or corrupt" in err
    assert "does not match its checksum" in err


def test_after_a_rollback_the_abandoned_line_is_never_evaluated(trainer, tmp_path):
    run = tmp_path / "run"
    save(trainer, run, 1, 1)
    save(trainer, run, 2, 2)
    store = CheckpointStore(run, compose(["train.keep_last=10"]).train)
    store.request_rollback(1)
    cfg = resolve_model(compose([]))
    assert newest_complete_checkpoint(run, cfg)[0].weight_version == 2  # not applied yet: the server serves 2
    applied = store.resume(trainer)  # the next start applies it: step_1's weights saved again as step_3
    assert (applied.checkpoint.name, applied.weight_version) == ("step_3", 3)
    assert newest_complete_checkpoint(run, cfg)[0].weight_version == 3
    (applied.checkpoint / "manifest.json").unlink()
    weights, notes = newest_complete_checkpoint(run, cfg)
    assert (weights.checkpoint.name, weights.weight_version) == ("step_1", 1)  # step_2 was rolled back
    assert len(notes) == 1 and notes[0].startswith("checkpoint step_3 is incomplete or corrupt")


def test_a_checkpoint_pruned_while_it_is_read_gives_way_to_the_newer_one(trainer, tmp_path, monkeypatch):
    run = tmp_path / "run"
    save(trainer, run, 1, 1)
    original = CheckpointStore.load

    def load_as_the_server_saves(store, step):
        if step == 1 and not store.path(2).exists():  # the live server saves step_2 and prunes step_1
            trainer.step = 2
            CheckpointStore(run, compose(["train.keep_last=1"]).train).save(trainer, 2)
        return original(store, step)

    monkeypatch.setattr(CheckpointStore, "load", load_as_the_server_saves)
    weights, notes = newest_complete_checkpoint(run, resolve_model(compose([])))
    assert (weights.checkpoint.name, weights.weight_version, notes) == ("step_2", 2, [])


def test_a_run_dir_without_checkpoints_evaluates_the_base_model_and_says_so(tmp_path, capsys):
    run = tmp_path / "fresh"
    run.mkdir()
    assert main([*EVAL, "--limit", "1", "--run-dir", str(run), *SMALL]) == 0
    out, err = capsys.readouterr()
    assert last_json(out)["weight_version"] == 0
    assert f"{run} has no complete checkpoint: evaluating the base model" in err
    assert list(run.iterdir()) == []


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path, capsys):
    other = TorchTrainer(compose(["model.device=cpu"]), str(make_model_dir(tmp_path / "other", "qwen3", seed=1)))
    run = tmp_path / "run"
    save(other, run, 1, 1)
    capsys.readouterr()
    assert main([*EVAL, "--run-dir", str(run), *SMALL]) == 2  # evaluated on the embedded model
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "step_1 does not fit the model" in err and "has shape" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--run-dir", "{tmp}/nowhere"], "--run-dir {tmp}/nowhere: no such run directory"),
    (["--run-dir", "{tmp}/a-file"], "--run-dir {tmp}/a-file: no such run directory"),
    (["--run-dir", "{tmp}/megatron"], "clawrl env eval reads torch-trainer checkpoints"),
    (["--n", "0"], "--n must be a whole number >= 1, got '0'"),
    (["--limit", "two"], "--limit must be a whole number >= 1, got 'two'"),
    (["--temperature", "-1"], "--temperature must be a number >= 0 (0: greedy), got '-1'"),
    (["--temperature", "nan"], "--temperature must be a number >= 0"),
    (["--split", "validation"], "no tasks in split 'validation' here (splits: test, train)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "a-file").write_text("not a run\n")
    CheckpointStore(tmp_path / "megatron").save(MegatronShards(), 1)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main([*EVAL, *argv, *SMALL]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("clawrl: "), err
    assert message.replace("{tmp}", str(tmp_path)) in err


class _RecordingEngine:
    """The real engine, with every generate call's sampling parameters and the most calls in flight
    at once recorded."""

    def __init__(self, engine):
        self._engine, self.params, self.in_flight, self.most_in_flight = engine, [], 0, 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, prompt_ids, params, request_id=None):
        self.params.append(params)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._engine.generate(prompt_ids, params, request_id)
        finally:
            self.in_flight -= 1


async def _evaluate_in_process(cfg, records, **kwargs):
    engine = make_engine(resolve_model(cfg))
    await engine.start()
    try:
        recording = _RecordingEngine(engine)
        return await evaluate(cfg, recording, records, **kwargs), recording
    finally:
        await engine.shutdown()


def test_n_plays_per_task_sample_concurrently_each_with_its_own_seed(capsys):
    task_set = resolve("toolcall-rl", [*SMALL, "env.max_turns=1"])
    records = split_records(task_set, "test", 2)
    result, engine = asyncio.run(_evaluate_in_process(task_set.cfg, records, n=3, temperature=0.7))
    assert (result.episodes, result.failed, len(result.scores)) == (6, 0, 6)
    assert [(s.task_id, s.play) for s in result.scores] == [(r.task.task_id, k) for r in records for k in range(3)]
    assert len(engine.params) == 6 and {p.temperature for p in engine.params} == {0.7}
    assert len({p.seed for p in engine.params}) == 6 and {p.max_new_tokens for p in engine.params} == {8}
    assert engine.most_in_flight > 1  # the engine saw them together, to batch
    assert result.weight_version == 0 and result.weight_versions == [0]

    assert main([*EVAL, "--n", "2", "--temperature", "0.7", *SMALL]) == 0
    assert last_json(capsys.readouterr().out)["episodes"] == 4


def test_an_environment_failure_costs_its_episode_not_the_evaluation():
    task_set = resolve("toolcall-rl", [*SMALL, "env.max_turns=1"])
    good = split_records(task_set, "test", 1)
    broken = TaskRecord(Task("no-answer", {"question": "What is 2+2?"}), "test", "rows")  # a row without an answer
    result, _ = asyncio.run(_evaluate_in_process(task_set.cfg, [broken, *good]))
    assert (result.episodes, result.failed) == (2, 1)
    failed = result.scores[0]
    assert failed.failed and not failed.success and "answer" in failed.error and "EnvError" in failed.error
    assert not result.scores[1].failed
    assert result.mean_reward == result.scores[1].reward  # the failure is left out of the rates


def test_when_no_episode_can_be_played_it_says_why_and_exits_1(tmp_path, capsys):
    rows = tmp_path / "rows"
    (rows / "data").mkdir(parents=True)
    (rows / "dataset.toml").write_text('name = "unanswerable"\n')
    unanswered = [{"task_id": "q1", "question": "2+3"}, {"task_id": "q2", "question": "4+4"}]  # no answer field
    (rows / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unanswered))
    assert main(["env", "eval", str(rows), "env.name=toolcall", *SMALL]) == 1
    out, err = capsys.readouterr()
    assert last_json(out)["failed"] == last_json(out)["episodes"] == 2
    assert "clawrl: 2 of 2 episodes could not be played (left out of the rates): " in err and "answer" in err


def test_episodes_keep_the_limits_training_rollouts_have():
    task_set = resolve("toolcall-rl", [*SMALL, "env.max_total_tokens=2"])  # not even the first prompt fits
    result, engine = asyncio.run(_evaluate_in_process(task_set.cfg, split_records(task_set, "test", 2)))
    assert engine.params == [] and result.failed == 2  # no reply: nothing of the model to score
    assert all("max_total_tokens" in s.error for s in result.scores)


def test_an_engine_failure_ends_the_evaluation_in_one_line(monkeypatch, capsys):
    async def engine_gone(cfg, engine, record, params):
        raise EngineError("engine stopped")

    monkeypatch.setattr(evaluation, "model_episode", engine_gone)
    assert main([*EVAL, *SMALL]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines()[-1] == "clawrl: the engine failed during the evaluation: engine stopped"


def test_an_evaluation_during_training_leaves_the_rollouts_their_sandbox_slots():
    """Beside 2 groups of 4 in flight, a periodic evaluation may hold 32 - 8 sandboxes: taking all
    32 made the rollouts' episodes fail with 'all sandbox slots are in use' (found in a toolcall-rl
    training run)."""
    cfg = compose(["engine.max_batch_size=64", "sandbox.slots=32", "env.groups_in_flight=2", "env.group_size=4"])
    assert default_concurrency(cfg) == 32 and concurrency_beside_rollouts(cfg) == 24
    tight = compose(["sandbox.slots=8", "env.groups_in_flight=2", "env.group_size=4"])
    assert concurrency_beside_rollouts(tight) == 1  # never zero: the evaluation still runs, one at a time
    small_engine = compose(["engine.max_batch_size=4", "sandbox.slots=32"])
    assert concurrency_beside_rollouts(small_engine) == 4
