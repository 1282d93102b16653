"""``openclaw-opd/run.sh`` and ``openclaw-combine/run.sh`` as a user launches them: config.yaml under
command-line overrides, an OpenAI client's corrections hint-judged, teacher-scored and trained on,
the counts in /admin/status, and a clean stop on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from gateway_support import build_tiny_model, free_port, model_cache_dir
from recipe_support import ask_then_reply, process_environ, wait_until

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("method", ["opd", "combine"])
def test_unknown_override_through_run_sh_is_refused_in_one_line(method, tmp_path):
    proc = subprocess.run(["bash", str(ROOT / f"openclaw-{method}" / "run.sh"), "combine.w_opdd=1",
                           f"run_dir={tmp_path}"], capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "combine.w_opd" in lines[0], proc.stderr


@pytest.mark.parametrize("method", ["opd", "combine"])
def test_run_sh_serves_hint_judges_teacher_scores_and_trains(method, tmp_path):
    import openai

    model = build_tiny_model(model_cache_dir())
    port = free_port()
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", str(ROOT / f"openclaw-{method}" / "run.sh"), f"server.port={port}", f"run_dir={tmp_path / 'run'}",
             f"model.path={model}", "model.name=tiny", "train.batch_size=2", "logging.wandb.mode=disabled",
             "engine.threads=1"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "MASTER_ADDR": "10.0.0.7"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200, [proc], [log], 120)
        env = process_environ(proc.pid)
        assert env["MASTER_ADDR"] == "10.0.0.7" and env["OMP_NUM_THREADS"] and env["CLAWRL_HOME"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        for question, feedback in (("Hi", "Too long. One line, please."), ("What is 7+5?", "Just the number, please."),
                                   ("Tell me a story about a cat.", "Thanks!")):
            ask_then_reply(client, "tiny", question, feedback)
        status = wait_until(lambda: (lambda s: s if s["training"]["train_step"] >= 1 else None)(
            httpx.get(url + "/admin/status", timeout=10).json()), [proc], [log], 120)
        t = status["training"]
        # only config.yaml sets the method (run.sh passes none; the default is rl) and openclaw-opd's
        # top-k (default 0); the batch size is the command line's
        assert t["method"] == method and t["opd"]["topk"] == {"opd": 8, "combine": 0}[method]
        assert t["batch_size"] == 2
        assert t["opd"]["hint_judge"] == "rules" and t["opd"]["teacher"] == "policy"
        assert t["opd"]["hints_accepted"] == 2 and t["opd"]["rejected_by_reason"] == {"no_hindsight": 1}
        assert t["opd"]["opd_samples_trained"] == 2
        proc.send_signal(signal.SIGTERM)  # run.sh execs clawrl: the signal reaches the server itself
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert "teacher scored" in log.read_text()
