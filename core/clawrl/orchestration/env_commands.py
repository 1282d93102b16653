"""``clawrl env``: the contract every environment shares.

``NAME|PATH`` is a method directory (``terminal-rl``, ... under the current directory or the repo
root, whose ``config.yaml`` names the environment and its task set) or a task set on disk: a task
directory, a directory of tasks (formats may be mixed), a ``dataset.toml`` directory or a
``.jsonl`` instance file (``clawrl.envs.task_formats.discover``).

- ``list`` prints ``ID<TAB>SPLIT<TAB>FORMAT`` per task.
- ``build`` builds an environment's task set (swe-rl: ``clawrl.orchestration.env_build``).
- ``check`` plays the oracle and the no-op on every task and prints one JSON line per task; it
  exits 0 when at least one oracle ran and none failed (oracle at full reward, no-op below it).
- ``run`` plays one episode (oracle, no-op or the model) and ends with one JSON line.
- ``eval`` plays every task of a split ``--n`` times with the model (a run's newest complete
  checkpoint with ``--run-dir``) and ends with one JSON line: the success rate, the mean reward,
  the episodes and the weight version (``clawrl.orchestration.evaluation``).

Usage errors exit 2 with a one-line reason (``CliError``); a check that finds a broken task exits 1.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from transformers.utils import logging as transformers_logging

from clawrl.config import ClawrlConfig, compose
from clawrl.engines.base import EngineError, SamplingParams
from clawrl.envs import EnvError
from clawrl.envs.scripted import NOP, ORACLE, EpisodeReport, NoOracle, play, success_of
from clawrl.envs.task_formats import TaskRecord, discover
from clawrl.errors import CliError
from clawrl.orchestration.env_build import build_cli
from clawrl.orchestration.evaluation import episode_env, evaluate, model_episode, open_eval_engine

REPO_ROOT = Path(__file__).resolve().parents[3]
METHOD_CONFIG = "config.yaml"
# Tasks checked at once: each holds a sandbox, and the box may have 2 cores.
CHECK_CONCURRENCY = 4
POLICIES = (ORACLE, NOP, "model")


@dataclass
class TaskSet:
    """What ``NAME|PATH`` resolves to: the config to run under and the tasks found."""

    cfg: ClawrlConfig
    records: list[TaskRecord]

    def find(self, task_id: str | None) -> TaskRecord:
        if task_id is None:
            if len(self.records) != 1:
                raise CliError(f"{len(self.records)} tasks here: pick one with --task ID (clawrl env list shows them)")
            return self.records[0]
        for r in self.records:
            if r.task.task_id == task_id:
                return r
        raise CliError(f"no task {task_id!r} here (clawrl env list shows the {len(self.records)} there are)")


def method_dir(target: str) -> Path | None:
    """The method directory ``target`` names, under the current directory or the repo root."""
    for base in (Path.cwd(), REPO_ROOT):
        candidate = (base / target)
        if (candidate / METHOD_CONFIG).is_file():
            return candidate
    return None


def resolve(target: str, overrides: list[str]) -> TaskSet:
    """The task set and config behind ``NAME|PATH`` (overrides on top)."""
    path = Path(target).expanduser()
    recipe = method_dir(target) if not path.exists() or (path / METHOD_CONFIG).is_file() else None
    if recipe is not None:
        cfg = compose(overrides, yaml_path=str(recipe / METHOD_CONFIG))
        if cfg.env.tasks is None:
            raise CliError(f"{recipe} sets no env.tasks: it is not an environment's method directory")
        tasks = Path(cfg.env.tasks).expanduser()
        path = tasks if tasks.is_absolute() else recipe / tasks
    elif not path.exists():
        raise CliError(f"{target}: no such task path, and no method directory of that name here or in {REPO_ROOT}")
    else:
        cfg = compose(overrides)
    try:
        return TaskSet(cfg, discover(path))
    except EnvError as e:
        raise CliError(str(e)) from None


def env_cli(args) -> int:
    """``clawrl env list|check|run|eval|build``."""
    if args.env_cmd == "build":
        path = Path(args.target).expanduser()
        return build_cli(args, method_dir(args.target) if not path.exists() or (path / METHOD_CONFIG).is_file()
                         else None)
    task_set = resolve(args.target, args.overrides)
    if args.env_cmd == "list":
        for r in task_set.records:
            print(f"{r.task.task_id}\t{r.split}\t{r.format}")
        return 0
    if args.env_cmd == "check":
        return asyncio.run(_check(task_set))
    if args.env_cmd == "eval":
        return _eval(task_set, args)
    record = task_set.find(args.task)
    try:
        report = asyncio.run(_run(task_set, record, args.policy))
    except EnvError as e:  # the episode could not run (a refused task, a sandbox that cannot start)
        raise CliError(f"task {record.task.task_id}: {e}") from None
    print(json.dumps(report.as_json()))
    return 0


async def _check(task_set: TaskSet) -> int:
    """Oracle and no-op on every task, a JSON line each as they finish, in task order."""
    gate = asyncio.Semaphore(CHECK_CONCURRENCY)
    turns = task_set.cfg.env.max_turns

    async def one(record: TaskRecord) -> dict:
        async with gate:
            line = {"task": record.task.task_id, "oracle": None, "nop": None}
            try:
                oracle = await play(episode_env(task_set.cfg, record), record.task, ORACLE, turns)
                line["oracle"] = oracle.reward
                nop = await play(episode_env(task_set.cfg, record), record.task, NOP, turns)
                line["nop"] = nop.reward
            except NoOracle:
                line["status"] = "no_oracle"
                return line
            except EnvError as e:
                line["status"], line["reason"] = "fail", str(e)
                return line
            ok = oracle.success and oracle.reward >= 1.0 and nop.reward < oracle.reward
            line["status"] = "ok" if ok else "fail"
            if not ok:
                line["reason"] = ("the oracle did not solve it: " + oracle.reason if not oracle.success
                                  or oracle.reward < 1.0 else "the no-op scores as well as the oracle")
            return line

    lines = await asyncio.gather(*(one(r) for r in task_set.records))
    for line in lines:
        print(json.dumps(line), flush=True)
    ran = sum(line["status"] != "no_oracle" for line in lines)
    failed = sum(line["status"] == "fail" for line in lines)
    print(f"clawrl env check: {sum(line['status'] == 'ok' for line in lines)} ok, {failed} failed, "
          f"{len(lines) - ran} without an oracle", file=sys.stderr)
    return 0 if ran and not failed else 1


async def _run(task_set: TaskSet, record: TaskRecord, policy: str) -> EpisodeReport:
    cfg = task_set.cfg
    if policy in (ORACLE, NOP):
        try:
            return await play(episode_env(task_set.cfg, record), record.task, policy, cfg.env.max_turns)
        except NoOracle as e:
            raise CliError(str(e)) from None
    engine, _ = await open_eval_engine(cfg, None)
    try:
        params = SamplingParams(max_new_tokens=cfg.env.max_tokens_per_turn, temperature=cfg.env.temperature,
                                seed=cfg.seed)
        episode = await model_episode(cfg, engine, record, params)
    finally:
        await engine.shutdown()
    # the loop's own reason: a limit that cut the episode wins over what the environment's verdict says
    reason = f"{episode.reason}: {episode.error}" if episode.failed else episode.reason
    return EpisodeReport(task=record.task.task_id, reward=episode.reward, success=success_of(episode.reward, episode.info),
                         turns=episode.turns, truncated=episode.truncated, reason=reason,
                         transcript=episode.transcript)


def count_arg(value: str, flag: str) -> int:
    """A whole number >= 1 from the command line, or a one-line usage error."""
    try:
        number = int(value)
    except ValueError:
        raise CliError(f"{flag} must be a whole number >= 1, got {value!r}") from None
    if number < 1:
        raise CliError(f"{flag} must be a whole number >= 1, got {value!r}")
    return number


def split_records(task_set: TaskSet, split: str, limit: int | None) -> list[TaskRecord]:
    """The tasks of ``split`` in task-set order, the first ``limit`` of them when given."""
    records = [r for r in task_set.records if r.split == split]
    if not records:
        known = sorted({r.split for r in task_set.records})
        raise CliError(f"no tasks in split {split!r} here (splits: {', '.join(known) or 'none'})")
    return records[:limit] if limit is not None else records


def _eval(task_set: TaskSet, args) -> int:
    """``clawrl env eval``: progress and notes on stderr, the result as the last line of stdout.
    Exit 0 when the evaluation ran, 1 when no episode could be played at all."""
    n = count_arg(args.n, "--n")
    limit = None if args.limit is None else count_arg(args.limit, "--limit")
    try:
        temperature = float(args.temperature)
    except ValueError:
        temperature = -1.0
    if not (math.isfinite(temperature) and temperature >= 0):
        raise CliError(f"--temperature must be a number >= 0 (0: greedy), got {args.temperature!r}")
    records = split_records(task_set, args.split, limit)
    transformers_logging.disable_progress_bar()  # the evaluation's bar is the console's only one
    try:
        result = asyncio.run(_evaluate(task_set.cfg, args.run_dir, records, n, temperature))
    except EngineError as e:
        print(f"clawrl: the engine failed during the evaluation: {e}", file=sys.stderr)
        return 1
    if result.failed:
        reasons = sorted({s.error for s in result.scores if s.failed and s.error})
        print(f"clawrl: {result.failed} of {result.episodes} episodes could not be played (left out of the "
              f"rates): {'; '.join(reasons[:3])}", file=sys.stderr)
    print(json.dumps(result.as_json()), flush=True)
    return 0 if result.failed < result.episodes else 1


async def _evaluate(cfg, run_dir, records: list[TaskRecord], n: int, temperature: float):
    engine, notes = await open_eval_engine(cfg, run_dir)
    for note in notes:
        print(f"clawrl: {note}", file=sys.stderr, flush=True)
    try:
        return await evaluate(cfg, engine, records, n=n, temperature=temperature, progress=True)
    finally:
        await engine.shutdown()
