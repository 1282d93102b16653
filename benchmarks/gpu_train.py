"""Training throughput: clawrl's torch trainer against the plain HF loop of ``tools/gpu_baselines.py``,
in the same run (``python benchmarks/gpu_suite.py --part train``).

The baseline runs exactly as the reference probe runs it: the Qwen3 shape built on the device with
``torch.manual_seed(0)`` and cast to bf16, gradient checkpointing on, ``AdamW(lr=1e-6, fused=True)``,
a step is ``model(input_ids=x, labels=x)`` on 8 x 2048 random tokens, then backward, step and
``zero_grad``; 2 warm-up steps, then 5 timed with a CUDA sync. clawrl trains the same weights (saved
and loaded the way ``model.path`` loads any HF directory) with its own trainer and default settings
on 8 samples of 16 prompt + 2032 response tokens, the same 16384 tokens a step, each sample an RL
sample with its advantage, so that the whole objective (pi_old, PPO clip, TIS, entropy and gap
metrics) runs; variants show what each setting costs. On a card under 100 GiB (an H100) both sides
take 4 sequences instead of 8 (``sequences`` in the output says which). MFU counts what the baseline's probe counts:
6 x parameters per token plus causal attention, against the matmul ceiling measured in the run.

The megatron backend (``trainer.backend=megatron``, one rank, tp=pp=1) trains the same directory on
the same samples in a spawned process, as ``clawrl serve`` runs its ranks; its figure is reported
against the torch trainer's default (``train.megatron.ratio_to_torch``). Without megatron-core the
part records why instead of a figure.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpu_models import sync

# Per shape: sequences per step, tokens per sequence, timed steps (the probe's 8 x 2048, 5).
TRAIN_SIZES = {"qwen3-1.7b": (8, 2048, 5), "qwen3-0.6b": (8, 2048, 5), "tiny": (4, 64, 2)}
PROMPT = 16  # prompt tokens of each clawrl sample; the rest of the sequence is the trained response


def matmul_tflops(device: str) -> float:
    """The bf16 (CPU: fp32) matmul ceiling, as the probe measures it."""
    n = 8192 if device == "cuda" else 512
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    return 2 * n ** 3 / ((time.perf_counter() - t) / 10) / 1e12


def model_flops(cfg, n_params: int, batch: int, seq: int) -> float:
    """FLOPs of one step as the probe counts them: 6N per token plus causal attention."""
    return 6 * n_params * batch * seq + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq * batch * seq / 2


def timed_steps(step, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    return times


def hf_loop(model, vocab: int, batch: int, seq: int, steps: int, device: str) -> list[float]:
    model.train()
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda" or None)
    x = torch.randint(0, vocab, (batch, seq), device=device)

    def step():
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    times = timed_steps(step, 2, steps)
    del opt
    model.gradient_checkpointing_disable()
    for p in model.parameters():
        p.grad = None
    return times


def samples(vocab: int, batch: int, seq: int, prompt: int = PROMPT):
    """``batch`` RL samples of ``seq`` random tokens, the first ``prompt`` of them the prompt; advantages
    alternate between +1 and -1, and every rollout logprob is -12 (so TIS and the gap metrics run)."""
    from clawrl.samples import Sample

    rng = random.Random(1)
    out = []
    for i in range(batch):
        response = seq - prompt
        out.append(Sample(sample_id=i, turn_id=i, group_id="g", prompt_ids=[rng.randrange(1, vocab) for _ in range(prompt)],
                          response_ids=[rng.randrange(1, vocab) for _ in range(response)],
                          rollout_logprobs=[-12.0] * response, weight_versions=[0] * response,
                          reward=1.0 if i % 2 else -1.0, advantage=1.0 if i % 2 else -1.0))
    return out


def clawrl_steps(model_dir: str, device: str, batch: list, steps: int, overrides: list[str]) -> tuple[list[float], dict]:
    from clawrl.config import compose
    from clawrl.trainers.torch_trainer import TorchTrainer

    # model.path names the directory, so the embedded model's defaults (its KL reference) do not apply
    cfg = compose([f"model.path={model_dir}", f"model.device={device}", "train.lr=1e-6", *overrides])
    trainer = TorchTrainer(cfg, model_dir)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    last = {}

    def step():
        result = trainer.train_step(batch, trainer.step)
        assert result.ok, result
        last.update(result.metrics)
    times = timed_steps(step, 1, steps)
    cuda = device == "cuda"
    info = {"peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0,
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0,
            "param_dtype": str(trainer.param_dtype).removeprefix("torch."), "packed_attention": trainer.packed,
            "pi_old_from_loss_forward": trainer.pi_old_from_loss_forward, "micro_batches": last["micro_batches"],
            "compiled_modules": trainer.compiled, "linear_kernels": trainer.linear_kernels}
    del trainer
    if device == "cuda":
        torch.cuda.empty_cache()
    return times, info


def _megatron_rank(rank: int, cfg, model_dir: str, batch: list, steps: int, out: str, port: int) -> None:
    """One megatron rank (world size 1) timing ``steps`` train steps after a warm-up, as ``timed_steps``."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from clawrl.trainers.megatron.ranks import MegatronRanks

    ranks = MegatronRanks(cfg, model_dir)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    last = {}

    def step():
        result = ranks.train_step(batch, ranks.step)
        assert result["ok"], result
        last.update(result["metrics"])
    times = timed_steps(step, 1, steps)
    Path(out).write_text(json.dumps({
        "runs_s": times, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0,
        "micro_batches": last["micro_batches"], "pi_old_from_loss_forward": ranks.pi_old_from_loss_forward,
        "layer_spec": "transformer-engine" if ranks.te else "local", "compiled_modules": ranks.compiled}))
    dist.destroy_process_group()


