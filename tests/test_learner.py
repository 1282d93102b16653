"""Learning beside serving: feedback becomes judged samples, a train step, a new weight version that
serves; pausing stops training but not serving; a restart resumes version and step; a trainer's
self-pause shows in /admin/status; train.enabled=false serves and records only."""
from __future__ import annotations

import shutil
import time
import uuid

import httpx
import pytest

from clawrl.config import compose
from clawrl.engines import make_engine
from clawrl.gateway.app import create_app
from clawrl.orchestration.learner import attach_learning
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore

from gateway_support import ServerThread, build_tiny_model, model_cache_dir


@pytest.fixture(scope="module")
def model_dir():
    return build_tiny_model(model_cache_dir())


def make_app(model_dir, run_dir, *overrides):
    cfg = compose([f"model.path={model_dir}", "model.name=tiny", f"run_dir={run_dir}", "train.batch_size=2",
                   "train.lr=1e-2", "train.save_every=1", "logging.wandb.mode=disabled", "engine.threads=1",
                   *overrides])
    engine = make_engine(cfg)
    store = TurnStore(cfg.run_dir)
    app = create_app(cfg, engine, SessionLinker(store, idle_timeout_s=cfg.sessions.idle_timeout_s))
    learner = attach_learning(app, cfg, engine, store)
    return app, learner, store


def chat(url, messages, **headers):
    r = httpx.post(url + "/v1/chat/completions", timeout=60, headers=headers,
                   json={"model": "tiny", "messages": messages, "max_tokens": 12})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def interaction(url, question, feedback):
    """A question, the reply, and the user's feedback (the reply's next state), ending the session.
    Each interaction is its own session, named by header as the OpenClaw plugin does."""
    session = {"X-Session-Id": uuid.uuid4().hex}
    asked = [{"role": "user", "content": question}]
    reply = chat(url, asked, **session)
    chat(url, asked + [{"role": "assistant", "content": reply}, {"role": "user", "content": feedback}],
         **session, **{"X-Session-Done": "1"})


def status(url):
    return httpx.get(url + "/admin/status", timeout=30).json()


def wait_for(url, predicate, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = status(url)
        if predicate(s):
            return s
        time.sleep(0.1)
    raise AssertionError(f"condition not reached; last status: {s}")


def test_feedback_is_judged_trained_and_served_as_a_new_weight_version(model_dir, tmp_path):
    app, learner, store = make_app(model_dir, tmp_path)
    with ServerThread(app) as srv:
        interaction(srv.url, "Hi", "Thanks!")
        interaction(srv.url, "Tell me a story about a cat.", "No, that's wrong.")
        s = wait_for(srv.url, lambda s: s["training"]["train_step"] == 1)
        t = s["training"]
        assert s["weight_version"] == 1 and t["weight_version"] == 1
        assert t["samples"]["judged"] == 2 and t["samples"]["trained"] == 2
        # the feedback turns themselves end their sessions: skipped, with the reason
        assert t["samples"]["skipped_by_reason"] == {"no_next_state": 2}
        assert t["last_loss"] is not None and t["paused"] is False
        assert httpx.get(srv.url + "/healthz").json()["weight_version"] == 1
        # new replies are produced by the new weights, tagged with their version
        turn_id = int(httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).headers["x-turn-ids"])
    assert set(store.get_turn(turn_id)["weight_versions"]) == {1}
    rewards = sorted(s["reward"] for s in learner.buffer.samples() if s["state"] == "trained")
    assert rewards == [-1.0, 1.0]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert any('"kind": "train_step"' in line for line in lines)
    assert (tmp_path / "checkpoints" / "step_1").is_dir()


def test_pause_stops_training_while_serving_continues(model_dir, tmp_path):
    app, learner, store = make_app(model_dir, tmp_path)
    with ServerThread(app) as srv:
        paused = httpx.post(srv.url + "/admin/pause").json()
        assert paused["paused"] is True
        interaction(srv.url, "Hi", "Thanks!")
        interaction(srv.url, "Hi there, tell me a story about a cat.", "Great, thank you.")
        s = wait_for(srv.url, lambda s: s["training"]["samples"]["ready"] == 2)
        time.sleep(1.0)  # several polls of the train loop
        s = status(srv.url)
        assert s["training"]["paused"] and s["training"]["paused_reason"] == "paused by the admin"
        assert s["training"]["train_step"] == 0 and s["weight_version"] == 0
        assert chat(srv.url, [{"role": "user", "content": "Hi"}])  # serving is not paused
        assert httpx.post(srv.url + "/admin/resume").json()["paused"] is False
        s = wait_for(srv.url, lambda s: s["training"]["train_step"] == 1)
        assert s["weight_version"] == 1 and s["training"]["samples"]["trained"] == 2


def test_restart_resumes_weight_version_and_step_from_the_checkpoint(model_dir, tmp_path):
    app, learner, store = make_app(model_dir, tmp_path)
    with ServerThread(app) as srv:
        interaction(srv.url, "Hi", "Thanks!")
        interaction(srv.url, "Tell me a story about a cat.", "That's not right.")
        wait_for(srv.url, lambda s: s["training"]["train_step"] == 1)
        trained = dict(learner.trainer.model.state_dict())
    store.close()

    app, learner, store = make_app(model_dir, tmp_path)
    with ServerThread(app) as srv:
        s = status(srv.url)
        assert s["weight_version"] == 1 and s["training"]["train_step"] == 1
        assert s["training"]["samples"]["trained"] == 2  # trained once, not again after the restart
        for name, value in learner.trainer.model.state_dict().items():
            assert value.equal(trained[name]), name
        interaction(srv.url, "Hi", "Thanks!")
        interaction(srv.url, "Hi", "Perfect, thanks.")
        s = wait_for(srv.url, lambda s: s["training"]["train_step"] == 2)
        assert s["weight_version"] == 2
    store.close()


