"""Episodes as a sample source of the learner: stored before they count, taken by whole groups,
each trained once; a store from before episodes migrates with every turn sample and vote intact;
an interrupted group is rolled out again where it stopped; live chat goes before rollouts in the
engine; and one GRPO step runs on each environment with the embedded model, through the same
learner, trainer, checkpoints and weight swap as chat."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import yaml

from clawrl.buffer import RolloutBuffer
from clawrl.config import TrainConfig, compose
from clawrl.engines import make_engine
from clawrl.engines.base import CHAT_PRIORITY, ROLLOUT_PRIORITY, SamplingParams
from clawrl.envs.rollout import Episode
from clawrl.envs.base import Task
from clawrl.envs.source import group_id, score_group
from clawrl.episode_store import EpisodeStore, sample_entries
from clawrl.gateway.app import create_app
from clawrl.orchestration.learner import Learner, attach_learning
from clawrl.orchestration.serve import tasks_beside_config
from clawrl.schema import BUFFER, EPISODES, OPD, TURNS, TableSet
from clawrl.sessions import SessionLinker
from clawrl.store import TurnStore
from required_tools import skip_unless_available

REPO = Path(__file__).resolve().parents[1]
GUESS = str(Path(__file__).with_name("guess_number_env.py")) + ":GuessNumber"
TASKS = ["guess-7", "guess-42", "guess-63"]


def gid(index, round_):
    return group_id(Task(TASKS[index]), round_)


def episode(reward, turns=2, failed=False, per_turn=3):
    """A finished episode of ``turns`` model turns, ``per_turn`` sampled ids each, one masked
    observation id between turns."""
    response, mask, starts, sampled = [], [], [], []
    for t in range(turns):
        if t:
            response.append(900 + t)
            mask.append(0)
        starts.append(len(response))
        ids = [100 * (t + 1) + k for k in range(per_turn)]
        sampled.append(ids)
        response += ids
        mask += [1] * per_turn
    return Episode(task=Task("guess-7"), prompt_ids=[1, 2, 3], response_ids=response, loss_mask=mask,
                   logprobs=[-0.5 if m else 0.0 for m in mask], weight_versions=[3] * len(response),
                   reward=reward, turns=turns, done=True, truncated=False, sampled=sampled, failed=failed,
                   error="boom" if failed else None, reason="failed" if failed else "done", turn_starts=starts,
                   info={"success": reward >= 1})


@pytest.fixture
def stores(tmp_path):
    store = TurnStore(tmp_path)
    buffer = RolloutBuffer(store, TrainConfig(max_weight_lag=100))
    yield store, buffer, EpisodeStore(store, buffer)
    store.close()


def roll(episodes, plan, results):
    """Play ``plan``'s members with the given episodes (reward or None for a failed one)."""
    for (member, attempt), reward in zip(plan.members, results):
        eid = episodes.start_episode(plan.group_id, member, attempt, TASKS[plan.task_index], 7, 1.0)
        episodes.finish_episode(eid, episode(0.0 if reward is None else reward, failed=reward is None))


def complete(episodes, plan, per_turn=False):
    members = episodes.members(plan.group_id)
    outcome, adv = score_group([None if m.failed else m.reward for m in members], plan.size, "grpo")
    return outcome, episodes.complete_group(plan.group_id, outcome, sample_entries(members, adv, per_turn))


def test_a_group_becomes_ready_samples_that_point_to_their_episodes(stores):
    store, buffer, episodes = stores
    plan = episodes.next_group(TASKS, 2, gid, set())
    assert plan.members == [(0, 1), (1, 1)] and plan.task_index == 0
    roll(episodes, plan, [1.0, -1.0])
    outcome, ids = complete(episodes, plan)
    assert outcome == "kept" and len(ids) == 2
    samples = buffer.take_batch(8, current_version=3)
    assert [s.source for s in samples] == ["episode", "episode"] and [s.sample_id for s in samples] == ids
    good = samples[0]
    ep = episode(1.0)
    assert good.prompt_ids == ep.prompt_ids and good.response_ids == ep.response_ids
    assert good.loss_mask == ep.loss_mask and good.rollout_logprobs == ep.logprobs
    assert good.advantage > 0 > samples[1].advantage and good.reward == 1.0
    assert good.extra["task_id"] == "guess-7" and good.origin == f"episode {good.source_id}"
    # nothing trains twice: the group cannot be completed again, and its samples are consumed
    assert episodes.complete_group(plan.group_id, "kept", [("episode", good.source_id, 1.0, 1.0)]) == []
    assert buffer.take_batch(8, current_version=3) == []


