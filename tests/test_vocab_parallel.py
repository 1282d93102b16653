"""Vocab-parallel logprobs, entropy and top-k logprobs equal the single-device functions on the
full logits, in value and in gradient, across 2 and 4 gloo ranks (CPU)."""
from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from clawrl.losses import (PolicyLossConfig, policy_loss, token_entropy, token_logprobs, topk_forward_kl,
                           topk_logprobs, topk_reverse_kl, vocab_parallel_token_entropy,
                           vocab_parallel_token_logprobs, vocab_parallel_topk_logprobs)

SHARD = 8    # vocabulary columns per rank
K = 4
# Against the single-device functions evaluated in float64 on the same logits (the exact values):
# float32 cannot do better than about half an ulp of the result, so the logits are kept O(1).
TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-6}
# Against the single-device functions in the same dtype, whose own float32 rounding differs: the
# torch-vs-megatron parity bound for logprobs.
SAME_DTYPE_ATOL = 1e-5
SPAWN_TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, check) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    try:
        check()
    finally:
        dist.destroy_process_group()


def _spawn(world: int, check, monkeypatch) -> None:
    """Run ``check()`` on ``world`` gloo ranks; a rank's exception fails the test, a hang is killed."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    ctx = mp.start_processes(_rank_main, args=(world, _free_port(), check), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= deadline:
                pytest.fail(f"{world} ranks did not finish within {SPAWN_TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()


def _problem(tp: int, dtype: torch.dtype, targets_on_rank: int | None):
    """Logits ``[T, tp*SHARD]`` with the awkward cases, targets, teacher top-k ids and logprobs.

    Rows ``0 .. 2tp-1`` target each shard's first and last column (the boundaries), and row 0's
    top-k ids straddle the first boundary; row -2 has one ``-inf`` logit, row -1 a whole shard of
    ``-inf`` (masked vocabulary padding) on a rank that holds no targets. Targets and top-k ids
    avoid ``-inf`` logits (their logprob is ``-inf``, on one device too). ``targets_on_rank`` puts
    every target and top-k id in that rank's slice instead.
    """
    g = torch.Generator().manual_seed(1234 + tp)
    vocab, t = tp * SHARD, 2 * tp + 6
    logits = torch.randn(t, vocab, generator=g, dtype=torch.float64)
    logits[-2, 3] = float("-inf")
    padded = 0 if targets_on_rank == tp - 1 else tp - 1
    logits[-1, padded * SHARD:(padded + 1) * SHARD] = float("-inf")
    logits = logits.to(dtype)
    allowed = torch.isfinite(logits)
    if targets_on_rank is not None:
        outside = torch.ones(vocab, dtype=torch.bool)
        outside[targets_on_rank * SHARD:(targets_on_rank + 1) * SHARD] = False
        allowed[:, outside] = False
    scores = torch.rand(t, vocab, generator=g, dtype=torch.float64).masked_fill(~allowed, -1.0)
    topk_ids = scores.topk(K, dim=-1).indices
    targets = torch.rand(t, vocab, generator=g, dtype=torch.float64).masked_fill(~allowed, -1.0).argmax(-1)
    if targets_on_rank is None:
        for r in range(tp):
            targets[2 * r], targets[2 * r + 1] = r * SHARD, (r + 1) * SHARD - 1
        topk_ids[0] = torch.tensor([0, SHARD - 1, SHARD, vocab - 1])
    teacher = torch.log_softmax(torch.randn(t, K + 1, generator=g, dtype=torch.float64), -1)[:, :K].to(dtype)
    old = torch.randn(t, generator=g, dtype=torch.float64) * 0.3
    advantages = torch.randn(t, generator=g, dtype=torch.float64)
    weights = torch.rand(t, generator=g, dtype=torch.float64)
    return logits, targets, topk_ids, teacher, old, advantages, weights


def _loss(lp, entropy, student_topk, teacher, old, advantages, weights):
    """GRPO-style policy loss (clip, dual clip, KL, entropy) plus both top-k distillation terms."""
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01)
    dtype = lp.dtype
    pg, _ = policy_loss(lp, (lp.detach() + old.to(dtype)), advantages.to(dtype), torch.ones_like(lp),
                        torch.tensor([0, 3, lp.shape[0]]), cfg, ref_logprobs=lp.detach() - old.to(dtype),
                        entropy=entropy)
    w = weights.to(dtype)
    return pg + (w * topk_reverse_kl(student_topk, teacher)).sum() + (w * topk_forward_kl(student_topk, teacher)).sum()


def _check_matches_full_logits(group, dtype: torch.dtype, targets_on_rank: int | None = None) -> None:
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    logits, targets, topk_ids, teacher, *rest = _problem(tp, dtype, targets_on_rank)
    exact = logits.to(torch.float64, copy=True).requires_grad_()
    want = (token_logprobs(exact, targets), token_entropy(exact), topk_logprobs(exact, topk_ids))
    _loss(*want, teacher.double(), *rest).backward()
    same_dtype = (token_logprobs(logits, targets), token_entropy(logits), topk_logprobs(logits, topk_ids))

    start = rank * SHARD
    shard = logits[:, start:start + SHARD].clone().requires_grad_()
    got = (vocab_parallel_token_logprobs(shard, targets, start, group, chunk_size=5),
           vocab_parallel_token_entropy(shard, group, chunk_size=5),
           vocab_parallel_topk_logprobs(shard, topk_ids, start, group, chunk_size=5))
    _loss(*got, teacher, *rest).backward()

    where = f"on rank {rank}/{tp} ({dtype})"
    for name, g, w, d in zip(("logprobs", "entropy", "topk logprobs"), got, want, same_dtype):
        assert g.dtype == d.dtype, (name, g.dtype, d.dtype)
        torch.testing.assert_close(g.double(), w.detach(), atol=TOL[dtype], rtol=0.0,
                                   msg=lambda m: f"{name} {where}: {m}")
        torch.testing.assert_close(g, d, atol=SAME_DTYPE_ATOL, rtol=0.0, msg=lambda m: f"{name} {where}: {m}")
    assert exact.grad.abs().sum() > 0 and torch.isfinite(exact.grad).all()
    assert shard.grad.dtype == dtype
    # bf16 gradients round to bf16 (8 significant bits).
    atol = 2 ** -8 * exact.grad.abs().max().item() if dtype == torch.bfloat16 else TOL[dtype]
    torch.testing.assert_close(shard.grad.double(), exact.grad[:, start:start + SHARD], atol=atol, rtol=0.0,
                               msg=lambda m: f"grad {where}: {m}")


def _two_rank_checks() -> None:
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        _check_matches_full_logits(dist.group.WORLD, dtype)
    _check_matches_full_logits(dist.group.WORLD, torch.float64, targets_on_rank=0)
    _check_matches_full_logits(dist.group.WORLD, torch.float32, targets_on_rank=1)

    rank = dist.get_rank()
    shard, targets = torch.zeros(3, SHARD), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="vocab_start must be"):
        vocab_parallel_token_logprobs(shard, targets, (1 - rank) * SHARD, dist.group.WORLD)
    with pytest.raises(ValueError, match=r"target_ids must lie in \[0, 16\)"):
        vocab_parallel_token_logprobs(shard, targets + 2 * SHARD, rank * SHARD, dist.group.WORLD)
    with pytest.raises(ValueError, match=r"topk_ids must be \[T=3, K\]"):
        vocab_parallel_topk_logprobs(shard, targets, rank * SHARD, dist.group.WORLD)


def _four_rank_checks() -> None:
    for dtype in (torch.float64, torch.float32):
        _check_matches_full_logits(dist.group.WORLD, dtype)
    _check_matches_full_logits(dist.group.WORLD, torch.float64, targets_on_rank=3)
    # Two tensor-parallel pairs side by side: each uses its own group's ranks, not the world's.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _check_matches_full_logits(pairs[dist.get_rank() // 2], torch.float64)


def test_two_ranks_match_full_logits_in_value_and_gradient(monkeypatch):
    _spawn(2, _two_rank_checks, monkeypatch)


def test_four_ranks_and_two_pairs_match_full_logits(monkeypatch):
    _spawn(4, _four_rank_checks, monkeypatch)


def test_without_a_group_the_single_device_functions_run():
    logits, targets, topk_ids, *_ = _problem(2, torch.float32, None)
    assert torch.equal(vocab_parallel_token_logprobs(logits, targets, 0), token_logprobs(logits, targets))
    assert torch.equal(vocab_parallel_token_entropy(logits), token_entropy(logits))
    assert torch.equal(vocab_parallel_topk_logprobs(logits, topk_ids, 0), topk_logprobs(logits, topk_ids))
    with pytest.raises(ValueError, match="vocab_start must be group rank x shard width = 0"):
        vocab_parallel_token_logprobs(logits, targets, SHARD)
