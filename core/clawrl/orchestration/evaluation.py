"""Held-out evaluation: the success rate of the served weights on a task split.

One function, ``evaluate``, serves both callers: ``clawrl env eval`` (which loads a run's newest
complete checkpoint into an engine of its own, ``open_eval_engine``) and the periodic held-out
evaluation of a training run, which hands it the engine it already serves, so no second copy of the
model is ever loaded. Every task of the split is played ``n`` times; the episodes run concurrently
(the engine batches their turns) behind a semaphore, so no more sandboxes are open than the host
allows.

Reading a run's checkpoints never takes the run's lock and never writes into the run directory:
it works beside a live server that is training and saving there. A checkpoint that is incomplete
or fails its checksums (a crash, a disk problem, a prune racing the read) is passed over for the
next newest one, and the caller is told so. ``clawrl export-model`` reads checkpoints with the same
functions (``complete_checkpoint``, ``serving_weights``), so an export holds what an evaluation scores.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from clawrl.checkpoints import CheckpointError, CheckpointStore, CorruptCheckpoint
from clawrl.config import ClawrlConfig
from clawrl.embedded.build import resolve_model
from clawrl.engines import make_engine
from clawrl.engines.base import ROLLOUT_PRIORITY, Engine, EngineError, SamplingParams
from clawrl.envs import CHAT, ENVS, Env, EnvError, env_class
from clawrl.envs.rollout import Episode, run_episode
from clawrl.envs.scripted import success_of
from clawrl.envs.task_formats import HARBOR, TB1, TaskRecord
from clawrl.errors import CliError
from clawrl.trainers.backends import make_trainer
from clawrl.trainers.base import TrainerError

# The environment a task directory's format implies when env.name does not say.
FORMAT_ENVS = {HARBOR: "terminal", TB1: "terminal"}
# A checkpoint pruned by a live server while it is read is looked for again this many times.
_LISTING_RETRIES = 3


def episode_env(cfg: ClawrlConfig, record: TaskRecord) -> Env:
    """A fresh environment for one episode of ``record``: ``env.name`` when it names one, else the
    one the task's format implies."""
    name = cfg.env.name if cfg.env.name != CHAT else FORMAT_ENVS.get(record.format)
    if name is None:
        raise EnvError(f"task {record.task.task_id} is a row of a dataset: say which environment plays it "
                       f"with env.name=NAME (built in: {', '.join(sorted(ENVS)) or 'none'}) or dir/file.py:Class")
    return env_class(name).from_config(cfg)


async def model_episode(cfg: ClawrlConfig, engine: Engine, record: TaskRecord, params: SamplingParams) -> Episode:
    """One episode of ``record`` played by the model ``engine`` serves, in a fresh environment,
    under the limits training rollouts have (``env.max_turns``, ``env.max_total_tokens``,
    ``env.episode_timeout_s``; tokens per turn are ``params``')."""
    return await run_episode(engine, engine.tokenizer, episode_env(cfg, record), record.task, params,
                             cfg.env.max_turns, max_total_tokens=cfg.env.max_total_tokens,
                             timeout_s=cfg.env.episode_timeout_s)


@dataclass
class EpisodeScore:
    """How one evaluation episode ended. ``failed`` episodes are the environment's failures (a
    sandbox that would not start, a crash), not the model's: they are counted, not scored."""

    task_id: str
    play: int  # which of the task's n plays
    reward: float = 0.0
    success: bool = False
    turns: int = 0
    truncated: bool = False
    malformed: int = 0  # replies the environment could not read as an action
    failed: bool = False
    error: Optional[str] = None


@dataclass
class EvalResult:
    """Rates over the episodes that ran (``failed`` ones are left out of them and counted apart).

    ``weight_version`` is the version the engine served when the evaluation began;
    ``weight_versions`` every version that produced a token (more than one when the weights were
    swapped during the evaluation, as they may be in a training run)."""

    success_rate: float
    mean_reward: float
    episodes: int
    weight_version: int
    failed: int
    truncated_rate: float
    mean_turns: float
    well_formed_rate: float = 0.0  # episodes in which every reply was a well-formed action
    success_when_well_formed: float = 0.0  # the success rate among those episodes
    weight_versions: list[int] = field(default_factory=list)
    scores: list[EpisodeScore] = field(default_factory=list)

    def as_json(self) -> dict:
        """What ``clawrl env eval`` prints: the four figures first, then the counts behind them."""
        return {"success_rate": self.success_rate, "mean_reward": self.mean_reward, "episodes": self.episodes,
                "weight_version": self.weight_version, "failed": self.failed,
                "truncated_rate": self.truncated_rate, "mean_turns": self.mean_turns,
                "well_formed_rate": self.well_formed_rate, "success_when_well_formed": self.success_when_well_formed}


def default_concurrency(cfg: ClawrlConfig) -> int:
    """Episodes at once: as many as the engine decodes together, and no more sandboxes than the
    host's slots."""
    return max(1, min(cfg.engine.max_batch_size, cfg.sandbox.slots))


