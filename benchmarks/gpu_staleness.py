"""Staleness while serving and training on one GPU (issue 17, goal 4): the share of judged samples
dropped for being more than ``train.max_weight_lag`` versions behind, at its default.

Two runs of ``bench_serve_training.py`` (``bash openclaw-combine/run.sh``, simulated users through the
live gateway, training paused and then on) on the same random-weight model: deadline-sized steps
(``clawrl.step_size``, the default) and, as the baseline in the same run, fixed steps of
``train.batch_size`` (``train.max_batch_size`` equal to it). The engine and the trainer share the GPU.

The model is the shape's (random weights, tied) with the embedded tokenizer's vocabulary of 8192, so
that replies detokenise into text the simulated users can read; it is written to a temporary
directory and served through ``model.path``, as a user's would be.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from clawrl.embedded.build import build_tokenizer
from clawrl.embedded.tokenizer import save_tokenizer

BENCH = Path(__file__).with_name("bench_serve_training.py")
VOCAB = 8192


def write_model(shape: dict, out: Path) -> None:
    save_tokenizer(build_tokenizer(0), out, 32768)
    cfg = Qwen3Config(**{**shape, "vocab_size": VOCAB}, max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)


def serve_and_train(model_dir: Path, device: str, sessions: int, seconds: float, batch_size: int,
                    extra: list[str]) -> dict:
    """One bench_serve_training run; its JSON (the training phase is what counts here)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(BENCH), "--sessions", str(sessions), "--seconds", str(seconds),
               "--warmup-seconds", "10", "--batch-size", str(batch_size), "--json", out.name,
               f"model.path={model_dir}", f"model.device={device}",
               f"model.dtype={'bfloat16' if device == 'cuda' else 'float32'}", *extra]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
        return json.loads(Path(out.name).read_text())


def run_staleness(shape: dict, device: str, sessions: int = 8, seconds: float = 30,
                  batch_size: int = 4) -> dict:
    work = Path(tempfile.mkdtemp(prefix="gpu-staleness-"))
    write_model(shape, work / "model")
    sides = {}
    for name, extra in (("fixed_steps", [f"train.max_batch_size={batch_size}"]), ("deadline_steps", [])):
        r = serve_and_train(work / "model", device, sessions, seconds, batch_size, extra)
        t = r["phases"]["training"]
        sides[name] = {k: t[k] for k in ("stale_fraction", "samples_trained", "samples_skipped", "train_steps",
                                          "samples_trained_per_min", "requests", "failures", "latency_p99_s")}
        sides[name]["failures"] += r["phases"]["paused"]["failures"]
    new, base = sides["deadline_steps"], sides["fixed_steps"]
    print(f"dropped as stale at the default max_weight_lag: {new['stale_fraction']} with deadline-sized steps, "
          f"{base['stale_fraction']} with fixed steps of {batch_size} (same run)", flush=True)
    return {"stale_fraction": new["stale_fraction"], "baseline_stale_fraction": base["stale_fraction"],
            "baseline": f"fixed steps of train.batch_size={batch_size} (train.max_batch_size={batch_size})",
            "sessions": sessions, "phase_seconds": seconds, "vocab_size": VOCAB,
            "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", **sides}
