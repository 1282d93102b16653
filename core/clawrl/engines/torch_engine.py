"""The built-in engine: continuous batching with per-sequence KV caches, on CPU or one GPU.

One scheduler thread owns the model. The asyncio side only validates requests, puts commands on
a thread-safe queue and reads chunks that the thread hands back through
``loop.call_soon_threadsafe``, so the event loop never runs model code and stays responsive
while the model works.

Each scheduler step runs one ragged forward over every running request: a decoding request
contributes its last sampled token; prefilling requests share a budget of
``prefill_chunk_tokens`` prompt tokens, so a 16k-token prompt is fed over several steps while
everybody else keeps decoding. New requests join between steps, finished ones leave. Weight
updates, aborts, pause and cache flushes are commands applied between steps, which is what makes
a weight swap atomic per token.

On a GPU, a request whose prompt is in and that fits a slot decodes in a ``StaticDecoder``
(static_decode.py): preallocated per-slot state and a CUDA graph per batch/width bucket, with sampling
on the device. Its step N is launched before step N-1's tokens are read back, so the host emits
tokens while the GPU computes; a request that finishes meanwhile just has its extra token
dropped. Longer requests, prefill chunks and scores run on the ragged path in the same step.
``generate()`` hands a request's tokens over once at the end instead of chunk by chunk.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import random
import threading
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Mapping, Sequence

import torch

from clawrl.config import EngineConfig
from clawrl.engines.base import (
    CHAT_PRIORITY, AbortingStream, Engine, EngineError, GenerateResult, ModelInfo, SamplingParams, ScoreResult,
    TokenChunk, check_generate_request, check_score_request,
)
from clawrl.engines.hf_fallback import HFForward
from clawrl.engines.hybrid import PREFIX_CACHE_NOTE, SNAPSHOT_TOKENS, HybridForward, is_hybrid
from clawrl.engines.hybrid import unsupported_reason as hybrid_unsupported_reason
from clawrl.engines.loading import LoadedModel
from clawrl.engines.prefix_cache import PrefixCache
from clawrl.engines.ragged import RaggedForward, Segment, unsupported_reason
from clawrl.engines.sampling import StopStringMatcher, sample_rows, unpack
from clawrl.engines.static_decode import StaticDecoder, default_capacity

log = logging.getLogger(__name__)

# With no request decoding, a step prefills up to this many times engine.prefill_chunk_tokens.
SOLO_PREFILL_FACTOR = 8


@dataclass(eq=False)
class _Request:
    """A generate or score request as the scheduler thread sees it."""

    rid: str
    feed: list[int]  # tokens to prefill: the prompt (generate) or prompt + response[:-1] (score)
    first_logit: int  # position whose next-token logits are first needed (len(prompt) - 1)
    loop: asyncio.AbstractEventLoop
    params: SamplingParams | None = None  # generate only
    target: list[int] | None = None  # score only: the response ids
    score_top_k: int = 0
    score_temperature: float = 1.0
    chunks: asyncio.Queue | None = None  # generate: where TokenChunks (or an exception) go
    future: asyncio.Future | None = None  # score: resolved with a ScoreResult; generate(): a GenerateResult
    out_lps: list[float] | None = None  # generate(): what the result gets besides out_ids
    out_versions: list[int] | None = None
    out_tops: list | None = None
    seed: int = 0  # with len(out_ids), picks this request's sampling noise (see sampling.gumbel_noise)
    stop_matcher: StopStringMatcher | None = None
    kv: object = None
    cached: int = 0  # prompt tokens taken from the prefix cache
    out_ids: list[int] = field(default_factory=list)
    score_lps: list[float] = field(default_factory=list)
    score_top_ids: list[list[int]] = field(default_factory=list)
    score_top_lps: list[list[float]] = field(default_factory=list)
    kv_version: int = -1  # weight version its KV started under; older KV never enters the prefix cache
    done: bool = False

    @property
    def is_score(self) -> bool:
        return self.target is not None

    @property
    def priority(self) -> int:
        return self.params.priority if self.params is not None else CHAT_PRIORITY

    @property
    def prefilling(self) -> bool:
        return self.kv.length < len(self.feed)


class TorchEngine(Engine):
    """See the module docstring. ``model`` and ``tokenizer`` are the HF objects being served.

    ``static_decode``: decode in a ``StaticDecoder`` (preallocated per-slot state: K/V, and a hybrid
    model's conv and recurrent states; CUDA graphs on a GPU); None means on CUDA only.
    ``static_capacity``: tokens per decode slot (default: what fits in part of the free device
    memory); requests that would outgrow a slot decode on the ragged path instead.
    ``linear_attention``: the delta-rule kernels of a hybrid model's linear-attention layers
    (``model.linear_attention``: auto | torch | fla, delta_rule.py).
    """

    def __init__(self, loaded: LoadedModel, engine_cfg: EngineConfig, static_decode: bool | None = None,
                 static_capacity: int | None = None, linear_attention: str = "auto"):
        if engine_cfg.threads:
            torch.set_num_threads(engine_cfg.threads)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.engine_cfg = engine_cfg
        self.max_context = engine_cfg.max_context or loaded.max_context
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.eos_ids = frozenset(loaded.eos_token_ids)
        hybrid_model = is_hybrid(self.model)
        reason = hybrid_unsupported_reason(self.model) if hybrid_model else unsupported_reason(self.model)
        if reason is None and hybrid_model:
            self.runner = HybridForward(self.model, linear_attention,
                                        snapshot_tokens=SNAPSHOT_TOKENS if engine_cfg.prefix_cache_tokens else 0)
            if engine_cfg.prefix_cache_tokens:
                log.info("%s", PREFIX_CACHE_NOTE)
        elif reason is None:
            self.runner = RaggedForward(self.model)
        else:
            log.warning("%s: %s; using the generic HF forward (one request per step, no prefix cache)",
                        loaded.architecture, reason)
            self.runner = HFForward(self.model)
        self.prefix_cache = PrefixCache(engine_cfg.prefix_cache_tokens if self.runner.ragged else 0)
        self.decoder: StaticDecoder | None = None
        if static_decode is None:
            static_decode = loaded.device.type == "cuda"
        if static_decode and self.runner.ragged:
            cap = static_capacity or default_capacity(self.runner, engine_cfg.max_batch_size, self.max_context)
            if cap >= 2:
                self.decoder = StaticDecoder(self.runner, engine_cfg.max_batch_size, cap,
                                             attention=engine_cfg.decode_attention)
        self.weight_version = 0
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._live: dict[str, _Request] = {}  # event-loop side: requests whose stream is open
        self._paused = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}
        self._launched = None  # the static decoder's step whose tokens are not emitted yet
        self.steps = 0

    # ---------------------------------------------------------------- asyncio side

    async def start(self) -> None:
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._stopping:
            raise EngineError("the engine is shut down")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="clawrl-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None or self._stopping:
            self._stopping = True
            return
        self._stopping = True
        self._cmds.put(("stop", None))
        await asyncio.to_thread(self._thread.join)

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> AsyncIterator[TokenChunk]:
        """Validate now (so a too-long prompt raises before any work), then stream chunks."""
        return _TokenStream(self, self._add_generate(prompt_ids, params, request_id, streamed=True))

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> GenerateResult:
        """Like the base class's (the stream, merged), but the scheduler keeps the tokens and hands
        over the whole result once: no per-token chunk, queue and task wake-up on the event loop,
        which at 64 concurrent requests costs the host about as much as a decode step."""
        req = self._add_generate(prompt_ids, params, request_id, streamed=False)
        try:
            return await req.future
        except asyncio.CancelledError:
            self._cmds.put(("abort", req.rid))  # nobody is waiting for it any more
            raise
        finally:
            self._live.pop(req.rid, None)

    def _add_generate(self, prompt_ids, params: SamplingParams, request_id: str | None, streamed: bool) -> _Request:
        prompt = check_generate_request(prompt_ids, params, self.vocab_size, self.max_context)
        rid = request_id or uuid.uuid4().hex
        if rid in self._live:
            raise EngineError(f"request id '{rid}' is already running")
        self._ensure_thread()
        loop = asyncio.get_running_loop()
        seed = random.getrandbits(32) if params.seed is None else params.seed
        req = _Request(rid, prompt, len(prompt) - 1, loop, params=params, seed=seed,
                       chunks=asyncio.Queue() if streamed else None,
                       future=None if streamed else loop.create_future(),
                       stop_matcher=StopStringMatcher(self.tokenizer, params.stop) if params.stop else None)
        if not streamed:
            req.out_lps, req.out_versions = [], []
            req.out_tops = [] if params.top_logprobs else None
        self._live[rid] = req
        self._cmds.put(("add", req))
        return req

    async def score(self, prompt_ids: Sequence[int], response_ids: Sequence[int], top_k: int = 0,
                    temperature: float = 1.0) -> ScoreResult:
        prompt, response = check_score_request(prompt_ids, response_ids, top_k, temperature, self.vocab_size,
                                               self.max_context)
        if not response:
            return ScoreResult([], self.weight_version, [] if top_k else None, [] if top_k else None)
        self._ensure_thread()
        loop = asyncio.get_running_loop()
        req = _Request(uuid.uuid4().hex, prompt + response[:-1], len(prompt) - 1, loop, target=response,
                       score_top_k=top_k, score_temperature=temperature, future=loop.create_future())
        self._cmds.put(("add", req))
        return await req.future

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._live:
            return False
        self._cmds.put(("abort", request_id))
        return True

    async def pause(self) -> None:
        await self._call("pause")

    async def resume(self) -> None:
        await self._call("resume")

    async def flush_cache(self) -> None:
        await self._call("flush")

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        await self._call("update", (dict(state), int(version)))

    async def health(self) -> dict:
        alive = self._thread is not None and self._thread.is_alive() and not self._stopping
        return {
            "ok": alive or (self._thread is None and not self._stopping),
            "backend": "torch",
            "running": len(self._running),
            "waiting": len(self._waiting),
            "paused": self._paused,
            "weight_version": self.weight_version,
            "prefix_cache_tokens": self.prefix_cache.tokens,
            "static_decode": None if self.decoder is None else {
                "slots": self.decoder.slots, "capacity": self.decoder.capacity, "decoding": len(self.decoder),
                "graphs": self.decoder.graphs, "captures": self.decoder.captures},
        }

    def model_info(self) -> ModelInfo:
        lm = self.loaded
        return ModelInfo(
            name=lm.name, path=lm.path, architecture=lm.architecture, vocab_size=self.vocab_size,
            max_context=self.max_context, eos_token_ids=sorted(self.eos_ids), weight_version=self.weight_version,
            device=str(lm.device), dtype=str(lm.dtype).removeprefix("torch."),
            extra={"ragged": self.runner.ragged, "max_batch_size": self.engine_cfg.max_batch_size,
                   "prefill_chunk_tokens": self.engine_cfg.prefill_chunk_tokens,
                   "static_decode_capacity": self.decoder.capacity if self.decoder is not None else 0},
        )

    async def _call(self, kind: str, payload=None):
        """Run a command on the scheduler thread and wait for it to be applied."""
        self._ensure_thread()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put((kind, (payload, loop, fut)))
        return await fut

    # ---------------------------------------------------------------- scheduler thread

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                busy = bool(self._running or self._waiting) and not self._paused
                try:  # idle: block until a command arrives; busy: just drain what is there
                    cmd = self._cmds.get_nowait() if busy else self._cmds.get()
                    while True:
                        if self._apply(cmd):
                            self._flush_outbox()
                            return
                        cmd = self._cmds.get_nowait()
                except queue.Empty:
                    pass
                if not self._paused:
                    self._admit()
                    if self._running:
                        try:
                            self._step()
                        except Exception as e:  # this step's requests fail; the thread serves on
                            self._fail_step(e)
                        if not self._running:
                            self.runner.release()
                if self._launched is not None and (self._paused or not self._running):
                    self._collect()  # nothing more to launch: deliver what is in flight now
                self._flush_outbox()

    def _apply(self, cmd) -> bool:
        """Apply one command; True means stop the thread."""
        kind, arg = cmd
        if kind == "add":
            self._waiting.append(arg)
        elif kind == "abort":
            for req in [r for r in (*self._running, *self._waiting) if r.rid == arg]:
                self._finish(req, "abort")
        elif kind == "stop":
            for req in [*self._running, *self._waiting]:
                if req.is_score:
                    self._fail(req, EngineError("the engine shut down"))
                else:
                    self._finish(req, "abort")
            return True
        else:
            payload, loop, fut = arg
            try:
                result = self._control(kind, payload)
            except Exception as e:  # reported to the caller, never kills the thread
                self._post(loop, _set_exception, fut, e)
            else:
                self._post(loop, _set_result, fut, result)
        return False

    def _control(self, kind: str, payload):
        if kind == "pause":
            self._paused = True
        elif kind == "resume":
            self._paused = False
        elif kind == "flush":
            self.prefix_cache.flush()
        elif kind == "update":
            self._update_weights(*payload)
        else:
            raise EngineError(f"unknown engine command {kind}")

    def _update_weights(self, state: dict, version: int) -> None:
        targets = self.model.state_dict(keep_vars=True)
        for name, value in state.items():
            if name not in targets:
                raise EngineError(f"update_weights: unknown parameter '{name}'")
            if tuple(value.shape) != tuple(targets[name].shape):
                raise EngineError(f"update_weights: '{name}' has shape {tuple(value.shape)}, "
                                  f"expected {tuple(targets[name].shape)}")
        with torch.no_grad():
            for name, value in state.items():
                targets[name].copy_(value.to(device=targets[name].device, dtype=targets[name].dtype))
        if self.decoder is not None:
            self.decoder.check_weights()
        self.weight_version = version
        self.prefix_cache.flush()
        for req in self._running:
            if req.is_score and req.kv is not None and req.kv.length:
                req.kv, req.cached = None, 0  # a score is one version throughout: start it again
                req.score_lps.clear(), req.score_top_ids.clear(), req.score_top_lps.clear()
                self._prepare(req)
        log.info("weights updated to version %d (%d tensors)", version, len(state))

    def _fail_step(self, err: Exception) -> None:
        """A step raised: fail every running request and those of the in-flight decode step."""
        launched, self._launched = self._launched, None
        self._fail_requests([*self._running, *(launched.members if launched is not None else ())], err)

    def _fail_requests(self, reqs: list[_Request], err: Exception) -> None:
        """Fail ``reqs`` (the requests of a failed step) with one log line naming them, releasing
        their KV and decoder slots, never caching that KV; the other requests go on."""
        reqs = [r for i, r in enumerate(reqs) if not r.done and r not in reqs[:i]]
        log.warning("engine step failed (%s: %s): failing requests %s", type(err).__name__, str(err)[:200],
                    ", ".join(r.rid for r in reqs))
        log.debug("engine step failure", exc_info=err)
        failure = EngineError(f"engine step failed: {type(err).__name__}: {str(err)[:200]}")
        for req in reqs:
            req.kv_version = -1  # its KV is suspect
            self._fail(req, failure)

    def _admit(self) -> None:
        """Waiting requests join the batch, live chat before rollouts (``SamplingParams.priority``),
        first come first served within a priority."""
        while self._waiting and len(self._running) < self.engine_cfg.max_batch_size:
            req = min(self._waiting, key=lambda r: r.priority)
            self._waiting.remove(req)
            try:
                self._prepare(req)
            except Exception as e:  # e.g. out of memory for its KV: this request fails, not the engine
                log.warning("cannot admit request %s: %s: %s", req.rid, type(e).__name__, str(e)[:200])
                log.debug("admission failure", exc_info=e)
                self._fail(req, EngineError(f"cannot allocate the request: {type(e).__name__}: {str(e)[:200]}"))
                continue
            self._running.append(req)

    def _prepare(self, req: _Request) -> None:
        """Give ``req`` a KV cache, starting from the longest cached prefix of its tokens."""
        total = len(req.feed) + (req.params.max_new_tokens if req.params else 0)
        req.kv = self.runner.new_kv(max(64, len(req.feed)), max(total, 1))
        entry, n = self.prefix_cache.lookup(req.feed, req.first_logit)
        if entry is not None and n:
            req.kv.copy_prefix_from(entry, n)
            req.cached = req.kv.length  # a hybrid model's state may resume from less than n (hybrid.py)
        req.kv_version = self.weight_version

    def _step(self) -> None:
        self._admit_decoders()
        segments, owners = self._plan()
        version = self.weight_version
        launched = None
        if self.decoder is not None and len(self.decoder):
            # first, so the device has this decode step queued while the host does the rest
            try:
                launched = self.decoder.launch()
                launched.version = version
            except Exception as e:
                self._fail_requests(list(self.decoder.members), e)
        if segments:
            self._eager_step(segments, owners, version)
        self._collect()  # the previous decode step's tokens, read while this one runs
        self._launched = launched
        self.steps += 1
        for req in owners:
            if req.is_score and not req.prefilling and not req.done:
                self._finish_score(req)
            elif not req.done and req.kv.length == len(req.feed):
                self._remember(req.feed, req)  # others with this prompt may reuse it now

    def _eager_step(self, segments: list[Segment], owners: list[_Request], version: int) -> None:
        """Prefill chunks, scores and decoders outside the static decoder: one ragged forward."""
        try:
            logits = self.runner.forward(segments)
        except Exception as e:  # keep serving others; these requests get a one-line error
            self._fail_requests(owners, e)
            return
        sample_reqs, rows, row = [], [], 0
        for seg, req in zip(segments, owners):
            n = len(seg.logit_rows)
            if req.is_score:
                self._score_rows(req, seg, logits[row: row + n])
            elif n:
                sample_reqs.append(req)
                rows.append(row)
            row += n
        if sample_reqs:
            picked = logits[torch.tensor(rows, device=logits.device)]
            try:
                draws = self._sample(picked, sample_reqs)
            except Exception:  # one request's sampling may be at fault: find it, the others go on
                draws = []
                for k, req in enumerate(sample_reqs):
                    try:
                        draws.extend(self._sample(picked[k: k + 1], [req]))
                    except Exception as e:
                        self._fail_requests([req], e)
                        draws.append(None)
            for req, d in zip(sample_reqs, draws):
                if d is not None:
                    self._emit_token(req, d, version)

    @staticmethod
    def _sample(logits: torch.Tensor, reqs: list[_Request]) -> list:
        return sample_rows(logits, [r.params for r in reqs], [r.seed for r in reqs], [len(r.out_ids) for r in reqs])

    def _collect(self) -> None:
        """Emit the tokens of the last launched decode step (waiting for them if needed)."""
        launched, self._launched = self._launched, None
        if launched is None:
            return
        draws = unpack(launched.read(), launched.top_ns)
        for req, d in zip(launched.members, draws):
            if not req.done:  # one that finished (or was aborted) since just has its extra token dropped
                self._emit_token(req, d, launched.version)

    def _admit_decoders(self) -> None:
        """Move generate requests whose prompt is in (and that fit a slot) into the static decoder."""
        dec = self.decoder
        if dec is None or len(dec) >= dec.slots:
            return
        for req in self._running:
            if (req.is_score or req.prefilling or not req.out_ids or dec.holds(req)
                    or not dec.fits(len(req.feed) + req.params.max_new_tokens)):
                continue
            self.runner.sync()  # it may have decoded on the ragged path: its own buffers first
            dec.admit(req, req.kv, req.out_ids[-1], req.params, req.seed, len(req.out_ids))
            if len(dec) >= dec.slots:
                return

    def _plan(self) -> tuple[list[Segment], list[_Request]]:
        segments, owners = [], []
        dec = self.decoder
        candidates = self._running if self.runner.ragged else [self._running[self.steps % len(self._running)]]
        for req in candidates:
            if not req.prefilling and not (dec is not None and dec.holds(req)):
                segments.append(Segment(req.kv, [req.out_ids[-1]], [0]))
                owners.append(req)
        budget = self.engine_cfg.prefill_chunk_tokens
        if not segments and not (dec is not None and len(dec)):
            # nobody is decoding, so there is no one to keep flowing: a long prompt goes in fewer,
            # larger chunks (on a GPU a 2048-token chunk is host-bound; one 15k-token OpenClaw prompt
            # takes 1.4x HF's single forward in 2048-token chunks and 1.0x in one)
            budget *= SOLO_PREFILL_FACTOR
        # prefill budget goes to live chat first: a rollout's long prompt never delays a user's first token
        for req in sorted(candidates, key=lambda r: r.priority):
            if budget <= 0 or (segments and not self.runner.ragged):
                break
            if not req.prefilling:
                continue
            start = req.kv.length
            n = min(budget, len(req.feed) - start)
            budget -= n
            ids = req.feed[start: start + n]
            if req.is_score:
                rows = [i for i in range(n) if start + i >= req.first_logit]
            else:
                rows = [n - 1] if start + n == len(req.feed) else []
            segments.append(Segment(req.kv, ids, rows))
            owners.append(req)
        return segments, owners

    def _score_rows(self, req: _Request, seg: Segment, logits: torch.Tensor) -> None:
        if not len(seg.logit_rows):
            return
        start = req.kv.length - len(seg.ids)
        positions = [start + r for r in seg.logit_rows]
        targets = torch.tensor([req.target[p - req.first_logit] for p in positions], device=logits.device)
        lp = torch.log_softmax(logits / req.score_temperature, dim=-1)
        req.score_lps += lp.gather(1, targets[:, None])[:, 0].tolist()
        if req.score_top_k:
            v, i = lp.topk(req.score_top_k, dim=-1)
            req.score_top_ids += i.tolist()
            req.score_top_lps += v.tolist()

    def _finish_score(self, req: _Request) -> None:
        req.done = True
        self._running.remove(req)
        self._remember(req.feed, req)
        k = req.score_top_k
        res = ScoreResult(req.score_lps, req.kv_version, req.score_top_ids if k else None,
                          req.score_top_lps if k else None)
        self._post(req.loop, _set_result, req.future, res)

    def _emit_token(self, req: _Request, d, version: int) -> None:
        p = req.params
        req.out_ids.append(d.token)
        finish, matched = None, None
        if d.token in p.stop_token_ids or (d.token in self.eos_ids and not p.ignore_eos):
            finish, matched = "stop", d.token
        elif req.stop_matcher is not None and (hit := req.stop_matcher.feed(d.token)) is not None:
            finish, matched = "stop", hit
        elif len(req.out_ids) >= p.max_new_tokens:
            finish = "length"
        if finish is not None:
            self._retire(req)
        if req.chunks is None:  # generate(): kept here, handed over whole at the end
            req.out_lps.append(d.logprob)
            req.out_versions.append(version)
            if req.out_tops is not None:
                req.out_tops.append(d.top)
            if finish is not None:
                self._post(req.loop, _set_result, req.future, self._result(req, finish, matched))
            return
        chunk = TokenChunk([d.token], [d.logprob], [version], [d.top] if d.top is not None else None,
                           finish, matched, req.cached if len(req.out_ids) == 1 else 0)
        self._post(req.loop, _put, req.chunks, chunk)

    @staticmethod
    def _result(req: _Request, finish: str, matched) -> GenerateResult:
        return GenerateResult(req.rid, list(req.feed), list(req.out_ids), req.out_lps, req.out_versions, finish,
                              matched, req.out_tops, req.cached)

    def _finish(self, req: _Request, reason: str) -> None:
        """End a generate request without a new token (abort)."""
        self._retire(req)
        if req.chunks is None:
            self._post(req.loop, _set_result, req.future, self._result(req, reason, None))
            return
        self._post(req.loop, _put, req.chunks, TokenChunk([], [], [], None, reason, None,
                                                         req.cached if not req.out_ids else 0))

    def _fail(self, req: _Request, err: Exception) -> None:
        self._retire(req)
        if req.chunks is None:  # a score, or a generate() call
            self._post(req.loop, _set_exception, req.future, err)
        else:
            self._post(req.loop, _put, req.chunks, err)

    def _post(self, loop: asyncio.AbstractEventLoop, fn, target, value) -> None:
        """Queue ``fn(target, value)`` for ``loop``; sent once per step by ``_flush_outbox``."""
        self._outbox.setdefault(loop, []).append((fn, target, value))

    def _flush_outbox(self) -> None:
        """One wake-up per event loop per step, not one per token: each wake-up is a syscall and a
        GIL hand-over that would otherwise grow with the batch size."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_run_all, items)
            except RuntimeError:  # that loop is closed; nobody is listening
                pass

    def _remember(self, tokens: list[int], req: _Request) -> None:
        if req.kv_version == self.weight_version:
            self.runner.sync()  # the entry's KV must be complete before others copy from it
            view = getattr(self.runner, "cache_view", None)  # a hybrid state changes in place: a frozen copy
            self.prefix_cache.insert(tokens, req.kv if view is None or req.kv.length > self.prefix_cache.budget
                                     else view(req.kv))

    def _retire(self, req: _Request) -> None:
        req.done = True
        if req in self._running:
            self._running.remove(req)
            dec = self.decoder
            if dec is not None and dec.holds(req):
                # its KV lives in the slot: copy it back only if the prefix cache may keep it
                keep = req.kv_version == self.weight_version and dec.length(req) <= self.prefix_cache.budget
                dec.release(req, req.kv if keep else None)
            if req.kv is not None:
                self._remember(req.feed + req.out_ids, req)
        elif req in self._waiting:
            self._waiting.remove(req)


class _TokenStream(AbortingStream):
    """``TorchEngine.stream``'s chunks, merged when a slow reader lets them pile up."""

    def __init__(self, engine: TorchEngine, req: _Request):
        self._engine, self._req = engine, req

    async def _next_chunk(self) -> TokenChunk:
        q = self._req.chunks
        items = [await q.get()]
        while not q.empty():  # a slow reader gets what piled up as one chunk
            items.append(q.get_nowait())
        for item in items:
            if isinstance(item, BaseException):  # the engine already dropped this request
                raise item
        return _merge(items)

    def _release(self, abort: bool) -> None:
        self._engine._live.pop(self._req.rid, None)
        if abort:
            self._engine._cmds.put(("abort", self._req.rid))


def _merge(chunks: list[TokenChunk]) -> TokenChunk:
    if len(chunks) == 1:
        return chunks[0]
    out = TokenChunk([], [], [], None, None, None, chunks[0].cached_prompt_tokens)
    for c in chunks:
        out.token_ids += c.token_ids
        out.logprobs += c.logprobs
        out.weight_versions += c.weight_versions
        if c.top_logprobs is not None:
            out.top_logprobs = (out.top_logprobs or []) + c.top_logprobs
        out.finish_reason, out.matched_stop = c.finish_reason, c.matched_stop
    return out


def _run_all(items) -> None:
    for fn, target, value in items:
        fn(target, value)


def _put(q: asyncio.Queue, item) -> None:
    q.put_nowait(item)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc) -> None:
    if not fut.done():
        fut.set_exception(exc)
