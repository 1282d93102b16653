"""Samples from an environment: ``group_size`` rollouts per task form a GRPO group.

Live chat yields one reply per prompt, so its samples are groups of one; an environment can replay
a task, so the same task is rolled out ``group_size`` times and the rollouts are compared with each
other (``train.group_advantage``). A group is complete when every rollout of it has finished; only
complete groups are handed on, and each episode becomes one trajectory sample whose loss mask
covers the model's sampled tokens and nothing else (``clawrl.envs.rollout``).

Rollouts of one group run concurrently, each with its own sampling seed, so they differ even
where the environment is deterministic.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
from typing import Callable

import torch

from clawrl.config import ClawrlConfig
from clawrl.engines.base import Engine, SamplingParams
from clawrl.envs import env_class
from clawrl.envs.base import Env, EnvError, Task
from clawrl.envs.rollout import Episode, run_episode
from clawrl.envs.tasks import load_tasks
from clawrl.losses import group_advantages
from clawrl.samples import Sample

log = logging.getLogger(__name__)


def group_id(task: Task, round_: int) -> str:
    """A group is one task in one round: the same task rolled out again later is a new group."""
    return hashlib.sha256(f"{task.task_id}\0{round_}".encode()).hexdigest()[:24]


class EnvSource:
    """Rolls out complete GRPO groups over ``tasks`` (round-robin), as samples; ``new_env`` makes
    the environment of one episode."""

    def __init__(self, new_env: Callable[[], Env], tasks: list[Task], engine: Engine, tokenizer, group_size: int,
                 params: SamplingParams, max_turns: int, group_advantage: str = "grpo"):
        if group_size < 1:
            raise EnvError(f"env.group_size must be >= 1, got {group_size}")
        if not tasks:
            raise EnvError("no tasks to roll out")
        self.new_env, self.tasks, self.engine, self.tokenizer = new_env, tasks, engine, tokenizer
        self.group_size, self.params, self.max_turns = group_size, params, max_turns
        self.group_advantage = group_advantage
        self._groups = 0  # groups rolled out so far: task = groups % len(tasks), round = groups // len(tasks)
        self._ids = itertools.count(1)

    async def next_group(self) -> tuple[list[Episode], list[Sample]]:
        """Roll out the next task ``group_size`` times; the episodes and their samples, advantages set."""
        round_, index = divmod(self._groups, len(self.tasks))
        self._groups += 1
        task = self.tasks[index]
        seed = (self.params.seed or 0) + self.group_size * self._groups
        episodes = await asyncio.gather(*(
            run_episode(self.engine, self.tokenizer, self.new_env(), task,
                        dataclasses.replace(self.params, seed=seed + k), self.max_turns)
            for k in range(self.group_size)))
        gid = group_id(task, round_)
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
        advantages = group_advantages(rewards, torch.zeros(len(episodes), dtype=torch.long), self.group_advantage)
        samples = [Sample(sample_id=next(self._ids), turn_id=0, group_id=gid, prompt_ids=e.prompt_ids,
                          response_ids=e.response_ids, rollout_logprobs=e.logprobs, weight_versions=e.weight_versions,
                          reward=e.reward, advantage=float(a), loss_mask=e.loss_mask)
                   for e, a in zip(episodes, advantages.tolist())]
        log.info("group %s: task %s, %d rollouts, rewards %s, %d turns", gid, task.task_id, len(episodes),
                 [round(e.reward, 3) for e in episodes], sum(e.turns for e in episodes))
        return list(episodes), samples


def make_env_source(cfg: ClawrlConfig, engine: Engine) -> EnvSource:
    """The source ``env.*`` describes, rolling out with ``engine`` (the served policy)."""
    cls = env_class(cfg.env.name)
    params = SamplingParams(max_new_tokens=cfg.env.max_tokens_per_turn, temperature=cfg.env.temperature,
                            seed=cfg.seed)
    return EnvSource(lambda: cls.from_config(cfg), load_tasks(cfg.env.tasks, cfg.env.split, cls), engine, engine.tokenizer,
                     cfg.env.group_size, params, cfg.env.max_turns, cfg.train.group_advantage)
