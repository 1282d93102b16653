"""``clawrl serve``: compose the config, load the model and engine, open the turn store, and serve
the OpenAI-compatible gateway with uvicorn until SIGINT/SIGTERM.

The listening socket is bound *before* the model loads, so a port in use fails in a second with
one line instead of after a long load; uvicorn then serves on that socket and handles the signals
(it stops accepting, lets in-flight responses finish, and runs the app's shutdown, which stops
the engine). Turns are durable as they are served, so even ``kill -9`` loses no acknowledged turn.
The run directory is locked for the server's life (``clawrl.run_lock``): one server per run_dir.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Optional

import uvicorn

from clawrl.cluster.control import ClusterError
from clawrl.cluster.launch import read_node_env, run_worker_node
from clawrl.config import compose, model_defaults_report
from clawrl.embedded.build import resolve_model
from clawrl.engines import make_engine
from clawrl.engines.base import EngineError
from clawrl.envs import CHAT, EnvError, env_class
from clawrl.errors import CliError
from clawrl.gateway.app import create_app
from clawrl.gateway.auth import AuthConfigError, check_server_auth, parse_keys
from clawrl.logs import setup_logging
from clawrl.methods.registry import check_method
from clawrl.orchestration.learner import attach_learning
from clawrl.run_lock import RunDirError, RunDirLock
from clawrl.sessions import SessionLinker
from clawrl.store import STORE_FILENAME, StoreError, TurnStore
from clawrl.trainers.megatron.trainer import PROGRAM
from clawrl.wal_check import check_wal

log = logging.getLogger(__name__)

API_KEY_ENV = "CLAWRL_API_KEY"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free port), or CliError in one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CliError(f"cannot resolve server.host={host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e} (is another server using the port? "
                       "set server.port=...)") from None
    sock.set_inheritable(True)
    return sock


def provider_snippet(base_url: str, model: str, context_window: int, max_tokens: int, has_key: bool) -> dict:
    """OpenClaw's provider entry for this server. The key is never printed: a placeholder, or an
    env reference OpenClaw expands when $CLAWRL_API_KEY is set here."""
    if not has_key:
        api_key = "none"  # loopback without a key: any value is accepted
    elif os.environ.get(API_KEY_ENV):
        api_key = "${" + API_KEY_ENV + "}"
    else:
        api_key = "<your api key>"
    return {"models": {"providers": {"clawrl": {
        "baseUrl": base_url, "apiKey": api_key, "api": "openai-completions",
        "models": [{"id": model, "name": model, "reasoning": False, "input": ["text"],
                    "contextWindow": context_window, "maxTokens": max_tokens}],
    }}}}


def tasks_beside_config(cfg, config_file: Optional[str], overrides: list[str]):
    """A relative ``env.tasks`` from a method directory's config.yaml names a path in that directory
    (``tasks: .`` in toolcall-rl/config.yaml is toolcall-rl/ wherever run.sh is started from); one given
    on the command line is relative to the working directory, as any path argument is."""
    tasks = cfg.env.tasks
    if tasks is None or config_file is None or Path(tasks).expanduser().is_absolute() \
            or any(o.lstrip("+~").startswith("env.tasks=") for o in overrides):
        return cfg
    resolved = (Path(config_file).expanduser().resolve().parent / tasks).resolve()
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, tasks=str(resolved)))


def _is_driver_node(cfg) -> bool:
    """NODE_RANK 0 (or no multi-node launch) runs the gateway, engine and learner."""
    return read_node_env(cfg).is_driver


def _serve_trainer_ranks_only(cfg) -> int:
    """NODE_RANK > 0 of a multi-node megatron run: this node's trainer ranks, no gateway. Blocks
    until the driver on node 0 shuts the ranks down. ``cfg.model.path`` is resolved: the embedded
    default is built here too (deterministic, cached)."""
    print(f"clawrl: NODE_RANK={os.environ.get('NODE_RANK')}: running this node's megatron trainer ranks "
          "(the gateway runs on NODE_RANK=0)", flush=True)
    try:
        run_worker_node(cfg, PROGRAM)
    except ClusterError as e:
        raise CliError(str(e).splitlines()[0]) from None
    return 0


def serve_cli(args) -> int:
    cfg = tasks_beside_config(compose(args.overrides, args.config), args.config, args.overrides)
    check_method(cfg.method)
    if cfg.env.name != CHAT:
        try:
            env_class(cfg.env.name)  # a bad name or path first, in its own words
        except EnvError as e:
            raise CliError(str(e).splitlines()[0]) from None
    setup_logging(cfg.logging.level)  # clawrl at logging.level, libraries (httpx, uvicorn.access, ...) at WARNING
    if cfg.trainer.backend == "megatron" and cfg.train.enabled and not _is_driver_node(cfg):
        return _serve_trainer_ranks_only(resolve_model(cfg))
    try:
        check_server_auth(cfg.server)
    except AuthConfigError as e:
        raise CliError(str(e)) from None
    try:
        # held for the server's life: a second server on this run_dir would train the same samples again
        run_lock = RunDirLock(cfg.run_dir).acquire()
    except RunDirError as e:  # busy, read-only, full
        raise CliError(str(e)) from None
    try:
        sock = bind_socket(cfg.server.host, cfg.server.port)
        # after the refusals above, which stay one line; from the unresolved config, in which model.path
        # null still means the embedded model (a worker node's ranks share the driver's config and log)
        log.info("%s", model_defaults_report(cfg))
        try:
            _serve_on(sock, resolve_model(cfg))  # after binding: a port in use fails before a model build
        finally:
            sock.close()
    finally:
        run_lock.release()
    return 0


def _serve_on(sock: socket.socket, cfg) -> None:
    """Load the model, open the store, and serve on ``sock`` until SIGINT/SIGTERM."""
    try:
        engine = make_engine(cfg)
        check_wal(Path(cfg.run_dir) / STORE_FILENAME)  # before SQLite's recovery rewrites the log
        store = TurnStore(cfg.run_dir)
    except (EngineError, StoreError) as e:
        raise CliError(str(e)) from None
    linker = SessionLinker(store, idle_timeout_s=cfg.sessions.idle_timeout_s)
    app = create_app(cfg, engine, linker)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=10))
    done: list[bool] = []

    def trained_enough() -> None:  # env.max_train_steps: saved and evaluated, so the server stops
        done.append(True)
        server.should_exit = True

    # judging (or environment rollouts) and training beside serving, per cfg.method and cfg.env
    attach_learning(app, cfg, engine, store, on_done=trained_enough)
    info = engine.model_info()
    host, port = sock.getsockname()[:2]
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else (f"[{host}]" if ":" in host else host)
    base_url = f"http://{shown}:{port}/v1"
    snippet = provider_snippet(base_url, info.name, info.max_context,
                               min(cfg.server.default_max_tokens, info.max_context),
                               bool(parse_keys(cfg.server.api_key)))
    print(f"clawrl: serving {info.name} at {base_url} (turns stored in {store.path})", flush=True)
    print("OpenClaw provider (paste into openclaw.json):", flush=True)
    print(json.dumps(snippet, indent=2), flush=True)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal into the
    # handler it found; this one turns that into a normal exit (status 0) after cleanup.
    stopped: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, f: stopped.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        store.close()
    if stopped:
        print(f"clawrl: stopped by {signal.Signals(stopped[0]).name}; every acknowledged turn is in {store.path}",
              flush=True)
    elif done:
        print(f"clawrl: env.max_train_steps={cfg.env.max_train_steps} train steps done and saved in {cfg.run_dir}",
              flush=True)
