"""``clawrl demo``: the simulated users' feedback means to the judge what the user means, held-out
questions stay held out, and a short demo runs end to end (interactions are trained, measurements
are not) and writes its table and plot."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from clawrl.cli import main
from clawrl.demo.users import USERS, Question, ask
from clawrl.embedded.corpus import is_held_out
from clawrl.judges.base import JudgeInput
from clawrl.judges.rules import RulesJudge
from clawrl.store import TurnStore

from gateway_support import build_tiny_model, model_cache_dir

REPLIES = {  # 7 + 5, as the embedded model phrases additions; the users judge the form, not the sum
    "12": {"bare"}, "12.": {"bare"}, "13": {"bare"}, "7 + 5 = 12": {"worked"}, "7 + 5 = 12.": {"worked"},
    "7 + 5 = 13": {"worked"}, "7 + 6 = 13": set(), "The answer is 12.": set(), "7 plus 5 is 12.": set(),
    "Hello!": set(),
}


@pytest.mark.parametrize("name", ["bare", "worked"])
def test_simulated_feedback_is_judged_the_way_the_user_means_it(name):
    user, judge, rng = USERS[name], RulesJudge(), random.Random(0)
    q = Question("What is 7 + 5?", 7, 5)
    for reply, pleases in REPLIES.items():
        assert user.satisfied(q, reply) == (name in pleases), reply
        for _ in range(8):  # every phrasing the user picks from
            feedback = user.feedback(q, reply, rng)
            verdict = judge.score(JudgeInput(1, q.text, reply, None, [{"role": "user", "content": feedback}]))
            assert verdict.signal and verdict.score == (1 if name in pleases else -1), (reply, feedback)


def test_held_out_questions_never_come_up_in_interactions():
    rng = random.Random(3)
    assert all(is_held_out(q.a, q.b) for q in (ask(rng, held_out=True) for _ in range(200)))
    assert not any(is_held_out(q.a, q.b) for q in (ask(rng, held_out=False) for _ in range(200)))


def test_short_demo_trains_on_interactions_not_on_measurements_and_writes_table_and_plot(tmp_path, capsys):
    model = build_tiny_model(model_cache_dir())
    run_dir = tmp_path / "demo"
    code = main(["demo", "method=rl", f"model.path={model}", "model.name=tiny", f"run_dir={run_dir}",
                 "demo.interactions=4", "demo.eval_every=2", "demo.eval_prompts=3", "train.batch_size=2",
                 "logging.wandb.mode=disabled", "engine.threads=1", "logging.level=WARNING"])
    assert code == 0
    results = json.loads((run_dir / "demo" / "results.json").read_text())
    points = results["points"]
    assert [p["interactions"] for p in points] == [0, 2, 4]
    assert [p["weight_version"] for p in points] == [0, 1, 2]  # measured after each batch was trained
    assert [p["train_step"] for p in points] == [0, 1, 2]
    assert all(0.0 <= p["rate"] <= 1.0 for p in points)
    assert (run_dir / "demo" / "preference_rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (run_dir / "demo" / "results.md").read_text()
    assert table.splitlines()[0].startswith("| interactions | held-out rate") and "rise:" in table
    assert "rise:" in capsys.readouterr().out

    store = TurnStore(run_dir, create=False)
    try:
        from clawrl.buffer import RolloutBuffer
        from clawrl.config import TrainConfig

        buffer = RolloutBuffer(store, TrainConfig())
        buffer.sync()  # the last measurement's turns closed after the learner's last look
        samples = buffer.samples()
        by_turn = {s["turn_id"]: s for s in samples}
        turns = list(store.iter_turns())
        questions = [t for t in turns if t["turn_type"] == "main" and t["next_state"]]
        measurements = [t for t in turns if t["turn_type"] == "side"]
        assert len(questions) == 4 and len(measurements) == 3 * 3
        assert all(by_turn[t["turn_id"]]["state"] == "trained" for t in questions)
        assert all(by_turn[t["turn_id"]]["skip_reason"] == "side_turn" for t in measurements)
    finally:
        store.close()


def test_demo_refuses_a_run_dir_that_holds_a_run(tmp_path, capsys):
    TurnStore(tmp_path).close()
    assert main(["demo", "method=rl", f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0]


def test_demo_of_an_unknown_method_is_a_one_line_error(tmp_path, capsys):
    assert main(["demo", "method=sft", f"run_dir={tmp_path / 'x'}"]) == 2
    assert "unknown method 'sft'" in capsys.readouterr().err


def test_demo_console_shows_progress_and_measurements_not_request_logs(tmp_path):
    """The console of a short demo: its own lines, the progress bar and the table; the per-request
    and per-sample INFO lines (640 httpx lines alone in a default run) go to run_dir/demo.log."""
    model = build_tiny_model(model_cache_dir())
    run_dir = tmp_path / "demo"
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from clawrl.cli import main; sys.exit(main())", "demo", "method=rl",
         f"model.path={model}", "model.name=tiny", f"run_dir={run_dir}", "demo.interactions=4", "demo.eval_every=2",
         "demo.eval_prompts=3", "train.batch_size=2", "engine.threads=1"],
        capture_output=True, timeout=600)  # bytes: a progress bar's \r redraws are not lines
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert out.returncode == 0, stderr
    console = stdout + stderr
    lines = console.count("\n")
    assert "HTTP Request" not in console and " INFO " not in console, console
    assert sum(line.startswith("clawrl demo: after") for line in stdout.splitlines()) == 3  # 0, 2, 4
    assert "rise:" in stdout and "interactions: 100%" in stderr
    assert lines < 30, console  # 16 measured at these settings; 110 before (17 of them httpx requests)
    kept = (run_dir / "demo.log").read_text()
    assert "INFO clawrl.orchestration.learner: train step 2" in kept and "INFO clawrl.sessions:" in kept


def test_the_embedded_corpus_never_opens_a_plain_reply_with_the_teachers_sure():
    """The teacher user's opener must be a behaviour the model never learned as a plain reply (issue 21
    item 4): in the chats the embedded model's build draws from (its own generators, seed 0, more of each
    stream than a build consumes), every assistant message that opens with "Sure!" answers a user message
    carrying the instruction to open so; and the tool-call drill file has no "Sure" at all. Read-only: the
    corpus and the build are not changed."""
    from importlib.resources import files

    from clawrl.embedded.build import _chat_batches

    instructed, plain = 0, []
    for kind, batches in (("short", 400), ("agent", 40), ("drill", 40), ("long", 60)):
        stream = _chat_batches(0, kind)
        for _ in range(batches):
            for chat in next(stream):
                last_user = ""
                for m in chat.messages:
                    text = m.get("content") if isinstance(m.get("content"), str) else ""
                    if m["role"] == "user":
                        last_user = text
                    elif m["role"] == "assistant" and "Sure!" in text:
                        if text.lstrip().startswith("Sure!") and "start your reply with 'Sure!'" in last_user:
                            instructed += 1
                        else:
                            plain.append((last_user, text))
    assert not plain, plain[:3]
    assert instructed > 100  # the check sees the instructed ones: the model learned "Sure!" only on request
    assert "Sure" not in (files("clawrl.embedded") / "toolcall_train.jsonl").read_text()
