"""Serving engines placed with Ray (``cluster.ray=true``): one TorchEngine per Ray actor, one client.

``make_ray_engine(cfg)`` connects to Ray, reserves ``cluster.engines`` bundles of
``{CPU: 1, GPU: cluster.engine_gpus}`` in a SPREAD placement group (so engines land on different
nodes when the cluster has room), starts one ``EngineActor`` in each bundle and returns a
``RayEngine``: the gateway, judges and weight sync use it exactly like a local TorchEngine.

Each actor builds its TorchEngine in its own process on the node where it landed, through
``make_local_engine``, so it is the same engine the single-process path serves.
Tokens stream back through Ray streaming generators, one object per chunk, as they are sampled.

Requirements on a real cluster:
- the model directory the driver serves (``model.path`` as the entry point resolved it: the
  embedded default is built into the driver's local CLAWRL_HOME cache) must exist at the same path on every node
  that may host an engine, and on the driver, which loads the tokenizer from it;
- clawrl and its dependencies must be importable on every node (the same environment
  everywhere, or a Ray runtime_env that ships it).

Ray is an optional dependency (``pip install 'clawrl[ray]'``); it is imported only here.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import AsyncIterator, Mapping, Sequence

import torch

from clawrl.config import ClawrlConfig
from clawrl.engines.base import (
    AbortingStream, Engine, EngineError, GenerateResult, ModelInfo, SamplingParams, ScoreResult, TokenChunk,
    check_generate_request, check_score_request,
)
from clawrl.engines.loading import ModelLoadError, _load_tokenizer, require_path
from clawrl.engines.local import make_local_engine

log = logging.getLogger(__name__)

INSTALL_HINT = "Ray is not installed; pip install 'clawrl[ray]' (or ray), or set cluster.ray=false"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise EngineError(INSTALL_HINT) from None
    return ray


@dataclass(frozen=True)
class Placement:
    """Where one engine actor runs."""

    index: int  # its bundle in the placement group
    node_id: str
    node_ip: str
    device: str


class EngineActor:
    """A TorchEngine in a Ray actor process (wrapped with ``ray.remote`` by ``make_ray_engine``).

    An async actor: every method runs on the actor's one event loop, which is what the engine
    requires, and many requests are in flight at once. ``load`` is separate from ``__init__`` so
    a model that cannot load raises its own one-line error to the driver instead of a dead actor.
    """

    def __init__(self, cfg: ClawrlConfig):
        self.cfg = cfg
        self.engine: Engine | None = None

    async def load(self) -> tuple[str, str, ModelInfo]:
        """Build the engine here; returns this node's id and ip, and what it serves."""
        import ray

        self.engine = make_local_engine(self.cfg)
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), self.engine.model_info()

    async def start(self) -> None:
        await self.engine.start()

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    async def stream(self, prompt_ids: list[int], params: SamplingParams, request_id: str):
        """A streaming generator: each chunk is its own object, sent as soon as it is sampled."""
        async for chunk in self.engine.stream(prompt_ids, params, request_id=request_id):
            yield chunk

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> GenerateResult:
        return await self.engine.generate(prompt_ids, params, request_id=request_id)

    async def score(self, prompt_ids: list[int], response_ids: list[int], top_k: int, temperature: float):
        return await self.engine.score(prompt_ids, response_ids, top_k=top_k, temperature=temperature)

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def flush_cache(self) -> None:
        await self.engine.flush_cache()

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> int:
        await self.engine.update_weights(state, version)
        return self.engine.model_info().weight_version

    async def health(self) -> dict:
        return await self.engine.health()


