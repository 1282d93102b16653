"""The parity check behind ``clawrl check-parallel`` and the backend's tests.

It trains one step on the same batch twice -- the torch backend in this process, the megatron
backend in ``world = tp * pp * dp`` local ranks (gloo on CPU, NCCL with one GPU per rank) -- and
reports the largest differences in per-token logprobs (before the step), the loss, the gradients
(HF-named, before the optimizer) and the weights after the step. Users run it to validate a
model and a layout before a long run; the tests run it on the tiny model at TP=2 and PP=2.

Both sides use float32 and the same optimizer settings, with weight decay off and gradient
clipping off (megatron exempts norms from decay, the torch trainer does not, so decayed runs
differ by design).
"""
from __future__ import annotations

import dataclasses
import os
import random
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from clawrl.cluster.groups import init_world
from clawrl.config import ClawrlConfig
from clawrl.methods.registry import load_method
from clawrl.samples import Sample, TeacherSignal

# The bounds: logprobs within 1e-5 absolute, gradients within 1e-4 relative (to the largest).
LOGPROB_ATOL = 1e-5
GRAD_RTOL = 1e-4
# Adam's first step moves a weight by lr * g / (|g| + eps): where |g| is near eps (1e-8), float32
# rounding of g changes the move a lot, on both backends alike. The weights are compared where
# |g| >= ADAM_SENSITIVE_BELOW, to within WEIGHT_RTOL of the largest move; the report also shows
# the difference over all weights.
ADAM_SENSITIVE_BELOW = 1e-5
WEIGHT_RTOL = 1e-3


@dataclass
class ParityReport:
    layout: str
    logprob_max_abs: float
    loss_abs: float
    grad_max_rel: float
    weight_max_abs: float
    worst_grad: str
    worst_weight: str
    update_max_abs: float
    weight_max_abs_all: float
    topk_kl: tuple[float, float] | None = None  # (torch, megatron) when the top-k term is active
    compiled: tuple[int, int] = (0, 0)  # (torch, megatron) modules compiled by train.compile

    @property
    def ok(self) -> bool:
        return (self.logprob_max_abs <= LOGPROB_ATOL and self.grad_max_rel <= GRAD_RTOL
                and self.loss_abs <= LOGPROB_ATOL and self.weight_max_abs <= WEIGHT_RTOL * max(self.update_max_abs, 1e-12))

    def lines(self) -> list[str]:
        return [f"layout: {self.layout}",
                f"logprobs   max |diff| {self.logprob_max_abs:.3e}  (bound {LOGPROB_ATOL:g})",
                f"loss           |diff| {self.loss_abs:.3e}",
                (f"gradients  {self.worst_grad} (the weights after the step are compared)"
                 if self.worst_grad.startswith("not compared") else
                 f"gradients  max rel    {self.grad_max_rel:.3e}  (bound {GRAD_RTOL:g}; worst {self.worst_grad})"),
                f"weights    max |diff| {self.weight_max_abs:.3e}  after a step that moved them up to "
                f"{self.update_max_abs:.3e} (bound {WEIGHT_RTOL:g} of that; worst {self.worst_weight}; "
                f"{self.weight_max_abs_all:.1e} counting weights whose gradient is below {ADAM_SENSITIVE_BELOW:g})",
                *([f"top-k KL     torch {self.topk_kl[0]:.6f}  megatron {self.topk_kl[1]:.6f}"] if self.topk_kl else []),
                *([f"compiled   torch {self.compiled[0]} modules, megatron {self.compiled[1]}"]
                  if any(self.compiled) else []),
                "parity: OK" if self.ok else "parity: FAILED"]