def test_per_turn_samples_carry_each_turns_exact_context(stores):
    store, buffer, episodes = stores
    plan = episodes.next_group(TASKS, 2, gid, set())
    roll(episodes, plan, [1.0, 0.0])
    complete(episodes, plan, per_turn=True)
    samples = buffer.take_batch(1, current_version=3)  # one asked for, the whole group comes
    assert len(samples) == 4 and {s.source for s in samples} == {"step"}
    ep = episode(1.0)
    first, second = samples[:2]
    assert first.prompt_ids == ep.prompt_ids and first.response_ids == ep.sampled[0]
    assert second.prompt_ids == ep.prompt_ids + ep.response_ids[:ep.turn_starts[1]]
    assert second.response_ids == ep.sampled[1] and second.loss_mask is None
    assert first.advantage == second.advantage > 0 and second.extra["step_index"] == 1


def test_a_train_step_takes_whole_groups(stores):
    store, buffer, episodes = stores
    for _ in range(2):
        plan = episodes.next_group(TASKS, 3, gid, set())
        roll(episodes, plan, [1.0, 0.0, 0.5])
        complete(episodes, plan)
    batch = buffer.take_batch(4, current_version=3)
    assert len(batch) == 6 and len({s.group_id for s in batch}) == 2


def test_failed_and_equal_groups_yield_no_samples_and_say_why(stores):
    store, buffer, episodes = stores
    plan = episodes.next_group(TASKS, 2, gid, set())
    roll(episodes, plan, [1.0, None])
    assert complete(episodes, plan) == ("too_few_healthy", [])
    plan = episodes.next_group(TASKS, 2, gid, set())
    roll(episodes, plan, [-1.0, -1.0])
    assert complete(episodes, plan) == ("filtered_equal", [])
    counts = episodes.counts()
    assert counts["episodes"]["failed"] == 1 and counts["episodes"]["finished"] == 3
    assert counts["groups"] == {"too_few_healthy": 1, "filtered_equal": 1}
    assert buffer.ready_count() == 0


def test_an_interrupted_group_is_rolled_out_again_where_it_stopped(stores, tmp_path):
    store, buffer, episodes = stores
    plan = episodes.next_group(TASKS, 3, gid, set())
    kept = episodes.start_episode(plan.group_id, 0, 1, "guess-7", 1, 1.0)
    episodes.finish_episode(kept, episode(1.0))
    episodes.start_episode(plan.group_id, 1, 1, "guess-7", 2, 1.0)  # running when the process dies
    # a restart: a new store on the same file
    store.close()
    store2 = TurnStore(tmp_path)
    buffer2 = RolloutBuffer(store2, TrainConfig(max_weight_lag=100))
    episodes2 = EpisodeStore(store2, buffer2)
    assert episodes2.abort_running() == 1
    again = episodes2.next_group(TASKS, 3, gid, set())
    assert again.group_id == plan.group_id and again.members == [(1, 2), (2, 1)]
    # a group in flight is not handed out twice; the next one is new, at the next position
    other = episodes2.next_group(TASKS, 3, gid, {plan.group_id})
    assert other.position == plan.position + 1 and other.task_index == 1
    roll(episodes2, again, [0.0, 0.5])
    outcome, ids = complete(episodes2, again)
    assert outcome == "kept" and len(ids) == 3
    members = episodes2.members(plan.group_id)
    assert members[0].episode_id == kept  # the finished episode was kept, not rolled again
    assert episodes2.episode(members[1].episode_id)["attempt"] == 2
    aborted = store2.connection().execute("SELECT COUNT(*) FROM episodes WHERE state = 'aborted'").fetchone()[0]
    assert aborted == 1
    store2.close()


