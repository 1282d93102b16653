"""``clawrl chat "message"``: one reply, a quick way to talk to the model from the command line.

With a server running (``clawrl serve`` or a method's ``run.sh``), the message goes to that server
over its OpenAI API, so the reply comes from the weights it serves, the trained ones: ``--url``
names the server; without it, the configured address (``server.host``/``server.port``) is tried
with a short ``GET /v1/models``. When nothing answers there, or with ``--local``, the configured
model is loaded in this process instead (its base weights, not a run's trained ones), and stderr
says so. The key for a server comes from ``--api-key``, ``$CLAWRL_API_KEY`` or ``server.api_key``.
"""
from __future__ import annotations

import asyncio
import os
import sys

import httpx

from clawrl.config import compose
from clawrl.embedded.build import resolve_model
from clawrl.engines import make_engine
from clawrl.engines.base import EngineError, SamplingParams
from clawrl.engines.chat_template import render_chat
from clawrl.errors import CliError
from clawrl.gateway.auth import parse_keys

API_KEY_ENV = "CLAWRL_API_KEY"
PROBE_TIMEOUT_S = 1.0  # a server on loopback answers /v1/models in milliseconds
REQUEST_TIMEOUT_S = 300.0  # a reply from a big model on CPU, behind other requests


def render_prompt(tokenizer, message: str) -> list[int]:
    """Token ids of a one-user-message conversation, ready for the assistant's reply."""
    text = render_chat(tokenizer, [{"role": "user", "content": message}])
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def configured_url(server) -> str:
    """``http://host:port`` of the configured server (a wildcard bind is reached on loopback)."""
    host = "127.0.0.1" if server.host in ("0.0.0.0", "::", "") else server.host
    return f"http://[{host}]:{server.port}" if ":" in host else f"http://{host}:{server.port}"


def _base_url(url: str) -> str:
    """``http://host:port`` from a URL given with or without ``/v1`` (as OpenAI clients take it)."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url[: -len("/v1")] if url.endswith("/v1") else url


def server_answers(base_url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True if an HTTP server answers ``GET /v1/models`` at ``base_url`` (any status: a 401 is a
    server that wants a key, which the chat request then reports)."""
    try:
        httpx.get(base_url + "/v1/models", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return True


def _api_key(args, server) -> str | None:
    configured = parse_keys(server.api_key)
    return args.api_key or os.environ.get(API_KEY_ENV) or (configured[0] if configured else None)


def _answer(response, base_url: str) -> dict:
    """The JSON body of a 2xx response, or CliError naming the status and the server's message."""
    if response.status_code < 400:
        try:
            return response.json()
        except ValueError:
            raise CliError(f"the server at {base_url} answered {response.request.url.path} with something "
                           "that is not JSON (is it an OpenAI-compatible server?)") from None
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = " ".join(response.text.split())[:200] or response.reason_phrase
    hint = " (pass --api-key KEY or set CLAWRL_API_KEY)" if response.status_code == 401 else ""
    raise CliError(f"the server at {base_url} answered {response.status_code}: {message}{hint}")


def remote_reply(base_url: str, api_key: str | None, message: str, max_tokens: int, temperature: float,
                 seed: int) -> tuple[str, str, str | None]:
    """Ask the server at ``base_url``: (reply, model id, system_fingerprint). Errors are CliError."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=base_url, headers=headers, timeout=REQUEST_TIMEOUT_S) as client:
            models = _answer(client.get("/v1/models", timeout=30), base_url)
            try:
                model = models["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise CliError(f"the server at {base_url} lists no model at /v1/models") from None
            # A one-shot question is a session of its own, ended at once (no later message links to it).
            body = _answer(client.post("/v1/chat/completions", headers={"X-Session-Done": "1"}, json={
                "model": model, "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens,
                "temperature": temperature, "seed": seed}), base_url)
    except httpx.HTTPError as e:
        raise CliError(f"cannot reach the server at {base_url}: {type(e).__name__}: {e}") from None
    try:
        reply = body["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise CliError(f"the server at {base_url} answered without a message in choices[0]") from None
    return reply, model, body.get("system_fingerprint")


def chat_cli(args) -> int:
    if args.max_tokens < 1:
        raise CliError("--max-tokens must be at least 1")
    if args.temperature < 0:
        raise CliError("--temperature must be >= 0")
    if args.local and args.url:
        raise CliError("--local and --url exclude each other: --local answers in this process")
    cfg = compose(args.overrides)
    base_url = _base_url(args.url) if args.url else configured_url(cfg.server)
    if args.url or (not args.local and cfg.server.port != 0 and server_answers(base_url)):
        reply, model, fingerprint = remote_reply(base_url, _api_key(args, cfg.server), args.message,
                                                 args.max_tokens, args.temperature, cfg.seed)
        weights = f", {fingerprint}" if fingerprint else ""
        print(f"clawrl: answered by {model} at {base_url}{weights}", file=sys.stderr, flush=True)
        print(reply.strip())
        return 0
    return _local_reply(cfg, args, None if args.local else base_url)


def _local_reply(cfg, args, missed_url: str | None) -> int:
    """Load the configured model here and answer; ``missed_url``: the server that did not answer."""
    try:
        engine = make_engine(resolve_model(cfg))
        name = engine.model_info().name
        where = f"no server at {missed_url}; answering" if missed_url else "answering"
        print(f"clawrl: {where} with {name} loaded in this process (base weights, not the trained ones)",
              file=sys.stderr, flush=True)
        prompt = render_prompt(engine.tokenizer, args.message)
        max_new = min(args.max_tokens, engine.model_info().max_context - len(prompt))
        if max_new < 1:
            raise CliError(f"the message is {len(prompt)} tokens; the model's context is "
                           f"{engine.model_info().max_context}")
        params = SamplingParams(max_new_tokens=max_new, temperature=args.temperature, seed=cfg.seed)
        result = asyncio.run(_generate(engine, prompt, params))
    except EngineError as e:
        raise CliError(str(e)) from None
    print(engine.tokenizer.decode(result.token_ids, skip_special_tokens=True).strip())
    return 0


async def _generate(engine, prompt, params):
    await engine.start()
    try:
        return await engine.generate(prompt, params)
    finally:
        await engine.shutdown()
