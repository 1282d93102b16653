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

Weight updates: the generation is paused in SGLang's ``retract`` mode (running requests go back to
its queue and keep their tokens; none fails), the tensors are loaded with ``weight_version`` set,
and generation continues. Each chunk's tokens carry the ``weight_version`` SGLang reports in that
chunk's ``meta_info`` (a chunk straddling a swap is labelled with the version current when SGLang
sent it); ``health()`` cannot tell SGLang's queued requests from its running ones.
"""
from __future__ import annotations

import importlib.util
import uuid
from typing import Any, AsyncIterator, Mapping, Sequence

import torch
from transformers import AutoConfig, AutoTokenizer

from clawrl.config import ClawrlConfig
from clawrl.engines.base import (
    ContextLengthExceeded, Engine, EngineError, ModelInfo, SamplingParams, ScoreResult, TokenChunk,
)
from clawrl.engines.loading import ModelLoadError, require_path

INSTALL_HINT = "SGLang is not installed; pip install sglang (GPU only), or use engine.backend=torch"

# Every key this adapter reads from SGLang's responses (a generate result and its meta_info, and a
# finish_reason dict). tests/test_sglang_protocol.py fails when one of them is not a string literal
# of the installed SGLang source, or when this module reads a key that is not listed here.
RESPONSE_KEYS = ("meta_info", "completion_tokens", "output_token_logprobs", "output_top_logprobs",
                 "input_token_logprobs", "input_top_logprobs", "finish_reason", "type", "matched",
                 "cached_tokens", "weight_version")
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


def _sgl_request(name: str, kwargs: Mapping[str, Any]):
    """One of SGLang's own request classes, constructed (and so validated) from ``kwargs``."""
    from sglang.srt.managers import io_struct

    return getattr(io_struct, name)(**kwargs)


class SGLangEngine(Engine):
    def __init__(self, cfg: ClawrlConfig):
        sgl = _import_sglang()
        path = require_path(cfg.model.path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            hf_cfg = AutoConfig.from_pretrained(path)
        except Exception as e:
            raise ModelLoadError(f"cannot load {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        kwargs = dict(model_path=path, skip_tokenizer_init=True, random_seed=cfg.seed)
        if cfg.model.dtype != "auto":
            kwargs["dtype"] = cfg.model.dtype
        if cfg.engine.max_context:
            kwargs["context_length"] = cfg.engine.max_context
        self._sgl = sgl.Engine(**kwargs)
        self.model = None  # the weights live in SGLang's worker process
        self.max_context = cfg.engine.max_context or int(hf_cfg.max_position_embeddings)
        self.vocab_size = int(hf_cfg.vocab_size)
        self.name = cfg.model.name or path.rstrip("/").split("/")[-1]
        self.path = path
        self.architecture = (getattr(hf_cfg, "architectures", None) or [hf_cfg.model_type])[0]
        eos = hf_cfg.eos_token_id
        self.eos_ids = sorted({*(eos if isinstance(eos, list) else [eos] if eos is not None else []),
                               *([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])})
        self.weight_version = 0
        self._live: set[str] = set()
        self._paused = False

    @property
    def _tm(self):
        return self._sgl.tokenizer_manager

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
        await self._tm.pause_generation(_sgl_request("PauseGenerationReqInput", pause_request()))
        self._paused = True

    async def resume(self) -> None:
        await self._tm.continue_generation(_sgl_request("ContinueGenerationReqInput", continue_request()))
        self._paused = False

    async def flush_cache(self) -> None:
        out = await self._tm.flush_cache()
        if not out.success:
            raise EngineError(f"SGLang did not flush its cache: {getattr(out, 'message', '')}")

    async def _swap(self, call, version: int) -> None:
        """Pause, load, continue: requests in flight wait in SGLang's queue and none fails."""
        was_paused = self._paused
        if not was_paused:
            await self.pause()
        try:
            ok, message = await call
        finally:
            if not was_paused:
                await self.resume()
        if not ok:
            raise EngineError(f"SGLang refused the weights: {message}")
        self.weight_version = int(version)

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        from sglang.srt.utils import MultiprocessingSerializer

        payload = MultiprocessingSerializer.serialize(list(state.items()))
        obj = _sgl_request("UpdateWeightsFromTensorReqInput", update_from_tensor_request(payload, version))
        await self._swap(self._tm.update_weights_from_tensor(obj, None), version)

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load a checkpoint SGLang reads itself (HF layout at ``path``), as ``version``."""
        obj = _sgl_request("UpdateWeightFromDiskReqInput", update_from_disk_request(path, version))
        await self._swap(self._tm.update_weights_from_disk(obj, None), version)

    async def health(self) -> dict:
        return {"ok": True, "backend": "sglang", "running": len(self._live), "waiting": 0,
                "paused": self._paused, "weight_version": self.weight_version}

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.name, self.path, self.architecture, self.vocab_size, self.max_context,
                         self.eos_ids, self.weight_version, "cuda", "auto")
