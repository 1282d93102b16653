"""Judge an episode with the task's own tests, and run the task's oracle.

``verify`` runs only after the agent has stopped: it empties /tests and /logs/verifier (whatever
the agent left there, a planted reward.txt or conftest.py included, is gone), copies the tests in,
and runs the test command from the working directory within the verifier's time limit. The reward
is the verifier's reward.txt or reward.json, else (Terminal-Bench 1.0) the share of tests pytest
reports passed. Success is reward >= 1, or every Terminal-Bench 1.0 test passed. A verifier that
times out, writes no reward, or writes a malformed one gives reward 0 and says so in ``detail``.

The usual test scripts of both formats (Terminal-Bench 1.0's run-tests.sh, Harbor's template
tests/test.sh) fetch their test tools first (curl the uv installer, ``uv pip install pytest``,
``uvx pytest``), which cannot work without network. When such a script leaves no pytest report,
the tests are run with the host's own pytest instead (``python3 -m pytest -rA`` on
/tests/test_outputs.py, or /tests), within the verifier time left; the reward is what the script
would have made of that run (tb1: the share passed; Harbor's template: 1 if all passed, else 0)
and ``detail`` says so.

``run_oracle`` copies the solution to /solution and runs it from the working directory, within the
agent's time limit: the reference for "the task can be solved here".
"""
from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from clawrl.envs.base import EnvError
from clawrl.envs.sandbox import ExecResult, Sandbox, SandboxError
from clawrl.envs.task_formats.environment import FETCHES, copy_into, make_dirs
from clawrl.envs.task_formats.rewards import RewardFileError, parse_pytest, parse_reward_json, parse_reward_txt
from clawrl.envs.task_formats.spec import SOLUTION_DIR, TB1, TESTS_DIR, VERIFIER_LOGS, TerminalTaskSpec

REWARD_FILES = ("reward.txt", "reward.json")


@dataclass(frozen=True)
class Verdict:
    reward: float
    success: bool
    passed: Optional[int]  # tests passed, where pytest's report shows them
    total: Optional[int]
    detail: str  # one line: where the reward came from, or why it is 0


async def verify(spec: TerminalTaskSpec, sandbox: Sandbox) -> Verdict:
    """Copy the tests in, run them, and read the reward (see the module docstring)."""
    _clear(sandbox, TESTS_DIR)
    _clear(sandbox, VERIFIER_LOGS)
    await make_dirs(sandbox, [TESTS_DIR, VERIFIER_LOGS])
    if spec.tests_dir is not None:
        await copy_into(sandbox, spec.tests_dir, TESTS_DIR)
    for extra in spec.extra_test_files:
        await copy_into(sandbox, extra, f"{TESTS_DIR}/{extra.name}")
    start = time.monotonic()
    result = await sandbox.exec(spec.test_command, env=spec.test_env, timeout_s=spec.verifier_timeout_s)
    counts = parse_pytest(result.stdout + "\n" + result.stderr)
    passed, total = (counts.passed, counts.total) if counts else (None, None)
    if result.timed_out:
        return Verdict(0.0, False, passed, total,
                       f"the verifier timed out after {spec.verifier_timeout_s:g} s ({spec.test_command})")
    if counts is None and _fetches_pytest(spec):
        return await _verify_with_host_pytest(spec, sandbox, spec.verifier_timeout_s - (time.monotonic() - start))
    try:
        found = await _reward_file(sandbox)
    except RewardFileError as e:
        return Verdict(0.0, False, passed, total, f"{e} (written by {spec.test_command})")
    if found is not None:
        name, reward = found
        return Verdict(reward, reward >= 1.0, passed, total, f"{name} says {reward:g}")
    if spec.format == TB1 and spec.parser == "pytest":
        if counts is None or counts.total == 0:
            return Verdict(0.0, False, passed, total, f"no pytest report in the test output (exit code "
                           f"{result.returncode}): {_last_words(result)}")
        reward = counts.passed / counts.total
        return Verdict(reward, counts.passed == counts.total, passed, total,
                       f"{counts.passed} of {counts.total} tests passed")
    return Verdict(0.0, False, passed, total,
                   f"{spec.test_command} wrote no {VERIFIER_LOGS}/reward.txt or reward.json (exit code "
                   f"{result.returncode}): {_last_words(result)}")


