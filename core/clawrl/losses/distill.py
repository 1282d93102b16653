"""Top-k distillation: reverse KL from the student to the teacher's top-k distribution plus a tail.

OPD's token-level advantage (``clawrl.losses.opd``) uses one number per token: how likely the
teacher finds the token that was sampled. The teacher's top-k logprobs say more -- which tokens it
would have preferred instead. This loss pulls the student's distribution over those k tokens (and
the leftover "tail" mass outside them) towards the teacher's (SDFT/SDPO style; teacher top-k, as
OpenClaw-RL does, so the teacher decides which tokens matter).

Two parts, so a tensor-parallel trainer can replace only the first:

- ``topk_logprobs`` (vocabulary-level): the student's logprobs at the teacher's k ids, ``[T, V] ->
  [T, K]``. One gather of k logits and one logsumexp per token; it never materialises a log-softmax
  or any other ``[T, V]`` tensor beyond the logits (and, in backward, their gradient): extra memory is
  O(T*K) plus a bounded float32 chunk. A vocab-parallel version computes the same with a max/sum
  all-reduce for the logsumexp and a masked local gather.
- ``topk_reverse_kl`` (token-level): the K+1-bin reverse KL from ``[T, K]`` logprobs.
"""
from __future__ import annotations

import math

import torch

from clawrl.losses.aggregate import aggregate

# A bin the teacher gives zero mass (its top-k covers everything) would make the reverse KL
# infinite wherever the student puts any mass there; the tail is floored at this probability.
MIN_TAIL_LOGPROB = math.log(1e-8)


