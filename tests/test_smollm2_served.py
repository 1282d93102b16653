"""The real SmolLM2-135M-Instruct (``smollm2_dir``), served as a user serves it (``clawrl serve
model.path=smollm2-135m-instruct``) and answered through the official ``openai`` client, and a
LoRA run over it exported and read back with the logits the trainer served."""
from __future__ import annotations

import subprocess
import time

import httpx
import openai
import pytest
import torch

from gateway_support import free_port
from test_export_model import CLAWRL, _train_run, export, logits, prompt_ids, with_weights

NAME = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_served_by_name_it_answers_paris_greedily_and_streams_the_same_reply(smollm2_dir, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*CLAWRL, "serve", f"model.path={NAME}", f"server.port={port}", f"run_dir={tmp_path}",
                                 "train.enabled=false", "logging.wandb.mode=disabled"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        t0, url = time.time(), f"http://127.0.0.1:{port}"
        while True:
            assert proc.poll() is None and time.time() - t0 < 120, log.read_text()
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        print(f"healthy after {time.time() - t0:.1f} s")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model=NAME, messages=FRANCE, temperature=0, max_tokens=24)
        answer = r.choices[0].message.content
        print("greedy:", repr(answer))
        assert "Paris" in answer and r.model == NAME
        chunks = list(client.chat.completions.create(model=NAME, messages=FRANCE, temperature=0, max_tokens=24,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow  # about 60 s on 2 shared cores: two LoRA steps, a 538 MB export and three loads
def test_a_lora_run_over_it_exports_merged_with_the_logits_it_served(smollm2_dir, tmp_path):
    run, served = _train_run(smollm2_dir, tmp_path / "run", "train.lora.enabled=true")
    out = tmp_path / "merged"
    assert export(run, out, NAME) == 0  # the installed name, resolved as model.path
    ids = prompt_ids(smollm2_dir)
    merged = logits(out, ids)
    torch.testing.assert_close(merged, logits(with_weights(smollm2_dir, served[2]), ids), atol=1e-5, rtol=0)
    assert (merged - logits(smollm2_dir, ids)).abs().max() > 1e-4
