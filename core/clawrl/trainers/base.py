"""The Trainer interface: what the orchestrator asks of a training backend.

Kept small on purpose so backends slot in: one optimizer step on a list of ``Sample``s, the
weights to serve (and how they travel: ``weight_sync``), and a checkpointable state. The orchestrator owns the loop
(when to step, when to push weights, when to save); a trainer owns only the model and optimizer.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from clawrl.engines.base import Engine
from clawrl.samples import Sample
from clawrl.weight_sync import InProcessWeightSync, WeightTransport

BACKENDS = ("torch", "megatron")


class TrainerError(RuntimeError):
    """A trainer that cannot be built or a state it cannot load; the message is one line."""


@dataclass
class StepResult:
    """Outcome of one ``train_step``.

    ``ok`` is True only when the optimizer stepped (so the weights changed and deserve a new
    version). Otherwise ``skipped_reason`` says why: ``nonfinite_loss``, ``nonfinite_grad``,
    ``no_trainable_tokens`` or ``paused``. ``metrics`` are plain floats, ready for the metrics log.
    """

    ok: bool
    metrics: dict[str, float] = field(default_factory=dict)
    skipped_reason: str | None = None


class Trainer(abc.ABC):
    """One policy being trained. Methods are called from one thread at a time per trainer."""

    # Set when the trainer refuses to continue on its own (e.g. too many non-finite losses in a
    # row); the orchestrator pauses training and shows this reason in its status.
    paused_reason: str | None = None
    # Optimizer steps taken so far (restored from checkpoints).
    step: int = 0

    @abc.abstractmethod
    def train_step(self, samples: list[Sample], weight_version: int) -> StepResult:
        """One optimizer step on ``samples``; ``weight_version`` is the version the current weights
        are served as (for staleness metrics)."""

    @abc.abstractmethod
    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights to serve (LoRA merged), on the serving device and dtype, as copies."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Everything needed to resume: ``weights`` (full model, or the adapter alone with LoRA),
        ``optimizer``, ``step``, ``rng`` and the bad-step counter."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned; raises ``TrainerError`` on a mismatched state."""

    def clear_pause(self) -> None:
        """Let training continue after ``paused_reason`` was set (an operator decision)."""
        self.paused_reason = None

    def weight_sync(self, engine: Engine) -> WeightTransport:
        """How this trainer's weights reach ``engine``: by default a copy in this process."""
        return InProcessWeightSync(engine)

    def close(self) -> None:
        """Release what the trainer holds beyond this process (trainer ranks); a no-op here."""
