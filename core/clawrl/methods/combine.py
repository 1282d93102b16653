"""Combine: Binary RL and OPD at once; a turn trains with its reward, its teacher signal, or both.

Both signal sources run (the reward judge of ``clawrl.methods.rl``, the hint judge and teacher of
``clawrl.methods.opd``), and a sample is ready once judged *and* its teacher outcome is in. A verdict
without signal is kept while the turn's hint may still train it; a rewarded sample whose teacher has not
answered after ``combine.opd_wait_s`` trains RL-only. The advantage is
``A = combine.w_rl * A_rl + combine.w_opd * A_opd`` per token (``clawrl.methods.signals``).
"""
from __future__ import annotations

import logging

from clawrl.buffer import Readiness, RolloutBuffer
from clawrl.config import ClawrlConfig
from clawrl.engines.base import Engine
from clawrl.methods.base import Method, SignalWorkers
from clawrl.methods.opd.method import OnPolicyDistillation
from clawrl.methods.rl import BinaryRL
from clawrl.methods.signals import mix_advantages
from clawrl.samples import Sample
from clawrl.store import TurnStore
from clawrl.trainers.batching import MicroBatch

log = logging.getLogger(__name__)


class Combine(Method):
    """``method=combine``; see the module docstring. ``rl`` and ``opd`` are its two parts."""

    def __init__(self, cfg: ClawrlConfig):
        super().__init__(cfg)
        self.rl = BinaryRL(cfg)
        self.opd = OnPolicyDistillation(cfg, teacher_wait_s=cfg.combine.opd_wait_s)

    @property
    def readiness(self) -> Readiness:
        return Readiness(reward=True, teacher=True)

    @property
    def topk(self) -> int:
        return self.opd.topk

    def prepare(self, engine: Engine, store: TurnStore, buffer: RolloutBuffer) -> SignalWorkers:
        workers = self.rl.prepare(engine, store, buffer) + self.opd.prepare(engine, store, buffer)
        log.info("combine: A = %g * A_rl + %g * A_opd; a rewarded sample waits up to %g s for its teacher",
                 self.cfg.combine.w_rl, self.cfg.combine.w_opd, self.cfg.combine.opd_wait_s)
        return workers

    def use_recorded(self, store: TurnStore) -> None:
        self.rl.use_recorded(store)
        self.opd.use_recorded(store)

    def attach(self, samples: list[Sample]) -> None:
        self.opd.attach(samples)

    def status(self) -> dict:
        return {**self.opd.status(), **self.rl.status()}

    def advantages(self, batches: list[MicroBatch]) -> dict[str, float]:
        return mix_advantages(batches, w_rl=self.cfg.combine.w_rl, w_opd=self.cfg.combine.w_opd,
                              opd_clip=self.cfg.opd.adv_clip)
