"""clawrl replay: a run's recorded train batches, retrained offline from the version-0 weights, give
the run's weights bit for bit at every checkpoint (a crash and a resume included), beside a live
server that holds the run's lock, writing nothing in it; overrides change what the replay trains;
a changed record (a batch dropped, two steps swapped) no longer reproduces the run; bad input is a
one-line error that leaves nothing behind."""
from __future__ import annotations

import json
from array import array
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clawrl.buffer import RolloutBuffer
from clawrl.cli import main
from clawrl.config import compose
from clawrl.orchestration.replay import replay
from clawrl.run_lock import RunDirLock
from clawrl.store import TurnStore

from gateway_support import ServerThread
from test_learner import interaction, make_app, model_dir, wait_for  # noqa: F401  (model_dir: a fixture)

RUN = ("train.batch_size=2", "train.lr=1e-2", "train.save_every=1", "train.keep_last=20",
       "logging.wandb.mode=disabled", "engine.threads=1")
FEEDBACK = [("Hi", "Thanks!"), ("Tell me a story about a cat.", "No, that's wrong."),
            ("What is 2 + 2?", "Perfect, thanks."), ("Name a colour.", "That's not right."),
            ("Say hello.", "Great, thank you."), ("Count to three.", "No, wrong.")]


def replay_cfg(model_dir, *extra):
    return compose([f"model.path={model_dir}", "model.name=tiny", *RUN, *extra])


def train_steps(url, pairs, step):
    for question, feedback in pairs:
        interaction(url, question, feedback)
    wait_for(url, lambda s: s["training"]["train_step"] >= step and s["training"]["samples"]["ready"] < 2)


def checkpoint(run: Path, step: int) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint ``step``: the weights and the optimizer state, which only the newest
    checkpoint keeps (the RNG state is left out: the online run's process also sampled replies from
    it, and training draws nothing from it)."""
    d = run / "checkpoints" / f"step_{step}"
    out = {f"weights/{k}": v for k, v in load_file(str(d / "weights.safetensors")).items()}
    state = torch.load(d / "trainer_state.pt", weights_only=True)
    if (d / "optimizer.pt").exists():
        optimizer = torch.load(d / "optimizer.pt", weights_only=True)["optimizer"]
        for pid, moments in optimizer["state"].items():
            out.update({f"optimizer/{pid}/{k}": v for k, v in moments.items()})
    out["step"] = torch.tensor(state["step"])
    out["weight_version"] = torch.tensor(state["weight_version"])
    return out


def steps_of(run: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (run / "checkpoints").glob("step_*"))


def differing(a: Path, b: Path, step: int) -> list[str]:
    x, y = checkpoint(a, step), checkpoint(b, step)
    assert x.keys() == y.keys()
    return [k for k in x if not torch.equal(x[k], y[k])]


def snapshot_of(run: Path) -> dict[str, bytes]:
    """What a replay must not touch in D: every file but SQLite's own shared-memory and log files."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and not p.name.endswith(("-shm", "-wal"))}


@pytest.fixture(scope="module")
def trained_run(model_dir, tmp_path_factory):
    """Run D: three train steps with a checkpoint at each, then stopped."""
    run = tmp_path_factory.mktemp("replay") / "D"
    app, learner, store = make_app(model_dir, run, *RUN[2:])
    with ServerThread(app) as srv:
        for i in range(3):
            train_steps(srv.url, FEEDBACK[2 * i:2 * i + 2], i + 1)
    store.close()
    assert steps_of(run) == [1, 2, 3]
    return run


def test_a_replay_beside_the_live_server_reproduces_every_checkpoint_bit_for_bit(model_dir, tmp_path):
    run = tmp_path / "D"
    app, learner, store = make_app(model_dir, run, *RUN[2:])
    with ServerThread(app) as srv:
        for i in range(3):
            train_steps(srv.url, FEEDBACK[2 * i:2 * i + 2], i + 1)
        with RunDirLock(run):  # what clawrl serve holds; the replay neither needs nor takes it
            before = snapshot_of(run)
            done = replay(replay_cfg(model_dir), run, tmp_path / "D2")
            assert snapshot_of(run) == before  # nothing written in D
    store.close()
    out = tmp_path / "D2"
    assert (done.steps, done.updated) == (3, 3)
    assert steps_of(run) == steps_of(out) == done.checkpoints == [1, 2, 3]
    for step in (1, 2, 3):
        assert differing(run, out, step) == [], step
    # D2 is a run directory of its own: metrics per step (the same losses), its lock free again
    online = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    replayed = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    loss = {m["step"]: m["loss"] for m in online if m["kind"] == "train_step"}
    assert {m["step"]: m["loss"] for m in replayed if m["kind"] == "train_step"} == loss
    RunDirLock(out).acquire().release()
    assert json.loads((out / "replay.json").read_text())["recorded_steps"] == 3


