"""The swe environment: fix a real package's bug in its git working copy, mini-swe-agent style.

One episode is one SWE-bench instance (``clawrl.envs.swe.instances``). The sandbox holds the
instance's buggy working copy in ``/testbed`` (``testbed.materialise``); the agent sees the problem
statement and replies with one ``bash`` block at a time (parsed as the terminal environment parses
them, ``clawrl.envs.terminal.parse_action``, so a bash tool call works too), which runs in a fresh
shell in ``/testbed``; its exit code and output come back. The agent submits by replying ``DONE``
(or, as mini-swe-agent's agents do, by running ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``).

Then the episode's patch is ``git diff`` of the working copy (new files included), and it is
judged as SWE-bench judges (``clawrl.envs.swe.evaluate``), in a fresh sandbox: whatever else the
agent did to its sandbox does not count. An episode cut short (``env.max_turns``, the episode's
clock ``env.episode_timeout_s``) is judged on its diff so far. Each command has
``sandbox.exec_timeout_s``.

Reward (``env.swe_reward``): ``resolved``, +1 when resolved and -1 otherwise; or ``f2p_share``,
2 x (share of FAIL_TO_PASS tests that pass) - 1, and -1 whenever a PASS_TO_PASS test breaks, so a
resolved episode gets +1 either way.
"""
from __future__ import annotations

from typing import Optional

from clawrl.envs.base import Env, EnvError, Observation, StepOutcome, Task
from clawrl.envs.sandbox import Sandbox
from clawrl.envs.swe.evaluate import Verdict, evaluate
from clawrl.envs.swe.instances import Instance, instance_of, refusal
from clawrl.envs.swe.testbed import WORKDIR, diff, materialise, open_testbed
from clawrl.envs.terminal import malformed, parse_action, render_result

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
REWARDS = ("resolved", "f2p_share")
SYSTEM_PROMPT = (
    "You are a software engineer fixing a bug in a Python repository, a git working copy in {workdir}, your "
    "working directory, with no network. Reply with one ```bash code block holding the commands to run next; "
    "you will see their exit code and output. Each block runs in a fresh shell in {workdir}: files persist, "
    "variables do not. Find the cause, edit the source (sed, python or a here-document), and run the tests. "
    "When the fix is done, reply with the single word DONE: your change (git diff) is then judged by the "
    "repository's tests.")


def reward_of(verdict: Verdict, mode: str) -> float:
    """The episode's reward under ``env.swe_reward`` (module docstring)."""
    if mode == "f2p_share":
        return -1.0 if verdict.p2p_failed else 2.0 * verdict.f2p_share - 1.0
    return 1.0 if verdict.resolved else -1.0


class SweEnv(Env):
    """A SWE-bench instance in a sandbox; the reward is the SWE-bench verdict on the episode's diff."""

    def __init__(self, sandbox_cfg, exec_timeout_s: float, reward: str = "resolved"):
        if reward not in REWARDS:
            raise EnvError(f"env.swe_reward must be one of {', '.join(REWARDS)}, got {reward!r}")
        self.sandbox_cfg, self.exec_timeout_s, self.reward_mode = sandbox_cfg, exec_timeout_s, reward
        self.instance: Optional[Instance] = None
        self.sandbox: Optional[Sandbox] = None
        self.verdict: Optional[StepOutcome] = None

    @classmethod
    def from_config(cls, cfg) -> "SweEnv":
        return cls(cfg.sandbox, cfg.sandbox.exec_timeout_s, cfg.env.swe_reward)

    async def reset(self, task: Task) -> Observation:
        self.instance = inst = instance_of(task)
        reason = refusal(inst)
        if reason is not None:
            raise EnvError(reason)
        self.sandbox = open_testbed(self.sandbox_cfg)
        await materialise(self.sandbox, inst.source, inst.patch, inst.base_commit)
        return Observation([{"role": "system", "content": SYSTEM_PROMPT.format(workdir=WORKDIR)},
                            {"role": "user", "content": inst.problem_statement}])

    async def step(self, action: str) -> StepOutcome:
        if self.instance is None:
            raise EnvError("step before reset")
        if self.verdict is not None:
            raise EnvError("the episode is over")
        commands, done = parse_action(action)
        if commands is None and not done:
            return malformed("fix")
        if commands is not None:
            result = await self.sandbox.exec(commands, timeout_s=self.exec_timeout_s)
            if result.stdout.lstrip().startswith(SUBMIT):
                return await self._judge("submitted")
            if not done:
                return StepOutcome(Observation([{"role": "user", "content": render_result(result)}]))
        return await self._judge("done")

    async def finish(self) -> Optional[StepOutcome]:
        """Cut short: the diff so far is judged, and the episode counts as truncated."""
        if self.verdict is not None or self.sandbox is None:
            return self.verdict
        return await self._judge("max_turns", truncated=True)

    async def oracle_actions(self) -> Optional[list[str]]:
        """Apply the gold patch with git apply, then submit."""
        if self.instance is None or not self.instance.patch.strip():
            return None
        marker = "SWE_RL_GOLD_PATCH_END"
        while marker in self.instance.patch:
            marker += "_"
        return [f"```bash\ngit apply - <<'{marker}'\n{self.instance.patch.rstrip(chr(10))}\n{marker}\n```", "DONE"]

    async def _judge(self, reason: str, truncated: bool = False) -> StepOutcome:
        try:
            patch = await diff(self.sandbox)
        except EnvError:  # the agent broke its repository (deleted .git, say): it submitted no change
            patch = ""
        await self.sandbox.close()
        self.sandbox = None
        verdict = await evaluate(self.sandbox_cfg, self.instance, patch)
        self.verdict = StepOutcome(None, reward=reward_of(verdict, self.reward_mode), done=not truncated,
                                   truncated=truncated, info={"success": verdict.resolved, "reason": reason,
                                                              "patch_lines": patch.count("\n"), **verdict.as_info()})
        return self.verdict

    async def close(self) -> None:
        if self.sandbox is not None:
            await self.sandbox.close()
            self.sandbox = None


__all__ = ["REWARDS", "SUBMIT", "SweEnv", "reward_of"]
