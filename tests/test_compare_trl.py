"""benchmarks/compare_trl.py without TRL: the reward is the demo user's preference, clawrl's side
gets the settings TRL's side gets, the one-turn environment scores a reply, and the script says how
to install TRL in one line when it cannot import it."""
from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "compare_trl.py"


@pytest.fixture(scope="module")
def ct():
    spec = importlib.util.spec_from_file_location("compare_trl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reward_is_the_demo_users_preference(ct):
    from clawrl.demo.users import Question

    q = Question("What is 7 + 5?", 7, 5)
    assert ct.reward("worked", q, "7 + 5 = 12") == 1.0
    assert ct.reward("worked", q, "12") == 0.0
    assert ct.reward("bare", q, "12") == 1.0


def test_the_environment_scores_one_reply_and_its_tasks_are_the_trl_prompts(ct, monkeypatch, tmp_path):
    monkeypatch.setenv(ct.ENV_PROMPTS, "5")
    monkeypatch.setenv(ct.ENV_USER, "worked")
    monkeypatch.setenv(ct.ENV_LOG, str(tmp_path / "log.jsonl"))
    tasks = ct.PreferenceEnv.tasks("train")
    assert [t.data["text"] for t in tasks] == [q.text for q in ct.train_questions(5, 1)]
    env = ct.PreferenceEnv()
    obs = asyncio.run(env.reset(tasks[0]))
    assert obs.messages == [{"role": "user", "content": tasks[0].data["text"]}]
    a, b = tasks[0].data["a"], tasks[0].data["b"]
    out = asyncio.run(env.step(f"{a} + {b} = {a + b}"))
    assert out.done and out.reward == 1.0 and out.observation is None
    assert (tmp_path / "log.jsonl").read_text().count("\n") == 1


def test_clawrls_side_composes_the_shared_settings(ct, tmp_path):
    from clawrl.config import compose
    from clawrl.embedded.build import resolve_model

    args = Namespace(group_size=4, batch=8, steps=3, seed=1)
    s = ct.shared_settings(args)
    assert s["lr"] == compose().train.lr and s["max_tokens"] == 24  # conf/embedded.yaml, demo.max_tokens
    assert s["kl_coef"] == compose().train.kl_coef  # conf/embedded.yaml too: TRL's beta
    cfg = resolve_model(compose(ct.clawrl_overrides(args, s, tmp_path)))
    assert (cfg.train.lr, cfg.env.group_size, cfg.train.batch_size) == (s["lr"], 4, 8)
    assert (cfg.env.max_tokens_per_turn, cfg.env.temperature, cfg.env.max_turns) == (24, 1.0, 1)
    assert cfg.train.kl_coef == s["kl_coef"] and cfg.train.aggregation == "token-mean"
    assert cfg.train.group_advantage == "grpo"


def test_without_trl_the_script_names_the_install_command():
    if importlib.util.find_spec("trl") is not None:
        pytest.skip("trl is installed here")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "pip install trl==1.16.0" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