class _ScaledLogSumExp(torch.autograd.Function):
    """``logsumexp(logits / temperature, -1)`` in float32 that saves only the logits and ``[T]``.

    Autograd's own version saves its input; with bf16 logits or a temperature that input is a new
    float32 ``[T, V]`` copy kept alive until backward. Here forward and backward each work on
    ``chunk`` rows at a time, and backward recomputes ``softmax`` from the logits.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, temperature: float, chunk: int) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        for s in range(0, logits.shape[0], chunk):
            out[s:s + chunk] = torch.logsumexp(logits[s:s + chunk].to(dtype) / temperature, dim=-1)
        ctx.save_for_backward(logits, out)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            z = logits[s:s + ctx.chunk].to(lse.dtype) / ctx.temperature
            p = torch.exp(z - lse[s:s + ctx.chunk, None])
            grad[s:s + ctx.chunk] = (p * (grad_out[s:s + ctx.chunk, None] / ctx.temperature)).to(grad.dtype)
        return grad, None, None


def topk_logprobs(logits: torch.Tensor, topk_ids: torch.Tensor, temperature: float = 1.0,
                  chunk_size: int = 1024) -> torch.Tensor:
    """``log softmax(logits / temperature)`` at ``topk_ids``: ``[T, V], [T, K] -> [T, K]`` (float32+).

    ``logits[t]`` must be the prediction for position t (the caller shifts by one, as for
    ``token_logprobs``). ``chunk_size`` bounds the float32 working copy to ``chunk_size x V``.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"topk_ids must be [T={logits.shape[0]}, K], got shape {tuple(topk_ids.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    ids = topk_ids.long()
    if ids.numel() and (ids.min() < 0 or ids.max() >= logits.shape[-1]):
        raise ValueError(f"topk_ids must lie in [0, {logits.shape[-1]})")
    lse = _ScaledLogSumExp.apply(logits, float(temperature), chunk_size)
    picked = logits.gather(-1, ids).to(lse.dtype) / temperature
    return picked - lse.unsqueeze(-1)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate at both ends (Maechler's split at -log 2)."""
    x = x.clamp(max=0.0)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _with_tail(topk: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` logprobs -> ``[T, K+1]``: the k bins plus the log of the mass outside them."""
    tail = _log1mexp(torch.logsumexp(topk, dim=-1)).clamp(min=MIN_TAIL_LOGPROB)
    return torch.cat([topk, tail.unsqueeze(-1)], dim=-1)


def topk_forward_kl(student_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(teacher || student)`` over the K teacher bins plus the tail, ``[T, K] -> [T]``:
    ``sum_b q_b (log q_b - log p_b)``, teacher constant. Its gradient on a bin is ``p_b - q_b``, so
    it raises a token the teacher prefers even where the student gives it ~0 probability (which the
    mode-seeking reverse KL cannot)."""
    dtype = torch.promote_types(student_topk_logprobs.dtype, torch.float32)
    q = _with_tail(teacher_topk_logprobs.detach().to(dtype))
    p = _with_tail(student_topk_logprobs.to(dtype))
    return (torch.exp(q) * (q - p)).sum(-1)


def topk_reverse_kl(student_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(student || teacher)`` over K+1 bins (the k ids and the tail), ``[T, K] -> [T]``.

    ``sum_b p_s(b) * (log p_s(b) - log p_t(b))`` with the tail bin ``log(1 - sum_k p(k))`` on each
    side. Reverse (student-weighted) KL is mode-seeking: the student is pushed off tokens the
    teacher rejects rather than spread over everything the teacher allows. Teacher logprobs are
    constants. Both tails are floored at ``MIN_TAIL_LOGPROB`` so a top-k that holds all the mass
    gives a finite loss.
    """
    if student_topk_logprobs.shape != teacher_topk_logprobs.shape or student_topk_logprobs.dim() != 2:
        raise ValueError("student and teacher top-k logprobs must both be [T, K] with equal shapes; got "
                         f"{tuple(student_topk_logprobs.shape)} and {tuple(teacher_topk_logprobs.shape)}")
    dtype = torch.promote_types(student_topk_logprobs.dtype, torch.float32)
    s = _with_tail(student_topk_logprobs.to(dtype))
    t = _with_tail(teacher_topk_logprobs.detach().to(dtype))
    return (torch.exp(s) * (s - t)).sum(-1)


def topk_distill_loss(student_logits: torch.Tensor, teacher_topk_ids: torch.Tensor,
                      teacher_topk_logprobs: torch.Tensor, temperature: float = 1.0,
                      chunk_size: int = 1024) -> torch.Tensor:
    """Per-token top-k reverse-KL distillation loss ``[T]`` (aggregate it with ``clawrl.losses.aggregate``).

    ``student_logits`` ``[T, V]`` (position t predicts response token t), the teacher's top-k ids and
    logprobs ``[T, K]`` for the same positions, as ``Engine.score(..., top_k=K)`` returns them.
    ``temperature`` must be the one the teacher was scored at. Memory beyond the logits is O(T*K):
    see ``topk_logprobs``.
    """
    if teacher_topk_ids.shape != teacher_topk_logprobs.shape:
        raise ValueError(f"teacher_topk_ids {tuple(teacher_topk_ids.shape)} and teacher_topk_logprobs "
                         f"{tuple(teacher_topk_logprobs.shape)} must have equal shapes")
    student = topk_logprobs(student_logits, teacher_topk_ids, temperature, chunk_size)
    return topk_reverse_kl(student, teacher_topk_logprobs)


def weighted_nll(logprobs: torch.Tensor, weights: torch.Tensor, cu_seqlens: torch.Tensor, mode: str = "token-mean",
                 global_denominator: float | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token NLL of given tokens, each weighted: ``(loss, per-token nll)``.

    ``logprobs`` ``[T]``: the student's logprobs of the tokens (a teacher's own sampled reply, under
    the student's prompt); ``weights`` ``[T]`` >= 0, 0 where a token does not take part (e.g. the
    hint judge's acceptance on a hinted reply's tokens). The loss is ``sum_t -logprob_t * weights_t *
    w_t / global_denominator`` with ``w_t`` the aggregation weight of ``mode`` over the tokens whose
    weight is > 0 (``clawrl.losses.aggregate``). No importance weight against the student: for a
    token the student gives ~e^-12 such a weight would zero the gradient, while the NLL's gradient
    grows as the token's probability shrinks.
    """
    if logprobs.shape != weights.shape or logprobs.dim() != 1:
        raise ValueError(f"logprobs and weights must both be [T]; got {tuple(logprobs.shape)} and "
                         f"{tuple(weights.shape)}")
    if bool((weights < 0).any()):
        raise ValueError("weights must be >= 0")
    nll = -logprobs
    mask = (weights > 0).to(logprobs.dtype)
    weighted = torch.where(weights > 0, nll * weights.to(nll.dtype), torch.zeros_like(nll))
    return aggregate(weighted, mask, cu_seqlens, mode, global_denominator=global_denominator), nll.detach()
