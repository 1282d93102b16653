"""The real SmolLM2-135M-Instruct (``smollm2_dir``), served as a user serves it (``clawrl serve
model.path=smollm2-135m-instruct``) and answered through the official ``openai`` client, and a
LoRA run over it exported and read back with the logits the trainer served."""
from __future__ import annotations

import json
import subprocess
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from clawrl.methods.opd.teacher import teacher_prompt_ids
from clawrl.store import TurnStore
from gateway_support import free_port
from test_export_model import CLAWRL, _train_run, export, logits, prompt_ids, with_weights

NAME = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(smollm2_dir, tmp_path_factory):
    """(base URL, run dir) of ``clawrl serve model.path=smollm2-135m-instruct`` in a subprocess."""
    run_dir, port = tmp_path_factory.mktemp("served"), free_port()
    log = run_dir / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*CLAWRL, "serve", f"model.path={NAME}", f"server.port={port}", f"run_dir={run_dir}",
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
        yield url, run_dir
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_served_by_name_it_answers_paris_greedily_and_streams_the_same_reply(served):
    client = openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model=NAME, messages=FRANCE, temperature=0, max_tokens=24)
    answer = r.choices[0].message.content
    print("greedy:", repr(answer))
    assert "Paris" in answer and r.model == NAME
    chunks = list(client.chat.completions.create(model=NAME, messages=FRANCE, temperature=0, max_tokens=24,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


@pytest.mark.slow  # about 60 s on 2 shared cores: two LoRA steps, a 538 MB export and three loads
def test_a_lora_run_over_it_exports_merged_with_the_logits_it_served(smollm2_dir, tmp_path):
    run, served = _train_run(smollm2_dir, tmp_path / "run", "train.lora.enabled=true")
    out = tmp_path / "merged"
    assert export(run, out, NAME) == 0  # the installed name, resolved as model.path
    ids = prompt_ids(smollm2_dir)
    merged = logits(out, ids)
    torch.testing.assert_close(merged, logits(with_weights(smollm2_dir, served[2]), ids), atol=1e-5, rtol=0)
    assert (merged - logits(smollm2_dir, ids)).abs().max() > 1e-4


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# One earlier call and its result: SmolLM2's template reads only content, so these render as text.
LONDON = [{"role": "user", "content": "What is the weather in London?"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "London"}'}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "12C, rain"},
          {"role": "assistant", "content": "It is 12C and raining in London."}]


def test_its_template_drops_tools_so_clawrl_prompts_them_and_parses_the_call_back(served, smollm2_dir):
    """SmolLM2's template ignores ``tools``: the served prompt carries clawrl's <tools> section, and the
    model's greedy completion of a named tool_choice comes back as tool_calls, streamed or not."""
    url, run_dir = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    ask = dict(model=NAME, messages=LONDON + [{"role": "user", "content": "What is the weather in Paris?"}],
               tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
               temperature=0, max_tokens=32)
    r = client.chat.completions.create(**ask)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r.choices[0]
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    chunks = [c for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    streamed = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert json.loads("".join(tc.function.arguments or "" for tc in streamed)) == {"city": "Paris"}
    assert streamed[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"

    store = TurnStore(run_dir, create=False)
    turn = list(store.iter_turns())[-1]
    store.close()
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt = tok.decode(turn["prompt_ids"])
    # the OPD teacher renders the stored turn the same way (else: prompt_mismatch), with its hint
    assert "<tools>" in tok.decode(teacher_prompt_ids(tok, turn, "Call the tool."))
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "London"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n12C, rain\n</tool_response><|im_end|>" in prompt
