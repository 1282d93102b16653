"""On-policy distillation (OPD) advantages, and how they combine with RL advantages.

OPD (OpenClaw-RL's "hindsight hint" teacher): the tokens the policy actually sampled at turn t are
scored twice -- under the original prompt (the student, i.e. the policy that sampled them) and
under the prompt with a hint extracted from turn t's next state appended (the teacher). The
per-token advantage is ``log pi_teacher(a_t | s + hint) - log pi_student(a_t | s)``: positive where
knowing the hint makes the sampled token likelier (keep doing it), negative where the hint argues
against it. Unlike a scalar reward, every token gets its own signal, and a correction such as
"just the number, please" says *which* tokens were wrong.

The advantage feeds the same PPO clipped surrogate as RL advantages (``policy_loss`` takes
per-token advantages), so the trust region, mismatch correction and aggregation all carry over.
"""
from __future__ import annotations

import math

import torch

from clawrl.losses.packed import broadcast_to_tokens, check_cu_seqlens, seq_lengths


def opd_advantages(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor,
                   loss_mask: torch.Tensor | None = None, scale: float = 1.0,
                   clip: float | None = None) -> torch.Tensor:
    """Per-token OPD advantage ``scale * clamp(teacher - student, -clip, clip)``, detached, ``[T]``.

    ``student_logprobs`` are the logprobs of the sampled tokens under the policy that sampled them
    (the rollout logprobs, or the trainer's recomputed old logprobs: the caller picks, and that
    choice decides whether the gap includes the rollout/trainer mismatch). ``clip`` bounds the gap
    symmetrically: a token the teacher finds nearly impossible (``log p ~ -30``) would otherwise
    dominate the batch. Tokens outside ``loss_mask`` (e.g. a tool-call prefill) get 0, and so do
    tokens whose gap is not finite -- a ``-inf`` teacher logprob is "no usable signal", not an
    infinitely bad token.
    """
    if teacher_logprobs.shape != student_logprobs.shape or teacher_logprobs.dim() != 1:
        raise ValueError("teacher_logprobs and student_logprobs must both be [T] with equal shapes; got "
                         f"{tuple(teacher_logprobs.shape)} and {tuple(student_logprobs.shape)}")
    if loss_mask is not None and loss_mask.shape != teacher_logprobs.shape:
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}, expected {tuple(teacher_logprobs.shape)}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")
    dtype = torch.promote_types(torch.promote_types(teacher_logprobs.dtype, student_logprobs.dtype), torch.float32)
    gap = teacher_logprobs.detach().to(dtype) - student_logprobs.detach().to(dtype)
    keep = torch.isfinite(gap)
    if loss_mask is not None:
        keep = keep & (loss_mask.detach() != 0)
    if clip is not None:
        gap = gap.clamp(-clip, clip)
    return torch.where(keep, gap * scale, torch.zeros_like(gap))


def _per_token(values: torch.Tensor, num_tokens: int, cu_seqlens: torch.Tensor | None, name: str) -> torch.Tensor:
    """``values`` as ``[T]``: already per token, or one per sequence broadcast with ``cu_seqlens``."""
    if values.dim() != 1:
        raise ValueError(f"{name} must be 1-D ([T] or one per sequence), got shape {tuple(values.shape)}")
    per_seq = cu_seqlens is not None and values.shape[0] == cu_seqlens.numel() - 1
    if per_seq and values.shape[0] == num_tokens:
        check_cu_seqlens(cu_seqlens, num_tokens)
        if bool((seq_lengths(cu_seqlens) != 1).any()):
            raise ValueError(f"{name} has one value per sequence *and* per token ({num_tokens}); ambiguous "
                             "with sequences longer than one token: pass it per token")
        return values
    if per_seq:
        check_cu_seqlens(cu_seqlens, num_tokens)
        return broadcast_to_tokens(values, cu_seqlens)
    if values.shape[0] != num_tokens:
        raise ValueError(f"{name} has {values.shape[0]} values; expected [T]={num_tokens}"
                         + ("" if cu_seqlens is None else f" or one per sequence ({cu_seqlens.numel() - 1})"))
    return values


def combine_advantages(a_rl: torch.Tensor, a_opd: torch.Tensor, w_rl: float, w_opd: float,
                       has_rl: torch.Tensor, has_opd: torch.Tensor,
                       cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``A = w_rl * A_rl * has_rl + w_opd * A_opd * has_opd`` per token, and which tokens train.

    A turn with both a judged reward and an accepted hint contributes both signals; a turn with
    one contributes that one, unscaled by the other's absence (its missing term is 0, not an
    average). A turn with neither has no signal: its tokens get advantage 0 *and* are reported as
    not trained, so the caller can drop them from ``loss_mask`` instead of diluting the batch
    with zero-advantage tokens.

    ``a_rl``, ``has_rl`` and ``has_opd`` may be per token ``[T]`` or per sequence ``[S]`` (then
    ``cu_seqlens`` broadcasts them); ``a_opd`` is per token (``opd_advantages``). Where a flag is
    false the matching advantage is ignored, even if it is NaN (a sample without a hint has no
    teacher logprobs). Returns ``(advantages [T] float32+, trained [T] bool)``.
    """
    if a_opd.dim() != 1:
        raise ValueError(f"a_opd must be per token [T], got shape {tuple(a_opd.shape)}")
    for name, w in (("w_rl", w_rl), ("w_opd", w_opd)):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {w}")
    n = a_opd.shape[0]
    rl = _per_token(a_rl.detach(), n, cu_seqlens, "a_rl")
    use_rl = _per_token(has_rl.detach(), n, cu_seqlens, "has_rl").bool()
    use_opd = _per_token(has_opd.detach(), n, cu_seqlens, "has_opd").bool()
    dtype = torch.promote_types(torch.promote_types(rl.dtype, a_opd.dtype), torch.float32)
    zero = torch.zeros(n, dtype=dtype, device=a_opd.device)
    rl_term = torch.where(use_rl & (w_rl != 0), rl.to(dtype) * w_rl, zero)
    opd_term = torch.where(use_opd & (w_opd != 0), a_opd.detach().to(dtype) * w_opd, zero)
    return rl_term + opd_term, use_rl | use_opd
