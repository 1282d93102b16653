"""The OpenAI-compatible gateway: ``create_app(cfg, engine, linker)`` -> a FastAPI app.

The path of a chat request, top to bottom in this file:

1. ``chat_completions``: auth and requests per minute (``Gateway.caller``), size-limited body,
   validation (``protocol``), model check, session hints, prompt rendering (``render``), sampling
   params, the caller's tokens per minute (``rate_limits``), admission (429 when the queue is full), ``linker.begin`` (links the request into its session), and the engine
   streams are opened (``Turn.open``: the engine validates ids and length up front).
2. ``Turn.execute``: drives the engine streams, turns token chunks into text and tool-call
   events (``text.ChoiceDecoder``), and ``linker.record``s every choice *before* the caller
   sends the last byte. If the client goes away, the engine requests are aborted and the partial
   turn is stored as aborted (untrainable).
3. ``Turn.stream_sse`` / ``Turn.completion``: the two response shapes (``streaming``).

Every failure leaves as OpenAI's error JSON; nothing reaches the client as a bare 500.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from dataclasses import dataclass, field, replace

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from clawrl.config import ClawrlConfig
from clawrl.engines.base import ContextLengthExceeded, Engine, EngineError, SamplingParams, TokenChunk
from clawrl.engines.chat_template import renders_tools
from clawrl.engines.model_defaults import sampling_defaults
from clawrl.gateway import openapi
from clawrl.gateway.auth import AdminGuard, key_rings
from clawrl.gateway.origin import BrowserPolicy, host_name
from clawrl.gateway.protocol import ApiError, ChatRequest, bad_request, parse_chat_request, parse_json_body
from clawrl.gateway.rate_limits import RateLimiter, Reservation
from clawrl.gateway.render import RenderedPrompt, context_error, render_prompt
from clawrl.gateway.streaming import DONE, ChunkMaker, SSEResponse, error_event, until_disconnect, usage
from clawrl.gateway.text import ChoiceDecoder, logprob_entry
from clawrl.gateway.toolcalls import Content, ToolCall
from clawrl.sessions import InvalidTurnType, SessionHints, SessionInputError, SessionLinker, TurnPlan
from clawrl.backoff import Backoff
from clawrl.storage_faults import storage_fault
from clawrl.store import UnknownTurn

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
RENDER_THREADS = 2
_TURN_ID = re.compile("[0-9]{1,18}")
_JSON_MEDIA_TYPE = re.compile(r'\s*application/json\s*(;\s*charset\s*=\s*"?utf-?8"?\s*)?', re.I)


class Admission:
    """At most ``capacity`` choices generate at once; at most ``max_queue`` requests wait (FIFO).

    The gateway keeps the engine's batch full but never over-full, so a burst queues here where
    it can be refused with 429 + Retry-After instead of piling up inside the engine.
    """

    def __init__(self, capacity: int, max_queue: int):
        self.capacity, self.free, self.max_queue = capacity, capacity, max_queue
        self._waiters: list[tuple[int, asyncio.Future]] = []

    def slots(self, n: int) -> int:
        return min(n, self.capacity)

    async def acquire(self, n: int) -> None:
        n = self.slots(n)
        if not self._waiters and self.free >= n:
            self.free -= n
            return
        if len(self._waiters) >= self.max_queue:
            log.warning("queue full (%d waiting, %d of %d slots busy): answering 429", len(self._waiters),
                        self.capacity - self.free, self.capacity)
            raise ApiError(429, f"server overloaded: {self.max_queue} requests already waiting; retry shortly",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted just as we were cancelled
            else:
                self._waiters.remove((n, fut))
            raise

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def release(self, n: int) -> None:
        self.free += self.slots(n)
        while self._waiters and self._waiters[0][0] <= self.free:
            k, fut = self._waiters.pop(0)
            if not fut.done():
                self.free -= k
                fut.set_result(None)


@dataclass
class Choice:
    """One choice of a response: the engine's exact tokens, and what the client is shown."""

    index: int
    request_id: str
    decoder: ChoiceDecoder
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    engine_finish: str | None = None
    cached_tokens: int = 0
    stop_cut: bool = False  # the gateway saw a stop string first and aborted the engine request

    def absorb(self, chunk: TokenChunk) -> list[Content | ToolCall]:
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.weight_versions += chunk.weight_versions
        self.top_logprobs += chunk.top_logprobs or [None] * len(chunk.token_ids)
        self.cached_tokens = max(self.cached_tokens, chunk.cached_prompt_tokens)
        if chunk.finish_reason is not None:
            self.engine_finish = chunk.finish_reason
        return self.decoder.push(chunk.token_ids)

    @property
    def finish_reason(self) -> str:
        """OpenAI's reason: stop | length | tool_calls (a model-ended turn that called tools)."""
        if self.stop_cut or self.engine_finish == "stop":
            return "tool_calls" if self.decoder.tools.calls else "stop"
        return self.engine_finish or "abort"

    def tool_parse_error(self) -> str | None:
        return "\n".join(self.decoder.tools.errors) or None