def synthetic_batch(vocab: int, n: int = 6, seed: int = 0, max_len: int = 24, pad_id: int | None = None,
                    topk: int = 0) -> list[Sample]:
    """A deterministic batch with varied lengths, temperatures and signed advantages; every other
    sample also carries a teacher signal (OPD logprobs, and ``topk`` top-k ids and logprobs when
    ``topk > 0``), so the OPD, top-k and Combine terms are exercised. The pad token is left out:
    HF embeddings never train their ``padding_idx`` row, megatron's do, so a prompt holding it
    would differ there by design."""
    rng = random.Random(seed)

    def token() -> int:
        while True:
            t = rng.randrange(vocab)
            if t != pad_id:
                return t

    out = []
    for i in range(n):
        p, r = rng.randint(3, max_len), rng.randint(2, max_len // 2)
        out.append(Sample(
            sample_id=i + 1, turn_id=i + 1, group_id=f"parity-{i}",
            prompt_ids=[token() for _ in range(p)], response_ids=[token() for _ in range(r)],
            rollout_logprobs=[-rng.uniform(0.5, 6.0) for _ in range(r)], weight_versions=[0] * r,
            reward=1.0 if i % 2 else -1.0, advantage=1.0 if i % 2 else -1.0,
            extra={"temperature": [1.0, 0.7, 1.3][i % 3]}))
        if i % 2 == 0:
            ids = [rng.sample(range(vocab), topk) for _ in range(r)]
            out[-1].teacher = TeacherSignal(
                teacher_logprobs=[-rng.uniform(0.1, 4.0) for _ in range(r)],
                topk_ids=ids if topk else None,
                topk_logprobs=[sorted((-rng.uniform(0.5, 5.0) for _ in range(topk)), reverse=True)
                               for _ in range(r)] if topk else None)
    return out


def parity_config(cfg: ClawrlConfig) -> ClawrlConfig:
    train = dataclasses.replace(cfg.train, weight_decay=0.0, grad_clip=0.0, lr=max(cfg.train.lr, 1e-3),
                                lora=dataclasses.replace(cfg.train.lora, enabled=False), kl_coef=0.0)
    return dataclasses.replace(cfg, train=train)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, cfg: ClawrlConfig, model_path: str, samples: list[Sample],
               out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    init_world(rank)
    try:
        from clawrl.trainers.megatron.ranks import MegatronRanks

        ranks = MegatronRanks(cfg, model_path, dtype=torch.float32)
        lps = ranks.logprobs(samples)
        # with data parallelism the distributed optimizer reduce-scatters gradients: each rank holds
        # a shard, so only dp=1 layouts compare gradients (the weights after the step still do)
        ranks.keep_grads_once = ranks.dp == 1
        result = ranks.train_step(samples, 0)
        weights = ranks.hf_state()
        if rank == 0:
            torch.save({"logprobs": lps, "result": result, "grads": ranks.kept_grads, "weights": weights,
                        "compiled": ranks.compiled}, Path(out_dir) / "megatron.pt")
    finally:
        dist.destroy_process_group()


def run_megatron(cfg: ClawrlConfig, model_path: str, samples: list[Sample], world: int) -> dict:
    """One logprob pass and one train step on ``world`` local ranks; rank 0's results."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_main, args=(world, free_port(), cfg, model_path, samples, out), nprocs=world,
                           join=True, start_method="spawn")
        return torch.load(Path(out) / "megatron.pt", weights_only=False)


def run_torch(cfg: ClawrlConfig, model_path: str, samples: list[Sample]) -> dict:
    """The same with the torch backend, capturing the gradients just before the optimizer step."""
    from clawrl.trainers.torch_trainer import TorchTrainer

    trainer = TorchTrainer(cfg, model_path, device="cpu", dtype=torch.float32)
    lps = trainer.logprobs(samples)
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    result = trainer.train_step(samples, 0)
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    before = {k: v for k, v in TorchTrainer(cfg, model_path, device="cpu", dtype=torch.float32).model.state_dict().items()}
    return {"logprobs": lps, "result": result, "grads": grads, "weights": weights, "before": before,
            "compiled": trainer.compiled}


def compare(ref: dict, meg: dict, layout: str) -> ParityReport:
    lp = max((abs(a - b) for ra, rb in zip(ref["logprobs"], meg["logprobs"]) for a, b in zip(ra, rb)), default=0.0)
    loss = abs(ref["result"].metrics["loss"] - meg["result"]["metrics"]["loss"])
    grad_rel, worst_grad = 0.0, "" if meg["grads"] is not None else "not compared: dp > 1 shards gradients"
    for name, g in (ref["grads"] if meg["grads"] is not None else {}).items():
        other = meg["grads"].get(name)
        if other is None:  # a tied lm_head is the embedding's gradient
            continue
        rel = float((g - other.to(g.dtype)).abs().max() / g.abs().max().clamp_min(1e-12))
        if rel > grad_rel:
            grad_rel, worst_grad = rel, name
    w_abs, worst_w, moved, w_all = 0.0, "", 0.0, 0.0
    for name, w in meg["weights"].items():
        diff = (ref["weights"][name] - w.to(torch.float32)).abs()
        moved = max(moved, float((ref["weights"][name] - ref["before"][name]).abs().max()))
        w_all = max(w_all, float(diff.max()))
        grad = ref["grads"].get(name)
        if grad is not None:
            diff = diff * (grad.abs() >= ADAM_SENSITIVE_BELOW)
        if float(diff.max()) > w_abs:
            w_abs, worst_w = float(diff.max()), name
    topk = None
    if "topk_kl" in ref["result"].metrics:
        topk = (ref["result"].metrics["topk_kl"], meg["result"]["metrics"]["topk_kl"])
    return ParityReport(layout, lp, loss, grad_rel, w_abs, worst_grad, worst_w, moved, w_all, topk,
                        (ref["compiled"], meg["compiled"]))


def check_parallel(cfg: ClawrlConfig, model_path: str, world: int | None = None) -> ParityReport:
    """Run the check for ``cfg.cluster.tp`` x ``cfg.cluster.pp`` (x data parallel to fill ``world``)."""
    cfg = parity_config(cfg)
    world = world or cfg.cluster.tp * cfg.cluster.pp
    from clawrl.trainers.megatron.convert import read_arch

    import json

    pad_id = json.loads((Path(model_path) / "config.json").read_text()).get("pad_token_id")
    topk = load_method(cfg).topk
    samples = synthetic_batch(read_arch(model_path).vocab, seed=cfg.seed, pad_id=pad_id, topk=topk)
    ref = run_torch(cfg, model_path, samples)
    meg = run_megatron(cfg, model_path, samples, world)
    dp = world // (cfg.cluster.tp * cfg.cluster.pp)
    layout = f"tp={cfg.cluster.tp} pp={cfg.cluster.pp} dp={dp} ({world} ranks) on {model_path}"
    return compare(ref, meg, layout)
