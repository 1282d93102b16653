"""The SGLang backend (optional dependency): SGLang's offline runtime behind clawrl's Engine.

SGLang is imported only when this backend is chosen, so clawrl installs and runs without it; if
it is missing, choosing it is a one-line EngineError. The adapter speaks token ids only
(``skip_tokenizer_init``), like the torch engine: prompts go in as ids, sampled ids and their
logprobs come back from SGLang's ``meta_info``.

Every request is built here as plain keyword arguments (``*_request`` below) for one of SGLang's
request classes in ``sglang.srt.managers.io_struct`` (0.5.23), and every key read from a response
is listed in ``RESPONSE_KEYS``: tests/test_sglang_protocol.py checks both against SGLang's
installed source (requirements-sglang.txt). SGLang needs a GPU, so no request has been sent to a
running SGLang from clawrl's CI.

Weight updates (``SGLangWeightUpdates``): the generation is paused in SGLang's ``retract`` mode
(running requests go back to its queue and keep their tokens; none fails), a weight-update session
is opened (SGLang 0.5.23 refuses tensor and distributed loads outside ``begin_weight_update`` /
``end_weight_update``), the tensors are loaded with ``weight_version`` set, the session is closed,
the prefix cache is flushed and generation continues. Each chunk's tokens carry the
``weight_version`` SGLang reports in that chunk's ``meta_info`` (a chunk straddling a swap is
labelled with the version current when SGLang sent it); ``health()`` cannot tell SGLang's queued
requests from its running ones.

From a distributed group (a trainer in another process): SGLang's workers join a torch process
group whose rank 0 is the trainer (``InitWeightsUpdateGroupReqInput``, once per group); then, per
bucket, one ``UpdateWeightsFromDistributedReqInput`` (names, dtypes, shapes, ``flattened_bucket``)
while the trainer broadcasts the bucket's bytes (``clawrl.weight_transport_sglang``). Every control
request goes through an ``SGLangControl``: SGLang's TokenizerManager in this process, or an SGLang
HTTP server (``HttpControl``).
"""
from __future__ import annotations

import abc
import asyncio
import importlib.util
import json
import logging
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Mapping, Sequence

import torch
from transformers import AutoConfig, AutoTokenizer

from clawrl.config import ClawrlConfig
from clawrl.engines.base import (
    ContextLengthExceeded, Engine, EngineError, ModelInfo, SamplingParams, ScoreResult, TokenChunk,
)
from clawrl.engines.loading import ModelLoadError, require_path
from clawrl.engines.model_defaults import end_of_turn_ids, generation_config

log = logging.getLogger(__name__)

INSTALL_HINT = "SGLang is not installed; pip install sglang (GPU only), or use engine.backend=torch"

# Every key this adapter reads from SGLang's responses (a generate result and its meta_info, a
# finish_reason dict, and the HTTP server's answer to a control request). tests/test_sglang_protocol.py
# fails when one of them is not a string literal of the installed SGLang source, or when this module
# reads a key that is not listed here.
RESPONSE_KEYS = ("meta_info", "completion_tokens", "output_token_logprobs", "output_top_logprobs",
                 "input_token_logprobs", "input_top_logprobs", "finish_reason", "type", "matched",
                 "cached_tokens", "weight_version", "success", "message")
# SGLang's finish_reason types (FINISH_* .to_json() in schedule_batch.py) and clawrl's names for them.
FINISH_TYPES = {"stop": "stop", "length": "length", "abort": "abort"}
# SGLang's pause mode that keeps running requests (retracted to its queue) instead of aborting them.
PAUSE_MODE = "retract"


def _import_sglang():
    if importlib.util.find_spec("sglang") is None:
        raise EngineError(INSTALL_HINT)
    try:
        import sglang
    except Exception as e:  # installed without its GPU dependencies (requirements-sglang.txt)
        raise EngineError(f"SGLang is installed but does not import ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); it needs a GPU install, "
                          "or use engine.backend=torch") from None
    return sglang