class Gateway:
    """What every request needs: config, engine, tokenizer, linker, keys, rate limits, admission."""

    def __init__(self, cfg: ClawrlConfig, engine: Engine, linker: SessionLinker):
        self.cfg, self.engine, self.linker = cfg, engine, linker
        info = engine.model_info()
        self.model_name, self.max_context = info.name, info.max_context
        self.tokenizer = engine.tokenizer
        renders_tools(self.tokenizer)  # at load, so the log says whether clawrl words the tools itself
        self.api_keys, self.admin_keys = key_rings(cfg.server)  # admin_keys: server.admin_key only
        self.admin_guard = AdminGuard(self.admin_keys)
        if not self.admin_keys.keys:
            log.info("server.admin_key is unset: /admin answers loopback clients only")
        self.admission = Admission(cfg.engine.max_batch_size, cfg.server.max_queue)
        # Rendering a multi-megabyte prompt takes seconds of CPU: it runs in worker threads, at most
        # RENDER_THREADS at once, so huge requests neither stall the event loop nor take every thread.
        self.render_limiter = anyio.CapacityLimiter(RENDER_THREADS)
        self.rate_limits = RateLimiter(cfg.server.rate_limit, self.api_keys.keys)
        self.defaults = sampling_defaults(info.path, cfg.server.default_temperature)
        log.info("sampling defaults for requests that send none: %s", self.defaults.describe())
        # a full disk's stretch of 507s: one warning when the store starts refusing, one line when it writes again
        self.store_refusals = Backoff("the turn store", "chat requests get 507 and nothing of them is stored",
                                      first_s=0)
        self.created = int(time.time())
        # Extra /admin/status sections from the layers above (e.g. training); each is a synchronous
        # callable returning a dict, run off the event loop. The gateway knows nothing of them.
        self.status_sections: list = []

    def caller(self, request: Request) -> str | None:
        """The caller's key (None: no keys are configured), after auth and its requests per minute."""
        key = self.api_keys.check(request.headers.get("authorization"))
        self.rate_limits.check_request(key)
        return key

    def fingerprint(self) -> str:
        return f"clawrl-w{self.engine.model_info().weight_version}"

    def sampling(self, req: ChatRequest, prompt_len: int) -> SamplingParams:
        """max_tokens is clamped to the context left after the prompt (finish_reason "length"); a
        sampling field the request leaves out takes the model's default (``self.defaults``)."""
        wanted = req.max_tokens or self.cfg.server.default_max_tokens
        d = self.defaults
        return SamplingParams(
            max_new_tokens=min(wanted, self.max_context - prompt_len),
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p, top_k=d.top_k if req.top_k is None else req.top_k,
            stop=req.stop, seed=req.seed, top_logprobs=req.top_logprobs,
        )