def test_an_interrupted_group_whose_task_is_gone_is_closed_not_rolled_as_another_task(stores):
    store, buffer, episodes = stores
    plan = episodes.next_group(TASKS, 2, gid, set())
    episodes.start_episode(plan.group_id, 0, 1, TASKS[0], 1, 1.0)
    episodes.abort_running()
    fewer = TASKS[1:]  # the task set lost guess-7
    again = episodes.next_group(fewer, 2, lambda i, r: group_id(Task(fewer[i]), r), set())
    assert again.group_id != plan.group_id and again.position == plan.position + 1
    assert episodes.counts()["groups"]["task_removed"] == 1


def test_a_store_from_before_episodes_keeps_every_turn_sample_and_vote(tmp_path):
    store = TurnStore(tmp_path)
    store.register(TableSet(BUFFER.what, BUFFER.meta_key, BUFFER.migrations[:3]))  # the schema of a v3 store
    c = store.connection()
    turn = _insert_turn(store)
    with store.transaction() as t:
        t.execute("INSERT INTO samples (turn_id, group_id, request_key, state, reward, created_at) "
                  "VALUES (?, 'g', 'rk', 'judged', 1.0, 0)", (turn,))
        t.execute("INSERT INTO votes (sample_id, attempt, vote_index, judge_kind, score, rationale, raw, at) "
                  "VALUES (1, 1, 0, 'rules', 1, 'ok', 'raw', 0)")
    buffer = RolloutBuffer(store, TrainConfig())  # migrates to the current version
    sample = buffer.get_sample(1)
    assert sample["source"] == "turn" and sample["source_id"] == turn == sample["turn_id"]
    assert sample["state"] == "judged" and buffer.votes(1)[0]["rationale"] == "ok"
    assert c.execute("PRAGMA foreign_key_check").fetchall() == []
    with pytest.raises(sqlite3.IntegrityError):  # votes still reference samples
        with store.transaction() as t:
            t.execute("INSERT INTO votes (sample_id, attempt, vote_index, judge_kind, score, rationale, raw, at) "
                      "VALUES (99, 1, 0, 'rules', 1, 'x', 'x', 0)")
    store.close()


def _insert_turn(store) -> int:
    with store.transaction() as c:
        c.execute("INSERT INTO sessions (session_id, caller_hash, source, created_at, last_seen_at) "
                  "VALUES ('s', 'h', 'header', 0, 0)")
        return c.execute(
            "INSERT INTO turns (session_id, branch_id, turn_index, caller_hash, link_rule, turn_type, type_rule, "
            "status, trainable, messages, history_len, prompt_tokens, response_tokens, response_text, created_at, "
            "completed_at, request_key) VALUES ('s', 0, 0, 'h', 'new', 'main', 'default', 'complete', 1, '[]', 0, "
            "0, 0, '', 0, 0, 'rk')").lastrowid


def test_live_chat_joins_the_batch_before_waiting_rollouts(tiny_model_dir):
    cfg = compose([f"model.path={tiny_model_dir}", "engine.threads=1", "engine.max_batch_size=1"])
    engine = make_engine(cfg)
    order = []

    async def one(name, priority, prompt):
        params = SamplingParams(max_new_tokens=4, temperature=0, priority=priority, ignore_eos=True)
        await engine.generate(prompt, params)
        order.append(name)

    async def main():
        await engine.start()
        try:
            await engine.pause()  # everything queues; then the engine picks what joins first
            tasks = [asyncio.ensure_future(one(f"rollout{k}", ROLLOUT_PRIORITY, [5, 6, 7 + k])) for k in range(3)]
            await asyncio.sleep(0.05)
            tasks.append(asyncio.ensure_future(one("chat", CHAT_PRIORITY, [5, 6, 9])))
            await asyncio.sleep(0.05)
            await engine.resume()
            await asyncio.gather(*tasks)
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert order[0] == "chat" and sorted(order[1:]) == ["rollout0", "rollout1", "rollout2"]


# ---------------------------------------------------------------- the learner, end to end