def test_a_clean_stop_checkpoints_the_steps_save_every_had_not_reached(model_dir, tmp_path):
    app, learner, store = make_app(model_dir, tmp_path, "train.save_every=10")
    with ServerThread(app) as srv:
        interaction(srv.url, "Hi", "Thanks!")
        interaction(srv.url, "Tell me a story about a cat.", "That's not right.")
        wait_for(srv.url, lambda s: s["training"]["train_step"] == 1)
        assert not (tmp_path / "checkpoints" / "step_1").exists()  # save_every=10 has not come round
        trained = dict(learner.trainer.model.state_dict())
    store.close()  # leaving the block stopped the server as SIGINT/SIGTERM does
    assert (tmp_path / "checkpoints" / "step_1").is_dir()

    app, learner, store = make_app(model_dir, tmp_path, "train.save_every=10")
    with ServerThread(app) as srv:
        s = status(srv.url)
        assert s["weight_version"] == 1 and s["training"]["train_step"] == 1
        assert s["training"]["samples"]["trained"] == 2 and s["training"]["samples"]["ready"] == 0
        for name, value in learner.trainer.model.state_dict().items():
            assert value.equal(trained[name]), name
    store.close()


def test_samples_requeued_after_a_crash_before_any_checkpoint_train_again_not_dropped_as_stale(model_dir, tmp_path):
    app, learner, store = make_app(model_dir, tmp_path, "train.save_every=10", "train.max_weight_lag=0")
    with ServerThread(app) as srv:
        interaction(srv.url, "Hi", "Thanks!")
        interaction(srv.url, "Tell me a story about a cat.", "That's not right.")
        wait_for(srv.url, lambda s: s["training"]["train_step"] == 1)
    store.close()
    # What kill -9 leaves: version 1 was served and its samples marked trained, but no checkpoint exists
    # (the clean stop above saved one; a crash would not have).
    for saved in (tmp_path / "checkpoints").glob("step_*"):
        shutil.rmtree(saved)

    app, learner, store = make_app(model_dir, tmp_path, "train.save_every=10", "train.max_weight_lag=0")
    with ServerThread(app) as srv:
        # the base weights come back as version 2; the two samples were sampled from them (version 0)
        s = wait_for(srv.url, lambda s: s["training"]["train_step"] == 1)
        assert s["weight_version"] == 3
        assert s["training"]["samples"]["trained"] == 2
        assert "stale" not in s["training"]["samples"]["skipped_by_reason"]
    store.close()


def test_trainer_self_pause_after_bad_steps_shows_in_status_and_serving_continues(model_dir, tmp_path):
    app, learner, store = make_app(model_dir, tmp_path, "train.max_bad_steps=1")

    def blow_up(module, args, output):  # a numerical blow-up inside the trainer's copy of the model
        output.logits.fill_(float("nan"))
        return output

    learner.trainer.model.register_forward_hook(blow_up)
    with ServerThread(app) as srv:
        interaction(srv.url, "Hi", "Thanks!")
        interaction(srv.url, "Tell me a story about a cat.", "No, that's wrong.")
        # the trainer pauses inside the step; the learner marks the batch skipped right after
        s = wait_for(srv.url, lambda s: s["training"]["paused"]
                     and "train_step_nonfinite_loss" in s["training"]["samples"]["skipped_by_reason"])
        t = s["training"]
        assert "non-finite" in t["paused_reason"] and "train.max_bad_steps=1" in t["paused_reason"]
        assert t["train_step"] == 0 and s["weight_version"] == 0  # the bad step changed nothing served
        assert t["samples"]["skipped_by_reason"].get("train_step_nonfinite_loss") == 2
        assert chat(srv.url, [{"role": "user", "content": "Hi"}])
        assert httpx.post(srv.url + "/admin/resume").json() == {"paused": False, "paused_reason": None}


def test_training_disabled_serves_and_records_only(model_dir, tmp_path):
    app, learner, store = make_app(model_dir, tmp_path, "train.enabled=false")
    assert learner is None
    with ServerThread(app) as srv:
        interaction(srv.url, "Hi", "Thanks!")
        s = status(srv.url)
        assert s["training"] == {"enabled": False, "method": "rl"}
        assert s["turns"] == 2 and s["turns_with_next_state"] == 1
        r = httpx.post(srv.url + "/admin/pause")
        assert r.status_code == 409 and r.json()["error"]["code"] == "training_disabled"
    assert not (tmp_path / "checkpoints").exists()


def test_admin_routes_need_the_admin_key(model_dir, tmp_path):
    app, learner, store = make_app(model_dir, tmp_path, "server.api_key=user-key", "server.admin_key=admin-key")
    with ServerThread(app) as srv:
        assert httpx.post(srv.url + "/admin/pause", headers={"Authorization": "Bearer user-key"}).status_code == 401
        ok = httpx.post(srv.url + "/admin/pause", headers={"Authorization": "Bearer admin-key"})
        assert ok.status_code == 200 and ok.json()["paused"] is True


@pytest.mark.parametrize("method", ["sft", "ppo"])
def test_unknown_methods_are_a_one_line_error(method, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import sys; from clawrl.cli import main; sys.exit(main())",
                           "serve", f"method={method}", f"run_dir={tmp_path}"], capture_output=True, text=True,
                          timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"unknown method '{method}'" in lines[0]