class Turn:
    """One chat request from its linked plan to its recorded turn(s); holds ``n`` admission slots."""

    def __init__(self, gw: Gateway, req: ChatRequest, prompt: RenderedPrompt, plan: TurnPlan,
                 params: SamplingParams, tokens: Reservation):
        self.gw, self.req, self.prompt, self.plan, self.params = gw, req, prompt, plan, params
        self.tokens = tokens
        self.id = "chatcmpl-" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.choices = [
            Choice(i, f"{self.id}-{i}",
                   ChoiceDecoder(gw.tokenizer, req.stop, prompt.tool_names, not req.parallel_tool_calls,
                                 prompt.prefill))
            for i in range(req.n)
        ]
        self.turn_ids: list[int] = []
        self._streams: list = []
        self._released = False

    def open(self) -> None:
        """Open the engine streams; the engine refuses bad prompts here, before any byte is sent."""
        for c in self.choices:
            seed = None if self.params.seed is None else self.params.seed + c.index  # n choices differ
            try:
                self._streams.append(self.gw.engine.stream(self.prompt.ids, replace(self.params, seed=seed),
                                                           request_id=c.request_id))
            except ContextLengthExceeded as e:
                raise context_error(e.prompt_tokens, e.max_context) from None
            except EngineError as e:
                raise ApiError(503, f"the engine refused the request: {e}", type="server_error",
                               code="engine_error") from None

    async def _merged(self):
        """(choice, chunk) pairs from all choices' engine streams, as they arrive."""
        if len(self._streams) == 1:  # the common case needs no fan-in (saves a task hop per chunk)
            async with contextlib.aclosing(self._streams[0]) as stream:  # closing early aborts it
                async for chunk in stream:
                    yield self.choices[0], chunk
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice, stream) -> None:
            try:
                async for chunk in stream:
                    queue.put_nowait((c, chunk, None))
                queue.put_nowait((c, None, None))
            except Exception as e:  # the engine failed this request; re-raised in the reader
                queue.put_nowait((c, None, e))

        tasks = [asyncio.create_task(pump(c, s)) for c, s in zip(self.choices, self._streams)]
        try:
            left = len(tasks)
            while left:
                c, chunk, err = await queue.get()
                if err is not None:
                    raise err
                if chunk is None:
                    left -= 1
                    continue
                yield c, chunk
        finally:
            for t in tasks:
                t.cancel()  # closing an engine stream early aborts its request

    async def _generate(self, on_events) -> None:
        """Run every choice to its end, handing each engine chunk's events to ``on_events``."""
        async with contextlib.aclosing(self._merged()) as merged:  # closed at once when cancelled
            async for c, chunk in merged:
                await on_events(c, c.absorb(chunk), chunk)
                if c.decoder.stopped and c.engine_finish is None and not c.stop_cut:
                    c.stop_cut = True  # the text hit a stop string the engine has not matched (yet)
                    await self.gw.engine.abort(c.request_id)
        for c in self.choices:
            if c.engine_finish == "abort" and not c.stop_cut:  # not ours: e.g. the engine is shutting down
                raise EngineError("the engine aborted the request")
            await on_events(c, c.decoder.finish(), None)

    async def execute(self, on_events) -> None:
        """Generate, then record every choice; on cancellation or failure, abort and record why."""
        try:
            await self._generate(on_events)
        except BaseException as e:
            gone = isinstance(e, (anyio.get_cancelled_exc_class(), OSError, GeneratorExit))
            with anyio.CancelScope(shield=True):
                await self.abort_unfinished()
                await self._record("aborted" if gone else "error")
            log.info("turn %s %s after %d tokens", self.id, "aborted: client went away" if gone else f"failed: {e}",
                     sum(len(c.token_ids) for c in self.choices))
            raise
        finally:
            self.release()
        await self._record("complete")

    def release(self) -> None:
        """Give back the admission slots and the tokens reserved but not generated (once)."""
        if not self._released:
            self._released = True
            self.gw.admission.release(self.req.n)
            self.tokens.settle(len(self.prompt.ids) + sum(len(c.token_ids) for c in self.choices))

    async def abort_unfinished(self) -> None:
        for c in self.choices[: len(self._streams)]:
            if c.engine_finish is None:
                await self.gw.engine.abort(c.request_id)

    async def _record(self, status: str) -> None:
        for c in self.choices:
            self.turn_ids.append(await asyncio.to_thread(
                self.gw.linker.record, self.plan, prompt_ids=self.prompt.ids, response_ids=c.token_ids,
                logprobs=c.logprobs, weight_versions=c.weight_versions, response_text=c.decoder.content,
                tool_calls=[t.to_openai() for t in c.decoder.tools.calls] or None,
                tool_parse_error=c.tool_parse_error(),
                finish_reason=c.finish_reason if status == "complete" else status, status=status,
                temperature=self.params.logprob_temperature,
            ))
        self.gw.store_refusals.succeeded()

    def _logprobs(self, c: Choice, start: int, end: int) -> list[dict]:
        return [logprob_entry(self.gw.tokenizer, c.token_ids[k], c.logprobs[k], c.top_logprobs[k])
                for k in range(start, end)]

    def usage(self) -> dict:
        return usage(len(self.prompt.ids), sum(len(c.token_ids) for c in self.choices),
                     max(c.cached_tokens for c in self.choices))

    # ---- non-streaming

    async def completion(self, receive) -> dict | None:
        """The ``chat.completion`` object, or None if the client disconnected first."""
        gone = await until_disconnect(receive, lambda: self.execute(_ignore_events))
        if gone:
            return None
        choices = []
        for c in self.choices:
            calls = [t.to_openai() for t in c.decoder.tools.calls]
            message = {"role": "assistant", "content": c.decoder.content or (None if calls else "")}
            if calls:
                message["tool_calls"] = calls
            lp = {"content": self._logprobs(c, 0, len(c.token_ids))} if self.req.logprobs else None
            choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.gw.model_name,
                "system_fingerprint": self.gw.fingerprint(), "choices": choices, "usage": self.usage()}

    # ---- streaming

    async def stream_sse(self, emit) -> None:
        chunks = ChunkMaker(self.id, self.created, self.gw.model_name, self.gw.fingerprint(), self.req.include_usage)
        call_counts = [0] * len(self.choices)
        sent_lp = [0] * len(self.choices)

        async def on_events(c: Choice, events, chunk: TokenChunk | None) -> None:
            lp = None
            if self.req.logprobs and len(c.token_ids) > sent_lp[c.index]:
                lp = self._logprobs(c, sent_lp[c.index], len(c.token_ids))
                sent_lp[c.index] = len(c.token_ids)
            out = []
            for ev in events:
                if isinstance(ev, ToolCall):
                    out += chunks.tool_call(c.index, call_counts[c.index], ev)
                    call_counts[c.index] += 1
                elif ev.text:
                    out.append(chunks.content(c.index, ev.text, lp))
                    lp = None
            if lp is not None:  # tokens whose text is held back still report their logprobs now
                out.append(chunks.chunk(c.index, {}, logprobs=lp))
            if out:
                await emit(b"".join(out))

        try:
            await emit(b"".join(chunks.role(c.index) for c in self.choices))
        except BaseException:  # gone before generation started: an empty aborted turn
            with anyio.CancelScope(shield=True):
                await self.abort_unfinished()
                await self._record("aborted")
            self.release()
            raise
        try:
            await self.execute(on_events)
        except Exception as e:  # headers are out: the error goes in-band, as OpenAI does
            await emit(error_event(_as_api_error(e, self.gw.store_refusals).body()) + DONE)
            return
        tail = [chunks.finish(c.index, c.finish_reason) for c in self.choices]
        if self.req.include_usage:
            tail.append(chunks.usage(self.usage()))
        await emit(b"".join(tail) + DONE)


