"""Environment rollouts beside serving: the sample source of a run with ``env.name`` set.

The ``RolloutWorker`` is to an environment run what the reward judge is to a chat run: it fills the
rollout buffer with ready samples, and the learner trains on them exactly as it trains on judged
turns. It rolls out GRPO groups (``env.group_size`` episodes of one task, ``env.groups_in_flight``
groups at a time) with the engine that serves the policy being trained, so episodes continue across
weight swaps and every token keeps the version that sampled it. Each request carries the rollout
priority, so a live chat's request joins the engine's batch before any waiting rollout turn.

Durability (``clawrl.episode_store``): an episode is recorded as running when it starts and stored
whole when it ends; a group's samples are written with its completion, in one transaction. A
crash leaves running episodes behind; at start they are marked aborted and their groups are rolled
out again where they stopped, before any new group.

Rollouts run ahead of training by at most ``env.rollout_ahead`` train batches of ready samples, so
the samples a step takes were sampled a bounded number of weight versions ago
(``train.max_weight_lag`` decides what happens to older ones). The worker stops starting groups
once the learner has done ``env.max_train_steps`` steps.
"""
from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from typing import Callable, Optional

from clawrl.buffer import RolloutBuffer
from clawrl.config import ClawrlConfig
from clawrl.engines.base import Engine
from clawrl.envs.rollout import Episode
from clawrl.envs.scripted import success_of
from clawrl.envs.source import PER_TURN, EnvSource, group_id, make_env_source, score_group
from clawrl.episode_store import EpisodeStore, GroupPlan, sample_entries

log = logging.getLogger(__name__)

STOPPED = "stopped: the server shut down mid-episode"
# After an engine failure the worker waits this long before the next group (the engine may be
# swapping weights or restarting); the group stays rolling and is resumed.
_RETRY_S = 2.0
# Groups in a row without samples before the worker says that nothing can train.
_UNLEARNABLE_WARN = 25
# When every episode of a group fails (no sandbox slot free on the host, a broken environment), the
# failure is the host's, not the policy's: the worker waits before the group's place is freed,
# doubling the wait for each such group in a row up to the cap, so that it does not spin through
# the task list at thousands of failed episodes a minute (it did, when another process held every
# sandbox uid). The first healthy episode resets the wait.
_FAILING_WAIT_S, _FAILING_WAIT_MAX_S = 2.0, 60.0


