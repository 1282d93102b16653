"""The engine ``engine.backend`` names, in this process: what ``make_engine`` serves without Ray,
and what each Ray actor builds on the node where it landed (``clawrl.engines.ray_engine``)."""
from __future__ import annotations

from clawrl.config import ClawrlConfig
from clawrl.engines.base import Engine, EngineError
from clawrl.engines.loading import load_model
from clawrl.engines.sglang_engine import SGLangEngine
from clawrl.engines.torch_engine import TorchEngine

BACKENDS = ("torch", "sglang")


def make_local_engine(cfg: ClawrlConfig) -> Engine:
    """A ``cfg.engine.backend`` engine serving ``cfg.model`` (loaded here; ``model.path`` resolved)."""
    backend = cfg.engine.backend
    if backend == "torch":
        loaded = load_model(cfg.model.path, device=cfg.model.device, dtype=cfg.model.dtype, name=cfg.model.name)
        return TorchEngine(loaded, cfg.engine, linear_attention=cfg.model.linear_attention)
    if backend == "sglang":
        return SGLangEngine(cfg)
    raise EngineError(f"unknown engine.backend '{backend}'; choose one of {', '.join(BACKENDS)}")
