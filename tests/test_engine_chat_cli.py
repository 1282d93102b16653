"""``clawrl chat`` end to end in a subprocess: the reply is the engine's greedy answer under the
model's chat template; a bad model directory is one line on stderr and exit status 2."""
from __future__ import annotations

import subprocess
import sys

import torch

from clawrl.chat import render_prompt
from clawrl.engines.loading import load_model
from engine_testing import make_model_dir


def clawrl(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI as the ``clawrl`` console script does (``-m clawrl.cli`` would load cli.py twice)."""
    entry = "import sys; from clawrl.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", entry, *args], capture_output=True, text=True, timeout=120)


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

    out = clawrl("chat", "What is 7+5?", f"model.path={path}", "model.device=cpu", "engine.threads=1", "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


def test_chat_with_bad_model_dir_is_one_line_exit_2(tmp_path):
    out = clawrl("chat", "hi", f"model.path={tmp_path / 'missing'}")
    assert out.returncode == 2
    assert out.stderr.strip() == f"clawrl: model path {tmp_path / 'missing'} does not exist"
    out = clawrl("chat", "hi", "engine.backend=sglang", f"model.path={tmp_path}")
    assert out.returncode == 2 and "SGLang is not installed" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
