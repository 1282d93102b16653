"""The trainer on CUDA (skipped without a GPU): bf16 parameters over float32 masters (the default)
or float32 parameters under bf16 autocast, logprobs close to a bf16 engine's, and a weight push that
the engine then serves."""
from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest
import torch

from clawrl.config import ClawrlConfig
from clawrl.engines.base import SamplingParams
from clawrl.engines.loading import load_model
from clawrl.engines.torch_engine import TorchEngine
from clawrl.samples import Sample
from clawrl.trainers.torch_trainer import TorchTrainer
from clawrl.weight_sync import InProcessWeightSync
from engine_testing import make_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("trainer_cuda") / "m", "qwen3")


def cuda_cfg(lora: bool = False, param_dtype: str = "auto") -> ClawrlConfig:
    cfg = ClawrlConfig()
    train = replace(cfg.train, lr=1e-2, lora=replace(cfg.train.lora, enabled=lora), param_dtype=param_dtype)
    return replace(cfg, model=replace(cfg.model, device="cuda"), train=train)


@pytest.mark.parametrize("lora,param_dtype", [(False, "auto"), (True, "auto"), (False, "float32")])
def test_cuda_step_in_bf16_and_push_to_a_bf16_engine(model_dir, lora, param_dtype):
    cfg = cuda_cfg(lora, param_dtype)
    trainer = TorchTrainer(cfg, str(model_dir))
    if param_dtype == "float32":
        assert trainer.autocast and next(trainer.model.parameters()).dtype == torch.float32
    else:  # auto: bf16 parameters, float32 masters, no autocast, packed attention
        assert not trainer.autocast and next(trainer.model.parameters()).dtype == torch.bfloat16
        assert trainer.masters is not None and trainer.packed
    engine = TorchEngine(load_model(str(model_dir), device="cuda"), cfg.engine)
    sync = InProcessWeightSync(engine)

    async def scenario():
        await engine.start()
        try:
            g = random.Random(0)
            prompts = [[g.randrange(3, trainer.vocab_size) for _ in range(g.randrange(5, 30))] for _ in range(6)]
            results = await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=16, seed=i,
                                                                                ignore_eos=True))
                                             for i, p in enumerate(prompts)))
            samples = [Sample(i, i, str(i), r.prompt_ids, r.token_ids, r.logprobs, r.weight_versions, 1.0,
                              1.0 if i % 2 else -1.0) for i, r in enumerate(results)]
            result = await asyncio.to_thread(trainer.train_step, samples, 0)
            ms = await sync.push(trainer, 1)
            probe = await engine.score(samples[0].prompt_ids, samples[0].response_ids)
            return samples, result, ms, probe
        finally:
            await engine.shutdown()

    samples, result, ms, probe = asyncio.run(scenario())
    print(f"lora={lora} gap mean {result.metrics['rollout_logprob_gap_mean']:.4f} "
          f"max {result.metrics['rollout_logprob_gap_max']:.4f}, sync {ms:.1f} ms")
    assert result.ok
    assert result.metrics["rollout_logprob_gap_mean"] < 0.05  # bf16 engine vs bf16-autocast trainer
    assert probe.weight_version == 1
    served = trainer.logprobs(samples[:1])[0]
    # the eager bf16 engine against the trainer's compiled layers, each one graph with attention inside
    # since a633723, which rounds differently: 0.102 in the LoRA case on an H100 (BENCHMARKS.md)
    assert max(abs(a - b) for a, b in zip(probe.logprobs, served)) < 0.15
    moved = max(abs(a - b) for a, b in zip(probe.logprobs, samples[0].rollout_logprobs))
    assert moved > 0.01
