"""Moving trained weights into the serving engine.

``InProcessWeightSync`` is the single-process path: trainer and engine live in one process, so a
sync is ``engine.update_weights(trainer.export_weights(), version)``. The engine applies the new
state between two decode steps, so every token is produced wholly by one version and no request
fails or waits on an error. Versions only move forward: samples are tagged with the version that
produced each token, and staleness is counted by subtracting versions, which a repeated or lower
number would corrupt. A multi-process or multi-node sync (NCCL broadcast, disk) would keep this
``push`` signature.
"""
from __future__ import annotations

import asyncio
import logging
import time

from clawrl.engines.base import Engine
from clawrl.trainers.base import Trainer

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A push the sync refuses (e.g. a version that is not above the served one); one line."""


class InProcessWeightSync:
    """Pushes a trainer's weights into an engine in the same process, with increasing versions."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.version = engine.model_info().weight_version
        self.last_sync_ms: float | None = None
        self._lock = asyncio.Lock()

    async def push(self, trainer: Trainer, version: int) -> float:
        """Serve ``trainer``'s weights as ``version``; returns the sync time in milliseconds.

        The export (merging LoRA, casting to the serving dtype) runs in a worker thread so the
        event loop keeps streaming tokens meanwhile; only the copy into the engine happens between
        decode steps.
        """
        async with self._lock:
            if version <= self.version:
                raise WeightSyncError(f"weight version {version} is not above the served version {self.version}; "
                                      "versions only ever increase")
            started = time.perf_counter()
            state = await asyncio.to_thread(trainer.export_weights)
            exported = time.perf_counter()
            await self.engine.update_weights(state, version)
            self.version = version
            done = time.perf_counter()
            self.last_sync_ms = (done - started) * 1000.0
            log.info("weight version %d served: %d tensors, export %.0f ms, apply %.0f ms", version, len(state),
                     (exported - started) * 1000.0, (done - exported) * 1000.0)
            return self.last_sync_ms
