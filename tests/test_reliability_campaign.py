"""The standing reliability campaign's machinery (issue 40, item 7), briefly: ``benchmarks/reliability.py``
runs hostile requests, a soak while training, and reports the figures RELIABILITY.md shows. The full
campaign (30 + 10 kills, every hostile case, 3 disk-full cycles, a 10-minute soak of 32 streams) is
``python benchmarks/reliability.py model.path=DIR model.name=tiny``; the kills alone are in
tests/test_crash_campaign.py."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from gateway_support import build_tiny_model, model_cache_dir

ROOT = Path(__file__).resolve().parent.parent
if "reliability" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("reliability", ROOT / "benchmarks" / "reliability.py")
    sys.modules["reliability"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["reliability"])
reliability = sys.modules["reliability"]
hostile = reliability.sibling("hostile")


def test_figures_count_kills_losses_double_training_cases_recoveries_and_the_soak():
    out = {"results": [{"turns_lost": 1, "trained_twice": 0}, {"turns_lost": 0, "trained_twice": 2}],
           "hostile": [{"case": "a", "handled": True, "detail": "400"}, {"case": "b", "handled": False, "detail": "5|0"}],
           "disk_full": {"skipped": None, "cycles": [{"problems": []}, {"problems": ["x"]}]},
           "soak": {"sessions": 32, "seconds": 600, "requests": 10, "latency_p50_s": 1.0, "latency_p99_s": 2.0,
                    "train_steps": 3, "rss_mb_first": 1, "rss_mb_peak": 3, "rss_mb_last": 2,
                    "rss_slope_second_half_mb_per_min": 0.5, "errors": {"429": 2}, "lost": []}}
    text = reliability.figures(out)
    assert "| 2 | 1 | 2 |" in text and "Hostile cases: 1 of 2 handled." in text and "| b | NO | 5/0 |" in text
    assert "Disk-full recoveries: 1 of 2." in text and "| 32 | 600 | 10 | 1.0 s / 2.0 s | 3 | 1 / 3 / 2 MB" in text
    assert "| +0.5 MB/min | 2 {'429': 2} | 0 |" in text


def test_every_hostile_case_the_issue_lists_is_in_the_campaign():
    assert len(hostile.CASES) == 13 and all(case.__doc__ for case in hostile.CASES.values())


def test_the_campaign_runs_hostile_cases_and_a_short_soak_and_writes_its_figures(tmp_path, monkeypatch, capsys):
    model = build_tiny_model(model_cache_dir())
    cheap = ("disconnect mid-body", "max_tokens=10**12")  # the others run in the full campaign
    monkeypatch.setattr(hostile, "CASES", {name: hostile.CASES[name] for name in cheap})
    out = tmp_path / "figures.json"
    reliability.main(["--kills", "0", "--sandbox-kills", "0", "--disk-full", "0", "--soak-s", "6",
                      "--soak-streams", "4", "--run-dir", str(tmp_path / "run"), "--out", str(out),
                      f"model.path={model}", "model.name=tiny"])
    figures = json.loads(out.read_text())
    assert [r["case"] for r in figures["hostile"]] == list(cheap)
    assert figures["hostile"][0]["handled"], figures["hostile"]  # nothing stored for a half-sent body
    soak = figures["soak"]
    assert soak["sessions"] == 4 and soak["requests"] > 0 and soak["lost"] == [] and len(soak["rss"]) >= 2
    assert "Hostile cases: " in capsys.readouterr().out
