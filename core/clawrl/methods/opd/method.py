"""On-policy distillation: a hint from what came next turns the policy into its own teacher.

For every closed main turn the ``TeacherWorker`` (``clawrl.methods.opd.teacher``) asks a hint judge
whether the next state holds a hint and, for an accepted one, scores the turn's sampled tokens under
the hinted prompt. The teacher is the serving engine (``opd.teacher=policy``: the policy as it is now,
so the teacher improves with it), a frozen copy of the starting policy (``opd.teacher=base``: it cannot
drift with the student) or a frozen engine loaded from the path ``opd.teacher`` names.
``opd.hint_judge=model`` votes with a frozen copy of the base policy (or the same frozen teacher
engine). Serving never waits: the worker scores ``opd.concurrency`` turns at a time and only in gaps
between user requests.

The ``TeacherGate`` (``clawrl.methods.opd.gate``) moves each teacher outcome into the rollout buffer;
no reward judge runs, so a sample is ready once scored and skipped with the hint judge's reason
otherwise. After the learner takes a batch, ``attach`` puts each scored turn's teacher signal on its
sample (``Sample.teacher``), and the per-token advantage is the teacher's logprob gap
(``clawrl.methods.signals``); with ``opd.topk > 0`` and ``opd.topk_coef > 0`` the objective adds a
top-k KL between the student and the teacher's top-k (``clawrl.trainers.objective``). With
``opd.hinted_sample`` the teacher also samples its own reply under the hinted prompt, and the student
trains on those tokens under the original prompt with token NLL weighted by the hint's acceptance
(``opd.hinted_coef``): the way to learn a behaviour the policy never samples without the hint.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

from clawrl.buffer import Readiness, RolloutBuffer
from clawrl.config import ClawrlConfig
from clawrl.engines import make_engine
from clawrl.engines.base import Engine
from clawrl.judges.hints import make_hint_judge
from clawrl.methods.base import Method, SignalWorkers
from clawrl.methods.opd.gate import TeacherGate
from clawrl.methods.opd.teacher import OpdStore, TeacherWorker
from clawrl.methods.signals import mix_advantages
from clawrl.samples import Sample
from clawrl.store import TurnStore
from clawrl.trainers.batching import MicroBatch

log = logging.getLogger(__name__)


class OnPolicyDistillation(Method):
    """``method=opd``; see the module docstring. ``teacher_wait_s``: how long a rewarded sample waits
    for its teacher before it trains RL-only (Combine's ``combine.opd_wait_s``; None: no reward, no
    timeout)."""

    def __init__(self, cfg: ClawrlConfig, teacher_wait_s: Optional[float] = None):
        super().__init__(cfg)
        self.teacher_wait_s = teacher_wait_s
        self.store: Optional[TurnStore] = None
        self.opd: Optional[OpdStore] = None
        self.teacher_engine: Optional[Engine] = None  # a frozen teacher, when opd.teacher is base or a path
        self.judge_engine: Optional[Engine] = None  # the model hint judge's frozen engine
        self.worker: Optional[TeacherWorker] = None

    @property
    def readiness(self) -> Readiness:
        return Readiness(reward=False, teacher=True)

    @property
    def topk(self) -> int:
        return self.cfg.opd.topk if self.cfg.opd.topk_coef > 0 else 0

    def prepare(self, engine: Engine, store: TurnStore, buffer: RolloutBuffer) -> SignalWorkers:
        cfg, opd_cfg = self.cfg, self.cfg.opd
        self.store, self.opd = store, OpdStore(store)
        gate = TeacherGate(buffer, store, self.teacher_wait_s)

        def frozen(path: str) -> Engine:
            return make_engine(replace(cfg, model=replace(cfg.model, path=path, name=None),
                                       cluster=replace(cfg.cluster, ray=False)))  # not the served policy

        if opd_cfg.teacher == "base":  # a frozen copy of the policy as it was loaded, before any training
            self.teacher_engine = frozen(str(engine.model_info().path))
        elif opd_cfg.teacher != "policy":
            self.teacher_engine = frozen(opd_cfg.teacher)
        if opd_cfg.hint_judge == "model":
            # like the PRM judge: a frozen model that does not drift with the weights it judges
            self.judge_engine = self.teacher_engine or frozen(str(engine.model_info().path))
        teacher = self.teacher_engine or engine
        self.worker = TeacherWorker(self.opd, make_hint_judge(opd_cfg, self.judge_engine), teacher, opd_cfg,
                                    tokenizer=getattr(engine, "tokenizer", None), timeout_s=cfg.judge.timeout_s)
        log.info("OPD: %s hint judge, teacher %s, top-k %d%s", opd_cfg.hint_judge,
                 "= the serving policy" if teacher is engine else opd_cfg.teacher, opd_cfg.topk,
                 f"; the teacher's own reply under each hint trains with NLL x {opd_cfg.hinted_coef:g}"
                 if opd_cfg.hinted_sample else "")
        engines = list(dict.fromkeys(e for e in (self.teacher_engine, self.judge_engine) if e is not None))
        return SignalWorkers(engines, [self.worker, gate])

    def use_recorded(self, store: TurnStore) -> None:
        """The teacher's scores as the run recorded them (table ``opd_hints``), for ``attach``."""
        self.store, self.opd = store, OpdStore(store)

    def attach(self, samples: list[Sample]) -> None:
        """``Sample.teacher`` for every sample of the batch whose teacher outcome is ``scored`` (one
        resolved ``timeout`` trains RL-only, even if its teacher answered later)."""
        self.opd.attach([s for s in samples if s.extra.get("opd_state") == "scored"], hinted=self.cfg.opd.hinted_sample)

    def status(self) -> dict:
        """No reward judge (``judge``), and the ``opd`` part of ``/admin/status``: hints accepted and
        rejected (by reason), teacher scores and failures, OPD samples trained."""
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
        return {"judge": None, "opd": {
            "hint_judge": self.cfg.opd.hint_judge, "teacher": self.cfg.opd.teacher, "topk": self.cfg.opd.topk,
            "hints_accepted": counts["accepted"] + counts["scored"] + counts["failed"],
            "hints_rejected": counts["rejected"], "rejected_by_reason": reasons["rejected"],
            "teacher_scored": counts["scored"], "teacher_failed": counts["failed"],
            "teacher_failed_by_reason": reasons["failed"], "awaiting_teacher": counts["accepted"],
            "samples_waiting_for_teacher": waiting,
            "opd_samples_trained": trained.get("scored", 0),
            "rl_only_after_timeout_trained": trained.get("timeout", 0),
        }}

    def advantages(self, batches: list[MicroBatch]) -> dict[str, float]:
        return mix_advantages(batches, w_rl=0.0, w_opd=1.0, opd_clip=self.cfg.opd.adv_clip)
