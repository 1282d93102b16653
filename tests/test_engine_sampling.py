"""The batched sampler (engines/sampling.py): draws follow the (truncated, tempered) distribution,
depend only on each row's seed and counter, and logprobs are of the full tempered distribution."""
from __future__ import annotations

import pytest
import torch

from clawrl.engines.base import SamplingParams
from clawrl.engines.sampling import sample_rows, uniform

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def draws(params: SamplingParams, n: int, seed0: int = 0) -> torch.Tensor:
    logits = LOGITS.expand(n, -1).clone()
    got = sample_rows(logits, [params] * n, list(range(seed0, seed0 + n)), [3] * n)
    return torch.tensor([d.token for d in got])


def test_uniforms_are_uniform_and_depend_on_seed_and_counter_only():
    u = uniform(torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    assert 0 < float(u.min()) and float(u.max()) < 1
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / 20000
    assert float((hist - 0.1).abs().max()) < 0.01
    v = uniform(torch.arange(20000), torch.ones(20000, dtype=torch.long))
    assert abs(float(torch.corrcoef(torch.stack((u, v)))[0, 1])) < 0.03  # next counter: fresh numbers
    one = uniform(torch.tensor([7]), torch.tensor([2]))
    assert torch.equal(uniform(torch.tensor([7, 9, 7]), torch.tensor([2, 2, 2]))[[0, 2]], one.expand(2))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draws_follow_the_tempered_distribution(temperature):
    n = 20000
    freq = torch.bincount(draws(SamplingParams(temperature=temperature), n), minlength=6).float() / n
    want = torch.softmax(LOGITS / temperature, -1)
    assert float((freq - want).abs().max()) < 0.015


def test_top_k_and_top_p_truncate_and_renormalise():
    n = 20000
    k2 = torch.bincount(draws(SamplingParams(temperature=1.0, top_k=2), n), minlength=6).float() / n
    assert k2[2:].sum() == 0
    p2 = torch.softmax(LOGITS[:2], -1)
    assert float((k2[:2] - p2).abs().max()) < 0.015
    probs = torch.softmax(LOGITS, -1)  # 0.56, 0.21, 0.13, ...: top_p 0.75 keeps the first two
    p = torch.bincount(draws(SamplingParams(temperature=1.0, top_p=0.75), n), minlength=6).float() / n
    assert p[2:].sum() == 0 and float((p[:2] - probs[:2] / probs[:2].sum()).abs().max()) < 0.015


def test_greedy_rows_beside_sampled_rows_and_logprobs_of_the_full_distribution():
    logits = LOGITS.expand(2, -1).clone()
    params = [SamplingParams(temperature=0.0, top_logprobs=2), SamplingParams(temperature=0.5, top_k=1)]
    g, s = sample_rows(logits, params, [1, 2], [0, 0])
    assert g.token == 0 and s.token == 0
    assert g.logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[0]), abs=1e-6)
    assert s.logprob == pytest.approx(float(torch.log_softmax(LOGITS / 0.5, -1)[0]), abs=1e-6)  # not 0: untruncated
    assert [t for t, _ in g.top] == [0, 1] and s.top is None
