"""The crash campaign at CI size (issue 20, items 1 and 7): one kill -9 at each moment of
``benchmarks/reliability.py`` (a streamed reply, judging, a train step, a weight swap, a
checkpoint write), each followed by a restart on the same run directory under continuous load.
Every kill must lose no acknowledged turn, train no sample twice on the surviving line, serve a
complete checkpoint and resume training by itself. Two more kills land while a toolcall-rl
episode's sandbox runs (the embedded model, which calls its python tool): no sandbox process may
outlive the server, and no episode may stay half done. The full campaign (30 + 10 kills) is
``python benchmarks/reliability.py``; its figures are in RELIABILITY.md."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from gateway_support import build_tiny_model, model_cache_dir
from required_tools import skip_unless_available

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("reliability", ROOT / "benchmarks" / "reliability.py")
reliability = importlib.util.module_from_spec(_spec)
sys.modules["reliability"] = reliability  # its dataclasses look their module up there
_spec.loader.exec_module(reliability)


@pytest.mark.slow
def test_one_kill_at_each_moment_loses_nothing_and_the_run_resumes(tmp_path):
    model = build_tiny_model(model_cache_dir())
    lines = []
    results = reliability.campaign(tmp_path / "run", len(reliability.MOMENTS), 0,
                                   [f"model.path={model}", "model.name=tiny"], tmp_path / "serve.log", lines.append)
    assert [r["moment"] for r in results] == list(reliability.MOMENTS)
    assert all(r["moment_seen"] for r in results), lines  # each kill landed at the moment it aimed for
    assert all(not r["problems"] for r in results), "\n".join(lines)
    assert results[-1]["resumed_step"] >= 3 and results[-1]["acked_turns"] >= 10  # it trained and served
    rows = reliability.summary(results)
    assert all(r["tried"] == r["survived"] == 1 and r["lost"] == 0 for r in rows)


@pytest.mark.slow
def test_a_kill_while_a_sandbox_runs_leaves_no_process_and_no_episode_half_done(tiny_model_dir, tmp_path):
    skip_unless_available("bwrap")
    if os.getuid() != 0:
        pytest.skip("the sandbox moment is seen by the sandboxes' own uids, which need root")
    lines = []
    results = reliability.sandbox_campaign(tmp_path / "run", 2, 0, [f"model.path={tiny_model_dir}"],
                                           tmp_path / "serve.log", lines.append)
    assert all(r["moment_seen"] for r in results), lines
    assert all(not r["problems"] for r in results), "\n".join(lines)
    assert sum(r["episodes_running_at_kill"] for r in results) >= 1  # the kills interrupted episodes
