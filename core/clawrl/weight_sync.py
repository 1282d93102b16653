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
- ``SGLangWeightSync``: the engine is SGLang (``engine.backend=sglang``) and the trainer's ranks run
  in other processes: rank 0 broadcasts buckets over SGLang's own weights-update group, and this
  process asks SGLang to receive each one (``clawrl.weight_transport_sglang``).
"""
from __future__ import annotations

import abc
import asyncio
import json
import logging
import threading
import time
import uuid
from datetime import timedelta
from typing import Protocol

import torch

from clawrl.config import ClusterConfig
from clawrl.engines.base import Engine
from clawrl.weight_transport import (MB, BucketReceiver, ServedWeights, SyncEndpoint, WeightSyncError, one_line,
                                     host_store)
from clawrl.weight_transport_sglang import SGLangGroupEndpoint

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


class SGLangWeightSync(WeightTransport):
    """Weights from trainer rank 0 (another process) into an SGLang engine over SGLang's
    weights-update group (``clawrl.weight_transport_sglang``).

    ``updates`` is the engine's ``SGLangWeightUpdates`` (pause, session, loads, flush, continue).
    The driver hosts the store for the bucket headers on ``host:port``; rank 0 hosts the group's
    rendezvous on ``group_host:group_port``. SGLang joins the group once (on the first push, while
    rank 0 joins); after a failed push the group is dropped on both sides and the next push forms
    the next generation's. Each bucket header is checked against the names and shapes the engine
    serves before SGLang is asked to receive it.
    """

    def __init__(self, updates, served: ServedWeights, cluster: ClusterConfig, host: str, port: int,
                 group_host: str, group_port: int, backend: str = "nccl"):
        self.updates = updates
        self.served = served
        self.version = updates.version
        self.last_sync_ms: float | None = None
        self._timeout_s = float(cluster.timeout_s)
        self._bucket_bytes = int(cluster.bucket_mb) * MB
        self._host, self._group_host, self._group_port, self._backend = host, group_host, int(group_port), backend
        self._store = host_store(host, port, self._timeout_s)
        self._generation = 0
        self._token = uuid.uuid4().hex[:8]
        self._lock = asyncio.Lock()

    @property
    def endpoint(self) -> SGLangGroupEndpoint:
        return SGLangGroupEndpoint(self._host, self._store.port, self._generation, self._group_host, self._group_port,
                                   self.updates.group_ranks + 1, self._backend, self._timeout_s, self._bucket_bytes,
                                   self._token)

    def _group(self, endpoint: SGLangGroupEndpoint):
        from clawrl.engines.sglang_engine import WeightGroup

        return WeightGroup(endpoint.master_address, endpoint.master_port, endpoint.world_size, endpoint.group_name,
                           endpoint.backend)

    async def push(self, source: StreamsWeights, version: int) -> float:
        """Serve ``version`` while ``source`` streams it; the trainer's side runs in a worker thread."""
        from clawrl.engines.base import EngineError

        async with self._lock:
            self._refuse_stale(version)
            endpoint = self.endpoint
            group = self._group(endpoint)
            started = time.perf_counter()
            sending = _in_thread(source.send_weights, version, endpoint)
            try:
                await self._race(self.updates.init_group(group), sending, "SGLang's join of the group")
                buckets = await self._race(self.updates.from_distributed(group, self._headers(endpoint, version),
                                                                         version), sending, "the load")
                await asyncio.wait_for(sending, self._timeout_s)
            except (EngineError, WeightSyncError, asyncio.TimeoutError) as e:
                await self._retire(group)
                if not sending.done():  # SGLang dropped the group: the sender fails now, or at its timeout
                    await asyncio.wait((sending,), timeout=_RECEIVER_GRACE_S)
                sender = sending.exception() if sending.done() and not sending.cancelled() else None
                also = f" (the sender: {one_line(sender)})" if sender is not None and one_line(sender) not in str(e) \
                    else ""
                raise WeightSyncError(f"weight version {version} was not served by SGLang: {one_line(e)}{also}") from e
            self.version = version
            self.last_sync_ms = (time.perf_counter() - started) * 1000.0
            log.info("weight version %d served by SGLang: %d buckets over %s in %.0f ms", version, buckets,
                     endpoint.describe(), self.last_sync_ms)
            return self.last_sync_ms

    async def _race(self, work, sending: asyncio.Future, what: str):
        """``work``, unless the sender fails first (then SGLang may wait forever for a broadcast)."""
        task = asyncio.ensure_future(work)
        await asyncio.wait((task, sending), return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and sending.exception() is not None:
            await asyncio.wait((task,), timeout=_RECEIVER_GRACE_S)
            if not task.done():
                task.cancel()
                raise WeightSyncError(f"the weight sender failed during {what}: {one_line(sending.exception())}")
        return await task

    async def _headers(self, endpoint: SGLangGroupEndpoint, version: int):
        """The bucket layouts rank 0 posts, in order, each checked against what the engine serves;
        ends at the end marker (whose counts must match), raises on ``abort`` or a timeout."""
        from clawrl.engines.sglang_engine import BucketMeta

        seen: set[str] = set()
        index = 0
        while True:
            key = endpoint.key(version, index)
            try:
                raw = await asyncio.to_thread(self._get, key)
                header = json.loads(raw)
                kind = header["kind"]
            except WeightSyncError:
                raise
            except Exception:
                raise WeightSyncError(f"malformed bucket header {key}") from None
            if header.get("version") != version:
                raise WeightSyncError(f"rank 0 streamed weight version {header.get('version')}, expected {version}")
            if kind == "abort":
                raise WeightSyncError(f"the sender aborted: {header.get('reason')}")
            if kind == "end":
                missing = sorted(self.served.required - seen)
                if missing:
                    raise WeightSyncError(f"the stream ended without {len(missing)} parameters the engine serves: "
                                          f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}")
                if (header.get("buckets"), header.get("tensors")) != (index, len(seen)):
                    raise WeightSyncError(f"the sender counted {header.get('buckets')} buckets and "
                                          f"{header.get('tensors')} tensors; {index} and {len(seen)} arrived")
                return
            if kind != "bucket":
                raise WeightSyncError(f"unknown message kind '{kind}'")
            try:
                names, dtypes = [str(n) for n in header["names"]], [str(d) for d in header["dtypes"]]
                shapes = [tuple(int(x) for x in s) for s in header["shapes"]]
                assert len(names) == len(dtypes) == len(shapes) > 0
            except Exception:
                raise WeightSyncError(f"malformed bucket header {key}") from None
            for name, dtype, shape in zip(names, dtypes, shapes):
                self.served.check(name, shape)
                if name in seen:
                    raise WeightSyncError(f"'{name}' arrived twice")
                if not isinstance(getattr(torch, dtype, None), torch.dtype):
                    raise WeightSyncError(f"'{name}' has unknown dtype '{dtype}'")
                seen.add(name)
            index += 1
            yield BucketMeta(tuple(names), tuple(dtypes), tuple(shapes))

    def _get(self, key: str) -> bytes:
        try:
            self._store.wait([key], timedelta(seconds=self._timeout_s))
            value = self._store.get(key)
            self._store.delete_key(key)
            return value
        except Exception as e:
            raise WeightSyncError(f"no bucket header {key} from rank 0 within {self._timeout_s:g} s: "
                                  f"{one_line(e)}") from e

    async def _retire(self, group) -> None:
        """After a failure: SGLang forgets this generation's group; the next push forms a new one."""
        await self.updates.forget_group(group)
        self._generation += 1

    def close(self) -> None:
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