class RayEngine(Engine):
    """The client for one or several EngineActors, with the async Engine interface.

    Requests go to the engine with the fewest outstanding requests (ties rotate). Control calls
    (pause, resume, flush_cache, update_weights, health) go to every engine and each must answer
    within ``timeout_s``. ``update_weights`` puts the state into Ray's object store once and every
    engine loads that same object under the same version; each engine swaps atomically between
    its decode steps, but the engines are not swapped in one instant, so for a moment different
    engines may serve different versions (every token still records the version that made it).
    """

    def __init__(self, actors: list, placements: list[Placement], info: ModelInfo, tokenizer,
                 placement_group=None, timeout_s: float = 300.0, owns_ray: bool = False):
        if not actors or len(actors) != len(placements):
            raise EngineError("RayEngine needs one placement per engine actor, and at least one actor")
        self.actors, self.placements = list(actors), list(placements)
        self.tokenizer = tokenizer
        self.max_context, self.vocab_size = info.max_context, info.vocab_size
        self._info = info
        self._pg, self._owns_ray, self.timeout_s = placement_group, owns_ray, timeout_s
        self._versions = [info.weight_version] * len(actors)
        self._outstanding = [0] * len(actors)
        self._assigned = [0] * len(actors)
        self._routes: dict[str, int] = {}  # open stream request id -> engine index
        self._closed = False

    # ------------------------------------------------------------------ requests

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> AsyncIterator[TokenChunk]:
        """Validate here (bad prompts raise before any work, as with a local engine), then stream."""
        prompt = check_generate_request(prompt_ids, params, self.vocab_size, self.max_context)
        rid = request_id or uuid.uuid4().hex
        if rid in self._routes:
            raise EngineError(f"request id '{rid}' is already running")
        if self._closed:
            raise EngineError("the engine is shut down")
        i = self._take()
        self._routes[rid] = i
        refs = self.actors[i].stream.options(num_returns="streaming").remote(prompt, params, rid)
        return _RayTokenStream(self, i, rid, refs)

    async def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int], top_k: int = 0,
                    temperature: float = 1.0) -> ScoreResult:
        prompt, response = check_score_request(prompt_ids, response_ids, top_k, temperature, self.vocab_size,
                                               self.max_context)
        i = self._take()
        try:
            return await _remote(self.actors[i].score.remote(prompt, response, top_k, temperature),
                                 self.placements[i])
        finally:
            self._outstanding[i] -= 1

    async def abort(self, request_id: str) -> bool:
        i = self._routes.get(request_id)
        if i is None:
            return False
        return await _remote(self.actors[i].abort.remote(request_id), self.placements[i])

    def _take(self) -> int:
        """The engine with the fewest outstanding requests; among equals, the least used."""
        i = min(range(len(self.actors)), key=lambda k: (self._outstanding[k], self._assigned[k], k))
        self._outstanding[i] += 1
        self._assigned[i] += 1
        return i

    def _release(self, i: int, rid: str) -> None:
        if self._routes.pop(rid, None) is not None:
            self._outstanding[i] -= 1


    # ------------------------------------------------------------------ control

    async def start(self) -> None:
        await self._on_all("start")

    async def shutdown(self) -> None:
        """Stop every engine, free its actor and the placement group; leave Ray if we joined it."""
        if self._closed:
            return
        self._closed = True
        ray = _import_ray()
        try:
            await self._on_all("shutdown")
        except EngineError as e:  # a dead or stuck engine must not keep the others' resources
            log.warning("engine shutdown: %s", e)
        for actor in self.actors:
            ray.kill(actor)
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
        if self._owns_ray:
            ray.shutdown()

    async def pause(self) -> None:
        await self._on_all("pause")

    async def resume(self) -> None:
        await self._on_all("resume")

    async def flush_cache(self) -> None:
        await self._on_all("flush_cache")

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Every engine loads the same state under ``version``; one failure is reported by name.

        Tensors are copied to CPU and put into the object store once; engines on the same node
        map that one copy, remote nodes fetch it once each.
        """
        ray = _import_ray()
        version = int(version)
        cpu_state = {name: t.detach().to("cpu") for name, t in state.items()}
        ref = await asyncio.to_thread(ray.put, cpu_state)
        calls = [_remote(a.update_weights.remote(ref, version), p, self.timeout_s, "update_weights")
                 for a, p in zip(self.actors, self.placements)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = []
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                failed.append(f"engine {i} on {self.placements[i].node_ip}: {_one_line(r)}")
            else:
                self._versions[i] = int(r)
        if failed:
            raise EngineError(f"update_weights to version {version} failed on {len(failed)} of "
                              f"{len(self.actors)} engines ({'; '.join(failed)}); "
                              f"engines now serve versions {self._versions}")

    async def health(self) -> dict:
        """Every engine's health, summed up; an engine that does not answer makes ok false."""
        calls = [_remote(a.health.remote(), p, self.timeout_s, "health")
                 for a, p in zip(self.actors, self.placements)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        engines = []
        for p, r in zip(self.placements, results):
            where = {"node_id": p.node_id, "node_ip": p.node_ip}
            engines.append({**where, "ok": False, "error": _one_line(r)} if isinstance(r, BaseException)
                           else {**where, **r})
        return {
            "ok": not self._closed and all(e["ok"] for e in engines),
            "backend": "ray",
            "running": sum(e.get("running", 0) for e in engines),
            "waiting": sum(e.get("waiting", 0) for e in engines),
            "paused": any(e.get("paused", False) for e in engines),
            "weight_version": min(self._versions),
            "engines": engines,
        }

    def model_info(self) -> ModelInfo:
        """The first engine's model; ``weight_version`` is the oldest any engine serves."""
        return replace(self._info, weight_version=min(self._versions), extra={
            **self._info.extra, "engines": len(self.actors), "weight_versions": list(self._versions),
            "nodes": [{"node_id": p.node_id, "node_ip": p.node_ip, "device": p.device} for p in self.placements],
        })

    async def _on_all(self, method: str) -> None:
        calls = [_remote(getattr(a, method).remote(), p, self.timeout_s, method)
                 for a, p in zip(self.actors, self.placements)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [f"engine {i} on {self.placements[i].node_ip}: {_one_line(r)}"
                  for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            raise EngineError(f"{method} failed on {len(failed)} of {len(self.actors)} engines ({'; '.join(failed)})")


class _RayTokenStream(AbortingStream):
    """What ``RayEngine.stream`` returns: chunks as the actor yields them (an end without a final
    chunk, which a TorchEngine never produces, raises like an error)."""

    def __init__(self, engine: RayEngine, index: int, rid: str, refs):
        self._engine, self._index, self._rid, self._refs = engine, index, rid, refs

    async def _next_chunk(self) -> TokenChunk:
        return await _remote(await self._refs.__anext__(), self._engine.placements[self._index])

    def _release(self, abort: bool) -> None:
        self._engine._release(self._index, self._rid)
        if abort:
            try:  # fire and forget: the actor ends the stream with an "abort" chunk nobody reads
                self._engine.actors[self._index].abort.remote(self._rid)
            except Exception:  # Ray already shut down: nothing left to abort
                pass

async def _remote(ref, placement: Placement, timeout_s: float | None = None, what: str = "call"):
    """Await one actor call; the actor's own exception comes back as itself, Ray's as one line."""
    import ray

    try:
        if timeout_s is None:
            return await ref
        return await asyncio.wait_for(ref, timeout_s)
    except asyncio.TimeoutError:
        raise EngineError(f"{what} on the engine at {placement.node_ip} took over {timeout_s:g} s "
                          "(cluster.timeout_s)") from None
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, Exception):
            raise e.cause from None
        raise EngineError(f"engine at {placement.node_ip}: {_one_line(e)}") from None
    except ray.exceptions.RayError as e:  # actor died, node lost, object lost
        raise EngineError(f"engine at {placement.node_ip} ({placement.node_id[:12]}) failed: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


# ---------------------------------------------------------------------- placement


def make_ray_engine(cfg: ClawrlConfig) -> RayEngine:
    """Place ``cluster.engines`` TorchEngines with Ray and return their client (see the module doc).

    Every step that can fail says why in one line: Ray missing, the address unreachable, the
    resources missing (after ``cluster.timeout_s``), or the model failing to load on a node.
    """
    cluster = cfg.cluster
    if cluster.engines < 1:
        raise EngineError(f"cluster.engines must be at least 1, got {cluster.engines}")
    if cluster.engine_gpus < 0:
        raise EngineError(f"cluster.engine_gpus must be >= 0, got {cluster.engine_gpus}")
    if cfg.model.device.startswith("cuda") and cluster.engine_gpus <= 0:
        raise EngineError(f"model.device={cfg.model.device} needs cluster.engine_gpus > 0 "
                          "when engines are placed with Ray")
    ray = _import_ray()

    # Every engine serves the directory the driver sees, under the same name.
    path, name = require_path(cfg.model.path), cfg.model.name
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise ModelLoadError(f"model path {root} is not a directory on this machine (the driver)")
    path, tokenizer = str(root), _load_tokenizer(root)
    actor_cfg = replace(cfg, model=replace(cfg.model, path=path, name=name), cluster=replace(cluster, ray=False))

    owns_ray = connect_ray(cluster.ray_address, cluster.timeout_s)
    pg = actors = None
    try:
        pg = place_bundles(cluster.engines, cluster.engine_gpus, cluster.timeout_s)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote_cls = ray.remote(EngineActor)
        actors = [
            remote_cls.options(
                num_cpus=1, num_gpus=cluster.engine_gpus, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(actor_cfg)
            for i in range(cluster.engines)
        ]
        try:
            loaded = ray.get([a.load.remote() for a in actors])
        except ray.exceptions.RayTaskError as e:
            raise (e.cause if isinstance(e.cause, Exception) else EngineError(_one_line(e))) from None
        except ray.exceptions.RayError as e:
            raise EngineError(f"an engine actor failed to start: {_one_line(e)}") from None
    except BaseException:
        for a in actors or []:
            ray.kill(a)
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(pg)
        if owns_ray:
            ray.shutdown()
        raise
    placements = [Placement(i, node, ip, info.device) for i, (node, ip, info) in enumerate(loaded)]
    for p in placements:
        log.info("engine %d of %d on node %s (%s), %s, serving %s", p.index, len(placements), p.node_id,
                 p.node_ip, p.device, path)
    return RayEngine(actors, placements, loaded[0][2], tokenizer, pg, cluster.timeout_s, owns_ray)


def connect_ray(address: str, timeout_s: float) -> bool:
    """Join Ray; True when this call started the connection (so ``shutdown`` should end it).

    ``auto``: the cluster RAY_ADDRESS names, else one started on this machine with ``ray start``,
    else a new local one. ``local``: always a new local one. Otherwise ``host:port`` (or
    ``ray://host:port``) of an existing cluster, which must answer within ``timeout_s``.
    A process already connected to Ray keeps that connection when the address agrees.
    """
    ray = _import_ray()
    target = (os.environ.get("RAY_ADDRESS") or None) if address == "auto" else address
    if target not in (None, "local"):
        _check_reachable(target, address, timeout_s)
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address == "auto" or target == current:
            return False
        raise EngineError(f"this process is already connected to the Ray cluster at {current}; "
                          f"cluster.ray_address={address} names another")
    try:
        ray.init(address=None if address == "auto" else address)
    except Exception as e:  # ConnectionError, RuntimeError, ValueError: the first line says which
        raise EngineError(f"cannot connect to Ray at {address} (cluster.ray_address): {_one_line(e)}") from None
    return True


def _check_reachable(target: str, address: str, timeout_s: float) -> None:
    """A TCP connect to the cluster's address, so a wrong address fails in seconds with its name
    instead of inside Ray's retry loop."""
    hostport = target.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise EngineError(f"cluster.ray_address={address} is not auto, local, host:port or ray://host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise EngineError(f"cannot reach the Ray cluster at {hostport} (cluster.ray_address={address}): "
                          f"{e.strerror or type(e).__name__}") from None


def place_bundles(engines: int, gpus: float, timeout_s: float):
    """A SPREAD placement group of ``engines`` bundles of {CPU: 1, GPU: gpus}, ready, or a one-line
    error naming what the cluster lacks (the group is removed, so nothing stays reserved)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"CPU": 1.0, **({"GPU": float(gpus)} if gpus else {})}
    pg = placement_group([bundle] * engines, strategy="SPREAD")
    if pg.wait(timeout_seconds=max(1, math.ceil(timeout_s))):
        return pg
    remove_placement_group(pg)
    total, free = ray.cluster_resources(), ray.available_resources()
    short, rest = [], []
    for res, each in bundle.items():
        need = each * engines
        line = f"{res} {need:g} needed, {free.get(res, 0):g} free of {total.get(res, 0):g}"
        (short if free.get(res, 0) < need else rest).append(line)
    shown = "; ".join(short or rest)
    raise EngineError(f"Ray could not place {engines} engines of {_fmt(bundle)} within {timeout_s:g} s "
                      f"(cluster.engines, cluster.engine_gpus): {shown}")


def _fmt(bundle: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"
