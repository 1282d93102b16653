"""The real SmolLM2-135M-Instruct (``smollm2_dir``), served as a user serves it (``clawrl serve
model.path=smollm2-135m-instruct``) and answered through the official ``openai`` client, and a
LoRA run over it exported and read back with the logits the trainer served."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from gateway_support import free_port
from test_export_model import CLAWRL, _train_run, export, logits, prompt_ids, with_weights

NAME = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@contextlib.contextmanager
def serving(model: str, run_dir: Path, *overrides: str):
    """``clawrl serve model.path=MODEL`` in a subprocess, as the ``openai`` client sees it."""
    port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*CLAWRL, "serve", f"model.path={model}", f"server.port={port}", f"run_dir={run_dir}",
                                 "train.enabled=false", "logging.wandb.mode=disabled", *overrides],
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
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def special_texts(model_dir: Path) -> list[str]:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [t.content for t in tok.added_tokens_decoder.values() if t.special]


def test_served_by_name_it_answers_paris_greedily_and_streams_the_same_reply(smollm2_dir, tmp_path):
    with serving(NAME, tmp_path) as (client, _):
        r = client.chat.completions.create(model=NAME, messages=FRANCE, temperature=0, max_tokens=24)
        answer = r.choices[0].message.content
        print("greedy:", repr(answer))
        assert "Paris" in answer and r.model == NAME
        chunks = list(client.chat.completions.create(model=NAME, messages=FRANCE, temperature=0, max_tokens=24,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
        # sampled replies, streamed and not, that run until the model ends its turn: no special token's text
        specials = special_texts(smollm2_dir)
        sampled = client.chat.completions.create(model=NAME, messages=FRANCE, temperature=1.0, seed=3, n=4,
                                                 max_tokens=48)
        texts = [c.message.content for c in sampled.choices]
        for seed in range(2):
            stream = client.chat.completions.create(model=NAME, messages=FRANCE, seed=seed, max_tokens=48,
                                                    stream=True)
            texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        assert "stop" in {c.finish_reason for c in sampled.choices}
        assert not [(s, t) for t in texts for s in specials if s in t]


def test_generation_config_sampling_defaults_apply_and_the_requests_own_value_wins(tiny_model_dir, tmp_path):
    model = tmp_path / "tiny-greedy"
    shutil.copytree(tiny_model_dir, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "top_k": 5}))
    with serving(str(model), tmp_path / "run") as (client, log):
        name = client.models.list().data[0].id
        ask = dict(model=name, messages=FRANCE, max_tokens=16)
        by_default = {client.chat.completions.create(**ask, seed=s).choices[0].message.content for s in range(4)}
        assert len(by_default) == 1  # temperature 0 from generation_config.json: greedy whatever the seed
        sent = {client.chat.completions.create(**ask, seed=s, temperature=1.0).choices[0].message.content
                for s in range(4)}
        assert len(sent) > 1  # the request's temperature wins
        assert "temperature 0.0 (generation_config.json)" in log.read_text()
        assert "top_k 5 (generation_config.json)" in log.read_text()
    with serving(str(model), tmp_path / "run2", "server.default_temperature=1.0") as (client, log):
        hot = {client.chat.completions.create(**ask, seed=s).choices[0].message.content for s in range(4)}
        assert len(hot) > 1  # server.default_temperature wins over generation_config.json


@pytest.mark.slow  # about 60 s on 2 shared cores: two LoRA steps, a 538 MB export and three loads
def test_a_lora_run_over_it_exports_merged_with_the_logits_it_served(smollm2_dir, tmp_path):
    run, served = _train_run(smollm2_dir, tmp_path / "run", "train.lora.enabled=true")
    out = tmp_path / "merged"
    assert export(run, out, NAME) == 0  # the installed name, resolved as model.path
    ids = prompt_ids(smollm2_dir)
    merged = logits(out, ids)
    torch.testing.assert_close(merged, logits(with_weights(smollm2_dir, served[2]), ids), atol=1e-5, rtol=0)
    assert (merged - logits(smollm2_dir, ids)).abs().max() > 1e-4
