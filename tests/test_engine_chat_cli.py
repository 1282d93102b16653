"""``clawrl chat`` end to end in a subprocess: in-process (``--local``, or when no server answers) the
reply is the engine's greedy answer under the model's chat template and stderr says the weights are
the base ones; with a server running it asks that server over its OpenAI API (the turn is stored
there), and the server's refusals are one line and exit status 2, as is a bad model directory."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import torch

from clawrl.chat import render_prompt
from clawrl.engines.loading import load_model
from clawrl.store import TurnStore
from engine_testing import make_model_dir
from gateway_support import PLAIN_ANSWER, build_tiny_model, free_port, model_cache_dir

KEY = "sk-chat-test-0b7d21"


def clawrl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the CLI as the ``clawrl`` console script does (``-m clawrl.cli`` would load cli.py twice)."""
    entry = "import sys; from clawrl.cli import main; sys.exit(main())"
    env = {k: v for k, v in (env or os.environ).items() if k != "CLAWRL_API_KEY"} | (env or {})
    return subprocess.run([sys.executable, "-c", entry, *args], capture_output=True, text=True, timeout=120, env=env)


def test_chat_prints_the_greedy_reply_of_the_model_dir(tmp_path):
    path = make_model_dir(tmp_path / "m", "qwen3")
    lm = load_model(str(path), device="cpu")
    ids = render_prompt(lm.tokenizer, "What is 7+5?")
    assert lm.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    reply = []
    with torch.no_grad():
        for _ in range(8):
            nxt = int(lm.model(torch.tensor([ids + reply])).logits[0, -1].argmax())
            if nxt in lm.eos_token_ids:
                break
            reply.append(nxt)
    expected = lm.tokenizer.decode(reply, skip_special_tokens=True).strip()

    out = clawrl("chat", "What is 7+5?", f"model.path={path}", "model.device=cpu", "engine.threads=1", "--max-tokens", "8",
                 "--local")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
    assert out.stderr.strip().endswith("loaded in this process (base weights, not the trained ones)")


def test_chat_with_bad_model_dir_is_one_line_exit_2(tmp_path):
    out = clawrl("chat", "hi", f"model.path={tmp_path / 'missing'}")
    assert out.returncode == 2
    assert out.stderr.strip() == f"clawrl: model path {tmp_path / 'missing'} does not exist"
    out = clawrl("chat", "hi", "engine.backend=sglang", f"model.path={tmp_path}")
    # not installed, or installed from requirements-sglang.txt without its GPU dependencies
    assert out.returncode == 2 and ("SGLang is not installed" in out.stderr
                                    or "SGLang is installed but does not import" in out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1


def test_chat_without_a_server_answers_in_process_and_says_so():
    model = build_tiny_model(model_cache_dir())
    port = free_port()  # nothing listens there
    out = clawrl("chat", "Hi", f"model.path={model}", "model.name=tiny", f"server.port={port}", "engine.threads=1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == PLAIN_ANSWER
    said = [s for s in out.stderr.splitlines() if s.strip() and not s.startswith("Loading weights")]  # the load bar
    assert said == [f"clawrl: no server at http://127.0.0.1:{port}; answering with tiny loaded in this process "
                    "(base weights, not the trained ones)"]
    out = clawrl("chat", "Hi", "--url", f"http://127.0.0.1:{port}")  # a named server must answer: no fallback
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith(f"clawrl: cannot reach the server at http://127.0.0.1:{port}")


@pytest.mark.slow
def test_chat_talks_to_the_running_server_and_reports_its_refusals(tmp_path):
    model = build_tiny_model(model_cache_dir())
    port = free_port()
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-c", "import sys; from clawrl.cli import main; sys.exit(main())", "serve",
             f"model.path={model}", "model.name=tiny", f"server.port={port}", f"server.api_key={KEY}",
             f"run_dir={tmp_path / 'run'}", "engine.threads=1", "train.enabled=false"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 90
        while True:
            assert server.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)

        # Found at the configured address; model.path points nowhere, so only the server can answer.
        absent = tmp_path / "no-model"
        out = clawrl("chat", "Hi", f"server.port={port}", f"model.path={absent}", "--api-key", KEY)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == PLAIN_ANSWER
        assert out.stderr.strip() == f"clawrl: answered by tiny at http://127.0.0.1:{port}, clawrl-w0"
        # --url (with or without /v1) and the key from the environment.
        out = clawrl("chat", "Hi", "--url", f"http://127.0.0.1:{port}/v1", env={**os.environ, "CLAWRL_API_KEY": KEY})
        assert out.returncode == 0 and out.stdout.strip() == PLAIN_ANSWER, out.stderr

        for key_args in (["--api-key", "wrong"], []):
            out = clawrl("chat", "Hi", "--url", f"http://127.0.0.1:{port}", *key_args)
            assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
            assert out.stderr.startswith(f"clawrl: the server at http://127.0.0.1:{port} answered 401: ")
            assert "--api-key" in out.stderr and "Traceback" not in out.stderr
    finally:
        server.terminate()
        assert server.wait(60) == 0
    store = TurnStore(tmp_path / "run", create=False)
    try:
        turns = list(store.iter_turns())
        assert [t["response_text"] for t in turns] == [PLAIN_ANSWER, PLAIN_ANSWER]  # both answers were served
        assert all(t["close_reason"] == "session_done" for t in turns)  # one-shot sessions, ended at once
    finally:
        store.close()
