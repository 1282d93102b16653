"""Inference engines behind one interface (``clawrl.engines.base.Engine``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from clawrl.config import ClawrlConfig
    from clawrl.engines.base import Engine

BACKENDS = ("torch", "sglang")


def make_engine(cfg: "ClawrlConfig") -> "Engine":
    """The engine ``cfg.engine.backend`` names, serving ``cfg.model`` (loaded here). With
    ``cluster.ray=true``, ``cluster.engines`` such engines are placed on a Ray cluster and served
    through one ``RayEngine`` (each actor builds its own with ``ray`` off)."""
    from clawrl.engines.base import EngineError

    if cfg.cluster.ray:
        from clawrl.engines.ray_engine import make_ray_engine

        return make_ray_engine(cfg)
    backend = cfg.engine.backend
    if backend == "torch":
        from clawrl.engines.loading import load_model
        from clawrl.engines.torch_engine import TorchEngine

        loaded = load_model(cfg.model.path, device=cfg.model.device, dtype=cfg.model.dtype, name=cfg.model.name)
        return TorchEngine(loaded, cfg.engine)
    if backend == "sglang":
        from clawrl.engines.sglang_engine import SGLangEngine

        return SGLangEngine(cfg)
    raise EngineError(f"unknown engine.backend '{backend}'; choose one of {', '.join(BACKENDS)}")
