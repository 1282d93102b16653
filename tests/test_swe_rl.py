"""swe-rl (issue 18): bugs built from a real package's own tests, judged as SWE-bench judges.

CI builds from one package only (inflection, the smallest suite: about a second a run), a few
instances, twice with one seed to show the build is deterministic; the gold patch must resolve
and the empty patch must not on a sample of them, through the evaluator and through the
environment (``env check``'s oracle and no-op). The full build (four packages, 68 instances) is a
benchmark command whose output swe-rl/README.md records. One GRPO step on swe-rl's own task set is
in tests/test_env_training.py with the other environments'.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from clawrl.cli import main
from clawrl.config import SandboxConfig
from clawrl.envs.base import EnvError, Task
from clawrl.envs.scripted import NOP, ORACLE, play
from clawrl.envs.swe import mutations
from clawrl.envs.swe.build import build, problem_statement, read_plans
from clawrl.envs.swe.env import SweEnv, reward_of
from clawrl.envs.swe.evaluate import Verdict, evaluate
from clawrl.envs.swe.instances import instance_of, refusal
from clawrl.envs.swe.testbed import parse_summary, run_tests
from clawrl.envs.task_formats import discover
from tests.required_tools import skip_unless_available

REPO = Path(__file__).resolve().parents[1]
PACKAGES = REPO / "swe-rl" / "packages.toml"
SEED = 3

SOURCE = '''\
def window(xs, n):
    """Docstrings are never mutated."""
    out = []
    for i in range(len(xs) - n + 1):
        if n > 0 and xs:
            out.append(tuple(xs[i:i + n]))
    total = max(len(out), 0)
    return out, total
'''


def test_every_kind_of_mutation_is_found_and_each_changes_one_line():
    found = mutations.sites(SOURCE)
    assert {s.kind for s in found} == set(mutations.KINDS)
    assert found == mutations.sites(SOURCE)  # a pure function of the text
    for site in found:
        new = mutations.apply(SOURCE, site)
        old_lines, new_lines = SOURCE.splitlines(), new.splitlines()
        changed = [a for a, b in zip(old_lines, new_lines) if a != b]
        assert len(changed) == 1 or (site.kind == "statement_remove" and len(new_lines) == len(old_lines) - 1)
        assert "Docstrings" in new
    flip = next(s for s in found if s.kind == "compare_flip")
    assert "if n <= 0 and xs:" in mutations.apply(SOURCE, flip)


def test_a_file_that_does_not_parse_has_no_sites_and_a_no_op_mutation_is_refused():
    assert mutations.sites("def broken(:\n") == []
    site = mutations.Site("constant_change", 1, 4, 1, 5, "1")
    with pytest.raises(ValueError, match="changes nothing"):
        mutations.apply("x = 1\n", site)


def test_official_instances_are_read_and_refused_with_the_reason():
    row = {"instance_id": "astropy__astropy-12907", "repo": "astropy/astropy", "base_commit": "d16bfe05",
           "patch": "diff --git a/x b/x\n", "test_patch": "", "problem_statement": "separability is wrong",
           "FAIL_TO_PASS": '["astropy/modeling/tests/test_separable.py::test_separable[compound_model6]"]',
           "PASS_TO_PASS": "[]"}
    inst = instance_of(Task("astropy__astropy-12907", row))
    assert inst.fail_to_pass == ("astropy/modeling/tests/test_separable.py::test_separable[compound_model6]",)
    assert inst.source is None and "needs its Docker image" in refusal(inst)
    with pytest.raises(EnvError, match="lacks FAIL_TO_PASS"):
        instance_of(Task("x", {k: v for k, v in row.items() if k != "FAIL_TO_PASS"}))
    with pytest.raises(EnvError, match="needs its Docker image"):
        asyncio.run(SweEnv(SandboxConfig(), 30.0).reset(Task("astropy__astropy-12907", row)))


def test_outcomes_are_read_from_the_rA_summary_ids_with_spaces_and_dashes_included():
    text = ("....F\n=== short test summary info ===\nPASSED t.py::test_a[x - y]\nPASSED t.py::test_b[-1--1st]\n"
            "FAILED t.py::test_c[a b] - AssertionError: assert [1] == [2]\nERROR t.py - ImportError: nope\n"
            "XFAIL t.py::test_d - known\nSKIPPED [1] t.py:3: no\n1 failed, 2 passed in 0.1s\n")
    outcomes, messages = parse_summary(text)
    assert outcomes == {"t.py::test_a[x - y]": "PASSED", "t.py::test_b[-1--1st]": "PASSED", "t.py::test_c[a b]": "FAILED",
                        "t.py": "ERROR", "t.py::test_d": "XFAIL"}
    assert messages["t.py::test_c[a b]"] == "AssertionError: assert [1] == [2]"


def test_the_f2p_share_reward_is_minus_one_when_a_passing_test_breaks():
    half = Verdict(False, True, 1, 2, 0, 10, "")
    assert reward_of(half, "resolved") == -1.0 and reward_of(half, "f2p_share") == 0.0
    assert reward_of(Verdict(False, True, 2, 2, 1, 10, ""), "f2p_share") == -1.0
    assert reward_of(Verdict(True, True, 2, 2, 0, 10, ""), "f2p_share") == 1.0


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """inflection, three instances, built twice with one seed."""
    skip_unless_available("bwrap", "bubblewrap is not installed: the build runs the tests in a sandbox")
    plans = read_plans(PACKAGES, ["inflection"])
    for plan in plans:
        plan.instances, plan.max_tries = 3, 12
    outs = []
    for name in ("a", "b"):
        out = tmp_path_factory.mktemp(f"swe-{name}")
        asyncio.run(build(SandboxConfig(), plans, SEED, out, lambda line: None))
        outs.append(out)
    return outs


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "data" / "train.jsonl").read_text().splitlines()]


def test_the_build_is_deterministic_for_a_seed_and_follows_the_schema(built):
    a, b = built
    assert (a / "data" / "train.jsonl").read_bytes() == (b / "data" / "train.jsonl").read_bytes()
    rows = _rows(a)
    assert len(rows) == 3 and len({r["instance_id"] for r in rows}) == 3
    for r in rows:
        assert {"instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "FAIL_TO_PASS",
                "PASS_TO_PASS", "clawrl_source"} <= set(r)
        assert r["FAIL_TO_PASS"] and not set(r["FAIL_TO_PASS"]) & set(r["PASS_TO_PASS"])
        assert r["patch"].startswith("diff --git a/inflection/__init__.py b/inflection/__init__.py")
        # the statement names failing tests, not the line the fix changes
        changed = [line[1:].strip() for line in r["patch"].splitlines()
                   if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        assert r["FAIL_TO_PASS"][0] in r["problem_statement"]
        assert not any(len(c) > 8 and c in r["problem_statement"] for c in changed)
    build_info = json.loads((a / "build.json").read_text())
    assert build_info["seed"] == SEED and build_info["instances"] == {"train": 3}


def test_gold_patches_resolve_and_empty_patches_do_not(built):
    rows = _rows(built[0])[:2]
    for row in rows:
        inst = instance_of(Task(row["instance_id"], row))
        gold = asyncio.run(evaluate(SandboxConfig(), inst, inst.patch))
        assert gold.resolved and gold.f2p_passed == gold.f2p_total and gold.p2p_failed == 0
        empty = asyncio.run(evaluate(SandboxConfig(), inst, ""))
        assert not empty.resolved and empty.f2p_passed == 0 and empty.p2p_failed == 0


def test_deleting_the_failing_tests_resolves_nothing(built):
    """The episode's diff deletes the test file; the evaluator restores the tests before judging."""
    row = _rows(built[0])[0]
    env = SweEnv(SandboxConfig(), 30.0)

    async def episode():
        try:
            await env.reset(Task(row["instance_id"], row))
            return await env.step("```bash\nrm test_inflection.py\n```\nDONE")
        finally:
            await env.close()

    outcome = asyncio.run(episode())
    assert outcome.done and outcome.reward == -1.0
    assert outcome.info["patch_applied"] and outcome.info["f2p_passed"] == 0 and outcome.info["patch_lines"] > 100