def learner_run(model_dir, run_dir, *overrides, timeout_s=300):
    """Run a learner with environment rollouts until env.max_train_steps; the learner afterwards."""
    cfg = compose([f"model.path={model_dir}", f"run_dir={run_dir}", "method=rl", "train.lr=1e-3",
                   "engine.threads=1", "logging.wandb.mode=disabled", "env.max_train_steps=1", *overrides])
    engine = make_engine(cfg)
    store = TurnStore(cfg.run_dir)

    async def main():
        done = asyncio.Event()
        learner = Learner(cfg, engine, store, on_done=done.set)
        await engine.start()
        try:
            await asyncio.to_thread(learner.prepare)
            await learner.start()
            await asyncio.wait_for(done.wait(), timeout_s)
        finally:
            await learner.stop()
            await engine.shutdown()
        return learner

    try:
        return asyncio.run(main()), store
    except BaseException:
        store.close()
        raise


def trained_samples(store):
    return store.connection().execute("SELECT source, source_id, reward, advantage FROM samples "
                                      "WHERE state = 'trained'").fetchall()


def test_guess_number_trains_one_grpo_step_saves_and_evaluates(tiny_model_dir, tmp_path):
    learner, store = learner_run(tiny_model_dir, tmp_path, f"env.name={GUESS}", "env.group_size=2",
                                 "train.batch_size=2", "env.max_turns=2", "env.max_tokens_per_turn=6",
                                 "env.eval_every=1", "env.eval_split=test")
    try:
        assert learner.train_step == 1 and learner.sync.version == 1
        trained = trained_samples(store)
        assert len(trained) >= 2 and {t[0] for t in trained} == {"episode"}
        assert sum(t[3] for t in trained) == pytest.approx(0, abs=1e-6)  # GRPO: advantages centred per group
        assert (tmp_path / "checkpoints").is_dir() and any((tmp_path / "checkpoints").iterdir())
        metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        step = next(m for m in metrics if m.get("kind") == "train_step" and "rollout/episodes" in m)
        assert step["rollout/episodes"] >= 2 and 0 <= step["rollout/success_rate"] <= 1
        evals = [m for m in metrics if "eval/success_rate" in m]
        assert len(evals) == 2 and evals[-1]["eval/episodes"] == 2  # before training and after the last step
        assert learner.last_eval["train_step"] == 1
        status = learner.status()
        assert status["env"]["episodes"]["finished"] >= 2 and status["env"]["halted"]
    finally:
        store.close()


def test_per_turn_samples_train_through_the_learner(tiny_model_dir, tmp_path):
    learner, store = learner_run(tiny_model_dir, tmp_path, f"env.name={GUESS}", "env.group_size=2",
                                 "train.batch_size=2", "env.max_turns=3", "env.max_tokens_per_turn=6",
                                 "env.sample_mode=per_turn")
    try:
        assert learner.train_step == 1
        trained = trained_samples(store)
        assert {t[0] for t in trained} == {"step"} and len(trained) >= 2
        # each trained step belongs to a stored episode, and the episode's other steps came with it
        steps = store.connection().execute(
            "SELECT st.episode_id, COUNT(*) FROM samples s JOIN episode_steps st ON st.step_id = s.source_id "
            "WHERE s.state = 'trained' GROUP BY st.episode_id").fetchall()
        turns = dict(store.connection().execute("SELECT episode_id, turns FROM episodes").fetchall())
        assert all(n == turns[e] for e, n in steps)
    finally:
        store.close()


@pytest.mark.parametrize("recipe, overrides", [
    ("toolcall-rl", ["env.max_turns=2", "env.max_tokens_per_turn=24"]),
    ("terminal-rl", ["env.max_turns=1", "env.max_tokens_per_turn=16", "env.episode_timeout_s=120"]),
    ("swe-rl", ["env.max_turns=1", "env.max_tokens_per_turn=16", "env.episode_timeout_s=120"]),
    ("gui-rl", ["env.max_turns=2", "env.max_tokens_per_turn=24", "env.episode_timeout_s=120"]),
])
def test_each_environment_trains_one_step_with_the_embedded_model(tiny_model_dir, tmp_path, recipe, overrides):
    """Groups of one train on their own reward (nothing to compare, nothing filtered), so the step
    comes whatever the untrained model does."""
    if recipe == "gui-rl":
        skip_unless_available("chromium", "chromium and chromium-driver are not installed",
                              available=bool(shutil.which("chromium") and shutil.which("chromedriver")))
    config = REPO / recipe / "config.yaml"
    env = {k: v for k, v in _yaml(config)["env"].items() if k in ("name", "tasks")}
    learner, store = learner_run(tiny_model_dir, tmp_path / "run", f"env.name={env['name']}",
                                 f"env.tasks={(REPO / recipe / env['tasks']).resolve()}", "env.group_size=1",
                                 "train.batch_size=1", *overrides)
    try:
        assert learner.train_step == 1
        trained = trained_samples(store)
        assert trained and {t[0] for t in trained} == {"episode"}
        row = store.connection().execute("SELECT e.response_ids, e.loss_mask, e.state FROM episodes e JOIN samples s "
                                         "ON s.source_id = e.episode_id WHERE s.state = 'trained'").fetchone()
        assert row[2] == 'finished' and row[0] and len(row[0]) // 4 == len(row[1])  # int32 ids, a mask byte each
    finally:
        store.close()


