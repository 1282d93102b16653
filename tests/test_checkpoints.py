"""Checkpoints: a restart resumes weights, optimizer, step and version; old ones are pruned; a
corrupt newest checkpoint falls back to the previous one; ``clawrl rollback`` goes back to an
earlier version under a new, higher version number."""
from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from clawrl.checkpoints import CheckpointError, CheckpointStore
from clawrl.cli import main
from clawrl.config import compose
from clawrl.samples import Sample
from clawrl.trainers.torch_trainer import TorchTrainer
from engine_testing import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("ckpt_model") / "q3", "qwen3", seed=4)


def new_trainer(model_dir, *overrides):
    cfg = compose(["model.device=cpu", "train.lr=1e-2", *overrides])
    return TorchTrainer(cfg, str(model_dir)), cfg


def batch(trainer, seed=0):
    g = random.Random(seed)
    out = []
    for i in range(3):
        prompt = [g.randrange(3, trainer.vocab_size) for _ in range(6)]
        response = [g.randrange(3, trainer.vocab_size) for _ in range(4)]
        out.append(Sample(i, i, str(i), prompt, response, [0.0] * 4, [0] * 4, 1.0, 1.0 if i % 2 else -1.0))
    for s, lps in zip(out, trainer.logprobs(out)):
        s.rollout_logprobs = lps
    return out


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def nudge(trainer, step: int):
    """Distinct weights per checkpoint without the cost of training."""
    with torch.no_grad():
        next(trainer.model.parameters()).add_(0.01)
    trainer.step = step


def test_resume_restores_weights_optimizer_step_version_and_buffer_state(model_dir, tmp_path):
    trainer, cfg = new_trainer(model_dir, "train.save_every=2")
    store = CheckpointStore(tmp_path, cfg.train)
    for version in (1, 2):
        assert trainer.train_step(batch(trainer, version), version - 1).ok
        saved = store.after_step(trainer, version, {"baseline": {"value": 0.5 * version, "count": version}})
    assert saved == tmp_path / "checkpoints" / "step_2"
    assert json.loads((saved / "manifest.json").read_text())["weight_version"] == 2

    fresh, _ = new_trainer(model_dir, "train.save_every=2")
    state = CheckpointStore(tmp_path, cfg.train).resume(fresh)
    assert (state.step, state.weight_version, state.rolled_back) == (2, 2, False)
    assert state.buffer_state == {"baseline": {"value": 1.0, "count": 2}}
    for name, p in params(trainer).items():
        assert torch.equal(params(fresh)[name], p), name
    # Same optimizer moments and RNG: the next step is identical on both.
    nxt = batch(trainer, 7)
    assert trainer.train_step(nxt, 2).ok and fresh.train_step(nxt, 2).ok
    for name, p in params(trainer).items():
        torch.testing.assert_close(params(fresh)[name], p, atol=1e-7, rtol=0)


def test_fresh_run_has_nothing_to_resume(model_dir, tmp_path):
    trainer, cfg = new_trainer(model_dir)
    assert CheckpointStore(tmp_path, cfg.train).resume(trainer) is None


def test_keep_last_prunes_older_checkpoints(model_dir, tmp_path):
    trainer, cfg = new_trainer(model_dir, "train.save_every=1", "train.keep_last=2")
    store = CheckpointStore(tmp_path, cfg.train)
    for step in range(1, 5):
        nudge(trainer, step)
        store.after_step(trainer, step)
    assert store.steps() == [4, 3]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(model_dir, tmp_path, caplog):
    trainer, cfg = new_trainer(model_dir, "train.save_every=1")
    store = CheckpointStore(tmp_path, cfg.train)
    saved = {}
    for step in (1, 2, 3):
        nudge(trainer, step)
        store.after_step(trainer, step)
        saved[step] = params(trainer)
    weights = tmp_path / "checkpoints" / "step_3" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    (tmp_path / "checkpoints" / "step_2" / "manifest.json").write_text("{not json")

    fresh, _ = new_trainer(model_dir)
    with caplog.at_level(logging.WARNING, logger="clawrl.checkpoints"):
        state = store.resume(fresh)
    assert state.checkpoint.name == "step_1" and fresh.step == 1
    assert "step_3 is unusable" in caplog.text and "checksum" in caplog.text and "step_2 is unusable" in caplog.text
    assert all(torch.equal(params(fresh)[n], p) for n, p in saved[1].items())
    # Version 3 was served, so the older weights come back under a new, higher version.
    assert state.weight_version == 4 and store.high_water() == 4


def test_rollback_cli_resumes_an_earlier_version_under_a_higher_one(model_dir, tmp_path, capsys):
    trainer, cfg = new_trainer(model_dir, "train.save_every=1", "train.keep_last=5")
    store = CheckpointStore(tmp_path, cfg.train)
    saved = {}
    for step in (1, 2, 3):
        nudge(trainer, step)
        store.after_step(trainer, 10 + step)
        saved[step] = params(trainer)

    assert main(["rollback", "--run-dir", str(tmp_path), "--to", "12"]) == 0
    assert "serves it as weight version 14" in capsys.readouterr().out
    fresh, _ = new_trainer(model_dir)
    state = store.resume(fresh)
    assert state.rolled_back and state.weight_version == 14 and state.step == 4
    assert all(torch.equal(params(fresh)[n], p) for n, p in saved[2].items())
    assert store.manifest(4)["weight_version"] == 14

    # Applied once: the next start resumes the rolled-back line, and never the abandoned step_3,
    # even when the newest checkpoint is corrupt.
    again, _ = new_trainer(model_dir)
    assert store.resume(again).weight_version == 14 and again.step == 4
    (tmp_path / "checkpoints" / "step_4" / "trainer_state.pt").write_bytes(b"garbage")
    third, _ = new_trainer(model_dir)
    state = store.resume(third)
    assert state.checkpoint.name == "step_2" and state.weight_version == 15
    assert all(torch.equal(params(third)[n], p) for n, p in saved[2].items())