def megatron_steps(model_dir: str, device: str, batch: list, steps: int, overrides: tuple[str, ...] = ()) -> dict:
    """The megatron backend's step times and facts, from a spawned rank; ``{"skipped": why}`` when
    megatron-core is not installed, the rank ran out of device memory (its 1.7B step holds 20 GiB
    more than the torch trainer's: an 80 GB card did not fit 4 x 2048 tokens beside the suite) or
    it failed otherwise (the error's last line)."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        return {"skipped": f"megatron-core is not installed ({e})"}
    import torch.multiprocessing as mp
    from clawrl.config import compose
    from clawrl.trainers.megatron.parity import free_port

    cfg = compose([f"model.path={model_dir}", f"model.device={device}", "train.lr=1e-6", "trainer.backend=megatron",
                   *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "megatron.json"
        try:
            mp.start_processes(_megatron_rank, args=(cfg, model_dir, batch, steps, str(out), free_port()), nprocs=1,
                               join=True, start_method="spawn")
        except mp.ProcessRaisedException as e:  # recorded, so that the other figures of the part still land
            if "OutOfMemoryError" in str(e):
                return {"skipped": "out of device memory"}
            last = [line for line in str(e).splitlines() if line.strip()][-1]
            return {"skipped": f"the rank failed: {last[:300]}", "overrides": list(overrides)}
        return json.loads(out.read_text())


def variants(tokens: int) -> list[tuple[str, list[str]]]:
    """(name, overrides): the default first; the others show what each setting costs."""
    return [("default", []), ("gradient_checkpointing", ["train.gradient_checkpointing=true"]),
            ("two_micro_batches", [f"train.micro_batch_tokens={tokens // 2}"]),
            ("float32_params_autocast", ["train.param_dtype=float32"]),
            ("eager", ["train.compile=off"]), ("compiled_parts", ["train.compile=on", "train.compile_scope=parts"]),
            ("compiled_layer", ["train.compile=on", "train.compile_scope=layer"])]


def sequences_that_fit(batch: int, device: str) -> int:
    """Sequences a step at 2048 tokens for this card: half of ``batch`` under 100 GiB (an H100). At the
    1.7B shape the eager 8 x 2048 step peaks at 89 GiB, megatron's at 110, and a hybrid's did not fit
    4 x 2048 in 80 GB without recomputation; the hybrid part halves its batch here too."""
    if device == "cuda" and torch.cuda.get_device_properties(0).total_memory < 100 * 2 ** 30:
        return batch // 2
    return batch


def run_train(build_model, shape: str, device: str, save_tokenizer, only: list[str] | None = None) -> dict:
    """The train part's figures (``build_model(shape, device)`` makes the probe's model;
    ``save_tokenizer(dir)`` writes a tokenizer beside the saved weights). ``only`` names the torch
    variants to measure (all when None; "default" is always measured, since the ratios need it)."""
    batch, seq, steps = TRAIN_SIZES[shape]
    batch = sequences_that_fit(batch, device)
    ceiling = matmul_tflops(device)
    model = build_model(shape, device)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    flops = model_flops(cfg, n_params, batch, seq)
    tokens = batch * seq
    hf = statistics.median(hf_loop(model, cfg.vocab_size, batch, seq, steps, device))
    out = {"hf": {"tok_s": tokens / hf, "step_s": hf, "mfu": flops / hf / 1e12 / ceiling,
                  "how": "probe's loop: bf16 params, gradient checkpointing, fused AdamW, labels=x"},
           "matmul_tflops": ceiling, "tokens_per_step": tokens, "sequences": batch, "seq_len": seq,
           "params": n_params, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model.save_pretrained(model_dir)
        save_tokenizer(model_dir)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        data = samples(cfg.vocab_size, batch, seq)
        for name, overrides in variants(tokens):
            if only is not None and name != "default" and name not in only:
                continue
            try:
                times, info = clawrl_steps(str(model_dir), device, data, steps, overrides)
            except torch.OutOfMemoryError as e:  # recorded, so the other variants' figures still land
                if name == "default":  # every ratio needs it
                    raise
                out[f"torch_{name}"] = {"error": f"OutOfMemoryError: {str(e).splitlines()[0]}", "overrides": overrides}
                print(f"train {name:>24}: out of memory", flush=True)
                torch.cuda.empty_cache()
                continue
            s = statistics.median(times)
            out["torch" if name == "default" else f"torch_{name}"] = {
                "tok_s": tokens / s, "step_s": s, "mfu": flops / s / 1e12 / ceiling, "ratio_to_hf": hf / s,
                "overrides": overrides, "runs_s": times, **info}
            print(f"train {name:>24}: {tokens / s:9.0f} tok/s, MFU {flops / s / 1e12 / ceiling:.1%}, "
                  f"{hf / s:.2f}x HF ({info})", flush=True)
        # megatron's default (compiled on a GPU, each layer whole; eager on CPU), and (variants like the
        # torch ones) its norms and MLP compiled only, and eager
        for name, overrides in (("megatron", ()), ("megatron_parts", ("train.compile=on", "train.compile_scope=parts")),
                                ("megatron_eager", ("train.compile=off",))):
            if only is not None and name != "megatron" and name not in only:
                continue
            meg = megatron_steps(str(model_dir), device, data, steps, overrides)
            if "runs_s" in meg:
                s, torch_s = statistics.median(meg["runs_s"]), out["torch"]["step_s"]
                meg.update(tok_s=tokens / s, step_s=s, mfu=flops / s / 1e12 / ceiling, ratio_to_torch=torch_s / s,
                           ratio_to_hf=hf / s, overrides=list(overrides))
                print(f"train {name.replace('_', ' ') + ' backend':>24}: {tokens / s:9.0f} tok/s, MFU "
                      f"{meg['mfu']:.1%}, {torch_s / s:.2f}x the torch trainer", flush=True)
            else:
                print(f"train {name:>24}: {meg['skipped']}", flush=True)
            out[name] = meg
    print(f"train {'HF loop':>24}: {tokens / hf:9.0f} tok/s, MFU {out['hf']['mfu']:.1%}", flush=True)
    return out
