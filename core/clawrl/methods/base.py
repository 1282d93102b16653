"""The method seam: one object decides how a sample trains.

A method is built from the config (``Method(cfg)``) in every process that needs it -- the learner
beside the gateway, the torch trainer, each megatron trainer rank -- so it holds no state that has to
travel between them. It decides four things:

- **signal workers** (``prepare``): what runs beside serving to give samples a training signal (a
  reward judge, a hint judge and a teacher). The method builds them; the learner starts, wakes and
  stops them, and never asks which method it runs.
- **readiness** (``readiness``): which signals the rollout buffer waits for before a sample is
  ready (``clawrl.buffer.Readiness``).
- **per-sample data** (``attach``): typed fields it puts on the samples of a batch before the step,
  such as OPD's ``Sample.teacher``.
- **per-token advantage** (``advantages``): what each token of a micro-batch trains with, and which
  tokens train at all. The shared objective (``clawrl.trainers.objective``) does the rest -- the
  policy loss with TIS/IcePop, KL, entropy, and the top-k distillation term when ``topk > 0``.

The built-in methods are ``clawrl.methods.rl``, ``clawrl.methods.opd`` and ``clawrl.methods.combine``;
``clawrl.methods.registry`` maps names and ``dir/file.py:ClassName`` paths to classes.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

from clawrl.buffer import Readiness, RolloutBuffer
from clawrl.config import ClawrlConfig
from clawrl.engines.base import Engine
from clawrl.samples import Sample
from clawrl.store import TurnStore
from clawrl.trainers.batching import MicroBatch
from clawrl.workers import PollingWorker


@dataclass
class SignalWorkers:
    """What a method runs beside serving. The learner starts the engines, then the workers; wakes the
    workers when a chat request finishes (a turn may have closed); stops the workers, then the engines."""

    engines: list[Engine] = field(default_factory=list)  # frozen engines the workers use (not the served one)
    workers: list[PollingWorker] = field(default_factory=list)

    def __add__(self, other: "SignalWorkers") -> "SignalWorkers":
        return SignalWorkers(self.engines + other.engines, self.workers + other.workers)


class Method(abc.ABC):
    """How a sample trains; see the module docstring. Subclasses take the config only, so that
    ``method=dir/file.py:ClassName`` can build them anywhere."""

    def __init__(self, cfg: ClawrlConfig):
        self.cfg = cfg

    @property
    @abc.abstractmethod
    def readiness(self) -> Readiness:
        """Which signals a sample waits for before it is ready to train."""

    @abc.abstractmethod
    def prepare(self, engine: Engine, store: TurnStore, buffer: RolloutBuffer) -> SignalWorkers:
        """Build the signal workers for the served ``engine`` and the run's ``store`` and ``buffer``.
        Synchronous and before serving, so a bad setting is a one-line error at startup."""

    def attach(self, samples: list[Sample]) -> None:
        """Put this method's typed per-sample data on a batch the learner just took (synchronous; may
        read the store). Nothing by default: the buffer's reward and advantage are all RL needs."""

    def use_recorded(self, store: TurnStore) -> None:
        """Read the per-sample data ``attach`` puts on a batch from what a run recorded in ``store``,
        without building signal workers (``clawrl replay``: no engine, no judge, no teacher runs).
        Nothing by default: the buffer's rows hold all RL needs."""

    def status(self) -> dict:
        """This method's part of the training section of ``/admin/status``."""
        return {}

    @property
    def topk(self) -> int:
        """K of the teacher's top-k the micro-batches carry, so that the objective adds the top-k
        distillation term; 0 turns it off."""
        return 0

    @abc.abstractmethod
    def advantages(self, batches: list[MicroBatch]) -> dict[str, float]:
        """Per-token advantages, in place: set each micro-batch's ``advantages`` and drop from its
        ``loss_mask`` the tokens that have no signal. Called once per step with every micro-batch of
        the step (on megatron, of every data-parallel rank), before the loss; returns step metrics."""