async def _ignore_events(c, events, chunk) -> None:
    return None


def _as_api_error(e: BaseException, store_refusals: Backoff) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ContextLengthExceeded):
        return context_error(e.prompt_tokens, e.max_context)
    if isinstance(e, EngineError):
        return ApiError(503, f"the engine failed: {e}", type="server_error", code="engine_error")
    fault = storage_fault(e)
    if fault is not None:
        store_refusals.failed(e)  # logged once per stretch, with the count when it ends
        return ApiError(507, f"the server cannot store this turn: {fault}; nothing of it was stored, and earlier "
                        "turns are safe. Retry once the server's operator has freed space", type="server_error",
                        code="storage_unavailable")
    ref = uuid.uuid4().hex[:8]
    log.error("internal error %s: %s", ref, e, exc_info=e)
    return ApiError(503, f"internal server error (logged as {ref})", type="server_error", code="internal_error")


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, sent as ``application/json`` (415 else: any web page may send a
    form or ``text/plain`` body here without a preflight, but never that) in at most ``limit`` bytes."""
    content_type = request.headers.get("content-type")
    if content_type is None or not _JSON_MEDIA_TYPE.fullmatch(content_type):
        raise ApiError(415, f"the request body must be sent as Content-Type: application/json (got {content_type!r})",
                       code="unsupported_media_type")
    return parse_json_body(await read_body(request, limit))


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past ``limit`` bytes (by Content-Length, or while it streams in)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes; the limit is {limit} (server.max_body_bytes)",
                           code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds {limit} bytes (server.max_body_bytes)",
                           code="request_too_large")
    return bytes(body)


def _hints(request: Request, body: dict) -> SessionHints:
    try:
        return SessionHints.from_request(request.headers, body)
    except InvalidTurnType as e:
        raise bad_request(str(e), param="X-Turn-Type", code="invalid_turn_type") from None
    except SessionInputError as e:
        raise bad_request(str(e), code="invalid_session") from None


class CatchAll:
    """ASGI middleware: an exception no handler took becomes a logged 503 JSON error, not a 500 page."""

    def __init__(self, app, store_refusals: Backoff):
        self.app, self.store_refusals = app, store_refusals

    async def __call__(self, scope, receive, send):
        started = False

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if scope["type"] != "http" or started:
                log.error("error after the response started: %s", e, exc_info=e)
                return
            await _error_response(_as_api_error(e, self.store_refusals))(scope, receive, send)


class Gate:
    """ASGI middleware: ``check`` runs before every HTTP request reaches a route, and the ApiError
    it raises is the answer. Checking by path rather than in each route means a route added by any
    layer (the learner's pause and resume) cannot forget it, and the check sees the client's
    address, which a route's key check does not."""

    def __init__(self, app):
        self.app = app

    def check(self, scope, headers: Headers) -> None:
        raise NotImplementedError

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            try:
                self.check(scope, Headers(scope=scope))
            except ApiError as e:
                await _error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AdminGate(Gate):
    """Every request for a path under /admin passes ``AdminGuard`` first."""

    def __init__(self, app, guard: AdminGuard):
        super().__init__(app)
        self.guard = guard

    def check(self, scope, headers: Headers) -> None:
        if scope["path"] == "/admin" or scope["path"].startswith("/admin/"):
            client = scope.get("client")
            self.guard.check(headers.get("authorization"), client[0] if client else None,
                             host_name(headers.get("host")))


class BrowserGate(Gate):
    """Every request passes the Host allow-list and the Origin check (``origin.BrowserPolicy``)."""

    def __init__(self, app, policy: BrowserPolicy):
        super().__init__(app)
        self.policy = policy

    def check(self, scope, headers: Headers) -> None:
        self.policy.check(scope["scheme"], headers.get("host"), headers.get("origin"))


def create_app(cfg: ClawrlConfig, engine: Engine, linker: SessionLinker) -> FastAPI:
    """The gateway app. Its lifespan starts the engine, runs the idle-session closer, and shuts
    the engine down on exit."""
    gw = Gateway(cfg, engine, linker)
    store = linker.store

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        closer = asyncio.create_task(_close_idle_sessions(linker, cfg.sessions.idle_timeout_s))
        try:
            yield
        finally:
            closer.cancel()
            await engine.shutdown()

    app = FastAPI(title="clawrl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    openapi.install(app)  # the schemas of the raw-body routes, for schema-driven clients and fuzzers
    app.state.gateway = gw
    app.add_middleware(CatchAll, store_refusals=gw.store_refusals)
    app.add_middleware(AdminGate, guard=gw.admin_guard)
    browsers = BrowserPolicy(cfg.server)
    if browsers.origins:  # outside AdminGate: a preflight carries no key; inside BrowserGate: listed origins only
        app.add_middleware(CORSMiddleware, allow_origins=sorted(browsers.origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Session-Id", "X-Turn-Ids", "Retry-After"],
                           allow_private_network=True)  # a listed page may be public, the server on loopback
    app.add_middleware(BrowserGate, policy=browsers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return _error_response(ApiError(e.status_code, str(e.detail), code=code))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, e: ClientDisconnect):
        log.info("%s %s: the client went away before sending its whole body; nothing was done", request.method,
                 request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return _error_response(bad_request(f"invalid request: {e.errors()[0].get('msg', 'bad value')}"))

    @app.get("/healthz")
    async def healthz():
        health = await engine.health()
        return JSONResponse({"ok": bool(health.get("ok")), "model": gw.model_name,
                             "weight_version": health.get("weight_version")},
                            status_code=200 if health.get("ok") else 503)

    def model_card() -> dict:
        return {"id": gw.model_name, "object": "model", "created": gw.created, "owned_by": "clawrl",
                "context_window": gw.max_context}

    @app.get("/v1/models", openapi_extra=openapi.MODELS)
    async def models(request: Request):
        gw.caller(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", openapi_extra=openapi.MODEL_CARD)
    async def model(request: Request, model_id: str):
        gw.caller(request)
        if model_id != gw.model_name:
            raise ApiError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions", openapi_extra=openapi.CHAT_COMPLETIONS)
    async def chat_completions(request: Request):
        caller_key = gw.caller(request)
        body = await read_json(request, cfg.server.max_body_bytes)
        req = parse_chat_request(body)
        if req.model != gw.model_name:
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves '{gw.model_name}'",
                           param="model", code="model_not_found")
        hints = _hints(request, body)
        prompt = await anyio.to_thread.run_sync(render_prompt, gw.tokenizer, req, gw.max_context,
                                                cfg.server.truncate_history, limiter=gw.render_limiter)
        params = gw.sampling(req, len(prompt.ids))
        tokens = gw.rate_limits.reserve(caller_key, len(prompt.ids) + req.n * params.max_new_tokens)
        try:
            await gw.admission.acquire(req.n)
        except BaseException:
            tokens.settle(0)
            raise
        turn = plan = None
        try:
            plan = await asyncio.to_thread(linker.begin, body["messages"], body.get("tools"),
                                           caller_key=caller_key, user=req.user, hints=hints)
            turn = Turn(gw, req, prompt, plan, params, tokens)
            turn.open()
        except BaseException as e:
            if turn is not None:
                await turn.abort_unfinished()
            if plan is not None:
                linker.release(plan)
            gw.admission.release(req.n)
            tokens.settle(0)
            if isinstance(e, SessionInputError):
                raise bad_request(str(e), code="invalid_session") from None
            raise
        headers = {"X-Session-Id": plan.session_id}
        if req.stream:
            return SSEResponse(turn.stream_sse, headers=headers)
        result = await turn.completion(request.receive)
        if result is None:
            return Response(status_code=499)  # nobody is listening; the turn is stored as aborted
        headers["X-Turn-Ids"] = ",".join(map(str, turn.turn_ids))
        return JSONResponse(result, headers=headers)

    # ---- admin (every route under /admin is guarded by AdminGate)

    @app.get("/admin/status")
    async def admin_status():
        counts = await asyncio.to_thread(store.status_counts)
        out = {"model": gw.model_name, "weight_version": engine.model_info().weight_version,
               "engine": await engine.health(), "queue": {"free_slots": gw.admission.free,
                                                          "waiting": gw.admission.waiting}, **counts}
        for section in gw.status_sections:
            out.update(await asyncio.to_thread(section))
        return out

    @app.get("/admin/sessions")
    async def admin_sessions(limit: int = 100, offset: int = 0):
        if not 1 <= limit <= 1000 or not 0 <= offset < 2**63:  # SQLite's INTEGER is 64-bit
            raise bad_request("limit must be 1..1000 and offset >= 0", param="limit")
        return {"object": "list", "data": await asyncio.to_thread(store.list_sessions, limit, offset)}

    @app.get("/admin/sessions/{session_id:path}")  # a session id may hold '/' (X-Session-Id: team/alice)
    async def admin_session(session_id: str):
        session = await asyncio.to_thread(store.get_session, session_id)
        if session is None:
            raise ApiError(404, f"no session '{session_id}'", param="session_id", code="session_not_found")
        return session

    @app.patch("/admin/turns/{turn_id}", openapi_extra=openapi.RELABEL_TURN)
    async def admin_relabel(request: Request, turn_id: str):
        body = await read_json(request, cfg.server.max_body_bytes)
        if not _TURN_ID.fullmatch(turn_id):  # ASCII digits that fit SQLite's INTEGER ("²".isdigit() too)
            raise ApiError(404, f"no turn with id {turn_id}", param="turn_id", code="turn_not_found")
        label = body.get("label")
        if set(body) != {"label"} or not isinstance(label, str):
            raise bad_request("body must be {\"label\": \"main\" | \"side\" | \"excluded\"}", param="label")
        try:
            return await asyncio.to_thread(store.relabel_turn, int(turn_id), label, "admin")
        except UnknownTurn as e:
            raise ApiError(404, str(e), param="turn_id", code="turn_not_found") from None
        except ValueError as e:
            raise bad_request(str(e), param="label") from None

    return app


async def _close_idle_sessions(linker: SessionLinker, idle_timeout_s: float) -> None:
    """Close sessions idle past the timeout, checking a few times per timeout period."""
    period = max(0.05, min(60.0, idle_timeout_s / 4))
    while True:
        await asyncio.sleep(period)
        try:
            await asyncio.to_thread(linker.close_idle_sessions)
        except Exception as e:  # a locked or full disk must not kill the loop; the next pass retries
            log.warning("closing idle sessions failed: %s", e)
