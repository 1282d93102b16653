"""``clawrl replay``: train a run's stored samples again, offline, from the version-0 weights.

Why: a live run trains once, on samples that arrive while it serves; what another learning rate or
another method's loss would have done with the *same* data cannot be asked of it afterwards. Replay
answers that: ``clawrl replay --run-dir D --out D2 [key=value ...]`` retrains, in a new run directory
D2, the batches run D trained, in D's order, and writes D2's own checkpoints and ``metrics.jsonl``, so
the two runs can be compared side by side (per-step loss and the other train metrics; for an
environment run ``clawrl env eval NAME --run-dir D2`` evaluates the replay's final weights as it does
D's). Without overrides the replay reproduces D's weights bit for bit at every checkpoint (torch
trainer on the CPU), which is what makes a replay with overrides a fair comparison. With ``--held-out``
the replay also measures its weights at the steps where D measured its held-out curve, as D measured
them, and draws the two curves side by side (``clawrl.orchestration.replay_eval``).

How determinism is kept:

- *Which samples, in which order.* The rollout buffer records every train step's batch as the trainer
  got it (table ``train_batches``: step, position, sample, the version the step started from, the
  sample's staleness at take time, the version it produced), in the same transaction that marks the
  samples trained, and a restart deletes the rows of the steps it lost (trained after the checkpoint it
  resumed; their samples train again in later steps). So the table holds exactly the surviving
  lineage, a crash and a resume included. ``RolloutBuffer.recorded_batches`` rebuilds each batch with
  the code ``take_batch`` uses (same payloads, rewards, advantages, ``extra``), read-only.
- *The starting point.* The trainer is built as the server builds it (``make_trainer`` on
  ``model.path``: the same float32 load, the LoRA adapter initialised from ``seed``) and starts at
  step 0; each recorded step is one ``train_step`` with the recorded starting version. A resumed run
  loaded exactly the weights, optimizer moments and step its checkpoint saved, so training straight
  through reaches the same state.
- *The arithmetic.* The torch thread count is set as the server's engine sets it (``engine.threads``),
  since a CPU reduction split over another number of threads can round differently. Training draws no
  random numbers unless something drops out (``train.lora.dropout > 0`` or a model with dropout): then
  the online run's draws depended on everything else its process sampled, and the replay says it cannot
  be exact.
- *The config.* A run stores its resolved config in its directory when it starts (``run_config.yaml``,
  ``clawrl.run_config``, secrets left out); ``clawrl replay`` composes D's stored config under the command
  line's overrides (the ones to try; they win) and says what it took from which. A run directory from
  before that composes from the command line alone (said in one line): give the run's own overrides.
- *A teacher's scores.* ``method=opd`` and ``combine`` train on a teacher's per-token logprobs, which D
  recorded when its teacher scored each turn (table ``opd_hints``): the method reads them from the
  snapshot (``Method.use_recorded``), and no hint judge or teacher runs. With another ``train.lr`` the
  scores stay those D's teacher gave (with ``opd.teacher=policy``, the policy of D at that time).

D is only read: its store is copied with SQLite's online backup from a read-only connection (a
consistent snapshot, also beside a live server that holds D's lock and keeps writing) into
``D2/source/``, and everything else is written into D2, which the replay holds with its own lock.
With overrides the batches stay D's: a setting that would have changed *which* samples trained online
(``train.batch_size``, ``train.max_weight_lag``, a judge) does not change them here; a step the new
setting makes non-finite is skipped as online (logged, no new checkpoint). Not replayed: runs recorded
before clawrl kept ``train_batches``, runs with a ``clawrl rollback`` (their lineage is not a line),
the megatron backend.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from transformers.utils import logging as transformers_logging

from clawrl.buffer import RolloutBuffer
from clawrl.checkpoints import ROLLBACK_FILE, CheckpointError, CheckpointStore
from clawrl.config import ClawrlConfig, compose
from clawrl.embedded.build import resolve_model
from clawrl.errors import CliError
from clawrl.methods.registry import check_method, load_method
from clawrl.metrics import MetricsLogger
from clawrl.orchestration.replay_eval import Curve, HeldOutReplay, check_held_out, write_side_by_side
from clawrl.run_config import compose_for_run
from clawrl.run_lock import RunDirError, RunDirLock
from clawrl.schema import BUFFER
from clawrl.store import STORE_FILENAME, StoreError, TurnStore
from clawrl.trainers import TrainerError
from clawrl.trainers.backends import make_trainer

COMMAND = "clawrl replay"
SOURCE_DIR = "source"  # D2/source/clawrl.sqlite: the snapshot of D's store the replay read
PROVENANCE = "replay.json"
RECORD_SINCE = len(BUFFER.migrations)  # the buffer schema version that records train batches


@dataclass
class Replayed:
    """What a replay did: the directory, the steps replayed and skipped, the checkpoints it wrote."""

    out: Path
    steps: int  # recorded steps replayed
    updated: int  # of them, steps whose optimizer step ran (the rest were non-finite under the overrides)
    checkpoints: list[int]
    last_loss: Optional[float]
    notes: list[str] = field(default_factory=list)
    held_out: Optional[tuple[Path, Path]] = None  # --held-out: heldout.json and heldout.png


def replay(cfg: ClawrlConfig, run_dir: str | Path, out: str | Path, overrides: tuple[str, ...] = (),
           note: Callable[[str], None] = lambda line: None, preface: tuple[str, ...] = (),
           held_out: bool = False) -> Replayed:
    """Retrain run ``run_dir``'s recorded batches into the new directory ``out``; see the module
    docstring. Raises CliError, with one line, on bad input (nothing is left in ``out`` then).
    ``preface``: lines told to ``note`` once the input is known good (where the config came from).
    ``held_out``: evaluate at the original's held-out steps and write the two curves side by side
    (``clawrl.orchestration.replay_eval``)."""
    root = Path(run_dir).expanduser()
    if not root.is_dir():
        raise CliError(f"--run-dir {run_dir}: no such run directory")
    if not (root / STORE_FILENAME).is_file():
        raise CliError(f"--run-dir {run_dir}: no run store ({STORE_FILENAME}) in it")
    out = Path(out).expanduser()
    if out.resolve() == root.resolve():
        raise CliError(f"--out {out} is the run directory itself; the replay writes into a new directory")
    if root.resolve() in out.resolve().parents:
        raise CliError(f"--out {out} is inside --run-dir {run_dir}; the replay writes nothing in the run it reads")
    if out.is_dir():
        if any(out.iterdir()):
            raise CliError(f"--out {out} exists and is not empty; give a new or empty directory")
    elif out.exists() or out.is_symlink():
        raise CliError(f"--out {out} exists and is not a directory")
    check_method(cfg.method)
    if cfg.trainer.backend != "torch":
        raise CliError(f"{COMMAND} runs the torch trainer; trainer.backend={cfg.trainer.backend} is not replayed")
    if (root / "checkpoints" / ROLLBACK_FILE).is_file():
        raise CliError(f"--run-dir {run_dir} had a clawrl rollback; its lineage is not one line and cannot be replayed")
    curve = check_held_out(root) if held_out else None

    created = not out.exists()
    try:
        lock = RunDirLock(out).acquire()  # D2's own lock; D's is left to whoever holds it
    except RunDirError as e:
        raise CliError(str(e)) from None
    try:
        try:
            store = _snapshot(root, out / SOURCE_DIR)
            try:
                steps = _recorded_steps(store, root)
            except BaseException:
                store.close()
                raise
        except BaseException:  # bad input: leave nothing behind
            if created:
                shutil.rmtree(out, ignore_errors=True)
            else:
                for child in out.iterdir():
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            raise
        for line in preface:
            note(line)
        try:
            return _train(cfg, root, out, store, steps, overrides, note, curve)
        finally:
            store.close()
    finally:
        lock.release()


def _snapshot(root: Path, dest: Path) -> TurnStore:
    """Copy D's store into ``dest`` through a read-only connection (SQLite's online backup: one
    consistent state, whatever a live server commits meanwhile) and check that it can be replayed."""
    dest.mkdir(parents=True)
    src_path = root / STORE_FILENAME
    try:
        src = sqlite3.connect(f"file:{src_path}?mode=ro", uri=True, timeout=30.0)
        try:
            dst = sqlite3.connect(dest / STORE_FILENAME)
            try:
                src.backup(dst)
            finally:
                dst.close()
        finally:
            src.close()
        c = sqlite3.connect(dest / STORE_FILENAME)
        try:
            has_meta = c.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
            row = c.execute("SELECT value FROM meta WHERE key = ?", (BUFFER.meta_key,)).fetchone() if has_meta else None
        finally:
            c.close()
    except sqlite3.Error as e:
        raise CliError(f"--run-dir {root}: cannot read {src_path}: {e}") from None
    version = int(row[0]) if row else 0
    if version == 0:
        raise CliError(f"--run-dir {root}: no train step in this run (it never trained); nothing to replay")
    if version < RECORD_SINCE:
        raise CliError(f"--run-dir {root} was recorded before clawrl kept each train step's batch (buffer schema "
                       f"{version} < {RECORD_SINCE}); it cannot be replayed")
    try:
        return TurnStore(dest, create=False)
    except StoreError as e:
        raise CliError(str(e)) from None


def _recorded_steps(store: TurnStore, root: Path) -> int:
    """How many steps D's record holds; CliError when it cannot be replayed (nothing trained, or
    steps trained before the record existed)."""
    c = store.connection()
    steps = [r[0] for r in c.execute("SELECT DISTINCT train_step FROM train_batches ORDER BY train_step")]
    unrecorded = c.execute("SELECT COUNT(*) FROM samples WHERE state = 'trained' AND sample_id NOT IN "
                           "(SELECT sample_id FROM train_batches)").fetchone()[0]
    if not steps and not unrecorded:
        raise CliError(f"--run-dir {root}: no sample was trained in this run; nothing to replay")
    if unrecorded or steps != list(range(1, len(steps) + 1)):
        missing = sorted(set(range(1, max(steps, default=0) + 1)) - set(steps))
        raise CliError(f"--run-dir {root} trained {unrecorded or 'some'} sample(s) that no recorded train batch "
                       f"holds{f' (no record of steps {missing[:5]})' if missing else ''}: a run from before clawrl "
                       "kept each train step's batch cannot be replayed")
    return len(steps)


def _train(cfg: ClawrlConfig, root: Path, out: Path, store: TurnStore, steps: int, overrides: tuple[str, ...],
           note: Callable[[str], None], curve: Optional[Curve] = None) -> Replayed:
    """The replay proper: D's recorded batches, one ``train_step`` each, checkpoints and metrics in D2."""
    notes: list[str] = []

    def tell(line: str) -> None:
        notes.append(line)
        note(line)

    method = load_method(cfg)
    method.use_recorded(store)  # a teacher's scores (opd, combine) as D recorded them; no judge or teacher runs
    if method.readiness.teacher and not _has_teacher_scores(store):
        tell(f"method={cfg.method}: D recorded no teacher scores (it ran without a hint judge and teacher), "
             "so only a reward trains here; samples without one add no signal")
    if cfg.engine.threads:
        torch.set_num_threads(cfg.engine.threads)  # as the server's engine set it: same CPU reductions
    if cfg.train.lora.enabled and cfg.train.lora.dropout > 0:
        tell(f"train.lora.dropout={cfg.train.lora.dropout} draws random numbers: the replay cannot be bit-exact")
    cfg = resolve_model(cfg)
    try:
        trainer = make_trainer(cfg, str(cfg.model.path))
        checkpoints = CheckpointStore(out, cfg.train)
    except (TrainerError, CheckpointError, ValueError) as e:
        raise CliError(str(e).splitlines()[0]) from None
    buffer = RolloutBuffer(store, cfg.train, method.readiness)
    metrics = MetricsLogger(out, cfg.logging, run_config=dataclasses.asdict(cfg))
    saved: list[int] = []
    updated, last_loss, version = 0, None, 0
    evaluator = HeldOutReplay(cfg, out, curve) if curve is not None else None
    pushed = 0  # the version the evaluator's engine serves

    def evaluate_at(step: int) -> None:
        nonlocal pushed
        if evaluator is None or not evaluator.wants(step):
            return
        figures = evaluator.at(step, trainer if version > pushed else None, version)
        pushed = version
        was = curve.points[step]
        tell(f"held out at recorded step {step}: {curve.metric} {figures[curve.metric]:.3f} (the run: "
             f"{was[curve.metric]:.3f}), {curve.side_metric} {figures[curve.side_metric]:.3f} (the run: "
             f"{was[curve.side_metric]:.3f})")

    try:
        if evaluator is not None:
            evaluator.start()
            evaluate_at(0)
        for step, consumed_version, trained_version, samples in buffer.recorded_batches():
            method.attach(samples)
            result = trainer.train_step(samples, consumed_version)
            figures = {**result.metrics, "recorded_step": step, "samples_trained": len(samples)}
            if not result.ok:
                metrics.log_step(trainer.step, {**figures, "skipped": result.skipped_reason})
                tell(f"recorded step {step}: the step did not update ({result.skipped_reason})")
                if trainer.paused_reason:
                    tell(f"stopped after recorded step {step}: {trainer.paused_reason}")
                    break
                evaluate_at(step)
                continue
            updated, last_loss, version = updated + 1, result.metrics.get("loss"), trained_version
            metrics.log_step(trainer.step, {**figures, "weight_version": trained_version})
            if checkpoints.after_step(trainer, trained_version) is not None:
                saved.append(trainer.step)
            evaluate_at(step)
        if updated and (not saved or saved[-1] != trainer.step):
            checkpoints.save(trainer, version)
            saved.append(trainer.step)
    finally:
        if evaluator is not None:
            evaluator.close()
        metrics.close()
        trainer.close()
    side_by_side = write_side_by_side(curve, evaluator.replayed, out, root, overrides) if evaluator else None
    (out / PROVENANCE).write_text(json.dumps({
        "run_dir": str(root.resolve()), "overrides": list(overrides), "recorded_steps": steps,
        "updated_steps": updated, "checkpoints": saved, "last_loss": last_loss, "replayed_at": time.time(),
    }, indent=2) + "\n")
    return Replayed(out, steps, updated, saved, last_loss, notes, side_by_side)


