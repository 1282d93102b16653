"""The SGLang backend (optional dependency): SGLang's offline runtime behind clawrl's Engine.

SGLang is imported only when this backend is chosen, so clawrl installs and runs without it; if
it is missing, choosing it is a one-line EngineError. The adapter speaks token ids only
(``skip_tokenizer_init``), like the torch engine: prompts go in as ids, sampled ids and their
logprobs come back from SGLang's ``meta_info``. Written against ``sglang.Engine`` (0.4+); SGLang
needs a GPU, so CI exercises only the missing-dependency path.

Known limits: SGLang applies weights in its own process, so the version recorded per token is the
version current when the chunk arrives here (a chunk straddling a swap is labelled with the new
one); ``health()`` cannot tell SGLang's queued requests from its running ones.
"""
from __future__ import annotations

import uuid
from typing import AsyncIterator, Mapping, Sequence

import torch
from transformers import AutoConfig, AutoTokenizer

from clawrl.config import ClawrlConfig
from clawrl.engines.base import (
    ContextLengthExceeded, Engine, EngineError, ModelInfo, SamplingParams, ScoreResult, TokenChunk,
)
from clawrl.engines.loading import ModelLoadError, require_path

INSTALL_HINT = "SGLang is not installed; pip install sglang (GPU only), or use engine.backend=torch"


def _import_sglang():
    try:
        import sglang
    except ImportError:
        raise EngineError(INSTALL_HINT) from None
    return sglang


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
        sp = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
              "top_k": params.top_k or -1, "stop": list(params.stop) or None,
              "stop_token_ids": list(params.stop_token_ids) or None, "ignore_eos": params.ignore_eos}
        if params.seed is not None:
            sp["sampling_seed"] = params.seed
        gen = await self._sgl.async_generate(
            input_ids=prompt, sampling_params=sp, return_logprob=True, logprob_start_len=len(prompt),
            top_logprobs_num=params.top_logprobs or None, stream=True, rid=rid)
        self._live.add(rid)
        seen, finished = 0, False
        try:
            async for out in gen:
                meta = out["meta_info"]
                # Chunks may be cumulative or incremental depending on SGLang's settings; the
                # completion count says how many of the listed tokens are new either way.
                new = int(meta["completion_tokens"]) - seen
                seen += new
                lps = meta.get("output_token_logprobs") or []
                tail = lps[len(lps) - new:] if new else []
                tops = None
                if params.top_logprobs:
                    rows = (meta.get("output_top_logprobs") or [])
                    tops = [[(int(t), float(lp)) for lp, t, *_ in row] for row in rows[len(rows) - new:]]
                fin = meta.get("finish_reason")
                reason = matched = None
                if fin:
                    reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(fin.get("type"), "stop")
                    matched = fin.get("matched")
                    finished = True
                yield TokenChunk([int(t) for _, t, *_ in tail], [float(lp) for lp, *_ in tail],
                                 [self.weight_version] * len(tail), tops, reason, matched,
                                 int(meta.get("cached_tokens", 0)) if seen == new else 0)
        finally:
            self._live.discard(rid)
            if not finished:
                self._tm.abort_request(rid)

    async def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int], top_k: int = 0,
                    temperature: float = 1.0) -> ScoreResult:
        prompt, response = [int(i) for i in prompt_ids], [int(i) for i in response_ids]
        if not prompt:
            raise EngineError("prompt_ids is empty")
        if len(prompt) + len(response) > self.max_context:
            raise ContextLengthExceeded(len(prompt), len(response), self.max_context)
        if not response:
            return ScoreResult([], self.weight_version, [] if top_k else None, [] if top_k else None)
        out = await self._sgl.async_generate(
            input_ids=prompt + response, sampling_params={"max_new_tokens": 0, "temperature": temperature},
            return_logprob=True, logprob_start_len=len(prompt), top_logprobs_num=top_k or None)
        meta = out["meta_info"]
        lps = [float(lp) for lp, *_ in meta["input_token_logprobs"]][-len(response):]
        ids = lps_top = None
        if top_k:
            rows = meta["input_top_logprobs"][-len(response):]
            ids = [[int(t) for _, t, *_ in row] for row in rows]
            lps_top = [[float(lp) for lp, *_ in row] for row in rows]
        return ScoreResult(lps, self.weight_version, ids, lps_top)

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._live:
            return False
        self._tm.abort_request(request_id)
        return True

    async def pause(self) -> None:
        await self._tm.pause_generation()
        self._paused = True

    async def resume(self) -> None:
        await self._tm.continue_generation()
        self._paused = False

    async def flush_cache(self) -> None:
        await self._tm.flush_cache()

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        payload = MultiprocessingSerializer.serialize(list(state.items()))
        ok, message = await self._tm.update_weights_from_tensor(
            UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload], flush_cache=True), None)
        if not ok:
            raise EngineError(f"SGLang refused the weights: {message}")
        self.weight_version = int(version)

    async def health(self) -> dict:
        return {"ok": True, "backend": "sglang", "running": len(self._live), "waiting": 0,
                "paused": self._paused, "weight_version": self.weight_version}

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.name, self.path, self.architecture, self.vocab_size, self.max_context,
                         self.eos_ids, self.weight_version, "cuda", "auto")