def sampling_params(params: SamplingParams, max_new_tokens: int | None = None,
                    temperature: float | None = None) -> dict[str, Any]:
    """The ``sampling_params`` dict of a ``GenerateReqInput`` (fields of SGLang's SamplingParams)."""
    sp: dict[str, Any] = {"max_new_tokens": params.max_new_tokens if max_new_tokens is None else max_new_tokens,
                          "temperature": params.temperature if temperature is None else temperature,
                          "top_p": params.top_p, "ignore_eos": params.ignore_eos}
    if params.top_k:
        sp["top_k"] = params.top_k
    if params.stop:
        sp["stop"] = list(params.stop)
    if params.stop_token_ids:
        sp["stop_token_ids"] = sorted(params.stop_token_ids)
    if params.seed is not None:
        sp["sampling_seed"] = params.seed
    return sp


def generate_request(prompt: list[int], params: SamplingParams, rid: str) -> dict[str, Any]:
    """Keyword arguments of ``GenerateReqInput`` for a streamed, token-in/token-out request."""
    req = {"rid": rid, "input_ids": prompt, "sampling_params": sampling_params(params),
           "return_logprob": True, "logprob_start_len": len(prompt), "stream": True}
    if params.top_logprobs:
        req["top_logprobs_num"] = params.top_logprobs
    return req


def score_request(prompt: list[int], response: list[int], top_k: int, temperature: float) -> dict[str, Any]:
    """Keyword arguments of ``GenerateReqInput`` for a prefill-only scoring request."""
    req = {"input_ids": prompt + response,
           "sampling_params": sampling_params(SamplingParams(max_new_tokens=1), max_new_tokens=0,
                                              temperature=temperature),
           "return_logprob": True, "logprob_start_len": len(prompt)}
    if top_k:
        req["top_logprobs_num"] = top_k
    return req


def update_from_tensor_request(payload: bytes, version: int) -> dict[str, Any]:
    """Keyword arguments of ``UpdateWeightsFromTensorReqInput``."""
    return {"serialized_named_tensors": [payload], "flush_cache": True, "weight_version": str(version)}


def update_from_disk_request(path: str, version: int) -> dict[str, Any]:
    """Keyword arguments of ``UpdateWeightFromDiskReqInput``."""
    return {"model_path": path, "flush_cache": True, "weight_version": str(version)}


# SGLang's receivers read a bucket as one flat byte tensor (FlattenedTensorBucket) when told so.
FLATTENED_BUCKET = "flattened_bucket"


@dataclass(frozen=True)
class WeightGroup:
    """SGLang's weights-update process group: rank 0 is the trainer, which hosts its TCP rendezvous
    at ``master_address:master_port``; SGLang's workers are ranks 1 .. world_size - 1."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str  # nccl between GPUs; gloo on CPU

    def __post_init__(self):
        if self.world_size < 2:
            raise EngineError(f"a weights-update group needs the trainer and SGLang, not world size {self.world_size}")
        if not self.group_name:
            raise EngineError("a weights-update group needs a name")


@dataclass(frozen=True)
class BucketMeta:
    """What one broadcast carries, in order: the tensors packed back to back in one byte buffer."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # torch dtype names without "torch.": bfloat16, float32, ...
    shapes: tuple[tuple[int, ...], ...]


def init_group_request(group: WeightGroup) -> dict[str, Any]:
    """Keyword arguments of ``InitWeightsUpdateGroupReqInput``; SGLang's workers take ranks 1.. ."""
    return {"master_address": group.master_address, "master_port": group.master_port, "rank_offset": 1,
            "world_size": group.world_size, "group_name": group.group_name, "backend": group.backend}


def destroy_group_request(group: WeightGroup) -> dict[str, Any]:
    """Keyword arguments of ``DestroyWeightsUpdateGroupReqInput``."""
    return {"group_name": group.group_name}


def update_from_distributed_request(bucket: BucketMeta, group: WeightGroup, version: int) -> dict[str, Any]:
    """Keyword arguments of ``UpdateWeightsFromDistributedReqInput`` for one flattened bucket. The
    cache is flushed once after the last bucket, not per bucket."""
    return {"names": list(bucket.names), "dtypes": list(bucket.dtypes), "shapes": [list(s) for s in bucket.shapes],
            "group_name": group.group_name, "flush_cache": False, "weight_version": str(version),
            "load_format": FLATTENED_BUCKET}


def begin_update_request() -> dict[str, Any]:
    """Keyword arguments of ``BeginWeightUpdateReqInput`` (every runner: ``selector`` all)."""
    return {}


def end_update_request() -> dict[str, Any]:
    """Keyword arguments of ``EndWeightUpdateReqInput``."""
    return {}


