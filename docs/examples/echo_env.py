"""A new sample source in one file: an environment that asks the model to repeat a word.

Run it with ``env.name=docs/examples/echo_env.py:EchoWord`` (``clawrl.envs.source.make_env_source``
rolls out ``env.group_size`` episodes per task and hands complete GRPO groups on). The model gets two
tries; the reward is 1 when its reply is the word, else the share of the word's letters it got right
in place. tests/test_docs_examples.py rolls out a group and trains a step with it.
"""
from clawrl.envs import Env, Observation, StepOutcome, Task


class EchoWord(Env):
    WORDS = {"train": ["apple", "river", "stone", "cloud"], "test": ["maple", "ocean"]}

    def __init__(self):
        self.word = ""

    @classmethod
    def tasks(cls, split: str) -> list[Task]:
        return [Task(task_id=f"echo-{w}", data={"word": w}) for w in cls.WORDS[split]]

    async def reset(self, task: Task) -> Observation:
        self.word = task.data["word"]
        return Observation([{"role": "user", "content": f"Repeat this word exactly: {self.word}"}])

    async def step(self, action: str) -> StepOutcome:
        reply = action.strip().lower()
        if reply == self.word:
            return StepOutcome(None, reward=1.0, done=True)
        right = sum(a == b for a, b in zip(reply, self.word)) / len(self.word)
        again = Observation([{"role": "user", "content": f"Not quite. The word is {self.word}."}])
        return StepOutcome(again, reward=right)
