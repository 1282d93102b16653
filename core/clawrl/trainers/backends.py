"""Which trainer ``trainer.backend`` names. Kept apart from ``trainers.base`` so the backends import
the interface and this module imports the backends, never the other way round."""
from __future__ import annotations

from clawrl.config import ClawrlConfig
from clawrl.trainers.base import BACKENDS, Trainer, TrainerError
from clawrl.trainers.megatron.trainer import MegatronTrainer
from clawrl.trainers.torch_trainer import TorchTrainer


def make_trainer(cfg: ClawrlConfig, model_path: str) -> Trainer:
    """The trainer ``cfg.trainer.backend`` names, training a copy of the model at ``model_path``
    (the same directory the engine serves, so both start from identical weights)."""
    backend = cfg.trainer.backend
    if backend == "torch":
        return TorchTrainer(cfg, model_path)
    if backend == "megatron":
        try:
            import megatron.core  # noqa: F401  (optional: only the ranks use it, but fail here, in one line)
        except ImportError:
            raise TrainerError("trainer.backend=megatron needs megatron-core: pip install 'clawrl[megatron]' "
                               "(megatron-core 0.16 to 0.19)") from None
        return MegatronTrainer(cfg, model_path)
    raise TrainerError(f"unknown trainer.backend '{backend}'; choose one of {', '.join(BACKENDS)}")
