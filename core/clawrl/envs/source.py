"""Samples from an environment: ``group_size`` rollouts per task form a GRPO group.

Live chat yields one reply per prompt, so its samples are groups of one; an environment can replay
a task, so the same task is rolled out ``group_size`` times and the rollouts are compared with each
other (``train.group_advantage``). A group is complete when every rollout of it has finished; only
complete groups are handed on.

An episode becomes samples in one of two shapes (``env.sample_mode``):

- ``trajectory``: one sample per episode, the first prompt and then everything after it, the loss
  mask 1 on the model's sampled tokens only (``clawrl.envs.rollout``);
- ``per_turn``: one sample per model turn, its prompt exactly the context that turn was sampled
  from and its response exactly the ids sampled there (OpenClaw-RL terminal-rl's
  ``dynamic_history``). Every turn takes its episode's advantage and stays in its episode's group.

An episode whose environment failed is left out of its group's statistics with a logged reason;
the advantages are computed over the rest. A group with fewer than two healthy episodes has
nothing to compare and yields no samples; nor does a group whose rewards are all equal (every
advantage would be 0: no rollout was better than another). Both are counted (``counters``, logged
with every group), as are truncated episodes by reason and malformed replies. With
``env.group_size=1`` there is no group to compare within: each healthy episode trains on its own
reward, as a live-chat turn does (``clawrl.losses.group_advantages``).

Per-step scores (``env.step_judge=prm``, per_turn only): the PRM judge reads each turn's reply and
the observation that followed it and scores it -1/0/+1 (OpenClaw-RL's process reward); a turn's
advantage is then its episode's plus ``env.step_score_weight`` times its score (0 where the judge
had no verdict, and for a last turn with no next state), so a good step in a failed episode is
pushed down less than the bad one beside it.

Rollouts of one group run concurrently, each with its own sampling seed, so they differ even
where the environment is deterministic.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
from collections import Counter
from typing import Callable, Optional

import torch

from clawrl.config import ClawrlConfig
from clawrl.engines.base import ROLLOUT_PRIORITY, Engine, SamplingParams
from clawrl.envs import env_class
from clawrl.envs.base import Env, EnvError, Task
from clawrl.envs.rollout import Episode, failed_episode, run_episode
from clawrl.envs.tasks import load_tasks
from clawrl.judges.base import Judge
from clawrl.judges.prm import PRMJudge
from clawrl.losses import group_advantages
from clawrl.samples import Sample

log = logging.getLogger(__name__)

TRAJECTORY, PER_TURN = "trajectory", "per_turn"
SAMPLE_MODES = (TRAJECTORY, PER_TURN)
NO_STEP_JUDGE, PRM = "none", "prm"
STEP_JUDGES = (NO_STEP_JUDGE, PRM)


def group_id(task: Task, round_: int) -> str:
    """A group is one task in one round: the same task rolled out again later is a new group."""
    return hashlib.sha256(f"{task.task_id}\0{round_}".encode()).hexdigest()[:24]


class EnvSource:
    """Rolls out complete GRPO groups over ``tasks`` (round-robin), as samples; ``new_env`` makes
    the environment of one episode. ``counters`` says how many episodes, groups and samples came
    out and why some did not."""

    def __init__(self, new_env: Callable[[], Env], tasks: list[Task], engine: Engine, tokenizer, group_size: int,
                 params: SamplingParams, max_turns: int, group_advantage: str = "grpo",
                 sample_mode: str = TRAJECTORY, max_total_tokens: Optional[int] = None,
                 episode_timeout_s: Optional[float] = None, step_judge: Optional[Judge] = None,
                 step_score_weight: float = 0.0):
        if group_size < 1:
            raise EnvError(f"env.group_size must be >= 1, got {group_size}")
        if not tasks:
            raise EnvError("no tasks to roll out")
        if sample_mode not in SAMPLE_MODES:
            raise EnvError(f"env.sample_mode must be one of {', '.join(SAMPLE_MODES)}, got {sample_mode!r}")
        if step_judge is not None and sample_mode != PER_TURN:
            raise EnvError("env.step_judge scores each turn, and a trajectory sample has one advantage for all of "
                           "them: use it with env.sample_mode=per_turn")
        self.new_env, self.tasks, self.engine, self.tokenizer = new_env, tasks, engine, tokenizer
        self.group_size, self.params, self.max_turns = group_size, params, max_turns
        self.group_advantage, self.sample_mode = group_advantage, sample_mode
        self.max_total_tokens, self.episode_timeout_s = max_total_tokens, episode_timeout_s
        self.step_judge, self.step_score_weight = step_judge, step_score_weight
        self._groups = 0  # groups rolled out so far: task = groups % len(tasks), round = groups // len(tasks)
        self._ids = itertools.count(1)
        self.counters: Counter[str] = Counter()

    async def next_group(self) -> tuple[list[Episode], list[Sample]]:
        """Roll out the next task ``group_size`` times; the episodes (failed ones included) and the
        samples of the group, advantages set (none when the group is filtered)."""
        round_, index = divmod(self._groups, len(self.tasks))
        self._groups += 1
        task = self.tasks[index]
        seed = (self.params.seed or 0) + self.group_size * self._groups
        results = await asyncio.gather(*(self.episode(task, seed + k) for k in range(self.group_size)),
                                       return_exceptions=True)
        raised = next((r for r in results if isinstance(r, BaseException)), None)
        if raised is not None:  # the engine failed, not an environment: the run cannot go on
            raise raised
        episodes: list[Episode] = list(results)
        gid = group_id(task, round_)
        samples = self._group_samples(gid, episodes)
        self._count(episodes, samples)
        log.info("group %s: task %s, rewards %s, %d turns, %d samples (%s); so far %s", gid, task.task_id,
                 [None if e.failed else round(e.reward, 3) for e in episodes], sum(e.turns for e in episodes),
                 len(samples), self.sample_mode, dict(sorted(self.counters.items())))
        return episodes, samples

    async def episode(self, task: Task, seed: int) -> Episode:
        """One rollout of ``task`` sampled with ``seed``; an environment that cannot be made or fails
        fails the episode (``Episode.failed``), an engine failure raises."""
        try:
            env = self.new_env()
        except Exception as e:  # an environment that cannot even be made fails its episode, not the run
            return failed_episode(task, f"making the environment raised {type(e).__name__}: {e}")
        return await run_episode(self.engine, self.tokenizer, env, task, dataclasses.replace(self.params, seed=seed),
                                 self.max_turns, max_total_tokens=self.max_total_tokens,
                                 timeout_s=self.episode_timeout_s, step_judge=self.step_judge)

    def _group_samples(self, gid: str, episodes: list[Episode]) -> list[Sample]:
        for e in episodes:
            if e.failed:
                log.warning("group %s: an episode of task %s failed and is left out: %s", gid, e.task.task_id,
                            e.error)
        outcome, advantages = score_group([None if e.failed else e.reward for e in episodes], self.group_size,
                                          self.group_advantage, gid)
        self.counters[f"groups_{outcome}"] += 1
        return [s for e, a in zip(episodes, advantages) if a is not None for s in self._samples(gid, e, a)]

    def _samples(self, gid: str, e: Episode, advantage: float) -> list[Sample]:
        extra = {"temperature": self.params.logprob_temperature, "task_id": e.task.task_id}
        if self.sample_mode == TRAJECTORY:
            return [Sample(sample_id=next(self._ids), turn_id=0, group_id=gid, prompt_ids=e.prompt_ids,
                           response_ids=e.response_ids, rollout_logprobs=e.logprobs, weight_versions=e.weight_versions,
                           reward=e.reward, advantage=advantage, loss_mask=e.loss_mask, extra=dict(extra))]
        scores = e.step_scores or [None] * e.turns
        return [Sample(sample_id=next(self._ids), turn_id=turn, group_id=gid, prompt_ids=context,
                       response_ids=e.response_ids[start:end], rollout_logprobs=e.logprobs[start:end],
                       weight_versions=e.weight_versions[start:end], reward=e.reward,
                       advantage=advantage + self.step_score_weight * (score or 0),
                       loss_mask=[1] * (end - start),
                       extra=dict(extra) if score is None else {**extra, "step_score": score})
                for turn, ((context, start, end), score) in enumerate(zip(e.turn_contexts(), scores))
                if end > start]  # a turn that sampled nothing has nothing to train

    def _count(self, episodes: list[Episode], samples: list[Sample]) -> None:
        c = self.counters
        c["groups"] += 1
        c["samples"] += len(samples)
        for e in episodes:
            c["episodes"] += 1
            c["turns"] += e.turns
            c["malformed_replies"] += e.malformed
            if self.step_judge is not None:
                c["steps_judged"] += sum(s is not None for s in e.step_scores)
            if e.failed:
                c["failed"] += 1
            elif e.truncated:
                c["truncated"] += 1
                c[f"truncated:{e.reason}"] += 1


# How a group ended (``score_group``): its samples train, or why it yields none.
KEPT, FILTERED_EQUAL, TOO_FEW_HEALTHY, NONE_HEALTHY = "kept", "filtered_equal", "too_few_healthy", "none_healthy"


def score_group(rewards: list[Optional[float]], group_size: int, mode: str,
                gid: str = "") -> tuple[str, list[Optional[float]]]:
    """The advantage of each rollout of a group from its reward (None: the episode failed and is
    left out), and how the group ended: ``kept``, or no samples at all because fewer than two
    rollouts are healthy (``too_few_healthy``; a group of one needs one) or every reward is equal
    (``filtered_equal``). A pure function, so a group completed across a restart, from episodes
    stored by two processes, is scored exactly as one rolled out in one go."""
    healthy = [r for r in rewards if r is not None]
    if group_size > 1 and len(healthy) < 2:
        log.warning("group %s yields no samples: %d of %d episodes are healthy, and a group needs 2 to compare",
                    gid, len(healthy), len(rewards))
        return TOO_FEW_HEALTHY, [None] * len(rewards)
    if not healthy:
        return NONE_HEALTHY, [None] * len(rewards)
    values = torch.tensor(healthy, dtype=torch.float64)
    if group_size > 1 and bool((values == values[0]).all()):
        log.info("group %s yields no samples: every reward is %g, so no rollout was better than another",
                 gid, float(values[0]))
        return FILTERED_EQUAL, [None] * len(rewards)
    advantages = iter(group_advantages(values, torch.zeros(len(healthy), dtype=torch.long), mode).tolist())
    return KEPT, [None if r is None else float(next(advantages)) for r in rewards]


def make_env_source(cfg: ClawrlConfig, engine: Engine) -> EnvSource:
    """The source ``env.*`` describes, rolling out with ``engine`` (the served policy)."""
    cls = env_class(cfg.env.name)
    params = SamplingParams(max_new_tokens=cfg.env.max_tokens_per_turn, temperature=cfg.env.temperature,
                            seed=cfg.seed, priority=ROLLOUT_PRIORITY)
    # the policy judges its own steps: a separate judge engine is the orchestrator's to make
    step_judge = PRMJudge(engine, engine.tokenizer, votes=cfg.judge.votes, seed=cfg.seed) \
        if cfg.env.step_judge == PRM else None
    return EnvSource(lambda: cls.from_config(cfg), load_tasks(cfg.env.tasks, cfg.env.split, cls), engine,
                     engine.tokenizer, cfg.env.group_size, params, cfg.env.max_turns, cfg.train.group_advantage,
                     sample_mode=cfg.env.sample_mode, max_total_tokens=cfg.env.max_total_tokens,
                     episode_timeout_s=cfg.env.episode_timeout_s, step_judge=step_judge,
                     step_score_weight=cfg.env.step_score_weight)