def test_a_run_killed_and_resumed_replays_bit_for_bit(model_dir, tmp_path):
    run = tmp_path / "D"
    app, learner, store = make_app(model_dir, run, *RUN[2:])
    step_1 = run / "checkpoints" / "step_1"
    with ServerThread(app) as srv:
        train_steps(srv.url, FEEDBACK[0:2], 1)
        kept = {name: (step_1 / name).read_bytes() for name in ("optimizer.pt", "manifest.json")}
        train_steps(srv.url, FEEDBACK[2:4], 2)
    store.close()
    # What kill -9 between step 2's weight push and its checkpoint leaves: step 2 trained and its samples
    # marked, no checkpoint of it, and step 1 still the newest, optimizer state and all. The restart
    # resumes step 1 and trains those samples again.
    shutil.rmtree(run / "checkpoints" / "step_2")
    assert not (step_1 / "optimizer.pt").exists()  # dropped once step 2's checkpoint was complete
    for name, data in kept.items():
        (step_1 / name).write_bytes(data)
    app, learner, store = make_app(model_dir, run, *RUN[2:])
    with ServerThread(app) as srv:
        wait_for(srv.url, lambda s: s["training"]["train_step"] == 2)
        train_steps(srv.url, FEEDBACK[4:6], 3)
    store.close()
    lost = [s for s in RolloutBuffer(TurnStore(run), compose([]).train).samples() if s["requeues"]]
    assert len(lost) == 2 and all(s["state"] == "trained" and s["train_step"] >= 2 for s in lost)

    out = tmp_path / "D2"
    assert main(["replay", "--run-dir", str(run), "--out", str(out), f"model.path={model_dir}", "model.name=tiny",
                 *RUN]) == 0
    assert steps_of(run) == steps_of(out) == [1, 2, 3]
    for step in (1, 2, 3):
        assert differing(run, out, step) == [], step


def test_overrides_change_what_the_replay_trains_and_only_there(model_dir, trained_run, tmp_path):
    before = snapshot_of(trained_run)
    done = replay(replay_cfg(model_dir, "train.lr=1e-3"), trained_run, tmp_path / "D2")
    assert snapshot_of(trained_run) == before
    assert done.checkpoints == [1, 2, 3]
    assert any(k.startswith("weights/") for k in differing(trained_run, tmp_path / "D2", 1))
    lrs = {json.loads(l).get("lr") for l in (tmp_path / "D2" / "metrics.jsonl").read_text().splitlines()}
    assert lrs == {1e-3}


LAST_OF_STEP_1 = "train_step = 1 AND position = (SELECT MAX(position) FROM train_batches WHERE train_step = 1)"


@pytest.mark.parametrize("change", ["move one sample of step 1 into step 2", "swap steps 1 and 2"])
def test_a_changed_record_no_longer_reproduces_the_run(model_dir, trained_run, tmp_path, change):
    """The bit-for-bit comparison can fail: the same replay on a record with one batch changed does."""
    run = tmp_path / "D"
    shutil.copytree(trained_run, run)
    c = sqlite3.connect(run / "clawrl.sqlite")
    with c:
        if change.startswith("move"):
            c.execute(f"UPDATE train_batches SET train_step = 2, position = 99 WHERE {LAST_OF_STEP_1}")
        else:
            c.execute("UPDATE train_batches SET train_step = -train_step WHERE train_step IN (1, 2)")
            c.execute("UPDATE train_batches SET train_step = 3 + train_step WHERE train_step IN (-1, -2)")
    c.close()
    replay(replay_cfg(model_dir), run, tmp_path / "D2")
    for step in (1, 2, 3):
        assert any(k.startswith("weights/") for k in differing(trained_run, tmp_path / "D2", step)), step


