"""The shipped terminal task suite (terminal-rl/tasks) is well-formed and fair.

Well-formed: every task is a complete Harbor directory that the loader reads, in a declared train
or test split (disjoint, with every category in both), without network, and with a Dockerfile the
host can interpret. Fair: in a real (bubblewrap) sandbox the task's oracle earns full reward and an
agent that does nothing earns less, and the verifier itself writes that lower reward (a verifier
that crashed on an untouched /app would also "fail" the no-op, and prove nothing).
"""
from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from clawrl.config import SandboxConfig
from clawrl.envs.sandbox import open_sandbox
from clawrl.envs.task_formats import (HARBOR, TerminalTaskSpec, discover, plan_environment,
                                      prepare_environment, run_oracle, spec_of, verify)
from tests.required_tools import skip_unless_available

TASKS = Path(__file__).resolve().parents[1] / "terminal-rl" / "tasks"
SPLITS = {"train", "test"}
CATEGORIES = {"files", "text", "processes", "git", "python", "data"}
DIFFICULTIES = {"easy", "medium", "hard"}
# Both episodes of a task run in parallel with a few others: the process tasks mostly sleep.
CONCURRENT_TASKS = 4


def suite() -> list[tuple[str, TerminalTaskSpec]]:
    """(split, spec) of every shipped task, in discovery order."""
    return [(r.split, spec_of(r.task)) for r in discover(TASKS) if r.format == HARBOR]


# ----- well-formed -----

def test_the_suite_has_at_least_24_harbor_tasks_with_unique_ids():
    records = discover(TASKS)
    assert len(records) >= 24
    assert {r.format for r in records} == {HARBOR}
    ids = [r.task.task_id for r in records]
    assert len(set(ids)) == len(ids)
    assert sorted(ids) == sorted(p.name for p in TASKS.iterdir() if p.is_dir())


def test_every_task_ships_instruction_environment_tests_and_oracle():
    for _, spec in suite():
        where = spec.path
        assert "/app" in spec.instruction and len(spec.instruction) > 80, where
        assert spec.dockerfile == where / "environment" / "Dockerfile", where
        assert spec.tests_dir == where / "tests" and (where / "tests" / "test.sh").is_file(), where
        assert spec.solution == where / "solution" / "solve.sh", where
        assert spec.test_command == "bash /tests/test.sh", where
        assert "/logs/verifier/reward.txt" in (where / "tests" / "test.sh").read_text(), where


def test_splits_are_declared_disjoint_and_the_test_split_has_at_least_six():
    records = discover(TASKS)
    by_split = Counter(r.split for r in records)
    assert set(by_split) == SPLITS, by_split
    assert by_split["test"] >= 6 and by_split["train"] > by_split["test"]
    train = {r.task.task_id for r in records if r.split == "train"}
    test = {r.task.task_id for r in records if r.split == "test"}
    assert not train & test


def test_every_category_appears_in_both_splits_and_difficulties_vary():
    seen = {split: set() for split in SPLITS}
    difficulties = set()
    for split, spec in suite():
        category, difficulty = spec.metadata.get("category"), spec.metadata.get("difficulty")
        assert category in CATEGORIES, (spec.task_id, category)
        assert difficulty in DIFFICULTIES, (spec.task_id, difficulty)
        seen[split].add(category)
        difficulties.add(difficulty)
    assert seen == {"train": CATEGORIES, "test": CATEGORIES}
    assert difficulties == DIFFICULTIES


def test_tasks_ask_for_no_network_and_declare_small_limits():
    for _, spec in suite():
        assert spec.network is False, spec.task_id
        assert spec.cpus == 1 and spec.memory_mb is not None and spec.memory_mb <= 2048, spec.task_id
        assert 0 < spec.verifier_timeout_s <= 120 and 0 < spec.agent_timeout_s <= 1800, spec.task_id


def test_every_dockerfile_is_one_the_host_can_interpret():
    for _, spec in suite():
        plan = plan_environment(spec)  # TaskRefused (naming the line) fails the test
        assert plan.workdir == "/app", spec.task_id


# ----- fair: the oracle solves it, doing nothing does not -----

