"""Training backends behind one interface (``clawrl.trainers.base.Trainer``). ``make_trainer`` lives in
``clawrl.trainers.backends``: re-exporting it here would make every import of a trainers module run
the backends, which import the methods, which import trainers modules (an import loop)."""
from clawrl.trainers.base import BACKENDS, StepResult, Trainer, TrainerError

__all__ = ["BACKENDS", "StepResult", "Trainer", "TrainerError"]
