"""The Engine interface: what the gateway, judges and trainers may ask of an inference engine.

Token-in, token-out. Prompts go in as token ids; out come the exact sampled ids, the logprob of
each under the distribution it was sampled from, and the weight version that produced it. Nothing
downstream ever re-tokenises text to train on, so these records are the training data.

The interface is complete from the start (generate, stream, score, abort, pause/resume,
flush_cache, update_weights, health, model_info) because every later stage builds on it: the
gateway streams, OPD scores, the trainer swaps weights. Implementations: ``TorchEngine`` (built in,
CPU or one GPU) and ``SGLangEngine`` (optional import).
"""
from __future__ import annotations

import abc
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Mapping, Sequence

import torch


class EngineError(RuntimeError):
    """A request the engine cannot serve (bad ids, too long, engine stopped). Message is one line."""


def check_token_ids(ids: Sequence[int], what: str, vocab_size: int) -> list[int]:
    """``ids`` as a list of ints inside the vocabulary, or ``EngineError`` naming ``what``."""
    try:
        out = [int(i) for i in ids]
    except (TypeError, ValueError):
        raise EngineError(f"{what} must be a list of integers") from None
    bad = next((i for i in out if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise EngineError(f"{what} contains {bad}, outside the vocabulary [0, {vocab_size})")
    return out


def check_generate_request(prompt_ids: Sequence[int], params: "SamplingParams", vocab_size: int,
                           max_context: int) -> list[int]:
    """The prompt of a generate/stream request, checked before any work (every engine, local or
    remote, refuses the same requests with the same messages)."""
    prompt = check_token_ids(prompt_ids, "prompt_ids", vocab_size)
    if not prompt:
        raise EngineError("prompt_ids is empty")
    if len(prompt) + params.max_new_tokens > max_context:
        raise ContextLengthExceeded(len(prompt), params.max_new_tokens, max_context)
    return prompt


def check_score_request(prompt_ids: Sequence[int], response_ids: Sequence[int], top_k: int, temperature: float,
                        vocab_size: int, max_context: int) -> tuple[list[int], list[int]]:
    """The prompt and response of a ``score`` request, checked before any work."""
    prompt = check_token_ids(prompt_ids, "prompt_ids", vocab_size)
    response = check_token_ids(response_ids, "response_ids", vocab_size)
    if not prompt:
        raise EngineError("prompt_ids is empty")
    if temperature <= 0:
        raise EngineError("temperature must be > 0 for scoring")
    if top_k < 0 or top_k > vocab_size:
        raise EngineError(f"top_k must be between 0 and {vocab_size}")
    if len(prompt) + len(response) > max_context:
        raise ContextLengthExceeded(len(prompt), len(response), max_context)
    return prompt, response


class AbortingStream:
    """What an engine's ``stream()`` returns: an async iterator of ``TokenChunk``s.

    Ending it early in any way -- ``aclose()``, leaving ``async for``, or dropping it without ever
    iterating (a request refused halfway through opening several) -- aborts the request, so an
    abandoned request never keeps decoding for nobody. An engine supplies ``_next_chunk`` and
    ``_release(abort)``. A chunk that raises means the engine already dropped the request; a
    cancelled reader (a client that went away) leaves it open, so closing it still aborts.
    """

    _finished = False
    _closed = False

    def __aiter__(self) -> "AbortingStream":
        return self

    async def __anext__(self) -> "TokenChunk":
        if self._finished or self._closed:
            raise StopAsyncIteration
        try:
            chunk = await self._next_chunk()
        except Exception:
            self._finished = True
            self._close()
            raise
        if chunk.finish_reason is not None:
            self._finished = True
            self._close()
        return chunk

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release(abort=not self._finished)

    def __del__(self):
        self._close()

    async def _next_chunk(self) -> "TokenChunk":
        raise NotImplementedError

    def _release(self, abort: bool) -> None:
        raise NotImplementedError


class ContextLengthExceeded(EngineError):
    """Prompt plus requested tokens exceed the model's context window."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, max_context: int):
        self.prompt_tokens, self.max_new_tokens, self.max_context = prompt_tokens, max_new_tokens, max_context
        asked = f" plus {max_new_tokens} requested" if prompt_tokens < max_context else ""
        super().__init__(
            f"prompt has {prompt_tokens} tokens{asked}; the model's context is {max_context} tokens"
        )


CHAT_PRIORITY, ROLLOUT_PRIORITY = 0, 1


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response.

    ``temperature == 0`` means greedy. Logprobs are always those of the distribution sampled from:
    ``log_softmax(logits / temperature)`` (temperature 1 when greedy), before top-p/top-k
    truncation, which is what a trainer recomputes from ``logits / temperature``.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k truncation
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded response text
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids beside the model's eos ids
    seed: int | None = None  # a per-request generator: same seed, same prompt, same tokens
    top_logprobs: int = 0  # alternatives to return per generated token
    ignore_eos: bool = False
    # lower goes first when the engine chooses what joins its batch: live chat (CHAT_PRIORITY) before
    # environment rollouts and evaluations (ROLLOUT_PRIORITY), so training never slows a user's reply
    priority: int = 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution the returned logprobs come from (1 when greedy)."""
        return self.temperature if self.temperature > 0 else 1.0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.top_logprobs < 0 or self.top_logprobs > 20:
            raise ValueError("top_logprobs must be between 0 and 20")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:  # engines keep it in an int64 tensor
            raise ValueError("seed must fit in a signed 64-bit integer")


@dataclass
class TokenChunk:
    """Tokens produced since the previous chunk of a stream.

    The last chunk of every stream has ``finish_reason`` set ("stop", "length" or "abort") and may
    carry no tokens. ``matched_stop`` is the stop string or stop id that ended it, if any.
    """

    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    cached_prompt_tokens: int = 0  # set on the first chunk: prompt tokens served from the prefix cache


@dataclass
class GenerateResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str
    matched_stop: str | int | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cached_prompt_tokens: int = 0


@dataclass
class ScoreResult:
    """Logprobs of given response ids under a prompt: one prefill, no sampling."""

    logprobs: list[float]
    weight_version: int
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None


@dataclass
class ModelInfo:
    name: str
    path: str
    architecture: str
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]
    weight_version: int
    device: str
    dtype: str
    extra: dict = field(default_factory=dict)


class Engine(abc.ABC):
    """Async inference engine. All methods are safe to call from one asyncio event loop."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Start background workers. Idempotent."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Abort in-flight requests and stop workers."""

    @abc.abstractmethod
    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[TokenChunk]:
        """Yield chunks as tokens are sampled. Closing the iterator early aborts the request."""

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        """Run one request to completion."""
        rid = request_id or uuid.uuid4().hex
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        tops: list[list[tuple[int, float]]] | None = [] if params.top_logprobs else None
        finish, matched, cached = "abort", None, 0
        async for chunk in self.stream(prompt_ids, params, request_id=rid):
            ids += chunk.token_ids
            lps += chunk.logprobs
            vers += chunk.weight_versions
            if tops is not None and chunk.top_logprobs:
                tops += chunk.top_logprobs
            cached = max(cached, chunk.cached_prompt_tokens)
            if chunk.finish_reason is not None:
                finish, matched = chunk.finish_reason, chunk.matched_stop
        return GenerateResult(rid, list(prompt_ids), ids, lps, vers, finish, matched, tops, cached)

    @abc.abstractmethod
    async def score(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        top_k: int = 0,
        temperature: float = 1.0,
    ) -> ScoreResult:
        """Per-token logprobs of ``response_ids`` after ``prompt_ids`` (prefill only)."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Stop a request; its stream ends with finish_reason "abort". False if unknown."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop scheduling decode steps after the current one; requests wait, none fail."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Undo ``pause``."""

    @abc.abstractmethod
    async def flush_cache(self) -> None:
        """Drop every prefix-cache entry."""

    @abc.abstractmethod
    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Load ``state`` (HF parameter names, full or partial) and bump the weight version.

        Applied atomically between decode steps: every token is produced wholly by one version,
        and the version is recorded per token. Returns once the new weights serve. The prefix
        cache is flushed, since its KV was computed under the old weights.
        """

    @abc.abstractmethod
    async def health(self) -> dict:
        """A small JSON-able dict: ok, running and waiting requests, weight version."""

    @abc.abstractmethod
    def model_info(self) -> ModelInfo:
        ...