class RolloutWorker:
    """Rolls out groups into the buffer; ``start`` / ``stop`` from the learner, ``window()`` hands
    the learner the statistics of the episodes finished since its last step."""

    def __init__(self, cfg: ClawrlConfig, engine: Engine, buffer: RolloutBuffer, episodes: EpisodeStore,
                 wake: Callable[[], None], source: Optional[EnvSource] = None, poll_s: float = 0.25):
        self.cfg, self.buffer, self.episodes, self.wake, self.poll_s = cfg, buffer, episodes, wake, poll_s
        self.source = source or make_env_source(cfg, engine)
        # task files are often sorted by kind: rolled out in a seeded shuffle (the same after a restart),
        # consecutive groups are different kinds of task
        random.Random(cfg.seed).shuffle(self.source.tasks)
        self.task_ids = [t.task_id for t in self.source.tasks]
        self.ahead = cfg.env.rollout_ahead * cfg.train.batch_size
        self.counters: Counter[str] = Counter()
        self.finished: list[Episode] = []  # since the learner's last window()
        self.halted = False  # no new groups (env.max_train_steps reached)
        self._task: Optional[asyncio.Task] = None
        self._groups: dict[str, asyncio.Task] = {}
        self._unlearnable = 0  # groups in a row that yielded no samples
        self._failing = 0  # groups in a row whose every episode failed

    def start(self) -> None:
        aborted = self.episodes.abort_running()
        if aborted:
            log.warning("%d episode(s) were running when the last run stopped: marked aborted, their groups are "
                        "rolled out again first", aborted)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="clawrl-rollouts")

    async def stop(self) -> None:
        """Cancel the groups in flight (their running episodes are marked aborted and resumed by the
        next start), then the loop."""
        self.halted = True
        tasks = [*self._groups.values(), *([self._task] if self._task else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        aborted = await asyncio.to_thread(self.episodes.abort_running, STOPPED)
        if aborted:
            log.info("stopped %d episode(s) mid-way; their groups resume at the next start", aborted)

    def window(self) -> dict:
        """Rollout statistics of the episodes finished since the last call, for the step's metrics:
        success rate, mean reward, truncation rate, turns per episode, failures."""
        done, self.finished = self.finished, []
        ran = [e for e in done if not e.failed]
        n = len(ran) or 1
        return {"rollout/episodes": len(done), "rollout/failed": len(done) - len(ran),
                "rollout/success_rate": sum(success_of(e.reward, e.info) for e in ran) / n,
                "rollout/reward_mean": sum(e.reward for e in ran) / n,
                "rollout/truncated_rate": sum(e.truncated for e in ran) / n,
                "rollout/turns_mean": sum(e.turns for e in ran) / n,
                "rollout/malformed_per_episode": sum(e.malformed for e in ran) / n}

    def status(self) -> dict:
        return {"env": self.cfg.env.name, "tasks": len(self.task_ids), "groups_in_flight": len(self._groups),
                "halted": self.halted, **dict(self.counters), **self.episodes.counts()}

    # ---------------------------------------------------------------- the loop

    async def _run(self) -> None:
        while not self.halted:
            try:
                ready = await asyncio.to_thread(self.buffer.ready_count)
                if ready < self.ahead and len(self._groups) < self.cfg.env.groups_in_flight:
                    plan = await asyncio.to_thread(self.episodes.next_group, self.task_ids, self.cfg.env.group_size,
                                                   self._group_id, set(self._groups))
                    self._groups[plan.group_id] = asyncio.get_running_loop().create_task(
                        self._group(plan), name=f"clawrl-group-{plan.position}")
                    continue
            except asyncio.CancelledError:
                raise
            except Exception:  # a store hiccup must not end the rollouts; logged, retried
                log.exception("rollouts: planning the next group failed")
            if self._groups:
                await asyncio.wait(list(self._groups.values()), timeout=self.poll_s,
                                   return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(self.poll_s)

    def _group_id(self, task_index: int, round_: int) -> str:
        return group_id(self.source.tasks[task_index], round_)

    async def _group(self, plan: GroupPlan) -> None:
        try:
            task = self.source.tasks[plan.task_index]
            if plan.members:
                log.info("group %s: task %s round %d, %s", plan.group_id, task.task_id, plan.round,
                         f"{len(plan.members)} rollouts" if len(plan.members) == plan.size else
                         f"resuming {len(plan.members)} of {plan.size} rollouts after an interruption")
            results = await asyncio.gather(*(self._member(plan, m, attempt) for m, attempt in plan.members),
                                           return_exceptions=True)
            raised = next((r for r in results if isinstance(r, Exception)), None)
            if raised is not None:  # the engine failed (an environment's failure fails only its episode)
                self.counters["engine_errors"] += 1
                log.error("group %s: a rollout's engine request failed (%s: %s); the group resumes later",
                          plan.group_id, type(raised).__name__, raised)
                await asyncio.sleep(_RETRY_S)
                return
            if await asyncio.to_thread(self._complete, plan):
                self.wake()
            await self._back_off_if_all_failed(plan, results)
        finally:
            self._groups.pop(plan.group_id, None)

    async def _back_off_if_all_failed(self, plan: GroupPlan, episodes: list[Episode]) -> None:
        if not episodes or not all(e.failed for e in episodes):
            self._failing = 0
            return
        self._failing += 1
        wait = min(_FAILING_WAIT_S * 2 ** (self._failing - 1), _FAILING_WAIT_MAX_S)
        self.counters["failing_waits"] += 1
        log.warning("every episode of group %s failed (%s); %d such group(s) in a row: waiting %.0f s before the "
                    "next group", plan.group_id, episodes[0].error, self._failing, wait)
        await asyncio.sleep(wait)

    async def _member(self, plan: GroupPlan, member: int, attempt: int) -> Episode:
        task = self.source.tasks[plan.task_index]
        seed = ((self.cfg.seed * 1_000_003 + plan.position) * 64 + member) * 16 + attempt
        episode_id = await asyncio.to_thread(self.episodes.start_episode, plan.group_id, member, attempt,
                                             task.task_id, seed % (2 ** 31),
                                             self.source.params.logprob_temperature)
        try:
            episode = await self.source.episode(task, seed % (2 ** 31))
        except Exception as e:  # the engine's failure: this attempt is aborted, a later one replaces it
            await asyncio.to_thread(self.episodes.abort, episode_id, f"engine error: {type(e).__name__}: {e}")
            raise
        await asyncio.to_thread(self.episodes.finish_episode, episode_id, episode)
        self.finished.append(episode)
        self.counters["episodes"] += 1
        self.counters["failed" if episode.failed else "truncated" if episode.truncated else "ended"] += 1
        if episode.failed:
            log.warning("episode %d (task %s) failed and is left out of its group: %s", episode_id, task.task_id,
                        episode.error)
        return episode

    def _complete(self, plan: GroupPlan) -> list[int]:
        """Score a group whose members all have a result and write its samples (synchronous); the
        new sample ids."""
        members = self.episodes.members(plan.group_id)
        if len(members) < plan.size:
            return []  # a member was cut short (stop): the group stays rolling
        outcome, advantages = score_group([None if m.failed else m.reward for m in members], plan.size,
                                          self.cfg.train.group_advantage, plan.group_id)
        entries = sample_entries(members, advantages, self.cfg.env.sample_mode == PER_TURN,
                                 self.cfg.env.step_score_weight)
        ids = self.episodes.complete_group(plan.group_id, outcome, entries)
        self.counters[f"groups_{outcome}"] += 1
        self._unlearnable = 0 if ids else self._unlearnable + 1
        if self._unlearnable and self._unlearnable % _UNLEARNABLE_WARN == 0:
            log.warning("the last %d groups yielded no samples (every reward equal, or too few healthy episodes): "
                        "nothing trains until a group's rollouts differ; a policy that never solves a task, or "
                        "always does, needs easier or harder tasks, a larger env.group_size or a higher "
                        "env.temperature", self._unlearnable)
        self.counters["samples"] += len(ids)
        log.info("group %s complete (%s): rewards %s -> %d sample(s)", plan.group_id, outcome,
                 [None if m.failed else round(m.reward, 3) for m in members], len(ids))
        return ids
