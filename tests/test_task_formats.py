"""Task formats on fixture tasks of each kind: discovery (formats detected per task, splits, stable
ids), what a Harbor and a Terminal-Bench 1.0 directory become, and judging in a real (bubblewrap)
sandbox: the oracle earns full reward, doing nothing earns less, tests appear only at verify."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from clawrl.config import SandboxConfig
from clawrl.envs.base import EnvError
from clawrl.envs.sandbox import open_sandbox
from clawrl.envs.task_formats import (TaskRefused, copy_solution, detect_format, discover, plan_environment,
                                      prepare_environment, run_oracle, spec_of, verify)
from clawrl.envs.task_formats.rewards import RewardFileError, parse_pytest, parse_reward_json, parse_reward_txt
from clawrl.envs.tasks import load_tasks
from tests.required_tools import skip_unless_available

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"


def spec(name: str):
    [record] = discover(FIXTURES / name)
    return spec_of(record.task)


@pytest.fixture
def sandbox_cfg() -> SandboxConfig:
    skip_unless_available("bwrap")
    return SandboxConfig(backend="bwrap")


def episode(cfg: SandboxConfig, task_spec, *, oracle: bool, agent: str | None = None):
    """Prepare the task, let the oracle (or ``agent``'s commands, or nothing) act, then verify."""
    async def go():
        async with open_sandbox(cfg, cpus=task_spec.cpus, memory_mb=task_spec.memory_mb) as sandbox:
            await prepare_environment(task_spec, sandbox)
            if oracle:
                result = await run_oracle(task_spec, sandbox)
                assert result.returncode == 0, result.stderr
            if agent is not None:
                await sandbox.exec(agent)
            return await verify(task_spec, sandbox)
    return asyncio.run(go())


# ----- discovery -----

def test_a_mixed_directory_lists_every_task_with_its_own_format_and_split():
    got = [(r.task.task_id, r.split, r.format) for r in discover(FIXTURES)]
    assert got == [
        ("harbor-failing-run", "train", "harbor"),
        ("harbor-needs-network", "train", "harbor"),
        ("harbor-own-image", "test", "harbor"),
        ("harbor-reward-json", "test", "harbor"),
        ("harbor-uv-template", "test", "harbor"),
        ("harbor-word-count", "train", "harbor"),
        ("add-9-9", "test", "rows"),
        ("add-2-3", "train", "rows"),
        ("train-3", "train", "rows"),  # no id: split and line number (the blank line 2 still counts)
        ("tb1-csv-sum", "test", "tb1"),
        ("tb1-uv-template", "train", "tb1"),
    ]


def test_one_task_dir_a_task_file_a_dataset_dir_and_a_jsonl_file():
    assert [r.task.task_id for r in discover(FIXTURES / "tb1-csv-sum")] == ["tb1-csv-sum"]
    assert [r.task.task_id for r in discover(FIXTURES / "harbor-word-count" / "task.toml")] == ["harbor-word-count"]
    rows = discover(FIXTURES / "rows-arith")
    assert [(r.task.task_id, r.split) for r in rows] == [("add-9-9", "test"), ("add-2-3", "train"),
                                                         ("train-3", "train")]
    assert rows[1].task.data == {"question": "2+3", "answer": 5}
    assert [r.task.task_id for r in discover(FIXTURES / "rows-arith" / "data" / "test.jsonl")] == ["add-9-9"]
    assert detect_format(FIXTURES / "rows-arith") == "rows"
    assert detect_format(FIXTURES / "harbor-word-count" / "tests") is None


def test_undeclared_split_is_unsplit(tmp_path):
    shutil.copytree(FIXTURES / "tb1-csv-sum", tmp_path / "t")
    yaml_file = tmp_path / "t" / "task.yaml"
    yaml_file.write_text(yaml_file.read_text().replace("split: test\n", ""))
    assert discover(tmp_path / "t")[0].split == "unsplit"


def test_paths_that_hold_no_task_are_one_line_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(EnvError, match=r"empty holds no task \(expected task.toml \(Harbor\), task.yaml"):
        discover(tmp_path / "empty")
    with pytest.raises(EnvError, match=r"notes.txt is not a task"):
        discover(tmp_path / "notes.txt")
    with pytest.raises(EnvError, match=r"no such file or directory"):
        discover(tmp_path / "missing")


def test_both_task_files_in_one_dir_and_duplicate_ids_are_refused(tmp_path):
    both = tmp_path / "both"
    shutil.copytree(FIXTURES / "harbor-word-count", both)
    shutil.copy(FIXTURES / "tb1-csv-sum" / "task.yaml", both)
    with pytest.raises(EnvError, match="holds both task.toml .* and task.yaml"):
        discover(both)
    dup = tmp_path / "dup"
    (dup / "data").mkdir(parents=True)
    (dup / "data" / "train.jsonl").write_text('{"id": "a"}\n{"id": "a"}\n')
    with pytest.raises(EnvError, match="task id 'a' appears twice"):
        discover(dup)


@pytest.mark.parametrize("toml, message", [
    ("[agent\ntimeout_sec = 1", "not TOML"),
    ("[agent]\ntimeout_sec = -5", r"\[agent\] timeout_sec must be a positive number of seconds, not -5"),
    ('[environment]\nmemory = "lots"', "memory must look like 2G or 512M"),
    ("[metadata]\nsplit = 3", r"\[metadata\] split must be a non-empty string, not 3"),
])
def test_malformed_task_toml_names_the_file_and_key(tmp_path, toml, message):
    task = tmp_path / "bad"
    task.mkdir()
    (task / "task.toml").write_text(toml)
    (task / "instruction.md").write_text("x")
    with pytest.raises(EnvError, match=message):
        discover(task)


def test_load_tasks_still_reads_row_splits_for_its_callers():
    class NoTasks:
        pass
    tasks = load_tasks(str(FIXTURES / "rows-arith"), "train", NoTasks)
    assert [t.task_id for t in tasks] == ["add-2-3", "train-3"]
    with pytest.raises(EnvError, match="has no dev split .*splits: test, train"):
        load_tasks(str(FIXTURES / "rows-arith"), "dev", NoTasks)


def test_load_tasks_reads_task_directories_by_their_declared_split():
    """What an environment source rolls out: terminal tasks of one split from a mixed directory."""
    class NoTasks:
        pass
    test = {t.task_id for t in load_tasks(str(FIXTURES), "test", NoTasks)}
    assert {"harbor-reward-json", "tb1-csv-sum", "harbor-own-image"} <= test
    assert "harbor-word-count" not in test
    with pytest.raises(EnvError, match=r"has no dev split \(splits: test, train"):
        load_tasks(str(FIXTURES), "dev", NoTasks)


# ----- what a task directory becomes -----

def test_harbor_spec_reads_limits_paths_and_commands():
    s = spec("harbor-word-count")
    assert (s.format, s.agent_timeout_s, s.verifier_timeout_s, s.cpus, s.memory_mb, s.network) == \
        ("harbor", 120.0, 60.0, 1.0, 1024, False)
    assert s.instruction.startswith("Count the words in /app/data/poem.txt")
    assert s.dockerfile == FIXTURES / "harbor-word-count" / "environment" / "Dockerfile"
    assert s.build_context == FIXTURES / "harbor-word-count" / "environment"
    assert s.tests_dir == FIXTURES / "harbor-word-count" / "tests" and s.test_command == "bash /tests/test.sh"
    assert s.solution == FIXTURES / "harbor-word-count" / "solution" / "solve.sh" and s.parser is None
    assert s.build_timeout_s == 120.0 and s.metadata["category"] == "text-processing"
    assert s.test_env == {"TEST_DIR": "/tests"}


def test_tb1_spec_reads_task_yaml_compose_and_test_script():
    s = spec("tb1-csv-sum")
    assert (s.format, s.agent_timeout_s, s.verifier_timeout_s, s.parser) == ("tb1", 120.0, 60.0, "pytest")
    assert s.test_command == "bash /tests/run-tests.sh" and s.test_env == {"TEST_DIR": "/tests"}
    assert s.extra_test_files == (FIXTURES / "tb1-csv-sum" / "run-tests.sh",)
    assert s.dockerfile == FIXTURES / "tb1-csv-sum" / "Dockerfile" and s.solution.name == "solution.sh"
    assert s.image is None and s.refusal is None and not s.network
    assert s.task_env == {"SALES_CURRENCY": "EUR"}  # the harness's own ${T_BENCH_...} variables left out


def test_tb1_older_descriptions_and_defaults(tmp_path):
    task = tmp_path / "old"
    task.mkdir()
    (task / "task.yaml").write_text("descriptions:\n  - key: base\n    description: Do the old thing.\n"
                                    "  - key: hard\n    description: Harder.\n")
    (task / "solution.yaml").write_text("- command: nano x\n")
    [r] = discover(task)
    s = spec_of(r.task)
    assert s.instruction == "Do the old thing." and (s.agent_timeout_s, s.verifier_timeout_s) == (180.0, 30.0)
    assert s.test_command == "python3 -m pytest -rA /tests" and s.solution is None

    async def no_oracle():
        with pytest.raises(EnvError, match="old has no oracle: solution.yaml holds tmux keystrokes"):
            await copy_solution(s, None)
    asyncio.run(no_oracle())


def test_compose_with_services_network_or_an_image_of_its_own_is_refused(tmp_path):
    def task(name: str, compose: str):
        d = tmp_path / name
        d.mkdir()
        (d / "task.yaml").write_text("instruction: x\n")
        (d / "docker-compose.yaml").write_text(compose)
        return spec_of(discover(d)[0].task)
    cases = {
        "two": ("services:\n  client:\n    build: .\n  db:\n    image: postgres:16\n",
                "two: needs 2 containers on a network of their own (client, db)"),
        "net": ("services:\n  client:\n    build: .\n    network_mode: host\n", "net: asks for network"),
        "img": ("services:\n  client:\n    image: acme/runner:1\n", "img: needs its own image acme/runner:1"),
    }
    for name, (compose, message) in cases.items():
        with pytest.raises(TaskRefused) as e:
            plan_environment(task(name, compose))
        assert str(e.value).startswith(message)


def test_network_is_refused_before_any_sandbox_opens():
    with pytest.raises(TaskRefused, match=r"^harbor-needs-network: asks for network, and the sandbox has none"):
        plan_environment(spec("harbor-needs-network"))


@pytest.mark.parametrize("mode, asks", [("no-network", False), ("none", False), ("public", True),
                                         ("allowlist", True)])
def test_harbor_network_modes(tmp_path, mode, asks):
    task = tmp_path / "n"
    (task / "tests").mkdir(parents=True)
    (task / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (task / "task.toml").write_text(f'[environment]\nnetwork_mode = "{mode}"\n')
    (task / "instruction.md").write_text("x")
    assert spec_of(discover(task)[0].task).network is asks


def test_memory_in_the_older_spelling(tmp_path):
    task = tmp_path / "m"
    task.mkdir()
    (task / "task.toml").write_text('[environment]\nmemory = "2G"\ncpus = 2\n')
    (task / "instruction.md").write_text("x")
    s = spec_of(discover(task)[0].task)
    assert (s.memory_mb, s.cpus, s.refusal) == (2048, 2.0, "m has no tests/test.sh to verify it")


# ----- rewards -----

def test_reward_files():
    assert parse_reward_txt(" 0.75\n") == 0.75
    assert parse_reward_json('{"reward": 1}') == 1.0
    assert parse_reward_json("0.5") == 0.5
    assert parse_reward_json('{"accuracy": 0.25, "note": "x"}') == 0.25
    for bad, message in [("yes", "not a number"), ("nan", "not a finite number")]:
        with pytest.raises(RewardFileError, match=message):
            parse_reward_txt(bad)
    with pytest.raises(RewardFileError, match=r'no "reward" key and 2 numbers \(a, b\)'):
        parse_reward_json('{"a": 1, "b": 2}')
    with pytest.raises(RewardFileError, match="not JSON"):
        parse_reward_json("{")


PYTEST_RA = """\
============================= test session starts ==============================
collected 4 items

../tests/test_outputs.py .F.s                                            [100%]

=========================== short test summary info ============================
PASSED ../tests/test_outputs.py::test_a
FAILED ../tests/test_outputs.py::test_b - assert 1 == 2
PASSED ../tests/test_outputs.py::test_c
SKIPPED [1] ../tests/test_outputs.py:9: no fixture
==================== 1 failed, 2 passed, 1 skipped in 0.05s ====================
"""


def test_pytest_reports_give_passed_and_total():
    counts = parse_pytest(PYTEST_RA)
    assert (counts.passed, counts.total) == (3, 4)  # skipped counts as passed, as in Terminal-Bench
    plain = "collected 5 items\n\nt.py ..F.E\n=========== 1 failed, 3 passed, 1 error in 0.10s ===========\n"
    assert (parse_pytest(plain).passed, parse_pytest(plain).total) == (3, 5)
    assert parse_pytest("bash: pytest: command not found\n") is None
    assert parse_pytest("============ no tests ran in 0.01s ============\n") is None


# ----- judging in a sandbox -----

@pytest.mark.parametrize("backend", ["bwrap", "unshare"])
def test_harbor_oracle_earns_full_reward_and_doing_nothing_less(backend):
    skip_unless_available(backend)
    cfg = SandboxConfig(backend=backend)
    s = spec("harbor-word-count")
    oracle, nop = episode(cfg, s, oracle=True), episode(cfg, s, oracle=False)
    assert (oracle.reward, oracle.success, oracle.detail) == (1.0, True, "reward.txt says 1")
    assert (nop.reward, nop.success) == (0.0, False)


def test_tb1_reward_is_the_share_of_pytest_tests_passed(sandbox_cfg):
    s = spec("tb1-csv-sum")
    oracle = episode(sandbox_cfg, s, oracle=True)
    assert (oracle.reward, oracle.success, oracle.passed, oracle.total) == (1.0, True, 3, 3)
    nop = episode(sandbox_cfg, s, oracle=False)
    assert (nop.passed, nop.total, nop.success, nop.detail) == (1, 3, False, "1 of 3 tests passed")
    assert nop.reward == pytest.approx(1 / 3)
    half = episode(sandbox_cfg, s, oracle=False, agent="echo 22 > total.txt")
    assert (half.passed, half.total, half.success) == (2, 3, False)


def test_tb1_run_tests_that_fetch_their_tools_fall_back_to_the_hosts_pytest(sandbox_cfg):
    s = spec("tb1-uv-template")
    oracle = episode(sandbox_cfg, s, oracle=True)  # the two files run-tests.sh names; not test_not_run.py
    assert (oracle.reward, oracle.success, oracle.passed, oracle.total) == (1.0, True, 3, 3)
    assert oracle.detail == ("3 of 3 tests passed (run-tests.sh fetches its test tools from the network; the "
                             "host's pytest ran the tests)")
    nop = episode(sandbox_cfg, s, oracle=False)
    assert (nop.reward, nop.success, nop.passed, nop.total) == (0.0, False, 0, 3)


def test_harbor_template_test_sh_that_fetches_pytest_falls_back_to_the_hosts(sandbox_cfg):
    s = spec("harbor-uv-template")
    oracle = episode(sandbox_cfg, s, oracle=True)
    assert (oracle.reward, oracle.success, oracle.passed, oracle.total) == (1.0, True, 2, 2)
    assert oracle.detail == ("2 of 2 tests passed (test.sh fetches its test tools from the network; the host's "
                             "pytest ran the tests)")
    half = episode(sandbox_cfg, s, oracle=False, agent="seq 1 5 | tr '\\n' ' ' > numbers.txt")
    assert (half.reward, half.success, half.passed, half.total) == (0.0, False, 1, 2)  # all or nothing, as test.sh


def test_reward_json_gives_partial_credit_in_the_declared_workdir(sandbox_cfg):
    s = spec("harbor-reward-json")
    assert episode(sandbox_cfg, s, oracle=True).reward == 1.0
    partial = episode(sandbox_cfg, s, oracle=False, agent="pwd > /tmp/where; touch status.txt")
    assert (partial.reward, partial.success, partial.detail) == (0.25, False, "reward.json says 0.25")


def test_tests_are_absent_until_verify_and_planted_rewards_do_not_count(sandbox_cfg):
    s = spec("harbor-word-count")

    async def go():
        async with open_sandbox(sandbox_cfg) as sandbox:
            await prepare_environment(s, sandbox)
            look = await sandbox.exec("ls /tests /solution 2>&1; mkdir -p /logs/verifier; "
                                      "echo 1 > /logs/verifier/reward.txt; mkdir -p /tests; "
                                      "echo 'exit 0' > /tests/test.sh")
            # a reward dir swapped for a link to a dir of the agent's: removed, never followed
            await sandbox.exec("mkdir -p /app/mine && echo 1 > /app/mine/reward.json && rm -rf /logs/verifier && "
                               "ln -s /app/mine /logs/verifier")
            verdict = await verify(s, sandbox)
            after = await sandbox.exec("test -L /logs/verifier && echo link; ls /logs/verifier /app/mine")
            return look, verdict, after.stdout
    look, verdict, after = asyncio.run(go())
    assert after == "/app/mine:\nreward.json\n\n/logs/verifier:\nreward.txt\n"
    assert "cannot access '/tests': No such file or directory" in look.stdout
    assert "cannot access '/solution': No such file or directory" in look.stdout
    assert (verdict.reward, verdict.detail) == (0.0, "reward.txt says 0")  # the real test.sh ran


def write_task(tmp_path: Path, test_sh: str, verifier_timeout: float = 30.0, verifier_extra: str = ""):
    task = tmp_path / "v"
    (task / "tests").mkdir(parents=True)
    (task / "task.toml").write_text(f"[verifier]\ntimeout_sec = {verifier_timeout}\n{verifier_extra}")
    (task / "instruction.md").write_text("x")
    (task / "tests" / "test.sh").write_text(test_sh)
    return spec_of(discover(task)[0].task)


def test_verifier_env_reaches_the_verifier(sandbox_cfg, tmp_path):
    s = write_task(tmp_path, 'test "$MODE/$TEST_DIR" = strict//tests && echo 1 > /logs/verifier/reward.txt\n',
                   verifier_extra='env = { MODE = "strict" }\n')
    assert episode(sandbox_cfg, s, oracle=False).reward == 1.0


def test_verifier_timeout_is_reward_zero_saying_so(sandbox_cfg, tmp_path):
    s = write_task(tmp_path, "echo 1 > /logs/verifier/reward.txt; sleep 30\n", verifier_timeout=1)
    v = episode(sandbox_cfg, s, oracle=False)
    assert (v.reward, v.success, v.detail) == (0.0, False, "the verifier timed out after 1 s (bash /tests/test.sh)")


def test_missing_or_malformed_reward_file_is_reward_zero_saying_so(sandbox_cfg, tmp_path):
    s = write_task(tmp_path / "a", "echo checking; echo 'oops: no reward written' >&2; exit 2\n")
    v = episode(sandbox_cfg, s, oracle=False)
    assert (v.reward, v.success) == (0.0, False)
    assert v.detail == ("bash /tests/test.sh wrote no /logs/verifier/reward.txt or reward.json (exit code 2): "
                        "oops: no reward written")
    s = write_task(tmp_path / "b", "echo great > /logs/verifier/reward.txt\n")
    v = episode(sandbox_cfg, s, oracle=False)
    assert (v.reward, v.detail) == (0.0, "reward.txt holds 'great', not a number (written by bash /tests/test.sh)")


def test_a_compose_environment_reaches_the_agents_shell(sandbox_cfg):
    async def go():
        async with open_sandbox(sandbox_cfg) as sandbox:
            await prepare_environment(spec("tb1-csv-sum"), sandbox)
            return (await sandbox.exec('echo "$SALES_CURRENCY ${TEST_DIR:-unset}"')).stdout
    assert asyncio.run(go()) == "EUR unset\n"  # TEST_DIR is the verifier's only


def test_oracle_copies_only_the_solution_into_slash_solution(sandbox_cfg):
    s = spec("tb1-csv-sum")

    async def go():
        async with open_sandbox(sandbox_cfg) as sandbox:
            await prepare_environment(s, sandbox)
            script = await copy_solution(s, sandbox)
            return script, (await sandbox.exec("ls /solution; ls /tests 2>&1")).stdout
    script, listing = asyncio.run(go())
    assert script == "/solution/solution.sh"
    assert listing.splitlines()[0] == "solution.sh" and "No such file" in listing


def test_the_unisolated_backend_is_refused_for_terminal_tasks():
    cfg = SandboxConfig(backend="subprocess", allow_unisolated=True)

    async def go():
        async with open_sandbox(cfg) as sandbox:
            with pytest.raises(TaskRefused) as e:
                await prepare_environment(spec("harbor-word-count"), sandbox)
            return str(e.value)
    assert asyncio.run(go()).startswith("harbor-word-count: terminal tasks work in absolute paths (/app, /tests, "
                                        "/logs/verifier), which sandbox.backend=subprocess would read and write on "
                                        "the host itself")


def test_pytest_report_with_spaced_ids_grouped_skips_and_teardown_errors():
    report = ("=========================== short test summary info ============================\n"
              "PASSED t.py::test_pair[a b]\n"
              "PASSED t.py::test_pair[a c]\n"
              "SKIPPED [2] t.py:9: needs a display\n"
              "PASSED t.py::test_cleanup\n"
              "ERROR t.py::test_cleanup - OSError: teardown failed\n"
              "FAILED t.py::test_pair[x - y] - assert 0\n"
              "=================== 1 failed, 4 passed, 2 skipped, 1 error in 0.31s ===================\n")
    counts = parse_pytest(report)
    assert (counts.passed, counts.total) == (4, 6)
