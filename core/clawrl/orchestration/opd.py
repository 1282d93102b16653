"""On-policy distillation beside the gateway: hint judge + teacher, and the gate into the buffer.

``method=opd`` and ``method=combine`` add this to the learner (``clawrl.orchestration.learner``):

- a ``TeacherWorker`` (``clawrl.teacher``) hint-judges every closed main turn and, for an accepted
  hint, scores the turn's sampled tokens under the hinted prompt. The teacher is the serving engine
  (``opd.teacher=policy``: the policy as it is now, so the teacher improves with it) or a frozen
  engine loaded from the path ``opd.teacher`` names. ``opd.hint_judge=model`` votes with a frozen
  copy of the base policy (or the same frozen teacher engine). Serving never waits: the worker
  scores ``opd.concurrency`` turns at a time and only in gaps between user requests.
- the ``TeacherGate`` moves each sample's teacher outcome into the rollout buffer
  (``RolloutBuffer.resolve_opd``): ``scored`` lets it train with teacher logprobs; no hint or a failed
  teacher skips it under ``opd`` (``no_hint:<reason>``, ``teacher_failed:<reason>``) and leaves it to
  its reward under ``combine``; under ``combine`` a rewarded sample whose teacher outcome has not
  come after ``combine.opd_wait_s`` seconds (e.g. a slow teacher) is resolved as ``timeout`` and trains
  RL-only. Under ``opd`` there is no timeout: a sample never trains without its teacher score.
- after the learner takes a batch, ``attach`` puts each scored turn's teacher signal into
  ``sample.extra["opd"]`` for the trainer.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Optional

from clawrl.buffer import RolloutBuffer
from clawrl.config import ClawrlConfig
from clawrl.engines.base import Engine
from clawrl.samples import Sample
from clawrl.store import TurnStore
from clawrl.teacher import OpdStore, TeacherWorker
from clawrl.workers import PollingWorker

log = logging.getLogger(__name__)

OPD_METHODS = ("opd", "combine")


class TeacherGate(PollingWorker):
    """Resolves samples from the ``opd_hints`` table (module docstring) on every poll (``poll_s``,
    or sooner after ``notify()``); it has no items of its own in flight."""

    name = "clawrl-teacher-gate"
    item_label = "sample"

    def __init__(self, buffer: RolloutBuffer, store: TurnStore, wait_s: Optional[float], poll_s: float = 0.5):
        super().__init__(concurrency=1, poll_s=poll_s)
        self.buffer, self.store, self.wait_s = buffer, store, wait_s

    def resolve_now(self, now: Optional[float] = None) -> int:
        """Resolve every sample whose teacher outcome is in (and time out waiting rewarded samples
        under combine). Synchronous; returns how many samples were resolved."""
        now = time.time() if now is None else now
        if not self.buffer.rl_judged:  # no reward judge creates (or relabel-skips) the samples under opd
            self.buffer.sync()
            self.buffer.skip_relabelled_pending()
        rows = self.store.connection().execute(
            "SELECT s.sample_id, h.state, h.reason FROM samples s JOIN opd_hints h ON h.turn_id = s.turn_id "
            "WHERE s.opd_state IS NULL AND s.state IN ('pending', 'judged') "
            "AND h.state IN ('scored', 'rejected', 'failed') ORDER BY s.sample_id").fetchall()
        for sid, state, reason in rows:
            if state == "scored":
                self.buffer.resolve_opd(sid, "scored", now=now)
            else:
                why = f"no_hint:{reason}" if state == "rejected" else f"teacher_failed:{reason}"
                self.buffer.resolve_opd(sid, "none", why, now=now)
        timed_out = []
        if self.wait_s is not None:
            timed_out = [r[0] for r in self.store.connection().execute(
                "SELECT sample_id FROM samples WHERE state = 'judged' AND opd_state IS NULL AND rl_signal = 1 "
                "AND judged_at <= ? ORDER BY sample_id", (now - self.wait_s,))]
            for sid in timed_out:
                log.warning("sample %d: no teacher outcome within combine.opd_wait_s=%g s; it trains RL-only",
                            sid, self.wait_s)
                self.buffer.resolve_opd(sid, "timeout", now=now)
        return len(rows) + len(timed_out)

    async def _prepare(self) -> None:
        await asyncio.to_thread(self.resolve_now)

    async def _next_work(self, free: int, busy: list[int]) -> list:
        return []

    def _started_message(self) -> str:
        wait = "no timeout" if self.wait_s is None else f"rewarded samples train RL-only after {self.wait_s:g} s"
        return f"OPD teacher gate started: samples wait for their teacher outcome ({wait})"


class OpdLearning:
    """The OPD side of a learner: teacher engine(s), ``TeacherWorker`` and ``TeacherGate``.

    ``prepare()`` (synchronous, before serving) builds the engines and the worker so a bad setting
    fails at startup; ``start()``/``stop()`` run in the server's event loop.
    """

    def __init__(self, cfg: ClawrlConfig, engine: Engine, store: TurnStore, buffer: RolloutBuffer):
        if cfg.method not in OPD_METHODS:
            raise ValueError(f"OPD runs under method=opd or combine, not {cfg.method}")
        self.cfg, self.engine, self.store, self.buffer = cfg, engine, store, buffer
        self.opd = OpdStore(store)
        wait_s = cfg.combine.opd_wait_s if cfg.method == "combine" else None
        if wait_s is not None and not wait_s > 0:
            raise ValueError(f"combine.opd_wait_s must be > 0, got {wait_s}")
        self.gate = TeacherGate(buffer, store, wait_s)
        self.teacher_engine: Optional[Engine] = None  # a frozen teacher, when opd.teacher is a path
        self.judge_engine: Optional[Engine] = None  # the model hint judge's frozen engine
        self.worker: Optional[TeacherWorker] = None

    def prepare(self) -> None:
        from clawrl.engines import make_engine
        from clawrl.judges.hints import make_hint_judge

        opd_cfg, model_path = self.cfg.opd, str(self.engine.model_info().path)

        def frozen(path: str) -> Engine:
            return make_engine(replace(self.cfg, model=replace(self.cfg.model, path=path, name=None),
                                       cluster=replace(self.cfg.cluster, ray=False)))  # not the served policy

        if opd_cfg.teacher != "policy":
            self.teacher_engine = frozen(opd_cfg.teacher)
        if opd_cfg.hint_judge == "model":
            # like the PRM judge: a frozen model that does not drift with the weights it judges
            self.judge_engine = self.teacher_engine or frozen(model_path)
        teacher = self.teacher_engine or self.engine
        self.worker = TeacherWorker(self.opd, make_hint_judge(opd_cfg, self.judge_engine), teacher, opd_cfg,
                                    tokenizer=getattr(self.engine, "tokenizer", None),
                                    timeout_s=self.cfg.judge.timeout_s)
        log.info("OPD: %s hint judge, teacher %s, top-k %d%s", opd_cfg.hint_judge,
                 "= the serving policy" if teacher is self.engine else opd_cfg.teacher, opd_cfg.topk,
                 f", combine weights rl {self.cfg.combine.w_rl:g} / opd {self.cfg.combine.w_opd:g}, teacher wait "
                 f"{self.cfg.combine.opd_wait_s:g} s" if self.cfg.method == "combine" else "")

    async def start(self) -> None:
        for e in dict.fromkeys(x for x in (self.teacher_engine, self.judge_engine) if x is not None):
            await e.start()
        self.worker.start()
        self.gate.start()

    async def stop(self) -> None:
        if self.worker is not None:
            await self.worker.stop()
        await self.gate.stop()
        for e in dict.fromkeys(x for x in (self.teacher_engine, self.judge_engine) if x is not None):
            await e.shutdown()

    def notify(self) -> None:
        """A turn may have closed: hint-judge it and resolve samples now rather than at the next
        poll. Thread-safe."""
        if self.worker is not None:
            self.worker.notify()
        self.gate.notify()

    def attach(self, samples: list[Sample]) -> int:
        """``sample.extra["opd"]`` for every scored sample of a batch (synchronous, reads the store)."""
        return self.opd.attach([s for s in samples if s.extra.get("opd_state") == "scored"])

    def status(self) -> dict:
        """The ``opd`` part of ``/admin/status``: hints accepted and rejected (by reason), teacher
        scores and failures, OPD samples trained."""
        counts = self.opd.counts()
        c = self.store.connection()
        trained = dict(c.execute(
            "SELECT opd_state, COUNT(*) FROM samples WHERE state = 'trained' AND opd_state IS NOT NULL "
            "GROUP BY opd_state").fetchall())
        waiting = c.execute("SELECT COUNT(*) FROM samples WHERE state IN ('pending', 'judged') "
                            "AND opd_state IS NULL").fetchone()[0]
        reasons: dict = {"rejected": {}, "failed": {}}
        for state, reason, n in c.execute("SELECT state, reason, COUNT(*) FROM opd_hints WHERE state IN "
                                          "('rejected', 'failed') GROUP BY state, reason ORDER BY 3 DESC"):
            reasons[state][reason] = n
        return {
            "hint_judge": self.cfg.opd.hint_judge, "teacher": self.cfg.opd.teacher, "topk": self.cfg.opd.topk,
            "hints_accepted": counts["accepted"] + counts["scored"] + counts["failed"],
            "hints_rejected": counts["rejected"], "rejected_by_reason": reasons["rejected"],
            "teacher_scored": counts["scored"], "teacher_failed": counts["failed"],
            "teacher_failed_by_reason": reasons["failed"], "awaiting_teacher": counts["accepted"],
            "samples_waiting_for_teacher": waiting,
            "opd_samples_trained": trained.get("scored", 0),
            "rl_only_after_timeout_trained": trained.get("timeout", 0),
        }
