"""Fixed inputs and a recorder for the method-seam parity test (tests/test_method_parity.py).

The numbers in ``tests/fixtures/method_parity.json`` were recorded *before* the methods became
plug-ins: three train steps of rl, opd and combine on the torch backend and on megatron (tp=2,
two gloo ranks on CPU), each step's loss, gradient norm and step metrics, and on torch the per-token
advantages the objective trained on. The refactor must reproduce them within 1e-6.

The inputs are plain numbers (``step_inputs``): token ids, rollout logprobs, rewards, the teacher's
logprobs and top-k, and which signals a sample has. ``to_samples`` turns them into the trainer's
samples the way the code of the day expects; it is the one place that changes with the seam.

Record again (only when the expected numbers are meant to change; ``run`` uses one thread):
    python3 tests/method_parity.py --record
"""
from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "method_parity.json"
METHODS = ("rl", "opd", "combine")
STEPS = 3
TOPK = 2
OVERRIDES = ["train.lr=1e-3", "train.micro_batch_tokens=48", "train.weight_decay=0.0", f"opd.topk={TOPK}",
             "opd.topk_coef=0.5", "combine.w_rl=1.0", "combine.w_opd=0.5", "logging.wandb.mode=disabled",
             "seed=0"]
BACKENDS = {"torch": [], "megatron": ["trainer.backend=megatron", "cluster.tp=2", "cluster.procs_per_node=2"]}


def step_inputs(vocab: int, step: int, n: int = 6) -> list[dict]:
    """Six samples of varied lengths and temperatures; which signals each has depends on the method
    (``signals``): rl -> reward only, opd -> teacher only, combine -> both, reward only, teacher only."""
    rng = random.Random(1000 + step)
    out = []
    for i in range(n):
        p, r = rng.randint(3, 20), rng.randint(2, 10)
        out.append({
            "prompt_ids": [rng.randrange(1, vocab) for _ in range(p)],
            "response_ids": [rng.randrange(1, vocab) for _ in range(r)],
            "rollout_logprobs": [-rng.uniform(0.5, 6.0) for _ in range(r)],
            "reward": 1.0 if (i + step) % 2 else -1.0,
            "temperature": [1.0, 0.7, 1.3][i % 3],
            "teacher_logprobs": [-rng.uniform(0.1, 4.0) for _ in range(r)],
            "topk_ids": [rng.sample(range(1, vocab), TOPK) for _ in range(r)],
            "topk_logprobs": [sorted((-rng.uniform(0.5, 5.0) for _ in range(TOPK)), reverse=True) for _ in range(r)],
        })
    return out


def signals(method: str, i: int) -> tuple[bool, bool]:
    """(has a judged reward, has a teacher score) of sample ``i`` under ``method``."""
    if method == "rl":
        return True, False
    if method == "opd":
        return False, True
    return [(True, True), (True, False), (False, True)][i % 3]


def to_samples(raw: list[dict], method: str, version: int):
    """The trainer's samples for one step (the method seam's format: ``Sample.rl_signal`` and a typed
    ``Sample.teacher``)."""
    from clawrl.samples import Sample, TeacherSignal

    out = []
    for i, x in enumerate(raw):
        rl, opd = signals(method, i)
        r = len(x["response_ids"])
        teacher = TeacherSignal(**{k: x[k] for k in ("teacher_logprobs", "topk_ids", "topk_logprobs")}) if opd else None
        out.append(Sample(sample_id=i + 1, turn_id=i + 1, group_id=f"g{i}", prompt_ids=x["prompt_ids"],
                          response_ids=x["response_ids"], rollout_logprobs=x["rollout_logprobs"],
                          weight_versions=[version] * r, reward=x["reward"] if rl else 0.0,
                          advantage=x["reward"] if rl else 0.0, rl_signal=rl, teacher=teacher,
                          extra={"temperature": x["temperature"], "opd_state": "scored" if opd else None}))
    return out


def _numbers(metrics: dict) -> dict:
    """The step's numeric metrics, less wall-clock time (not a number a refactor must reproduce)."""
    return {k: float(v) for k, v in sorted(metrics.items()) if k != "step_seconds"
            and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


def run(model_dir: Path, method: str, backend: str) -> list[dict]:
    """Three train steps; per step the metrics, and (torch) the per-token advantages trained on.

    One CPU thread, in this process and in megatron's ranks (they inherit OMP_NUM_THREADS), as when
    the numbers were recorded: a float32 reduction split over two threads rounds differently (1e-6)."""
    import os

    import torch

    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return _run(model_dir, method, backend)
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = omp


def _run(model_dir: Path, method: str, backend: str) -> list[dict]:
    from clawrl.config import compose
    from clawrl.trainers.backends import make_trainer

    cfg = compose([f"method={method}", f"model.path={model_dir}", *OVERRIDES, *BACKENDS[backend]])
    trainer = make_trainer(cfg, str(model_dir))
    captured: list = []
    plugin = getattr(trainer, "method", None)
    if plugin is not None:  # torch: the method runs in this process
        apply = plugin.advantages

        def capture(batches):
            out = apply(batches)
            captured.append([[round(float(a), 9) for a in (mb.advantages * mb.loss_mask).tolist()] for mb in batches])
            return out

        plugin.advantages = capture
    vocab = _vocab(model_dir)
    steps = []
    try:
        for step in range(STEPS):
            result = trainer.train_step(to_samples(step_inputs(vocab, step), method, step), step)
            assert result.ok, result.skipped_reason
            entry = {"metrics": _numbers(result.metrics)}
            if captured:
                entry["advantages"] = captured.pop()
            steps.append(entry)
    finally:
        trainer.close()
    return steps


def _vocab(model_dir: Path) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def model_dir(tmp: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from engine_testing import make_model_dir

    return make_model_dir(tmp / "qwen3", arch="qwen3")


def record() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        md = model_dir(Path(tmp))
        data = {f"{backend}/{method}": run(md, method, backend) for backend in BACKENDS for method in METHODS}
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"recorded {FIXTURE}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python3 tests/method_parity.py --record")
    record()
