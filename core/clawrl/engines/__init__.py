"""Inference engines behind one interface (``clawrl.engines.base.Engine``)."""
from __future__ import annotations

from clawrl.config import ClawrlConfig
from clawrl.engines.base import Engine
from clawrl.engines.local import BACKENDS, make_local_engine
from clawrl.engines.ray_engine import make_ray_engine

__all__ = ["BACKENDS", "make_engine"]


def make_engine(cfg: ClawrlConfig) -> Engine:
    """The engine ``cfg.engine.backend`` names, serving ``cfg.model`` (loaded here; the entry point
    has resolved ``model.path``). With ``cluster.ray=true``, ``cluster.engines`` such engines are
    placed on a Ray cluster and served through one ``RayEngine`` (each actor builds its own with
    ``ray`` off)."""
    if cfg.cluster.ray:
        return make_ray_engine(cfg)
    return make_local_engine(cfg)