def test_a_record_that_lost_a_trained_sample_is_refused(model_dir, trained_run, tmp_path, capsys):
    run = tmp_path / "D"
    shutil.copytree(trained_run, run)
    c = sqlite3.connect(run / "clawrl.sqlite")
    with c:
        c.execute(f"DELETE FROM train_batches WHERE {LAST_OF_STEP_1}")
    c.close()
    code, err = run_cli(capsys, "--run-dir", str(run), "--out", str(tmp_path / "D2"), f"model.path={model_dir}")
    assert code == 2 and "trained 1 sample(s) that no recorded train batch holds" in err
    assert not (tmp_path / "D2").exists()


def run_cli(capsys, *args):
    code = main(["replay", *args])
    err = capsys.readouterr().err.strip()
    return code, err


def test_bad_input_is_a_one_line_error_that_leaves_nothing(model_dir, trained_run, tmp_path, capsys):
    out = tmp_path / "D2"
    code, err = run_cli(capsys, "--run-dir", str(tmp_path / "missing"), "--out", str(out))
    assert code == 2 and err == f"clawrl: --run-dir {tmp_path / 'missing'}: no such run directory"

    code, err = run_cli(capsys, "--run-dir", str(trained_run), "--out", str(trained_run))
    assert code == 2 and "is the run directory itself" in err and len(err.splitlines()) == 1

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    code, err = run_cli(capsys, "--run-dir", str(trained_run), "--out", str(busy))
    assert code == 2 and "exists and is not empty" in err and len(err.splitlines()) == 1

    fresh = tmp_path / "fresh"  # a run that served but never trained
    store = TurnStore(fresh)
    RolloutBuffer(store, compose([]).train)
    store.close()
    code, err = run_cli(capsys, "--run-dir", str(fresh), "--out", str(out))
    assert code == 2 and "no sample was trained in this run" in err and len(err.splitlines()) == 1
    assert not out.exists()

    old = tmp_path / "old"  # recorded before train_batches existed
    shutil.copytree(trained_run, old)
    c = sqlite3.connect(old / "clawrl.sqlite")
    with c:
        c.execute("DROP TABLE train_batches")
        c.execute("UPDATE meta SET value = '4' WHERE key = 'buffer_schema_version'")
    c.close()
    code, err = run_cli(capsys, "--run-dir", str(old), "--out", str(out))
    assert code == 2 and "recorded before clawrl kept each train step's batch" in err and "cannot be replayed" in err
    assert len(err.splitlines()) == 1 and not out.exists()

    code, err = run_cli(capsys, "--run-dir", str(trained_run), "--out", str(out), "train.lr=-1")
    assert code == 2 and err.splitlines()[-1].startswith("clawrl: train.lr=-1") and not out.exists()


# ---------------------------------------------------------------- the run's stored config


def test_a_run_stores_its_config_without_secrets(model_dir, trained_run, tmp_path):
    from clawrl.run_config import CONFIG_FILE, save_run_config

    stored = (trained_run / CONFIG_FILE).read_text()
    assert f"path: {model_dir}" in stored and "lr: 0.01" in stored and "batch_size: 2" in stored
    secret, admin = "sk-test-0123456789abcdefghij", "admin-key-9876543210"
    cfg = compose([f"server.api_key={secret}", f"server.admin_key={admin}", "train.lr=3e-4"])
    path = save_run_config(cfg, tmp_path / "R")
    text = path.read_text()
    assert secret not in text and admin not in text and "api_key: null" in text and "admin_key: null" in text
    hf = "hf_" + "A1b2C3d4" * 5  # a token pasted into another value is masked too
    text = save_run_config(compose([f"opd.teacher=/models/{hf}/m"]), tmp_path / "S").read_text()
    assert hf not in text and "[REDACTED:hf_token]" in text
    # a restart with another config keeps the earlier one
    save_run_config(compose(["train.lr=1e-3"]), tmp_path / "R")
    assert "lr: 0.0003" in (tmp_path / "R" / "run_config.1.yaml").read_text()
    assert "lr: 0.001" in path.read_text()
    save_run_config(compose(["train.lr=1e-3"]), tmp_path / "R")  # the same again: nothing new kept
    assert not (tmp_path / "R" / "run_config.2.yaml").exists()


