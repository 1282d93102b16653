"""``clawrl env``: the contract every environment shares (list, check, run).

The commands run in-process (``clawrl.cli.main``), as a user's shell would run them, against the
shipped terminal-rl suite, the fixture task directories of every format, and broken copies of a
task: the oracle must solve, the no-op must not, and every usage error is one line and exit 2."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from clawrl.cli import main
from tests.required_tools import skip_unless_available

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "tasks"
SUITE = ROOT / "terminal-rl" / "tasks"


@pytest.fixture(autouse=True)
def _isolating_sandbox():
    skip_unless_available("bwrap", "bubblewrap is not installed: terminal episodes need an isolating sandbox")


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_env_list_names_each_task_with_its_split_and_format(capsys):
    assert main(["env", "list", "terminal-rl"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert len(rows) >= 24 and all(len(r) == 3 for r in rows)
    assert {r[0] for r in rows} == {p.name for p in SUITE.iterdir() if (p / "task.toml").is_file()}
    assert {r[1] for r in rows} == {"train", "test"} and {r[2] for r in rows} == {"harbor"}


def test_env_list_detects_the_format_of_each_task_in_a_mixed_directory(capsys):
    assert main(["env", "list", str(FIXTURES)]) == 0
    formats = {line.split("\t")[0]: line.split("\t")[2] for line in capsys.readouterr().out.splitlines()}
    assert formats["harbor-word-count"] == "harbor" and formats["tb1-csv-sum"] == "tb1"
    assert "rows" in formats.values()


def test_env_run_plays_the_oracle_and_the_nop_and_ends_with_one_json_line(capsys):
    task = ["env", "run", "terminal-rl", "--task", "text-word-frequency"]
    assert main([*task, "--policy", "oracle"]) == 0
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(last) == {"task", "reward", "success", "turns", "truncated", "reason", "transcript"}
    assert (last["task"], last["reward"], last["success"], last["truncated"], last["reason"]) == (
        "text-word-frequency", 1.0, True, False, "done")
    assert last["transcript"][0]["role"] == "system" and "/app" in last["transcript"][0]["content"]
    assert main([*task, "--policy", "nop", "env.max_turns=2"]) == 0
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (last["reward"] < 1, last["success"], last["turns"], last["truncated"], last["reason"]) == (
        True, False, 2, True, "max_turns")
    # the no-op's replies were malformed, and the environment said so
    assert "no ```bash code block" in last["transcript"][3]["content"]


def _copy_task(name: str, dest: Path) -> Path:
    return Path(shutil.copytree(SUITE / name, dest / name))


def test_env_check_passes_good_tasks_and_fails_broken_ones(tmp_path, capsys):
    good = tmp_path / "good"
    _copy_task("text-word-frequency", good)
    _copy_task("git-revert-commit", good)
    assert main(["env", "check", str(good)]) == 0
    lines = _json_lines(capsys.readouterr().out)
    assert [(x["task"], x["oracle"], x["status"]) for x in lines] == [("git-revert-commit", 1.0, "ok"),
                                                                     ("text-word-frequency", 1.0, "ok")]
    assert all(x["nop"] < 1 for x in lines)

    bad = tmp_path / "bad"
    lax = _copy_task("text-word-frequency", bad)  # its tests pass whatever the agent does
    (lax / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    wrong = _copy_task("git-revert-commit", bad)  # its oracle does nothing
    (wrong / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    unsolved = _copy_task("files-bulk-rename", bad)  # no oracle at all
    shutil.rmtree(unsolved / "solution")
    assert main(["env", "check", str(bad)]) == 1
    by_task = {x["task"]: x for x in _json_lines(capsys.readouterr().out)}
    assert by_task["text-word-frequency"]["status"] == "fail"
    assert by_task["text-word-frequency"]["nop"] == by_task["text-word-frequency"]["oracle"] == 1.0
    assert by_task["git-revert-commit"]["status"] == "fail" and by_task["git-revert-commit"]["oracle"] < 1
    assert by_task["files-bulk-rename"]["status"] == "no_oracle"


def test_env_check_with_no_oracle_at_all_exits_1(tmp_path, capsys):
    shutil.rmtree(_copy_task("files-bulk-rename", tmp_path) / "solution")
    assert main(["env", "check", str(tmp_path)]) == 1
    assert _json_lines(capsys.readouterr().out)[0]["status"] == "no_oracle"


def test_env_check_reports_tasks_the_host_cannot_run_with_the_reason(capsys):
    assert main(["env", "check", str(FIXTURES / "harbor-needs-network")]) == 1
    line = _json_lines(capsys.readouterr().out)[0]
    assert line["status"] == "fail" and "network" in line["reason"]


@pytest.mark.parametrize("argv, message", [
    (["env", "list", "no-such-dir"], "no such task path"),
    (["env", "run", "terminal-rl"], "pick one with --task ID"),
    (["env", "run", "terminal-rl", "--task", "nope"], "no task 'nope'"),
    (["env", "run", str(FIXTURES / "rows-arith"), "--task", "add-2-3"], "say which environment plays it"),
    (["env", "run", "terminal-rl", "--task", "git-revert-commit", "env.max_turn=3"], "env.max_turns"),
])
def test_env_usage_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("clawrl: ") and message in err and err.count("\n") == 1


def test_env_run_with_the_model_plays_an_episode_of_model_turns(tiny_model_dir, capsys):
    """The embedded model is not trained for shell tasks yet: the episode must run, not succeed."""
    assert main(["env", "run", "terminal-rl", "--task", "text-word-frequency", "--policy", "model",
                 f"model.path={tiny_model_dir}", "env.max_turns=2", "env.max_tokens_per_turn=16",
                 "engine.threads=1"]) == 0
    last = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert 1 <= last["turns"] <= 2 and last["reward"] < 1
    assert [m["role"] for m in last["transcript"][:3]] == ["system", "user", "assistant"]