def concurrency_beside_rollouts(cfg: ClawrlConfig) -> int:
    """Episodes at once of a held-out evaluation during training: what the rollouts leave of the
    sandbox slots (``env.groups_in_flight`` groups of ``env.group_size`` episodes each hold one),
    at least 1. Taking ``default_concurrency`` beside them asked for more slots than the host has,
    and the rollouts' episodes then failed for want of a sandbox."""
    rollouts = cfg.env.groups_in_flight * cfg.env.group_size
    return max(1, min(cfg.engine.max_batch_size, cfg.sandbox.slots - rollouts))


def episode_seed(base: int, index: int, n: int, play: int) -> int:
    """A distinct, reproducible sampling seed for play ``play`` of the ``index``-th task."""
    return (base * 1_000_003 + index * n + play) % (2 ** 31)


async def evaluate(cfg: ClawrlConfig, engine: Engine, records: list[TaskRecord], n: int = 1,
                   temperature: float = 0.0, concurrency: Optional[int] = None,
                   progress: bool = False) -> EvalResult:
    """Play every task of ``records`` ``n`` times with the weights ``engine`` serves now.

    ``temperature`` 0 is greedy (the ``n`` plays then differ only where the environment does);
    above it, each play samples with its own seed (``episode_seed``), so the figures are
    reproducible for a ``cfg.seed``. Turns and tokens per turn follow ``env.max_turns`` and
    ``env.max_tokens_per_turn``. ``progress`` draws a bar on stderr. An environment failure costs
    its episode, never the evaluation; an engine failure (``EngineError``) ends it, as it ends a
    training run's rollouts."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if not records:
        raise ValueError("no tasks to evaluate")
    gate = asyncio.Semaphore(concurrency or default_concurrency(cfg))
    start_version = engine.model_info().weight_version
    versions: set[int] = set()
    bar = tqdm(total=len(records) * n, desc="clawrl env eval", unit="episode", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)

    async def play(index: int, record: TaskRecord, k: int) -> EpisodeScore:
        score = EpisodeScore(task_id=record.task.task_id, play=k)
        params = SamplingParams(max_new_tokens=cfg.env.max_tokens_per_turn, temperature=temperature,
                                seed=episode_seed(cfg.seed, index, n, k), priority=ROLLOUT_PRIORITY)
        async with gate:
            try:
                episode = await model_episode(cfg, engine, record, params)
            except EnvError as e:  # its environment could not be made; the other episodes go on
                score.failed, score.error = True, f"{type(e).__name__}: {e}"
            else:
                score.failed, score.error = episode.failed, episode.error
                score.reward, score.turns, score.truncated = episode.reward, episode.turns, episode.truncated
                score.malformed = episode.malformed
                score.success = not score.failed and success_of(episode.reward, episode.info)
                versions.update(episode.weight_versions)
            finally:
                bar.update(1)
        return score

    try:
        scores = await asyncio.gather(*(play(i, r, k) for i, r in enumerate(records) for k in range(n)))
    finally:
        bar.close()
    ran = [s for s in scores if not s.failed]
    count = len(ran) or 1  # rates of nothing are 0, and the failures say why
    well_formed = [s for s in ran if not s.malformed]
    return EvalResult(success_rate=sum(s.success for s in ran) / count,
                      mean_reward=sum(s.reward for s in ran) / count, episodes=len(scores),
                      weight_version=start_version, failed=len(scores) - len(ran),
                      truncated_rate=sum(s.truncated for s in ran) / count,
                      mean_turns=sum(s.turns for s in ran) / count,
                      well_formed_rate=len(well_formed) / count,
                      success_when_well_formed=sum(s.success for s in well_formed) / (len(well_formed) or 1),
                      weight_versions=sorted(versions), scores=scores)


# ---------------------------------------------------------------- weights of a run


@dataclass
class RunWeights:
    """The weights of a run's newest complete checkpoint, HF-named for ``Engine.update_weights``."""

    state: dict[str, torch.Tensor]
    weight_version: int
    checkpoint: Path


@dataclass
class RunCheckpoint:
    """A complete checkpoint of a run as the trainer saved it: its trainer state (``state["weights"]``:
    the full model, or the LoRA adapter alone; ``state["kind"]`` says which) and its weight version."""

    state: dict
    weight_version: int
    checkpoint: Path