def test_replay_and_export_read_the_stored_config_and_the_command_line_wins(model_dir, trained_run, tmp_path,
                                                                            capsys):
    out = tmp_path / "D2"
    assert main(["replay", "--run-dir", str(trained_run), "--out", str(out)]) == 0  # no override at all
    err = capsys.readouterr().err
    assert f"config from {trained_run / 'run_config.yaml'}: " in err and f"model.path={model_dir}" in err
    assert "train.lr=0.01" in err
    for step in (1, 2, 3):
        assert differing(trained_run, out, step) == [], step

    assert main(["replay", "--run-dir", str(trained_run), "--out", str(tmp_path / "D3"), "train.lr=1e-3"]) == 0
    err = capsys.readouterr().err
    assert "overridden on the command line: train.lr" in err and "train.lr=0.01" not in err
    lrs = {json.loads(l).get("lr") for l in (tmp_path / "D3" / "metrics.jsonl").read_text().splitlines()}
    assert lrs == {1e-3}

    assert main(["export-model", "--run-dir", str(trained_run), "--out", str(tmp_path / "E")]) == 0
    err = capsys.readouterr().err
    assert f"model.path={model_dir}" in err
    assert json.loads((tmp_path / "E" / "clawrl_export.json").read_text())["base_model"] == str(model_dir)


def test_an_old_run_without_a_stored_config_replays_from_the_command_line(model_dir, trained_run, tmp_path, capsys):
    run = tmp_path / "D"
    shutil.copytree(trained_run, run)
    (run / "run_config.yaml").unlink()
    out = tmp_path / "D2"
    assert main(["replay", "--run-dir", str(run), "--out", str(out), f"model.path={model_dir}", "model.name=tiny",
                 *RUN]) == 0
    err = capsys.readouterr().err
    assert "no stored run_config.yaml (a run started before clawrl stored its config)" in err
    assert differing(run, out, 3) == []


# ---------------------------------------------------------------- opd and combine


def opd_run(model_dir, run: Path, method: str) -> Path:
    """Two train steps of ``method`` on teacher-scored corrections (and, for combine, rewards)."""
    app, learner, store = make_app(model_dir, run, *RUN[2:], f"method={method}", "opd.topk=4")
    pairs = [("Hi", "Too long. One line, please."), ("What is 7+5?", "Just the number, please."),
             ("Tell me a story about a cat.", "No, that's wrong. One line, please."),
             ("Name a colour.", "Shorter, please.")]
    with ServerThread(app) as srv:
        for i in range(2):
            train_steps(srv.url, pairs[2 * i:2 * i + 2], i + 1)
    store.close()
    assert steps_of(run) == [1, 2]
    return run


@pytest.mark.parametrize("method", ["opd", "combine"])
def test_opd_and_combine_runs_replay_bit_for_bit_and_with_overrides(model_dir, tmp_path, method, capsys):
    run = opd_run(model_dir, tmp_path / "D", method)
    online = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["opd_tokens"] > 0 for m in online if m["kind"] == "train_step")  # the teacher's signal trained
    assert main(["replay", "--run-dir", str(run), "--out", str(tmp_path / "D2")]) == 0
    assert f"method={method}" in capsys.readouterr().err
    for step in (1, 2):
        assert differing(run, tmp_path / "D2", step) == [], step
    replayed = [json.loads(l) for l in (tmp_path / "D2" / "metrics.jsonl").read_text().splitlines()]
    assert ([m["loss"] for m in replayed if m["kind"] == "train_step"]
            == [m["loss"] for m in online if m["kind"] == "train_step"])

    out = tmp_path / "lr"
    assert main(["replay", "--run-dir", str(run), "--out", str(out), "train.lr=1e-3"]) == 0
    assert steps_of(out) == [1, 2] and any(k.startswith("weights/") for k in differing(run, out, 2))
    if method == "combine":  # the rewards alone, the teacher alone: each trains otherwise
        for other in ("rl", "opd"):
            out = tmp_path / other
            assert main(["replay", "--run-dir", str(run), "--out", str(out), f"method={other}"]) == 0
            assert steps_of(out) == [1, 2] and any(k.startswith("weights/") for k in differing(run, out, 2)), other
    else:  # an opd run recorded no rewards: combine (w_opd=1) trains exactly what opd trained
        out = tmp_path / "combine"
        assert main(["replay", "--run-dir", str(run), "--out", str(out), "method=combine"]) == 0
        assert differing(run, out, 2) == []


# ---------------------------------------------------------------- held-out curves side by side


def side_turns(db: Path) -> list[tuple]:
    """Every held-out reply a run's gateway served: (weight versions, question, reply), sorted."""
    c = sqlite3.connect(db)
    try:
        rows = c.execute("SELECT weight_versions, messages, response_text FROM turns WHERE turn_type = 'side'")
        return sorted((max(array("q", v)), m, r) for v, m, r in rows)
    finally:
        c.close()