def pause_request() -> dict[str, Any]:
    """Keyword arguments of ``PauseGenerationReqInput``."""
    return {"mode": PAUSE_MODE}


def continue_request() -> dict[str, Any]:
    """Keyword arguments of ``ContinueGenerationReqInput`` (all defaults)."""
    return {}


def _version(meta: Mapping[str, Any], fallback: int) -> int:
    v = meta.get("weight_version")
    try:
        return int(v)
    except (TypeError, ValueError):  # SGLang's initial version is the string "default"
        return fallback


def parse_chunk(meta: Mapping[str, Any], seen: int, top_logprobs: int, fallback_version: int,
                first: bool) -> tuple[TokenChunk, int]:
    """One streamed ``meta_info`` as a TokenChunk, and the completion count seen so far.

    SGLang's chunks may list all logprobs so far or only the new ones; ``completion_tokens`` says
    how many of the listed ones are new either way. A logprob entry is ``(logprob, token_id, text)``.
    """
    new = int(meta["completion_tokens"]) - seen
    lps = meta.get("output_token_logprobs") or []
    if new > len(lps):
        raise EngineError(f"SGLang reported {new} new tokens but {len(lps)} logprobs")
    tail = lps[len(lps) - new:] if new else []
    tops = None
    if top_logprobs:
        rows = meta.get("output_top_logprobs") or []
        tops = [[(int(t), float(lp)) for lp, t, *_ in row] for row in (rows[len(rows) - new:] if new else [])]
    fin = meta.get("finish_reason")
    reason = matched = None
    if fin:
        reason = FINISH_TYPES.get(fin.get("type"), "stop")
        matched = fin.get("matched")
    version = _version(meta, fallback_version)
    chunk = TokenChunk([int(t) for _, t, *_ in tail], [float(lp) for lp, *_ in tail], [version] * len(tail),
                       tops, reason, matched, int(meta.get("cached_tokens") or 0) if first else 0)
    return chunk, seen + new


def gpu_index(device: str) -> int:
    """The GPU SGLang starts on: N of ``model.device=cuda:N``, else 0 (SGLang's default)."""
    return int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0


