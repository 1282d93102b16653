"""Learning beside the gateway: give served turns a training signal, train, serve the new weights.

Four things run at once in the server's event loop, and serving never waits on the other three:

- the gateway serves and records turns (``clawrl.gateway``);
- the method's signal workers (``cfg.method``, ``clawrl.methods``) give closed turns their signal:
  Binary RL's reward judge scores each by its next state (+1 / -1, or skipped with a reason), OPD's
  hint judge and teacher score its tokens under a hint from it, Combine runs both; the rollout buffer
  makes a sample ready when the method's readiness rule says so;
- the training loop (``Learner._train_loop``) waits until ``train.batch_size`` samples are ready,
  takes them, runs one optimizer step in a worker thread (torch releases the GIL, so tokens keep
  streaming), pushes the new weights to the engine as the next version (swapped between decode
  steps, never a 503), marks the samples trained, checkpoints every ``train.save_every`` steps and
  logs what it trained and what it skipped and why; the method puts its per-sample data on each
  batch (``Method.attach``) and gives the trainer its per-token advantages;
- admin routes pause and resume *training only* (``POST /admin/pause``, ``/admin/resume``) and
  ``GET /admin/status`` reports samples, steps, the last loss and why training is paused.

The learner never asks which method it runs: it starts, wakes and stops whatever signal workers the
method built (``Method.prepare``), and shows the method's own status.

On start the learner resumes from the newest checkpoint (trainer weights, optimizer, step, and the
engine serving those weights under the checkpoint's version) and returns to ready every sample
whose update was lost with the newer weights (``RolloutBuffer.requeue_after_restore``), so each
sample trains exactly once in the surviving lineage.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from typing import Callable, Optional

from fastapi import FastAPI, Request

from clawrl.backoff import Backoff
from clawrl.buffer import RolloutBuffer
from clawrl.checkpoints import CheckpointError, CheckpointStore
from clawrl.config import ClawrlConfig
from clawrl.engines.base import Engine
from clawrl.envs import CHAT, EnvError, env_class
from clawrl.envs.task_formats import TaskRecord
from clawrl.envs.tasks import load_tasks
from clawrl.episode_store import EpisodeStore
from clawrl.errors import CliError
from clawrl.gateway.protocol import ApiError
from clawrl.judges import JudgeError
from clawrl.methods.base import SignalWorkers
from clawrl.methods.registry import check_method, load_method
from clawrl.metrics import MetricsLogger
from clawrl.orchestration.evaluation import concurrency_beside_rollouts, evaluate
from clawrl.orchestration.rollouts import RolloutWorker
from clawrl.run_config import save_run_config
from clawrl.samples import Sample
from clawrl.storage_faults import storage_fault
from clawrl.store import TurnStore
from clawrl.trainers import TrainerError
from clawrl.trainers.backends import make_trainer
from clawrl.weight_sync import InProcessWeightSync

log = logging.getLogger(__name__)


class Learner:
    """The method's signal workers and training, for one run; see the module docstring.

    ``start()`` after the engine has started; ``stop()`` before it shuts down. ``pause()`` /
    ``resume()`` act between train steps (a step in flight finishes and its weights are served).
    """

    def __init__(self, cfg: ClawrlConfig, engine: Engine, store: TurnStore, poll_s: float = 0.25,
                 on_done: Optional[Callable[[], None]] = None):
        self.cfg, self.engine, self.store, self.poll_s = cfg, engine, store, poll_s
        self.method = load_method(cfg)
        self.env_mode = cfg.env.name != CHAT
        if self.env_mode and self.method.readiness.teacher:
            raise ValueError(f"method={cfg.method} needs a teacher's hint for each served turn; environment rollouts "
                             "train on the environment's verdict: use method=rl with env.name")
        self.buffer = RolloutBuffer(store, cfg.train, self.method.readiness)
        save_run_config(cfg, store.run_dir)  # what clawrl replay and clawrl export-model read back
        self.rollouts: Optional[RolloutWorker] = None  # env.name set: the sample source, built by prepare()
        self.eval_records: list[TaskRecord] = []
        self.on_done = on_done  # env.max_train_steps reached and saved: the server may exit
        self.last_eval: Optional[dict] = None
        self.signals = SignalWorkers()  # the method's, built by prepare()
        self.checkpoints = CheckpointStore(store.run_dir, cfg.train)
        self.metrics = MetricsLogger(store.run_dir, cfg.logging, run_config=dataclasses.asdict(cfg))
        self.sync = InProcessWeightSync(engine)
        self.trainer = None
        self._resume_step, self._resume_version, self._resume_source = 0, 0, 0
        self._saved_step = 0  # the newest step with a checkpoint (or the start, nothing to save)
        self.train_step = 0  # the last step whose weights are served and whose samples are marked trained
        self.admin_pause: Optional[str] = None  # why an operator paused training
        self.last_loss: Optional[float] = None
        self.last_step_at: Optional[float] = None
        self.last_step_skip: Optional[str] = None  # why the latest attempted step did not update
        self.stepping = False
        self._stopping = False
        self._task: Optional[asyncio.Task] = None
        self._wake = asyncio.Event()
        self._skip_mark = 0.0  # skips logged up to this time
        # A step served but not yet on disk (a full disk refused it): its samples to mark trained
        # (ids, step, version), and whether its checkpoint is due. Written before the next batch.
        self._unmarked: Optional[tuple[list[int], int, int]] = None
        self._checkpoint_due = False
        self.backoff = Backoff("training", "checkpointing and training pause (serving goes on)")

    # ---------------------------------------------------------------- lifecycle

    def prepare(self) -> None:
        """Build the trainer and the method's signal workers, and load the newest checkpoint.

        Synchronous and before serving, so a bad setting or an unusable checkpoint is a one-line
        error at startup rather than a failure inside the running server."""
        model_path = str(self.engine.model_info().path)
        self.trainer = make_trainer(self.cfg, model_path)
        self.sync = self.trainer.weight_sync(self.engine)  # in-process, or streamed from trainer ranks
        resumed = self.checkpoints.resume(self.trainer)
        if resumed is not None:
            self._resume_step, self._resume_version = resumed.step, resumed.weight_version
            self._resume_source = resumed.source_version
        else:
            # No usable checkpoint: the base weights. If versions were served before (a crash before
            # the first checkpoint), they come back under a new number, so versions never repeat.
            served = self.checkpoints.high_water()
            self._resume_step, self._resume_version, self._resume_source = 0, served + 1 if served else 0, 0
        self._saved_step = self._resume_step
        if self.env_mode:
            # the environment gives every episode its verdict: no judge runs, live chats are served and
            # recorded but train only in chat runs
            self.rollouts = RolloutWorker(self.cfg, self.engine, self.buffer, EpisodeStore(self.store, self.buffer),
                                          self._wake.set)
            if self.cfg.env.eval_every or self.cfg.env.max_train_steps:
                self.eval_records = self._eval_records()
        else:
            self.signals = self.method.prepare(self.engine, self.store, self.buffer)

    def _eval_records(self) -> list[TaskRecord]:
        """The held-out tasks of the periodic evaluation (``env.eval_split``, ``env.eval_limit``); none
        when the task set has no such split (said once, at start)."""
        env = self.cfg.env
        try:
            tasks = load_tasks(env.tasks, env.eval_split, env_class(env.name))
        except EnvError as e:
            log.warning("no periodic held-out evaluation: %s", e)
            return []
        return [TaskRecord(t, env.eval_split, env.name) for t in tasks][:env.eval_limit]

    async def start(self) -> None:
        """Serve the resumed weights, requeue lost updates, start the signal workers and training."""
        if self.trainer is None:
            await asyncio.to_thread(self.prepare)
        version = self._resume_version
        if version > self.sync.version:
            if version != self._resume_source:  # older weights under a new number: no staleness of their own
                await asyncio.to_thread(self.buffer.record_alias, version, self._resume_source)
            await self.sync.push(self.trainer, version)
            await asyncio.to_thread(self.checkpoints.record_version, version)
        requeued = await asyncio.to_thread(self.buffer.requeue_after_restore, self._resume_step)
        self.train_step = self._resume_step
        for engine in self.signals.engines:
            await engine.start()
        for worker in self.signals.workers:
            worker.start()
        self._skip_mark = time.time()
        if self.rollouts is not None:
            if self._done():
                self.rollouts.halted = True
            else:
                self.rollouts.start()
        self._task = asyncio.get_running_loop().create_task(self._train_loop(), name="clawrl-train-loop")
        log.info("learning: method=%s from %s, batches of %d, lr %g; train step %d, serving weight version %d%s",
                 self.cfg.method, f"env {self.cfg.env.name}" if self.env_mode else "live chat",
                 self.cfg.train.batch_size, self.cfg.train.lr, self.trainer.step, self.sync.version,
                 f"; {requeued} sample(s) whose update was lost are ready again" if requeued else "")
        if self._done():
            log.info("env.max_train_steps=%d already reached (train step %d): nothing to train",
                     self.cfg.env.max_train_steps, self.train_step)
            self._finish_soon()

    async def stop(self, step_timeout_s: float = 300.0) -> None:
        """Stop the signal workers and training. A step in flight finishes first (weights pushed,
        samples marked), then the newest step is checkpointed if ``train.save_every`` has not saved it
        yet, so a clean stop (SIGINT, SIGTERM) loses no training. Past ``step_timeout_s`` the step in flight is
        abandoned, nothing is saved from its half-updated trainer, and its samples, still consumed,
        are requeued on the next start."""
        self._stopping = True
        self._wake.set()
        if self.rollouts is not None:
            await self.rollouts.stop()
        finished = True
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), step_timeout_s)
            except asyncio.TimeoutError:
                log.warning("the train step in flight did not finish within %.0f s; abandoning it", step_timeout_s)
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
                finished = False
            self._task = None
        if finished:
            await self._save_unsaved(f"stopping, not yet checkpointed (train.save_every={self.cfg.train.save_every})")
        for worker in self.signals.workers:
            await worker.stop()
        for engine in self.signals.engines:
            await engine.shutdown()
        if self.trainer is not None:
            close_sync = getattr(self.sync, "close", None)
            if close_sync is not None:
                close_sync()
            await asyncio.to_thread(self.trainer.close)
        self.metrics.close()

    # ---------------------------------------------------------------- pause / resume

    @property
    def paused_reason(self) -> Optional[str]:
        if self.admin_pause:
            return self.admin_pause
        return self.trainer.paused_reason if self.trainer is not None else None

    def pause(self, reason: str = "paused by the admin") -> None:
        if not self.admin_pause:
            log.info("training paused (%s); serving continues", reason)
        self.admin_pause = reason

    def resume(self) -> None:
        """Lift an admin pause and a trainer's self-pause (resuming is the operator's decision)."""
        if self.trainer is not None and self.trainer.paused_reason:
            log.info("training resumed after the trainer paused itself: %s", self.trainer.paused_reason)
            self.trainer.clear_pause()
        if self.admin_pause:
            log.info("training resumed")
        self.admin_pause = None
        self._wake.set()

    # ---------------------------------------------------------------- the loop

    async def _save_unsaved(self, why: str) -> None:
        """Checkpoint the newest step if no checkpoint holds it yet. Only while the trainer holds
        exactly the served weights of the last marked step (trainer.step == train_step)."""
        if self.trainer is None or self.train_step <= self._saved_step or self.trainer.step != self.train_step:
            return
        try:
            await self._write_owed()
            if self.train_step > self._saved_step:
                log.info("%s: saving train step %d (weight version %d)", why, self.train_step, self.sync.version)
                await asyncio.to_thread(self.checkpoints.save, self.trainer, self.sync.version)
                self._saved_step = self.train_step
        except Exception as e:
            fault = storage_fault(e)
            if fault is None:
                raise
            log.warning("%s: train step %d cannot be checkpointed (%s); the next start resumes step_%d and trains "
                        "the samples since then again", why, self.train_step, fault, self._saved_step)

    async def _write_owed(self) -> bool:
        """Write what a full disk refused after the last step: its samples marked trained, then
        its checkpoint (in that order: a checkpoint never holds samples the store calls untrained).
        True if there was something to write."""
        owed = self._unmarked is not None or self._checkpoint_due
        if self._unmarked is not None:
            ids, step, version = self._unmarked
            await asyncio.to_thread(self.checkpoints.record_version, version)  # the high-water mark first
            await asyncio.to_thread(self.buffer.mark_trained, ids, step, version)
            self._unmarked = None
        if self._checkpoint_due:
            await asyncio.to_thread(self.checkpoints.save, self.trainer, self.sync.version)
            self._saved_step, self._checkpoint_due = self.train_step, False
        return owed

    def _done(self) -> bool:
        """env.max_train_steps steps are trained."""
        cap = self.cfg.env.max_train_steps
        return cap is not None and self.train_step >= cap

    def _finish_soon(self) -> None:
        """After the last step: save, evaluate, then tell the server it may exit."""
        asyncio.get_running_loop().create_task(self._finish(), name="clawrl-finish")

    async def _finish(self) -> None:
        if self.rollouts is not None:
            await self.rollouts.stop()
        await self._save_unsaved(f"env.max_train_steps={self.cfg.env.max_train_steps} reached")
        if self.eval_records and (self.last_eval is None or self.last_eval["train_step"] != self.train_step):
            await self._guarded_eval()  # a failed evaluation is logged; the run still ends
        if self.on_done is not None:
            self.on_done()

    async def held_out_eval(self) -> dict:
        """Greedy success on the held-out split with the weights served now (``evaluate``, the same
        function as ``clawrl env eval``), into the metrics as ``eval/*`` of the current step."""
        started = time.monotonic()
        result = await evaluate(self.cfg, self.engine, self.eval_records, n=1, temperature=0.0,
                                concurrency=concurrency_beside_rollouts(self.cfg))
        figures = {f"eval/{k}": v for k, v in result.as_json().items()}
        figures["eval/seconds"] = round(time.monotonic() - started, 1)
        self.metrics.log_step(self.train_step, figures)
        self.last_eval = {"train_step": self.train_step, **result.as_json()}
        log.info("held-out evaluation at train step %d (weight version %d, %d %s tasks): success %.3f, mean reward "
                 "%.3f, well-formed %.3f, truncated %.3f, %.1f turns", self.train_step, result.weight_version,
                 result.episodes, self.cfg.env.eval_split, result.success_rate, result.mean_reward,
                 result.well_formed_rate, result.truncated_rate, result.mean_turns)
        return self.last_eval

    async def _train_loop(self) -> None:
        if self.eval_records and self.cfg.env.eval_every and self.train_step == 0:
            await self._guarded_eval()  # the curve starts at the base weights
        while not self._stopping and not self._done():
            self._wake.clear()
            try:
                wrote = await self._write_owed()
                if self.paused_reason is None:
                    ready = await asyncio.to_thread(self.buffer.ready_count)
                    if ready >= self.cfg.train.batch_size and not self._stopping:
                        await self.train_once()
                        wrote = True
                if wrote:
                    self.backoff.succeeded()
                    continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a full disk, a store hiccup or a bug must not end learning: retried
                await self._sleep_unless_stopping(self.backoff.failed(e))
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        """Back off: new samples do not wake the loop, a stop does."""
        deadline = time.monotonic() + seconds
        while not self._stopping and (left := deadline - time.monotonic()) > 0:
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)

    async def _guarded_eval(self) -> None:
        try:
            await self.held_out_eval()
        except asyncio.CancelledError:
            raise
        except Exception:  # an evaluation that fails costs its figures, never the training run
            log.exception("held-out evaluation failed")

    async def train_once(self) -> bool:
        """Take one batch and train on it; True if the weights changed (a new version is served)."""
        version = self.sync.version
        samples = await asyncio.to_thread(self.buffer.take_batch, self.cfg.train.batch_size, version)
        if not samples:
            return False
        await asyncio.to_thread(self.method.attach, samples)
        self.stepping = True
        try:
            # The step runs in a thread: the event loop keeps serving while torch computes.
            result = await asyncio.to_thread(self.trainer.train_step, samples, version)
        except Exception as e:
            await asyncio.to_thread(self.buffer.mark_skipped, [s.sample_id for s in samples],
                                    f"trainer_error: {type(e).__name__}")
            log.error("train step failed on %s; skipped them: %s", _origins(samples), e)
            return False
        finally:
            self.stepping = False
        self.last_step_at = time.time()
        if not result.ok:
            self.last_step_skip = result.skipped_reason
            await asyncio.to_thread(self.buffer.mark_skipped, [s.sample_id for s in samples],
                                    f"train_step_{result.skipped_reason}")
            log.warning("train step did not update (%s); %s skipped%s", result.skipped_reason, _origins(samples),
                        f"; training paused: {self.trainer.paused_reason}" if self.trainer.paused_reason else "")
            self.metrics.log_step(self.trainer.step, {**result.metrics, "skipped": result.skipped_reason})
            return False
        new_version = version + 1
        sync_ms = await self.sync.push(self.trainer, new_version)
        step = self.trainer.step
        # served from now on: the step counts, and what the disk must hold of it is owed until written
        self.train_step, self.last_loss, self.last_step_skip = step, result.metrics.get("loss"), None
        self._unmarked = ([s.sample_id for s in samples], step, new_version)
        self._checkpoint_due = step % self.cfg.train.save_every == 0
        try:
            await self._write_owed()  # a full disk raises here; the loop retries it before the next batch
        finally:
            skipped = await asyncio.to_thread(self._skips_since_last_step)
            log.info("train step %d -> weight version %d: loss %.4f; trained %s; skipped since the last step: %s",
                     step, new_version, self.last_loss or 0.0, _origins(samples),
                     ", ".join(f"{origin} ({why})" for origin, why in skipped) or "none")
            if self._done():
                self._finish_soon()
        rollout = self.rollouts.window() if self.rollouts is not None else {}
        self.metrics.log_step(step, {**result.metrics, **rollout, "weight_version": new_version})
        self.metrics.log_version(new_version, {"weight_sync_ms": sync_ms, "train_step": step,
                                               "samples_trained": len(samples), "samples_skipped": len(skipped),
                                               "reward_mean": result.metrics.get("reward_mean")})
        eval_due = self.eval_records and self.cfg.env.eval_every and step % self.cfg.env.eval_every == 0
        if eval_due and not self._done():
            await self._guarded_eval()
        return True

    def notify(self) -> None:
        """A chat request finished: a turn may have closed (its next state arrived), so wake the
        signal workers now instead of at their next poll. Thread-safe."""
        for worker in self.signals.workers:
            worker.notify()

    def _skips_since_last_step(self) -> list[tuple[str, str]]:
        """(origin, reason) of samples skipped since the previous step's log line."""
        mark, self._skip_mark = self._skip_mark, time.time()
        return self.buffer.skipped_between(mark, self._skip_mark)

    async def settle(self, timeout_s: float = 120.0) -> None:
        """Wait until every closed turn is judged and every full batch is trained (or training is
        paused). For the demo and tests, which measure the model after a known amount of feedback."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            await asyncio.to_thread(self.buffer.sync)
            counts = await asyncio.to_thread(self.buffer.counts)
            busy = counts["pending"] or counts["judged"] or self.stepping or (
                counts["ready"] >= self.cfg.train.batch_size and self.paused_reason is None)
            if not busy:
                return
            self._wake.set()
            self.notify()
            await asyncio.sleep(0.05)
        raise TimeoutError(f"learning did not settle within {timeout_s:g} s")

    # ---------------------------------------------------------------- status

    def status(self) -> dict:
        """The training section of ``/admin/status`` (synchronous: reads the store)."""
        counts = self.buffer.counts()
        judged = self.buffer.judged_count()
        env = {"env": self.rollouts.status(), "last_eval": self.last_eval} if self.rollouts is not None else {}
        return {
            "enabled": True, "method": self.cfg.method, **self.method.status(), **env,
            "paused": self.paused_reason is not None, "paused_reason": self.paused_reason,
            "storage_fault": self.backoff.fault,  # a full disk pausing training and checkpoints, if any
            "train_step": self.train_step,
            "weight_version": self.sync.version, "last_loss": self.last_loss, "last_step_at": self.last_step_at,
            "last_step_skipped": self.last_step_skip, "batch_size": self.cfg.train.batch_size,
            "samples": {"judged": judged, "pending": counts["pending"], "ready": counts["ready"],
                        "consumed": counts["consumed"], "trained": counts["trained"], "skipped": counts["skipped"],
                        "skipped_by_reason": counts["skipped_by_reason"]},
            "judge_votes": {"votes": counts["votes"], "garbage": counts["garbage_votes"],
                            "agreement": counts["judge_agreement"]},
        }


def _origins(samples: list[Sample]) -> str:
    """What a batch trained, for the step's log line: "turns 3, 4 (rewards +1 x2)"."""
    rewards = Counter(f"{s.reward:+.2g}" for s in samples)
    by_source: dict[str, list[str]] = {}
    for s in samples:
        by_source.setdefault(s.source, []).append(str(s.source_id or s.turn_id))
    return ("; ".join(f"{source}s {', '.join(ids)}" for source, ids in by_source.items())
            + " (rewards " + ", ".join(f"{k} x{v}" for k, v in sorted(rewards.items())) + ")")


class _NotifyAfterChat:
    """ASGI middleware: after each chat request, wake the signal workers (a next state may have arrived)."""

    def __init__(self, app, learner: Learner):
        self.app, self.learner = app, learner

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http" and scope["path"].startswith("/v1/chat/completions"):
                self.learner.notify()


def attach_learning(app: FastAPI, cfg: ClawrlConfig, engine: Engine, store: TurnStore,
                    on_done: Optional[Callable[[], None]] = None) -> Optional[Learner]:
    """Run a learner beside the gateway ``app``: started after the engine in the app's lifespan,
    stopped before it, with the admin routes for pause/resume and a training section in
    ``/admin/status``. ``train.enabled=false``: serve and record only (returns None)."""
    check_method(cfg.method)
    gw = app.state.gateway
    learner = None
    if cfg.train.enabled:
        try:
            learner = Learner(cfg, engine, store, on_done=on_done)
            learner.prepare()
        except (CheckpointError, EnvError, JudgeError, TrainerError, ValueError) as e:
            raise CliError(str(e).splitlines()[0]) from None
    app.state.learner = learner

    if learner is None:
        save_run_config(cfg, store.run_dir)  # a learner stores it itself
        log.info("train.enabled=false: serving and recording turns only, no judging or training")
        gw.status_sections.append(lambda: {"training": {"enabled": False, "method": cfg.method}})
    else:
        gw.status_sections.append(lambda: {"training": learner.status()})
        app.add_middleware(_NotifyAfterChat, learner=learner)
        inner = app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(a):
            async with inner(a) as state:
                await learner.start()
                try:
                    yield state
                finally:
                    await learner.stop()

        app.router.lifespan_context = lifespan

    def admin(request: Request) -> None:
        gw.admin_keys.check(request.headers.get("authorization"))

    def refuse_disabled() -> None:
        raise ApiError(409, "training is disabled (train.enabled=false); nothing to pause or resume",
                       code="training_disabled")

    @app.post("/admin/pause")
    async def admin_pause(request: Request):
        admin(request)
        if learner is None:
            refuse_disabled()
        learner.pause()
        return {"paused": True, "paused_reason": learner.paused_reason}

    @app.post("/admin/resume")
    async def admin_resume(request: Request):
        admin(request)
        if learner is None:
            refuse_disabled()
        learner.resume()
        return {"paused": learner.paused_reason is not None, "paused_reason": learner.paused_reason}

    return learner