@pytest.fixture(scope="module")
def demo_run(model_dir, tmp_path_factory):
    """A short clawrl demo: held-out measurements at train steps 0, 2 and 4."""
    run = tmp_path_factory.mktemp("replay-demo") / "D"
    assert main(["demo", "method=rl", f"model.path={model_dir}", "model.name=tiny", f"run_dir={run}",
                 "demo.interactions=8", "demo.eval_every=4", "demo.eval_prompts=6", "train.batch_size=2",
                 "train.lr=1e-2", "engine.threads=1", "logging.level=WARNING"]) == 0
    points = json.loads((run / "demo" / "results.json").read_text())["points"]
    assert [p["train_step"] for p in points] == [0, 2, 4]
    return run


def test_held_out_replay_measures_as_the_demo_did_and_draws_both_curves(demo_run, tmp_path, capsys):
    out = tmp_path / "same"
    assert main(["replay", "--run-dir", str(demo_run), "--out", str(out), "--held-out"]) == 0
    assert "held out at recorded step 4: preference_rate" in capsys.readouterr().err
    data = json.loads((out / "heldout.json").read_text())
    assert data["kind"] == "demo" and [p["train_step"] for p in data["replay"]] == [0, 2, 4]
    assert data["replay"] == [{k: p[k] for k in ("train_step", "preference_rate", "correct")}
                              for p in data["original"]]
    # the same questions, seeds and weights: every held-out reply is the one the demo got, at each version
    assert side_turns(out / "heldout" / "clawrl.sqlite") == side_turns(demo_run / "clawrl.sqlite")
    assert (out / "heldout.png").read_bytes().startswith(b"\x89PNG")

    out = tmp_path / "lr"
    assert main(["replay", "--run-dir", str(demo_run), "--out", str(out), "--held-out", "train.lr=1e-1"]) == 0
    data = json.loads((out / "heldout.json").read_text())
    assert data["overrides"] == ["train.lr=1e-1"] and data["original_values"] == {"train.lr": 0.01}
    assert [p["train_step"] for p in data["replay"]] == [0, 2, 4]
    replayed, online = side_turns(out / "heldout" / "clawrl.sqlite"), side_turns(demo_run / "clawrl.sqlite")
    first = [t for t in online if t[0] == 0]
    assert len(first) == 6 and [t for t in replayed if t[0] == 0] == first  # step 0: the base weights, both
    assert replayed != online  # after: other weights, other replies


def test_held_out_needs_a_held_out_curve(trained_run, tmp_path, capsys):
    code, err = run_cli(capsys, "--run-dir", str(trained_run), "--out", str(tmp_path / "D2"), "--held-out")
    assert code == 2 and "has no held-out curve to compare with" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "D2").exists()


def test_held_out_replay_of_an_environment_run_evaluates_as_its_learner_did(tiny_model_dir, tmp_path, capsys):
    from test_env_training import GUESS, learner_run

    run = tmp_path / "D"
    learner, store = learner_run(tiny_model_dir, run, f"env.name={GUESS}", "env.group_size=2", "train.batch_size=2",
                                 "env.max_turns=2", "env.max_tokens_per_turn=6", "env.eval_every=1",
                                 "env.eval_split=test", "env.max_train_steps=2", "train.lr=1e-2")
    store.close()
    evals = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if "eval/success_rate" in m}
    assert sorted(evals) == [0, 1, 2]
    assert main(["replay", "--run-dir", str(run), "--out", str(tmp_path / "D2"), "--held-out"]) == 0
    data = json.loads((tmp_path / "D2" / "heldout.json").read_text())
    assert data["kind"] == "env" and data["metric"] == "success_rate"
    assert data["replay"] == [{"train_step": s, "success_rate": m["eval/success_rate"],
                               "mean_reward": m["eval/mean_reward"]} for s, m in sorted(evals.items())]
    assert main(["replay", "--run-dir", str(run), "--out", str(tmp_path / "D3"), "--held-out", "train.lr=1e-4"]) == 0
    data = json.loads((tmp_path / "D3" / "heldout.json").read_text())
    assert [p["train_step"] for p in data["replay"]] == [0, 1, 2] and data["original_values"] == {"train.lr": 0.01}
