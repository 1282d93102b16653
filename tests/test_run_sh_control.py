"""Checkpoint retention, pausing and rollback, end to end through ``openclaw-rl/run.sh`` as an
operator uses them (issue 20, item 6): ``train.keep_last`` keeps only the newest checkpoints while
the run trains; ``POST /admin/pause`` stops training while chats are still answered and stored,
and ``/admin/resume`` trains what waited; after a clean stop, ``clawrl rollback`` makes the next
``run.sh`` serve an earlier checkpoint's exact weights under a new, higher weight version."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from gateway_support import build_tiny_model, free_port, model_cache_dir
from recipe_support import ask_then_reply, wait_until

RUN_SH = Path(__file__).resolve().parent.parent / "openclaw-rl" / "run.sh"
CLAWRL = [sys.executable, "-c", "import sys; from clawrl.cli import main; sys.exit(main())"]


class Run:
    """One ``run.sh`` process on a run directory, its output in a log file."""

    def __init__(self, tmp_path: Path, run_dir: Path, model: Path, name: str):
        self.port, self.log = free_port(), tmp_path / f"{name}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                ["bash", str(RUN_SH), f"server.port={self.port}", f"run_dir={run_dir}", f"model.path={model}",
                 "model.name=tiny", "engine.threads=1", "logging.wandb.mode=disabled", "train.batch_size=1",
                 "train.save_every=1", "train.keep_last=2", "train.lr=1e-3"],
                stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self.wait(lambda: httpx.get(self.url + "/healthz", timeout=1).status_code == 200)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def wait(self, check, timeout=120):
        return wait_until(check, [self.proc], [self.log], timeout)

    def status(self) -> dict:
        return httpx.get(self.url + "/admin/status", timeout=10).json()

    def at_step(self, step: int) -> dict:
        return self.wait(lambda: (lambda s: s if s["training"]["train_step"] == step else None)(self.status()))

    def chat_and_judge(self, n: int) -> None:
        for i in range(n):
            ask_then_reply(self.client, "tiny", f"Tell me about the number {i}.", "Thanks!")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(60) == 0, self.log.read_text()[-3000:]


def steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def manifest(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step}" / "manifest.json").read_text())


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "weights.safetensors"))


@pytest.mark.slow
def test_retention_pause_resume_and_rollback_through_run_sh(tmp_path):
    model = build_tiny_model(model_cache_dir())
    run_dir = tmp_path / "run"
    run = Run(tmp_path, run_dir, model, "first")
    try:
        run.chat_and_judge(3)
        run.at_step(3)
        assert steps(run_dir) == [2, 3]  # keep_last=2: step_1 went when step_3 was saved

        assert httpx.post(run.url + "/admin/pause", timeout=10).status_code == 200
        run.chat_and_judge(2)  # chats are answered while training is paused
        run.wait(lambda: run.status()["training"]["samples"]["ready"] == 2)
        time.sleep(2.0)  # room for a step that should not happen
        status = run.status()["training"]
        assert status["paused"] and status["train_step"] == 3 and steps(run_dir) == [2, 3]

        assert httpx.post(run.url + "/admin/resume", timeout=10).status_code == 200
        run.at_step(5)
        run.wait(lambda: steps(run_dir) == [4, 5])
        run.stop()
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait(30)
    log = run.log.read_text()
    assert "training paused" in log and "training resumed" in log

    target, newest = manifest(run_dir, 4)["weight_version"], manifest(run_dir, 5)["weight_version"]
    assert newest > target
    out = subprocess.run([*CLAWRL, "rollback", "--run-dir", str(run_dir), "--to", str(target)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"serves it as weight version {newest + 1}" in out.stdout
    old = weights(run_dir, 4)

    again = Run(tmp_path, run_dir, model, "second")
    try:
        status = again.status()
        assert status["weight_version"] == newest + 1 and status["training"]["train_step"] == 6
        restored = weights(run_dir, 6)  # the rollback's own checkpoint
        assert restored.keys() == old.keys() and all(torch.equal(restored[k], old[k]) for k in old)
        assert manifest(run_dir, 6)["weight_version"] == newest + 1
        # the rolled-back line trains on: a new sample is step 7, saved, and keep_last holds on the
        # live line (step_4 goes); step_5, the abandoned line's, stays as the way back
        again.chat_and_judge(1)
        again.at_step(7)
        again.wait(lambda: steps(run_dir) == [5, 6, 7])
        again.stop()
    finally:
        if again.proc.poll() is None:
            again.proc.kill()
            again.proc.wait(30)
