"""Scripted episodes (oracle and no-op) and the terminal agent's reply format.

The oracle and the no-op prove an environment's ground before a model touches it, so they must go
through the same reset/step/finish path a model's episode takes: an oracle that ends early is
judged by ``finish``, a task without an oracle says so, and the environment is always closed."""
from __future__ import annotations

import asyncio

import pytest

from clawrl.envs import Env, Observation, StepOutcome, Task
from clawrl.envs.sandbox import ExecResult
from clawrl.envs.scripted import NOP, ORACLE, NoOracle, play
from clawrl.envs.terminal import OBSERVATION_CHARS, parse_action, render_result


class Counter(Env):
    """Count to the task's target by replying "+1"; judged on the final count when cut short."""

    def __init__(self, oracle=True, ends_itself=True):
        self.oracle, self.ends_itself = oracle, ends_itself
        self.count = self.target = 0
        self.closed = 0

    async def reset(self, task: Task) -> Observation:
        self.target = task.data["target"]
        return Observation([{"role": "user", "content": f"count to {self.target}"}])

    async def step(self, action: str) -> StepOutcome:
        self.count += action == "+1"
        if self.ends_itself and self.count == self.target:
            return StepOutcome(None, reward=1.0, done=True, info={"reason": "reached"})
        return StepOutcome(Observation([{"role": "user", "content": str(self.count)}]), reward=0.0)

    async def finish(self):
        return StepOutcome(None, reward=self.count / self.target, info={"success": self.count == self.target})

    async def oracle_actions(self):
        return ["+1"] * self.target if self.oracle else None

    async def close(self):
        self.closed += 1


TASK = Task("count-3", {"target": 3})


def test_the_oracle_plays_its_replies_until_the_environment_ends_the_episode():
    env = Counter()
    report = asyncio.run(play(env, TASK, ORACLE, max_turns=8))
    assert (report.reward, report.success, report.turns, report.truncated, report.reason) == (1.0, True, 3, False,
                                                                                            "reached")
    assert [m["content"] for m in report.transcript] == ["count to 3", "+1", "1", "+1", "2", "+1"]
    assert env.closed == 1


def test_an_oracle_that_stops_before_the_end_is_judged_by_finish():
    report = asyncio.run(play(Counter(ends_itself=False), TASK, ORACLE, max_turns=8))
    assert (report.reward, report.success, report.truncated, report.reason) == (1.0, True, False, "policy_stopped")


def test_the_nop_runs_out_of_turns_and_finish_judges_what_is_left():
    env = Counter()
    report = asyncio.run(play(env, TASK, NOP, max_turns=4))
    assert (report.reward, report.success, report.turns, report.truncated, report.reason) == (0.0, False, 4, True,
                                                                                            "max_turns")
    assert env.closed == 1


def test_a_task_without_an_oracle_says_so_and_the_environment_is_closed():
    env = Counter(oracle=False)
    with pytest.raises(NoOracle, match="count-3 has no oracle"):
        asyncio.run(play(env, TASK, ORACLE, max_turns=8))
    assert env.closed == 1


def test_the_oracle_is_cut_by_the_turn_limit_like_any_agent():
    report = asyncio.run(play(Counter(), Task("count-5", {"target": 5}), ORACLE, max_turns=2))
    assert (report.reward, report.truncated, report.turns) == (pytest.approx(0.4), True, 2)


# --- the terminal agent's replies ----------------------------------------------------------------

@pytest.mark.parametrize("reply, commands, done", [
    ("```bash\nls -la\n```", "ls -la", False),
    ("Let me look.\n```sh\ncat a\n```\nthen\n```\nwc -l a\n```", "cat a\nwc -l a", False),
    ("All finished.\nDONE", None, True),
    ("```bash\nmv a b\n```\nDone.", "mv a b", True),
    ("```bash\necho DONE\n```", "echo DONE", False),  # DONE inside a command is a command
    ("I think the answer is 4.", None, False),
    ("```python\nprint(1)\n```", None, False),  # only shell blocks run
])
def test_a_reply_runs_its_shell_blocks_and_ends_on_a_done_line(reply, commands, done):
    assert parse_action(reply) == (commands, done)


def test_the_agent_sees_the_exit_code_and_the_tail_of_long_output():
    long = "x" * (OBSERVATION_CHARS + 500) + "END"
    text = render_result(ExecResult(returncode=2, stdout=long, stderr="oops\n", timed_out=True, duration_s=30.2))
    assert text.startswith("exit code 2 (killed: the command ran past its time limit, 30 s)\nstdout:\n[... 503 characters cut")
    assert text.endswith("END\nstderr:\noops")
    assert render_result(ExecResult(0, "", "", False, 0.1)) == "exit code 0"