async def _episode(cfg: SandboxConfig, spec: TerminalTaskSpec, oracle: bool):
    """A fresh sandbox with the task's environment; the oracle runs or nothing does; the verdict."""
    async with open_sandbox(cfg, cpus=spec.cpus, memory_mb=spec.memory_mb, network=spec.network) as sandbox:
        await prepare_environment(spec, sandbox)
        solved = await run_oracle(spec, sandbox) if oracle else None
        return solved, await verify(spec, sandbox)


async def _judge_suite(cfg: SandboxConfig) -> list[str]:
    """One line per task whose oracle falls short of 1 or whose no-op reaches it."""
    gate = asyncio.Semaphore(CONCURRENT_TASKS)

    async def judge(spec: TerminalTaskSpec) -> str | None:
        async with gate:
            (solved, oracle), (_, nop) = await asyncio.gather(_episode(cfg, spec, True), _episode(cfg, spec, False))
        if solved.returncode != 0:
            return f"{spec.task_id}: solve.sh exited {solved.returncode}: {solved.stderr.strip()[-300:]}"
        if not (oracle.success and oracle.reward == 1.0):
            return f"{spec.task_id}: the oracle earned {oracle.reward} ({oracle.detail})"
        if nop.reward >= 1.0 or nop.success:
            return f"{spec.task_id}: doing nothing earned {nop.reward} ({nop.detail})"
        if not nop.detail.startswith("reward.txt says"):
            return f"{spec.task_id}: on an untouched /app the verifier wrote no reward ({nop.detail})"
        return None

    verdicts = await asyncio.gather(*(judge(spec) for _, spec in suite()))
    return [v for v in verdicts if v is not None]


def test_the_oracle_solves_every_task_and_doing_nothing_solves_none():
    skip_unless_available("bwrap")
    failures = asyncio.run(_judge_suite(SandboxConfig(backend="bwrap")))
    assert not failures, "\n".join(failures)


def _verdict_after(spec: TerminalTaskSpec, commands: list[str], oracle: bool = False):
    """The verdicts before and after the oracle (if ``oracle``) and then ``commands`` (each a sandbox
    exec, in order) on a fresh environment."""
    async def go():
        async with open_sandbox(SandboxConfig(backend="bwrap"), cpus=spec.cpus, memory_mb=spec.memory_mb) as sandbox:
            await prepare_environment(spec, sandbox)
            before = await verify(spec, sandbox)
            if oracle:
                assert (await run_oracle(spec, sandbox)).returncode == 0
            for command in commands:
                done = await sandbox.exec(command)
                assert done.returncode == 0, (command, done.stderr)
            return before, await verify(spec, sandbox)
    return asyncio.run(go())


def _task(task_id: str) -> TerminalTaskSpec:
    [spec] = [s for _, s in suite() if s.task_id == task_id]
    return spec


def test_modules_the_agent_leaves_in_app_do_not_break_a_solved_tasks_verifier():
    """The checkers run Python from /app, where a solution may well leave a json.py or csv.py of its
    own; they run it isolated, so the solved task still earns full reward."""
    skip_unless_available("bwrap")
    spec = _task("data-csv-to-json")
    plant = "for m in json csv pathlib; do echo 'raise SystemExit(9)' > /app/$m.py; done"
    _, after = _verdict_after(spec, [plant], oracle=True)
    assert after.reward == 1.0, after.detail


@pytest.mark.parametrize("task_id", ["files-sort-by-extension", "git-resolve-merge"])
def test_a_half_done_task_earns_partial_credit(task_id):
    """Rewards are shares of checks: a run that does part of the work lands strictly between the
    no-op and the oracle (here: one inbox file sorted; the merge concluded with feature's side of
    the conflict, so TIMEOUT and BACKENDS are wrong)."""
    skip_unless_available("bwrap")
    half_done = {
        "files-sort-by-extension": "mkdir -p sorted/pdf && mv inbox/report.PDF sorted/pdf/",
        "git-resolve-merge": "cd repo && { git merge feature; git checkout --theirs settings.py && "
                             "git add settings.py && git commit -q --no-edit; }",
    }[task_id]
    before, after = _verdict_after(_task(task_id), [half_done])
    assert before.reward < after.reward < 1.0, (before.detail, after.detail)
