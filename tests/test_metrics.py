"""Metrics: JSONL lines per train step and weight version, WandB offline files, the online probe
falling back to offline without hanging, and no secrets in anything written."""
from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from clawrl.config import ConfigError, LoggingConfig, WandbConfig, compose
from clawrl.metrics import PROBE_TIMEOUT_S, MetricsLogger, configure_logging, wandb_reachable
from clawrl.redact import public_config

SECRET = "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789ABCD"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_disabled_writes_jsonl_only(tmp_path):
    m = MetricsLogger(tmp_path, LoggingConfig(wandb=WandbConfig(mode="disabled")))
    m.log_step(1, {"loss": 0.5, "kl_mean": 0.01, "clip_fraction": 0.0, "grad_norm": float("nan")})
    m.log_version(1, {"sync_ms": 12.5, "samples_trained": 8, "samples_skipped": 1})
    m.close()
    step, version = lines(tmp_path)
    assert step["kind"] == "train_step" and step["step"] == 1 and step["loss"] == 0.5
    assert step["grad_norm"] is None  # non-finite values stay valid JSON
    assert version["kind"] == "weight_version" and version["weight_version"] == 1 and version["sync_ms"] == 12.5
    assert not (tmp_path / "wandb").exists()


def test_offline_wandb_writes_a_local_run_without_secrets(tmp_path):
    cfg = compose([f"server.api_key={SECRET}"])
    from dataclasses import asdict

    m = MetricsLogger(tmp_path, cfg.logging, run_config=asdict(cfg))
    assert m.wandb_mode == "offline"
    m.log_step(1, {"loss": 0.25, "note": f"key {SECRET}"})
    m.log_version(1, {"sync_ms": 3.0})
    m.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert runs and runs[0].stat().st_size > 0
    assert lines(tmp_path)[0]["loss"] == 0.25
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def test_online_without_network_falls_back_to_offline_quickly(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="clawrl.metrics"):
        m = MetricsLogger(tmp_path, LoggingConfig(wandb=WandbConfig(mode="online")))
    m.close()
    assert m.wandb_mode == "offline"
    assert "falls back" in caplog.text or "unreachable" in caplog.text
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert time.monotonic() - started < 30


def test_probe_of_the_real_wandb_host_never_hangs():
    started = time.monotonic()
    wandb_reachable()
    assert time.monotonic() - started < PROBE_TIMEOUT_S + 1.0


def test_unknown_wandb_mode_and_log_level_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="logging.wandb.mode=cloud"):
        MetricsLogger(tmp_path, LoggingConfig(wandb=WandbConfig(mode="cloud")))
    with pytest.raises(ConfigError, match="logging.level=LOUD"):
        configure_logging(LoggingConfig(level="LOUD"))


def test_public_config_drops_secret_fields_but_keeps_token_counts():
    cfg = public_config({"server": {"api_key": SECRET, "admin_key": "x", "max_body_bytes": 1},
                         "train": {"micro_batch_tokens": 16, "hf_token": "hf_x"}, "note": f"use {SECRET}"})
    assert cfg["server"] == {"max_body_bytes": 1}
    assert cfg["train"] == {"micro_batch_tokens": 16}
    assert SECRET not in cfg["note"]