def test_rollback_cli_errors_are_one_line(model_dir, tmp_path, capsys):
    assert main(["rollback", "--run-dir", str(tmp_path), "--to", "3"]) == 2
    assert capsys.readouterr().err.strip() == f"clawrl: no checkpoints in {tmp_path / 'checkpoints'}"
    trainer, cfg = new_trainer(model_dir, "train.save_every=1")
    store = CheckpointStore(tmp_path, cfg.train)
    for step in (1, 2):
        nudge(trainer, step)
        store.after_step(trainer, step)
    capsys.readouterr()
    assert main(["rollback", "--run-dir", str(tmp_path), "--to", "9"]) == 2
    assert capsys.readouterr().err.strip() == "clawrl: no checkpoint has weight version 9; available: 1, 2"


def test_lora_checkpoint_holds_only_the_adapter(model_dir, tmp_path):
    trainer, cfg = new_trainer(model_dir, "train.lora.enabled=true", "train.save_every=1")
    assert trainer.train_step(batch(trainer), 0).ok
    path = CheckpointStore(tmp_path, cfg.train).after_step(trainer, 1)
    from safetensors.torch import load_file

    names = list(load_file(str(path / "adapter.safetensors")))
    assert names and all("lora_" in n for n in names)
    fresh, _ = new_trainer(model_dir, "train.lora.enabled=true")
    CheckpointStore(tmp_path, cfg.train).resume(fresh)
    assert all(torch.equal(params(fresh)[n], p) for n, p in params(trainer).items())
    full, _ = new_trainer(model_dir)
    with pytest.raises(CheckpointError, match="lora weights but the trainer is set up for full"):
        CheckpointStore(tmp_path, cfg.train).resume(full)


def test_only_the_newest_checkpoint_keeps_the_optimizer_and_an_older_one_restarts_it(model_dir, tmp_path, caplog):
    trainer, cfg = new_trainer(model_dir, "train.keep_last=3")
    store = CheckpointStore(tmp_path, cfg.train)
    weights = {}
    for step in (1, 2, 3):
        assert trainer.train_step(batch(trainer, step), step - 1).ok
        store.save(trainer, step)
        weights[step] = params(trainer)
    root = tmp_path / "checkpoints"
    assert [s for s in (1, 2, 3) if (root / f"step_{s}" / "optimizer.pt").exists()] == [3]
    for s in (1, 2, 3):  # every checkpoint stays valid, its manifest naming exactly its files
        assert set(store.verify(s)["files"]) == {"weights.safetensors", "trainer_state.pt"} | (
            {"optimizer.pt"} if s == 3 else set())
    # the newest resumes exactly, moments and all
    resumed, _ = new_trainer(model_dir, "train.keep_last=3")
    store.resume(resumed)
    assert resumed.optimizer.state_dict()["state"] and params(resumed).keys() == weights[3].keys()
    # a fallback past a corrupt newest (as a rollback would) takes step 2's weights and restarts AdamW
    (root / "step_3" / "weights.safetensors").write_bytes(b"garbage")
    older, _ = new_trainer(model_dir, "train.keep_last=3")
    with caplog.at_level(logging.WARNING):
        state = store.resume(older)
    assert state.step == 2 and "AdamW restarts with zero moments" in caplog.text
    assert not older.optimizer.state_dict()["state"]
    for name, p in params(older).items():
        assert torch.equal(p, weights[2][name]), name
    assert older.train_step(batch(older, 9), 2).ok  # and it trains on from there


def test_weights_are_kept_in_the_serving_dtype_and_the_newest_resumes_at_full_precision(model_dir, tmp_path):
    from safetensors.torch import load_file

    # the engine serves bf16, the trainer keeps float32: weights.safetensors in bf16, float32 beside it
    trainer, cfg = new_trainer(model_dir, "model.dtype=bfloat16", "train.lr=1e-3")
    store = CheckpointStore(tmp_path, cfg.train)
    for step in (1, 2):
        assert trainer.train_step(batch(trainer, step), step - 1).ok
        store.save(trainer, step)
    full = params(trainer)
    for step in (1, 2):
        on_disk = load_file(str(tmp_path / "checkpoints" / f"step_{step}" / "weights.safetensors"))
        assert {v.dtype for v in on_disk.values()} == {torch.bfloat16}
    step_2 = load_file(str(tmp_path / "checkpoints" / "step_2" / "weights.safetensors"))
    assert all(torch.equal(step_2[k], v.to(torch.bfloat16)) for k, v in full.items())
    resumed, _ = new_trainer(model_dir, "model.dtype=bfloat16", "train.lr=1e-3")
    store.resume(resumed)
    for name, p in params(resumed).items():  # float32, not the bf16 rounding
        assert p.dtype == torch.float32 and torch.equal(p, full[name]), name
