"""A tiny deterministic multi-turn environment for tests: guess the hidden number.

The model guesses; the environment answers "higher" or "lower" until the guess is right or the
turns run out. The reward is dense enough to tell two rollouts apart: 1 for the right number, else
``-|guess - target| / 100`` for the last guess (-1 when no guess was a number).
"""
from __future__ import annotations

import asyncio
import re

from clawrl.envs import Env, Observation, StepOutcome, Task


class GuessNumber(Env):
    def __init__(self):
        self.target = 0
        self.reward = -1.0

    @classmethod
    def tasks(cls, split: str) -> list[Task]:
        targets = {"train": [7, 42, 63], "test": [18, 91]}[split]
        return [Task(task_id=f"guess-{t}", data={"target": t}) for t in targets]

    async def reset(self, task: Task) -> Observation:
        self.target = int(task.data["target"])
        return Observation([{"role": "user", "content": "Guess my number between 1 and 100. Answer with a number."}])

    async def step(self, action: str) -> StepOutcome:
        found = re.search(r"-?\d+", action)
        if found is None:
            return StepOutcome(Observation([{"role": "user", "content": "That is not a number. Guess again."}]),
                               reward=self.reward)
        guess = int(found.group())
        if guess == self.target:
            return StepOutcome(None, reward=1.0, done=True)
        self.reward = -abs(guess - self.target) / 100
        hint = "higher" if guess < self.target else "lower"
        return StepOutcome(Observation([{"role": "user", "content": f"No, {hint}."}]), reward=self.reward)


class SlowGuessNumber(GuessNumber):
    """Each answer takes a second, so a test can kill the process while episodes are running."""

    async def step(self, action: str) -> StepOutcome:
        await asyncio.sleep(1.0)
        return await super().step(action)
