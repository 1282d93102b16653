"""Training metrics: one JSON line per train step and per weight version, mirrored to WandB.

``run_dir/metrics.jsonl`` is the record that always exists (plots, tests and the status endpoint
read it); WandB is a view on the same numbers. WandB runs offline by default, writing under
``run_dir/wandb`` to sync later with ``wandb sync``, because a self-hosted agent often has no
route to wandb.ai and a training loop must never wait on one. ``online`` is honoured only when
api.wandb.ai answers a short TCP probe; otherwise it falls back to offline with a warning.

Nothing secret is logged: metric values are numbers (strings pass through ``redact_text``), and
the run config sent to WandB drops every key that names a key, token, secret or password.
WandB's own system metadata (command line, git, code) is turned off, since a command line can
hold ``server.api_key=...``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from clawrl.config import ConfigError, LoggingConfig
from clawrl.redact import public_config, redact_text

log = logging.getLogger(__name__)

WANDB_MODES = ("offline", "online", "disabled")
PROBE_TIMEOUT_S = 2.0


def configure_logging(cfg: LoggingConfig) -> None:
    """Apply ``logging.level`` to clawrl's loggers (and a plain format if nothing is set up)."""
    level = logging.getLevelName(cfg.level.upper())
    if not isinstance(level, int):
        raise ConfigError(f"logging.level={cfg.level}: use DEBUG, INFO, WARNING or ERROR")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("clawrl").setLevel(level)


def wandb_reachable(timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True if WandB's API host accepts a TCP connection within ``timeout_s`` (DNS included).

    The probe runs in a daemon thread joined with a timeout, because name resolution ignores
    socket timeouts and can hang for far longer on a machine without a resolver.
    """
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host, port = url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)
    ok: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, name="clawrl-wandb-probe", daemon=True)
    t.start()
    t.join(timeout_s)
    return bool(ok)


def _clean(metrics: dict) -> dict:
    """JSON-safe metric values: finite numbers stay, non-finite become None, strings are redacted."""
    out = {}
    for k, v in metrics.items():
        if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
            v = v.item()
        if isinstance(v, bool) or v is None:
            out[k] = v
        elif isinstance(v, (int, float)):
            out[k] = v if math.isfinite(v) else None
        elif isinstance(v, str):
            out[k] = redact_text(v)[0]
    return out


class MetricsLogger:
    """Writes ``run_dir/metrics.jsonl`` and, per ``logging.wandb.mode``, a WandB run.

    ``log_step`` after every train step (ok or skipped); ``log_version`` after every weight push.
    ``run_config`` (e.g. the composed config as a dict) goes to WandB without secrets.
    """

    def __init__(self, run_dir: str | Path, logging_cfg: LoggingConfig, run_config: dict | None = None):
        self.wandb_mode = self._resolve_mode(logging_cfg.wandb.mode)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._wandb = None
        if self.wandb_mode != "disabled":
            self._wandb = self._start_wandb(logging_cfg.wandb.project, run_config)

    @staticmethod
    def _resolve_mode(mode: str) -> str:
        if mode not in WANDB_MODES:
            raise ConfigError(f"logging.wandb.mode={mode}: choose one of {', '.join(WANDB_MODES)}")
        if mode == "online" and not wandb_reachable():
            log.warning("logging.wandb.mode=online but api.wandb.ai is unreachable; logging to WandB offline "
                        "(sync later with `wandb sync`)")
            return "offline"
        return mode

    def _start_wandb(self, project: str, run_config: dict | None):
        try:
            import wandb

            settings = wandb.Settings(silent=True, console="off", x_disable_meta=True, x_disable_stats=True,
                                      disable_git=True, disable_code=True, save_code=False)
            run = wandb.init(project=project, dir=str(self.run_dir), mode=self.wandb_mode,
                             config=public_config(run_config or {}), settings=settings)
        except Exception as e:  # WandB is a mirror: its failure must not stop training
            log.warning("WandB %s logging unavailable (%s: %s); metrics go to %s only", self.wandb_mode,
                        type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "", self.path)
            self.wandb_mode = "disabled"
            return None
        for kind, key in (("train_step", "step"), ("weight_version", "weight_version")):
            run.define_metric(f"{kind}/*", step_metric=f"{kind}/{key}")
        log.info("WandB %s run %s under %s", self.wandb_mode, run.id, self.run_dir / "wandb")
        return run

    def log_step(self, step: int, metrics: dict) -> None:
        """One train step: loss, KL, clip fraction, entropy, logprob gap, rewards, staleness, ..."""
        self._write("train_step", step, metrics)

    def log_version(self, version: int, metrics: dict) -> None:
        """One weight version made live: sync milliseconds, samples trained and skipped, judge stats."""
        self._write("weight_version", version, metrics)

    def _write(self, kind: str, index: int, metrics: dict) -> None:
        values = _clean(metrics)
        key = "step" if kind == "train_step" else "weight_version"
        line = {"kind": kind, "time": time.time(), key: int(index), **values}
        with self._lock:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()
            if self._wandb is not None:
                numbers = {f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}
                numbers[f"{kind}/{key}"] = int(index)
                self._wandb.log(numbers)

    def close(self) -> None:
        with self._lock:
            if self._wandb is not None:
                offline_dir = self._wandb.settings.sync_dir if self.wandb_mode == "offline" else None
                self._wandb.finish()
                self._wandb = None
                if offline_dir:  # said once, at the end of the run (clawrl serve, clawrl demo)
                    print(f"clawrl: WandB logged offline to {offline_dir}; upload it with: wandb sync {offline_dir}",
                          file=sys.stderr, flush=True)
            if not self._file.closed:
                self._file.close()
