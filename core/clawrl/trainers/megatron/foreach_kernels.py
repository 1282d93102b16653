"""Torch's for-each ops in place of apex's multi-tensor kernels, for megatron-core without apex or
transformer-engine (our machines have neither).

megatron-core's own fallback for the gradient norm (``megatron.core.utils.local_multi_tensor_l2_norm``)
takes each gradient tensor's norm and gathers them through ``torch.tensor(list_of_norms)``: a host
sync per parameter tensor, 311 at the Qwen3-1.7B shape, each draining the GPU's queue before the next
small kernel is launched. Profiled on one H100, a megatron step made 527 stream syncs, against 67 in
the torch trainer's (BENCHMARKS.md). ``torch._foreach_norm`` takes all the norms in a few kernels and
the total stays on the device until megatron reads it once. The scale used to clip is megatron's loop
of ``dst.copy_(src * scale)`` per tensor; here one for-each multiply.

``install`` swaps them into megatron's optimizer modules, only where megatron fell back to its own
(with apex or transformer-engine present, their fused kernels stay).
"""
from __future__ import annotations

import torch


def l2_norm(chunk_size: int, noop_flag, tensor_lists, per_tensor: bool, *args):
    """``amp_C.multi_tensor_l2norm``'s contract: the L2 norm over every tensor of ``tensor_lists[0]``,
    a float32 ``[1]`` tensor on their device, and no per-tensor norms."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm([t.float() if t.dtype != torch.float32 else t for t in tensors])
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def scale(chunk_size: int, noop_flag, tensor_lists, factor: float) -> None:
    """``amp_C.multi_tensor_scale``'s contract: ``dst = src * factor`` for each pair."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, factor)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def install() -> bool:
    """Use ``l2_norm`` and ``scale`` where megatron uses its own fallbacks; False where apex or
    transformer-engine provides the kernels (left alone). Idempotent."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl not in (utils.local_multi_tensor_l2_norm, l2_norm):
        return False
    clip_grads.l2_norm_impl = l2_norm
    clip_grads.multi_tensor_scale_impl = scale
    optimizer.multi_tensor_scale_impl = scale
    return True
