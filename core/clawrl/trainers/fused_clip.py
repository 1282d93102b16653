"""Gradient clipping inside torch's fused Adam, shared by both trainers.

The fused AdamW divides each gradient by its ``grad_scale`` as it reads it. Set to the inverse of
the clip coefficient, that is the clip itself, without the pass that rewrites every float32
gradient first (3.8 ms of an H200 step of the 1.7B shape at 8 x 2048 tokens).
"""
from __future__ import annotations

import torch


def fused_adam(optimizer) -> bool:
    """Whether ``optimizer`` is torch's Adam or AdamW in its fused form in every parameter group (the
    megatron backend switches the groups after construction, so ``defaults`` would not tell)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and all(
        g.get("fused") for g in optimizer.param_groups)


def grad_scale(norm: torch.Tensor, clip: float) -> torch.Tensor:
    """The ``grad_scale`` that clips to ``clip``: ``clip_grad_norm_``'s (and megatron's) coefficient is
    ``clip / (norm + 1e-6)``, at most 1; this is its inverse."""
    return ((norm + 1e-6) / clip).clamp(min=1.0)


def arm(optimizers, grads: list[torch.Tensor], clip: float, finite_loss: torch.Tensor) -> torch.Tensor:
    """Ready each fused ``optimizers``' next step without a host read, and return the norm of
    ``grads`` (a device scalar): its ``grad_scale`` clips to ``clip`` (0 or less: no clip), and its
    ``found_inf`` makes it skip the update, weight decay and step count included, where the loss
    (``finite_loss`` False) or the norm is not finite."""
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    scale = grad_scale(norm, clip if clip > 0 else float("inf"))
    found_inf = (~(finite_loss & torch.isfinite(norm))).to(torch.float32)
    for optimizer in optimizers:
        optimizer.grad_scale, optimizer.found_inf = scale, found_inf
    return norm
