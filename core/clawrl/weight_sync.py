"""Moving trained weights into the serving engine: the driver's side of every transport.

A ``WeightTransport`` serves a source's weights in the driver's engine under a new version. The
engine applies the new state between two decode steps, so every token is produced wholly by one
version and no request fails or waits on an error. Versions only move forward: samples are tagged
with the version that produced each token, and staleness is counted by subtracting versions, which
a repeated or lower number would corrupt. A failed push raises a one-line ``WeightSyncError`` and
leaves the engine serving the version it served before.

- ``InProcessWeightSync``: trainer and engine share a process (and usually a device), so a sync is
  ``engine.update_weights(trainer.export_weights(), version)``; the fast path.
- ``BroadcastWeightSync``: the trainer's ranks run in other processes or on other nodes and rank 0
  streams HF-named buckets over a process group of its own into this process
  (``clawrl.weight_transport`` has the wire, the staging and the failure rules).
"""
from __future__ import annotations

import abc
import asyncio
import logging
import threading
import time
from typing import Protocol

import torch

from clawrl.config import ClusterConfig
from clawrl.engines.base import Engine
from clawrl.weight_transport import (MB, BucketReceiver, ServedWeights, SyncEndpoint, WeightSyncError, one_line,
                                     host_store)

log = logging.getLogger(__name__)


class WeightTransport(abc.ABC):
    """Serves new weights in the driver's engine; ``version`` is the one served now."""

    version: int
    last_sync_ms: float | None

    @abc.abstractmethod
    async def push(self, source, version: int) -> float:
        """Serve ``source``'s weights as ``version``; returns the sync time in milliseconds.

        Raises WeightSyncError (one line) when the version is not above the served one or the sync
        fails; the engine then still serves the previous version.
        """

    def _refuse_stale(self, version: int) -> None:
        if version <= self.version:
            raise WeightSyncError(f"weight version {version} is not above the served version {self.version}; "
                                  "versions only ever increase")


class ExportsWeights(Protocol):
    """What ``InProcessWeightSync`` pushes from: a trainer in this process (every ``Trainer`` is one,
    structurally, so weight sync needs nothing from the trainers package)."""

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights to serve, on the serving device and dtype, as copies."""


class InProcessWeightSync(WeightTransport):
    """Pushes a trainer's weights into an engine in the same process, with increasing versions."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.version = engine.model_info().weight_version
        self.last_sync_ms: float | None = None
        self._lock = asyncio.Lock()

    async def push(self, trainer: ExportsWeights, version: int) -> float:
        """Serve ``trainer``'s weights as ``version``; returns the sync time in milliseconds.

        The export (merging LoRA, casting to the serving dtype) runs in a worker thread so the
        event loop keeps streaming tokens meanwhile; only the copy into the engine happens between
        decode steps.
        """
        async with self._lock:
            self._refuse_stale(version)
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


class StreamsWeights(Protocol):
    """What ``BroadcastWeightSync`` pushes from: in the real system, the driver's handle on the
    trainer ranks, which commands rank 0 to stream (``BucketSender(endpoint).send(version, ...)``)."""

    def send_weights(self, version: int, endpoint: SyncEndpoint) -> None:
        """Blocks until rank 0 has streamed ``version`` to ``endpoint`` (or raises why not)."""


# When the sender fails first, the receiver usually fails a moment later with the cause seen on the
# wire (a refused header, a closed socket); wait this long for it before reporting the sender's error.
_RECEIVER_GRACE_S = 1.0


