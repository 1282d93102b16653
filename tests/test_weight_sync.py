"""In-process weight sync into a real TorchEngine: versions only increase, updates land between
decode steps while streams are running, and no request fails."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from clawrl.config import compose
from clawrl.engines.base import SamplingParams
from clawrl.engines.loading import load_model
from clawrl.engines.torch_engine import TorchEngine
from clawrl.samples import Sample
from clawrl.trainers.torch_trainer import TorchTrainer
from clawrl.weight_sync import InProcessWeightSync, WeightSyncError
from engine_testing import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("sync_model") / "q3", "qwen3", seed=2)


def samples_from(results) -> list[Sample]:
    return [Sample(i, i, str(i), r.prompt_ids, r.token_ids, r.logprobs, r.weight_versions, 1.0, 1.0 if i % 2 else -1.0)
            for i, r in enumerate(results)]


def test_streams_survive_weight_updates_with_non_decreasing_versions(model_dir):
    cfg = compose(["model.device=cpu", "train.lr=1e-2"])
    trainer = TorchTrainer(cfg, str(model_dir))
    engine = TorchEngine(load_model(str(model_dir), device="cpu"), cfg.engine)
    sync = InProcessWeightSync(engine)
    vocab = trainer.vocab_size

    async def stream_one(prompt, seed):
        versions, tokens, finish = [], 0, None
        params = SamplingParams(max_new_tokens=160, temperature=1.0, seed=seed, ignore_eos=True)
        async for chunk in engine.stream(prompt, params):
            versions += chunk.weight_versions
            tokens += len(chunk.token_ids)
            finish = chunk.finish_reason or finish
        return versions, tokens, finish

    async def scenario():
        await engine.start()
        try:
            g = random.Random(0)
            prompts = [[g.randrange(3, vocab) for _ in range(g.randrange(5, 15))] for _ in range(6)]
            seed_batch = await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=6, seed=i))
                                                for i, p in enumerate(prompts)))
            batch = samples_from(seed_batch)
            streams = [asyncio.create_task(stream_one(p, 100 + i)) for i, p in enumerate(prompts)]
            sync_ms = []
            for version in (1, 2, 3):
                result = await asyncio.to_thread(trainer.train_step, batch, version - 1)
                assert result.ok
                sync_ms.append(await sync.push(trainer, version))
            outcomes = await asyncio.gather(*streams)
            probe = await engine.score(prompts[0], seed_batch[0].token_ids)
            return outcomes, sync_ms, probe, batch
        finally:
            await engine.shutdown()

    outcomes, sync_ms, probe, batch = asyncio.run(scenario())
    for versions, tokens, finish in outcomes:
        assert finish == "length" and tokens == 160 == len(versions)
        assert versions == sorted(versions)
    assert any(len(set(versions)) > 1 for versions, _, _ in outcomes)  # updates landed mid-stream
    assert all(ms > 0 for ms in sync_ms) and sync.last_sync_ms == sync_ms[-1]
    assert engine.weight_version == 3 and probe.weight_version == 3
    # The engine now serves exactly the trainer's weights.
    expected = trainer.logprobs([Sample(0, 0, "0", batch[0].prompt_ids, batch[0].response_ids,
                                        batch[0].rollout_logprobs, batch[0].weight_versions, 0.0, 0.0)])[0]
    assert max(abs(a - b) for a, b in zip(probe.logprobs, expected)) < 1e-4
    assert max(abs(a - b) for a, b in zip(probe.logprobs, batch[0].rollout_logprobs)) > 1e-3


def test_push_refuses_a_version_that_is_not_higher(model_dir):
    cfg = compose(["model.device=cpu"])
    trainer = TorchTrainer(cfg, str(model_dir))
    engine = TorchEngine(load_model(str(model_dir), device="cpu"), cfg.engine)
    sync = InProcessWeightSync(engine)

    async def scenario():
        await engine.start()
        try:
            await sync.push(trainer, 5)
            for bad in (5, 4, 0):
                with pytest.raises(WeightSyncError, match=f"weight version {bad} is not above the served version 5"):
                    await sync.push(trainer, bad)
            return engine.weight_version
        finally:
            await engine.shutdown()

    assert asyncio.run(scenario()) == 5


def test_export_is_a_copy_in_the_serving_dtype(model_dir):
    trainer = TorchTrainer(compose(["model.device=cpu", "model.dtype=bfloat16"]), str(model_dir))
    exported = trainer.export_weights()
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    assert next(trainer.model.parameters()).dtype == torch.float32
    name = "model.layers.0.self_attn.q_proj.weight"
    exported[name].zero_()
    assert float(dict(trainer.model.named_parameters())[name].detach().abs().sum()) > 0
