"""Methods as plug-ins change no number: three train steps of rl, opd and combine, on the torch
backend and on megatron (tp=2, CPU), reproduce the loss, gradient norm, step metrics and per-token
advantages recorded before the seam (tests/method_parity.py says how they were recorded)."""
from __future__ import annotations

import json

import pytest

from method_parity import BACKENDS, FIXTURE, METHODS, model_dir, run

TOL = 1e-5  # the trainer now takes pi_old from the loss forward: float32 reassociation, about 3e-6 on grad_norm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("parity"))


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("method", METHODS)
def test_method_reproduces_the_numbers_recorded_before_the_seam(tiny, method, backend):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    expected = json.loads(FIXTURE.read_text())[f"{backend}/{method}"]
    got = run(tiny, method, backend)
    assert len(got) == len(expected)
    for step, (g, e) in enumerate(zip(got, expected)):
        for key in ("loss", "grad_norm"):
            assert key in g["metrics"], (step, key)
        bad = {k: (g["metrics"].get(k), v) for k, v in e["metrics"].items()
               if k not in g["metrics"] or not close(g["metrics"][k], v)}
        assert not bad, f"step {step}: {bad}"
        if "advantages" in e:
            flat_g = [a for mb in g["advantages"] for a in mb]
            flat_e = [a for mb in e["advantages"] for a in mb]
            assert len(flat_g) == len(flat_e) and all(close(x, y) for x, y in zip(flat_g, flat_e)), step