def engine_kwargs(cfg: ClawrlConfig, path: str) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` (fields of SGLang's ServerArgs): token ids only, the
    run's seed, and the model's dtype, device and context where set."""
    kwargs: dict[str, Any] = dict(model_path=path, skip_tokenizer_init=True, random_seed=cfg.seed)
    if cfg.model.dtype != "auto":
        kwargs["dtype"] = cfg.model.dtype
    if cfg.engine.max_context:
        kwargs["context_length"] = cfg.engine.max_context
    if cfg.model.device == "cpu":
        kwargs["device"] = "cpu"
    elif cfg.model.device.startswith("cuda:"):
        kwargs["base_gpu_id"] = gpu_index(cfg.model.device)
    return kwargs


def _sgl_request(name: str, kwargs: Mapping[str, Any]):
    """One of SGLang's own request classes, constructed (and so validated) from ``kwargs``."""
    from sglang.srt.managers import io_struct

    return getattr(io_struct, name)(**kwargs)


# Every control operation the adapter sends: SGLang's request class and its HTTP server's route. The
# TokenizerManager method has the operation's name; tests/test_sglang_protocol.py checks all three
# against SGLang's source.
CONTROL_OPS = {
    "pause_generation": ("PauseGenerationReqInput", "/pause_generation"),
    "continue_generation": ("ContinueGenerationReqInput", "/continue_generation"),
    "flush_cache": ("FlushCacheReqInput", "/flush_cache"),
    "begin_weight_update": ("BeginWeightUpdateReqInput", "/begin_weight_update"),
    "end_weight_update": ("EndWeightUpdateReqInput", "/end_weight_update"),
    "init_weights_update_group": ("InitWeightsUpdateGroupReqInput", "/init_weights_update_group"),
    "destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", "/destroy_weights_update_group"),
    "update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput", "/update_weights_from_distributed"),
    "update_weights_from_tensor": ("UpdateWeightsFromTensorReqInput", "/update_weights_from_tensor"),
    "update_weights_from_disk": ("UpdateWeightFromDiskReqInput", "/update_weights_from_disk"),
}
# Operations SGLang answers with nothing to check (pause and continue return once done).
_NO_VERDICT = ("pause_generation", "continue_generation")


class SGLangControl(abc.ABC):
    """Sends one of SGLang's control requests (``CONTROL_OPS``) and raises EngineError, naming the
    operation and SGLang's message, when SGLang reports a failure."""

    @abc.abstractmethod
    async def send(self, op: str, kwargs: Mapping[str, Any]) -> None:
        ...


class TokenizerManagerControl(SGLangControl):
    """SGLang in this process: its TokenizerManager, given SGLang's own request objects."""

    def __init__(self, tm):
        self._tm = tm

    async def send(self, op: str, kwargs: Mapping[str, Any]) -> None:
        if op == "flush_cache":  # the manager builds its FlushCacheReqInput itself
            out = await self._tm.flush_cache(**kwargs)
            ok, message = out.success, getattr(out, "message", "")
        else:
            obj = _sgl_request(CONTROL_OPS[op][0], kwargs)
            out = await getattr(self._tm, op)(obj) if op in _NO_VERDICT else await getattr(self._tm, op)(obj, None)
            if op in _NO_VERDICT:
                return
            ok, message = out[0], out[1]  # update_weights_from_disk adds a third: requests paused
        if not ok:
            raise EngineError(f"SGLang refused {op}: {message}")


class HttpControl(SGLangControl):
    """An SGLang HTTP server (``python -m sglang.launch_server``): each request's fields as its JSON
    body, POSTed to the operation's route; a non-200 answer or ``success: false`` is a failure."""

    def __init__(self, url: str, timeout_s: float, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self._api_key = api_key

    async def send(self, op: str, kwargs: Mapping[str, Any]) -> None:
        route = CONTROL_OPS[op][1]
        if op == "flush_cache":  # a query parameter, not a body
            route += "".join(f"?timeout={float(v)}" for k, v in kwargs.items() if k == "timeout_s" and v)
            body = None
        else:
            body = json.dumps(dict(kwargs), default=_json_bytes).encode()
        status, text = await asyncio.to_thread(self._post, route, body)
        try:
            answer = json.loads(text) if text else {}
        except ValueError:
            answer = {}
        if status != 200 or (isinstance(answer, dict) and answer.get("success") is False):
            message = answer.get("message") if isinstance(answer, dict) else None
            raise EngineError(f"SGLang refused {op} (HTTP {status}): {message or text.strip()[:300]}")

    def _post(self, route: str, body: bytes | None) -> tuple[int, str]:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        req = urllib.request.Request(self.url + route, data=body if body is not None else b"", headers=headers,
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as e:
            raise EngineError(f"SGLang at {self.url} did not answer {route}: {getattr(e, 'reason', e)}") from None


def _json_bytes(value):
    """SGLang's HTTP server takes bytes fields (serialized tensors) as base64 strings."""
    if isinstance(value, (bytes, bytearray)):
        import base64

        return base64.b64encode(value).decode()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class SGLangWeightUpdates:
    """Weight swaps on one SGLang engine, in SGLang 0.5.23's order: pause (``retract``: running
    requests wait in SGLang's queue with their tokens, none fails), ``begin_weight_update``, the
    loads, ``end_weight_update``, flush the prefix cache (its KV came from the old weights),
    continue. ``version`` is the version SGLang serves now.

    A distributed update loads bucket by bucket into the live model, so a stream that breaks after
    a bucket has landed leaves a mix of two versions: then generation stays paused
    (``paused_reason`` says why) until a later update succeeds; requests wait, none is served by
    mixed weights. A failure before any bucket landed resumes the old weights.
    """

    def __init__(self, control: SGLangControl, group_ranks: int = 1):
        self.control = control
        self.group_ranks = int(group_ranks)  # SGLang's ranks in a weights-update group (its tp size)
        self.version = 0
        self.paused = False
        self.paused_reason: str | None = None
        self._groups: set[str] = set()
        self._lock = asyncio.Lock()

    async def pause(self) -> None:
        await self.control.send("pause_generation", pause_request())
        self.paused = True

    async def resume(self) -> None:
        await self.control.send("continue_generation", continue_request())
        self.paused, self.paused_reason = False, None

    async def flush_cache(self) -> None:
        await self.control.send("flush_cache", {})

    async def from_tensor(self, payload: bytes, version: int) -> None:
        await self._swap([("update_weights_from_tensor", update_from_tensor_request(payload, version))], version)

    async def from_disk(self, path: str, version: int) -> None:
        """A checkpoint SGLang reads itself; no session (SGLang loads from disk without one, and
        rolls back to the weights it had when a load fails). A whole checkpoint also ends a pause
        left by a partly loaded update."""
        async with self._lock:
            was_paused = self.paused and self.paused_reason is None
            if not self.paused:
                await self.pause()
            try:
                await self.control.send("update_weights_from_disk", update_from_disk_request(path, version))
            except BaseException:
                if not was_paused and self.paused_reason is None:
                    await self.resume()
                raise
            self.version = int(version)
            self.paused_reason = None
            if not was_paused:
                await self.resume()

    async def init_group(self, group: WeightGroup) -> None:
        """Make SGLang's workers join ``group`` (blocks until the trainer has joined too); once per
        group name."""
        if group.group_name in self._groups:
            return
        if group.world_size != self.group_ranks + 1:
            raise EngineError(f"weights-update group '{group.group_name}' has world size {group.world_size}; "
                              f"SGLang has {self.group_ranks} rank(s) beside the trainer's")
        await self.control.send("init_weights_update_group", init_group_request(group))
        self._groups.add(group.group_name)

    async def forget_group(self, group: WeightGroup) -> None:
        """After a failed stream: ask SGLang to drop the group (best effort: it may be broken)."""
        if group.group_name in self._groups:
            self._groups.discard(group.group_name)
            try:
                await self.control.send("destroy_weights_update_group", destroy_group_request(group))
            except EngineError as e:
                log.warning("SGLang kept weights-update group %s: %s", group.group_name, e)

    async def from_distributed(self, group: WeightGroup, buckets: AsyncIterator[BucketMeta], version: int) -> int:
        """Load ``version`` bucket by bucket while the trainer broadcasts each one over ``group``
        (already joined: ``init_group``); returns the number of buckets. ``buckets`` ends after the
        last one, or raises why the stream failed."""
        loaded = 0

        async def load():
            nonlocal loaded
            async for bucket in buckets:
                await self.control.send("update_weights_from_distributed",
                                        update_from_distributed_request(bucket, group, version))
                loaded += 1
            return loaded

        await self._swap(load, version, loaded_any=lambda: loaded > 0)
        return loaded

    async def _swap(self, loads, version: int, loaded_any=None) -> None:
        """Pause, begin, ``loads`` (a list of (op, kwargs), or a coroutine function with
        ``loaded_any`` telling whether any of its loads reached the model), end, flush, continue;
        see the class docstring for failures."""
        async with self._lock:
            was_paused = self.paused and self.paused_reason is None
            if not self.paused:
                await self.pause()
            begun = sent = False
            if loaded_any is None:
                loaded_any = lambda: sent  # noqa: E731 (a load sent and failed may have applied in part)
            try:
                await self.control.send("begin_weight_update", begin_update_request())
                begun = True
                if callable(loads):
                    await loads()
                else:
                    for op, kwargs in loads:
                        sent = True
                        await self.control.send(op, kwargs)
                begun = False
                await self.control.send("end_weight_update", end_update_request())
                await self.flush_cache()
            except BaseException as e:  # a cancelled load (its sender failed) too
                if begun:
                    try:
                        await self.control.send("end_weight_update", end_update_request())
                    except EngineError as end_error:
                        log.warning("SGLang did not close the weight-update session: %s", end_error)
                if loaded_any() or self.paused_reason is not None:
                    self.paused_reason = (f"weight version {version} failed after part of it was loaded "
                                          f"({_one_line(e)}); generation stays paused until an update succeeds")
                    log.error("SGLang %s", self.paused_reason)
                elif not was_paused:
                    await self.resume()
                raise
            self.version = int(version)
            self.paused_reason = None
            if not was_paused:
                await self.resume()


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] or type(e).__name__


class SGLangEngine(Engine):
    def __init__(self, cfg: ClawrlConfig):
        sgl = _import_sglang()
        path = require_path(cfg.model.path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            hf_cfg = AutoConfig.from_pretrained(path)
        except Exception as e:
            raise ModelLoadError(f"cannot load {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        self._sgl = sgl.Engine(**engine_kwargs(cfg, path))
        self.device = "cpu" if cfg.model.device == "cpu" else f"cuda:{gpu_index(cfg.model.device)}"
        self.model = None  # the weights live in SGLang's worker process
        self.max_context = cfg.engine.max_context or int(hf_cfg.max_position_embeddings)
        self.vocab_size = int(hf_cfg.vocab_size)
        self.name = cfg.model.name or path.rstrip("/").split("/")[-1]
        self.path = path
        self.architecture = (getattr(hf_cfg, "architectures", None) or [hf_cfg.model_type])[0]
        self.eos_ids = sorted(end_of_turn_ids(self.tokenizer, generation_config(path), hf_cfg))
        self._live: set[str] = set()
        # SGLang is started with its default tensor-parallel size 1: one rank joins a weights-update group
        self.weight_updates = SGLangWeightUpdates(TokenizerManagerControl(self._sgl.tokenizer_manager), group_ranks=1)

    @property
    def _tm(self):
        return self._sgl.tokenizer_manager

    @property
    def weight_version(self) -> int:
        return self.weight_updates.version

    async def start(self) -> None:
        """SGLang starts its workers in the constructor."""

    async def shutdown(self) -> None:
        self._sgl.shutdown()

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> AsyncIterator[TokenChunk]:
        prompt = [int(i) for i in prompt_ids]
        if not prompt:
            raise EngineError("prompt_ids is empty")
        if len(prompt) + params.max_new_tokens > self.max_context:
            raise ContextLengthExceeded(len(prompt), params.max_new_tokens, self.max_context)
        if not params.ignore_eos:  # SGLang stops at the config's eos only; the other end-of-turn ids are ours
            params = replace(params, stop_token_ids=tuple(sorted({*params.stop_token_ids, *self.eos_ids})))
        return self._stream(prompt, params, request_id or uuid.uuid4().hex)

    async def _stream(self, prompt: list[int], params: SamplingParams, rid: str) -> AsyncIterator[TokenChunk]:
        gen = self._tm.generate_request(_sgl_request("GenerateReqInput", generate_request(prompt, params, rid)), None)
        self._live.add(rid)
        seen, finished = 0, False
        try:
            async for out in gen:
                chunk, seen_now = parse_chunk(out["meta_info"], seen, params.top_logprobs, self.weight_version,
                                              first=seen == 0)
                seen = seen_now
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            self._live.discard(rid)
            if not finished:
                self._tm.abort_request(rid=rid)

    async def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int], top_k: int = 0,
                    temperature: float = 1.0) -> ScoreResult:
        prompt, response = [int(i) for i in prompt_ids], [int(i) for i in response_ids]
        if not prompt:
            raise EngineError("prompt_ids is empty")
        if len(prompt) + len(response) > self.max_context:
            raise ContextLengthExceeded(len(prompt), len(response), self.max_context)
        if not response:
            return ScoreResult([], self.weight_version, [] if top_k else None, [] if top_k else None)
        obj = _sgl_request("GenerateReqInput", score_request(prompt, response, top_k, temperature))
        out = await self._tm.generate_request(obj, None).__anext__()
        meta = out["meta_info"]
        lps = [float(lp) for lp, *_ in meta["input_token_logprobs"]][-len(response):]
        ids = lps_top = None
        if top_k:
            rows = meta["input_top_logprobs"][-len(response):]
            ids = [[int(t) for _, t, *_ in row] for row in rows]
            lps_top = [[float(lp) for lp, *_ in row] for row in rows]
        return ScoreResult(lps, _version(meta, self.weight_version), ids, lps_top)

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._live:
            return False
        self._tm.abort_request(rid=request_id)
        return True

    async def pause(self) -> None:
        """SGLang's ``retract`` pause: running requests go back to its queue with their tokens."""
        await self.weight_updates.pause()

    async def resume(self) -> None:
        await self.weight_updates.resume()

    async def flush_cache(self) -> None:
        await self.weight_updates.flush_cache()

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        from sglang.srt.utils import MultiprocessingSerializer

        await self.weight_updates.from_tensor(MultiprocessingSerializer.serialize(list(state.items())), version)

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load a checkpoint SGLang reads itself (HF layout at ``path``), as ``version``."""
        await self.weight_updates.from_disk(path, version)

    async def health(self) -> dict:
        out = {"ok": True, "backend": "sglang", "running": len(self._live), "waiting": 0,
               "paused": self.weight_updates.paused, "weight_version": self.weight_version}
        if self.weight_updates.paused_reason:
            out["paused_reason"] = self.weight_updates.paused_reason
        return out

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.name, self.path, self.architecture, self.vocab_size, self.max_context,
                         self.eos_ids, self.weight_version, self.device, "auto")
