"""Binary RL: a reward judge scores each served turn by what came next, and that reward trains it.

The ``JudgeWorker`` (``clawrl.orchestration.judging``) turns closed turns into samples and scores each
by its next state (+1 / -1, or skipped with a reason), ``judge.concurrency`` at a time; the buffer
turns rewards into advantages (GRPO groups, or a baseline for a live-chat turn) and a sample is ready
once judged. Every response token trains with its sample's advantage. ``judge.kind=prm`` scores with
a frozen engine of its own (``judge.model.path``, or the base policy as it was before training), so
the judge never drifts with the weights it judges.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from clawrl.buffer import Readiness, RolloutBuffer
from clawrl.config import ClawrlConfig
from clawrl.engines import make_engine
from clawrl.engines.base import Engine
from clawrl.judges import make_judge
from clawrl.methods.base import Method, SignalWorkers
from clawrl.methods.signals import mix_advantages
from clawrl.orchestration.judging import JudgeWorker
from clawrl.store import TurnStore
from clawrl.trainers.batching import MicroBatch


class BinaryRL(Method):
    """``method=rl``; see the module docstring."""

    def __init__(self, cfg: ClawrlConfig):
        super().__init__(cfg)
        self.judge_engine: Optional[Engine] = None  # the PRM judge's frozen engine
        self.worker: Optional[JudgeWorker] = None

    @property
    def readiness(self) -> Readiness:
        return Readiness(reward=True, teacher=False)

    def prepare(self, engine: Engine, store: TurnStore, buffer: RolloutBuffer) -> SignalWorkers:
        if self.cfg.judge.kind == "prm":
            cfg = self.cfg
            model = replace(cfg.model, path=cfg.judge.model.path or str(engine.model_info().path), name=None)
            # a frozen judge is not the served policy: it stays in this process, not on Ray
            self.judge_engine = make_engine(replace(cfg, model=model, cluster=replace(cfg.cluster, ray=False)))
        self.worker = JudgeWorker(buffer, make_judge(self.cfg.judge, self.judge_engine), self.cfg.judge)
        return SignalWorkers([self.judge_engine] if self.judge_engine is not None else [], [self.worker])

    def status(self) -> dict:
        return {"judge": self.cfg.judge.kind}

    def advantages(self, batches: list[MicroBatch]) -> dict[str, float]:
        return mix_advantages(batches, w_rl=1.0, w_opd=0.0, opd_clip=None)