def complete_checkpoint(run_dir: str | Path, version: Optional[int] = None
                        ) -> tuple[Optional[RunCheckpoint], list[str]]:
    """``(checkpoint, notes)``: the newest checkpoint of ``run_dir`` whose files all match their
    checksums, or ``(None, notes)`` when it has none. Read only: no lock, no write.

    Without ``version``, checkpoints of a line abandoned by an applied rollback are not the run's
    weights and are skipped. With ``version``, the newest complete checkpoint saved at that weight
    version (versions are never reused, so an abandoned line's version still names the weights that
    were served under it). A directory that disappears while it is read was pruned by a live server
    that saved a newer one meanwhile, so the listing is read again."""
    store = CheckpointStore(run_dir)
    for _ in range(_LISTING_RETRIES):
        notes: list[str] = []
        record = store.rollback_record()
        pruned = False
        for step in store.steps():
            if version is None and store._abandoned(step, record):  # the store's own rule, so eval and resume agree
                continue
            if version is not None:
                manifest = store.manifest(step)
                if manifest is None:
                    if store.path(step).exists():
                        notes.append(f"checkpoint step_{step} has no readable manifest; passed over")
                    continue
                if manifest.get("weight_version") != version:
                    continue
            try:
                state, manifest = store.load(step)
            except (CorruptCheckpoint, OSError) as e:
                if not store.path(step).exists():
                    pruned = True
                    break
                notes.append(f"checkpoint step_{step} is incomplete or corrupt ({_first_line(e)}); "
                             f"trying the one before it")
                continue
            return RunCheckpoint(state, int(manifest["weight_version"]), store.path(step)), notes
        if not pruned:
            return None, notes
    raise CliError(f"the checkpoints of {run_dir} kept changing while they were read; try again")


def newest_complete_checkpoint(run_dir: str | Path, cfg: ClawrlConfig) -> tuple[Optional[RunWeights], list[str]]:
    """``(weights, notes)`` of the newest complete checkpoint of ``run_dir`` (``complete_checkpoint``)
    as the trainer served them, or ``(None, notes)`` when it has none. Read only: no lock, no write."""
    found, notes = complete_checkpoint(run_dir)
    if found is None:
        return None, notes
    return RunWeights(serving_weights(found.state, found.checkpoint, cfg), found.weight_version,
                      found.checkpoint), notes


def serving_weights(state: dict, path: Path, cfg: ClawrlConfig,
                    command: str = "clawrl env eval") -> dict[str, torch.Tensor]:
    """HF-named weights to serve from a checkpoint's trainer state. A full checkpoint holds them as
    they are; a LoRA one holds the adapter, which the torch trainer merges into the base model
    exactly as it does when it pushes weights to a serving engine. ``command`` names the caller in
    the refusal of megatron rank shards."""
    kind = state.get("kind")
    if kind == "full":
        return dict(state["weights"])
    if kind == "lora":
        return lora_trainer(state, path, cfg).export_weights()
    raise CliError(f"{path} holds {kind} weights (megatron rank shards resume only in a megatron run with the "
                   f"same layout); {command} reads torch-trainer checkpoints (full or LoRA)")


def lora_trainer(state: dict, path: Path, cfg: ClawrlConfig):
    """A torch trainer of ``cfg.model.path`` with the LoRA checkpoint ``state`` loaded (its
    ``train.lora`` settings must be the run's: another rank is refused by shape)."""
    lora_cfg = dataclasses.replace(cfg.train, lora=dataclasses.replace(cfg.train.lora, enabled=True))
    trainer_cfg = dataclasses.replace(cfg.trainer, backend="torch")
    merge_cfg = dataclasses.replace(cfg, train=lora_cfg, trainer=trainer_cfg)
    try:
        trainer = make_trainer(merge_cfg, str(cfg.model.path))
        trainer.load_state_dict(state)
    except TrainerError as e:
        raise CliError(f"{path} holds a LoRA adapter that does not fit {cfg.model.path}: {e}") from None
    return trainer


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


async def open_eval_engine(cfg: ClawrlConfig, run_dir: Optional[str | Path]) -> tuple[Engine, list[str]]:
    """A started engine serving what ``clawrl env eval`` evaluates, and the notes to show: run
    ``run_dir``'s newest complete checkpoint when it has one (under its own weight version), else
    ``model.path``, else the embedded model (weight version 0). The caller shuts the engine down.

    ``cfg.model.path`` must be the model the run trained (as it is when the same method directory
    and overrides are used); weights of another shape are refused in one line."""
    cfg = resolve_model(cfg)
    notes: list[str] = []
    weights = None
    if run_dir is not None:
        root = Path(run_dir).expanduser()
        if not root.is_dir():
            raise CliError(f"--run-dir {run_dir}: no such run directory")
        try:
            weights, notes = await asyncio.to_thread(newest_complete_checkpoint, root, cfg)
        except CheckpointError as e:
            raise CliError(f"--run-dir {run_dir}: {e}") from None
        if weights is None:
            notes.append(f"{root} has no complete checkpoint: evaluating the base model {cfg.model.path}")
        else:
            notes.append(f"evaluating {weights.checkpoint} (weight version {weights.weight_version})")
    engine = make_engine(cfg)
    await engine.start()
    try:
        if weights is not None:
            await engine.update_weights(weights.state, weights.weight_version)
    except EngineError as e:
        await engine.shutdown()
        raise CliError(f"{weights.checkpoint} does not fit the model {cfg.model.path} (was the run trained from "
                       f"another model.path?): {e}") from None
    except BaseException:
        await engine.shutdown()
        raise
    return engine, notes
