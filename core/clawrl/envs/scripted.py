"""Episodes played by a script instead of a model: the oracle and the no-op.

They prove an environment's ground before any model touches it. The oracle replies what
``Env.oracle_actions`` says an agent that knows the answer would reply, so a task it cannot solve
is broken; the no-op replies nothing at all, so a task it solves checks nothing. Both go through
the same ``reset``/``step``/``finish`` path a model's episode takes (``clawrl.envs.rollout``), so
what they prove holds for model episodes too. Text only: no tokens, nothing to train on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from clawrl.envs.base import Env, EnvError, Task

ORACLE, NOP = "oracle", "nop"


class NoOracle(EnvError):
    """The task has no oracle (``Env.oracle_actions`` returned None)."""


@dataclass
class EpisodeReport:
    """How one episode went, as ``clawrl env run`` prints it."""

    task: str
    reward: float
    success: bool
    turns: int
    truncated: bool
    reason: str  # why it ended: done | max_turns | policy_stopped | whatever the environment said
    transcript: list[dict] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"task": self.task, "reward": self.reward, "success": self.success, "turns": self.turns,
                "truncated": self.truncated, "reason": self.reason, "transcript": self.transcript}


def success_of(reward: float, info: dict) -> bool:
    """An environment that knows better says so in ``info["success"]``; otherwise full reward."""
    return bool(info["success"]) if "success" in info else reward >= 1.0


async def play(env: Env, task: Task, policy: str, max_turns: int) -> EpisodeReport:
    """Play ``task`` in ``env`` with the ``oracle`` or ``nop`` policy for at most ``max_turns``
    replies. The environment is closed whatever happens."""
    if policy not in (ORACLE, NOP):
        raise EnvError(f"unknown scripted policy {policy!r}; choose {ORACLE} or {NOP}")
    try:
        first = await env.reset(task)
        transcript = list(first.messages)
        replies: Optional[list[str]] = [""] * max_turns if policy == NOP else await env.oracle_actions()
        if replies is None:
            raise NoOracle(f"task {task.task_id} has no oracle")
        reward, info = None, {}
        for turn, reply in enumerate(replies[:max_turns], 1):
            transcript.append({"role": "assistant", "content": reply})
            outcome = await env.step(reply)
            info = outcome.info
            if outcome.reward is not None:
                reward = outcome.reward
            if outcome.done or outcome.truncated or outcome.observation is None:
                reason = info.get("reason", "done" if outcome.done else "truncated")
                return _report(task, reward, info, turn, outcome.truncated, reason, transcript)
            transcript += outcome.observation.messages
        # The policy ran out of replies (or turns) before the environment ended the episode.
        final = await env.finish()
        if final is not None:
            reward, info = final.reward if final.reward is not None else reward, final.info
        truncated = len(replies) >= max_turns
        return _report(task, reward, info, min(len(replies), max_turns), truncated,
                       "max_turns" if truncated else "policy_stopped", transcript)
    finally:
        await env.close()


def _report(task: Task, reward: Optional[float], info: dict, turns: int, truncated: bool, reason: str,
            transcript: list[dict]) -> EpisodeReport:
    reward = 0.0 if reward is None else float(reward)
    return EpisodeReport(task=task.task_id, reward=reward, success=success_of(reward, info), turns=turns,
                         truncated=truncated, reason=str(reason), transcript=transcript)
