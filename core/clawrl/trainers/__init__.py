"""Training backends behind one interface (``clawrl.trainers.base.Trainer``)."""
from clawrl.trainers.base import BACKENDS, StepResult, Trainer, TrainerError, make_trainer

__all__ = ["BACKENDS", "StepResult", "Trainer", "TrainerError", "make_trainer"]