def test_the_environment_plays_the_oracle_to_plus_one_and_the_no_op_to_minus_one(built):
    record = next(r for r in discover(built[0]))
    oracle = asyncio.run(play(SweEnv(SandboxConfig(), 30.0), record.task, ORACLE, 4))
    assert oracle.reward == 1.0 and oracle.success
    nop = asyncio.run(play(SweEnv(SandboxConfig(), 30.0), record.task, NOP, 2))
    assert nop.reward == -1.0 and not nop.success


def test_a_working_copy_has_one_commit_and_the_agent_sees_the_bug(built):
    row = _rows(built[0])[0]
    env = SweEnv(SandboxConfig(), 30.0)

    async def episode():
        try:
            first = await env.reset(Task(row["instance_id"], row))
            log = await env.step("```bash\ngit log --oneline | wc -l && git rev-parse HEAD && git status --short\n```")
            return first, log
        finally:
            await env.close()

    first, log = asyncio.run(episode())
    assert first.messages[1]["content"] == row["problem_statement"]
    out = log.observation.messages[0]["content"]
    assert "exit code 0" in out and f"\n1\n{row['base_commit']}" in out


def test_env_build_usage_errors_are_one_line_and_exit_2(tmp_path, capsys):
    for argv, message in ((["env", "build", "swe-rl", "--seed", "x"], "--seed must be a whole number"),
                          (["env", "build", "terminal-rl"], "has no task set to build"),
                          (["env", "build", "no-such-recipe"], "takes a method directory")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("clawrl: ") and message in err and err.count("\n") == 1
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    assert main(["env", "build", "swe-rl", "--out", str(tmp_path)]) == 2
    assert "--force rebuilds it" in capsys.readouterr().err
    assert main(["env", "build", "swe-rl", "--out", str(tmp_path / "new"), "--packages", "nope"]) == 1
    assert "has no package nope" in capsys.readouterr().err


def test_a_package_list_without_pins_or_with_a_bad_plan_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "packages.toml"
    bad.write_text('[[package]]\nname = "inflection"\nversion = "0.5.1"\nsha256 = "abc"\nsource = ["x.py"]\n'
                   'tests = ["t.py"]\n')
    with pytest.raises(EnvError, match="needs a 64-hex sha256"):
        read_plans(bad)
    good = PACKAGES.read_text()
    bad.write_text(good.replace('split = "test"', 'split = "dev"'))
    with pytest.raises(EnvError, match="needs split train\\|test"):
        read_plans(bad)
    plans = read_plans(PACKAGES)
    assert {p.split for p in plans} == {"train", "test"}
    train = {p.package.name for p in plans if p.split == "train"}
    assert len(train) >= 3 and not train & {p.package.name for p in plans if p.split == "test"}


def test_env_check_reads_an_official_instance_file_and_fails_its_instances_with_the_reason(tmp_path, capsys):
    row = {"instance_id": "sympy__sympy-20590", "repo": "sympy/sympy", "base_commit": "cffd4e0f",
           "patch": "", "test_patch": "", "problem_statement": "Symbol instances have __dict__",
           "FAIL_TO_PASS": '["test_immutable"]', "PASS_TO_PASS": "[]", "image_name": "swebench/sweb.eval.x86_64.sympy"}
    file = tmp_path / "swe-bench-lite.jsonl"
    file.write_text(json.dumps(row) + "\n")
    assert main(["env", "list", str(file)]) == 0
    assert capsys.readouterr().out == "sympy__sympy-20590\tswe-bench-lite\trows\n"
    assert main(["env", "check", str(file), "env.name=swe"]) == 1
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert line["status"] == "fail" and "needs its Docker image (swebench/sweb.eval.x86_64.sympy)" in line["reason"]


def test_an_instance_whose_source_no_longer_rebuilds_its_base_commit_is_refused(built):
    row = dict(_rows(built[0])[0], base_commit="0" * 40)
    env = SweEnv(SandboxConfig(), 30.0)

    async def episode():
        try:
            await env.reset(Task(row["instance_id"], row))
        finally:
            await env.close()

    with pytest.raises(EnvError, match="the instance says 000000000000"):
        asyncio.run(episode())


CONFTEST_HACK = '''import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
'''


def test_a_conftest_that_turns_failures_into_passes_resolves_nothing(built):
    """The hook works (run as is, the failing tests pass), and the evaluator undoes it."""
    row = _rows(built[0])[0]
    inst = instance_of(Task(row["instance_id"], row))
    env = SweEnv(SandboxConfig(), 30.0)

    async def episode():
        try:
            await env.reset(Task(row["instance_id"], row))
            await env.sandbox.write_file("/testbed/conftest.py", CONFTEST_HACK)
            hacked = await run_tests(env.sandbox, inst.source, 60)
            return hacked, await env.step("DONE")
        finally:
            await env.close()

    hacked, outcome = asyncio.run(episode())
    assert all(hacked.passing(t) for t in inst.fail_to_pass)
    assert outcome.reward == -1.0 and outcome.info["f2p_passed"] == 0
    assert "conftest.py were undone" in outcome.info["verdict"]


def test_a_statement_quotes_messages_without_the_memory_addresses_that_change_every_run():
    import random

    pkg = read_plans(PACKAGES, ["toolz"])[0].package
    messages = {"t.py::test_a": "assert [(<toolz.test...fa482caee10>)] == [(<toolz.test...fa482caee10>)]",
                "t.py::test_b": "AssertionError: <object object at 0x7f3a9e2b1c10> != 3"}
    text = problem_statement(pkg, sorted(messages), messages, random.Random(0))
    assert "fa482caee10" not in text and "0x7f3a9e2b1c10" not in text
    assert "<object object at ...> != 3" in text and "t.py::test_a" in text
