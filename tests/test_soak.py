"""Load and soak at CI size (issue 20, item 2): 16 concurrent sessions for 20 seconds against a
server that judges and trains; nothing acknowledged is lost, latencies and memory are measured.
The full figures (64 sessions, 10 minutes) come from ``python benchmarks/soak.py``."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from gateway_support import build_tiny_model, model_cache_dir

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
sys.modules["soak"] = soak
_spec.loader.exec_module(soak)


def test_rss_slope_is_a_least_squares_fit():
    assert soak.slope_mb_per_min([(0, 100), (60, 110), (120, 120)]) == pytest.approx(10.0)
    assert soak.slope_mb_per_min([(0, 100)]) == 0.0


@pytest.mark.slow
def test_sixteen_concurrent_sessions_lose_nothing_while_training(tmp_path):
    model = build_tiny_model(model_cache_dir())
    result = soak.soak(tmp_path / "run", 16, 20, 1.0, [f"model.path={model}", "model.name=tiny"],
                       tmp_path / "serve.log", progress=lambda line: None)
    assert result["lost"] == [], result["lost"]
    assert result["requests"] >= 40 and result["acked_turns"] >= 20 and result["acked_streams"] >= 5
    assert result["train_steps"] >= 1
    assert 0 < result["latency_p50_s"] <= result["latency_p99_s"] < 30
    assert len(result["rss"]) >= 10 and 0 < result["rss_mb_first"] <= result["rss_mb_peak"]