async def copy_solution(spec: TerminalTaskSpec, sandbox: Sandbox) -> str:
    """Copy the oracle into /solution (Harbor: all of solution/, which solve.sh may use; tb1:
    solution.sh alone) and return the in-sandbox path of the script to run. EnvError: no oracle."""
    if spec.solution is None:
        why = spec.metadata.get("no_oracle_reason", "it ships no solution/solve.sh or solution.sh")
        raise EnvError(f"{spec.task_id} has no oracle: {why}")
    if spec.solution.parent.name == "solution" and spec.solution.parent != spec.path:
        await copy_into(sandbox, spec.solution.parent, SOLUTION_DIR)
    else:
        await copy_into(sandbox, spec.solution, f"{SOLUTION_DIR}/{spec.solution.name}")
    return f"{SOLUTION_DIR}/{spec.solution.name}"


async def run_oracle(spec: TerminalTaskSpec, sandbox: Sandbox) -> ExecResult:
    """Run the task's solution in its working directory, within the agent's time limit."""
    script = await copy_solution(spec, sandbox)
    return await sandbox.exec(["bash", script], timeout_s=spec.agent_timeout_s)


async def _verify_with_host_pytest(spec: TerminalTaskSpec, sandbox: Sandbox, left_s: float) -> Verdict:
    """The tests of a task whose script fetches pytest from the network, run with the host's pytest.
    The reward is what the script would have made of the run: Terminal-Bench 1.0's share of tests
    passed; Harbor's template test.sh writes 1 when pytest passes and 0 otherwise."""
    why = f"{_test_script(spec).name} fetches its test tools from the network; the host's pytest ran the tests"
    if left_s <= 0:
        return Verdict(0.0, False, None, None, f"the verifier timed out after {spec.verifier_timeout_s:g} s ({why})")
    result = await sandbox.exec(["python3", "-m", "pytest", "-rA", "-p", "no:cacheprovider", *_pytest_targets(spec)],
                                env=spec.test_env, timeout_s=left_s)
    counts = parse_pytest(result.stdout + "\n" + result.stderr)
    passed, total = (counts.passed, counts.total) if counts else (None, None)
    if result.timed_out:
        return Verdict(0.0, False, passed, total, f"the verifier timed out after {spec.verifier_timeout_s:g} s ({why})")
    if counts is None or counts.total == 0:
        return Verdict(0.0, False, passed, total, f"no pytest report ({why}): {_last_words(result)}")
    all_passed = counts.passed == counts.total
    reward = counts.passed / counts.total if spec.format == TB1 else float(all_passed)
    return Verdict(reward, all_passed, passed, total, f"{counts.passed} of {counts.total} tests passed ({why})")


_TEST_FILE = re.compile(r"(?:\$\{?TEST_DIR\}?|/tests)/([\w./-]+\.py)\b")


def _pytest_targets(spec: TerminalTaskSpec) -> list[str]:
    """The test files the script hands pytest ($TEST_DIR/test_outputs.py ...), else all of /tests."""
    names = dict.fromkeys(_TEST_FILE.findall(_test_script(spec).read_text(errors="replace")))
    found = [f"{TESTS_DIR}/{n}" for n in names if spec.tests_dir is not None and (spec.tests_dir / n).is_file()]
    return found or [TESTS_DIR]


def _test_script(spec: TerminalTaskSpec) -> Path:
    """The script test_command runs: tb1's run-tests.sh, Harbor's tests/test.sh."""
    for f in spec.extra_test_files:
        if f.name == "run-tests.sh":
            return f
    return (spec.tests_dir or spec.path / "tests") / "test.sh"


def _fetches_pytest(spec: TerminalTaskSpec) -> bool:
    """Whether the task's test script installs its tools from the network (curl, uv, pip, apt-get)
    to run pytest, which no sandbox here can do."""
    script = _test_script(spec)
    if not script.is_file():
        return False
    text = script.read_text(errors="replace")
    return "pytest" in text and FETCHES.search(text) is not None


def _clear(sandbox: Sandbox, path: str) -> None:
    """Remove in-sandbox ``path`` and everything under it, from the host side. The path is taken
    literally under the sandbox's tree: a link the agent planted on the way is removed, never
    followed (and rmtree does not follow links inside)."""
    host = sandbox.root
    for part in path.strip("/").split("/"):
        host = host / part
        if host.is_symlink() or host.is_file():
            host.unlink()
            return
        if not host.is_dir():
            return
    shutil.rmtree(host)


async def _reward_file(sandbox: Sandbox) -> Optional[tuple[str, float]]:
    for name in REWARD_FILES:  # a missing (or unreadable) file is no reward; the next is tried
        try:
            data = await sandbox.read_file(f"{VERIFIER_LOGS}/{name}")
        except SandboxError:
            continue
        text = data.decode(errors="replace")
        return name, parse_reward_txt(text) if name.endswith(".txt") else parse_reward_json(text)
    return None


def _last_words(result: ExecResult) -> str:
    for text in (result.stderr, result.stdout):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        if lines:
            return lines[-1][:200]
    return "no output"
