"""Environment episodes in the run store: durable before they count, each trained once, resumed after a crash.

The run's rollouts are a sequence of GRPO groups (``env_groups``): position p rolls out task
``p % len(tasks)`` for round ``p // len(tasks)``, ``size`` times. Each rollout is an episode row:

    running -> finished | failed        (what the environment and the model did)
    running -> aborted                  (the process died mid-episode: found so at the next start)

An episode is inserted as ``running`` when it starts and written whole (every sampled id, logprob,
weight version and the loss mask; one row per model turn in ``episode_steps``) in one transaction
when it ends, so a finished episode is on disk before anything counts it. A group is complete when
each of its members has a finished or failed attempt; completing it writes its samples (born ready,
advantages computed by the caller from the stored rewards) and marks the group complete in one
transaction, and the samples table keeps one sample per source, so a group never trains twice.

After ``kill -9``: ``abort_running`` marks the episodes that were running as aborted, and
``next_group`` hands their group out again with the members that lack a result, as new attempts;
finished members are kept. Positions continue from the stored ones, so a restarted run goes on
with the next task instead of starting the task list over.

The tables are declared in ``clawrl.schema`` (``EPISODES``); samples are the rollout buffer's.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

from clawrl.buffer import RolloutBuffer
from clawrl.samples import EPISODE, STEP
from clawrl.schema import EPISODES
from clawrl.store import TurnStore, pack, unpack

EPISODE_STATES = ("running", "finished", "failed", "aborted")
ABORTED_ON_RESTART = "interrupted: the process stopped mid-episode"


class EpisodeRecord(Protocol):
    """An episode as the store keeps it (``clawrl.envs.rollout.Episode``)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    reward: float
    turns: int
    done: bool
    truncated: bool
    failed: bool
    error: Optional[str]
    reason: str
    malformed: int
    info: dict
    transcript: list[dict]
    turn_starts: list[int]
    sampled: list[list[int]]
    step_scores: list[Optional[int]]


@dataclass
class GroupPlan:
    """A group to roll out: which task, and the members still to run (all of them for a new group;
    the aborted ones of a group resumed after a restart) with their attempt numbers."""

    group_id: str
    position: int
    task_index: int
    round: int
    size: int
    members: list[tuple[int, int]] = field(default_factory=list)  # (member, attempt)


@dataclass
class Member:
    """The result that counts for one member of a group: its latest finished or failed attempt."""

    member: int
    episode_id: int
    failed: bool
    reward: float
    steps: list[tuple[int, Optional[int]]]  # (step_id, step score) per model turn