class BroadcastWeightSync(WeightTransport):
    """Receives weights that trainer rank 0 streams from another process or node into ``engine``.

    Hosts the weight-sync store on ``host:port`` (port 0: a free one) at construction, so a port in
    use fails at start. The group is gloo when the engine runs on CPU, NCCL on its GPU when it runs
    on CUDA; ``backend="ipc"`` when the sender shares the engine's GPU (gloo messages, the payload
    through CUDA IPC, ``clawrl.weight_transport``). ``close()`` releases the store and the group.
    """

    def __init__(self, engine: Engine, cluster: ClusterConfig, host: str = "127.0.0.1", port: int = 0,
                 backend: str | None = None):
        info = engine.model_info()
        self.engine = engine
        self.version = info.weight_version
        self.last_sync_ms: float | None = None
        self.served = ServedWeights.of_model_dir(info.path)
        device = torch.device(info.device)
        # NCCL cannot join two processes on one GPU: a caller whose sender shares the engine's GPU
        # passes backend="ipc" (or "gloo": staged through host memory).
        self._backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        if self._backend == "ipc" and device.type != "cuda":
            raise WeightSyncError(f"the ipc weight-sync backend needs the engine on a CUDA device, not {device}")
        self._device = device if self._backend in ("nccl", "ipc") else torch.device("cpu")
        self._timeout_s = float(cluster.timeout_s)
        self._bucket_bytes = int(cluster.bucket_mb) * MB
        if self._timeout_s <= 0 or self._bucket_bytes <= 0:
            raise WeightSyncError(f"cluster.timeout_s ({cluster.timeout_s}) and cluster.bucket_mb "
                                  f"({cluster.bucket_mb}) must be positive")
        self._host = host
        self._store = host_store(host, port, self._timeout_s)
        self._generation = 0
        self._receiver: BucketReceiver | None = None
        self._lock = asyncio.Lock()

    @property
    def endpoint(self) -> SyncEndpoint:
        """Where the sender joins for the next push."""
        return SyncEndpoint(self._host, self._store.port, self._generation, 2, self._backend, self._timeout_s,
                            self._bucket_bytes)

    async def push(self, source: StreamsWeights, version: int) -> float:
        """Receive ``version`` while ``source`` streams it, then serve it; both sides run in worker
        threads, so the event loop keeps serving tokens meanwhile."""
        async with self._lock:
            self._refuse_stale(version)
            endpoint = self.endpoint
            started = time.perf_counter()
            try:
                staged = await self._transfer(source, version, endpoint)
            except WeightSyncError:
                self._retire_group()
                raise
            received = time.perf_counter()
            try:
                await self.engine.update_weights(staged, version)
            except Exception as e:
                raise WeightSyncError(f"the engine refused weight version {version}: {one_line(e)}") from e
            self.version = version
            done = time.perf_counter()
            self.last_sync_ms = (done - started) * 1000.0
            log.info("weight version %d served: %d tensors over %s, transfer %.0f ms, apply %.0f ms", version,
                     len(staged), endpoint.describe(), (received - started) * 1000.0, (done - received) * 1000.0)
            return self.last_sync_ms

    async def _transfer(self, source: StreamsWeights, version: int, endpoint: SyncEndpoint) -> dict:
        receiving = _in_thread(self._receive, endpoint, version)
        sending = _in_thread(source.send_weights, version, endpoint)
        await asyncio.wait((receiving, sending), return_when=asyncio.FIRST_COMPLETED)
        if sending.done() and sending.exception() is not None:
            await asyncio.wait((receiving,), timeout=_RECEIVER_GRACE_S)
            if not (receiving.done() and receiving.exception() is not None):
                raise WeightSyncError(f"the weight sender failed: {one_line(sending.exception())}")
        staged = await receiving  # bounded by the receiver's own timeouts; raises its WeightSyncError
        try:
            await asyncio.wait_for(sending, self._timeout_s)
        except asyncio.TimeoutError:
            raise WeightSyncError(f"the weight sender streamed version {version} but did not return within "
                                  f"{self._timeout_s:g} s") from None
        except Exception as e:
            raise WeightSyncError(f"the weight sender failed after streaming version {version}: "
                                  f"{one_line(e)}") from e
        return staged

    def _receive(self, endpoint: SyncEndpoint, version: int) -> dict:
        receiver = self._receiver
        if receiver is None or receiver.endpoint != endpoint:
            receiver = self._receiver = BucketReceiver(endpoint, 1, self._store, self._device)
        return receiver.receive(version, self.served)

    def _retire_group(self) -> None:
        """After a failure: drop this generation's group (a side still blocked on it fails now) and
        hand out the next generation, so the next push builds a fresh one."""
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()
        self._generation += 1

    def close(self) -> None:
        """Release the group and stop hosting the store."""
        self._retire_group()
        self._store = None


def _in_thread(fn, *args) -> asyncio.Future:
    """``fn(*args)`` in a daemon thread: a side left blocked by a failed sync ends on its own
    timeout without holding up the event loop's shutdown (``asyncio.to_thread`` would)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # an abandoned failure is not an error

    def settle(result, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run():
        try:
            result, error = fn(*args), None
        except BaseException as e:
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop is gone: nobody waits for this side any more

    threading.Thread(target=run, name=f"weight-sync-{getattr(fn, '__name__', 'side')}", daemon=True).start()
    return future
