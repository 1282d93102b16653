"""Training backends behind one interface (``clawrl.trainers.base.Trainer``)."""
from clawrl.trainers.backends import make_trainer
from clawrl.trainers.base import BACKENDS, StepResult, Trainer, TrainerError

__all__ = ["BACKENDS", "StepResult", "Trainer", "TrainerError", "make_trainer"]