def _yaml(path):
    return yaml.safe_load(path.read_text())


def test_opd_is_refused_for_environments_in_one_line(tiny_model_dir, tmp_path):
    cfg = compose([f"model.path={tiny_model_dir}", f"run_dir={tmp_path}", "method=opd", f"env.name={GUESS}",
                   "engine.threads=1", "logging.wandb.mode=disabled"])
    engine = make_engine(cfg)
    store = TurnStore(tmp_path)
    app = create_app(cfg, engine, SessionLinker(store, idle_timeout_s=60))
    try:
        with pytest.raises(Exception, match="use method=rl with env.name"):
            attach_learning(app, cfg, engine, store)
    finally:
        store.close()


def test_a_relative_env_tasks_in_a_recipe_config_is_the_recipes(tmp_path):
    config = REPO / "toolcall-rl" / "config.yaml"
    cfg = compose([], str(config))
    assert tasks_beside_config(cfg, str(config), [])
    resolved = tasks_beside_config(cfg, str(config), []).env.tasks
    assert Path(resolved) == (REPO / "toolcall-rl").resolve()
    given = tasks_beside_config(dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, tasks="data")),
                                str(config), ["env.tasks=data"])
    assert given.env.tasks == "data"  # a command-line path is the user's, relative to where they are


def test_every_migration_statement_is_whole():
    """Migrations are split at ';': a semicolon inside an SQL comment would cut a statement."""
    for tables in (TURNS, BUFFER, OPD, EPISODES):
        for block in tables.migrations:
            for stmt in block.split(";"):
                assert not stmt.strip() or sqlite3.complete_statement(stmt + ";"), (tables.what, stmt[-120:])


class _Source:
    """A source whose episodes all fail while ``broken`` (as when no sandbox slot is free)."""

    def __init__(self):
        self.tasks = [Task(t) for t in TASKS]
        self.params = SamplingParams(temperature=1.0)
        self.broken, self.played = True, 0

    async def episode(self, task, seed):
        self.played += 1
        return episode(0.0, failed=True) if self.broken else episode(float(self.played % 2))


def test_groups_whose_every_episode_fails_wait_longer_each_time_instead_of_spinning(stores, monkeypatch):
    """Another process held every sandbox uid: each episode failed at once and the worker ran through
    66,000 of them in 3.5 minutes. Now a group that fails whole waits 2x longer than the last one."""
    from clawrl.orchestration import rollouts

    monkeypatch.setattr(rollouts, "_FAILING_WAIT_S", 0.2)
    store, buffer, episodes = stores
    cfg = compose(["env.group_size=2", "env.groups_in_flight=1"])
    source = _Source()

    async def run(seconds):
        worker = rollouts.RolloutWorker(cfg, None, buffer, episodes, wake=lambda: None, source=source, poll_s=0.01)
        worker.start()
        await asyncio.sleep(seconds)
        await worker.stop()
        return worker

    worker = asyncio.run(run(1.3))
    # waits of 0.2, 0.4, 0.8 s: three or four groups in 1.3 s, not hundreds
    assert 2 <= worker.counters["failing_waits"] <= 4 and source.played <= 8, (worker.counters, source.played)
    assert worker._failing == worker.counters["failing_waits"]
    source.broken, source.played = False, 0
    worker = asyncio.run(run(0.5))  # healthy groups: no wait (until rollouts are env.rollout_ahead ahead)
    assert worker._failing == 0 and worker.counters["failing_waits"] == 0 and source.played >= 8
