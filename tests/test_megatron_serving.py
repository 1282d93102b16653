"""The megatron backend as ``clawrl serve`` runs it: trainer ranks in their own processes (torchrun),
the engine in the driver, weights streamed between them.

A 2-rank tensor-parallel trainer trains one step and streams its weights into a TorchEngine in
this process; the engine's greedy output then equals an HF model loaded with the trainer's
weights. (Full ``run.sh`` runs, on one node and on two, are in ``test_megatron_launch.py``.)
"""
from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("megatron.core")

from clawrl.config import compose  # noqa: E402
from engine_testing import make_model_dir  # noqa: E402

PROMPTS = [[5, 17, 42, 9], [3, 3, 8]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("qwen3"), arch="qwen3", std=0.25)


@pytest.fixture
def tp2_config(tmp_path, monkeypatch):
    """A one-node launch of 2 tensor-parallel CPU ranks (no multi-node variables from the caller's
    environment), with ``overrides`` on top."""
    for var in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def make(*overrides):
        return compose(["trainer.backend=megatron", "cluster.tp=2", "cluster.procs_per_node=2", "cluster.timeout_s=120",
                        "train.lr=1e-2", "train.micro_batch_tokens=64", f"run_dir={tmp_path}", "model.device=cpu",
                        *overrides])
    return make


def hf_greedy(model_dir, state):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = list(prompt)
            for _ in range(NEW_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt):])
    return out


@pytest.mark.slow
def test_two_rank_tensor_parallel_trainer_streams_weights_into_the_engine(model_dir, tmp_path, tp2_config):
    from clawrl.engines.base import SamplingParams
    from clawrl.engines.loading import load_model
    from clawrl.engines.torch_engine import TorchEngine
    from clawrl.trainers.backends import make_trainer
    from clawrl.trainers.megatron.convert import read_arch
    from clawrl.trainers.megatron.parity import synthetic_batch

    cfg = tp2_config("cluster.bucket_mb=1")
    trainer = make_trainer(cfg, str(model_dir))
    engine = TorchEngine(load_model(str(model_dir), device="cpu"), cfg.engine)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    async def run():
        await engine.start()
        sync = trainer.weight_sync(engine)
        try:
            before = [r.token_ids for r in await asyncio.gather(*(engine.generate(p, greedy) for p in PROMPTS))]
            samples = synthetic_batch(read_arch(model_dir).vocab, n=4, pad_id=0)
            result = await asyncio.to_thread(trainer.train_step, samples, 0)
            assert result.ok and result.metrics["step"] == 1, result
            await sync.push(trainer, 1)
            after = await asyncio.gather(*(engine.generate(p, greedy) for p in PROMPTS))
            return before, after, sync.version
        finally:
            sync.close()
            await engine.shutdown()

    try:
        before, after, version = asyncio.run(run())
        trained = trainer.export_weights()
    finally:
        trainer.close()
    assert version == 1 and all(set(r.weight_versions) == {1} for r in after)
    expected = hf_greedy(model_dir, trained)
    assert [r.token_ids for r in after] == expected
    assert expected != before  # the step moved the weights enough to change greedy output (lr 1e-2)
    assert "megatron trainer" in (tmp_path / "cluster" / "node0.log").read_text()  # the ranks logged their start


@pytest.mark.slow
def test_a_restarted_megatron_trainer_resumes_from_its_checkpoint(model_dir, tmp_path, tp2_config):
    from clawrl.checkpoints import CheckpointStore
    from clawrl.trainers.backends import make_trainer
    from clawrl.trainers.megatron.convert import read_arch
    from clawrl.trainers.megatron.parity import synthetic_batch

    cfg = tp2_config("train.save_every=1")
    samples = synthetic_batch(read_arch(model_dir).vocab, n=4, pad_id=0)
    store = CheckpointStore(tmp_path, cfg.train)
    trainer = make_trainer(cfg, str(model_dir))
    try:
        assert trainer.train_step(samples, 0).ok
        saved = store.after_step(trainer, 1)
        assert saved is not None and (saved / "weights.safetensors").exists()
        assert trainer.train_step(samples, 1).ok  # the step a restart must reproduce
        expected = trainer.export_weights()
    finally:
        trainer.close()

    restarted = make_trainer(cfg, str(model_dir))  # fresh ranks: base weights until resumed
    try:
        resumed = store.resume(restarted)
        assert resumed.step == 1 and resumed.weight_version == 1 and restarted.step == 1
        assert restarted.train_step(samples, 1).ok
        again = restarted.export_weights()
    finally:
        restarted.close()
    assert set(again) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(tensor, again[name]), name