class EpisodeStore:
    """Episodes and groups on the run's turn store; synchronous SQLite transactions (call them
    with ``asyncio.to_thread`` from the event loop)."""

    def __init__(self, store: TurnStore, buffer: RolloutBuffer):
        self.store, self.buffer = store, buffer
        store.register(EPISODES)

    # --- groups --------------------------------------------------------------------------------

    def abort_running(self, reason: str = ABORTED_ON_RESTART) -> int:
        """Mark every running episode aborted (at start-up: nobody runs them any more). Their groups
        stay rolling and come back from ``next_group``."""
        with self.store.transaction() as c:
            return c.execute("UPDATE episodes SET state = 'aborted', reason = ?, finished_at = ? "
                             "WHERE state = 'running'", (reason, time.time())).rowcount

    def abort(self, episode_id: int, reason: str) -> None:
        """One running episode will not finish (its engine request failed); its group resumes it."""
        with self.store.transaction() as c:
            c.execute("UPDATE episodes SET state = 'aborted', reason = ?, finished_at = ? "
                      "WHERE episode_id = ? AND state = 'running'", (reason[:500], time.time(), episode_id))

    def next_group(self, task_ids: Sequence[str], size: int, group_id_of, busy: set[str]) -> GroupPlan:
        """The oldest rolling group not in ``busy`` (one that a restart interrupted), else a new one at
        the next position. ``group_id_of(task_index, round)`` names a group. Registering the new
        group is durable, so its position is never handed out twice."""
        with self.store.transaction() as c:
            for gid, position, task_id, round_, gsize in c.execute(
                    "SELECT group_id, position, task_id, round, size FROM env_groups WHERE state = 'rolling' "
                    "ORDER BY position").fetchall():
                if gid in busy:
                    continue
                if task_id not in task_ids:  # the task set changed since: its task is gone, and so is the group
                    c.execute("UPDATE env_groups SET state = 'complete', outcome = 'task_removed', done_at = ? "
                              "WHERE group_id = ?", (time.time(), gid))
                    continue
                results = {m for (m,) in c.execute(
                    "SELECT member FROM episodes WHERE group_id = ? AND state IN ('finished', 'failed')", (gid,))}
                attempts = dict(c.execute("SELECT member, MAX(attempt) FROM episodes WHERE group_id = ? "
                                          "GROUP BY member", (gid,)).fetchall())
                members = [(m, attempts.get(m, 0) + 1) for m in range(gsize) if m not in results]
                return GroupPlan(gid, position, task_ids.index(task_id), round_, gsize, members)
            position = c.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM env_groups").fetchone()[0]
            round_, index = divmod(position, len(task_ids))
            gid = group_id_of(index, round_)
            c.execute("INSERT INTO env_groups (group_id, position, task_id, round, size, state, created_at) "
                      "VALUES (?, ?, ?, ?, ?, 'rolling', ?)", (gid, position, task_ids[index], round_, size,
                                                                time.time()))
        return GroupPlan(gid, position, index, round_, size, [(m, 1) for m in range(size)])

    def members(self, group_id: str) -> list[Member]:
        """Each member's result that counts (its latest finished or failed attempt), by member."""
        c = self.store.connection()
        out = []
        for member, episode_id, state, reward in c.execute(
                "SELECT e.member, e.episode_id, e.state, e.reward FROM episodes e WHERE e.group_id = ? "
                "AND e.state IN ('finished', 'failed') AND e.attempt = (SELECT MAX(attempt) FROM episodes x "
                "WHERE x.group_id = e.group_id AND x.member = e.member AND x.state IN ('finished', 'failed')) "
                "ORDER BY e.member", (group_id,)).fetchall():
            # a turn that sampled nothing (its budget was spent) has nothing to train
            steps = c.execute("SELECT step_id, step_score FROM episode_steps WHERE episode_id = ? AND span_end > span_start "
                              "ORDER BY step_index", (episode_id,)).fetchall()
            out.append(Member(member, episode_id, state == "failed", float(reward or 0.0), steps))
        return out

    def complete_group(self, group_id: str, outcome: str,
                       entries: Sequence[tuple[str, int, float, float]]) -> list[int]:
        """Write the group's samples ((source, source_id, reward, advantage), born ready) and mark it
        complete with ``outcome``, in one transaction. A group already complete is left alone
        (returns [])."""
        now = time.time()
        with self.store.transaction() as c:
            n = c.execute("UPDATE env_groups SET state = 'complete', outcome = ?, done_at = ? "
                          "WHERE group_id = ? AND state = 'rolling'", (outcome, now, group_id)).rowcount
            if not n:
                return []
            return self.buffer.add_ready(c, group_id, entries, now)

    # --- episodes ------------------------------------------------------------------------------

    def start_episode(self, group_id: str, member: int, attempt: int, task_id: str, seed: int,
                      temperature: float) -> int:
        """Record an episode as running (before its first token); its id."""
        with self.store.transaction() as c:
            return c.execute("INSERT INTO episodes (group_id, member, attempt, task_id, seed, temperature, state, "
                             "started_at) VALUES (?, ?, ?, ?, ?, ?, 'running', ?)",
                             (group_id, member, attempt, task_id, seed, temperature, time.time())).lastrowid

    def finish_episode(self, episode_id: int, ep: EpisodeRecord) -> None:
        """Store a finished or failed episode whole, with one step row per model turn."""
        scores = list(ep.step_scores) or [None] * len(ep.sampled)
        with self.store.transaction() as c:
            n = c.execute(
                "UPDATE episodes SET state = ?, reason = ?, error = ?, reward = ?, done = ?, truncated = ?, turns = ?, "
                "malformed = ?, prompt_ids = ?, response_ids = ?, loss_mask = ?, logprobs = ?, weight_versions = ?, "
                "info = ?, transcript = ?, finished_at = ? WHERE episode_id = ? AND state = 'running'",
                ("failed" if ep.failed else "finished", ep.reason, ep.error, float(ep.reward), int(ep.done),
                 int(ep.truncated), ep.turns, ep.malformed, pack(ep.prompt_ids, "i"), pack(ep.response_ids, "i"),
                 pack(ep.loss_mask, "b"), pack(ep.logprobs, "d"), pack(ep.weight_versions, "q"),
                 json.dumps(ep.info, default=str), json.dumps(ep.transcript, default=str), time.time(), episode_id),
            ).rowcount
            if not n:
                raise KeyError(f"episode {episode_id} is not running")
            c.executemany("INSERT INTO episode_steps (episode_id, step_index, span_start, span_end, step_score) "
                          "VALUES (?, ?, ?, ?, ?)",
                          [(episode_id, i, start, start + len(ids), score)
                           for i, (start, ids, score) in enumerate(zip(ep.turn_starts, ep.sampled, scores))])

    def episode(self, episode_id: int) -> dict:
        """One stored episode, its token arrays unpacked (for tests and inspection)."""
        cols = ("episode_id", "group_id", "member", "attempt", "task_id", "seed", "state", "reason", "error",
                "reward", "done", "truncated", "turns", "malformed", "prompt_ids", "response_ids", "loss_mask",
                "logprobs", "weight_versions", "info")
        row = self.store.connection().execute(f"SELECT {', '.join(cols)} FROM episodes WHERE episode_id = ?",
                                              (episode_id,)).fetchone()
        if row is None:
            raise KeyError(f"no episode with id {episode_id}")
        out = dict(zip(cols, row))
        for key, code in (("prompt_ids", "i"), ("response_ids", "i"), ("loss_mask", "b"), ("logprobs", "d"),
                          ("weight_versions", "q")):
            out[key] = unpack(out[key], code)
        out["info"] = json.loads(out["info"]) if out["info"] else None
        return out

    # --- status --------------------------------------------------------------------------------

    def counts(self) -> dict:
        """Episodes by state, groups by outcome, truncations by reason (for /admin/status)."""
        c = self.store.connection()
        episodes = {state: 0 for state in EPISODE_STATES}
        episodes.update(c.execute("SELECT state, COUNT(*) FROM episodes GROUP BY state").fetchall())
        groups = dict(c.execute("SELECT COALESCE(outcome, 'rolling'), COUNT(*) FROM env_groups "
                                "GROUP BY outcome").fetchall())
        truncated = dict(c.execute("SELECT reason, COUNT(*) FROM episodes WHERE state = 'finished' AND truncated = 1 "
                                   "GROUP BY reason").fetchall())
        return {"episodes": episodes, "groups": groups, "truncated_by_reason": truncated}


def sample_entries(members: list[Member], advantages: list[Optional[float]], per_turn: bool,
                   step_score_weight: float = 0.0) -> list[tuple[str, int, float, float]]:
    """The samples of a scored group: one per episode (``trajectory``) or one per model turn
    (``per_turn``, each with its episode's advantage plus ``step_score_weight`` times its step score).
    Members without an advantage (failed, or a filtered group) yield none."""
    out = []
    for m, adv in zip(members, advantages):
        if adv is None:
            continue
        if not per_turn:
            out.append((EPISODE, m.episode_id, m.reward, adv))
        else:
            out += [(STEP, step_id, m.reward, adv + step_score_weight * (score or 0)) for step_id, score in m.steps]
    return out
