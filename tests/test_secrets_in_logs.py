"""No key and no secret the redactor knows leaves a full run, in any log line or any file (issue 20,
item 4).

One ``openclaw-rl/run.sh`` run at DEBUG log level, as a user would run it beyond loopback: two API
keys and an admin key on the command line, chats that judge and train a step (saved as a
checkpoint), refused requests with a wrong key and past a rate limit, admin calls, and sessions
whose messages carry secrets in the places an agent puts them: the user's text, an assistant
tool call's arguments, a tool result and a streamed request. Then every line the server printed
and every byte under the run directory (the SQLite store with its WAL, metrics, checkpoints) is
searched for each secret. The model here never writes a secret itself, so the streamed *reply*
path is covered by the store's own tests (``tests/test_redact.py``), which feed it secrets.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from clawrl.store import TurnStore

from gateway_support import build_tiny_model, free_port, model_cache_dir
from recipe_support import ask_then_reply, wait_until

RUN_SH = Path(__file__).resolve().parent.parent / "openclaw-rl" / "run.sh"

KEYS = ("clawrl-key-alpha-9f3b2c71d0", "clawrl-key-beta-4a8e6d5c21")
ADMIN_KEY = "clawrl-admin-77c1e0b9f2a4"
WRONG_KEY = "someone-elses-key-31d9a6c4e8"  # a caller's mistake may be another service's real key
CONVERSATION_SECRETS = {
    "openai_key": "sk-proj-Zq8vR2mX4tL9wB7nK3pH6yD1",
    "github_token": "ghp_7Hq2Lm9Xv4Rt8Wz1Kc6Bn3Jd5Fs0Gy2Pa4Ue",
    "aws_access_key": "AKIAQ7XZ4R2M9T6V3B8N",
    "hf_token": "hf_Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zCd",
    "assignment": "Tr0ub4dor-and-3-horses",
}


@pytest.mark.slow
def test_a_full_run_writes_no_key_and_no_known_secret_anywhere(tmp_path):
    model = build_tiny_model(model_cache_dir())
    port, run_dir, log = free_port(), tmp_path / "run", tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", str(RUN_SH), f"server.port={port}", f"run_dir={run_dir}", f"model.path={model}",
             "model.name=tiny", "engine.threads=1", "logging.level=DEBUG", "logging.wandb.mode=offline",
             f"server.api_key='{','.join(KEYS)}'", f"server.admin_key={ADMIN_KEY}", "train.batch_size=2",
             "train.save_every=1", "server.rate_limit.requests_per_minute=30"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "CLAWRL_API_KEY": KEYS[0]})
    url = f"http://127.0.0.1:{port}"
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    try:
        wait_until(lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200, [proc], [log], 120)
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {WRONG_KEY}"}).status_code == 401
        assert httpx.get(url + "/admin/status", headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 401

        client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[0], max_retries=0)
        for question, feedback in (("Hi", "Thanks!"), ("Tell me a story about a cat.", "No, that's wrong.")):
            ask_then_reply(client, "tiny", question, feedback)

        s = CONVERSATION_SECRETS
        leaky = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[1], max_retries=0)
        call = {"id": "call_1", "type": "function",
                "function": {"name": "login", "arguments": json.dumps({"token": s["github_token"]})}}
        messages = [
            {"role": "user", "content": f"my key is {s['openai_key']} and password: {s['assignment']}"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": f"AWS_ACCESS_KEY_ID={s['aws_access_key']}"},
        ]
        session = {"X-Session-Id": uuid.uuid4().hex}
        leaky.chat.completions.create(model="tiny", messages=messages, max_tokens=8, extra_headers=session)
        stream = leaky.chat.completions.create(
            model="tiny", max_tokens=8, stream=True, extra_headers=session,
            messages=messages + [{"role": "assistant", "content": "ok"},
                                 {"role": "user", "content": f"and HF_TOKEN={s['hf_token']}"}])
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

        status = wait_until(lambda: (lambda st: st if st["training"]["train_step"] >= 1 else None)(
            httpx.get(url + "/admin/status", headers=admin, timeout=10).json()), [proc], [log], 180)
        assert status["turns"] >= 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)

    printed = log.read_text()
    assert "train step 1" in printed.lower() or "trained" in printed  # the run did train
    assert any(line.startswith("DEBUG") or " DEBUG " in line for line in printed.splitlines())
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".jsonl" for p in files) and any("checkpoint" in str(p) for p in files)
    for name, secret in [("api key", k) for k in KEYS] + [("admin key", ADMIN_KEY), ("wrong key", WRONG_KEY)] \
            + list(CONVERSATION_SECRETS.items()):
        assert secret not in printed, f"the {name} is in the server's output"
        for p in files:
            assert secret.encode() not in p.read_bytes(), f"the {name} is in {p.relative_to(run_dir)}"

    # the secrets were stored, redacted, where they were sent: the store held them, not nothing
    store = TurnStore(run_dir, create=False)
    stored = json.dumps([[t["messages"], t["next_state"]] for t in store.iter_turns()])
    store.close()
    for kind in ("openai_key", "github_token", "aws_access_key", "hf_token", "assignment"):
        assert f"[REDACTED:{kind}]" in stored, kind
