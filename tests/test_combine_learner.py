"""OPD and Combine beside serving: corrections become hints, the teacher scores the served tokens,
a train step uses them, and /admin/status shows hints accepted and rejected (by reason) and the OPD
samples trained -- while a turn with only a reward (combine) trains RL-only and one with nothing
under opd is skipped with the hint judge's reason."""
from __future__ import annotations

import json

import httpx

from test_learner import interaction, make_app, model_dir, status, wait_for  # noqa: F401 (fixture)
from gateway_support import ServerThread


def test_opd_trains_on_teacher_scored_turns_and_reports_hints(model_dir, tmp_path):
    app, learner, store = make_app(model_dir, tmp_path, "method=opd", "opd.topk=4")
    with ServerThread(app) as srv:
        interaction(srv.url, "Hi", "Too long. One line, please.")
        interaction(srv.url, "Tell me a story about a cat.", "Thanks!")  # no hint: skipped under opd
        interaction(srv.url, "What is 7+5?", "Just the number, please.")
        s = wait_for(srv.url, lambda s: s["training"]["train_step"] == 1)
        t = s["training"]
        assert t["method"] == "opd" and t["judge"] is None  # no reward judge under opd
        o = t["opd"]
        assert o["hints_accepted"] == 2 and o["hints_rejected"] == 1
        assert o["rejected_by_reason"] == {"no_hindsight": 1} and o["teacher_scored"] == 2
        assert o["opd_samples_trained"] == 2 and t["samples"]["trained"] == 2
        assert t["samples"]["skipped_by_reason"]["no_hint:no_hindsight"] == 1
        assert s["weight_version"] == 1 and httpx.get(srv.url + "/healthz").json()["weight_version"] == 1
    step = next(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
                if '"kind": "train_step"' in line)
    assert step["samples_opd_only"] == 2 and step["samples_rl_only"] == 0 and step["opd_tokens"] > 0
    assert "topk_kl" in step


def test_combine_trains_reward_only_hint_only_and_both(model_dir, tmp_path):
    app, learner, store = make_app(model_dir, tmp_path, "method=combine", "train.batch_size=3")
    with ServerThread(app) as srv:
        interaction(srv.url, "Hi", "Thanks!")  # reward only
        interaction(srv.url, "What is 7+5?", "Just the number, please.")  # hint only (no reward signal)
        interaction(srv.url, "Tell me a story about a cat.", "No, that's wrong. One line, please.")  # both
        s = wait_for(srv.url, lambda s: s["training"]["train_step"] == 1)
        t = s["training"]
        assert t["judge"] == "rules" and t["samples"]["trained"] == 3
        assert t["opd"]["opd_samples_trained"] == 2 and t["opd"]["hints_rejected"] == 1
    step = next(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
                if '"kind": "train_step"' in line)
    assert (step["samples_rl_only"], step["samples_opd_only"], step["samples_both"]) == (1, 1, 1)


def test_short_combine_demo_trains_hinted_and_rewarded_interactions(tmp_path):
    from clawrl.buffer import Readiness, RolloutBuffer
    from clawrl.cli import main
    from clawrl.config import TrainConfig
    from clawrl.store import TurnStore
    from gateway_support import build_tiny_model, model_cache_dir

    model = build_tiny_model(model_cache_dir())
    run_dir = tmp_path / "demo"
    assert main(["demo", "method=combine", "demo.user=student", f"model.path={model}", "model.name=tiny",
                 f"run_dir={run_dir}", "demo.interactions=4", "demo.eval_every=4", "demo.eval_prompts=2",
                 "train.batch_size=2", "engine.threads=1", "logging.level=WARNING"]) == 0
    results = json.loads((run_dir / "demo" / "results.json").read_text())
    assert results["method"] == "combine" and [p["train_step"] for p in results["points"]] == [0, 2]
    store = TurnStore(run_dir, create=False)
    try:
        trained = [s for s in RolloutBuffer(store, TrainConfig(), Readiness(teacher=True)).samples()
                   if s["state"] == "trained"]
        assert len(trained) == 4
        # a correction ("just the number") trains through its hint; each trained turn had a signal
        assert any(s["opd_state"] == "scored" for s in trained)
        assert all(s["rl_signal"] or s["opd_state"] == "scored" for s in trained)
    finally:
        store.close()


def test_frozen_teacher_engine_scores_when_opd_teacher_is_a_path(model_dir, tmp_path):
    app, learner, store = make_app(model_dir, tmp_path, "method=opd", f"opd.teacher={model_dir}")
    assert learner.method.teacher_engine is not None and learner.method.teacher_engine is not learner.engine
    with ServerThread(app) as srv:
        interaction(srv.url, "Hi", "Too long. One line, please.")
        interaction(srv.url, "What is 7+5?", "Just the number, please.")
        s = wait_for(srv.url, lambda s: s["training"]["train_step"] == 1)
        assert s["training"]["opd"]["teacher"] == str(model_dir) and s["training"]["opd"]["opd_samples_trained"] == 2
    rows = store.connection().execute("SELECT teacher FROM opd_hints WHERE state = 'scored'").fetchall()
    assert rows == [(str(model_dir),)] * 2


def test_model_hint_judge_votes_with_a_frozen_engine_not_the_served_policy(model_dir, tmp_path):
    app, learner, store = make_app(model_dir, tmp_path, "method=combine", "opd.hint_judge=model", "opd.votes=1")
    opd = learner.method.opd  # combine's OPD part
    assert opd.judge_engine is not None and opd.judge_engine is not learner.engine
    assert opd.worker.hint_judge.kind == "model" and opd.worker.hint_judge.votes == 1
    assert learner.method.rl.worker is not None  # combine keeps the reward judge


def test_combine_with_hinted_sample_and_a_frozen_base_teacher_trains_the_hinted_replies(model_dir, tmp_path):
    # opd.teacher=base: a frozen copy of the starting policy samples under each hint; the step trains the
    # replies it sampled (hinted_tokens) beside the turns' own signals
    app, learner, store = make_app(model_dir, tmp_path, "method=combine", "train.batch_size=2",
                                   "opd.hinted_sample=true", "opd.hinted_temperature=0", "opd.hinted_max_tokens=4",
                                   "opd.teacher=base")
    teacher = learner.method.opd.teacher_engine
    assert teacher is not None and teacher is not learner.engine
    with ServerThread(app) as srv:
        interaction(srv.url, "Hi", "Too long. One line, please.")
        interaction(srv.url, "What is 7+5?", "No, that's wrong. Just the number, please.")
        s = wait_for(srv.url, lambda s: s["training"]["train_step"] == 1)
        assert s["training"]["opd"]["opd_samples_trained"] == 2
        assert teacher.model_info().weight_version == 0  # the frozen teacher never takes the new weights
    rows = store.connection().execute(
        "SELECT teacher, hinted_ids FROM opd_hints WHERE state = 'scored' ORDER BY turn_id").fetchall()
    assert [r[0] for r in rows] == ["base", "base"] and all(r[1] for r in rows)
    step = next(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
                if '"kind": "train_step"' in line)
    assert step["samples_both"] + step["samples_opd_only"] == 2
    assert 2 <= step["hinted_tokens"] <= 8 and step["hinted_nll"] > 0