def _has_teacher_scores(store: TurnStore) -> bool:
    c = store.connection()
    return c.execute("SELECT 1 FROM opd_hints WHERE state = 'scored' LIMIT 1").fetchone() is not None


def replay_cli(args) -> int:
    """``clawrl replay --run-dir D --out D2 [key=value ...]``: the config is D's stored one (its
    ``run_config.yaml``) under the command line's overrides."""
    note = lambda line: print(f"clawrl: {line}", file=sys.stderr, flush=True)  # noqa: E731
    transformers_logging.disable_progress_bar()  # the console: the notes, then what was done
    if Path(args.run_dir).expanduser().is_dir():
        run = compose_for_run(args.run_dir, args.overrides)
        cfg, preface = run.cfg, tuple(run.notes(COMMAND))
    else:
        cfg, preface = compose(args.overrides), ()  # replay() says the directory is missing
    done = replay(cfg, args.run_dir, args.out, tuple(args.overrides), note=note, preface=preface,
                  held_out=args.held_out)
    print(f"clawrl: replayed {done.steps} train step(s) of {args.run_dir} into {done.out} ({done.updated} updated; "
          f"checkpoints {', '.join(f'step_{s}' for s in done.checkpoints) or 'none'}; last loss "
          f"{done.last_loss if done.last_loss is not None else 'n/a'})", flush=True)
    if done.held_out is not None:
        print(f"clawrl: held-out curves side by side in {done.held_out[1]} ({done.held_out[0].name} beside it)",
              flush=True)
    return 0
