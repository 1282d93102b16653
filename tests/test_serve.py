"""``clawrl serve`` as a user runs it: a subprocess on a free port, one-line refusals, the printed
OpenClaw provider snippet, clean SIGTERM, and turns that survive ``kill -9`` and keep linking."""
from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clawrl.run_lock import RunDirBusy, RunDirLock
from clawrl.store import TurnStore

from gateway_support import PLAIN_ANSWER, build_tiny_model, free_port, model_cache_dir

SECRET = "sk-serve-test-5e3f9a"


CLAWRL = [sys.executable, "-c", "import sys; from clawrl.cli import main; sys.exit(main())"]


def run_serve(*args, timeout=60):
    return subprocess.run([*CLAWRL, "serve", *args], capture_output=True, text=True, timeout=timeout)


def one_line_refusal(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clawrl: "), proc.stderr
    return lines[0]


def test_non_loopback_bind_without_a_key_is_refused():
    line = one_line_refusal(run_serve("server.host=0.0.0.0"))
    assert "server.api_key is required" in line


def test_unknown_config_key_is_refused_with_the_closest_name():
    line = one_line_refusal(run_serve("server.prot=1234"))
    assert "server.port" in line


def test_port_in_use_is_a_one_line_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = one_line_refusal(run_serve(f"server.port={port}", f"run_dir={tmp_path}"))
    assert str(port) in line and "in use" in line


class Served:
    """A ``clawrl serve`` subprocess; output goes to a file so a full pipe can never stall it."""

    def __init__(self, run_dir, model_path, port):
        self.port, self.log = port, run_dir / f"serve-{port}.log"
        env = {**os.environ, "CLAWRL_API_KEY": SECRET}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [*CLAWRL, "serve", f"model.path={model_path}", "model.name=tiny",
                 f"server.port={port}", f"server.api_key={SECRET}", f"run_dir={run_dir}", "engine.threads=1"],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 90
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError("serve did not come up: " + self.output())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text()

    def chat(self, messages, **kw):
        r = httpx.post(self.url + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {SECRET}"},
                       json={"model": "tiny", "temperature": 0, "messages": messages, **kw})
        assert r.status_code == 200, r.text
        return r


@pytest.mark.slow
def test_turn_survives_kill_9_and_the_next_request_links_across_the_restart(tmp_path):
    model = build_tiny_model(model_cache_dir())
    first = Served(tmp_path, model, free_port())
    try:
        out = first.output()
        snippet = json.loads(out[out.index("{"): out.index("\n}\n") + 2])
        provider = snippet["models"]["providers"]["clawrl"]
        assert provider["baseUrl"] == f"http://127.0.0.1:{first.port}/v1"
        assert provider["api"] == "openai-completions" and provider["models"][0]["id"] == "tiny"
        assert provider["apiKey"] == "${CLAWRL_API_KEY}"
        opening = [{"role": "user", "content": "Hi"}]
        r = first.chat(opening)
        acked_turn = int(r.headers["x-turn-ids"])
        session = r.headers["x-session-id"]
        streamed = first.chat([{"role": "user", "content": "Tell me a story about a cat."}], stream=True)
        assert streamed.text.endswith("data: [DONE]\n\n")
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(30)
    assert SECRET not in first.output()  # the key is never printed or logged

    store = TurnStore(tmp_path, create=False)
    acked = store.get_turn(acked_turn)
    assert acked["status"] == "complete" and acked["response_text"] == PLAIN_ANSWER
    assert sum(1 for _ in store.iter_turns()) == 2
    store.close()

    second = Served(tmp_path, model, free_port())
    try:
        follow = second.chat(opening + [{"role": "assistant", "content": PLAIN_ANSWER},
                                        {"role": "user", "content": "What is the weather in Paris?"}])
        assert follow.headers["x-session-id"] == session
        # no server.admin_key: /admin answers this loopback client without a key (the API key never opens it)
        status = httpx.get(second.url + "/admin/status").json()
        assert status["turns"] == 3 and status["turns_with_next_state"] == 1
        turns = httpx.get(f"{second.url}/admin/sessions/{session}").json()["turns"]
        before, after = turns
        assert before["turn_id"] == acked_turn and after["parent_turn_id"] == acked_turn
        assert before["next_state"][0]["content"] == "What is the weather in Paris?"
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(30) == 0  # a clean shutdown on SIGTERM
        assert "stopped by SIGTERM" in second.output()
    finally:
        if second.proc.poll() is None:
            second.proc.kill()
            second.proc.wait(30)


def test_provider_snippet_never_contains_the_key(monkeypatch):
    from clawrl.orchestration.serve import API_KEY_ENV, provider_snippet

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    snip = provider_snippet("http://127.0.0.1:9/v1", "m", 4096, 512, has_key=True)
    p = snip["models"]["providers"]["clawrl"]
    assert p["apiKey"] == "<your api key>" and p["baseUrl"] == "http://127.0.0.1:9/v1"
    assert p["models"] == [{"id": "m", "name": "m", "reasoning": False, "input": ["text"], "contextWindow": 4096,
                            "maxTokens": 512}]
    monkeypatch.setenv(API_KEY_ENV, SECRET)
    p = provider_snippet("u", "m", 1, 1, has_key=True)["models"]["providers"]["clawrl"]
    assert p["apiKey"] == "${CLAWRL_API_KEY}" and SECRET not in json.dumps(p)


def test_run_dir_lock_refuses_a_second_holder_until_the_first_releases(tmp_path):
    first = RunDirLock(tmp_path).acquire()
    with pytest.raises(RunDirBusy, match=rf"in use by another clawrl server \(pid {os.getpid()}\)"):
        RunDirLock(tmp_path).acquire()
    first.release()
    RunDirLock(tmp_path).acquire().release()  # released: free again


@pytest.mark.slow
def test_a_second_server_on_a_run_dir_is_refused_while_read_only_commands_work(tmp_path):
    model = build_tiny_model(model_cache_dir())
    first = Served(tmp_path, model, free_port())
    try:
        first.chat([{"role": "user", "content": "Hi"}])
        line = one_line_refusal(run_serve(f"model.path={model}", f"server.port={free_port()}",
                                          f"run_dir={tmp_path}", f"server.api_key={SECRET}"))
        assert f"pid {first.proc.pid}" in line and str(tmp_path) in line
        listed = subprocess.run([*CLAWRL, "sessions", "--run-dir", str(tmp_path)], capture_output=True, text=True,
                                timeout=60)
        assert listed.returncode == 0 and len(listed.stdout.strip().splitlines()) == 2, listed.stderr  # header, 1 session
        exported = subprocess.run([*CLAWRL, "export", "--run-dir", str(tmp_path)], capture_output=True, text=True,
                                  timeout=60)
        assert exported.returncode == 0 and len(exported.stdout.splitlines()) == 1, exported.stderr
    finally:
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(60) == 0
    # the lock goes with the server: a new one starts on the same run_dir
    second = Served(tmp_path, model, free_port())
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(60) == 0


def test_a_bad_environment_is_refused_in_one_line():
    assert "unknown env.name 'bogus'" in one_line_refusal(run_serve("env.name=bogus"))


SLOW_GUESS = str(Path(__file__).with_name("guess_number_env.py")) + ":SlowGuessNumber"


def serve_env(run_dir, model, port, *overrides):
    with open(run_dir.parent / f"serve-{port}.log", "w") as out:
        return subprocess.Popen(
            [*CLAWRL, "serve", f"model.path={model}", "model.name=tiny", f"server.port={port}", f"run_dir={run_dir}",
             "engine.threads=1", "logging.wandb.mode=disabled", f"env.name={SLOW_GUESS}", "env.group_size=2",
             "env.groups_in_flight=1", "env.max_turns=3", "env.max_tokens_per_turn=6", "train.batch_size=2",
             "train.save_every=1", *overrides], stdout=out, stderr=subprocess.STDOUT)


def episode_rows(run_dir):
    """Every episode (id, group, member, attempt, state); none before the server made the table."""
    if not (run_dir / "clawrl.sqlite").exists():
        return []
    c = sqlite3.connect(run_dir / "clawrl.sqlite", timeout=30)
    try:
        return c.execute("SELECT episode_id, group_id, member, attempt, state FROM episodes").fetchall()
    except sqlite3.OperationalError:  # not created yet
        return []
    finally:
        c.close()


@pytest.mark.slow
def test_kill_9_mid_rollout_aborts_the_episodes_and_the_restart_rolls_their_group_again(tiny_model_dir, tmp_path):
    model = tiny_model_dir  # the embedded model guesses numbers, so its groups are rarely all equal
    run_dir = tmp_path / "run"
    port = free_port()
    first = serve_env(run_dir, model, port)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # wait until one episode finished and others run
            rows = episode_rows(run_dir)
            states = [r[4] for r in rows]
            if "finished" in states and "running" in states:
                break
            assert first.poll() is None, "serve exited early"
            time.sleep(0.2)
        else:
            raise AssertionError(f"no episode ran: {rows}")
        # the OpenAI endpoint keeps serving the policy while it is rolled out and trained
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "What is 2+3?"}],
                             "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    before = {r[0]: r for r in episode_rows(run_dir)}
    interrupted = {r[1] for r in before.values() if r[4] == "running"}
    finished_before = {r[0] for r in before.values() if r[4] in ("finished", "failed")}

    # the first server may have trained and saved steps already (on a slow machine a whole group can
    # finish before the poll sees one); the restart resumes from its newest checkpoint and trains one more
    saved = [int(p.name[len("step_"):]) for p in (run_dir / "checkpoints").glob("step_*")
             if (p / "manifest.json").is_file()]
    # a batch of two groups: the interrupted group, rolled out first, is complete before the step
    second = serve_env(run_dir, model, free_port(), f"env.max_train_steps={max(saved, default=0) + 1}",
                       "train.batch_size=4")
    assert second.wait(180) == 0  # trains one step, saves, and exits by itself
    after = {r[0]: r for r in episode_rows(run_dir)}
    assert all(after[e][4] == before[e][4] for e in finished_before)  # no finished episode lost or redone
    assert all(after[e][4] == "aborted" for e, r in before.items() if r[4] == "running")
    for group in interrupted:  # the interrupted group was rolled out again where it stopped
        members = [r for r in after.values() if r[1] == group]
        results = [r for r in members if r[4] in ("finished", "failed")]
        assert sorted(r[2] for r in results) == [0, 1] and any(r[3] == 2 for r in results)
    c = sqlite3.connect(run_dir / "clawrl.sqlite")
    try:
        sources = c.execute("SELECT source, source_id FROM samples").fetchall()
        trained = c.execute("SELECT COUNT(*) FROM samples WHERE state = 'trained'").fetchone()[0]
        complete = {g for (g,) in c.execute("SELECT group_id FROM env_groups WHERE state = 'complete'")}
    finally:
        c.close()
    assert len(sources) == len(set(sources)) and trained >= 2  # each episode one sample, trained once
    assert interrupted <= complete

