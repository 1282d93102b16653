"""float32 master weights behind bf16 parameters (``train.param_dtype=bfloat16``).

bf16 parameters make every matmul run natively in bf16 (no autocast casting the weights again in
each forward) and halve what the weights occupy, but an AdamW update applied to a bf16 weight is
rounded away whenever it is below the weight's precision (about 1/256 of it): at ``lr=1e-6`` nearly
every update would vanish. So the optimizer steps on float32 copies, where the gradients are also
summed: each micro-batch's bf16 gradient is added into its master's float32 gradient right after
its backward, so a step of many micro-batches rounds once per micro-batch, not cumulatively. After
the step the bf16 parameters are rewritten from the masters.
"""
from __future__ import annotations

import torch


class MasterWeights:
    """float32 masters of ``params`` (the model's trainable bf16 parameters), in the same order."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.master = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in params]

    @torch.no_grad()
    def accumulate(self) -> None:
        """Move the parameters' gradients (of the micro-batch just back-propagated) into the masters':
        for-each copies and adds, a few kernels for all tensors rather than one per tensor."""
        fresh, fresh_from, summed, summed_from = [], [], [], []
        for p, m in zip(self.params, self.master):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
                fresh.append(m.grad)
                fresh_from.append(p.grad)
            else:
                summed.append(m.grad)
                summed_from.append(p.grad)
        if fresh:
            torch._foreach_copy_(fresh, fresh_from)
        if summed:
            torch._foreach_add_(summed, summed_from)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """Round the masters into the parameters the model computes with."""
        torch._foreach_copy_(self.params, self.master)

    @torch.no_grad()
    def load(self, named: dict[str, torch.Tensor], names: list[str]) -> None:
        """Set the masters (``names`` in ``params`` order) from a checkpoint, then the parameters."""
        for name, m in zip(names, self.master):
            m.copy_(named[name].to(device=m.device, dtype=m.dtype))
        self.publish()

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.master):
            p.grad = m.grad = None
