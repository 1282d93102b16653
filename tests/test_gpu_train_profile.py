"""benchmarks/gpu_train_profile.py: its tiny CPU run, so the listing behind BENCHMARKS.md's "where
the step goes" cannot rot, and its idle-gap reading on a made-up device timeline (CPU runs have
none)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_profile():
    if str(BENCHMARKS) not in sys.path:  # it imports gpu_models and loads gpu_suite beside it
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("gpu_train_profile", BENCHMARKS / "gpu_train_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_profile_runs_tiny_on_cpu_and_lists_the_step(monkeypatch, capsys):
    profile = load_profile()
    monkeypatch.setattr(sys, "argv", ["gpu_train_profile.py", "--shape", "tiny", "--setting", "off"])
    profile.main()
    out = capsys.readouterr().out
    assert "== off (train.compile=off; tiny, 4 x 64 tokens)" in out
    assert "aten::mm" in out and "host calls that wait on the device" in out


def _event(name, start, end, device=True, parent=None):
    kind = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, key=name, device_type=kind, cpu_parent=parent,
                           time_range=SimpleNamespace(start=start, end=end))


def test_idle_gaps_are_read_off_the_device_timeline_with_what_the_host_was_doing():
    """Kernels at 1-2, 2.05-3 and 5-6 ms of a step that starts at 0 and lasts 7 ms: 1 ms idle before
    the first, one gap over 0.1 ms (3 to 5 ms, the host in aten::item), 1 ms after the last; the
    annotation the profiler mirrors onto the device is not a kernel and fills no gap."""
    profile = load_profile()
    events = [_event("step", 0, 7000, device=False), _event("aten::item", 2900, 5100, device=False),
              _event("aten::child", 3000, 3100, device=False, parent=object()),
              _event("k1", 1000, 2000), _event("k2", 2050, 3000), _event("k3", 5000, 6000),
              _event("Optimizer.step#AdamW.step", 2000, 6000)]
    gaps = profile.idle_gaps(SimpleNamespace(events=lambda: events), wall_ms=7.0)
    assert gaps["before_first_ms"] == 1.0 and gaps["after_last_ms"] == 1.0
    assert gaps["gaps"] == 1 and gaps["between_ms"] == 2.0
    ms, at, name, host = gaps["longest"][0]
    assert (ms, at, name) == (2.0, 3.0, "k3") and host == ["aten::item", "step"]
