"""``openclaw-rl/run.sh``: the Binary RL recipe as a user launches it -- its config.yaml layered under
command-line overrides, an OpenAI client's chats judged by the rules judge and trained on."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from gateway_support import build_tiny_model, free_port, model_cache_dir
from recipe_support import ask_then_reply, process_environ, wait_until

RUN_SH = Path(__file__).resolve().parent.parent / "openclaw-rl" / "run.sh"


def test_unknown_override_through_run_sh_is_refused_in_one_line(tmp_path):
    proc = subprocess.run(["bash", str(RUN_SH), "server.prot=1", f"run_dir={tmp_path}"], capture_output=True,
                          text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "server.port" in lines[0], proc.stderr


@pytest.mark.slow
def test_run_sh_serves_judges_and_trains_with_an_openai_client(tmp_path):
    import openai

    model = build_tiny_model(model_cache_dir())
    port = free_port()
    log = tmp_path / "run.log"
    # The recipe sets only method: rl, which is also the default. So that this run shows run.sh
    # layering its config.yaml, it runs a copy whose config.yaml adds two keys: train.batch_size
    # (default 8; the test needs 2 to train) and a run_dir the command line overrides.
    recipe = tmp_path / "openclaw-rl"
    recipe.mkdir()
    shutil.copy(RUN_SH, recipe / "run.sh")
    (recipe / "config.yaml").write_text((RUN_SH.parent / "config.yaml").read_text()
                                        + f"train:\n  batch_size: 2\nrun_dir: {tmp_path / 'yaml_run'}\n")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", str(recipe / "run.sh"), f"server.port={port}", f"run_dir={tmp_path / 'run'}",
             f"model.path={model}", "model.name=tiny", "logging.wandb.mode=disabled", "engine.threads=1"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "MASTER_ADDR": "10.0.0.7"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200, [proc], [log], 120)
        # run.sh execs the server: same process, launch environment added, multi-node variables untouched
        env = process_environ(proc.pid)
        assert env["MASTER_ADDR"] == "10.0.0.7" and env["OMP_NUM_THREADS"] and env["CLAWRL_HOME"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        for question, feedback in (("Hi", "Thanks!"), ("Tell me a story about a cat.", "No, that's wrong.")):
            ask_then_reply(client, "tiny", question, feedback)
        status = wait_until(lambda: (lambda s: s if s["training"]["train_step"] == 1 else None)(
            httpx.get(url + "/admin/status", timeout=10).json()), [proc], [log], 120)
        t = status["training"]
        assert t["method"] == "rl" and t["judge"] == "rules"
        assert t["batch_size"] == 2  # only config.yaml sets it
        assert status["weight_version"] == 1 and t["samples"]["trained"] == 2
        metrics = (tmp_path / "run" / "metrics.jsonl").read_text()  # the command line's run_dir wins
        assert not (tmp_path / "yaml_run").exists()
        assert '"kind": "train_step"' in metrics
        proc.send_signal(signal.SIGTERM)  # run.sh execs clawrl: the signal reaches the server itself
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert "trained turns" in log.read_text()
